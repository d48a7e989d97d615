#!/usr/bin/env bash
# H200, session 12 call 58, at the commit that adds this script. Run 57's
# paired timing blocked on every step (as e2e.py does): 14.4 ms for optax,
# where its profile's steps, dispatched back to back, took 11.8 ms of wall
# time and 11.4 ms of GPU time. e2e_paired.py now times every arm both ways
# in each round: synced (as before) and pipelined (10 steps dispatched back
# to back, one block at the end: what a training loop that does not read
# every loss sees). BT 512 (three processes, as run 57) and BT 2048 (two).
# Predictions (written before the run), FORGE / optax p50 of the per-round
# ratios:
#   BT 512  synced:    forge-xla 0.99-1.02, fused 1.08-1.10 (run 57: 1.004, 1.090)
#   BT 512  pipelined: forge-xla 0.99-1.01 (GPU busy equal in run 57's profile),
#                      fused 1.06-1.10 (GPU busy +9 %, traced wall +6 %)
#   BT 2048 both:      forge-xla 0.98-1.02, fused 1.07-1.10 (run 55: 1.095)
source "$(dirname "$0")/gpu_lib.sh"
run paired512 260 python3 benchmarks/e2e_paired.py --bt 512 \
  --arms optax forge-xla forge --processes 3 --rounds 12 --block 10 \
  --warmup 5 --timeout 80 --out "$OUT/paired512.csv" --plot "$OUT/paired512.png"
run paired2048 $((560 - SECONDS)) python3 benchmarks/e2e_paired.py --bt 2048 \
  --arms optax forge-xla forge --processes 2 --rounds 12 --block 10 \
  --warmup 5 --timeout 120 --out "$OUT/paired2048.csv" --plot "$OUT/paired2048.png"
