#!/usr/bin/env bash
# H200, session 2 call 1: does issuing the W/m/v loads before the main loop
# (BlockConfig.prefetch) overlap the epilogue traffic with the GEMM? Kernel
# tests for the prefetch tilings, then the variants side by side.
source "$(dirname "$0")/gpu_lib.sh"
run kernel_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_kernel.py
C="64x128x64,g1,w4,s3 64x128x64,g1,w4,s3,p 64x128x64,g1,w8,s3,p 64x128x64,g1,w4,s2,p
   128x128x64,g1,w8,s3 128x128x64,g1,w8,s3,p 128x128x64,g8,w8,s3,p 128x256x64,g1,w8,s3,p 64x256x64,g1,w4,s3,p"
run variants 300 python3 benchmarks/kernel.py --out "$OUT/variants.csv" --moments bfloat16 \
  --shapes "q/o 4096x4096" "up/gate 4096x14336" --tokens 512 2048 4096 --config $C
