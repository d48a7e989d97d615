#!/usr/bin/env bash
# The benchmark suite of issue #4 in one command, on a GPU machine:
#
#   benchmarks/suite.sh [OUT_DIR]          (default out/suite; PYTHON=python3)
#
# 1. kernel.py: one layer's fused step vs XLA's unfused GEMM + AdamW, every
#    Llama-3.1-8B projection shape x BT 512/2048/4096 with bf16 W/m/v, then
#    4096^2 and 4096x14336 at BT 512 with fp32 m/v -> OUT/kernel.csv, .png
# 2. e2e.py: the Llama-style decoder's training step, FORGE vs optax.adamw,
#    BT 512 and 2048, one process per cell -> OUT/e2e.csv, .png
# Every CSV row carries the device, the versions and p20/p50/p80.
# Estimated from the parts' times in session 3 (runs 15 and 16): ~9 minutes
# on the H200; the suite as a whole has not been run in one call.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/suite}"
PY="${PYTHON:-python3}"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
"$PY" benchmarks/kernel.py --out "$OUT/kernel.csv" --moments bfloat16
"$PY" benchmarks/kernel.py --out "$OUT/kernel.csv" --moments float32 \
  --shapes "q/o 4096x4096" "up/gate 4096x14336" --tokens 512
"$PY" benchmarks/plot.py "$OUT/kernel.csv" "$OUT/kernel.png"
"$PY" benchmarks/e2e.py --out "$OUT/e2e.csv" --plot "$OUT/e2e.png" \
  --bt 512 2048 --budget 330
echo "suite: results in $OUT"
