#!/usr/bin/env bash
# H200, session 13 call 63, at the commit that adds this script.
# 1. The stacked xla path (make_step(wgrad="xla") with ScannedBlocks /
#    ScannedDenseStack, stack_update "layer"): the new slices now pass an
#    optimization_barrier before their dynamic-update-slice. On the CPU that
#    removed every stack-sized copy from the backward loop body (28 per
#    iteration in the scanned tiny decoder; hlo_schedule.py). Run 62 had
#    forge-xla 1.13x slower than optax on the scanned decoder at BT 512.
#    Prediction: forge-xla 0.97-1.00x optax (the fused arm unchanged,
#    0.95x); on the 16 x 4096^2 stack forge-xla from 1.18-1.20x to
#    0.95-1.00x.
# 2. The scanned decoder at BT 2048, paired and per cell (peak).
#    Prediction: fused 0.98-1.02x optax; peak ~1.4 GiB below optax's.
# 3. The GPU tests of the two stacked modules again (the barrier).
source "$(dirname "$0")/gpu_lib.sh"
run paired512 150 python3 benchmarks/e2e_paired.py --scan --bt 512 \
  --arms optax forge-xla forge --processes 2 --rounds 12 --block 10 \
  --warmup 5 --timeout 70 --out "$OUT/paired512.csv" --plot "$OUT/paired512.png"
run stack512 80 python3 benchmarks/e2e_paired.py --model stack --bt 512 \
  --arms optax forge-xla forge --processes 1 --rounds 12 --block 10 \
  --warmup 5 --timeout 70 --out "$OUT/stack512.csv" --plot "$OUT/stack512.png"
run paired2048 170 python3 benchmarks/e2e_paired.py --scan --bt 2048 \
  --arms optax forge-xla forge --processes 2 --rounds 12 --block 5 \
  --warmup 3 --timeout 80 --out "$OUT/paired2048.csv" --plot "$OUT/paired2048.png"
run e2e2048 90 python3 benchmarks/e2e.py --scan --bt 2048 --arms optax forge \
  --budget 85 --out "$OUT/e2e2048.csv" --plot "$OUT/e2e2048.png"
run pytest_gpu $((575 - SECONDS)) python3 -m pytest -m gpu tests/test_blocks.py \
  tests/test_scan.py -q -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml"
