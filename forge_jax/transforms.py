"""Optax-compatible optimizer transforms that also drive FORGE layers.

A FORGE transform *is* its optax counterpart (same signature, defaults, state
tree and ``update``), plus a :class:`ForgeSpec` that :func:`forge_jax.make_step`
uses to hand FORGE layers their slots and this step's hyperparameters. Every
parameter that is not a FORGE kernel is updated by the optax transform itself,
so it is updated exactly as optax would; a checkpoint of the state reads the
same as optax's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional, Union

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


@dataclasses.dataclass(frozen=True)
class ForgeSpec:
  """How a FORGE transform's state maps onto the fused kernel.

  Attributes:
    rule: the kernel's elementwise update.
    slot_fields: for each of ``rule.slots``, the field of the inner optax
      state that holds that slot as a params-shaped tree: a field name, or a
      ``(StateClass, field_name)`` pair where a name alone is ambiguous (two
      states of the chain with a ``mu``).
    hparams: ``hparams(opt_state) -> dict`` of this step's hyperparameters by
      ``rule.hparams`` name, read from the state *before* the step (the
      ``weight_decay`` entry, for families that have one, unmasked).
    weight_decay_mask: optax's ``mask`` argument (tree, prefix or callable).
  """

  rule: pallas_kernels.UpdateRule
  slot_fields: tuple[Union[str, tuple[type, str]], ...]
  hparams: Callable[[Any], dict[str, jax.Array]]
  weight_decay_mask: Any = None


class ForgeTransformation(NamedTuple):
  """An optax ``GradientTransformation`` that can also drive FORGE layers."""

  init: optax.TransformInitFn
  update: optax.TransformUpdateFn
  spec: ForgeSpec


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
           weight_decay: Optional[optax.ScalarOrSchedule] = None,
           mask: Any = None) -> ForgeTransformation:
  """``inner`` itself, plus the :class:`ForgeSpec` that drives FORGE layers.

  ``hparams(state)`` gives the family's own hyperparameters; this adds the
  step's ``lr`` (read at ``scale_by_learning_rate``'s count, as optax does)
  and, where the family has decoupled weight decay, ``weight_decay`` (read at
  ``add_decayed_weights``' count).
  """

  def all_hparams(state):
    h = dict(hparams(state))
    h["lr"] = _schedule_value(
        learning_rate, _field(state, optax.ScaleByScheduleState, "count"))
    if weight_decay is not None:
      h["weight_decay"] = _schedule_value(
          weight_decay, _field(state, _WeightDecaySchedule, "count"))
    return h

  spec = ForgeSpec(rule=rule, slot_fields=tuple(slot_fields),
                   hparams=all_hparams, weight_decay_mask=mask)
  return ForgeTransformation(inner.init, inner.update, spec)


def _adam_hparams(state, b1, b2, eps, eps_root) -> dict[str, Any]:
  """``scale_by_adam``'s constants and this step's bias corrections."""
  t = _count_after(state, optax.ScaleByAdamState)
  return dict(
      b1=b1, b2=b2, one_minus_b1=1 - b1, one_minus_b2=1 - b2,
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
  return _forge(inner, rule, rule.slots, learning_rate,
                lambda state: {} if momentum is None else dict(decay=momentum))


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
                learning_rate, lambda state: dict(eps=eps))


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

  return _forge(inner, rule, rule.slots, learning_rate, hparams)


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
  return _forge(inner, pallas_kernels.adam_rule(nesterov=nesterov),
                ("mu", "nu"), learning_rate,
                lambda state: _adam_hparams(state, b1, b2, eps, eps_root))


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
                      mu_dtype=mu_dtype, weight_decay=weight_decay, mask=mask,
                      nesterov=nesterov)
  return _forge(inner, pallas_kernels.adamw_rule(nesterov=nesterov),
                ("mu", "nu"), learning_rate,
                lambda state: _adam_hparams(state, b1, b2, eps, eps_root),
                weight_decay=weight_decay, mask=mask)


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
                learning_rate, hparams)


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
                ("mu", "nu"), learning_rate, hparams)


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
                     weight_decay=weight_decay, mask=mask)
  return _forge(
      inner, pallas_kernels.lion_rule(), ("mu",), learning_rate,
      lambda state: dict(b1=b1, one_minus_b1=1 - b1, b2=b2,
                         one_minus_b2=1 - b2),
      weight_decay=weight_decay, mask=mask)
