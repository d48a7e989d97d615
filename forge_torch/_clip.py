"""Gradient clipping with FORGE-managed weights.

Two parts:

* **The guard.** A FORGE-managed weight is updated inside its layer's
  backward: its gradient is never formed, so ``weight.grad`` stays ``None``.
  ``torch.nn.utils``'s clipping functions skip parameters without a
  gradient, so on a model with managed weights they would silently compute
  the norm over the other parameters only and leave the managed weights
  unclipped. :func:`install` (run once when ``forge_torch`` is imported)
  wraps them so that they raise a ``RuntimeError`` naming the weights and the
  fix when a weight that FORGE updated since the last ``optimizer.step()``
  is among their parameters; any other call (no forge_torch layer, a layer
  with ``fused = False`` whose weight has an ordinary gradient) goes straight
  to torch's function, unchanged. ``torch.nn.utils.get_total_norm`` takes
  gradients, not parameters, so a managed weight cannot reach it and it is
  not wrapped.
* **``max_grad_norm=``**, the clipping that does cover managed weights: a
  forge_torch optimizer built with ``max_grad_norm=m`` steps as
  ``torch.nn.utils.clip_grad_norm_(its parameters, m)`` followed by its
  torch optimizer's ``step()``, in two passes of a closure,
  ``optimizer.step(closure)`` (:func:`two_pass_step`): the first measures
  every gradient's norm (a managed weight's in the registers of
  ``pallas_kernels.wgrad_sqnorm``, never stored), the second applies the
  updates with the clip coefficient folded into the fused kernel's
  hyperparameters (``pallas_kernels.grad_scaled``). See ``docs/clipping.md``.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers

import jax
import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.utils.weak import WeakIdKeyDictionary

import pallas_kernels
from forge_torch import _bridge
from forge_torch import distributed as _distributed
from forge_torch import linear as _linear
from pallas_kernels.rules import UpdateRule

# The torch.nn.utils functions that take parameters and read their .grad
# (the deprecated clip_grad_norm calls clip_grad_norm_ by its module name).
WRAPPED = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_")


def fused_weights_among(params) -> list[str]:
  """The names of the weights in ``params`` whose gradient FORGE took in
  backward since their optimizer's last ``step()`` (so their ``grad``, if
  any, is not it: ``None``, or a zero tensor left by a module's
  ``zero_grad(set_to_none=False)``): updated, added to their accumulation
  buffer (a step of ``accumulate_steps`` micro-batches not yet complete),
  or measured by the norm pass of ``max_grad_norm``."""
  names = []
  for p in params:
    if not (isinstance(p, torch.Tensor) and _linear.is_forge_weight(p)):
      continue
    optimizer = _linear.owner_of(p)
    if optimizer is not None and (
        p in optimizer._forge_updated or p in optimizer._forge_micro
        or p in getattr(optimizer, "_forge_clip_sq", ())):
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
      f"({shown}). FORGE takes those weights' gradient inside the backward "
      "(to update them, or into their accumulation buffer), so it never "
      "exists as a .grad: the clipping would cover only the other "
      "parameters and leave these weights unclipped. To clip by the global "
      "norm of every gradient, managed weights included, build the forge_torch"
      " optimizer with max_grad_norm=... and run the forward and backward in "
      "a closure, optimizer.step(closure) (docs/clipping.md). Or keep those "
      "layers as plain nn.Linear: forge_torch.convert(model, exclude=[...]) "
      "or layer.fused = False before the forward. Or do not clip them: "
      "leave out the clipping, or clip only the other parameters on purpose "
      "with [p for p in model.parameters() if not "
      "forge_torch.is_forge_weight(p)].")


def _guard(fn, name: str):
  """``fn`` (a torch clipping function, ``torch.nn.utils.<name>``), first
  checking its parameters (messages name it ``name``: torch's own name for
  some of these functions is a private one)."""
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
    check_clippable(params, name)
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
        setattr(module, name, _guard(fn, name))


# --- max_grad_norm: global-norm clipping in two passes ------------------------

# The pass an optimizer with max_grad_norm is in (its `_forge_clip_phase`).
NORM_PASS, UPDATE_PASS = _linear.NORM_PASS, "update"

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
TORCH_EPS = 1e-6


def check_max_grad_norm(value, where: str) -> float | None:
  """``value`` as a float (or ``None``: no clipping).

  Raises:
    TypeError: not a real number.
    ValueError: not finite and > 0.
  """
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{where}: max_grad_norm must be a number > 0 or None, "
                    f"got {type(value).__name__}")
  value = float(value)
  if not math.isfinite(value) or value <= 0:
    raise ValueError(f"{where}: max_grad_norm={value!r} must be a finite "
                     "number > 0 (or None: no clipping)")
  return value


def set_max_grad_norm(opt, value) -> None:
  """The setter of the optimizers' ``max_grad_norm`` (between steps only)."""
  name = type(opt).__name__
  value = check_max_grad_norm(value, f"forge_torch.{name}")
  _refuse_mid_step(opt, "max_grad_norm")
  opt._forge_max_grad_norm = value


def _refuse_mid_step(opt, option: str) -> None:
  if getattr(opt, "_forge_calls", None) is not None and opt._forge_in_step():
    raise RuntimeError(
        f"forge_torch.{type(opt).__name__}.{option} cannot change in the "
        "middle of a step: managed layers have already run forwards since "
        "the last optimizer.step(). Set it at construction or right after "
        "step().")


def signature_with_options(base: type, options) -> inspect.Signature:
  """``base``'s constructor signature plus the keyword-only ``options``
  (``(name, default)`` pairs: a forge_torch optimizer's own, e.g.
  ``max_grad_norm=None``), before any ``**kwargs``."""
  sig = inspect.signature(base)
  extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                             default=default) for name, default in options]
  params = list(sig.parameters.values())
  if params and params[-1].kind == inspect.Parameter.VAR_KEYWORD:
    params[-1:-1] = extra
  else:
    params += extra
  return sig.replace(parameters=params)


def _no_closure(name: str) -> RuntimeError:
  return RuntimeError(
      f"forge_torch.{name} was built with max_grad_norm=..., so each step runs"
      " the forward and backward twice (first the gradient norms, then the "
      "clipped updates): pass them as a closure, optimizer.step(closure), "
      "where closure() runs the forward and loss.backward() and returns the "
      "loss; do not call loss.backward() yourself before step() "
      "(docs/clipping.md). Set max_grad_norm=None to step without clipping.")


def measuring(opt, layer: str) -> bool:
  """In a managed layer's backward: whether this is the norm pass (measure,
  do not update).

  Raises:
    RuntimeError: the optimizer clips but the backward runs outside
      ``step(closure)``.
  """
  if getattr(opt, "_forge_max_grad_norm", None) is None:
    return False
  phase = getattr(opt, "_forge_clip_phase", None)
  if phase is None:
    raise RuntimeError(f"forge_torch.Linear {layer}: "
                       + str(_no_closure(type(opt).__name__)))
  return phase == NORM_PASS


@functools.lru_cache(maxsize=None)
def _sqnorm_fn(interpret: bool):
  return jax.jit(functools.partial(pallas_kernels.wgrad_sqnorm,
                                   interpret=interpret))


def sqnorm(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
  """``sum((x^T dy) ** 2)`` as an fp32 torch scalar on ``x``'s device, from
  ``pallas_kernels.wgrad_sqnorm`` (``G`` never stored).

  On CUDA the kernel is ordered with torch's current stream as the bridge
  orders the fused update (``forge_torch.set_sync_mode``): in stream mode
  the DLPack imports make the kernel wait for torch's queued work; where
  that is unavailable, and in host mode, the host synchronises torch's
  stream first and waits for the result. Either way the result's import
  into torch (``torch.from_dlpack``, as the bridge copies results back)
  orders torch's stream after the kernel.
  """
  cuda = x.is_cuda
  stream = torch.cuda.current_stream() if cuda else None
  ordered = (cuda and _bridge.get_sync_mode(effective=True) == "stream"
             and not _bridge._tfrt_gpu_client())
  if cuda and not ordered:
    stream.synchronize()
  x_c, dy_c = _bridge._contiguous(x), _bridge._contiguous(dy)
  xj = _bridge._to_jax(x_c)
  if ordered and not _bridge._device_has_ready_stream(next(iter(xj.devices()))):
    ordered = False
    stream.synchronize()  # before any JAX work on the imports
  out = _sqnorm_fn(not cuda)(xj, _bridge._to_jax(dy_c))
  if not ordered:
    jax.block_until_ready(out)
  # A copy torch owns; x_c and dy_c are referenced until it is queued.
  result = torch.from_dlpack(out).clone()
  del x_c, dy_c
  return result


def record(opt, p: torch.Tensor, grad_output: torch.Tensor,
           input: torch.Tensor, layer: str) -> None:
  """The norm pass, in managed weight ``p``'s backward: its squared
  gradient norm is kept for :func:`two_pass_step`; nothing is updated."""
  if p in opt._forge_clip_sq:
    raise RuntimeError(
        f"forge_torch.Linear {layer}: a second backward reached this weight "
        "in one closure call; FORGE measures and applies one gradient per "
        "step")
  with torch.no_grad():
    opt._forge_clip_sq[p] = sqnorm(grad_output, input)


def scaled(opt, rule: UpdateRule, values: dict) -> tuple[UpdateRule, dict]:
  """In the update pass: ``rule`` stepping from ``G * clip_coef`` (torch's
  ``clip_grad_norm_`` multiplies by the clamped coefficient) and ``values``
  with its factors; otherwise both unchanged."""
  if getattr(opt, "_forge_clip_phase", None) != UPDATE_PASS:
    return rule, values
  return pallas_kernels.grad_scaled(rule), {
      **values, "gscale_div": 1.0, "gscale_mul": opt._forge_clip_coef}


def in_update_pass(opt) -> bool:
  return getattr(opt, "_forge_clip_phase", None) == UPDATE_PASS


def _zero_gradients_only(opt) -> bool:
  """Whether no managed layer has run in this step and the parameters'
  gradients are zero tensors (some) or ``None`` (the rest). A managed
  weight zeroed by ``zero_grad(set_to_none=False)`` holds such a zero
  tensor in torch's terms (``.grad`` stays ``None``: FORGE forms none),
  which the step steps from (:meth:`_ForgeOptimizer._forge_step_from_zero`)."""
  if opt.__dict__.get("_forge_updated") or opt.__dict__.get("_forge_micro"):
    return False
  grads = [p.grad for p in _params(opt) if p.grad is not None]
  zeroed = bool(opt.__dict__.get("_forge_grad_zeroed"))
  return (bool(grads) or zeroed) and not any(bool(torch.any(g))
                                             for g in grads)


def _params(opt) -> list[torch.Tensor]:
  seen, out = set(), []
  for g in opt.param_groups:
    for p in g["params"]:
      if id(p) not in seen:
        seen.add(id(p))
        out.append(p)
  return out


def total_norm(opt, params) -> torch.Tensor:
  """The global norm as ``clip_grad_norm_`` computes it: the norm of the
  per-parameter norms (a managed weight's from its measured square)."""
  norms = []
  for p in params:
    sq = opt._forge_clip_sq.get(p)
    if sq is not None:
      norms.append(torch.sqrt(sq))
    elif p.grad is not None:
      norms.append(torch.linalg.vector_norm(p.grad, 2.0))
  if not norms:
    return torch.tensor(0.0)
  first = norms[0].device
  return torch.linalg.vector_norm(
      torch.stack([n.to(first) for n in norms]), 2.0)


def _rng_state():
  """torch's default generators' states (CPU, and each CUDA device's if
  CUDA is initialised)."""
  cuda = (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized()
          else None)
  return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
  cpu, cuda = state
  torch.set_rng_state(cpu)
  if cuda is not None:
    torch.cuda.set_rng_state_all(cuda)


def check_restore_buffers(value, where: str):
  """A ``restore_buffers`` option: ``None`` or a ``torch.nn.Module``."""
  if value is None or isinstance(value, torch.nn.Module):
    return value
  raise TypeError(
      f"{where}: restore_buffers must be a torch.nn.Module (the model whose "
      "buffers -- BatchNorm's running statistics, a spectral_norm's vectors "
      "-- the first of the two passes of max_grad_norm must not advance; "
      "for several models, torch.nn.ModuleList([model_a, model_b])) or "
      f"None, not {type(value).__name__}.")


def set_restore_buffers(opt, value) -> None:
  """The setter of the optimizers' ``restore_buffers`` (between steps only)."""
  name = type(opt).__name__
  value = check_restore_buffers(value, f"forge_torch.{name}")
  _refuse_mid_step(opt, "restore_buffers")
  opt._forge_restore_buffers = value


class BufferSnapshot:
  """A model's buffers as they are now, and :meth:`restore` to put them back.

  Every buffer of ``model`` and its submodules is copied; a module's buffer
  names are kept too, so that a buffer registered as ``None`` and filled
  since, or one registered since, is undone. A buffer not yet materialised
  (a lazy module's) is copied by a forward pre-hook of its module, right
  after the module's own hook has materialised it.
  """

  def __init__(self, model: torch.nn.Module):
    self._names = []    # (module, its buffer names)
    self._saved = {}    # (module id, name) -> (module, name, tensor, copy)
    self._hooks = []
    with torch.no_grad():
      for mod in model.modules():
        self._names.append((mod, tuple(mod._buffers)))
        if any(torch.nn.parameter.is_lazy(b) for b in mod._buffers.values()
               if b is not None):
          self._hooks.append(mod.register_forward_pre_hook(self._take))
        self._take(mod)

  def _take(self, mod: torch.nn.Module, *_) -> None:
    """Copies ``mod``'s buffers not copied yet (but a lazy one)."""
    with torch.no_grad():
      for name, buf in mod._buffers.items():
        if ((id(mod), name) not in self._saved
            and (buf is None or not torch.nn.parameter.is_lazy(buf))):
          self._saved[id(mod), name] = (
              mod, name, buf, None if buf is None else buf.clone())

  def restore(self) -> None:
    """Each buffer back to its tensor and values: one updated in place,
    reassigned, filled from ``None`` or registered since the snapshot holds
    what it held then (is gone). Only a buffer whose tensor or values
    changed is written (one host synchronisation per device, to compare)."""
    for hook in self._hooks:
      hook.remove()
    self._hooks = []
    for mod, names in self._names:
      for name in [n for n in mod._buffers if n not in names]:
        del mod._buffers[name]
        mod._non_persistent_buffers_set.discard(name)
    compare = []
    with torch.no_grad():
      for mod, name, buf, copy in self._saved.values():
        if buf is None:
          mod._buffers[name] = None
          continue
        if mod._buffers.get(name) is not buf:
          mod._buffers[name] = buf
        if (buf.shape != copy.shape or buf.dtype != copy.dtype
            or buf.device != copy.device):
          mod._buffers[name] = copy  # (resized or moved in place)
          continue
        compare.append((buf, copy))
      by_device = {}
      for buf, copy in compare:
        # Differs: not equal, NaN in both counting as equal (x != x: NaN).
        same = (buf == copy) | ((buf != buf) & (copy != copy))
        by_device.setdefault(buf.device, []).append(
            (buf, copy, ~same.all()))
      for pairs in by_device.values():
        differ = torch.stack([d for _, _, d in pairs]).tolist()
        for (buf, copy, _), changed in zip(pairs, differ):
          if changed:
            buf.copy_(copy)


# The optimizers whose step(closure) is running its closure (either pass),
# innermost last: another forge_torch optimizer's managed layer must not
# update in it (:func:`refuse_other_optimizer`).
RUNNING: list = _linear.CLIPPING


def _run(opt, closure, phase: str):
  opt._forge_clip_phase = phase
  RUNNING.append(opt)
  try:
    with torch.enable_grad():
      return closure()
  finally:
    RUNNING.pop()
    opt._forge_clip_phase = None


def refuse_other_optimizer(opt, layer: str) -> None:
  """Raises if a managed layer of ``opt`` is about to update inside the
  closure of another optimizer's clipped ``step(closure)``, which runs the
  closure twice: ``opt`` would update the layer in both passes (the second
  forward then fails, the layer already updated once)."""
  clipping = RUNNING[-1]
  if clipping is opt:
    return
  raise RuntimeError(
      f"forge_torch.Linear {layer}, managed by another "
      f"forge_torch.{type(opt).__name__}, ran in the closure of a "
      f"forge_torch.{type(clipping).__name__}.step(closure) with "
      "max_grad_norm, which runs the closure twice (a pass that measures "
      "the gradients' norm, then the pass that updates): the layer's own "
      "optimizer would update it in both. Build one optimizer over all the "
      "managed layers the closure runs (param groups can hold different "
      "options; all of them are then clipped together), or run the other "
      "optimizer's layers outside that closure.")


@getattr(torch, "_disable_dynamo", torch.compiler.disable)
def two_pass_step(opt, closure, finish):
  """``opt.step(closure)`` of an optimizer built with ``max_grad_norm``:
  ``clip_grad_norm_(params, max_grad_norm)`` then the torch step.

  1. Every parameter's ``grad`` tensor is zeroed (a ``grad`` of ``None``
     stays so: the first pass starts from the gradients torch's
     ``zero_grad(set_to_none=False)`` would leave); ``closure()`` runs with
     the managed layers measuring: each managed weight's squared gradient
     norm is kept, no weight is updated, the other parameters get their
     ``grad``.
  2. The global norm and the coefficient ``min(1, max_grad_norm / (norm +
     1e-6))`` are computed as ``clip_grad_norm_`` does (one host
     synchronisation, to read the coefficient into the kernels'
     hyperparameters); the norm is kept as ``opt.last_grad_norm``.
  3. Every ``grad`` tensor is zeroed again, torch's default random
     generators are rewound to their state before the first call (so that
     dropout draws the same masks), and ``closure()`` runs a second time:
     each managed layer's backward applies its update from ``G`` times
     the coefficient; then the other parameters' gradients are multiplied by
     it and the torch optimizer steps them (``finish()``: the rest of the
     optimizer's ``step()``, run once, in the update pass).

  With ``restore_buffers=model``, every buffer of ``model`` (BatchNorm's
  running statistics, a ``spectral_norm``'s vectors) is copied before the
  first call and put back after it (:class:`BufferSnapshot`), so that the
  second call starts from the same buffers and the step advances them
  once.

  Left to Python by Dynamo (a compiled function calling
  ``step(closure)``: a graph break, as at a managed layer), which would
  trace the closure's two passes and the optimizer's bookkeeping between
  them; a compiled model the closure calls still runs its compiled code.

  Returns:
    The second call's loss.

  Without a closure, a step from zero gradients (no managed layer run in
  it: ``torch.distributed.checkpoint``'s state-forming step) is the rest of
  ``step()`` as is, clipping leaving zeros as they are.

  Raises:
    RuntimeError: no ``closure`` (gradients other than zeros);
      ``accumulate_steps > 1`` (the norm of an
      accumulated gradient needs the whole accumulation); a process group of
      more than one rank (the norms are measured before any reduction).
  """
  name = type(opt).__name__
  if closure is None:
    if not _zero_gradients_only(opt):
      raise _no_closure(name)
    # No backward ran and every gradient is zero: a step from zero
    # gradients, which clipping leaves as they are (their norm is 0) --
    # torch.distributed.checkpoint forms a fresh optimizer's state so.
    opt._forge_clip_coef = 1.0  # (what clip_grad_norm_ takes for a norm of 0)
    opt._forge_clip_phase = UPDATE_PASS  # the rest of step(), as below
    try:
      finish()
    finally:
      opt._forge_clip_phase = None
    return None
  if getattr(opt, "accumulate_steps", 1) > 1:
    raise RuntimeError(
        f"forge_torch.{name}: max_grad_norm with accumulate_steps > 1 is not "
        "supported (the norm of the accumulated gradient needs every "
        "micro-batch first); accumulate without clipping, or clip without "
        "accumulation.")
  dist = torch.distributed
  if (dist.is_available() and dist.is_initialized()
      and dist.get_world_size() > 1):
    raise RuntimeError(
        f"forge_torch.{name}: max_grad_norm under torch.distributed (data "
        "parallelism) is not supported: the norm pass measures each managed "
        "weight's gradient on this rank, before any reduction, so the ranks' "
        "norms would differ from the averaged gradient's. Clip in a single "
        "process, or keep the clipped layers as nn.Linear.")
  params = _params(opt)
  prepared = [p for p in params if _distributed.is_data_parallel(p)
              or _distributed.is_sharded(p)]
  if prepared:  # (their reduction refuses clipping: refused before a pass)
    names = ", ".join(_linear.weight_name(p) for p in prepared[:3])
    raise RuntimeError(
        f"forge_torch.{name}: max_grad_norm is not supported with the data "
        f"parallelism of forge_torch.distributed.prepare_ddp / prepare_fsdp "
        f"(here {names}{' ...' if len(prepared) > 3 else ''}), whatever "
        "the process group's size: the norm must be taken over the ranks' "
        "averaged gradients of the whole model before any update. Set "
        "max_grad_norm=None, or keep the layers to clip as nn.Linear.")

  def clear():
    # Each pass starts from the same gradients: zero where a tensor is
    # (kept, as torch's zero_grad(set_to_none=False) keeps it, so that a
    # closure that zeroes so leaves a parameter its backward does not reach
    # with a zero gradient, which torch's step steps), none elsewhere.
    for p in params:
      g = p.grad
      if g is not None:
        if g.grad_fn is not None:
          g.detach_()
        else:
          g.requires_grad_(False)
        g.zero_()

  clear()
  opt._forge_clip_sq = WeakIdKeyDictionary()
  rng = _rng_state()
  model = getattr(opt, "_forge_restore_buffers", None)
  buffers = BufferSnapshot(model) if model is not None else None
  try:
    try:
      _run(opt, closure, NORM_PASS)
    finally:
      if buffers is not None:  # as before the first call, raised or not
        buffers.restore()
        buffers = None
    with torch.no_grad():
      norm = total_norm(opt, params)
      coef = torch.clamp(opt._forge_max_grad_norm / (norm + TORCH_EPS),
                         max=1.0)
    opt.last_grad_norm = norm
    opt._forge_clip_sq = WeakIdKeyDictionary()
    # The first pass's forwards no longer count: the second runs them again.
    opt._forge_reset_step()
    clear()
    opt._forge_clip_coef = float(coef)
    _set_rng_state(rng)  # the second call draws what the first drew
    loss = _run(opt, closure, UPDATE_PASS)
    with torch.no_grad():
      for p in params:
        if p.grad is not None:
          p.grad.mul_(coef.to(p.grad.device))
    opt._forge_clip_phase = UPDATE_PASS  # the rest of step()
    try:
      finish()
    finally:
      opt._forge_clip_phase = None
  except BaseException:
    # The step can be called again: its measurements and forward counts go
    # (a weight updated by an update pass that then raised stays updated).
    opt._forge_clip_sq = WeakIdKeyDictionary()
    opt._forge_reset_step()
    raise
  return loss


__all__ = ["check_clippable", "fused_weights_among", "install",
           "two_pass_step"]
