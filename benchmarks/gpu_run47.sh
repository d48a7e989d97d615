#!/usr/bin/env bash
# H200, session 9 call 47. Run 46 timed the shipped tilings at 4096x14336
# BT 512 at 406 us (64x128x32,g1,w4,s4,e,o2), against 338-350 us in every
# session from 3 to 8 (run 39, at 73aad2c, the last before the rounding
# flags: 350.6). The flags (f886202 ... 583bf66) were runtime scalars, so
# every bf16-moment kernel carried a convert pair and a select per product,
# even where the flag is 0. They are now static settings of the rule: a 0
# flag emits no code. A/B/C side by side in one call, same configs, one
# process per tree: ab/c6c57fc (before the flags), ab/6834953 (runtime
# flags, main before this change), and the working tree (static flags).
# ab/ is an untracked copy made with `git archive <commit> pallas_kernels
# benchmarks`. Prediction: c6c57fc ~ working tree ~ 340-350 us at the o2
# tiling, 6834953 ~ 400 us; 4096^2 64x64 w4 ~106 us in all three (its
# registers were not at the cliff). Then the tests the change touches, on
# the GPU: compiled families (bf16 moments, flags 1) and the kernel's
# GPU-marked tests.
source "$(dirname "$0")/gpu_lib.sh"
ARGS=(--torch off --moments bfloat16 --tokens 512 2048 --shapes "q/o 4096x4096" "gate/up 4096x14336"
      --config 64x128x32,g1,w4,s4,e,o2 64x64x64,g1,w4,s3,e 128x256x32,g8,w8,s4,e,o4)
for t in c6c57fc 6834953; do
  (cd ab/$t && run ab_$t 150 env PYTHONPATH=. python3 benchmarks/kernel.py --out "$OUT/ab_$t.csv" "${ARGS[@]}")
done
run ab_static 150 python3 benchmarks/kernel.py --out "$OUT/ab_static.csv" "${ARGS[@]}"
run pytest_families_compiled 170 python3 -m pytest -q -p no:cacheprovider -rfEs \
  --junitxml="$OUT/pytest_families_compiled.xml" tests/test_families.py \
  -k "bf16_moment or weakly or keeps_the_moment or lion_sign"
run pytest_kernel_gpu 240 python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu \
  --junitxml="$OUT/pytest_kernel_gpu.xml" tests/test_kernel.py
