#!/usr/bin/env bash
# H200, session 5 call 24: a wider tuning of the e2e decoder's projection
# shapes at BT 512 (run 18 tried 5 tilings; the acceptance cell is BT 512),
# then e2e.py at BT 512 with that cache in front of the shipped one
# (FORGE_AUTOTUNE_CACHE), then the kernel's and the autotuner's GPU tests.
source "$(dirname "$0")/gpu_lib.sh"
run autotune_decoder512 200 python3 -m pallas_kernels.autotune \
  --out "$OUT/decoder512_tuned.json" \
  --shapes 2048x2048 2048x1024 2048x5632 5632x2048 2048x32000 --tokens 512 \
  --config 64x64x64,g1,w4,s3,e 64x64x32,g1,w4,s4,e 64x64x64,g8,w4,s3,e \
  64x128x32,g1,w4,s4,e,o2 64x128x32,g8,w4,s4,e,o2 64x128x64,g1,w4,s3,e,o2 \
  128x128x32,g1,w4,s4,e,o2 128x256x32,g8,w8,s4,e,o4 128x128x64,g8,w8,s3,e
run e2e512 200 env FORGE_AUTOTUNE_CACHE="$OUT/decoder512_tuned.json" \
  python3 benchmarks/e2e.py --out "$OUT/e2e512.csv" --bt 512
run pytest_kernel 130 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  tests/test_kernel.py -k "not knob_tilings"
run pytest_autotune 80 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  tests/test_autotune.py
