#!/usr/bin/env bash
# H200, session 12 call 60, at the commit that adds this script. Runs 57-59
# showed why the unrolled decoder cannot be faster with FORGE: XLA already
# runs each of optax's updates right after the GEMM forming its G. A scanned
# stack is the case where it cannot: nn.scan's transpose writes every
# layer's G into one stacked pool (512 MiB for 16 x 4096^2 bf16) and optax's
# update reads it after the loop, from HBM. The issue asks for the step
# "with the layers unrolled and scanned"; the scanned step's time had never
# been measured (scan_memory.py measures memory only). e2e_paired.py
# --model stack: 16 x 4096^2 bf16, ReLU, no bias, BT 512 (three processes)
# and 2048 (two), synced and pipelined.
# Predictions (written before the run), FORGE / optax p50 of the per-round
# ratios, both ways: per layer the fused kernel (~105 us at 4096^2 BT 512)
# replaces XLA's GEMM storing G (~46-61 us) and an AdamW reading G, W, m, v
# from HBM (~69 us), beside ~60 us of forward and input-gradient GEMMs:
#   BT 512:  fused 0.88-0.97x; forge-xla 0.93-1.00x (G read back from L2)
#   BT 2048: fused 0.98-1.06x (the kernel's main loop is slower there);
#            forge-xla 0.95-1.00x
source "$(dirname "$0")/gpu_lib.sh"
run stack512 230 python3 benchmarks/e2e_paired.py --model stack --bt 512 \
  --arms optax forge-xla forge --processes 3 --rounds 12 --block 10 \
  --warmup 5 --timeout 75 --out "$OUT/stack512.csv" --plot "$OUT/stack512.png"
run stack2048 $((400 - SECONDS)) python3 benchmarks/e2e_paired.py --model stack \
  --bt 2048 --arms optax forge-xla forge --processes 2 --rounds 12 --block 10 \
  --warmup 5 --timeout 90 --out "$OUT/stack2048.csv" --plot "$OUT/stack2048.png"
