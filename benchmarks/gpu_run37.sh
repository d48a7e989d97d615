#!/usr/bin/env bash
# H200, session 7 call 37: the README's main job (the digits demo, FORGE vs
# optax, 200 steps, fp32) compiled on the H200, its whole output kept (run 1
# kept only the plot), after session 7's demo and make_step changes.
source "$(dirname "$0")/gpu_lib.sh"
run demo 240 python3 -m forge_jax.demo --out "$OUT/demo" --bench on --no-progress
