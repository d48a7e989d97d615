#!/usr/bin/env bash
# H200, session 5 call 26: Nsight Compute's full section set (raw metrics,
# incl. warp stall reasons and L2 / LSU throughput) on the fused kernel at
# BT 16 (epilogue alone) and BT 512 for three tilings, beside the GEMM-free
# Pallas AdamW at 32 and 64 elements per thread: what the BT-512 kernel
# waits on.
# Outcome: no data. Under `--set full` XLA's GEMM autotuning (for the
# probe's XLA arm) compiled so slowly that the call hit the device's 540 s
# limit before any profiled kernel ran (run26_ncu_full.log), and ncu did not
# stop on timeout's SIGTERM. A re-run should set
# XLA_FLAGS=--xla_gpu_autotune_level=0 and fewer sections; gpu_lib.sh's
# `run` now sends SIGKILL 10 s after the limit.
source "$(dirname "$0")/gpu_lib.sh"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/nsight-compute*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
run ncu_full 420 "$NCU" --set full --page raw --csv \
  --kernel-name regex:"fused_wgrad|elementwise_adamw" \
  --log-file "$OUT/ncu_full.csv" \
  python3 benchmarks/epilogue_probe.py --out "$OUT/once" --once --tokens 16 512 \
    --elementwise 32x128,w4 64x128,w4 \
    --config 64x64x64,g1,w4,s3,e 64x128x32,g1,w4,s4,e,o2 128x256x32,g8,w8,s4,e,o4
ls -la "$OUT"
