#!/usr/bin/env bash
# H200, session 9 call 44. Three commits to pallas_kernels/ (90a9fac: RMSprop
# momentum trace; 2fad50f: XLA paths round a bf16 moment's product with
# lax.reduce_precision, the compiled kernel keeps its convert pair; 583bf66:
# one _stored_ema helper) never ran on the GPU. Prediction: every GPU test of
# the kernel, accumulation, the Dense layer and the bridge
# passes, and so do the bf16-moment, weak-decay and lion-sign family tests
# compiled (against optax op by op and jitted).
source "$(dirname "$0")/gpu_lib.sh"
run pytest_families_compiled 170 python3 -m pytest -q -p no:cacheprovider -rfEs \
  --junitxml="$OUT/pytest_families_compiled.xml" tests/test_families.py \
  -k "bf16_moment or weakly or keeps_the_moment or lion_sign"
run pytest_gpu 380 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_gpu.xml" tests/test_kernel.py tests/test_accumulate.py \
  tests/test_forge_jax.py tests/test_torch_bridge.py
