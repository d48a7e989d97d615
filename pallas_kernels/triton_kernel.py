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
           layer, interpret: bool, bt: int, precision):
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

  Returns:
    ``(w_new, slots_new)`` as :func:`pallas_kernels.fused_wgrad_update`
    returns them.
  """
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
                     rule.name, *(n for n, v in rule.static if v)]),
  )(*operands, hparams, *extra, *state)
  if rule.updates_weight:
    return out[0], tuple(out[1:])
  return w, tuple(out)
