"""bf16 parameters: rms error against an fp32-master run, FORGE vs unfused.

    ./dev.sh python -m benchmarks.bf16_error --out out/bench/bf16_error.csv

The paper's App. E effect: the standard bf16 path rounds G to bf16 before the
optimizer reads it; FORGE reads the fp32 accumulator. Three arms start from
the same bf16-rounded initialisation and see the same batches: an fp32 master
(nn.Dense fp32 + optax.adamw), the unfused bf16 path (nn.Dense bf16 +
optax.adamw) and FORGE (forge_jax.Dense bf16 + forge_jax.adamw). Reported: the
rms error of the kernels and the relative rms error of the moments, per seed
and learning rate, after `--steps` steps (the 37-70-130-5 test MLP).
"""

import argparse
import sys
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import forge_jax
from benchmarks import common, paths
from tests.harness import mse
from tests.test_forge_jax import MLP, data, optax_step


def errors(seed, lr, steps):
  batches = data(seed=seed, steps=steps)
  kwargs = dict(learning_rate=lr, weight_decay=1e-2)
  v32 = MLP(nn.Dense).init(jax.random.key(seed), batches[0][0])
  v16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), v32)
  master = jax.tree.map(lambda a: a.astype(jnp.float32), v16)
  tx, ftx = optax.adamw(**kwargs), forge_jax.adamw(**kwargs)
  arms = {
      "master": [optax_step(mse(MLP(nn.Dense)), tx), master, tx.init(master["params"])],
      "unfused": [optax_step(mse(MLP(nn.Dense, param_dtype=jnp.bfloat16)), tx),
                  v16, tx.init(v16["params"])],
      "forge": [jax.jit(forge_jax.make_step(mse(MLP(forge_jax.Dense, param_dtype=jnp.bfloat16)), ftx)),
                v16, ftx.init(v16["params"])],
  }
  with jax.default_matmul_precision("highest"):
    for b in batches:
      for arm in arms.values():
        _, arm[1], arm[2] = arm[0](arm[1], arm[2], b)

  def kernels(tree):
    return jnp.concatenate([a.astype(jnp.float32).ravel() for kp, a in
                            jax.tree_util.tree_flatten_with_path(tree)[0]
                            if "kernel" in jax.tree_util.keystr(kp)])

  ref_v, ref_s = arms["master"][1], arms["master"][2]
  out = {}
  for name in ("unfused", "forge"):
    v, s = arms[name][1], arms[name][2]
    out[name] = dict(
        w_rms=float(jnp.sqrt(jnp.mean((kernels(v) - kernels(ref_v)) ** 2))),
        mu_rel=common_rel(kernels(s[0].mu), kernels(ref_s[0].mu)),
        nu_rel=common_rel(kernels(s[0].nu), kernels(ref_s[0].nu)))
  return out


def common_rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file,
                 default="out/bench/bf16_error.csv")
  p.add_argument("--lrs", type=common.positive_float, nargs="+",
                 default=[1e-2, 1e-3, 1e-4])
  p.add_argument("--seeds", type=common.positive_int, default=6)
  p.add_argument("--steps", type=common.positive_int, default=20)
  args = p.parse_args(argv)
  res = common.Results(args.out, "bf16_error")
  for lr in args.lrs:
    wins, rows = 0, []
    for seed in range(args.seeds):
      e = errors(seed, lr, args.steps)
      wins += e["forge"]["w_rms"] <= e["unfused"]["w_rms"]
      rows.append(e)
      for arm, m in e.items():
        for metric, val in m.items():
          res.add(f"lr={lr:g} seed={seed}", arm, "37-70-130-5", "bf16",
                  metric, val, "abs" if metric == "w_rms" else "rel")
    mean = lambda arm, k: sum(r[arm][k] for r in rows) / len(rows)
    print(f"lr {lr:g}: kernel rms error forge {mean('forge', 'w_rms'):.4e} vs "
          f"unfused {mean('unfused', 'w_rms'):.4e} (forge <= unfused in "
          f"{wins}/{args.seeds} seeds); mu rel {mean('forge', 'mu_rel'):.3e} vs "
          f"{mean('unfused', 'mu_rel'):.3e}; nu rel {mean('forge', 'nu_rel'):.3e}"
          f" vs {mean('unfused', 'nu_rel'):.3e}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
