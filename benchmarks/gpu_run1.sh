#!/usr/bin/env bash
# One H200 session: GPU tests, kernel benchmark, demo. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import jax, jaxlib, flax, optax, triton; print(jax.devices(), jax.__version__, flax.__version__, optax.__version__, triton.__version__)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernel.py tests/test_forge_jax.py tests/test_regimes.py 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout 240 python3 benchmarks/kernel.py --out "$OUT/kernel.csv" --tokens 512 2048 --moments bfloat16 2>&1 | tee "$OUT/kernel.log"
timeout 90 python3 -m forge_jax.demo --out "$OUT/demo" --bench on --no-progress 2>&1 | tail -12
