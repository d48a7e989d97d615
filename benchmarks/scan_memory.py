"""Peak memory of a scanned stack's training step: FORGE vs nn.scan + optax.

    ./dev.sh python -m benchmarks.scan_memory --out S.csv \\
        [--layers 16 --width 4096 --tokens 512]

The model is one ``forge_jax.ScannedDenseStack`` of ``--layers`` bf16
``width x width`` kernels (no bias, ReLU). Arms, one subprocess each
(``XLA_PYTHON_CLIENT_PREALLOCATE=false``):

  forge   ``forge_jax.make_step`` + ``forge_jax.adamw``: the backward loop
          updates the stacked W, m, v in place;
  optax   the same module with ``fused=False`` (it *is* ``nn.scan`` of a
          Dense layer) + ``jax.value_and_grad`` + ``optax.adamw``: the scan's
          transpose materialises the whole gradient pool.

Each arm records the compiled step's temporaries and the allocator's peak
over 3 donated steps, minus the bytes in use before the first step (the
parameters, the optimizer state and the input): ``step_peak``. The gradient
pool is ``layers * width**2 * 2`` bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

from benchmarks import paths

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

# The cells run in the repository (``python -m benchmarks.scan_memory``).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cell(arm: str, layers: int, width: int, tokens: int) -> dict:
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  import forge_jax
  from benchmarks import common

  model = forge_jax.ScannedDenseStack(
      width, layers, use_bias=False, activation=nn.relu, dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16, fused=(arm == "forge"))
  x = jax.random.normal(jax.random.key(1), (tokens, width), jnp.bfloat16)
  jitted, compiled, (variables, opt_state, x) = common.compiled_adamw_step(
      model, x, forge=(arm == "forge"), learning_rate=1e-4)
  temp = compiled.memory_analysis().temp_size_in_bytes
  jax.block_until_ready((variables, opt_state, x))
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  base = stats.get("bytes_in_use")
  losses = []
  for _ in range(3):
    loss, variables, opt_state = jitted(variables, opt_state, x)
    losses.append(float(loss))
  stats = dev.memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return {"arm": arm, "temp": temp, "base": base, "peak": peak,
          "step_peak": None if peak is None or base is None else peak - base,
          "losses": losses, "device": f"{dev.platform}:{dev.device_kind}"}


def main(argv=None):
  from benchmarks import common
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file,
                 default="out/bench/scan_memory.csv")
  p.add_argument("--layers", type=common.positive_int, default=16)
  p.add_argument("--width", type=common.positive_int, default=4096)
  p.add_argument("--tokens", type=common.positive_int, default=512)
  p.add_argument("--cell", choices=["forge", "optax"], default=None)
  args = p.parse_args(argv)
  if args.cell:
    print("RESULT " + json.dumps(cell(args.cell, args.layers, args.width,
                                       args.tokens)), flush=True)
    return 0

  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  results = {}
  for arm in ("forge", "optax"):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.scan_memory", "--cell", arm,
         "--layers", str(args.layers), "--width", str(args.width),
         "--tokens", str(args.tokens), "--out", os.path.abspath(args.out)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not line:
      print(proc.stdout[-2000:], proc.stderr[-4000:])
      raise SystemExit(f"{arm} cell failed (exit {proc.returncode})")
    results[arm] = json.loads(line[0][len("RESULT "):])
  res = common.Results(args.out, "scan_memory")
  pool = args.layers * args.width**2 * 2
  case = f"{args.layers}x{args.width}^2 bf16 scanned BT={args.tokens}"
  mib = lambda b: None if b is None else b / 2**20
  for arm, r in results.items():
    for metric in ("temp", "base", "peak", "step_peak"):
      if r[metric] is not None:
        res.add(case, arm, f"{args.width}x{args.width}", "bf16", metric,
                mib(r[metric]), "MiB")
  f, o = results["forge"], results["optax"]
  print(f"device {f['device']}; gradient pool {mib(pool):.0f} MiB")
  for what in ("temp", "step_peak", "peak"):
    if f[what] is None:
      print(f"{what}: not available on this device")
      continue
    saved = o[what] - f[what]
    print(f"{what:10s} forge {mib(f[what]):9.1f} MiB  optax {mib(o[what]):9.1f} MiB"
          f"  saved {mib(saved):8.1f} MiB = {saved / pool:.3f} x pool")
  print("losses forge", f["losses"], "optax", o["losses"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
