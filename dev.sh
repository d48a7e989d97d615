#!/usr/bin/env bash
# forge-jax developer entry point. Sets up everything it needs from nothing
# (a Python >= 3.12 virtualenv with the dependencies, in pyproject.toml's
# version ranges), then:
#
#   ./dev.sh train [flags]   the main job: a Flax MLP on scikit-learn's digits,
#                            FORGE beside optax (python -m
#                            examples.train_digits; --help lists the flags)
#   ./dev.sh test [args]     the test suite's quick tier (what tests/tiers.py
#                            leaves out is deselected; --full runs it all), on
#                            FORGE_TEST_WORKERS processes (pytest-xdist;
#                            default: the CPU count, at most 4); pytest args
#                            pass through (-n 0: one process)
#   ./dev.sh python [args]   the project's Python, e.g. for the benchmarks:
#                            ./dev.sh python -m benchmarks.kernel --help
#
# train installs the package with its demo extra; test and python add the
# test and torch extras (torch is a large CUDA build).
#
# FORGE_VENV overrides the virtualenv location (default: .venv in the
# repository; a relative FORGE_VENV is relative to where you run dev.sh). The
# commands run from the repository root: relative paths in their arguments
# (e.g. train --out, pytest paths) are relative to the repository.
set -euo pipefail
caller_dir="$PWD"
cd "$(dirname "$0")"
VENV="${FORGE_VENV:-$PWD/.venv}"
case "$VENV" in /*) ;; *) VENV="$caller_dir/$VENV" ;; esac

usage() {  # the header comment above, without its '#'
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python() {
  local c
  for c in python3.13 python3.12 python3 python; do
    if command -v "$c" >/dev/null && is_py312 "$(command -v "$c")"; then
      command -v "$c"; return 0
    fi
  done
  # pyenv installs that are not on the PATH (jax >= 0.11 needs Python 3.12).
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  command -v pyenv >/dev/null && root="$(pyenv root)"
  for c in "$root"/versions/3.1[2-9]*/bin/python "$root"/versions/3.[2-9][0-9]*/bin/python; do
    if [ -x "$c" ] && is_py312 "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

pip_install() {  # pip install ARGS..., showing its progress in a few lines
  # pip's whole output goes to a log; the terminal gets a line per package
  # downloaded (or taken from pip's cache), then how many were installed.
  # On failure: the log's tail.
  local log="$VENV/.forge-pip.log"
  echo "   pip install $*"
  if ! "$VENV/bin/python" -m pip install --progress-bar off "$@" 2>&1 \
      | tee "$log" | awk '
        function n(k) { return k " package" (k == 1 ? "" : "s") }
        /^ *(Downloading|Using cached) / && !/\.metadata / {
          sub(/^ */, ""); print "   " $0; fflush(); next }
        /^Installing collected packages:/ {
          print "   installing " n(split(substr($0, 31), a, ",")); fflush()
          next }
        /^Successfully installed/ { print "   installed " n(NF - 2); fflush() }
      '; then
    echo "error: pip install $* failed; the end of its output (all of it" \
         "in $log):" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
}

setup() {  # the extras to install: "demo" (train) or "demo,test,torch"
  local extras="$1"
  if [ ! -x "$VENV/bin/python" ] || ! is_py312 "$VENV/bin/python"; then
    local py
    py="$(find_python)" || {
      echo "error: forge-jax needs Python >= 3.12 (jax >= 0.11 does), and none" \
           "was found on the PATH or under pyenv. Install one (e.g." \
           "'pyenv install 3.12') and run again." >&2
      exit 2
    }
    if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ] \
       && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
      echo "error: $VENV exists and is not a virtualenv (no pyvenv.cfg);" \
           "refusing to replace it. Point FORGE_VENV elsewhere." >&2
      exit 2
    fi
    echo "== creating $VENV with $py ($("$py" --version 2>&1))"
    rm -rf "$VENV"
    "$py" -m venv "$VENV"
  fi
  # One stamp per set of extras: `train` needs no torch (a large CUDA
  # build); `test` and `python` add torch and the test tools (not the
  # `cuda` extra: without a GPU the kernels run in interpret mode).
  local stamp="$VENV/.forge-installed-${extras//,/-}"
  local full="$VENV/.forge-installed-demo-test-torch"  # covers every command
  if [ -f "$full" ] && [ ! pyproject.toml -nt "$full" ]; then
    return 0
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "== installing forge-jax[$extras] and its dependencies into $VENV"
    echo "   (the first time takes minutes: jax, and torch for the tests, are" \
         "large downloads)"
    pip_install --upgrade pip
    pip_install -e ".[$extras]"
    touch "$stamp"
  fi
}

test_workers() {  # FORGE_TEST_WORKERS, else the CPU count capped at 4
  if [ -n "${FORGE_TEST_WORKERS:-}" ]; then
    echo "$FORGE_TEST_WORKERS"; return
  fi
  local n
  n="$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
  # Each worker is a JAX process of its own (compilation is memory-hungry).
  [ "$n" -gt 4 ] && n=4
  # One CPU: no worker processes at all.
  [ "$n" -le 1 ] && n=0
  echo "$n"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  train)  setup demo; exec "$VENV/bin/python" -m examples.train_digits "$@" ;;
  test)   setup demo,test,torch
          # A later -n or --dist in the arguments wins over these defaults.
          # loadfile: a test file's tests share one worker, so a module-scoped
          # fixture (a training run, a compile) runs once, not once per worker.
          exec "$VENV/bin/python" -m pytest -q -n "$(test_workers)" \
            --dist loadfile "$@" ;;
  python) setup demo,test,torch; exec "$VENV/bin/python" "$@" ;;
  -h|--help|help) usage; exit 0 ;;
  *) [ -n "$cmd" ] && echo "dev.sh: unknown command '$cmd'" >&2
     usage >&2; exit 2 ;;
esac
