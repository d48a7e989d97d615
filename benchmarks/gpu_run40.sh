#!/usr/bin/env bash
# H200, session 8 call 40: every GPU-marked test at the code that ships,
# the first full GPU run after the stored-moment decay (b1_m / decay_m,
# commit 6c4a0d8), the frozen-layer-with-penalty path, the weak-type decay
# check and forge_torch's forward-AD fallback (session 7, CPU-checked only).
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 570 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_gpu.xml" tests
