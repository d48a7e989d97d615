#!/usr/bin/env bash
# H200, session 8 call 43: the GPU tests run 42 did not reach (its pytest_gpu
# step hit its 330 s limit after 62 of 68 tests, all passed): the regime-2/3,
# scan and torch-family GPU tests, at the same commit. Typed as one command
# into the device tool; this file is that command.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu_rest 185 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_gpu_rest.xml" tests/test_regimes23.py tests/test_scan.py \
  tests/test_torch_families.py
