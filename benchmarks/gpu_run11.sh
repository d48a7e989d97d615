#!/usr/bin/env bash
# H200, session 2 call 6: every tiling in the shipped autotune cache against
# the reference (compiled), and the shared-weight fallback with compiled kernels.
source "$(dirname "$0")/gpu_lib.sh"
run shipped_tilings 75 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_autotune.py -k shipped
run shared_weights 80 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/test_shared_weights.py
