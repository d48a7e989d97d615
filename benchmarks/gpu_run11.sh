#!/usr/bin/env bash
# H200, session 2 call 6: every tiling in the shipped autotune cache against
# the reference (compiled), and the shared-weight fallback with compiled kernels.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
SECONDS=0
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -4
  echo "[$name ${SECONDS}s]"
}
run shipped_tilings 75 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_autotune.py -k shipped
run shared_weights 80 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/test_shared_weights.py
