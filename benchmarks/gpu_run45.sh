#!/usr/bin/env bash
# H200, session 9 call 45, same commit as call 44: the rest of the GPU tests
# (autotune, regimes 2/3, scan, torch families) and the bf16-m/v AdamW kernel
# at 4096^2, BT 512 and 2048, beside XLA. Prediction: all pass; the kernel's
# times match run 42's (106.3 / 213.0 us) within the +-4 % spread, since the
# compiled kernel's arithmetic did not change.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu_rest 330 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_gpu_rest.xml" tests/test_autotune.py tests/test_regimes23.py \
  tests/test_scan.py tests/test_torch_families.py
run kernel 120 python3 benchmarks/kernel.py --out "$OUT/kernel.csv" --torch off \
  --moments bfloat16 --shapes "q/o 4096x4096" --tokens 512 2048 --config auto
