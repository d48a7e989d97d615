"""Fused weight gradient + optimizer update: ``G = x^T dy`` never leaves registers.

For a linear layer ``y = x @ W`` (``W`` of shape ``(in, out)``) the weight
gradient of a step is ``G = x^T dy``, a sum over the ``BT`` token rows. This
kernel computes ``G`` one ``(block_in, block_out)`` output tile at a time,
accumulating over ``BT`` chunks in fp32, then applies an elementwise optimizer
rule (:class:`pallas_kernels.rules.UpdateRule`) to that tile in the epilogue:
it loads the tile of ``W`` and of each state slot, updates them and stores them
back in place (``input_output_aliases``). ``G`` is never written to memory.

The caller must have read the *pre-update* ``W`` (for ``dx = dy @ W^T``)
before this kernel runs; inside ``jax.jit`` data dependencies order that.

The same module holds the pure-``jnp`` reference, :func:`fused_wgrad_update_reference`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.rules import HPARAM_VECTOR_LEN, UpdateRule

_MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16.


def _is_int(v) -> bool:
  # A Python int (the tiling reaches Triton's compile parameters as is): not
  # a bool, a float or a NumPy scalar.
  return isinstance(v, int) and not isinstance(v, bool)


def _is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tiling of the fused kernel.

  Attributes:
    block_in: rows of a ``G`` tile (the layer's input dimension).
    block_out: columns of a ``G`` tile (the layer's output dimension).
    block_bt: token rows reduced per main-loop iteration.
    group_in: tiles along ``in`` visited together before moving along
      ``out`` (grouped order, so neighbouring programs share ``dy`` chunks in
      L2); 1 is plain row-major order.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages of the main loop.
    prefetch: load the tile of ``W`` and of each slot *before* the main loop
      instead of after it, so that this traffic overlaps the GEMM (it then
      occupies registers during the loop).
    stream_state: load and store ``W`` and the slots with the
      ``evict_first`` L2 policy and ``x``, ``dy`` with ``evict_last``: each
      state byte is touched once, while every ``x``/``dy`` chunk is re-read
      by a whole row/column of tiles, so the operands should stay in L2.
    split_out: compute the ``(block_in, block_out)`` tile as this many
      column sub-tiles of ``block_out // split_out``, each its own fp32
      accumulator (they share each loaded ``x`` chunk), and run the epilogue
      one sub-tile at a time, so only one sub-tile of ``W`` and its state is
      live in registers at once (with ``prefetch``, every sub-tile's state
      is loaded before the main loop and all are live through it).
  """

  block_in: int = 64
  block_out: int = 128
  block_bt: int = 64
  group_in: int = 1
  num_warps: int = 4
  num_stages: int = 3
  prefetch: bool = False
  stream_state: bool = False
  split_out: int = 1

  def __post_init__(self):
    for name in ("block_in", "block_out", "block_bt"):
      v = getattr(self, name)
      if not _is_int(v):
        raise ValueError(f"{name}={v!r} must be a Python int (a power of two"
                         f" >= {_MIN_BLOCK}), got {type(v).__name__}")
      if not _is_pow2(v) or v < _MIN_BLOCK:
        raise ValueError(
            f"{name}={v!r} must be a power of two >= {_MIN_BLOCK}")
    if not _is_int(self.group_in) or self.group_in < 1:
      raise ValueError(f"group_in={self.group_in!r} must be an int >= 1")
    if not _is_int(self.num_warps) or self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps!r} must be 1, 2, 4, 8 or 16")
    if not _is_int(self.num_stages) or self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages!r} must be an int >= 1")
    for name in ("prefetch", "stream_state"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
    if (not _is_int(self.split_out) or not _is_pow2(self.split_out)
        or self.block_out // self.split_out < _MIN_BLOCK):
      raise ValueError(
          f"split_out={self.split_out!r} must be a power of two leaving "
          f"sub-tiles of >= {_MIN_BLOCK} columns (block_out={self.block_out})")

  def fit(self, bt: int, n_in: int, n_out: int) -> "BlockConfig":
    """This tiling shrunk to the problem: each block at most the next power
    of two of its dimension (and at least 16), ``split_out`` reduced so that
    sub-tiles keep >= 16 columns. The one clamp every heuristic and the
    autotuner's candidates go through."""
    clamp = lambda b, n: max(_MIN_BLOCK, min(b, _next_pow2(n)))
    bo = clamp(self.block_out, n_out)
    return dataclasses.replace(
        self, block_in=clamp(self.block_in, n_in), block_out=bo,
        block_bt=clamp(self.block_bt, bt),
        split_out=max(1, min(self.split_out, bo // _MIN_BLOCK)))

  @classmethod
  def default(cls, bt: int, n_in: int, n_out: int) -> "BlockConfig":
    """A heuristic tiling: the measured-best 64x128x64 tile, shrunk to fit."""
    return cls(block_in=64, block_out=128, block_bt=64).fit(bt, n_in, n_out)

  @classmethod
  def stored_default(cls, n_in: int, n_out: int) -> "BlockConfig":
    """The tiling of :func:`stored_g_update` (no GEMM): 32x128 blocks on 4
    warps, 32 elements per thread, the best of seven block shapes for a
    stored-gradient AdamW on the H200 (3.34 TB/s at 4096x4096, against
    2.56 for 64x128 and XLA's 3.16; ``benchmarks/epilogue_probe.py``,
    docs/perf_notes.md variant 7). Shrunk to fit."""
    return cls(block_in=32, block_out=128, block_bt=16, num_stages=1).fit(
        _MIN_BLOCK, n_in, n_out)

  @classmethod
  def compiled_default(cls, bt: int, n_in: int, n_out: int,
                       w_dtype) -> "BlockConfig":
    """The heuristic for a compiled (GPU) kernel on a problem the autotune
    cache does not hold, from the H200 sweep over the Llama-8B shapes
    (docs/perf_notes.md, session 3): with 16-bit weights, the 64x128 tile
    computed as two column halves for ``BT`` up to 1024 and the grouped
    128x256 tile in four column quarters above (``BT`` buckets as the cache
    rounds them: 1025..2048 is the 2048 bucket), both streaming the state.
    The large tile wins at ``BT`` >= 2048 through fewer re-reads of ``x``
    and ``dy``, the halves at ``BT`` 512 (the sum over the four shapes is
    the lowest; 64x64 wins on the two smaller ones). ``BT`` <= 64 was not
    swept: at ``BT`` 16 the probe measured 32x128 and 64x64 tiles ahead of
    this one. fp32 weights keep :meth:`default`. Shrunk to fit."""
    if jnp.dtype(w_dtype).itemsize != 2:
      return cls.default(bt, n_in, n_out)
    if bt > 1024:
      cfg = cls(128, 256, 32, group_in=8, num_warps=8, num_stages=4,
                stream_state=True, split_out=4)
    else:
      cfg = cls(64, 128, 32, num_stages=4, stream_state=True, split_out=2)
    return cfg.fit(bt, n_in, n_out)


def select_config(bt: int, n_in: int, n_out: int, w_dtype, slot_dtypes,
                  rule: UpdateRule | str | None = None, *,
                  interpret: bool | None = None) -> BlockConfig:
  """The tiling ``fused_wgrad_update`` uses when given no ``config``.

  On a GPU (not in interpret mode): the autotuned winner cached for this
  device kind and problem (:func:`pallas_kernels.autotune.lookup`: the
  shipped ``tuned_configs.json``, or ``$FORGE_AUTOTUNE_CACHE`` first), else
  the heuristic :meth:`BlockConfig.compiled_default`. On a CPU / in
  interpret mode always :meth:`BlockConfig.default`. Runs at trace time; the
  parsed JSON is cached.
  """
  if interpret is None:
    interpret = default_interpret()
  if not interpret:
    from pallas_kernels import autotune  # noqa: PLC0415 -- imports this module
    cfg = autotune.lookup(bt, n_in, n_out, w_dtype, slot_dtypes, rule)
    if cfg is not None:
      return cfg
    return BlockConfig.compiled_default(bt, n_in, n_out, w_dtype)
  return BlockConfig.default(bt, n_in, n_out)


def _float_dtype_check(name: str, a) -> None:
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {a.dtype}")
  if jax.dtypes.canonicalize_dtype(a.dtype) == jnp.float64:
    raise TypeError(
        f"{name} is float64: the fused kernel computes in fp32 and stores "
        "fp32, bf16 or fp16; cast it (e.g. to float32) first")


def _check_inputs(x, dy, w, slots, hparams, rule: UpdateRule, layer=None):
  for name, a in (("x", x), ("dy", dy), ("w", w)):
    _float_dtype_check(name, a)
  if layer is None and w.ndim != 2:
    raise ValueError(f"w must be 2-D (in, out), got shape {w.shape}")
  if layer is not None:
    if w.ndim != 3:
      raise ValueError(
          f"with layer=..., w must be a stack (L, in, out), got shape {w.shape}")
    # A concrete index goes through NumPy: under an explicit-sharding
    # (abstract) mesh, jnp.asarray(1) inside jit is a tracer and int() of it
    # fails.
    concrete = not isinstance(layer, jax.core.Tracer)
    layer_a = np.asarray(layer) if concrete else layer
    if layer_a.shape != () or not jnp.issubdtype(layer_a.dtype, jnp.integer):
      raise TypeError(f"layer must be an integer scalar, got {layer_a.dtype}"
                      f"{list(layer_a.shape)}")
    if concrete:
      index = int(layer_a)  # concrete: a Python, NumPy or JAX integer
      if not 0 <= index < w.shape[0]:
        raise IndexError(
            f"layer={index} is out of range for {w.shape[0]} layers")
  if x.ndim < 1 or dy.ndim < 1:
    raise ValueError(
        f"x and dy need at least one dimension, got {x.shape} and {dy.shape}")
  n_in, n_out = w.shape[-2:]
  if n_in == 0 or n_out == 0:
    raise ValueError(f"w has a zero-size dimension, shape {w.shape}: there is "
                     "no weight to update")
  if x.shape[-1] != n_in:
    raise ValueError(f"x's last dimension {x.shape[-1]} != w.shape[0]={n_in}")
  if dy.shape[-1] != n_out:
    raise ValueError(
        f"dy's last dimension {dy.shape[-1]} != w.shape[1]={n_out}")
  if x.shape[:-1] != dy.shape[:-1]:
    raise ValueError(
        f"x and dy must share leading (token) dimensions, got {x.shape} and "
        f"{dy.shape}")
  if len(slots) != len(rule.slots):
    raise ValueError(
        f"rule {rule.name!r} needs slots {rule.slots}, got {len(slots)} arrays")
  for name, s in zip(rule.slots, slots):
    _float_dtype_check(f"slot {name!r}", s)
    if s.shape != w.shape:
      raise ValueError(
          f"slot {name!r} has shape {s.shape}, expected w's shape {w.shape}")
  shape, dtype = getattr(hparams, "shape", None), getattr(hparams, "dtype", None)
  if shape != (HPARAM_VECTOR_LEN,) or dtype != jnp.float32:
    got = (f"{dtype}{list(shape)}" if shape is not None and dtype is not None
           else type(hparams).__name__)
    raise ValueError(
        f"hparams must be a float32 vector of length {HPARAM_VECTOR_LEN} (use"
        f" rule.pack(...)), got {got}")


def _checked_inputs(x, dy, w, slots, hparams, rule: UpdateRule, layer=None):
  """:func:`_check_inputs`, then the arrays both the kernel and its reference
  take: NumPy inputs as JAX arrays (float64 under x64-off canonicalises to
  float32), ``x`` and ``dy`` promoted to their common dtype, as ``jnp.dot``
  does (the kernel's dot needs one operand dtype)."""
  slots = tuple(slots)
  _check_inputs(x, dy, w, slots, hparams, rule, layer)
  x, dy, w = jnp.asarray(x), jnp.asarray(dy), jnp.asarray(w)
  slots = tuple(jnp.asarray(a) for a in slots)
  common = jnp.result_type(x, dy)
  return x.astype(common), dy.astype(common), w, slots


def _and(*masks):
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  out = masks[0]
  for m in masks[1:]:
    out = out & m
  return out


def _fused_kernel(*refs, rule: UpdateRule, cfg: BlockConfig, bt: int,
                  n_in: int, n_out: int, precision, stacked: bool,
                  interpret: bool, g_stored: bool = False):
  # Inputs: x, dy (or, with g_stored, a stored G), the hyperparameters, (the
  # layer index if stacked), (W if the rule updates it), slots.
  # Outputs: the same state, aliased, then the rule's write-only outputs.
  if g_stored:
    g_ref, h_ref, *refs = refs
  else:
    x_ref, dy_ref, h_ref, *refs = refs
  if stacked:
    layer_ref, *refs = refs
  n_state = int(rule.updates_weight) + len(rule.slots)
  in_refs, out_refs = refs[:n_state], refs[n_state:]
  bi, bo = cfg.block_in, cfg.block_out

  # Grouped tile order: program p walks `group_in` tiles down `in` before
  # moving to the next `out` column, so the programs in flight share chunks of
  # dy (and the grid's x chunks stay hot across groups).
  pid = pl.program_id(0)
  tiles_in = pl.cdiv(n_in, bi)
  tiles_out = pl.cdiv(n_out, bo)
  per_group = cfg.group_in * tiles_out
  group = pid // per_group
  first_in = group * cfg.group_in
  group_size = jnp.minimum(tiles_in - first_in, cfg.group_in)
  ti = first_in + (pid % per_group) % group_size
  to = (pid % per_group) // group_size

  # Column sub-tiles (BlockConfig.split_out): each has its own accumulator
  # and its own epilogue; there is one of them unless split_out > 1.
  ns = cfg.split_out
  so = bo // ns
  col0 = [to * bo + j * so for j in range(ns)]

  # Masks only along dimensions the tiles do not divide: an unmasked access
  # can be vectorised (a masked one may not be).
  row_ok = (ti * bi + jnp.arange(bi) < n_in) if n_in % bi else None
  col_ok = ([c + jnp.arange(so) < n_out for c in col0] if n_out % bo
            else [None] * ns)
  col = lambda m: None if m is None else m[None, :]
  row = lambda m: None if m is None else m[:, None]

  tiles = [(pl.ds(ti * bi, bi), pl.ds(c, so)) for c in col0]
  masks = [_and(row(row_ok), col(m)) for m in col_ok]
  # A stacked state (L, in, out): this call updates layer `layer_ref[0]`.
  state_tiles = ([(layer_ref[0], *t) for t in tiles] if stacked else tiles)
  state_policy = "evict_first" if cfg.stream_state else None
  operand_policy = "evict_last" if cfg.stream_state else None

  def load_state(j):
    return [plgpu.load(r.at[state_tiles[j]], mask=masks[j],
                       other=None if masks[j] is None else 0.0,
                       eviction_policy=state_policy) for r in in_refs]

  # With `prefetch` the W/slot loads are issued before the main loop, so they
  # are in flight while the tensor cores run.
  old = [load_state(j) for j in range(ns)] if cfg.prefetch else [None] * ns

  if g_stored:
    # G was formed elsewhere (XLA's GEMM): the epilogue alone, on its tiles.
    gs = tuple(
        plgpu.load(g_ref.at[tiles[j]], mask=masks[j],
                   other=None if masks[j] is None else 0.0,
                   eviction_policy=state_policy).astype(jnp.float32)
        for j in range(ns))
  else:
    gs = _main_loop(x_ref, dy_ref, cfg, bt, ti, col0, so, row_ok, col_ok,
                    operand_policy, precision)
  _epilogue(rule, cfg, h_ref, in_refs, out_refs, gs, old, load_state,
            state_tiles, tiles, masks, state_policy, interpret)


def _main_loop(x_ref, dy_ref, cfg, bt, ti, col0, so, row_ok, col_ok,
               operand_policy, precision):
  """The weight-gradient GEMM of one tile: its ``split_out`` fp32
  accumulators, ``x[:, tile rows]^T dy[:, tile columns]``."""
  bi, bk, ns = cfg.block_in, cfg.block_bt, cfg.split_out
  col = lambda m: None if m is None else m[None, :]

  def body(k, accs):
    k_ok = (k * bk + jnp.arange(bk) < bt)[:, None] if bt % bk else None
    x_mask = _and(k_ok, col(row_ok))
    xk = plgpu.load(
        x_ref.at[pl.ds(k * bk, bk), pl.ds(ti * bi, bi)],
        mask=x_mask, other=None if x_mask is None else 0.0,
        eviction_policy=operand_policy)
    out = []
    for j in range(ns):
      dy_mask = _and(k_ok, col(col_ok[j]))
      dyk = plgpu.load(
          dy_ref.at[pl.ds(k * bk, bk), pl.ds(col0[j], so)],
          mask=dy_mask, other=None if dy_mask is None else 0.0,
          eviction_policy=operand_policy)
      out.append(accs[j] + plgpu.dot(xk, dyk, trans_a=True,
                                      precision=precision))
    return tuple(out)

  return lax.fori_loop(0, pl.cdiv(bt, bk), body,
                       tuple(jnp.zeros((bi, so), jnp.float32)
                             for _ in range(ns)))


def _epilogue(rule, cfg, h_ref, in_refs, out_refs, gs, old, load_state,
              state_tiles, tiles, masks, state_policy, interpret):
  """The optimizer on each sub-tile, reading and writing W and its state in
  place. ``g`` (fp32) is consumed here and never stored."""
  n_aliased = len(in_refs)
  # Compiled, the rule rounds with convert pairs (Triton keeps them); in
  # interpret mode the body is XLA code and uses lax.reduce_precision.
  h = rule.unpack(h_ref, [r.dtype for r in in_refs[int(rule.updates_weight):]],
                  round_by_convert=not interpret)
  for j, g in enumerate(gs):
    olds = old[j] if old[j] is not None else load_state(j)
    olds = [a.astype(jnp.float32) for a in olds]
    if rule.updates_weight:
      w_new, new = rule.update(g, olds[0], tuple(olds[1:]), h)
      new = (w_new, *new)
    else:  # regime 2: the state only; W stays in HBM, untouched.
      _, new = rule.update(g, None, tuple(olds), h)
    for i, (r, v) in enumerate(zip(out_refs, new)):
      plgpu.store(r.at[state_tiles[j] if i < n_aliased else tiles[j]],
                  v.astype(r.dtype), mask=masks[j],
                  eviction_policy=state_policy)


def check_block_config(config, where: str) -> None:
  """Refuses a tiling that is neither ``None`` nor a :class:`BlockConfig`
  (a dict, a tuple, a label string) where it is given, rather than as an
  AttributeError deep inside a backward."""
  if config is not None and not isinstance(config, BlockConfig):
    raise TypeError(
        f"{where}: block_config must be a pallas_kernels.BlockConfig or None, "
        f"got {type(config).__name__} {config!r:.80}")


def _flatten_tokens(x, dy):
  return x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])


def default_interpret() -> bool:
  """Pallas interpret mode unless the default backend is a GPU."""
  return jax.default_backend() != "gpu"


def _dot_precision(x, dy, w):
  # fp32 parameters get IEEE fp32 products, not TF32, so fp32 parity holds.
  if jnp.float32 in (x.dtype, dy.dtype, w.dtype):
    return lax.Precision.HIGHEST
  return None


def fused_wgrad_update(
    x: jax.Array,
    dy: jax.Array,
    w: jax.Array,
    slots: Sequence[jax.Array],
    hparams: jax.Array,
    *,
    rule: UpdateRule,
    config: BlockConfig | None = None,
    interpret: bool | None = None,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """One optimizer step of ``w`` from ``G = x^T dy``, without storing ``G``.

  Args:
    x: layer input, ``(..., in)``; leading dimensions are the tokens.
    dy: gradient of the layer output, ``(..., out)``, same leading dims.
      ``x`` and ``dy`` of different float dtypes are promoted to their common
      dtype first, as ``jnp.dot`` does.
    w: the weight, ``(in, out)``, fp32 or bf16 (fp16 works too; float64 is
      refused). Written in place.
    slots: the rule's state arrays (``rule.slots``), each of ``w``'s shape, in
      any float dtype (e.g. ``mu`` in ``mu_dtype``). Written in place.
    hparams: ``rule.pack(...)``: this step's runtime hyperparameters.
    rule: the optimizer family's elementwise update.
    config: tiling; when ``None``, :func:`select_config` (the autotuned
      winner cached for this GPU, else a heuristic).
    interpret: run in Pallas interpret mode (CPU); default: unless on a GPU.
    layer: for a stack of layers: ``w`` and the slots are ``(L, in, out)``
      and only layer ``layer`` (an integer scalar, may be traced) is updated,
      in place in the stacks -- no slice is copied out or back. A static
      index out of range raises; a traced one is clamped into ``[0, L)``, as
      ``lax.dynamic_update_slice`` clamps.

  Returns:
    ``(w_new, slots_new)``, aliasing the buffers of ``w`` and ``slots`` when
    the caller donates them. For a rule with ``outputs`` (Muon's ``mu_hat``),
    ``slots_new`` continues with those fresh arrays (``w``'s shape,
    ``rule.output_dtype``). For a rule with ``updates_weight=False`` the
    kernel does not touch ``w`` and ``w_new`` is ``w``.

  Example:
    >>> from pallas_kernels import ADAMW, fused_wgrad_update
    >>> h = ADAMW.pack(lr=1e-3, b1=0.9, b2=0.999, one_minus_b1=0.1,
    ...                one_minus_b2=0.001, eps=1e-8, eps_root=0.0,
    ...                weight_decay=1e-4, bc1=0.1, bc2=0.001, bc1_next=0.19)
    >>> w, (mu, nu) = fused_wgrad_update(x, dy, w, (mu, nu), h, rule=ADAMW)
  """
  x, dy, w, slots = _checked_inputs(x, dy, w, slots, hparams, rule, layer)
  x2, dy2 = _flatten_tokens(x, dy)
  bt = x2.shape[0]
  n_in, n_out = w.shape[-2:]
  stacked = layer is not None
  if stacked:
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, w.shape[0] - 1)
  if interpret is None:
    interpret = default_interpret()
  check_block_config(config, "fused_wgrad_update(config=...)")
  cfg = config or select_config(bt, n_in, n_out, w.dtype,
                                [a.dtype for a in slots], rule,
                                interpret=interpret)
  if bt == 0:
    # No tokens: G = 0, the optimizer still steps (moments decay, weight decay).
    return _apply_maybe_stacked(rule, jnp.zeros((n_in, n_out), jnp.float32),
                                w, slots, hparams, layer)

  return _call_kernel((x2, dy2), w, slots, hparams, rule, cfg, layer,
                      interpret, bt=bt, precision=_dot_precision(x, dy, w))


def _call_kernel(operands, w, slots, hparams, rule, cfg, layer, interpret, *,
                 bt, precision):
  """The ``pallas_call`` of :func:`_fused_kernel`: ``operands`` are
  ``(x, dy)`` (the fused GEMM) or ``(g,)`` (a stored gradient); ``W`` (if
  the rule updates it) and the slots are aliased to the outputs, so they are
  updated in place (layer ``layer`` of stacks, unless ``None``)."""
  g_stored = len(operands) == 1
  stacked = layer is not None
  n_in, n_out = w.shape[-2:]
  n_tiles = pl.cdiv(n_in, cfg.block_in) * pl.cdiv(n_out, cfg.block_out)
  kernel = functools.partial(
      _fused_kernel, rule=rule, cfg=cfg, bt=bt, n_in=n_in, n_out=n_out,
      precision=precision, stacked=stacked, interpret=bool(interpret),
      g_stored=g_stored)
  state = (w, *slots) if rule.updates_weight else slots
  out_dtype = rule.output_dtype(w.dtype, [a.dtype for a in slots])
  outputs = tuple(jax.ShapeDtypeStruct((n_in, n_out), out_dtype)
                  for _ in rule.outputs)
  extra = (layer.reshape(1),) if stacked else ()
  # After the operands, hparams (and the layer index).
  first_state_arg = len(operands) + 1 + len(extra)
  out = pl.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in state)
      + outputs,
      grid=(n_tiles,),
      input_output_aliases={first_state_arg + i: i for i in range(len(state))},
      compiler_params=plgpu.CompilerParams(
          num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      # Nonzero static settings (e.g. round_mu=1) are named, so a profile
      # tells the kernels apart (with fp32 slots round_mu changes no code).
      name="_".join(["stored_g_update" if g_stored else "fused_wgrad",
                     rule.name, *(n for n, v in rule.static if v)]),
  )(*operands, hparams, *extra, *state)
  if rule.updates_weight:
    return out[0], tuple(out[1:])
  return w, tuple(out)


def _apply_maybe_stacked(rule, g, w, slots, hparams, layer):
  if layer is None:
    return rule.apply(g, w, slots, hparams)
  layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, w.shape[0] - 1)
  take = lambda a: lax.dynamic_index_in_dim(a, layer, keepdims=False)
  put = lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype),
                                                     layer, 0)
  w_new, new = rule.apply(g, take(w), [take(s) for s in slots], hparams)
  # The new slices materialised before they are written back: otherwise XLA
  # fuses the rule into each dynamic-update-slice, whose fusion then reads
  # the stack it writes, and protects that read with a copy of the whole
  # stack on every call (every loop iteration of a scanned stack).
  w_new, new = lax.optimization_barrier((w_new, tuple(new)))
  n = len(slots)
  new_slots = tuple(put(s, v) for s, v in zip(slots, new[:n]))
  return (put(w, w_new) if rule.updates_weight else w), new_slots + tuple(
      new[n:])


def unfused_wgrad_update(x, dy, w, slots, hparams, *, rule: UpdateRule,
                         layer=None, precision=None):
  """The same step as :func:`fused_wgrad_update`, unfused: XLA's GEMM forms
  ``G = x^T dy`` in memory and ``rule.apply`` (XLA's elementwise code)
  consumes it -- or, for layer ``layer`` of stacks on a GPU,
  :func:`stored_g_update` (the fused kernel's epilogue on that ``G``),
  which updates the layer in place where XLA would copy each new slice into
  its stack. In Pallas interpret mode (no GPU) the stacked case keeps
  XLA's rule and a dynamic-update-slice per array: the interpreter copies
  every operand, the whole stacks, once per grid program.

  ``G`` is formed as JAX's transpose of a ``Dense`` layer's dot forms the
  kernel's gradient (``dy^T x`` over every token axis, transposed), stored in
  ``x``'s and ``dy``'s common dtype: for bf16 operands it is the gradient
  ``jax.grad`` gives optax, bit for bit. ``precision`` is the GEMM's (the
  layer's ``precision``); ``None``: the default, except that fp32 operands
  get fp32 products (``HIGHEST``, as in the fused kernel). For shapes where
  the fused kernel is slower than XLA's GEMM plus an elementwise update
  (``forge_jax.make_step(..., wgrad="xla")``); called inside a layer's
  backward, ``G`` lives for that one call. Otherwise the same arguments and
  returns as :func:`fused_wgrad_update`, without ``config`` and
  ``interpret`` (the stacked kernel takes :meth:`BlockConfig.stored_default`
  and runs compiled).
  """
  x, dy, w, slots = _checked_inputs(x, dy, w, slots, hparams, rule, layer)
  # G as JAX's transpose of the layer's dot forms it -- dy^T x over every
  # token axis at once, then transposed -- so that it rounds as optax's does.
  tokens = tuple(range(x.ndim - 1))
  if precision is None and x.dtype == jnp.float32:  # (x, dy: one dtype)
    precision = lax.Precision.HIGHEST
  g = lax.dot_general(dy, x, ((tokens, tokens), ((), ())),
                      precision=precision,
                      preferred_element_type=x.dtype).T
  if layer is not None and not default_interpret():
    # Layer `layer` of the stacks, in place: the fused kernel's epilogue on
    # the stored G. (XLA's elementwise rule plus a dynamic-update-slice per
    # array copied every new slice into its stack once more: +12 bytes per
    # weight, 1.08-1.13x optax's step on the scanned decoder, run 66.)
    return stored_g_update(g, w, slots, hparams, rule=rule, layer=layer,
                           interpret=False)
  return _apply_maybe_stacked(rule, g, w, slots, hparams, layer)


def stored_g_update(g, w, slots, hparams, *, rule: UpdateRule,
                    config: BlockConfig | None = None,
                    interpret: bool | None = None, layer=None):
  """One optimizer step of ``w`` from a gradient ``g`` already in memory:
  the fused kernel's epilogue without its GEMM (the same kernel body), ``W``
  and the slots updated in place.

  For a weight gradient formed by another GEMM (``wgrad="xla"``) on a
  stacked ``(L, in, out)`` kernel: with ``layer=i`` it updates layer ``i``
  of ``w`` and of each slot where they lie, as :func:`fused_wgrad_update`
  does, where XLA's elementwise rule would write new slices and copy each
  into its stack. ``g`` is ``(in, out)`` (one layer), of any float dtype;
  it is read once, in fp32. ``config``: the tiling (``block_bt``,
  ``num_stages`` and ``group_in`` do not matter here); default
  :meth:`BlockConfig.stored_default`. Otherwise the arguments and returns
  of :func:`fused_wgrad_update`.
  """
  g, w = jnp.asarray(g), jnp.asarray(w)
  slots = tuple(jnp.asarray(a) for a in slots)
  _float_dtype_check("g", g)
  if w.ndim < 2:
    raise ValueError(f"w must be 2-D (in, out), got shape {w.shape}")
  n_in, n_out = w.shape[-2:]
  if g.shape != (n_in, n_out):
    raise ValueError(f"g must have the shape of one layer of w, "
                     f"{(n_in, n_out)}, got {g.shape}")
  # x, dy stand-ins of the right widths: the shared checks (w, slots,
  # hparams, layer) need them.
  _check_inputs(jax.ShapeDtypeStruct((1, n_in), g.dtype),
                jax.ShapeDtypeStruct((1, n_out), g.dtype), w, slots, hparams,
                rule, layer)
  if layer is not None:
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, w.shape[0] - 1)
  if interpret is None:
    interpret = default_interpret()
  check_block_config(config, "stored_g_update(config=...)")
  cfg = config or BlockConfig.stored_default(n_in, n_out)
  return _call_kernel((g,), w, slots, hparams, rule, cfg, layer, interpret,
                      bt=0, precision=None)


def fused_wgrad_update_reference(x, dy, w, slots, hparams, *, rule: UpdateRule,
                                 layer=None):
  """Pure-``jnp`` reference: form ``G`` in fp32, then apply ``rule``."""
  x, dy, w, slots = _checked_inputs(x, dy, w, slots, hparams, rule, layer)
  x2, dy2 = _flatten_tokens(x, dy)
  g = jnp.dot(x2.T, dy2, precision=lax.Precision.HIGHEST,
              preferred_element_type=jnp.float32)
  return _apply_maybe_stacked(rule, g, w, slots, hparams, layer)
