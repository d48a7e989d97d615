"""Host time per fused-kernel launch: a jitted chain of N fused updates
against the same chain as XLA's GEMM + AdamW.

    ./dev.sh python -m benchmarks.launch_overhead --out L.csv [--plot L.png]

Why. Timed paired (``e2e_paired``), the unrolled decoder's fused step is as
fast as optax's when steps are dispatched back to back, and slower when each
step is blocked on: the difference is time the GPU waits for the host. This
script isolates the launches (on the H200 a fused kernel's launch costs
what XLA's launches of a layer cost: docs/benchmarks.md, "Where the time
goes in a step"). One jitted function updates N independent
layers (``x`` shared, a ``dy`` per layer, so that XLA cannot merge the
layers' GEMMs into one; each layer's bf16 ``W``, ``m`` and ``v`` donated
and fed back every call, as a training step does) either with N calls of
``fused_wgrad_update`` (N kernel launches) or with N ``dot(x.T, dy)`` + the
rule's AdamW (XLA's GEMM and its fusions per layer; XLA may still fuse
several layers' AdamW into one kernel, as it does in a training step).

Per arm and N, per layer (the chain's time divided by N), µs:

  dispatch   host time until the jitted call returns, the GPU idle before it
  synced     the call and a block on its result: the dispatch, the GPU's
             work and any wait of the GPU on the host
  pipelined  ``--reps`` calls back to back, one block after the last: the
             GPU's pace when the host runs ahead
  kernels    on a GPU only: the GPU time of the chain's kernels, summed
             over ``--reps`` calls in a ``jax.profiler`` trace (one value);
             ``synced`` minus ``kernels`` is what the GPU did not spend
             running the chain's kernels (launch gaps, waits on the host)
  launches   on a GPU only: the kernels of that trace per layer (XLA may
             fuse several layers' AdamW into one kernel: below one)

p20/p50/p80 over ``--reps`` calls (pipelined: one value). The summary
prints the fused arm's excess over XLA's per layer in each. Backend:
``--backend`` (default ``mosaic_gpu`` on a GPU, ``triton`` in interpret
mode elsewhere, where the times mean nothing but the script runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from benchmarks import common, paths  # noqa: E402
from benchmarks.kernel import hparams  # noqa: E402

METRICS = ("dispatch", "synced", "pipelined")
GPU_METRICS = ("kernels", "launches")  # from a profiler trace: GPU only
UNITS = {"launches": "kernels per layer"}  # the others: "us"


def _shape(text: str) -> tuple[int, int]:
  """argparse ``type=`` for ``--shapes``: :func:`common.parse_shape`."""
  try:
    return common.parse_shape(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e).removeprefix("--shapes: "))


def _lists(out):
  """``[(w, (m, v)), ...]`` as the lists ``(ws, ms, vs)``."""
  return ([w for w, _ in out], [m for _, (m, _) in out],
          [v for _, (_, v) in out])


def chains(backend: str):
  """The two arms: functions of ``(x, dys, ws, ms, vs, h)`` (a ``dy`` per
  layer) returning the updated ``(ws, ms, vs)`` lists."""

  def fused(x, dys, ws, ms, vs, h):
    return _lists([pk.fused_wgrad_update(x, dy, w, (m, v), h, rule=pk.ADAMW,
                                         backend=backend)
                   for dy, w, m, v in zip(dys, ws, ms, vs)])

  def xla(x, dys, ws, ms, vs, h):  # a bf16 G, as the standard path stores it
    return _lists([pk.ADAMW.apply(jnp.dot(x.T, dy), w, (m, v), h)
                   for dy, w, m, v in zip(dys, ws, ms, vs)])

  return {"fused": fused, "xla": xla}


def time_chain(fn, n: int, shape, reps: int, seed: int = 0,
               kernels: bool = False) -> dict:
  """Per-layer dispatch, synced (p20/p50/p80 over ``reps`` calls) and
  pipelined times of ``fn`` over ``n`` layers, in µs; with ``kernels``
  (a GPU), also the GPU time of the calls' kernels and their count per
  layer (``launches``), from a profiler trace."""
  bt, n_in, n_out = shape
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (bt, n_in), jnp.bfloat16)
  dys = [jax.random.normal(jax.random.fold_in(k[1], i), (bt, n_out),
                           jnp.bfloat16) for i in range(n)]
  ws = [jax.random.normal(jax.random.fold_in(k[2], i), (n_in, n_out),
                          jnp.bfloat16) for i in range(n)]
  ms = [jnp.zeros((n_in, n_out), jnp.bfloat16) for _ in range(n)]
  vs = [jnp.zeros((n_in, n_out), jnp.bfloat16) for _ in range(n)]
  h = hparams()
  step = jax.jit(fn, donate_argnums=(2, 3, 4))
  for _ in range(3):  # compile and warm up
    ws, ms, vs = step(x, dys, ws, ms, vs, h)
  jax.block_until_ready(ws)
  dispatch, synced = [], []
  for _ in range(reps):
    t0 = time.perf_counter()
    ws, ms, vs = step(x, dys, ws, ms, vs, h)
    t1 = time.perf_counter()
    jax.block_until_ready(ws)
    t2 = time.perf_counter()
    dispatch.append(t1 - t0)
    synced.append(t2 - t0)
  t0 = time.perf_counter()
  for _ in range(reps):
    ws, ms, vs = step(x, dys, ws, ms, vs, h)
  jax.block_until_ready(ws)
  pipelined = (time.perf_counter() - t0) / reps

  def per_layer_us(values):
    return common.quantiles([v * 1e6 / n for v in values])

  got = {"dispatch": per_layer_us(dispatch), "synced": per_layer_us(synced),
         "pipelined": per_layer_us([pipelined])}
  if kernels:  # the donated step itself, traced
    def run():
      nonlocal ws, ms, vs
      for _ in range(reps):
        ws, ms, vs = step(x, dys, ws, ms, vs, h)
      jax.block_until_ready(ws)

    _, timed, _ = common.traced(run)
    got["kernels"] = per_layer_us([sum(us for _, _, us in timed) * 1e-6
                                   / reps])
    got["launches"] = common.quantiles([len(timed) / (reps * n)])
  return got


def plot(src: str, dst: str) -> int:
  """Per shape, each arm's blocked-on time per layer against N, split into
  the kernels' GPU time and the rest (the GPU outside the chain's kernels);
  without kernel rows (a run off the GPU) the blocked-on time alone. The
  newest row of each (shape, N, arm, metric) counts."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  rows = [r for r in common.read_rows(src)
          if r.get("benchmark") == "launch_overhead"]
  if not rows:
    print(f"{src} has no launch_overhead rows; nothing plotted",
          file=sys.stderr)
    return 1
  p50 = {(r["shape"], int(r["case"].removeprefix("N=")), r["provider"],
          r["metric"]): float(r["p50"]) for r in rows}  # newest last
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  arms = list(dict.fromkeys(r["provider"] for r in rows))
  fig, axes = plt.subplots(1, len(shapes), squeeze=False,
                           figsize=(5 * len(shapes), 4.2))
  for ax, shape in zip(axes[0], shapes):
    ns = sorted({n for s, n, _, _ in p50 if s == shape})
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
      xs = [j + i * width for j in range(len(ns))]
      synced = [p50.get((shape, n, arm, "synced"), 0.0) for n in ns]
      kernels = [p50.get((shape, n, arm, "kernels")) for n in ns]
      if all(k is not None for k in kernels):
        ax.bar(xs, kernels, width, color=f"C{i}", label=f"{arm}: kernels")
        ax.bar(xs, [t - k for t, k in zip(synced, kernels)], width,
               bottom=kernels, color=f"C{i}", alpha=0.4,
               label=f"{arm}: outside the kernels")
      else:
        ax.bar(xs, synced, width, color=f"C{i}", label=f"{arm}: synced")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ns))])
    ax.set_xticklabels([f"N={n}" for n in ns])
    ax.set_ylabel("blocked-on call per layer (µs, p50)")
    ax.set_title(shape, fontsize=9)
    ax.legend(fontsize=7)
  fig.suptitle(f"A chain of N layers' updates, fused against XLA's GEMM + "
               f"AdamW ({rows[-1]['device']})", fontsize=9)
  common.save_figure(fig, dst)
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--n", type=common.positive_int, nargs="+",
                 default=[8, 32, 113],
                 help="layers per chain (113: the 0.886 B decoder's calls)")
  p.add_argument("--tokens", type=common.positive_int, default=512,
                 help="BT, the tokens of x and dy")
  p.add_argument("--shapes", type=_shape, nargs="+", default=[(1024, 1024)],
                 metavar="SHAPE", help="each layer's in x out: NxM or a "
                 "Llama-3.1-8B shape's name (default 1024x1024: a short "
                 "kernel, so the launches show)")
  p.add_argument("--reps", type=common.positive_int, default=40)
  p.add_argument("--backend", choices=("mosaic_gpu", "triton"), default=None,
                 help="the fused arm's backend (default: mosaic_gpu on a "
                 "GPU, else triton)")
  p.add_argument("--out", type=paths.out_file,
                 default="out/bench/launch_overhead.csv")
  p.add_argument("--plot", type=paths.out_file, metavar="PNG", default=None,
                 help="also plot the CSV (its launch_overhead rows)")
  p.add_argument("--replot", action="store_true",
                 help="only plot --out to --plot; measure nothing")
  args = p.parse_args(argv)
  if args.replot:
    if not args.plot:
      p.error("--replot needs --plot PNG")
    if not os.path.exists(args.out):
      p.error(f"--replot: no CSV at {args.out}")
    return plot(args.out, args.plot)

  on_gpu = jax.devices()[0].platform == "gpu"
  backend = args.backend or ("mosaic_gpu" if on_gpu else "triton")
  if not on_gpu:
    print("no GPU: the kernels run in Pallas interpret mode; the times "
          "below measure the interpreter, not launches", file=sys.stderr)
  res = common.Results(args.out, "launch_overhead")
  arms = chains(backend)
  metrics = METRICS + (GPU_METRICS if on_gpu else ())
  if not on_gpu:
    print(f"no GPU: {', '.join(GPU_METRICS)} not measured (they are read "
          "from a GPU profiler trace)", file=sys.stderr)
  for n_in, n_out in args.shapes:
    case = (args.tokens, n_in, n_out)
    shape = f"BT={args.tokens} {n_in}x{n_out}"
    print(f"per layer, µs (p50); fused arm: backend={backend}; {shape}")
    print(f"{'N':>5} {'arm':>6} " + " ".join(f"{m:>10}" for m in metrics))
    for n in args.n:
      got = {}
      for arm, fn in arms.items():
        got[arm] = time_chain(fn, n, case, args.reps, kernels=on_gpu)
        provider = f"fused ({backend})" if arm == "fused" else "xla"
        for metric in metrics:
          res.add(f"N={n}", provider, shape, "w=bf16,m/v=bf16", metric,
                  got[arm][metric], UNITS.get(metric, "us"))
        print(f"{n:>5} {arm:>6} "
              + " ".join(f"{got[arm][m][1]:>10.2f}" for m in metrics))
      print(f"{n:>5} {'excess':>6} " + " ".join(
          f"{got['fused'][m][1] - got['xla'][m][1]:>+10.2f}" for m in metrics))
  print(f"wrote {args.out}")
  if args.plot:
    return plot(args.out, args.plot)
  return 0


if __name__ == "__main__":
  sys.exit(main())
