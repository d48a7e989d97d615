#!/usr/bin/env bash
# H200, session 2 call 5: allocator peak of the scanned 16 x 4096^2 bf16 stack
# step (BT 512), FORGE vs nn.scan + optax.adamw, one process per arm.
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
python3 benchmarks/scan_memory.py --out "$OUT/scan_memory.csv" 2>&1 | tee "$OUT/scan_memory.log"
