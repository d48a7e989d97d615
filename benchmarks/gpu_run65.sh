#!/usr/bin/env bash
# H200, session 13 call 65, at the commit that adds this script: every
# GPU-marked test after the session's changes (ScannedBlocks and its review
# fixes, the Dense block hook, the stacked xla path's barrier, the shared
# update_layer). Prediction: all pass (run 56 took 450 s for 81 tests; now
# 3 more in tests/test_blocks.py), within ~480 s.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 555 python3 -m pytest -m gpu tests -q -p no:cacheprovider \
  --junitxml="$OUT/pytest_gpu.xml"
