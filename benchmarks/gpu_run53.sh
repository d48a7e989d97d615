#!/usr/bin/env bash
# H200, session 11 call 53, at the commit that adds this script. Session 10's
# last changes ran on the CPU only: the xla-path GEMM's precision argument
# and operand-following default, the jaxpr path tests, a renamed GPU test.
# Then the question runs 50-52 left open: is forge-xla's e2e step (BT 512)
# faster than optax's, or on par? Three rounds of both arms, alternating
# order, a fresh process and compile per cell. Prediction: every test
# passes; forge-xla's median within +-3 % of optax's (runs 50-52: 0.985x,
# 1.071x, 0.968x), optax's cells within 2 % of each other.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 150 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_gpu.xml" tests/test_forge_jax.py tests/test_scan.py \
  tests/test_accumulate.py
run pytest_xla_wgrad 90 python3 -m pytest -q -p no:cacheprovider -rfEs \
  --junitxml="$OUT/pytest_xla_wgrad.xml" tests/test_families.py tests/test_regimes23.py \
  -k "mlp_training and xla"
run e2e512 $((580 - SECONDS)) python3 benchmarks/e2e.py --bt 512 --arms optax forge-xla \
  --repeat 3 --cell-timeout 90 --budget $((570 - SECONDS)) --out "$OUT/e2e.csv"
