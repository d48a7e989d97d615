# Sourced by the benchmarks/gpu_run*.sh scripts run on the H200 with the
# device tool: the environment, $OUT, and `run NAME TIMEOUT CMD...`, which
# runs CMD under a timeout (SIGTERM, then SIGKILL 10 s later), keeps its whole
# log in $OUT/NAME.log, prints its tail and the seconds elapsed since the
# script started.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. OUT="${OUT:-out/gpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
SECONDS=0
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -6
  echo "[$name ${SECONDS}s]"
}
