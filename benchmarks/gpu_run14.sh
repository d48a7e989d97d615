#!/usr/bin/env bash
# H200, session 3 call 14: registers / occupancy / coalescing from Nsight
# Compute when the machine has it (each kernel once), then smaller-footprint
# tilings timed beside the split_out ones at BT 16 / 512 / 2048.
source "$(dirname "$0")/gpu_lib.sh"
ls /usr/local/cuda/bin | tr '\n' ' '; echo
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/nsight-compute*/ncu 2>/dev/null | head -1)
CONFIGS="64x128x32,g1,w4,s4,e 64x128x32,g1,w4,s4,e,o2 64x128x32,g1,w4,s2,e 64x64x32,g1,w4,s4,e 32x128x32,g1,w4,s4,e 128x128x32,g1,w4,s4,e,o2 128x256x32,g8,w8,s4,e,o4"
if [ -n "$NCU" ]; then
  echo "ncu: $NCU"
  run ncu 170 "$NCU" --csv --log-file "$OUT/ncu.csv" --metrics \
launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__occupancy_limit_warps,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum \
    python3 benchmarks/epilogue_probe.py --out "$OUT/once" --once --tokens 16 512 \
      --elementwise 32x128,w4 64x128,w4 --config $CONFIGS
else
  echo "no ncu on this machine"
fi
run probe 330 python3 benchmarks/epilogue_probe.py --out "$OUT/probe" --tokens 16 512 2048 \
  --elementwise 32x128,w4 16x256,w4 64x64,w4 32x64,w4 --config $CONFIGS
