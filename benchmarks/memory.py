"""Compiled-step memory of a FORGE step vs optax's, and in-place checks.

    ./dev.sh python -m benchmarks.memory --out out/bench/memory.csv [--hlo-dir D]

For an MLP of `--layers` bf16 `--width` x `--width` kernels (default
4096; BT tokens, unrolled), trained by `--optimizer` (adamw, lamb, muon or
sgd: the forge_jax transform against optax's, optax.contrib.muon for
Muon), it
compiles one jitted, donated training step per arm and records XLA's
`memory_analysis()` (temporaries, arguments, outputs, aliased bytes), the
number of kernel-shaped `copy` ops and of weight-gradient GEMMs (a
kernel-shaped `G = x^T dy` stored by a dot / cuBLAS call) in the optimized
HLO, and whether the kernel/moment buffers come back at the same addresses
(in place).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import forge_jax
from benchmarks import common, paths


class Stack(nn.Module):
  dense: type
  width: int
  layers: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = nn.relu(self.dense(self.width, use_bias=False, dtype=jnp.bfloat16,
                             param_dtype=jnp.bfloat16)(x))
    return x


def weight_gradient_gemms(hlo: str, tokens: int, width: int) -> list[str]:
  """Instructions of an optimized HLO that form a weight gradient ``x^T dy``:
  a ``dot`` or GEMM custom call whose result is kernel-shaped
  ``[width,width]`` and whose operands are two ``[tokens,width]``
  activations. The standard path has one per layer; FORGE none (its
  gradient exists only inside the fused kernel)."""
  kernel, act = f"[{width},{width}]", f"[{tokens},{width}]"
  define = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
  shapes, candidates = {}, []
  for line in hlo.splitlines():
    m = define.match(line)
    if not m:
      continue
    name, shape, op, rest = m.groups()
    shapes[name] = shape
    if op == "dot" or (op == "custom-call" and "gemm" in rest.lower()):
      if kernel in shape:
        candidates.append((line.strip(), rest.split(")", 1)[0]))
  found = []
  for line, operands in candidates:
    # Operands print as "%name" or "bf16[4,8]{1,0} %name".
    n_act = 0
    for o in operands.split("%")[1:]:
      name = "%" + re.match(r"[\w.\-]+", o).group(0)
      n_act += act in shapes.get(name, "")
    if n_act == 0:  # shapes printed inline
      n_act = operands.count(act)
    if n_act >= 2:
      found.append(line)
  return found


def loss_of(model):
  return lambda v, x: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2)


REFERENCES = {"adamw": optax.adamw, "muon": optax.contrib.muon,
              "lamb": optax.lamb, "sgd": optax.sgd}


def arms(width, layers, optimizer="adamw"):
  fmodel, rmodel = Stack(forge_jax.Dense, width, layers), Stack(nn.Dense, width, layers)
  ftx = getattr(forge_jax, optimizer)(1e-4)
  rtx = REFERENCES[optimizer](1e-4)
  fstep = forge_jax.make_step(loss_of(fmodel), ftx)
  rstep = common.optax_step(loss_of(rmodel), rtx)
  return {"forge": (fstep, ftx), "optax": (rstep, rtx)}, rmodel


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file, default="out/bench/memory.csv")
  p.add_argument("--hlo-dir", type=paths.out_dir, default=None)
  p.add_argument("--width", type=common.positive_int, default=4096)
  p.add_argument("--layers", type=common.positive_int, nargs="+",
                 default=[1, 16])
  p.add_argument("--tokens", type=common.positive_int, default=512)
  p.add_argument("--optimizer", default="adamw", choices=sorted(REFERENCES))
  args = p.parse_args(argv)
  if args.tokens == args.width:
    # weight_gradient_gemms tells x^T dy from the forward x @ W by shape.
    p.error("--tokens must differ from --width (the weight-gradient GEMMs "
            "are found in the HLO by their operand shapes)")
  res = common.Results(args.out, "memory")
  for layers in args.layers:
    steps, model = arms(args.width, layers, args.optimizer)
    x = jnp.ones((args.tokens, args.width), jnp.bfloat16)
    kernel_bytes = args.width * args.width * 2
    for name, (step, tx) in steps.items():
      variables = model.init(jax.random.key(0), x)
      opt_state = tx.init(variables["params"])
      jitted = jax.jit(step, donate_argnums=(0, 1))
      compiled = jitted.lower(variables, opt_state, x).compile()
      mem = compiled.memory_analysis()
      hlo = compiled.as_text()
      shape = f"[{args.width},{args.width}]"
      copies = [l.strip() for l in hlo.splitlines()
                if re.search(r"= \S+\[" + f"{args.width},{args.width}" + r"\]\S* copy\(", l)]
      wgrads = weight_gradient_gemms(hlo, args.tokens, args.width)
      case = f"{args.optimizer} {layers}x{args.width}^2 bf16 BT={args.tokens}"
      if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        with open(os.path.join(args.hlo_dir, f"hlo_{name}_{layers}.txt"), "w") as f:
          f.write(hlo)
      leaves = lambda v, s: jax.tree.leaves((v["params"], s))
      before = [a.unsafe_buffer_pointer() for a in leaves(variables, opt_state)]
      _, nv, ns = jitted(variables, opt_state, x)
      after = [a.unsafe_buffer_pointer() for a in leaves(nv, ns)]
      in_place = sum(a == b for a, b in zip(before, after))
      for metric, value in (("temp_bytes", mem.temp_size_in_bytes),
                            ("argument_bytes", mem.argument_size_in_bytes),
                            ("output_bytes", mem.output_size_in_bytes),
                            ("alias_bytes", mem.alias_size_in_bytes),
                            ("kernel_bytes", kernel_bytes * layers),
                            ("kernel_shaped_copies", len(copies)),
                            ("weight_gradient_gemms", len(wgrads)),
                            ("buffers_in_place", in_place),
                            ("buffers_total", len(before))):
        res.add(case, name, shape, "bf16", metric, float(value), "count" if
                "copies" in metric or "buffers" in metric or "gemms" in metric
                else "bytes")
      print(f"{case:28s} {name:6s} temp {mem.temp_size_in_bytes/2**20:9.1f} MiB"
            f"  args {mem.argument_size_in_bytes/2**20:9.1f}  out "
            f"{mem.output_size_in_bytes/2**20:9.1f}  alias {mem.alias_size_in_bytes/2**20:9.1f}"
            f"  kernel-shaped copies {len(copies)}  weight-gradient GEMMs "
            f"{len(wgrads)}  in place {in_place}/{len(before)}",
            flush=True)
      for c in copies[:4]:
        print("    ", c[:200])
  return 0


if __name__ == "__main__":
  sys.exit(main())
