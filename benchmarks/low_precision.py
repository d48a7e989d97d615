"""Low-precision optimizer state: weight error against fp32 state, and
stochastic rounding against round-to-nearest.

    ./dev.sh python -m benchmarks.low_precision error --out out/bench/lowp_error.csv
    ./dev.sh python -m benchmarks.low_precision sr --out out/bench/lowp_sr.csv

``error``: the paper's App. E protocol (20 steps from the same seeded inputs
against an fp32-state reference; the rms-relative weight error
``||W - W_ref|| / ||W_ref||``) for a softmax head ``H x V`` (default the
paper's 4096 x 1024, BT 2048, weights N(0, 0.02)) trained by
``forge_jax.adamw`` with each ``moments=`` format, at each learning rate.
The arms run the transform's own update (``pallas_kernels.lowp.apply``,
which the fused kernel equals bit for bit in interpret mode:
tests/test_low_precision.py), so the large shape runs on a CPU.

``sr``: the digits MLP (examples/train_digits.py, ``64 -> hidden -> hidden
-> 10``) computing in bf16, trained by ``forge_jax.adamw`` through
``forge_jax.make_step`` three ways from the same initialisation and batches:
an fp32 master (fp32 parameters), bf16 parameters stored by rounding to
nearest, and bf16 parameters stored by stochastic rounding (fp32 moments in
all three). Reported per step: each bf16 arm's relative distance from the
master, ``||W - W_master|| / ||W_master||`` over all parameters.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import sys
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import forge_jax  # noqa: E402
from benchmarks import common, paths  # noqa: E402

MOMENTS = ("int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3/fp8_e5m2")


def _moments_arg(name: str):
  """A ``MOMENTS`` entry as ``forge_jax.adamw``'s ``moments=``."""
  return tuple(name.split("/")) if "/" in name else name


def rel(a, b) -> float:
  """``||a - b|| / ||b||`` over all leaves of two trees, in float64."""
  a = np.concatenate([np.ravel(np.asarray(x, np.float64))
                      for x in jax.tree.leaves(a)])
  b = np.concatenate([np.ravel(np.asarray(x, np.float64))
                      for x in jax.tree.leaves(b)])
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def head_errors(h: int, v: int, bt: int, lr: float, steps: int = 20,
                seed: int = 0, moments=MOMENTS) -> dict[str, float]:
  """The App. E errors of a softmax head: ``{"moved": ||W_ref - W_0|| /
  ||W_ref||, moments: error against the fp32-state run, ...}``."""
  kw, kx, ky = jax.random.split(jax.random.key(seed), 3)
  w0 = {"w": 0.02 * jax.random.normal(kw, (h, v))}
  xs = jax.random.normal(kx, (steps, bt, h))
  ys = jax.random.randint(ky, (steps, bt), 0, v)

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(
        x @ p["w"], y).mean()

  def run(tx):
    @jax.jit
    def step(p, s, x, y):
      u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
      return optax.apply_updates(p, u), s

    p, s = w0, tx.init(w0)
    for i in range(steps):
      p, s = step(p, s, xs[i], ys[i])
    return p

  with jax.default_matmul_precision("highest"):
    ref = run(forge_jax.adamw(lr, weight_decay=0.0))
    out = {"moved": rel(ref, w0)}
    for m in moments:
      out[m] = rel(run(forge_jax.adamw(lr, weight_decay=0.0,
                                       moments=_moments_arg(m))), ref)
  return out


class DigitsMLP(nn.Module):
  """The digits MLP of examples/train_digits.py (``64 -> hidden -> hidden
  -> 10``, ReLU), computing in bf16 whatever its parameters' dtype (an fp32
  master's parameters are cast for each product, as in mixed precision)."""
  dense: type
  hidden: int
  param_dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=jnp.bfloat16, param_dtype=self.param_dtype)
    x = nn.relu(self.dense(self.hidden, **kw)(x))
    x = nn.relu(self.dense(self.hidden, **kw)(x))
    return self.dense(10, **kw)(x)


def sr_trajectories(steps: int, lr: float, hidden: int = 128,
                    batch: int = 128, seed: int = 0) -> dict[str, np.ndarray]:
  """Per-step relative distance of the bf16 arms from the fp32 master on
  the digits MLP: ``{"rne": (steps,), "sr": (steps,)}``, plus ``"loss"``,
  the master's losses."""
  from examples.train_digits import batch_indices, load_digits_split
  (x, y), _ = load_digits_split(seed)
  idx = batch_indices(len(x), batch, steps, seed)

  def loss_fn_of(param_dtype):
    model = DigitsMLP(forge_jax.Dense, hidden, param_dtype)

    def loss_fn(variables, b):
      logits = model.apply(variables, b[0]).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, b[1]).mean()
    return loss_fn

  v16 = jax.tree.map(
      lambda a: a.astype(jnp.bfloat16),
      DigitsMLP(nn.Dense, hidden).init(jax.random.key(seed), x[:1]))
  v32 = jax.tree.map(lambda a: a.astype(jnp.float32), v16)  # same start
  arms = {
      "master": (jnp.float32, forge_jax.adamw(lr, weight_decay=0.0), v32),
      "rne": (jnp.bfloat16, forge_jax.adamw(lr, weight_decay=0.0,
                                            moments=jnp.float32), v16),
      "sr": (jnp.bfloat16, forge_jax.adamw(lr, weight_decay=0.0,
                                           moments=jnp.float32,
                                           stochastic_rounding=True,
                                           seed=seed), v16),
  }
  state = {}
  for name, (dtype, tx, v) in arms.items():
    step = jax.jit(forge_jax.make_step(loss_fn_of(dtype), tx))
    state[name] = [step, v, tx.init(v["params"])]
  out = {"rne": np.zeros(steps), "sr": np.zeros(steps),
         "loss": np.zeros(steps)}
  for t in range(steps):
    b = (jnp.asarray(x[idx[t]]), jnp.asarray(y[idx[t]]))
    for name, s in state.items():
      loss, s[1], s[2] = s[0](s[1], s[2], b)
      if name == "master":
        out["loss"][t] = float(loss)
    for name in ("rne", "sr"):
      out[name][t] = rel(state[name][1]["params"],
                         state["master"][1]["params"])
  return out


def _write(path: str, header, rows) -> None:
  """The rows, each followed by the device, versions, commit and time."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
  where = [common.device_name(), common.versions(), common.commit(), stamp]
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow([*header, "device", "versions", "commit", "timestamp"])
    w.writerows([*row, *where] for row in rows)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  e = sub.add_parser("error", help="20-step weight error vs fp32 state")
  e.add_argument("--shape", default="4096x1024", help="H x V of the head")
  e.add_argument("--tokens", type=common.positive_int, default=2048)
  e.add_argument("--lrs", type=common.positive_float, nargs="+",
                 default=[1e-4, 2.5e-4, 1e-3])
  e.add_argument("--seeds", type=common.positive_int, default=1)
  e.add_argument("--out", type=paths.out_file, required=True)
  s = sub.add_parser("sr", help="stochastic rounding vs round-to-nearest")
  s.add_argument("--steps", type=common.positive_int, default=200)
  s.add_argument("--lr", type=common.positive_float, default=1e-4)
  s.add_argument("--hidden", type=common.positive_int, default=128)
  s.add_argument("--seeds", type=common.positive_int, default=3)
  s.add_argument("--out", type=paths.out_file, required=True)
  args = p.parse_args(argv)
  if args.cmd == "error":
    try:
      h, v = (int(n) for n in args.shape.lower().split("x"))
    except ValueError:
      p.error(f"--shape {args.shape!r}: give H x V, e.g. 4096x1024")
    if h < 1 or v < 1:
      p.error(f"--shape {args.shape!r}: H and V must be >= 1")
    rows = []
    for seed in range(args.seeds):
      for lr in args.lrs:
        r = head_errors(h, v, args.tokens, lr, seed=seed)
        rows.append([h, v, args.tokens, lr, seed, f"{r['moved']:.4g}"]
                    + [f"{r[m]:.4g}" for m in MOMENTS])
        print(", ".join(f"{k} {val:.4g}" for k, val in r.items()),
              f"(lr {lr}, seed {seed})", flush=True)
    _write(args.out, ["H", "V", "BT", "lr", "seed", "moved", *MOMENTS], rows)
    return 0
  rows = []
  for seed in range(args.seeds):
    r = sr_trajectories(args.steps, args.lr, args.hidden, seed=seed)
    rows += [[seed, t + 1, f"{r['loss'][t]:.6g}", f"{r['rne'][t]:.6g}",
              f"{r['sr'][t]:.6g}"] for t in range(args.steps)]
    print(f"seed {seed}: after {args.steps} steps, distance from the fp32 "
          f"master: round-to-nearest {r['rne'][-1]:.4g}, stochastic "
          f"rounding {r['sr'][-1]:.4g} (mean over steps {r['rne'].mean():.4g}"
          f" vs {r['sr'].mean():.4g})", flush=True)
  _write(args.out, ["seed", "step", "master_loss", "rne", "sr"], rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
