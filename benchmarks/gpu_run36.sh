#!/usr/bin/env bash
# H200, session 7 call 36: more of the suite's non-GPU-marked tests compiled
# on the H200 (CI runs them in interpret mode): forge_jax vs optax
# (test_forge_jax.py), MultiSteps (test_accumulate.py), regimes 2/3.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_compiled2 470 python3 -m pytest -m "not gpu" tests/test_forge_jax.py \
  tests/test_accumulate.py tests/test_regimes23.py \
  -q -p no:cacheprovider -rfEs --durations=8 --junitxml="$OUT/pytest_compiled2.xml"
