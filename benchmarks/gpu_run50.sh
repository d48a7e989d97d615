#!/usr/bin/env bash
# H200, session 10 call 50: the e2e decoder step with the new
# make_step(..., wgrad="xla") arm (each layer's update in its own backward,
# from XLA's GEMM storing that layer's G) beside optax and the fused arm.
# Prediction: forge-xla's step time equals optax's within the ~3 % spread
# (the same GEMMs and elementwise AdamW bytes; one layer's G read back soon
# after it is written, partly from L2) and its peak stays below optax's (one
# G live instead of all); forge as run 41 (~1.07x optax).
source "$(dirname "$0")/gpu_lib.sh"
run e2e512 330 python3 benchmarks/e2e.py --bt 512 --arms optax forge-xla forge \
  --cell-timeout 150 --out "$OUT/e2e.csv"
run e2e2048 200 python3 benchmarks/e2e.py --bt 2048 --arms optax forge-xla \
  --cell-timeout 110 --out "$OUT/e2e.csv"
