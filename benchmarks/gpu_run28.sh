#!/usr/bin/env bash
# Runs at commit 6c2240a (variant 14: make_step(overlap=True), the
# forge_overlap e2e arm, benchmarks/hlo_check.py), reverted in the next commit.
# H200, session 6 call 28. Run 27 showed XLA makes each overlap=True update
# an async call-start/call-done pair with no copies, but its default
# scheduler puts the done right after the start (0 kernels between: nothing
# overlaps). Here: the same with XLA's latency-hiding scheduler
# (forge_jax.OVERLAP_COMPILER_OPTIONS), and the e2e step at BT 512 with every
# arm under that scheduler (--lhs: the control), plus optax as users compile
# it by default, all in one run.
source "$(dirname "$0")/gpu_lib.sh"
run hlo_check 90 python3 benchmarks/hlo_check.py --bt 512 --arms forge_overlap
run e2e512_lhs 240 python3 benchmarks/e2e.py --bt 512 --lhs \
  --arms optax forge forge_overlap --cell-timeout 100 --out "$OUT/e2e.csv"
run e2e512_default 95 python3 benchmarks/e2e.py --bt 512 --arms optax \
  --cell-timeout 90 --out "$OUT/e2e.csv"
