"""What XLA made of the e2e step: async stream calls, copies, kernels.

    ./dev.sh python benchmarks/hlo_check.py --bt 512 --arms forge forge_overlap

Compiles the training step of each ``benchmarks/e2e.py`` arm (abstract
arguments: no state is allocated) and counts, in the optimised HLO, the
instructions that decide whether ``make_step(..., overlap=True)`` can
overlap: ``call-start`` / ``call-done`` (a stream-annotated call made
asynchronous), copies (a kernel-sized copy would undo the in-place update),
custom calls (the fused kernels) and GEMMs -- and, in the entry
computation's schedule, how many kernels (fusions, custom calls) XLA placed
between each ``call-start`` and its ``call-done``: the work the update can
overlap (0: none). ``--lhs`` compiles every arm with XLA's latency-hiding
scheduler (forge_overlap always is). With ``--dump DIR`` each arm's
optimised HLO text is written there.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import jax  # noqa: E402

from benchmarks import common, e2e  # noqa: E402

PATTERNS = {
    "call-start": r" call-start\(",
    "call-done": r" call-done\(",
    "stream annotation": r"_xla_stream_annotation",
    "copy": r" copy\(",
    "copy-start": r" copy-start\(",
    "custom-call": r" custom-call\(",
    "fused kernel": r"fused_wgrad",
}


def counts(text: str) -> dict[str, int]:
  return {k: len(re.findall(p, text)) for k, p in PATTERNS.items()}


_HEAVY = re.compile(r"\b(fusion|custom-call)\(")


def overlap_gaps(text: str) -> list[int]:
  """Kernels scheduled between each call-start and its call-done, in the
  entry computation (the printed order of a scheduled module). Calls whose
  operand is another call's result are skipped: JAX's compute_on wraps each
  output in a device-placement annotation, itself a stream call."""
  entry = text[text.index("\nENTRY "):]
  entry = entry[:entry.index("\n}")]
  open_at, gaps, heavy = {}, [], 0
  for line in entry.splitlines():
    m = re.match(r"\s*(?:ROOT )?%(\S+) = .* call-start\((\S+?)[,)]", line)
    if m:
      if not m.group(2).startswith("%call-done"):
        open_at[m.group(1)] = heavy
      continue
    m = re.search(r" call-done\(%(\S+?)\)", line)
    if m and m.group(1) in open_at:
      gaps.append(heavy - open_at.pop(m.group(1)))
      continue
    if _HEAVY.search(line):
      heavy += 1
  return gaps


def compiled_text(arm: str, cfg: e2e.Config, bt: int, lhs: bool = False) -> str:
  step, tx = e2e.build_arm(arm, cfg)
  abs_vars = e2e.abstract_variables(cfg)
  abs_state = jax.eval_shape(tx.init, abs_vars["params"])
  batch = e2e.make_batch(cfg, bt // cfg.seq)
  compiled = jax.jit(step, donate_argnums=(0, 1),
                     compiler_options=e2e.compiler_options(arm, lhs)).lower(
      abs_vars, abs_state, batch).compile()
  return compiled.as_text()


def main(argv=None) -> int:
  d = e2e.Config()
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--bt", type=common.positive_int, default=512)
  p.add_argument("--arms", nargs="+", default=["forge", "forge_overlap"],
                 choices=e2e.ARMS)
  p.add_argument("--layers", type=common.positive_int, default=d.layers)
  p.add_argument("--lhs", action="store_true")
  p.add_argument("--dump", default=None, metavar="DIR")
  args = p.parse_args(argv)
  cfg = e2e.Config(layers=args.layers)
  if args.bt % cfg.seq:
    p.error(f"--bt {args.bt} is not a multiple of seq={cfg.seq}")
  print(f"backend {jax.default_backend()}; {common.versions()}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  for arm in args.arms:
    text = compiled_text(arm, cfg, args.bt, args.lhs)
    print(f"{arm:>14}: " + ", ".join(f"{k} {v}" for k, v in
                                      counts(text).items()), flush=True)
    gaps = sorted(overlap_gaps(text))
    if gaps:
      print(f"{'':>14}  kernels between call-start and call-done: "
            f"{len(gaps)} pairs; min {gaps[0]}, median {gaps[len(gaps) // 2]}"
            f", max {gaps[-1]}; {sum(g > 0 for g in gaps)} pairs overlap "
            "something", flush=True)
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      with open(os.path.join(args.dump, f"{arm}_bt{args.bt}.hlo.txt"), "w") as f:
        f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
