"""`forge_torch.Linear`: `torch.nn.Linear` whose backward updates its own weight.

torch stores a linear weight as ``(out, in)``, the transpose of the kernel's
``(in, out)`` layout. Calling the fused kernel with ``x := grad_output`` and
``dy := input`` computes ``G' = grad_output^T input``, which *is* torch's
weight gradient in torch's own layout, so the weight is updated where it lies
and no transpose is ever materialised.
"""

from __future__ import annotations

import collections
import functools
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.autograd import forward_ad as _forward_ad
from torch.nn import functional as F
from torch.utils.weak import WeakIdRef

import pallas_kernels
from forge_torch import _bridge
from forge_torch import _hot


# A key for an object that no other live object shares, as ``id(obj)``:
# CPython's default hash, the object's address with its bits rotated. Unlike
# ``id()``, it raises no audit event; ``id()`` raises one, which costs a
# call into every audit hook installed (jax's imports install one), several
# times the dict access that follows.
_map_key = object.__hash__


class WeakIdMap(MutableMapping):
  """A mapping keyed by object identity that holds its keys weakly: what
  ``torch.utils.weak.WeakIdKeyDictionary`` is, with lookups cheap enough
  for every forward and backward of every layer (one dict access by
  ``_map_key(key)``, where ``WeakIdKeyDictionary`` makes a weak reference
  per lookup).

  An entry is dropped by its key's weak-reference callback, which runs when
  the key is deallocated, before its memory (and so its identity key) can
  be reused: a key in the map always belongs to its live object. A key's
  weak reference outlives its entry (``pop``, ``clear``) until the key
  dies, so that setting the key again (bookkeeping cleared every optimizer
  step) makes no new one. Iteration works on a snapshot, so entries may
  come and go meanwhile. (Code on the path of every forward and backward
  reads ``_values`` by ``_map_key(key)`` directly, saving a method call.)"""

  def __init__(self):
    # identity key -> weak ref to the object: every live key set since the
    # map was made
    self._refs: dict[int, WeakIdRef] = {}
    self._values: dict[int, Any] = {}  # identity key -> value: the entries
    map_ref = weakref.ref(self)

    def drop(k: int, ref: WeakIdRef) -> None:  # the key was deallocated
      live = map_ref()
      if live is not None and live._refs.get(k) is ref:
        del live._refs[k]
        live._values.pop(k, None)

    self._drop = drop

  def __contains__(self, key) -> bool:
    return _map_key(key) in self._values

  def get(self, key, default=None):
    return self._values.get(_map_key(key), default)

  def __getitem__(self, key):
    try:
      return self._values[_map_key(key)]
    except KeyError:
      raise KeyError(key) from None

  def __setitem__(self, key, value) -> None:
    k = _map_key(key)
    if k not in self._refs:
      self._refs[k] = WeakIdRef(key, functools.partial(self._drop, k))
    self._values[k] = value

  def __delitem__(self, key) -> None:
    self.pop(key)

  def pop(self, key, *default):
    k = _map_key(key)
    if k in self._values:
      return self._values.pop(k)
    if default:
      return default[0]
    raise KeyError(key)

  def clear(self) -> None:
    self._values.clear()

  def __iter__(self) -> Iterator:
    for k in list(self._values):
      ref = self._refs.get(k)
      key = ref() if ref is not None else None
      if key is not None:
        yield key

  def __len__(self) -> int:
    return len(self._values)


# Parameters created (or adopted) by a forge_torch.Linear as its weight.
_FORGE_WEIGHTS = WeakIdMap()
# FORGE weight -> weakref to the forge_torch optimizer that owns it.
_OWNERS = WeakIdMap()
# FORGE weight -> the module path of its layer (set by convert()).
_PATHS = WeakIdMap()
# Every live forge_torch optimizer (prepare_fsdp refuses to mark a weight
# one of them already holds as an ordinary parameter).
_OPTIMIZERS = weakref.WeakSet()
# The optimizers whose clipped step(closure) is running its closure,
# innermost last, and the name of its first pass, which measures the norm:
# forge_torch._clip's (RUNNING, NORM_PASS), kept here for the layer's
# messages (_clip imports this module).
CLIPPING: list = []
NORM_PASS = "norm"
# Its entries by identity key, as the forward reads them (the dict is never
# replaced: cleared in place).
_FORGE_WEIGHT_KEYS = _FORGE_WEIGHTS._values


class ConvertSkipWarning(UserWarning):
  """:func:`convert` left some ``nn.Linear`` layers on the standard path;
  the message (and the returned list's ``skipped``) says which and why."""


def _mark(weight: torch.Tensor) -> None:
  # A zero-size weight has nothing to update: it stays on the standard path
  # (nn.Linear(0, n) trains with torch.optim, and so does this layer).
  if weight.numel() > 0:
    _FORGE_WEIGHTS[weight] = True


def is_forge_weight(p: torch.Tensor) -> bool:
  """Whether ``p`` is a FORGE-managed weight: the (non-empty) weight a
  ``forge_torch.Linear`` created or adopted (``from_linear``, ``convert``,
  ``prepare_fsdp``); not a Parameter assigned later by ``layer.weight =
  p``."""
  return _map_key(p) in _FORGE_WEIGHT_KEYS


def weight_name(p: torch.Tensor) -> str:
  """How messages name FORGE weight ``p``: ``<layer path>.weight`` once
  :func:`convert` has seen its model, else its shape."""
  path = _PATHS.get(p)
  return f"{path}.weight" if path else f"weight of shape {tuple(p.shape)}"


def path_of(p: torch.Tensor) -> str | None:
  """The module path of the layer FORGE weight ``p`` was last named for by
  :func:`convert`, or ``None``."""
  return _PATHS.get(p)


def owner_of(p: torch.Tensor):
  """The live forge_torch optimizer that owns FORGE weight ``p``, or ``None``.

  The newest optimizer built over ``p`` owns it. If that one has been
  garbage-collected (a throwaway optimizer), ownership returns to the newest
  earlier one that is alive and still holds ``p`` in its param groups."""
  k = _map_key(p)
  refs = _OWNERS._values.get(k)
  if refs:  # the usual case: the newest one, alive, manages it
    optimizer = refs[-1]()
    if optimizer is not None and k in optimizer._forge_managed._values:
      return optimizer
  while refs:
    optimizer = refs[-1]()
    if optimizer is not None and optimizer._forge_reclaim(p):
      return optimizer
    refs.pop()
  return None


def group_index(groups, p: torch.Tensor) -> int | None:
  """The index of the first of ``groups`` whose ``"params"`` hold ``p``
  (by identity), or ``None``."""
  for index, group in enumerate(groups):
    if any(q is p for q in group["params"]):
      return index
  return None


class NotOwnedError(RuntimeError):
  """A managed layer's weight that its optimizer no longer holds in its
  param groups (the layer's forward then looks for another that does)."""


def _adopter(p: torch.Tensor, layer: str):
  """The live forge_torch optimizer that registers FORGE weight ``p``,
  owned by none, found in one of its param groups' ``"params"`` lists
  (appended there after the group was added), or ``None``."""
  holders = [o for o in list(_OPTIMIZERS)
             if group_index(o.param_groups, p) is not None]
  if len(holders) > 1:
    raise RuntimeError(
        f"forge_torch.Linear {layer}: its weight was appended to the param "
        f"groups of {len(holders)} forge_torch optimizers, which would each "
        "update it; keep it in one (optimizer.add_param_group).")
  if holders and holders[0]._forge_adopt(p):
    return holders[0]
  return None


def _set_owner(p: torch.Tensor, optimizer) -> None:
  refs = _OWNERS.setdefault(p, [])
  refs[:] = [r for r in refs if r() is not None and r() is not optimizer]
  refs.append(weakref.ref(optimizer))


class _Handle:
  """What a layer's backward needs besides tensors; one counted forward of
  a managed weight.

  Attributes:
    optimizer: ``weakref.ref`` to the owning optimizer.
    weight: the Parameter itself (saved tensors may be aliases).
    config: the layer's ``block_config``.
    layer: how messages name the layer.
    generation: the optimizer step this forward was counted in (``None``:
      not counted, e.g. a checkpointing recomputation inside backward).
    amp: the dtype ``torch.autocast`` ran the forward in, or ``None``.
    done: ``True`` once its backward consumed it (an update or an
      accumulated micro-batch) or it was released, so that it stops
      counting at most once.
  """

  __slots__ = ("optimizer", "weight", "config", "layer", "generation",
               "amp", "done")

  def __init__(self, optimizer, weight: nn.Parameter,
               config: pallas_kernels.BlockConfig | None, layer: str,
               generation: int | None = None,
               amp: torch.dtype | None = None):
    self.optimizer = optimizer
    self.weight = weight
    self.config = config
    self.layer = layer
    self.generation = generation
    self.amp = amp
    self.done = False

  def release(self) -> None:
    """This forward will not update the weight: it stops counting (a no-op
    if it was consumed or released already, or the step has moved on)."""
    if self.done:
      return
    self.done = True
    optimizer = self.optimizer()
    if optimizer is not None:
      optimizer._forge_release(self.weight, self.generation)

  def __del__(self):
    # The forward's graph was freed: a graph dropped without a backward (a
    # skipped batch, an exception later in the forward) stops counting.
    if self.generation is not None and not self.done:
      self.release()


_grad_enabled = torch.is_grad_enabled

# Whether autocast is on for any device type (one call, no device string);
# it covers CPU and CUDA, the devices a managed weight can be on.
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_dtype(device_type: str) -> torch.dtype | None:
  """The dtype ``torch.autocast`` casts a linear layer to on
  ``device_type``, or ``None`` when autocast is off there (or autocast does
  not know the device type, e.g. ``meta``)."""
  try:
    if not torch.is_autocast_enabled(device_type):
      return None
  except RuntimeError:  # "unknown device type for autocast"
    return None
  return torch.get_autocast_dtype(device_type)


def _autocast_eligible(t: torch.Tensor | None) -> bool:
  # What torch.autocast casts: floating tensors other than float64.
  return (t is not None and t.is_floating_point()
          and t.dtype != torch.float64)


# Inside a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``...)
# when it returns something: the transform computes gradients functionally
# and trains nothing, so the layer is ``F.linear`` there.
_PEEK_INTERPRETER = getattr(getattr(torch._C, "_functorch", None),
                            "peek_interpreter_stack", None)


def _has_tangent(*tensors) -> bool:
  """One of ``tensors`` is a forward-mode dual (``torch.autograd.forward_ad``):
  the fused backward has no ``jvp``, so the layer is ``F.linear`` there (as
  under ``torch.func``); a backward of that graph then gives the weight an
  ordinary ``grad``, which ``optimizer.step()`` applies."""
  # Outside a dual level (the usual case) unpack_dual finds no tangent.
  if getattr(_forward_ad, "_current_level", 0) < 0:
    return False
  for t in tensors:
    if t is not None and _forward_ad.unpack_dual(t).tangent is not None:
      return True
  return False


# What a backward wants of a managed weight (_weight_grad_mode).
UPDATE, SKIP, RETURN = "update", "skip", "return"


_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)


def _weight_grad_mode(weight: torch.Tensor, node=None) -> str:
  """Inside a backward, what it wants of ``weight``'s gradient:

  * ``UPDATE`` -- it accumulates into the weight (``loss.backward()``, or
    ``backward(inputs=[..., weight])``): FORGE applies the update instead;
  * ``SKIP`` -- it does not reach the weight (``torch.autograd.grad(loss, x)``,
    ``backward(inputs=[...])`` without it): torch leaves the weight alone;
  * ``RETURN`` -- ``torch.autograd.grad(loss, [..., weight])`` asks for the
    gradient itself: it is returned, and the weight is left alone.

  Uses the engine's ``_will_engine_execute_node`` (what
  ``torch.utils.checkpoint`` relies on), which refuses a leaf that
  ``autograd.grad`` captures; without it, ``UPDATE``. ``node``: the
  weight's gradient accumulator as the graph holds it, if the caller has it
  (else looked up, the same node while the graph is alive)."""
  if not weight.requires_grad:  # frozen after the forward: torch skips it
    return SKIP
  if _WILL_EXECUTE is None:
    return UPDATE
  if node is None:
    node = torch.autograd.graph.get_gradient_edge(weight).node
  try:
    return UPDATE if _WILL_EXECUTE(node) else SKIP
  except RuntimeError:  # "a leaf node ... running autograd.grad()": captured
    return RETURN


def _layer_of(ctx) -> str:
  """The layer name a backward's ``ctx`` holds: its handle's, or, once the
  handle was consumed, the name left in its place."""
  handle = ctx.handle
  return handle if handle.__class__ is str else getattr(handle, "layer", "")


def _refuse_double_backward(ctx) -> None:
  """Refuses double backward clearly (``once_differentiable``'s own error
  names neither forge_torch nor a fix): the fused backward is not itself
  differentiable. The backward calls it first when grad mode is on
  (autograd runs a backward with grad mode on only for
  ``create_graph=True``); past that check grad mode is off, so the
  backward records no graph, as under ``once_differentiable``."""
  raise RuntimeError(
      f"forge_torch.Linear {_layer_of(ctx)}: a backward "
      "with create_graph=True (a gradient penalty, double backward) "
      "cannot run through a FORGE-managed layer, whose backward updates "
      "the weight in place and is not itself differentiable. Keep this "
      "layer as nn.Linear (layer.fused = False) for such a loss.")


def check_no_grad_hooks(weight: torch.Tensor, layer: str) -> None:
  """A hook on a managed weight's gradient would never see it (FORGE forms
  none): refuse instead of calling it with ``None`` or silently skipping."""
  post = weight._post_accumulate_grad_hooks
  if not (weight._backward_hooks or post):
    return  # the usual case
  if not weight._backward_hooks and all(
      getattr(h, "forge_own", False) for h in post.values()):
    return  # forge_torch's own (prepare_ddp: for a step run unfused)
  hook_names = ("_backward_hooks", "_post_accumulate_grad_hooks")
  hooks = [name for name in hook_names if getattr(weight, name, None)]
  raise RuntimeError(
      f"forge_torch.Linear {layer}: its weight has a gradient hook "
      f"(tensor.register_hook / register_post_accumulate_grad_hook: "
      f"{', '.join(hooks)}), but FORGE never forms that gradient -- the "
      "backward applies the update in place. Clip or transform gradients "
      "some other way, or keep this layer as nn.Linear (layer.fused = "
      "False).")


def rows(t: torch.Tensor, n: int) -> torch.Tensor:
  """``t`` (``(..., n)``: a layer's input or output gradient) as the 2-d
  ``(rows, n)`` operand of ``G``; a 2-d one as it is (a reshape to the
  same shape would make a view of the same memory, for a microsecond)."""
  return t if t.dim() == 2 else t.reshape(-1, n)


def _other_grads(grad_output, input, w_op, w_dtype, needs, mode):
  """The backward's gradients other than the update: the input's (from
  ``w_op``, the weight as the forward's GEMM read it), the weight's when the
  caller asked for it (``mode == RETURN``, in ``w_dtype``) and the bias's,
  each ``None`` where not needed."""
  grad_input = grad_output.matmul(w_op) if needs[0] else None
  grad_weight = grad_bias = None
  if mode == RETURN or needs[2]:
    g2 = rows(grad_output, w_op.shape[0])
    if mode == RETURN:
      grad_weight = g2.t().matmul(rows(input, w_op.shape[1])).to(w_dtype)
    if needs[2]:
      grad_bias = g2.sum(0)
  return grad_input, grad_weight, grad_bias


class _FusedLinearFn(torch.autograd.Function):
  """``y = x W^T + b``; the backward updates ``W`` instead of returning its grad.

  ``handle.amp`` (``torch.autocast``): the GEMMs read ``W`` cast to it, as
  autocast's linear does (``input`` and ``bias`` arrive cast already); the
  fused update reads the cast ``input`` and ``grad_output`` and updates the
  full-precision ``W`` and its state.
  """

  @staticmethod
  def forward(ctx, input, weight, bias, handle):
    # The weight is saved as is; its cast is formed again in backward (the
    # same values: the version counter guarantees it is unchanged), so no
    # low-precision copy stays alive between forward and backward.
    ctx.save_for_backward(input, weight)
    ctx.handle = handle
    if handle.amp is not None:
      weight = weight.to(handle.amp)
    return F.linear(input, weight, bias)

  @staticmethod
  def backward(ctx, grad_output):
    if _is_compiling():  # loss.backward() inside a torch.compile'd function:
      # the engine calls this frame, which Dynamo would trace; run it eagerly
      return _backward_eagerly(ctx, grad_output)
    if _grad_enabled():  # create_graph=True
      _refuse_double_backward(ctx)
    handle = ctx.handle
    if handle.__class__ is str:  # consumed (the layer's name), checked
      # first: the saved weight's version moved on
      raise RuntimeError(_second_backward_message(handle))
    try:
      input, weight = ctx.saved_tensors
    except RuntimeError:
      # The saved weight's version moved on. Where this step's update of it
      # was applied already (a layer reused under reentrant checkpointing,
      # whose forwards are counted at their backward only), FORGE's refusal
      # instead of autograd's.
      optimizer = handle.optimizer()
      if optimizer is not None:
        optimizer._forge_refuse_second_update(handle.weight, handle.layer)
      raise
    # The graph's edge to the weight (input 1 of apply): its accumulator.
    mode = _weight_grad_mode(handle.weight, ctx.next_functions[1][0])
    if mode == UPDATE:
      # A later backward through this graph cannot update: refused, naming
      # the layer.
      ctx.handle = handle.layer
    # (needs_input_grad is False for an absent bias.)
    needs = ctx.needs_input_grad
    amp = handle.amp
    # grad_input reads the PRE-update weight: computed (queued) before the
    # fused kernel, which waits for torch's stream, overwrites the weight.
    # If the caller did not ask to accumulate into the weight, torch would
    # leave the weight (and its optimizer state) alone, and so do we; if it
    # asked for the gradient itself (autograd.grad), it gets it, formed
    # here (under autocast: in its dtype, then cast, as torch does).
    if amp is None:
      grad_input, grad_weight, grad_bias = _other_grads(
          grad_output, input, weight, weight.dtype, needs, mode)
    else:
      with torch.autocast(grad_output.device.type, enabled=False):
        # As the forward's GEMM read it (cast again, the same values).
        grad_input, grad_weight, grad_bias = _other_grads(
            grad_output, input, weight.to(amp), weight.dtype, needs, mode)
    if mode != UPDATE:
      # This forward no longer counts towards the one use per step.
      handle.release()
      return grad_input, grad_weight, grad_bias, None
    optimizer = handle.optimizer()
    if optimizer is None:
      raise RuntimeError(
          f"forge_torch.Linear {handle.layer}: the optimizer that owned this "
          "weight was garbage-collected between forward and backward")
    w = handle.weight
    check_no_grad_hooks(w, handle.layer)  # one added after forward
    # `weight` (unpacked) may be an alias of the Parameter, e.g. under
    # activation checkpointing; the optimizer keys its state by the Parameter.
    # Updates the weight, or (gradient accumulation) adds G to its buffer.
    # (The (..., out) and (..., in) operands of G as they are: an update
    # that repeats its plan takes them by rows, the others make them 2-d.)
    # The plan's update in C++ where the native host path is on and holds;
    # else (False: nothing done) the optimizer's Python path.
    native = _hot.run_plan
    if native is None or not native(optimizer, w, grad_output, input,
                                    handle.config):
      optimizer._forge_fused_update(w, grad_output, input,
                                    config=handle.config, layer=handle.layer)
    handle.done = True  # this forward's use is consumed
    # No gradient for the weight: it has been updated already (grad stays None).
    return grad_input, None, grad_bias, None


def _second_backward_message(layer: str) -> str:
  """Why a second backward through one forward of managed layer ``layer``
  is refused: its first took the weight's gradient (applied the update, or
  added it to the accumulation buffer), or, in the norm pass of a clipped
  step (``max_grad_norm``), measured its norm and applied nothing."""
  if CLIPPING and getattr(CLIPPING[-1], "_forge_clip_phase",
                          None) == NORM_PASS:
    return (
        f"forge_torch.Linear {layer}: backward ran twice through the same "
        "forward (retain_graph=True?) in the first pass of a clipped step "
        "(max_grad_norm), whose first backward measured the gradient's "
        "norm: the closure must run one backward per call. Nothing has "
        "been applied; the weights are unchanged.")
  return (
      f"forge_torch.Linear {layer}: backward ran twice through the same "
      "forward (retain_graph=True?). Its first backward took the weight's "
      "gradient already: it applied the optimizer's update or, with "
      "accumulate_steps > 1, added the gradient to the weight's "
      "accumulation buffer; a second one cannot be fused. For an input's "
      "gradient as well, take it first (torch.autograd.grad(loss, inputs, "
      "retain_graph=True)), then run the training backward.")


def _direct_apply(fn_cls):
  """The C++ apply of ``torch._C._FunctionBase`` bound to ``fn_cls``, where
  torch wraps it in Python as ``Function.apply``; ``None`` where it does not
  (``fn_cls.apply`` is the C++ apply itself) or the pieces are missing.

  In torch up to 2.11 ``Function.apply`` is a Python classmethod that,
  outside a ``torch.func`` transform, unwraps dead functorch wrappers from
  its arguments and calls the C++ apply (newer torch binds the C++ apply as
  ``Function.apply``). The layer's forward calls it outside a transform only
  (checked again there, with ``_are_functorch_transforms_active``) and
  unwraps its tensors itself: the same work, without a few microseconds of
  Python frames per layer call. (Checked against torch 2.11 and 2.14; a
  version in between is taken to wrap it alike.)"""
  raw = vars(torch._C._FunctionBase).get("apply")
  if (raw is None or vars(torch.autograd.Function).get("apply") is raw
      or _UNWRAP_IF_DEAD is None or _TRANSFORMS_ACTIVE is None):
    return None
  return raw.__get__(None, fn_cls)


_UNWRAP_IF_DEAD = getattr(getattr(torch._C, "_functorch", None),
                          "unwrap_if_dead", None)
_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active",
                             None)
_FUSED_APPLY = _direct_apply(_FusedLinearFn)


def _bind_backward(fn_cls) -> None:
  """Makes the autograd engine call ``fn_cls.backward`` as its graph node's
  ``apply``. torch's (``BackwardCFunction.apply``) looks the user's
  function up at every call: ``backward`` or ``vjp``, and in newer torch
  whether the gradients come boxed (``boxed_grads_call``); ``fn_cls``
  defines ``backward`` alone, unboxed, so the lookup always finds it.
  (Bound once, at import: a ``backward`` patched in later is not what the
  engine calls.)"""
  node_cls = getattr(fn_cls, "_backward_cls", None)
  if (node_cls is not None and "apply" not in vars(node_cls)
      and "vjp" not in vars(fn_cls)
      and not getattr(fn_cls, "boxed_grads_call", False)):
    node_cls.apply = fn_cls.backward


_bind_backward(_FusedLinearFn)


def is_fsdp_managed(layer: nn.Module) -> bool:
  """Whether FSDP manages ``layer``'s parameters: ``fully_shard`` (FSDP2) and
  ``FullyShardedDataParallel`` (FSDP1) mark every module they shard, or
  whose sharded ancestor covers, with ``_is_fsdp_managed_module``."""
  return bool(getattr(layer, "_is_fsdp_managed_module", False))


def is_fully_sharded(module: nn.Module) -> bool:
  """Whether ``torch.distributed.fsdp.fully_shard`` (FSDP2) was applied to
  ``module`` itself (its class then is fully_shard's subclass of the
  module's own, an ``FSDPModule``)."""
  if not is_fsdp_managed(module):  # (no import of torch's FSDP otherwise)
    return False
  try:
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
  except ImportError:  # a torch without FSDP2
    return False
  return isinstance(module, FSDPModule)


def is_prepared_sharded(layer: nn.Module) -> bool:
  """Whether ``forge_torch.distributed.prepare_fsdp`` took over the update of
  ``layer``'s ``fully_shard``-sharded weight."""
  return bool(getattr(layer, "_forge_sharded", False))


def check_not_sharded(layer: nn.Module, name: str) -> None:
  """Refuses a ``forge_torch.Linear`` that FSDP shards unless
  ``forge_torch.distributed.prepare_fsdp`` prepared it.

  ``torch.distributed.fsdp.fully_shard`` (FSDP2) replaces the layer's weight
  by a sharded ``DTensor`` and, around the forward and backward, by a
  gathered copy that is not the weight forge_torch manages (FSDP1 by views of
  a flat parameter): unprepared, the layer would silently train on the
  standard path (torch's gradient, reduce-scattered by FSDP, stepped by
  ``optimizer.step()``), with no sign that FORGE is off.
  """
  if is_fsdp_managed(layer) and not is_prepared_sharded(layer):
    raise RuntimeError(
        f"forge_torch.Linear {name}: it is sharded by FSDP "
        "(torch.distributed.fsdp.fully_shard or FullyShardedDataParallel) "
        "but was not prepared for it: FSDP gathers the weight into a copy "
        "for the forward and reduce-scatters that copy's gradient, so FORGE "
        "cannot update the weight in the layer's backward. With fully_shard "
        "(FSDP2), call forge_torch.distributed.prepare_fsdp(model) after "
        "fully_shard(...) and before building the optimizer: each rank's "
        "shard is then updated as soon as FSDP reduce-scatters its "
        "gradient. FullyShardedDataParallel (FSDP1) is not supported: keep "
        "the layers it shards as nn.Linear (convert the model with "
        "exclude=[...], or set layer.fused = False), or train with "
        "DistributedDataParallel after forge_torch.distributed.prepare_ddp "
        "(docs/torch.md, Data parallelism).")


class Linear(nn.Linear):
  """A drop-in for :class:`torch.nn.Linear` whose backward applies the optimizer.

  Same constructor, parameters (``weight`` ``(out, in)``, ``bias``
  ``(out,)``), initialisation and forward as ``nn.Linear``. When the weight is
  owned by a forge_torch optimizer (e.g. :class:`forge_torch.AdamW`), the
  backward computes ``grad_input`` from the pre-update weight, then updates the
  weight and its optimizer state in place with the fused weight-gradient
  kernel; ``weight.grad`` stays ``None`` and, in single-process training
  without accumulation, the weight's gradient never exists in memory (see
  ``accumulate_steps`` and :mod:`forge_torch.distributed` for the buffers
  those keep). The bias takes the ordinary path (its ``.grad`` is set and
  ``optimizer.step()`` updates it).

  Outside autograd (``torch.no_grad()``, a weight with ``requires_grad=False``)
  or with ``fused = False`` it *is* ``nn.Linear``.

  Attributes (beside ``nn.Linear``'s):
    fused: ``False`` keeps this layer on the standard path.
    block_config: a Triton tiling of the fused kernel
      (``pallas_kernels.BlockConfig``), which makes the update take the
      Triton kernel through DLPack. When ``None``, the backend choice's:
      on a Hopper GPU the Mosaic GPU kernel with its cached (or nearest
      cached, or default) tiling, launched directly where it covers the
      case; else ``pallas_kernels.select_config``'s Triton tiling, a cached
      winner for this rule, GPU and shape if a cache file has one (the
      shipped cache holds forge_jax AdamW's, which torch's AdamW and Adam
      rules take, ``UpdateRule.tuned_as``; the other torch rules take the
      heuristic ``BlockConfig.compiled_default``).

  Each managed layer may run once per optimizer step (one forward, one
  backward): FORGE updates the weight during that backward, so a second
  reader of the weight in the same step would see the updated one. With
  gradient accumulation (``optimizer.accumulate_steps = K``) it may run once
  per micro-batch, K times per step: the backwards before the K-th add the
  weight's gradient to an fp32 buffer and leave the weight as it is.

  Under ``torch.autocast(device_type, dtype=torch.bfloat16)`` it is autocast's
  linear (input, weight and bias cast to bf16; bf16 output; the input and bias
  gradients in their own dtypes); the fused update forms ``G`` in fp32 from
  the bf16 input and output gradient and updates the weight and its state in
  their own dtypes. float16 autocast raises (it needs a ``GradScaler``).
  """

  fused: bool = True
  block_config: pallas_kernels.BlockConfig | None = None
  # Read by every forward; class defaults, so that reading them does not
  # fall back to nn.Module.__getattr__. The module path (convert(),
  # _set_path), and whether FSDP manages the layer (set on the instance by
  # fully_shard / FullyShardedDataParallel).
  _forge_path: str | None = None
  _is_fsdp_managed_module: bool = False
  # (in_features, out_features, "Linear(in, out)"): _layer_name's cache.
  _forge_default_name: tuple = (None, None, None)
  # Whether the layer has warned that its weight is formed at each forward.
  _forge_formed_warned: bool = False

  def __init__(self, in_features: int, out_features: int, bias: bool = True,
               device=None, dtype=None, *,
               block_config: pallas_kernels.BlockConfig | None = None) -> None:
    pallas_kernels.fused_wgrad.check_block_config(
        block_config, "forge_torch.Linear")
    super().__init__(in_features, out_features, bias=bias, device=device,
                     dtype=dtype)
    self.fused = True
    self.block_config = block_config
    _mark(self.weight)

  # Ways the layer's own weight is replaced by a new Parameter: copy.deepcopy
  # / pickle (__setstate__), to_empty() from the meta device and conversions
  # that do not keep the Parameter (_apply), load_state_dict(assign=True).
  # Where the weight replaced was FORGE's, the new one is the same weight:
  # mark it, as __init__ did the first. (`layer.weight = p` assigns a tensor
  # that may be used elsewhere -- a tied weight -- and is not marked: the
  # layer then runs its standard path, and stays on it through those
  # replacements.)
  def _has_forge_weight(self) -> bool:
    return is_forge_weight(self._parameters.get("weight"))

  def _mark_own_weight(self, own: bool) -> None:
    if own and isinstance(self._parameters.get("weight"), torch.Tensor):
      _mark(self.weight)
      self._set_path(getattr(self, "_forge_path", None))

  def _set_path(self, path: str | None) -> None:
    """Records the module path by which messages name this layer."""
    if path is None:
      return
    self._forge_path = path
    if isinstance(self._parameters.get("weight"), torch.Tensor):
      _PATHS[self.weight] = path

  def __getstate__(self):
    # (Whether the weight is FORGE's: the copy's new one is, then.)
    return {**super().__getstate__(),
            "_forge_own_weight": self._has_forge_weight()}

  def __setstate__(self, state):
    state = dict(state)
    own = state.pop("_forge_own_weight", True)  # (older pickles: their own)
    super().__setstate__(state)
    self._mark_own_weight(own)

  def _warn_formed_weight(self) -> None:
    """Says once that this layer runs on the standard path: its weight is
    no longer a Parameter of it but formed from others at each forward (a
    parametrization, weight_norm, spectral_norm or prune applied after
    convert()), which FORGE cannot update in place."""
    self._forge_formed_warned = True
    warnings.warn(
        f"forge_torch.Linear {self._layer_name()}: its weight is no longer a "
        "Parameter of the layer but formed from other parameters at each "
        "forward (torch.nn.utils.parametrize, weight_norm, spectral_norm or "
        "prune applied after convert()), so the layer trains on the "
        "standard path, its parameters stepped by the optimizer from their "
        "gradients. Apply them before convert(), which leaves such a layer "
        "nn.Linear.", ConvertSkipWarning, stacklevel=3)

  def _swap_refused(self, what: str) -> str:
    """Why torch could not swap this layer's weight (``what`` did)."""
    return (
        f"forge_torch.Linear {self._layer_name()}: {what} swaps the weight's "
        "tensor object (torch.utils.swap_tensors: torch.__future__."
        "set_swap_module_params_on_conversion(True), or a tensor subclass), "
        "which torch cannot do for a FORGE-managed weight: forge_torch keeps "
        "weak references to it, to find its optimizer and layer. Turn that "
        "flag off (torch's default) for this model; the weight's values are "
        "then replaced in place.")

  def _load_from_state_dict(self, *args, **kwargs):
    error_msgs = args[6] if len(args) > 6 else kwargs.get("error_msgs")
    n = len(error_msgs) if isinstance(error_msgs, list) else None
    own = self._has_forge_weight()
    super()._load_from_state_dict(*args, **kwargs)
    if n is not None:  # torch's "Cannot swap t1 because it has weakref"
      for i in range(n, len(error_msgs)):
        if "weakref" in str(error_msgs[i]):
          error_msgs[i] = self._swap_refused("load_state_dict")
    self._mark_own_weight(own)

  def _apply(self, fn, recurse=True):
    own = self._has_forge_weight()
    try:
      out = super()._apply(fn, recurse)
    except RuntimeError as e:
      if "weakref" in f"{e} {e.__cause__}":
        raise RuntimeError(self._swap_refused(
            "a conversion (.to(), .cuda(), .half(), ...)")) from e
      raise
    self._mark_own_weight(own)
    return out

  @classmethod
  def from_linear(cls, linear: nn.Linear, *,
                  block_config: pallas_kernels.BlockConfig | None = None
                  ) -> "Linear":
    """A ``forge_torch.Linear`` sharing ``linear``'s weight and bias Parameters.

    The new module holds the very same Parameter objects (no copy), so an
    optimizer built afterwards over either module's parameters sees the same
    tensors. Hooks registered on ``linear`` are not carried over; use
    :func:`convert` to convert a model in place.
    """
    if not isinstance(linear, nn.Linear):
      raise TypeError(
          f"from_linear needs an nn.Linear, got {type(linear).__name__}")
    if isinstance(linear, nn.modules.lazy.LazyModuleMixin):
      raise ValueError(f"from_linear: {linear!r}: {_uninitialized(linear)}")
    if not isinstance(linear._parameters.get("weight"), nn.Parameter):
      raise ValueError(f"from_linear: {_FORMED_WEIGHT}, so keep this layer "
                       "an nn.Linear")
    if type(linear) not in (nn.Linear, Linear):
      raise TypeError(f"from_linear: {_subclass(linear)}: keep it as it is "
                      "(convert() leaves it alike)")
    new = cls(linear.in_features, linear.out_features,
              bias=linear.bias is not None, device="meta",
              dtype=linear.weight.dtype, block_config=block_config)
    new.weight = linear.weight
    new.bias = linear.bias
    new.train(linear.training)
    _mark(new.weight)
    return new

  def extra_repr(self) -> str:
    return super().extra_repr() + f", fused={self.fused}"

  def __prepare_scriptable__(self):
    # torch.jit.script calls it first (and would put what it returns in
    # the model's place, in the caller's model too).
    raise RuntimeError(
        f"forge_torch.Linear {self._forge_path or self._layer_name()}: "
        "torch.jit.script cannot compile it (its backward, which applies "
        "the optimizer, is Python). For an inference graph use "
        "torch.jit.trace or torch.export, which record the layer as "
        "nn.Linear, or script a model built without forge_torch.convert "
        "that loads this one's state_dict.")

  def _layer_name(self) -> str:
    """Its module path (e.g. ``blocks.3.mlp.fc1``) once :func:`convert` has
    seen its model; else ``Linear(in, out)``."""
    path = self._forge_path
    if path is not None:
      return path if path else "(the converted model itself)"
    # Formed once per shape (every forward names its layer).
    n_in, n_out, name = self._forge_default_name
    if n_in != self.in_features or n_out != self.out_features:
      n_in, n_out = self.in_features, self.out_features
      name = f"Linear({n_in}, {n_out})"
      self._forge_default_name = (n_in, n_out, name)
    return name

  def forward(self, input: torch.Tensor) -> torch.Tensor:
    if _is_compiling():  # traced: torch.compile, torch.export
      if _exporting() or not (self.fused and _grad_enabled()):
        # An exported program is the standard layer (FORGE's update happens
        # in an eager backward, which no exported graph holds); so is a
        # compiled layer that trains nothing (no_grad, inference_mode,
        # fused = False): traced whole, as nn.Linear is.
        return F.linear(input, self.weight, self.bias)
      return _forward_eagerly(self, input)
    params = self._parameters
    try:  # what self.weight, self.bias find, without Module.__getattr__
      w, bias = params["weight"], params["bias"]
    except KeyError:  # not parameters (e.g. parametrized): as attributes
      w, bias = self.weight, self.bias
      if ("weight" not in params and not self._forge_formed_warned
          and self.fused and _grad_enabled()):
        self._warn_formed_weight()
    # (Under torch.jit.trace, the standard layer: its graph records torch's
    # ops, and its check reruns the forward without autograd, here too;
    # under an FX trace -- torch.fx.symbolic_trace, make_fx -- likewise: a
    # traced graph holds no FORGE update, and the trace counts no use.)
    if (not (self.fused and _grad_enabled()) or _jit_tracing() is not None
        or _fx_tracing()):
      return F.linear(input, w, bias)
    if self._is_fsdp_managed_module:
      # FSDP2 swapped in a gathered copy of the weight. Unprepared: refused
      # (it would silently train on the standard path). Prepared
      # (prepare_fsdp): torch's linear, whose weight gradient FSDP
      # reduce-scatters; the shard is updated from it as it arrives
      # (forge_torch/distributed.py).
      check_not_sharded(self, self._layer_name())
      return F.linear(input, w, bias)
    k = _map_key(w)
    # Not managed, inside a torch.func transform, or forward-mode AD (a dual
    # level entered: _has_tangent).
    if not (w.requires_grad and k in _FORGE_WEIGHT_KEYS) or (
        _PEEK_INTERPRETER is not None and _PEEK_INTERPRETER() is not None
        ) or (getattr(_forward_ad, "_current_level", 0) >= 0
              and _has_tangent(input, w, bias)):
      return F.linear(input, w, bias)
    layer = self._forge_path or self._layer_name()
    optimizer = owner_of(w)
    if optimizer is None:
      optimizer = _adopter(w, layer)
    if optimizer is None:
      raise RuntimeError(
          f"forge_torch.Linear {layer} ran with autograd on, but "
          "its weight is not registered in a forge_torch optimizer. FORGE "
          "updates the weight inside backward: to train it, build the "
          "optimizer first (e.g. forge_torch.AdamW(model.parameters())) "
          "over parameters that include this weight (after "
          "forge_torch.convert(), not before). To run it without training "
          "it -- e.g. a copy of a converted model (copy.deepcopy, "
          "torch.optim.swa_utils.AveragedModel), whose layers stay "
          "FORGE-managed and whose weights no optimizer holds -- run under "
          "torch.no_grad(), or set layer.fused = False on its "
          "forge_torch.Linear modules (the standard nn.Linear path).")
    check_no_grad_hooks(w, layer)
    amp = (None if _ANY_AUTOCAST is not None and (w.is_cuda or w.is_cpu)
           and not _ANY_AUTOCAST() else autocast_dtype(w.device.type))
    if amp is not None:
      if amp != torch.bfloat16:
        raise RuntimeError(
            f"forge_torch.Linear {layer}: torch.autocast with "
            f"dtype={amp} is not supported for FORGE-managed layers, only "
            "dtype=torch.bfloat16 (float16 training needs a GradScaler, "
            "which cannot unscale an update FORGE already applied in "
            "backward). Use torch.autocast(..., dtype=torch.bfloat16), or "
            "set layer.fused = False.")
      # What autocast's linear does: input and bias cast (differentiably:
      # their gradients come back in their own dtypes), the weight cast
      # inside the fused function, which updates the full-precision one.
      if _autocast_eligible(input):
        input = input.to(amp)
      if _autocast_eligible(bias):
        bias = bias.to(amp)
    # (Counted by the native host path where it is on and the forward is
    # a plain one; NotImplemented: the Python method decides.)
    native = _hot.before_forward
    generation = (NotImplemented if native is None
                  else native(optimizer, w, input, amp))
    try:
      if generation is NotImplemented:
        generation = optimizer._forge_before_forward(
            w, input, layer=layer, autocast_dtype=amp)
    except NotOwnedError:
      # Moved from that optimizer's groups to another's lists: registered
      # there (else refused as it was).
      adopter = _adopter(w, layer)
      if adopter is None:
        raise
      optimizer = adopter
      generation = optimizer._forge_before_forward(
          w, input, layer=layer, autocast_dtype=amp)
    # A graph dropped without a backward (a skipped batch, an exception
    # later in the forward) frees the handle: the forward stops counting
    # (_Handle.__del__).
    handle = _Handle(weakref.ref(optimizer), w, self.block_config, layer,
                     generation, amp)
    if _FUSED_APPLY is None or _TRANSFORMS_ACTIVE():
      return _FusedLinearFn.apply(input, w, bias, handle)
    return _FUSED_APPLY(_UNWRAP_IF_DEAD(input), _UNWRAP_IF_DEAD(w),
                        None if bias is None else _UNWRAP_IF_DEAD(bias),
                        handle)


# Run eagerly under torch.compile (a graph break around the layer): traced
# by Dynamo, the fused autograd.Function would be replaced by an ordinary
# linear, and the weight would get a .grad instead of FORGE's update.
# Dynamo reads torch.compiler.is_compiling() as True while it traces, so
# Linear.forward hands itself to this function, which Dynamo does not trace
# (it runs the forward again eagerly, where is_compiling() is False); an
# eager forward pays one flag read instead of a disable wrapper's frame
# switching on every call. torch._disable_dynamo is torch.compiler.disable
# applied at the first call (torch's own lazy form, in a module Dynamo
# never traces), so importing forge_torch does not import torch._dynamo
# (seconds). A torch without it (a private name) gets the eager decorator.
_is_compiling = torch.compiler.is_compiling
# torch.export (strict: Dynamo traces with both flags set; non-strict: the
# forward runs in Python with both set, where a hand-over to the eager
# forward would find them set again).
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _exporting() -> bool:
  """Whether torch.export is tracing the forward (strict or not). Read from
  torch.compiler's flag itself where it has one: Dynamo in some torch
  versions (2.11 among them) folds ``torch.compiler.is_exporting()`` to
  True in every trace, torch.compile's included, where the flag (a module
  attribute, which Dynamo reads as its value) is set only by torch.export."""
  flag = getattr(torch.compiler, "_is_exporting_flag", None)
  return _is_exporting() if flag is None else bool(flag)


_jit_tracing = torch._C._get_tracing_state  # noqa: SLF001  (None: not tracing)
# Whether an FX tracer (torch.fx.symbolic_trace, make_fx) is tracing: a
# thread-local flag in newer torch, read from the thread's dict (its
# getter's getattr of an unset flag raises and catches, ten times as
# slow, at every forward), a module global in older torch (not through
# is_fx_tracing(), which logs a warning).
_fx_trace = torch.fx._symbolic_trace  # noqa: SLF001
_FX_TLS = getattr(_fx_trace, "_is_fx_tracing_tls", None)


def _fx_tracing() -> bool:
  if _FX_TLS is not None:
    return _FX_TLS.__dict__.get("flag", False)
  return getattr(_fx_trace, "_is_fx_tracing_flag", False)


@getattr(torch, "_disable_dynamo", torch.compiler.disable)
def _forward_eagerly(layer: "Linear", input: torch.Tensor) -> torch.Tensor:
  if _is_compiling():  # a tracer other than Dynamo sets the flag: the
    # eager forward would hand itself back here; the standard layer instead
    return F.linear(input, layer.weight, layer.bias)
  return layer.forward(input)


@getattr(torch, "_disable_dynamo", torch.compiler.disable)
def _backward_eagerly(ctx, grad_output):
  # (Dynamo leaves this function to Python: is_compiling() is False in it.)
  return _FusedLinearFn.backward(ctx, grad_output)


class Converted(list):
  """What :func:`convert` returns: the qualified names of the modules it
  converted (a ``list[str]``), plus ``skipped``: a dict from the qualified
  name of each ``nn.Linear`` (or subclass) it left on the standard path to
  the reason, in plain words."""

  skipped: dict[str, str]

  def __init__(self, names=(), skipped=None):
    super().__init__(names)
    self.skipped = dict(skipped or {})


def _names(exclude) -> tuple[str, ...]:
  """``convert``'s ``exclude`` as a tuple of module names: one name, or an
  iterable of them (``None``: none)."""
  if exclude is None:
    return ()
  if isinstance(exclude, str):
    return (exclude,)
  if not isinstance(exclude, (bytes, bytearray)):
    try:
      names = tuple(exclude)
    except TypeError:
      names = None
    if names is not None and all(isinstance(n, str) for n in names):
      return names
  raise TypeError(
      "forge_torch.convert: exclude must be a module name (a str) or an "
      f"iterable of them, got {exclude!r:.80}")


def _excluded(name: str, exclude: tuple[str, ...]) -> str | None:
  """The entry of ``exclude`` that names module ``name`` or a parent of it."""
  for e in exclude:
    if name == e or name.startswith(e + ".") or e == "":  # "": the root
      return e
  return None


def _uninitialized(module: nn.Module) -> str:
  return (f"it is an uninitialized {type(module).__name__}: run one forward "
          "first (e.g. under torch.no_grad()), which makes it an nn.Linear")


# Why a layer whose weight is not its own Parameter cannot be managed.
_FORMED_WEIGHT = (
    "its weight is not a parameter of the model but is formed from others "
    "at each forward (torch.nn.utils.parametrize, weight_norm, "
    "spectral_norm or prune: their weight_g / weight_v / weight_orig); "
    "FORGE updates a weight Parameter in place")


def _subclass(module: nn.Module) -> str:
  return (f"its type is {type(module).__name__}, a subclass of nn.Linear "
          "whose forward may differ or whose weight may be read outside its "
          "forward (e.g. MultiheadAttention.out_proj); only exact nn.Linear "
          "is converted")


def _skip_reason(module: nn.Module, names_of: Mapping[int, list[str]]
                 ) -> str | None:
  """Why ``module`` (an ``nn.Linear`` or subclass) cannot be managed.
  ``names_of``: the model's parameter names by identity. (The weight is
  read only past the type check: a parametrized layer, e.g. under
  ``spectral_norm``, is a subclass whose ``weight`` runs its
  parametrization, a power iteration in training mode.)"""
  if isinstance(module, nn.modules.lazy.LazyModuleMixin):
    return f"{_uninitialized(module)}, then convert()"
  if type(module) is not nn.Linear and is_fully_sharded(module):
    return (f"fully_shard has sharded it already (its type is "
            f"{type(module).__name__}): convert the model before "
            "fully_shard, then call "
            "forge_torch.distributed.prepare_fsdp(model)")
  if not isinstance(module._parameters.get("weight"), nn.Parameter):
    return _FORMED_WEIGHT  # (parametrized: read without running it)
  if type(module) is not nn.Linear:
    return _subclass(module)
  w = module.weight
  names_of_weight = names_of.get(id(w), [])
  if not names_of_weight:
    return _FORMED_WEIGHT
  if len(names_of_weight) > 1:
    return (f"its weight appears {len(names_of_weight)} times in the model "
            f"({', '.join(names_of_weight)}): it is tied to another module, "
            "or the module is registered under several names; FORGE updates "
            "a weight in its one layer's backward, so it needs a weight read "
            "by one layer only")
  if w.dtype not in _bridge.SUPPORTED_DTYPES:
    return (f"its weight is {w.dtype}; FORGE-managed weights must be float32 "
            "or bfloat16 (cast the model, e.g. model.float(), before "
            "convert())")
  if w.numel() == 0:
    return "its weight is empty: there is nothing to update"
  if not w.is_contiguous():
    return ("its weight is not contiguous in memory (e.g. a transposed view "
            "assigned as the Parameter); the fused kernel updates a weight in "
            "place, row-major: make it contiguous (layer.weight = "
            "nn.Parameter(layer.weight.detach().contiguous())) before "
            "convert()")
  return None


def convert(model: nn.Module, *,
            block_config: pallas_kernels.BlockConfig | None = None,
            exclude: str | Iterable[str] = ()) -> Converted:
  """Turns every eligible ``nn.Linear`` of ``model`` into a ``forge_torch.Linear``.

  In place: each eligible module's class is switched to
  :class:`forge_torch.Linear` (same object, same Parameters, same hooks), so
  references held elsewhere stay valid. Build the optimizer *after* this.

  Eligible: modules whose type is exactly ``nn.Linear`` (subclasses, e.g.
  ``MultiheadAttention``'s ``out_proj`` whose weight is read by functional
  code, are left alone), with a non-empty float32 or bfloat16 weight that
  appears once in ``model.named_parameters(remove_duplicate=False)`` (not a
  weight that ``weight_norm``, ``spectral_norm`` or ``prune`` forms from
  other parameters), and not named by ``exclude``. A weight appearing more than once -- tied to an
  embedding, or one module registered under two names -- stays on the
  standard path: FORGE needs exactly one layer reading each weight per step.

  Every ``forge_torch.Linear`` of the model (converted now or before) is
  given its module path, by which forge_torch's errors and warnings name it;
  one whose weight appears more than once (a ``forge_torch.Linear`` used
  as a drop-in and tied to an embedding, or layers tied after an earlier
  ``convert``) is put on the standard path (``fused = False``) and reported
  among the skipped.

  Args:
    model: the model, changed in place (not itself an ``nn.Linear``).
    block_config: kernel tiling for the converted layers (``None``: chosen
      per shape).
    exclude: qualified module names (or one name; ``None``: none) to leave
      as ``nn.Linear``; a name also excludes the modules under it
      (``"head"`` excludes ``head.fc``). Use it for layers whose gradient
      you need, e.g. to clip.
      It stops conversion only: a layer that already is a
      ``forge_torch.Linear`` stays one (set its ``fused = False``).

  Returns:
    A :class:`Converted`: the list of the converted modules' qualified names,
    with ``.skipped``, a dict from each ``nn.Linear`` (or subclass) left on
    the standard path to the reason. Skipped layers other than the excluded
    ones are also reported by one :class:`ConvertSkipWarning`.

  Raises:
    ValueError: ``model`` is a bare ``nn.Linear``, or ``exclude`` names a
      module the model does not have.
    TypeError: ``block_config`` is not a ``BlockConfig``; ``exclude`` is
      neither a str nor an iterable of them.
  """
  if type(model) is nn.Linear:
    raise ValueError(
        "convert() replaces submodules in place; for a bare nn.Linear use "
        "forge_torch.Linear.from_linear(layer)")
  pallas_kernels.fused_wgrad.check_block_config(block_config,
                                                "forge_torch.convert")
  exclude = _names(exclude)
  modules = dict(model.named_modules())
  unknown = [e for e in exclude if e not in modules]
  if unknown:
    raise ValueError(
        f"forge_torch.convert: exclude names no module of the model: "
        f"{unknown}; use the names of model.named_modules() (e.g. 'head' or "
        "'blocks.3.mlp.fc1')")
  names_of = collections.defaultdict(list)
  for name, p in model.named_parameters(remove_duplicate=False):
    names_of[id(p)].append(name)
  converted, skipped, excluded = [], {}, set()
  for name, module in modules.items():
    if isinstance(module, Linear):  # already FORGE's: name it
      module._set_path(name)
      w = module._parameters.get("weight")
      shared = names_of.get(id(w), ())
      if (module.fused and len(shared) > 1 and is_forge_weight(w)
          and not is_fsdp_managed(module)):  # tied: the standard path
        module.fused = False
        skipped[name] = (
            f"a forge_torch.Linear whose weight appears {len(shared)} times "
            f"in the model ({', '.join(shared)}): tied to another module, or "
            "the module is registered under several names; FORGE needs a "
            "weight read by one layer only, so its fused is set to False "
            "(it trains with ordinary gradients)")
      continue
    if not isinstance(module, nn.Linear):
      continue
    e = _excluded(name, exclude)
    if e is not None:
      skipped[name] = f"excluded (exclude={e!r})"
      excluded.add(name)
      continue
    reason = _skip_reason(module, names_of)
    if reason is not None:
      skipped[name] = reason
      continue
    module.__class__ = Linear
    module.fused = True
    module.block_config = block_config
    _mark(module.weight)
    module._set_path(name)
    converted.append(name)
  reported = {n: r for n, r in skipped.items() if n not in excluded}
  if reported:
    warnings.warn(
        f"forge_torch.convert left {len(reported)} nn.Linear layer(s) on the "
        "standard path (they train with ordinary gradients, applied by "
        "optimizer.step()):\n" + "\n".join(
            f"  {n or '(model)'}: {r}" for n, r in reported.items()) +
        "\n(The returned list's .skipped holds these reasons; pass "
        "exclude=[...] to leave layers out on purpose.)",
        ConvertSkipWarning, stacklevel=2)
  if not (converted or skipped or any(isinstance(m, Linear)
                                      for m in modules.values())):
    warnings.warn(_nothing_converted(model, modules), ConvertSkipWarning,
                  stacklevel=2)
  return Converted(converted, skipped)


def _nothing_converted(model: nn.Module, modules: Mapping[str, nn.Module]
                       ) -> str:
  """Why a model holding no ``nn.Linear`` trains as it did: its layers of
  other types with a 2-d weight (e.g. transformers' ``Conv1D`` in GPT-2,
  which computes ``x @ W + b``) counted by type."""
  kinds = collections.Counter(
      type(m).__name__ for m in modules.values()
      if not isinstance(m, (nn.Linear, nn.Embedding, nn.EmbeddingBag))
      and getattr(m._parameters.get("weight"), "ndim", 0) == 2)
  found = (" It has layers of other types with a 2-d weight: " + ", ".join(
      f"{k} ({n})" for k, n in kinds.most_common()) + "; FORGE converts "
      "exact nn.Linear only (a layer computing x @ W + b can be replaced "
      "by a forge_torch.Linear by hand, its weight transposed)."
      if kinds else "")
  return (f"forge_torch.convert found no nn.Linear in this "
          f"{type(model).__name__}: nothing was converted, and the whole "
          f"model trains with ordinary gradients.{found}")


__all__ = ["ConvertSkipWarning", "Converted", "Linear", "convert",
           "is_forge_weight", "owner_of", "weight_name"]
