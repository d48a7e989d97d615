"""forge_torch optimizers: ``torch.optim`` optimizers that also drive FORGE layers.

``forge_torch.SGD``, ``Adagrad``, ``RMSprop``, ``Adam``, ``AdamW``,
``Adamax``, ``NAdam`` and ``RAdam`` each subclass their ``torch.optim``
counterpart: same constructor (torch's signature and defaults, plus the
keyword-only ``max_grad_norm``, ``restore_buffers``, ``moments``,
``stochastic_rounding`` and ``seed``), ``param_groups``, ``state``
(torch's names, dtypes and devices) and ``state_dict()``, so checkpoints
interchange with the torch optimizer (with ``moments=None``: quantized
state loads into forge_torch only).

Semantics of a step. torch's loop is::

    loss.backward(); opt.step(); opt.zero_grad(); sched.step()

torch updates every parameter in ``opt.step()``, first incrementing
``state["step"]`` to ``t`` (families with a step count) and using the group's
current ``lr``. Here a FORGE-managed weight is updated during
``loss.backward()`` instead, with exactly that ``t`` (``state["step"] + 1``;
``state["step"]`` is incremented right after the update; a tensor on a GPU
(a ``fused`` group's), with every managed weight's in one launch, when
``opt.step()``, ``zero_grad()`` or ``state_dict()`` runs next) and the
group's
hyperparameters *at backward time* -- the values ``opt.step()`` would read,
since a scheduler only changes them after ``opt.step()``. ``opt.step()`` then
updates every other parameter with torch's own ``step`` (managed weights have
``grad is None`` and are skipped by it). The trajectory is torch's.

A managed weight whose layer ran no backward in a step is not touched, as
torch skips a parameter whose ``grad`` is ``None``.

Gradient accumulation (opt-in, ``opt.accumulate_steps = K``). torch's loop
runs K backwards, which sum into ``.grad``, then ``opt.step()``. Here a
managed weight's first K - 1 backwards of a step add ``G`` to an fp32 buffer
(:mod:`forge_torch._accumulate`) and the K-th applies the update to the sum;
``opt.step()`` applies it for a weight that got fewer micro-batches.

Autocast. Under ``torch.autocast(dtype=torch.bfloat16)`` a managed layer's
forward, input gradient and bias gradient are autocast's linear's; the update
reads ``G`` formed in fp32 from the bf16 ``input`` and ``grad_output`` and
writes the fp32 weight and state (torch's AMP rounds ``G`` to bf16 first).

Structure. :class:`_ForgeOptimizer` is the one implementation of the managed
weight machinery (registration on ``forge_torch.Linear`` weights, per-weight
state, step counting, the fused call, ``state_dict`` round trip, misuse
errors). A family is a small subclass of it and of its torch optimizer that
says which rule a param group uses (its family's torch-order rule from the
registry :mod:`pallas_kernels.families`; slot names = torch's state names),
how torch initialises a parameter's state, and how to compute the rule's
scalars from the group and the step.
"""

from __future__ import annotations

import collections
import functools
import numbers
import operator
import warnings
import zlib
from typing import Any, Callable, ClassVar, Mapping

import jax.numpy as jnp
import numpy as np
import torch
from torch.optim.optimizer import _get_scalar_dtype, _get_value

import pallas_kernels
from forge_torch import _accumulate
from forge_torch import _bridge
from forge_torch import _clip
from forge_torch import distributed as _distributed
from forge_torch import linear as _linear
from pallas_kernels import families
from pallas_kernels import quant
from pallas_kernels.quant import MomentFormat, Quantized
from pallas_kernels.rules import UpdateRule, pack_host

# Options torch has that no family fuses: option -> (value that is supported,
# why the other is not).
_REFUSED: dict[str, tuple[Any, str]] = {
    "capturable": (False, "a CUDA graph can record FORGE's fused updates "
                   "only for Adam and AdamW with fused=True (their step's "
                   "scalars then formed on the GPU from the step count, the "
                   "Mosaic GPU kernel launched directly); other families and "
                   "the for-loop / foreach Adam form them on the host"),
    "differentiable": (False, "the fused update happens inside backward and "
                       "is not itself differentiable"),
}


# moments= names -> the pallas_kernels.quant format kind (forge_jax's names).
MOMENT_KINDS: dict[str, str] = {"int8": "int8", "fp8": "fp8_e4m3",
                                "fp8_e4m3": "fp8_e4m3",
                                "fp8_e5m2": "fp8_e5m2"}
# A quantized moment's codes: the format kind -> their torch dtype.
_CODE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8,
                                        "fp8_e4m3": torch.float8_e4m3fn,
                                        "fp8_e5m2": torch.float8_e5m2}
# state[name + SCALE_SUFFIX]: a quantized moment's float32 scales.
SCALE_SUFFIX = "_scale"
# The warning lists at most this many parameters by position.
_LIST_AT_MOST = 8
# Identity keys and writes of _linear.WeakIdMap, on the per-call paths.
_key = _linear._map_key
_group_index = _linear.group_index


class _InputDtypeError(TypeError, RuntimeError):
  """A managed layer's input in a dtype the layer does not compute in: a
  ``TypeError``, and a ``RuntimeError`` as ``nn.Linear``'s dtype mismatch
  is, so that code written for ``nn.Linear`` catches it alike."""


class _Raw:
  """A state tensor that torch's ``load_state_dict`` must not cast to the
  parameter's dtype (codes and float32 scales): it casts ``torch.Tensor``
  values and rebuilds iterables, and leaves anything else as it is."""

  __slots__ = ("tensor",)

  def __init__(self, tensor: torch.Tensor):
    self.tensor = tensor


def _quantize_tensor(x: torch.Tensor, fmt: MomentFormat, second: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
  """``pallas_kernels.quant.quantize(x)`` as torch tensors on ``x``'s
  device: codes of ``x``'s shape and float32 scales, one per 64 elements of
  its last axis. All zeros (the usual initial state): zero codes and zero
  scales, as the format stores them, without a host round trip."""
  dtype = _CODE_DTYPES[fmt.kind]
  scale_shape = fmt.scale_shape(x.shape)
  if not bool(torch.any(x)):
    return (torch.zeros(x.shape, dtype=dtype, device=x.device),
            torch.zeros(scale_shape, dtype=torch.float32, device=x.device))
  qx = quant.quantize(jnp.asarray(x.detach().float().cpu().numpy()), fmt,
                      second_moment=second)
  bits = np.array(qx.q).view(np.int8 if fmt.kind == "int8" else np.uint8)
  q = torch.from_numpy(bits).view(dtype).to(x.device)
  return q, torch.from_numpy(np.array(qx.scale)).to(x.device)


def _dequantize_tensor(q: torch.Tensor, scale: torch.Tensor,
                       block: int = 64) -> torch.Tensor:
  """``float32(q) * scale`` of each element's block (the format's
  dequantization), float32."""
  full = scale.repeat_interleave(block, dim=-1)[..., :q.shape[-1]]
  return q.float() * full


# The keyword-only options a forge_torch optimizer adds to torch's
# constructor, with their defaults (in its signature, in this order).
FORGE_OPTIONS = (("max_grad_norm", None), ("restore_buffers", None),
                 ("moments", None), ("stochastic_rounding", False),
                 ("seed", None))


def _unhooked(fn: Callable) -> Callable:
  """``fn`` without torch's step-hook wrapper (so hooks run once, from ours)."""
  while getattr(fn, "hooked", False):
    fn = fn.__wrapped__
  return fn


def _scalar(v) -> float:
  return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def _loop_operand(v):
  """A hyperparameter as torch's for-loop step computes with it
  (``torch.optim.optimizer._to_scalar``): a Tensor stays one (0-d,
  detached), so that the step's scalar expressions of it run in its dtype
  (float32) as torch's do; anything else is a float."""
  if isinstance(v, torch.Tensor):
    return v.detach().reshape(())
  return float(v)


def _zeros(p: torch.Tensor) -> torch.Tensor:
  return torch.zeros_like(p, memory_format=torch.preserve_format)


def _zero_step(p: torch.Tensor, fused) -> torch.Tensor:
  """``state["step"]`` as torch's ``_init_group`` creates it.

  On the parameter's device in fp32 for a ``fused`` group (the group's
  option, in the families that have it: SGD, Adagrad, Adam, AdamW), else a
  CPU scalar of torch's default scalar dtype. (``capturable``, torch's
  other on-device case, is taken only with ``fused``.)
  """
  if fused:
    return torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused),
                       device=p.device)
  return torch.tensor(0.0, dtype=_get_scalar_dtype())


def _prologue(group: Mapping[str, Any], *, decoupled: bool = False
              ) -> dict[str, float]:
  """The shared rule hparams: maximize sign, coupled / decoupled decay."""
  wd = _scalar(group["weight_decay"])
  lr = _scalar(group["lr"])
  return {
      "grad_sign": -1.0 if group.get("maximize") else 1.0,
      "weight_decay": 0.0 if decoupled else wd,
      "decay": (1 - lr * wd) if (decoupled and wd != 0) else 1.0,
  }


class _ForgeOptimizer:
  """The managed-weight machinery shared by every forge_torch optimizer.

  Mixed in *before* a ``torch.optim`` optimizer (``class SGD(_ForgeOptimizer,
  torch.optim.SGD)``), whose constructor is inherited unchanged. A family
  implements three hooks:

  * :meth:`_forge_rule` -- the :class:`UpdateRule` for a param group (its
    static options pick it, and the managed weight's ``device`` where torch's
    arithmetic depends on it; raise ``ValueError`` for a combination that
    cannot be fused). Its slots are torch's state names.
  * :meth:`_forge_init_state` -- a new parameter's state, exactly as torch's
    ``_init_group`` creates it (``{}`` if torch keeps none).
  * :meth:`_forge_hparams` -- the rule's scalars for this update, in Python
    doubles as torch computes them, plus any scalar state tensors to store
    after the update (e.g. NAdam's ``mu_product``). ``state["step"]``, if
    the family has one, is counted here in the base.

  The rule and the scalars depend on the group's options, the step and the
  weight's device only (unless ``_forge_hparams_per_weight``), so the
  weights of a group share one computation per step while the group's
  options stay the same (:meth:`_forge_shared_scalars`).
  """

  # The torch optimizer this class extends (set by __init_subclass__).
  _forge_torch: ClassVar[type[torch.optim.Optimizer]]
  # torch.amp.GradScaler then hands the step its scale (``grad_scale``,
  # ``found_inf``) instead of unscaling ``.grad``s behind our back, so step()
  # can refuse it: the managed weights were already updated during backward
  # with the loss-scaled gradient, which no later unscaling can undo.
  _step_supports_amp_scaling: ClassVar[bool] = True
  # Whether the family counts steps (``state["step"]``), which stochastic
  # rounding draws its random bits from.
  _forge_counts_steps: ClassVar[bool] = True
  # The low-precision options (set per instance by the constructor).
  _forge_moments: str | None = None
  _forge_format: MomentFormat | None = None
  _forge_sr: bool = False
  _forge_seed: int = 0
  # Whether _forge_hparams reads the weight's own state (NAdam's
  # mu_product) beside the group's options, the step t, ``fresh`` and the
  # weight's device; if not, one computation serves every weight of a group
  # in a step (_forge_shared_scalars).
  _forge_hparams_per_weight: ClassVar[bool] = False
  # Whether capturable=True is accepted (with fused=True): the family forms
  # its step's scalars on the GPU (_forge_captured_hparams), so a CUDA
  # graph can record its fused updates.
  _forge_capturable: ClassVar[bool] = False
  # Slots (torch's state names) that torch's step -- its for-loop and
  # foreach forms; fused=True refuses -- also updates in float32 beside a
  # bfloat16 weight (the model cast after the state was created): in float32
  # arithmetic, rounding only the weight, as the fused update computes.
  _forge_fp32_slots: ClassVar[frozenset[str]] = frozenset()
  # Set per instance (accumulate_steps, max_grad_norm, forge_torch/_clip.py);
  # class defaults, so that the backward reads them without getattr.
  _forge_accumulate_steps: int = 1
  _forge_max_grad_norm: float | None = None
  _forge_restore_buffers: torch.nn.Module | None = None
  _forge_clip_phase: str | None = None
  # The step whose plans found the param groups unchanged (_forge_plans_hold).
  _forge_plans_checked: int | None = None
  # The step whose first forward found each group's "params" unchanged
  # (_forge_check_members), and those params when last read.
  _forge_members_checked: int | None = None
  _forge_members_seen: list | None = None

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    base = next((b for b in cls.__mro__
                 if issubclass(b, torch.optim.Optimizer)
                 and not issubclass(b, _ForgeOptimizer)), None)
    if base is not None:  # None for intermediate mixins (_AdamMoments)
      cls._forge_torch = base
      # torch's constructor, plus max_grad_norm (forge_torch/_clip.py) and
      # the low-precision state options.
      cls.__signature__ = _clip.signature_with_options(base, FORGE_OPTIONS)

  def __init__(self, *args, max_grad_norm: float | None = None,
               restore_buffers: torch.nn.Module | None = None,
               moments: str | None = None, stochastic_rounding: bool = False,
               seed: int | None = None, **kwargs):
    # max_grad_norm: clip by the global norm, in two passes of a closure
    # given to step() (forge_torch/_clip.py), restore_buffers: the model
    # whose buffers the first pass leaves as they were; moments,
    # stochastic_rounding, seed: low-precision state of managed weights;
    # the rest is torch's.
    self.max_grad_norm = max_grad_norm
    self.restore_buffers = restore_buffers
    self.last_grad_norm = None  # the last clipped step's norm (a tensor)
    self._forge_set_low_precision(moments, stochastic_rounding, seed)
    args, kwargs = self._forge_check_takeover_first(args, kwargs)
    super().__init__(*args, **kwargs)
    self._forge_warn_unmanaged(self.param_groups)
    self._forge_constructed = True

  # -- low-precision state ----------------------------------------------------

  def _forge_set_low_precision(self, moments, stochastic_rounding,
                               seed) -> None:
    name = f"forge_torch.{type(self).__name__}"
    if moments is not None and not (isinstance(moments, str)
                                    and moments in MOMENT_KINDS):
      raise ValueError(
          f"{name}: moments={moments!r} is not supported. Use 'int8' "
          "(8-bit integer codes), 'fp8' (float8_e4m3fn codes; 'fp8_e4m3' is "
          "the same) or 'fp8_e5m2' (float8_e5m2 codes: more range, fewer "
          "digits) -- each with one float32 scale per 64 elements -- or "
          "None (the default: moments in the weight's dtype, as torch keeps "
          "them)")
    if not isinstance(stochastic_rounding, (bool, np.bool_)):
      raise TypeError(f"{name}: stochastic_rounding must be True or False, "
                      f"got {stochastic_rounding!r}")
    if seed is not None and (isinstance(seed, bool)
                             or not isinstance(seed, (int, np.integer))):
      raise TypeError(f"{name}: seed must be an integer (the stochastic-"
                      f"rounding seed), got {seed!r:.80}")
    if seed is not None and not stochastic_rounding:
      raise ValueError(
          f"{name}: seed={seed} without stochastic_rounding=True would do "
          "nothing (it seeds stochastic rounding's random bits); pass "
          "stochastic_rounding=True, or leave seed out")
    if stochastic_rounding and not self._forge_counts_steps:
      raise ValueError(
          f"{name}: stochastic_rounding=True draws its random bits from the "
          "step number, and torch's SGD keeps no step count in its state; "
          "use another optimizer, or leave stochastic_rounding=False")
    self._forge_moments = moments
    self._forge_format = (None if moments is None
                          else MomentFormat(MOMENT_KINDS[moments]))
    self._forge_sr = bool(stochastic_rounding)
    self._forge_seed = 0 if seed is None else int(seed)
    self._forge_plans_checked = None  # (modes the plans check)

  @property
  def moments(self) -> str | None:
    """How managed weights of at least 4096 elements store their moments:
    ``"int8"``, ``"fp8"`` / ``"fp8_e4m3"``, ``"fp8_e5m2"`` (codes plus one
    float32 scale per 64 elements, ``state[name]`` and
    ``state[name + "_scale"]``), or ``None`` (torch's float state)."""
    return self._forge_moments

  @property
  def stochastic_rounding(self) -> bool:
    """Whether managed (bfloat16) weights are stored by stochastic
    rounding (``pallas_kernels.quant.stochastic_round_to_bf16``)."""
    return self._forge_sr

  @property
  def seed(self) -> int:
    """The stochastic-rounding seed (0 unless given); a managed weight's
    own seed is ``(seed + crc32("param_groups[g][i]")) mod 2**32`` for its
    position ``i`` in param group ``g``."""
    return self._forge_seed

  @moments.setter
  def moments(self, value) -> None:
    self._forge_refuse_set("moments")

  @stochastic_rounding.setter
  def stochastic_rounding(self, value) -> None:
    self._forge_refuse_set("stochastic_rounding")

  @seed.setter
  def seed(self, value) -> None:
    self._forge_refuse_set("seed")

  def _forge_refuse_set(self, name: str) -> None:
    """A constructor-only option set afterwards: the state already held
    was formed under the old one (codes, their scales, rounding seeds)."""
    cls = type(self).__name__
    raise AttributeError(
        f"forge_torch.{cls}.{name} is set when the optimizer is built "
        f"({cls}(params, ..., {name}=...)): the state it holds was formed "
        "under the current one. Build a new optimizer with the new value "
        "(load_state_dict converts a checkpoint's moments to its format). "
        "max_grad_norm, accumulate_steps and restore_buffers can be set "
        "between steps.")

  def _forge_moment_format(self, p: torch.Tensor) -> MomentFormat | None:
    """The format of managed weight ``p``'s moments, or ``None`` (float
    moments: ``moments=None``, or fewer than 4096 elements)."""
    fmt = self._forge_format
    if fmt is None or not fmt.quantizes(tuple(p.shape)):
      return None
    return fmt

  def _forge_param_seed(self, p: torch.Tensor) -> int:
    """``p``'s stochastic-rounding seed (see :attr:`seed`)."""
    for gi, group in enumerate(self.param_groups):
      for pi, q in enumerate(group["params"]):
        if q is p:
          crc = zlib.crc32(f"param_groups[{gi}][{pi}]".encode())
          return (self._forge_seed + crc) % 2**32
    raise RuntimeError("forge_torch: a managed weight is in none of the "
                       "optimizer's param groups")

  def _forge_check_low_precision(self, group: Mapping[str, Any],
                                 managed: list[torch.Tensor]) -> None:
    """Refuses a group's managed weights that the options cannot apply to."""
    name = f"forge_torch.{type(self).__name__}"
    if self._forge_moments is not None and managed and not self._forge_rule(
        group).slots:
      raise ValueError(
          f"{name}: moments={self._forge_moments!r}, but this param group "
          "keeps no moments (SGD without momentum has no state); give the "
          "group momentum, or leave moments=None")
    if self._forge_sr:
      for p in managed:
        if p.dtype != torch.bfloat16:
          raise ValueError(
              f"{name}: stochastic_rounding=True stores bfloat16 weights by "
              f"stochastic rounding, but the forge_torch.Linear "
              f"{_linear.weight_name(p)} is {p.dtype}. Cast the model to "
              "bfloat16 before building the optimizer "
              "(model.to(torch.bfloat16)), or leave stochastic_rounding="
              "False")

  def _forge_warn_unmanaged(self, groups) -> None:
    """Warns once per call about parameters the options do not reach:
    torch's own step updates them with float moments, rounding to
    nearest."""
    if self._forge_moments is None and not self._forge_sr:
      return
    lines = []
    for group in groups:
      gi = next((i for i, g in enumerate(self.param_groups) if g is group), 0)
      for pi, p in enumerate(group["params"]):
        if _linear.is_forge_weight(p):
          continue
        why = []
        if (self._forge_moments is not None
            and p.numel() >= quant.MIN_QUANTIZED_SIZE):
          why.append("float moments")
        if (self._forge_sr and p.dtype == torch.bfloat16
            and p.numel() >= quant.MIN_QUANTIZED_SIZE):
          why.append("rounded to nearest")
        if why:
          lines.append(f"param_groups[{gi}]['params'][{pi}] (shape "
                       f"{tuple(p.shape)}): {', '.join(why)}")
    if not lines:
      return
    shown = "; ".join(lines[:_LIST_AT_MOST]) + (
        f"; and {len(lines) - _LIST_AT_MOST} more"
        if len(lines) > _LIST_AT_MOST else "")
    name = type(self).__name__
    warnings.warn(
        f"forge_torch.{name}(moments={self._forge_moments!r}, "
        f"stochastic_rounding={self._forge_sr}): {len(lines)} parameter(s) "
        f"are not forge_torch.Linear weights, so torch.optim.{name}'s own "
        "step updates them with its float state and rounds them to nearest: "
        f"{shown}. Only forge_torch.Linear weights get int8/fp8 moments (of "
        "at least 4096 elements) and stochastic rounding (bfloat16); make "
        "large layers forge_torch.Linear, or give these parameters to a "
        "separate torch optimizer to silence this warning.",
        UserWarning, stacklevel=3)

  def _forge_low_precision_slots(self, p, state, rule, fmt, layer: str
                                 ) -> list[Quantized]:
    """``p``'s quantized slots as ``Quantized`` pairs of its state tensors,
    checked against the format."""
    out = []
    dtype = _CODE_DTYPES[fmt.kind]
    scale_shape = fmt.scale_shape(tuple(p.shape))
    for name in rule.slots:
      q, scale = state.get(name), state.get(name + SCALE_SUFFIX)
      if q is None and scale is None:
        raise RuntimeError(
            f"forge_torch.Linear {layer}: its optimizer state has no "
            f"{name!r}, which this param group's options need: were the "
            "group's options (e.g. momentum, centered, amsgrad) changed "
            "after its state was created? torch.optim would not create the "
            "missing state either; set them before the first step.")
      if (not isinstance(q, torch.Tensor)
          or not isinstance(scale, torch.Tensor) or q.dtype != dtype
          or q.shape != p.shape or q.device != p.device
          or scale.dtype != torch.float32
          or tuple(scale.shape) != scale_shape or scale.device != p.device):
        raise RuntimeError(
            f"forge_torch.Linear {layer}: with moments="
            f"{self._forge_moments!r} its optimizer state {name!r} must be "
            f"{dtype} codes {list(p.shape)} and {name + SCALE_SUFFIX!r} "
            f"float32 scales {list(scale_shape)} on {p.device}; got "
            f"{_describe(q)} and {_describe(scale)} (was the state replaced, "
            "or the model moved after the state was created?)")
      out.append(Quantized(q, scale))
    return out

  def _forge_convert_state(self, p: torch.Tensor, state: dict,
                           rule: UpdateRule) -> None:
    """Brings loaded state of managed weight ``p`` to this optimizer's
    format: float moments (a torch checkpoint) quantized, quantized ones in
    another format requantized, quantized ones dequantized for float
    state."""
    fmt = self._forge_moment_format(p)
    for name in rule.slots:
      value = state.get(name)
      scale = state.pop(name + SCALE_SUFFIX, None)
      if not isinstance(value, torch.Tensor):
        continue
      if scale is None and value.dtype in _CODE_DTYPES.values():
        raise ValueError(
            f"forge_torch: the loaded state of the managed weight of shape "
            f"{tuple(p.shape)} holds {name!r} as {value.dtype} codes without "
            f"their scales ({name + SCALE_SUFFIX!r}): not a checkpoint this "
            "optimizer can read.")
      if scale is not None:
        if fmt is not None and value.dtype == _CODE_DTYPES[fmt.kind]:
          state[name + SCALE_SUFFIX] = scale
          continue
        value = _dequantize_tensor(value.to(p.device), scale.to(p.device))
      if fmt is None:
        state[name] = value.to(dtype=p.dtype, device=p.device)
      else:
        second = name in rule.second_moments
        state[name], state[name + SCALE_SUFFIX] = _quantize_tensor(
            value.to(p.device), fmt, second)

  @property
  def max_grad_norm(self) -> float | None:
    """Global-norm clipping: ``step(closure)`` equals
    ``torch.nn.utils.clip_grad_norm_(<this optimizer's parameters>,
    max_grad_norm)`` then the torch optimizer's ``step()``, managed weights
    included, the closure running the forward and backward twice (first the
    norms, then the clipped updates: ``docs/clipping.md``), so that its
    side effects (BatchNorm's running statistics, hooks) happen twice
    too, unless ``restore_buffers`` names the model (its buffers are put
    back between the two calls). ``None`` (the
    default): no clipping. Set it at construction or between steps; it is
    not part of ``state_dict()``. The last clipped step's global norm
    (before clipping, a 0-d tensor; ``None`` before one) is
    ``last_grad_norm``."""
    return self._forge_max_grad_norm

  @max_grad_norm.setter
  def max_grad_norm(self, value: float | None) -> None:
    _clip.set_max_grad_norm(self, value)
    self._forge_plans_checked = None  # (a mode the plans check)

  @property
  def restore_buffers(self) -> torch.nn.Module | None:
    """The model whose buffers a clipped step (``max_grad_norm``) advances
    once, as torch's loop does: every buffer of it and its submodules
    (BatchNorm's running statistics and ``num_batches_tracked``, a
    ``spectral_norm``'s power-iteration vectors) is copied before the
    closure's first call and put back after it, so that the second call
    starts from the same buffers (``docs/clipping.md``). ``None`` (the
    default): the buffers are left to the closure's two calls. It acts
    only while ``max_grad_norm`` is set (without it the closure runs once:
    nothing to restore); it costs one copy of the buffers per step and one
    comparison of them. Set it at construction or between steps; it is
    not part of ``state_dict()``, and a ``copy.deepcopy`` or pickle of the
    optimizer copies the model with it (copy the model and the optimizer
    together; checkpoint with ``state_dict()``)."""
    return self._forge_restore_buffers

  @restore_buffers.setter
  def restore_buffers(self, value: torch.nn.Module | None) -> None:
    _clip.set_restore_buffers(self, value)

  # -- family hooks -----------------------------------------------------------

  def _forge_option(self, group: Mapping[str, Any], name: str,
                    default: Any = None) -> Any:
    """``group[name]`` where this family has the option ``name`` (a key of
    its ``defaults``), else ``default``: torch's family reads no key it
    does not define (one left in a group built from a config shared with
    another family), and neither does FORGE."""
    return group.get(name, default) if name in self.defaults else default

  def _forge_rule(self, group: Mapping[str, Any],
                  device: torch.device | None = None) -> UpdateRule:
    """``device``: the weight's, at update time (``None`` when only checking
    the group's options at registration)."""
    raise NotImplementedError

  def _forge_init_state(self, p: torch.Tensor, group: Mapping[str, Any]
                        ) -> dict[str, torch.Tensor]:
    raise NotImplementedError

  def _forge_fresh(self, state: Mapping[str, Any],
                   group: Mapping[str, Any]) -> bool:
    """Whether a weight's step starts its state anew, as torch's
    ``_init_group`` decides: an empty state (SGD: no momentum buffer)."""
    return len(state) == 0

  def _forge_hparams(self, group: Mapping[str, Any], state: Mapping[str, Any],
                     t: float | None, fresh: bool
                     ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """``(values, scalar_state_updates)`` for step ``t`` (``None`` without a
    step count); ``fresh``: the state was created for this update. Reads
    ``state`` only for its device, unless the class sets
    ``_forge_hparams_per_weight``."""
    raise NotImplementedError

  def _forge_captured_hparams(self, group: Mapping[str, Any],
                              rule: UpdateRule, step: torch.Tensor
                              ) -> torch.Tensor:
    """The rule's packed vector for the update after ``step`` (a CUDA
    tensor holding ``t - 1``) as a float32 CUDA tensor, formed by GPU work
    only (no host read or copy), so that a CUDA graph records it; families
    with ``_forge_capturable``."""
    raise NotImplementedError

  def _forge_shared_scalars(self, index: int, group: Mapping[str, Any],
                            device: torch.device) -> _SharedScalars | None:
    """Param group ``index``'s rule and scalars for its weights on
    ``device``, computed once per step and reused by its other weights'
    updates while the group's options are unchanged; ``None`` where they
    cannot be shared (per-weight scalars, or an option that could change
    without being replaced, e.g. a tensor ``lr``): each update then computes
    its own, as the family's hooks say."""
    shared = self._forge_scalars.get(index)
    if shared is not None and shared.valid_for(group, device):
      return shared  # every option the very same (immutable) object
    # Options set after construction (e.g. differentiable=True), refused as
    # add_param_group and load_state_dict refuse them.
    self._forge_check_options(group)
    if self._forge_hparams_per_weight:
      return None
    # ("param_names", torch's record of named_parameters(), is a list but
    # no option of the update.)
    if not all(_immutable(v) for k, v in group.items()
               if k not in ("params", "param_names")):
      self._forge_scalars.pop(index, None)
      return None
    names, options = tuple(group), tuple(group.values())
    shared = _SharedScalars(names, options, device,
                            self._forge_rule(group, device))
    self._forge_scalars[index] = shared
    return shared

  # -- registration -----------------------------------------------------------

  def _forge_flush_steps(self) -> None:
    """Advances the GPU ``state["step"]`` tensors of the weights updated
    since the last flush by 1 (each holds ``t - 1``; its record says
    ``t``), in one ``foreach`` launch. Runs when ``step()`` starts and
    ends, in ``zero_grad()``, ``state_dict()`` and ``load_state_dict()``,
    and before a copy or pickle (``__getstate__``), so that between two
    updates of a weight (a ``step()`` apart) its tensor is flushed. A
    tensor written by anything else meanwhile (its version counter moved)
    keeps what was written."""
    pending = self.__dict__.get("_forge_pending_steps")
    if not pending:
      return
    steps = [(st, rec) for st, rec in pending if st._version == rec.version]
    pending.clear()
    if steps:
      with torch.no_grad():
        torch._foreach_add_([st for st, _ in steps], 1)
      # Recorded in a CUDA graph, the add has not run (each replay runs
      # it): the tensors' values are unknown here until read again.
      captured = _bridge._capturing()
      for st, rec in steps:
        rec.version = None if captured else st._version

  def _forge_reset_step(self) -> None:
    self._forge_flush_steps()
    # (step tensor, its _StepRecord) updated since the last flush
    self.__dict__.setdefault("_forge_pending_steps", [])
    # Per managed weight: forwards since step(), fused updates since step();
    # gradient accumulation: micro-batches accumulated since step() (not yet
    # applied), and its fp32 accumulator. Cleared, not replaced: the maps
    # keep their weak references to the weights for the next step.
    for name in ("_forge_calls", "_forge_updated", "_forge_micro",
                 "_forge_acc", "_forge_cleared"):
      if name in self.__dict__:
        getattr(self, name).clear()
      else:
        setattr(self, name, _linear.WeakIdMap())
    # group index -> its options as the fused updates since step() read them
    self._forge_used = {}
    # (group index, step) -> the step's hyperparameters formed on the GPU
    # by the work a CUDA graph records (_forge_captured_update)
    self._forge_capture_vecs = {}
    # group index -> its rule and scalars, shared by its weights' updates
    # (_forge_shared_scalars). The rule is kept for the next step while the
    # group holds the very same options (else dropped: nothing outlives the
    # groups' own options); the scalars are the step's.
    shared = self.__dict__.get("_forge_scalars")
    if shared is None:
      self._forge_scalars = {}
    else:
      groups = self.param_groups
      for index, entry in list(shared.items()):
        if index < len(groups) and entry.valid_for(groups[index],
                                                   entry.device):
          entry.scalars.clear()
        else:
          del shared[index]
    # Which step the counts above belong to (a forward's release checks it).
    self._forge_generation = getattr(self, "_forge_generation", 0) + 1

  def _forge_check_options(self, group: Mapping[str, Any]) -> None:
    wide = [k for k, _ in FORGE_OPTIONS if k in group]
    if wide:
      name = type(self).__name__
      raise ValueError(
          f"forge_torch.{name}: {', '.join(wide)} in a param group: "
          f"forge_torch's options ({', '.join(k for k, _ in FORGE_OPTIONS)})"
          " apply to the whole optimizer, not to one group. Pass them to the "
          f"constructor, forge_torch.{name}(params, ..., {wide[0]}=...); for "
          "weights that need other settings, use a second optimizer.")
    bad = [k for k, (ok, _) in _REFUSED.items()
           if k in group and k in self.defaults and bool(group[k]) != ok
           and not (k == "capturable" and self._forge_capturable
                    and group.get("fused"))]
    if bad:
      name = type(self).__name__
      raise ValueError(
          f"forge_torch.{name} does not support "
          f"{', '.join(f'{k}=True' for k in bad)}: "
          + "; ".join(f"{k}: {_REFUSED[k][1]}" for k in bad)
          + f" (use torch.optim.{name} for these options)")
    eps = self._forge_option(group, "eps")
    if (isinstance(eps, numbers.Real) and not isinstance(eps, bool)
        and 0 < abs(float(eps)) < _F32_TINY):
      raise ValueError(
          f"forge_torch.{type(self).__name__}: eps={float(eps)!r} is below "
          f"float32's smallest normal number ({_F32_TINY:.4g}); the fused "
          "update's float32 arithmetic may flush it to zero (XLA on the "
          "CPU does, giving NaN where torch's step does not). Use eps=0 "
          f"or eps >= {_F32_TINY:.4g}.")

  def __getstate__(self):
    # torch keeps defaults, state and param_groups; the managed-weight
    # registry is keyed by tensor identity, so record where the managed
    # weights sit in param_groups, and rebuild it from that on the copy.
    # The step counts of updates already applied (the copy starts with no
    # pending advance of its own). (A gradient-accumulation window is not
    # carried, as torch's copy carries no parameter's .grad.)
    self._forge_flush_steps()
    state = dict(super().__getstate__())
    state["_forge_accumulate_steps"] = self.accumulate_steps
    state["_forge_max_grad_norm"] = self.max_grad_norm
    state["_forge_restore_buffers"] = self.restore_buffers
    state["_forge_low_precision"] = (self._forge_moments, self._forge_sr,
                                     self._forge_seed)
    state["_forge_last_grad_norm"] = getattr(self, "last_grad_norm", None)
    state["_forge_managed_at"] = [
        (gi, pi) for gi, g in enumerate(self.param_groups)
        for pi, p in enumerate(g["params"]) if p in self._forge_managed]
    return state

  def __setstate__(self, state):
    """copy.deepcopy / pickle: the copy owns the copied managed weights
    (marked as such whichever of the model and the optimizer is rebuilt
    first); step bookkeeping starts afresh, JAX views are made anew."""
    state = dict(state)
    at = state.pop("_forge_managed_at", None)
    k = state.pop("_forge_accumulate_steps", None)
    clip = state.pop("_forge_max_grad_norm", None)
    buffers = state.pop("_forge_restore_buffers", None)
    low = state.pop("_forge_low_precision", None)
    norm = state.pop("_forge_last_grad_norm", None)
    super().__setstate__(state)
    if "last_grad_norm" not in self.__dict__:
      self.last_grad_norm = norm
    if low is not None:
      moments, sr, seed = low
      self._forge_set_low_precision(moments, sr, seed if sr else None)
    if clip is not None:
      self._forge_max_grad_norm = clip
    if buffers is not None:
      self._forge_restore_buffers = buffers
    if k is not None:
      self._forge_accumulate_steps = k
    if at is None:  # torch's load_state_dict ends here: keep the registry
      return
    self._forge_constructed = True
    self._forge_init_registry()
    for gi, pi in at:
      p = self.param_groups[gi]["params"][pi]
      _linear._mark(p)
      self._forge_take(p, gi)

  def _forge_init_registry(self) -> None:
    _linear._OPTIMIZERS.add(self)
    # The param_groups list's groups when _forge_managed's indices were last
    # read from it (_forge_check_groups).
    self._forge_groups_seen = None
    self._forge_managed = _linear.WeakIdMap()  # managed weight -> group
    # managed weight -> _bridge.ViewCache (its state's JAX views, CUDA)
    self._forge_views = _linear.WeakIdMap()
    # step tensor -> its _StepRecord: its version counter and value as this
    # optimizer last wrote it (_forge_step_count), and a CPU one's view
    self._forge_steps = _linear.WeakIdMap()
    # managed weight -> _UpdatePlan: its last plain update, which the next
    # one repeats after a few checks (_forge_run_plan)
    self._forge_plans = _linear.WeakIdMap()
    # Managed weights whose torch counterpart would hold a .grad now (their
    # layer ran a backward, or an ordinary gradient reached them, since the
    # last zero_grad(set_to_none=True)), and those of them whose .grad
    # would be a zero tensor (zero_grad(set_to_none=False) since): torch's
    # step steps these from zero in a step their layer skips.
    self._forge_grad_held = _linear.WeakIdMap()
    self._forge_grad_zeroed = _linear.WeakIdMap()
    # The weights updated in the last step (the map _forge_updated was
    # then, kept by a swap at the step's end: no work per weight), and
    # whether no zero_grad() has read it since.
    self._forge_last_updated = _linear.WeakIdMap()
    self._forge_last_unseen = False
    self._forge_reset_step()

  def _forge_check_groups(self) -> None:
    """Reads again which param group holds each managed weight when
    ``param_groups`` itself changed (a group removed, inserted or
    reordered; ``load_state_dict``'s new group dicts), so that no update
    takes another group's options by a stale index. A weight that is in no
    group any more is no longer managed here (its layer's forward then says
    so)."""
    where = {}
    for index, group in enumerate(self.param_groups):
      for q in group["params"]:
        where.setdefault(_key(q), index)
    for p in list(self._forge_managed):
      index = where.get(_key(p))
      if index is None:
        self._forge_managed.pop(p, None)
      else:
        self._forge_managed[p] = index
    # (Per group index: this step's options, rules and scalars; the plans
    # that hold them.)
    self._forge_used.clear()
    self._forge_plans.clear()
    self._forge_scalars.clear()
    self._forge_capture_vecs.clear()
    self._forge_groups_seen = list(self.param_groups)
    self._forge_members_seen = _members(self.param_groups)
    self._forge_members_checked = self._forge_generation
    self._forge_refuse_held_elsewhere()

  def _forge_check_members(self) -> None:
    """Once per step (the step's first managed forward): reads the param
    groups again (:meth:`_forge_check_groups`) where a group's ``"params"``
    changed since they were last read -- a weight moved to another group
    or removed from every one by editing the lists, a list replaced --
    which the groups' own identities do not show. (An edit between a
    layer's forward and its backward is read at the next step's.)"""
    self._forge_members_checked = self._forge_generation
    if _members(self.param_groups) != self._forge_members_seen:
      self._forge_check_groups()

  def _forge_step_count(self, step) -> tuple[float, _StepRecord | None]:
    """``state["step"]``'s value, and its :class:`_StepRecord` if this
    optimizer wrote it (``None``: not a tensor, or never written here). A
    fused group keeps it on the device (as
    torch's fused kernels do), where reading it waits for the GPU: in a
    backward that would stall every managed layer until all the work queued
    before it had run. So the value this optimizer last wrote is kept on
    the host beside the tensor's version counter, and the tensor is read
    only when something else has written it since (a loaded state dict, a
    user's edit). (The same on the CPU, where the read is cheap.)"""
    if not isinstance(step, torch.Tensor):
      return _get_value(step), None
    known = self._forge_steps._values.get(_key(step))
    if known is not None and known.ptr != step.data_ptr():
      # Its memory replaced (``step.data = ...``): the record is another
      # tensor's; the next write makes a new one.
      self._forge_steps.pop(step, None)
      known = None
    if known is not None and known.version == step._version:
      return known.value, known
    return _get_value(step), known

  def _forge_take(self, p: torch.Tensor, index: int) -> None:
    """Registers managed weight ``p`` (of group ``index``) here, taking it
    from any optimizer that owned it before."""
    previous = _linear.owner_of(p)
    if previous is not None and previous is not self:
      previous._forge_managed.pop(p, None)
      previous._forge_views.pop(p, None)
      previous._forge_plans.pop(p, None)
      # Its step() refuses to run while its groups still hold ``p``.
      previous.__dict__.setdefault("_forge_taken", _linear.WeakIdMap())[
          p] = True
    taken = self.__dict__.get("_forge_taken")
    if taken:
      taken.pop(p, None)
    _linear._set_owner(p, self)
    self._forge_managed[p] = index

  def _forge_check_takeover_first(self, args, kwargs):
    """The constructor's ``params`` (made a list, as torch's constructor
    makes it) checked by :meth:`_forge_refuse_mid_step_takeover` in every
    group before torch's adds the first, so that a refused constructor
    has taken no group's weights; ``(args, kwargs)`` with that list."""
    if args:
      params, args = args[0], (None, *args[1:])
    elif "params" in kwargs:
      params = kwargs["params"]
    else:
      return args, kwargs  # (torch's constructor says what is missing)
    if not isinstance(params, torch.Tensor):  # (refused by torch's)
      params = list(params)
    groups = (params if isinstance(params, list) and params
              and isinstance(params[0], dict) else [{"params": params}])
    managed = []
    for group in groups:
      if not isinstance(group, dict):
        continue
      if not isinstance(group.get("params"),
                        (torch.Tensor, list, tuple, set)):
        group["params"] = list(group.get("params", ()))  # (as torch does)
      members = group["params"]
      for q in [members] if isinstance(members, torch.Tensor) else members:
        q = q[1] if isinstance(q, tuple) and len(q) == 2 else q  # (named)
        if isinstance(q, torch.Tensor) and _linear.is_forge_weight(q):
          managed.append(q)
    self._forge_refuse_mid_step_takeover(managed)
    if args:
      return (params, *args[1:]), kwargs
    return args, {**kwargs, "params": params}

  def _forge_refuse_mid_step_takeover(self, managed) -> None:
    """Refuses taking over managed weights in the middle of their owner's
    step: updated by a backward whose ``step()`` has not run, or with
    micro-batches accumulated in the owner's buffers. torch keeps either in
    the parameters' ``.grad``, which a new optimizer's ``step()`` applies;
    FORGE applied the one with the owner's state and keeps the other in the
    owner's buffers, which this optimizer would never read."""
    for p in managed:
      previous = _linear.owner_of(p)
      if previous is None or previous is self:
        continue
      # (An update a zero_grad() has cleared since: torch would apply
      # nothing of it either.)
      updated = (p in previous.__dict__.get("_forge_updated", ())
                 and p not in previous.__dict__.get("_forge_cleared", ()))
      micro = previous.__dict__.get("_forge_micro", {}).get(p)
      if not (updated or micro):
        continue
      owner = f"forge_torch.{type(previous).__name__}"
      what = (f"its backward already applied {owner}'s update in a step "
              "whose step() has not run" if updated else
              f"{micro} micro-batch{'es' if micro > 1 else ''} of its "
              f"accumulate_steps window {'are' if micro > 1 else 'is'} "
              f"held in {owner}'s buffers")
      raise RuntimeError(
          f"forge_torch.{type(self).__name__}: given the managed "
          f"{_linear.weight_name(p)} in the middle of a step of the "
          f"optimizer that owns it ({what}). torch keeps that in .grad, "
          "which the new optimizer's step() would apply; FORGE keeps it in "
          "the owner, so the new optimizer would drop it. Call the owner's "
          "step() first (and zero_grad()), then build the new optimizer.")

  def _forge_refuse_taken(self) -> None:
    """Refuses a step while this optimizer's groups hold managed weights
    that a forge_torch optimizer given them later took over (built over
    them, or given them by ``add_param_group``): their backward ran that
    optimizer's update, not this one's."""
    held = {_key(q) for g in self.param_groups for q in g["params"]}
    taken = []
    for p in list(self._forge_taken):
      owner = _linear.owner_of(p)  # (a collected one hands it back here)
      if owner is None or owner is self or _key(p) not in held:
        self._forge_taken.pop(p, None)
      else:
        taken.append((p, type(owner).__name__))
    if not taken:
      return
    names = ", ".join(_linear.weight_name(p) for p, _ in taken)
    owners = ", ".join(sorted({f"forge_torch.{new}" for _, new in taken}))
    raise RuntimeError(
        f"forge_torch.{type(self).__name__}.step(): the managed weights "
        f"{names} are in this optimizer's param groups, but a forge_torch "
        f"optimizer given them later ({owners}) took them over. A managed "
        "weight is updated inside its layer's backward by the one optimizer "
        "that owns it, the last given it, so their backward applied that "
        "optimizer's update with its options, not this one's. Build "
        "one forge_torch optimizer over each managed weight (param groups "
        "give weights their own options), or build a second only to "
        "replace the first.")

  def _forge_refuse_held_elsewhere(self) -> None:
    """Refuses a managed weight appended to one of this optimizer's
    ``"params"`` lists while another forge_torch optimizer owns it (holds
    it in its own groups): its backward applies the owner's update, once,
    where torch's two optimizers would each step it. (A weight this one
    gave up to a newer optimizer is :meth:`_forge_refuse_taken`'s.)"""
    taken = self.__dict__.get("_forge_taken") or ()
    for index, group in enumerate(self.param_groups):
      for q in group["params"]:
        if (not _linear.is_forge_weight(q) or q in self._forge_managed
            or q in taken):
          continue
        owner = _linear.owner_of(q)
        if (owner is None or owner is self
            or _group_index(owner.param_groups, q) is None):
          continue  # (moved here from the owner's lists: its forward's)
        raise RuntimeError(
            f"forge_torch.{type(self).__name__}: the managed "
            f"{_linear.weight_name(q)} is in this optimizer's "
            f"param_groups[{index}] (appended to its \"params\" list), but "
            f"a forge_torch.{type(owner).__name__} holds it in its own "
            "groups and owns it: its layer's backward applies that "
            "optimizer's update, once per step, where torch's two "
            "optimizers would each step it. Keep it in one optimizer's "
            "groups (to move it, remove it from the other's list).")

  def add_param_group(self, param_group: dict[str, Any]) -> None:
    if "_forge_managed" not in self.__dict__:  # from torch's __init__
      self._forge_init_registry()
    super().add_param_group(param_group)
    index = len(self.param_groups) - 1
    group = self.param_groups[index]
    managed = [p for p in group["params"] if _linear.is_forge_weight(p)]
    try:
      if managed:
        _check_single_process(managed)
      self._forge_check_options(group)
      for p in managed:
        name = _linear.weight_name(p)
        _bridge.check_dtype(p, f"forge_torch.Linear's {name}")
        _check_contiguous(p, name)
      if managed or self._forge_managed._values:
        _check_own_memory([q for g in self.param_groups
                           for q in g["params"]])
      if managed:
        self._forge_rule(group)  # refuses unfusable combinations now
      self._forge_check_low_precision(group, managed)
      if getattr(self, "_forge_constructed", False):  # (else checked first)
        self._forge_refuse_mid_step_takeover(managed)
    except (TypeError, ValueError, RuntimeError):
      self.param_groups.pop()
      raise
    for p in managed:
      self._forge_take(p, index)
    self._forge_plans_checked = None  # (the groups changed)
    if getattr(self, "_forge_constructed", False):
      self._forge_warn_unmanaged([group])

  def state_dict(self) -> dict[str, Any]:
    self._forge_flush_steps()  # the step counts of updates already applied
    return super().state_dict()

  def _forge_refuse_open_window(self) -> None:
    """Refuses a load in the middle of a step: after a backward updated
    managed weights (torch would apply their gradients at ``step()`` from
    the loaded state; FORGE applied them already, from the state the load
    replaces), or while micro-batches are accumulated into managed weights'
    buffers and not yet applied (``accumulate_steps > 1``): torch keeps such
    a window in the parameters' ``.grad`` through a load, but FORGE's
    buffers belong to this optimizer's step, which a load starts afresh."""
    updated = self.__dict__.get("_forge_updated")
    if updated:
      names = sorted(_linear.weight_name(p) for p in updated)
      raise RuntimeError(
          f"forge_torch.{type(self).__name__}: load_state_dict() between a "
          f"backward and optimizer.step(): that backward already updated "
          f"the managed {', '.join(names[:3])}"
          f"{f' and {len(names) - 3} more' if len(names) > 3 else ''} from "
          "the state the load would replace (torch would apply those "
          "gradients at step(), from the loaded state), so the loaded step "
          "counts and moments would not match the weights. Load before the "
          "forward, or after optimizer.step().")
    micro = self.__dict__.get("_forge_micro")
    if not micro:
      return
    n = max(micro.values())
    raise RuntimeError(
        f"forge_torch.{type(self).__name__}: load_state_dict() in the "
        f"middle of a gradient-accumulation step ({n} of accumulate_steps="
        f"{self._forge_accumulate_steps} micro-batches accumulated into the "
        "managed weights' buffers and not yet applied) would drop those "
        "micro-batches for the managed weights only. Finish the step first "
        "(optimizer.step(), which applies a step cut short), or discard it "
        "(optimizer.zero_grad()).")

  def load_state_dict(self, state_dict) -> None:
    self._forge_refuse_open_window()
    # Managed weights appended to the groups' lists and not yet registered
    # (their layers have not run since): registered first, so that their
    # loaded state is read as managed state (low-precision codes kept).
    for group in self.param_groups:
      for q in group["params"]:
        if _linear.is_forge_weight(q) and _linear.owner_of(q) is None:
          self._forge_adopt(q)
    # torch's load hooks run where torch's loader runs them, around this
    # loader's own work: the pre-hooks first, on a shallow copy of the
    # checkpoint (one may adapt it before the checks below read it), the
    # post-hooks once the load has passed them (a refused load runs none).
    pre = self._optimizer_load_state_dict_pre_hooks
    post = self._optimizer_load_state_dict_post_hooks
    if pre:
      state_dict = state_dict.copy()
      for hook in pre.values():
        result = hook(self, state_dict)
        if result is not None:
          state_dict = result
    # The loaded groups' options must pass the checks add_param_group made
    # (capturable / differentiable refused, a fusable rule for managed ones).
    incoming = state_dict.get("param_groups", []) if isinstance(
        state_dict, Mapping) else []
    for index, loaded in enumerate(incoming):
      options = {k: v for k, v in loaded.items() if k != "params"}
      self._forge_check_options(options)
      if index < len(self.param_groups) and any(
          p in self._forge_managed for p in self.param_groups[index]["params"]):
        self._forge_rule({**self.param_groups[index], **options})
    self._forge_flush_steps()
    state_dict, raw = self._forge_hold_raw(state_dict)
    # torch's loader installs new group dicts and a new state mapping; a
    # load refused by the checks below puts the old ones back, so that a
    # refused load changes nothing (as torch's own refusals, made before).
    before = self.param_groups, self.state
    try:
      try:
        # (its hooks ran above, or run below)
        self._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
        super().load_state_dict(state_dict)
      except KeyError as e:  # torch's loader reads an entry it lacks
        name = type(self).__name__
        raise ValueError(
            f"forge_torch.{name}.load_state_dict: the checkpoint has no "
            f"{e.args[0]!r}, which torch.optim.{name}'s loader reads: a "
            "checkpoint saved by another optimizer family?") from e
      finally:
        self._optimizer_load_state_dict_pre_hooks = pre
        self._optimizer_load_state_dict_post_hooks = post
      self._forge_after_load(state_dict, raw)
    except BaseException:
      self.param_groups, self.state = before
      self._forge_check_groups()  # the managed weights' indices, as before
      raise
    # The loaded state tensors are new memory; drop the views of the old,
    # and the plans that hold them.
    self._forge_views = _linear.WeakIdMap()
    self._forge_plans = _linear.WeakIdMap()
    self._forge_reset_step()
    for hook in post.values():
      hook(self)

  def _forge_check_loaded(self) -> None:
    """Refuses, after torch's loader ran, a checkpoint whose groups or
    state do not fit this optimizer's managed weights: a group without an
    option of this family (another family's checkpoint), a managed
    weight's state with none of the rule's slots (likewise), or a state
    tensor of another shape than the weight's (another model's checkpoint,
    or param groups in another order). Left unchecked, each fails at the
    layer's next backward with a message about casts or changed options."""
    name = type(self).__name__
    for index, group in enumerate(self.param_groups):
      managed = [p for p in group["params"] if p in self._forge_managed]
      if not managed:
        continue
      missing = [k for k in self.defaults if k not in group]
      try:
        rule = self._forge_rule(group)
      except KeyError as e:
        missing = missing or [e.args[0]]
        raise ValueError(
            f"forge_torch.{name}.load_state_dict: the checkpoint's "
            f"param_groups[{index}] has no {', '.join(map(repr, missing))}"
            f" option{'s' if len(missing) > 1 else ''}, which {name} needs: "
            "a checkpoint saved by another optimizer family?") from None
      for p in managed:
        state = self.state.get(p)
        if not state:
          continue
        held = sorted(k for k in state if isinstance(k, str) and k != "step"
                      and not k.endswith(SCALE_SUFFIX))
        # Another family's: none of the rule's slots, or some missing and
        # others held in their place (a slot merely missing is an option
        # changed after the state was made: the update says so).
        foreign = set(held) - set(rule.slots) - set(
            getattr(self, "_forge_extra_scalars", ()))
        if held and rule.slots and (set(held).isdisjoint(rule.slots) or (
            foreign and not set(rule.slots) <= set(held))):
          raise ValueError(
              f"forge_torch.{name}.load_state_dict: the checkpoint's state "
              f"for {_linear.weight_name(p)} holds {held}, not {name}'s "
              f"{sorted(rule.slots)}: a checkpoint saved by another "
              "optimizer family?")
        for k, v in state.items():
          if isinstance(v, _Raw):  # quantized moments' codes, held as saved
            v = v.tensor
          if (isinstance(v, torch.Tensor) and v.dim() > 0
              and not (isinstance(k, str) and k.endswith(SCALE_SUFFIX))
              and v.shape != p.shape):
            raise ValueError(
                f"forge_torch.{name}.load_state_dict: the checkpoint's "
                f"{k!r} for {_linear.weight_name(p)} is of shape "
                f"{tuple(v.shape)}, the weight {tuple(p.shape)}: a "
                "checkpoint of another model, or of param groups in another "
                "order (torch's loader pairs the saved parameters with this "
                "optimizer's in order).")

  def _forge_after_load(self, state_dict, raw) -> None:
    """What :meth:`load_state_dict` does once torch's loader has run."""
    self._forge_keep_scalar_dtypes(state_dict)
    for index, group in enumerate(self.param_groups):
      for p in group["params"]:
        if p in self._forge_managed:
          self._forge_managed[p] = index
    self._forge_check_loaded()
    for p in raw:  # codes and scales as saved, on the weight's device
      state = self.state[p]
      for k, v in list(state.items()):
        if isinstance(v, _Raw):
          state[k] = v.tensor.to(device=p.device, copy=True)
      if p not in self._forge_managed:
        # torch's own step updates it (a weight saved managed, now a plain
        # nn.Linear's): float moments of its dtype, as torch keeps.
        _dequantize_unmanaged(p, state)
    for index, group in enumerate(self.param_groups):
      for p in group["params"]:
        if p in self._forge_managed and p in self.state:
          self._forge_convert_state(p, self.state[p],
                                    self._forge_rule(group, p.device))

  def _forge_keep_scalar_dtypes(self, state_dict) -> None:
    """The family's scalar state (NAdam's ``mu_product``) in the dtype it
    was saved in: torch's loader casts it to the parameter's dtype, float32
    to bfloat16 for a bfloat16 weight, and the run would not resume bit for
    bit (torch's own NAdam loses those digits)."""
    scalars = getattr(self, "_forge_extra_scalars", {})
    if not scalars:
      return
    for _, p, entry in self._forge_saved_entries(state_dict):
      state = self.state.get(p)
      if not isinstance(state, dict):
        continue
      for key in scalars:
        saved, now = entry.get(key), state.get(key)
        if (isinstance(saved, torch.Tensor) and isinstance(now, torch.Tensor)
            and saved.dtype != now.dtype):
          state[key] = saved.to(device=now.device, copy=True)

  def _forge_saved_entries(self, state_dict) -> list:
    """``(saved id, parameter, saved state entry)`` of each parameter of
    this optimizer that ``state_dict`` holds state for, paired in order as
    torch's loader pairs them."""
    if not isinstance(state_dict, Mapping) or not isinstance(
        state_dict.get("state"), Mapping):
      return []
    saved_ids = [i for g in state_dict.get("param_groups", [])
                 for i in g.get("params", [])]
    params = [p for g in self.param_groups for p in g["params"]]
    entries = [(sid, p, state_dict["state"].get(sid))
               for sid, p in zip(saved_ids, params)]
    return [e for e in entries if isinstance(e[2], Mapping)]

  def _forge_hold_raw(self, state_dict):
    """``state_dict`` with quantized moments' codes and scales wrapped so
    that torch's loader keeps their dtypes (it casts floating-point
    parameters' state to the parameter's dtype: int8 codes would become
    floats and float32 scales of a bfloat16 weight would lose digits); and
    the parameters concerned (managed weights, and parameters that torch's
    own step updates, saved as a managed weight's)."""
    entries = self._forge_saved_entries(state_dict)
    if not entries:
      return state_dict, []
    state = dict(state_dict["state"])
    raw = []
    for sid, p, entry in entries:
      # A weight whose moments this optimizer quantizes: its float moments
      # too (a torch checkpoint's float32 ones, quantized as saved rather
      # than after torch's cast to a bfloat16 weight's dtype).
      quantizes = (p in self._forge_managed
                   and self._forge_moment_format(p) is not None)
      wrapped = {
          k: _Raw(v) if isinstance(v, torch.Tensor) and (
              v.dtype in _CODE_DTYPES.values() or (
                  isinstance(k, str) and k.endswith(SCALE_SUFFIX)
                  and f"{k[:-len(SCALE_SUFFIX)]}" in entry) or (
                      quantizes and k != "step" and v.dim() > 0
                      and v.is_floating_point())) else v
          for k, v in entry.items()}
      if any(isinstance(v, _Raw) for v in wrapped.values()):
        state[sid] = wrapped
        raw.append(p)
    return {**state_dict, "state": state}, raw

  def zero_grad(self, set_to_none: bool = True) -> None:
    """torch's ``zero_grad``; a managed weight's ``grad`` becomes ``None``
    even with ``set_to_none=False``: FORGE never forms it. What torch does
    with the zero tensor it would leave there is done all the same: in a
    step whose backward does not reach the weight, :meth:`step` steps it
    from a zero gradient, as torch's step would. With
    ``accumulate_steps > 1`` it also discards the micro-batches accumulated
    into managed weights' buffers and not yet applied, as torch's discards
    their ``.grad``; an update already applied in backward stays."""
    super().zero_grad(set_to_none=set_to_none)
    self._forge_flush_steps()
    # The step's updates applied so far: in torch's terms cleared (torch
    # would apply none of their gradients now).
    for p in self._forge_updated:
      self._forge_cleared[p] = True
    held, zeroed = self._forge_grad_held, self._forge_grad_zeroed
    last = self._forge_last_updated if self._forge_last_unseen else ()
    self._forge_last_unseen = False
    if set_to_none:
      held.clear()
      zeroed.clear()
    for p in self.managed_params:
      had = p.grad is not None  # an ordinary gradient (run unfused)
      if had:
        p.grad = None
      # (A weight with micro-batches accumulated and not yet applied
      # holds a .grad in torch too: zeroed, stepped from zero.)
      if not set_to_none and (had or p in held or p in last
                              or p in self._forge_updated
                              or p in self._forge_micro):
        held[p] = zeroed[p] = True
    if self._forge_micro._values:
      self._forge_discard_accumulated()

  @property
  def managed_params(self) -> list[torch.Tensor]:
    """The FORGE-managed weights this optimizer updates during backward."""
    managed = self._forge_managed._values
    return [p for g in self.param_groups for p in g["params"]
            if _key(p) in managed or (
                _linear.is_forge_weight(p) and _linear.owner_of(p) is self)]

  def _forge_reclaim(self, p: torch.Tensor) -> bool:
    """Whether this optimizer manages ``p``; a weight a newer (since
    collected) optimizer took over is registered here again if it is still
    in one of this optimizer's param groups."""
    if p in self._forge_managed:
      return True
    index = _group_index(self.param_groups, p)
    if index is None:
      return False
    self._forge_managed[p] = index
    return True

  def _forge_adopt(self, p: torch.Tensor) -> bool:
    """Whether managed weight ``p``, owned by no optimizer, is in one of
    this optimizer's param groups: appended to its ``"params"`` list after
    the group was added (torch reads the lists at every step, so its
    optimizers train such a parameter). Registered then, after the checks
    :meth:`add_param_group` makes (which raise, naming the weight)."""
    index = _group_index(self.param_groups, p)
    if index is None:
      return False
    group = self.param_groups[index]
    name = _linear.weight_name(p)
    _check_single_process([p])
    _bridge.check_dtype(p, f"forge_torch.Linear's {name}")
    _check_contiguous(p, name)
    _check_own_memory([q for g in self.param_groups for q in g["params"]],
                      only=[p])
    self._forge_rule(group)  # refuses unfusable combinations now
    self._forge_check_low_precision(group, [p])
    self._forge_take(p, index)
    self._forge_plans_checked = None  # (the groups changed)
    return True

  # -- called by forge_torch.Linear -------------------------------------------

  def _forge_before_forward(self, w: torch.Tensor, x: torch.Tensor, *,
                            layer: str,
                            autocast_dtype: torch.dtype | None = None
                            ) -> int | None:
    """Checks a forward of managed weight ``w`` and counts it; returns the
    step it is counted in (``None``: a recomputation, not counted).
    ``autocast_dtype``: the dtype ``torch.autocast`` runs the layer in
    (``x`` is cast to it already), or ``None`` outside autocast. (The
    native host path's ``before_forward`` does the same in C++ for a plain
    counted forward, before the layer calls this method: see
    :mod:`forge_torch._hot`.)"""
    wk = _key(w)
    seen = self._forge_groups_seen
    if seen is None or len(seen) != len(self.param_groups):
      self._forge_check_groups()  # (a group added or removed)
    elif self._forge_members_checked != self._forge_generation:
      self._forge_check_members()
    if wk not in self._forge_managed._values:
      raise _linear.NotOwnedError(
          f"forge_torch.Linear {layer}: its weight is no longer owned by this "
          "optimizer (it is in none of its param_groups)")
    if w.dtype not in _bridge.SUPPORTED_DTYPES:
      _bridge.check_dtype(w, f"the weight of forge_torch.Linear {layer}")
    if not w.is_contiguous():  # (refused: the check names it)
      _check_contiguous(w, f"the weight of forge_torch.Linear {layer}")
    if x.device != w.device:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: input is on {x.device} but the weight "
          f"is on {w.device}; move them to one device")
    if autocast_dtype is None and x.dtype != w.dtype:
      raise _InputDtypeError(
          f"forge_torch.Linear {layer}: input dtype {x.dtype} differs from the "
          f"weight's {w.dtype}; cast the input, or run the forward under "
          "torch.autocast(device_type, dtype=torch.bfloat16)")
    if autocast_dtype is not None and x.dtype != autocast_dtype:
      raise _InputDtypeError(
          f"forge_torch.Linear {layer}: input dtype {x.dtype} under "
          f"torch.autocast, which computes this layer in {autocast_dtype} and "
          "casts only float32, float16 and bfloat16 inputs; cast the input")
    if _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1:  # in backward
      # Activation checkpointing recomputes the forward inside backward; the
      # recomputation is the same use of the weight (paper Remark 3).
      return None
    calls = self._forge_calls
    n = calls._values.get(wk, 0)
    k = self._forge_accumulate_steps
    if n < k and wk in self._forge_updated._values:
      # Updated in this step by a forward that had stopped counting (its
      # backward first asked for other gradients only: autograd.grad, then
      # backward through the same graph): the step's uses are spent.
      n = k
    if n >= k:
      self._forge_refuse_another_use(w, layer, k)
    calls[w] = n + 1
    return self._forge_generation

  def _forge_refuse_another_use(self, w: torch.Tensor, layer: str,
                                k: int) -> None:
    """Raises for a forward of managed weight ``w`` beyond the step's ``k``
    uses, saying why it may have happened: the step's update applied
    already (a skipped ``step()``), or, not yet, an earlier use whose graph
    is still alive (a reused layer, or an output kept without a
    backward)."""
    updated = w in self._forge_updated
    owner = _linear.path_of(w)
    if owner == "":  # (how the layer names a converted model itself)
      owner = "(the converted model itself)"
    tied = (
        f" Its weight is also that of forge_torch.Linear {owner} (one "
        "Parameter in two layers: a tie made after convert(), e.g. "
        f"{layer}.weight = {owner}.weight), which reads it twice per step: "
        "call forge_torch.convert(model) again, which puts tied layers on "
        "the standard path, or set layer.fused = False on both."
        if owner is not None and owner != layer else "")
    pending = (
        "An earlier forward's output that is no longer wanted keeps its use "
        "counted while it is referenced -- a loss skipped after a "
        "non-finite check, an evaluation output computed with autograd on: "
        "drop it before the next forward (del loss: a variable the next "
        "forward reassigns is still alive while that forward runs), or "
        "compute it under torch.no_grad(). ")
    if k > 1:
      applied = (
          f" This step's update of the weight has been applied already (by "
          f"the backward of its use number {k}), with the gradients of the "
          "uses so far." if updated else "")
      raise RuntimeError(
          f"forge_torch.Linear {layer} was called more than "
          f"accumulate_steps={k} times before optimizer.step().{applied} "
          "With gradient accumulation each managed layer runs one forward "
          f"and one backward per micro-batch, {k} micro-batches per step, and "
          "the backward of the last one applies the update: a further "
          "forward would read the updated weight. Call optimizer.step() after "
          f"every {k} micro-batches (it also completes a step cut short, with "
          "fewer). " + ("" if updated else pending) +
          "A layer run twice per micro-batch counts twice: keep such a layer "
          "as nn.Linear (or set layer.fused = False). Evaluation forwards "
          "must run under torch.no_grad()." + tied)
    if updated:
      raise RuntimeError(
          f"forge_torch.Linear {layer} was called a second time before "
          "optimizer.step(), after its backward had already applied this "
          "step's update to the weight: a step was skipped (e.g. a loop that "
          "skips step() after a non-finite loss), or the layer is reused "
          "after the backward of its first use. Skipping step() does not "
          "undo FORGE's update; check the loss before backward() (and drop "
          "a skipped loss: del loss), and end every step with "
          "optimizer.step() (after optimizer.zero_grad() to drop the other "
          "parameters' gradients). Evaluation forwards must run under "
          "torch.no_grad(). Gradient accumulation over K micro-batches is "
          "opt-in: set optimizer.accumulate_steps = K." + tied)
    raise RuntimeError(
        f"forge_torch.Linear {layer} was called a second time before "
        "optimizer.step(), while the autograd graph of its first call in "
        "this step is alive (no backward has reached it yet). FORGE updates "
        "the weight in place during the layer's backward, so each managed "
        "layer may run one forward and one backward per step (a second "
        "reader would see the already-updated weight). " + pending +
        "A layer reused within a step must stay nn.Linear (or set "
        "layer.fused = False). Gradient accumulation over K micro-batches "
        "is opt-in: set optimizer.accumulate_steps = K." + tied)

  def _forge_refuse_second_update(self, w: torch.Tensor, layer: str) -> None:
    """Raises :func:`_second_update_message` where managed weight ``w`` had
    its update of this step already (called where a backward of ``w``'s
    layer failed to read its saved weight, whose version that update
    moved on: autograd's message names neither the layer nor a fix)."""
    if w in self._forge_updated:
      raise RuntimeError(_second_update_message(layer)) from None

  def _forge_release(self, w: torch.Tensor, generation: int | None) -> None:
    """A counted forward of ``w`` that will not update it (its graph was
    freed without a backward, or the backward did not ask for the weight's
    gradient) no longer counts: the layer may run again in this step."""
    if (generation is not None and generation == self._forge_generation
        and w not in self._forge_updated):
      n = self._forge_calls.get(w, 0) - 1
      if n > 0:  # other forwards of the step (gradient accumulation)
        self._forge_calls[w] = n
      else:
        self._forge_calls.pop(w, None)

  def _forge_fused_update(self, p: torch.Tensor, grad_output: torch.Tensor,
                          input: torch.Tensor, *,
                          config: pallas_kernels.BlockConfig | None,
                          layer: str) -> None:
    """This family's step on managed weight ``p``, ``G = grad_output^T input``
    (``accumulate_steps > 1``: ``G`` added to the weight's buffer, except on
    the step's last micro-batch, which steps from the sum). A plain update
    repeats the weight's plan where it holds (:meth:`_forge_run_plan`).
    ``grad_output``, ``input``: ``(..., out)`` and ``(..., in)``."""
    if _clip.RUNNING:  # inside a clipped step's closure: its optimizer's?
      _clip.refuse_other_optimizer(self, layer)
    pk = _key(p)
    plan = self._forge_plans._values.get(pk)
    if plan is not None and self._forge_run_plan(plan, p, pk, grad_output,
                                                 input, config):
      return
    # (The full path's operands: 2-d.)
    grad_output = _linear.rows(grad_output, p.shape[0])
    input = _linear.rows(input, p.shape[1])
    # The group index the weight was registered with must still name its
    # group (param_groups edited since: read again).
    index, groups = self._forge_managed._values.get(pk), self.param_groups
    seen = self._forge_groups_seen
    if (seen is None or len(seen) != len(groups) or index is not None
        and groups[index] is not seen[index]):
      self._forge_check_groups()
    if pk not in self._forge_managed._values:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: its weight is no longer owned by this "
          "optimizer (it is in none of its param_groups)")
    if pk in self._forge_updated._values:
      raise RuntimeError(_second_update_message(layer))
    if p.is_cuda and _bridge._capturing():
      self._forge_check_capture(p, layer)
      self._forge_captured_update(p, grad_output, input, config=config,
                                  layer=layer)
      return
    if self._forge_max_grad_norm is not None and _clip.measuring(
        self, layer):  # max_grad_norm: the norm pass
      _clip.record(self, p, grad_output, input, layer)
      return
    if _distributed.is_data_parallel(p):  # DDP: reduced, then stepped
      _distributed.reduce_and_step(self, p, grad_output, input, config=config,
                                   layer=layer)
      return
    _check_single_process([p])
    acc = None
    if self._forge_accumulate_steps > 1:
      n = self._forge_micro.get(p, 0) + 1
      if n < self._forge_accumulate_steps:  # not the step's last micro-batch
        self._forge_accumulate(p, grad_output, input, config=config,
                               first=n == 1)
        self._forge_micro[p] = n
        return
      acc = self._forge_acc[p]
    self._forge_step_weight(p, grad_output, input, config=config,
                            layer=layer, acc=acc, plan=acc is None)

  def _forge_plans_hold(self) -> bool:
    """Whether this step's updates may repeat their plans as far as the
    whole optimizer goes: no clipping, accumulation, quantized moments or
    stochastic rounding; the param groups the ones the plans were made
    from; no process group or data-parallel weight. Checked once per step
    (kept as ``_forge_plans_checked``, which the setters of those modes and
    ``add_param_group`` forget)."""
    groups, seen = self.param_groups, self._forge_groups_seen
    if (self._forge_max_grad_norm is not None
        or self._forge_accumulate_steps != 1
        or self._forge_clip_phase is not None
        or self._forge_format is not None or self._forge_sr
        or seen is None or len(groups) != len(seen)
        or not all(map(operator.is_, groups, seen))
        or _distributed.any_registered() or _dist_initialized()):
      return False
    self._forge_plans_checked = self._forge_generation
    return True

  def _forge_run_plan(self, plan: "_UpdatePlan", p: torch.Tensor, pk: int,
                      grad_output: torch.Tensor, input: torch.Tensor,
                      config) -> bool:
    """Managed weight ``p``'s update as its last one ran (``plan``), where
    nothing it depends on has changed since; ``False`` (nothing done)
    otherwise, and :meth:`_forge_fused_update` then takes its full path.

    What the full path would check or read again, checked here: once per
    step, the optimizer's modes and the param groups list
    (:meth:`_forge_plans_hold`); per update, the weight's group dict (still
    the one at its index), the group's options (the same objects as its
    rule and scalars were formed from, else formed anew) and rule (the
    plan's), the weight's state (the same tensors, and a step count this
    optimizer wrote) and the operands' shapes, dtypes, layouts and devices
    (the direct launch's key and stream, or the plan's signature on the
    DLPack path). (The weight's index in the groups is the plan's: what
    changes it drops the plans.) The native host path
    (:mod:`forge_torch._hot`) does the same in C++ where it is on, from the
    layer's backward before this method's caller; this is its reference
    and its fallback."""
    index, groups = plan.index, self.param_groups
    group = plan.seen[index]
    # (The group list checked once per step; a group dict replaced since,
    # within the step, is read again by the full path.)
    if not (config is plan.config
            and pk not in self._forge_updated._values
            and (self._forge_plans_checked == self._forge_generation
                 or self._forge_plans_hold())
            and index < len(groups) and groups[index] is group):
      return False
    state, step, record = plan.state, plan.step, plan.record
    if self.state.get(p) is not state or state.get("step") is not step:
      return False
    slots = plan.slots
    for name, s in zip(plan.rule.slots, slots):
      if state.get(name) is not s:
        return False
    t = None
    if step is not None:  # (None: a family without a step count, SGD)
      if (self._forge_steps._values.get(_key(step)) is not record
          or record.version != step._version or record.value is None
          or record.ptr != step.data_ptr()):
        return False
      t = record.value + 1
    # The group's rule and scalars, shared by its weights: formed anew
    # where its options were replaced (an lr scheduler's step, an lr set
    # during the backward), as the full path does; the rule must still be
    # the plan's (a plan made before the options changed, its layer
    # skipped since, must not step with another rule's scalars).
    shared = self._forge_scalars.get(index)
    if shared is None or not shared.valid_for(group, plan.device):
      shared = self._forge_shared_scalars(index, group, plan.device)
      if shared is None:
        return False
    if shared.rule is not plan.rule and shared.rule != plan.rule:
      return False
    if index not in self._forge_used:  # (as the full path: step() checks)
      self._forge_used[index] = _options_snapshot(group, self.defaults)
    scalars = shared.scalars.get((t, False))
    if scalars is None:  # the step's first update in the group
      values, scalar_updates = self._forge_hparams(group, state, t, False)
      if scalar_updates:
        return False
      scalars = shared.scalars[(t, False)] = _Scalars(values)
    rule = plan.rule
    vec = scalars.packed(rule)
    if plan.launch is not None:
      if not _bridge.relaunch(plan.launch, grad_output, input, p, slots, vec,
                              rule, config):
        return False
    else:
      if _plan_signature(p, slots) != plan.signature or (
          p.is_cuda and _bridge._capturing()):
        return False
      views = self._forge_views._values.get(pk)
      if views is None:
        views = self._forge_views[p] = _bridge.ViewCache()
      _bridge.fused_update(_linear.rows(grad_output, p.shape[0]),
                           _linear.rows(input, p.shape[1]), p.data, slots,
                           vec, rule=rule, config=config, views=views)
    self._forge_advance_step(state, step, record, t, [p, *slots])
    self._forge_updated[p] = True
    return True

  def _forge_check_capture(self, p: torch.Tensor, layer: str) -> None:
    """Raises unless managed weight ``p``'s update can be recorded in the
    CUDA graph being captured."""
    group = self.param_groups[self._forge_managed[p]]
    name = type(self).__name__
    problem = None
    if not self._forge_capturable:
      problem = (f"forge_torch.{name} forms its step's scalars on the host; "
                 "only forge_torch.Adam and AdamW (fused=True, "
                 "capturable=True) can be captured")
    elif not (group.get("capturable") and group.get("fused")):
      problem = ("its param group was not built with fused=True, "
                 "capturable=True (torch's rule for optimizers in graphs)")
    elif self._forge_max_grad_norm is not None:
      problem = "max_grad_norm runs the backward twice with host work between"
    elif self._forge_accumulate_steps > 1:
      problem = "accumulate_steps > 1 counts micro-batches on the host"
    elif self._forge_format is not None or self._forge_sr:
      problem = ("moments= and stochastic_rounding= run through JAX, "
                 "never the direct launch")
    elif _distributed.is_data_parallel(p) or _distributed.is_sharded(p):
      problem = "DDP and fully_shard weights reduce their gradients first"
    elif not self.state.get(p):
      problem = ("the weight has no optimizer state yet: run a step "
                 "eagerly before capturing (torch asks for warm-up steps "
                 "too)")
    elif not isinstance(self.state[p].get("step"), torch.Tensor) or (
        self.state[p]["step"].device != p.device):
      problem = "its state's step count is not a tensor on its device"
    else:
      for k in ("betas", "eps", "weight_decay"):
        v = group.get(k)
        if any(isinstance(b, torch.Tensor)
               for b in (v if isinstance(v, (tuple, list)) else (v,))):
          problem = (f"{k} is a tensor (read with .item(), a host "
                     "synchronisation); give it as a number")
      lr = group["lr"]
      if isinstance(lr, torch.Tensor) and (lr.device != p.device
                                           or lr.numel() != 1):
        problem = (f"lr is a tensor {list(lr.shape)} on {lr.device}; in a "
                   f"graph it must be one number on the weight's device "
                   f"{p.device}, or a Python number")
    if problem is not None:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: its fused update cannot be recorded "
          f"in this CUDA graph: {problem}")

  def _forge_captured_update(self, p: torch.Tensor, grad_output: torch.Tensor,
                             input: torch.Tensor, *,
                             config: pallas_kernels.BlockConfig | None,
                             layer: str) -> None:
    """The fused update of ``p`` recorded in a CUDA graph: the step's
    scalars formed on the GPU from ``state["step"]`` (once per group and
    step value, shared by the group's weights), the kernel launched
    directly on torch's capturing stream, the step count advanced by the
    step's flush (also recorded). At each replay the GPU forms the scalars
    of the step it runs; the host runs nothing."""
    index = self._forge_managed[p]
    group = self.param_groups[index]
    self._forge_check_options(group)  # (as _forge_shared_scalars)
    if index not in self._forge_used:
      self._forge_used[index] = _options_snapshot(group, self.defaults)
    rule = self._forge_rule(group, p.device)
    state = self.state[p]
    step = state["step"]
    slots = [state[name] for name in rule.slots]
    for name, s in zip(rule.slots, slots):
      if not (isinstance(s, torch.Tensor) and s.shape == p.shape
              and s.device == p.device and s.dtype == p.dtype):
        raise RuntimeError(
            f"forge_torch.Linear {layer}: optimizer state {name!r} does not "
            f"match the weight {p.dtype}{list(p.shape)} on {p.device}")
    # One vector per group and step count: weights whose counts this
    # optimizer knows to be equal share it (a count it does not know
    # gets its own).
    record = self._forge_steps._values.get(_key(step))
    known = (record.value if record is not None
             and record.version == step._version
             and record.ptr == step.data_ptr() else None)
    cache_key = (index, known) if known is not None else (index, id(step))
    hparams = self._forge_capture_vecs.get(cache_key)
    if hparams is None:
      hparams = self._forge_capture_vecs[cache_key] = (
          self._forge_captured_hparams(group, rule, step))
    views = self._forge_views._values.get(_key(p))
    if views is None:
      views = self._forge_views[p] = _bridge.ViewCache()
    try:
      _bridge.fused_update(grad_output, input, p.data, slots, hparams,
                           rule=rule, config=config, views=views)
    except _bridge.CaptureRefused as e:  # (the case the kernel does not
      # cover: found at the launch, after the checks above)
      raise RuntimeError(
          f"forge_torch.Linear {layer}: its fused update cannot be "
          f"recorded in this CUDA graph: {e.reason}") from None
    if record is None:
      record = self._forge_steps[step] = _StepRecord(step)
    # Advanced by the (recorded) flush when the step ends.
    record.version, record.value = step._version, None
    self._forge_pending_steps.append((step, record))
    _increment_version([p, *slots])
    self._forge_updated[p] = True

  def _forge_check_slot(self, name: str, s: torch.Tensor, p: torch.Tensor,
                        group: Mapping[str, Any], layer: str) -> None:
    """Raises unless state tensor ``s`` (slot ``name``), whose shape, device
    or dtype differs from managed weight ``p``'s, can be updated as torch's
    step would update it: a float32 slot of :attr:`_forge_fp32_slots` beside
    a bfloat16 weight, outside ``fused=True`` (the model cast to bfloat16
    after the state was created, e.g. Adagrad's ``sum``, made at
    construction)."""
    if s.shape != p.shape or s.device != p.device:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: optimizer state {name!r} is "
          f"{s.dtype}{list(s.shape)} on {s.device}, the weight "
          f"{p.dtype}{list(p.shape)} on {p.device} (was the model moved or "
          "cast after the optimizer state was created?)")
    fused = bool(self._forge_option(group, "fused"))
    if (s.dtype == torch.float32 and p.dtype == torch.bfloat16
        and name in self._forge_fp32_slots and not fused):
      return
    family = type(self).__name__
    if s.dtype not in _bridge.SUPPORTED_DTYPES:
      why = "the fused update keeps state in float32 or bfloat16"
    elif s.dtype.itemsize < p.dtype.itemsize:
      why = (f"torch.optim.{family}'s step would keep that state in "
             f"{s.dtype}, rounding each of its operations to it, which the "
             "fused update (float32 arithmetic) does not reproduce")
    else:
      why = (f"torch.optim.{family}"
             f"{' with fused=True' if fused else ''} refuses this mix too")
    raise RuntimeError(
        f"forge_torch.Linear {layer}: optimizer state {name!r} is "
        f"{s.dtype}, the weight {p.dtype} (was the model cast after the "
        f"optimizer state was created?), and {why}. Cast the state to the "
        "weights' dtypes with optimizer.load_state_dict("
        "optimizer.state_dict()) (torch's loader casts each parameter's "
        "state to its dtype), or build the optimizer after casting the "
        "model")

  def _forge_step_weight(self, p: torch.Tensor, grad_output: torch.Tensor,
                         input: torch.Tensor, *,
                         config: pallas_kernels.BlockConfig | None,
                         layer: str, acc: torch.Tensor | None = None,
                         plan: bool = False) -> None:
    """The family's step on ``p`` from ``G = grad_output^T input``, plus the
    accumulated micro-batch gradients ``acc`` (gradient accumulation).
    ``plan``: the call is the full path of a plain update
    (:meth:`_forge_fused_update`); where the update turns out plain (below),
    it is kept as ``p``'s plan for the next one."""
    pk = _key(p)
    index = self._forge_managed._values.get(pk)
    if index is None:
      index = self._forge_managed[p]  # (raises KeyError)
    group = self.param_groups[index]
    if index not in self._forge_used:
      self._forge_used[index] = _options_snapshot(group, self.defaults)
    device = p.device
    shared = self._forge_scalars.get(index)
    if not (shared is not None and shared.valid_for(group, device)):
      shared = self._forge_shared_scalars(index, group, device)
    rule = shared.rule if shared is not None else self._forge_rule(
        group, device)
    state = self.state.get(p, {})  # (self.state is a defaultdict)
    fresh = self._forge_fresh(state, group)
    new_state = None  # a fresh state, stored once the update has run
    if fresh:  # as torch's _init_group (which keeps no entry when it has none)
      init = self._forge_init_state(p, group)
      if init:
        state = new_state = dict(init)
    fmt = (None if self._forge_format is None
           else self._forge_moment_format(p))
    if fmt is not None:  # initial moments (fresh, or Adagrad's), quantized
      for name in rule.slots:
        s = state.get(name)
        if (name + SCALE_SUFFIX not in state and isinstance(s, torch.Tensor)
            and s.dtype in _bridge.SUPPORTED_DTYPES and s.shape == p.shape):
          state[name], state[name + SCALE_SUFFIX] = _quantize_tensor(
              s, fmt, name in rule.second_moments)
    if self._forge_sr and p.dtype != torch.bfloat16:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: stochastic_rounding=True needs a "
          f"bfloat16 weight; this one is {p.dtype} (was the model cast after "
          "the optimizer was built?)")
    # (unlike: a slot whose dtype, shape or device is not the weight's)
    slots, unlike = [], False
    shape, dtype = p.shape, p.dtype
    for name in (() if fmt is not None else rule.slots):
      s = state.get(name)
      if not isinstance(s, torch.Tensor):
        raise RuntimeError(
            f"forge_torch.Linear {layer}: optimizer state has no {name!r} "
            f"tensor (state keys {sorted(state)}); were the group's options "
            "(e.g. momentum, centered, amsgrad) changed after its state was "
            "created?")
      if s.shape != shape or s.device != device or s.dtype != dtype:
        # (Allowed or not by the group's options: no plan repeats it.)
        self._forge_check_slot(name, s, p, group, layer)
        unlike = True
      slots.append(s)
    if fmt is not None:
      slots = self._forge_low_precision_slots(p, state, rule, fmt, layer)
      bumped = [p, *_state_tensors(slots)]
    else:
      bumped = [p, *slots]
    weight = p.data
    sharded = _distributed.is_sharded(p)
    if (fmt is not None or self._forge_sr) and sharded:
      raise RuntimeError(
          f"forge_torch.Linear {layer}: moments= and stochastic_rounding= "
          "are not supported for fully_shard (FSDP2) weights yet: their "
          "scales and random bits would have to follow the weight's shards; "
          "build the optimizer with moments=None, stochastic_rounding=False")
    if sharded:  # fully_shard: this rank's shards
      _check_sharded_state(p, rule.slots, slots, layer)
      weight = _distributed.local(p)
      slots = [_distributed.local(s) for s in slots]
      bumped += [weight, *slots]
    step, t, record = state.get("step"), None, None
    if "step" in state:
      t, record = self._forge_step_count(step)
      t += 1
    scalars = shared.scalars.get((t, fresh)) if shared is not None else None
    if scalars is None:
      values, scalar_updates = self._forge_hparams(group, state, t, fresh)
      if shared is not None:
        scalars = shared.scalars[(t, fresh)] = _Scalars(values)
    else:
      values, scalar_updates = scalars.values, {}
    base_rule, base_values = rule, values
    # max_grad_norm's update pass: G scaled by the clip coefficient.
    if self._forge_clip_phase is not None:
      rule, values = _clip.scaled(self, rule, values)
    # Kernel layout: x := grad_output (BT, out), dy := input (BT, in),
    # w := weight (out, in), so G' = grad_output^T input is torch's own grad.
    views = self._forge_views._values.get(pk)
    if views is None:
      views = self._forge_views[p] = _bridge.ViewCache()
    kernel_rule, kernel_slots = rule, slots
    if acc is not None:  # G + the step's earlier micro-batches' sum
      kernel_rule = _accumulate.from_accumulator(rule)
      kernel_slots = [acc, *slots]
    sr = None
    if self._forge_sr:  # the step t this update is (1-based)
      sr = (self._forge_param_seed(p), int(t))
    plain = (plan and scalars is not None and kernel_rule is base_rule
             and values is base_values and fmt is None and sr is None
             and not sharded and not fresh and not scalar_updates
             and self._forge_clip_phase is None and not unlike
             and self._forge_managed._values.get(pk) == index
             and self._forge_groups_seen is not None
             and weight.numel() > 0)
    if weight.numel() > 0:  # (a fully_shard rank may hold no rows)
      if (scalars is not None and kernel_rule is base_rule
          and values is base_values):  # the group's rule and scalars as such
        hparams = scalars.packed(kernel_rule)
      else:
        hparams = pack_host(kernel_rule, values)
      _bridge.fused_update(grad_output, input, weight, kernel_slots, hparams,
                           rule=kernel_rule, config=config, views=views,
                           stochastic_rounding=sr)
    if new_state is not None:  # (an update that raised leaves none behind)
      self.state[p].update(new_state)
      state = self.state[p]
    if acc is not None:  # consumed: its memory is freed
      views.discard(acc)
      self._forge_acc.pop(p, None)
      self._forge_micro.pop(p, None)
    record = self._forge_advance_step(state, step, record, t, bumped)
    for name, value in scalar_updates.items():
      state[name].copy_(value)
    self._forge_updated[p] = True
    if plain and (step is None and "step" not in state
                  or isinstance(step, torch.Tensor)):
      self._forge_plans[p] = _UpdatePlan(
          self, index, rule, device, config, state, slots, step, record,
          _bridge.resolved_launch(grad_output, input, weight, slots,
                                  len(hparams), rule, config),
          _plan_signature(p, slots))
    else:
      self._forge_plans.pop(p, None)

  def _forge_advance_step(self, state, step, record: "_StepRecord | None",
                          t, bumped: list) -> "_StepRecord | None":
    """After an update: advances the weight's step count to ``t``, bumps
    the version counters of ``bumped`` (the weight and the state it wrote)
    and returns the count's record (``None``: no tensor count)."""
    # Scalar state advances once the update is done (torch: `step_t += 1`).
    # A tensor step is set to t, the same value: by a store through its
    # record's NumPy view if it is a CPU one this optimizer wrote before
    # (its version counter bumped below, as fill_ would); on a GPU, with
    # every other managed weight's when the step ends, in one launch instead
    # of one per layer, as torch's fused step does (_forge_flush_steps);
    # else by fill_.
    if isinstance(step, torch.Tensor) and _defers_step(step):
      if record is None:  # holds t - 1 until the flush
        record = self._forge_steps[step] = _StepRecord(step)
      self._forge_pending_steps.append((step, record))
    elif (record is not None and record.array is not None
          and step.data_ptr() == record.ptr
          and step.dtype == record.dtype):  # still its memory (_StepRecord)
      record.array[()] = t
      bumped.append(step)
    elif isinstance(step, torch.Tensor):
      step.fill_(t)
      if record is None or record.array is not None:  # none, or stale
        record = self._forge_steps[step] = _StepRecord(step)
    # The weight and its state changed in place (through .data / a donated
    # buffer, which autograd does not see): bump their version counters, as
    # torch's in-place optimizer ops do, so that a graph which saved the
    # pre-update weight elsewhere (e.g. a detached read) makes autograd raise
    # "modified by an inplace operation" instead of silently using the new one.
    _increment_version(bumped)
    if record is not None:
      record.version, record.value = step._version, t
    elif "step" in state:
      state["step"] += 1
    return record

  # -- gradient accumulation --------------------------------------------------

  @property
  def accumulate_steps(self) -> int:
    """K, the micro-batches per optimizer step (gradient accumulation).

    ``1`` (the default): each managed layer runs one forward and one
    backward per step, and a second forward before ``step()`` raises. With
    ``K > 1`` each managed layer may run up to K forwards and backwards per
    step: the backwards of the first K - 1 micro-batches add the weight's
    gradient to an fp32 buffer (in the fused kernel's epilogue; the weight
    and its state are untouched), and the K-th backward applies the update
    to the sum of the K gradients, as torch's ``.grad`` accumulation then
    ``step()`` would. ``step()`` applies the update to the buffer of a
    weight that got fewer than K micro-batches in the step (a cut-short
    step, a layer some micro-batches skipped); ``zero_grad()`` discards
    the buffers of a step not yet applied, as torch discards ``.grad``.
    Set it between steps (at construction, or right after ``step()``);
    it is not part of ``state_dict()``.
    """
    return self._forge_accumulate_steps

  @accumulate_steps.setter
  def accumulate_steps(self, k: int) -> None:
    # (Any integer type, a NumPy one included, as forge_jax.MultiSteps
    # takes; not a bool.)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
      raise ValueError(
          f"{type(self).__name__}.accumulate_steps must be an int >= 1 (the "
          f"number of micro-batches per optimizer step), got {k!r}")
    k = int(k)
    if self._forge_in_step():
      raise RuntimeError(
          f"{type(self).__name__}.accumulate_steps cannot change in the "
          "middle of a step: managed layers have already run forwards since "
          "the last optimizer.step(). Set it before the step's first forward "
          "(at construction, or right after optimizer.step()).")
    self._forge_accumulate_steps = k
    self._forge_plans_checked = None  # (a mode the plans check)

  def _forge_in_step(self) -> bool:
    """Whether a step is under way: managed layers ran forwards since the
    last ``step()``, or applied updates or accumulated micro-batches, or a
    prepared ``fully_shard`` weight (whose forwards are torch's, not
    counted) holds its reduce-scattered gradient."""
    return bool(any(self._forge_calls.values()) or self._forge_micro
                or self._forge_updated
                or _distributed.holds_sharded_grad(self))

  def _forge_accumulate(self, p: torch.Tensor, grad_output: torch.Tensor,
                        input: torch.Tensor, *,
                        config: pallas_kernels.BlockConfig | None,
                        first: bool) -> None:
    """Adds ``G = grad_output^T input`` to ``p``'s fp32 accumulator (on the
    step's first micro-batch: sets it), in the fused kernel's epilogue; the
    weight and its optimizer state are not touched."""
    acc = self._forge_acc.get(p)
    if acc is None:  # its old contents are never read: no zeroing
      acc = self._forge_acc[p] = torch.empty(
          p.shape, dtype=torch.float32, device=p.device)
    views = self._forge_views.get(p)
    if views is None:
      views = self._forge_views[p] = _bridge.ViewCache()
    rule = _accumulate.sum_rule()
    _bridge.fused_update(grad_output, input, p.data, [acc],
                         pack_host(rule, {"acc_first": float(first)}),
                         rule=rule, config=config, views=views)

  def _forge_apply_accumulated(self) -> None:
    """The update of every managed weight whose step got fewer than
    ``accumulate_steps`` micro-batches, from its accumulator alone (the
    kernel with no token rows: ``G = 0``)."""
    if not self._forge_micro._values:
      return
    for p in list(self._forge_micro):
      if p not in self._forge_managed or p in self._forge_updated:
        continue
      n_out, n_in = p.shape
      none = functools.partial(torch.zeros, dtype=torch.float32,
                               device=p.device)
      _distributed.reduce_accumulated(self, p, self._forge_acc[p])
      self._forge_step_weight(p, none(0, n_out), none(0, n_in), config=None,
                              layer=_linear.weight_name(p),
                              acc=self._forge_acc[p])

  def _forge_discard_accumulated(self) -> None:
    """Drops the accumulated micro-batches of a step not yet applied (as
    torch's ``zero_grad`` drops ``.grad``); their forwards stop counting."""
    for p, n in list(self._forge_micro.items()):
      left = self._forge_calls.get(p, 0) - n
      if left > 0:
        self._forge_calls[p] = left
      else:
        self._forge_calls.pop(p, None)
      acc = self._forge_acc.pop(p, None)
      views = self._forge_views.get(p)
      if acc is not None and views is not None:
        views.discard(acc)
    self._forge_micro.clear()

  # -- the step ---------------------------------------------------------------

  def step(self, closure=None):
    """The torch optimizer's ``step`` for every non-managed parameter.

    Managed weights were already updated during backward (their ``grad`` is
    ``None``, so torch's step skips them). A managed weight that did *not* get
    a fused update in this step but has an ordinary ``grad`` (its layer ran
    with ``fused = False``, say) is updated by torch's step like any other
    (with quantized moments, ``moments=``, or stochastic rounding this
    raises ``RuntimeError``: torch's step has neither form; a ``grad`` of
    zeros is stepped from ``G = 0`` by the fused kernel instead). One that did get a fused update
    and has a ``grad`` of zeros (left by ``nn.Module.zero_grad(set_to_none=
    False)`` after a step its layer ran unfused) has it set to ``None``:
    torch would step from ``0 + G``, the update already applied. A nonzero
    ``grad`` there (a tied weight's second use, or a leftover gradient)
    raises ``RuntimeError``. After this optimizer's ``zero_grad(set_to_none=
    False)``, a managed weight updated since its last ``zero_grad()`` with
    ``set_to_none=True`` and not reached by this step's backward is stepped
    from a zero gradient, as torch steps a parameter whose ``grad`` is a
    zero tensor.

    With ``max_grad_norm`` set, ``closure`` is required and runs twice
    (:func:`forge_torch._clip.two_pass_step`).
    """
    self._forge_flush_steps()
    if self.__dict__.get("_forge_taken"):
      self._forge_refuse_taken()
    if self._forge_members_checked != self._forge_generation:
      # No managed forward read the groups in this step (this optimizer's
      # layers did not run): its lists, if edited, read and checked now.
      self._forge_check_members()
    if self.max_grad_norm is not None and not _clip.in_update_pass(self):
      # The rest of this step (below) runs once, after the two passes,
      # without the step hooks running again.
      return _clip.two_pass_step(
          self, closure, lambda: _unhooked(type(self).step)(self))
    if (getattr(self, "found_inf", None) is not None
        or getattr(self, "grad_scale", None) is not None):
      raise RuntimeError(
          f"forge_torch.{type(self).__name__} cannot be driven by "
          "torch.amp.GradScaler: the managed weights were already updated "
          "during backward with the loss-scaled gradient, which the scaler "
          "can neither unscale nor skip on inf/NaN. Train in bfloat16 without "
          "loss scaling, or keep these layers as nn.Linear (layer.fused = "
          "False) with a torch optimizer.")
    loss = None
    if closure is not None:
      with torch.enable_grad():
        loss = closure()
    for index, used in self._forge_used.items():
      now = _options_snapshot(self.param_groups[index], self.defaults)
      if now == used:  # the usual case: nothing changed
        continue
      changed = sorted(k for k in set(used) | set(now)
                       if used.get(k) != now.get(k))
      if changed:
        raise RuntimeError(
            f"param_groups[{index}] {changed} changed between backward and "
            f"{type(self).__name__}.step(): its FORGE-managed weights were "
            "already updated during backward with the old values, while "
            "step() would update the group's other parameters with the new "
            "ones. Set hyperparameters (and step lr schedulers) before the "
            "forward, or after step().")
    for p in self.managed_params:
      if p.grad is None:  # the usual case: FORGE formed no gradient
        continue
      if p in self._forge_updated or p in self._forge_micro:
        if not bool(torch.any(p.grad)):
          # A zero tensor: left by nn.Module.zero_grad(set_to_none=False)
          # after a step the layer ran unfused. torch's step would read
          # 0 + G, the G the fused update applied; dropped, so that torch's
          # step below does not update the weight a second time.
          p.grad = None
          continue
        if p not in self._forge_updated:  # a micro-batch's G held
          raise RuntimeError(
              f"the FORGE-managed {_linear.weight_name(p)} has gradients of "
              "this accumulation window (accumulate_steps="
              f"{self._forge_accumulate_steps}) in FORGE's buffer, from "
              "micro-batches its forge_torch.Linear ran fused, AND a "
              "nonzero ordinary gradient: from a micro-batch of the window "
              "that the layer ran with fused = False, another use in the "
              "same step (a tied or shared weight), or an earlier step that "
              "no zero_grad() cleared. The two cannot be summed: change a "
              "layer's fused only right after optimizer.step(), keep layers "
              "that share a weight as nn.Linear (forge_torch.convert() does "
              "so), and clear gradients with optimizer.zero_grad() after "
              "each step. " + _step_left_open(self))
        raise RuntimeError(
            f"the FORGE-managed {_linear.weight_name(p)} was updated by its "
            "forge_torch.Linear's backward AND has a nonzero ordinary "
            "gradient: another use in the same step (a tied or shared "
            "weight), or a gradient left from an earlier step that the layer "
            "ran with fused = False and that no zero_grad() cleared. FORGE "
            "applies the update as soon as its layer's gradient is formed, "
            "so it cannot add that gradient: keep the layers that share this "
            "weight as nn.Linear (forge_torch.convert() does so), and clear "
            "gradients with optimizer.zero_grad() after each step. "
            + _step_left_open(self))
      if _distributed.is_sharded(p):
        continue  # fully_shard's gradient (its update refuses the options)
      quantized = self._forge_moment_format(p) is not None or any(
          isinstance(k, str) and k.endswith(SCALE_SUFFIX)
          for k in self.state.get(p, {}))
      rounded = self._forge_sr and p.dtype == torch.bfloat16
      if (quantized or rounded) and not bool(torch.any(p.grad)):
        # A zero tensor, which torch's step cannot apply to codes or round
        # stochastically (torch.distributed.checkpoint forms a fresh
        # optimizer's state by a step from zero gradients at lr 0): held
        # as zero_grad(set_to_none=False) holds it, the step from G = 0
        # applied fused (_step_managed).
        p.grad = None
        self._forge_grad_held[p] = self._forge_grad_zeroed[p] = True
        continue
      if quantized:
        raise RuntimeError(
            f"the FORGE-managed {_linear.weight_name(p)} received an "
            "ordinary gradient (its layer ran with fused = False), but "
            f"with moments={self._forge_moments!r} its moments are "
            f"{self._forge_moments} codes, which "
            f"torch.optim.{type(self).__name__}'s own step cannot create or "
            "update. "
            "Keep the layer fused, or build the optimizer with "
            "moments=None. " + _step_left_open(self))
      if rounded:
        raise RuntimeError(
            f"the FORGE-managed {_linear.weight_name(p)} received an "
            "ordinary gradient (its layer ran with fused = False), but the "
            "optimizer was built with stochastic_rounding=True, which "
            f"torch.optim.{type(self).__name__}'s own step cannot apply (it "
            "rounds to nearest). Keep the layer fused, or build the "
            "optimizer with stochastic_rounding=False. "
            + _step_left_open(self))
    # fully_shard with accumulate_steps > 1: the summed sharded gradients.
    # (DDP: ordinary gradients of prepared weights, from a layer run
    # unfused, were averaged by their hooks in backward.)
    _step_managed(self)
    _unhooked(self._forge_torch.step)(self)
    # This step's updated weights, kept for zero_grad(set_to_none=False);
    # the last step's, if no zero_grad() read them, held from now on.
    held, last = self._forge_grad_held, self._forge_last_updated
    if self._forge_last_unseen:
      for p in last:
        held[p] = True
    self._forge_last_updated, self._forge_updated = self._forge_updated, last
    self._forge_last_unseen = True
    self._forge_reset_step()  # (clears the map swapped in)
    return loss

  def _forge_step_from_zero(self) -> None:
    """torch's step of a parameter whose ``.grad`` is a zero tensor, for
    each managed weight that would hold one (``zero_grad(set_to_none=
    False)`` after a step it was updated in) and that this step's backward
    did not reach: the family's update from ``G = 0`` (Adam's moments decay
    and the weight moves by them; weight decay applies)."""
    zeroed = self._forge_grad_zeroed
    if not zeroed:
      return
    for p in zeroed:
      if (p in self._forge_updated or p in self._forge_micro
          or p.grad is not None or p not in self._forge_managed
          or p.numel() == 0):
        # Its .grad in torch is G now (or it is no longer this one's).
        zeroed.pop(p, None)
        continue
      name = _linear.weight_name(p)
      if _distributed.is_sharded(p) or (p.is_cuda and _bridge._capturing()):
        raise RuntimeError(
            f"after zero_grad(set_to_none=False), torch's step would update "
            f"the FORGE-managed {name} from its zero gradient in this step, "
            "which its layer did not run; forge_torch cannot do so for a "
            + ("fully_shard (FSDP2) weight" if _distributed.is_sharded(p)
               else "step captured in a CUDA graph")
            + ". Call optimizer.zero_grad() (set_to_none=True, torch's "
            "default), which leaves a skipped layer's weight alone.")
      n_out, n_in = p.shape
      self._forge_step_weight(p, p.new_zeros((8, n_out)),
                              p.new_zeros((8, n_in)), config=None,
                              layer=name)


@getattr(torch, "_disable_dynamo", torch.compiler.disable)
def _step_managed(opt: "_ForgeOptimizer") -> None:
  """The fused updates ``step()`` itself applies: fully_shard's summed
  gradients (:func:`forge_torch.distributed.step_sharded`), a step cut
  short of its micro-batches, the zero-gradient steps after
  ``zero_grad(set_to_none=False)``. Left to Python by Dynamo (a compiled
  ``step()``, or a compiled function holding it), as the layer's backward
  is: Dynamo cannot trace the kernel's call (its DLPack hand-off to JAX,
  or its direct launch); the rest of ``step()`` is traced. (The disable
  wrapper imports torch._dynamo at its first call; building a torch
  optimizer has imported it already.)"""
  _distributed.step_sharded(opt)
  opt._forge_apply_accumulated()  # a step with fewer than K micro-batches
  opt._forge_step_from_zero()


def _defers_step(step: torch.Tensor) -> bool:
  """Whether a managed weight's ``state["step"]`` tensor is advanced at the
  step's end (:meth:`_ForgeOptimizer._forge_flush_steps`) rather than right
  after its update: on a GPU, where each write is a kernel launch."""
  return step.is_cuda


class _StepRecord:
  """A ``state["step"]`` tensor as an optimizer last wrote it: its version
  counter, memory (``ptr``) and value then (``_forge_step_count``: an
  in-place write bumps the version; ``.data =``, which does not, moves the
  memory), and for a plain CPU tensor a NumPy view of its memory
  (``array``), through which the next update stores the new value instead
  of a torch ``fill_`` dispatch. The view holds that memory alive, so while
  the tensor's ``data_ptr`` and dtype equal ``ptr`` and ``dtype``, the view
  is its memory (set_ or ``.data =`` moves it elsewhere: then ``fill_``,
  and a new record)."""

  __slots__ = ("version", "value", "array", "ptr", "dtype")

  def __init__(self, step: torch.Tensor):
    self.version = self.value = self.array = None
    self.ptr, self.dtype = step.data_ptr(), step.dtype
    if (type(step) is torch.Tensor and step.is_cpu
        and not step.requires_grad and step.numel() == 1):
      try:
        self.array = step.detach().numpy()
      except (RuntimeError, TypeError):  # a dtype NumPy lacks (bfloat16)
        pass


class _UpdatePlan:
  """A managed weight's last plain update (no accumulation, clipping,
  quantized moments, stochastic rounding, sharding or capture; state
  present; the group's scalars shared), kept so that the next one can skip
  the full path's reads and checks (:meth:`_ForgeOptimizer._forge_run_plan`
  says which it checks instead): the weight's group index and the
  param-groups list it was read from, the group's rule, the weight's
  device, the layer's tiling, the weight's state dict, slots and step
  tensor with its record (none for a family without a step count), the
  direct launch it took (``None``: the DLPack path) and the signature of its
  operands (shapes, dtypes, devices)."""

  __slots__ = ("index", "seen", "rule", "device", "config", "state",
               "slots", "step", "record", "launch", "signature")

  def __init__(self, optimizer, index: int, rule: UpdateRule,
               device: torch.device, config, state: dict, slots: list,
               step: torch.Tensor | None, record: "_StepRecord | None",
               launch, signature: tuple):
    self.index, self.seen = index, optimizer._forge_groups_seen
    self.rule, self.device, self.config = rule, device, config
    self.state, self.slots = state, tuple(slots)
    self.step, self.record = step, record
    self.launch, self.signature = launch, signature


def _members(groups) -> list[tuple[int, ...]]:
  """Which parameters each param group holds, by identity."""
  return [tuple(map(_key, g["params"])) for g in groups]


def _step_left_open(opt) -> str:
  """Said by step()'s refusals of an ordinary gradient on a managed
  weight, which come before anything else of the step is applied: how to
  close the step (with max_grad_norm a step takes a closure; one that runs
  no backward closes it)."""
  again = ("optimizer.step(lambda: None) (with max_grad_norm a step takes "
           "a closure; this one runs no backward)"
           if opt._forge_max_grad_norm is not None
           else "optimizer.step() again")
  return ("This step() applied nothing else, and the step stays open (the "
          "updates its backward applied in place stand): to go on, clear "
          f"the gradients (optimizer.zero_grad()) and call {again}, which "
          "closes it without stepping the other parameters.")


def _second_update_message(layer: str) -> str:
  """Why a backward of managed layer ``layer`` that would update its weight
  a second time in one step is refused."""
  return (
      f"forge_torch.Linear {layer}: a second backward reached this weight "
      "before optimizer.step(); FORGE applies one update per step (one "
      "per accumulate_steps micro-batches). The layer ran more often "
      "than that in this step -- reused, or its forwards recomputed by "
      "reentrant torch.utils.checkpoint, which runs them without "
      "autograd, so that they are counted at their backward only. This "
      "step's update of the weight has been applied already. Call "
      "optimizer.step() after each step's backward, or keep a layer "
      "reused within a step as nn.Linear (layer.fused = False).")


def _plan_signature(p: torch.Tensor, slots) -> tuple:
  return (p.shape, p.dtype, p.device,
          tuple((s.shape, s.dtype, s.device) for s in slots))


_dist_initialized = (torch.distributed.is_initialized
                     if torch.distributed.is_available() else lambda: False)


def _dequantize_unmanaged(p: torch.Tensor, state: dict) -> None:
  """Loaded state of a parameter torch's own step updates: each quantized
  moment (codes and ``<name>_scale``) dequantized to ``p``'s dtype, the
  scales dropped; codes without their scales are refused."""
  for key in [k for k in state if isinstance(k, str)
              and k.endswith(SCALE_SUFFIX)]:
    name = key[:-len(SCALE_SUFFIX)]
    codes = state.get(name)
    if isinstance(codes, torch.Tensor) and codes.dtype in (
        _CODE_DTYPES.values()):
      scale = state.pop(key)
      state[name] = _dequantize_tensor(codes, scale.to(p.device)).to(
          dtype=p.dtype)
  codes = [k for k, v in state.items() if isinstance(v, torch.Tensor)
           and v.dtype in _CODE_DTYPES.values()]
  if codes:
    raise ValueError(
        f"forge_torch: the loaded state of a parameter of shape "
        f"{tuple(p.shape)} holds {', '.join(map(repr, codes))} as "
        f"{state[codes[0]].dtype} codes without their scales: not a "
        "checkpoint this optimizer can read.")


class _Scalars:
  """A rule's scalars for one step: the family's ``values`` and their packed
  vector (read-only: every weight of the group shares it)."""

  __slots__ = ("values", "_packed")

  def __init__(self, values: dict[str, float]):
    self.values = values
    self._packed = None

  def packed(self, rule: UpdateRule) -> np.ndarray:
    """``pack_host(rule, values)``, packed once (``rule``: the group's)."""
    if self._packed is None:
      vec = pack_host(rule, self.values)
      vec.flags.writeable = False
      self._packed = vec
    return self._packed


class _SharedScalars:
  """What the fused updates of one param group's weights share in a step:
  its rule for weights on ``device`` and its scalars by ``(t, fresh)``. Valid
  while the group holds the very same option objects (``names``,
  ``options``), all of which cannot change in place."""

  __slots__ = ("names", "options", "device", "rule", "scalars")

  def valid_for(self, group: Mapping[str, Any], device: torch.device) -> bool:
    """Whether ``group`` holds the very same options, under the same names
    and in the same order, and the weight is on ``device``."""
    return self.device == device and self.holds(group)

  def holds(self, group: Mapping[str, Any]) -> bool:
    """Whether ``group`` holds the very same options, under the same names
    and in the same order."""
    # (Names are strings: equal ones name the same option.)
    return (len(group) == len(self.names)
            and all(map(operator.is_, self.options, group.values()))
            and self.names == tuple(group))

  def __init__(self, names: tuple, options: tuple, device: torch.device,
               rule: UpdateRule):
    self.names = names
    self.options = options  # held: their ids cannot be reused meanwhile
    self.device = device
    self.rule = rule
    self.scalars: dict[tuple[float | None, bool], _Scalars] = {}


_IMMUTABLE = frozenset((float, int, bool, str, type(None)))


def _immutable(v) -> bool:
  """A group option value that cannot change in place (plain numbers,
  strings, ``None``, tuples of them), so that an option holding the same
  object still holds the same value."""
  if type(v) is tuple:
    return all(type(a) in _IMMUTABLE for a in v)
  return type(v) in _IMMUTABLE


def _check_contiguous(w: torch.Tensor, what: str) -> None:
  """Refuses a managed weight that is not contiguous (e.g. a transposed
  tensor loaded with ``load_state_dict(..., assign=True)``) before any
  update of the step, rather than in one layer's backward after others."""
  if not w.is_contiguous():
    raise ValueError(
        f"forge_torch: {what} is not contiguous in memory (e.g. a transposed "
        "tensor assigned or loaded with load_state_dict(..., assign=True)); "
        "the fused kernel updates a weight in place, row-major. Load a "
        "contiguous tensor (t.contiguous()), or assign layer.weight = "
        "nn.Parameter(layer.weight.detach().contiguous()) before building "
        "the optimizer.")


def _storage_of(p: torch.Tensor) -> int | None:
  """The address of ``p``'s memory block (``None`` for a tensor without
  one: on the meta device, or a wrapper subclass such as a DTensor)."""
  if p.device.type == "meta" or type(p) not in (torch.nn.Parameter,
                                                torch.Tensor):
    return None
  try:
    return p.untyped_storage().data_ptr() or None
  except (RuntimeError, NotImplementedError):
    return None


def _check_own_memory(params, only=None) -> None:
  """Refuses a managed weight that shares autograd's version counter with
  another of the optimizer's parameters: slices of one tensor made
  Parameters without a copy (e.g. a fused checkpoint split and loaded with
  ``load_state_dict(..., assign=True)``). FORGE's in-place update of one
  weight in its layer's backward bumps that counter, which fails the
  backward of every other layer that saved a tensor sharing it, after
  some updates were applied. Parameters that only share a memory block
  (read from one saved tensor by ``torch.load``; bound with ``p.data =
  buf[i:j]``) keep counters of their own and are fine. The counters are
  compared by bumping the managed weight's (only where a memory block is
  shared: a tensor that a live graph saved would then refuse its
  backward, as after any in-place write). ``only``: the managed weights to
  check (default: every one in ``params``); the others' counters are not
  bumped (a weight registered during a forward, whose earlier layers'
  graphs saved theirs)."""
  by_storage = collections.defaultdict(list)
  for q in params:
    key = _storage_of(q)
    if key is not None and not any(q is r for r in by_storage[key]):
      by_storage[key].append(q)
  for members in by_storage.values():
    if len(members) < 2:
      continue
    for p in members:
      if not _linear.is_forge_weight(p) or (
          only is not None and not any(p is q for q in only)):
        continue
      others = [q for q in members if q is not p]
      versions = [q._version for q in others]
      _increment_version([p])
      linked = [q for q, v in zip(others, versions) if q._version != v]
      if not linked:
        continue
      names = ", ".join(_linear.weight_name(q) if _linear.is_forge_weight(q)
                        else f"a parameter of shape {tuple(q.shape)}"
                        for q in linked)
      raise ValueError(
          f"forge_torch: the managed {_linear.weight_name(p)} is a slice of "
          f"one tensor with other parameters ({names}), sharing autograd's "
          "version counter: e.g. a fused checkpoint split and loaded with "
          "load_state_dict(..., assign=True). FORGE's in-place update of "
          "one weight in its layer's backward would fail the backward of "
          "the others. Give each weight its own memory (load the slices' "
          ".clone(), or load without assign=True) before building the "
          "optimizer.")


def _options_snapshot(group: Mapping[str, Any],
                      options: Mapping[str, Any]) -> dict[str, Any]:
  """A group's options (its keys that are in ``options``, the family's
  defaults: torch reads no other key), comparable across a step without
  reading any device value: a tensor (e.g. a tensor ``lr``) by identity
  and version counter, which an in-place change bumps."""
  def snap(v):
    if isinstance(v, torch.Tensor):
      return ("tensor", id(v), v._version)
    if isinstance(v, (tuple, list)):
      return tuple(snap(a) for a in v)
    return v
  # (A plain number, string or None is its own snapshot: taken as is.)
  return {k: v if type(v) in _IMMUTABLE else snap(v)
          for k, v in group.items() if k in options}


def _describe(t) -> str:
  if not isinstance(t, torch.Tensor):
    return "none" if t is None else type(t).__name__
  return f"{t.dtype}{list(t.shape)} on {t.device}"


def _state_tensors(slots) -> list[torch.Tensor]:
  """The tensors of the slots (a quantized one: its codes and scales)."""
  out = []
  for s in slots:
    out += list(s) if isinstance(s, Quantized) else [s]
  return out


def _check_sharded_state(p: torch.Tensor, names, slots, layer: str) -> None:
  """A ``fully_shard`` weight's state must be sharded as the weight is
  (``DTensor`` of its mesh and placements), or the local shards would not
  line up element for element."""
  for name, s in zip(names, slots):
    if (getattr(s, "placements", None) != p.placements
        or getattr(s, "device_mesh", None) != p.device_mesh):
      raise RuntimeError(
          f"forge_torch.Linear {layer}: optimizer state {name!r} is not "
          "sharded as the weight is (a DTensor on the weight's device mesh "
          f"with placements {tuple(p.placements)}; got "
          f"{type(s).__name__} with placements "
          f"{getattr(s, 'placements', None)}). Load optimizer state for a "
          "fully_shard model with torch.distributed.checkpoint's "
          "set_optimizer_state_dict, which shards it.")


def _check_single_process(params=()) -> None:
  """Refuses managed weights in a multi-rank process group unless
  ``forge_torch.distributed.prepare_ddp`` registered them."""
  _distributed.check_single_process(params)


# torch.autograd.graph.increment_version on a list of tensors, without its
# Python wrapper where torch has the function it calls.
_increment_version = getattr(torch._C, "_increment_version",
                             torch.autograd.graph.increment_version)
# The running backward's graph task (-1: none, i.e. not inside a backward).
_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


_COMMON_DOC = """
  Same constructor (torch's signature and defaults, plus the keyword-only
  ``max_grad_norm``, ``restore_buffers``, ``moments``,
  ``stochastic_rounding`` and ``seed``), ``param_groups``, ``state`` and
  ``state_dict()`` as ``torch.optim.{name}``, whose checkpoints it loads
  and which loads its checkpoints when
  ``moments=None`` (quantized state, codes and ``*_scale`` tensors, loads
  into a forge_torch optimizer only). Parameters that are weights of
  :class:`forge_torch.Linear` layers (*managed* weights) are registered with
  this optimizer at construction (or ``add_param_group``); their layers'
  backward applies the update with the fused kernel, in torch's operation
  order (:mod:`pallas_kernels.torch_rules`). ``step()`` updates every other
  parameter with ``torch.optim.{name}.step`` itself. Param groups and LR
  schedulers apply to managed weights too; ``foreach`` / ``fused`` choose
  torch's implementation for the non-managed parameters (and, for Adam /
  AdamW with ``fused=True`` on CUDA, the arithmetic of the managed ones: see
  Adam).

  Not supported (``ValueError`` at construction, in ``add_param_group`` or in
  ``load_state_dict``): ``capturable=True`` (except Adam and AdamW with
  ``fused=True``: CUDA graphs), ``differentiable=True``.

  Gradient accumulation over K micro-batches is opt-in:
  ``opt.accumulate_steps = K`` (see ``accumulate_steps``). Under
  ``torch.autocast(dtype=torch.bfloat16)`` a managed layer computes as
  autocast's linear does, and its update reads ``G`` formed in fp32 from the
  bf16 operands.

  Raises at run time (clear errors): a managed layer run again before
  ``step()`` once its forward has run a backward or while that forward's graph
  is alive (more than ``accumulate_steps`` times with accumulation);
  ``torch.amp.GradScaler`` (from ``scaler.step``); input and weight on
  different devices or of different dtypes (outside autocast); a weight that
  is not float32 or bfloat16; float16 autocast; a managed weight that also
  received an ordinary gradient in the step (a tied/shared weight: keep that
  layer an ``nn.Linear``); group options changed after a weight's state was
  created so that the state lacks a tensor the update needs (e.g. RMSprop
  ``momentum`` turned on later).

  Global-norm clipping (keyword-only): ``max_grad_norm=`` clips by the
  norm over every parameter's gradient, ``step(closure)`` running the
  closure twice (a norm pass, then the update pass); ``restore_buffers=
  model`` puts back the model's buffers that the norm pass changed
  (BatchNorm statistics), inert without ``max_grad_norm``.

  If a managed weight is given to a second forge_torch optimizer, the last
  one given it owns it; the earlier one's ``step()`` raises
  ``RuntimeError`` while its param groups still hold the weight.

  Low-precision state (keyword-only, beside torch's options): ``moments=``
  ``None`` (torch's float state), ``"int8"``, ``"fp8"`` (float8_e4m3fn) or
  ``"fp8_e5m2"``: a managed weight of at least 4096 elements keeps each
  moment as codes ``state[name]`` plus float32 scales
  ``state[name + "_scale"]`` of shape ``(out, ceil(in / 64))``;
  ``stochastic_rounding=True`` stores (bfloat16) managed weights by
  stochastic rounding, with ``seed``. Other parameters keep torch's float
  state and rounding (a warning names the large ones). ``docs/torch.md``.
"""


def _doc(cls):
  cls.__doc__ = ((cls.__doc__ or "").rstrip() + "\n"
                 + _COMMON_DOC.format(name=cls.__name__))
  return cls


# ----------------------------------------------------------------------------
# The families.
# ----------------------------------------------------------------------------


_F32_TINY = float(np.finfo(np.float32).tiny)
_ADAMW_IS_ADAM = issubclass(torch.optim.AdamW, torch.optim.Adam)


def _torch_rule(family: str, **options) -> UpdateRule:
  """The registered ``family``'s rule in torch's operation order."""
  return families.REGISTRY[family].torch_rule(**options)


@_doc
class SGD(_ForgeOptimizer, torch.optim.SGD):
  """``torch.optim.SGD`` whose FORGE-managed weights update in backward.

  All options: ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``,
  ``maximize``. State: ``momentum_buffer`` (with momentum; formed as
  ``grad`` by a step that finds none or ``None``, as in torch), nothing
  otherwise.
  ``stochastic_rounding=True`` is refused (SGD keeps no step count).
  """

  _forge_counts_steps = False
  _forge_fp32_slots = frozenset({"momentum_buffer"})

  def _forge_rule(self, group, device=None):
    family = "sgd_momentum" if group["momentum"] != 0 else "sgd"
    return _torch_rule(family, nesterov=bool(group["nesterov"]))

  def _forge_init_state(self, p, group):
    return {"momentum_buffer": _zeros(p)} if group["momentum"] != 0 else {}

  def _forge_fresh(self, state, group):
    # torch's SGD starts the buffer from the gradient wherever it finds
    # none (state.get("momentum_buffer") is None): a buffer reset to None,
    # a checkpoint of torch <= 2.0 saved without momentum (which stored
    # None), other keys beside it.
    if group["momentum"] != 0:
      return state.get("momentum_buffer") is None
    return super()._forge_fresh(state, group)

  def _forge_hparams(self, group, state, t, fresh):
    momentum = _scalar(group["momentum"])
    return {
        **_prologue(group),
        "neg_lr": -_scalar(group["lr"]),
        # torch's first step: buf = grad.clone() == 0 * 0 + 1 * grad.
        "buf_decay": 0.0 if fresh else momentum,
        "one_minus_dampening": 1.0 if fresh else 1 - _scalar(group["dampening"]),
        "momentum": momentum,
    }, {}


@_doc
class Adagrad(_ForgeOptimizer, torch.optim.Adagrad):
  """``torch.optim.Adagrad`` whose FORGE-managed weights update in backward.

  All options: ``lr_decay``, ``weight_decay``, ``initial_accumulator_value``,
  ``eps``, ``maximize``. State: ``step``, ``sum`` (created at construction,
  as torch does; a model cast to bfloat16 afterwards keeps a float32
  ``sum``, updated in float32 as torch's step updates it).
  """

  _forge_fp32_slots = frozenset({"sum"})

  def _forge_rule(self, group, device=None):
    return _torch_rule("adagrad")

  def _forge_init_state(self, p, group):
    # torch reads the initial value from the defaults, not the group.
    return {"step": _zero_step(p, self._forge_option(group, "fused")),
            "sum": torch.full_like(p, self.defaults["initial_accumulator_value"],
                                   memory_format=torch.preserve_format)}

  def _forge_hparams(self, group, state, t, fresh):
    clr = _scalar(group["lr"]) / (1 + (t - 1) * _scalar(group["lr_decay"]))
    return {**_prologue(group), "eps": _scalar(group["eps"]),
            "neg_clr": -clr}, {}


@_doc
class RMSprop(_ForgeOptimizer, torch.optim.RMSprop):
  """``torch.optim.RMSprop`` whose FORGE-managed weights update in backward.

  All options: ``alpha``, ``eps``, ``weight_decay``, ``momentum``,
  ``centered``, ``maximize``. State: ``step``, ``square_avg``, and
  ``momentum_buffer`` (momentum > 0), ``grad_avg`` (centered).
  """

  _forge_fp32_slots = frozenset({"square_avg", "momentum_buffer"})

  def _forge_rule(self, group, device=None):
    # (Checked wherever a managed weight's rule is made: construction,
    # add_param_group, load_state_dict, and a group changed between steps.)
    if self._forge_moments is not None and group["centered"]:
      raise ValueError(
          f"forge_torch.RMSprop: moments={self._forge_moments!r} with "
          "centered=True is not supported: centered RMSprop divides by "
          "sqrt(square_avg - grad_avg**2), a variance that is the difference "
          "of two moments, and int8/fp8 codes of each cannot resolve it (it "
          "rounds to zero or below: huge steps or NaN weights). Use "
          "centered=False, or moments=None for this optimizer.")
    return _torch_rule("rmsprop", centered=bool(group["centered"]),
                       momentum=group["momentum"] > 0)

  def _forge_init_state(self, p, group):
    state = {"step": _zero_step(p, self._forge_option(group, "fused")),
             "square_avg": _zeros(p)}
    if group["momentum"] > 0:
      state["momentum_buffer"] = _zeros(p)
    if group["centered"]:
      state["grad_avg"] = _zeros(p)
    return state

  def _forge_hparams(self, group, state, t, fresh):
    alpha = _scalar(group["alpha"])
    return {**_prologue(group), "alpha": alpha, "one_minus_alpha": 1 - alpha,
            "eps": _scalar(group["eps"]), "neg_lr": -_scalar(group["lr"]),
            "momentum": _scalar(group["momentum"])}, {}


class _AdamMoments(_ForgeOptimizer):
  """State and scalars shared by the Adam-style families."""

  _forge_extra_scalars: ClassVar[dict[str, float]] = {}

  def _forge_init_state(self, p, group):
    state = {"step": _zero_step(p, self._forge_option(group, "fused"))}
    for name, value in self._forge_extra_scalars.items():
      state[name] = torch.tensor(value, dtype=_get_scalar_dtype())
    state["exp_avg"] = _zeros(p)
    state["exp_avg_sq"] = _zeros(p)
    return state

  def _forge_betas(self, group):
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    return beta1, beta2, {
        **_prologue(group, decoupled=self._forge_decoupled(group)),
        "one_minus_b1": 1 - beta1, "b2": beta2, "one_minus_b2": 1 - beta2,
        "eps": _scalar(group["eps"])}

  def _forge_decoupled(self, group) -> bool:
    return bool(self._forge_option(group, "decoupled_weight_decay", False))


@_doc
class Adam(_AdamMoments, torch.optim.Adam):
  """``torch.optim.Adam`` whose FORGE-managed weights update in backward.

  All options: ``betas``, ``eps``, ``weight_decay``, ``amsgrad``,
  ``maximize``, ``decoupled_weight_decay``. State: ``step``, ``exp_avg``,
  ``exp_avg_sq``, and ``max_exp_avg_sq`` (amsgrad).

  ``fused=True`` on CUDA: managed weights follow the arithmetic of torch's
  CUDA fused kernel (fp32 scalars, fma-form moments, fp32 bias corrections),
  not of its for-loop / ``foreach`` implementation -- the two differ by
  ~1.3e-5 in ``exp_avg_sq`` at ``beta2 = 0.999``. Elsewhere (CPU ``fused``
  included) the for-loop arithmetic.
  """

  _forge_family: ClassVar[str] = "adam"

  def _forge_rule(self, group, device=None):
    return _torch_rule(self._forge_family, amsgrad=bool(group["amsgrad"]),
                       cuda_fused=_torch_cuda_fused(group, device))

  def _forge_init_state(self, p, group):
    state = super()._forge_init_state(p, group)
    if group["amsgrad"]:
      state["max_exp_avg_sq"] = _zeros(p)
    return state

  _forge_capturable: ClassVar[bool] = True

  def _forge_captured_hparams(self, group, rule, step):
    # _cuda_fused_adam_scalars's operations on the GPU, from the step
    # tensor: torch.pow of fp32 tensors is the kernel _device_powf reads
    # back, and 1 - x, sqrt, / and * are single IEEE fp32 operations on
    # both sides, so a replay's vector equals the eager step's bit for bit.
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    decoupled = self._forge_decoupled(group)
    wd = _scalar(group["weight_decay"])
    static = pack_host(rule, {
        "grad_sign": -1.0 if group.get("maximize") else 1.0,
        "weight_decay": 0.0 if decoupled else wd,
        "eps": _scalar(group["eps"]),
        **_cuda_fused_adam_betas(beta1, beta2),
        "neg_lr_wd": 0.0, "bc2_sqrt": 0.0, "step_size": 0.0})
    dev, f32 = step.device, torch.float32

    def full(v):  # a fill kernel: the value travels as its argument
      return torch.full((1,), float(np.float32(v)), dtype=f32, device=dev)
    with torch.no_grad():
      vec = torch.zeros(len(static), dtype=f32, device=dev)
      for i, v in enumerate(static):
        if v != 0:
          vec[i:i + 1].fill_(float(v))
      lr = group["lr"]
      lr = (lr.detach().to(f32).reshape(1) if isinstance(lr, torch.Tensor)
            else full(lr))
      t = step.detach().to(f32).reshape(1) + 1
      bc1 = 1 - torch.pow(full(beta1), t)
      bc2 = 1 - torch.pow(full(beta2), t)
      at = rule.hparams.index
      vec[at("bc2_sqrt"):at("bc2_sqrt") + 1].copy_(torch.sqrt(bc2))
      vec[at("step_size"):at("step_size") + 1].copy_(lr / bc1)
      if decoupled:
        vec[at("neg_lr_wd"):at("neg_lr_wd") + 1].copy_(-(lr * full(wd)))
    return vec

  def _forge_hparams(self, group, state, t, fresh):
    beta1, beta2, values = self._forge_betas(group)
    device = state["exp_avg"].device  # the weight's (checked by the caller)
    if _torch_cuda_fused(group, device):
      values.update(_cuda_fused_adam_scalars(
          group, beta1, beta2, t, device, self._forge_decoupled(group)))
      return values, {}
    # torch's expressions on torch's operands: its for-loop step keeps a
    # tensor lr or betas (float32 tensor arithmetic); its fused kernel
    # (fused=True, here on the CPU) takes them as numbers.
    operand = _scalar if group.get("fused") else _loop_operand
    lr, b1, b2 = map(operand, (group["lr"], *group["betas"]))
    bc1 = 1 - b1**t
    bc2 = 1 - b2**t
    values["bc2_sqrt"] = _scalar(bc2**0.5)
    values["neg_step_size"] = -_scalar(lr / bc1)
    return values, {}


def _torch_cuda_fused(group: Mapping[str, Any],
                      device: torch.device | None) -> bool:
  """Whether torch steps this group's weights on ``device`` with its CUDA
  ``fused`` Adam/AdamW kernel, whose arithmetic differs from its for-loop /
  ``foreach`` one (:func:`pallas_kernels.torch_rules.adam_rule`). torch's
  CPU fused kernel follows the for-loop arithmetic."""
  return (bool(group.get("fused")) and device is not None
          and torch.device(device).type == "cuda")


# (base, t, device) -> fp32 pow(base, t) computed on the device.
_POWF: dict[tuple[float, float, str], np.float32] = {}
# Steps computed per device round trip.
_POWF_BLOCK = 1024


def _device_powf(base: float, t: float, device: str) -> np.float32:
  """fp32 ``pow(base, t)`` by torch's own kernel on ``device``.

  On CUDA that is the libdevice ``powf`` the fused Adam kernel calls for its
  bias corrections; a host ``powf`` may differ by an ulp, which ``1 - b**t``
  magnifies hundreds of times (``b = 0.999``, small ``t``). Reading it back
  waits for the GPU, so one round trip computes the next ``_POWF_BLOCK``
  steps (the same kernel, elementwise): training then waits once per 1024
  steps per beta, not in every step's backward.
  """
  key = (base, t, device)
  value = _POWF.get(key)
  if value is None:
    b = torch.tensor(base, dtype=torch.float32, device=device)
    e = torch.tensor(t, dtype=torch.float32, device=device) + torch.arange(
        _POWF_BLOCK, dtype=torch.float32, device=device)
    values = torch.pow(b, e).cpu().numpy()
    if len(_POWF) > 16 * _POWF_BLOCK:
      _POWF.clear()
    for k, tk in enumerate(e.cpu().numpy()):
      _POWF[(base, float(tk), device)] = np.float32(values[k])
    value = _POWF.get(key)
  if value is None:  # t not an fp32 number: this one alone
    b = torch.tensor(base, dtype=torch.float32, device=device)
    e = torch.tensor(t, dtype=torch.float32, device=device)
    value = _POWF[key] = np.float32(torch.pow(b, e).item())
  return value


def _cuda_fused_adam_betas(beta1: float, beta2: float) -> dict[str, float]:
  """The step-independent betas of ``adam_rule(cuda_fused=True)``, in fp32.
  ``1 - fp32(beta)`` is exact in fp32 for beta in [0.5, 1] (and 0), so
  ``g * (1 - b)`` is the kernel's ``fma(-b, g, g)`` bit for bit."""
  b1, b2 = float(np.float32(beta1)), float(np.float32(beta2))
  return {"b1": b1, "one_minus_b1_f32": 1.0 - b1,
          "b2": b2, "one_minus_b2_f32": 1.0 - b2}


def _cuda_fused_adam_scalars(group, beta1: float, beta2: float, t: float,
                             device: torch.device, decoupled: bool
                             ) -> dict[str, float]:
  """``adam_rule(cuda_fused=True)``'s scalars, in fp32 as torch's CUDA fused
  kernel forms them: every hyperparameter rounded to fp32 first, then
  ``bc1 = 1 - powf(b1, t)``, ``bc2_sqrt = sqrtf(1 - powf(b2, t))``,
  ``step_size = lr / bc1`` and AdamW's ``lr * wd``, each one fp32 operation
  (numpy's fp32 arithmetic is IEEE, as the kernel's). In a CUDA graph the
  same operations run on the GPU (:meth:`Adam._forge_captured_hparams`)."""
  f32 = np.float32
  b1, b2 = f32(beta1), f32(beta2)
  lr, wd = f32(_scalar(group["lr"])), f32(_scalar(group["weight_decay"]))
  dev = str(device)
  bc1 = f32(1) - _device_powf(float(b1), float(t), dev)
  bc2 = f32(1) - _device_powf(float(b2), float(t), dev)
  return {
      "neg_lr_wd": -float(lr * wd) if decoupled else 0.0,
      **_cuda_fused_adam_betas(beta1, beta2),
      "bc2_sqrt": float(np.sqrt(bc2)),
      "step_size": float(lr / bc1),
  }


@_doc
class AdamW(Adam, torch.optim.AdamW):
  """``torch.optim.AdamW`` whose FORGE-managed weights update in backward.

  All options: ``betas``, ``eps``, ``weight_decay``, ``amsgrad``,
  ``maximize``. State: ``step``, ``exp_avg``, ``exp_avg_sq``, and
  ``max_exp_avg_sq`` (amsgrad). (The Adam rule with decoupled weight decay,
  as torch's AdamW is its Adam with ``decoupled_weight_decay=True``; a
  param group that sets ``decoupled_weight_decay=False`` steps with L2
  decay, as torch's does.)
  """

  _forge_family: ClassVar[str] = "adamw"

  def _forge_decoupled(self, group) -> bool:
    # torch's AdamW is its Adam with decoupled_weight_decay=True as the
    # default, read per group: a group that sets it False steps as Adam with
    # L2 decay. (An AdamW that is no Adam always decouples.)
    return not _ADAMW_IS_ADAM or bool(
        group.get("decoupled_weight_decay", True))


@_doc
class Adamax(_AdamMoments, torch.optim.Adamax):
  """``torch.optim.Adamax`` whose FORGE-managed weights update in backward.

  All options: ``betas``, ``eps``, ``weight_decay``, ``maximize``. State:
  ``step``, ``exp_avg``, ``exp_inf``.
  """

  def _forge_rule(self, group, device=None):
    return _torch_rule("adamax")

  def _forge_init_state(self, p, group):
    return {"step": _zero_step(p, self._forge_option(group, "fused")),
            "exp_avg": _zeros(p),
            "exp_inf": _zeros(p)}

  def _forge_hparams(self, group, state, t, fresh):
    _, _, values = self._forge_betas(group)
    lr, b1 = _loop_operand(group["lr"]), _loop_operand(group["betas"][0])
    values["neg_clr"] = -_scalar(lr / (1 - b1**t))
    return values, {}


@_doc
class NAdam(_AdamMoments, torch.optim.NAdam):
  """``torch.optim.NAdam`` whose FORGE-managed weights update in backward.

  All options: ``betas``, ``eps``, ``weight_decay``, ``momentum_decay``,
  ``decoupled_weight_decay``, ``maximize``. State: ``step``, ``mu_product``
  (a scalar tensor, advanced with torch's own fp32 multiply), ``exp_avg``,
  ``exp_avg_sq``.
  """

  _forge_extra_scalars = {"mu_product": 1.0}
  _forge_hparams_per_weight = True  # reads the weight's mu_product

  def _forge_rule(self, group, device=None):
    return _torch_rule("nadam")

  def _forge_hparams(self, group, state, t, fresh):
    beta1, beta2, values = self._forge_betas(group)
    lr = _scalar(group["lr"])
    md = _scalar(group["momentum_decay"])
    # torch's expressions on torch's operands: a tensor beta1 forms mu, the
    # coefficients and mu_product in its own dtype (float32), a float in
    # double precision.
    b1 = group["betas"][0]
    b1 = b1.detach().cpu() if isinstance(b1, torch.Tensor) else beta1
    mu = b1 * (1.0 - 0.5 * (0.96 ** (t * md)))
    mu_next = b1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * md)))
    mu_product = state["mu_product"].clone()
    mu_product *= mu  # torch: mu_product *= mu (in place: its dtype kept)
    mp = _get_value(mu_product)
    values["bc2"] = 1 - beta2**t
    values["c_grad"] = _scalar(-lr * (1.0 - mu) / (1.0 - mp))
    values["c_avg"] = _scalar((-lr * mu_next) / (1.0 - mp * mu_next))
    return values, {"mu_product": mu_product}


@_doc
class RAdam(_AdamMoments, torch.optim.RAdam):
  """``torch.optim.RAdam`` whose FORGE-managed weights update in backward.

  All options: ``betas``, ``eps``, ``weight_decay``,
  ``decoupled_weight_decay``, ``maximize``. State: ``step``, ``exp_avg``,
  ``exp_avg_sq``.
  """

  def _forge_rule(self, group, device=None):
    return _torch_rule("radam")

  def _forge_hparams(self, group, state, t, fresh):
    _, _, values = self._forge_betas(group)
    # torch's expressions on torch's operands (as Adam's).
    lr, b1, b2 = map(_loop_operand, (group["lr"], *group["betas"]))
    bc2 = 1 - b2**t
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * t * (b2**t) / bc2
    rectify = bool(rho_t > 5.0)
    values.update(
        bc1=_scalar(1 - b1**t), lr=_scalar(lr), bc2_sqrt=_scalar(bc2**0.5),
        rectify=1.0 if rectify else 0.0,
        rect=_scalar(((rho_t - 4) * (rho_t - 2) * rho_inf
                      / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5)
        if rectify else 0.0)
    return values, {}


__all__ = ["Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
           "SGD"]
