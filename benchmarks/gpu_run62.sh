#!/usr/bin/env bash
# H200, session 13 call 62, at the commit that adds this script: the new
# forge_jax.ScannedBlocks (a scanned stack of whole decoder blocks) and the
# scanned decoder arm of e2e.py / e2e_paired.py (--scan).
# Predictions (written before the run):
# 1. GPU tests of ScannedBlocks pass (no gradient pool: temporaries at least
#    0.9 x pool below flax's nn.scan(nn.remat) + optax; buffers in place;
#    fp32 parity); ScannedDenseStack's GPU tests still pass after the shared
#    update_layer refactor.
# 2. Scanned decoder (0.886B, BT 512), paired: the optax arm writes the whole
#    stacked gradient pool (~1.4 GiB bf16) in its backward loop and reads it
#    back after it; FORGE does not. fused/optax 0.97-1.03 (the kernel's
#    0.79-0.95x at these shapes against the pool's round trip);
#    forge-xla/optax 0.97-1.00.
# 3. Peak memory per cell (e2e.py --scan, BT 512): FORGE arms ~1.3-1.5 GiB
#    below optax.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 150 python3 -m pytest -m gpu tests/test_blocks.py tests/test_scan.py \
  -q -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml"
run paired512 200 python3 benchmarks/e2e_paired.py --scan --bt 512 \
  --arms optax forge-xla forge --processes 2 --rounds 12 --block 10 \
  --warmup 5 --timeout 95 --hlo-dir "$OUT/hlo512" \
  --out "$OUT/paired512.csv" --plot "$OUT/paired512.png"
run e2e512 $((570 - SECONDS)) python3 benchmarks/e2e.py --scan --bt 512 \
  --arms optax forge forge-xla --budget $((540 - SECONDS)) \
  --out "$OUT/e2e512.csv" --plot "$OUT/e2e512.png"
