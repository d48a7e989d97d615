"""The Pallas Triton kernel: the weight-gradient GEMM with the rule in its
epilogue.

One program computes one ``(block_in, block_out)`` tile of ``G = x^T dy``,
accumulating over ``BT`` chunks in fp32 (:func:`_main_loop`), then applies
the rule to that tile (:func:`_epilogue`): it loads the tile of ``W`` and
of each state slot, updates them and stores them back in place
(``input_output_aliases``). ``G`` never leaves registers. The same body
without the main loop applies the rule to a gradient already in memory.
:func:`launch` is its ``pallas_call``; :mod:`pallas_kernels.fused_wgrad`
holds the public wrappers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import lowp, quant
from pallas_kernels.rules import UpdateRule
from pallas_kernels.tiling import BlockConfig

__all__ = ["launch"]


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
                  interpret: bool, g_stored: bool = False,
                  plan: lowp.StatePlan | None = None):
  # Inputs: x, dy (or, with g_stored, a stored G), the hyperparameters, (the
  # layer index if stacked), (the stochastic-rounding seed and step), (W if
  # the rule updates it), slots (a quantized one as its codes and scales).
  # Outputs: the same state, aliased, then the rule's write-only outputs.
  if g_stored:
    g_ref, h_ref, *refs = refs
  else:
    x_ref, dy_ref, h_ref, *refs = refs
  layer_ref = sr_ref = None
  if stacked:
    layer_ref, *refs = refs
  if plan is not None and plan.stochastic_rounding:
    sr_ref, *refs = refs
  n_state = int(rule.updates_weight) + (
      len(rule.slots) if plan is None else sum(s.arrays for s in plan.slots))
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

  if plan is not None:
    state = _LowPrecisionState(
        plan, rule, cfg, in_refs, out_refs, n_in, n_out, ti, to, col0, so,
        row_ok, col_ok, layer_ref, sr_ref, tiles, state_tiles, masks,
        state_policy, interpret)
    load_state = state.load
  else:
    state = None

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
  if state is not None:
    state.epilogue(h_ref, gs, old)
    return
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
      w_new, new = rule.call(g, olds[0], tuple(olds[1:]), h)
      new = (w_new, *new)
    else:  # regime 2: the state only; W stays in HBM, untouched.
      _, new = rule.call(g, None, tuple(olds), h)
    for i, (r, v) in enumerate(zip(out_refs, new)):
      plgpu.store(r.at[state_tiles[j] if i < n_aliased else tiles[j]],
                  v.astype(r.dtype), mask=masks[j],
                  eviction_policy=state_policy)


class _LowPrecisionState:
  """The epilogue with low-precision state (:mod:`pallas_kernels.lowp`):
  quantized slots dequantized after their load and requantized before
  their store, the weight stored by stochastic rounding. Built once per
  program; ``load(j)`` and ``epilogue`` work on column sub-tile ``j``."""

  def __init__(self, plan, rule, cfg, in_refs, out_refs, n_in, n_out, ti, to,
               col0, so, row_ok, col_ok, layer_ref, sr_ref, tiles,
               state_tiles, masks, policy, interpret):
    self.plan, self.rule, self.interpret = plan, rule, interpret
    self.in_refs, self.out_refs = in_refs, out_refs
    self.tiles, self.state_tiles, self.masks = tiles, state_tiles, masks
    self.col_ok, self.policy = col_ok, policy
    self.sr_ref = sr_ref
    self.compiled = not interpret
    bi, bo = cfg.block_in, cfg.block_out
    self.layer = None if layer_ref is None else layer_ref[0]
    # The first global row of this tile (a stack's rows counted across its
    # layers), for the stochastic-rounding index.
    self.row0 = ti * bi if layer_ref is None else self.layer * n_in + ti * bi
    self.n_out, self.so, self.col0 = n_out, so, col0
    # Each quantized slot's scale tile: (rows, scales per sub-tile), its
    # first scale column for sub-tile j, and its mask.
    self.scale_tiles, self.scale_masks = {}, {}
    row = None if row_ok is None else row_ok[:, None]
    for block in plan.blocks:
      nsc = lowp.scale_columns(so, block)
      n_sc = -(-n_out // block)
      tiles_j, masks_j = [], []
      for j in range(len(col0)):
        first = (to * (bo // block) + j * (so // block)) if so >= block else 0
        rows = pl.ds(ti * bi, bi)
        cols = pl.ds(first, nsc)
        tiles_j.append((rows, cols) if layer_ref is None
                       else (self.layer, rows, cols))
        # Masked where a sub-tile's scale columns can pass the array's:
        # one that splits a block column, or a tile running past the
        # weight's edge (its last sub-tiles can lie wholly beyond it, and
        # their columns would land in the next row's scales).
        cm = ((first + jnp.arange(nsc) < n_sc)[None, :]
              if n_sc % nsc or n_out % bo else None)
        masks_j.append(_and(row, cm))
      self.scale_tiles[block], self.scale_masks[block] = tiles_j, masks_j

  def _slot_refs(self, refs):
    """``refs`` past the weight, grouped per slot."""
    refs = list(refs[int(self.rule.updates_weight):])
    out = []
    for s in self.plan.slots:
      out.append(refs[:s.arrays])
      refs = refs[s.arrays:]
    return out

  def load(self, j):
    """The fp32 values of sub-tile ``j``: the weight (if read), then each
    slot (a quantized one dequantized)."""
    mask = self.masks[j]
    vals = []
    if self.rule.updates_weight:
      vals.append(plgpu.load(
          self.in_refs[0].at[self.state_tiles[j]], mask=mask,
          other=None if mask is None else 0.0,
          eviction_policy=self.policy).astype(jnp.float32))
    for s, refs in zip(self.plan.slots, self._slot_refs(self.in_refs)):
      if s.fmt is None:
        vals.append(plgpu.load(
            refs[0].at[self.state_tiles[j]], mask=mask,
            other=None if mask is None else 0.0,
            eviction_policy=self.policy).astype(jnp.float32))
        continue
      q_ref, scale_ref = refs
      # Codes are loaded without a fill value (an fp8 constant is not
      # needed); the lanes outside the array are zeroed below.
      q = plgpu.load(q_ref.at[self.state_tiles[j]], mask=mask,
                     eviction_policy=self.policy)
      sm = self.scale_masks[s.fmt.block][j]
      scale = plgpu.load(scale_ref.at[self.scale_tiles[s.fmt.block][j]],
                         mask=sm, other=None if sm is None else 0.0,
                         eviction_policy=self.policy)
      v = lowp.dequantize_tile(q, scale, s.fmt, self.compiled)
      if mask is not None:
        v = jnp.where(mask, v, 0.0)
      vals.append(v)
    return vals

  def epilogue(self, h_ref, gs, old):
    rule, plan = self.rule, self.plan
    # The rule sees a quantized slot as fp32 (nothing rounded to a storage
    # dtype); a float slot as its dtype, as in the plain epilogue.
    stored = []
    for s, refs in zip(plan.slots, self._slot_refs(self.in_refs)):
      stored.append(jnp.float32 if s.fmt is not None else refs[0].dtype)
    h = rule.unpack(h_ref, stored, round_by_convert=self.compiled)
    n = len(rule.slots)
    if plan.stochastic_rounding:
      seed, step = self.sr_ref[0], self.sr_ref[1]
    for j, g in enumerate(gs):
      vals = old[j] if old[j] is not None else self.load(j)
      if rule.updates_weight:
        w_new, new = rule.call(g, vals[0], tuple(vals[1:]), h)
      else:
        _, new = rule.call(g, None, tuple(vals), h)
      mask = self.masks[j]
      out = list(self.out_refs)
      if rule.updates_weight:
        w_ref = out.pop(0)
        if plan.stochastic_rounding:
          idx = quant.global_index((w_new.shape[0], self.so), self.row0,
                                   self.col0[j], self.n_out)
          w_store = quant.stochastic_round_to_bf16(
              w_new.astype(jnp.float32), seed, step, idx)
        else:
          w_store = w_new.astype(w_ref.dtype)
        plgpu.store(w_ref.at[self.state_tiles[j]], w_store, mask=mask,
                    eviction_policy=self.policy)
      for s, v in zip(plan.slots, new[:n]):
        if s.fmt is None:
          r = out.pop(0)
          plgpu.store(r.at[self.state_tiles[j]], v.astype(r.dtype),
                      mask=mask, eviction_policy=self.policy)
          continue
        q_ref, scale_ref = out.pop(0), out.pop(0)
        if self.col_ok[j] is not None:
          # Columns past the array count as zeros in their block.
          v = jnp.where(self.col_ok[j][None, :], v, 0.0)
        q, scale = lowp.quantize_tile(v, s.fmt, s.second, self.compiled)
        plgpu.store(q_ref.at[self.state_tiles[j]], q, mask=mask,
                    eviction_policy=self.policy)
        plgpu.store(scale_ref.at[self.scale_tiles[s.fmt.block][j]], scale,
                    mask=self.scale_masks[s.fmt.block][j],
                    eviction_policy=self.policy)
      for r, v in zip(out, new[n:]):  # the rule's write-only outputs
        plgpu.store(r.at[self.tiles[j]], v.astype(r.dtype), mask=mask,
                    eviction_policy=self.policy)


def _plan_tags(plan) -> list[str]:
  """Name parts of low-precision state: each quantized slot's format, and
  ``sr`` for stochastic rounding."""
  if plan is None:
    return []
  tags = [s.fmt.kind for s in plan.slots if s.fmt is not None]
  return tags + (["sr"] if plan.stochastic_rounding else [])


def varying_axes(arrays):
  """The union of the arrays' device-varying mesh axes inside
  ``jax.shard_map`` (none outside one), as a ``ManualAxisType``."""
  varying = frozenset()
  for a in arrays:
    varying |= jax.typeof(a).manual_axis_type.varying
  return jax.sharding.ManualAxisType(varying=varying)


def _vary(a, axes):
  """``a`` typed as varying over ``axes`` (a no-op on the data)."""
  missing = tuple(sorted(axes - jax.typeof(a).manual_axis_type.varying))
  return lax.pcast(a, missing, to="varying") if missing else a


def launch(operands, w, slots, hparams, *, rule: UpdateRule, cfg: BlockConfig,
           layer, interpret: bool, bt: int, precision,
           plan: lowp.StatePlan | None = None, sr=None):
  """The ``pallas_call`` of the kernel on checked inputs.

  Args:
    operands: ``(x, dy)``, ``(BT, in)`` and ``(BT, out)`` of one dtype (the
      fused GEMM), or ``(g,)``, a stored ``(in, out)`` gradient.
    w, slots: the weight and the rule's slots, ``(in, out)``, or stacks
      ``(L, in, out)`` with ``layer``. ``W`` (if the rule updates it) and the
      slots are aliased to the outputs: they are updated in place.
    hparams: ``rule.pack(...)``.
    rule: the update rule of the epilogue.
    cfg: the tiling.
    layer: ``None``, or the layer of the stacks to update (an int32 scalar
      already clamped into range).
    interpret: run in Pallas interpret mode.
    bt: the number of token rows (0 with a stored gradient).
    precision: the dot's precision.
    plan: low-precision state (:func:`pallas_kernels.lowp.plan_state`), or
      ``None``; with a plan, quantized slots are ``Quantized`` pairs (the
      tiling already fitted to their blocks).
    sr: with ``plan.stochastic_rounding``, ``(seed, step)``.

  Returns:
    ``(w_new, slots_new)`` as :func:`pallas_kernels.fused_wgrad_update`
    returns them.
  """
  # The seed's vector formed outside the jit, which would take a Python
  # seed of 2**31 or more as an int32 and overflow.
  sr_vec = (lowp.seed_step_vector(sr)
            if plan is not None and plan.stochastic_rounding else None)
  w_new, slots_new = _launch_compiled(
      operands, w, slots, hparams, layer, sr_vec, rule=rule, cfg=cfg,
      interpret=bool(interpret), bt=bt, precision=precision, plan=plan)
  # A rule that leaves the weight alone returns it as given (not passed
  # through the jit, which would hand back another array).
  return (w_new if rule.updates_weight else w), slots_new


def _launch(operands, w, slots, hparams, layer, sr_vec, *,
            rule: UpdateRule, cfg: BlockConfig, interpret: bool, bt: int,
            precision, plan):
  """:func:`launch`, traced once per case by :data:`_launch_compiled`."""
  g_stored = len(operands) == 1
  stacked = layer is not None
  n_in, n_out = w.shape[-2:]
  n_tiles = pl.cdiv(n_in, cfg.block_in) * pl.cdiv(n_out, cfg.block_out)
  kernel = functools.partial(
      _fused_kernel, rule=rule, cfg=cfg, bt=bt, n_in=n_in, n_out=n_out,
      precision=precision, stacked=stacked, interpret=bool(interpret),
      g_stored=g_stored, plan=plan)
  if plan is None:
    slot_arrays = tuple(slots)
    out_dtype = rule.output_dtype(w.dtype, [a.dtype for a in slots])
  else:
    slot_arrays = plan.flatten(slots)
    out_dtype = rule.output_dtype(w.dtype, plan.logical_dtypes(slots))
  state = (w, *slot_arrays) if rule.updates_weight else slot_arrays
  # Inside jax.shard_map(check_vma=True) every output varies over the mesh
  # axes any input varies over (a weight updated from a device-varying G
  # comes back device-varying, and the out_specs check reports it).
  mat = varying_axes((*operands, hparams, *state))
  if mat.varying:  # the aliased inputs typed as their outputs are
    operands, hparams, state = jax.tree.map(
        lambda a: _vary(a, mat.varying), (operands, hparams, state))
  outputs = tuple(jax.ShapeDtypeStruct((n_in, n_out), out_dtype,
                                       manual_axis_type=mat)
                  for _ in rule.outputs)
  extra = (layer.reshape(1),) if stacked else ()
  if sr_vec is not None:
    extra += (sr_vec,)
  # After the operands, hparams (and the layer index).
  first_state_arg = len(operands) + 1 + len(extra)
  out = pl.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype,
                                           manual_axis_type=mat)
                      for a in state)
      + outputs,
      grid=(n_tiles,),
      input_output_aliases={first_state_arg + i: i for i in range(len(state))},
      compiler_params=plgpu.CompilerParams(
          num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      # Nonzero static settings (e.g. round_mu=1) are named, so a profile
      # tells the kernels apart (with fp32 slots round_mu changes no code).
      name="_".join(["stored_g_update" if g_stored else "fused_wgrad",
                     rule.name, *(n for n, v in rule.static if v),
                     *_plan_tags(plan)]),
  )(*operands, hparams, *extra, *state)
  if rule.updates_weight:
    w_new, out = out[0], tuple(out[1:])
  else:
    w_new, out = w, tuple(out)
  return w_new, out if plan is None else plan.unflatten(out)


# One compiled kernel per case for eager calls: ``pl.pallas_call`` makes a
# new function at each call, which an eager call would compile again; the
# static arguments are hashed by value. Traced inside another function the
# call is inlined (its jaxpr holds the pallas_call itself). The aliased
# state is not donated here: an eager call leaves its inputs as they were.
_launch_compiled = jax.jit(
    _launch, inline=jax.Inline.JAX_EARLY,
    static_argnames=("rule", "cfg", "interpret", "bt", "precision", "plan"))
