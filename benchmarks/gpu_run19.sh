#!/usr/bin/env bash
# H200, session 4 call 19: the torch bridge's stream-ordered mode (GPU tests,
# then torch_memory.py timing host vs stream vs torch side by side), the GPU
# tests run 18's time limit cut (torch families), kernel.py's torch arms on
# CUDA (the CPU smoke test, here on the GPU), and variant 12 (64x128, 8 warps,
# two halves) beside 64x64 and the BT-512 winner.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_torch 200 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  tests/test_torch_bridge.py tests/test_torch_families.py
run pytest_kernel_bench_torch 60 python3 -m pytest -q -p no:cacheprovider -rfEs \
  tests/test_kernel_bench_torch.py
run torch_memory 120 python3 benchmarks/torch_memory.py --out "$OUT/torch_memory.csv" \
  --bt 2048,256 --sync host stream
run variant12 120 python3 benchmarks/kernel.py --out "$OUT/variant12.csv" --torch off \
  --moments bfloat16 --shapes "q/o 4096x4096" "up/gate 4096x14336" --tokens 512 2048 \
  --config 64x128x32,g1,w8,s4,e,o2 64x128x64,g1,w8,s3,e,o2 64x64x64,g1,w4,s3,e \
  64x128x32,g1,w4,s4,e,o2
