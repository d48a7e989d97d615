#!/usr/bin/env bash
# H200, session 2 call 3: the stacked (layer=i) kernel and the scanned-stack
# acceptance, Muon's weight-gradient GEMM count, mask-free tiles (masks only on
# ragged dimensions) side by side, and the end-to-end decoder benchmark.
source "$(dirname "$0")/gpu_lib.sh"
run tests_gpu 150 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_scan.py \
  tests/test_kernel.py -k "scan or stack or knob or in_place or matches_reference_on_gpu"
run muon_memory 60 python3 benchmarks/memory.py --optimizer muon --layers 1 4 --out "$OUT/memory.csv"
C="64x128x64,g1,w4,s3 64x128x64,g1,w4,s3,e 64x128x32,g1,w4,s4,e 128x128x64,g8,w8,s3,e 128x256x64,g8,w8,s3,e"
run variants 120 python3 benchmarks/kernel.py --out "$OUT/variants3.csv" --moments bfloat16 \
  --shapes "q/o 4096x4096" --tokens 16 512 2048 --config $C
run e2e 280 python3 benchmarks/e2e.py --out "$OUT/e2e.csv" --plot "$OUT/e2e.png" --bt 512 2048 --budget 260
