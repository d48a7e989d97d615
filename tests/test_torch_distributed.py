"""forge_torch under torch's DistributedDataParallel and FSDP2's fully_shard:
two and four CPU ranks (gloo) against single-process torch.optim.AdamW on
the full batch, a weight tied across two managed layers under fully_shard,
and the misuses that must be refused (DDP without
forge_torch.distributed.prepare_ddp, fully_shard without prepare_fsdp,
global-norm clipping, a managed weight read twice under DDP, a tied weight
split across FSDP groups, ranks reducing different managed layers under
``prepare_ddp(check_order=True)``).

The ranks run once per test session and world size, rank 0 in the test
process and the others in child processes (``torch.multiprocessing``),
rendezvousing through a file store; the tests assert on what they report
(the kernels run in Pallas interpret mode and compile in every process, so
the ranks run everything in one go).
"""

import contextlib
import copy
import datetime
import fcntl
import gc
import os
import traceback
import warnings
import weakref

import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from torch import nn  # noqa: E402
from torch import multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint import state_dict as dcp_state  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import forge_torch  # noqa: E402
from forge_torch import distributed as forge_dist  # noqa: E402
from tests.tolerances import tol  # noqa: E402

# FSDP2 warns that a module returned a view (a linear's output on 3-d
# input): a caveat about in-place ops on the output, which these models
# never make.
pytestmark = pytest.mark.filterwarnings(
    "ignore:FSDP2-wrapped module.*returned a view tensor:UserWarning")

FP32 = tol(jnp.float32)
# The world sizes run: two ranks run every case; four ranks the plain DDP and
# fully_shard ones (D = 13 rows shard 4 + 4 + 4 + 1 under FSDP2).
WORLD = 2
WIDE_WORLD = 4
# Odd sizes; both managed layers are D x D and every micro-batch has the same
# 2 x 3 token rows per rank, so each process compiles two kernels only (the
# gradient into its buffer; the update from the averaged buffer).
D, OUT, ROWS, SEQ = 13, 5, 2, 3
LR, WD = 2e-2, 0.1
# A rank waits this long for the others at a collective before failing.
TIMEOUT_S = 120
# Micro-batches per step: DDP alone (accumulate_steps=1), then with
# accumulate_steps=2, whose last step is cut short (one micro-batch: step()
# reduces and applies the buffer).
PLAIN = [1, 1, 1]
ACCUMULATED = [2, 2, 1]


class Net(nn.Module):
  """fc1, fc2: FORGE-managed; norm, head and the biases: DDP's. ``tied``:
  fc2 reads fc1's weight (one Parameter, two layers)."""

  def __init__(self, tied: bool = False):
    super().__init__()
    self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)
    if tied:
      self.fc2.weight = self.fc1.weight
    self.norm = nn.LayerNorm(D)
    self.head = nn.Linear(D, OUT)

  def forward(self, x):
    return self.head(self.norm(self.fc2(F.gelu(self.fc1(x)))))


def make_net(tied: bool = False) -> Net:
  torch.manual_seed(0)
  return Net(tied)


def converted(net: nn.Module) -> nn.Module:
  model = copy.deepcopy(net)
  assert forge_torch.convert(model, exclude="head") == ["fc1", "fc2"]
  return model


def tied_after_convert() -> nn.Module:
  """The converted net with fc2 reading fc1's managed weight (tied after
  forge_torch.convert, which leaves weights tied before it on the standard
  path)."""
  model = converted(make_net())
  model.fc2.weight = model.fc1.weight
  return model


def batches(micro_batches, seed, world=WORLD):
  """``[step][micro-batch][rank] -> (x, y)``: every rank its own data."""
  g = torch.Generator().manual_seed(seed)
  return [[[(torch.randn(ROWS, SEQ, D, generator=g),
             torch.randn(ROWS, SEQ, OUT, generator=g))
            for _ in range(world)] for _ in range(k)] for k in micro_batches]


def managed_names(model: nn.Module, opt) -> list[str]:
  """The names of the optimizer's managed weights (a tied one once)."""
  return [n for n, p in model.named_parameters()
          if any(p is q for q in opt.managed_params)]


def rel(a, b) -> float:
  a, b = a.detach().double(), b.detach().double()
  d = b.norm().item()
  return (a - b).norm().item() / (d if d > 0 else 1.0)


# --- what each rank runs ------------------------------------------------------


def _error(fn, kinds=RuntimeError) -> str:
  """The message of the error of ``kinds`` ``fn()`` raises ('' if none)."""
  try:
    fn()
  except kinds as e:
    return str(e)
  return ""


def _misuses(rank: int) -> dict:
  net = make_net()
  found = {}
  # DDP over managed layers without prepare_ddp: the optimizer refuses.
  model = converted(net)
  ddp = nn.parallel.DistributedDataParallel(model)
  found["no_prepare"] = _error(lambda: forge_torch.AdamW(ddp.parameters()))
  # prepare_ddp after DDP was built (DDP already expects those gradients),
  # given the DDP or the model it wraps.
  found["late_prepare"] = _error(lambda: forge_dist.prepare_ddp(ddp))
  found["late_prepare_model"] = _error(lambda: forge_dist.prepare_ddp(model))
  found["late_prepare_left"] = forge_dist.is_data_parallel(model.fc1.weight)
  del ddp
  # Global-norm clipping: the norm would be this rank's, not the average's.
  model = converted(net)
  ddp = forge_dist.wrap_ddp(model)
  found["checked"] = forge_dist.prepare_ddp(ddp)  # built in order: accepted
  found["prepared_again"] = forge_dist.prepare_ddp(model)  # in order too
  opt = forge_torch.AdamW(ddp.parameters(), max_grad_norm=1.0)
  x, y = batches([1], seed=9)[0][0][rank]
  found["clip"] = _error(lambda: opt.step(
      lambda: F.mse_loss(ddp(x), y).backward()))
  # The scan for DDPs (prepare_ddp; a weight's first reduction under a DDP
  # the user built) passes over what it cannot read: a dead weak proxy
  # here. One scan serves every prepared weight (not one per weight), and
  # wrap_ddp's DDP needs none.
  class Gone:
    pass

  gone = Gone()
  dead = weakref.proxy(gone)
  del gone
  scans = []
  scan = forge_dist._ddps_over  # noqa: SLF001

  def counted(weights):
    scans.append(len(weights))
    return scan(weights)

  forge_dist._ddps_over = counted  # noqa: SLF001
  try:
    model = converted(net)
    found["scan_prepared"] = forge_dist.prepare_ddp(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    scan_opt = forge_torch.AdamW(ddp.parameters())
    F.mse_loss(ddp(x), y).backward()
    found["scans_user"] = list(scans)
    scans.clear()
    model = converted(net)
    ddp = forge_dist.wrap_ddp(model)
    scan_opt = forge_torch.AdamW(ddp.parameters())
    F.mse_loss(ddp(x), y).backward()
    found["scans_wrap_ddp"] = list(scans)
  finally:
    forge_dist._ddps_over = scan  # noqa: SLF001
  del dead, scan_opt, ddp
  # DDP's join() (uneven inputs): a rank out of inputs would shadow DDP's
  # all-reduces only; refused on every rank at the first managed reduction
  # inside it (the DDP built by the user after prepare_ddp, or by wrap_ddp).
  for how in ("user", "wrap_ddp"):
    model = converted(net)
    if how == "user":
      forge_dist.prepare_ddp(model)
      ddp = nn.parallel.DistributedDataParallel(model)
    else:
      ddp = forge_dist.wrap_ddp(model)
    join_opt = forge_torch.AdamW(ddp.parameters())
    with ddp.join():
      found[f"join_{how}"] = _error(
          lambda: F.mse_loss(ddp(x), y).backward())
    del join_opt, ddp
  # FSDP2 shards the managed layers without prepare_fsdp: refused at the
  # forward; prepare_fsdp before fully_shard: nothing to prepare.
  model = converted(net)
  found["fsdp_early"] = _error(lambda: forge_dist.prepare_fsdp(model))
  fully_shard(model)
  forge_torch.AdamW(model.parameters())  # sharded weights: not managed
  found["fsdp"] = _error(lambda: model(x))
  # Prepared, global-norm clipping is refused as the gradient arrives
  # (a backward outside opt.step(closure), which refuses it up front).
  model = converted(net)
  fully_shard(model)
  forge_dist.prepare_fsdp(model)
  opt = forge_torch.AdamW(model.parameters(), max_grad_norm=1.0)
  found["fsdp_clip"] = _error(lambda: F.mse_loss(model(x), y).backward())
  # accumulate_steps changed in the middle of a step under fully_shard,
  # whose forwards are torch's (not counted): refused as without it, once
  # a micro-batch's gradient is held or the update applied; between steps
  # accepted.
  model = converted(net)
  fully_shard(model)
  forge_dist.prepare_fsdp(model)
  opt = forge_torch.AdamW(model.parameters())
  opt.accumulate_steps = 2
  F.mse_loss(model(x), y).backward()  # micro-batch 1: summed in .grad
  found["fsdp_k_held"] = _error(lambda: setattr(opt, "accumulate_steps", 1))
  opt.step()
  opt.zero_grad()
  opt.accumulate_steps = 1
  F.mse_loss(model(x), y).backward()  # the update applied in backward
  found["fsdp_k_applied"] = _error(
      lambda: setattr(opt, "accumulate_steps", 2))
  opt.step()
  opt.accumulate_steps = 2
  found["fsdp_k_between"] = opt.accumulate_steps
  # A layer run unfused keeps torch's .grad after step(), which no update
  # of this optimizer waits for: options change right after step().
  model = converted(net)
  fully_shard(model)
  forge_dist.prepare_fsdp(model)
  model.fc1.fused = False
  opt = forge_torch.AdamW(model.parameters())
  F.mse_loss(model(x), y).backward()
  opt.step()
  found["fsdp_unfused_grad_kept"] = model.fc1.weight.grad is not None
  found["fsdp_k_unfused"] = _error(
      lambda: setattr(opt, "accumulate_steps", 2))
  # A managed weight tied across two layers under DDP: read twice in the
  # step, refused at its second forward.
  model = tied_after_convert()
  ddp = forge_dist.wrap_ddp(model)
  opt = forge_torch.AdamW(ddp.parameters())
  found["ddp_tied"] = _error(lambda: ddp(x))
  # The tied weight under fully_shard with its two layers in different FSDP
  # groups: fully_shard refuses it where this torch's does (the groups
  # would shard two copies; torch 2.11 shards them silently, as it does for
  # the same nn.Linear model: "fsdp_tied_split_plain"); both layers in one
  # group train as the single process does (_train_fsdp(..., tied=True)).
  plain = copy.deepcopy(net)
  plain.fc2.weight = plain.fc1.weight
  fully_shard(plain.fc1)
  fully_shard(plain)
  found["fsdp_tied_split_plain"] = _error(lambda: plain(x),
                                          (RuntimeError, ValueError))
  model = tied_after_convert()
  fully_shard(model.fc1)
  fully_shard(model)
  forge_dist.prepare_fsdp(model)
  forge_torch.AdamW(model.parameters())
  found["fsdp_tied_split"] = _error(lambda: model(x), (RuntimeError,
                                                      ValueError))
  # The ranks running different managed layers of one shape (experts routed
  # per rank): prepare_ddp(check_order=True) refuses it on every rank at the
  # first reduction (unchecked, the two layers' gradients would be averaged
  # together); wrap_ddp passes the option on.
  model = converted(net)
  forge_dist.prepare_ddp(model, check_order=True)
  opt = forge_torch.AdamW(model.parameters())
  layer = model.fc1 if rank == 0 else model.fc2
  found["misrouted"] = _error(
      lambda: F.mse_loss(model.head(layer(x)), y).backward())
  found["check_order_type"] = _error(
      lambda: forge_dist.wrap_ddp(converted(net), check_order="yes"),
      TypeError)
  # Arguments of the wrong type, refused before anything is registered.
  model = converted(net)
  found["group_type"] = _error(
      lambda: forge_dist.prepare_ddp(model, [0, 1]), TypeError)
  found["broadcast_type"] = _error(
      lambda: forge_dist.prepare_ddp(model, broadcast="no"), TypeError)
  found["group_type_left"] = [forge_dist._GROUPS.get(p, "none")  # noqa: SLF001
                              for p in (model.fc1.weight, model.fc2.weight)]
  # check_order or a group given with a DDP already built: they would not
  # apply (only prepare_ddp(model) registers them).
  ddp = forge_dist.wrap_ddp(converted(net))
  found["ddp_check_order"] = _error(
      lambda: forge_dist.prepare_ddp(ddp, check_order=True), ValueError)
  found["ddp_group"] = _error(
      lambda: forge_dist.prepare_ddp(
          ddp, torch.distributed.new_group([0, 1])), ValueError)
  # A forge_torch optimizer built before prepare_fsdp holds the sharded
  # weights as ordinary parameters: prepare_fsdp refuses to mark them
  # (its layers would train unfused, silently); built after, accepted.
  model = converted(net)
  fully_shard(model)
  early_opt = forge_torch.AdamW(model.parameters())
  found["fsdp_opt_before"] = _error(lambda: forge_dist.prepare_fsdp(model))
  found["fsdp_opt_before_marked"] = forge_torch.is_forge_weight(
      model.fc1.weight)
  del early_opt
  found["fsdp_opt_after"] = forge_dist.prepare_fsdp(model)
  opt = forge_torch.AdamW(model.parameters())
  found["fsdp_prepared_again"] = forge_dist.prepare_fsdp(model)
  # fully_shard before convert: convert skips the sharded layers and
  # prepare_fsdp says which order it takes.
  plain = copy.deepcopy(net)
  for layer in (plain.fc1, plain.fc2, plain):
    fully_shard(layer)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    found["shard_then_convert"] = list(forge_torch.convert(
        plain, exclude=["head"]))
  found["shard_then_convert_warning"] = " ".join(
      str(w.message) for w in caught
      if issubclass(w.category, forge_torch.ConvertSkipWarning))
  found["shard_then_prepare"] = _error(lambda: forge_dist.prepare_fsdp(plain))
  return found


def _train_fsdp(rank: int, micro_batches, accumulate: int, seed: int,
                world: int = WORLD, tied: bool = False) -> dict:
  """fully_shard per managed layer and on the root; D = 13 rows split
  7 + 6 over two ranks, 4 + 4 + 4 + 1 over four (FSDP2 pads the short
  shards). ``tied``: fc1 and fc2 share one weight, both in the root's FSDP
  group (fully_shard's rule for shared parameters), so FSDP sums both
  layers' gradients before the reduce-scatter and the weight is updated
  once from the sum."""
  model = tied_after_convert() if tied else converted(make_net())
  if not tied:
    fully_shard(model.fc1)
    fully_shard(model.fc2)
  fully_shard(model)
  names = forge_dist.prepare_fsdp(model)
  opt = forge_torch.AdamW(model.parameters(), lr=LR, weight_decay=WD)
  opt.accumulate_steps = accumulate
  assert opt.managed_params == (
      [model.fc1.weight] if tied else [model.fc1.weight, model.fc2.weight])
  calls = forge_torch.bridge_stats.calls
  for s, step in enumerate(batches(micro_batches, seed, world)):
    # The second step of the plain run takes fc2 unfused: FSDP's sharded
    # gradient stays for opt.step(), which applies torch's own update to
    # the state FORGE created.
    model.fc2.fused = tied or not (accumulate == 1 and s == 1)
    for micro in step:
      x, y = micro[rank]
      F.mse_loss(model(x), y).backward()
      if accumulate == 1:  # updated as the reduce-scattered gradient came
        assert model.fc1.weight.grad is None
        assert (model.fc2.weight.grad is None) == model.fc2.fused
    opt.step()
    opt.zero_grad()
  state = [opt.state[p] for p in opt.managed_params]
  placements = [(s["exp_avg"].placements == p.placements,
                 s["exp_avg_sq"].placements == p.placements)
                for s, p in zip(state, opt.managed_params)]
  # One fused update per managed weight and step, but fc2's unfused one.
  fused_updates = forge_torch.bridge_stats.calls - calls
  # torch.distributed.checkpoint gathers the sharded state (a collective),
  # and loads it back sharded into a new optimizer (first initialising its
  # state by a step with zero gradients and lr = 0, which must leave the
  # weights as they are: "params" below are read after it).
  full = dcp_state.get_optimizer_state_dict(
      model, opt, options=dcp_state.StateDictOptions(full_state_dict=True))
  managed = managed_names(model, opt)
  new = forge_torch.AdamW(model.parameters(), lr=LR, weight_decay=WD)
  dcp_state.set_optimizer_state_dict(
      model, new, full,
      options=dcp_state.StateDictOptions(full_state_dict=True))
  reloaded = [torch.equal(new.state[p]["exp_avg_sq"].to_local(),
                          s["exp_avg_sq"].to_local())
              and new.state[p]["exp_avg_sq"].placements == p.placements
              for s, p in zip(state, new.managed_params)]
  return {
      "names": names,
      "fused_updates": fused_updates,
      # full_tensor(): a collective, run by every rank.
      "params": {k: v.full_tensor().detach()
                 for k, v in model.named_parameters()},
      "exp_avg_sq": {n: full["state"][n]["exp_avg_sq"] for n in managed},
      "reloaded": reloaded,
      "local_rows": [s["exp_avg_sq"].to_local().shape[0] for s in state],
      "placements": placements,
  }


def _train(rank: int, micro_batches, accumulate: int, seed: int,
           device: str, world: int = WORLD) -> dict:
  model = converted(make_net()).to(device)
  with torch.no_grad():  # prepare_ddp copies rank 0's managed weights
    model.fc1.weight.add_(float(rank))
  if accumulate == 1:
    # (Every managed reduction checked for the same weight on every rank:
    # the check passes and changes nothing.)
    names = forge_dist.prepare_ddp(model, check_order=True)
    ddp = nn.parallel.DistributedDataParallel(model)
  else:
    names, ddp = None, forge_dist.wrap_ddp(model)
  opt = forge_torch.AdamW(ddp.parameters(), lr=LR, weight_decay=WD)
  opt.accumulate_steps = accumulate
  assert opt.managed_params == [model.fc1.weight, model.fc2.weight]
  unfused_grads = []
  for s, step in enumerate(batches(micro_batches, seed, world)):
    # Plain DDP's second step runs fc2 as nn.Linear: its ordinary gradient,
    # which DDP ignores, is averaged in backward by the hook prepare_ddp
    # registered (before step(): what clip_grad_norm_ would read).
    model.fc2.fused = not (accumulate == 1 and s == 1)
    for i, micro in enumerate(step):
      x, y = (t.to(device) for t in micro[rank])
      last = i == len(step) - 1
      with ddp.no_sync() if not last else contextlib.nullcontext():
        F.mse_loss(ddp(x), y).backward()
    assert model.fc1.weight.grad is None
    assert (model.fc2.weight.grad is None) == model.fc2.fused
    if not model.fc2.fused:
      unfused_grads.append(model.fc2.weight.grad.detach().cpu().clone())
    opt.step()
    opt.zero_grad()
  return {
      "names": names,
      "unfused_grads": unfused_grads,
      "params": {k: v.detach().cpu() for k, v in model.named_parameters()},
      "exp_avg_sq": {n: opt.state[model.get_parameter(n)]["exp_avg_sq"].cpu()
                     for n in managed_names(model, opt)},
  }


# fc1 frozen for the first steps of FROZEN (a fine-tuning's frozen base
# layer, converted with the rest), then trained as nn.Linear (unfused) in
# the last: the hook registered while it was frozen averages its gradient.
FROZEN = [1, 1, 1]


def _frozen(rank: int) -> dict:
  """A managed weight frozen when DDP and fully_shard are prepared, and a
  forge_torch.Linear given to DDP as the whole model."""
  ddp_model = converted(make_net())
  ddp_model.fc1.weight.requires_grad_(False)
  ddp = forge_dist.wrap_ddp(ddp_model)
  ddp_opt = forge_torch.AdamW(ddp.parameters(), lr=LR, weight_decay=WD)
  fsdp_model = converted(make_net())
  fsdp_model.fc1.weight.requires_grad_(False)
  fully_shard(fsdp_model.fc1)
  fully_shard(fsdp_model.fc2)
  fully_shard(fsdp_model)
  fsdp_names = forge_dist.prepare_fsdp(fsdp_model)
  fsdp_opt = forge_torch.AdamW(fsdp_model.parameters(), lr=LR,
                               weight_decay=WD)
  for s, step in enumerate(batches(FROZEN, SEEDS["frozen"])):
    last = s == len(FROZEN) - 1
    ddp_model.fc1.weight.requires_grad_(last)
    ddp_model.fc1.fused = not last
    x, y = step[0][rank]
    F.mse_loss(ddp(x), y).backward()
    ddp_opt.step()
    ddp_opt.zero_grad()
    if not last:
      F.mse_loss(fsdp_model(x), y).backward()
      fsdp_opt.step()
      fsdp_opt.zero_grad()
  # A forge_torch.Linear wrapped whole: DDP leaves its weight to FORGE (no
  # gradient allocated and reduced for it by DDP).
  layer = converted(make_net()).fc2
  root = forge_dist.wrap_ddp(layer)
  root_opt = forge_torch.AdamW(root.parameters(), lr=LR)
  root(torch.randn(ROWS, SEQ, D)).sum().backward()
  # DDP told not to copy rank 0's parameters: nor does FORGE.
  unsynced = converted(make_net())
  with torch.no_grad():
    unsynced.fc1.weight.add_(float(rank))
  forge_dist.wrap_ddp(unsynced, init_sync=False)
  return {
      "unsynced": unsynced.fc1.weight - make_net().fc1.weight,
      "ddp": {k: v.detach() for k, v in ddp_model.named_parameters()},
      "fsdp": {k: v.full_tensor().detach()
               for k, v in fsdp_model.named_parameters()},
      "fsdp_names": fsdp_names,
      "root_grad": layer.weight.grad,
      "root_managed": root_opt.managed_params == [layer.weight],
      "root_checked": forge_dist.prepare_ddp(root),
  }


def frozen_reference(steps: int) -> nn.Module:
  """torch.optim.AdamW in one process over FROZEN's first ``steps`` steps,
  fc1 frozen but in the last of FROZEN."""
  net = make_net()
  opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
  for s, step in enumerate(batches(FROZEN, SEEDS["frozen"])[:steps]):
    net.fc1.weight.requires_grad_(s == len(FROZEN) - 1)
    x = torch.cat([x for x, _ in step[0]])
    y = torch.cat([y for _, y in step[0]])
    F.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad()
  return net


def _rank(rank: int, init: str, device: str, world: int = WORLD) -> dict:
  """What rank ``rank`` of ``world`` reports (an exception's traceback, if
  one ends it)."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  dist = torch.distributed
  dist.init_process_group("gloo", init_method=init, rank=rank,
                          world_size=world,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
  try:
    cpu = device == "cpu"
    if world != WORLD:  # the plain cases only
      return {"plain": _train(rank, PLAIN, 1, seed=1, device=device,
                              world=world),
              "fsdp_plain": (_train_fsdp(rank, PLAIN, 1, seed=3, world=world)
                             if cpu else None)}
    return {"misuses": _misuses(rank) if cpu else None,
            "frozen": _frozen(rank) if cpu else None,
            "plain": _train(rank, PLAIN, 1, seed=1, device=device),
            "accumulated": _train(rank, ACCUMULATED, 2, seed=2, device=device),
            # FSDP2 over gloo: CPU tensors only.
            "fsdp_plain": _train_fsdp(rank, PLAIN, 1, seed=3) if cpu else None,
            "fsdp_accumulated": (_train_fsdp(rank, ACCUMULATED, 2, seed=4)
                                 if cpu else None),
            "fsdp_tied": (_train_fsdp(rank, PLAIN, 1, seed=5, tied=True)
                          if cpu else None)}
  except Exception:  # noqa: BLE001 -- reported to the tests
    return {"error": traceback.format_exc()}
  finally:
    dist.destroy_process_group()
    torch.set_num_threads(threads)
    # Rank 0 runs in the test process: its models (DDP and FSDP keep
    # reference cycles) are freed now, so that their registered weights do
    # not outlive this (forge_torch.distributed.any_registered() would stay
    # True for the tests after it, which then take no update plans).
    gc.collect()


def _child(rank: int, init: str, device: str, world: int, out: str) -> None:
  """A child process's rank: its report, saved to ``out``."""
  torch.save(_rank(rank, init, device, world), out)


# --- the reference and the tests ----------------------------------------------


def reference(micro_batches, seed, device="cpu", world=WORLD, tied=False
              ) -> tuple[nn.Module, torch.optim.AdamW]:
  """torch.optim.AdamW in one process: each micro-batch's loss is the mean
  over all ranks' rows (DDP's average of the ranks' means), its gradients
  summed over a step's micro-batches."""
  net = make_net(tied).to(device)
  opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD)
  for step in batches(micro_batches, seed, world):
    for micro in step:
      x = torch.cat([x for x, _ in micro]).to(device)
      y = torch.cat([y for _, y in micro]).to(device)
      F.mse_loss(net(x), y).backward()
    opt.step()
    opt.zero_grad()
  return net, opt


def run_ranks(root, device: str, world: int = WORLD) -> list[dict]:
  """Every rank's report, the ``world`` ranks run once per test session on
  ``device``: pytest-xdist workers share them through files in the
  session's temporary root, written under an exclusive lock."""
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # shared by the workers of this session
  out = root / f"torch_ddp_{device}_{world}"
  with open(f"{out}.lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    paths = [out / f"rank{r}.pt" for r in range(world)]
    if not all(p.is_file() for p in paths):
      # Rank 0 is this process (torch, JAX and forge_torch are imported
      # already); the others are forked from a fresh server process that
      # imports this module once (a child forked from this process would
      # inherit JAX's threads; spawning each child would import torch, JAX
      # and forge_torch once per rank).
      out.mkdir(exist_ok=True)
      store = out / "store"
      store.unlink(missing_ok=True)
      init = f"file://{store}"
      context = mp.get_context("forkserver")
      context.set_forkserver_preload([__name__])
      children = [context.Process(target=_child,
                                  args=(r, init, device, world,
                                        str(paths[r])))
                  for r in range(1, world)]
      for c in children:
        c.start()
      try:
        torch.save(_rank(0, init, device, world), paths[0])
      finally:
        for c in children:
          c.join(timeout=2 * TIMEOUT_S)
          if c.is_alive():
            c.kill()
      for r, c in enumerate(children, 1):
        assert c.exitcode == 0, f"rank {r} exited with {c.exitcode}"
  got = [torch.load(p, weights_only=False) for p in paths]
  for r, report in enumerate(got):
    assert "error" not in report, f"rank {r}:\n{report.get('error')}"
  return got


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  return run_ranks(tmp_path_factory.getbasetemp(), "cpu")


@pytest.fixture(scope="module")
def wide_reports(tmp_path_factory):
  return run_ranks(tmp_path_factory.getbasetemp(), "cpu", WIDE_WORLD)


SEEDS = {"plain": 1, "accumulated": 2, "fsdp_plain": 3, "fsdp_accumulated": 4,
         "fsdp_tied": 5, "frozen": 6}


def check_against_torch(ranks: list[dict], case: str, device: str) -> None:
  """Every rank's parameters (bit-identical across the ranks) and the
  managed weights' second moments against torch.optim.AdamW in one process
  on the same global batches."""
  micro_batches = ACCUMULATED if case.endswith("accumulated") else PLAIN
  tied = case == "fsdp_tied"
  ref, ref_opt = reference(micro_batches, SEEDS[case], device, len(ranks),
                           tied)
  if case != "accumulated":
    assert ranks[0]["names"] == ["fc1.weight", "fc2.weight"]
  start = make_net(tied)
  for name, pr in ref.named_parameters():
    p0 = ranks[0]["params"][name]
    # Replicas stay identical (the collective's result is the same bytes on
    # every rank), and equal to the single-process run.
    for r, report in enumerate(ranks[1:], 1):
      assert torch.equal(report["params"][name], p0), (name, r)
    assert rel(p0, pr.cpu()) <= FP32, (name, rel(p0, pr.cpu()))
    # Not a vacuous match: every parameter moved.
    assert rel(p0, start.get_parameter(name)) > 1e3 * FP32, name
  managed = ["fc1.weight"] if tied else ["fc1.weight", "fc2.weight"]
  assert list(ranks[0]["exp_avg_sq"]) == managed
  for name, got in ranks[0]["exp_avg_sq"].items():
    want = ref_opt.state[ref.get_parameter(name)]["exp_avg_sq"].cpu()
    assert rel(got, want) <= FP32, (name, rel(got, want))


@pytest.mark.parametrize("case", ["plain", "accumulated"])
def test_ddp_matches_single_process_adamw(reports, case):
  check_against_torch([r[case] for r in reports], case, "cpu")


def test_an_unfused_layers_gradient_is_averaged_in_backward(reports):
  """fc2 run as nn.Linear in plain DDP's second step: its .grad after the
  backward, before step(), is the same on both ranks (averaged by the hook
  prepare_ddp registered), and not zero."""
  grads = [r["plain"]["unfused_grads"] for r in reports]
  assert [len(g) for g in grads] == [1, 1]
  assert torch.equal(grads[0][0], grads[1][0])
  assert grads[0][0].abs().max() > 0


def test_four_ranks_match_single_process_adamw(wide_reports):
  """DDP and fully_shard over four ranks: the same parity, every replica
  bit-identical; D = 13 rows shard 4 + 4 + 4 + 1 under FSDP2."""
  assert len(wide_reports) == WIDE_WORLD
  check_against_torch([r["plain"] for r in wide_reports], "plain", "cpu")
  check_against_torch([r["fsdp_plain"] for r in wide_reports], "fsdp_plain",
                      "cpu")
  rows = [r["fsdp_plain"]["local_rows"] for r in wide_reports]
  assert rows == [[4, 4], [4, 4], [4, 4], [1, 1]], rows
  for r in wide_reports:  # fc2 unfused in the second step
    assert r["fsdp_plain"]["fused_updates"] == 2 * len(PLAIN) - 1
    assert r["fsdp_plain"]["placements"] == [(True, True)] * 2


@pytest.mark.gpu
def test_gpu_ddp_matches_single_process_adamw(tmp_path_factory):
  """Two ranks on one GPU (gloo reduces CUDA tensors): the collective and
  the fused kernels ordered on torch's stream."""
  reports = run_ranks(tmp_path_factory.getbasetemp(), "cuda")
  for case in ("plain", "accumulated"):
    check_against_torch([r[case] for r in reports], case, "cuda")


@pytest.mark.parametrize("case", ["fsdp_plain", "fsdp_accumulated"])
def test_fully_shard_matches_single_process_adamw(reports, case):
  """Each rank updates its shard as FSDP reduce-scatters the gradient
  (accumulated: opt.step() from the summed sharded gradients); the state is
  sharded as the weight is."""
  check_against_torch([r[case] for r in reports], case, "cpu")
  rows = [r[case]["local_rows"] for r in reports]
  assert rows == [[7, 7], [6, 6]], rows  # D = 13 rows, padded split
  updates = 2 * len(PLAIN) - (case == "fsdp_plain")
  assert [r[case]["fused_updates"] for r in reports] == [updates] * WORLD
  for r in reports:
    assert r[case]["placements"] == [(True, True)] * 2
    assert r[case]["reloaded"] == [True, True]


def test_fully_shard_tied_weight_matches_single_process_adamw(reports):
  """A managed weight read by two layers (fc2 tied to fc1), both in the
  root's FSDP group: FSDP sums both layers' gradients before it
  reduce-scatters, so the shard is updated once, from the whole gradient,
  as torch.optim.AdamW updates the tied model in one process."""
  check_against_torch([r["fsdp_tied"] for r in reports], "fsdp_tied", "cpu")
  for r in reports:
    # Both names of the one weight; one fused update per step.
    assert r["fsdp_tied"]["names"] == ["fc1.weight", "fc2.weight"]
    assert r["fsdp_tied"]["fused_updates"] == len(PLAIN)
    assert r["fsdp_tied"]["local_rows"] == [r["fsdp_plain"]["local_rows"][0]]
    assert r["fsdp_tied"]["placements"] == [(True, True)]
    assert r["fsdp_tied"]["reloaded"] == [True]


def test_a_frozen_managed_weight_and_a_wrapped_layer(reports):
  """A managed weight frozen when DDP or fully_shard is prepared: prepared
  (torch refuses a hook on a frozen tensor), left as it is while frozen,
  and under DDP averaged by the hook once unfrozen and run unfused; both
  match torch.optim.AdamW with the same weight frozen. A forge_torch.Linear
  given to DDP as the whole model gets no DDP gradient. wrap_ddp(...,
  init_sync=False) does not copy the managed weights either."""
  ddp_ref, fsdp_ref = frozen_reference(len(FROZEN)), frozen_reference(2)
  start = make_net()
  for r, report in enumerate(reports):
    got = report["frozen"]
    for case, ref in (("ddp", ddp_ref), ("fsdp", fsdp_ref)):
      for name, want in ref.named_parameters():
        assert rel(got[case][name], want) <= FP32, (r, case, name)
      moved = rel(got[case]["fc1.weight"], start.fc1.weight)
      assert (moved > 1e3 * FP32) == (case == "ddp"), (r, case, moved)
    assert got["fsdp_names"] == ["fc1.weight", "fc2.weight"]
    assert got["root_managed"] and got["root_grad"] is None
    assert torch.allclose(got["unsynced"], torch.full((D, D), float(r)),
                          atol=1e-6), got["unsynced"]
    assert got["root_checked"] == ["weight"]


def test_misuse_is_refused(reports):
  for report in reports:
    found = report["misuses"]
    assert "one of 2" in found["no_prepare"], found["no_prepare"]
    assert "forge_torch.distributed.prepare_ddp(model)" in found["no_prepare"]
    assert "built before" in found["late_prepare"], found["late_prepare"]
    late = found["late_prepare_model"]
    assert "prepare_ddp(model) was called after DistributedDataParallel" in (
        late), late
    assert "wrap_ddp" in late, late
    assert found["late_prepare_left"] is False
    assert found["checked"] == ["fc1.weight", "fc2.weight"]
    assert found["prepared_again"] == ["fc1.weight", "fc2.weight"]
    assert found["scan_prepared"] == ["fc1.weight", "fc2.weight"]
    # prepare_ddp's scan, then one at the first reduction for both weights
    # (and those of the models prepared before, alive or not, in this
    # process); wrap_ddp: prepare_ddp's only.
    assert len(found["scans_user"]) == 2, found["scans_user"]
    assert found["scans_user"][0] == 2, found["scans_user"]
    assert len(found["scans_wrap_ddp"]) == 1, found["scans_wrap_ddp"]
    for how in ("user", "wrap_ddp"):
      joined = found[f"join_{how}"]
      assert "DistributedDataParallel.join() (uneven inputs" in joined, (
          how, joined)
      assert "fc" in joined and "drop_last=True" in joined, (how, joined)
    assert "max_grad_norm" in found["clip"], found["clip"]
    assert "data parallelism" in found["clip"], found["clip"]
    assert "fully_shard" in found["fsdp"], found["fsdp"]
    assert "fc1" in found["fsdp"] and "prepare_fsdp(model)" in found["fsdp"]
    assert "after fully_shard" in found["fsdp_early"], found["fsdp_early"]
    assert "max_grad_norm" in found["fsdp_clip"], found["fsdp_clip"]
    for case in ("fsdp_k_held", "fsdp_k_applied"):
      assert "accumulate_steps cannot change in the middle of a step" in (
          found[case]), (case, found[case])
    assert found["fsdp_k_between"] == 2
    assert found["fsdp_unfused_grad_kept"] is True
    assert found["fsdp_k_unfused"] == "", found["fsdp_k_unfused"]
    assert "fully_shard" in found["fsdp_clip"], found["fsdp_clip"]
    # A weight tied across two managed layers: under DDP its second reader
    # is refused; under fully_shard, split over two FSDP groups, fully_shard
    # refuses it and says how to group it.
    assert "called a second time" in found["ddp_tied"], found["ddp_tied"]
    assert "fc2" in found["ddp_tied"], found["ddp_tied"]
    # As torch's fully_shard does for the same nn.Linear model: refused
    # (saying how to group the layers), or, in a torch whose fully_shard
    # does not refuse it, not refused either.
    if found["fsdp_tied_split_plain"]:
      assert "shared" in found["fsdp_tied_split"], found["fsdp_tied_split"]
      assert "same FSDP group" in found["fsdp_tied_split"]
    else:
      assert found["fsdp_tied_split"] == "", found["fsdp_tied_split"]
    # Rank 0 reduces fc1, rank 1 fc2: both ranks refuse, naming both.
    misrouted = found["misrouted"]
    assert "reducing different managed weights" in misrouted, misrouted
    assert "fc1.weight (number 1)" in misrouted, misrouted
    assert "fc2.weight (number 2)" in misrouted, misrouted
    assert "check_order must be True or False" in found["check_order_type"]
    assert "process_group must be a torch.distributed" in found["group_type"]
    assert "got list" in found["group_type"], found["group_type"]
    assert "broadcast must be True or False" in found["broadcast_type"]
    assert found["group_type_left"] == ["none", "none"]
    for case in ("ddp_check_order", "ddp_group"):
      assert "before wrapping" in found[case], found[case]
    early = found["fsdp_opt_before"]
    assert "built before prepare_fsdp" in early, early
    assert "fc1" in early and "unfused" in early, early
    assert found["fsdp_opt_before_marked"] is False
    assert found["fsdp_opt_after"] == ["fc1.weight", "fc2.weight"]
    assert found["fsdp_prepared_again"] == ["fc1.weight", "fc2.weight"]
    assert found["shard_then_convert"] == []
    assert "convert the model before fully_shard" in (
        found["shard_then_convert_warning"])
    late = found["shard_then_prepare"]
    assert "fully_shard ran before convert" in late, late
    assert "fc1" in late, late


def test_prepare_ddp_needs_a_process_group():
  assert not torch.distributed.is_initialized()
  with pytest.raises(RuntimeError, match="init_process_group"):
    forge_dist.prepare_ddp(converted(make_net()))


def test_wrap_ddp_takes_ddps_process_group_by_keyword_or_position():
  """wrap_ddp prepares the managed weights over the group DDP will use,
  however the caller passes it (by name, or at its position in this torch's
  DistributedDataParallel signature)."""
  import inspect  # noqa: PLC0415
  model, group = converted(make_net()), object()
  take = forge_dist._ddp_process_group  # noqa: SLF001
  assert take(model, (), {}) is None
  assert take(model, (), {"process_group": group}) is group
  params = inspect.signature(
      nn.parallel.DistributedDataParallel.__init__).parameters
  before = [p.default for p in list(params.values())[2:]
            if p.name != "process_group"][
                :list(params).index("process_group") - 2]
  assert take(model, (*before, group), {}) is group
  assert take(model, (None,), {"process_group": group}) is group
  with pytest.raises(TypeError, match="process_group"):
    take(model, (*before, group), {"process_group": group})

  class Mesh:  # a DeviceMesh's data-parallel dimension: its group
    def get_group(self):
      return group

  assert take(model, (), {"device_mesh": Mesh()}) is group
