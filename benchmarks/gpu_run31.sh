#!/usr/bin/env bash
# Ran the variant-15 kernel of commit f6d427f as it was before its last change (the
# program's last tile updated from registers, not from the scratch); that
# state was not committed. Reverted with the rest in the commit after f6d427f.
# H200, session 7 call 31: variant 15 -- the interleaved, software-pipelined
# epilogue (BlockConfig.interleave; label ,i<k>): persistent programs, each
# tile's fp32 G parked in the program's scratch tile and applied to W/m/v a
# few rows per main-loop iteration of the program's next tile. First checked
# against the reference on the GPU, then timed beside the best tilings
# without it on 4096^2 and 4096x14336 at BT 512 and 2048.
# Prediction (written before the run): if the chunk traffic overlaps the
# main loop, 4096^2 BT 512 drops from ~105-111 us (best without) to ~75-85 us
# (>= 1.1x XLA), BT 2048 (128x128 i1) from ~202 to ~160-175 us; if the warps
# stall on the chunk loads despite the one-iteration lead, or the scratch
# round trip through L2 costs more than it hides, no gain.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_interleave 150 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  tests/test_kernel.py -k "knob_tilings and (i1 or i2 or i3)"
run variant15 400 python3 benchmarks/kernel.py --out "$OUT/variant15.csv" --torch off \
  --moments bfloat16 --shapes "q/o 4096x4096" "up/gate 4096x14336" --tokens 512 2048 \
  --config 64x128x32,g1,w4,s4,e,o2 64x64x64,g1,w4,s3,e 128x256x32,g8,w8,s4,e,o4 \
  64x128x32,g1,w4,s4,e,i2 64x128x32,g1,w4,s4,e,i1 64x128x32,g8,w4,s4,e,i2 \
  64x64x64,g1,w4,s3,e,i3 128x128x32,g8,w8,s4,e,i1
