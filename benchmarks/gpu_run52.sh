#!/usr/bin/env bash
# H200, session 10 call 52: run 50 measured forge-xla at 0.985x optax (BT
# 512), run 51 at 1.071x, each a fresh compile; the spread between compiles
# of one arm is the question. Three arms twice, in two orders, one process
# per cell as always. Prediction: optax 14.2-14.4 ms each time; forge-xla
# varies by compile between ~14.1 and ~15.2 ms; forge (fused) 15.3-15.5 ms.
source "$(dirname "$0")/gpu_lib.sh"
run e2e_a 215 python3 benchmarks/e2e.py --bt 512 --arms forge-xla optax forge \
  --cell-timeout 75 --out "$OUT/e2e.csv"
run e2e_b 215 python3 benchmarks/e2e.py --bt 512 --arms optax forge forge-xla \
  --cell-timeout 75 --out "$OUT/e2e.csv"
