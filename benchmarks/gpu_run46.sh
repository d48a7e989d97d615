#!/usr/bin/env bash
# H200, session 9 call 46: variant 17, eight warps on small tiles (never in
# the config space: every 64x64 tiling so far ran 4 warps). 64x64 on 8 warps
# holds 16 fp32 accumulator elements per thread (64x64 w4: 32; the GEMM-free
# AdamW reached 3.34 TB/s at 16 per thread, run 14), so ~100-130 registers
# and 4-5 programs (32-40 warps) per SM; the main loop runs two warpgroups
# on m64n32 wgmma instructions with 64x64's operand re-reads. 128x64 w8 holds
# 32 per thread with half the re-reads along `in`.
# Prediction (written before the run): at 4096^2 BT 512, 64x64 w8 95-105 us
# against 64x64 w4's ~106 (0.90-0.97x XLA, far from 1.3x); at BT 2048 slower
# than the shipped 128x256 o4 (64x64's operand re-reads); 128x64 w8 between.
# Also the fp32-moment kernel at 4096^2 BT 512 with the tiling it picks by
# itself (not re-measured since session 4).
source "$(dirname "$0")/gpu_lib.sh"
run variant17 300 python3 benchmarks/kernel.py --out "$OUT/variant17.csv" --torch off \
  --moments bfloat16 --shapes "q/o 4096x4096" "gate/up 4096x14336" --tokens 512 2048 \
  --config auto 64x64x64,g1,w8,s3,e 64x64x32,g1,w8,s4,e 64x64x64,g8,w8,s3,e \
  128x64x64,g1,w8,s3,e 128x64x32,g8,w8,s4,e
run fp32_moments 120 python3 benchmarks/kernel.py --out "$OUT/fp32_moments.csv" --torch off \
  --moments float32 --shapes "q/o 4096x4096" --tokens 512 --config auto
