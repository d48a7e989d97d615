#!/usr/bin/env bash
# H200, session 2 call 4: torch's CUDA fused Adam rule, gradient accumulation
# with compiled kernels, and the end-to-end decoder at BT 2048.
source "$(dirname "$0")/gpu_lib.sh"
run torch_gpu 150 python3 -m pytest -q -s -p no:cacheprovider -rfE -m gpu tests/test_torch_families.py
run accumulate_gpu 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_accumulate.py \
  -k "on_gpu or scanned_stack_exact"
run e2e 235 python3 benchmarks/e2e.py --out "$OUT/e2e.csv" --plot "$OUT/e2e.png" --bt 2048 --budget 225
