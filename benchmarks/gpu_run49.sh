#!/usr/bin/env bash
# H200, session 10 call 49, at 44262ac. The commits to pallas_kernels/ after
# eb55bc4 (5a977fb: kernel name carries the nonzero static settings, pack()
# refuses a traced static value; bdc90f6: docstrings; 44262ac:
# UpdateRule.defaults name sources only, _stored_product returns directly)
# never ran on the GPU, and run 47 cut the autotune test of every shipped
# tiling. Prediction: every kernel-level GPU test passes (the compiled
# arithmetic did not change), and so do the compiled family tests.
source "$(dirname "$0")/gpu_lib.sh"
run pytest_families_compiled 170 python3 -m pytest -q -p no:cacheprovider -rfEs \
  --junitxml="$OUT/pytest_families_compiled.xml" tests/test_families.py \
  -k "bf16_moment or weakly or keeps_the_moment or lion_sign or rounding_flags"
run pytest_kernel_gpu 330 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_kernel_gpu.xml" tests/test_kernel.py tests/test_accumulate.py \
  tests/test_autotune.py
