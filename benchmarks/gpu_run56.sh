#!/usr/bin/env bash
# H200, session 12 call 56, at the commit that adds this script. Session 11's
# changes after run 55 ran on the CPU only (check_block_config in
# fused_wgrad_update, Dense and the scanned stack; BlockConfig's int check;
# tune() refusing a rule name; the nadamw alias; forge_torch's owner stack,
# zero-size Linear on the standard path; the scanned stack's width-70 GPU
# parity case; the strengthened tests). Every GPU-marked test, one pytest
# process (81 tests; ~470 s predicted from runs 40, 49 and 51). Prediction:
# all pass.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 575 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_gpu.xml" --durations=15 tests
