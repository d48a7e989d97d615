#!/usr/bin/env bash
# H200, session 12 call 59, at the commit that adds this script. Runs 57-58
# put forge-xla level with optax (the same kernels in the same order, per the
# scheduled HLO) and the fused arm 7-9 % behind. A per-layer choice between
# the fused kernel and XLA's GEMM + update could only beat forge-xla if the
# fused kernel won at some shape of the e2e decoder. kernel.py had only timed
# the Llama-3.1-8B shapes; here the decoder's own (d 2048, kv 1024, ffn 5632,
# vocab 32000), BT 512 and 2048, bf16 W/m/v, the tiling the kernel picks
# (auto: these shapes are not in the cache, so the heuristic) and the five
# curated tilings, torch arms off. Then one e2e.py cell, which has not run on
# the GPU since its options moved into add_model_args.
# Prediction (written before the run): FORGE / XLA 0.80-0.95x at every shape
# and BT for the best tiling (4096x1024 at BT 512 reached 0.93x), so no shape
# where a per-layer choice would take the fused kernel; the e2e cell runs
# (optax p50 13.5-15 ms at BT 512).
source "$(dirname "$0")/gpu_lib.sh"
run kernel 420 python3 benchmarks/kernel.py --out "$OUT/kernel.csv" \
  --moments bfloat16 --tokens 512 2048 --torch off \
  --shapes "q/o 2048x2048" "k/v 2048x1024" "gate/up 2048x5632" \
  "down 5632x2048" "head 2048x32000" \
  --config auto 64x64x64,g1,w4,s3,e 64x128x32,g1,w4,s4,e,o2 \
  128x256x32,g8,w8,s4,e,o4 128x256x64,g8,w8,s3,e,o2 64x128x64,g1,w4,s3
run plot 60 python3 benchmarks/plot.py "$OUT/kernel.csv" "$OUT/kernel.png"
run e2e $((570 - SECONDS)) python3 benchmarks/e2e.py --bt 512 --arms optax \
  --cell-timeout 90 --out "$OUT/e2e.csv"
