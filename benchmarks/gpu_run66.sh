#!/usr/bin/env bash
# H200, session 14 call 66. Where the stacked wgrad="xla" path (forge-xla on
# the scanned decoder: 1.08x optax at BT 512 in run 63) loses its time.
# Hypothesis (written before the run): its backward loop moves ~28 bytes per
# stacked weight element (G written and read, 4; W/m/v slices read, 6; the
# barrier's new slices written, 6; each dynamic-update-slice reading them
# back and writing the stack, 12) against optax's 16 (G into its pool, then
# the update), i.e. ~0.72e9 * 12 B = 8.6 GB more, ~2.5 ms at 3.4 TB/s, more
# than the 1.4 ms measured: so part of the copy is fused, or runs faster.
# 1. The scanned decoder's kernels per step, per arm (e2e_profile.py --scan).
# 2. The compiled HLO of every arm, scanned decoder and 16 x 4096^2 stack,
#    packed in one archive (the device tool returns at most 8 files).
source "$(dirname "$0")/gpu_lib.sh"
run profile512 200 python3 benchmarks/e2e_profile.py --scan --bt 512 \
  --arms forge-xla forge optax --top 40 --out "$OUT/profile512.csv"
run hlo_scan 120 python3 benchmarks/e2e_paired.py --scan --bt 512 \
  --arms optax forge-xla forge --processes 1 --rounds 1 --block 2 \
  --warmup 1 --timeout 110 --hlo-dir "$OUT/hlo/scan" --out "$OUT/hlo_scan.csv"
run hlo_stack 90 python3 benchmarks/e2e_paired.py --model stack --bt 512 \
  --arms optax forge-xla forge --processes 1 --rounds 1 --block 2 \
  --warmup 1 --timeout 80 --hlo-dir "$OUT/hlo/stack" --out "$OUT/hlo_stack.csv"
tar -czf "$OUT/hlo.tgz" -C "$OUT" hlo && rm -rf "$OUT/hlo"
