"""An update plan's per-update checks in Python and in C++, on the CPU.

    ./dev.sh python -m benchmarks.plan_checks --out O.csv

forge_torch's managed layer spends most of its backward's host time in the
checks an update plan makes before it launches the fused kernel again
(``_ForgeOptimizer._forge_run_plan``, its relaunch and step advance). This
probe times that path on one ``Linear(16, 16)`` bf16 weight with
``(4, 8, 16)`` operands, the direct launch stood in for (as
``benchmarks.torch_overhead --launch direct`` does), against a C++
function (``benchmarks/plan_checks.cpp``, built by
``torch.utils.cpp_extension.load``: it needs a C++ compiler and ninja)
that reads what the Python path reads for its checks -- the updated mark,
the group list and dict, the state dict, step and slots by identity, the
step count's version and pointer, the group's options by identity under
the same names, the operands' rows, columns and dtypes, the weight's and
slots' shapes, density and dtype, the pointers and their alignment --
bumps the versions and sets the mark. It leaves out the scalars' lookup
and hyperparameter ring, the group's device, the first-update snapshot,
the current-device and capture checks and the launch call: a lower bound
for a C++ path, not one. Each arm runs on its own optimizer (their step
counts apart); every timed call must take its plan (each call's updated
mark is dropped first). Rows: ``plan_checks``, metric ``call_time``, per
arm (``python``, ``c++``, ``loop``: the mark's drop alone), p20/p50/p80
over ``--rounds`` rounds of ``--calls`` calls.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from benchmarks import common, paths

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "plan_checks.cpp")


def _quantiles(v):
  v = sorted(v)
  pick = lambda q: v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]  # noqa: E731
  return pick(0.2), statistics.median(v), pick(0.8)


def measure(rounds: int, calls: int, build_dir: str | None) -> dict:
  """Microseconds per call of each arm, one list entry per round."""
  import torch  # noqa: PLC0415
  from torch.utils import cpp_extension  # noqa: PLC0415

  import forge_torch  # noqa: PLC0415
  from forge_torch import _direct, optim as fo  # noqa: PLC0415
  from benchmarks import torch_overhead  # noqa: PLC0415

  hot = cpp_extension.load(name="forge_plan_checks", sources=[SOURCE],
                           extra_cflags=["-O2"], build_directory=build_dir,
                           verbose=False)
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
      return layer, opt, p, pk, plan, opt._forge_updated._values  # noqa: SLF001

    _, opt, p, pk, plan, upd = made()
    _, opt2, p2, pk2, plan2, upd2 = made()
    st, group = opt2.state[p2], opt2.param_groups[0]
    c = hot.Plan()
    c.config, c.group, c.state, c.step, c.updated = (None, group, st,
                                                     st["step"], upd2)
    c.names, c.options = tuple(group), tuple(group.values())
    c.slot_names = list(plan2.rule.slots)
    c.slots = [st[n] for n in plan2.rule.slots]
    c.index, c.n_in, c.n_out, c.rows_x, c.rows_dy = 0, 16, 16, 32, 32
    c.set_dtype(x)
    c.set_step_ptr()
    c.step_version, c.step_value = st["step"]._version, 0

    def python():
      upd.pop(pk, None)
      return opt._forge_run_plan(plan, p, pk, dy, x, None)  # noqa: SLF001

    def cpp():
      upd2.pop(pk2, None)
      return hot.run_plan(c, opt2, p2, pk2, dy, x, None, None)

    def loop():
      upd.pop(pk, None)
      return True

    arms = {"python": python, "c++": cpp, "loop": loop}
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
                 help="where the C++ extension is built (default: torch's "
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
  except (OSError, RuntimeError, ImportError) as e:
    if "ninja" in str(e).lower() or "compil" in str(e).lower() or (
        "command" in str(e).lower()):
      print("benchmarks/plan_checks.py: the C++ arm could not be built "
            f"(it needs a C++ compiler and ninja): {e}. Nothing measured.",
            file=sys.stderr)
      return 2
    raise
  res = common.Results(args.out, "plan_checks",
                       device=f"cpu:{platform.machine()}")
  for arm, v in runs.items():
    q = _quantiles(v)
    res.add("an update plan's per-update checks, launch stood in", arm,
            "Linear(16, 16) weight, (4, 8, 16) operands", "bfloat16",
            "call_time", q, "us per call")
    print(f"{arm:7s} p50 {q[1]:6.2f} us per call "
          f"(rounds: {' '.join(f'{a:.2f}' for a in v)})")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
