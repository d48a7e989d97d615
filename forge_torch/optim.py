"""`forge_torch.AdamW`: ``torch.optim.AdamW`` that also drives FORGE layers.

Semantics of a step. torch's loop is::

    loss.backward(); opt.step(); opt.zero_grad(); sched.step()

torch's AdamW updates every parameter in ``opt.step()``, first incrementing
``state["step"]`` to ``t`` and using ``bc1 = 1 - beta1**t``,
``bc2 = 1 - beta2**t`` and the group's current ``lr``. Here a FORGE-managed
weight is updated during ``loss.backward()`` instead, with exactly that ``t``
(``state["step"] + 1``; ``state["step"]`` is incremented right after the
update) and the group's ``lr`` *at backward time* -- the same value
``opt.step()`` would read, since a scheduler only changes it after
``opt.step()``. ``opt.step()`` then updates every other parameter as
``torch.optim.AdamW.step`` does (it *is* that method; managed weights have
``grad is None`` and are skipped by it). The trajectory is torch's.

A managed weight whose layer ran no backward in a step is not touched, as
torch's AdamW skips a parameter whose ``grad`` is ``None``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim.optimizer import _get_scalar_dtype, _get_value
from torch.utils.weak import WeakIdKeyDictionary

import pallas_kernels
from forge_torch import _bridge
from forge_torch import linear as _linear

_UNSUPPORTED = {
    "amsgrad": False,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
}


def _unhooked(fn: Callable) -> Callable:
  """``fn`` without torch's step-hook wrapper (so hooks run once, from ours)."""
  while getattr(fn, "hooked", False):
    fn = fn.__wrapped__
  return fn


def _scalar(v) -> float:
  return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


class AdamW(torch.optim.AdamW):
  """``torch.optim.AdamW`` whose FORGE-managed weights update in backward.

  Same signature, defaults, ``param_groups``, ``state`` (``step``,
  ``exp_avg``, ``exp_avg_sq`` per parameter, torch's names and dtypes) and
  ``state_dict()`` as ``torch.optim.AdamW``. Parameters that are weights of
  :class:`forge_torch.Linear` layers (*managed* weights) are registered with
  this optimizer at construction; their layers' backward applies AdamW to them
  with the fused kernel. ``step()`` updates every other parameter exactly as
  ``torch.optim.AdamW`` does. Param groups (their ``lr``, ``betas``, ``eps``,
  ``weight_decay``) apply to managed weights too, and LR schedulers work.

  Not supported (``ValueError``): ``amsgrad``, ``maximize``, ``capturable``,
  ``differentiable``. ``foreach`` and ``fused`` select torch's implementation
  for the non-managed parameters.

  Raises at run time (clear errors): a managed layer run twice before
  ``step()`` (or gradient accumulation over micro-batches); input and weight on
  different devices or of different dtypes; a weight that is not float32 or
  bfloat16; autocast; a managed weight that also received an ordinary gradient
  in the step (a tied/shared weight: keep that layer an ``nn.Linear``).

  If a managed weight is given to a second forge_torch optimizer, the newest
  one owns it.
  """

  def __init__(self, params, lr: float | torch.Tensor = 1e-3,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, amsgrad: bool = False, *,
               maximize: bool = False, foreach: bool | None = None,
               capturable: bool = False, differentiable: bool = False,
               fused: bool | None = None) -> None:
    _check_supported(dict(amsgrad=amsgrad, maximize=maximize,
                          capturable=capturable, differentiable=differentiable))
    # Managed weight -> index of its param group (set by add_param_group,
    # which torch's __init__ calls).
    self._forge_managed = WeakIdKeyDictionary()
    self._forge_calls = WeakIdKeyDictionary()    # forwards since step()
    self._forge_updated = WeakIdKeyDictionary()  # fused updates since step()
    super().__init__(params, lr, betas, eps, weight_decay, amsgrad,
                     maximize=maximize, foreach=foreach, capturable=capturable,
                     differentiable=differentiable, fused=fused)

  # -- registration ---------------------------------------------------------

  def add_param_group(self, param_group: dict[str, Any]) -> None:
    _check_supported({k: param_group.get(k, self.defaults.get(k, False))
                      for k in _UNSUPPORTED})
    super().add_param_group(param_group)
    index = len(self.param_groups) - 1
    managed = [p for p in self.param_groups[index]["params"]
               if _linear.is_forge_weight(p)]
    try:
      for p in managed:
        _bridge.check_dtype(p, "a forge_torch.Linear weight")
    except TypeError:
      self.param_groups.pop()
      raise
    for p in managed:
      previous = _linear.owner_of(p)
      if previous is not None and previous is not self:
        previous._forge_managed.pop(p, None)
      _linear._set_owner(p, self)
      self._forge_managed[p] = index

  def load_state_dict(self, state_dict) -> None:
    super().load_state_dict(state_dict)
    for index, group in enumerate(self.param_groups):
      for p in group["params"]:
        if p in self._forge_managed:
          self._forge_managed[p] = index
    self._forge_calls = WeakIdKeyDictionary()
    self._forge_updated = WeakIdKeyDictionary()

  @property
  def managed_params(self) -> list[torch.Tensor]:
    """The FORGE-managed weights this optimizer updates during backward."""
    return [p for g in self.param_groups for p in g["params"]
            if p in self._forge_managed]

  # -- called by forge_torch.Linear -----------------------------------------

  def _forge_before_forward(self, w: torch.Tensor, x: torch.Tensor, *,
                            layer: str) -> None:
    if w not in self._forge_managed:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: its weight is no longer owned by this "
          "optimizer")
    _bridge.check_dtype(w, f"the weight of forge_torch.Linear {layer}")
    if x.device != w.device:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: input is on {x.device} but the weight "
          f"is on {w.device}; move them to one device")
    if x.dtype != w.dtype:
      raise TypeError(
          f"forge_torch.Linear {layer}: input dtype {x.dtype} differs from the "
          f"weight's {w.dtype}; cast the input (autocast is not supported for "
          "FORGE-managed layers: cast the model to bfloat16 instead)")
    if torch.is_autocast_enabled(x.device.type):
      raise RuntimeError(
          f"forge_torch.Linear {layer}: torch.autocast is not supported for "
          "FORGE-managed layers; cast the model (weights) to bfloat16 instead, "
          "or set layer.fused = False")
    if _in_backward():
      # Activation checkpointing recomputes the forward inside backward; the
      # recomputation is the same use of the weight (paper Remark 3).
      return
    n = self._forge_calls.get(w, 0)
    if n >= 1:
      raise RuntimeError(
          f"forge_torch.Linear {layer} was called a second time before "
          "optimizer.step(). FORGE updates the weight in place during the "
          "layer's backward, so each managed layer may run one forward and one "
          "backward per step (paper Remark 2): no reuse of a layer within a "
          "step, no gradient accumulation over micro-batches, and evaluation "
          "forwards must run under torch.no_grad(). Keep a reused layer as "
          "nn.Linear (or set layer.fused = False).")
    self._forge_calls[w] = n + 1

  def _forge_fused_update(self, p: torch.Tensor, grad_output: torch.Tensor,
                          input: torch.Tensor, *,
                          config: pallas_kernels.BlockConfig | None,
                          layer: str) -> None:
    """AdamW on managed weight ``p`` from ``G = grad_output^T input``."""
    if p not in self._forge_managed:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: its weight is no longer owned by this "
          "optimizer")
    if p in self._forge_updated:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: a second backward reached this weight "
          "before optimizer.step(); FORGE applies one update per step")
    group = self.param_groups[self._forge_managed[p]]
    state = self.state[p]
    if len(state) == 0:  # as torch.optim.Adam._init_group
      state["step"] = (
          torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]),
                      device=p.device)
          if group["capturable"] or group["fused"]
          else torch.tensor(0.0, dtype=_get_scalar_dtype()))
      state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
      state["exp_avg_sq"] = torch.zeros_like(
          p, memory_format=torch.preserve_format)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    for name, s in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
      if s.shape != p.shape or s.device != p.device or s.dtype != p.dtype:
        raise RuntimeError(
            f"forge_torch.Linear {layer}: optimizer state {name!r} is "
            f"{s.dtype}{list(s.shape)} on {s.device}, the weight "
            f"{p.dtype}{list(p.shape)} on {p.device} (was the model moved or "
            "cast after the optimizer state was created?)")
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    t = _get_value(state["step"]) + 1
    h = _bridge.torch_adamw_hparams(
        lr=_scalar(group["lr"]), beta1=beta1, beta2=beta2,
        eps=_scalar(group["eps"]),
        weight_decay=_scalar(group["weight_decay"]), step=t)
    # Kernel layout: x := grad_output (BT, out), dy := input (BT, in),
    # w := weight (out, in), so G' = grad_output^T input is torch's own grad.
    _bridge.fused_update(grad_output, input, p.data, (exp_avg, exp_avg_sq), h,
                         config=config)
    state["step"] += 1  # as torch's `step_t += 1`, once the update is done
    self._forge_updated[p] = True

  # -- the step ---------------------------------------------------------------

  def step(self, closure=None):
    """``torch.optim.AdamW.step`` for every non-managed parameter.

    Managed weights were already updated during backward (their ``grad`` is
    ``None``, so torch's step skips them). A managed weight that did *not* get
    a fused update in this step but has an ordinary ``grad`` (its layer ran
    with ``fused = False``, say) is updated by torch's step like any other.
    """
    loss = None
    if closure is not None:
      with torch.enable_grad():
        loss = closure()
    for p in self.managed_params:
      if p.grad is not None and p in self._forge_updated:
        raise RuntimeError(
            "a FORGE-managed weight (shape "
            f"{tuple(p.shape)}) was updated by its forge_torch.Linear's "
            "backward AND received an ordinary gradient from another use in "
            "the same step (a tied or shared weight). FORGE cannot sum two "
            "consumers (paper Remark 2): keep the layers that share this "
            "weight as nn.Linear (forge_torch.convert() does so).")
    _unhooked(torch.optim.AdamW.step)(self)
    self._forge_calls = WeakIdKeyDictionary()
    self._forge_updated = WeakIdKeyDictionary()
    return loss


def _in_backward() -> bool:
  get = getattr(torch._C, "_current_graph_task_id", None)
  return get is not None and get() != -1


def _check_supported(options: dict[str, Any]) -> None:
  bad = [k for k, v in options.items() if bool(v) != _UNSUPPORTED[k]]
  if bad:
    raise ValueError(
        f"forge_torch.AdamW does not support {', '.join(f'{k}=True' for k in bad)}"
        ": the fused kernel implements plain AdamW (use torch.optim.AdamW for"
        " these options)")


__all__ = ["AdamW"]
