#!/usr/bin/env bash
# H200, session 4 call 18: tune the e2e decoder's own projection shapes (they
# are not in the shipped cache), then every GPU-marked test (the changes made
# after run 17 were CPU-tested only).
source "$(dirname "$0")/gpu_lib.sh"
run autotune_decoder 180 python3 -m pallas_kernels.autotune --out "$OUT/e2e_tuned.json" \
  --shapes 2048x2048 2048x1024 2048x5632 5632x2048 2048x32000 --tokens 512 2048 \
  --config 64x64x64,g1,w4,s3,e 64x128x32,g1,w4,s4,e,o2 128x256x32,g8,w8,s4,e,o4 \
  128x256x64,g8,w8,s3,e,o2 64x128x64,g1,w4,s3
run pytest_gpu 390 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests
