#!/usr/bin/env bash
# H200 session 4: the revised in-place/no-G test, torch memory at small BT,
# fp32-moment kernel timings. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
SECONDS=0
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_forge_jax.py -k 4096 2>&1 | tee "$OUT/pytest_4096.log" | tail -4
echo "[4096 ${SECONDS}s]"
timeout 100 python3 benchmarks/torch_memory.py --out "$OUT/torch_memory.csv" --bt 128,64 --assert-peak-bt 128,64 2>&1 | tee "$OUT/torch_memory.log" | tail -12
echo "[torch ${SECONDS}s]"
timeout 120 python3 benchmarks/kernel.py --out "$OUT/kernel_fp32m.csv" --tokens 512 --moments float32 --shapes "q/o 4096x4096" "up/gate 4096x14336" --configs 2 2>&1 | tee "$OUT/kernel_fp32m.log"
echo "[kernel ${SECONDS}s]"
