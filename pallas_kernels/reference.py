"""Pure-``jnp`` references of the kernels: the rule applied by XLA.

:func:`fused_wgrad_update_reference` is the fused kernel's math with ``G``
formed in fp32; :func:`apply_rule` is the elementwise part, on one weight
or on one layer of stacks, which the unfused path
(:func:`pallas_kernels.unfused_wgrad_update`) runs too.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import lowp
from pallas_kernels.checks import checked_state_inputs, flatten_tokens
from pallas_kernels.rules import UpdateRule

__all__ = ["apply_rule", "fused_wgrad_update_reference"]


def apply_rule(rule: UpdateRule, g, w, slots, hparams, layer=None, *,
               plan: lowp.StatePlan | None = None, sr=None):
  """``rule.apply`` on a gradient ``g``, by XLA.

  Args:
    rule: the update rule.
    g: the weight gradient, ``(in, out)``.
    w: the weight, ``(in, out)``, or with ``layer`` a stack ``(L, in, out)``.
    slots: the rule's state arrays, ``w``'s shape.
    hparams: ``rule.pack(...)``.
    layer: ``None``, or the layer of the stacks to update (an integer
      scalar, may be traced; clamped into ``[0, L)``).
    plan: low-precision state (quantized slots as ``Quantized`` pairs,
      stochastic rounding; :func:`pallas_kernels.lowp.plan_state`), or
      ``None``: :func:`pallas_kernels.lowp.apply` runs the rule then.
    sr: with a plan's stochastic rounding, ``(seed, step)``.

  Returns:
    ``(w_new, slots_new)`` as :func:`pallas_kernels.fused_wgrad_update`
    returns them: with ``layer``, the stacks with that layer replaced.
  """
  if plan is not None:
    return lowp.apply(rule, plan, g, w, slots, hparams, sr, layer)
  if layer is None:
    return rule.apply(g, w, slots, hparams)
  layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, w.shape[0] - 1)
  take = lambda a: lax.dynamic_index_in_dim(a, layer, keepdims=False)
  put = lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype),
                                                     layer, 0)
  w_new, new = rule.apply(g, take(w), [take(s) for s in slots], hparams)
  # The new slices materialised before they are written back: otherwise XLA
  # fuses the rule into each dynamic-update-slice, whose fusion then reads
  # the stack it writes, and protects that read with a copy of the whole
  # stack on every call (every loop iteration of a scanned stack).
  w_new, new = lax.optimization_barrier((w_new, tuple(new)))
  n = len(slots)
  new_slots = tuple(put(s, v) for s, v in zip(slots, new[:n]))
  return (put(w, w_new) if rule.updates_weight else w), new_slots + tuple(
      new[n:])


def fused_wgrad_update_reference(x, dy, w, slots, hparams, *, rule: UpdateRule,
                                 layer=None, formats=None,
                                 stochastic_rounding=None):
  """Pure-``jnp`` reference of :func:`pallas_kernels.fused_wgrad_update`:
  form ``G`` in fp32, then apply ``rule`` (quantized slots and stochastic
  rounding as :mod:`pallas_kernels.quant` specifies them). Same arguments
  and returns, without ``config``, ``interpret`` and ``backend``."""
  x, dy, w, slots, plan = checked_state_inputs(
      x, dy, w, slots, hparams, rule, layer, formats, stochastic_rounding,
      where="fused_wgrad_update_reference")
  x2, dy2 = flatten_tokens(x, dy)
  g = jnp.dot(x2.T, dy2, precision=lax.Precision.HIGHEST,
              preferred_element_type=jnp.float32)
  return apply_rule(rule, g, w, slots, hparams, layer, plan=plan,
                    sr=stochastic_rounding)
