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
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics
# optax exports no name for add_decayed_weights' schedule state.
from optax.transforms._adding import WeightDecaySchedule as _WeightDecaySchedule

import pallas_kernels


@dataclasses.dataclass(frozen=True)
class ForgeSpec:
  """How a FORGE transform's state maps onto the fused kernel.

  Attributes:
    rule: the kernel's elementwise update.
    slot_fields: for each of ``rule.slots``, the name of the field of the
      inner optax state that holds that slot as a params-shaped tree.
    hparams: ``hparams(opt_state) -> dict`` of this step's hyperparameters by
      ``rule.hparams`` name, read from the state *before* the step (the
      ``weight_decay`` entry unmasked).
    weight_decay_mask: optax's ``mask`` argument (tree, prefix or callable).
  """

  rule: pallas_kernels.UpdateRule
  slot_fields: tuple[str, ...]
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
  rule = pallas_kernels.adamw_rule(nesterov=nesterov)

  def hparams(state):
    count = _field(state, optax.ScaleByAdamState, "count")
    t = numerics.safe_increment(count)
    lr_count = _field(state, optax.ScaleByScheduleState, "count")
    wd_count = _field(state, _WeightDecaySchedule, "count")
    return dict(
        lr=_schedule_value(learning_rate, lr_count),
        b1=b1, b2=b2, one_minus_b1=1 - b1, one_minus_b2=1 - b2,
        eps=eps, eps_root=eps_root,
        weight_decay=_schedule_value(weight_decay, wd_count),
        # optax.tree.bias_correction's denominators, same expressions.
        bc1=1 - b1**t, bc2=1 - b2**t,
        bc1_next=1 - b1**numerics.safe_increment(t),
    )

  spec = ForgeSpec(rule=rule, slot_fields=("mu", "nu"), hparams=hparams,
                   weight_decay_mask=mask)
  return ForgeTransformation(inner.init, inner.update, spec)
