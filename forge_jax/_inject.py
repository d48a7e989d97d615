"""``optax.inject_hyperparams(forge_jax.<family>)(...)`` in a FORGE step.

``optax.inject_hyperparams(factory)(...)`` returns a plain optax
``GradientTransformationExtraArgs`` whose state,
``InjectStatefulHyperparamsState``, holds the numeric hyperparameters in a
``hyperparams`` dict (which the user may change between steps), the states
of the scheduled ones, and the inner transform's state. Its ``update``
rebuilds ``factory(**hyperparams)`` at every call and runs it on the inner
state. That transform carries no :class:`ForgeSpec`, so this module
recognises it and, at each trace of the step, rebuilds the factory the same
way from the state: the rebuilt forge_jax transform's spec, pointed at the
inner state, drives the FORGE layers, so the kernels' packed hyperparameters
are this step's injected values.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from optax.schedules import _inject as optax_inject

from forge_jax.transforms import (ForgeSpec, ForgeTransformation,
                                  chain_member, chain_members, check_spec)


@dataclasses.dataclass(frozen=True)
class Injected:
  """What ``optax.inject_hyperparams`` closed over in one transform.

  Attributes:
    tx: the injected transform itself (its ``update`` updates every
      parameter that is not a FORGE kernel, as optax does).
    inner_factory: the wrapped factory (e.g. ``forge_jax.adamw``).
    other_hps: the arguments passed as they are (flags, masks, dtypes).
    sched_hps: the scheduled hyperparameters (stateful schedules).
    hyperparam_dtype: the dtype override, or ``None`` (the params' widest).
  """

  tx: Any
  inner_factory: Callable[..., Any]
  other_hps: dict
  sched_hps: dict
  hyperparam_dtype: Any


def recognise(tx) -> Optional[Injected]:
  """The parts of ``tx`` if it came from ``optax.inject_hyperparams``.

  Args:
    tx: any object passed to ``make_step`` as its transform.

  Returns:
    An :class:`Injected`, or ``None`` if ``tx`` is not an injected transform
    (or comes from an optax whose ``inject_hyperparams`` this module does not
    know).
  """
  update = getattr(tx, "update", None)
  if not isinstance(tx, optax.GradientTransformation) or not callable(update):
    return None
  if not getattr(update, "__qualname__", "").startswith("inject_hyperparams."):
    return None
  try:
    found = inspect.getclosurevars(update).nonlocals
  except (TypeError, ValueError):
    return None
  names = ("inner_factory", "other_hps", "sched_hps", "hyperparam_dtype")
  if not all(n in found for n in names):
    return None
  return Injected(tx, *(found[n] for n in names))


def check_state(opt_state) -> None:
  """Raises a ``TypeError`` unless ``opt_state`` is an injected state."""
  if not isinstance(opt_state, optax_inject.InjectStatefulHyperparamsState):
    raise TypeError(
        "make_step with an optax.inject_hyperparams transform needs the state"
        " its init() made (an InjectStatefulHyperparamsState), got "
        f"{type(opt_state).__name__}: build opt_state with tx.init(params) "
        "from the same tx")


def this_step_hyperparams(inj: Injected, opt_state, params) -> dict:
  """The hyperparameters ``inj.tx.update`` will call its factory with.

  Same expressions as optax's ``update_fn``: the numeric values of
  ``opt_state.hyperparams`` cast to ``hyperparam_dtype`` (default: the widest
  float dtype of ``params``), and the scheduled ones evaluated on their
  states. ``params`` is the whole parameter tree, as the optax reference
  step passes it.
  """
  return _hyperparams(inj, opt_state, _hyperparam_dtype(inj, params))


def _hyperparam_dtype(inj: Injected, params):
  """``hyperparam_dtype``, or the widest float dtype of ``params``."""
  if inj.hyperparam_dtype is not None:
    return inj.hyperparam_dtype
  return optax.tree.dtype(params, "highest")


def _hyperparams(inj: Injected, opt_state, dtype) -> dict:
  hp = {k: optax_inject._convert_floats(v, dtype)
        for k, v in opt_state.hyperparams.items()}
  hp.update({k: optax_inject._convert_floats(
      f(opt_state.hyperparams_states[k]), dtype)
             for k, f in inj.sched_hps.items()})
  return hp


def check_dtype_of_the_rest(inj: Injected, opt_state, params,
                            params_rest) -> None:
  """Refuses a step whose injected hyperparameters optax would cast to
  another dtype than in the reference step.

  Without ``hyperparam_dtype`` optax casts the hyperparameters that are not
  strongly typed arrays (a Python float set into ``opt_state.hyperparams``,
  a schedule's value) to the widest float dtype of the parameters it is
  given. The step gives it every parameter but the FORGE kernels
  (``params_rest``); where those are narrower than the whole tree (an fp32
  kernel beside bf16 norms, say), the other parameters would step with
  narrower hyperparameters than optax's own step uses (``b2 = 0.999`` is
  1.0 in bf16)."""
  if inj.hyperparam_dtype is not None:
    return
  loose = bool(inj.sched_hps) or any(
      not (isinstance(v, jax.Array) and not getattr(v, "weak_type", False))
      and jnp.issubdtype(jnp.result_type(v), jnp.floating)
      for v in opt_state.hyperparams.values())
  if not loose or not jax.tree.leaves(params_rest):
    return
  whole = optax.tree.dtype(params, "highest")
  rest = optax.tree.dtype(params_rest, "highest")
  if whole != rest:
    raise ValueError(
        f"make_step: optax.inject_hyperparams without hyperparam_dtype casts "
        f"scheduled or Python-float hyperparameters to the parameters' "
        f"widest dtype, {jnp.dtype(whole).name} for this model; the "
        f"parameters optax updates beside the FORGE kernels are at most "
        f"{jnp.dtype(rest).name}, so they would step with "
        f"{jnp.dtype(rest).name} hyperparameters. Pass "
        f"optax.inject_hyperparams(..., hyperparam_dtype=jnp."
        f"{jnp.dtype(whole).name}).")


def _chain_holds_forge(made) -> bool:
  """Whether ``made`` is an ``optax.chain`` with a forge_jax transform
  among its members (optax's own optimizers are chains of optax's)."""
  return any(chain_member(update) is not None
             for _, update in chain_members(made) or ())


def _not_forge(inj: Injected, made) -> TypeError:
  name = getattr(inj.inner_factory, "__qualname__", repr(inj.inner_factory))
  if _chain_holds_forge(made):
    # (A factory that makes an optax.chain holding a forge_jax transform:
    # clipping and the optimizer, say.)
    return TypeError(
        f"make_step: optax.inject_hyperparams wraps {name}, which makes an "
        "optax.chain, not a forge_jax transform: inject the forge_jax "
        "factory alone and keep the rest of the chain outside it, e.g. "
        "optax.chain(forge_jax.clip_by_global_norm(max_norm), "
        "optax.inject_hyperparams(forge_jax.adamw)(learning_rate=...)) "
        "(max_norm then a number).")
  return TypeError(
      f"make_step: optax.inject_hyperparams wraps {name}, which makes "
      f"{type(made).__name__}, not a forge_jax transform: FORGE layers "
      "update themselves in their own backward, so the step must know the "
      "optimizer's family. Wrap the forge_jax factory instead, e.g. "
      "optax.inject_hyperparams(forge_jax.adamw)(learning_rate=1e-3).")


def initial_product(inj: Injected):
  """What the factory makes with the initial hyperparameters, or ``None``
  where this optax keeps them where this module does not read them."""
  try:
    numeric = inspect.getclosurevars(inj.tx.init).nonlocals["numeric_hps"]
  except (TypeError, ValueError, KeyError):
    return None
  hp = dict(numeric)
  hp.update({k: f(f.init()) for k, f in inj.sched_hps.items()})
  return inj.inner_factory(**inj.other_hps, **hp)


def check_factory(inj: Injected) -> None:
  """Builds the factory once with the initial hyperparameters.

  Raises:
    TypeError: it does not make a forge_jax transform (e.g.
      ``optax.inject_hyperparams(optax.adamw)``).
  """
  made = initial_product(inj)
  if made is None:
    return  # checked at trace time
  if not isinstance(made, ForgeTransformation):
    raise _not_forge(inj, made)
  check_spec(made, "optax.inject_hyperparams over a forge_jax factory")


def spec_for(inj: Injected, opt_state, params) -> ForgeSpec:
  """The spec that drives FORGE layers in this step.

  Args:
    inj: the recognised injected transform.
    opt_state: its state before the step.
    params: the whole parameter tree.

  Returns:
    A :class:`ForgeSpec` reading the injected state: regimes 1 and 2, the
    rebuilt family's spec with its hyperparameters and shared arrays read
    from ``opt_state.inner_state``; regime 3, optax's injected ``update``
    itself, run per kernel.

  Raises:
    TypeError: ``opt_state`` is not the injected state, or the factory does
      not make a forge_jax transform (``optax.inject_hyperparams(optax.adamw)``
      cannot drive FORGE layers).
  """
  check_state(opt_state)
  hp = this_step_hyperparams(inj, opt_state, params)
  inner = inj.inner_factory(**inj.other_hps, **hp)
  if not isinstance(inner, ForgeTransformation):
    raise _not_forge(inj, inner)
  check_spec(inner, "optax.inject_hyperparams over a forge_jax factory")
  spec = inner.spec
  if spec.regime == 3:
    # Deferred: the layer runs optax's injected update on its own slice of
    # the state: the factory rebuilt from the slice's hyperparameters, cast
    # to the whole tree's dtype as optax's own step casts them (optax's
    # update would cast them to the one kernel's, bf16 for a bf16 kernel
    # in an fp32 model). The slice's hyperparameters and schedule states
    # are not written back (the other parameters' update advances them).
    dtype = _hyperparam_dtype(inj, params)

    def update(updates, state, params_one):
      inner = inj.inner_factory(**inj.other_hps,
                                **_hyperparams(inj, state, dtype))
      updates, inner_state = inner.update(updates, state.inner_state,
                                          params_one)
      return updates, state._replace(inner_state=inner_state)

    return ForgeSpec(rule=None, slot_fields=None, hparams=lambda state: {},
                     family=spec.family, update=update)
  return ForgeSpec(
      rule=spec.rule, slot_fields=spec.slot_fields,
      hparams=lambda state: spec.hparams(state.inner_state),
      weight_decay_mask=spec.weight_decay_mask, family=spec.family,
      layer_pass=spec.layer_pass,
      shared=lambda state: spec.shared(state.inner_state),
      momentum_decay=spec.momentum_decay,
      low_precision=spec.low_precision,
      sr_step=None if spec.sr_step is None else (
          lambda state: spec.sr_step(state.inner_state)))


def widened_like_optax(inj: Injected, opt_state, params):
  """``opt_state`` with each floating leaf that optax's injected update
  returns in a wider dtype cast to it beforehand; the others as they are.

  Injected hyperparameters are arrays that are not weakly typed, so
  optax's step promotes the state it multiplies by them: a bfloat16
  parameter's first moment (``b1 * mu``, no ``mu_dtype``) comes back
  float32, and stays so. A FORGE kernel returns its slots in their own
  dtypes (in place; a regime-3 kernel's state, stepped by optax's update,
  is stored back in its slots' dtypes too), so the slots are widened
  before the step, as optax's arithmetic widens them (exactly: every
  bfloat16 value is a float32 one); from the first step on they are
  float32 already and nothing is cast. Not traced at all where no
  floating leaf of the state is narrower than the hyperparameters (an
  fp32 model); see :func:`widened_by`.
  """
  check_state(opt_state)  # (before optax's update reads it)
  widths = [jnp.dtype(h.dtype).itemsize
            for h in jax.tree.leaves(opt_state.hyperparams)
            if jnp.issubdtype(getattr(h, "dtype", jnp.int32), jnp.floating)]
  if not widths or all(
      jnp.dtype(a.dtype).itemsize >= max(widths)
      for a in jax.tree.leaves(opt_state.inner_state)
      if jnp.issubdtype(getattr(a, "dtype", jnp.int32), jnp.floating)):
    return opt_state  # (nothing narrower than the hyperparameters)
  return widened_by(inj.tx.update, opt_state, params)


# What tracing an update that needs concrete values raises.
_NEEDS_VALUES = (jax.errors.ConcretizationTypeError,
                 jax.errors.TracerArrayConversionError,
                 jax.errors.TracerIntegerConversionError)


def has_narrow_floats(opt_state) -> bool:
  """Whether a floating leaf of ``opt_state`` is narrower than float32
  (a bfloat16 or float16 model's state), which optax's update may widen
  (:func:`widened_by`)."""
  return any(jnp.issubdtype(getattr(a, "dtype", jnp.int32), jnp.floating)
             and jnp.dtype(a.dtype).itemsize < 4
             for a in jax.tree.leaves(opt_state))


def widened_by(update, opt_state, params):
  """``opt_state`` with each floating leaf that ``update`` (an optax
  update: ``update(grads, state, params) -> (updates, state)``) returns
  in a wider dtype cast to it beforehand. A hyperparameter that is not
  weakly typed (injected, or a NumPy / JAX float32 scalar given to the
  factory) promotes a bfloat16 moment it multiplies to float32, which
  optax then keeps. Read from ``jax.eval_shape`` of ``update`` (no
  computation), so whatever optax's promotion does is followed; run
  instead in an eager step whose update optax cannot trace."""
  leaves, treedef = jax.tree.flatten(opt_state)

  def new_state(g, p):
    return update(g, opt_state, p)[1]

  try:
    out = jax.eval_shape(new_state, params, params)
  except _NEEDS_VALUES:
    # optax's update branches in Python on a hyperparameter, or reads an
    # array with NumPy (a weight-decay mask, say): only an eager step (a
    # concrete state) can run it, so it runs here; a traced one is left as
    # it is (optax's own jitted step fails there too, and so will the
    # step's update of the other parameters).
    if any(isinstance(a, jax.core.Tracer) for a in leaves):
      return opt_state
    out = new_state(params, params)
  want, want_def = jax.tree.flatten(out)
  if treedef != want_def:  # (a state optax's update reshapes: left as is)
    return opt_state

  def widened(a, w):
    dtype = getattr(a, "dtype", None)
    if (dtype is not None and jnp.issubdtype(dtype, jnp.floating)
        and jnp.issubdtype(w.dtype, jnp.floating)
        and jnp.dtype(w.dtype).itemsize > jnp.dtype(dtype).itemsize):
      return jnp.asarray(a).astype(w.dtype)
    return a

  return jax.tree.unflatten(treedef, list(map(widened, leaves, want)))
