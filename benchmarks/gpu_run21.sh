#!/usr/bin/env bash
# H200, session 4 call 21: the e2e decoder's own projection shapes through
# kernel.py (FORGE with the tiling it picks, beside XLA's unfused step), to
# decompose the e2e step-time gap layer by layer.
source "$(dirname "$0")/gpu_lib.sh"
run decoder_shapes 300 python3 benchmarks/kernel.py --out "$OUT/decoder_shapes.csv" \
  --torch off --moments bfloat16 --tokens 512 2048 --config auto \
  --shapes "q/o 2048x2048" "k/v 2048x1024" "gate/up 2048x5632" "down 5632x2048" \
  "lm_head 2048x32000"
