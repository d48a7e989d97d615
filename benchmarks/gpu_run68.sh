#!/usr/bin/env bash
# H200, session 14 call 68, at the commit that adds this script: the whole
# benchmark suite (kernel, e2e, scan) after the stacked wgrad="xla" path
# moved to pallas_kernels.stored_g_update (run 67). The scan part now runs
# the scanned decoder's forge-xla arm too (e2e.py --scan, BT 512 and 2048).
# Packed into one archive (the device tool returns at most 8 files).
# Predictions (written before the run): the suite in 450-520 s; kernel and
# unrolled e2e as run 64 within the +-5 % spread (unchanged code); stack
# forge-xla ~0.87x optax at BT 512 (run 67: 0.866x) and 0.92-0.97x at 2048;
# scanned decoder forge-xla ~0.90x (BT 512) and ~0.95x (BT 2048) per cell,
# its peak within a few MiB of the fused arm's (~1.45 GiB below optax's).
source "$(dirname "$0")/gpu_lib.sh"
export PYTHON=python3
run suite 570 bash benchmarks/suite.sh "$OUT/suite"
cp "$OUT/suite.log" "$OUT/suite/" 2>/dev/null
tar czf "$OUT/suite.tgz" -C "$OUT" suite && rm -rf "$OUT/suite"
