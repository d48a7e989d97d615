#!/usr/bin/env bash
# H200, session 12 call 61, at the commit that adds this script. suite.sh
# gained a scan part (scan_memory.py, then e2e_paired.py --model stack at
# BT 512 and 2048, two processes each) and a PART selector; this runs that
# part alone, as `suite.sh OUT scan` (the whole suite does not fit in the
# session's remaining device time).
# Predictions (written before the run): scan_memory as run 10 (compiled
# temporaries 204 vs 716 MiB, saved 1.00 x pool); the fused stack step
# 0.91-0.93x optax's at BT 512 and 1.02-1.04x at 2048 (run 60); the part
# done within 150 s.
source "$(dirname "$0")/gpu_lib.sh"
export PYTHON=python3
run suite_scan 280 bash benchmarks/suite.sh "$OUT/suite" scan
