"""Per-family step time at one Llama-8B shape: fused vs XLA's unfused pair.

    ./dev.sh python -m benchmarks.families --out out/bench/families.csv

For every regime-1 rule of the family registry (`pallas_kernels.families`;
one kernel body, per-family epilogue) it times the fused kernel against
`jnp.dot(x.T, dy)` (bf16 G) + the same rule applied elementwise by XLA, side
by side, bf16 W and state, default tiling.
"""

import argparse
import sys
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks import common, paths

# Every registered regime-1 rule and its named variants (the registry's
# order), by family or variant name.
RULES = pk.families.optax_rules(regimes=(1,))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file, default="out/bench/families.csv")
  p.add_argument("--tokens", type=common.positive_int, default=512)
  p.add_argument("--shape", default="q/o 4096x4096",
                 choices=list(common.LLAMA8B_SHAPES))
  args = p.parse_args(argv)
  if jax.default_backend() != "gpu":
    print("benchmarks/families.py needs a GPU; nothing measured.",
          file=sys.stderr)
    return 1
  n_in, n_out = common.LLAMA8B_SHAPES[args.shape]
  bt = args.tokens
  res = common.Results(args.out, "families")
  shape = f"BT={bt} {n_in}x{n_out}"
  k = jax.random.split(jax.random.key(0), 3)
  for name, rule in RULES.items():
    # Timing only: every hyperparameter 0.5 keeps the arithmetic finite.
    h = rule.pack(**{n: 0.5 for n in rule.hparams})

    def state():
      x = jax.random.normal(k[0], (bt, n_in), jnp.bfloat16)
      dy = jax.random.normal(k[1], (bt, n_out), jnp.bfloat16)
      w = jax.random.normal(k[2], (n_in, n_out), jnp.bfloat16)
      return x, dy, w, tuple(jnp.full((n_in, n_out), 0.5, jnp.bfloat16)
                             for _ in rule.slots)

    def xla(s, rule=rule, h=h):
      x, dy, w, slots = s
      w, slots = rule.apply(jnp.dot(x.T, dy), w, slots, h)
      return x, dy, w, slots

    def forge(s, rule=rule, h=h):
      x, dy, w, slots = s
      # The Triton kernel (the one every family's tiling was tuned for).
      w, slots = pk.fused_wgrad_update(x, dy, w, slots, h, rule=rule,
                                       backend="triton")
      return x, dy, w, slots

    tx, _ = common.time_loop(xla, state())
    tf, _ = common.time_loop(forge, state())
    res.add(name, "xla_unfused", shape, "bf16", "time", tuple(t * 1e6 for t in tx), "us")
    res.add(name, "forge", shape, "bf16", "time", tuple(t * 1e6 for t in tf), "us")
    res.add(name, "forge", shape, "bf16", "speedup_vs_xla", tx[1] / tf[1], "x")
    print(f"{name:18s} {shape}: xla {tx[1]*1e6:7.1f} us  forge {tf[1]*1e6:7.1f} us"
          f"  {tx[1]/tf[1]:.2f}x  ({len(rule.slots)} slots)", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
