"""FORGE vs optax, side by side, on scikit-learn's digits.

Trains one small Flax MLP classifier twice, from the same initialisation and
on the same batches:

* arm ``forge``: layers are :class:`forge_jax.Dense`, the optimizer is
  :func:`forge_jax.adamw` and the step is :func:`forge_jax.make_step` (jitted,
  parameters and optimizer state donated) -- each kernel is updated inside its
  own backward by the fused Pallas kernel, and its gradient never exists;
* arm ``optax``: the same model with :class:`flax.linen.Dense`,
  :func:`optax.adamw` and a plain jitted ``value_and_grad`` + update step.

Same hyperparameters in both (AdamW, warmup-cosine learning rate, weight decay
masked off the biases). On the CPU the Pallas kernel runs in interpret mode;
on a GPU it is compiled (Mosaic GPU on Hopper where the autotune cache
measured it faster for the case, else Triton: ``pallas_kernels.
select_backend``), and the demo also reports each arm's step time and the
compiled step's memory.

Run from the repository root (``./dev.sh train [flags]`` runs it too)::

  python -m examples.train_digits                   # fp32: each step agrees
  python -m examples.train_digits --dtype bfloat16  # bf16 params: the gap

Writes ``<out>/losses.csv`` (step, arm, loss) and ``<out>/losses.png``: the
two arms' training losses, their per-step difference (parameters and loss,
log scale) and both arms' test accuracy during training.

What is checked (fp32): at every step, optax's step is also run from the
forge arm's own state (its parameters and optimizer state, copied) on the
same batch, and the two updated parameter trees and optimizer states must
agree to the project's fp32 bar, 1e-5 relative (``norm_rel`` of
:func:`param_diff`, leaf by leaf): FORGE's step is optax's. The
two trajectories are reported too but not held to it: the arms' rounding
differs (FORGE sums ``G`` in another order), and training compounds such
differences, by orders of magnitude where the learning rate makes it
unstable. The exit status is 1 if a step differs by more than 1e-5 or a
loss is not finite.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import tempfile
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Sequence

# The Triton backend of Pallas is deprecated since jax 0.11 (id
# ``jax-pallas-triton``; the message does not contain the id). It is what this
# project targets, so keep the warning out of the demo's output.
warnings.filterwarnings(
    "ignore", message=r"The Pallas Triton backend is deprecated",
    category=DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import forge_jax  # noqa: E402
from benchmarks.common import timed_steps  # noqa: E402

# One step from the same state, forge against optax (param_diff's norm_rel
# of the new parameters and of the new optimizer state): the project's fp32
# parity bar.
FP32_TOLERANCE = 1e-5
ARMS = ("forge", "optax")


# --------------------------------------------------------------------------
# Data and model


def load_digits_split(seed: int, test_fraction: float = 0.2):
  """Standardised digits features (fit on the train split) and int labels."""
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split
  from sklearn.preprocessing import StandardScaler

  x, y = load_digits(return_X_y=True)
  x_tr, x_te, y_tr, y_te = train_test_split(
      x.astype(np.float32), y.astype(np.int32), test_size=test_fraction,
      random_state=seed, stratify=y)
  scaler = StandardScaler().fit(x_tr)
  return ((scaler.transform(x_tr).astype(np.float32), y_tr),
          (scaler.transform(x_te).astype(np.float32), y_te))


def batch_indices(n: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
  """``(steps, batch_size)`` row indices: shuffled epochs, last partial batch
  of each epoch dropped."""
  if batch_size > n:
    raise ValueError(f"--batch-size {batch_size} exceeds the {n} train rows")
  rng = np.random.default_rng(seed)
  per_epoch = n // batch_size
  out = []
  while len(out) < steps:
    perm = rng.permutation(n)
    out.extend(perm[i * batch_size:(i + 1) * batch_size]
               for i in range(per_epoch))
  return np.stack(out[:steps])


class MLP(nn.Module):
  """``in -> hidden -> hidden -> classes`` with ReLU; ``dense`` is the layer
  class (``flax.linen.Dense`` or ``forge_jax.Dense``), the only difference
  between the arms' models. Layers compute in ``param_dtype`` (bf16 params:
  bf16 activations and gradients, as in bf16 training); logits are cast to
  fp32 for the loss."""

  dense: Callable[..., nn.Module]
  hidden: int
  classes: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=self.param_dtype, param_dtype=self.param_dtype)
    x = nn.relu(self.dense(self.hidden, **kw)(x))
    x = nn.relu(self.dense(self.hidden, **kw)(x))
    return self.dense(self.classes, **kw)(x)


def make_loss(model: nn.Module):
  def loss_fn(variables, batch):
    x, y = batch
    logits = model.apply(variables, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss_fn


def decay_mask(params):
  """Weight decay on kernels only (not on biases)."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def make_schedule(lr: float, steps: int) -> optax.Schedule:
  warmup = max(1, steps // 10)
  return optax.warmup_cosine_decay_schedule(
      init_value=lr / 10, peak_value=lr, warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1), end_value=lr / 100)


# --------------------------------------------------------------------------
# The two arms


def build_arms(hidden: int, classes: int, param_dtype, lr: float,
               weight_decay: float, steps: int):
  """``{arm: (jitted step, optimizer)}``; a step is
  ``(variables, opt_state, batch) -> (loss, variables, opt_state)``."""
  schedule = make_schedule(lr, steps)
  hp = dict(weight_decay=weight_decay, mask=decay_mask)

  # forge: forge_jax.Dense + forge_jax.adamw + forge_jax.make_step.
  forge_model = MLP(forge_jax.Dense, hidden, classes, param_dtype)
  forge_tx = forge_jax.adamw(schedule, **hp)
  forge_step = jax.jit(forge_jax.make_step(make_loss(forge_model), forge_tx),
                       donate_argnums=(0, 1))

  # optax: flax.linen.Dense + optax.adamw, plain value_and_grad + update.
  optax_model = MLP(nn.Dense, hidden, classes, param_dtype)
  optax_tx = optax.adamw(schedule, **hp)
  optax_loss = make_loss(optax_model)

  def optax_step_fn(variables, opt_state, batch):
    loss, grads = jax.value_and_grad(optax_loss)(variables, batch)
    updates, opt_state = optax_tx.update(grads["params"], opt_state,
                                         variables["params"])
    params = optax.apply_updates(variables["params"], updates)
    return loss, {**variables, "params": params}, opt_state

  # Donated too, so that the two arms' memory figures compare like with like.
  optax_step = jax.jit(optax_step_fn, donate_argnums=(0, 1))
  return ({"forge": (forge_step, forge_tx), "optax": (optax_step, optax_tx)},
          optax_model)


def rel_norm(a, b) -> float:
  """``||a - b|| / ||b||`` of two arrays, in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b)) / max(float(np.linalg.norm(b)), 1e-30)


def worst(values) -> float:
  """The largest of ``values`` (0.0 for none), NaN if any is NaN."""
  return max(values, default=0.0, key=lambda r: (math.isnan(r), r))


def param_diff(a, b) -> dict[str, Any]:
  """Largest difference between two parameter trees, over every leaf.

  ``max_abs``: ``max |a - b|`` over all elements of all leaves (NaN if any
  difference is NaN, and likewise ``max_rel``).
  ``max_rel``: the largest per-leaf ``max |a - b| / max |b|`` (a leaf's
  difference relative to its own scale; elementwise ratios are meaningless
  for entries that pass near zero). ``worst_leaf``: where ``max_rel`` is.
  ``norm_rel``: the largest per-leaf ``||a - b|| / ||b||``, the relative
  error tests/tolerances.py's table bounds (an element whose gradient is
  near zero, which Adam's normalised step moves by about the learning rate
  whatever its sign, weighs in it as one element).
  """
  flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
  flat_b = jax.tree.leaves(b)
  max_abs, max_rel, worst_leaf, norms = 0.0, 0.0, "", []
  for (path, x), y in zip(flat_a, flat_b, strict=True):
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    norms.append(rel_norm(x, y))
    d = float(np.max(np.abs(x - y)))
    scale = float(np.max(np.abs(y)))
    r = d / (scale if math.isnan(scale) else max(scale, 1e-30))
    # A NaN difference is reported as NaN (Python's max(0.0, nan) is 0.0).
    if not math.isnan(max_abs) and (math.isnan(d) or d > max_abs):
      max_abs = d
    if not math.isnan(max_rel) and (math.isnan(r) or r >= max_rel):
      max_rel, worst_leaf = r, jax.tree_util.keystr(path)
  return {"max_abs": max_abs, "max_rel": max_rel, "worst_leaf": worst_leaf,
          "norm_rel": worst(norms)}


def accuracy(model, variables, x, y, apply=None) -> float:
  """Fraction of rows of ``x`` whose argmax logit is the label ``y``.

  ``apply``: a jitted ``model.apply`` to reuse across calls (default: one
  jitted for this call).
  """
  logits = (apply or jax.jit(model.apply))(variables, x)
  return float(np.mean(np.asarray(jnp.argmax(logits, -1)) == y))


def eval_steps(steps: int, points: int = 40) -> list[int]:
  """The steps after which the plot's test-accuracy curve is evaluated:
  about ``points`` evenly spaced ones, always including the last step."""
  every = max(1, steps // points)
  return sorted({*range(every - 1, steps, every), steps - 1})


# --------------------------------------------------------------------------
# GPU measurements


def median_step_time(step, variables, opt_state, batch, warmup: int,
                     iters: int) -> float:
  """Median wall time of one step (seconds), blocking on every result,
  after ``warmup`` steps (the first of which compiles)."""
  return statistics.median(
      timed_steps(step, variables, opt_state, batch, warmup, iters)[0])


def compiled_memory(step, variables, opt_state, batch) -> dict[str, int]:
  """The compiled step's own buffers (``memory_analysis()``), in bytes."""
  m = step.lower(variables, opt_state, batch).compile().memory_analysis()
  out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
         for k in ("argument", "output", "alias", "temp")}
  out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def _mib(n: int) -> str:
  return f"{n / 2**20:8.3f} MiB"


# --------------------------------------------------------------------------
# Output


def write_csv(path: str, losses: dict[str, list[float]]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["step", "arm", "loss"])
    for arm in ARMS:
      for i, l in enumerate(losses[arm]):
        w.writerow([i, arm, repr(float(l))])


def _positive(xs) -> np.ndarray:
  """``xs`` as floats with exact zeros as NaN (not drawn on a log scale)."""
  a = np.asarray(xs, np.float64)
  return np.where(a > 0, a, np.nan)


def write_plot(path: str, losses: dict[str, list[float]], title: str,
               param_rel: Sequence[float] | None = None,
               acc_curve: dict[str, list[tuple[int, float]]] | None = None,
               tolerance: float | None = None,
               step_rel: Sequence[float] | None = None) -> None:
  """Writes the demo's figure to ``path`` (PNG).

  Args:
    path: the PNG to write.
    losses: each arm's training loss per step.
    title: the figure's title.
    param_rel: per step, the arms' largest per-leaf relative parameter
      difference (:func:`param_diff`'s ``max_rel``); drawn with the losses'
      relative difference in a log-scale panel. None: that panel shows the
      losses' difference only.
    acc_curve: each arm's ``(step, test accuracy)`` points; None: no
      accuracy panel.
    tolerance: drawn as a line in the difference panel (the fp32 bar,
      which ``step_rel`` is held to).
    step_rel: per step, the forge step's difference from the reference's
      step from the same state (:func:`param_diff`'s ``norm_rel``, of the
      parameters and the optimizer state); None: not drawn.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = 3 if acc_curve else 2
  fig, axes = plt.subplots(panels, 1, figsize=(7, 2.6 * panels + 0.6),
                           sharex=True)
  styles = {"forge": dict(lw=2.2, color="tab:orange"),
            "optax": dict(lw=1.0, ls="--", color="black")}
  ax = axes[0]
  for arm in ARMS:
    ax.plot(np.arange(len(losses[arm])), losses[arm], label=arm,
            **styles[arm])
  ax.set_yscale("log")
  ax.set_ylabel("train loss (cross-entropy)")
  ax.set_title(title, fontsize=10)
  ax.legend()

  # The loss curves lie on top of each other: the gap, on a log scale.
  ax = axes[1]
  f, o = (np.asarray(losses[a], np.float64) for a in ARMS)
  steps = np.arange(len(f))
  ax.plot(steps, _positive(np.abs(f - o) / np.maximum(np.abs(o), 1e-30)),
          lw=0.8, marker=".", ms=4, color="tab:blue",
          label="|loss forge - loss optax| / loss")
  if param_rel is not None:
    ax.plot(np.arange(len(param_rel)), _positive(param_rel), lw=1.6,
            color="tab:red", label="trajectories' params: max over leaves "
            "of max|forge - optax| / max|optax|")
  if step_rel is not None:
    ax.plot(np.arange(len(step_rel)), _positive(step_rel), lw=1.0,
            color="tab:green", label="one step from the same state: max "
            "over params and state of ||forge - optax|| / ||optax||")
  if tolerance is not None:
    ax.axhline(tolerance, color="gray", ls=":", lw=1.0,
               label=f"fp32 tolerance {tolerance:.0e} (one step)")
  ax.set_yscale("log")
  ax.set_ylabel("forge vs optax\n(relative; 0 not drawn)")
  ax.legend(fontsize=7)

  if acc_curve:
    ax = axes[2]
    for arm in ARMS:
      pts = acc_curve[arm]
      ax.plot([s for s, _ in pts], [100 * a for _, a in pts], marker=".",
              label=f"{arm} (final {100 * pts[-1][1]:.1f} %)", **styles[arm])
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=8, loc="lower right")
  axes[-1].set_xlabel("step")
  for ax in axes:
    ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# --------------------------------------------------------------------------
# Main


def add_training_args(p: argparse.ArgumentParser, out: str,
                      reference: str = "optax's") -> None:
  """The flags this example and its torch twin share (``out``: the default
  output folder; ``reference``: the optimizer its steps are checked
  against, as the help names it)."""
  p.add_argument("--steps", type=int, default=200, help="training steps")
  p.add_argument("--batch-size", type=int, default=128,
                 help="rows per training step")
  p.add_argument("--hidden", type=int, default=128, help="MLP hidden width")
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 default="float32", help="parameter (and optimizer state) "
                 f"dtype; in fp32 each step must match {reference} to "
                 "1e-5 relative")
  p.add_argument("--lr", type=float, default=3e-3,
                 help="peak learning rate (warmup-cosine schedule)")
  p.add_argument("--weight-decay", type=float, default=1e-2,
                 help="AdamW decoupled weight decay (not on biases)")
  p.add_argument("--seed", type=int, default=0,
                 help="init, train/test split and batch order")
  p.add_argument("--out", default=out, help="output folder")
  p.add_argument("--log-every", type=int, default=25,
                 help="print both losses every N steps (0: never)")


def check_training_args(p: argparse.ArgumentParser,
                        args: argparse.Namespace) -> None:
  """Refuses bad values of :func:`add_training_args`' flags (usage errors)."""
  if args.steps < 1 or args.batch_size < 1 or args.hidden < 1:
    p.error("--steps, --batch-size and --hidden must be positive")
  if args.log_every < 0:
    p.error("--log-every must be >= 0 (0: never)")
  if not (math.isfinite(args.lr) and args.lr > 0):
    p.error(f"--lr must be a finite number > 0, got {args.lr}")
  if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
    p.error(f"--weight-decay must be a finite number >= 0, got "
            f"{args.weight_decay}")
  # The nearest existing folder on the way to --out must be a folder.
  existing = os.path.abspath(args.out)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    p.error(f"--out {args.out}: {existing} is a file, not a folder")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m examples.train_digits",
      description=("Train one MLP on sklearn digits with forge_jax "
                   "(Dense + adamw + make_step) and with flax/optax, from the "
                   "same init on the same batches, and compare."),
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  add_training_args(p, os.path.join("out", "demo"))
  p.add_argument("--bench", choices=("auto", "on", "off"), default="auto",
                 help="time steps and report compiled memory (auto: on GPU)")
  p.add_argument("--bench-steps", type=int, default=100,
                 help="timed steps per arm (after 10 warm-up steps)")
  p.add_argument("--no-progress", action="store_true",
                 help="no tqdm progress bar")
  args = p.parse_args(argv)
  check_training_args(p, args)
  if args.bench_steps < 1:
    p.error("--bench-steps must be positive")
  return args


def check_out_writable(out: str) -> None:
  """Creates ``out`` and writes a scratch file there, before any training.

  Raises:
    SystemExit: (code 2, with a message) the folder cannot be created or
      written.
  """
  try:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryFile(dir=out):
      pass
  except OSError as e:
    print(f"demo: error: --out {out} is not writable ({e.strerror or e}); "
          "choose another folder with --out", file=sys.stderr)
    raise SystemExit(2) from None


def _require_demo_extra() -> None:
  """The demo's own dependencies (the ``demo`` extra): a clear error, not a
  bare ModuleNotFoundError, when one is missing."""
  import importlib.util
  missing = [m for m in ("sklearn", "tqdm", "matplotlib")
             if importlib.util.find_spec(m) is None]
  if missing:
    print(f"demo: error: missing {', '.join(missing)}: install the demo "
          "extra (pip install -e \".[demo]\", or run ./dev.sh train, which "
          "does)", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the demo; returns a summary (also printed). ``result["ok"]`` is
  False if an fp32 step differs from optax's beyond 1e-5 relative (from the
  same state) or a loss is not finite."""
  args = parse_args(argv)
  _require_demo_extra()
  check_out_writable(args.out)
  from tqdm.auto import tqdm
  param_dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  bench = args.bench == "on" or (args.bench == "auto" and on_gpu)
  mode = ("compiled Pallas kernels" if on_gpu else
          "Pallas interpret mode" if backend == "cpu" else
          "Pallas interpret mode (non-GPU backend)")
  print(f"backend: {backend} ({jax.devices()[0].device_kind}) -> {mode}")

  (x_tr, y_tr), (x_te, y_te) = load_digits_split(args.seed)
  classes = int(max(y_tr.max(), y_te.max())) + 1
  try:
    idx = batch_indices(len(x_tr), args.batch_size, args.steps, args.seed)
  except ValueError as e:  # --batch-size beyond the data: a usage error
    print(f"demo: error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  print(f"data: sklearn digits, {x_tr.shape[1]} features, {classes} classes, "
        f"{len(x_tr)} train / {len(x_te)} test rows")
  print(f"model: MLP {x_tr.shape[1]}-{args.hidden}-{args.hidden}-{classes}, "
        f"params {args.dtype}; AdamW lr {args.lr:g} (warmup-cosine), "
        f"weight decay {args.weight_decay:g} (kernels only); "
        f"{args.steps} steps x batch {args.batch_size}, seed {args.seed}")

  # fp32 parity needs IEEE fp32 matmuls everywhere (XLA's GPU default is TF32).
  precision = (jax.default_matmul_precision("highest")
               if param_dtype == jnp.float32 else contextlib.nullcontext())
  with precision:
    arms, eval_model = build_arms(args.hidden, classes, param_dtype, args.lr,
                                  args.weight_decay, args.steps)
    init = eval_model.init(jax.random.key(args.seed), x_tr[:1])
    state = {}
    for arm, (_, tx) in arms.items():
      variables = jax.tree.map(jnp.array, init)  # own buffers: steps donate
      state[arm] = (variables, tx.init(variables["params"]))

    losses: dict[str, list[float]] = {arm: [] for arm in ARMS}
    # For the plot: the arms' parameter difference after every step, and
    # both arms' test accuracy at a few steps (a small jitted forward each).
    param_rel: list[float] = []
    # fp32: each step's difference (norm_rel) from optax's step taken from
    # the forge arm's own state (copied: the steps donate their inputs).
    step_rel: list[float] = []
    fp32 = param_dtype == jnp.float32
    acc_curve: dict[str, list[tuple[int, float]]] = {arm: [] for arm in ARMS}
    acc_at = set(eval_steps(args.steps))
    apply = jax.jit(eval_model.apply)
    t_start = time.perf_counter()
    # Counted by hand, after each step: iterating the bar would count a step
    # when the next one starts, one behind the losses in its postfix.
    bar = tqdm(total=args.steps, desc="train", unit="step",
               disable=args.no_progress, dynamic_ncols=True, leave=True)
    for i in range(args.steps):
      batch = (jnp.asarray(x_tr[idx[i]]), jnp.asarray(y_tr[idx[i]]))
      if fp32:
        _, probe, probe_state = arms["optax"][0](
            *jax.tree.map(jnp.array, state["forge"]), batch)
      for arm in ARMS:
        step = arms[arm][0]
        loss, variables, opt_state = step(*state[arm], batch)
        state[arm] = (variables, opt_state)
        losses[arm].append(float(loss))
      param_rel.append(param_diff(state["forge"][0]["params"],
                                  state["optax"][0]["params"])["max_rel"])
      if fp32:
        # (the state too: a step that stored it wrongly would start the
        # next comparison from it on both sides)
        step_rel.append(max(
            param_diff(state["forge"][0]["params"],
                       probe["params"])["norm_rel"],
            param_diff(state["forge"][1], probe_state)["norm_rel"]))
      if i in acc_at:
        for arm in ARMS:
          acc_curve[arm].append(
              (i, accuracy(eval_model, state[arm][0], x_te, y_te, apply)))
      bar.set_postfix(forge=f"{losses['forge'][-1]:.5f}",
                      optax=f"{losses['optax'][-1]:.5f}", refresh=False)
      bar.update(1)
      if args.log_every and (i % args.log_every == 0 or i == args.steps - 1):
        tqdm.write(f"step {i:5d}  forge {losses['forge'][-1]:.7f}  "
                   f"optax {losses['optax'][-1]:.7f}")
    bar.close()
    train_s = time.perf_counter() - t_start

    acc = {arm: accuracy(eval_model, state[arm][0], x_te, y_te, apply)
           for arm in ARMS}
    diff = param_diff(state["forge"][0]["params"], state["optax"][0]["params"])

    bench_res: dict[str, Any] = {}
    if bench:
      batch = (jnp.asarray(x_tr[idx[0]]), jnp.asarray(y_tr[idx[0]]))
      for arm in ARMS:
        step = arms[arm][0]
        variables = jax.tree.map(jnp.array, state[arm][0])
        opt_state = jax.tree.map(jnp.array, state[arm][1])
        mem = compiled_memory(step, variables, opt_state, batch)
        t = median_step_time(step, variables, opt_state, batch, warmup=10,
                             iters=args.bench_steps)
        bench_res[arm] = {"median_step_s": t, "memory": mem}

  os.makedirs(args.out, exist_ok=True)
  csv_path = os.path.join(args.out, "losses.csv")
  png_path = os.path.join(args.out, "losses.png")
  write_csv(csv_path, losses)
  write_plot(png_path, losses,
             f"sklearn digits MLP, {args.dtype} params, {backend} ({mode}): "
             f"forge_jax vs optax", param_rel=param_rel, acc_curve=acc_curve,
             tolerance=FP32_TOLERANCE if fp32 else None,
             step_rel=step_rel if fp32 else None)

  finite = all(np.isfinite(losses[a]).all() for a in ARMS)
  worst_step = worst(step_rel)  # (a NaN difference fails)
  ok = finite and (not fp32 or worst_step <= FP32_TOLERANCE)

  print(f"trained {args.steps} steps x 2 arms in {train_s:.1f} s "
        f"(incl. compilation" + (" and the checks' reference steps)"
                                 if fp32 else ")"))
  print(f"final train loss  forge {losses['forge'][-1]:.7f}  "
        f"optax {losses['optax'][-1]:.7f}")
  print(f"test accuracy     forge {acc['forge']:.4f}  "
        f"optax {acc['optax']:.4f}")
  print(f"param difference  max abs {diff['max_abs']:.3e}  max rel "
        f"{diff['max_rel']:.3e} (per leaf max|forge-optax|/max|optax|, worst "
        f"at {diff['worst_leaf']})")
  if bench:
    if not on_gpu:
      print("benchmark (interpret mode: times are NOT representative)")
    for arm in ARMS:
      r = bench_res[arm]
      m = r["memory"]
      print(f"{arm:5s} median step {r['median_step_s'] * 1e3:9.3f} ms "
            f"({args.bench_steps} steps after warm-up)")
    print("compiled step memory (jit(step).lower(...).compile()."
          "memory_analysis(); one step's own buffers, not a device peak):")
    for arm in ARMS:
      m = bench_res[arm]["memory"]
      print(f"  {arm:5s} temp {_mib(m['temp'])}  argument "
            f"{_mib(m['argument'])}  output {_mib(m['output'])}  alias "
            f"{_mib(m['alias'])}  -> arg+out-alias+temp {_mib(m['total'])}")
  print(f"wrote {csv_path} and {png_path}")
  if fp32:
    verdict = "PASS" if ok else "FAIL"
    print(f"{verdict}: each fp32 step within {worst_step:.1e} relative of "
          f"optax's step from the same state (tolerance "
          f"{FP32_TOLERANCE:.0e}); the trajectories after {args.steps} "
          f"steps {diff['max_rel']:.1e} apart (rounding compounds in "
          "training)" + ("" if finite else "; a loss is not finite"))
  else:
    print(f"bf16: arms differ by {diff['max_rel']:.1e} relative (not checked: "
          "FORGE reads the fp32 accumulator, optax a bf16-rounded gradient)"
          + ("" if finite else "; FAIL: a loss is not finite"))

  return {"ok": ok, "backend": backend, "dtype": args.dtype,
          "steps": args.steps, "losses": losses, "test_accuracy": acc,
          "max_abs_param_diff": diff["max_abs"],
          "max_rel_param_diff": diff["max_rel"],
          "worst_leaf": diff["worst_leaf"],
          "max_rel_param_diff_per_step": param_rel,
          "step_diff": worst_step if fp32 else None,
          "step_diff_per_step": step_rel,
          "test_accuracy_curve": acc_curve, "train_seconds": train_s,
          "bench": bench_res, "csv": csv_path, "png": png_path}


if __name__ == "__main__":
  sys.exit(0 if main()["ok"] else 1)
