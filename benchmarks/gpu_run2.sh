#!/usr/bin/env bash
# H200 session 2: the whole suite compiled on the GPU, memory and in-place
# checks, torch memory benchmark. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
timeout 100 python3 benchmarks/memory.py --out "$OUT/memory.csv" --hlo-dir "$OUT/hlo" 2>&1 | tee "$OUT/memory.log"
timeout 330 python3 -m pytest -q -p no:cacheprovider -rfE tests/ 2>&1 | tee "$OUT/pytest.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
timeout 40 python3 -m pytest -q -s -p no:cacheprovider tests/test_forge_jax.py -k "bf16_fused_error and gpu" 2>&1 | grep -E "bf16 rms|passed|failed"
timeout 90 python3 benchmarks/torch_memory.py --out "$OUT/torch_memory.csv" 2>&1 | tee "$OUT/torch_memory.log" | tail -15
