"""Trace-time check that each FORGE kernel has one consumer (paper Remark 2).

A kernel updated in place by its layer's backward must not be read by any
other op of the step (a tied head, a reuse through ``module.variables``):
AD would add that op's gradient to the returned *new kernel* -- a silent
corruption. We trace the loss once and follow each kernel's jaxpr variable,
through call-like primitives, to every op that reads it.

Each FORGE layer module registers its fused backward at import
(:func:`register_fused_backward`); the check imports no layer.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
from jax.extend import core as jex_core

from forge_jax import _context

# Primitives whose sub-jaxpr receives the operands one-to-one.
_CALL_PARAMS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
}


# The fused backward functions of the FORGE layers' custom_vjp ops, registered
# by each layer module at import (the checker imports no layer). A list, not a
# set: the backward of a user's custom_vjp, tested against it, may be
# unhashable.
_FUSED_BACKWARDS: list[Any] = []


def register_fused_backward(bwd):
  """Registers a FORGE layer's fused backward with the single-use check.

  Args:
    bwd: the backward function given to the layer's ``jax.custom_vjp``
      ``defvjp``; a ``custom_vjp_call`` whose backward is ``bwd`` counts as
      that layer's own fused op.

  Returns:
    ``bwd``, unchanged (so it can be used as a decorator).
  """
  if bwd not in _FUSED_BACKWARDS:
    _FUSED_BACKWARDS.append(bwd)
  return bwd


def is_fused_op(eqn) -> bool:
  """Whether a jaxpr equation is a FORGE layer's own fused op.

  Args:
    eqn: a jaxpr equation.

  Returns:
    ``True`` for a ``custom_vjp_call`` whose backward was registered with
    :func:`register_fused_backward` (``forge_jax.Dense``'s op, the whole-stack
    op of ``ScannedDenseStack`` or ``ScannedBlocks``).
  """
  bwd = getattr(eqn.params.get("bwd"), "f", None)
  return eqn.primitive.name == "custom_vjp_call" and bwd in _FUSED_BACKWARDS


def _open(jaxpr):
  return getattr(jaxpr, "jaxpr", jaxpr)


# While check_single_use traces the step: {layer path: how the fused op
# that steps that layer reads another layer's kernel among its operands}.
_READERS = threading.local()


def describe_reader(paths, text: str) -> None:
  """Names a fused op as the reader of another FORGE layer's kernel.

  Called by a FORGE op while the step is traced (a no-op outside
  :func:`check_single_use`'s trace): when the op that steps the layers at
  ``paths`` reads a kernel that is not one of theirs, the check names that
  reader ``text`` (e.g. ``"forge_jax.ScannedBlocks at 'layers', whose
  blocks read it as a value they close over"``) where it would otherwise
  name the op by one of its layers.
  """
  readers = getattr(_READERS, "names", None)
  if readers is not None:
    for p in paths:
      readers[tuple(p)] = text


# The reason check_single_use gives for a kernel read only through
# stop_gradient: a frozen layer, which make_step moves to the standard path
# without a warning (nothing is shared).
FROZEN = "kernel read by its layer through stop_gradient (frozen)"


class KernelNotReadError(ValueError):
  """A FORGE layer whose fused op does not read its kernel, refused under
  either ``shared`` policy (forge_jax._convert adds a converted layer's
  fix to it)."""


# Reads that pass no cotangent back to the kernel: not a second consumer.
NO_COTANGENT = {"stop_gradient"}
# Control flow whose branches / body the trace does not follow: a layer inside
# runs conditionally or repeatedly, so its fused backward cannot be relied on.
_CONTROL_FLOW = {"cond", "while", "scan"}


def _loss_eqns(jaxpr) -> set[int] | None:
  """The top-level equations the first output (the loss) depends on, by
  ``id``; ``None`` when there is no other output. With ``has_aux``, reads
  that only feed the aux outputs (a logged weight norm) are not consumers of
  the kernel's gradient. (Inside a call the whole call counts: a coarser,
  safe answer.)"""
  if len(jaxpr.outvars) <= 1:
    return None
  live = {v for v in jaxpr.outvars[:1] if not isinstance(v, jex_core.Literal)}
  eqns = set()
  for eqn in reversed(jaxpr.eqns):
    if any(v in live for v in eqn.outvars):
      eqns.add(id(eqn))
      live.update(v for v in eqn.invars
                  if not isinstance(v, jex_core.Literal))
  return eqns


def _consumers(jaxpr, var, out: list[str], only=None, path=None,
               owners=None, readers=None) -> None:
  """Appends to ``out`` every op of ``jaxpr`` that reads ``var``, the
  kernel of the layer at ``path``, following it into calls: ``"fused"``
  for that layer's own fused op, else the reader's name.

  A fused op's own layers are those whose state it takes: ``owners`` maps
  the variables of ``jaxpr`` that are a layer's ``touched`` input to that
  layer's path. A fused op that takes other layers' state only reads the
  kernel as one more operand (a ``ScannedBlocks`` block closing over it);
  it is named as ``readers`` (:func:`describe_reader`) names it, or by one
  of its layers."""
  owners = owners or {}
  for eqn in jaxpr.eqns:
    if only is not None and id(eqn) not in only:
      continue
    positions = [i for i, v in enumerate(eqn.invars)
                 if not isinstance(v, jex_core.Literal) and v is var]
    if not positions:
      continue
    if is_fused_op(eqn):
      held = sorted({owners[v] for v in eqn.invars
                     if not isinstance(v, jex_core.Literal) and v in owners})
      if held and path not in held:
        reader = (readers or {}).get(held[0]) or (
            f"the fused op of the FORGE layer at "
            f"{_context.layer_name(held[0])!r}")
        out.extend([reader] * len(positions))
      else:
        out.extend(["fused"] * len(positions))
      continue
    sub_name = _CALL_PARAMS.get(eqn.primitive.name)
    sub = _open(eqn.params.get(sub_name)) if sub_name else None
    if sub is not None and len(sub.invars) == len(eqn.invars):
      inner = {s: owners[v] for s, v in zip(sub.invars, eqn.invars)
               if not isinstance(v, jex_core.Literal) and v in owners}
      for i in positions:
        _consumers(sub, sub.invars[i], out, path=path, owners=inner,
                   readers=readers)
    else:
      out.extend([eqn.primitive.name] * len(positions))


def check_single_use(fn, params, inputs, kpaths: dict[_context.Path, Any],
                     collect: bool = False,
                     kinds: dict[_context.Path, str] | None = None
                     ) -> dict[_context.Path, str]:
  """Checks that each FORGE kernel is read by its own layer only.

  A kernel with another consumer (a tied head, a second fused call, a
  ``ScannedBlocks`` whose blocks close over it) raises a
  ``ValueError`` naming the layer and both fixes; with ``collect=True`` it is
  returned instead, as ``{path: "read by <ops>"}`` (``{}``: all single-use)
  -- ``make_step(..., shared="standard")`` moves those layers to the
  standard path. A kernel its layer reads through ``stop_gradient`` (a
  frozen layer) is returned either way: the standard path is its optax
  update. A
  layer whose fused op is missing from the trace (a cached trace, see below)
  raises either way: that is not a shared weight. ``kinds``: how the
  messages name each layer's kind (default ``forge_jax.Dense``).
  """
  _READERS.names = readers = {}
  try:
    closed = jax.make_jaxpr(fn)(params, inputs)
  finally:
    _READERS.names = None
  loss_eqns = _loss_eqns(closed.jaxpr)
  flat, _ = jax.tree_util.tree_flatten_with_path((params, inputs))
  index = {tuple(kp[1:]): i for i, (kp, _) in enumerate(flat)
           if kp and kp[0] == jax.tree_util.SequenceKey(0)}
  # Each layer's `touched` input: the fused op that takes it steps the layer.
  owners = {closed.jaxpr.invars[i]: kp[1].key for i, (kp, _) in enumerate(flat)
            if len(kp) == 3 and kp[0] == jax.tree_util.SequenceKey(1)
            and kp[2] == jax.tree_util.GetAttrKey("touched")}
  shared: dict[_context.Path, str] = {}
  for path, kp in kpaths.items():
    kind = (kinds or {}).get(path, "forge_jax.Dense")
    follow = dict(path=path, owners=owners, readers=readers)
    uses: list[str] = []
    _consumers(closed.jaxpr, closed.jaxpr.invars[index[kp]], uses, **follow)
    # Second consumers that matter: reads the loss depends on (not only an
    # aux output) that pass a cotangent back (not stop_gradient).
    loss_uses = uses
    if loss_eqns is not None:
      loss_uses = []
      _consumers(closed.jaxpr, closed.jaxpr.invars[index[kp]], loss_uses,
                 only=loss_eqns, **follow)
    foreign = [u for u in loss_uses if u != "fused" and u not in NO_COTANGENT]
    flow = [u for u in uses if u in _CONTROL_FLOW]
    if not uses:
      # Discovered (the layer ran) but its kernel in `params` feeds nothing:
      # the layer read its kernel from somewhere else. Its "new kernel"
      # would be the zero gradient of an unused input.
      raise ValueError(
          f"{kind} at {_context.layer_name(path)!r} ran in loss_fn, "
          "but its kernel in the variables the step received is never read: "
          "loss_fn must apply the model to its `variables` argument (does it "
          "close over other variables, e.g. a captured TrainState or params?)."
          " FORGE returns the updated kernel through that argument; a layer "
          "reading another copy would get its kernel zeroed.")
    if "fused" not in uses and any(u in NO_COTANGENT for u in uses):
      # The layer reads its kernel through stop_gradient (frozen inside
      # loss_fn), perhaps beside other reads (a regulariser on the frozen
      # kernel): no fused update can apply, and the standard path gives
      # optax's update exactly (returned whatever `collect` says).
      shared[path] = FROZEN
      continue
    if flow and "fused" not in uses:
      # Inside lax.cond / while / scan (nn.cond, nn.while_loop): the layer may
      # not run, or run several times; its fused backward cannot carry the
      # update. shared="standard" moves it to the standard path.
      why = f"kernel read inside control flow ({', '.join(dict.fromkeys(flow))})"
      if collect:
        shared[path] = why
        continue
      raise ValueError(
          f"{kind} at {_context.layer_name(path)!r} runs inside "
          f"control flow (its kernel is read by: {', '.join(dict.fromkeys(flow))}"
          ": lax.cond / nn.cond, a while or scan loop). A FORGE layer updates "
          "its kernel in its own backward, so it must run exactly once per "
          "step, unconditionally. Give this layer fused=False, or use "
          "make_step(..., shared='standard'), which moves such layers to the "
          "standard path. (For scanned blocks use forge_jax.ScannedBlocks, "
          "or forge_jax.ScannedDenseStack for a stack of Dense layers.)")
    all_foreign = [u for u in uses if u != "fused"]
    if all_foreign and "fused" not in uses:
      # The layer was seen at discovery but its fused op does not read the
      # kernel: something between the two changed what the layer receives.
      raise KernelNotReadError(
          f"{kind} at {_context.layer_name(path)!r} did not read its "
          f"kernel through its fused op inside the FORGE step (the kernel is "
          f"read by: {', '.join(dict.fromkeys(all_foreign))}). Causes: a JAX "
          "transform inside loss_fn that caches traces (jax.checkpoint or "
          "jax.jit: apply remat per module with flax.linen.remat, supported, "
          "and jit the whole step instead); jax.vmap / nn.vmap over the "
          "model (per-example kernels cannot be fused); a nested jax.grad / "
          "jax.vjp through the model inside loss_fn (e.g. a gradient "
          "penalty: FORGE's backward updates the kernel); or the parameters "
          "transformed before model.apply (e.g. cast to another dtype: give "
          "the model param_dtype/dtype instead). Or give this layer "
          "fused=False.")
    if foreign or uses.count("fused") > 1:
      readers = ", ".join(dict.fromkeys(foreign)) or "a second fused call"
      if collect:
        shared[path] = f"kernel also read by: {readers}"
        continue
      raise ValueError(
          f"the kernel of {kind} at {_context.layer_name(path)!r} is "
          f"also read outside its own layer (by: {readers})."
          " FORGE updates a kernel in place during its backward, so it may "
          "have one consumer per step (paper Remark 2: tied or shared "
          "weights). " + _context.SHARED_FIX)
  return shared
