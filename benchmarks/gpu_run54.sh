#!/usr/bin/env bash
# H200, session 11 call 54. (1) Runs 50-53: optax's cells repeat their losses
# to the digit within a device call, forge-xla's do not (run 53: second-step
# 9.9204 vs 9.9333) and its p50 moves 0.968x-1.071x of optax between calls.
# Hypothesis: XLA's GEMM autotuner picks differently per compile among
# near-tied candidates. Test: two forge-xla cells, each with a fresh
# per-fusion autotune cache (A, B), then a third loading A. Prediction: A
# and B hold the same keys but some differ in the chosen algorithm; the third
# cell repeats A's losses to the digit. (2) The fused arm beside optax,
# twice (its last e2e figure is run 50's, 1.070x). Cells now report where
# their ~60-80 s go (phases).
source "$(dirname "$0")/gpu_lib.sh"
cell() {  # name, cache dir
  run "$1" 110 env XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=$2" \
    python3 benchmarks/e2e.py --bt 512 --arms forge-xla --cell-timeout 100 \
    --out "$OUT/e2e_at.csv"
}
cell at_A "$OUT/atA"; cell at_B "$OUT/atB"; cell at_A2 "$OUT/atA"
python3 - "$OUT/atA" "$OUT/atB" > "$OUT/at_diff.txt" 2>&1 <<'PY'
import os, sys
a, b = sys.argv[1], sys.argv[2]
def entries(d):
  out = {}
  for root, _, files in os.walk(d):
    for f in files:
      p = os.path.join(root, f)
      out[os.path.relpath(p, d)] = open(p, "rb").read()
  return out
A, B = entries(a), entries(b)
same = [k for k in A if k in B and A[k] == B[k]]
diff = [k for k in A if k in B and A[k] != B[k]]
print(f"A {len(A)} entries, B {len(B)}; common {len(set(A) & set(B))}: "
      f"{len(same)} identical, {len(diff)} differ; only A {len(set(A) - set(B))},"
      f" only B {len(set(B) - set(A))}")
for k in diff:
  print(f"--- {k}\nA: {A[k].decode(errors='replace')[-600:]}\n"
        f"B: {B[k].decode(errors='replace')[-600:]}")
PY
head -c 1500 "$OUT/at_diff.txt"; echo; echo "[at_diff ${SECONDS}s]"
rm -rf "$OUT/atA" "$OUT/atB"
run e2e_fused $((585 - SECONDS)) python3 benchmarks/e2e.py --bt 512 --arms optax forge \
  --repeat 2 --cell-timeout 100 --budget $((575 - SECONDS)) --out "$OUT/e2e.csv"
