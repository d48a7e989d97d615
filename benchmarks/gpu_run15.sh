#!/usr/bin/env bash
# H200, session 3 call 15: the tilings that cut registers per thread (64x64,
# split_out) beside the previous winners, over every Llama-8B shape x BT,
# bf16 moments (and fp32 moments at 4096^2, BT 512); the CSV feeds the
# autotune cache (python -m pallas_kernels.autotune --from-csv).
source "$(dirname "$0")/gpu_lib.sh"
CONFIGS="64x128x32,g1,w4,s4,e 64x128x32,g1,w4,s4,e,o2 64x128x32,g1,w4,s4,e,o4 64x64x32,g1,w4,s4,e \
64x64x64,g1,w4,s3,e 64x64x32,g1,w4,s4,e,o2 64x64x64,g8,w4,s3,e 128x128x32,g1,w4,s4,e,o2 \
128x256x32,g8,w8,s4,e,o4 128x256x64,g8,w8,s3,e,o2 128x128x64,g8,w8,s3,e"
run sweep_bf16 420 python3 benchmarks/kernel.py --out "$OUT/sweep.csv" --moments bfloat16 --config $CONFIGS
run sweep_fp32m 90 python3 benchmarks/kernel.py --out "$OUT/sweep.csv" --moments float32 \
  --shapes "q/o 4096x4096" --tokens 512 --config 64x128x32,g1,w4,s4,e 64x128x32,g1,w4,s4,e,o2 64x64x32,g1,w4,s4,e 64x64x32,g1,w4,s4,e,o2
