# Sourced by the benchmarks/gpu_run*.sh scripts run on the H200 with the
# device tool: the environment, $OUT, and `run NAME TIMEOUT CMD...`, which
# runs CMD under a timeout (SIGTERM, then SIGKILL 10 s later), keeps its whole
# log in $OUT/NAME.log, prints its tail, the seconds elapsed since the
# script started and, if CMD failed or timed out, its exit status.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
SECONDS=0
# The script exits 1 if any `run` failed or timed out (until session 13 it
# exited 0 whatever its commands did: run 65's timed-out pytest read rc 0).
GPU_LIB_RC=0
trap 'exit $GPU_LIB_RC' EXIT
run() {  # name, timeout, command...
  local name=$1 limit=$2 rc; shift 2
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -6
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || GPU_LIB_RC=1
  case "$rc" in
    0) echo "[$name ${SECONDS}s]" ;;
    124|137) echo "[$name ${SECONDS}s: TIMED OUT after ${limit}s (exit $rc)]" ;;
    *) echo "[$name ${SECONDS}s: exit $rc]" ;;
  esac
}
