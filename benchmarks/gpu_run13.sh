#!/usr/bin/env bash
# H200, session 3 call 13: the probe's PTX/registers and GEMM-free Pallas
# AdamW (run 12 lost both to a dump-name and a donation bug), then the
# split_out tilings beside the previous best over two shapes x three BT.
# (epilogue_probe.py's --ptx was removed after run 13: XLA's dump holds no PTX of a
# Pallas-Triton kernel -- docs/perf_notes.md, variant 6. A historical record:
# as written it no longer runs; drop --ptx to rerun.)
source "$(dirname "$0")/gpu_lib.sh"
run probe 200 python3 benchmarks/epilogue_probe.py --out "$OUT/probe" --ptx --tokens 16 \
  --config 64x128x32,g1,w4,s4,e 64x128x32,g1,w4,s4,e,o2 128x128x64,g8,w8,s3,e 128x256x64,g8,w8,s3,e,o4
run split_sweep 380 python3 benchmarks/kernel.py --out "$OUT/split_sweep.csv" --moments bfloat16 \
  --shapes "q/o 4096x4096" "up/gate 4096x14336" --tokens 512 2048 4096 --config \
  64x128x32,g1,w4,s4,e 64x128x32,g1,w4,s4,e,o2 64x128x64,g1,w4,s3,e,o2 64x256x32,g1,w4,s4,e,o2 \
  64x256x32,g1,w8,s4,e,o4 128x128x32,g1,w4,s4,e,o2 128x128x64,g8,w8,s3,e 128x256x64,g8,w8,s3,e,o4 \
  128x256x64,g8,w8,s3,e,o2 128x256x32,g8,w8,s4,e,o4 64x256x64,g8,w4,s3,e,o2
