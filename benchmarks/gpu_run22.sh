#!/usr/bin/env bash
# H200, session 4 call 22: the bridge's ViewCache (the state's JAX views reused
# across calls, so only x and dy are imported): the torch bridge GPU tests,
# including the new ordering test of reused views, then torch_memory.py with
# the views on and off side by side in stream mode (BT 256).
source "$(dirname "$0")/gpu_lib.sh"
run pytest_bridge 150 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu tests/test_torch_bridge.py
run torch_memory_views 110 python3 benchmarks/torch_memory.py --out "$OUT/torch_memory_views.csv" \
  --bt 256 --assert-peak-bt "" --sync stream --views on off
