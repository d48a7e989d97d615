"""Shared benchmark plumbing: shapes, timing, the results CSV and its plot."""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import glob
import gzip
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from benchmarks import paths
from pallas_kernels import autotune, tuning_cache

# Llama-3.1-8B projection shapes (in, out), one place for tests and benches.
LLAMA8B_SHAPES = {
    "q/o 4096x4096": (4096, 4096),
    "k/v 4096x1024": (4096, 1024),
    "up/gate 4096x14336": (4096, 14336),
    "down 14336x4096": (14336, 4096),
}
TOKENS = (512, 2048, 4096)
# The 0.886 B Llama-style decoder's (benchmarks/e2e.py) projection shapes.
DECODER_SHAPES = {
    "decoder q/o 2048x2048": (2048, 2048),
    "decoder k/v 2048x1024": (2048, 1024),
    "decoder up/gate 2048x5632": (2048, 5632),
    "decoder down 5632x2048": (5632, 2048),
}


def parse_shape(name: str) -> tuple[int, int]:
  """``(n_in, n_out)`` of a shape named in :data:`LLAMA8B_SHAPES` or
  :data:`DECODER_SHAPES`, or of any ``"NAME NxM"`` (e.g. ``"t 40x24"``:
  small shapes for CPU smoke tests)."""
  if name in LLAMA8B_SHAPES:
    return LLAMA8B_SHAPES[name]
  try:
    n_in, n_out = (int(d) for d in name.split()[-1].split("x"))
  except ValueError:
    n_in = n_out = 0
  if n_in < 1 or n_out < 1:
    raise ValueError(f"--shapes: {name!r} is neither one of "
                     f"{list(LLAMA8B_SHAPES)} nor 'NAME NxM' with "
                     "N, M >= 1")
  return n_in, n_out

CSV_FIELDS = ["benchmark", "case", "provider", "shape", "dtypes", "metric",
              "p20", "p50", "p80", "unit", "device", "versions", "timestamp",
              "commit"]


# argparse ``type=``: an int >= 1 (a clean usage error otherwise).
positive_int = paths.int_at_least(1)
non_negative_int = paths.int_at_least(0)


def positive_float(s: str) -> float:
  """argparse ``type=``: a finite float > 0, as a learning rate (a clean
  usage error otherwise)."""
  try:
    v = float(s)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
  if not math.isfinite(v) or v <= 0:
    raise argparse.ArgumentTypeError(f"{s} must be a finite number > 0")
  return v


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Each flag's default in its help, except where the help states it
  itself (a default of ``None``, resolved after parsing)."""

  def _get_help_string(self, action):
    if action.default is None:
      return action.help
    return super()._get_help_string(action)


def versions() -> str:
  """The packages' versions, and a kernel backend forced by
  ``$FORGE_BACKEND`` (which every FORGE kernel call of the run then takes),
  for a results row."""
  parts = [f"python {platform.python_version()}", f"jax {jax.__version__}"]
  for mod in ("jaxlib", "flax", "optax", "triton", "torch"):
    try:
      parts.append(f"{mod} {__import__(mod).__version__}")
    except Exception:  # noqa: BLE001 -- optional packages
      pass
  forced = os.environ.get(tuning_cache.BACKEND_ENV_VAR)
  if forced:
    parts.append(f"{tuning_cache.BACKEND_ENV_VAR}={forced}")
  return "; ".join(parts)


# benchmarks/COMMIT holds "$Format:%h$", which `git archive` replaces by the
# archived commit (.gitattributes: export-subst).
_ARCHIVE_STAMP = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "COMMIT")


def commit() -> str:
  """The repository's commit (short hash, ``+changes`` when the work tree
  differs from it); in a tree exported by ``git archive``, the archived
  commit (not that of a checkout the tree happens to sit in); ``unknown``
  outside both."""
  try:
    with open(_ARCHIVE_STAMP) as f:
      stamp = f.read().strip()
  except OSError:
    stamp = ""
  if stamp and not stamp.startswith("$Format"):
    return stamp
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True, check=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=root, capture_output=True, text=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head.strip() + ("+changes" if dirty.strip() else "")


def device_name() -> str:
  d = jax.devices()[0]
  return f"{d.platform}:{d.device_kind}"


def quantiles(xs):
  xs = sorted(xs)
  if len(xs) == 1:
    return xs[0], xs[0], xs[0]
  q = statistics.quantiles(xs, n=10, method="inclusive")
  return q[1], statistics.median(xs), q[7]


def trace_events(trace_dir: str):
  """The complete events of the newest ``jax.profiler`` trace (Perfetto
  JSON) under ``trace_dir`` as ``(name, start_us, duration_us)``, in order
  of start: ``(those on a GPU device, those on the host)``."""
  paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                    recursive=True)
  if not paths:
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
  with gzip.open(max(paths, key=os.path.getmtime)) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  gpu_pids = {e["pid"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"
              and "GPU" in str(e.get("args", {}).get("name", ""))}
  gpu, host = [], []
  for e in events:
    if e.get("ph") == "X":
      (gpu if e.get("pid") in gpu_pids else host).append(
          (e["name"], float(e.get("ts", 0.0)), float(e.get("dur", 0.0))))
  return sorted(gpu, key=lambda e: e[1]), sorted(host, key=lambda e: e[1])


def overlap_by_name(events, start: float, end: float):
  """Of ``(name, start, duration)`` events, the time each name spends
  inside ``[start, end)``: ``[(name, count, overlap), ...]``, largest
  first."""
  total, count = {}, {}
  for name, t0, dur in events:
    ov = min(end, t0 + dur) - max(start, t0)
    if ov > 0:
      total[name] = total.get(name, 0.0) + ov
      count[name] = count.get(name, 0) + 1
  return sorted(((n, count[n], total[n]) for n in total),
                key=lambda r: -r[2])


def per_step_kernels(gpu_events, n_steps: int):
  """From a trace's GPU events ``(name, start, duration)`` over ``n_steps``
  steps: ``[(name, launches per step, µs per step)]``, largest first
  (:func:`overlap_by_name` over the whole trace)."""
  return [(name, count / n_steps, us / n_steps) for name, count, us in
          overlap_by_name(gpu_events, -math.inf, math.inf)]


def idle_gaps(events) -> tuple[float, float, list]:
  """From GPU events ``(name, start, duration)`` (µs; :func:`trace_events`'
  first list): the span
  from the first start to the last end, the GPU's busy time within it
  (events on several streams merged), and the idle gaps as ``(gap_us,
  name of the event before, name of the event after, gap start)``, largest
  first."""
  if not events:
    return 0.0, 0.0, []
  events = sorted(events, key=lambda e: e[1])
  busy, gaps = 0.0, []
  cur_start, cur_end, cur_last = events[0][1], events[0][1] + events[0][2], \
      events[0][0]
  for name, start, dur in events[1:]:
    if start > cur_end:
      busy += cur_end - cur_start
      gaps.append((start - cur_end, cur_last, name, cur_end))
      cur_start, cur_end = start, start + dur
    elif start + dur > cur_end:
      cur_end = start + dur
    if start + dur >= cur_end:
      cur_last = name
  busy += cur_end - cur_start
  span = cur_end - events[0][1]
  return span, busy, sorted(gaps, key=lambda g: -g[0])


def traced(run: Callable, keep: str | None = None):
  """``run()`` under ``jax.profiler.trace``: ``(its result, the GPU events,
  the host events)`` as :func:`trace_events` gives them. Block on the work
  inside ``run`` so that every kernel lands in the trace. ``keep``: a
  directory to copy the trace file into (for Perfetto or a later look)."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      result = run()
    gpu, host = trace_events(d)
    if keep:
      os.makedirs(keep, exist_ok=True)
      for path in glob.glob(os.path.join(d, "**", "*.trace.json.gz"),
                            recursive=True):
        shutil.copy(path, keep)
    return result, gpu, host


def time_loop(step: Callable, state, n_inner: int = 50, n_outer: int = 7):
  """Seconds per step: ``step(state) -> state`` run ``n_inner`` times inside
  one jitted ``fori_loop`` (donated), ``n_outer`` timed calls after a warm-up.
  Returns (p20, p50, p80) and the final state."""
  times, state = autotune.time_steps(step, state, n_inner, n_outer)
  return quantiles(times), state


def timed_steps(step, variables, opt_state, batch, warmup: int, iters: int):
  """Runs a training step ``warmup + iters`` times, blocking on every result.

  Args:
    step: ``step(variables, opt_state, batch) -> (loss, variables,
      opt_state)``, typically jitted with the state donated.
    variables, opt_state, batch: its inputs (the state is threaded through).
    warmup: untimed steps first (the first one compiles).
    iters: timed steps after them.

  Returns:
    ``(times, losses, variables, opt_state)``: the wall times (seconds) of
    the last ``iters`` steps, every step's loss, and the final state.
  """
  times, losses = [], []
  for i in range(warmup + iters):
    t0 = time.perf_counter()
    loss, variables, opt_state = step(variables, opt_state, batch)
    jax.block_until_ready((loss, variables, opt_state))
    if i >= warmup:
      times.append(time.perf_counter() - t0)
    losses.append(float(loss))
  return times, losses, variables, opt_state


def optax_step(loss_fn: Callable, tx, has_aux: bool = False) -> Callable:
  """The standard-path arm every benchmark compares FORGE against:
  ``step(variables, opt_state, batch) -> (loss, variables, opt_state)`` with
  ``jax.value_and_grad`` + the optax transform (jit and donate it as the
  FORGE arm is); ``has_aux`` as in ``forge_jax.make_step``."""

  def step(variables, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(variables,
                                                               batch)
    updates, opt_state = tx.update(grads["params"], opt_state,
                                   variables["params"])
    return loss, {**variables, "params": optax.apply_updates(
        variables["params"], updates)}, opt_state

  return step


def compiled_adamw_step(model, x, forge: bool, learning_rate: float = 1e-3,
                        wgrad: str = "fused"):
  """One AdamW training step of ``model`` on ``mean(model(x)^2)`` (fp32 loss),
  jitted with the state donated and compiled for ``x``: FORGE's
  ``make_step(..., wgrad=wgrad)`` + ``forge_jax.adamw`` when ``forge``, else
  :func:`optax_step` + ``optax.adamw``. Returns ``(jitted, compiled, (variables, opt_state,
  x))`` -- the arms the memory benchmarks and tests compare."""
  import forge_jax  # noqa: PLC0415 -- kernel-only benchmarks skip flax's import

  variables = model.init(jax.random.key(0), x)
  loss_fn = lambda v, b: jnp.mean(model.apply(v, b).astype(jnp.float32) ** 2)
  if forge:
    tx = forge_jax.adamw(learning_rate)
    step = forge_jax.make_step(loss_fn, tx, wgrad=wgrad)
  else:
    tx = optax.adamw(learning_rate)
    step = optax_step(loss_fn, tx)
  opt_state = tx.init(variables["params"])
  jitted = jax.jit(step, donate_argnums=(0, 1))
  return jitted, jitted.lower(variables, opt_state, x).compile(), (
      variables, opt_state, x)


def copy_ceiling_bytes_per_s(nbytes: int = 2 << 30) -> float:
  """Measured device-to-device copy bandwidth (bytes read + written / s)."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a + 1.0)
  (p20, p50, p80), _ = time_loop(f, x, n_inner=10, n_outer=5)
  return 2 * nbytes / p50


class Results:
  """Rows appended to one CSV (created with a header if new).

  ``device``: the rows' device column; by default JAX's first device
  (:func:`device_name`). A torch benchmark passes torch's device name, which
  also keeps its process from starting JAX's GPU backend."""

  def __init__(self, path: str, benchmark: str, device: str | None = None):
    self.path, self.benchmark = path, benchmark
    self.device = device_name() if device is None else device
    self.versions = versions()
    self.commit = commit()
    self.stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if not os.path.exists(path):
      with open(path, "w", newline="") as f:
        csv.DictWriter(f, CSV_FIELDS).writeheader()

  def add(self, case, provider, shape, dtypes, metric, q, unit):
    p20, p50, p80 = q if isinstance(q, tuple) else (q, q, q)
    with open(self.path, "a", newline="") as f:
      csv.DictWriter(f, CSV_FIELDS).writerow(dict(
          benchmark=self.benchmark, case=case, provider=provider, shape=shape,
          dtypes=dtypes, metric=metric, p20=f"{p20:.6g}", p50=f"{p50:.6g}",
          p80=f"{p80:.6g}", unit=unit, device=self.device,
          versions=self.versions, timestamp=self.stamp, commit=self.commit))


def save_figure(fig, path: str) -> None:
  """Lays out ``fig``, writes it to ``path`` (its folder made if missing)
  at 120 dpi, closes it and says where it went."""
  import matplotlib.pyplot as plt
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"wrote {path}")


def read_rows(path: str):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))
