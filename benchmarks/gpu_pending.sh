#!/usr/bin/env bash
# H200: the GPU checks that the 2026-11-29 session could not run (its GPU time
# ran out). One call, ~8 minutes; results under $OUT. Run with the device tool:
#   bash benchmarks/gpu_pending.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
SECONDS=0
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -4
  echo "[$name ${SECONDS}s]"
}
# Issue 3/5: torch bridge and families after the family refactor.
run torch_gpu 150 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_torch_bridge.py tests/test_torch_families.py
# Issue 5: the regime-1 variants not re-run after the three-path refactor.
run families_rest 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_families.py -k "mlp_training and (rmsprop_eps or rmsprop_momentum or sgd)"
# Issue 6: scanned stacks (acceptance shape: 16 x 4096^2 bf16, BT 512).
run scan_gpu 150 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_scan.py
# Issue 4: the autotuner on the GPU, and the kernel tests with cached tilings.
run autotune_gpu 120 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_autotune.py tests/test_kernel.py
# Issue 5: Muon's compiled memory (no weight-sized G) against optax.contrib.muon.
run muon_memory 100 python3 benchmarks/memory.py --optimizer muon --layers 1 4 --out "$OUT/memory_muon.csv"
