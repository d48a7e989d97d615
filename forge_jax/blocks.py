"""`forge_jax.ScannedBlocks`: ``L`` identical blocks (any Flax module) stacked
and scanned, whose backward updates the stacked kernels of the blocks'
``forge_jax.Dense`` and ``forge_jax.DenseGeneral`` layers and their optimizer
slots in place.

A decoder's blocks (attention + MLP, several projections of different
shapes) are scanned with ``nn.scan``: every parameter is stacked
``(L, ...)``. A FORGE ``custom_vjp`` inside the scan body would return each
layer's new kernel as a cotangent, which scan's transpose stacks into a fresh
params-sized buffer: the gradient pool is back
(``forge_jax.ScannedDenseStack`` explains the same for a stack of Dense
layers). Here the whole stack is one ``jax.custom_vjp``:

* forward: a ``lax.scan`` over the blocks, saving each block's input only;
* backward: a reverse ``lax.scan`` whose carry holds the input gradient and,
  for every FORGE layer of the block, its stacked kernel and slots, each
  viewed as the ``(L, n_in, n_out)`` stack of the layer's GEMM matrices (a
  ``forge_jax.DenseGeneral`` kernel ``(L, *in_dims, *features)`` is
  reshaped, a bitcast of a contiguous array, and reshaped back after the
  loop). Iteration ``i`` recomputes block ``i`` from its saved input (as
  ``nn.remat`` does) with ``jax.vjp`` over the block's input, its other
  parameters and one zero *tap* per FORGE layer, added to that layer's
  output: the tap's cotangent is the layer's ``dy``, its input is kept from
  the recomputation, and the kernels are constants of the ``vjp`` (read from
  the carried stacks before any update), so no kernel gradient is formed.
  Then each FORGE layer's optimizer step runs in the fused kernel's epilogue
  in its ``layer=i`` mode, on layer ``i`` of the carried stacks, in place.
  The block's other parameters (norm scales, biases, ``fused=False`` layers'
  kernels) get ordinary gradients, stacked, for optax.

Outside a FORGE step (and with ``fused=False``) the module *is*
``nn.scan(nn.remat(block))`` over ``num_layers`` copies, parameters (and
every other collection: a BatchNorm's ``batch_stats``, sown values, an
attention cache) stacked on axis 0 (``variable_axes={True: 0}``,
``split_rngs={'params': True}``), under the name ``block``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
import flax.errors
import flax.linen as nn
from flax.core import FrozenDict
from collections.abc import Mapping

import pallas_kernels
from pallas_kernels import fused_wgrad
from forge_jax import _context
from forge_jax import _paths
from forge_jax import clip as _clip
from forge_jax import dense as _dense
from forge_jax import _usage
from forge_jax import scan as _scan

_BLOCK = "block"  # the stacked block's name in this module's scope


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
  """Static (non-array) arguments of the fused stack of blocks."""

  path: _context.Path              # the ScannedBlocks module's path
  block: nn.Module                 # the block, unbound
  forge: tuple[_context.Path, ...]  # FORGE layer paths, relative to the block
  records: dict                    # path -> _context.DenseRecord
  spec: Any
  layouts: tuple
  in_place_layer: bool
  wgrad: str
  # Per FORGE layer, the formats of its quantized moments
  # (:func:`quantized_formats`); empty: float moments.
  quantized: tuple[frozenset, ...]
  # A block that reads traced values it is not given (its closure): its two
  # functions, traced with those values as arguments (``_Traced``), as
  # ``{"plain": ..., "tap": ...}``; None: the block is run as it is.
  traced: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class _Traced:
  """One of a block's functions (:func:`_plain_block`, :func:`_tapped_block`)
  traced once, with every traced value the block reads but is not given made
  an argument: called as ``traced(closure, *args)``, ``closure`` the values
  in the order ``ScannedBlocks`` passes them to the stack's ``custom_vjp``.

  A block may close over an array of the step's trace: a conditioning vector
  computed from parameters outside the stack (adaLN), an activation scaled by
  a parameter, given to the block as an attribute or through a Python
  closure. Inside the ``custom_vjp`` such a value would be a constant whose
  gradient nobody forms, and the backward, traced after the forward's trace
  has ended, could not read it at all. As inputs of the ``custom_vjp`` they
  are differentiated with the block's other inputs."""

  jaxpr: Any
  consts: tuple  # the trace's constants, None where an argument replaces one
  closure: tuple[tuple[int, int], ...]  # (constant's index, argument's index)
  out_tree: Any

  def __call__(self, closure, *args):
    consts = list(self.consts)
    for i, j in self.closure:
      consts[i] = closure[j]
    out = jax.core.eval_jaxpr(self.jaxpr, consts, *jax.tree.leaves(args))
    return jax.tree.unflatten(self.out_tree, out)


def _get(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree


def _copy(tree):
  """The nested mappings of ``tree`` as fresh plain dicts (leaves shared)."""
  if isinstance(tree, Mapping):
    return {k: _copy(v) for k, v in tree.items()}
  return tree


def _without(tree, paths):
  """A copy of the nested-dict ``tree`` without the ``kernel`` leaves of
  ``paths`` (the FORGE kernels, which travel separately)."""
  tree = _copy(tree)
  for p in paths:
    del _get(tree, p)["kernel"]
  return tree


def _with(tree, paths, kernels):
  """``tree`` (as :func:`_without` left it) with those kernels put back."""
  tree = _copy(tree)
  for p, k in zip(paths, kernels):
    _get(tree, p)["kernel"] = k
  return tree


def _block_cls(block):
  """The class ``block`` makes (a class, or ``functools.partial`` of one),
  or ``None``."""
  while isinstance(block, functools.partial):
    block = block.func
  return block if isinstance(block, type) else None


def _check_one_argument(where: str, cls) -> None:
  """Refuses a block class whose ``__call__`` needs more than the carry (a
  block written for ``nn.scan(..., in_axes=nn.broadcast)`` taking a mask,
  or ``(carry, x)``), naming the fix."""
  if cls is None:
    return
  try:
    params = list(inspect.signature(cls.__call__).parameters.values())[1:]
  except (TypeError, ValueError):
    return
  needed = [p.name for p in params
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  if len(needed) > 1:
    raise TypeError(
        f"{where}: {cls.__name__}.__call__ takes {needed}; ScannedBlocks "
        "calls each block with the carry alone (h -> h). Make the other "
        f"values attributes of the block (a field {needed[1]!r}, given as "
        f"functools.partial({cls.__name__}, {needed[1]}=...): an array the "
        "block reads, differentiated as such), or give them defaults.")


def _lifted(cls) -> tuple[str, str] | None:
  """``(its name, the class it lifts)`` for a block class that is a flax
  transform of another (``nn.remat(Block)``: ``CheckpointBlock``)."""
  if (cls is None or cls.__module__ != "flax.linen.transforms"
      or len(cls.__mro__) < 2 or not issubclass(cls.__mro__[1], nn.Module)):
    return None
  return cls.__name__, cls.__mro__[1].__name__


def _apply(static, params, h, tap):
  tap.prefix = (*static.path, _BLOCK)
  with _context.block_tap(tap):
    return static.block.apply({"params": params}, h)


def _plain_block(static, h, others_i, w_i):
  """One block as flax runs it: its FORGE kernels ``w_i`` put back into its
  other parameters ``others_i``."""
  return _apply(static, _with(others_i, static.forge, w_i), h,
                _context.BlockTap("plain"))


def _tapped_block(static, h, others_i, taps, w_i):
  """One block with a tap added to each FORGE layer's output: ``(output,
  {path: the layer's input as its GEMM's (*lead, n_in)})``."""
  tap = _context.BlockTap("tap", forge=frozenset(static.forge), taps=taps)
  y = _apply(static, _with(others_i, static.forge, w_i), h, tap)
  return y, {p: tap.inputs[p] for p in static.forge}


_BLOCK_FNS = {"plain": _plain_block, "tap": _tapped_block}


def _run(static, which, closure, *args):
  """The block's ``which`` function (``"plain"``, ``"tap"``): as it is, or
  (a block with a closure) its trace, ``closure`` its traced values."""
  if static.traced is None:
    return _BLOCK_FNS[which](static, *args)
  return static.traced[which](closure, *args)


def _forward(static, x, kernels, others, closure, save):
  def body(h, per_layer):
    kernels_i, others_i = per_layer
    y = _run(static, "plain", closure, h, others_i, kernels_i)
    return y, (h if save else None)
  if save:  # the saved inputs' stack made when the forward runs
    return _scan.scan_saving(body, x, (kernels, others), kernels)
  return lax.scan(body, x, (kernels, others))


def quantized_formats(spec, layout, kernel_shape) -> frozenset:
  """The low-precision formats of a FORGE layer's quantized moments (a
  ``Quantized`` pair of codes and scales), by ``forge_jax.DenseGeneral``'s
  rule (:func:`forge_jax.dense.quantized_formats`): ``layout`` (the
  kernel's ``_state.KernelLayout``) as the state stores them, else the
  formats' own rule on the stacked kernel ``(L, *kernel_shape)``. A kernel
  of fewer elements than a format's ``min_size`` keeps float moments, which
  have no blocks to view or refuse."""
  if spec is None or spec.low_precision is None:
    return frozenset()
  return frozenset(_dense.quantized_formats(spec.low_precision, layout,
                                            tuple(kernel_shape)))


def gemm_views(kernel_shape, rec, formats) -> dict:
  """``{shape of a stacked leaf: its view}``: the stacked kernel
  ``(L, *kernel_shape)`` (and each slot of its shape) as the
  ``(L, n_in, n_out)`` stack of the layer's GEMM matrices (``rec.gemm``);
  the scales of the quantized moments (of ``formats``,
  :func:`quantized_formats`; one per ``block`` consecutive elements of the
  kernel's last axis) as the matrices' (one per ``block`` elements of a
  row). :func:`check_scale_view` has checked that those blocks are the
  rows'."""
  num = kernel_shape[0]
  matrix = (num, *rec.gemm)
  views = {tuple(kernel_shape): matrix}
  for fmt in formats:
    views.setdefault(tuple(fmt.scale_shape(tuple(kernel_shape))),
                     tuple(fmt.scale_shape(matrix)))
  return views


def check_scale_view(rec, formats, name: str) -> None:
  """Refuses quantized moments (of ``formats``, :func:`quantized_formats`)
  of a ``forge_jax.DenseGeneral`` kernel with several feature axes, the
  last not a multiple of the block: its blocks along that axis are not
  blocks of the GEMM matrix's rows. Float moments (a kernel too small to be
  quantized) have no blocks: nothing to refuse."""
  if rec.gemm is None:
    return
  last = rec.kernel_shape[-1]
  fmt = _dense.misfit_block(rec.kernel_shape, rec.gemm[1], formats)
  if fmt is not None:
    raise ValueError(
        f"{rec.kind} at {name!r} (in a forge_jax.ScannedBlocks block): its "
        f"kernel {tuple(rec.kernel_shape)} has several feature axes, the "
        f"last of {last} elements, not a multiple of {fmt.block}: the "
        f"quantized moments' blocks ({fmt.block} consecutive elements of "
        "the kernel's last axis) are not blocks of the fused kernel's "
        f"{tuple(rec.gemm)} matrix rows. Give this layer fused=False (the "
        "standard path steps it with the same quantized state), or "
        f"features whose last axis is a multiple of {fmt.block}.")


def _as_gemm(a, views):
  """``a``, a stacked kernel or one of its slot leaves, in its GEMM view
  (:func:`gemm_views`); any other array as it is. A reshape of a contiguous
  array: a bitcast, no copy (a Dense kernel is such a stack already)."""
  view = views.get(tuple(a.shape))
  return a if view is None else a.reshape(view)


def _as_param(stacks, like):
  """:func:`_as_gemm` undone: each array reshaped to the one of ``like``."""
  return tuple(a.reshape(b.shape) for a, b in zip(stacks, like))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Differentiated:
  """Which of the closure's values are differentiated: a float value the
  step's gradient depends on. Static (carried by the residuals' tree
  structure), so that the backward forms those values' gradients alone: a
  value that is not differentiated (a mask computed from the batch) costs
  the backward nothing beyond reading it."""

  flags: tuple[bool, ...]


def _primal_values(tree):
  """The values of ``symbolic_zeros``' ``CustomVJPPrimal`` leaves."""
  return jax.tree.map(lambda p: p.value, tree, is_leaf=lambda p: isinstance(
      p, jax.custom_derivatives.CustomVJPPrimal))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_blocks(static: _Static, x, kernels, others, inputs, closure):
  return _forward(static, x, kernels, others, closure, save=False)[0]


def _fused_blocks_fwd(static, x, kernels, others, inputs, closure):
  # (symbolic_zeros: every leaf comes with whether it is differentiated,
  # which only the closure's values use.)
  diff = _Differentiated(tuple(
      c.perturbed and jnp.issubdtype(c.value.dtype, jnp.inexact)
      for c in closure))
  x, kernels, others, inputs, closure = _primal_values(
      (x, kernels, others, inputs, closure))
  y, hs = _forward(static, x, kernels, others, closure, save=True)
  return y, (hs, kernels, others, inputs, closure, diff)


def _fused_blocks_bwd(static, res, dy):
  """Reverse loop over the blocks: each block recomputed and differentiated
  with its FORGE kernels held constant, then each FORGE kernel's layer ``i``
  stepped in place; the carried stacks are returned in place of the
  kernels' and slots' cotangents.

  The carry holds every kernel and slot stack as ``(L, n_in, n_out)``
  (``_as_gemm``): layer ``i`` is read back in the kernel's own shape for the
  recomputation and stepped as the GEMM's matrix. The gradients of the
  block's closure values (``_Traced``), which every block reads, are summed
  over the blocks in the carry (in fp32 at least), for the values that are
  differentiated."""
  hs, kernels, others, inputs, closure, diff = res
  diff = diff.flags
  if isinstance(dy, jax.custom_derivatives.SymbolicZero):  # output unused
    dy = jnp.zeros(dy.shape, dy.dtype)
  num_layers = hs.shape[0]
  records = tuple(static.records[p] for p in static.forge)
  # The norm pass of a clipped step (forge_jax/clip.py): each FORGE layer's
  # squared gradient norm, summed over the blocks in the carry; nothing is
  # updated, and the stacks are read, not carried (see ScannedDenseStack).
  norm_pass = _clip.is_norm_pass(static.wgrad)

  def body(carry, per_layer):
    dh, k_stacks, slot_stacks, sqnorms, d_closure = carry
    i, h_i, others_i = per_layer
    w_i = tuple(
        lax.dynamic_index_in_dim(k, i, keepdims=False).reshape(
            rec.kernel_shape)
        for k, rec in zip(kernels if norm_pass else k_stacks, records))
    taps = {p: jnp.zeros(static.records[p].out.shape,
                         static.records[p].out.dtype) for p in static.forge}

    def block(h, others_i, taps, closure_d):
      values = iter(closure_d)
      c = tuple(next(values) if d else v for v, d in zip(closure, diff))
      return _run(static, "tap", c, h, others_i, taps, w_i)

    y, block_vjp, layer_inputs = jax.vjp(
        block, h_i, others_i, taps,
        tuple(c for c, d in zip(closure, diff) if d), has_aux=True)
    dh_in, d_others, dys, dc = block_vjp(dh.astype(y.dtype))
    d_closure = tuple(s + g.astype(s.dtype) for s, g in zip(d_closure, dc))
    if norm_pass:
      sqnorms = tuple(
          s + _clip.layer_sqnorm(layer_inputs[p], dys[p], static.wgrad,
                                 static.records[p].precision)
          for s, p in zip(sqnorms, static.forge))
      return (dh_in.astype(dh.dtype), k_stacks, slot_stacks, sqnorms,
              d_closure), d_others
    # Every read of the pre-update kernels (the recomputation, the input
    # gradients) feeds these outputs; the barrier orders them before the
    # fused kernels overwrite layer i of the stacks (as in forge_jax.Dense).
    (dh_in, d_others, d_closure, dys, layer_inputs,
     k_stacks) = lax.optimization_barrier(
         (dh_in, d_others, d_closure, dys, layer_inputs, k_stacks))
    new_k, new_s = [], []
    for j, p in enumerate(static.forge):
      rec = static.records[p]
      w, s = _scan.update_layer(
          static.spec, static.layouts[j], static.in_place_layer, i,
          layer_inputs[p], dys[p], k_stacks[j], slot_stacks[j], inputs[j],
          rec.config, static.wgrad, rec.precision)
      new_k.append(w)
      new_s.append(s)
    return (dh_in.astype(dh.dtype), tuple(new_k), tuple(new_s),
            sqnorms, d_closure), d_others

  views = tuple(gemm_views(k.shape, rec, q)
                for k, rec, q in zip(kernels, records, static.quantized))
  with _paths.refusing_derivatives(
      f"forge_jax.ScannedBlocks at {_context.layer_name(static.path)!r}"):
    (dx, new_kernels, new_slots, sqnorms, d_closure), d_others = lax.scan(
        body, (dy,
               () if norm_pass else tuple(
                   _as_gemm(k, v) for k, v in zip(kernels, views)),
               () if norm_pass else tuple(
                   tuple(_as_gemm(s, v) for s in t.slots)
                   for t, v in zip(inputs, views)),
               tuple(jnp.zeros((), jnp.float32) for _ in static.forge),
               tuple(jnp.zeros(c.shape, jnp.promote_types(c.dtype,
                                                          jnp.float32))
                     for c, d in zip(closure, diff) if d)),
        (jnp.arange(num_layers), hs, others), reverse=True)
  d_others = jax.tree.map(lambda g, o: g.astype(o.dtype), d_others, others)
  sums = iter(d_closure)  # None: a zero cotangent (not differentiated)
  d_closure = tuple(next(sums).astype(c.dtype) if d else None
                    for c, d in zip(closure, diff))
  if norm_pass:
    return (dx.astype(hs.dtype), tuple(jnp.zeros_like(k) for k in kernels),
            d_others, tuple(_clip.norm_pass_inputs(t, s)
                            for t, s in zip(inputs, sqnorms)), d_closure)
  new_kernels = _as_param(new_kernels, kernels)
  new_slots = tuple(_as_param(s, t.slots) for s, t in zip(new_slots, inputs))
  ctx = _context.current()
  if ctx is not None:
    ctx.bwd_traced.update(_full(static.path, p) for p in static.forge)
  return dx.astype(hs.dtype), new_kernels, d_others, tuple(
      _context.LayerInputs(
          slots=s,
          hparams=jax.tree.map(jnp.zeros_like, t.hparams),
          touched=jnp.ones_like(t.touched),
          shared=jax.tree.map(_paths.zero_cotangent, t.shared))
      for s, t in zip(new_slots, inputs)), d_closure


_fused_blocks.defvjp(_fused_blocks_fwd, _fused_blocks_bwd,
                     symbolic_zeros=True)
_usage.register_fused_backward(_fused_blocks_bwd)


def _readers(jaxpr, var) -> list[str]:
  """Who reads ``var`` at the top level of ``jaxpr``: ``"fused"`` for a
  FORGE layer's own fused op, else the primitive's name (a read that passes
  no cotangent back, ``stop_gradient``, is left out)."""
  out = []
  for eqn in jaxpr.eqns:
    n = sum(1 for v in eqn.invars
            if not isinstance(v, jex_core.Literal) and v is var)
    name = "fused" if _usage.is_fused_op(eqn) else eqn.primitive.name
    if name not in _usage.NO_COTANGENT:
      out += [name] * n
  if any(v is var for v in jaxpr.outvars):
    out.append("the block's output")
  return out


def _foreign_module(block, params, error) -> str | None:
  """The module a block calls that is not its own (defined outside it: a
  module of the model passed to the block as an attribute), in words, when
  that is why running the block with its own ``params`` alone raised the
  flax ``error`` (a parameter not found); else None.

  A module bound to another module (made in the parent's ``setup`` or
  ``@nn.compact`` method) and passed as an attribute is looked up by flax
  among the block's own parameters, where it is not."""
  if not isinstance(error, flax.errors.ScopeParamNotFoundError):
    return None
  scope = re.search(r'in scope "([^"]*)"', str(error))
  parts = [p for p in scope.group(1).split("/") if p] if scope else []
  if parts and parts[0] in params:  # a module of the block's own tree
    return None
  held = [
      f"its attribute {f.name!r} (the {type(m).__name__} at "
      f"{_context.layer_name(tuple(m.path))!r})"
      for f in dataclasses.fields(block) if f.name not in ("parent", "name")
      for m in jax.tree.leaves(getattr(block, f.name, None),
                               is_leaf=lambda v: isinstance(v, nn.Module))
      if isinstance(m, nn.Module) and m.scope is not None]
  if held:
    return ", ".join(held)
  if parts:  # a module held some other way: the scope flax searched
    return f"the module flax looked for at {scope.group(1)!r}"
  return None


def _full(path, rel):
  return (*path, _BLOCK, *rel)


def _scan_body(module, carry, _):
  return module.block(name=_BLOCK)(carry), None


class ScannedBlocks(nn.Module):
  """``num_layers`` copies of ``block``, stacked and scanned; FORGE updates the
  stacked kernels of the block's ``forge_jax.Dense`` and
  ``forge_jax.DenseGeneral`` layers in its backward.

  ``block`` makes one block: a Flax module class or a callable returning an
  unbound module (e.g. ``functools.partial(Block, cfg)``; not a module
  instance), called as ``block(name=...)`` and ``block(parent=None)``. The
  module's ``__call__(h)`` takes the carry, one array, and returns the next
  one, of the same shape and dtype; it may hold any parameters and any mix
  of ``forge_jax.Dense`` / ``forge_jax.DenseGeneral`` (fused), the same with
  ``fused=False``, and other layers. In a FORGE step each block runs with
  its ``params`` alone: a block that draws randomness (dropout), uses
  other collections (``batch_stats``) or calls a module that is not its own
  (a module of the model passed as an attribute) is refused there;
  ``fused=False`` runs it as flax's scan, every layer of the stack on the
  standard optax path.
  The block may read arrays it is not given (an adaLN-style conditioning
  computed from parameters outside the stack, passed as an attribute or
  through a Python closure): the stack takes them as inputs of its
  backward, which sums the gradients of those differentiated over the
  blocks.

  The parameters are ``{'block': <the block's tree, every leaf stacked
  (L, ...)>}`` in this module's scope: the tree (and the initial values) of
  ``nn.scan(nn.remat(body), variable_axes={'params': 0, 'batch_stats': 0},
  split_rngs={'params': True}, length=L)`` of a body that calls
  ``block(name='block')``; a block's other collections (a BatchNorm's
  ``batch_stats``, values it sows, an attention cache) are stacked the same
  way. Outside a FORGE step (or with
  ``fused=False``) the module *is* that scan (with every rng split per
  layer, so that dropout differs from block to block).

  Inside a step built by :func:`forge_jax.make_step` its backward is one
  reverse loop over the blocks. Block ``i`` is recomputed from its saved input
  (so the forward saves only the ``L`` block inputs, as under ``nn.remat``),
  differentiated with its FORGE kernels held constant, and each FORGE layer's
  stacked kernel and optimizer slots are then stepped at layer ``i`` in place
  (the fused kernel's epilogue; ``make_step(..., wgrad="xla")``: XLA's GEMM
  forms layer ``i``'s ``G``, then the same epilogue, ``stored_g_update``,
  updates the layer in place). No kernel gradient of any layer is
  formed as a whole, and no gradient pool. A ``forge_jax.DenseGeneral``
  (``batch_dims=()``, trailing contracted axes: one GEMM) is stepped as its
  ``(n_in, n_out)`` matrix: its stacked kernel ``(L, *in_dims, *features)``
  and slots are viewed as ``(L, n_in, n_out)`` (reshapes, no copy) and come
  back in their own shape (a quantized moment's scales, one per 64
  elements of the kernel's last axis, viewed as the matrix's: a kernel
  with quantized moments and several feature axes needs the last to be a
  multiple of 64; one too small to be quantized keeps float moments).
  Regime-1 families only (SGD ... Lion), low-precision state included, as
  for ``forge_jax.ScannedDenseStack``, whose docstring says why.
  Each FORGE kernel's hyperparameters and weight-decay mask entry are those of
  its one stacked leaf. A FORGE layer the block calls twice, whose
  kernel the block also reads elsewhere (a tied projection), or that runs
  under a transform inside the block (``nn.remat``, ``nn.jit``, ``nn.cond``:
  the block is recomputed anyway) cannot take its update from its own ``x``
  and ``dy``: ``make_step``'s ``shared`` policy applies to it (``"error"``
  refuses it, ``"standard"`` moves it to optax's path and warns).

  ``stack_update``: as for ``forge_jax.ScannedDenseStack`` (``"layer"``: the
  fused kernel reads and writes layer ``i`` inside the carried stacks;
  ``"slice"``: copied out, stepped, written back; ``"auto"``: ``"layer"`` on
  a GPU, ``"slice"`` in Pallas interpret mode).

  ``metadata_params``: as ``nn.scan``'s, passed to it: for a block whose
  parameters are boxed (``nn.with_logical_partitioning``), e.g.
  ``{nn.PARTITION_NAME: 'layers'}`` names the stacked axis 0 of every box
  (without it flax cannot stack boxed parameters). ``make_step`` trains the
  boxed tree and returns it boxed, names kept.
  """

  block: Callable[..., nn.Module]
  num_layers: int
  fused: bool = True
  stack_update: str = "auto"
  metadata_params: Mapping[Any, Any] = FrozenDict()

  def _scanned(self, x):
    # Every rng split per layer: the parameters as split_rngs={'params':
    # True} draws them, and a block's dropout (outside a FORGE step) differs
    # from block to block.
    try:
      y, _ = nn.scan(nn.remat(_scan_body),
                     variable_axes={True: 0},  # every collection
                     split_rngs={True: True}, length=self.num_layers,
                     metadata_params=dict(self.metadata_params))(self, x, None)
    except TypeError as e:  # the scan's own words, without the module's name
      said = " ".join(str(e).split())
      if not any(f"carry input and carry output must have {what}" in said
                 for what in ("equal types", "the same pytree structure")):
        raise
      raise ValueError(
          f"{self._where()}: a scan's carry changes type in this stack. A "
          "scanned block must return one array of its input's shape, dtype "
          f"and sharding ({jax.typeof(x).str_short()}), the next block's "
          "input (e.g. return out.astype(h.dtype)); a scan inside the block "
          f"must keep its own carry's type too. (jax: {said})") from e
    return y

  def _record(self, block, params, x) -> tuple[dict, bool]:
    """Each FORGE layer of one block, as it reports itself
    (``DenseRecord``), with ``unfusable`` set for a fused one whose kernel
    the block reads other than through that layer, once (a tied kernel, a
    read through ``.variables``, the layer under ``nn.remat`` / ``nn.jit``
    / ``nn.cond`` inside the block): its update could not be formed from
    the layer's own ``x`` and ``dy``; and whether the block reads traced
    values it is not given (its closure, see ``_Traced``)."""
    tap = _context.BlockTap("record", prefix=(*self.path, _BLOCK))
    # The random streams apply was given (other than 'params'), passed to
    # the block as keys of its own: a block that draws from them is refused.
    names = sorted(n for n in (self.scope.rngs or {}) if n != "params")

    # The collections the caller's apply may write (sow's 'intermediates',
    # 'batch_stats', an attention cache): those the block writes are
    # refused below, as this path would not keep them.
    mutable = self.scope.mutable
    written = []

    def one(p, h, keys):
      with _context.block_tap(tap):
        out = block.apply({"params": p}, h,
                          rngs=dict(zip(names, keys)) or None,
                          mutable=mutable)
      if mutable is not False:
        out, state = out
        written.extend(c for c, v in state.items()
                       if c != "params" and jax.tree.leaves(v))
      return out

    layer = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    try:
      closed, out = jax.make_jaxpr(one, return_shape=True)(
          layer, jax.ShapeDtypeStruct(x.shape, x.dtype), [key] * len(names))
    except flax.errors.FlaxError as e:
      foreign = _foreign_module(block, layer, e)
      if foreign is not None:
        raise ValueError(
            f"{self._where()}: the block calls a module that is not its own, "
            f"{foreign}, defined outside the block ({type(e).__name__}: {e})."
            " In a FORGE step ScannedBlocks runs each block, layer by layer, "
            "with its own parameters only, so it cannot run a module defined "
            "outside it. Pass the block arrays instead (arrays the block "
            "reads are supported, and their gradients reach the parameters "
            "they came from): compute that module's output outside the stack "
            "and pass the array into the block, or pass the module's "
            "parameters (its variables['params']) and apply them inside the "
            "block as arrays. Or give this module fused=False: it then runs "
            "as flax's nn.scan, every layer of the stack on the standard "
            "optax path.") from e
      raise ValueError(
          f"{self._where()}: one block, run with its 'params' alone, failed "
          f"({type(e).__name__}: {e}). In a FORGE step ScannedBlocks runs "
          "each block with its parameters only: no randomness (dropout), no "
          "other collections (batch_stats). Give this module fused=False: "
          "it then runs as flax's nn.scan, every layer of the stack on the "
          "standard optax path, with the random streams given to apply and "
          "the batch_stats stacked per layer as the parameters are (apply "
          "the model with mutable=['batch_stats'] and build the step with "
          "make_step(..., has_aux=True) to keep their new values).") from e
    if written:
      raise ValueError(
          f"{self._where()}: the block writes the collections "
          f"{sorted(set(written))} (self.sow, a BatchNorm's batch_stats, an "
          "attention cache), which the apply around it asks for. In a FORGE "
          "step ScannedBlocks runs each block with its parameters only and "
          "keeps no other collection: their values would be lost. Give this "
          "module fused=False: it then runs as flax's nn.scan, every layer "
          "of the stack on the standard optax path, with the batch_stats "
          "stacked per layer as the parameters are, and every other "
          "collection too (build the step with make_step(..., has_aux=True) "
          "to keep their new values); or apply the model without mutable= "
          "for them.")
    keys = {id(v) for v in closed.jaxpr.invars[len(closed.jaxpr.invars)
                                               - len(names):]}
    if names and any(id(v) in keys for eqn in closed.jaxpr.eqns
                     for v in eqn.invars):
      raise ValueError(
          f"{self._where()}: the block draws from the random streams "
          f"{names} given to apply (dropout, say). In a FORGE step "
          "ScannedBlocks runs each block with its parameters only: no "
          "randomness, so it would silently run without it. Give this "
          "module fused=False (flax's nn.scan, standard optax path), or "
          "apply it without those streams.")
    if not hasattr(out, "shape") or (out.shape, out.dtype) != (x.shape,
                                                              x.dtype):
      got = (f"{out.dtype}{list(out.shape)}" if hasattr(out, "shape")
             else type(out).__name__)
      raise ValueError(
          f"{self._where()}: the block maps its input {x.dtype}{list(x.shape)}"
          f" to {got}; a scanned block must return a carry of its input's "
          "shape and dtype")
    flat, _ = jax.tree_util.tree_flatten_with_path(layer)
    index = {tuple(k.key for k in kp): i for i, (kp, _) in enumerate(flat)}
    for rel, rec in tap.records.items():
      if not (self.fused and rec.fused) or rec.calls != 1:
        continue
      var = closed.jaxpr.invars[index[(*rel, "kernel")]]
      readers = _readers(closed.jaxpr, var)
      others = [r for r in readers if r != "fused"]
      if "fused" not in readers:
        lifted = _lifted(_block_cls(self.block))
        rec.unfusable = (
            f"is read through {', '.join(dict.fromkeys(others))} inside the "
            + ("block: the block class given is flax's transform "
               f"{lifted[0]} of {lifted[1]} (nn.remat({lifted[1]}), say); "
               f"pass {lifted[1]} itself: ScannedBlocks already recomputes "
               "each block in its backward" if lifted else
               "block (the layer under a transform such as nn.remat, nn.jit "
               "or nn.cond: ScannedBlocks already recomputes each block in "
               "its backward, so remove that transform around the layer)"))
      elif others:
        rec.unfusable = (f"is also read inside the block (by: "
                         f"{', '.join(dict.fromkeys(others))})")
    return tap.records, any(isinstance(c, jax.core.Tracer)
                            for c in closed.consts)

  def _traced(self, static, params, x) -> tuple[dict, tuple]:
    """The block's two functions (``_plain_block``, ``_tapped_block``)
    traced with every traced value the block reads but is not given made an
    argument (``_Traced``), and those values: ``({"plain": ..., "tap":
    ...}, closure)``."""
    layer = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
    h = jax.ShapeDtypeStruct(x.shape, x.dtype)
    others = _without(layer, static.forge)
    w = tuple(_get(layer, (*p, "kernel")) for p in static.forge)
    taps = {p: static.records[p].out for p in static.forge}
    closure, index, traced = [], {}, {}
    for which, args in (("plain", (h, others, w)),
                        ("tap", (h, others, taps, w))):
      closed, out = jax.make_jaxpr(
          functools.partial(_BLOCK_FNS[which], static),
          return_shape=True)(*args)
      consts, where = list(closed.consts), []
      for i, c in enumerate(consts):
        if isinstance(c, jax.core.Tracer):
          if id(c) not in index:
            index[id(c)] = len(closure)
            closure.append(c)
          where.append((i, index[id(c)]))
          consts[i] = None
      traced[which] = _Traced(closed.jaxpr, tuple(consts), tuple(where),
                              jax.tree.structure(out))
    return traced, tuple(closure)

  def _where(self):
    return f"forge_jax.ScannedBlocks at {_context.layer_name(tuple(self.path))!r}"

  @nn.compact
  def __call__(self, x):
    where = self._where()
    _scan.check_stack_settings(where, self.num_layers, self.stack_update)
    if isinstance(self.block, nn.Module):
      raise TypeError(
          f"{where}: block must be a Flax module class or a callable that "
          f"makes one (e.g. functools.partial(Block, cfg)), not a module "
          f"instance ({type(self.block).__name__}(...)): ScannedBlocks makes "
          "its own copies")
    if not callable(self.block):
      raise TypeError(f"{where}: block must be a Flax module class or a "
                      f"callable that makes one, got {self.block!r}")
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise TypeError(
          f"{where}: the carry must be one array (got {type(x).__name__}); "
          "ScannedBlocks scans a block h -> h of one shape and dtype")
    _check_one_argument(where, _block_cls(self.block))
    outer = _context.current_tap()
    if outer is not None:
      raise ValueError(
          "forge_jax.ScannedBlocks at "
          f"{_context.layer_name((*outer.prefix, *self.path))!r}: a "
          "ScannedBlocks cannot be nested inside another ScannedBlocks' block "
          "(one scan over the blocks steps their FORGE layers). Call the "
          "inner block several times in the outer block instead (a Python "
          "loop, each call a module of its own name): the outer stack then "
          "fuses every copy's FORGE layers. Or scan the inner blocks with "
          "flax's nn.scan over blocks of flax's own layers (nn.Dense), whose "
          "kernels take the standard optax path.")
    ctx = _context.current()
    if ctx is None or self.is_initializing():
      return self._scanned(x)
    path = tuple(self.path)
    plain = _context.BlockTap("plain")
    if not self.fused:  # flax's scan, every layer on the standard path
      if ctx.mode == "discover":
        ctx.unfused.add(path)
      with _context.block_tap(plain):
        return self._scanned(x)
    params = self.variables.get("params", {}).get(_BLOCK)
    if params is None:
      raise ValueError(f"{where}: no '{_BLOCK}' parameters in this scope "
                       "(were the variables made by this module's init?)")
    block = self.block(parent=None)
    records, closes_over = self._record(block, params, x)
    if ctx.mode == "discover":
      for rel, rec in records.items():
        full = _full(path, rel)
        if not rec.fused:
          ctx.unfused.add(full)
          continue
        for _ in range(rec.calls):
          info = _context.register_layer(
              ctx, full, (self.num_layers, *rec.kernel_shape),
              rec.param_dtype, f"{rec.kind} (in a ScannedBlocks block)")
        if rec.unfusable:
          if ctx.shared == "error":
            raise ValueError(
                f"the kernel of {rec.kind} at "
                f"{_context.layer_name(full)!r} (in a forge_jax.ScannedBlocks "
                f"block) {rec.unfusable}. FORGE updates a kernel in place "
                "during its backward from its layer's own input and output "
                "gradient, so the layer must read it once, directly, in the "
                "block (paper Remark 2). " + _context.SHARED_FIX)
          info.unfusable = rec.unfusable
      with _context.block_tap(plain):
        return self._scanned(x)

    forge = tuple(sorted(
        rel for rel, rec in records.items()
        if rec.fused and rec.calls == 1 and not rec.unfusable
        and not ctx.is_standard(_full(path, rel))))
    if not forge:
      with _context.block_tap(plain):
        return self._scanned(x)
    spec = ctx.spec
    _scan.require_regime_1(where, spec, "module")
    missing = [_full(path, p) for p in forge if _full(path, p) not in ctx.inputs]
    if missing:
      raise RuntimeError(
          f"{where}: the layers {[_context.layer_name(m) for m in missing]} "
          "were not seen when the step discovered its FORGE layers: the loss "
          "function must call the same layers on every trace")
    layouts = tuple(ctx.layouts.get(_full(path, p)) for p in forge)
    quantized = tuple(
        quantized_formats(spec, layout,
                          (self.num_layers, *records[p].kernel_shape))
        for p, layout in zip(forge, layouts))
    for p, q in zip(forge, quantized):
      fused_wgrad.check_block_config(
          records[p].config, f"{records[p].kind} at "
          f"{_context.layer_name(_full(path, p))!r}")
      check_scale_view(records[p], q, _context.layer_name(_full(path, p)))
    static = _Static(
        path=path, block=block, forge=forge, records=records, spec=spec,
        layouts=layouts,
        in_place_layer=_scan.updates_in_place(self.stack_update),
        wgrad=ctx.wgrad, quantized=quantized)
    closure = ()
    if closes_over:
      traced, closure = self._traced(static, params, x)
      static = dataclasses.replace(static, traced=traced)
    # A kernel of another layer among the stack's operands is a value its
    # blocks close over: the single-use check names this stack as its reader.
    _usage.describe_reader(
        [_full(path, p) for p in forge],
        f"{where}, whose blocks read it as a value they close over")
    kernels = tuple(_get(params, (*p, "kernel")) for p in forge)
    return _fused_blocks(static, x, kernels, _without(params, forge),
                         tuple(ctx.inputs[_full(path, p)] for p in forge),
                         closure)
