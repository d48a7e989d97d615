"""Gradient clipping refuses FORGE-managed weights instead of skipping them.

A FORGE-managed weight is updated inside its layer's backward: its gradient
is never formed, so ``weight.grad`` stays ``None``. ``torch.nn.utils``'s
clipping functions skip parameters without a gradient, so on a model with
managed weights they would silently compute the norm over the other
parameters only and leave the managed weights unclipped. :func:`install`
(run once when ``forge_torch`` is imported) wraps them so that they raise a
``RuntimeError`` naming the weights and the fix when a weight that FORGE
updated since the last ``optimizer.step()`` is among their parameters; any
other call (no forge_torch layer, a layer with ``fused = False`` whose weight
has an ordinary gradient) goes straight to torch's function, unchanged.

``torch.nn.utils.get_total_norm`` takes gradients, not parameters, so a
managed weight cannot reach it and it is not wrapped.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from forge_torch import linear as _linear

# The torch.nn.utils functions that take parameters and read their .grad
# (the deprecated clip_grad_norm calls clip_grad_norm_ by its module name).
WRAPPED = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")


def fused_weights_among(params) -> list[str]:
  """The names of the weights in ``params`` that FORGE updated in backward
  since their optimizer's last ``step()`` (so they have no gradient)."""
  names = []
  for p in params:
    if not (isinstance(p, torch.Tensor) and _linear.is_forge_weight(p)
            and p.grad is None):
      continue
    optimizer = _linear.owner_of(p)
    if optimizer is not None and p in optimizer._forge_updated:
      names.append(_linear.weight_name(p))
  return names


def check_clippable(params, what: str) -> None:
  """Raises if ``params`` holds a weight whose update FORGE already applied.

  Args:
    params: the parameters given to the clipping function (a list).
    what: the function's name, for the message.

  Raises:
    RuntimeError: one of ``params`` is such a weight.
  """
  names = fused_weights_among(params)
  if not names:
    return
  shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more"
                                  if len(names) > 5 else "")
  raise RuntimeError(
      f"torch.nn.utils.{what}: the parameters include FORGE-managed weights "
      f"({shown}). FORGE updates those weights inside the backward, so their "
      "gradient never exists: the clipping would cover only the other "
      "parameters and leave these weights unclipped (clipping the managed "
      "weights themselves is not supported yet). To clip them, keep those "
      "layers as plain nn.Linear: forge_torch.convert(model, exclude=[...]) "
      "or layer.fused = False before the forward. Or do not clip them: "
      "leave out the clipping, or clip only the other parameters on purpose "
      "with [p for p in model.parameters() if not "
      "forge_torch.is_forge_weight(p)].")


def _guard(fn):
  """``fn`` (a torch clipping function), first checking its parameters."""
  if getattr(fn, "__forge_guarded__", False):
    return fn

  @functools.wraps(fn)
  def guarded(*args, **kwargs):
    # The parameters, positional or by keyword (torch names it `parameters`).
    if args:
      parameters, args = args[0], args[1:]
    else:
      parameters = kwargs.pop("parameters")
    params = ([parameters] if isinstance(parameters, torch.Tensor)
              else list(parameters))  # a generator is read once, here
    check_clippable(params, fn.__name__)
    return fn(params, *args, **kwargs)

  guarded.__forge_guarded__ = True
  return guarded


def install() -> None:
  """Wraps ``torch.nn.utils``'s clipping functions (idempotent).

  Both ``torch.nn.utils.<name>`` and ``torch.nn.utils.clip_grad.<name>`` are
  replaced; a reference taken before ``forge_torch`` was imported (``from
  torch.nn.utils import clip_grad_norm_`` above ``import forge_torch``) keeps
  torch's unguarded function.
  """
  for module in (torch.nn.utils.clip_grad, torch.nn.utils):
    for name in WRAPPED:
      fn = getattr(module, name, None)
      if fn is not None:
        setattr(module, name, _guard(fn))
