"""forge_torch's own Python per managed layer, with the fused update stubbed.

    ./dev.sh python -m benchmarks.torch_overhead --out O.csv

A stack of ``--layers`` small ``--width x --width`` linear layers (no bias)
on the CPU, trained ``--steps`` steps after ``--warmup`` steps, in two arms:

  torch   ``nn.Linear`` + ``torch.optim.AdamW``;
  forge   ``forge_torch.Linear`` + ``forge_torch.AdamW``, with
          ``forge_torch._bridge.fused_update`` replaced by a function that
          does nothing: what remains is the layer's and the optimizer's own
          Python (bookkeeping, checks, hyperparameter packing) around the
          kernel launch.

The layers are small so the arithmetic is negligible: the figures are host
time per layer per step, split into the forward, the backward, ``step()``
and ``zero_grad()`` (``perf_counter`` around each, medians over the steps).
On a GPU the launch itself comes on top (``benchmarks.torch_call``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from benchmarks import common

PHASES = ("forward", "backward", "step", "zero_grad")


def run_arm(arm: str, layers: int, width: int, steps: int,
            warmup: int) -> dict[str, float]:
  """Seconds per layer per step for each phase (median over ``steps``)."""
  import torch  # noqa: PLC0415
  import forge_torch  # noqa: PLC0415
  from forge_torch import optim as forge_optim  # noqa: PLC0415

  torch.manual_seed(0)
  forge = arm == "forge"
  linear = forge_torch.Linear if forge else torch.nn.Linear
  model = torch.nn.Sequential(*[linear(width, width, bias=False)
                                for _ in range(layers)])
  opt = (forge_torch.AdamW if forge else torch.optim.AdamW)(
      model.parameters(), lr=1e-3)
  x = torch.randn(4, width)
  real = forge_optim._bridge.fused_update  # noqa: SLF001
  forge_optim._bridge.fused_update = lambda *a, **k: True  # noqa: SLF001
  try:
    times = {p: [] for p in PHASES}
    for i in range(warmup + steps):
      t0 = time.perf_counter()
      loss = model(x).square().mean()
      t1 = time.perf_counter()
      loss.backward()
      t2 = time.perf_counter()
      opt.step()
      t3 = time.perf_counter()
      opt.zero_grad(set_to_none=True)
      t4 = time.perf_counter()
      if i >= warmup:
        for p, a, b in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4)):
          times[p].append((b - a) / layers)
  finally:
    forge_optim._bridge.fused_update = real  # noqa: SLF001
  return {p: statistics.median(v) for p, v in times.items()}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="out/bench/torch_overhead.csv")
  p.add_argument("--layers", type=common.positive_int, default=20)
  p.add_argument("--width", type=common.positive_int, default=16)
  p.add_argument("--steps", type=common.positive_int, default=200)
  p.add_argument("--warmup", type=common.positive_int, default=5)
  args = p.parse_args(argv)
  res = common.Results(args.out, "torch_overhead",
                       device=f"cpu:{platform.machine()}")
  shape = f"{args.layers} x Linear({args.width}, {args.width})"
  totals = {}
  for arm in ("torch", "forge"):
    t = run_arm(arm, args.layers, args.width, args.steps, args.warmup)
    totals[arm] = sum(t.values())
    for phase, v in t.items():
      res.add("per layer per step, fused update stubbed", arm, shape,
              "float32", phase, v * 1e6, "us")
    res.add("per layer per step, fused update stubbed", arm, shape,
            "float32", "total", totals[arm] * 1e6, "us")
    print(f"{arm:>5}: " + "  ".join(f"{k} {v * 1e6:6.1f}" for k, v in
                                     t.items())
          + f"  total {totals[arm] * 1e6:6.1f} us per layer per step",
          flush=True)
  print(f"forge - torch: {(totals['forge'] - totals['torch']) * 1e6:.1f} us "
        "per layer per step", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
