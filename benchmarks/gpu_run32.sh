#!/usr/bin/env bash
# Ran the variant-15 kernel of commit f6d427f as it was before its last change (the
# program's last tile updated from registers, not from the scratch); that
# state was not committed. Reverted with the rest in the commit after f6d427f.
# H200, session 7 call 32: why variant 15 (the interleaved epilogue, ,i<k>)
# is slower (run 31: 4096^2 BT 512 136-212 us vs 101-116 without; BT 2048
# 294-625 vs 207). Nsight Compute sections (launch, occupancy, warp states,
# speed of light) on each kernel once, the fused kernels only, beside the
# o2 tiling it was meant to beat.
source "$(dirname "$0")/gpu_lib.sh"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/nsight-compute*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
run ncu 300 "$NCU" --csv --log-file "$OUT/ncu.csv" --kernel-name regex:fused_wgrad \
  --section LaunchStats --section Occupancy --section WarpStateStats --section SpeedOfLight \
  python3 benchmarks/epilogue_probe.py --out "$OUT/once" --once --tokens 512 2048 \
    --config 64x128x32,g1,w4,s4,e,o2 64x128x32,g1,w4,s4,e,i2 128x128x32,g8,w8,s4,e,i1
