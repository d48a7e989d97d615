#!/usr/bin/env bash
# H200 session 5: re-verify after the three-path refactor of forge_jax; the
# regime-2/3 and torch-family GPU tests; per-family step times.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
SECONDS=0
timeout 80 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_forge_jax.py 2>&1 | tee "$OUT/pytest_forge_jax_gpu.log" | tail -3
echo "[forge_jax ${SECONDS}s]"
timeout 80 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_regimes23.py tests/test_torch_families.py 2>&1 | tee "$OUT/pytest_regimes23_torchfam_gpu.log" | tail -3
echo "[regimes23+torch families ${SECONDS}s]"
timeout 75 python3 benchmarks/families.py --out "$OUT/families.csv" 2>&1 | tee "$OUT/families.log"
echo "[families bench ${SECONDS}s]"
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_families.py -k mlp_training 2>&1 | tee "$OUT/pytest_families.log" | tail -3
echo "[families mlp ${SECONDS}s]"
