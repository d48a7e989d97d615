#!/usr/bin/env bash
# Runs at commit f6d427f (BlockConfig.interleave; reverted in the next commit).
# H200, session 7 call 33: variant 15b -- the interleaved epilogue with the
# last tile also applied from the scratch, chunk by chunk (run 32's Nsight
# Compute: every ,i kernel sat at 255 registers, 2 (or 1) programs per SM,
# against 168 and 3 per SM for the o2 tiling, because the last tile's
# whole-tile epilogue from registers set the kernel's register count).
# Prediction: registers drop to the main loop's + a chunk's (<= 168), so
# 64x128 i3 runs 3 programs per SM; if the chunk traffic then overlaps the
# main loop, 4096^2 BT 512 goes below o2's ~101-116 us. BT 2048's 1.7x loss
# (run 31) is not explained by registers (o2 also ran 2 per SM there), so
# it is predicted to stay slower. Parity first, then timing, then ncu.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_interleave 150 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  tests/test_kernel.py -k "knob_tilings and (i1 or i2 or i3)"
run variant15b 300 python3 benchmarks/kernel.py --out "$OUT/variant15b.csv" --torch off \
  --moments bfloat16 --shapes "q/o 4096x4096" --tokens 512 2048 \
  --config 64x128x32,g1,w4,s4,e,o2 64x64x64,g1,w4,s3,e \
  64x128x32,g1,w4,s4,e,i3 64x128x32,g1,w4,s4,e,i2 64x64x64,g1,w4,s3,e,i4 \
  64x128x64,g1,w4,s3,e,i3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
run ncu 120 "$NCU" --csv --log-file "$OUT/ncu.csv" --kernel-name regex:fused_wgrad \
  --section LaunchStats --section Occupancy --section SpeedOfLight \
  python3 benchmarks/epilogue_probe.py --out "$OUT/once" --once --tokens 512 2048 \
    --config 64x128x32,g1,w4,s4,e,i3 64x64x64,g1,w4,s3,e,i4
