#!/usr/bin/env bash
# H200, session 7 call 34: every GPU-marked test at the code that ships (the
# kernel as in run 30; after variant 15's revert), including those session 6
# could not run: the 3 in test_torch_families.py after its forge_torch
# changes, the new ragged stacked-kernel test, the CUDA-only device-mismatch
# test, and the make_step / forge_torch changes made after run 30.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 560 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rfEs \
  --durations=10 --junitxml="$OUT/pytest_gpu.xml"
