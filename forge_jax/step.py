"""`make_step`: one training step in which FORGE layers update themselves."""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import numbers
from typing import Any, Callable
import warnings

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax
from flax.core import FrozenDict
from flax.core import meta as flax_meta

from forge_jax import _context
from forge_jax import clip as _clip
from forge_jax import _convert
from forge_jax import _inject
from forge_jax import _paths
from forge_jax import _sharding
from forge_jax import _state
from forge_jax import _usage
from forge_jax import low_precision as _low_precision
from forge_jax.transforms import ForgeTransformation, check_spec

KeyPath = tuple[Any, ...]

SHARED_POLICIES = ("error", "standard")


class SharedWeightsWarning(UserWarning):
  """``make_step(..., shared="standard")`` moved shared FORGE layers (tied or
  called more than once: paper Remark 2) to the standard path for a step.
  (A layer frozen by ``stop_gradient`` inside ``loss_fn`` takes that path
  too, without a warning, under either policy.)

  Emitted once per trace of the step; filter it, or escalate it to an error
  (``warnings.simplefilter("error", SharedWeightsWarning)``), like any warning.
  """


def _with_params(variables, params):
  """``variables`` with its ``params`` replaced, in the same container type
  (a ``FrozenDict`` stays one, so a scan or loop carry keeps its structure)."""
  if isinstance(variables, FrozenDict):
    return variables.copy({"params": params})
  return {**variables, "params": params}


def _kernel_keypath(path: _context.Path) -> KeyPath:
  return tuple(jax.tree_util.DictKey(p) for p in (*path, "kernel"))


def _replace_leaves(tree, new: dict[KeyPath, Any]):
  """``tree`` with the leaves at the given key paths replaced (None allowed)."""
  return jax.tree_util.tree_map_with_path(
      lambda kp, x: new.get(tuple(kp), x), tree, is_leaf=lambda x: x is None)


def _map_slot_trees(state, fields, fn):
  """Rebuilds an optax state with ``fn(field, tree)`` applied to slot trees.

  A field is a name (any NamedTuple state's field of that name) or a
  ``(StateClass, name)`` pair (that field of states of that class only);
  ``fn`` receives the entry of ``fields`` that matched.
  """

  def matching(owner, name):
    return next((f for f in fields
                 if _state.field_matches(f, owner, name)), None)

  return _state.walk(
      state, lambda v, owner, name: matching(owner, name) is not None,
      lambda i, owner, name, tree: fn(matching(owner, name), tree))


def _slot_trees(state, fields) -> dict[Any, Any]:
  found: dict[Any, Any] = {}

  def record(name, tree):
    if name in found:
      raise ValueError(f"optimizer state has more than one {name!r} field")
    found[name] = tree
    return tree

  _map_slot_trees(state, fields, record)
  missing = [f for f in fields if f not in found]
  if missing:
    raise ValueError(
        f"opt_state has no {missing} field(s): was it made by this "
        "transform's init()?")
  return found


def _weight_decay_on(mask, params, keypath: KeyPath) -> bool:
  if mask is None:
    return True
  tree = _context.call_mask(mask, params) if callable(mask) else mask
  for k in keypath:  # `mask` may be a prefix of the params tree.
    if not isinstance(tree, Mapping):
      break
    tree = tree[k.key]
  # Any truthy scalar, as optax's masks accept (True / 1 / a NumPy bool).
  if not isinstance(tree, (numbers.Number, np.bool_)) and not (
      hasattr(tree, "dtype") and getattr(tree, "shape", None) == ()):
    raise TypeError(
        f"weight-decay mask at {'/'.join(k.key for k in keypath)} must be a "
        f"bool, got {type(tree).__name__}")
  return bool(tree)


def _is_box(x) -> bool:
  return isinstance(x, flax_meta.AxisMetadata)


def _unbox(tree):
  """``tree`` with every boxed leaf (``nn.Partitioned``, ...) replaced by its
  value (``flax.core.meta.unbox``); ``tree`` itself if it holds none."""
  if not any(_is_box(x) for x in jax.tree.leaves(tree, is_leaf=_is_box)):
    return tree
  return flax_meta.unbox(tree)


def _rebox(like, new):
  """``new`` (a tree of values) boxed as ``like`` is: each box of ``like``
  holds the value at its place in ``new``, with its metadata (names, mesh,
  rules) kept; ``new`` itself if ``like`` holds no box."""
  if not any(_is_box(x) for x in jax.tree.leaves(like, is_leaf=_is_box)):
    return new
  return jax.tree.map(lambda b, v: b.replace_boxed(v) if _is_box(b) else v,
                      like, new, is_leaf=_is_box)


def _named_axes() -> list:
  """Axis names in scope where the step is traced (pmap, shard_map, vmap with
  axis_name); [] if none, or if this JAX cannot say."""
  try:
    from jax._src import core as jax_core
    return list(jax_core.unsafe_get_axis_names())
  except (ImportError, AttributeError):  # another JAX: no check
    return []


def _check_params(params, paths) -> None:
  """Clear errors for parameter trees make_step cannot drive."""
  for path in paths:
    if _context.kernel_at(params, path) is None:
      raise ValueError(
          f"forge_jax.Dense at {_context.layer_name(path)!r} was called by "
          "loss_fn, but variables['params'] has no kernel at that path: a "
          "FORGE layer must belong to the model whose variables the step "
          "receives, applied to all of them (a second model applied inside "
          "loss_fn, e.g. a frozen teacher, must use nn.Dense or "
          "forge_jax.Dense(fused=False); a model applied to part of the "
          "variables, model.apply({'params': params['a']}, x), names its "
          "layers from that part: make the parts submodules of one model "
          "applied to the whole variables).")


def _containers(tree, made, at: str = "opt_state") -> str | None:
  """Where ``tree``'s tuples (optax's states: ``NamedTuple`` s and the
  tuples ``optax.chain`` makes) depart from ``made``'s, down to the first
  node that is not one (a per-parameter tree, a count, a hyperparameter
  dict: not compared); ``None`` where they match."""
  def name(t):
    return (f"{type(t).__name__} of {len(t)}"
            if isinstance(t, tuple) else type(t).__name__)

  if not isinstance(made, tuple):
    return None
  if type(tree) is not type(made) or len(tree) != len(made):
    return f"{at} is a {name(tree)} where init() makes a {name(made)}"
  for i, (a, b) in enumerate(zip(tree, made)):
    found = _containers(a, b, f"{at}[{i}]")
    if found is not None:
      return found
  return None


def _check_not_accumulation_state(tx, opt_state, params) -> None:
  """Refuses gradient accumulation's state (``optax.MultiStepsState``, of
  ``forge_jax.MultiSteps`` or ``optax.MultiSteps``) given to a step whose
  transform does not accumulate (its ``init`` makes another state), naming
  both, before its fields are read as the transform's."""
  if not isinstance(opt_state, optax.MultiStepsState):
    return
  made = jax.eval_shape(tx.init, params)
  if not isinstance(made, optax.MultiStepsState):
    raise TypeError(
        "make_step: opt_state is gradient accumulation's state (an "
        "optax.MultiStepsState, made by forge_jax.MultiSteps(...).init or "
        "optax.MultiSteps(...).init), but the step's transform does not "
        "accumulate. Build the "
        "step with the transform that made the state, "
        "make_step(loss_fn, forge_jax.MultiSteps(forge_jax.adamw(...), k)), "
        "or make the state with this transform's init().")


def _check_state_made_by(tx, opt_state, params, at: str) -> None:
  """Refuses an ``opt_state`` whose chain of optax states differs from
  what ``tx.init`` makes (a clipped chain's state given to a step without
  clipping; another transform's state), before optax's update reads it
  (whose own error would not say why). Not checked where ``tx.init``
  cannot run on shapes alone (it branches in Python on a value, as an
  injected hyperparameter Adafactor reads, or a mask callable reads its
  arrays with NumPy): a step that runs must not fail by this check."""
  try:
    made = jax.eval_shape(tx.init, params)
  except Exception:  # noqa: BLE001 -- a diagnostic: what fails, skips it
    return
  where = _containers(opt_state, made, at)
  if where is not None:
    raise TypeError(
        f"make_step: opt_state is not the state the step's transform's "
        f"init() makes: {where}. Was it made by another transform -- e.g. "
        "a clipped chain, optax.chain(forge_jax.clip_by_global_norm(m), "
        "...), given to a step built without the clipping? Make the state "
        "with the step's transform: tx.init(variables[\"params\"]).")


def _check_step_arguments(tx, shared, has_aux, wgrad) -> None:
  """Checks ``make_step``'s arguments (see :func:`make_step`).

  Raises:
    TypeError: ``tx`` is ``optax.MultiSteps``, or neither a forge_jax
      transform nor ``optax.inject_hyperparams`` of a forge_jax factory;
      ``has_aux`` is not a bool.
    ValueError: ``shared`` is not in ``SHARED_POLICIES`` or ``wgrad`` not in
      ``_paths.WGRAD_MODES``.
  """
  # optax.MultiSteps, or its .gradient_transformation() (its bound
  # methods; forge_jax.MultiSteps' init is one too, of its inner object)
  multi = tx if isinstance(tx, (optax.MultiSteps, ForgeTransformation)) else (
      getattr(getattr(tx, "init", None), "__self__", None))
  if isinstance(multi, optax.MultiSteps):
    if _clip.holds_clipping(multi.inner_opt):
      raise _clip.accumulation_refused("make_step", "optax.MultiSteps")
    injected = (" It wraps an optax.inject_hyperparams transform, which "
                "forge_jax.MultiSteps does not take: give the forge_jax "
                "transform a schedule instead (forge_jax.adamw(learning_rate="
                "optax.cosine_decay_schedule(...)))."
                if _inject.recognise(multi.inner_opt) is not None else "")
    raise TypeError(
        "make_step: optax.MultiSteps cannot drive FORGE layers (they update "
        "in their own backward, so the accumulation must happen in the fused "
        "kernel): use forge_jax.MultiSteps(forge_jax.adamw(...), k), its "
        "FORGE counterpart, with the same state and results." + injected)
  clipping = _clip.recognise(tx)  # optax.chain(clip_by_global_norm, tx)
  if clipping is not None:
    tx = clipping.member
  injected = _inject.recognise(tx)
  if injected is not None:
    _inject.check_factory(injected)
  elif not isinstance(tx, ForgeTransformation):
    raise TypeError(
        "make_step needs a forge_jax transform (e.g. forge_jax.adamw(...)); "
        f"got {type(tx).__name__}. An optax transform or chain is not one: "
        "FORGE layers update themselves in their own backward, so the step "
        "must know the optimizer's family. The one chain make_step runs is "
        "global-norm clipping before a forge_jax transform, "
        "optax.chain(forge_jax.clip_by_global_norm(max_norm), "
        "forge_jax.adamw(...)), in two passes (docs/clipping.md); train any "
        "other chain with optax on the standard path. (To change a "
        "hyperparameter during training, wrap the forge_jax factory: "
        "optax.inject_hyperparams(forge_jax.adamw)(learning_rate=...), or "
        "pass a schedule, forge_jax.adamw(learning_rate=schedule, ...).)")
  else:
    check_spec(tx, "make_step")
  if not isinstance(shared, str) or shared not in SHARED_POLICIES:
    raise ValueError(
        f"make_step: shared={shared!r} must be one of {SHARED_POLICIES}: "
        "'error' refuses a FORGE layer that is called more than once or "
        "whose kernel is read elsewhere (tied weights); 'standard' moves such "
        "layers to the standard (optax) path and warns which")
  if not isinstance(has_aux, bool):
    raise TypeError(f"make_step: has_aux must be a bool, got {has_aux!r}")
  if not isinstance(wgrad, str) or wgrad not in _paths.WGRAD_MODES:
    raise ValueError(
        f"make_step: wgrad={wgrad!r} must be one of {_paths.WGRAD_MODES}: "
        "'fused' forms each FORGE layer's weight gradient in the fused "
        "kernel's registers, 'xla' with XLA's GEMM inside the layer's "
        "backward")


def _check_trace(variables) -> None:
  """Checks, at trace time, the step's variables and where it is traced.

  Raises:
    ValueError: ``variables`` has no ``params`` collection, or the step is
      traced inside a named-axis map (``jax.pmap``, ``shard_map``,
      ``vmap(axis_name=...)``), where each replica would train on its shard
      alone.
  """
  if "params" not in variables:
    raise ValueError("variables must hold a 'params' collection")
  axes = _named_axes()
  if axes:
    raise ValueError(
        f"forge_jax.make_step: the step is traced inside a named-axis map "
        f"(axes {axes}: jax.pmap, shard_map or vmap(axis_name=...)). A "
        "FORGE layer updates its kernel inside its own backward from its "
        "local x^T dy: there is no gradient to average across the axis, so "
        "each replica would train on its own shard alone and the replicas "
        "would drift apart. For data, tensor or fully-sharded parallelism, "
        "place the arrays on a mesh (jax.device_put with a NamedSharding), "
        "build the step with make_step(..., mesh_layout=forge_jax.MeshLayout("
        "mesh, data_axes=...)) and jit it: each kernel's update then reads "
        "its complete gradient (docs/distributed.md).")


def _discover_layers(loss_fn, variables, batch,
                     shared: str) -> _context.StepContext:
  """Traces ``loss_fn`` abstractly once to find the FORGE layers it calls.

  Args:
    loss_fn: the step's loss function.
    variables: the step's variables.
    batch: the step's batch (closed over, as ``value_and_grad`` leaves it: a
      Python value in it, a ``train`` flag, stays a Python value).
    shared: the ``shared`` policy (with ``"error"`` a second call of a layer
      raises here).

  Returns:
    The discovery context: ``layers`` (path -> ``LayerInfo``, with its call
    count) and ``unfused`` (FORGE layers with ``fused=False``).

  Raises:
    ValueError: ``loss_fn`` called no FORGE layer (or only cached traces of
      them), or, with ``shared="error"``, called one twice.
  """
  # A fresh closure: eval_shape caches traces by function and shapes, and a
  # cache hit would skip the layers' discovery side effects (a retrace of
  # the step, e.g. under a second jax.jit, found no layers).
  found = _context.StepContext("discover", shared=shared)

  def traced(v):
    found.params = v.get("params") if isinstance(v, Mapping) else None
    return loss_fn(v, batch)

  with _context.step_context(found):
    jax.eval_shape(traced, variables)
  found.params = None  # traced values of the finished trace: not kept
  if not found.layers and not found.unfused:
    raise ValueError(
        "no forge_jax.Dense layer (or ScannedDenseStack) was called by "
        "loss_fn. If the model has none, use optax directly. If it has: "
        "a function inside loss_fn that was jitted (jax.jit(model.apply), "
        "a jitted loss_fn) or checkpointed and already traced at these "
        "shapes is replayed from JAX's cache, and its layers are never "
        "called -- call model.apply un-jitted inside loss_fn and jit the "
        "whole step instead (apply remat per module with "
        "flax.linen.remat)" + _convert.no_layers_note())
  return found


@dataclasses.dataclass
class _FusedLayers:
  """The FORGE layers that take their fused path in one traced step.

  Each dict is keyed by the layer's path: ``layers`` what discovery found,
  ``kpaths`` the key path of its kernel in ``params``, ``layouts`` how its
  slots sit in the optimizer state, ``inputs`` what its backward reads.
  """

  layers: dict[_context.Path, _context.LayerInfo]
  kpaths: dict[_context.Path, KeyPath]
  layouts: dict[_context.Path, _state.KernelLayout] = dataclasses.field(
      default_factory=dict)
  inputs: dict[_context.Path, _context.LayerInputs] = dataclasses.field(
      default_factory=dict)

  def drop(self, paths) -> None:
    """Removes the layers at ``paths`` (moved to the standard path)."""
    for d in (self.layers, self.kpaths, self.inputs, self.layouts):
      for p in paths:
        d.pop(p, None)


# Why a layer whose kernel has no elements takes the standard path (there is
# nothing to update; optax's update of an empty array is itself empty).
_EMPTY = "its kernel has a zero-size dimension"


def _split_by_policy(found: _context.StepContext):
  """Splits the discovered layers into fused ones and standard-path ones.

  With ``shared="standard"`` a layer called more than once takes the
  standard path (with ``"error"``, discovery raised), as does one that
  discovery found unfusable. More are found by the single-use check
  (:func:`_settle_shared_layers`).

  Returns:
    ``(fused, fallback)``: a :class:`_FusedLayers` without layouts or
    inputs yet, and ``{path: why}`` for the standard-path layers.
  """
  fallback = {p: (_context.shared_reason(info) if info.calls > 1
                  else info.unfusable or _EMPTY)
              for p, info in found.layers.items()
              if info.calls > 1 or info.unfusable
              or 0 in tuple(info.kernel_shape)}
  layers = {p: info for p, info in found.layers.items()
            if p not in fallback}
  return _FusedLayers(layers, {p: _kernel_keypath(p) for p in layers}), fallback


def _state_shared_by_layers(spec, opt_state, params, params_def):
  """What every FORGE layer's backward reads beside its own slots.

  Args:
    spec: the transform's ``ForgeSpec``.
    opt_state: the optimizer state.
    params: the parameter tree.
    params_def: its tree structure.

  Returns:
    ``(shared_state, shared_def, skeleton, packed)``: the state shared by all
    parameters (step counts; for a deferred family, regime 3, the whole state
    with holes for the per-parameter fields, flattened, its treedef and a
    params-shaped skeleton; else ``spec.shared(opt_state)`` and ``None``s),
    and this step's packed hyperparameters, keyed by whether weight decay
    applies (``()`` for regime 3, whose layer runs optax's own update).
  """
  if spec.regime == 3:
    # Deferred: the layer runs optax's own update on its slice of the
    # state; what is not per-parameter (step counts) is read, not written.
    holed = _state.map_per_param(opt_state, params_def,
                                 lambda i, t: _state.Hole())
    shared_state, shared_def = jax.tree.flatten(holed)
    skeleton = jax.tree.map(lambda _: None, params)
    return shared_state, shared_def, skeleton, {True: (), False: ()}
  shared_state = spec.shared(opt_state)
  h = spec.hparams(opt_state)
  packed = {
      # Families without decoupled weight decay have no such entry.
      wd_on: spec.rule.pack(**(h if wd_on or "weight_decay" not in h
                               else {**h, "weight_decay": 0.0}))
      for wd_on in (True, False)
  }
  return shared_state, None, None, packed


def _gather_layer_inputs(fused: _FusedLayers, spec, opt_state, params,
                         params_def):
  """Fills ``fused.layouts`` and ``fused.inputs`` from the optimizer state.

  A per-parameter field of the state (one whose structure has the params'
  as a prefix) holds a subtree per kernel; each kernel's slots are its
  subtrees of the fields the family's FORGE path updates.

  Returns:
    ``(fields, slot_ids)``: the per-parameter fields of ``opt_state`` and
    the indices of those holding slots.

  Raises:
    ValueError: another per-parameter field holds arrays for a FORGE kernel.
    TypeError: a kernel's slots are not floating point.
  """
  fields = _state.per_param_fields(opt_state, params_def)
  slot_ids = _state.select_slots(fields, spec, opt_state, params_def)
  shared_state, shared_def, skeleton, packed = _state_shared_by_layers(
      spec, opt_state, params, params_def)
  for p, kp in fused.kpaths.items():
    subtrees = [_state.get_subtree(fields[i].tree, kp) for i in slot_ids]
    for f in fields:
      if f.index not in slot_ids and jax.tree.leaves(
          _state.get_subtree(f.tree, kp)):
        raise ValueError(
            f"optimizer state field {f.name!r} holds arrays for the kernel "
            f"of the FORGE layer at {_context.layer_name(p)!r} that this "
            f"transform's FORGE path does not update ({spec.family}). "
            "Either the state was made by another transform's init (e.g. "
            "sgd with momentum, given to sgd without): make it with this "
            "transform's init; or optax keeps that kernel in another part "
            "of its state (e.g. Muon's AdamW branch for kernels of more "
            "than two axes, such as a scanned stack's): give that layer or "
            "stack fused=False (standard optax path).")
    flat = [jax.tree.flatten(t) for t in subtrees]
    slots = tuple(a for leaves, _ in flat for a in leaves)
    leaf_dtypes, shared = None, shared_state
    lp = spec.low_precision
    if lp is not None:
      # Quantized moments: int8 codes travel as a float dtype (their new
      # values come back as cotangents); the stochastic-rounding seed and
      # step of this kernel are read with the shared state.
      leaf_dtypes = tuple(a.dtype for a in slots)
      slots = _low_precision.to_transport(slots)
      if lp.stochastic_rounding:
        shared = (jnp.stack([
            jnp.asarray(_low_precision.param_seed(lp.seed, kp), jnp.uint32),
            jnp.asarray(spec.sr_step(opt_state)).astype(jnp.uint32)]),)
    bad = [a.dtype for a in slots if not jnp.issubdtype(a.dtype, jnp.inexact)]
    if bad:
      raise TypeError(
          f"the optimizer state of {_context.layer_name(p)!r} has non-float"
          f" per-parameter arrays ({bad}); FORGE returns new state values as"
          " cotangents, which must be floating point")
    fused.layouts[p] = _state.KernelLayout(
        keypath=kp, slot_ids=slot_ids, slot_defs=tuple(d for _, d in flat),
        shared_def=shared_def, params_skeleton=skeleton,
        leaf_dtypes=leaf_dtypes)
    fused.inputs[p] = _context.LayerInputs(
        slots=slots,
        hparams=packed[spec.regime == 3 or _weight_decay_on(
            spec.weight_decay_mask, params, kp)],
        touched=jnp.zeros((), jnp.float32),
        shared=shared)
  return fields, slot_ids


def _settle_shared_layers(loss_of, params, fused: _FusedLayers, fallback,
                          ctx: _context.StepContext, shared: str) -> None:
  """Runs the single-use check (paper Remark 2) until no kernel is shared.

  Each remaining FORGE kernel must have one consumer. With
  ``shared="standard"`` a shared one moves to the standard path; that
  changes the trace (its kernel now feeds a plain dot), so the rest are
  checked again. A kernel its layer reads through ``stop_gradient`` (a
  frozen layer) moves whatever the policy: the standard path is optax's
  update for it. Moved layers leave ``fused`` and join ``fallback`` and
  ``ctx.standard``.

  Raises:
    ValueError: with ``shared="error"``, a shared kernel; under either
      policy, a kernel that its layer does not read through its fused op
      (``_usage.check_single_use``).
  """
  while fused.kpaths:
    extra = _usage.check_single_use(
        loss_of, params, fused.inputs, fused.kpaths,
        collect=shared == "standard",
        kinds={p: info.kind for p, info in fused.layers.items()})
    if not extra:
      break
    fallback.update(extra)
    ctx.standard = frozenset(fallback)
    fused.drop(extra)


def _forge_updates(spec, params, grads, new_inputs, fused: _FusedLayers,
                   slot_ids, ctx: _context.StepContext):
  """The FORGE kernels' new values and new slots, from the backward.

  A layer whose fused backward was not traced (its output did not reach the
  loss: paper Remark 1) gets what optax gives a zero gradient, unless its
  ``touched`` cotangent says at run time that the backward did run (a cached
  transpose).

  Returns:
    ``(new_kernels, new_subtrees)``: kernel key path -> new kernel, and
    kernel key path -> ``{field index: new slot subtree}``.
  """
  new_kernels, new_subtrees = {}, {}
  for p, kp in fused.kpaths.items():
    kernel, slots = _state.get_subtree(grads, kp), new_inputs[p].slots
    if p not in ctx.bwd_traced:
      def zero_grad_step(p=p, kp=kp):
        return _paths.step_from_grad(
            spec, fused.layouts[p],
            jnp.zeros(fused.layers[p].kernel_shape, jnp.float32),
            _state.get_subtree(params, kp), fused.inputs[p])
      kernel, slots = lax.cond(new_inputs[p].touched > 0,
                               lambda k=kernel, s=slots: (k, s),
                               zero_grad_step)
    new_kernels[kp] = kernel
    layout = fused.layouts[p]
    if layout.leaf_dtypes is not None:  # int8 codes back from their transport
      slots = _low_precision.from_transport(slots, layout.leaf_dtypes)
    new_subtrees[kp] = dict(zip(slot_ids, layout.split(list(slots))))
  return new_kernels, new_subtrees


def _optax_update(tx, grads, params, opt_state, params_def, cut, injected):
  """Every parameter but the FORGE kernels: the optax transform itself.

  Args:
    tx: the forge_jax transform.
    grads: the gradient tree (the FORGE kernels' leaves hold their new
      values).
    params: the parameter tree.
    opt_state: the optimizer state.
    params_def: the params' tree structure.
    cut: ``{kernel key path: None}`` for the FORGE kernels, cut out of the
      gradient, parameter and state trees.
    injected: ``tx`` as ``optax.inject_hyperparams`` made it
      (:func:`_inject.recognise`), or ``None``.

  Returns:
    ``(new_params, new_state)``, both with the FORGE kernels' leaves
    ``None``.
  """
  grads_rest = _replace_leaves(grads, cut)
  params_rest = _replace_leaves(params, cut)
  if injected is not None:
    _inject.check_dtype_of_the_rest(injected, opt_state, params, params_rest)
  state_rest = _state.map_per_param(
      opt_state, params_def, lambda i, t: _state.replace_subtrees(t, cut))
  with _context.full_params(params):
    updates, new_state = tx.update(grads_rest, state_rest, params_rest)
  if injected is not None and not jax.tree.leaves(params_rest):
    # Every parameter is a FORGE kernel: optax cast the injected
    # hyperparameters it keeps to the widest dtype of none (float32), where
    # its reference step casts them to the whole tree's, as the kernels
    # read them; the state keeps those, as optax's does.
    new_state = new_state._replace(hyperparams=_inject.this_step_hyperparams(
        injected, opt_state, params))
  return optax.apply_updates(params_rest, updates), new_state


def _put_back_state(new_state, params_def, fields, new_subtrees, cut):
  """``new_state`` with the FORGE kernels' new slots put back.

  Fields a kernel does not own (another partition's ``MaskedNode``) get
  their old subtree from ``fields``.
  """
  def put_back(i, tree):
    return _state.replace_subtrees(tree, {
        kp: new_subtrees[kp][i] if i in new_subtrees[kp]
        else _state.get_subtree(fields[i].tree, kp) for kp in cut})

  return _state.map_per_param(new_state, params_def, put_back)


def _report_standard_layers(fallback, standard_layers: list[str]) -> None:
  """Reports the layers that took the standard path (at trace time).

  Sets ``standard_layers`` (the step's list, in place) to their names, and
  warns a :class:`SharedWeightsWarning` for those moved as shared (not the
  frozen ones, nor those with an empty kernel), at the caller of the step.
  """
  standard_layers[:] = sorted(_context.layer_name(p) for p in fallback)
  moved = {p: why for p, why in fallback.items()
           if why not in (_usage.FROZEN, _EMPTY)}
  if moved:
    warnings.warn(SharedWeightsWarning(
        f"forge_jax.make_step(shared='standard'): {len(moved)} shared "
        "FORGE layer(s) took the standard path (ordinary gradient and "
        "optax update) in this step, the others stay fused: " + "; ".join(
            f"{_context.layer_name(p)!r} ({why})"
            for p, why in sorted(moved.items()))
        + " (paper Remark 2)"), stacklevel=3)


def make_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: ForgeTransformation,
    *,
    shared: str = "error",
    has_aux: bool = False,
    wgrad: str = "fused",
    convert: bool = False,
    mesh_layout: _sharding.MeshLayout | None = None,
) -> Callable[[Any, Any, Any], tuple[jax.Array, Any, Any]]:
  """Builds ``step(variables, opt_state, batch) -> (loss, variables, opt_state)``.

  In the step, each FORGE layer (``forge_jax.Dense``, ``ScannedDenseStack``,
  ``ScannedBlocks``) updates its kernel and optimizer state inside its own
  backward, on the path its family's regime allows
  (``pallas_kernels.classify``): in the fused kernel's epilogue (regime 1),
  in the epilogue then a per-layer pass over the new state (regime 2: LAMB,
  Muon), or deferred -- the layer's gradient formed, consumed and freed in
  that backward (regime 3: Adafactor, SM3). Every other parameter is updated
  by ``tx`` exactly as optax would.

  The step is a pure function; use it as
  ``jax.jit(step, donate_argnums=(0, 1))`` so that kernels and slots are
  updated in place.

  Args:
    loss_fn: ``loss_fn(variables, batch)`` returns a scalar loss and calls
      ``model.apply(variables, ...)``.
    tx: a forge_jax transform (``forge_jax.adamw(...)``, ...), or
      ``optax.inject_hyperparams`` of one
      (``optax.inject_hyperparams(forge_jax.adamw)(learning_rate=1e-3)``:
      the values in ``opt_state.hyperparams``, which may be changed between
      steps, drive the FORGE kernels as they drive optax), or either one
      after global-norm clipping,
      ``optax.chain(forge_jax.clip_by_global_norm(max_norm), ...)`` (or
      ``optax.clip_by_global_norm``): each step then runs twice through the
      model, a norm pass and the clipped update (``forge_jax.clip``,
      ``docs/clipping.md``);
      ``opt_state = tx.init(variables["params"])``. Parameters may be boxed
      (``nn.with_partitioning``, ``nn.with_logical_partitioning``; the state
      ``tx.init`` builds for them is boxed too): the step runs on their
      values and returns them boxed as they came, names and all.
    shared: what to do with a *shared* FORGE layer (paper Remark 2). FORGE
      updates a kernel inside its layer's backward, so the kernel may have
      one consumer per step; a shared layer -- called more than once in the
      step, or whose kernel is also read by anything other than its own
      layer (a tied output head reading
      ``embed.variables["params"]["kernel"]``, the kernel passed elsewhere)
      -- has a gradient summed over several consumers.

      * ``"error"`` (default): refuse it at trace time with a ``ValueError``
        naming the layer and the fixes;
      * ``"standard"``: move it to the standard path for this step, as if it
        had ``fused=False``: its kernel gets an ordinary gradient from
        ``jax.value_and_grad`` and is updated by ``tx`` with the other
        non-FORGE parameters, exactly as optax would; every other FORGE
        layer stays fused. A :class:`SharedWeightsWarning` naming those
        layers (and why) is emitted once per trace.
    has_aux: as in ``jax.value_and_grad``: ``loss_fn`` returns
      ``(loss, aux)`` -- e.g. the updated ``batch_stats`` of
      ``model.apply(..., mutable=["batch_stats"])``, or metrics -- and the
      step returns ``((loss, aux), variables, opt_state)``. The step does
      not merge ``aux`` into ``variables``: collections other than
      ``params`` pass through unchanged, so put new ``batch_stats`` back
      yourself.
    wgrad: how a FORGE layer forms its weight gradient ``G``.

      * ``"fused"`` (default): the fused Pallas kernel -- ``G = x^T dy`` in
        registers, the optimizer applied in its epilogue; ``G`` never exists
        in memory.
      * ``"xla"``: XLA's GEMM stores the layer's ``G`` (formed as
        ``jax.grad`` forms it, at the layer's ``precision``; with none, fp32
        operands get fp32 products as in the fused kernel, which ignores the
        layer's ``precision``), the family's elementwise update reads it,
        both inside the layer's backward
        (``pallas_kernels.unfused_wgrad_update``): that layer's ``G`` exists
        for its update only. In a ``ScannedDenseStack`` or ``ScannedBlocks``
        (``stack_update="layer"``, a GPU) the update is the fused kernel's
        epilogue on that ``G`` (``pallas_kernels.stored_g_update``), in place
        in the stacks.

      Regime-3 families (Adafactor, SM3) form ``G`` in fp32 in the backward
      under either setting.
    convert: ``True`` runs the model's ``flax.linen.Dense`` and
      ``flax.linen.DenseGeneral`` layers -- the model's own, and those
      built inside Flax modules such as ``nn.MultiHeadDotProductAttention``
      -- as ``forge_jax.Dense`` and ``forge_jax.DenseGeneral`` in the step,
      with no edit to the model: same parameters (names, shapes, boxes), so
      ``model.init``'s variables and checkpoints work unchanged. A layer
      FORGE cannot fuse (``nn.DenseGeneral`` with ``batch_dims`` or
      non-trailing ``axis``, or of more than two axes under Muon;
      a custom ``dot_general``; a non-float or float64 kernel or
      computation; a layer of another model applied in ``loss_fn``) runs as
      it is, on the standard path, and is reported: a
      :class:`forge_jax.ConvertSkipWarning` per trace and ``step.skipped``
      (below). Converted layers are FORGE layers like any other: ``shared``
      applies to them. ``False`` (default): only FORGE layers are fused
      (docs/adopting.md).

    mesh_layout: a :class:`forge_jax.MeshLayout` when the step's arrays are
      placed on a device mesh (``NamedSharding``): the mesh, the axes the
      batch is sharded over, and where the kernels' shardings are read
      (Flax's partitioning boxes, or ``param_specs``). Each FORGE kernel is
      then stepped per shard inside ``shard_map`` -- tensor-parallel shards
      with the fused kernel and no communication, data-parallel and
      fully-sharded ones from their reduced (or reduce-scattered) gradient
      -- and every array keeps its sharding (docs/distributed.md). ``None``
      (default): arrays placed on a mesh of several devices are refused.

  Returns:
    The step, ``step(variables, opt_state, batch) -> (loss, variables,
    opt_state)``. Its attribute ``step.standard_layers`` -- a list, updated
    in place at each trace (so that it is also readable through
    ``jax.jit(step)``, which copies the attribute when made) -- holds the
    names of the fused FORGE layers this step moved to the standard path
    (shared ones under ``shared="standard"``, frozen ones, ones whose
    kernel has no elements; ``[]``: none;
    before the first trace, ``[]``); layers built with ``fused=False`` are
    not listed. With ``convert=True``, also updated in
    place at each trace: ``step.converted``, the list of the names of the
    ``nn.Dense`` / ``nn.DenseGeneral`` layers that ran as FORGE layers, and
    ``step.skipped``, a dict from the name of each one left on the standard
    path to the reason, in plain words (both empty without ``convert``).

  Raises:
    TypeError: ``tx`` is not a forge_jax transform (an optax chain is not
      one, except global-norm clipping before one: any other form of that
      chain is refused with the reason), nor ``optax.inject_hyperparams``
      of a factory that makes one, or ``has_aux`` or ``convert`` is not a
      bool, or ``mesh_layout`` is not a ``MeshLayout``.
    ValueError: ``shared`` is not ``"error"`` or ``"standard"``, or
      ``wgrad`` not ``"fused"`` or ``"xla"``, or a clipped chain is given
      with ``mesh_layout``.

    At trace time: ``ValueError``, with ``shared="error"``, if a FORGE layer
    is called twice in a step, or its kernel is also read by anything other
    than its own layer -- give that layer ``fused=False``, or use
    ``shared="standard"``. Also ``ValueError`` if a FORGE layer's kernel in
    ``variables`` is never read (``loss_fn`` applied the model to other
    variables) or reaches the layer only through another op (``jax.vmap``
    over the model, params cast before ``apply``), if a FORGE layer has no
    kernel at its path in ``variables["params"]`` (a second model built from
    ``forge_jax.Dense``), if ``loss_fn`` calls no FORGE layer, or if the step
    is traced inside a named-axis map (``jax.pmap``, ``shard_map``), if
    arrays are placed on a mesh of several devices without ``mesh_layout``
    (or on another mesh than its), or if low-precision state
    (``moments=``, ``stochastic_rounding=``) meets ``mesh_layout``;
    ``TypeError`` if an injected transform's ``opt_state`` is not the state
    its ``init`` made, or if ``opt_state``'s chain of optax states is not
    the one ``tx.init`` makes (a clipped chain's state given to a step
    built without the clipping); ``ValueError`` if its scheduled or Python-float
    hyperparameters would be cast, without ``hyperparam_dtype``, to a
    narrower dtype than in optax's own step (the parameters beside the
    FORGE kernels narrower than the whole tree).
  """
  _check_step_arguments(tx, shared, has_aux, wgrad)
  # Global-norm clipping: tx is optax.chain(clip_by_global_norm, optimizer);
  # the step drives the optimizer, in two passes (forge_jax/clip.py).
  clipping = _clip.recognise(tx)
  if clipping is not None:
    tx = clipping.member
    _clip.check_mesh_layout(mesh_layout)
  _convert.check_flag(convert)
  if convert:  # each trace tells the conversion which parameters are the step's
    loss_fn = _convert.reading_params(loss_fn)
  _sharding.check_layout_argument(mesh_layout)
  injected = _inject.recognise(tx)
  standard_layers: list[str] = []
  converted: list[str] = []
  skipped: dict[str, str] = {}

  def step(variables, opt_state, batch):
    _check_trace(variables)
    # Boxed parameters (nn.with_partitioning): the step runs on the values;
    # the boxes, with their names, are put back around the new ones.
    boxed_params = variables["params"]
    params = _unbox(boxed_params)
    state_in = chain_state = _unbox(opt_state)
    if clipping is not None:  # the optimizer's own state in the chain's
      state_in = clipping.member_state(chain_state)
    _sharding.check_placement(mesh_layout, params, batch, chain_state)
    member = clipping.member if clipping is not None else tx
    _check_not_accumulation_state(member, state_in, params)
    spec = (tx.spec if injected is None
            else _inject.spec_for(injected, state_in, params))
    # optax's promotion of the state, first (the kernels store their slots
    # in the slots' own dtypes)
    if injected is not None:
      state_in = _inject.widened_like_optax(injected, state_in, params)
    elif spec.low_precision is None and _inject.has_narrow_floats(state_in):
      state_in = _inject.widened_by(member.update, state_in, params)
    if spec.low_precision is not None and mesh_layout is not None:
      raise ValueError(
          f"forge_jax.make_step(mesh_layout=...): forge_jax.{spec.family} "
          "with low-precision state (moments= or stochastic_rounding=) does "
          "not run on a device mesh yet; train it on one device, or with "
          "moments=None and stochastic_rounding=False")
    if clipping is not None:  # the kernels step from the clipped gradient
      spec = _clip.clipped_spec(spec)
    # convert=True: the model's nn.Dense / nn.DenseGeneral run as FORGE
    # layers in every trace of loss_fn (and of ScannedBlocks' backward).
    with _convert.converting(convert, params, spec,
                             mesh_layout is not None) as report:
      value, new_params, new_state = _plain_step(
          _with_params(variables, params), state_in, batch, params, spec,
          boxed_params)
    if report is not None:
      report.publish(converted, skipped, standard_layers)
    new_params, new_state = _sharding.keep_shardings(
        mesh_layout, boxed_params, params, new_params, new_state)
    if clipping is not None:
      new_state = clipping.with_member_state(chain_state, new_state)
    return (value, _with_params(variables, _rebox(boxed_params, new_params)),
            _rebox(opt_state, new_state))

  def _plain_step(variables, opt_state, batch, params, spec, boxed_params):
    # Which layers are FORGE layers, and which of them take the fused path.
    found = _discover_layers(loss_fn, variables, batch, shared)
    _check_params(params, found.layers)
    fused, fallback = _split_by_policy(found)

    # Each kernel's slice of the optimizer state, and this step's
    # hyperparameters.
    params_def = jax.tree.structure(params)
    fields, slot_ids = _gather_layer_inputs(fused, spec, opt_state, params,
                                            params_def)
    ctx = _context.StepContext("fused", rule=spec.rule, spec=spec,
                               wgrad=wgrad, layouts=fused.layouts,
                               shared=shared, standard=frozenset(fallback),
                               sharding=_sharding.plan_layers(
                                   mesh_layout, boxed_params, fused.layers,
                                   fused.kpaths))

    def loss_of(params, inputs, ctx=ctx):
      ctx.inputs = inputs  # the traced values, so that AD sees them
      return loss_fn(_with_params(variables, params), batch)

    # The backward: FORGE kernels and their state come back updated.
    # (Integer inputs -- a deferred family's step counts, read only -- get
    # float0 cotangents: allow_int.)
    with _context.step_context(ctx), _context.full_params(params):
      _settle_shared_layers(loss_of, params, fused, fallback, ctx, shared)
    if clipping is not None:
      # Clipping, pass 1: the global gradient norm, nothing updated; its
      # clip factors go into the FORGE kernels' hyperparameters.
      clip_norm, params = _clip.norm_pass(ctx, loss_of, params, fused.inputs,
                                          fused.kpaths, has_aux)
      fused.inputs = _clip.with_factors(fused.inputs, spec.rule, clip_norm,
                                        clipping.max_norm)
    with _context.step_context(ctx), _context.full_params(params):
      value, (grads, new_inputs) = jax.value_and_grad(
          loss_of, argnums=(0, 1), allow_int=True, has_aux=has_aux)(
              params, fused.inputs)
    if clipping is not None:  # every other parameter's gradient, clipped
      grads = _clip.clip_gradients(grads, fused.kpaths, clip_norm,
                                   clipping.max_norm)
    new_kernels, new_subtrees = _forge_updates(
        spec, params, grads, new_inputs, fused, slot_ids, ctx)

    # Every other parameter: optax, with the FORGE kernels cut out; then
    # the FORGE kernels and their new state put back.
    cut = {kp: None for kp in fused.kpaths.values()}
    _check_state_made_by(tx, opt_state, params, "opt_state" if clipping is None
                         else f"the chain's opt_state[{clipping.index}]")
    new_params, new_state = _optax_update(tx, grads, params, opt_state,
                                          params_def, cut, injected)
    new_params = _replace_leaves(new_params, new_kernels)
    new_state = _put_back_state(new_state, params_def, fields, new_subtrees,
                                cut)

    _report_standard_layers(fallback, standard_layers)
    return value, new_params, new_state

  step.standard_layers = standard_layers
  step.converted = converted
  step.skipped = skipped
  return step
