#!/usr/bin/env bash
# H200, session 14 call 70, at the session's final code (after the review):
# every GPU-marked test again (96: run 69's 94, plus the two no-gradient-pool
# tests now also run with wgrad="xla" and check the compiled step's loops
# for stack-sized copies, both modes), in four pytest workers. The review
# changed the stacked xla path only where there is no GPU (interpret mode
# keeps XLA's rule); on the GPU it is run 69's.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 560 python3 -m pytest -m gpu tests -n 4 -q -p no:cacheprovider \
  -o console_output_style=classic --junitxml="$OUT/pytest_gpu.xml"
