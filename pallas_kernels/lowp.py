"""Low-precision optimizer state in the kernels: quantized slots and
stochastic rounding of bf16 weights.

The formats are :mod:`pallas_kernels.quant`'s (its docstring is the
bit-exact specification); this module wires them into the Triton kernel's
epilogue (:mod:`pallas_kernels.triton_kernel`) and into the references
(:func:`apply`), so that the kernel and the reference give the same bits.

**A quantized slot.** Any slot of a rule may be passed to
:func:`pallas_kernels.fused_wgrad_update` (and :func:`stored_g_update`,
:func:`unfused_wgrad_update`, the reference) as a
:class:`~pallas_kernels.quant.Quantized` pair ``(q, scale)``: codes ``q`` of
the weight's shape in int8, float8_e4m3fn or float8_e5m2, and float32
``scale`` of shape ``(..., in, ceil(out / block))``, one per block of
``block`` (64) consecutive elements along a row of ``W``. Its format is
:class:`~pallas_kernels.quant.MomentFormat` of the codes' dtype (block 64,
``v_floor`` 1) unless ``formats`` names another. The epilogue dequantizes
the tile (``float32(q) * scale``), runs the rule's unchanged fp32
``update`` and requantizes the new value as :func:`quant.quantize` does; a
slot the rule lists in :attr:`~pallas_kernels.rules.UpdateRule.second_moments`
is clamped at zero and floored. The rule sees a quantized slot as an fp32
one (no product is rounded to a storage dtype).

**Tiles and blocks.** A block never straddles a tile: each column sub-tile
of the tiling (``block_out // split_out`` columns) holds whole blocks -- a
multiple of the block -- or is the only sub-tile of a row (``block_out >=
out``, ``split_out == 1``). A tiling the kernel chooses is adjusted to that
(:func:`fit_tiling`); one passed as ``config`` that breaks it is refused.

**Stochastic rounding.** ``stochastic_rounding=(seed, step)`` (integer
scalars, Python or traced: a new step does not recompile) stores a bf16
weight with :func:`quant.stochastic_round_to_bf16` of the element's global
flat index (:func:`quant.global_index`; for layer ``l`` of a stack, rows
``l * in + i``), so the result does not depend on the tiling.

**Triton.** Compiled, the per-block reciprocal ``QMAX / a`` is PTX's
correctly rounded ``div.rn.f32`` (Triton's ``/`` is approximate), int8
codes are rounded to nearest even by ``cvt.rni.f32.f32`` and a dequantized
value is the product ``mul.rn.f32``, which is never contracted into a
following add. In interpret mode the same steps are XLA's (exact) ops:
the quantized states equal the reference's bit for bit wherever XLA
computes the rule's fp32 arithmetic before them alike in both programs
(the cases ``tests/test_low_precision.py`` tests). It may contract that
arithmetic into fused multiply-adds in one program and not the other (seen
with Adagrad's e5m2 moments and torch's amsgrad Adam with int8 ones): a
one-ulp difference in a moment then moves its block's scale by one ulp.

**Mosaic GPU.** Asked for by name (``backend="mosaic_gpu"``, or a
``MosaicConfig``), or by ``backend=None`` where the autotune cache measured
it faster with int8 moments (fp8 moments and stochastic rounding: always
Triton), the Mosaic GPU kernel
takes int8 moments (64-element blocks) in its streamed epilogue, in
sub-tiles one block wide (``epi_n=64``): the codes stream through the
state ring, the scales, transposed around the launch so that a sub-tile's
are contiguous, by plain loads and stores. In interpret mode its codes and
scales equal the reference's bit for bit. Compiled, its per-block
reciprocal is the compiler's division (the approximate ``div.full``), not
``div.rn`` as in the Triton kernel: bit-exactness on the GPU is not
established. fp8 codes, stochastic rounding and a stored gradient with
quantized slots are refused there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from pallas_kernels import quant
from pallas_kernels.quant import MomentFormat, Quantized
from pallas_kernels.rules import UpdateRule

__all__ = ["MOSAIC_REFUSAL", "SlotPlan", "StatePlan", "apply",
           "dequantize_tile", "fit_tiling", "format_of_dtype", "plan_state",
           "quantize_tile", "scale_columns", "seed_step_vector",
           "tiling_problem"]

# Why backend=None takes the Triton kernel for low-precision state.
MOSAIC_REFUSAL = ("fp8 moments, int8 moments in blocks other than 64 "
                  "elements and stochastic rounding run on the Triton "
                  "backend (the Mosaic GPU kernel takes int8 moments in "
                  "64-element blocks only, and without stochastic rounding)")

_KIND_OF_DTYPE = {jnp.dtype(jnp.int8): "int8",
                  jnp.dtype(jnp.float8_e4m3fn): "fp8_e4m3",
                  jnp.dtype(jnp.float8_e5m2): "fp8_e5m2"}


def format_of_dtype(dtype) -> MomentFormat:
  """The default :class:`MomentFormat` of codes stored in ``dtype`` (block
  64, ``v_floor`` 1).

  Raises:
    ValueError: ``dtype`` is not a code dtype.
  """
  kind = _KIND_OF_DTYPE.get(jnp.dtype(dtype))
  if kind is None:
    raise ValueError(
        f"quantized codes must be int8, float8_e4m3fn or float8_e5m2, got "
        f"{jnp.dtype(dtype).name}")
  return MomentFormat(kind)


@dataclasses.dataclass(frozen=True)
class SlotPlan:
  """How one slot is stored: ``fmt`` ``None`` for a float array, else its
  format; ``second``: a second moment (clamped and floored)."""

  fmt: MomentFormat | None
  second: bool

  @property
  def arrays(self) -> int:
    """The arrays the slot takes in the kernel: 2 quantized, else 1."""
    return 1 if self.fmt is None else 2


@dataclasses.dataclass(frozen=True)
class StatePlan:
  """The static plan of a call's state (hashable: part of the kernel).

  Attributes:
    slots: one :class:`SlotPlan` per rule slot.
    stochastic_rounding: the weight is stored by stochastic rounding.
  """

  slots: tuple[SlotPlan, ...]
  stochastic_rounding: bool = False

  @property
  def quantized(self) -> bool:
    """Whether any slot is quantized."""
    return any(s.fmt is not None for s in self.slots)

  @property
  def blocks(self) -> tuple[int, ...]:
    """The block sizes of the quantized slots."""
    return tuple(sorted({s.fmt.block for s in self.slots
                         if s.fmt is not None}))

  def flatten(self, slots) -> tuple[jax.Array, ...]:
    """The slots as the kernel's arrays: ``q, scale`` for a quantized one."""
    out = []
    for s, a in zip(self.slots, slots):
      out.extend(a if s.fmt is not None else (a,))
    return tuple(out)

  def unflatten(self, arrays) -> tuple[Any, ...]:
    """The inverse of :meth:`flatten` (a quantized slot as ``Quantized``);
    arrays past the slots' (a rule's ``outputs``) follow as they are."""
    arrays, out, i = list(arrays), [], 0
    for s in self.slots:
      if s.fmt is None:
        out.append(arrays[i])
      else:
        out.append(Quantized(arrays[i], arrays[i + 1]))
      i += s.arrays
    return tuple(out) + tuple(arrays[i:])

  def logical_dtypes(self, slots) -> list:
    """The dtype each slot has for the rule: float32 for a quantized one
    (its update is fp32; nothing is rounded to a storage dtype), else the
    array's."""
    return [jnp.dtype(jnp.float32) if s.fmt is not None else jnp.dtype(a.dtype)
            for s, a in zip(self.slots, slots)]


def _is_quantized(a) -> bool:
  return isinstance(a, Quantized)


def plan_state(slots, rule: UpdateRule, w, formats=None,
               stochastic_rounding=None, *, where: str
               ) -> tuple[StatePlan | None, tuple[Any, ...]]:
  """Checks quantized slots and stochastic rounding; returns the plan.

  Args:
    slots: the call's slots, each an array or a ``Quantized`` pair.
    rule: the update rule.
    w: the weight (array or ``jax.ShapeDtypeStruct``), ``(in, out)`` or a
      stack ``(L, in, out)``.
    formats: ``None``, a sequence with one :class:`MomentFormat` (or
      ``None``: the codes' default format) per slot, or a mapping from slot
      name to format.
    stochastic_rounding: ``None`` or ``(seed, step)``.
    where: the call named in errors.

  Returns:
    ``(plan, stand_ins)``: ``plan`` is ``None`` when no slot is quantized
    and there is no stochastic rounding (the call is the plain kernel);
    ``stand_ins`` are the slots with each quantized one replaced by a
    float32 ``jax.ShapeDtypeStruct`` of ``w``'s shape, for the shared
    input checks.

  Raises:
    ValueError: codes or scales of the wrong shape or dtype, quantized
      slots for a rule that refuses them (``rule.no_quantized_state``),
      ``formats`` that do not fit the slots, stochastic rounding of a
      weight that is not bfloat16 or by a rule that does not write the
      weight.
    TypeError: a seed or step that is not an integer scalar, a slot that is
      neither an array nor a ``Quantized`` pair, ``formats`` that is one
      format (not one per slot).
  """
  slots = tuple(slots)
  names = rule.slots
  fmts = _formats_by_slot(formats, rule, where)
  if len(slots) != len(names):
    # The shared checks say it (rule needs slots ...): no plan.
    return None, slots
  plan, stand_ins = [], []
  w_shape = tuple(w.shape)
  for name, a, fmt in zip(names, slots, fmts):
    second = name in rule.second_moments
    if not _is_quantized(a) and not hasattr(a, "dtype"):
      if isinstance(a, (tuple, list)) and len(a) == 2:
        raise TypeError(
            f"{where}: slot {name!r} is a plain {type(a).__name__} of two "
            "entries; a quantized slot must be a "
            "pallas_kernels.quant.Quantized(q, scale) (codes and per-block "
            "scales: quant.quantize(values, fmt) makes one, "
            "Quantized(*pair) converts a pair), a plain slot an array")
      raise TypeError(
          f"{where}: slot {name!r} must be an array (or a quantized slot's "
          f"pallas_kernels.quant.Quantized pair), got {type(a).__name__}")
    if not _is_quantized(a):
      if jnp.dtype(a.dtype) in _KIND_OF_DTYPE:
        raise ValueError(
            f"{where}: slot {name!r} is a plain "
            f"{jnp.dtype(a.dtype).name} array; quantized codes travel with "
            "their per-block scales, as pallas_kernels.quant.Quantized(q, "
            "scale) (quant.quantize(values, fmt) makes the pair)")
      if fmt is not None:
        raise ValueError(
            f"{where}: formats gives slot {name!r} the format {fmt.kind}, "
            "but the slot is a plain array; pass it as "
            "pallas_kernels.quant.Quantized(q, scale) (codes and per-block "
            "scales, e.g. quant.quantize(values, fmt))")
      plan.append(SlotPlan(None, second))
      stand_ins.append(a)
      continue
    if rule.no_quantized_state is not None:
      raise ValueError(
          f"{where}: slot {name!r} is quantized, but rule {rule.name!r} "
          f"cannot keep quantized state: {rule.no_quantized_state}. Pass "
          "its slots as float arrays")
    q, scale = a
    q_dtype = jnp.dtype(q.dtype)
    if q_dtype not in _KIND_OF_DTYPE:
      raise ValueError(
          f"{where}: the codes of quantized slot {name!r} are "
          f"{q_dtype.name}; they must be int8, float8_e4m3fn or float8_e5m2 "
          "(pallas_kernels.quant.MomentFormat)")
    fmt = fmt if fmt is not None else format_of_dtype(q_dtype)
    if fmt.dtype != q_dtype:
      raise ValueError(
          f"{where}: formats gives slot {name!r} the format {fmt.kind} "
          f"({fmt.dtype.name} codes), but its codes are {q_dtype.name}")
    if tuple(q.shape) != w_shape:
      raise ValueError(
          f"{where}: the codes of quantized slot {name!r} have shape "
          f"{tuple(q.shape)}; they must have the weight's shape {w_shape}")
    want = fmt.scale_shape(w_shape)
    if (jnp.dtype(scale.dtype) != jnp.float32
        or tuple(scale.shape) != tuple(want)):
      raise ValueError(
          f"{where}: the scale of quantized slot {name!r} is "
          f"{jnp.dtype(scale.dtype).name}{list(scale.shape)}; codes of "
          f"shape {w_shape} need float32{list(want)}: one per {fmt.block} "
          "consecutive elements of a row (pass formats=... for another "
          "block size)")
    plan.append(SlotPlan(fmt, second))
    stand_ins.append(jax.ShapeDtypeStruct(w_shape, jnp.float32))
  sr = stochastic_rounding is not None
  if sr:
    _check_seed_step(stochastic_rounding, where)
    if not rule.updates_weight:
      raise ValueError(
          f"{where}: stochastic_rounding rounds the stored weight, but rule "
          f"{rule.name!r} does not write the weight (its layer pass does); "
          "pass stochastic_rounding=None")
    if jnp.dtype(w.dtype) != jnp.bfloat16:
      raise ValueError(
          f"{where}: stochastic_rounding stores a bfloat16 weight; this "
          f"weight is {jnp.dtype(w.dtype).name}. Pass "
          "stochastic_rounding=None (round to nearest) for it")
  state = StatePlan(tuple(plan), sr)
  if not state.quantized and not sr:
    return None, tuple(stand_ins)
  return state, tuple(stand_ins)


def _formats_by_slot(formats, rule: UpdateRule, where: str):
  """``formats`` as one entry (a ``MomentFormat`` or ``None``) per slot."""
  names = rule.slots
  if formats is None:
    return [None] * len(names)
  per_slot = (f"give one MomentFormat or None per slot of rule {rule.name!r} "
              f"{names}, e.g. formats=(fmt,) * {len(names)}, or a mapping "
              "from slot name to format")
  if isinstance(formats, MomentFormat):
    raise TypeError(f"{where}: formats is one MomentFormat ({formats.kind}, "
                    f"block {formats.block}), not one per slot: {per_slot}")
  if isinstance(formats, (str, bytes)) or not isinstance(formats, Iterable):
    raise TypeError(f"{where}: formats must be None or per slot, got "
                    f"{type(formats).__name__}: {per_slot}")
  if isinstance(formats, Mapping):
    unknown = [n for n in formats if n not in names]
    if unknown:
      raise ValueError(f"{where}: formats names {unknown}, which are not "
                       f"slots of rule {rule.name!r} ({names})")
    out = [formats.get(n) for n in names]
  else:
    out = list(formats)
    if len(out) != len(names):
      raise ValueError(
          f"{where}: formats has {len(out)} entries; rule {rule.name!r} has "
          f"{len(names)} slots {names} (give one format or None per slot, "
          "or a mapping from slot name to format)")
  for n, f in zip(names, out):
    if f is not None and not isinstance(f, MomentFormat):
      raise TypeError(
          f"{where}: the format of slot {n!r} must be a "
          f"pallas_kernels.quant.MomentFormat or None, got {f!r}")
  return out


def _check_seed_step(sr, where: str) -> None:
  if not isinstance(sr, (tuple, list)) or len(sr) != 2:
    raise TypeError(f"{where}: stochastic_rounding must be (seed, step), two "
                    f"integer scalars, or None; got {sr!r:.80}")
  for name, v in zip(("seed", "step"), sr):
    if isinstance(v, bool):
      raise TypeError(f"{where}: stochastic_rounding's {name} must be an "
                      f"integer, got the bool {v!r}")
    if isinstance(v, int):
      continue
    dtype, shape = getattr(v, "dtype", None), getattr(v, "shape", None)
    if (dtype is None or not jnp.issubdtype(dtype, jnp.integer)
        or tuple(shape) != ()):
      raise TypeError(
          f"{where}: stochastic_rounding's {name} must be an integer scalar "
          f"(a Python int or an integer array of shape ()), got {v!r:.80}")


def seed_step_vector(sr) -> jax.Array:
  """``(seed, step)`` as the kernel's uint32 vector (each modulo 2**32, as
  :func:`quant.counter_hash` takes them)."""
  return jnp.stack([quant._u32(v, n, scalar=True)  # noqa: SLF001
                    for v, n in zip(sr, ("seed", "step"))])


# --- tilings ------------------------------------------------------------------


def tiling_problem(cfg, plan: StatePlan, n_out: int) -> str | None:
  """Why the Triton tiling ``cfg`` (a ``BlockConfig``) splits a block of a
  quantized slot across sub-tiles, or ``None``."""
  so = cfg.block_out // cfg.split_out
  for block in plan.blocks:
    if so % block == 0:
      continue
    if cfg.split_out == 1 and cfg.block_out >= n_out:
      continue  # one sub-tile holds the whole row, hence its blocks
    return (f"its column sub-tiles are block_out // split_out = "
            f"{cfg.block_out} // {cfg.split_out} = {so} columns, which "
            f"splits the {block}-element blocks of the quantized moments "
            f"(one scale per {block} consecutive elements of a row): use a "
            f"sub-tile that is a multiple of {block} columns, e.g. "
            f"BlockConfig(block_out={max(block, 128)}, split_out=1)")
  return None


def fit_tiling(cfg, plan: StatePlan, n_out: int):
  """``cfg`` adjusted so that no block of a quantized slot straddles a
  sub-tile: ``split_out`` lowered, ``block_out`` raised to the block (or to
  the row) where needed. Unchanged when it already fits."""
  if plan is None or not plan.quantized or tiling_problem(
      cfg, plan, n_out) is None:
    return cfg
  block = max(plan.blocks)
  bo = cfg.block_out
  row = 1 << max(0, (int(n_out) - 1).bit_length())  # next power of two
  if bo < block:
    bo = max(bo, min(block, row))
  split = max(1, min(cfg.split_out, bo // block))
  if bo < block:  # the row fits in one sub-tile
    split = 1
  return dataclasses.replace(cfg, block_out=bo, split_out=split)


# --- the per-tile arithmetic (kernel epilogue) -------------------------------


def _asm(op: str, *args):
  """One PTX instruction on fp32 tensors of one shape (compiled Triton)."""
  from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415
  shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
  args = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in args]
  operands = ", ".join(f"${i + 1}" for i in range(len(args)))
  [out] = plgpu.elementwise_inline_asm(
      f"{op} $0, {operands};", args=args,
      constraints=",".join(["=f"] + ["f"] * len(args)), pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
  return out


def _div_rn(a, b, compiled: bool):
  """``a / b`` correctly rounded."""
  return _asm("div.rn.f32", a, b) if compiled else a / b


def _rint(y, compiled: bool):
  """Rounds to the nearest integer, ties to even (as fp32)."""
  return _asm("cvt.rni.f32.f32", y) if compiled else jnp.rint(y)


def _mul_rn(a, b, compiled: bool):
  """``a * b`` rounded on its own (never contracted into an add)."""
  return _asm("mul.rn.f32", a, b) if compiled else a * b


def _blocked(x, block: int):
  """A ``(rows, cols)`` tile as ``(rows, cols // block, block)``, or itself
  when it is one block (``cols <= block``)."""
  rows, cols = x.shape
  if cols <= block:
    return x
  return x.reshape(rows, cols // block, block)


def scale_columns(cols: int, block: int) -> int:
  """Scales per row of a ``cols``-wide sub-tile."""
  return max(1, cols // block)


def dequantize_tile(q, scale, fmt: MomentFormat, compiled: bool):
  """``float32(q) * scale`` of a ``(rows, cols)`` tile of codes and its
  ``(rows, scale_columns(cols))`` scales."""
  qf = q.astype(jnp.float32)
  rows, cols = qf.shape
  qb = _blocked(qf, fmt.block)
  s = scale if qb.ndim == 2 else scale[:, :, None]
  out = _mul_rn(qb, jnp.broadcast_to(s, qb.shape), compiled)
  return out.reshape(rows, cols)


def quantize_tile(x, fmt: MomentFormat, second: bool, compiled: bool):
  """:func:`quant.quantize_blocks` on a ``(rows, cols)`` fp32 tile whose
  columns are whole blocks (or one partial block, padded with zeros by the
  caller); returns codes ``(rows, cols)`` and scales ``(rows,
  scale_columns(cols))``. Steps and roundings are the specification's;
  only the reciprocal, the int8 rounding and (in the kernel) the ops'
  spelling differ between compiled and interpreted code."""
  f32 = jnp.float32
  rows, cols = x.shape
  xb = _blocked(x, fmt.block)
  zero = jnp.zeros((), f32)
  finite = jnp.isfinite(xb)
  bad = jnp.max(jnp.where(finite, zero, jnp.ones((), f32)), axis=-1,
                keepdims=True) > 0
  if second:
    xb = jnp.where(xb > 0, xb, zero)
  a = jnp.max(jnp.where(finite, jnp.abs(xb), zero), axis=-1, keepdims=True)
  live = jnp.logical_not(bad) & (a >= f32(quant.TINY_ABSMAX))
  scale = jnp.where(live, a * f32(fmt.inv_qmax), zero)
  scale = jnp.where(bad, f32(np.nan), scale)
  qmax = f32(fmt.qmax)
  r = _div_rn(jnp.full(a.shape, qmax, f32), jnp.where(live, a, f32(1)),
              compiled)
  y = jnp.where(live, jnp.minimum(jnp.maximum(xb * r, f32(-fmt.qmax)), qmax),
                zero)
  if second and fmt.v_floor:
    y = jnp.where(live, jnp.maximum(y, f32(fmt.floor_value)), zero)
  if fmt.kind == "int8":
    q = _rint(y, compiled).astype(jnp.int8)
  else:
    # Never the -0 code: on the bits (a compiler may fold a float select of
    # zero for zero), as quant.quantize_blocks does.
    bits = lax.bitcast_convert_type(y.astype(fmt.dtype), jnp.uint8)
    q = lax.bitcast_convert_type(
        jnp.where(bits == jnp.uint8(0x80), jnp.uint8(0), bits), fmt.dtype)
  q = q.reshape(rows, cols)
  scale = scale.reshape(rows, scale_columns(cols, fmt.block))
  return q, scale


# --- the reference ------------------------------------------------------------


def _stack_rows(w_shape, layer):
  """The first global row of layer ``layer`` of a stack (0 unstacked)."""
  if layer is None:
    return 0
  return layer * w_shape[-2]


def apply(rule: UpdateRule, plan: StatePlan, g, w, slots, hparams, sr=None,
          layer=None):
  """The rule on whole arrays with low-precision state, by XLA: the
  reference of the kernel's epilogue.

  Args:
    rule: the update rule.
    plan: :func:`plan_state`'s plan.
    g: the gradient, ``(in, out)``.
    w: the weight ``(in, out)``, or with ``layer`` a stack ``(L, in, out)``.
    slots: the slots (quantized ones as ``Quantized``), of ``w``'s shape.
    hparams: ``rule.pack(...)``.
    sr: ``(seed, step)`` or ``None``.
    layer: ``None``, or the layer of the stacks to update (an integer
      scalar, clamped into ``[0, L)``).

  Returns:
    ``(w_new, slots_new)``, quantized slots as ``Quantized``, the rule's
    outputs after the slots; with ``layer``, the stacks with that layer
    replaced.
  """
  f32 = jnp.float32
  slots = tuple(slots)
  if layer is not None:
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, w.shape[0] - 1)
    take = lambda a: lax.dynamic_index_in_dim(a, layer, keepdims=False)
    w_l = take(w)
    slots_l = tuple(Quantized(take(a.q), take(a.scale)) if _is_quantized(a)
                    else take(a) for a in slots)
  else:
    w_l, slots_l = w, slots
  vals = []
  for s, a in zip(plan.slots, slots_l):
    vals.append(quant.dequantize(a, s.fmt) if s.fmt is not None
                else a.astype(f32))
  h = rule.unpack(hparams, plan.logical_dtypes(slots_l))
  w_new, new = rule.call(
      g.astype(f32), w_l.astype(f32) if rule.updates_weight else None,
      tuple(vals), h)
  n = len(slots)
  out_dtype = rule.output_dtype(
      w.dtype, [d for d in plan.logical_dtypes(slots_l)])
  new_slots = []
  for s, a, v in zip(plan.slots, slots_l, new[:n]):
    if s.fmt is not None:
      new_slots.append(quant.quantize(v, s.fmt, second_moment=s.second))
    else:
      new_slots.append(v.astype(a.dtype))
  outputs = tuple(v.astype(out_dtype) for v in new[n:])
  if rule.updates_weight:
    if plan.stochastic_rounding:
      seed, step = sr
      rows0 = _stack_rows(w.shape, layer)
      idx = quant.global_index(w_l.shape, rows0, 0, w_l.shape[-1])
      w_new = quant.stochastic_round_to_bf16(w_new.astype(f32), seed, step,
                                             idx)
    else:
      w_new = w_new.astype(w.dtype)
  if layer is None:
    return (w_new if rule.updates_weight else w), tuple(new_slots) + outputs
  # Materialised before the write-back (see reference.apply_rule).
  w_new, new_slots, outputs = lax.optimization_barrier(
      (w_new if rule.updates_weight else w_l, tuple(new_slots), outputs))
  put = lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype),
                                                     layer, 0)
  stacked = []
  for a, v in zip(slots, new_slots):
    if _is_quantized(a):
      stacked.append(Quantized(put(a.q, v.q), put(a.scale, v.scale)))
    else:
      stacked.append(put(a, v))
  w_out = put(w, w_new) if rule.updates_weight else w
  return w_out, tuple(stacked) + tuple(outputs)
