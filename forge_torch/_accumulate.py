"""Gradient accumulation for FORGE-managed weights: the two epilogue rules.

With ``optimizer.accumulate_steps = K`` (:class:`forge_torch.optim`'s
optimizers), a managed weight's first ``K - 1`` backwards in a step add their
gradient ``G = grad_output^T input`` to an fp32 buffer of the weight's shape,
and the ``K``-th applies the family's update to ``buffer + G``: torch's
``.grad`` accumulation (a sum over the micro-batches) followed by its step.
Both happen in the fused kernel's epilogue, with ``G`` in fp32 registers, as
``forge_jax.MultiSteps`` does (``docs/accumulation.md``):

* :func:`sum_rule` -- a state-only rule (the kernel neither loads nor stores
  the weight) whose one slot, ``acc``, becomes ``G`` on the cycle's first
  micro-batch and ``acc + G`` on the next ones: the buffer's old contents are
  never read on the first, so it needs no zeroing;
* :func:`from_accumulator` -- a family's rule stepping from ``acc + G``
  (``acc`` is its first slot and is written back unchanged). Called with no
  token rows (``G = 0``), it applies the update to the buffer alone: what
  ``optimizer.step()`` does for a weight that got fewer than ``K``
  micro-batches in the step.

The sum is formed in fp32 in the order torch's ``.grad += G`` forms it, so
fp32 training matches torch's accumulation to the summation order of ``G``
itself; bf16 weights accumulate in fp32 (torch's bf16 ``.grad`` rounds every
partial sum).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from pallas_kernels.rules import UpdateRule

# The accumulator's slot name (torch has no state of this name).
ACC = "acc"


@functools.lru_cache(maxsize=None)
def sum_rule() -> UpdateRule:
  """``acc <- G`` (hyperparameter ``acc_first`` = 1) or ``acc <- acc + G``
  (``acc_first`` = 0); the weight is not touched."""

  def update(g, w, slots, h):
    del w  # None: updates_weight=False
    (acc,) = slots
    # (The predicate broadcast explicitly: the Mosaic GPU kernel's
    # warpgroup lowering takes no implicit broadcast in a select.)
    first = jnp.broadcast_to(h["acc_first"] > 0, g.shape)
    return None, (jnp.where(first, g, acc + g),)

  return UpdateRule(name="accumulate_sum_torch", slots=(ACC,),
                    hparams=("acc_first",), update=update,
                    updates_weight=False)


@functools.lru_cache(maxsize=None)
def from_accumulator(rule: UpdateRule) -> UpdateRule:
  """``rule`` applied to ``acc + G``; slots ``(acc, *rule.slots)``, ``acc``
  written back unchanged. Cached: one rule object (one compiled kernel) per
  family variant."""
  if ACC in rule.slots:
    raise ValueError(f"rule {rule.name!r} already has a slot named {ACC!r}")

  def update(g, w, slots, h):
    acc, inner = slots[0], tuple(slots[1:])
    w_new, new = rule.update(acc + g, w, inner, h)
    return w_new, (acc, *new)

  # (Every other field is the rule's -- its second moments, which quantized
  # slots are floored -- and its tilings are its own.)
  return dataclasses.replace(rule, name=f"{rule.name}_from_acc",
                             slots=(ACC, *rule.slots), update=update,
                             tuned_as=None)


__all__ = ["ACC", "from_accumulator", "sum_rule"]
