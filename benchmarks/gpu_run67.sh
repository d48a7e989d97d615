#!/usr/bin/env bash
# H200, session 14 call 67: the stacked wgrad="xla" path through
# pallas_kernels.stored_g_update (the fused kernel's epilogue on the G that
# XLA's GEMM stored, updating layer i of the W/m/v stacks in place) instead
# of XLA's elementwise rule + one dynamic-update-slice per array (run 66:
# those write-backs cost 3.2 ms of the scanned decoder's 18.8 ms step).
# Predictions (written before the run):
#  - scanned decoder BT 512: forge-xla from 1.10x (run 66) / 1.08x (run 63)
#    to 0.90-0.95x optax; the profile shows no dynamic-update-slice fusion
#    of a weight stack and 2.3-2.9 ms of stored_g_update per step.
#  - scanned decoder BT 2048: forge-xla from 1.014x (run 63) to 0.94-0.98x.
#  - 16 x 4096^2 stack BT 512: forge-xla from 1.13x (run 66) to 0.93-0.98x.
#  - peak (e2e.py --scan, BT 512): forge-xla within a few MiB of the fused
#    arm's (run 64: 5678 MiB against optax's 7120).
source "$(dirname "$0")/gpu_lib.sh"
run pytest_stored 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_kernel.py -k stored --junitxml="$OUT/pytest_stored.xml"
run profile512 120 python3 benchmarks/e2e_profile.py --scan --bt 512 \
  --arms forge-xla optax --top 20 --out "$OUT/profile512.csv"
run paired512 110 python3 benchmarks/e2e_paired.py --scan --bt 512 \
  --arms optax forge-xla forge --processes 1 --rounds 12 --block 10 \
  --warmup 5 --timeout 100 --out "$OUT/paired512.csv"
run stack512 80 python3 benchmarks/e2e_paired.py --model stack --bt 512 \
  --arms optax forge-xla forge --processes 1 --rounds 12 --block 10 \
  --warmup 5 --timeout 70 --out "$OUT/stack512.csv"
run paired2048 110 python3 benchmarks/e2e_paired.py --scan --bt 2048 \
  --arms optax forge-xla forge --processes 1 --rounds 12 --block 5 \
  --warmup 3 --timeout 100 --out "$OUT/paired2048.csv"
run e2e512 $((570 - SECONDS)) python3 benchmarks/e2e.py --scan --bt 512 \
  --arms optax forge-xla --budget $((560 - SECONDS)) --out "$OUT/e2e512.csv"
