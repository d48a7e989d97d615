#!/usr/bin/env bash
# H200, session 12 call 57, at the commit that adds this script. The e2e
# question runs 50-55 left open: is forge-xla's step (BT 512) faster than
# optax's, on par, or slower? e2e.py's cells (one process and compile each)
# differ by up to 7.5 % between cells with identical losses, more than the
# ~1 % in question. benchmarks/e2e_paired.py compiles every arm in one
# process and alternates blocks of 10 steps (12 rounds, order reversed every
# other round), three fresh processes pooled; each scheduled HLO is kept (to
# read how far each layer's update sits from its gradient GEMM). Then
# e2e_profile.py: GPU busy time per arm, kernel category by category,
# forge-xla included for the first time.
# Predictions (written before the run): per-round ratios spread <= 2 % within
# a process; forge-xla / optax p50 0.98-1.02, the three processes' medians
# within 2 % of each other; fused / optax 1.05-1.08; forge-xla's GPU busy time
# within 0.3 ms of optax's (the same GEMMs and update bytes), its wall-time
# gap to busy time the same as optax's.
source "$(dirname "$0")/gpu_lib.sh"
run paired 420 python3 benchmarks/e2e_paired.py --bt 512 \
  --arms optax forge-xla forge --processes 3 --rounds 12 --block 10 \
  --warmup 5 --timeout 135 --hlo-dir "$OUT/hlo" --out "$OUT/paired.csv" \
  --plot "$OUT/paired.png"
gzip -9 "$OUT"/hlo/*/*.hlo.txt 2>/dev/null
run profile $((585 - SECONDS)) python3 benchmarks/e2e_profile.py --bt 512 \
  --arms forge-xla forge optax --steps 10 --out "$OUT/profile.csv"
