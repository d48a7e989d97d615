"""`make_step`: one training step in which FORGE layers update themselves."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
import optax

from forge_jax import _context
from forge_jax import _usage
from forge_jax.transforms import ForgeTransformation

KeyPath = tuple[Any, ...]


def _kernel_keypath(path: _context.Path) -> KeyPath:
  return tuple(jax.tree_util.DictKey(p) for p in (*path, "kernel"))


def _get(tree, keypath: KeyPath):
  for k in keypath:
    tree = tree[k.key]
  return tree


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
  if hasattr(state, "_fields"):  # a NamedTuple state
    def matching(name):
      for f in fields:
        if f == name or (isinstance(f, tuple) and isinstance(state, f[0])
                         and f[1] == name):
          return f
      return None

    rebuilt = []
    for name, value in zip(state._fields, state):
      f = matching(name)
      rebuilt.append(_map_slot_trees(value, fields, fn) if f is None
                     else fn(f, value))
    return type(state)(*rebuilt)
  if isinstance(state, (tuple, list)):
    return type(state)(_map_slot_trees(s, fields, fn) for s in state)
  return state


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
  tree = mask(params) if callable(mask) else mask
  for k in keypath:  # `mask` may be a prefix of the params tree.
    if not isinstance(tree, dict):
      break
    tree = tree[k.key]
  if not isinstance(tree, (bool, jnp.bool_)) and not (
      hasattr(tree, "dtype") and tree.shape == ()):
    raise TypeError(
        f"weight-decay mask at {'/'.join(k.key for k in keypath)} must be a "
        f"bool, got {type(tree).__name__}")
  return bool(tree)


def make_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: ForgeTransformation,
) -> Callable[[Any, Any, Any], tuple[jax.Array, Any, Any]]:
  """Builds ``step(variables, opt_state, batch) -> (loss, variables, opt_state)``.

  ``loss_fn(variables, batch)`` returns a scalar loss and calls
  ``model.apply(variables, ...)``. In the step, each ``forge_jax.Dense``
  updates its kernel and optimizer slots inside its own backward with the
  fused kernel; every other parameter is updated by ``tx`` exactly as optax
  would. ``opt_state = tx.init(variables["params"])``.

  The step is a pure function; use it as
  ``jax.jit(step, donate_argnums=(0, 1))`` so that kernels and slots are
  updated in place.

  Raises (at trace time): ``ValueError`` if a FORGE layer is called twice in
  a step, or its kernel is also read by anything other than its own layer
  (paper Remark 2) -- give that layer ``fused=False``.
  """
  if not isinstance(tx, ForgeTransformation):
    raise TypeError(
        "make_step needs a forge_jax transform (e.g. forge_jax.adamw(...)); "
        f"got {type(tx).__name__}")
  spec = tx.spec

  def step(variables, opt_state, batch):
    if "params" not in variables:
      raise ValueError("variables must hold a 'params' collection")
    params = variables["params"]

    # 1. Which layers are FORGE layers (and is each called once)?
    with _context.step_context(_context.StepContext("discover")) as found:
      jax.eval_shape(loss_fn, variables, batch)
    layers = found.layers
    if not layers:
      raise ValueError(
          "no forge_jax.Dense layer was called by loss_fn; use optax directly")
    kpaths = {p: _kernel_keypath(p) for p in layers}

    # 2. Their slots and this step's hyperparameters.
    slot_trees = _slot_trees(opt_state, spec.slot_fields)
    h = spec.hparams(opt_state)
    packed = {
        # Families without decoupled weight decay have no such entry.
        wd_on: spec.rule.pack(**(h if wd_on or "weight_decay" not in h
                                 else {**h, "weight_decay": 0.0}))
        for wd_on in (True, False)
    }
    inputs = {}
    for p, kp in kpaths.items():
      inputs[p] = _context.LayerInputs(
          slots=tuple(_get(slot_trees[f], kp) for f in spec.slot_fields),
          hparams=packed[_weight_decay_on(spec.weight_decay_mask, params, kp)],
          touched=jnp.zeros((), jnp.float32))

    ctx = _context.StepContext("fused", rule=spec.rule)

    def loss_of(params, inputs):
      ctx.inputs = inputs  # the traced values, so that AD sees them
      return loss_fn({**variables, "params": params}, batch)

    # 3. The backward: FORGE kernels come back already updated.
    with _context.step_context(ctx):
      _usage.check_single_use(loss_of, params, inputs, kpaths)
      loss, (grads, new_inputs) = jax.value_and_grad(
          loss_of, argnums=(0, 1))(params, inputs)

    new_kernels, new_slots = {}, {}
    for p, kp in kpaths.items():
      kernel, slots = _get(grads, kp), new_inputs[p].slots
      if p not in ctx.bwd_traced:
        # Remark 1: the layer's output did not reach the loss, so no fused
        # backward ran. Give it what optax gives a zero gradient. (If the
        # backward did run but was not traced here -- a cached transpose --
        # `touched` says so at run time.)
        def zero_grad_step(p=p, kp=kp):
          return spec.rule.apply(
              jnp.zeros(layers[p].kernel_shape, jnp.float32),
              _get(params, kp), inputs[p].slots, inputs[p].hparams)
        kernel, slots = lax.cond(new_inputs[p].touched > 0,
                                 lambda k=kernel, s=slots: (k, s),
                                 zero_grad_step)
      new_kernels[kp] = kernel
      new_slots[kp] = slots

    # 4. Every other parameter: the optax transform itself, with FORGE
    # kernels cut out of the gradient, parameter and slot trees.
    cut = {kp: None for kp in kpaths.values()}
    grads_rest = _replace_leaves(grads, cut)
    params_rest = _replace_leaves(params, cut)
    state_rest = _map_slot_trees(opt_state, spec.slot_fields,
                                 lambda _, t: _replace_leaves(t, cut))
    updates, new_state = tx.update(grads_rest, state_rest, params_rest)
    new_params = optax.apply_updates(params_rest, updates)
    new_params = _replace_leaves(new_params, new_kernels)
    slot_index = {f: i for i, f in enumerate(spec.slot_fields)}
    new_state = _map_slot_trees(
        new_state, spec.slot_fields,
        lambda f, t: _replace_leaves(
            t, {kp: s[slot_index[f]] for kp, s in new_slots.items()}))
    return loss, {**variables, "params": new_params}, new_state

  return step
