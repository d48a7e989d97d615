#!/usr/bin/env bash
# H200, session 2 call 2: the L2 eviction-policy knob (BlockConfig.stream_state)
# side by side with the baseline tilings (BT 16 = the epilogue alone), then the
# GPU checks still pending from the previous session (its gpu_pending.sh,
# removed once this ran).
source "$(dirname "$0")/gpu_lib.sh"
C="64x128x64,g1,w4,s3 64x128x64,g1,w4,s3,e 64x128x64,g8,w4,s3,e 128x128x64,g1,w8,s3,e
   128x128x64,g8,w8,s3,e 128x128x64,g8,w8,s3,p,e 64x128x128,g1,w4,s2,e 64x128x32,g1,w4,s4,e"
run variants 200 python3 benchmarks/kernel.py --out "$OUT/variants2.csv" --moments bfloat16 \
  --shapes "q/o 4096x4096" --tokens 16 512 2048 4096 --config $C
run variants_ug 100 python3 benchmarks/kernel.py --out "$OUT/variants2.csv" --moments bfloat16 \
  --shapes "up/gate 4096x14336" --tokens 512 --config $C
run torch_gpu 120 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_torch_bridge.py tests/test_torch_families.py
run families_rest 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_families.py -k "mlp_training and (rmsprop_eps or rmsprop_momentum or sgd)"
run scan_gpu 100 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_scan.py
run muon_memory 60 python3 benchmarks/memory.py --optimizer muon --layers 1 4 --out "$OUT/memory_muon.csv"
run autotune_gpu 60 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_autotune.py
