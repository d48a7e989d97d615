#!/usr/bin/env bash
# H200, session 5 call 25: the e2e step profiled kernel by kernel, FORGE vs
# optax.adamw (benchmarks/e2e_profile.py), at BT 512 and 2048: where the
# measured step gap comes from, instead of summing one-layer timings.
source "$(dirname "$0")/gpu_lib.sh"
run e2e_profile512 200 python3 benchmarks/e2e_profile.py --bt 512 --top 30 \
  --out "$OUT/e2e_profile.csv"
run e2e_profile2048 200 python3 benchmarks/e2e_profile.py --bt 2048 --top 30 \
  --out "$OUT/e2e_profile.csv"
