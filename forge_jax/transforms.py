"""Optax-compatible optimizer transforms that also drive FORGE layers.

A FORGE transform *is* its optax counterpart (same signature, defaults, state
tree and ``update``), plus a :class:`ForgeSpec` that :func:`forge_jax.make_step`
uses to hand FORGE layers their slots and this step's hyperparameters. Every
parameter that is not a FORGE kernel is updated by the optax transform itself,
so it is updated exactly as optax would; a checkpoint of the state reads the
same as optax's. For the families optax lacks (:func:`scion`,
:func:`adam_mini`, :func:`adalomo`) the counterpart is an optax-style
transform defined here, built from optax's pieces where they exist.

The spec's ``family`` is classified (``pallas_kernels.classify``) and its
regime picks the path the layer's backward takes (``forge_jax._paths``):
regime 1 (SGD ... Lion) fuses entirely into the kernel's epilogue; regime 2
(:func:`lamb`, :func:`muon`, :func:`scion`) advances the state in the
epilogue and updates the weight in a per-layer pass over that state; regime
3 (:func:`adafactor`, :func:`sm3`, :func:`adam_mini`, :func:`adalomo`,
:func:`lars`) is deferred: the layer's ``G`` is formed and consumed inside
its own backward. Regime 4 (global-norm clipping) cannot be fused into one
backward (:func:`refuse_reason`); it runs as a two-pass step
(:mod:`forge_jax.clip`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import operator
from typing import Any, Callable, NamedTuple, Optional, Union
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics
# optax exports no names for these states.
from optax._src.transform import (
    ScaleByRmsWithCountState as _ScaleByRmsWithCountState,
    ScaleByRStdDevWithCountState as _ScaleByRStdDevWithCountState,
)
from optax.transforms._adding import WeightDecaySchedule as _WeightDecaySchedule

import pallas_kernels
from forge_jax import _context
from forge_jax import low_precision as _lowp


def _no_shared(state):
  del state
  return ()


@dataclasses.dataclass(frozen=True)
class ForgeSpec:
  """How a FORGE transform's state maps onto a FORGE layer's backward.

  Attributes:
    rule: the kernel's elementwise epilogue (regimes 1 and 2; ``None`` for a
      deferred family).
    slot_fields: for each of ``rule.slots``, the field of the inner optax
      state that holds that slot as a params-shaped tree: a field name, or a
      ``(StateClass, field_name)`` pair where a name alone is ambiguous (two
      states of the chain with a ``mu``). ``None`` (deferred families): every
      per-parameter field of the state travels with the layer.
    hparams: ``hparams(opt_state) -> dict`` of this step's hyperparameters by
      ``rule.hparams`` name, read from the state *before* the step (the
      ``weight_decay`` entry, for families that have one, unmasked).
    weight_decay_mask: optax's ``mask`` argument (tree, prefix or callable).
    family: the optimizer family, classified by ``pallas_kernels.classify``;
      its regime picks the layer's path (``regime``). Regime 4 is refused.
    layer_pass: regime 2: ``layer_pass(w, slots, outputs, h, shared) ->
      (w_new, slots)``, run in the layer's backward right after the epilogue
      on the *new* slots, the rule's ``outputs``, ``h = rule.unpack(...)`` and
      ``shared``; it never sees ``G``.
    update: regime 3: the optax ``update`` applied, inside the layer's
      backward, to that one parameter and its slice of the state.
    shared: regime 2: ``shared(opt_state)``, read-only arrays the layer pass
      needs (Muon's Newton-Schulz coefficients). Regime 3 derives its shared
      inputs (step counts) from the state itself.
    momentum_decay: for a family whose every update reads ``G`` only through
      one momentum slot, affine in ``G`` (``m' = decay * m + c * G``: SGD
      with momentum, no Nesterov), the name of that decay's hyperparameter;
      ``None`` otherwise. ``forge_jax.MultiSteps(..., mode="momentum")``
      needs it (``pallas_kernels.rules.momentum_accumulating``).
    low_precision: a :class:`forge_jax.low_precision.LowPrecision` when the
      transform keeps int8/fp8 moments, moments in a given float dtype, or
      stores bf16 weights by stochastic rounding (``moments=``,
      ``stochastic_rounding=``); ``None`` otherwise.
    sr_step: with ``low_precision``, ``sr_step(opt_state)``: this step's
      1-based number, hashed into the stochastic-rounding bits.
  """

  rule: Optional[pallas_kernels.UpdateRule]
  slot_fields: Optional[tuple[Union[str, tuple[type, str]], ...]]
  hparams: Callable[[Any], dict[str, jax.Array]]
  weight_decay_mask: Any = None
  family: Optional[str] = None
  layer_pass: Optional[Callable[..., Any]] = None
  update: Optional[optax.TransformUpdateFn] = None
  shared: Callable[[Any], Any] = _no_shared
  momentum_decay: Optional[str] = None
  low_precision: Any = None
  sr_step: Optional[Callable[[Any], Any]] = None
  regime: int = dataclasses.field(init=False)

  def __post_init__(self):
    if self.family is None:
      raise ValueError(
          "ForgeSpec needs its optimizer family (e.g. family='adamw'): "
          "pallas_kernels.classify(family) picks the layer's path")
    regime = pallas_kernels.classify(self.family)
    if regime.number == 4:
      raise ValueError(refuse_reason(self.family))
    n = regime.number
    object.__setattr__(self, "regime", n)
    need = {
        1: dict(rule=True, slot_fields=True, layer_pass=False, update=False),
        2: dict(rule=True, slot_fields=True, layer_pass=True, update=False),
        3: dict(rule=False, slot_fields=False, layer_pass=False, update=True),
    }[n]
    for name, wanted in need.items():
      if (getattr(self, name) is not None) != wanted:
        raise ValueError(
            f"ForgeSpec for {regime.family!r} (regime {n}: "
            f"{regime.path.description}) {'needs' if wanted else 'takes no'} "
            f"{name}")
    if n == 2 and self.rule.updates_weight:
      raise ValueError(
          f"ForgeSpec for {regime.family!r}: a regime-2 epilogue rule must "
          "leave the weight to the layer pass (updates_weight=False)")
    if self.low_precision is not None and n != 1:
      raise ValueError(
          f"ForgeSpec for {regime.family!r}: low-precision state is "
          "supported for regime-1 families only")


# The family and spec of each ForgeTransformation, by its update function:
# optax.chain keeps its members' functions, not the transforms, and
# forge_jax.clip finds a forge_jax optimizer inside a chain through this.
# Weak keys: an entry lives as long as its function. (A deferred family's
# spec holds that very function, so only its family name is kept.)
_CHAIN_MEMBERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _remember_member(update, spec: Optional[ForgeSpec]) -> None:
  if spec is None:
    return
  try:
    _CHAIN_MEMBERS[update] = (spec.family,
                              spec if spec.update is None else None)
  except TypeError:  # not weakly referenceable: not found inside a chain
    pass


def closure_vars(fn) -> dict:
  """The nonlocal names ``fn`` closes over (``{}`` where there are none to
  read): how optax's closures are looked into."""
  try:
    return inspect.getclosurevars(fn).nonlocals
  except (TypeError, ValueError):
    return {}


def chain_members(tx) -> Optional[list[tuple[Callable, Callable]]]:
  """``[(init, update), ...]`` of an ``optax.chain``, or ``None`` if ``tx``
  is not one (or comes from an optax whose ``chain`` this does not know)."""
  update, init = getattr(tx, "update", None), getattr(tx, "init", None)
  if not isinstance(tx, optax.GradientTransformation) or not callable(update):
    return None
  if getattr(update, "__qualname__", "") != "chain.<locals>.update_fn":
    return None
  updates = closure_vars(update).get("update_fns")
  inits = closure_vars(init).get("init_fns")
  if updates is None or inits is None or len(updates) != len(inits):
    return None
  return list(zip(inits, updates))


def chain_member(update) -> Optional[tuple[str, Optional[ForgeSpec]]]:
  """``(family, spec)`` of the forge_jax transform whose ``update`` this is
  (``spec`` is ``None`` for a deferred family, regime 3), or ``None``."""
  try:
    return _CHAIN_MEMBERS.get(update)
  except TypeError:
    return None


class ForgeTransformation(optax.GradientTransformationExtraArgs):
  """An optax ``GradientTransformation`` that can also drive FORGE layers.

  It *is* optax's ``(init, update)`` pair (``init, update = tx``,
  ``isinstance(tx, optax.GradientTransformation)``), carrying the
  :class:`ForgeSpec` that drives FORGE layers as the attribute ``spec``.
  """

  def __new__(cls, init, update, spec: ForgeSpec | None = None):
    self = super().__new__(cls, init, update)
    self.spec = spec
    _remember_member(update, spec)
    return self

  def _replace(self, **changes):
    spec = changes.pop("spec", self.spec)
    return ForgeTransformation(*super()._replace(**changes), spec)

  def __repr__(self) -> str:
    family = self.spec.family if self.spec is not None else None
    return f"ForgeTransformation(family={family!r})"


def check_spec(tx: ForgeTransformation, who: str) -> None:
  """Refuses a :class:`ForgeTransformation` that carries no
  :class:`ForgeSpec` (one made by hand around an optax transform: the
  constructor allows it, as copying and unpickling call it without one)."""
  if tx.spec is None:
    raise TypeError(
        f"{who} needs a forge_jax transform made by a forge_jax factory "
        "(e.g. forge_jax.adamw(...)); this ForgeTransformation carries no "
        "ForgeSpec (spec=None), so FORGE layers cannot know the "
        "optimizer's family. Build it with the factory instead of wrapping "
        "an optax transform in ForgeTransformation.")


def _holes_aware(mask):
  """The weight-decay ``mask`` given to the inner optax transform.

  In a step the inner transform sees parameter trees with ``None`` where the
  FORGE kernels are (they update themselves), and regime 3 runs it on a tree
  holding one kernel. A callable mask is then evaluated on the step's whole
  parameter tree (a mask that reads leaves, ``x.ndim > 1``, works as with
  optax) and its result cut to the holes of the tree optax gave it. Outside a
  step (``init``) it is the mask itself."""
  if not callable(mask):
    return mask

  def wrapped(tree):
    full = _context.current_full_params()
    if full is None:
      return _context.call_mask(mask, tree)
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is None)
    holes = {tuple(kp) for kp, v in flat if v is None}
    if not holes:
      return _context.call_mask(mask, tree)
    return jax.tree_util.tree_map_with_path(
        lambda kp, m: None if tuple(kp) in holes else m,
        _context.call_mask(mask, full))

  return wrapped


def _field(state, cls, name):
  """The first ``name`` field of a state of type ``cls`` in a chain's state."""
  if isinstance(state, cls):
    return getattr(state, name)
  if isinstance(state, tuple):
    for s in state:
      found = _field(s, cls, name)
      if found is not None:
        return found
  return None


def _count_of(state, cls):
  """The ``count`` of the first state of type ``cls`` in a chain's state.

  Raises:
    ValueError: the state holds none (it was made by another transform).
  """
  count = _field(state, cls, "count")
  if count is None:
    raise ValueError(
        f"opt_state has no {cls.__name__} (the step count this transform "
        "reads): was it made by this transform's init()?")
  return count


def _schedule_value(value, state, cls):
  """``value``, or where it is a schedule its value at ``cls``'s count."""
  return value(_count_of(state, cls)) if callable(value) else value


def _count_after(state, cls):
  """The step count ``cls``'s update will use: its ``count`` plus one."""
  return numerics.safe_increment(_count_of(state, cls))


def _forge(inner: optax.GradientTransformation,
           rule: pallas_kernels.UpdateRule,
           slot_fields,
           learning_rate: optax.ScalarOrSchedule,
           hparams: Callable[[Any], dict[str, Any]] = lambda state: {},
           *,
           family: str,
           weight_decay: Optional[optax.ScalarOrSchedule] = None,
           mask: Any = None,
           layer_pass: Optional[Callable[..., Any]] = None,
           shared: Callable[[Any], Any] = _no_shared,
           scope: Callable[[Any], Any] = lambda state: state,
           momentum_decay: Optional[str] = None,
           low_precision: Optional[_lowp.LowPrecision] = None,
           init_values: Optional[dict[str, float]] = None,
           ) -> ForgeTransformation:
  """``inner`` itself, plus the :class:`ForgeSpec` that drives FORGE layers.

  ``hparams(state)`` gives the family's own hyperparameters; this adds the
  step's ``lr`` (read at ``scale_by_learning_rate``'s count, as optax does)
  and, where the family has decoupled weight decay, ``weight_decay`` (read at
  ``add_decayed_weights``' count). ``scope(state)`` is the part of the state
  that FORGE kernels' transforms live in (Muon: its ``'muon'`` partition).

  With ``low_precision`` (``moments=`` or ``stochastic_rounding=``) the
  transform is not ``inner`` but
  :func:`forge_jax.low_precision.transform` of ``rule`` -- the same update,
  on the low-precision state; its hyperparameters are read from its one
  step count (``init_values``: the slots' initial values).
  """

  def all_hparams(state):
    h = dict(hparams(state))
    sub = scope(state)
    h["lr"] = _schedule_value(learning_rate, sub, optax.ScaleByScheduleState)
    if weight_decay is not None:
      h["weight_decay"] = _schedule_value(weight_decay, sub,
                                          _WeightDecaySchedule)
    return h

  if low_precision is not None:
    inner = _lowp.transform(low_precision, rule, all_hparams,
                            mask=_holes_aware(mask), init_values=init_values)

    def count(state):
      # The state's one step count, once it is known to be this
      # transform's state (optax's state has no such field).
      _lowp.check_state(low_precision, state)
      return state.count

    spec = ForgeSpec(
        rule=rule, slot_fields=tuple(slot_fields),
        hparams=lambda state: all_hparams(_lowp.count_view(count(state))),
        weight_decay_mask=mask, family=family, layer_pass=layer_pass,
        shared=shared, momentum_decay=momentum_decay,
        low_precision=low_precision,
        sr_step=lambda state: numerics.safe_increment(count(state)))
    return ForgeTransformation(inner.init, inner.update, spec)

  def optax_hparams(state):
    kind = _lowp.state_type(state)
    if kind is not None:
      raise ValueError(
          f"forge_jax.{family}: opt_state holds a low-precision state ("
          f"{kind.__qualname__}, made by a transform with moments= or "
          "stochastic_rounding=True); this transform keeps optax's state "
          "(moments=None, stochastic_rounding=False): was it made by this "
          f"transform's init()? {_lowp.REMEDY}.")
    return all_hparams(state)

  spec = ForgeSpec(rule=rule, slot_fields=tuple(slot_fields),
                   hparams=optax_hparams, weight_decay_mask=mask,
                   family=family,
                   layer_pass=layer_pass, shared=shared,
                   momentum_decay=momentum_decay)
  return ForgeTransformation(inner.init, inner.update, spec)


def _forge_deferred(inner: optax.GradientTransformation,
                    family: str) -> ForgeTransformation:
  """``inner`` itself, run per FORGE kernel inside its layer's backward
  (regime 3): the spec carries optax's own ``update``."""
  spec = ForgeSpec(rule=None, slot_fields=None, hparams=lambda state: {},
                   family=family, update=inner.update)
  return ForgeTransformation(inner.init, inner.update, spec)


def _stored_decay(decay, dtype):
  """``decay`` as optax's ``decay * moment`` applies it to a stored moment of
  ``dtype``: where JAX forms the product in the moment's dtype
  (:func:`_product_in_moment_dtype`: a Python float or int, a weakly typed
  JAX scalar such as ``jnp.asarray(0.9)``, or a decay of that very dtype) a
  bf16 moment sees 0.9 as 0.8984375; a NumPy scalar or a ``jnp.float32``
  keeps its own dtype (the product is then promoted, not rounded).
  ``dtype=None``: the parameters' dtype, fp32 here (bf16 parameters train on
  an fp32 ``G`` in FORGE anyway)."""
  if not _product_in_moment_dtype(decay, dtype):
    return decay
  return jnp.asarray(decay, dtype).astype(jnp.float32)


def _product_in_moment_dtype(decay, dtype) -> bool:
  """Whether JAX forms ``decay * moment`` in the moment's ``dtype``: for a
  Python number or a weakly typed JAX scalar (``jnp.asarray(0.9)``), and for
  a decay of that very dtype (``jnp.bfloat16(0.9)``); not for a NumPy or JAX
  scalar of another dtype (``np.float32``: the product is promoted).
  ``dtype=None``: the moment follows the parameters (see below)."""
  if dtype is None:
    return False
  return jnp.result_type(decay, jnp.dtype(dtype)) == jnp.dtype(dtype)


def _rounds_product(decay, dtype) -> float:
  """1.0 where optax's ``decay * moment`` is formed in the stored moment's
  ``dtype`` (:func:`_product_in_moment_dtype`) and that moment is narrower
  than fp32, so the kernel rounds that product to ``dtype``; else
  0.0. With ``dtype=None`` the moment follows the parameters: fp32, or bf16
  parameters, which keep the fp32 product (they train on an fp32 ``G``)."""
  return float(_product_in_moment_dtype(decay, dtype)
               and jnp.dtype(dtype).itemsize < 4)


def _adam_family_rule(rule, b1, mu_dtype):
  """``rule`` (Adam family, Muon) set to round ``b1 * mu`` to ``mu_dtype``
  where optax does (:func:`_rounds_product`): a static setting, so a kernel
  that never rounds carries no rounding code."""
  return rule.with_static(round_mu=_rounds_product(b1, mu_dtype))


def _adam_hparams(state, b1, b2, eps, eps_root,
                  mu_dtype=None) -> dict[str, Any]:
  """``scale_by_adam``'s constants and this step's bias corrections."""
  t = _count_after(state, optax.ScaleByAdamState)
  return dict(
      b1=b1, b1_m=_stored_decay(b1, mu_dtype),
      b2=b2, one_minus_b1=1 - b1, one_minus_b2=1 - b2,
      eps=eps, eps_root=eps_root,
      # optax.tree.bias_correction's denominators, same expressions.
      bc1=1 - b1**t, bc2=1 - b2**t,
      bc1_next=1 - b1**numerics.safe_increment(t),
  )


def _param_dtype(p):
  """The dtype optax gives a moment that follows its parameter."""
  return jnp.dtype(p.dtype)


def _dtype_or_param(dtype):
  """``dtype`` if given, else the parameter's (optax's ``mu_dtype=None``)."""
  return _param_dtype if dtype is None else (lambda p: jnp.dtype(dtype))


def sgd(
    learning_rate: optax.ScalarOrSchedule,
    momentum: Optional[float] = None,
    nesterov: bool = False,
    accumulator_dtype: Optional[Any] = None,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
    seed: Optional[int] = None,
) -> ForgeTransformation:
  r"""Stochastic gradient descent: ``optax.sgd``, FORGE-enabled.

  .. math::
    m_t = g_t + \mu m_{t-1},\quad
    w_t = w_{t-1} - \eta_t m_t
    \quad(\text{nesterov: } w_t = w_{t-1} - \eta_t (g_t + \mu m_t))

  (without ``momentum``: :math:`w_t = w_{t-1} - \eta_t g_t`). Same signature,
  defaults and state as :func:`optax.sgd` (which has no weight decay).

  Args:
    learning_rate: a scalar or an optax schedule.
    momentum: the trace's decay; ``None`` for plain SGD (no slot).
    nesterov: Nesterov momentum (only with ``momentum``).
    accumulator_dtype: dtype of the momentum trace; ``None`` follows params.
    moments, stochastic_rounding, seed: low-precision state (the momentum
      trace; see :func:`adamw`).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.sgd(optax.cosine_decay_schedule(0.1, 1000), momentum=0.9)
  """
  inner = optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov,
                    accumulator_dtype=accumulator_dtype)
  rule = pallas_kernels.sgd_rule(momentum=momentum is not None,
                                 nesterov=nesterov)
  if momentum is not None:
    rule = rule.with_static(
        round_trace=_rounds_product(momentum, accumulator_dtype))
  family = "sgd" if momentum is None else "sgd_momentum"
  return _forge(inner, rule, rule.slots, learning_rate,
                lambda state: {} if momentum is None else dict(
                    decay=momentum,
                    decay_m=_stored_decay(momentum, accumulator_dtype)),
                family=family,
                # The trace is affine in G and, without Nesterov, the only
                # way G reaches W: MultiSteps' momentum mode applies.
                momentum_decay=("decay" if momentum is not None
                                and not nesterov else None),
                low_precision=_lowp.make(
                    "sgd", rule, moments, stochastic_rounding, seed,
                    (_dtype_or_param(accumulator_dtype),) * len(rule.slots),
                    ((0, "accumulator_dtype", accumulator_dtype),)
                    if rule.slots else ()))


def adagrad(
    learning_rate: optax.ScalarOrSchedule,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
    seed: Optional[int] = None,
) -> ForgeTransformation:
  r"""Adagrad: ``optax.adagrad``, FORGE-enabled.

  .. math::
    s_t = s_{t-1} + g_t^2,\quad
    w_t = w_{t-1} - \eta_t\, g_t / \sqrt{s_t + \epsilon}

  (a coordinate with :math:`s_t = 0` does not move). Same signature, defaults
  and state (``ScaleByRssState``) as :func:`optax.adagrad`.

  Args:
    learning_rate: a scalar or an optax schedule.
    initial_accumulator_value: initial :math:`s_0`.
    eps: added inside the square root.
    moments, stochastic_rounding, seed: low-precision state (the
      accumulator, a second moment; see :func:`adamw`).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adagrad(1e-2)
  """
  inner = optax.adagrad(learning_rate,
                        initial_accumulator_value=initial_accumulator_value,
                        eps=eps)
  rule = pallas_kernels.adagrad_rule()
  return _forge(inner, rule, ("sum_of_squares",),
                learning_rate, lambda state: dict(eps=eps), family="adagrad",
                low_precision=_lowp.make("adagrad", rule, moments,
                                         stochastic_rounding, seed,
                                         (_param_dtype,)),
                init_values={"sum_of_squares": initial_accumulator_value})


def rmsprop(
    learning_rate: optax.ScalarOrSchedule,
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: Optional[float] = None,
    nesterov: bool = False,
    bias_correction: bool = False,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
    seed: Optional[int] = None,
) -> ForgeTransformation:
  r"""RMSprop: ``optax.rmsprop``, FORGE-enabled, with all of its options.

  .. math::
    \nu_t = \rho \nu_{t-1} + (1-\rho) g_t^2,\quad
    u_t = -\eta_t\, g_t / \sqrt{\nu_t + \epsilon},\quad
    w_t = w_{t-1} + u_t

  ``centered`` subtracts the squared EMA of :math:`g` from :math:`\nu_t`;
  ``eps_in_sqrt=False`` uses :math:`\sqrt{\nu_t} + \epsilon`;
  ``bias_correction`` divides the EMAs by :math:`1-\rho^t`; ``momentum``
  (and ``nesterov``) trace the lr-scaled :math:`u_t`, as optax does. Same
  signature, defaults and state as :func:`optax.rmsprop`.

  Args:
    learning_rate: a scalar or an optax schedule.
    decay, eps, initial_scale, eps_in_sqrt, centered, momentum, nesterov,
      bias_correction: as in :func:`optax.rmsprop`.
    moments, stochastic_rounding, seed: low-precision state (``nu`` is a
      second moment; see :func:`adamw`).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.rmsprop(1e-3, centered=True, momentum=0.9)
  """
  inner = optax.rmsprop(learning_rate, decay=decay, eps=eps,
                        initial_scale=initial_scale, eps_in_sqrt=eps_in_sqrt,
                        centered=centered, momentum=momentum,
                        nesterov=nesterov, bias_correction=bias_correction)
  rule = pallas_kernels.rmsprop_rule(
      centered=centered, eps_in_sqrt=eps_in_sqrt,
      bias_correction=bias_correction, momentum=momentum is not None,
      nesterov=nesterov)
  count_state = (_ScaleByRStdDevWithCountState if centered
                 else _ScaleByRmsWithCountState)
  low_precision = _lowp.make("rmsprop", rule, moments, stochastic_rounding,
                             seed, (_param_dtype,) * len(rule.slots))
  if centered and low_precision is not None and any(
      f is not None for f in low_precision.formats):
    raise ValueError(
        f"forge_jax.rmsprop: moments={moments!r} with centered=True is not "
        "supported: centered RMSprop divides by sqrt(nu - mu**2), a "
        "variance that is the difference of two moments, and int8/fp8 codes "
        "cannot resolve it (it rounds to zero or below: huge steps or NaN "
        "weights). Use centered=False, or float moments (moments=None or a "
        "float dtype such as jnp.bfloat16).")

  def hparams(state):
    h = dict(decay=decay, one_minus_decay=1 - decay, eps=eps)
    if bias_correction:
      h["bc"] = 1 - decay**_count_after(state, count_state)
    if momentum is not None:
      h["momentum"] = momentum
    return h

  return _forge(inner, rule, rule.slots, learning_rate, hparams,
                family="rmsprop", low_precision=low_precision,
                init_values={"nu": initial_scale})


def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = False,
    moments: Any = None,
    stochastic_rounding: bool = False,
    seed: Optional[int] = None,
) -> ForgeTransformation:
  r"""Adam: ``optax.adam``, FORGE-enabled.

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\\
    w_t = w_{t-1} - \eta_t \frac{m_t/(1-\beta_1^t)}
          {\sqrt{v_t/(1-\beta_2^t) + \epsilon_{root}} + \epsilon}

  Same signature, defaults and state as :func:`optax.adam`; ``nesterov`` as
  there (:func:`nadam`).

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2, eps, eps_root: Adam's constants, as in optax.
    mu_dtype: dtype of the first moment; ``None`` follows the parameters.
    nesterov: Nesterov momentum (NAdam).
    moments, stochastic_rounding, seed: low-precision state (see
      :func:`adamw`).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adam(optax.warmup_cosine_decay_schedule(0, 1e-3, 100, 1000))
  """
  inner = optax.adam(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                     mu_dtype=mu_dtype, nesterov=nesterov)
  rule = _adam_family_rule(pallas_kernels.adam_rule(nesterov=nesterov), b1,
                           mu_dtype)
  family = "nadam" if nesterov else "adam"
  return _forge(inner, rule,
                ("mu", "nu"), learning_rate,
                lambda state: _adam_hparams(state, b1, b2, eps, eps_root,
                                            mu_dtype),
                family=family,
                low_precision=_lowp.make(
                    family, rule, moments, stochastic_rounding, seed,
                    (_dtype_or_param(mu_dtype), _param_dtype),
                    ((0, "mu_dtype", mu_dtype),)))


nadam = functools.partial(adam, nesterov=True)
nadam.__doc__ = """NAdam: ``optax.nadam``, FORGE-enabled (:func:`adam` with
``nesterov=True``; same signature, defaults and state as ``optax.nadam``)."""


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    *,
    nesterov: bool = False,
    moments: Any = None,
    stochastic_rounding: bool = False,
    seed: Optional[int] = None,
) -> ForgeTransformation:
  r"""AdamW with decoupled weight decay: ``optax.adamw``, FORGE-enabled.

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\\
    w_t = w_{t-1} - \eta_t\Big(\frac{m_t/(1-\beta_1^t)}
          {\sqrt{v_t/(1-\beta_2^t) + \epsilon_{root}} + \epsilon}
          + \lambda w_{t-1}\Big)

  Same signature, defaults and state (``(ScaleByAdamState, ..., ...)``) as
  :func:`optax.adamw`. Used with plain gradients it is ``optax.adamw``; used
  through :func:`forge_jax.make_step`, FORGE layers apply the same update to
  their kernels inside their backward, and the weight-decay ``mask`` covers
  them too.

  Args:
    learning_rate: a scalar or an optax schedule (read once per step as a
      runtime scalar: a schedule never recompiles the kernel).
    b1, b2, eps, eps_root: Adam's constants, as in optax.
    mu_dtype: dtype of the first moment; ``None`` follows the parameters.
    weight_decay: decoupled weight decay rate (scalar or schedule).
    mask: which parameters get weight decay (tree, prefix or callable).
    nesterov: Nesterov momentum, as in ``optax.adamw``.
    moments: how the moments are stored: ``None`` (default) as optax
      stores them; ``"int8"`` (8-bit integer codes), ``"fp8"`` (the same
      as ``"fp8_e4m3"``: float8_e4m3fn codes) or ``"fp8_e5m2"``, each with
      one float32 scale per 64 consecutive elements of a row, for
      parameters of at least 4096 elements (smaller ones keep float
      moments); a ``pallas_kernels.quant.MomentFormat``; a tuple with one
      of those per moment (``("fp8_e4m3", "fp8_e5m2")``: ``mu`` e4m3, ``nu``
      e5m2); or a float dtype or its name (``jnp.bfloat16``,
      ``"bfloat16"``: every moment stored in it). The state is
      then a ``forge_jax.low_precision`` NamedTuple (docs/optimizers.md,
      low-precision state).
    stochastic_rounding: store bfloat16 parameters by stochastic rounding
      (unbiased; the default rounds to nearest). Other dtypes are stored as
      usual.
    seed: the stochastic-rounding seed (``None``: 0; each parameter hashes
      its own from it and its key path).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adamw(optax.cosine_decay_schedule(1e-3, 1000))
    >>> opt_state = tx.init(variables["params"])
    >>> step = jax.jit(forge_jax.make_step(loss_fn, tx), donate_argnums=(0, 1))

    With int8 moments and stochastic rounding of bf16 weights:

    >>> tx = forge_jax.adamw(1e-3, moments="int8", stochastic_rounding=True)
  """
  inner = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                      mu_dtype=mu_dtype, weight_decay=weight_decay,
                      mask=_holes_aware(mask),
                      nesterov=nesterov)
  rule = _adam_family_rule(pallas_kernels.adamw_rule(nesterov=nesterov), b1,
                           mu_dtype)
  return _forge(inner, rule,
                ("mu", "nu"), learning_rate,
                lambda state: _adam_hparams(state, b1, b2, eps, eps_root,
                                            mu_dtype),
                weight_decay=weight_decay, mask=mask, family="adamw",
                low_precision=_lowp.make(
                    "nadamw" if nesterov else "adamw", rule, moments,
                    stochastic_rounding, seed,
                    (_dtype_or_param(mu_dtype), _param_dtype),
                    ((0, "mu_dtype", mu_dtype),)))


nadamw = functools.partial(adamw, nesterov=True)
nadamw.__doc__ = """NAdamW: ``optax.nadamw``, FORGE-enabled (:func:`adamw` with
``nesterov=True``; same signature, defaults and state as ``optax.nadamw``)."""


def adamax(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
    seed: Optional[int] = None,
) -> ForgeTransformation:
  r"""Adamax: ``optax.adamax``, FORGE-enabled.

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
    v_t = \max(|g_t| + \epsilon, \beta_2 v_{t-1}),\quad
    w_t = w_{t-1} - \eta_t \frac{m_t/(1-\beta_1^t)}{v_t}

  Same signature, defaults and state as :func:`optax.adamax`.

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2, eps: as in optax.
    moments, stochastic_rounding, seed: low-precision state (``nu``, the
      infinity norm, is kept as a second moment: non-negative, floored;
      see :func:`adamw`).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adamax(2e-3)
  """
  inner = optax.adamax(learning_rate, b1=b1, b2=b2, eps=eps)

  def hparams(state):
    t = _count_after(state, optax.ScaleByAdamState)
    return dict(b1=b1, one_minus_b1=1 - b1, b2=b2, eps=eps, bc1=1 - b1**t)

  rule = pallas_kernels.adamax_rule()
  return _forge(inner, rule, ("mu", "nu"),
                learning_rate, hparams, family="adamax",
                low_precision=_lowp.make("adamax", rule, moments,
                                         stochastic_rounding, seed,
                                         (_param_dtype, _param_dtype)))


def radam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    threshold: float = 5.0,
    *,
    nesterov: bool = False,
    moments: Any = None,
    stochastic_rounding: bool = False,
    seed: Optional[int] = None,
) -> ForgeTransformation:
  r"""Rectified Adam: ``optax.radam``, FORGE-enabled.

  Adam whose step is rectified by
  :math:`r_t = \sqrt{\frac{(\rho_t-4)(\rho_t-2)\rho_\infty}
  {(\rho_\infty-4)(\rho_\infty-2)\rho_t}}` while
  :math:`\rho_t \ge` ``threshold``, and is plain bias-corrected momentum
  before. :math:`r_t` and the switch depend only on the step count: they are
  runtime scalars of the kernel. Same signature, defaults and state as
  :func:`optax.radam`.

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2, eps, eps_root, threshold, nesterov: as in optax.
    moments, stochastic_rounding, seed: low-precision state (see
      :func:`adamw`).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.radam(1e-3)
  """
  inner = optax.radam(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                      threshold=threshold, nesterov=nesterov)
  ro_inf = 2.0 / (1.0 - b2) - 1.0

  def hparams(state):
    # scale_by_radam's expressions, term for term.
    count_inc = _count_after(state, optax.ScaleByAdamState)
    b2t = b2**count_inc
    ro = ro_inf - 2 * count_inc * b2t / (1 - b2t)
    r = jnp.sqrt((ro - 4.0) * (ro - 2.0) * ro_inf
                 / ((ro_inf - 4.0) * (ro_inf - 2.0) * ro))
    rectify = ro >= threshold
    return dict(_adam_hparams(state, b1, b2, eps, eps_root),
                r=jnp.where(rectify, r, 0.0), rectify=rectify)

  rule = pallas_kernels.radam_rule(nesterov=nesterov)
  return _forge(inner, rule,
                ("mu", "nu"), learning_rate, hparams, family="radam",
                low_precision=_lowp.make("radam", rule, moments,
                                         stochastic_rounding, seed,
                                         (_param_dtype, _param_dtype)))


def lion(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[Any] = None,
    weight_decay: optax.ScalarOrSchedule = 1e-3,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
    seed: Optional[int] = None,
) -> ForgeTransformation:
  r"""Lion: ``optax.lion``, FORGE-enabled.

  .. math::
    w_t = w_{t-1} - \eta_t\big(\mathrm{sign}(\beta_1 m_{t-1}
          + (1-\beta_1) g_t) + \lambda w_{t-1}\big),\quad
    m_t = \beta_2 m_{t-1} + (1-\beta_2) g_t

  Same signature, defaults and state as :func:`optax.lion`; the weight-decay
  ``mask`` covers FORGE kernels too.

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2: as in optax.
    mu_dtype: dtype of the moment; ``None`` follows the parameters.
    weight_decay: decoupled weight decay rate (scalar or schedule).
    mask: which parameters get weight decay (tree, prefix or callable).
    moments, stochastic_rounding, seed: low-precision state (see
      :func:`adamw`).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.lion(1e-4, weight_decay=1e-2)
  """
  inner = optax.lion(learning_rate, b1=b1, b2=b2, mu_dtype=mu_dtype,
                     weight_decay=weight_decay, mask=_holes_aware(mask))
  rule = pallas_kernels.lion_rule().with_static(
      round_b1=_rounds_product(b1, mu_dtype),
      round_b2=_rounds_product(b2, mu_dtype))
  return _forge(
      inner, rule, ("mu",), learning_rate,
      # b1 and b2 both multiply the stored moment (scale_by_lion).
      lambda state: dict(b1=_stored_decay(b1, mu_dtype), one_minus_b1=1 - b1,
                         b2=_stored_decay(b2, mu_dtype), one_minus_b2=1 - b2),
      weight_decay=weight_decay, mask=mask, family="lion",
      low_precision=_lowp.make("lion", rule, moments, stochastic_rounding,
                               seed, (_dtype_or_param(mu_dtype),),
                               ((0, "mu_dtype", mu_dtype),)))


# --- Regime 2: the epilogue advances the state, a layer pass updates W ---------


def lamb(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
) -> ForgeTransformation:
  r"""LAMB: ``optax.lamb``, FORGE-enabled (regime 2).

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\\
    u_t = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t) + \epsilon_{root}}
          + \epsilon} + \lambda w_{t-1},\quad
    w_t = w_{t-1} - \eta_t \frac{\|w_{t-1}\|}{\|u_t\|} u_t

  (the trust ratio is 1 where either norm is 0). In a FORGE layer the fused
  kernel's epilogue advances only the moments (``G`` stays in registers) and
  leaves ``W``; a per-layer pass in the same backward then forms ``u_t`` from
  the *new* moments, the trust ratio from the two layer norms (optax's own
  ``scale_by_trust_ratio``) and the new weight. Same signature, defaults and
  state as :func:`optax.lamb`.

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2, eps, eps_root: Adam's constants, as in optax.
    weight_decay: weight decay rate (scalar or schedule), added before the
      trust ratio.
    mask: which parameters get weight decay (tree, prefix or callable).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.lamb(optax.linear_schedule(2e-3, 0.0, 1000),
    ...                     weight_decay=1e-2)
  """
  _lowp.refuse("lamb", moments, stochastic_rounding)
  inner = optax.lamb(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                     weight_decay=weight_decay, mask=_holes_aware(mask))
  trust_ratio = optax.scale_by_trust_ratio()

  def layer_pass(w, slots, outputs, h, shared):
    del outputs, shared
    mu, nu = slots
    # scale_by_adam's update from the new moments, then add_decayed_weights,
    # scale_by_trust_ratio (optax's own) and the learning rate.
    u = (mu / h["bc1"]) / (jnp.sqrt(nu / h["bc2"] + h["eps_root"]) + h["eps"])
    u = u + h["weight_decay"] * w
    u, _ = trust_ratio.update(u, optax.EmptyState(), w)
    return w + (-h["lr"]) * u, slots

  return _forge(inner, pallas_kernels.lamb_rule(), ("mu", "nu"),
                learning_rate,
                lambda state: _adam_hparams(state, b1, b2, eps, eps_root),
                family="lamb", weight_decay=weight_decay, mask=mask,
                layer_pass=layer_pass)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = (3.4445, -4.7750, 2.0315),
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    weight_decay_mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = 'frobenius',
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: Optional[float] = None,
    moments: Any = None,
    stochastic_rounding: bool = False,
) -> ForgeTransformation:
  r"""Muon: ``optax.contrib.muon``, FORGE-enabled (regime 2).

  .. math::
    B_t = \beta B_{t-1} + (1-\beta) G_t,\quad
    \hat B_t = B_t / (1-\beta^t)
    \ (\text{nesterov: } \beta B_t/(1-\beta^{t+1}) + (1-\beta) G_t/(1-\beta^t)),\\
    w_t = w_{t-1} - \eta_t\big(s\,\mathrm{NS}(\hat B_t) + \lambda w_{t-1}\big)

  with :math:`\mathrm{NS}` optax's Newton-Schulz orthogonalisation and
  :math:`s` its shape scaling. In a FORGE layer the weight-gradient GEMM
  accumulates straight into the momentum: the fused kernel's epilogue
  writes :math:`B_t` and :math:`\hat B_t` (the Nesterov term's ``G`` is
  consumed in registers) and leaves ``W``; no weight-sized ``G`` is ever
  stored. A per-layer pass in the same backward then runs optax's own
  ``orthogonalize_via_newton_schulz`` on :math:`\hat B_t` and updates ``W``.
  Parameters that are not 2-D (biases) go through Muon's AdamW part, run by
  optax itself. Same signature, defaults and state as
  :func:`optax.contrib.muon`.

  Args:
    learning_rate, ns_coeffs, ns_steps, beta, eps, weight_decay,
      weight_decay_mask, mu_dtype, nesterov, adaptive, preconditioning,
      adam_b1, adam_b2, adam_eps_root, adam_weight_decay, adam_learning_rate,
      consistent_rms: as in :func:`optax.contrib.muon`.
    muon_weight_dimension_numbers: must be ``None`` (every 2-D parameter is a
      Muon matrix with axes ``(0, 1)``, which is what FORGE kernels are).

  Returns:
    A :class:`ForgeTransformation`.

  Raises:
    ValueError: ``muon_weight_dimension_numbers`` is given, or ``moments``
      or ``stochastic_rounding`` is set (low-precision state is for the
      regime-1 families).

  Example:
    >>> tx = forge_jax.muon(optax.cosine_decay_schedule(2e-2, 1000))
  """
  _lowp.refuse("muon", moments, stochastic_rounding)
  from optax.contrib import _muon

  if muon_weight_dimension_numbers is not None:
    raise ValueError(
        "forge_jax.muon: muon_weight_dimension_numbers is not supported on "
        "the FORGE path: FORGE kernels are 2-D (in, out) matrices, which Muon"
        " orthogonalises with its default dimension numbers (0, 1). Use "
        "optax.contrib.muon with fused=False layers for other layouts.")
  inner = optax.contrib.muon(
      learning_rate, ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta,
      eps=eps, weight_decay=weight_decay,
      weight_decay_mask=_holes_aware(weight_decay_mask),
      mu_dtype=mu_dtype, nesterov=nesterov, adaptive=adaptive,
      preconditioning=preconditioning, adam_b1=adam_b1, adam_b2=adam_b2,
      adam_eps_root=adam_eps_root, adam_weight_decay=adam_weight_decay,
      adam_learning_rate=adam_learning_rate,
      muon_weight_dimension_numbers=muon_weight_dimension_numbers,
      consistent_rms=consistent_rms)
  dims = _muon.MuonDimensionNumbers()
  shape_scale = _muon.scale_by_shape(dims, consistent_rms)

  def scope(state):  # FORGE kernels are 2-D: Muon's partition
    return state.inner_states["muon"]

  def hparams(state):
    t = _count_after(scope(state), _muon.MuonState)
    return dict(b1=beta, b1_m=_stored_decay(beta, mu_dtype),
                one_minus_b1=1 - beta,
                # optax.tree.bias_correction's denominators, same expressions.
                bc1=1 - beta**t,
                bc1_next=1 - beta**numerics.safe_increment(t))

  def shared(state):
    return _field(scope(state), _muon.MuonState, "ns_coeffs")

  def layer_pass(w, slots, outputs, h, ns_coeffs_):
    # scale_by_muon from the epilogue's mu_hat, then scale_by_shape,
    # add_decayed_weights and the learning rate, as optax chains them.
    (mu_hat,) = outputs
    u = _muon.orthogonalize_via_newton_schulz(
        mu_hat, ns_coeffs_, ns_steps, preconditioning, eps, dims)
    if adaptive:
      u = jnp.sum(mu_hat.conj() * u) * u
    u, _ = shape_scale.update(u, optax.EmptyState())
    u = u + h["weight_decay"] * w
    return w + (-h["lr"]) * u, slots

  return _forge(inner,
                _adam_family_rule(pallas_kernels.muon_rule(nesterov=nesterov),
                                  beta, mu_dtype),
                ((_muon.MuonState, "mu"),), learning_rate, hparams,
                family="muon", weight_decay=weight_decay,
                mask=weight_decay_mask, layer_pass=layer_pass, shared=shared,
                scope=scope)


class ScaleByScionState(NamedTuple):
  """State of :func:`scale_by_scion`: the gradient average ``d`` per
  parameter (``mu``, the parameter's shape and dtype)."""
  mu: optax.Updates


def _scion_check_params(params) -> None:
  """Scion's oracle is defined here for matrices and for vectors/scalars."""
  for path, p in jax.tree_util.tree_leaves_with_path(params):
    if jnp.ndim(p) > 2:
      raise ValueError(
          f"forge_jax.scion: the parameter at {jax.tree_util.keystr(path)} "
          f"has shape {tuple(jnp.shape(p))} ({jnp.ndim(p)} axes). Scion's "
          "linear minimisation oracle is defined here for matrices (the "
          "spectral-norm ball, by Newton-Schulz) and for vectors and scalars"
          " (the RMS-norm ball); a kernel with more axes (a DenseGeneral "
          "with several input or feature axes, an nn.scan stack, a "
          "convolution) has no single operator norm to take. Give that "
          "layer a 2-D kernel (forge_jax.Dense, or a DenseGeneral with one "
          "input and one feature axis).")


def _scion_direction(d, scale: float, ns_coeffs, ns_steps: int, eps: float):
  """``scale`` times Scion's oracle direction at ``d``: ``-lmo(d)`` for the
  ball of radius ``scale`` (Pethick et al. 2025).

  A matrix ``(fan_in, fan_out)`` (Flax's kernel layout) takes the ball of
  the RMS-to-RMS operator norm, ``sqrt(fan_in/fan_out) * ||.||_2``, whose
  oracle is ``sqrt(fan_out/fan_in) * U V^T`` (``d = U S V^T``), with ``U
  V^T`` from optax's Newton-Schulz iteration (``d`` divided by its
  Frobenius norm plus ``eps``, then ``ns_steps`` quintic steps with
  ``ns_coeffs``). A vector (bias, norm scale) or scalar is a one-column
  matrix: the same norm is its RMS, whose oracle is ``d / RMS(d)``
  (``RMS(d) + eps`` here). Computed in fp32 at least.
  """
  from optax.contrib import _muon

  d = d.astype(jnp.promote_types(d.dtype, jnp.float32))
  if d.ndim == 2:
    fan_in, fan_out = d.shape
    o = _muon.orthogonalize_via_newton_schulz(
        d, jnp.asarray(ns_coeffs, d.dtype), ns_steps, "frobenius", eps)
    return (scale * (fan_out / fan_in) ** 0.5) * o
  rms = jnp.sqrt(jnp.mean(numerics.abs_sq(d)))
  return scale * (d / (rms + eps))


def _scion_check_ns(ns_coeffs, ns_steps) -> None:
  """Refuses Newton-Schulz coefficients optax's muon would refuse: a name
  (muon's presets are not taken here), a shape other than ``(3,)`` or
  ``(n, 3)``, or more rows than ``ns_steps`` (a ``(n, 3)`` array runs its
  ``n`` rows, one per step, whatever ``ns_steps`` says)."""
  if isinstance(ns_coeffs, str):
    raise ValueError(
        f"forge_jax.scion: ns_coeffs={ns_coeffs!r}: named coefficient "
        "presets are not supported here; pass the coefficients, (3,) or "
        "(n, 3)")
  shape = jnp.asarray(ns_coeffs).shape
  if len(shape) not in (1, 2) or shape[-1] != 3:
    raise ValueError(f"forge_jax.scion: ns_coeffs must have shape (3,) or "
                     f"(n, 3), got {shape}")
  if len(shape) == 2 and shape[0] > ns_steps:
    raise ValueError(
        f"forge_jax.scion: ns_coeffs has {shape[0]} rows, one per "
        f"Newton-Schulz step, but ns_steps={ns_steps}: give at most ns_steps "
        "rows (as optax.contrib.muon requires), or raise ns_steps")


def _concrete_number(x) -> float | None:
  """``x`` as a Python float where it is one number known now (a plain
  number, or a 0-d NumPy or JAX array outside a trace), else ``None``."""
  if isinstance(x, numbers.Real):
    return float(x)
  if (isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0
      and not isinstance(x, jax.core.Tracer)):
    return float(x)
  return None


def _scion_check_scalars(momentum, scale) -> None:
  """Refuses a ``momentum`` outside ``(0, 1]`` or a ``scale`` that is not
  positive, where they are known when the transform is built (under
  ``optax.inject_hyperparams`` or ``jit`` they are traced arrays). With
  ``momentum = 0`` no gradient ever enters the average; a negative
  ``scale`` turns the oracle, and the step, up the gradient."""
  m, r = _concrete_number(momentum), _concrete_number(scale)
  if m is not None and not 0 < m <= 1:
    raise ValueError(
        f"forge_jax.scion: momentum={m!r} is outside (0, 1]: it is "
        "the weight of the new gradient in the average (1 minus the usual "
        "momentum; 1: no averaging), and at 0 no gradient would reach the "
        "weights")
  if r is not None and not r > 0:
    raise ValueError(
        f"forge_jax.scion: scale={r!r} must be positive: it is the "
        "radius of every parameter's norm ball (a negative one steps up "
        "the gradient)")


def scale_by_scion(
    momentum: float = 0.1,
    scale: float = 1.0,
    ns_coeffs: Any = (3.4445, -4.7750, 2.0315),
    ns_steps: int = 5,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
  r"""Scion's direction: the gradient average and its oracle, scaled.

  .. math::
    d_t = \alpha g_t + (1-\alpha) d_{t-1},\quad
    u_t = -\mathrm{lmo}_{\rho}(d_t)

  (:func:`_scion_direction`: spectral for a matrix, RMS for a vector or
  scalar; ``momentum`` is :math:`\alpha`, ``scale`` is :math:`\rho`). The
  oracle reads the average as stored (the parameter's dtype).

  Raises:
    ValueError: ``momentum`` is outside ``(0, 1]`` or ``scale`` is not
      positive (plain numbers); ``ns_coeffs`` is not ``(3,)`` or ``(n, 3)``
      with ``n <= ns_steps`` (optax's muon's check); at ``init``, a
      parameter with more than two axes.
  """
  _scion_check_scalars(momentum, scale)
  _scion_check_ns(ns_coeffs, ns_steps)

  def init_fn(params):
    _scion_check_params(params)
    return ScaleByScionState(mu=optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    mu = jax.tree.map(
        lambda g, m: None if g is None else (
            momentum * g + (1 - momentum) * m).astype(m.dtype),
        updates, state.mu, is_leaf=lambda x: x is None)
    u = jax.tree.map(
        lambda m: None if m is None else _scion_direction(
            m, scale, ns_coeffs, ns_steps, eps),
        mu, is_leaf=lambda x: x is None)
    return u, ScaleByScionState(mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)


def scion(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.1,
    scale: float = 1.0,
    unconstrained: bool = False,
    ns_coeffs: Any = (3.4445, -4.7750, 2.0315),
    ns_steps: int = 5,
    eps: float = 1e-8,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
) -> ForgeTransformation:
  r"""Scion (Pethick et al. 2025, "Training Deep Learning Models with
  Norm-Constrained LMOs", arXiv:2502.07529), FORGE-enabled (regime 2).

  .. math::
    d_t = \alpha g_t + (1-\alpha) d_{t-1},\\
    w_t = (1-\gamma_t) w_{t-1} + \gamma_t\,\mathrm{lmo}_{\rho}(d_t)
    \quad(\text{unconstrained: } w_t = w_{t-1} + \gamma_t\,
    \mathrm{lmo}_{\rho}(d_t))

  (the paper's SCG and uSCG; :math:`\gamma_t` the learning rate,
  :math:`\alpha` = ``momentum``, the weight of the *new* gradient,
  :math:`\rho` = ``scale``, the radius). :math:`\mathrm{lmo}_\rho` is the
  linear minimisation oracle of the radius-:math:`\rho` ball: for a
  ``(fan_in, fan_out)`` matrix, of the RMS-to-RMS operator norm,
  :math:`-\rho\sqrt{\text{fan\_out}/\text{fan\_in}}\,UV^\top` by optax's
  Newton-Schulz iteration (Muon's); for a vector or scalar (bias, norm
  scale: a one-column matrix), of its RMS norm, :math:`-\rho\, d/\mathrm{RMS}(d)`.
  Every parameter takes it, with one radius. Computed as the optax chain
  :func:`scale_by_scion`, ``add_decayed_weights(1.0)`` (the constrained
  variant's :math:`-\gamma_t w_{t-1}`), ``scale_by_learning_rate``.

  In a FORGE layer the weight-gradient GEMM accumulates straight into the
  average: the fused kernel's epilogue writes :math:`d_t` (rule
  ``pallas_kernels.rules.scion_rule``) and leaves ``W``; a per-layer pass in
  the same backward runs the oracle on the whole matrix of :math:`d_t` and
  updates ``W``. No weight-sized ``G`` is stored.

  Args:
    learning_rate: :math:`\gamma`, a scalar or an optax schedule.
    momentum: :math:`\alpha \in (0, 1]`, the weight of the new gradient in
      the average (1 minus the usual momentum; 1: no averaging).
    scale: :math:`\rho`, the radius of every parameter's norm ball.
    unconstrained: the uSCG variant (no :math:`(1-\gamma_t)` shrink).
    ns_coeffs, ns_steps: Newton-Schulz coefficients (``(3,)``, or
      ``(n, 3)`` with ``n <= ns_steps``: one row per step, ``n`` steps)
      and iterations, as in :func:`optax.contrib.muon`.
    eps: added to the Frobenius norm before Newton-Schulz and to the RMS
      of a vector.

  Returns:
    A :class:`ForgeTransformation`.

  Raises:
    ValueError: ``moments`` or ``stochastic_rounding`` is set
      (low-precision state is for the regime-1 families); ``momentum``
      outside ``(0, 1]`` or ``scale`` not positive; ``ns_coeffs`` of
      another shape or with more than ``ns_steps`` rows; at ``init``, a
      parameter with more than two axes (its operator norm is not defined
      here).

  Example:
    >>> tx = forge_jax.scion(optax.cosine_decay_schedule(2**-10, 1000),
    ...                      scale=10.0)
  """
  _lowp.refuse("scion", moments, stochastic_rounding)
  parts = [scale_by_scion(momentum, scale, ns_coeffs, ns_steps, eps)]
  if not unconstrained:
    parts.append(optax.add_decayed_weights(1.0))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  inner = optax.chain(*parts)

  def layer_pass(w, slots, outputs, h, shared):
    del outputs, shared
    # scale_by_scion's oracle on the new average, then add_decayed_weights
    # and the learning rate, as the chain applies them.
    (mu,) = slots
    u = _scion_direction(mu, scale, ns_coeffs, ns_steps, eps)
    if not unconstrained:
      u = u + h["weight_decay"] * w
    return w + (-h["lr"]) * u, slots

  return _forge(inner, pallas_kernels.rules.scion_rule(),
                ((ScaleByScionState, "mu"),), learning_rate,
                lambda state: dict(momentum=momentum, decay=1 - momentum),
                family="scion", weight_decay=0.0 if unconstrained else 1.0,
                layer_pass=layer_pass)


# --- Regime 3: deferred, one layer's G at a time ------------------------------


def adafactor(
    learning_rate: Optional[optax.ScalarOrSchedule] = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: Optional[float] = 1.0,
    momentum: Optional[float] = None,
    dtype_momentum: Any = jnp.float32,
    weight_decay_rate: Optional[optax.ScalarOrSchedule] = None,
    eps: float = 1e-30,
    factored: bool = True,
    weight_decay_mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
) -> ForgeTransformation:
  r"""Adafactor: ``optax.adafactor``, FORGE-enabled (regime 3, deferred).

  Its state update reads row and column means of :math:`G^{\odot 2}` (the
  factored second moment), which no output tile can close, so a FORGE layer
  forms its ``G = x^T dy`` in fp32 inside its own backward, applies optax's
  own Adafactor update to that one kernel (its ``v_row``, ``v_col``, ``v``
  and momentum slices) and frees ``G`` there: at most one layer's gradient
  is live, never the whole pool. Same signature, defaults and state as
  :func:`optax.adafactor`.

  Args:
    learning_rate, min_dim_size_to_factor, decay_rate, decay_offset,
      multiply_by_parameter_scale, clipping_threshold, momentum,
      dtype_momentum, weight_decay_rate, eps, factored, weight_decay_mask: as
      in :func:`optax.adafactor`.

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adafactor(optax.linear_schedule(1e-2, 1e-3, 1000))
  """
  _lowp.refuse("adafactor", moments, stochastic_rounding)
  inner = optax.adafactor(
      learning_rate, min_dim_size_to_factor=min_dim_size_to_factor,
      decay_rate=decay_rate, decay_offset=decay_offset,
      multiply_by_parameter_scale=multiply_by_parameter_scale,
      clipping_threshold=clipping_threshold, momentum=momentum,
      dtype_momentum=dtype_momentum, weight_decay_rate=weight_decay_rate,
      eps=eps, factored=factored,
      weight_decay_mask=_holes_aware(weight_decay_mask))
  return _forge_deferred(inner, "adafactor")


def sm3(learning_rate: float, momentum: float = 0.9, *, moments: Any = None,
        stochastic_rounding: bool = False) -> ForgeTransformation:
  r"""SM3: ``optax.sm3``, FORGE-enabled (regime 3, deferred).

  Its state update reads row and column maxima of the accumulated
  :math:`G^{\odot 2}` (the cover sets' statistics), so a FORGE layer forms its
  ``G`` in fp32 inside its own backward, applies optax's own SM3 update to
  that one kernel (its per-axis ``mu`` and its ``nu``) and frees ``G`` there.
  Same signature, defaults and state as :func:`optax.sm3` (whose learning
  rate is a scalar, not a schedule).

  Args:
    learning_rate: the (scalar) learning rate.
    momentum: as in :func:`optax.sm3`.

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.sm3(1e-2)
  """
  _lowp.refuse("sm3", moments, stochastic_rounding)
  return _forge_deferred(optax.sm3(learning_rate, momentum=momentum), "sm3")


class ScaleByAdamMiniState(NamedTuple):
  """State of :func:`scale_by_adam_mini`: the step count, the first moment
  ``mu`` (the parameters' shape) and one second moment per block, ``nu``
  (each parameter's shape without its block axes)."""
  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates


def _adam_mini_block_axes(path, leaf, block_axes) -> tuple[int, ...]:
  """The axes one Adam-mini block spans in ``leaf`` (the parameter at
  ``path``, or its gradient): ``block_axes(path, leaf)`` where it gives
  them, else the default -- a matrix ``(in, out)`` one block per output
  neuron (axis 0), a vector or scalar one block."""
  ndim = jnp.ndim(leaf)
  axes = (None if block_axes is None
          else block_axes(_context.user_path(path), leaf))
  where = jax.tree_util.keystr(path)
  if axes is None:
    if ndim <= 1:
      return tuple(range(ndim))
    if ndim == 2:
      return (0,)
    raise ValueError(
        f"forge_jax.adam_mini: the parameter at {where} has shape "
        f"{tuple(jnp.shape(leaf))} ({ndim} axes), for which there is no "
        "default block. Pass block_axes=fn, fn(path, param) -> the axes one "
        "block spans (e.g. (0, 2) for a (in, heads, head_dim) query or key "
        "kernel: one block per head; (0,) for a value kernel: one per output "
        "neuron), or None for the default.")
  try:
    raw = [operator.index(a) for a in (
        (axes,) if isinstance(axes, int) else axes)]
  except TypeError:
    raw = None
  if (raw is None or any(not -ndim <= a < ndim for a in raw)
      or len({a % ndim for a in raw}) != len(raw)):
    raise ValueError(
        f"forge_jax.adam_mini: block_axes gave {axes!r} for the parameter at "
        f"{where} (shape {tuple(jnp.shape(leaf))}): it must be distinct axes "
        f"of it, each in [-{ndim}, {ndim}), or None for the default")
  return tuple(sorted(a % ndim for a in raw))


def scale_by_adam_mini(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    mu_dtype: Optional[Any] = None,
    block_axes: Optional[Callable[[Any, jax.Array],
                                  Optional[tuple[int, ...]]]] = None,
) -> optax.GradientTransformation:
  r"""Adam-mini's scaling (Zhang et al. 2024, Algorithm 1).

  .. math::
    m_t = (1-\beta_1) g_t + \beta_1 m_{t-1},\quad
    v_{t,b} = (1-\beta_2)\,\mathrm{mean}_{i \in b}(g_{t,i}^2) + \beta_2 v_{t-1,b},\\
    u_t = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_{t,b}/(1-\beta_2^t)} + \epsilon}

  with one :math:`v` per block :math:`b` (:func:`_adam_mini_block_axes`).
  Same operation order as ``optax.scale_by_adam``.

  Raises:
    ValueError: at ``init``, a parameter with no block (more than two axes
      and no ``block_axes`` for it), or bad ``block_axes``.
  """
  none = lambda x: x is None

  def axes_of(path, leaf):
    return _adam_mini_block_axes(path, leaf, block_axes)

  def init_fn(params):
    nu = jax.tree_util.tree_map_with_path(
        lambda kp, p: jnp.zeros(
            [n for i, n in enumerate(jnp.shape(p)) if i not in axes_of(kp, p)],
            p.dtype), params)
    return ScaleByAdamMiniState(
        count=jnp.zeros([], jnp.int32),
        mu=optax.tree.zeros_like(params, dtype=mu_dtype), nu=nu)

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = jax.tree_util.tree_map_with_path(
        lambda kp, g, v: None if g is None else (
            (1 - b2) * jnp.mean(numerics.abs_sq(g), axis=axes_of(kp, g))
            + b2 * v),
        updates, state.nu, is_leaf=none)
    count_inc = numerics.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
    nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
    updates = jax.tree_util.tree_map_with_path(
        lambda kp, m, v: None if m is None else m / (
            jnp.sqrt(jnp.expand_dims(v, axes_of(kp, m))) + eps),
        mu_hat, nu_hat, is_leaf=none)
    mu = optax.tree.cast(mu, mu_dtype)
    nu = optax.tree.cast_like(nu, state.nu)
    return updates, ScaleByAdamMiniState(count=count_inc, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def adam_mini(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    mu_dtype: Optional[Any] = None,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    *,
    block_axes: Optional[Callable[[Any, jax.Array],
                                  Optional[tuple[int, ...]]]] = None,
    moments: Any = None,
    stochastic_rounding: bool = False,
) -> ForgeTransformation:
  r"""Adam-mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To
  Gain More", arXiv:2406.16793), FORGE-enabled (regime 3, deferred).

  .. math::
    m_t = (1-\beta_1) g_t + \beta_1 m_{t-1},\quad
    v_{t,b} = (1-\beta_2)\,\mathrm{mean}_{i \in b}(g_{t,i}^2) + \beta_2 v_{t-1,b},\\
    w_t = w_{t-1} - \eta_t\Big(\frac{m_t/(1-\beta_1^t)}
          {\sqrt{v_{t,b}/(1-\beta_2^t)} + \epsilon} + \lambda w_{t-1}\Big)

  Adam with one second moment per *block* :math:`b` of each parameter, the
  mean of :math:`g^2` over the block. Blocks by default, following the
  paper's partition for linear layers: a ``(in, out)`` kernel has one block
  per output neuron (the mean over axis 0: ``nu`` has shape ``(out,)``); a
  vector (bias, norm scale) or scalar is one block. ``block_axes`` sets
  others, e.g. one block per head for a query or key kernel
  ``(in, heads, head_dim)`` (axes ``(0, 2)``), one per token for an
  embedding table ``(vocab, features)`` (axis ``(1,)``), as the paper
  partitions them; a parameter of more than two axes needs one. Computed as
  the optax chain :func:`scale_by_adam_mini`, ``add_decayed_weights``,
  ``scale_by_learning_rate`` (``optax.adamw``'s order).

  The state update reads a statistic of the whole block (an output neuron's
  column spans every input row), which no output tile can close: a FORGE
  layer forms its ``G`` in fp32 inside its own backward, applies this
  transform's ``update`` to that one kernel and its slice of the state and
  frees ``G`` there.

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2, eps: Adam's constants.
    mu_dtype: dtype of the first moment; ``None`` follows the parameters.
    weight_decay: decoupled weight decay rate (scalar or schedule).
    mask: which parameters get weight decay (tree, prefix or callable).
    block_axes: ``block_axes(path, leaf) -> axes`` (a tuple of the
      parameter's axes one block spans; ``None``: the default above), with
      ``path`` the parameter's key path in the params tree and ``leaf`` the
      parameter or its gradient (read its shape, not its values).

  Returns:
    A :class:`ForgeTransformation`.

  Raises:
    ValueError: ``moments`` or ``stochastic_rounding`` is set
      (low-precision state is for the regime-1 families); at ``init``, a
      parameter with more than two axes and no ``block_axes`` for it, or
      ``block_axes`` naming axes it does not have.

  Example:
    >>> heads = lambda path, p: (0, 2) if p.ndim == 3 else None
    >>> tx = forge_jax.adam_mini(1e-3, weight_decay=0.1, block_axes=heads)
  """
  _lowp.refuse("adam_mini", moments, stochastic_rounding)
  inner = optax.chain(
      scale_by_adam_mini(b1, b2, eps, mu_dtype, block_axes),
      optax.add_decayed_weights(weight_decay, _holes_aware(mask)),
      optax.scale_by_learning_rate(learning_rate))
  return _forge_deferred(inner, "adam_mini")


def adalomo(
    learning_rate: optax.ScalarOrSchedule,
    decay_rate: float = 0.8,
    eps: float = 1e-30,
    min_scale: float = 1e-3,
    clipping_threshold: float = 1.0,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    weight_decay_mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
) -> ForgeTransformation:
  r"""AdaLomo (Lv et al. 2023, "AdaLomo: Low-memory Optimization with
  Adaptive Learning Rate", arXiv:2310.10195), FORGE-enabled (regime 3).

  For a matrix :math:`G_t` (:math:`n \times m`), with
  :math:`\beta_t = 1 - t^{-\kappa}` (``decay_rate`` :math:`\kappa`):

  .. math::
    r_t = \beta_t r_{t-1} + (1-\beta_t)\,\mathrm{mean}_j(G_t^2 + \epsilon_1),\quad
    c_t = \beta_t c_{t-1} + (1-\beta_t)\,\mathrm{mean}_i(G_t^2 + \epsilon_1),\\
    v_t = r_t c_t^\top / \mathrm{mean}(r_t),\quad
    u_t = G_t / \sqrt{v_t},\quad
    \hat u_t = u_t / \max(1, \mathrm{RMS}(u_t)/d),\\
    w_t = w_{t-1} - \eta_t \max(\epsilon_2, \mathrm{RMS}(w_{t-1}))
          (\hat u_t + \lambda w_{t-1})

  The factored second moment (non-negative rank-1 factorisation, as
  Adafactor's), no first moment, and the paper's *grouped* update
  normalisation: :math:`\mathrm{RMS}(u_t)` and the relative step
  :math:`\max(\epsilon_2, \mathrm{RMS}(w))` per parameter, not over the
  whole model -- which is what lets each layer update inside its own
  backward. Every parameter of two or more axes is factored (over its two
  largest axes); a vector or scalar keeps a full second moment
  :math:`v_t = \beta_t v_{t-1} + (1-\beta_t)(g_t^2 + \epsilon_1)`. Weight
  decay :math:`\lambda` is decoupled and scaled by the same relative step.
  Computed with optax's own pieces: ``scale_by_factored_rms`` (every matrix
  factored), ``clip_by_block_rms(d)``, ``add_decayed_weights``,
  ``scale_by_param_block_rms(ε₂)``, ``scale_by_learning_rate``.

  Its state update reads row and column means of :math:`G^2`, so a FORGE
  layer forms its ``G`` in fp32 inside its own backward, applies this
  update to that one kernel (its ``v_row``, ``v_col``) and frees ``G`` there.

  Args:
    learning_rate: :math:`\eta`, a scalar or an optax schedule.
    decay_rate: :math:`\kappa` of :math:`\beta_t = 1 - t^{-\kappa}`.
    eps: :math:`\epsilon_1`, added to :math:`G^2`.
    min_scale: :math:`\epsilon_2`, the smallest relative step scale.
    clipping_threshold: :math:`d`, the update RMS above which the update is
      normalised.
    weight_decay: :math:`\lambda` (scalar or schedule).
    weight_decay_mask: which parameters get weight decay (tree, prefix or
      callable).

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adalomo(optax.linear_schedule(5e-3, 5e-4, 1000))
  """
  _lowp.refuse("adalomo", moments, stochastic_rounding)
  inner = optax.chain(
      optax.scale_by_factored_rms(factored=True, decay_rate=decay_rate,
                                  min_dim_size_to_factor=1, epsilon=eps),
      optax.clip_by_block_rms(clipping_threshold),
      optax.add_decayed_weights(weight_decay,
                                _holes_aware(weight_decay_mask)),
      optax.scale_by_param_block_rms(min_scale),
      optax.scale_by_learning_rate(learning_rate))
  return _forge_deferred(inner, "adalomo")


def lars(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    weight_decay_mask: Any = True,
    trust_coefficient: Any = 0.001,
    eps: Any = 0.0,
    trust_ratio_mask: Any = True,
    momentum: Any = 0.9,
    nesterov: bool = False,
    *,
    moments: Any = None,
    stochastic_rounding: bool = False,
) -> ForgeTransformation:
  r"""LARS: ``optax.lars``, FORGE-enabled (regime 3, deferred).

  .. math::
    u_t = g_t + \lambda w_{t-1},\quad
    u_t \leftarrow \tau \frac{\|w_{t-1}\|}{\|u_t\| + \epsilon}\, u_t,\quad
    b_t = -\eta_t u_t + \mu b_{t-1},\quad
    w_t = w_{t-1} + b_t
    \quad(\text{nesterov: } w_t = w_{t-1} - \eta_t u_t + \mu b_t)

  (You et al. 2017; the trust ratio is 1 where either norm is 0, and only
  where ``trust_ratio_mask`` says; the decay only where
  ``weight_decay_mask`` says). optax's arithmetic: the trust ratio's
  denominator is the norm of the decayed update :math:`\|g + \lambda w\|`
  (the paper's :math:`\|g\| + \lambda\|w\|` bounds it), and the learning
  rate is applied before the momentum. Both masks default to every
  parameter, biases included, as in optax. The trust ratio scales ``G``
  by a ratio that reads the whole layer's ``||G||`` *before* the momentum,
  so a FORGE layer forms its ``G`` in fp32 inside its own backward, applies
  optax's own update to that one kernel and frees ``G`` there. Same
  signature, defaults and state as :func:`optax.lars`.

  Args:
    learning_rate, weight_decay, weight_decay_mask, trust_coefficient, eps,
      trust_ratio_mask, momentum, nesterov: as in :func:`optax.lars`.

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.lars(optax.cosine_decay_schedule(0.5, 1000),
    ...                     weight_decay=1e-4)
  """
  _lowp.refuse("lars", moments, stochastic_rounding)
  return _forge_deferred(
      optax.lars(learning_rate, weight_decay=weight_decay,
                 weight_decay_mask=_holes_aware(weight_decay_mask),
                 trust_coefficient=trust_coefficient, eps=eps,
                 trust_ratio_mask=_holes_aware(trust_ratio_mask),
                 momentum=momentum, nesterov=nesterov), "lars")


# --- What forge_jax does not fuse ----------------------------------------------

# pallas_kernels family name -> the forge_jax transform that implements it
# (the registry's optax transform of that family, wrapped under its name).
IMPLEMENTED = {name: family.optax
               for name, family in pallas_kernels.families.REGISTRY.items()
               if family.optax is not None}


def refuse_reason(family: str) -> Optional[str]:
  """Why ``forge_jax`` cannot drive FORGE layers with ``family``, or ``None``.

  ``family`` is a name ``pallas_kernels.classify`` knows (aliases such as
  ``"clip_by_global_norm"`` included). A regime-4 family (global-norm
  clipping) is refused as a family: its state update reads a statistic of
  *every* layer's gradient, which exists only after the whole backward, so no
  layer can update itself in its own backward; global-norm clipping runs as
  a two-pass step, ``optax.chain(forge_jax.clip_by_global_norm(max_norm),
  forge_jax.adamw(...))`` (``forge_jax.clip``). A known
  regime-1-3 family that forge_jax does not implement yet, and an unknown
  name, are refused with a reason too.

  Example:
    >>> forge_jax.refuse_reason("adamw") is None
    True
    >>> print(forge_jax.refuse_reason("clip_by_global_norm"))  # doctest: +ELLIPSIS
    global_norm_clip is regime 4: ...
  """
  try:
    regime = pallas_kernels.classify(family)
  except (ValueError, TypeError) as e:
    return f"forge_jax cannot fuse {family!r}: {e}"
  if regime.number == 4:
    return (
        f"{regime.reason} FORGE updates each layer inside its own backward, "
        "before later layers' gradients exist, so a regime-4 transform cannot"
        " be fused into one backward. forge_jax runs global-norm clipping as "
        "a two-pass step instead (a norm pass, then the fused update; "
        "docs/clipping.md), written as optax.chain("
        "forge_jax.clip_by_global_norm(max_norm), forge_jax.adamw(...)); any "
        "other cross-layer statistic: train with optax on the standard path "
        "(flax.linen.Dense, or forge_jax.Dense(fused=False)).")
  if regime.family in IMPLEMENTED:
    return None
  return (f"{regime.reason} forge_jax does not implement {regime.family!r} "
          f"yet (its path would be: {regime.path.description}); implemented:"
          f" {', '.join(sorted(IMPLEMENTED))}.")
