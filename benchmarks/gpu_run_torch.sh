#!/usr/bin/env bash
# H200: forge_torch GPU tests (zero copy, streams, parity) and the memory
# benchmark. Results under $OUT. Needs torch (CUDA) and JAX (CUDA) installed.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}"
# JAX shares the GPU with torch: tests/conftest.py starts JAX's backend at
# collection, before forge_torch could set this.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
nvidia-smi -L
"$PY" -c "import torch, jax; print('torch', torch.__version__, torch.version.cuda, torch.cuda.is_available(), '| jax', jax.__version__, jax.devices())"
timeout 300 "$PY" -m pytest -q -s -p no:cacheprovider -rfEs tests/test_torch_bridge.py 2>&1 | tee "$OUT/pytest_torch.log" | tail -60
timeout 280 "$PY" benchmarks/torch_memory.py --out "$OUT/torch_memory.csv" 2>&1 | tee "$OUT/torch_memory.log"
