#!/usr/bin/env bash
# H200, session 14 call 69, at the session's final code: every GPU-marked
# test (94: session 13's 84 and the 10 of stored_g_update), in four pytest
# workers at once (pytest-xdist, installed on the device; run 65 ran 81 of
# 84 in one process before its 555 s limit cut it). Each worker is its own
# process with its own GPU allocator, so the memory and in-place checks
# read their own process.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 570 python3 -m pytest -m gpu tests -n 4 -q -p no:cacheprovider \
  -o console_output_style=classic --junitxml="$OUT/pytest_gpu.xml"
