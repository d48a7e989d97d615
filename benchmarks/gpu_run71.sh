#!/usr/bin/env bash
# H200, session 14 call 71: after UpdateRule.tuned_as (the Adam variants and
# forge_torch's AdamW / Adam take AdamW's cached tilings instead of the
# heuristic), the GPU tests whose kernels now compile with other tilings:
# the torch bridge and families, forge_jax's families, the autotuner's.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 200 python3 -m pytest -m gpu -n 4 -q -p no:cacheprovider \
  -o console_output_style=classic tests/test_torch_bridge.py \
  tests/test_torch_families.py tests/test_families.py tests/test_autotune.py \
  tests/test_forge_jax.py --junitxml="$OUT/pytest_gpu.xml"
