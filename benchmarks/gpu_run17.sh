#!/usr/bin/env bash
# H200, session 3 call 17: the kernel GPU tests that run 16's 130 s limit cut
# off (the knob tilings after the sixth, and the two in-place pointer tests).
source "$(dirname "$0")/gpu_lib.sh"
run pytest_kernel_rest 170 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_kernel.py -k "in_place or knob"
