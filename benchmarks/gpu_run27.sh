#!/usr/bin/env bash
# Runs at commit 6c2240a (variant 14: make_step(overlap=True), the
# forge_overlap e2e arm, benchmarks/hlo_check.py), reverted in the next commit.
# H200, session 6 call 27: make_step(..., overlap=True) -- each layer's fused
# update on a second GPU stream (XLA stream annotation). Does XLA make the
# calls asynchronous without copying W/m/v (hlo_check), does the e2e step get
# faster than optax at BT 512 and 2048 with no higher peak (e2e), and do the
# fused kernels actually run beside other kernels (e2e_profile)?
source "$(dirname "$0")/gpu_lib.sh"
run hlo_check 120 python3 benchmarks/hlo_check.py --bt 512 --dump "$OUT/hlo"
gzip -f "$OUT"/hlo/*.txt 2>/dev/null
run e2e512 200 python3 benchmarks/e2e.py --bt 512 \
  --arms optax forge forge_overlap --cell-timeout 100 --out "$OUT/e2e.csv"
run profile512 150 python3 benchmarks/e2e_profile.py --bt 512 \
  --arms forge_overlap optax --top 20 --out "$OUT/e2e_profile.csv"
run e2e2048 130 python3 benchmarks/e2e.py --bt 2048 \
  --arms optax forge_overlap --cell-timeout 80 --budget 125 --out "$OUT/e2e.csv"
