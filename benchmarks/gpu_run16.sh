#!/usr/bin/env bash
# H200, session 3 call 16: the GPU tests touched by split_out, the compiled
# heuristic and the re-tuned cache (every shipped tiling compiled against the
# reference), then the end-to-end BT 512 cell pair with that cache.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_kernel 130 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_kernel.py
run pytest_autotune 130 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_autotune.py
run e2e 230 python3 benchmarks/e2e.py --out "$OUT/e2e.csv" --plot "$OUT/e2e.png" --bt 512 --budget 220
run pytest_forge_jax_scan 100 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_forge_jax.py tests/test_scan.py
run pytest_regimes23 60 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_regimes23.py
