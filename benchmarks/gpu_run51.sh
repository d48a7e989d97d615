#!/usr/bin/env bash
# H200, session 10 call 51, after make_step(..., wgrad="xla"): the GPU tests
# not run at this code yet (forge_jax incl. the new in-place/one-G test for
# wgrad="xla" and its fp32 parity, accumulation, the bridge, regimes 2/3,
# scan, torch families), every family's 20-step MLP parity with
# wgrad="xla" compiled on the GPU, then the e2e BT 512 pair again in the
# reverse order (forge-xla first). Prediction: all pass; forge-xla within
# +-2 % of optax again (run 50: 0.985x).
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 400 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_gpu.xml" tests/test_forge_jax.py tests/test_accumulate.py \
  tests/test_torch_bridge.py tests/test_regimes23.py tests/test_scan.py \
  tests/test_torch_families.py
run pytest_xla_wgrad 120 python3 -m pytest -q -p no:cacheprovider -rfEs \
  --junitxml="$OUT/pytest_xla_wgrad.xml" tests/test_families.py tests/test_regimes23.py \
  -k "mlp_training and xla"
run e2e512 170 python3 benchmarks/e2e.py --bt 512 --arms forge-xla optax \
  --cell-timeout 80 --out "$OUT/e2e.csv"
