"""forge_torch vs torch.optim, side by side, on scikit-learn's digits.

The PyTorch twin of ``examples.train_digits``: one small torch MLP
classifier trained twice, from the same initialisation and on the same
batches:

* arm ``forge``: ``forge_torch.convert(model)`` (its ``nn.Linear`` layers
  become ``forge_torch.Linear``) and ``forge_torch.AdamW``: each weight is
  updated inside ``loss.backward()`` by the fused kernel, and its ``.grad``
  never exists; ``opt.step()`` updates the biases;
* arm ``torch``: the same model with ``torch.optim.AdamW``.

Same hyperparameters in both: AdamW, the JAX demo's warmup-cosine learning
rate (through ``torch.optim.lr_scheduler.LambdaLR``; forge_torch reads the
group's ``lr`` when the layer's backward runs, so a scheduler stepped after
``opt.step()`` drives both arms alike), weight decay on the weights only.
On the CPU the kernel runs in Pallas interpret mode through DLPack; on a
Hopper GPU it is launched directly on the torch tensors.

Run from the repository root::

  python -m examples.train_digits_torch                 # fp32: each step agrees
  python -m examples.train_digits_torch --device cuda --dtype bfloat16

Writes ``<out>/losses.csv`` (step, arm, loss). What is checked (fp32), as
in the JAX demo: at every step, ``torch.optim.AdamW`` also steps a copy of
the forge arm's own state (its parameters and its optimizer's state dict,
which is torch's format) on the same batch, and the two updated models and
optimizer states must agree to 1e-5 relative (``norm_rel`` of
:func:`param_diff`, and :func:`state_diff`); the trajectories are reported,
not held to it (training compounds the arms' rounding differences). The
exit status is 1 if a step differs by more than that or a loss is not
finite.
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import sys
from typing import Sequence

import numpy as np

from examples.train_digits import (FP32_TOLERANCE, add_training_args,
                                   batch_indices, check_training_args,
                                   load_digits_split, make_schedule,
                                   rel_norm, worst)

ARMS = ("forge", "torch")


def make_model(n_in: int, hidden: int, classes: int):
  """``in -> hidden -> hidden -> classes`` with ReLU, torch's own layers."""
  import torch  # noqa: PLC0415
  return torch.nn.Sequential(
      torch.nn.Linear(n_in, hidden), torch.nn.ReLU(),
      torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
      torch.nn.Linear(hidden, classes))


def param_groups(model, weight_decay: float) -> list[dict]:
  """Weight decay on the weights (2-D), none on the biases."""
  params = list(model.parameters())
  return [{"params": [p for p in params if p.dim() > 1],
           "weight_decay": weight_decay},
          {"params": [p for p in params if p.dim() <= 1],
           "weight_decay": 0.0}]


def param_diff(forge_model, torch_model) -> dict:
  """The largest per-parameter ``max|a - b| / max|b|`` (NaN if any is) and
  the name of the parameter where it is, the largest ``max|a - b|``, and
  the largest per-parameter ``||a - b|| / ||b||`` (``norm_rel``: the
  relative error tests/tolerances.py's table bounds)."""
  max_abs, max_rel, worst_name, norms = 0.0, 0.0, "", []
  b_params = dict(torch_model.named_parameters())
  for name, a in forge_model.named_parameters():
    a = a.detach().double().cpu().numpy()
    b = b_params[name].detach().double().cpu().numpy()
    norms.append(rel_norm(a, b))
    d = float(np.max(np.abs(a - b)))
    r = d / max(float(np.max(np.abs(b))), 1e-30)
    if not math.isnan(max_abs) and (math.isnan(d) or d > max_abs):
      max_abs = d
    if not math.isnan(max_rel) and (math.isnan(r) or r >= max_rel):
      max_rel, worst_name = r, name
  return {"max_abs": max_abs, "max_rel": max_rel, "worst": worst_name,
          "norm_rel": worst(norms)}


def state_diff(opt_a, model_a, opt_b, model_b) -> float:
  """The largest ``||a - b|| / ||b||`` over the state tensors (moments and
  step counts) of corresponding parameters of two optimizers; a state
  entry one of them lacks counts as infinitely far."""
  import torch  # noqa: PLC0415
  as_np = lambda t: torch.as_tensor(t).detach().double().cpu().numpy()
  norms = []
  for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
    sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
    if set(sa) != set(sb):
      return math.inf
    norms += [rel_norm(as_np(sa[k]), as_np(b)) for k, b in sb.items()]
  return worst(norms)


def accuracy(model, x, y) -> float:
  import torch  # noqa: PLC0415
  with torch.no_grad():
    return float((model(x).argmax(-1) == y).float().mean())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m examples.train_digits_torch",
      description=("Train one MLP on sklearn digits with forge_torch "
                   "(convert + AdamW) and with torch.optim.AdamW, from the "
                   "same init on the same batches, and compare."),
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add_training_args(p, os.path.join("out", "demo_torch"),
                    reference="torch.optim.AdamW's")
  p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                 help="auto: cuda when torch has it, else cpu")
  args = p.parse_args(argv)
  check_training_args(p, args)
  return args


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the comparison; returns what it measured (``ok``: the check
  passed)."""
  args = parse_args(argv)
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    sys.exit("examples.train_digits_torch needs torch: pip install "
             "'.[torch]' (./dev.sh test installs it)")
  import forge_torch  # noqa: PLC0415

  if args.device == "cuda" and not torch.cuda.is_available():
    sys.exit("--device cuda: this torch has no CUDA device")
  device = torch.device(args.device if args.device != "auto" else
                        "cuda" if torch.cuda.is_available() else "cpu")
  dtype = getattr(torch, args.dtype)
  (x_tr, y_tr), (x_te, y_te) = load_digits_split(args.seed)
  batches = batch_indices(len(x_tr), args.batch_size, args.steps, args.seed)
  as_t = lambda a, t: torch.as_tensor(a).to(device=device, dtype=t)
  x_tr, x_te = as_t(x_tr, dtype), as_t(x_te, dtype)
  y_tr, y_te = as_t(y_tr, torch.long), as_t(y_te, torch.long)

  torch.manual_seed(args.seed)
  torch_model = make_model(x_tr.shape[1], args.hidden, 10).to(device, dtype)
  forge_model = copy.deepcopy(torch_model)
  forge_torch.convert(forge_model)  # in place: the same initial weights
  schedule = make_schedule(args.lr, args.steps)
  lr_factor = lambda step: float(schedule(step)) / args.lr
  opts = {
      "forge": forge_torch.AdamW(param_groups(forge_model, args.weight_decay),
                                 lr=args.lr),
      "torch": torch.optim.AdamW(param_groups(torch_model, args.weight_decay),
                                 lr=args.lr)}
  scheds = {arm: torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
            for arm, opt in opts.items()}
  models = {"forge": forge_model, "torch": torch_model}

  losses = {arm: [] for arm in ARMS}
  fp32 = args.dtype == "float32"
  # fp32: each step's difference from torch's step taken from the forge
  # arm's own state, on a copy (a checkpoint of forge_torch.AdamW loads
  # into torch.optim.AdamW).
  step_rel: list[float] = []
  probe = copy.deepcopy(torch_model)
  probe_opt = torch.optim.AdamW(param_groups(probe, args.weight_decay),
                                lr=args.lr)
  stats = forge_torch.bridge_stats
  calls0, direct0 = stats.calls, stats.direct
  for step, idx in enumerate(batches):
    idx = torch.as_tensor(idx, device=device)
    if fp32:
      probe.load_state_dict(forge_model.state_dict())
      # (copied: torch's loader keeps tensors of the right dtype and
      # device as they are, and its step would write the forge arm's)
      probe_opt.load_state_dict(copy.deepcopy(opts["forge"].state_dict()))
      torch.nn.functional.cross_entropy(
          probe(x_tr[idx]).float(), y_tr[idx]).backward()
      probe_opt.step()
      probe_opt.zero_grad()
    for arm in ARMS:
      logits = models[arm](x_tr[idx]).float()
      loss = torch.nn.functional.cross_entropy(logits, y_tr[idx])
      loss.backward()  # forge: the weights are updated here
      opts[arm].step()
      opts[arm].zero_grad()
      scheds[arm].step()
      losses[arm].append(loss.item())
    if fp32:
      # (the state too: a step that stored it wrongly would start the next
      # comparison from it on both sides)
      step_rel.append(max(param_diff(forge_model, probe)["norm_rel"],
                          state_diff(opts["forge"], forge_model, probe_opt,
                                     probe)))
    if args.log_every and (step % args.log_every == 0
                           or step == args.steps - 1):
      print(f"step {step:5d}  " + "  ".join(
          f"{arm} {losses[arm][-1]:.7f}" for arm in ARMS), flush=True)

  fused, direct = stats.calls - calls0, stats.direct - direct0
  diff = param_diff(forge_model, torch_model)
  acc = {arm: accuracy(models[arm], x_te, y_te) for arm in ARMS}
  os.makedirs(args.out, exist_ok=True)
  csv_path = os.path.join(args.out, "losses.csv")
  with open(csv_path, "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(["step", "arm", "loss"])
    for arm in ARMS:
      w.writerows([i, arm, repr(l)] for i, l in enumerate(losses[arm]))

  finite = all(math.isfinite(l) for arm in ARMS for l in losses[arm])
  worst_step = worst(step_rel)  # (a NaN difference fails)
  ok = finite and (not fp32 or worst_step <= FP32_TOLERANCE)
  print(f"trained {args.steps} steps x 2 arms on {device}; {fused} fused "
        f"updates ({direct} launched directly)")
  print("final train loss  " + "  ".join(
      f"{arm} {losses[arm][-1]:.7f}" for arm in ARMS))
  print("test accuracy     " + "  ".join(
      f"{arm} {acc[arm]:.4f}" for arm in ARMS))
  print(f"param difference  max abs {diff['max_abs']:.3e}  max rel "
        f"{diff['max_rel']:.3e} (per parameter max|forge-torch|/max|torch|, "
        f"worst at {diff['worst']})")
  print(f"wrote {csv_path}")
  if not finite:
    print("FAIL: a loss is not finite")
  elif fp32:
    print(f"{'PASS' if ok else 'FAIL'}: each fp32 step within "
          f"{worst_step:.1e} relative of torch's step from the same state "
          f"(tolerance {FP32_TOLERANCE:.0e}); the trajectories after "
          f"{args.steps} steps {diff['max_rel']:.1e} apart (rounding "
          "compounds in training)")
  else:
    print(f"({args.dtype}: the arms part by rounding; no tolerance is "
          "checked)")
  return {"ok": ok, "losses": losses, "test_accuracy": acc,
          "max_rel_param_diff": diff["max_rel"],
          "max_abs_param_diff": diff["max_abs"], "dtype": args.dtype,
          "step_diff": worst_step if fp32 else None,
          "step_diff_per_step": step_rel,
          "device": str(device), "csv": csv_path,
          "fused_updates": fused}


if __name__ == "__main__":
  sys.exit(0 if main()["ok"] else 1)
