#!/usr/bin/env bash
# The benchmark suite (docs/benchmarks.md) in one command, on a GPU machine:
#
#   benchmarks/suite.sh [OUT_DIR [PART...]]
#
# OUT_DIR: default out/suite. PART: kernel, e2e, scan, backends, torch
# (default: the first three, in that order; any subset runs in this order). PYTHON: the project's .venv/bin/python if there is one, else
# python3. Every benchmark, in the suite or not, runs as a module from the
# repository root: `python -m benchmarks.<name> --help` lists its flags.
# One-off device scripts and raw logs belong in the ignored /scratch/
# folder, not in the repository.
#
# 1. benchmarks.kernel: one layer's fused step vs XLA's unfused GEMM + AdamW
#    (and, with CUDA torch, torch's cuBLAS + AdamW(fused=True) and the kernel
#    through forge_torch), every Llama-3.1-8B projection shape x BT
#    512/2048/4096 with bf16 W/m/v, then 4096^2 and 4096x14336 at BT 512 with
#    fp32 m/v -> OUT/kernel.csv, .png. The fused kernel runs with the tiling
#    it picks by itself ("auto": the shipped autotune cache) and, for
#    reference, the untuned 64x128x64 tile; a sweep over more tilings is
#    `python -m benchmarks.kernel --config LABEL...` or
#    `python -m pallas_kernels.autotune`.
# 2. benchmarks.e2e: the Llama-style decoder's training step, FORGE (fused
#    kernel; at BT 512 also wgrad="xla") vs optax.adamw, BT 512 and 2048, one
#    process per cell -> OUT/e2e.csv, .png
# 3. scan: the scanned stack (16 x 4096^2 bf16, ReLU; FORGE's
#    ScannedDenseStack vs nn.scan + optax.adamw, whose step keeps the whole
#    gradient pool): benchmarks.scan_memory's compiled temporaries and
#    allocator peak (BT 512, one process per arm) -> OUT/scan_memory.csv, then
#    benchmarks.e2e_paired --model stack's step time, the arms paired in one
#    process (one process each at BT 512 and 2048) -> OUT/scan_paired.csv,
#    scan_paired{512,2048}.png; then the scanned decoder (benchmarks.e2e
#    --scan: forge_jax.ScannedBlocks vs flax's nn.scan(nn.remat) +
#    optax.adamw, one process per cell, the fused arm and wgrad="xla" --
#    XLA's GEMM, then the kernel's epilogue on the stacks in place -- at BT
#    512 and 2048) -> OUT/e2e_scan.csv, .png
# 4. backends: benchmarks.backends, the Mosaic GPU kernel's default tilings
#    and the rolled epilogue beside the Triton kernel and XLA, BT 512, 2048
#    and 4096 with bf16 moments (and int8 ones at BT 512, in 64x64
#    sub-tiles, on 128x128 tiles and the smaller ones int8 defaults to),
#    BT 512 with fp32 moments, and the 0.886 B decoder's shapes at BT 512
#    and 2048 (its four projections, its LM head, and the transposed cases
#    forge_torch runs for k/v and the head), an fp32 weight with fp32
#    moments at BT 512 and 2048, and backend=None's choice (--auto) at six
#    shapes the cache holds no entry for -> OUT/backends.csv (the source
#    of the autotune cache's Mosaic GPU entries: pallas_kernels.autotune
#    --from-csv ... --commit ...)
# 5. torch: benchmarks.torch_call (one forge_torch update per call, BT 512,
#    with a plot) and benchmarks.torch_e2e (the decoder in torch, forge_torch
#    vs AdamW(fused=True), BT 512 and 2048, --check first) -> OUT/torch_call.*,
#    OUT/torch_e2e/
# Every CSV row carries the device, the versions and p20/p50/p80. CSVs are
# appended to: the e2e plot draws each BT's bars from one run of
# OUT/e2e.csv (of the runs with the most arms at that BT, the newest; its
# commit under the BT), which may be an earlier suite run's where this one
# lost a cell, so give each suite run its own OUT.
# The e2e part stops starting cells after --budget seconds.
set -euo pipefail
for arg in "$@"; do
  case "$arg" in  # the usage: the comment above, without its "# "
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
  esac
done
case "${1:-}" in
  -*) echo "suite.sh: the output folder '$1' starts with '-'; this script" \
           "takes no flags but -h/--help (usage: suite.sh [OUT_DIR" \
           "[PART...]])" >&2
      exit 2 ;;
esac
cd "$(dirname "$0")/.."
OUT="${1:-out/suite}"
PARTS=("${@:2}")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(kernel e2e scan)
for part in "${PARTS[@]}"; do
  case "$part" in
    kernel|e2e|scan|backends|torch) ;;
    *) echo "suite.sh: unknown part '$part' (parts: kernel e2e scan" \
            "backends torch)" >&2
       exit 2 ;;
  esac
done
has() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY="${PYTHON:-python3}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "suite.sh: $PY sees no GPU (or no jax); the suite measures on a GPU." \
       "Nothing measured." >&2
  exit 1
fi
mkdir -p "$OUT"
SECONDS=0
rc=0
# A failing command marks the suite failed (exit 1); the other parts still run.
if has kernel; then
  TILINGS=(auto 64x128x64,g1,w4,s3)
  "$PY" -m benchmarks.kernel --out "$OUT/kernel.csv" --moments bfloat16 \
    --config "${TILINGS[@]}" || rc=1
  "$PY" -m benchmarks.kernel --out "$OUT/kernel.csv" --moments float32 \
    --shapes "q/o 4096x4096" "up/gate 4096x14336" --tokens 512 \
    --config "${TILINGS[@]}" || rc=1
  if [ -f "$OUT/kernel.csv" ]; then
    "$PY" -m benchmarks.plot "$OUT/kernel.csv" "$OUT/kernel.png" || rc=1
  fi
  echo "suite: kernel part done at ${SECONDS}s"
fi
if has e2e; then
  # Two e2e calls (three arms at BT 512, two at 2048); a failed cell makes a
  # call exit 1, which must not skip the other call or the plot.
  "$PY" -m benchmarks.e2e --out "$OUT/e2e.csv" --bt 512 \
    --arms optax forge forge-xla --budget 250 || rc=1
  "$PY" -m benchmarks.e2e --out "$OUT/e2e.csv" --bt 2048 \
    --arms optax forge --budget 170 || rc=1
  "$PY" -m benchmarks.e2e --out "$OUT/e2e.csv" --replot \
    --plot "$OUT/e2e.png" || rc=1
  echo "suite: e2e part done at ${SECONDS}s"
fi
if has scan; then
  "$PY" -m benchmarks.scan_memory --out "$OUT/scan_memory.csv" || rc=1
  for bt in 512 2048; do
    "$PY" -m benchmarks.e2e_paired --model stack --bt "$bt" \
      --arms optax forge-xla forge --processes 1 --rounds 12 --block 10 \
      --timeout 90 --out "$OUT/scan_paired.csv" \
      --plot "$OUT/scan_paired$bt.png" || rc=1
  done
  "$PY" -m benchmarks.e2e --scan --out "$OUT/e2e_scan.csv" --bt 512 \
    --arms optax forge forge-xla --budget 120 || rc=1
  "$PY" -m benchmarks.e2e --scan --out "$OUT/e2e_scan.csv" --bt 2048 \
    --arms optax forge forge-xla --budget 140 || rc=1
  "$PY" -m benchmarks.e2e --out "$OUT/e2e_scan.csv" --replot \
    --plot "$OUT/e2e_scan.png" || rc=1
  echo "suite: scan part done at ${SECONDS}s"
fi
if has backends; then
  B=("$PY" -m benchmarks.backends --out "$OUT/backends.csv")
  "${B[@]}" --tokens 512 --moments bf16 int8 \
    --mosaic 128x128x64/4,e64x32,pp 128x128x64/4,e64x64,pp \
    128x128x64/4,e64x64,pp,lp 64x128x64/4,e64x64,pp,lp \
    128x64x64/4,e64x64,pp,lp || rc=1
  "${B[@]}" --tokens 2048 4096 --moments bf16 \
    --mosaic 128x128x64/4,e64x32,s8,pp 128x128x64/4,s8,pp,lp || rc=1
  "${B[@]}" --tokens 512 --moments fp32 --mosaic 128x128x64/4,pp,lp \
    128x128x64/4,e64x32,pp 128x128x64/4,r1 || rc=1
  "${B[@]}" --tokens 512 2048 --moments bf16 --shapes decoder \
    --mosaic 64x128x64/4,e64x32,pp 128x128x64/4,e64x32,pp \
    128x128x64/4,e64x32,pp,lp || rc=1
  # The decoder's LM head, and the kernel cases forge_torch runs for the
  # k/v projections and the head (torch's weight is (out, in)).
  "${B[@]}" --tokens 512 2048 --moments bf16 --shapes "head 2048x32000" \
    "torch k/v 1024x2048" "torch head 32000x2048" \
    --mosaic 128x128x64/4,e64x32,pp 128x128x64/4,pp 128x128x64/4,pp,lp || rc=1
  # An fp32 weight with fp32 moments (mixed precision) and with bf16 m
  # (optax's mu_dtype), and what backend=None takes at shapes the cache
  # holds no entry for (--auto: the nearest entry's tiling).
  "${B[@]}" --tokens 512 2048 --weights fp32 --moments fp32 mu-bf16 --auto \
    --mosaic 128x128x64/4,pp,lp 64x128x64/5,c2,pp,lp,nb \
    128x128x64/4,s8,pp,lp,nb || rc=1
  "${B[@]}" --tokens 512 2048 --moments bf16 --auto --mosaic --shapes \
    "gpt2-fc 768x3072" "gpt2-proj 3072x768" "gpt2-attn 768x768" \
    "1b-up 2048x8192" "1b-down 8192x2048" "13b-up 5120x13824" || rc=1
  echo "suite: backends part done at ${SECONDS}s"
fi
if has torch; then
  "$PY" -m benchmarks.torch_call --tokens 512 --reps 5 \
    --out "$OUT/torch_call.csv" --plot "$OUT/torch_call.png" || rc=1
  "$PY" -m benchmarks.torch_e2e --out-dir "$OUT/torch_e2e" --check \
    --bt 512 2048 || rc=1
  echo "suite: torch part done at ${SECONDS}s"
fi
echo "suite: results in $OUT (${SECONDS}s)"
exit $rc
