#!/usr/bin/env bash
# H200, session 7 call 38: after the review fixes made following run 34 --
# forge_torch's version-counter bump after each fused update (CUDA stream
# mode included) and make_step's changes (discovery closing over the batch,
# FrozenDict variables, all-unfused and stop_gradient-frozen layers) -- the
# GPU-marked torch bridge, torch family and forge_jax tests, and the new
# make_step tests compiled.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_gpu_torch 300 python3 -m pytest -m gpu tests/test_torch_bridge.py \
  tests/test_torch_families.py tests/test_forge_jax.py -q -p no:cacheprovider -rfEs \
  --junitxml="$OUT/pytest_gpu_torch.xml"
run pytest_make_step 90 python3 -m pytest tests/test_make_step_inputs.py -q \
  -p no:cacheprovider -rfEs -k "python_values or frozendict or fused_false or stop_gradient or has_updated" \
  --junitxml="$OUT/pytest_make_step.xml"
