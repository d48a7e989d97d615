"""Update rules in ``torch.optim``'s operation order, for the fused kernel.

Each rule is a pure ``jnp`` function (a :class:`pallas_kernels.rules.UpdateRule`)
that performs, on fp32 tiles, the same elementwise operations in the same order
as torch's single-tensor implementation of its optimizer (torch 2.11-2.14,
``torch/optim/<family>.py``, ``_single_tensor_<family>``), so that given the
same ``G`` the result matches torch to rounding (torch's vectorised CPU
kernels fuse some multiply-adds and use a non-IEEE ``sqrt``, and the CUDA
``foreach`` implementations reassociate a few products, so "to rounding" means
a few ulps per step, not bit identity). One exception: torch's CUDA
``fused=True`` Adam/AdamW kernel is not its single-tensor arithmetic (fp32
scalars, fma-form moments, fp32 bias corrections), so
``adam_rule(cuda_fused=True)`` reproduces that kernel instead.

Conventions:

* A rule's **slot names are torch's state names** (``"exp_avg"``,
  ``"momentum_buffer"``, ...), so ``forge_torch``'s optimizers read the slot
  tensors straight out of ``optimizer.state[p]``.
* Every scalar arrives as a runtime hyperparameter, computed by the caller in
  Python doubles exactly as torch computes it and rounded once to fp32 (as
  torch does when it applies a Python scalar to an fp32 tensor): ``1 - beta1``
  is an hparam, never formed in fp32 here. A new learning rate or step never
  recompiles the kernel; only the options that change the code (``momentum !=
  0``, ``nesterov``, ``centered``, ``amsgrad``, Adam's CUDA ``fused``) pick a
  different rule.
* The prologue every family shares (torch: ``grad = -grad`` if ``maximize``;
  ``grad = grad + weight_decay * param``; for the decoupled variants
  ``param *= 1 - lr * weight_decay``) is always in the rule, driven by hparams
  whose neutral values are exact: ``grad_sign`` (``1`` or ``-1``),
  ``weight_decay`` (``0`` for none or decoupled) and ``decay`` (``1`` for
  none or coupled). ``g * 1``, ``g + 0 * w`` and ``w * 1`` are exact, so the
  neutral settings reproduce torch's skipped branches bit for bit.

No torch import here (the rules are JAX); :mod:`forge_torch.optim` packs the
hyperparameters from torch's param groups and state
(:func:`~pallas_kernels.rules.pack_host`). The
registry :mod:`pallas_kernels.families` names each family's factory here.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from pallas_kernels.rules import (CENTERED_VARIANCE, UpdateRule, lerp,
                                  pack_host, rule_name, select)

# --------------------------------------------------------------------------
# Shared pieces.
# --------------------------------------------------------------------------

_COUPLED = ("grad_sign", "weight_decay")
_DECOUPLED = _COUPLED + ("decay",)


def _grad(g, w, h):
  """``grad = -grad if maximize``; ``grad = grad.add(param, alpha=wd)``."""
  return g * h["grad_sign"] + h["weight_decay"] * w


def _decay(w, h):
  """``param.mul_(1 - lr * weight_decay)`` (decoupled weight decay)."""
  return w * h["decay"]


# --------------------------------------------------------------------------
# The families. Each factory is cached: one UpdateRule object per variant, so
# the bridge's jit cache (keyed on the rule) compiles each variant once.
# --------------------------------------------------------------------------


def _name(base: str, **flags: bool) -> str:
  """A torch rule's name: :func:`~pallas_kernels.rules.rule_name`, then
  ``"_torch"`` (``"adam_amsgrad_torch"``)."""
  return rule_name(base, **flags, torch=True)


def sgd_rule(momentum: bool = False, nesterov: bool = False) -> UpdateRule:
  """``torch.optim.SGD`` (``_single_tensor_sgd``).

    grad = maximize-sign * grad + weight_decay * param
    buf = buf * buf_decay + one_minus_dampening * grad      (momentum)
    grad = grad + momentum * buf  (nesterov)  |  grad = buf
    param = param + (-lr) * grad

  torch's first step sets ``buf = grad.clone()``; the caller reproduces it
  exactly with ``buf = 0``, ``buf_decay = 0``, ``one_minus_dampening = 1``.
  ``momentum``: torch's ``momentum != 0``. The defaults are torch's
  (``momentum=0``, ``nesterov=False``).
  """
  return _sgd_rule(bool(momentum), bool(nesterov and momentum))


@functools.lru_cache(maxsize=None)
def _sgd_rule(momentum: bool, nesterov: bool) -> UpdateRule:
  """:func:`sgd_rule`, one object per variant however it is called."""

  def update(g, w, slots, h):
    g = _grad(g, w, h)
    if momentum:
      (buf,) = slots
      buf = buf * h["buf_decay"] + h["one_minus_dampening"] * g
      g = g + h["momentum"] * buf if nesterov else buf
      return w + h["neg_lr"] * g, (buf,)
    return w + h["neg_lr"] * g, ()

  hparams = _COUPLED + ("neg_lr",)
  if momentum:
    hparams += ("buf_decay", "one_minus_dampening")
  if nesterov:
    hparams += ("momentum",)
  return UpdateRule(
      name=_name("sgd", momentum=momentum, nesterov=nesterov),
      slots=("momentum_buffer",) if momentum else (), hparams=hparams,
      update=update)


@functools.lru_cache(maxsize=None)
def adagrad_rule() -> UpdateRule:
  """``torch.optim.Adagrad`` (``_single_tensor_adagrad``, dense).

    grad = maximize-sign * grad + weight_decay * param
    sum = sum + grad * grad                  (addcmul_, value=1)
    std = sqrt(sum) + eps
    param = param + neg_clr * (grad / std)   (neg_clr = -lr / (1 + (t-1) lr_decay))
  """

  def update(g, w, slots, h):
    (state_sum,) = slots
    g = _grad(g, w, h)
    state_sum = state_sum + g * g
    std = jnp.sqrt(state_sum) + h["eps"]
    return w + h["neg_clr"] * (g / std), (state_sum,)

  return UpdateRule(name=_name("adagrad"), slots=("sum",),
                    hparams=_COUPLED + ("eps", "neg_clr"), update=update,
                    second_moments=("sum",))


def rmsprop_rule(centered: bool = False, momentum: bool = False
                 ) -> UpdateRule:
  """``torch.optim.RMSprop`` (``_single_tensor_rmsprop``).

    grad = maximize-sign * grad + weight_decay * param
    square_avg = square_avg * alpha + (1 - alpha) * grad * grad
    centered: grad_avg.lerp_(grad, 1 - alpha)
              avg = sqrt(square_avg - grad_avg * grad_avg) + eps
    else:     avg = sqrt(square_avg) + eps
    momentum: buf = buf * momentum + grad / avg; param = param + (-lr) * buf
    else:     param = param + (-lr) * (grad / avg)

  Slots ``square_avg``, then ``momentum_buffer`` (momentum > 0), then
  ``grad_avg`` (centered): torch's state names. ``momentum``: torch's
  ``momentum > 0``. The defaults are torch's (``centered=False``,
  ``momentum=0``).
  """
  return _rmsprop_rule(bool(centered), bool(momentum))


@functools.lru_cache(maxsize=None)
def _rmsprop_rule(centered: bool, momentum: bool) -> UpdateRule:
  """:func:`rmsprop_rule`, one object per variant however it is called."""

  def update(g, w, slots, h):
    square_avg, *rest = slots
    buf = rest.pop(0) if momentum else None
    grad_avg = rest.pop(0) if centered else None
    g = _grad(g, w, h)
    square_avg = square_avg * h["alpha"] + h["one_minus_alpha"] * g * g
    if centered:
      grad_avg = lerp(grad_avg, g, h["one_minus_alpha"])
      avg = jnp.sqrt(square_avg + (-1.0 * grad_avg) * grad_avg) + h["eps"]
    else:
      avg = jnp.sqrt(square_avg) + h["eps"]
    new = [square_avg]
    if momentum:
      buf = buf * h["momentum"] + g / avg
      w = w + h["neg_lr"] * buf
      new.append(buf)
    else:
      w = w + h["neg_lr"] * (g / avg)
    if centered:
      new.append(grad_avg)
    return w, tuple(new)

  return UpdateRule(
      name=_name("rmsprop", centered=centered, momentum=momentum),
      slots=("square_avg",) + (("momentum_buffer",) if momentum else ())
      + (("grad_avg",) if centered else ()),
      hparams=_COUPLED + ("alpha", "one_minus_alpha", "eps", "neg_lr")
      + (("momentum",) if momentum else ()),
      update=update, second_moments=("square_avg",),
      no_quantized_state=CENTERED_VARIANCE if centered else None)


def adam_rule(amsgrad: bool = False, cuda_fused: bool = False
              ) -> UpdateRule:
  """``torch.optim.Adam`` / ``AdamW`` (``_single_tensor_adam``, non-capturable).

    grad = maximize-sign * grad + weight_decay * param   (coupled: Adam)
    param = param * (1 - lr * wd)                        (decoupled: AdamW)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    amsgrad: max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq), used below
    denom = sqrt(exp_avg_sq) / sqrt(1 - beta2**t) + eps
    param = param + (-lr / (1 - beta1**t)) * (exp_avg / denom)

  ``cuda_fused``: instead the arithmetic of torch's CUDA ``fused=True``
  kernel (torch >= 2.11, ``aten/src/ATen/native/cuda/fused_adam_utils.cuh``),
  which computes everything in fp32 from fp32-rounded scalars ``b1``,
  ``b2``, ``lr``, ``wd``, ``eps``:

    grad = maximize-sign * grad + wd * param             (one fma)
    param = param - (lr * wd) * param                    (decoupled; one fma)
    exp_avg = b1 * exp_avg + grad * (1 - b1)             (fma(-b1, g, g) inside)
    exp_avg_sq = b2 * exp_avg_sq + (grad * grad) * (1 - b2)
    denom = sqrt(v) / sqrt(1 - powf(b2, t)) + eps
    param = param - (exp_avg * (lr / (1 - powf(b1, t)))) / denom

  Here ``1 - b2`` is one minus the *fp32* ``beta2`` (exact in fp32), not
  torch's ``foreach``/for-loop ``fp32(1 - beta2)``: for ``beta2 = 0.999``
  they differ by 1.3e-5 relative, which scales every ``exp_avg_sq`` by that
  much, more than the fp32 bar. The caller supplies ``b1``, ``b2``, the two
  complements, ``bc2_sqrt`` and ``step_size`` computed in fp32 as the kernel
  does (``powf`` from the device itself).

  The defaults are torch's (``amsgrad=False``, ``fused=None``).
  """
  return _adam_rule(bool(amsgrad), bool(cuda_fused))


@functools.lru_cache(maxsize=None)
def _adam_rule(amsgrad: bool, cuda_fused: bool) -> UpdateRule:
  """:func:`adam_rule`, one object per variant however it is called."""

  def update(g, w, slots, h):
    exp_avg, exp_avg_sq, *mx = slots
    g = _grad(g, w, h)
    if cuda_fused:
      w = w + h["neg_lr_wd"] * w
      exp_avg = h["b1"] * exp_avg + g * h["one_minus_b1_f32"]
      exp_avg_sq = h["b2"] * exp_avg_sq + (g * g) * h["one_minus_b2_f32"]
    else:
      w = _decay(w, h)
      exp_avg = lerp(exp_avg, g, h["one_minus_b1"])
      exp_avg_sq = exp_avg_sq * h["b2"] + h["one_minus_b2"] * g * g
    if amsgrad:
      mx = [jnp.maximum(mx[0], exp_avg_sq)]
      v = mx[0]
    else:
      v = exp_avg_sq
    denom = jnp.sqrt(v) / h["bc2_sqrt"] + h["eps"]
    if cuda_fused:
      w = w - (exp_avg * h["step_size"]) / denom
    else:
      w = w + h["neg_step_size"] * (exp_avg / denom)
    return w, (exp_avg, exp_avg_sq, *mx)

  if cuda_fused:
    hparams = _COUPLED + ("neg_lr_wd", "b1", "one_minus_b1_f32", "b2",
                          "one_minus_b2_f32", "bc2_sqrt", "eps", "step_size")
  else:
    hparams = _DECOUPLED + ("one_minus_b1", "b2", "one_minus_b2", "bc2_sqrt",
                            "eps", "neg_step_size")
  return UpdateRule(
      name=_name("adam", amsgrad=amsgrad, cuda_fused=cuda_fused),
      slots=("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad
                                         else ()),
      hparams=hparams, update=update,
      second_moments=("exp_avg_sq",) + (("max_exp_avg_sq",) if amsgrad
                                         else ()),
      # optax's AdamW tilings, for the same two moments (amsgrad's third
      # slot is more state than they were tuned for).
      tuned_as=None if amsgrad else "adamw")


@functools.lru_cache(maxsize=None)
def adamax_rule() -> UpdateRule:
  """``torch.optim.Adamax`` (``_single_tensor_adamax``, non-capturable).

    grad = maximize-sign * grad + weight_decay * param
    exp_avg.lerp_(grad, 1 - beta1)
    exp_inf = maximum(exp_inf * beta2, |grad| + eps)
    param = param + (-lr / (1 - beta1**t)) * (exp_avg / exp_inf)
  """

  def update(g, w, slots, h):
    exp_avg, exp_inf = slots
    g = _grad(g, w, h)
    exp_avg = lerp(exp_avg, g, h["one_minus_b1"])
    exp_inf = jnp.maximum(exp_inf * h["b2"], jnp.abs(g) + h["eps"])
    return w + h["neg_clr"] * (exp_avg / exp_inf), (exp_avg, exp_inf)

  return UpdateRule(name=_name("adamax"), slots=("exp_avg", "exp_inf"),
                    hparams=_COUPLED + ("one_minus_b1", "b2", "eps", "neg_clr"),
                    update=update, second_moments=("exp_inf",))


@functools.lru_cache(maxsize=None)
def nadam_rule() -> UpdateRule:
  """``torch.optim.NAdam`` (``_single_tensor_nadam``, non-capturable).

    grad = maximize-sign * grad + weight_decay * param   (coupled)
    param = param * (1 - lr * wd)                        (decoupled)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    denom = sqrt(exp_avg_sq / (1 - beta2**t)) + eps
    param = param + c_grad * (grad / denom)
    param = param + c_avg * (exp_avg / denom)

  ``c_grad = -lr (1 - mu_t) / (1 - mu_product)`` and
  ``c_avg = -lr mu_{t+1} / (1 - mu_product mu_{t+1})`` come from the step and
  the ``mu_product`` state scalar, which the caller advances as torch does.
  """

  def update(g, w, slots, h):
    exp_avg, exp_avg_sq = slots
    g = _grad(g, w, h)
    w = _decay(w, h)
    exp_avg = lerp(exp_avg, g, h["one_minus_b1"])
    exp_avg_sq = exp_avg_sq * h["b2"] + h["one_minus_b2"] * g * g
    denom = jnp.sqrt(exp_avg_sq / h["bc2"]) + h["eps"]
    w = w + h["c_grad"] * (g / denom)
    w = w + h["c_avg"] * (exp_avg / denom)
    return w, (exp_avg, exp_avg_sq)

  return UpdateRule(
      name=_name("nadam"), slots=("exp_avg", "exp_avg_sq"),
      hparams=_DECOUPLED + ("one_minus_b1", "b2", "one_minus_b2", "bc2", "eps",
                            "c_grad", "c_avg"),
      update=update, second_moments=("exp_avg_sq",))


@functools.lru_cache(maxsize=None)
def radam_rule() -> UpdateRule:
  """``torch.optim.RAdam`` (``_single_tensor_radam``, non-capturable).

    grad = maximize-sign * grad + weight_decay * param   (coupled)
    param = param * (1 - lr * wd)                        (decoupled)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    bias_corrected_exp_avg = exp_avg / (1 - beta1**t)
    rho_t > 5:  param = param - bce * lr * (sqrt(bc2) / (sqrt(exp_avg_sq) + eps)) * rect
    else:       param = param - bce * lr

  ``rectify`` (1 if ``rho_t > 5`` else 0) and ``rect`` are computed by the
  caller from the step, as torch does in Python.
  """

  def update(g, w, slots, h):
    exp_avg, exp_avg_sq = slots
    g = _grad(g, w, h)
    w = _decay(w, h)
    exp_avg = lerp(exp_avg, g, h["one_minus_b1"])
    exp_avg_sq = exp_avg_sq * h["b2"] + h["one_minus_b2"] * g * g
    bce_lr = (exp_avg / h["bc1"]) * h["lr"]
    adaptive = h["bc2_sqrt"] / (jnp.sqrt(exp_avg_sq) + h["eps"])
    u = select(h["rectify"] > 0, (bce_lr * adaptive) * h["rect"], bce_lr)
    return w - u, (exp_avg, exp_avg_sq)

  return UpdateRule(
      name=_name("radam"), slots=("exp_avg", "exp_avg_sq"),
      hparams=_DECOUPLED + ("one_minus_b1", "b2", "one_minus_b2", "bc1", "lr",
                            "bc2_sqrt", "eps", "rect", "rectify"),
      update=update, second_moments=("exp_avg_sq",))


def adamw_hparams(*, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, step: float) -> np.ndarray:
  """``adam_rule(amsgrad=False)``'s packed vector for ``torch.optim.AdamW``
  (decoupled weight decay, not maximizing) at 1-based step ``step``, its
  scalars computed in Python doubles as torch computes them."""
  bc1 = 1 - beta1**step
  bc2 = 1 - beta2**step
  return pack_host(adam_rule(amsgrad=False), {
      "grad_sign": 1.0,
      "weight_decay": 0.0,
      "decay": (1 - lr * weight_decay) if weight_decay != 0 else 1.0,
      "one_minus_b1": 1 - beta1,
      "b2": beta2,
      "one_minus_b2": 1 - beta2,
      "bc2_sqrt": bc2**0.5,
      "eps": eps,
      "neg_step_size": -(lr / bc1),
  })


__all__ = ["adagrad_rule", "adam_rule", "adamax_rule", "adamw_hparams",
           "nadam_rule", "radam_rule", "rmsprop_rule", "sgd_rule"]
