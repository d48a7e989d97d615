#!/usr/bin/env bash
# H200, session 6 call 30: the GPU-marked tests of the code this session's
# review changed after run 29 -- the kernel wrapper (x/dy promotion, input
# checks), make_step, the deferred path, forge_torch -- on the compiled path.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu 340 python3 -m pytest -m gpu tests/test_kernel.py \
  tests/test_regimes23.py tests/test_forge_jax.py tests/test_torch_bridge.py \
  tests/test_torch_families.py -q -p no:cacheprovider -rs --durations=8 \
  --junitxml="$OUT/pytest_gpu.xml"
