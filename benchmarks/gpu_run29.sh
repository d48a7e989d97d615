#!/usr/bin/env bash
# H200, session 6 call 29: every GPU-marked test at the current code (after
# session 5's review fixes and merged tuning cache, and variant 14's revert):
# the kernel, autotuner, forge_jax, scan, accumulate, regime-2/3 and torch
# bridge tests on the compiled (non-interpret) path.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 560 python3 -m pytest -m gpu tests -q -p no:cacheprovider \
  -rs --durations=15 --junitxml="$OUT/pytest_gpu.xml"
