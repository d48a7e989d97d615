#!/usr/bin/env bash
# H200, session 3 call 12: where the epilogue loses bandwidth (PTX, registers,
# a GEMM-free Pallas AdamW), the split_out knob, and the one-compile check.
# (epilogue_probe.py's --ptx was removed after run 13: XLA's dump holds no PTX of a
# Pallas-Triton kernel -- docs/perf_notes.md, variant 6. A historical record:
# as written it no longer runs; drop --ptx to rerun.)
source "$(dirname "$0")/gpu_lib.sh"
run probe 330 python3 benchmarks/epilogue_probe.py --out "$OUT/probe" --ptx
run knob_tilings 90 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_kernel.py -k knob
run traced_once 60 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_forge_jax.py -k traced_once
