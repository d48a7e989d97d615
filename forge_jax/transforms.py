"""Optax-compatible optimizer transforms that also drive FORGE layers.

A FORGE transform *is* its optax counterpart (same signature, defaults, state
tree and ``update``), plus a :class:`ForgeSpec` that :func:`forge_jax.make_step`
uses to hand FORGE layers their slots and this step's hyperparameters. Every
parameter that is not a FORGE kernel is updated by the optax transform itself,
so it is updated exactly as optax would; a checkpoint of the state reads the
same as optax's.

The spec's ``family`` is classified (``pallas_kernels.classify``) and its
regime picks the path the layer's backward takes (``forge_jax._paths``):
regime 1 (SGD ... Lion) fuses entirely into the kernel's epilogue; regime 2
(:func:`lamb`, :func:`muon`) advances the state in the epilogue and updates
the weight in a per-layer pass over that state; regime 3 (:func:`adafactor`,
:func:`sm3`) is deferred: the layer's ``G`` is formed and consumed inside its
own backward. Regime 4 (global-norm clipping) cannot be fused and is refused
(:func:`refuse_reason`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
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


class ForgeTransformation(optax.GradientTransformationExtraArgs):
  """An optax ``GradientTransformation`` that can also drive FORGE layers.

  It *is* optax's ``(init, update)`` pair (``init, update = tx``,
  ``isinstance(tx, optax.GradientTransformation)``), carrying the
  :class:`ForgeSpec` that drives FORGE layers as the attribute ``spec``.
  """

  def __new__(cls, init, update, spec: ForgeSpec | None = None):
    self = super().__new__(cls, init, update)
    self.spec = spec
    return self

  def _replace(self, **changes):
    spec = changes.pop("spec", self.spec)
    return ForgeTransformation(*super()._replace(**changes), spec)

  def __repr__(self) -> str:
    family = self.spec.family if self.spec is not None else None
    return f"ForgeTransformation(family={family!r})"


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
      return mask(tree)
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is None)
    holes = {tuple(kp) for kp, v in flat if v is None}
    if not holes:
      return mask(tree)
    return jax.tree_util.tree_map_with_path(
        lambda kp, m: None if tuple(kp) in holes else m, mask(full))

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


def _schedule_value(value, count):
  return value(count) if callable(value) else value


def _count_after(state, cls):
  """The step count ``cls``'s update will use: its ``count`` plus one."""
  return numerics.safe_increment(_field(state, cls, "count"))


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
           ) -> ForgeTransformation:
  """``inner`` itself, plus the :class:`ForgeSpec` that drives FORGE layers.

  ``hparams(state)`` gives the family's own hyperparameters; this adds the
  step's ``lr`` (read at ``scale_by_learning_rate``'s count, as optax does)
  and, where the family has decoupled weight decay, ``weight_decay`` (read at
  ``add_decayed_weights``' count). ``scope(state)`` is the part of the state
  that FORGE kernels' transforms live in (Muon: its ``'muon'`` partition).
  """

  def all_hparams(state):
    h = dict(hparams(state))
    sub = scope(state)
    h["lr"] = _schedule_value(
        learning_rate, _field(sub, optax.ScaleByScheduleState, "count"))
    if weight_decay is not None:
      h["weight_decay"] = _schedule_value(
          weight_decay, _field(sub, _WeightDecaySchedule, "count"))
    return h

  spec = ForgeSpec(rule=rule, slot_fields=tuple(slot_fields),
                   hparams=all_hparams, weight_decay_mask=mask, family=family,
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


def sgd(
    learning_rate: optax.ScalarOrSchedule,
    momentum: Optional[float] = None,
    nesterov: bool = False,
    accumulator_dtype: Optional[Any] = None,
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
  return _forge(inner, rule, rule.slots, learning_rate,
                lambda state: {} if momentum is None else dict(
                    decay=momentum,
                    decay_m=_stored_decay(momentum, accumulator_dtype)),
                family="sgd" if momentum is None else "sgd_momentum",
                # The trace is affine in G and, without Nesterov, the only
                # way G reaches W: MultiSteps' momentum mode applies.
                momentum_decay=("decay" if momentum is not None
                                and not nesterov else None))


def adagrad(
    learning_rate: optax.ScalarOrSchedule,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
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

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adagrad(1e-2)
  """
  inner = optax.adagrad(learning_rate,
                        initial_accumulator_value=initial_accumulator_value,
                        eps=eps)
  return _forge(inner, pallas_kernels.adagrad_rule(), ("sum_of_squares",),
                learning_rate, lambda state: dict(eps=eps), family="adagrad")


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

  def hparams(state):
    h = dict(decay=decay, one_minus_decay=1 - decay, eps=eps)
    if bias_correction:
      h["bc"] = 1 - decay**_count_after(state, count_state)
    if momentum is not None:
      h["momentum"] = momentum
    return h

  return _forge(inner, rule, rule.slots, learning_rate, hparams,
                family="rmsprop")


def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = False,
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

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adam(optax.warmup_cosine_decay_schedule(0, 1e-3, 100, 1000))
  """
  inner = optax.adam(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                     mu_dtype=mu_dtype, nesterov=nesterov)
  rule = _adam_family_rule(pallas_kernels.adam_rule(nesterov=nesterov), b1,
                           mu_dtype)
  return _forge(inner, rule,
                ("mu", "nu"), learning_rate,
                lambda state: _adam_hparams(state, b1, b2, eps, eps_root,
                                            mu_dtype),
                family="nadam" if nesterov else "adam")


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

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adamw(optax.cosine_decay_schedule(1e-3, 1000))
    >>> opt_state = tx.init(variables["params"])
    >>> step = jax.jit(forge_jax.make_step(loss_fn, tx), donate_argnums=(0, 1))
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
                weight_decay=weight_decay, mask=mask, family="adamw")


nadamw = functools.partial(adamw, nesterov=True)
nadamw.__doc__ = """NAdamW: ``optax.nadamw``, FORGE-enabled (:func:`adamw` with
``nesterov=True``; same signature, defaults and state as ``optax.nadamw``)."""


def adamax(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
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

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.adamax(2e-3)
  """
  inner = optax.adamax(learning_rate, b1=b1, b2=b2, eps=eps)

  def hparams(state):
    t = _count_after(state, optax.ScaleByAdamState)
    return dict(b1=b1, one_minus_b1=1 - b1, b2=b2, eps=eps, bc1=1 - b1**t)

  return _forge(inner, pallas_kernels.adamax_rule(), ("mu", "nu"),
                learning_rate, hparams, family="adamax")


def radam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    threshold: float = 5.0,
    *,
    nesterov: bool = False,
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

  return _forge(inner, pallas_kernels.radam_rule(nesterov=nesterov),
                ("mu", "nu"), learning_rate, hparams, family="radam")


def lion(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[Any] = None,
    weight_decay: optax.ScalarOrSchedule = 1e-3,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
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

  Returns:
    A :class:`ForgeTransformation`.

  Example:
    >>> tx = forge_jax.lion(1e-4, weight_decay=1e-2)
  """
  inner = optax.lion(learning_rate, b1=b1, b2=b2, mu_dtype=mu_dtype,
                     weight_decay=weight_decay, mask=_holes_aware(mask))
  return _forge(
      inner,
      pallas_kernels.lion_rule().with_static(
          round_b1=_rounds_product(b1, mu_dtype),
          round_b2=_rounds_product(b2, mu_dtype)),
      ("mu",), learning_rate,
      # b1 and b2 both multiply the stored moment (scale_by_lion).
      lambda state: dict(b1=_stored_decay(b1, mu_dtype), one_minus_b1=1 - b1,
                         b2=_stored_decay(b2, mu_dtype), one_minus_b2=1 - b2),
      weight_decay=weight_decay, mask=mask, family="lion")


# --- Regime 2: the epilogue advances the state, a layer pass updates W ---------


def lamb(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
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
    ValueError: ``muon_weight_dimension_numbers`` is given.

  Example:
    >>> tx = forge_jax.muon(optax.cosine_decay_schedule(2e-2, 1000))
  """
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
  inner = optax.adafactor(
      learning_rate, min_dim_size_to_factor=min_dim_size_to_factor,
      decay_rate=decay_rate, decay_offset=decay_offset,
      multiply_by_parameter_scale=multiply_by_parameter_scale,
      clipping_threshold=clipping_threshold, momentum=momentum,
      dtype_momentum=dtype_momentum, weight_decay_rate=weight_decay_rate,
      eps=eps, factored=factored,
      weight_decay_mask=_holes_aware(weight_decay_mask))
  return _forge_deferred(inner, "adafactor")


def sm3(learning_rate: float, momentum: float = 0.9) -> ForgeTransformation:
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
  return _forge_deferred(optax.sm3(learning_rate, momentum=momentum), "sm3")


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
  clipping) is refused for good: its state update reads a statistic of
  *every* layer's gradient, which exists only after the whole backward, so no
  layer can update itself in its own backward -- use optax on the standard
  path (``flax.linen.Dense``, or ``forge_jax.Dense(fused=False)``). A known
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
        " be fused: forge_jax refuses it (there is no "
        f"forge_jax.{family}). Train with optax on the standard path "
        "(flax.linen.Dense, or forge_jax.Dense(fused=False)) -- e.g. "
        "optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...)) -- or "
        "drop the clipping and use a forge_jax transform.")
  if regime.family in IMPLEMENTED:
    return None
  return (f"{regime.reason} forge_jax does not implement {regime.family!r} "
          f"yet (its path would be: {regime.path.description}); implemented:"
          f" {', '.join(sorted(IMPLEMENTED))}.")
