#!/usr/bin/env bash
# H200 session 3: verification after the TF32 and optimization-barrier fixes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
SECONDS=0
timeout 100 python3 benchmarks/memory.py --out "$OUT/memory.csv" --layers 1 16 2>&1 | tee "$OUT/memory.log" | grep -v "^     "
echo "[memory ${SECONDS}s]"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_forge_jax.py 2>&1 | tee "$OUT/pytest_forge_jax.log" | tail -4
echo "[forge_jax ${SECONDS}s]"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_torch_bridge.py 2>&1 | tee "$OUT/pytest_torch.log" | tail -6
echo "[torch ${SECONDS}s]"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_families.py -k mlp_training 2>&1 | tee "$OUT/pytest_families.log" | tail -6
echo "[families ${SECONDS}s]"
