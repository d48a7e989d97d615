"""An update plan's per-update path in Python and natively, on the CPU.

    ./dev.sh python -m benchmarks.plan_checks --out O.csv

forge_torch's managed layer spends most of its backward's host time on
an update that repeats its weight's plan: the checks the plan makes, the
relaunch of the fused kernel and the step count's advance. This times that
path on one ``Linear(16, 16)`` bf16 weight with ``(4, 8, 16)`` operands,
the direct launch stood in for (as ``benchmarks.torch_overhead --launch
direct`` does: the kernel's launch and the hyperparameter ring are Python
stand-ins, which both arms call), in Python
(``_ForgeOptimizer._forge_run_plan``) and on the native host path
(``forge_torch/_hot.cpp``'s ``run_plan``, built into ``--build-dir`` by
``torch.utils.cpp_extension``: it needs a C++ compiler and ninja). Each arm
runs on its own optimizer; before every call the weight's updated mark is
dropped and its step count's record set back, so that every timed call
takes its plan for the same step (it raises otherwise). Rows:
``plan_checks``, metric ``call_time``, per arm (``python``, ``native``,
``loop``: the resets alone), p20/p50/p80 over ``--rounds`` rounds of
``--calls`` calls.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from benchmarks import common, paths


def _quantiles(v):
  v = sorted(v)
  pick = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]  # noqa: E731
  return pick(0.2), statistics.median(v), pick(0.8)


class _Unbuilt(RuntimeError):
  """The native path could not be built (or is turned off)."""


def measure(rounds: int, calls: int, build_dir: str | None) -> dict:
  """Microseconds per call of each arm, one list entry per round."""
  import torch  # noqa: PLC0415

  import forge_torch  # noqa: PLC0415
  from forge_torch import _direct, _hot, optim as fo  # noqa: PLC0415
  from benchmarks import torch_overhead  # noqa: PLC0415

  with _hot.using(True, build_dir) as on:
    if not on:
      raise _Unbuilt(_hot.unavailable())
    native = _hot.run_plan
  undo = torch_overhead._direct_stand_in(fo._bridge, _direct)  # noqa: SLF001
  try:
    x = torch.randn(4, 8, 16, dtype=torch.bfloat16)
    dy = torch.randn(4, 8, 16, dtype=torch.bfloat16)

    def made():  # a layer whose weight has its plan (a direct launch's)
      layer = forge_torch.Linear(16, 16, bias=False).to(torch.bfloat16)
      opt = forge_torch.AdamW(layer.parameters(), lr=1e-3)
      for _ in range(4):
        layer(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
      p = layer.weight
      pk = fo._key(p)  # noqa: SLF001
      plan = opt._forge_plans._values.get(pk)  # noqa: SLF001
      if plan is None or plan.launch is None:
        raise RuntimeError("the weight has no direct-launch plan "
                           f"({forge_torch.bridge_stats})")
      upd, record = opt._forge_updated._values, plan.record  # noqa: SLF001
      value = record.value

      def reset():
        upd.pop(pk, None)
        record.value = value

      # The step's first update forms its scalars (Python); later ones,
      # timed, find them.
      reset()
      if not opt._forge_run_plan(plan, p, pk, dy, x, None):  # noqa: SLF001
        raise RuntimeError("the plan did not hold")
      return opt, p, pk, plan, reset

    opt, p, pk, plan, reset = made()
    opt2, p2, _, _, reset2 = made()

    def python():
      reset()
      return opt._forge_run_plan(plan, p, pk, dy, x, None)  # noqa: SLF001

    def native_arm():
      reset2()
      return native(opt2, p2, dy, x, None)

    def loop():
      reset()
      return True

    arms = {"python": python, "native": native_arm, "loop": loop}
    out = {name: [] for name in arms}
    for _ in range(rounds):
      for name, f in arms.items():
        t0 = time.perf_counter()
        took = sum(bool(f()) for _ in range(calls))
        out[name].append((time.perf_counter() - t0) / calls * 1e6)
        if took != calls:
          raise RuntimeError(f"{name}: {calls - took} of {calls} calls did "
                             "not take the plan")
    return out
  finally:
    undo()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file,
                 default="out/bench/plan_checks.csv")
  p.add_argument("--rounds", type=common.positive_int, default=7)
  p.add_argument("--calls", type=common.positive_int, default=20000)
  p.add_argument("--build-dir", type=paths.out_dir, default=None,
                 help="where the native path is built (default: torch's "
                      "extensions cache)")
  args = p.parse_args(argv)
  try:
    import torch  # noqa: PLC0415,F401
  except ImportError as e:
    print(f"benchmarks/plan_checks.py needs torch ({e}); install the "
          "'torch' extra. Nothing measured.", file=sys.stderr)
    return 2
  try:
    runs = measure(args.rounds, args.calls, args.build_dir)
  except _Unbuilt as e:
    print(f"benchmarks/plan_checks.py: {e}. Nothing measured.",
          file=sys.stderr)
    return 2
  res = common.Results(args.out, "plan_checks",
                       device=f"cpu:{platform.machine()}")
  for arm, v in runs.items():
    q = _quantiles(v)
    res.add("an update plan's per-update path, launch stood in", arm,
            "Linear(16, 16) weight, (4, 8, 16) operands", "bfloat16",
            "call_time", q, "us per call")
    print(f"{arm:7s} p50 {q[1]:6.2f} us per call "
          f"(rounds: {' '.join(f'{a:.2f}' for a in v)})")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
