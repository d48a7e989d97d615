#!/usr/bin/env bash
# H200, session 9 call 48, at the static rounding flags (eb55bc4): the
# GPU-marked tests call 47 did not run (accumulation, forge_jax, the bridge,
# regimes 2/3, scan, torch families, autotune), then, with the device time
# left, the e2e decoder step at BT 512 beside optax. Prediction: all pass;
# e2e as run 41 (15.47 vs 14.43 ms): its bf16-parameter kernels have flag 0,
# the code run 41 ran before the flags existed.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu_rest 330 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_gpu_rest.xml" tests/test_accumulate.py tests/test_forge_jax.py \
  tests/test_torch_bridge.py tests/test_regimes23.py tests/test_scan.py \
  tests/test_torch_families.py tests/test_autotune.py
run e2e512 200 python3 benchmarks/e2e.py --bt 512 --arms optax forge \
  --cell-timeout 90 --out "$OUT/e2e.csv"
