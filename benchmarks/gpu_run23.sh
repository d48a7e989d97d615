#!/usr/bin/env bash
# H200, session 5 call 23: variant 13 -- persistent programs with a staggered
# start (BlockConfig.persistent / .stagger; labels ,P<k> ,d<n>) -- checked
# against the reference on the GPU, then timed beside the non-persistent
# tilings on 4096^2 and 4096x14336 at BT 512 and 2048; then the bridge's GPU
# tests (not re-run after session 4's last optimizer change). The ,P/,d knobs
# exist only in commit 6b26533 (reverted after this measurement).
source "$(dirname "$0")/gpu_lib.sh"
run pytest_knobs 150 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  tests/test_kernel.py -k knob_tilings
run variant13 330 python3 benchmarks/kernel.py --out "$OUT/variant13.csv" --torch off \
  --moments bfloat16 --shapes "q/o 4096x4096" "up/gate 4096x14336" --tokens 512 2048 \
  --config 64x128x32,g1,w4,s4,e,o2 64x128x32,g1,w4,s4,e,o2,P2 \
  64x128x32,g1,w4,s4,e,o2,P2,d300 64x128x32,g1,w4,s4,e,o2,P2,d1000 \
  64x128x32,g1,w4,s4,e,o2,P2,d3000 \
  64x64x64,g1,w4,s3,e 64x64x64,g1,w4,s3,e,P3 64x64x64,g1,w4,s3,e,P3,d300 \
  64x64x64,g1,w4,s3,e,P3,d1000 \
  128x256x32,g8,w8,s4,e,o4 128x256x32,g8,w8,s4,e,o4,P1
run pytest_bridge 80 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  tests/test_torch_bridge.py
