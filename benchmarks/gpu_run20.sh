#!/usr/bin/env bash
# H200, session 4 call 20: benchmarks/suite.sh as one command (kernel with the
# torch arms + plot, e2e at BT 512 and 2048 with the cache that now holds the
# decoder's shapes), then, if time is left, a cProfile of the torch bridge's
# per-layer call inside torch_memory.py's training step (stream mode, BT 256).
source "$(dirname "$0")/gpu_lib.sh"
run suite 560 bash benchmarks/suite.sh "$OUT/suite"
if (( SECONDS < 500 )); then
  run bridge_profile $((585 - SECONDS)) python3 -c "
import cProfile, pstats, benchmarks.torch_memory as t
t.child('forge', 8, 4096, 256, 3, 'stream')
cProfile.run('t.child(\"forge\", 8, 4096, 256, 20, \"stream\")', '$OUT/bridge.prof')
pstats.Stats('$OUT/bridge.prof').sort_stats('cumtime').print_stats(45)
pstats.Stats('$OUT/bridge.prof').sort_stats('tottime').print_stats(25)"
fi
