#!/usr/bin/env bash
# The benchmark suite of issue #4 in one command, on a GPU machine:
#
#   benchmarks/suite.sh [OUT_DIR]   (default out/suite; PYTHON: the project's
#                                    .venv/bin/python if there is one, else
#                                    python3)
#
# 1. kernel.py: one layer's fused step vs XLA's unfused GEMM + AdamW (and, with
#    CUDA torch, torch's cuBLAS + AdamW(fused=True) and the kernel through
#    forge_torch), every Llama-3.1-8B projection shape x BT 512/2048/4096 with
#    bf16 W/m/v, then 4096^2 and 4096x14336 at BT 512 with fp32 m/v ->
#    OUT/kernel.csv, .png. The fused kernel runs with the tiling it picks by
#    itself ("auto": the shipped autotune cache) and, for reference, the
#    untuned 64x128x64 tile; a sweep over more tilings is
#    `kernel.py --config LABEL...` or `python -m pallas_kernels.autotune`.
# 2. e2e.py: the Llama-style decoder's training step, FORGE (fused kernel;
#    at BT 512 also wgrad="xla") vs optax.adamw, BT 512 and 2048, one process
#    per cell -> OUT/e2e.csv, .png
# Every CSV row carries the device, the versions and p20/p50/p80. CSVs are
# appended to: the e2e plot draws the newest row of each (arm, BT) in
# OUT/e2e.csv, so give each suite run its own OUT.
# The e2e part stops starting cells after --budget seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/suite}"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY="${PYTHON:-python3}"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "suite.sh: $PY sees no GPU (or no jax); the suite measures on a GPU." \
       "Nothing measured." >&2
  exit 1
fi
mkdir -p "$OUT"
SECONDS=0
TILINGS=(auto 64x128x64,g1,w4,s3)
"$PY" benchmarks/kernel.py --out "$OUT/kernel.csv" --moments bfloat16 \
  --config "${TILINGS[@]}"
"$PY" benchmarks/kernel.py --out "$OUT/kernel.csv" --moments float32 \
  --shapes "q/o 4096x4096" "up/gate 4096x14336" --tokens 512 \
  --config "${TILINGS[@]}"
echo "suite: kernel part ${SECONDS}s"
"$PY" benchmarks/plot.py "$OUT/kernel.csv" "$OUT/kernel.png"
# Two e2e calls (three arms at BT 512, two at 2048); a failed cell makes a
# call exit 1, which must not skip the other call or the plot.
rc=0
"$PY" benchmarks/e2e.py --out "$OUT/e2e.csv" --bt 512 \
  --arms optax forge forge-xla --budget 250 || rc=1
"$PY" benchmarks/e2e.py --out "$OUT/e2e.csv" --bt 2048 \
  --arms optax forge --budget 170 || rc=1
"$PY" benchmarks/e2e.py --out "$OUT/e2e.csv" --replot --plot "$OUT/e2e.png" || rc=1
echo "suite: results in $OUT (${SECONDS}s)"
exit $rc
