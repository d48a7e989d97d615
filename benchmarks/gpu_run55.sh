#!/usr/bin/env bash
# H200, session 11 call 55 (the session's last ~590 s of device time). Run
# 54's phases showed 43-55 s of each ~70 s e2e cell in one jitted
# Decoder.init; the variables are now built block by block. Then the
# benchmark suite of issue #4 as it stands (its e2e part split in two calls
# in session 10, never run), and more BT 512 cells of all three arms with
# what time is left. Prediction: cells take 25-35 s (init < 5 s); the suite
# finishes in <= 330 s; kernel ratios as in run 47 (+-4 %); e2e fused ~1.07x
# optax, forge-xla within +-3 %.
source "$(dirname "$0")/gpu_lib.sh"
run suite 350 bash benchmarks/suite.sh "$OUT/suite"
run e2e_rep $((520 - SECONDS)) python3 benchmarks/e2e.py --bt 512 \
  --arms forge-xla optax forge --repeat 3 --cell-timeout 60 \
  --budget $((510 - SECONDS)) --out "$OUT/e2e_rep.csv" --plot "$OUT/e2e_rep.png"
