#!/usr/bin/env bash
# H200, session 7 call 35: the make_step tests that are not GPU-marked (they
# run in interpret mode on CI), here compiled: shared/tied weights and
# shared="standard" (docs/parity.md cited session 2's run 11 for them),
# make_step's input checks, has_aux, control flow and the differentiation
# guard (session 6, never run compiled), and the scan variants.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_compiled 540 python3 -m pytest -m "not gpu" tests/test_shared_weights.py \
  tests/test_make_step_inputs.py tests/test_scan.py \
  -q -p no:cacheprovider -rfEs --durations=8 --junitxml="$OUT/pytest_compiled.xml"
