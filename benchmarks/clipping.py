r"""Global-norm clipping: the two-pass FORGE step against optax's clipped step.

    ./dev.sh python -m benchmarks.clipping --out out/bench/clipping.csv \
        --plot out/bench/clipping.png
    ./dev.sh python -m benchmarks.clipping --replot \
        --out benchmarks/results/h200/clipping.csv \
        --plot benchmarks/results/h200/clipping.png

Per model (`--models`: `layer`, one bf16 `width`x`width` Dense; `mlp`,
`--layers` of them unrolled with ReLUs; `scan`, a ScannedDenseStack of
`--layers`) at BT `--tokens`, every arm a jitted, donated AdamW training
step on mean(model(x)^2), timed in a `fori_loop` (common.time_loop):

  optax            jax.value_and_grad + optax.adamw
  optax_clipped    the same with optax.chain(optax.clip_by_global_norm(m), ...)
  forge            forge_jax.make_step + forge_jax.adamw
  forge_clipped    make_step + optax.chain(forge_jax.clip_by_global_norm(m),
                   forge_jax.adamw(...)): a norm pass, then the fused update

with each compiled step's temporaries (memory_analysis) and weight-gradient
GEMMs in its optimized HLO (benchmarks.memory.weight_gradient_gemms), and
the ratios forge_clipped / forge (the cost of clipping) and optax_clipped /
forge_clipped (> 1: the clipped FORGE step is faster). `m` is 1.0, small
enough that every step clips. It also times the norm kernel alone,
pallas_kernels.wgrad_sqnorm, against XLA's sum((x^T dy)^2) at the layer's
shape. Without a GPU it measures nothing unless `--smoke` (tiny shapes,
Pallas interpret mode: a test of this script; its times mean nothing).

`--plot PNG` draws the CSV (:func:`plot`: per model, the four arms' step
time and compiled temporaries); `--replot` only draws an existing `--out`
CSV, on any machine, and measures nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import forge_jax
import pallas_kernels as pk
from benchmarks import common, paths
from benchmarks.memory import weight_gradient_gemms

ARMS = ("optax", "optax_clipped", "forge", "forge_clipped")
MODELS = ("layer", "mlp", "scan")
MAX_NORM = 1.0


class Unrolled(nn.Module):
  """``layers`` bf16 Dense layers ``width -> width``, ReLU between them."""
  width: int
  layers: int

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = forge_jax.Dense(self.width, use_bias=False, dtype=jnp.bfloat16,
                          param_dtype=jnp.bfloat16)(x)
      if i < self.layers - 1:
        x = nn.relu(x)
    return x


def model_for(name: str, width: int, layers: int) -> nn.Module:
  """The model of one case (FORGE layers: flax's own outside a FORGE step,
  so the optax arms run the same module)."""
  if name == "layer":
    return Unrolled(width, 1)
  if name == "mlp":
    return Unrolled(width, layers)
  return forge_jax.ScannedDenseStack(width, layers, use_bias=False,
                                     dtype=jnp.bfloat16,
                                     param_dtype=jnp.bfloat16)


def step_for(arm: str, loss_fn):
  """``(step, tx)`` of one arm."""
  if arm.startswith("optax"):
    tx = optax.adamw(1e-3)
    if arm == "optax_clipped":
      tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), tx)
    return common.optax_step(loss_fn, tx), tx
  tx = forge_jax.adamw(1e-3)
  if arm == "forge_clipped":
    tx = optax.chain(forge_jax.clip_by_global_norm(MAX_NORM), tx)
  return forge_jax.make_step(loss_fn, tx), tx


def time_arm(arm, model, x, n_inner, n_outer):
  """``(time quantiles in s, temporaries in bytes, weight-gradient GEMMs)``."""
  variables = model.init(jax.random.key(0), x)
  loss_fn = lambda v, b: jnp.mean(model.apply(v, b).astype(jnp.float32) ** 2)
  step, tx = step_for(arm, loss_fn)
  opt_state = tx.init(variables["params"])
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      variables, opt_state, x).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  gemms = len(weight_gradient_gemms(compiled.as_text(), x.shape[0],
                                    x.shape[1]))
  q, _ = common.time_loop(lambda s: step(s[0], s[1], x)[1:],
                          (variables, opt_state), n_inner, n_outer)
  return q, temp, gemms


def time_norm_kernel(res, shape, bt, width, n_inner, n_outer):
  """``pallas_kernels.wgrad_sqnorm`` against XLA's ``sum((x^T dy)^2)``."""
  kx, kd = jax.random.split(jax.random.key(1))

  def state():  # fresh arrays per arm: the timed loop donates them
    return (jax.random.normal(kx, (bt, width), jnp.bfloat16),
            jax.random.normal(kd, (bt, width), jnp.bfloat16),
            jnp.zeros((), jnp.float32))

  def xla(s):
    x, dy, acc = s
    g = jnp.dot(x.T, dy, preferred_element_type=jnp.float32)
    return x, dy, acc + jnp.sum(g * g)

  def forge(s):
    x, dy, acc = s
    return x, dy, acc + pk.wgrad_sqnorm(x, dy)

  tx, _ = common.time_loop(xla, state(), n_inner, n_outer)
  tf, _ = common.time_loop(forge, state(), n_inner, n_outer)
  res.add("norm_kernel", "xla_sum_sq", shape, "bf16", "time",
          tuple(t * 1e6 for t in tx), "us")
  res.add("norm_kernel", "wgrad_sqnorm", shape, "bf16", "time",
          tuple(t * 1e6 for t in tf), "us")
  res.add("norm_kernel", "wgrad_sqnorm", shape, "bf16", "speedup_vs_xla",
          tx[1] / tf[1], "x")
  print(f"norm kernel {shape}: xla {tx[1] * 1e6:8.1f} us  wgrad_sqnorm "
        f"{tf[1] * 1e6:8.1f} us  {tx[1] / tf[1]:.2f}x", flush=True)


def plot_rows(csv_path: str) -> dict:
  """``{(model, arm, metric): row}`` of a clipping CSV: the newest row of
  each (rows are appended, so the last in file order), for the models of
  :data:`MODELS`, the arms of :data:`ARMS` and the metrics ``time`` and
  ``temp``."""
  last = {}
  for r in common.read_rows(csv_path):
    if (r.get("benchmark") == "clipping" and r.get("case") in MODELS
        and r.get("provider") in ARMS and r.get("metric") in ("time", "temp")):
      last[(r["case"], r["provider"], r["metric"])] = r
  return last


def plot(csv_path: str, png_path: str) -> int:
  """Writes the plot of clipping CSV ``csv_path`` to ``png_path``: one panel
  of median step time (µs) and one of compiled temporaries (MiB), a group of
  bars per model, one bar per arm (the clipped arms hatched), under each
  model's name in the time panel its clipping cost (clipped / unclipped
  step time, FORGE and optax). Returns 0, or 1 (nothing written, the
  reason on stderr) when the CSV has no clipping step-time rows."""
  last = plot_rows(csv_path)
  models = [m for m in MODELS if any((m, a, "time") in last for a in ARMS)]
  if not models:
    print(f"clipping.py: {csv_path} has no clipping step-time rows (case one "
          f"of {', '.join(MODELS)}, provider one of {', '.join(ARMS)}, "
          "metric time); nothing plotted. Write it with "
          "`python -m benchmarks.clipping --out CSV`.", file=sys.stderr)
    return 1
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def p50(model, arm, metric):
    r = last.get((model, arm, metric))
    return float(r["p50"]) if r else float("nan")

  names, costs = [], []
  for m in models:
    shape = next(last[(m, a, "time")]["shape"] for a in ARMS
                 if (m, a, "time") in last)
    names.append(shape.replace(" BT=", "\nBT="))
    cost = [f"{who} {p50(m, a + '_clipped', 'time') / p50(m, a, 'time'):.2f}x"
            for who, a in (("FORGE", "forge"), ("optax", "optax"))]
    cost = ", ".join(c for c in cost if "nan" not in c)
    costs.append(f"\nclipped / unclipped:\n{cost}" if cost else "")
  colors = {"optax": "gray", "forge": "tab:orange"}
  panels = (("time", "median step time (µs)"),
            ("temp", "compiled temporaries (MiB)"))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
  width = 0.8 / len(ARMS)
  for ax, (metric, ylabel) in zip(axes, panels):
    for i, arm in enumerate(ARMS):
      vals = [p50(m, arm, metric) for m in models]  # no row: no bar, not 0
      bars = ax.bar([j + i * width for j in range(len(models))], vals, width,
                    label=arm, color=colors[arm.split("_")[0]],
                    hatch="//" if arm.endswith("_clipped") else None,
                    edgecolor="black", linewidth=0.5)
      ax.bar_label(bars, labels=["" if v != v else f"{v:.0f}" for v in vals],
                   fontsize=7)
    ax.set_xticks([j + width * (len(ARMS) - 1) / 2
                   for j in range(len(models))])
    ax.set_xticklabels([n + (c if metric == "time" else "")
                        for n, c in zip(names, costs)], fontsize=7)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
  rows = list(last.values())
  device = ", ".join(sorted({r["device"] for r in rows}))
  commit = ", ".join(sorted({r["commit"] for r in rows}))
  fig.suptitle("Exact global-norm clipping: bf16 layers, AdamW, max_norm "
               f"{MAX_NORM:g} (every step clips); {device}, commit {commit}",
               fontsize=9)
  common.save_figure(fig, png_path)
  return 0


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file, default="out/bench/clipping.csv")
  p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
  p.add_argument("--width", type=common.positive_int, default=4096)
  p.add_argument("--layers", type=common.positive_int, default=4)
  p.add_argument("--tokens", type=common.positive_int, default=512)
  p.add_argument("--inner", type=common.positive_int, default=20,
                 help="steps per timed fori_loop call")
  p.add_argument("--outer", type=common.positive_int, default=7,
                 help="timed calls")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, CPU allowed (Pallas interpret mode): a "
                 "test of this script; its times mean nothing")
  p.add_argument("--plot", type=paths.out_file, default=None, metavar="PNG",
                 help="draw --out (after measuring) into this PNG")
  p.add_argument("--replot", action="store_true",
                 help="only draw an existing --out CSV into --plot; measure "
                 "nothing (any machine)")
  args = p.parse_args(argv)
  if args.replot:
    if not args.plot:
      p.error("--replot needs --plot PNG (where to draw --out)")
    if not os.path.exists(args.out):
      p.error(f"--replot: no CSV at {args.out}")
    return plot(args.out, args.plot)
  if args.smoke:
    args.width, args.layers, args.tokens = 48, 2, 24
    args.inner, args.outer = 2, 1
  elif jax.default_backend() != "gpu":
    print("benchmarks/clipping.py needs a GPU (or --smoke); nothing "
          "measured.", file=sys.stderr)
    return 1
  res = common.Results(args.out, "clipping")
  bt, width = args.tokens, args.width
  x = jax.random.normal(jax.random.key(2), (bt, width), jnp.bfloat16)
  for name in args.models:
    model = model_for(name, width, args.layers)
    layers = 1 if name == "layer" else args.layers
    shape = f"{name} L={layers} BT={bt} {width}x{width}"
    times = {}
    for arm in ARMS:
      q, temp, gemms = time_arm(arm, model, x, args.inner, args.outer)
      times[arm] = q[1]
      res.add(name, arm, shape, "bf16", "time", tuple(t * 1e6 for t in q),
              "us")
      res.add(name, arm, shape, "bf16", "temp", temp / 2**20, "MiB")
      res.add(name, arm, shape, "bf16", "wgrad_gemms", gemms, "count")
      print(f"{shape} {arm:14s} {q[1] * 1e6:9.1f} us  temp "
            f"{temp / 2**20:8.1f} MiB  weight-gradient GEMMs {gemms}",
            flush=True)
    ratios = {
        "clip_cost_vs_forge": times["forge_clipped"] / times["forge"],
        "clip_cost_vs_optax": times["optax_clipped"] / times["optax"],
        "speedup_vs_optax_clipped": (times["optax_clipped"]
                                     / times["forge_clipped"]),
    }
    for metric, value in ratios.items():
      res.add(name, "forge_clipped", shape, "bf16", metric, value, "x")
    print(f"{shape}: clipped/unclipped forge {ratios['clip_cost_vs_forge']:.2f}x"
          f", optax {ratios['clip_cost_vs_optax']:.2f}x; optax clipped / "
          f"forge clipped {ratios['speedup_vs_optax_clipped']:.2f}x",
          flush=True)
  time_norm_kernel(res, f"BT={bt} {width}x{width}", bt, width, args.inner,
                   args.outer)
  return plot(args.out, args.plot) if args.plot else 0


if __name__ == "__main__":
  sys.exit(main())
