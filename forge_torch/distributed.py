"""FORGE-managed layers under ``torch.distributed`` data parallelism (DDP).

Under data parallelism every rank holds the whole weight and sees a shard of
the batch, so a rank's weight gradient ``G_r = grad_output_r^T input_r`` is
a partial sum over tokens. DDP averages the ranks' gradients before the
optimizer step; an update that is not linear in ``G`` (Adam's second moment
is quadratic in it) cannot be applied to the pieces. So a managed weight
cannot be updated from its rank's ``G_r`` alone, and DDP's own reducer cannot
reduce it either: FORGE never gives it a ``.grad``.

:func:`prepare_ddp` hands the managed weights' reduction to forge_torch.
Each managed layer is one reduction bucket. In the layer's backward:

1. the fused kernel forms ``G_r`` in fp32 in a buffer of the weight's shape
   (the kernel's state-only accumulation epilogue; with gradient
   accumulation, the step's earlier micro-batches are already summed there);
2. ``torch.distributed.all_reduce`` sums the buffer over the ranks and it is
   divided by the world size: DDP's averaged gradient;
3. the optimizer's update is applied to it (the same kernel with no token
   rows, stepping from the buffer alone), and the buffer is freed.

So the full gradient exists one layer at a time, never for the whole model
at once, and every rank applies the same update to the same weight. DDP
keeps reducing every other parameter (biases, norms, embeddings, layers left
as ``nn.Linear``), which ``optimizer.step()`` updates as usual.

Usage::

    forge_torch.convert(model)
    forge_torch.distributed.prepare_ddp(model)   # before DDP(...)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = forge_torch.AdamW(ddp.parameters(), lr=1e-3)

or ``ddp = forge_torch.distributed.wrap_ddp(model, **ddp_kwargs)``, which
does both. Without :func:`prepare_ddp`, building a forge_torch optimizer
over managed weights, or running their backward, in a process group of more
than one rank raises a ``RuntimeError`` saying so.

Fully sharded data parallelism with ``torch.distributed.fsdp.fully_shard``
(FSDP2) is :func:`prepare_fsdp`'s. Each managed weight is then a sharded
``DTensor``; FSDP gathers it for the layer's forward and backward and
reduce-scatters the gathered copy's gradient, so each rank receives the
averaged gradient of its own shard -- a complete gradient for the elements it
holds. The layer runs torch's linear (FSDP needs the gathered copy's
gradient), and a post-accumulate-grad hook on the sharded parameter applies
the optimizer's update to the rank's shard and its shard of the optimizer
state as soon as FSDP hands the gradient over (the same kernel with no token
rows, stepping from that gradient: the update DDP's path applies to its
averaged buffer), then drops the gradient. The full gradient exists only as
FSDP's per-layer transient; the optimizer state is sharded as the weight is
(``DTensor`` state of the weight's placements, as ``torch.optim`` creates
for a ``DTensor`` parameter, so ``state_dict()`` and
``torch.distributed.checkpoint`` treat it as FSDP2's own). Usage::

    forge_torch.convert(model)
    for block in model.blocks:
      fully_shard(block)
    fully_shard(model)
    forge_torch.distributed.prepare_fsdp(model)  # before the optimizer
    opt = forge_torch.AdamW(model.parameters(), lr=1e-3)

A managed layer that FSDP shards without :func:`prepare_fsdp`, or that
``FullyShardedDataParallel`` (FSDP1) shards, raises at its forward
(:func:`check_not_sharded`). ``docs/torch.md`` (Data parallelism) has the
details.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from typing import Any

import torch
from torch import nn

from forge_torch import linear as _linear

# Managed weight -> the process group (None: the default group) whose ranks
# average its gradient before each update. Set by prepare_ddp().
_GROUPS = _linear.WeakIdMap()
# Managed weight -> (its number among the weights its prepare_ddp call
# registered, from 1; their names in that order), where that call was given
# check_order=True: its reductions first check that every rank reduces the
# same layer.
_ORDER = _linear.WeakIdMap()
# fully_shard's sharded weight (a DTensor Parameter) -> weakref to its
# forge_torch.Linear. Set by prepare_fsdp().
_SHARDED = _linear.WeakIdMap()
# A prepared weight -> weak references to the DistributedDataParallel
# instances over it: those wrap_ddp built, and those a scan found at the
# first reduction of a weight it had not recorded (_wrapping).
_WRAPPERS = _linear.WeakIdMap()


def _ddps_over(weights) -> list:
  """The ``DistributedDataParallel`` instances alive whose module holds
  one of ``weights``. torch keeps no registry of them: one scan of the
  objects the garbage collector tracks (about 0.1 s in a process holding
  torch and jax), read without touching anything else (a dead weak proxy
  or a half-built DDP among them is passed over)."""
  ddp = nn.parallel.DistributedDataParallel
  ids = {id(p) for p in weights}
  found = []
  for o in gc.get_objects():
    if not issubclass(type(o), ddp):  # (type(): no attribute lookup)
      continue
    module = vars(o).get("_modules", {}).get("module")
    if module is not None and any(id(q) in ids
                                  for q in module.parameters()):
      found.append(o)
  return found


def _record_wrapper(ddp_module, weights) -> None:
  """Records ``ddp_module`` as a ``DistributedDataParallel`` over
  ``weights`` (:func:`wrap_ddp`: no scan needed)."""
  for p in weights:
    refs = [r for r in _WRAPPERS.get(p) or () if r() is not None]
    _WRAPPERS[p] = [*refs, weakref.ref(ddp_module)]


def _wrapping(p: torch.Tensor) -> list:
  """The ``DistributedDataParallel`` instances over prepared weight ``p``:
  recorded by :func:`wrap_ddp`, else found by one scan, for every prepared
  weight with none recorded (or only DDPs gone since), at the first
  reduction of such a weight. A DDP built over the model after that scan
  found one (a second DDP beside the first) or none (a step run on the
  bare model first) is not seen."""
  def unknown(q) -> bool:  # none recorded, or all those recorded gone
    refs = _WRAPPERS.get(q)
    return refs is None or (refs and all(r() is None for r in refs))

  if unknown(p):
    prepared = [q for q in _GROUPS.keys() if unknown(q)]
    found = _ddps_over(prepared)
    for q in prepared:
      _WRAPPERS[q] = [weakref.ref(d) for d in found
                      if any(r is q for r in d.module.parameters())]
  return [d for d in (r() for r in _WRAPPERS[p]) if d is not None]


def _refuse_join(p: torch.Tensor, layer: str) -> None:
  """Raises where a ``DistributedDataParallel`` over ``p`` runs under
  ``join()`` (uneven inputs): a rank out of inputs shadows DDP's own
  all-reduces only, so this weight's reduction would meet another
  collective (a crash, or under NCCL a hang)."""
  for d in _wrapping(p):
    if getattr(getattr(d, "_join_config", None), "enable", False):
      raise RuntimeError(
          f"forge_torch.Linear {layer}: DistributedDataParallel.join() "
          "(uneven inputs across ranks) is not supported for FORGE-managed "
          "weights: a rank that has run out of inputs shadows DDP's own "
          "all-reduces, not the reduction forge_torch runs in each managed "
          "layer's backward, so the ranks' collectives would no longer "
          "match (a crash or a hang). Give every rank the same number of "
          "batches (e.g. DistributedSampler(..., drop_last=True)), or keep "
          "these layers as nn.Linear (forge_torch.convert(model, "
          "exclude=[...])).")


def _dist():
  dist = torch.distributed
  if not dist.is_available():
    raise RuntimeError(
        "forge_torch.distributed: this torch build has no torch.distributed")
  return dist


def _managed_weights(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
  """``(qualified name, weight)`` of every FORGE-managed weight of
  ``module``, in ``named_parameters`` order."""
  return [(name, p) for name, p in module.named_parameters()
          if _linear.is_forge_weight(p)]


is_fsdp_managed = _linear.is_fsdp_managed
check_not_sharded = _linear.check_not_sharded


def prepare_ddp(module: nn.Module, process_group=None, *,
                broadcast: bool = True,
                check_order: bool = False) -> list[str]:
  """Lets ``module``'s FORGE-managed weights train under DDP.

  Call it on every rank, after :func:`forge_torch.convert` and before
  wrapping ``module`` in ``torch.nn.parallel.DistributedDataParallel``
  (and before building the forge_torch optimizer). It

  * registers the managed weights to be averaged over ``process_group``'s
    ranks by forge_torch, one layer at a time, inside each managed layer's
    backward, before the update (see the module docstring);
  * tells DDP to leave them alone
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``,
    added to any names already ignored): DDP's reducer expects a ``.grad``
    on every parameter it reduces, and FORGE forms none;
  * with ``broadcast`` (the default), copies the managed weights from the
    group's first rank to the others, as DDP does at construction for the
    parameters it manages (it skips ignored ones).

  A prepared layer run as ``nn.Linear`` in some step (``layer.fused =
  False``, a ``torch.func`` transform) gives its weight an ordinary
  ``.grad``, which DDP ignores: a post-accumulate-grad hook averages it
  over the ranks as soon as autograd has accumulated it (each backward's
  addition: the mean of a sum already averaged plus this backward's part
  is the sum's mean), so that whatever reads ``.grad`` before the step --
  ``clip_grad_norm_``, a ``torch.optim`` optimizer -- sees DDP's averaged
  gradient.

  Every rank must run each managed layer the same number of times per step
  (its backward joins a collective): DDP's ``find_unused_parameters=True``
  does not cover managed weights. That is not checked by default: a rank
  that reduces another managed layer of the same shape instead (experts
  routed differently per rank) averages the two silently. With
  ``check_order=True`` every reduction of a managed weight first checks,
  by one small collective and a host synchronisation, that every rank is
  reducing the same weight, and raises on every rank where they are not
  (a rank that skips the last managed layer reduced in the backward joins
  no such check, so the other ranks' check meets DDP's own all-reduce
  there: the backend's error or hang, not this one).
  ``model.no_sync()`` does not apply to
  them either: with ``optimizer.accumulate_steps = K`` they are reduced once
  per step, at the K-th micro-batch, which is what ``no_sync`` achieves for
  DDP's parameters.

  Args:
    module: the model (not yet wrapped), or a ``DistributedDataParallel``
      already built over a prepared model (then only checked: the other
      arguments left at their defaults).
    process_group: the group DDP reduces over (``None``: the default group,
      DDP's default). Pass DDP's ``process_group`` if you give it one.
    broadcast: copy the managed weights from the group's first rank.
    check_order: check at each managed weight's reduction that every rank
      reduces the same weight (a collective of two integers and a host
      synchronisation per managed layer and step: for finding a model
      whose ranks run different managed layers, not for every run).

  Returns:
    The qualified names of the managed weights, now reduced by forge_torch.

  Raises:
    RuntimeError: ``torch.distributed`` is not initialised; ``module`` is a
      ``DistributedDataParallel`` built before this was called on its
      module, or a module such a ``DistributedDataParallel`` wraps; a
      managed layer is sharded by FSDP. (Later, a managed weight's
      reduction inside ``ddp.join()`` raises on every rank.)
    TypeError: ``check_order`` or ``broadcast`` is not a bool;
      ``process_group`` is neither ``None`` nor a ``ProcessGroup``.
    ValueError: ``module`` is a ``DistributedDataParallel`` and
      ``check_order`` or ``process_group`` is given (they apply to the
      model's preparation, before wrapping).
  """
  if not isinstance(check_order, bool):
    raise TypeError(f"prepare_ddp: check_order must be True or False, got "
                    f"{check_order!r}")
  if not isinstance(broadcast, bool):
    raise TypeError(f"prepare_ddp: broadcast must be True or False, got "
                    f"{broadcast!r}")
  dist = _dist()
  if not dist.is_initialized():
    raise RuntimeError(
        "forge_torch.distributed.prepare_ddp: torch.distributed is not "
        "initialised; call torch.distributed.init_process_group(...) first")
  if process_group is not None and not isinstance(process_group,
                                                  dist.ProcessGroup):
    raise TypeError(
        "prepare_ddp: process_group must be a torch.distributed "
        "ProcessGroup (e.g. from torch.distributed.new_group(ranks)) or None "
        f"for the default group, got {type(process_group).__name__}")
  if isinstance(module, nn.parallel.DistributedDataParallel):
    if check_order or process_group is not None:
      raise ValueError(
          "forge_torch.distributed.prepare_ddp: given a "
          "DistributedDataParallel, it only checks that its model was "
          "prepared, so check_order and process_group would not apply. "
          "Pass them to prepare_ddp(model) (or wrap_ddp(model, ...)) on the "
          "model before wrapping it.")
    inner = module.module
    missing = [name for name, p in _managed_weights(inner)
               if not set(_ddp_names([name])) <= module.parameters_to_ignore
               or p not in _GROUPS]
    if missing:
      raise RuntimeError(
          "forge_torch.distributed.prepare_ddp was called on a "
          "DistributedDataParallel built before the FORGE-managed weights "
          f"were prepared ({', '.join(missing)}): DDP would expect gradients "
          "FORGE never forms. Call prepare_ddp(model) on the model before "
          "wrapping it, then build DistributedDataParallel(model) (or use "
          "forge_torch.distributed.wrap_ddp(model)).")
    return [name for name, _ in _managed_weights(inner)]
  for mod_name, layer in module.named_modules():
    if (isinstance(layer, _linear.Linear)
        and _linear.is_prepared_sharded(layer)):
      raise RuntimeError(
          f"forge_torch.Linear {mod_name or type(module).__name__}: "
          "forge_torch.distributed.prepare_fsdp prepared it for fully_shard; "
          "a layer is trained by one of FSDP and DDP, not both.")
    if isinstance(layer, _linear.Linear) and layer.fused:
      check_not_sharded(layer, mod_name or type(module).__name__)
  weights = _managed_weights(module)
  names = [name for name, _ in weights]
  ignored_by = [vars(d).get("parameters_to_ignore")
                for d in _ddps_over([p for _, p in weights])]
  if any(i is not None and not set(_ddp_names(names)) <= set(i)
         for i in ignored_by):  # (None: a DDP whose construction failed)
    raise RuntimeError(
        "forge_torch.distributed.prepare_ddp(model) was called after "
        "DistributedDataParallel(model) was built: that DDP reduces the "
        "FORGE-managed weights itself (a full-size .grad of each, "
        "all-reduced every step, which FORGE never needs) and cannot be "
        "told to leave them alone once built. Call prepare_ddp(model) "
        "before DistributedDataParallel(model), or build it with "
        "forge_torch.distributed.wrap_ddp(model, ...); then build the "
        "optimizer.")
  for number, (_, p) in enumerate(weights, 1):
    if p not in _GROUPS:  # once per weight
      _register_grad_hook(p, _unfused_grad_ready)
    _GROUPS[p] = process_group
    if check_order:
      _ORDER[p] = (number, names)
    else:
      _ORDER.pop(p, None)
  # DDP names a parameter of the module it wraps ".weight" in some of its
  # checks and "weight" in others; a nested one is "fc.weight" in both.
  ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
  ddp = nn.parallel.DistributedDataParallel
  ddp._set_params_and_buffers_to_ignore_for_model(
      module, ignored + [n for n in _ddp_names(names) if n not in ignored])
  if broadcast and weights:
    src = (0 if process_group is None
           else dist.get_global_rank(process_group, 0))
    with torch.no_grad():
      for _, p in weights:
        dist.broadcast(p.data, src=src, group=process_group)
  return names


def _ddp_names(names: list[str]) -> list[str]:
  """The names under which DDP looks up the parameters ``names`` in its
  ignore list: a parameter of the wrapped module itself is ``"weight"`` to
  some of DDP's checks and ``".weight"`` to others."""
  return [m for n in names for m in ((n,) if "." in n else (n, "." + n))]


def _register_grad_hook(p: torch.Tensor, hook) -> None:
  """``p.register_post_accumulate_grad_hook(hook)``, also for a weight
  frozen now (``requires_grad=False``), which torch refuses to hook: the
  hook is registered with ``requires_grad`` on for the moment, so it is in
  place if the weight is unfrozen later."""
  if p.requires_grad:
    p.register_post_accumulate_grad_hook(hook)
    return
  p.requires_grad_(True)
  try:
    p.register_post_accumulate_grad_hook(hook)
  finally:
    p.requires_grad_(False)


def _ddp_arguments(module: nn.Module, args: tuple, kwargs: dict) -> dict:
  """``DistributedDataParallel(module, *args, **kwargs)``'s arguments by
  name. Raises ``TypeError`` as DDP would for arguments it does not take."""
  signature = inspect.signature(nn.parallel.DistributedDataParallel.__init__)
  return signature.bind_partial(None, module, *args, **kwargs).arguments


def _group_of(arguments: dict):
  """The process group DDP reduces over given ``arguments``: its
  ``process_group`` or its ``device_mesh``'s group (``None``: the default
  group)."""
  mesh = arguments.get("device_mesh")
  if mesh is not None:
    return mesh.get_group()
  return arguments.get("process_group")


def _ddp_process_group(module: nn.Module, args: tuple, kwargs: dict):
  """The process group that ``DistributedDataParallel(module, *args,
  **kwargs)`` would reduce over: its ``process_group``, by keyword or by
  position, or its ``device_mesh``'s group (``None``: the default group).
  Raises ``TypeError`` as DDP would for arguments it does not take."""
  return _group_of(_ddp_arguments(module, args, kwargs))


def wrap_ddp(module: nn.Module, *args: Any, check_order: bool = False,
             **kwargs: Any) -> nn.parallel.DistributedDataParallel:
  """``torch.nn.parallel.DistributedDataParallel(module, *args, **kwargs)``
  after :func:`prepare_ddp` over the group DDP reduces over (its
  ``process_group``, by keyword or by position, or its ``device_mesh``'s
  group; none: the default group). The managed weights are copied from the
  group's first rank unless DDP is given ``init_sync=False``, which skips
  its own copy of the other parameters. ``check_order``: as
  :func:`prepare_ddp`'s."""
  arguments = _ddp_arguments(module, args, kwargs)
  prepare_ddp(module, _group_of(arguments),
              broadcast=bool(arguments.get("init_sync", True)),
              check_order=check_order)
  wrapped = nn.parallel.DistributedDataParallel(module, *args, **kwargs)
  _record_wrapper(wrapped, [p for _, p in _managed_weights(module)])
  return wrapped


def prepare_fsdp(module: nn.Module) -> list[str]:
  """Lets ``module``'s FORGE-managed layers train under ``fully_shard``
  (FSDP2).

  Call it on every rank after :func:`forge_torch.convert` and after
  ``torch.distributed.fsdp.fully_shard`` has sharded the model (per layer or
  block and on the root, as FSDP2 is used), and before building the
  forge_torch optimizer over ``module.parameters()`` (the sharded ones). For
  each ``forge_torch.Linear`` that FSDP shards it

  * marks the sharded weight (a ``DTensor`` parameter) as FORGE-managed, so
    the optimizer registers it;
  * registers a post-accumulate-grad hook on it, which FSDP calls when it
    has reduce-scattered the weight's gradient into the shard's ``.grad``:
    the hook applies the optimizer's update to this rank's shard and its
    shard of the optimizer state, then sets ``.grad`` to ``None``.

  The layer itself then runs ``torch.nn.functional.linear`` (FSDP needs the
  gathered weight's gradient to reduce-scatter it). With
  ``optimizer.accumulate_steps = K > 1`` the sharded gradients are left to
  sum over the micro-batches (FSDP adds each micro-batch's into ``.grad``,
  or defers the reduce-scatter under ``set_requires_gradient_sync(False)``)
  and ``optimizer.step()`` applies the update from them. A prepared layer
  with ``fused = False`` keeps its gradient for ``optimizer.step()``, which
  applies torch's own update. With no forge_torch optimizer owning the
  weight (e.g. a ``torch.optim`` optimizer), the hook does nothing.

  Args:
    module: the model, sharded with ``fully_shard``.

  Returns:
    The qualified names of the sharded managed weights.

  Raises:
    RuntimeError: ``torch.distributed`` is not initialised; no
      ``forge_torch.Linear`` of ``module`` is sharded by ``fully_shard``
      (called before ``fully_shard``, or ``fully_shard`` before
      ``convert``: said so); a layer is sharded by
      ``FullyShardedDataParallel`` (FSDP1), whose flat parameters are not
      supported; a forge_torch optimizer built before this call holds a
      sharded weight as an ordinary parameter.
  """
  dist = _dist()
  if not dist.is_initialized():
    raise RuntimeError(
        "forge_torch.distributed.prepare_fsdp: torch.distributed is not "
        "initialised; call torch.distributed.init_process_group(...) first")
  from torch.distributed.tensor import DTensor  # noqa: PLC0415
  layers = []
  for mod_name, layer in module.named_modules():
    if not (isinstance(layer, _linear.Linear)
            and _linear.is_fsdp_managed(layer)):
      continue
    w = layer.weight
    label = mod_name or type(module).__name__
    if not isinstance(w, DTensor):
      raise RuntimeError(
          f"forge_torch.Linear {label}: FSDP manages it but its weight is "
          f"not a fully_shard DTensor ({type(w).__name__}): "
          "FullyShardedDataParallel (FSDP1) flattens parameters, which "
          "forge_torch does not support. Shard the model with "
          "torch.distributed.fsdp.fully_shard (FSDP2), or keep these layers "
          "as nn.Linear (layer.fused = False).")
    if w.numel() == 0:
      continue
    layers.append((mod_name, layer, w))
  _refuse_an_earlier_optimizer(
      [(mod_name or type(module).__name__, w) for mod_name, _, w in layers])
  names = []
  for mod_name, layer, w in layers:
    if getattr(layer, "_forge_path", None) is None:
      layer._set_path(mod_name)
    else:
      layer._set_path(layer._forge_path)
    if w not in _SHARDED:  # once per sharded parameter
      _register_grad_hook(w, _sharded_grad_ready)
    _linear._mark(w)
    _SHARDED[w] = weakref.ref(layer)
    layer._forge_sharded = True
    names.append(f"{mod_name}.weight" if mod_name else "weight")
  if not names:
    early = [mod_name or type(module).__name__
             for mod_name, layer in module.named_modules()
             if isinstance(layer, nn.Linear)
             and not isinstance(layer, _linear.Linear)
             and _linear.is_fully_sharded(layer)]
    if early:
      raise RuntimeError(
          "forge_torch.distributed.prepare_fsdp: no forge_torch.Linear of "
          "the model is sharded, but fully_shard has sharded nn.Linear "
          f"layers ({', '.join(early[:8])}{', ...' if len(early) > 8 else ''})"
          ", which forge_torch.convert cannot take once sharded: fully_shard "
          "ran before convert. Call forge_torch.convert(model) first, then "
          "fully_shard(...), then prepare_fsdp(model).")
    raise RuntimeError(
        "forge_torch.distributed.prepare_fsdp: no forge_torch.Linear of the "
        "model is sharded by torch.distributed.fsdp.fully_shard. Call it "
        "after forge_torch.convert(model) and after fully_shard(...) (per "
        "layer or block, and on the root).")
  return names


def _refuse_an_earlier_optimizer(weights) -> None:
  """Refuses to mark the sharded weights ``weights`` (``(label, weight)``
  pairs) as FORGE-managed where a live forge_torch optimizer holds one
  already as an ordinary parameter (built before :func:`prepare_fsdp`):
  that optimizer would never take it over, and the layer would train
  unfused, with no sign of it."""
  held = {}  # id of a parameter an optimizer holds unmanaged -> its name
  for optimizer in list(_linear._OPTIMIZERS):
    managed = getattr(optimizer, "_forge_managed", ())
    for group in optimizer.param_groups:
      for q in group["params"]:
        if q not in managed:  # (prepared again: it manages the weight)
          held.setdefault(id(q), type(optimizer).__name__)
  for label, w in weights:
    name = held.get(id(w))
    if name is not None:
      raise RuntimeError(
          f"forge_torch.Linear {label}: a forge_torch.{name} built before "
          "prepare_fsdp holds its sharded weight as an ordinary parameter, "
          "so the layer would train unfused (torch's gradient and update) "
          "with no sign of it. Call "
          "forge_torch.distributed.prepare_fsdp(model) after fully_shard "
          "and before building the optimizer.")


def is_sharded(p: torch.Tensor) -> bool:
  """Whether managed weight ``p`` is a ``fully_shard`` shard registered by
  :func:`prepare_fsdp`."""
  return p in _SHARDED


def _sharded_grad_ready(p: torch.Tensor) -> None:
  """The post-accumulate-grad hook of a prepared sharded weight: FSDP has
  reduce-scattered (and averaged) its gradient into ``p.grad``."""
  ref = _SHARDED.get(p)
  layer = ref() if ref is not None else None
  if layer is None or not layer.fused:  # the standard path: step() applies
    return
  optimizer = _linear.owner_of(p)
  if optimizer is None or optimizer.accumulate_steps > 1:
    return  # a torch optimizer's, or summing micro-batches: step() applies
  step_shard(optimizer, p)


def step_shard(optimizer, p: torch.Tensor) -> None:
  """The optimizer's update of sharded managed weight ``p`` (registered by
  :func:`prepare_fsdp`) from its reduce-scattered gradient ``p.grad``, on
  this rank's shard of the weight and of the state; ``p.grad`` is then
  dropped."""
  layer = _linear.weight_name(p)
  if optimizer.max_grad_norm is not None:
    raise RuntimeError(_clip_refused(layer, "fully_shard", "prepare_fsdp"))
  if p in optimizer._forge_updated:
    raise RuntimeError(
        f"forge_torch.Linear {layer}: FSDP reduce-scattered a second "
        "gradient into this weight after its update in this step (two "
        "backwards before optimizer.step()?). FORGE applies one update per "
        "step: call optimizer.step() after each backward, or, to accumulate "
        "micro-batches, set optimizer.accumulate_steps = K.")
  grad = p.grad
  with torch.no_grad():
    acc = local(grad)
    if acc.dtype != torch.float32 or not acc.is_contiguous():
      acc = acc.to(torch.float32, memory_format=torch.contiguous_format)
    n_out, n_in = local(p).shape
    none = (torch.zeros((0, n_out), dtype=torch.float32, device=acc.device),
            torch.zeros((0, n_in), dtype=torch.float32, device=acc.device))
    optimizer._forge_step_weight(p, *none, config=None, layer=layer, acc=acc)
  p.grad = None


def step_sharded(optimizer) -> None:
  """Applies, from ``step()``, the update of every sharded managed weight
  that has a reduce-scattered gradient not yet applied (gradient
  accumulation: the step's micro-batches summed by FSDP in ``.grad``).
  A no-op for others and for layers with ``fused = False``."""
  for p in list(_pending_shards(optimizer)):
    step_shard(optimizer, p)


def holds_sharded_grad(optimizer) -> bool:
  """Whether a prepared sharded weight of ``optimizer`` holds a gradient
  its update has not applied yet (micro-batches FSDP summed,
  ``accumulate_steps > 1``): what :func:`step_sharded` would apply. (A
  layer run with ``fused = False`` keeps torch's ``.grad`` after
  ``step()``: not one.)"""
  return next(_pending_shards(optimizer), None) is not None


def _pending_shards(optimizer):
  """The prepared sharded weights of ``optimizer`` whose layer is fused
  and whose reduce-scattered gradient its update has not applied yet."""
  if not _SHARDED._values:  # (no sharded weight: the usual case)
    return
  for p in optimizer.managed_params:
    ref = _SHARDED.get(p)
    layer = ref() if ref is not None else None
    if (layer is not None and layer.fused and p.grad is not None
        and p not in optimizer._forge_updated):
      yield p


def local(t: torch.Tensor) -> torch.Tensor:
  """This rank's shard of ``t`` (a ``DTensor``: its local tensor, sharing
  its memory), or ``t`` itself."""
  to_local = getattr(t, "to_local", None)
  if to_local is None:
    return t
  with torch.no_grad():
    return to_local()


def any_registered() -> bool:
  """Whether :func:`prepare_ddp` or :func:`prepare_fsdp` registered any
  weight (alive) in this process."""
  return bool(_GROUPS._values or _SHARDED._values)


def is_data_parallel(p: torch.Tensor) -> bool:
  """Whether managed weight ``p`` was registered by :func:`prepare_ddp`."""
  return p in _GROUPS


def _all_reduce_mean(buffer: torch.Tensor, p: torch.Tensor,
                     layer: str) -> None:
  """``buffer`` <- its mean over ``p``'s group (in place)."""
  dist = _dist()
  if not dist.is_initialized():
    raise RuntimeError(
        f"forge_torch.Linear {layer}: its weight was prepared for data "
        "parallelism (forge_torch.distributed.prepare_ddp) but "
        "torch.distributed is no longer initialised")
  _refuse_join(p, layer)
  group = _GROUPS[p]
  order = _ORDER.get(p)
  if order is not None:
    _check_same_weight(dist, order, group, buffer.device, layer)
  dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
  world = dist.get_world_size(group)
  if world > 1:
    buffer.div_(world)


def _check_same_weight(dist, order, group, device, layer: str) -> None:
  """Raises on every rank of ``group`` unless all of them are reducing the
  weight numbered ``order[0]`` now (``prepare_ddp(..., check_order=True)``):
  the least and the greatest number over the ranks, by one collective."""
  number, names = order
  t = torch.tensor([number, -number], dtype=torch.int64, device=device)
  dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
  high, low = t[0].item(), -t[1].item()
  if high == low:
    return
  other = high if high != number else low

  def named(n: int) -> str:
    return (f"{names[n - 1]} (number {n})" if 1 <= n <= len(names)
            else f"number {n}")

  raise RuntimeError(
      f"forge_torch.Linear {layer}: the ranks are reducing different "
      f"managed weights (prepare_ddp(..., check_order=True)): this rank "
      f"{named(number)}, another {named(other)}, of the {len(names)} "
      "prepared in order. Every rank must run each managed layer the same "
      "number of times per step, in the same order: its backward joins a "
      "collective. Keep a layer that some ranks skip or route around "
      "(experts chosen per rank) as nn.Linear "
      "(forge_torch.convert(model, exclude=[...])).")


def _forget_view(optimizer, p: torch.Tensor, buffer: torch.Tensor) -> None:
  # The collective rewrote the buffer outside JAX: the next kernel call
  # imports it afresh (its import orders the kernel after the collective on
  # torch's stream) instead of reusing the view from the call that formed it.
  views = optimizer._forge_views.get(p)
  if views is not None:
    views.discard(buffer)


def reduce_and_step(optimizer, p: torch.Tensor, grad_output: torch.Tensor,
                    input: torch.Tensor, *, config, layer: str) -> None:
  """The data-parallel update of managed weight ``p`` (registered by
  :func:`prepare_ddp`) from this rank's ``G_r = grad_output^T input``:
  ``G_r`` (plus the step's earlier micro-batches) into the weight's fp32
  buffer; on the step's last micro-batch, the buffer averaged over the
  ranks and the optimizer's update applied to it (the buffer is then freed).
  Called by the forge_torch optimizer from the layer's backward."""
  if optimizer.max_grad_norm is not None:
    raise RuntimeError(_clip_refused(layer, "data parallelism",
                                     "prepare_ddp"))
  k = optimizer.accumulate_steps
  n = optimizer._forge_micro.get(p, 0) + 1
  optimizer._forge_accumulate(p, grad_output, input, config=config,
                              first=n == 1)
  if n < k:  # not the step's last micro-batch: keep summing locally
    optimizer._forge_micro[p] = n
    return
  buffer = optimizer._forge_acc[p]
  _forget_view(optimizer, p, buffer)
  _all_reduce_mean(buffer, p, layer)
  optimizer._forge_step_weight(p, *_no_rows(p), config=None, layer=layer,
                               acc=buffer)


def reduce_accumulated(optimizer, p: torch.Tensor, buffer: torch.Tensor
                       ) -> None:
  """Averages the accumulated buffer of data-parallel weight ``p`` over the
  ranks before ``optimizer.step()`` applies it (a step that got fewer than
  ``accumulate_steps`` micro-batches). A no-op for other weights."""
  if p in _GROUPS:
    _forget_view(optimizer, p, buffer)
    _all_reduce_mean(buffer, p, _linear.weight_name(p))


def _unfused_grad_ready(p: torch.Tensor) -> None:
  """The post-accumulate-grad hook of a weight :func:`prepare_ddp`
  registered: its layer ran as ``nn.Linear`` (``layer.fused = False``, a
  ``torch.func`` transform), so autograd accumulated an ordinary gradient
  into ``p.grad``, which DDP ignores: averaged over the ranks now (in
  backward order, the same on every rank)."""
  if p not in _GROUPS or p.grad is None:
    return
  layer = _linear.weight_name(p)
  optimizer = _linear.owner_of(p)
  if optimizer is not None and optimizer.max_grad_norm is not None:
    raise RuntimeError(_clip_refused(layer, "data parallelism",
                                     "prepare_ddp"))
  with torch.no_grad():
    _all_reduce_mean(p.grad, p, layer)


_unfused_grad_ready.forge_own = True  # (not a user's hook: linear.py)


def _clip_refused(layer: str, how: str, prepare: str) -> str:
  return (
      f"forge_torch.Linear {layer}: max_grad_norm (global-norm clipping) is "
      f"not supported with {how} (forge_torch.distributed.{prepare}) yet: "
      "the norm must be taken over the ranks' averaged gradients of the "
      "whole model before any update. Set max_grad_norm=None, or keep the "
      "layers to clip as nn.Linear.")


def _no_rows(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
  """``(grad_output, input)`` with no token rows: ``G = 0``, so the kernel
  steps from the buffer alone."""
  n_out, n_in = p.shape
  return (torch.zeros((0, n_out), dtype=torch.float32, device=p.device),
          torch.zeros((0, n_in), dtype=torch.float32, device=p.device))


def check_single_process(params=()) -> None:
  """Refuses managed weights in a process group of more than one rank unless
  :func:`prepare_ddp` or :func:`prepare_fsdp` registered them (``params``:
  the weights to check; none given: refuses whenever there is more than one
  rank)."""
  dist = torch.distributed
  if not (dist.is_available() and dist.is_initialized()):
    return
  world = dist.get_world_size()
  if world <= 1:
    return
  params = list(params)
  if params and all(p in _GROUPS or p in _SHARDED for p in params):
    return
  raise RuntimeError(
      f"forge_torch: this process is one of {world} (torch.distributed). "
      "Data-parallel training must average each weight's gradient across "
      "ranks before the update; a FORGE-managed weight is updated inside its "
      "layer's backward, from this rank's gradient alone unless forge_torch "
      "reduces it, so the replicas would drift apart. Under "
      "DistributedDataParallel call forge_torch.distributed.prepare_ddp(model) "
      "after forge_torch.convert() and before wrapping the model in DDP and "
      "building the optimizer (or use forge_torch.distributed.wrap_ddp); "
      "under fully_shard (FSDP2) call forge_torch.distributed.prepare_fsdp("
      "model) after fully_shard(...) and before building the optimizer.")


__all__ = ["any_registered", "check_not_sharded", "check_single_process",
           "is_data_parallel", "is_fsdp_managed", "is_sharded", "local",
           "prepare_ddp", "prepare_fsdp", "reduce_accumulated",
           "reduce_and_step", "step_shard", "step_sharded",
           "wrap_ddp"]
