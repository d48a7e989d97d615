"""Where the e2e step's GPU time goes: FORGE vs optax.adamw, kernel by kernel.

    ./dev.sh python -m benchmarks.e2e_profile --bt 512 --out P.csv [--scan]

Builds the arms of ``benchmarks/e2e.py`` (the same Llama-style decoder,
batch and AdamW; ``--scan``: its blocks scanned, as ``e2e.py --scan``),
runs a few warm-up steps, then traces ``--steps`` steps of
each with ``jax.profiler.trace`` (dispatched back to back, or each blocked
on with ``--synced``) and reads the GPU kernels from the trace (Perfetto
JSON; ``--keep-trace DIR`` keeps it). Per arm and per step it reports the
GPU time of each kernel category -- the fused FORGE kernel, GEMMs,
attention, XLA's other fusions, copies -- the GPU's busy time, its idle
time between the traced steps' first and last kernel, and the step's wall
time (wall minus busy is time the GPU waits on the host); per arm the
largest idle gaps with the kernels around them; and the kernels whose time
differs most between the arms. Rows go to ``--out`` (benchmark
``e2e_profile``; metric ``gpu_time`` per category, ``gpu_busy``,
``gpu_idle``, ``step_wall``, ``kernel_time`` per kernel name, ms per step;
``--synced`` marks the shape "synced").
The arms run one after the other in this process (each state is freed
first). GPU only: on another backend it says so and exits 1.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import jax  # noqa: E402

from benchmarks import common, e2e, paths  # noqa: E402

# First match wins: a kernel's category from its name.
CATEGORIES = (
    # (The Triton kernel is named after its rule; every Mosaic GPU kernel
    # of a FORGE step is one: Pallas names them anonymous_mosaic_gpu_kernel.)
    ("forge kernel", re.compile(r"fused_wgrad|mosaic_gpu", re.I)),
    # The fused kernel's epilogue on an XLA-formed G (stacked wgrad="xla").
    ("forge stored-G update", re.compile(r"stored_g_update", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn|attention|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|sm90_|sm80_",
                        re.I)),
    ("copy/memset", re.compile(r"memcpy|memset|copy", re.I)),
)
OTHER = "xla fusions, other"
HOST_TOP = 20  # host events listed for the longest idle gap


def category(name: str) -> str:
  for cat, pattern in CATEGORIES:
    if pattern.search(name):
      return cat
  return OTHER


def profile_arm(arm: str, cfg: e2e.Config, bt: int, steps: int,
                warmup: int, synced: bool = False,
                keep: str | None = None) -> dict:
  step, tx = e2e.build_arm(arm, cfg)
  batch = e2e.make_batch(cfg, bt // cfg.seq)
  variables = e2e.init_variables(cfg)
  opt_state = jax.jit(tx.init)(variables["params"])
  jitted = jax.jit(step, donate_argnums=(0, 1))
  for _ in range(warmup):
    loss, variables, opt_state = jitted(variables, opt_state, batch)
  jax.block_until_ready((loss, variables, opt_state))
  def run():
    nonlocal loss, variables, opt_state
    t0 = time.perf_counter()
    for _ in range(steps):
      loss, variables, opt_state = jitted(variables, opt_state, batch)
      if synced:
        jax.block_until_ready((loss, variables, opt_state))
    jax.block_until_ready((loss, variables, opt_state))
    return (time.perf_counter() - t0) * 1e3 / steps

  wall_ms, kernels, host = common.traced(
      run, keep=os.path.join(keep, arm) if keep else None)
  del variables, opt_state
  span_us, union_us, gaps = common.idle_gaps(kernels)
  # The host's work while the GPU sat idle longest (in a --synced run: the
  # time from one step's last kernel to the next step's first).
  during = []
  if gaps:
    gap_us, _, _, start = gaps[0]
    during = [(name, n, us / 1e3) for name, n, us in
              common.overlap_by_name(host, start, start + gap_us)]
  per_step = common.per_step_kernels(kernels, steps)
  by_name = {name: us / 1e3 for name, _, us in per_step}
  by_cat = collections.defaultdict(float)
  for name, ms in by_name.items():
    by_cat[category(name)] += ms
  return dict(wall_ms=wall_ms, busy_ms=sum(by_name.values()),
              idle_ms=(span_us - union_us) / 1e3 / steps,
              gaps=[(us / 1e3, a, b) for us, a, b, _ in gaps],
              host_in_gap=during,
              by_cat=dict(by_cat), by_name=dict(by_name),
              per_step={name: n for name, n, _ in per_step},
              n_kernels=len(kernels) / steps)


def report(results: dict, top: int, gap_top: int = 10) -> None:
  arms = list(results)
  cats = [c for c, _ in CATEGORIES] + [OTHER]
  print(f"\nGPU time per step (ms){'':14}" + "".join(f"{a:>10}" for a in arms)
        + f"{'diff':>10}")
  rows = [(c, [results[a]["by_cat"].get(c, 0.0) for a in arms]) for c in cats]
  rows += [("GPU busy", [results[a]["busy_ms"] for a in arms]),
           ("GPU idle within the traced steps",
            [results[a]["idle_ms"] for a in arms]),
           ("step wall time", [results[a]["wall_ms"] for a in arms]),
           ("kernels per step", [results[a]["n_kernels"] for a in arms])]
  for label, vals in rows:
    diff = vals[0] - vals[-1] if len(vals) > 1 else float("nan")
    print(f"  {label:<34}" + "".join(f"{v:10.3f}" for v in vals)
          + f"{diff:10.3f}")
  for arm in arms:
    gaps = results[arm]["gaps"][:gap_top]
    if not gaps:
      continue
    print(f"\n{arm}: the largest GPU idle gaps in the traced steps (ms "
          f"each; the kernels before and after):")
    for ms, before, after in gaps:
      print(f"  {ms:8.3f}  {before[:50]}  ->  {after[:50]}")
    print(f"  the host's work during the largest gap ({gaps[0][0]:.3f} ms; "
          f"ms inside it, calls; nested events each count):")
    for name, n, ms in results[arm]["host_in_gap"][:HOST_TOP]:
      print(f"    {ms:8.3f}  x{n:<4d} {name[:70]}")
  if len(arms) < 2:
    return
  a, b = arms[0], arms[-1]
  names = set(results[a]["by_name"]) | set(results[b]["by_name"])
  diffs = sorted(names, key=lambda n: -abs(results[a]["by_name"].get(n, 0)
                                          - results[b]["by_name"].get(n, 0)))
  print(f"\nkernels differing most ({a} - {b}, ms per step; calls per step):")
  for n in diffs[:top]:
    va, vb = (results[x]["by_name"].get(n, 0.0) for x in (a, b))
    ca, cb = (results[x]["per_step"].get(n, 0) for x in (a, b))
    print(f"  {va - vb:+8.3f}  {a} {va:7.3f} ({ca:4.0f})  {b} {vb:7.3f} "
          f"({cb:4.0f})  [{category(n)}] {n[:90]}")


def main(argv=None) -> int:
  d = e2e.Config()
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--bt", type=common.positive_int, default=512)
  p.add_argument("--arms", nargs="+", default=["forge", "optax"],
                 choices=e2e.ARMS)
  p.add_argument("--layers", type=common.positive_int, default=d.layers)
  p.add_argument("--scan", action="store_true",
                 help="the blocks scanned (ScannedBlocks against flax's "
                 "nn.scan(nn.remat) + optax), as e2e.py --scan")
  p.add_argument("--steps", type=common.positive_int, default=5)
  p.add_argument("--warmup", type=common.positive_int, default=3)
  p.add_argument("--top", type=common.non_negative_int, default=25,
                 help="kernels listed (those differing most between arms); "
                 "also the idle gaps listed per arm, at most 10")
  p.add_argument("--synced", action="store_true",
                 help="block on every step's result (as e2e_paired's "
                 "synced steps) instead of dispatching the steps back to "
                 "back")
  p.add_argument("--keep-trace", type=paths.out_dir, metavar="DIR",
                 default=None,
                 help="copy each arm's trace (Perfetto JSON) to DIR/ARM/")
  p.add_argument("--out", type=paths.out_file,
                 default="out/bench/e2e_profile.csv")
  args = p.parse_args(argv)
  cfg = e2e.Config(layers=args.layers, scan=args.scan)
  if args.bt % cfg.seq:
    p.error(f"--bt {args.bt} is not a multiple of seq={cfg.seq}")
  if jax.default_backend() != "gpu":
    print("benchmarks/e2e_profile.py needs a GPU (it reads the GPU kernels "
          "of a trace); nothing measured.", file=sys.stderr)
    return 1
  results = {}
  for arm in args.arms:
    results[arm] = profile_arm(arm, cfg, args.bt, args.steps, args.warmup,
                               synced=args.synced, keep=args.keep_trace)
    if not results[arm]["by_name"]:
      print(f"{arm}: the trace holds no GPU kernels (backend "
            f"{jax.default_backend()}); nothing to report", file=sys.stderr)
      return 1
  print(f"device {common.device_name()}; {common.versions()}; BT={args.bt}, "
        f"{cfg.layers} layers{' (scanned)' if cfg.scan else ''}; "
        f"{args.steps} traced steps per arm"
        f"{', each blocked on' if args.synced else ', back to back'}")
  report(results, args.top, gap_top=min(args.top, 10))
  res = common.Results(args.out, "e2e_profile")
  shape = (f"L{cfg.layers} d{cfg.d_model} BT={args.bt}"
           f"{' scanned' if cfg.scan else ''}"
           f"{' synced' if args.synced else ''}")
  for arm, r in results.items():
    add = lambda case, metric, ms: res.add(case, arm, shape, cfg.dtype,
                                           metric, ms, "ms")
    for cat, ms in r["by_cat"].items():
      add(cat, "gpu_time", ms)
    add("all kernels", "gpu_busy", r["busy_ms"])
    add("between kernels", "gpu_idle", r["idle_ms"])
    add("step", "step_wall", r["wall_ms"])
    for name, ms in r["by_name"].items():
      add(name[:200], "kernel_time", ms)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
