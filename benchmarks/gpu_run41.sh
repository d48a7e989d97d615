#!/usr/bin/env bash
# H200, session 8 call 41, at the code that ships:
# 1. session 7's new CPU tests compiled on the GPU (CI runs them in interpret
#    mode): the bf16-moment parity with jitted optax (the kernel reads b1_m /
#    decay_m) and the weak-type decay check; the make_step inputs (frozen
#    layer with a penalty, FrozenDict, fused=False, MultiSteps refusal).
# 2. the README's main job (digits demo), compiled, after the b1_m change.
# 3. the e2e decoder step at BT 512, optax vs FORGE, after the b1_m change.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_compiled 200 python3 -m pytest -m "not gpu" -q -p no:cacheprovider -rfEs \
  --junitxml="$OUT/pytest_compiled.xml" tests/test_make_step_inputs.py \
  tests/test_families.py -k "bf16_moment or weakly or make_step or frozen or Frozen or multisteps or fused"
run demo 150 python3 -m forge_jax.demo --out "$OUT/demo" --bench on --no-progress
run e2e512 230 python3 benchmarks/e2e.py --bt 512 --arms optax forge \
  --cell-timeout 100 --out "$OUT/e2e.csv"
