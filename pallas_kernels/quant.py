"""Low-precision optimizer-state formats: the pure-``jnp`` reference.

The arithmetic that a kernel epilogue storing quantized moments, or rounding
a bf16 weight stochastically, must reproduce bit for bit: the specification
that the kernels' epilogues (:mod:`pallas_kernels.lowp`, the Mosaic GPU
kernel's int8 epilogue) and ``forge_jax.low_precision`` implement and are
tested against; its types (``Quantized``, ``MomentFormat``) are the ones
they take.

**Blocked formats.** A moment of a weight of shape ``(..., in, out)`` is
stored as codes ``q`` of the same shape (int8, float8_e4m3fn or float8_e5m2)
and one fp32 scale per block of :attr:`MomentFormat.block` (64) consecutive
elements along the last axis: ``scale`` has shape
``(..., in, ceil(out / block))``; a partial last block counts its missing
columns as zeros. Quantizing one block of fp32 values ``x`` (the order below
is the order of the fp32 roundings; every operation is one IEEE fp32
operation rounded to nearest even, with no fused multiply-add):

1. ``bad = any(x is inf or nan)``. A second moment is first clamped:
   ``x = x if x > 0 else +0.0`` (so ``-0.0`` and negative values become
   ``+0.0``; the ``bad`` test reads ``x`` before the clamp).
2. ``a = max(|x|)`` over the block's finite values (exact).
3. ``live = not bad and a >= TINY_ABSMAX`` (``2**-90``). A block that is not
   live stores ``q = +0`` everywhere and ``scale = 0`` (all finite, ``a``
   below ``2**-90``, including an all-zero block) or ``scale = nan`` (``bad``:
   the whole block dequantizes to nan, so a diverged moment stays visible).
   With the threshold, scales, ``r`` and dequantized values are normal fp32
   numbers, and a subnormal ``x`` or ``x * r`` rounds to a zero code whether
   or not it is flushed, so hardware that flushes subnormals to zero (XLA
   on the CPU does) gives the same bits as hardware that keeps them.
4. ``scale = a * INV_QMAX`` and ``r = QMAX / a``, where ``QMAX`` is 127
   (int8), 448 (e4m3fn) or 57344 (e5m2), the largest finite code, and
   ``INV_QMAX`` the fp32 constant nearest ``1 / QMAX`` (bit patterns
   ``0x3C010204``, ``0x3B124925``, ``0x37924925``). ``r`` is the only
   division, one per block, and must be correctly rounded: Triton's default
   fp32 ``/`` is an approximate division, a Triton epilogue needs its
   round-to-nearest division. (The scale is a product, not ``a / QMAX``:
   XLA compiles a division by a scalar into that same product anyway.)
5. ``y = clip(x * r, -QMAX, QMAX)`` (the clip is exact; ``|x * r|`` exceeds
   ``QMAX`` by at most one fp32 ulp, at ``|x| = a``).
6. Second moments with ``v_floor = k > 0``: ``y = max(y, F_k)``, ``F_k`` the
   ``k``-th smallest positive value of the format (int8: ``k``; fp8: the
   value whose bit pattern is ``k``, e.g. ``2**-9`` for e4m3fn and ``2**-16``
   for e5m2 at ``k = 1``).
7. int8: ``q = int8(round_half_to_even(y))``. fp8: ``q = fp8(y)``, the
   conversion rounding to nearest even; then ``q = +0`` where ``q`` is zero
   (never the ``-0`` bit pattern ``0x80``).

Dequantizing is one product per element, ``float32(q) * scale`` of the
element's block (no other arithmetic; a kernel must not contract it into a
following add). Per element, with ``s`` the block's scale, the int8 error is
``|x - dequantize(q)| <= s / 2 + 2**-21 * a`` (the round-off of ``y`` plus
four fp32 roundings), the fp8 error half an fp8 ulp of ``y`` times ``s``
plus the same fp32 term. A block's largest magnitude maps to the largest
code, ``+-QMAX``, and finite moments dequantize to finite values up to
fp32's largest.

**The second-moment floor.** Adam divides by ``sqrt(v)`` and keeps ``v``
for about ``1 / (1 - b2)`` steps (1000 at ``b2 = 0.999``), so an entry
rounded to zero would turn its update into ``m / eps`` for that long. With
``v_floor = 1`` (the default) a second moment in a live block is never
stored as zero: its code is at least the format's smallest positive one, so
it dequantizes to at least that value times the block's scale. Entries
below the floor are overestimated (their update only shrinks); every other
entry is rounded to nearest from ``y >= 1`` code, which errs by at most half
a code step, so every stored entry is at least 2/3 of its fp32 value (up to
fp32 rounding) and ``1 / sqrt(v)`` grows by at most ``sqrt(3/2)`` (1.22)
instead of without bound. Blocks below ``2**-90`` store zeros: there
``sqrt(v) <= 2**-45``, negligible against any ``eps`` (3e-6 of 1e-8).

**Stochastic rounding to bf16.** :func:`stochastic_round_to_bf16` adds 16
random bits to the low half of the fp32 bit pattern and truncates it to
bf16: the magnitude rounds up with probability equal to the fraction of a
bf16 ulp it lies above the value below, so the result is unbiased, and the
sign is untouched. The random bits are a counter-based hash of ``(seed,
step, index)`` (:func:`counter_hash`), ``index`` the element's global flat
index (:func:`global_index`), so the result does not depend on tiling,
backend or sharding.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "KINDS", "MIN_QUANTIZED_SIZE", "TINY_ABSMAX", "MomentFormat", "Quantized",
    "counter_hash", "dequantize", "dequantize_blocks", "global_index",
    "quantize", "quantize_blocks", "stochastic_round_to_bf16",
]

KINDS = ("int8", "fp8_e4m3", "fp8_e5m2")
# A block whose largest magnitude is below this stores zeros (scale 0): the
# codes then do not depend on whether subnormals are flushed (docstring).
TINY_ABSMAX = 2.0 ** -90
# Weights with fewer elements (biases, norms' scales) keep float moments.
MIN_QUANTIZED_SIZE = 4096

_STORAGE = {
    "int8": jnp.int8,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}
# The largest finite code, as a value.
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# The fp32 nearest 1 / QMAX, by bit pattern.
_INV_QMAX_BITS = {"int8": 0x3C010204, "fp8_e4m3": 0x3B124925,
                  "fp8_e5m2": 0x37924925}
# (exponent bias, mantissa bits, bit pattern of the largest finite code).
_FP8_LAYOUT = {"fp8_e4m3": (7, 3, 0x7E), "fp8_e5m2": (15, 2, 0x7B)}


def _f32_from_bits(bits: int) -> float:
  return struct.unpack("<f", struct.pack("<I", bits))[0]


def _code_value(kind: str, k: int) -> float:
  """The ``k``-th smallest positive value of ``kind`` (a non-negative
  code's magnitude: int8 ``k``; fp8 the value of bit pattern ``k``)."""
  if kind == "int8":
    return float(k)
  bias, mant, _ = _FP8_LAYOUT[kind]
  e, m = k >> mant, k & ((1 << mant) - 1)
  if e == 0:  # subnormal
    return m * 2.0 ** (1 - bias - mant)
  return ((1 << mant) + m) * 2.0 ** (e - bias - mant)


@dataclasses.dataclass(frozen=True)
class MomentFormat:
  """How one optimizer moment is stored: codes plus one scale per block.

  Attributes:
    kind: ``"int8"`` (symmetric, codes in ``[-127, 127]``), ``"fp8_e4m3"``
      (float8_e4m3fn, largest finite 448) or ``"fp8_e5m2"`` (float8_e5m2,
      largest finite 57344).
    block: elements per scale along the weight's last axis (a power of two,
      so a block never straddles a kernel's power-of-two tile).
    v_floor: a second moment in a live block is stored as at least the
      ``v_floor``-th smallest positive value of the format times the block's
      scale (1: one code, ``scale`` for int8, ``2**-9 * scale`` for e4m3fn,
      ``2**-16 * scale`` for e5m2); 0 turns the floor off. First moments
      ignore it.
    min_size: weights with fewer elements keep their moments in their float
      dtype (:meth:`quantizes`).
  """

  kind: str = "int8"
  block: int = 64
  v_floor: int = 1
  min_size: int = MIN_QUANTIZED_SIZE

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(
          f"MomentFormat kind {self.kind!r} is not one of {KINDS}: int8 is "
          "the symmetric 8-bit integer format, fp8_e4m3 and fp8_e5m2 the two "
          "8-bit float formats.")
    if (not isinstance(self.block, int) or isinstance(self.block, bool)
        or self.block < 1
        or self.block & (self.block - 1)):
      raise ValueError(
          f"MomentFormat block={self.block!r}: the block (elements per "
          "scale) must be a positive power of two such as 64, so that a "
          "block never straddles a kernel tile.")
    top = 127 if self.kind == "int8" else _FP8_LAYOUT[self.kind][2]
    if (not isinstance(self.v_floor, int) or isinstance(self.v_floor, bool)
        or not 0 <= self.v_floor <= top):
      raise ValueError(
          f"MomentFormat v_floor={self.v_floor!r}: the second-moment floor "
          f"is a number of codes between 0 (no floor) and {top} for "
          f"{self.kind}; 1 is the usual choice.")
    if (not isinstance(self.min_size, int) or isinstance(self.min_size, bool)
        or self.min_size < 0):
      raise ValueError(
          f"MomentFormat min_size={self.min_size!r} must be a non-negative "
          "integer (the smallest weight, in elements, whose moments are "
          "quantized).")

  @property
  def dtype(self) -> jnp.dtype:
    """The codes' storage dtype."""
    return jnp.dtype(_STORAGE[self.kind])

  @property
  def qmax(self) -> float:
    """The largest finite code, as a value (127, 448 or 57344)."""
    return _QMAX[self.kind]

  @property
  def inv_qmax(self) -> float:
    """The fp32 value nearest ``1 / qmax`` (a Python float, exact)."""
    return _f32_from_bits(_INV_QMAX_BITS[self.kind])

  @property
  def floor_value(self) -> float:
    """The second-moment floor in units of the scale (0.0 without one)."""
    return _code_value(self.kind, self.v_floor)

  def quantizes(self, shape) -> bool:
    """Whether a weight of ``shape`` gets quantized moments (at least
    :attr:`min_size` elements); smaller ones keep float moments."""
    return math.prod(shape) >= self.min_size

  def scale_shape(self, shape) -> tuple[int, ...]:
    """The scale's shape for codes of ``shape``: the last axis counted in
    blocks, a partial last block included."""
    shape = tuple(shape)
    if not shape:
      raise ValueError("a quantized moment needs at least one axis; got a "
                       "scalar shape ()")
    return shape[:-1] + (-(-shape[-1] // self.block),)


class Quantized(NamedTuple):
  """A quantized moment: codes ``q`` and per-block fp32 ``scale``.

  ``q`` has the weight's shape ``(..., in, out)`` and dtype
  :attr:`MomentFormat.dtype`; ``scale`` is float32 of shape
  ``(..., in, ceil(out / block))``.
  """

  q: jax.Array
  scale: jax.Array


def _as_f32(x, what: str) -> jax.Array:
  x = jnp.asarray(x)
  if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise ValueError(
        f"{what} has dtype {x.dtype}; the quantizer takes float32 values "
        "(bfloat16 and float16 are widened exactly). Cast it with "
        ".astype(jnp.float32) first.")
  return x.astype(jnp.float32)


def quantize_blocks(xb: jax.Array, fmt: MomentFormat, *,
                    second_moment: bool = False):
  """Quantizes values already grouped in blocks: the per-block arithmetic.

  What a kernel epilogue runs on a ``(rows, k, block)`` view of a
  ``(rows, k * block)`` tile; reduces over the last axis only.

  Args:
    xb: float32, ``(..., n_blocks, block)``.
    fmt: the format.
    second_moment: clamp negative values to zero and apply the floor.

  Returns:
    ``(q, scale)``: codes of ``xb``'s shape in ``fmt.dtype`` and float32
    scales of shape ``(..., n_blocks)``.
  """
  xb = _as_f32(xb, "the blocks")
  if xb.ndim == 0 or xb.shape[-1] != fmt.block:
    raise ValueError(f"quantize_blocks: blocks of shape {xb.shape}; the "
                     f"last axis must be the format's block, {fmt.block}")
  finite = jnp.isfinite(xb)
  bad = ~jnp.all(finite, axis=-1, keepdims=True)
  if second_moment:
    xb = jnp.where(xb > 0, xb, jnp.float32(0))
  a = jnp.max(jnp.where(finite, jnp.abs(xb), jnp.float32(0)), axis=-1,
              keepdims=True)
  live = ~bad & (a >= jnp.float32(TINY_ABSMAX))
  zero = jnp.float32(0)
  scale = jnp.where(live, a * jnp.float32(fmt.inv_qmax), zero)
  scale = jnp.where(bad, jnp.float32(jnp.nan), scale)
  r = jnp.float32(fmt.qmax) / jnp.where(live, a, jnp.float32(1))
  qmax = jnp.float32(fmt.qmax)
  y = jnp.where(live, jnp.clip(xb * r, -qmax, qmax), zero)
  if second_moment and fmt.v_floor:
    y = jnp.where(live, jnp.maximum(y, jnp.float32(fmt.floor_value)), zero)
  if fmt.kind == "int8":
    q = jnp.rint(y).astype(jnp.int8)
  else:
    q = y.astype(fmt.dtype)
    # On the bits: a compiler may fold a float select of zero for zero
    # (XLA:GPU does), which would keep the -0 code.
    bits = lax.bitcast_convert_type(q, jnp.uint8)
    q = lax.bitcast_convert_type(jnp.where(bits == 0x80, jnp.uint8(0), bits),
                                 fmt.dtype)
  return q, scale[..., 0]


def dequantize_blocks(q: jax.Array, scale: jax.Array) -> jax.Array:
  """``float32(q) * scale`` on ``(..., n_blocks, block)`` codes and
  ``(..., n_blocks)`` scales."""
  return q.astype(jnp.float32) * scale[..., None]


def quantize(x, fmt: MomentFormat, *, second_moment: bool = False
             ) -> Quantized:
  """Quantizes a moment, blocks along the last axis (module docstring).

  Runs unchanged on a column tile ``x[..., c0:c0 + w]`` at a multiple ``c0``
  of ``fmt.block`` and gives that tile's codes and scales bit for bit.

  Args:
    x: float32 (or a 16-bit float, widened exactly), ``(..., in, out)``.
    fmt: the format.
    second_moment: ``True`` for a second moment (``v``): negative values and
      ``-0.0`` are stored as ``+0`` and ``fmt.v_floor`` applies.

  Returns:
    :class:`Quantized` ``(q, scale)``.
  """
  x = _as_f32(x, "the moment")
  if x.ndim == 0:
    raise ValueError("quantize: the moment is a scalar; it needs at least one "
                     "axis (blocks run along the last one)")
  out = x.shape[-1]
  n_blocks = -(-out // fmt.block)
  pad = n_blocks * fmt.block - out
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  xb = x.reshape(x.shape[:-1] + (n_blocks, fmt.block))
  q, scale = quantize_blocks(xb, fmt, second_moment=second_moment)
  q = q.reshape(x.shape[:-1] + (n_blocks * fmt.block,))[..., :out]
  return Quantized(q, scale)


def dequantize(qx: Quantized, fmt: MomentFormat) -> jax.Array:
  """The fp32 values of a quantized moment: ``float32(q) * scale``."""
  q, scale = qx
  q, scale = jnp.asarray(q), jnp.asarray(scale)
  if q.dtype != fmt.dtype:
    raise ValueError(f"dequantize: the codes are {q.dtype}, the format "
                     f"{fmt.kind} stores {fmt.dtype}")
  if scale.dtype != jnp.float32 or scale.shape != fmt.scale_shape(q.shape):
    raise ValueError(
        f"dequantize: the scale is {scale.dtype}{list(scale.shape)}, codes of "
        f"shape {q.shape} need float32{list(fmt.scale_shape(q.shape))} (one "
        f"per {fmt.block} elements of the last axis)")
  full = jnp.repeat(scale, fmt.block, axis=-1)[..., :q.shape[-1]]
  return q.astype(jnp.float32) * full


# --- stochastic rounding ----------------------------------------------------

# MurmurHash3's 32-bit finalizer (fmix32) multipliers, and Weyl-sequence
# increments (the 32-bit golden ratio and another odd constant).
_FMIX_M1 = 0x85EBCA6B
_FMIX_M2 = 0xC2B2AE35
_WEYL = 0x9E3779B9
_SEED_SALT = 0x7F4A7C15


def _fmix32(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 16)
  h = h * jnp.uint32(_FMIX_M1)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(_FMIX_M2)
  return h ^ (h >> 16)


def _u32(v, what: str, *, scalar: bool) -> jax.Array:
  """An integer (Python or array) as uint32, modulo 2**32."""
  if isinstance(v, bool):
    raise ValueError(f"{what} must be an integer, got the bool {v!r}")
  if isinstance(v, int):
    return jnp.uint32(v % 2 ** 32)
  arr = jnp.asarray(v)
  if not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(f"{what} must be an integer (Python int or integer "
                     f"array), got dtype {arr.dtype}")
  if scalar and arr.ndim:
    raise ValueError(f"{what} must be a scalar, got shape {arr.shape}")
  return lax.convert_element_type(arr, jnp.uint32)


def counter_hash(seed, step, index) -> jax.Array:
  """32 random bits per element from ``(seed, step, index)``, as uint32.

  A counter-based hash, no generator state: the key
  ``k = fmix32(fmix32(seed ^ 0x7F4A7C15) ^ step)``, then per element
  ``fmix32(fmix32(index * 0x9E3779B9 + k) + k)`` (a Weyl sequence over the
  index mixed by two rounds of MurmurHash3's 32-bit finalizer, fmix32:
  ``h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35;
  h ^= h >> 16``), all in uint32 arithmetic modulo ``2**32``.

  Args:
    seed: integer scalar (Python int or integer array; taken modulo 2**32).
    step: integer scalar, the optimizer step (modulo 2**32).
    index: integer array, each element's global flat index
      (:func:`global_index`; modulo 2**32).
  """
  seed = _u32(seed, "seed", scalar=True)
  step = _u32(step, "step", scalar=True)
  index = _u32(index, "index", scalar=False)
  key = _fmix32(_fmix32(seed ^ jnp.uint32(_SEED_SALT)) ^ step)
  h = _fmix32(index * jnp.uint32(_WEYL) + key)
  return _fmix32(h + key)


def global_index(shape, row_offset=0, col_offset=0, n_cols=None) -> jax.Array:
  """Global flat element indices of a tile, as uint32 (modulo 2**32).

  Element ``(i, j)`` of a tile at ``(row_offset, col_offset)`` of a row-major
  array with ``n_cols`` columns has index
  ``(row_offset + i) * n_cols + col_offset + j``. Leading axes of ``shape``
  beyond two are flattened into rows, so ``global_index(w.shape)`` indexes
  a whole ``(..., in, out)`` weight; the tile of a stack's layer ``l`` has
  ``row_offset = l * in + i0``.

  Args:
    shape: the tile's shape (at least one axis; the last is columns).
    row_offset: the tile's first row in the whole array (int or traced
      integer scalar, e.g. ``program_id * block_rows``).
    col_offset: the tile's first column.
    n_cols: the whole array's number of columns (default: the tile's).
  """
  shape = tuple(int(d) for d in shape)
  if not shape:
    raise ValueError("global_index: the tile shape needs at least one axis")
  cols = shape[-1]
  n_cols = cols if n_cols is None else n_cols
  for name, v in (("row_offset", row_offset), ("col_offset", col_offset)):
    if isinstance(v, int) and v < 0:
      raise ValueError(f"global_index: {name}={v} is negative")
  if isinstance(n_cols, int) and n_cols < 1:
    raise ValueError(f"global_index: n_cols={n_cols} must be positive")
  if (isinstance(n_cols, int) and isinstance(col_offset, int)
      and col_offset + cols > n_cols):
    raise ValueError(
        f"global_index: columns {col_offset}..{col_offset + cols - 1} of the "
        f"tile do not fit in an array of {n_cols} columns; pass the whole "
        "array's column count as n_cols")
  rows = math.prod(shape[:-1])
  i = lax.broadcasted_iota(jnp.uint32, (rows, cols), 0)
  j = lax.broadcasted_iota(jnp.uint32, (rows, cols), 1)
  idx = ((i + _u32(row_offset, "row_offset", scalar=True))
         * _u32(n_cols, "n_cols", scalar=True)
         + j + _u32(col_offset, "col_offset", scalar=True))
  return idx.reshape(shape)


def stochastic_round_to_bf16(x, seed, step, index) -> jax.Array:
  """Rounds float32 ``x`` to bfloat16 stochastically, unbiased.

  ``bits(x) + (counter_hash(seed, step, index) >> 16)``, truncated to its
  high 16 bits: a value ``f`` of the way (in bf16 ulps) from the bf16 value
  below its magnitude to the one above rounds up with probability ``f``,
  so the expected result is ``x``. Values already in bf16 (and zeros, infs)
  are unchanged; the sign is kept; nan becomes bf16's quiet nan
  ``0x7FC0`` (the truncation could turn a nan payload in the low bits into
  inf, and conversions' nan bits differ between backends). Finite values beyond bf16's largest finite value round to it or to
  inf, as if inf were the next value.

  Args:
    x: float32 array.
    seed: integer scalar (modulo 2**32).
    step: integer scalar, the optimizer step (modulo 2**32).
    index: integer array broadcastable to ``x``'s shape: each element's
      global flat index (:func:`global_index`), which makes the result
      independent of tiling and sharding.

  Returns:
    bfloat16 array of ``x``'s shape.
  """
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    raise ValueError(f"stochastic_round_to_bf16 rounds float32 values; got "
                     f"{x.dtype} (cast with .astype(jnp.float32) first)")
  index = jnp.asarray(index)
  try:
    shape = jnp.broadcast_shapes(index.shape, x.shape)
  except ValueError:
    shape = None
  if shape != x.shape:
    raise ValueError(
        f"stochastic_round_to_bf16: index of shape {index.shape} does not "
        f"broadcast to x's shape {x.shape}; pass one global index per "
        "element (global_index)")
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  noise = counter_hash(seed, step, index) >> 16
  high = ((bits + noise) >> 16).astype(jnp.uint16)
  out = lax.bitcast_convert_type(high, jnp.bfloat16)
  # nan: the one quiet nan 0x7FC0 (a conversion's nan bits differ between
  # backends).
  return jnp.where(jnp.isnan(x), jnp.full(x.shape, jnp.nan, jnp.bfloat16), out)
