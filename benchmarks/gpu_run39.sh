#!/usr/bin/env bash
# Runs at commit 73aad2c (BlockConfig.touch; reverted in the next commit).
# H200, session 8 call 39: variant 16 -- BlockConfig.touch (label ",t"): before
# the main loop each program loads one element of every 32-byte sector of its
# W/m/v tile (evict_last), a few registers instead of the tile (variant 2
# held the whole tile and lost occupancy), and consumes them after the loop
# through an inline-PTX select that never fires. The state's HBM reads are
# then in flight while the tensor cores run; the epilogue finds the tile in L2
# and pays only L2 reads and the stores.
# Prediction (written before the run): 4096^2 BT 512 with 64x64x64 e,t drops
# from ~100-105 us to ~85 us (main loop ~52 + L2-fed epilogue); BT 2048 with
# 128x256 o4 from ~206 to ~185-190 us; 4096x14336 BT 512 o2 from ~340 to
# ~290 us. Risks: ptxas sinks the loads to their use (no change), or the warm
# lines are evicted by the operands before the epilogue (no change).
# Also the first GPU run of the stored-moment decay (b1_m, commit 6c4a0d8):
# the plain tilings here time the code that ships.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_touch 200 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_touch.xml" tests/test_kernel.py -k "touch or knob_tilings"
run variant16 380 python3 benchmarks/kernel.py --out "$OUT/variant16.csv" --torch off \
  --moments bfloat16 --shapes "q/o 4096x4096" "up/gate 4096x14336" --tokens 512 2048 \
  --config 64x64x64,g1,w4,s3,e 64x64x64,g1,w4,s3,e,t \
  64x128x32,g1,w4,s4,e,o2 64x128x32,g1,w4,s4,e,t,o2 \
  128x256x32,g8,w8,s4,e,o4 128x256x32,g8,w8,s4,e,t,o4
