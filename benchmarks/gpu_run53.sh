#!/usr/bin/env bash
# H200, session 10 call 53 (the last ~140 s of device time): the GPU-marked
# wgrad="xla" tests after the review changes (the layer's precision reaches
# the unfused GEMM; an unknown mode is refused). Prediction: both pass.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_xla_gpu 70 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  tests/test_forge_jax.py -k "xla"
