"""The tuner of the fused kernel's tilings (both backends), and its command
line.

* :data:`CONFIG_SPACE`: the curated candidate Triton tilings (tile sizes,
  ``BT`` chunk, warps, stages, tile order), as data;
  :data:`MOSAIC_CONFIG_SPACE`: the Mosaic GPU kernel's (tile sizes, K steps
  in flight, epilogue sub-tile, compute warpgroups, state buffers or ring,
  tile order, clusters, column-split or ping-pong schedule), as labels.
* :func:`tune`: times each candidate with the real kernel on *scratch* arrays
  (fresh random arrays of the right shapes and dtypes; never the caller's
  weight or state), skips candidates that fail to compile, and returns the
  best with every timing. The timer is injectable (tests use a fake one).
* :func:`main`: measures on this GPU (or imports a benchmarks/kernel.py or
  benchmarks.backends CSV, or merges other cache files) and merges the
  winners into a cache JSON, which :mod:`pallas_kernels.tuning_cache` reads.
  A Mosaic GPU entry records the Triton kernel's time for the same case in
  the same run: ``fused_wgrad_update(backend=None)`` takes the Mosaic GPU
  kernel only where it was the faster.

Command line::

    # re-tune on this machine's GPU, merging into the JSON (refuses on CPU):
    python -m pallas_kernels.autotune --shapes 4096x4096 4096x14336 \\
        --tokens 512 2048 --out pallas_kernels/tuned_configs.json
    # both backends (Hopper), each entry beside the other's time:
    python -m pallas_kernels.autotune --backend both --shapes 4096x4096 \\
        --tokens 512 --out JSON
    # a quick re-tune over chosen candidates instead of the spaces (a label
    # with '/' is a Mosaic GPU tiling):
    python -m pallas_kernels.autotune --shapes 2048x5632 --tokens 512 \\
        --config 64x64x64,g1,w4,s3,e 64x128x32,g1,w4,s4,e,o2 --out JSON
    # rebuild the cache's entries from a benchmarks/kernel.py CSV (Triton)
    # or a benchmarks.backends CSV (Mosaic GPU):
    python -m pallas_kernels.autotune --from-csv kernel.csv --out JSON
    python -m pallas_kernels.autotune --from-csv backends.csv \\
        --commit ddd1e56 --mosaic-pick default --out JSON
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import uuid
from typing import Callable, Iterable, Mapping, Sequence

try:
  import fcntl
except ImportError:  # (not POSIX: writes of the cache are not serialised)
  fcntl = None

import jax
import jax.numpy as jnp

from pallas_kernels import families, mosaic_kernel
from pallas_kernels.fused_wgrad import fused_wgrad_update
from pallas_kernels.mosaic_kernel import MosaicConfig
from pallas_kernels.rules import UpdateRule
from pallas_kernels.tiling import BlockConfig
from pallas_kernels.tuning_cache import (
    ANY_RULE,
    BACKENDS,
    ENV_VAR,
    FORMAT_VERSION,
    MOSAIC_GPU,
    MOSAIC_MIN_CAPABILITY,
    SHIPPED_CACHE,
    TRITON,
    bt_bucket,
    cache_key,
    cache_paths,
    clear_cache,
    compute_capability,
    config_label,
    current_device_kind,
    describe,
    dtype_name,
    lookup,
    parse_label,
    read_json,
    validated,
)

# (block_in, block_out, block_bt, group_in, num_warps, num_stages[, prefetch,
# stream_state[, split_out]]): BlockConfig's fields in order. The first six
# are the curated tilings of the first H200 sweep; the next ten vary one knob
# at a time around its best (64x128x64); then the winners of the later
# sweeps (docs/perf_notes.md).
CONFIG_SPACE: tuple[tuple, ...] = (
    (64, 128, 64, 1, 4, 3),
    (128, 128, 64, 1, 8, 3),
    (128, 128, 32, 1, 4, 4),
    (128, 256, 64, 1, 8, 3),
    (64, 256, 64, 1, 4, 3),
    (128, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 4, 3),
    (64, 128, 64, 4, 4, 3),
    (64, 128, 32, 1, 4, 4),
    (64, 128, 128, 1, 4, 2),
    (64, 128, 64, 1, 4, 4),
    (64, 128, 64, 1, 8, 3),
    (64, 64, 64, 1, 4, 3),
    (128, 64, 64, 1, 4, 3),
    (32, 128, 64, 1, 4, 3),
    (128, 128, 64, 1, 4, 3),
    # Prefetching and streaming winners (prefetch, stream_state).
    (64, 128, 32, 1, 4, 4, False, True),
    (64, 128, 64, 8, 4, 3, False, True),
    (128, 128, 64, 8, 8, 3, True, False),
    (128, 128, 64, 8, 8, 3, True, True),
    # Register-lean winners (split_out: BlockConfig's last field).
    (64, 64, 64, 1, 4, 3, False, True),
    (64, 64, 32, 1, 4, 4, False, True),
    (64, 128, 32, 1, 4, 4, False, True, 2),
    (128, 128, 32, 1, 4, 4, False, True, 2),
    (128, 256, 32, 8, 8, 4, False, True, 4),
    (128, 256, 64, 8, 8, 3, False, True, 2),
)


def config_space() -> list[BlockConfig]:
  """:data:`CONFIG_SPACE` as :class:`BlockConfig` objects."""
  return [BlockConfig(*c) for c in CONFIG_SPACE]


# The Mosaic GPU kernel's candidate tilings, as MosaicConfig labels
# (tile_m x tile_n x tile_k / K steps in flight, then ,wgW compute
# warpgroups, ,dD delay_release, ,eMxN epilogue sub-tile, ,bB state
# buffers, ,rR state ring, ,sS snaking bands of S tile columns, ,cC
# clusters of C programs, ,pn prefetch the next tile's state, ,pp the
# ping-pong schedule, ,lp the epilogue looped over its sub-tiles, ,nb no
# automatic barriers).
MOSAIC_CONFIG_SPACE: tuple[str, ...] = (
    # The ping-pong defaults (mosaic_kernel.default_config) up to 1024
    # tokens and beyond, and their fallbacks: 3 K steps (wide state), 64
    # rows (shapes 128-row tiles would overreach by more than 1/16).
    "128x128x64/4,e64x32,pp",
    "128x128x64/4,e64x32,s8,pn,pp,nb",
    "128x128x64/3,e64x32,pp",
    "64x128x64/4,e64x32,pp",
    # Ping-pong: a fixed ring of 2; 64 x 256 tiles.
    "128x128x64/4,e64x32,r2,s8,pp",
    "64x256x64/3,e64x32,s8,pp",
    # Ping-pong with the epilogue looped over its sub-tiles (rolled), in
    # 64 x 32 and 64 x 64 sub-tiles.
    "128x128x64/4,e64x32,pp,lp",
    "128x128x64/4,pp,lp",
    "128x128x64/4,s8,pp,lp",
    # Ping-pong on half tiles, and without Pallas's automatic barriers
    # (the cache's picks at the Llama-3.1-8B shapes).
    "64x128x64/4,pp,lp", "128x64x64/4,pp,lp",
    "64x128x64/4,pp,lp,nb", "128x64x64/4,pp,lp,nb",
    "128x128x64/4,e64x32,s8,pp",
    # The ring running across tiles (prefetch_next) up to 1024 tokens.
    "128x128x64/4,e64x32,pn,pp,nb",
    # Clusters of two programs sharing the dy blocks (multicast).
    "64x128x64/4,c2,pp,lp,nb",
    # Five K steps on half tiles (the cache's picks at BT 512), with a
    # cluster or the ring across tiles.
    "64x128x64/5,pp,lp,nb", "64x128x64/5,c2,pp,lp,nb",
    "128x64x64/5,pn,pp,lp,nb",
    # The column-split schedule: its best measured tilings (64 x 128 with
    # two state buffers up to 1024 tokens; 128 x 128 streaming the state,
    # in bands of 8 beyond) and their fallbacks.
    "64x128x64/4,b2,pn",
    "128x128x64/4,r1",
    "128x128x64/4,e64x32,r2,s8",
    "128x128x64/4", "128x128x64/3", "64x128x64/4", "64x128x64/3",
    "128x128x64/2", "64x128x64/2",
    # The other tilings of the H200 measurements
    # (benchmarks/results/h200/backends.csv).
    "64x128x64/4,b2,s8,pn",
    "128x128x64/4,r2",
    "128x128x64/4,e64x32,r2",
    "64x128x64/4,e64x32,r4",
    "128x256x64/2,r2",
    "128x256x64/2,e64x32,r4",
    "256x128x64/2,r2",
    # One knob at a time around the defaults.
    "128x128x64/4,e64x32,r2,s4",
    "128x128x64/4,e64x32,r2,s16",
    "128x128x64/4,e64x32,r4,s8",
    "128x128x64/4,r1,s8",
    "128x128x64/4,d0,e64x32,r2,s8",
    "128x128x64/4,wg1,r2,s8",
    "128x128x64/3,e64x32,r2,s8",
    "128x128x128/2,e64x32,r2,s8",
    "128x256x64/3,e64x32,r2,s8",
    "128x256x64/2,wg4,e64x32,r2,s8",
    "64x256x64/4,e64x32,r2,s8",
    "64x128x64/4,b2,s4,pn",
    "64x128x64/4,b2",
    "64x128x64/4,r2",
)


def mosaic_config_space() -> list[MosaicConfig]:
  """:data:`MOSAIC_CONFIG_SPACE` as :class:`MosaicConfig` objects."""
  return [MosaicConfig.from_label(c) for c in MOSAIC_CONFIG_SPACE]


def label_of(cfg: BlockConfig | MosaicConfig) -> str:
  """A tiling's label: :func:`config_label` for a Triton tiling,
  :attr:`MosaicConfig.label` for a Mosaic GPU one."""
  return cfg.label if isinstance(cfg, MosaicConfig) else config_label(cfg)


# --- tuning ------------------------------------------------------------------

# Plausible values for the hyperparameters the families use (AdamW-like); any
# other name gets 0.5. They only need to keep the scratch state finite.
_TUNING_HPARAMS = {
    "lr": 1e-4, "b1": 0.9, "b2": 0.999, "one_minus_b1": 0.1,
    "one_minus_b2": 1e-3, "eps": 1e-8, "eps_root": 0.0, "weight_decay": 1e-4,
    "bc1": 0.65, "bc2": 0.01, "bc1_next": 0.69, "decay": 0.9,
}


def _tuning_hparams(rule: UpdateRule) -> jax.Array:
  return rule.pack(**{n: _TUNING_HPARAMS.get(n, 0.5) for n in rule.hparams})


def scratch_state(bt: int, n_in: int, n_out: int, w_dtype,
                  slot_dtypes: Sequence, act_dtype=None, seed: int = 0):
  """Fresh random ``(x, dy, w, *slots)`` of the problem's shapes and dtypes."""
  act = dtype_name(w_dtype if act_dtype is None else act_dtype)
  k = jax.random.split(jax.random.key(seed), 3 + len(slot_dtypes))
  x = jax.random.normal(k[0], (bt, n_in), jnp.float32).astype(act)
  dy = jax.random.normal(k[1], (bt, n_out), jnp.float32).astype(act)
  w = (0.02 * jax.random.normal(k[2], (n_in, n_out))).astype(dtype_name(w_dtype))
  slots = [(1e-4 * jax.random.uniform(k[3 + i], (n_in, n_out))).astype(
      dtype_name(d)) for i, d in enumerate(slot_dtypes)]
  return (x, dy, w, *slots)


Timer = Callable[[Callable, tuple, "BlockConfig | MosaicConfig"], float]


def time_steps(step, state, n_inner: int, n_outer: int):
  """Seconds per step of ``step(state) -> state``: ``n_outer`` timed calls of
  an ``n_inner``-step jitted, donated ``fori_loop`` after a warm-up call
  (compile errors surface there). Returns (the per-call times, final state).
  Shared with ``benchmarks/``."""
  loop = jax.jit(
      lambda s: jax.lax.fori_loop(0, n_inner, lambda i, s: step(s), s),
      donate_argnums=0)
  state = loop(state)
  jax.block_until_ready(state)
  times = []
  for _ in range(n_outer):
    t0 = time.perf_counter()
    state = loop(state)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - t0) / n_inner)
  return times, state


def loop_timer(n_inner: int = 20, n_outer: int = 5) -> Timer:
  """The default timer: the median of :func:`time_steps` (the benchmarks'
  method)."""

  def timer(step, state, config):
    del config
    return statistics.median(time_steps(step, state, n_inner, n_outer)[0])

  return timer


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """What :func:`tune` measured.

  Attributes:
    best: the fastest config that compiled and ran.
    best_s: its time per step, seconds.
    timings: seconds per step of every config that ran, in the order tried.
    failures: the configs that failed (to compile or run), with the error.
    backend: the backend tuned (``"triton"`` or ``"mosaic_gpu"``).
  """

  best: BlockConfig | MosaicConfig
  best_s: float
  timings: dict
  failures: dict
  backend: str = TRITON


def candidates(bt: int, n_in: int, n_out: int,
               configs: Iterable[BlockConfig] | None = None) -> list[BlockConfig]:
  """``configs`` (default :func:`config_space`), each shrunk to the problem
  (:meth:`BlockConfig.fit`), duplicates dropped."""
  out = []
  for c in (config_space() if configs is None else configs):
    c = c.fit(bt, n_in, n_out)
    if c not in out:
      out.append(c)
  return out


def mosaic_candidates(bt: int, n_in: int, n_out: int, x_dtype, w_dtype,
                      slot_dtypes: Sequence, rule: UpdateRule,
                      configs: Iterable[MosaicConfig] | None = None
                      ) -> list[MosaicConfig]:
  """``configs`` (default :func:`mosaic_config_space`) that the Mosaic GPU
  kernel accepts for the problem (dimensions TMA can move, shared memory
  that fits: :func:`~pallas_kernels.mosaic_kernel.unsupported`), duplicates
  dropped."""
  w = jax.ShapeDtypeStruct((n_in, n_out), dtype_name(w_dtype))
  slots = [jax.ShapeDtypeStruct((n_in, n_out), dtype_name(d))
           for d in slot_dtypes]
  out = []
  for c in (mosaic_config_space() if configs is None else configs):
    if c not in out and mosaic_kernel.unsupported(
        bt, n_in, n_out, dtype_name(x_dtype), w, slots, rule, c,
        stacked=False, g_stored=False) is None:
      out.append(c)
  return out


def tune(bt: int, n_in: int, n_out: int, w_dtype, slot_dtypes: Sequence,
         rule: UpdateRule, *, configs: Iterable | None = None,
         timer: Timer | None = None, act_dtype=None,
         interpret: bool | None = None, verbose: bool = False,
         backend: str = TRITON) -> TuneResult:
  """Times the fused kernel for each candidate config and returns the best.

  Every candidate runs on its own fresh scratch arrays (:func:`scratch_state`:
  ``x``/``dy`` in ``act_dtype``, default ``w_dtype``); the caller's weight and
  state are never touched. ``w_dtype`` and ``slot_dtypes`` may be dtypes,
  dtype names or arrays (standing for their dtypes).

  Args:
    bt, n_in, n_out: tokens and the weight's shape ``(in, out)``.
    w_dtype, slot_dtypes: the weight's and the rule's slots' storage dtypes.
    rule: the optimizer rule the kernel's epilogue applies.
    configs: candidates. Triton: :class:`BlockConfig` s (default
      :data:`CONFIG_SPACE`), clamped to the shape. Mosaic GPU:
      :class:`MosaicConfig` s (default :data:`MOSAIC_CONFIG_SPACE`), those
      the kernel does not accept for the problem left out
      (:func:`mosaic_candidates`).
    timer: ``timer(step, state, config) -> seconds per step`` where
      ``step(state) -> state`` runs the kernel once on the scratch tuple
      ``state``; default :func:`loop_timer`. An exception counts as a failure.
    interpret: passed to the kernel (default: unless on a GPU).
    backend: ``"triton"`` or ``"mosaic_gpu"``.

  Raises:
    RuntimeError: no candidate ran (or, for Mosaic GPU, none is accepted
      for the problem).
  """
  if not isinstance(rule, UpdateRule):
    raise TypeError(
        f"tune(rule=...) needs an UpdateRule (e.g. pallas_kernels.ADAMW; the "
        f"CLI's --rule names: {', '.join(sorted(RULES))}), got "
        f"{type(rule).__name__} {rule!r:.60}")
  slot_dtypes = tuple(dtype_name(d) for d in slot_dtypes)
  if len(slot_dtypes) != len(rule.slots):
    raise ValueError(f"rule {rule.name!r} has slots {rule.slots}; got "
                     f"{len(slot_dtypes)} slot dtypes")
  if backend not in BACKENDS:
    raise ValueError(f"tune(backend={backend!r}): use 'triton' or "
                     "'mosaic_gpu'")
  timer = loop_timer() if timer is None else timer
  h = _tuning_hparams(rule)

  def make_step(cfg):
    def step(state):
      x, dy, w, *slots = state
      w, new = fused_wgrad_update(x, dy, w, slots, h, rule=rule, config=cfg,
                                  interpret=interpret, backend=backend)
      return (x, dy, w, *new[:len(rule.slots)])
    return step

  if backend == MOSAIC_GPU:
    act = dtype_name(w_dtype if act_dtype is None else act_dtype)
    cands = mosaic_candidates(bt, n_in, n_out, act, w_dtype, slot_dtypes,
                              rule, configs)
    if not cands:
      raise RuntimeError(
          f"no Mosaic GPU tiling covers BT={bt} {n_in}x{n_out} with {act} "
          "x and dy (the kernel takes 16-bit x and dy, BT a multiple of 8 "
          "and in, out of 64; see mosaic_kernel.unsupported)")
  else:
    cands = candidates(bt, n_in, n_out, configs)
  timings, failures = {}, {}
  for cfg in cands:
    state = scratch_state(bt, n_in, n_out, w_dtype, slot_dtypes, act_dtype)
    try:
      t = float(timer(make_step(cfg), state, cfg))
    except Exception as e:  # noqa: BLE001 -- a config may not compile
      failures[cfg] = f"{type(e).__name__}: {str(e)[:300]}"
      if verbose:
        print(f"  {label_of(cfg)}: failed: {failures[cfg]}", flush=True)
      continue
    finally:
      del state
    timings[cfg] = t
    if verbose:
      print(f"  {label_of(cfg)}: {t * 1e6:.1f} us", flush=True)
  if not timings:
    raise RuntimeError(
        f"no config ran for BT={bt} {n_in}x{n_out}: " + "; ".join(
            f"{label_of(c)}: {e}" for c, e in failures.items()))
  best = min(timings, key=timings.get)  # first of equals: the order tried
  return TuneResult(best, timings[best], timings, failures, backend)


# --- writing the cache -------------------------------------------------------


def _empty_cache() -> dict:
  return {"format": FORMAT_VERSION,
          "about": ("forge-jax tuned tilings: devices[device_kind]"
                    "[\"entries\"][key] (the Triton kernel's BlockConfigs) "
                    "and devices[device_kind][\"mosaic_gpu\"][key] (the "
                    "Mosaic GPU kernel's MosaicConfigs, each with time_us "
                    "and triton_time_us, the Triton kernel's time in the "
                    "same run), key = rule|btBUCKET|INxOUT|w=DTYPE|"
                    "slots=DTYPES (pallas_kernels.tuning_cache.cache_key); each "
                    "entry names its measurement in devices[kind][\"sources\"]."),
          "devices": {}}


def _read_or_empty(path: str) -> dict:
  if os.path.exists(path):
    data = read_json(path)
    validated(data, describe(path))
    return data
  return _empty_cache()


def merge(data: dict, device_kind: str, source_id: str, source: dict,
          entries: Mapping[str, dict], backend: str = TRITON) -> dict:
  """Adds ``entries`` (key -> entry) of ``backend``'s kernel and their source
  to ``data`` in place."""
  table = "entries" if backend == TRITON else MOSAIC_GPU
  dev = data["devices"].setdefault(device_kind, {"sources": {}, "entries": {}})
  dev.setdefault("sources", {})[source_id] = source
  for key, entry in entries.items():
    dev.setdefault(table, {})[key] = dict(entry, source=source_id)
  if table in dev:
    dev[table] = dict(sorted(dev[table].items()))
  return data


def merge_file(data: dict, path: str) -> int:
  """Merges another cache JSON (e.g. an autotune run's ``--out``) into ``data``.

  Every source keeps its own record, plus ``"file": path`` (where its
  measurements are kept); returns the number of entries merged.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"--merge: no such cache file {path!r}")
  other = _read_or_empty(path)  # (validated: sources are objects)
  n = 0
  for kind, dev in other["devices"].items():
    sources = dict(dev.get("sources", {}))
    for backend, table in ((TRITON, "entries"), (MOSAIC_GPU, MOSAIC_GPU)):
      entries_of = {sid: {} for sid in sources}
      for k, e in dev.get(table, {}).items():
        sid = e.get("source")
        if sid not in sources:
          # An entry with no (or an unknown) source record, e.g. written by
          # hand: lookup() uses it, so it is merged, under a record saying
          # so.
          sid = f"unrecorded@{path}"
          sources.setdefault(sid, {"kind": "entries without a source record"})
          entries_of.setdefault(sid, {})
        entries_of[sid][k] = {f: v for f, v in e.items() if f != "source"}
      for sid, entries in entries_of.items():
        if entries or backend == TRITON:
          merge(data, kind, sid, dict(sources[sid], file=path), entries,
                backend)
        n += len(entries)
  return n


def write(path: str, data: dict) -> None:
  """Writes ``data`` to ``path`` whole or not at all: through a temporary
  file of this call's own in the same folder, then renamed over ``path``
  (a reader never sees half a file; two writers never share a
  temporary). The file keeps the mode of the one it replaces; a new one
  gets ``open()``'s (0666 less the umask, which the system applies)."""
  validated(data, path)
  folder = os.path.dirname(os.path.abspath(path))
  try:  # (set before a byte is written: never more open than the file)
    mode = os.stat(path).st_mode & 0o777
  except FileNotFoundError:
    mode = None
  while True:
    tmp = os.path.join(folder, f"{os.path.basename(path)}."
                       f"{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
      fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                   0o666 if mode is None else 0o600)
      break
    except FileExistsError:  # (a name taken meanwhile: another one)
      continue
  try:
    if mode is not None:
      if hasattr(os, "fchmod"):
        os.fchmod(fd, mode)
      else:  # (Windows before Python 3.13)
        os.chmod(tmp, mode)
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1)
      f.write("\n")
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise
  clear_cache()


_UNLOCKED: set = set()  # cache files written without a lock, warned of


@contextlib.contextmanager
def _locked(path: str):
  """Holds an exclusive lock on ``path + ".lock"``, so that one
  read-merge-write of the cache file at ``path`` at a time runs: two
  autotune runs sharing an ``--out`` keep both their entries. The lock
  file is opened for writing (NFS and CIFS clients lock only such files),
  read-only where this user may not write it (one another user made).
  Where no lock can be had (a filesystem without locks) the write goes on
  unserialised, with a warning on stderr, once per file; without
  ``fcntl`` (not POSIX) it goes on unserialised."""
  fd, why = None, None
  if fcntl is not None:
    lock = path + ".lock"
    try:
      try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
      except PermissionError:
        fd = os.open(lock, os.O_RDONLY)
      fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
      if fd is not None:
        os.close(fd)
      fd, why = None, f"{lock}: {e}"
  if why is not None and path not in _UNLOCKED:
    _UNLOCKED.add(path)
    print(f"warning: {path} is written without a lock ({why}): another "
          "run writing it at the same time may drop this run's entries or "
          "its own", file=sys.stderr)
  try:
    yield
  finally:
    if fd is not None:
      os.close(fd)  # (releases the lock)


def update_file(path: str, add) -> dict:
  """Reads the cache at ``path`` (empty where there is none), calls
  ``add(data)`` to put entries in, and writes it back, under
  :func:`_locked`: what another process wrote there meanwhile is kept."""
  with _locked(path):
    data = _read_or_empty(path)
    add(data)
    write(path, data)
  return data


def _entry(cfg: BlockConfig | MosaicConfig, time_us: float,
           timings_us: Mapping[str, float], bt: int, **extra) -> dict:
  return {"config": dataclasses.asdict(cfg), "time_us": round(time_us, 4),
          "bt_measured": bt, **extra,
          "timings_us": {k: round(v, 4) for k, v in timings_us.items()}}


def _put(entries: dict, key: str, entry: dict, where: str) -> None:
  """``entries[key] = entry``, where another case already took ``key`` (BTs
  of one power-of-two bucket share it): the one measured at the larger BT
  stays (the bucket's own BT, where measured); two at one BT are
  refused."""
  held = entries.get(key)
  if held is not None:
    if held["bt_measured"] == entry["bt_measured"]:
      raise ValueError(
          f"{where}: two cases measured at BT {entry['bt_measured']} map to "
          f"cache key {key!r}; import them from separate runs or without "
          "--any-rule")
    if held["bt_measured"] > entry["bt_measured"]:
      return
  entries[key] = entry


_SHAPE = re.compile(r"^BT=(\d+) (\d+)x(\d+)$")


def _csv_shape(shape: str, path: str) -> tuple[int, int, int]:
  """``"BT=512 4096x1024"`` -> ``(512, 4096, 1024)``, each at least 1."""
  sm = _SHAPE.match(shape)
  if not sm or min(int(v) for v in sm.groups()) < 1:
    raise ValueError(f"{path}: unexpected shape {shape!r} (expected "
                     "'BT=<tokens> <in>x<out>', each at least 1)")
  return tuple(int(v) for v in sm.groups())


def _csv_dtypes(field: str, path: str) -> tuple[str, tuple[str, ...]]:
  """``"w=bf16,m/v=bfloat16"`` -> ``("bfloat16", ("bfloat16", "bfloat16"))``
  (``path``: the CSV, named where the field cannot be read)."""
  try:
    parts = dict(p.split("=", 1) for p in field.split(","))
    w = dtype_name(parts.pop("w"))
    slots = []
    for names, d in parts.items():
      slots += [dtype_name(d)] * len(names.split("/"))
  except (ValueError, TypeError, KeyError):
    raise ValueError(f"{path}: dtypes {field!r} is not of the form "
                     "'w=bf16,m/v=bf16' (dtype names jax knows)") from None
  return w, tuple(slots)


def _row_time(r: Mapping, metric: str, path: str) -> float:
  """A CSV row's ``metric`` in microseconds: a positive, finite number in
  a unit the benchmarks write (us, ms, s); ``ValueError`` naming the row
  otherwise (a NaN would never lose a comparison, nor a negative time
  ever win one honestly)."""
  value, unit = r.get(metric), r.get("unit")
  try:
    t = float(value) * _to_us(unit)
  except (TypeError, ValueError, KeyError):
    t = None
  if t is None or not 0 < t < math.inf:
    raise ValueError(
        f"{path}: row {r.get('provider')!r} / {r.get('shape')!r}: "
        + (f"no {metric} or unit (a row of too few fields)"
           if value is None or unit is None else
           f"{metric}={value!r} {unit!r} is not a positive, finite time "
           "in us, ms or s"))
  return t


def _read_csv(path: str, what: str, need: set, commit: str | None):
  """The rows of a benchmark CSV (those of ``commit`` when given)."""
  with open(path, newline="") as f:
    reader = csv.DictReader(f)
    need = need | ({"commit"} if commit is not None else set())
    missing = sorted(need - set(reader.fieldnames or ()))
    if missing:
      raise ValueError(f"{path}: not a {what} CSV (no column "
                       f"{', '.join(missing)})")
    rows = list(reader)
  if commit is not None:
    rows = [r for r in rows if r["commit"] == commit]
    if not rows:
      raise ValueError(f"{path}: no rows of commit {commit!r}")
  return rows


def csv_benchmarks(path: str) -> set[str]:
  """The ``benchmark`` column's values in a benchmark CSV (``{"kernel"}``
  for a benchmarks/kernel.py one, ``{"backends"}`` for a
  benchmarks.backends one)."""
  return {r["benchmark"] for r in _read_csv(path, "benchmark",
                                             {"benchmark"}, None)}


def winners_from_csv(path: str, rule: str = "adamw", metric: str = "p50",
                     commit: str | None = None):
  """The best tiling per (shape, BT, dtypes) in a benchmarks/kernel.py CSV.

  Reads its ``forge[<config>]`` time rows (the fused AdamW step per curated
  config; those of ``commit`` only, when given) and picks the lowest
  ``metric`` (the benchmark's own choice: p50, first of equals). Returns
  ``(device_kind, source_id, source, entries)``.
  """
  groups: dict[tuple, list] = {}
  devices, versions, stamps = set(), set(), set()
  rows = _read_csv(path, "benchmarks/kernel.py",
                   {"benchmark", "provider", "shape", "dtypes", "metric",
                    metric, "unit", "device", "versions", "timestamp"},
                   commit)
  for r in rows:
    m = re.match(r"^forge\[(.+)\]$", r["provider"])
    if r["benchmark"] != "kernel" or r["metric"] != "time" or not m:
      continue
    groups.setdefault((r["shape"], r["dtypes"]), []).append(
        (parse_label(m.group(1)), _row_time(r, metric, path)))
    devices.add(r["device"])
    versions.add(r["versions"])
    stamps.add(r["timestamp"])
  if not groups:
    raise ValueError(f"{path}: no forge[<config>] time rows")
  if len(devices) != 1:
    raise ValueError(f"{path}: rows from several devices {sorted(devices)}")
  (device,) = devices
  device_kind = device.split(":", 1)[1] if ":" in device else device
  entries = {}
  for (shape, dtypes), rows in groups.items():
    bt, n_in, n_out = _csv_shape(shape, path)
    w, slots = _csv_dtypes(dtypes, path)
    best_cfg, best_t = None, None
    for cfg, t in rows:
      if best_t is None or t < best_t:
        best_cfg, best_t = cfg, t
    key = cache_key(rule, bt, n_in, n_out, w, slots)
    _put(entries, key, _entry(best_cfg, best_t,
                              {config_label(c): t for c, t in rows}, bt),
         path)
  source = {
      "kind": "benchmarks/kernel.py CSV",
      "csv": _display_path(path),
      "device": device,
      "versions": "; ".join(sorted(versions)),
      "measured": ", ".join(sorted(stamps)),
      "metric": f"{metric} of the fused AdamW step per config, us",
  }
  if commit is not None:
    source["commit"] = commit
  source_id = f"{os.path.basename(path)}@{min(stamps)}"
  return device_kind, source_id, source, entries


# How mosaic_winners_from_csv picks a case's tiling.
MOSAIC_PICKS = {
    "fastest": "the fastest Mosaic GPU tiling measured for the case",
    "default": ("the kernel's default tiling for the case "
                "(mosaic_kernel.default_config) where measured, else the "
                "fastest"),
}
# The CLI's picks (--mosaic-pick): those, and "faster", which compares
# with the cache it merges into (_import_csv).
CLI_MOSAIC_PICKS = {
    **MOSAIC_PICKS,
    "faster": ("the fastest Mosaic GPU tiling measured for the case, only "
               "where it is faster than the entry already held (or there "
               "is none)"),
}


def _backends_dtypes(field: str) -> tuple[str, str, tuple[str, ...]]:
  """``"x,dy,W bf16; m,v fp32"`` -> ``("bfloat16", "bfloat16", ("float32",
  "float32"))``: the dtypes of ``x`` and ``dy``, of ``W``, of the slots
  (``"...; 1 slot(s) fp32"``: a rule's slots by number, none for ``0``)."""
  act, w, slots = None, None, []
  try:
    for part in field.split(";"):
      words = part.split()
      if len(words) == 3 and words[1] == "slot(s)":
        slots += [dtype_name(words[2])] * int(words[0])
        continue
      names, d = words
      d = dtype_name(d)
      for name in names.split(","):
        if name in ("x", "dy"):
          act = d
        elif name.lower() == "w":
          w = d
        else:
          slots.append(d)
  except (ValueError, TypeError):
    act = None
  if act is None or w is None:
    raise ValueError(f"{path}: dtypes {field!r} is not of the form "
                     "'x,dy,W bf16; m,v fp32' (or '...; N slot(s) fp32')")
  return act, w, tuple(slots)


# The providers of a benchmarks.backends CSV that time a Mosaic GPU tiling
# (its MOSAIC_ARMS: the CSV's format, which this package reads without
# importing the benchmarks).
_MOSAIC_ARMS = ("forge_mosaic_", "forge_auto_mosaic_")


def mosaic_winners_from_csv(path: str, rule: str | None = None,
                            metric: str = "p50", commit: str | None = None,
                            pick: str = "fastest"):
  """Mosaic GPU entries from a benchmarks.backends CSV.

  Per case (rule, shape, BT, dtypes), among its ``forge_mosaic_<label>``
  time rows and those of the ``--auto`` arm, ``forge_auto_mosaic_<label>``
  (those of ``commit`` only, when given), that have a
  ``forge_triton`` row of the same case in the same run (same timestamp),
  the tiling ``pick`` names (:data:`MOSAIC_PICKS`), at its lowest
  ``metric`` over the runs; the entry records that time (``time_us``) and
  the Triton kernel's in the same run (``triton_time_us``), so it selects
  the Mosaic GPU kernel for ``backend=None`` only if that was the faster.
  Rows of int8 moments give entries keyed by the codes' dtype
  (``slots=int8,int8``), which only calls with int8 moments look up
  (:func:`~pallas_kernels.tuning_cache.select_backend`'s
  ``mosaic_slot_dtypes``). A tiling with ``approx_math`` (``,ax``) is
  listed in ``timings_us`` but never picked: the cache holds only kernels
  whose arithmetic is the reference's.

  Args:
    path: the CSV.
    rule: the rule name the entries are keyed by; default each row's
      ``case`` (``"adamw"``).
    metric: the column compared (the benchmark's p50).
    commit: only the rows of this commit (the ``commit`` column).
    pick: ``"fastest"`` or ``"default"``.

  Returns:
    ``(device_kind, source_id, source, entries)``.
  """
  if pick not in MOSAIC_PICKS:
    raise ValueError(f"pick={pick!r}: use one of {sorted(MOSAIC_PICKS)}")
  rows = _read_csv(path, "benchmarks.backends",
                   {"benchmark", "case", "provider", "shape", "dtypes",
                    "metric", metric, "unit", "device", "versions",
                    "timestamp"}, commit)
  triton, mosaic = {}, {}
  devices, versions, stamps = set(), set(), set()
  for r in rows:
    if r["benchmark"] != "backends" or r["metric"] != "time":
      continue
    case = (r["case"], r["shape"], r["dtypes"])
    run = (r["timestamp"], r.get("commit"))
    t = _row_time(r, metric, path)
    if r["provider"] == "forge_triton":
      triton[(case, run)] = t
    elif r["provider"].startswith(_MOSAIC_ARMS):
      # The --auto arm (forge_auto_mosaic_<label>) timed the tiling
      # backend=None took: a measurement of that tiling like the others.
      label = r["provider"].split("mosaic_", 1)[1]
      try:
        cfg = MosaicConfig.from_label(label)
      except ValueError as e:
        raise ValueError(f"{path}: provider {r['provider']!r}: {e}") from None
      mosaic.setdefault(case, []).append((cfg, t, run))
    else:
      continue
    devices.add(r["device"])
    versions.add(r["versions"])
    stamps.add(r["timestamp"])
  if not mosaic:
    raise ValueError(f"{path}: no forge_mosaic_<tiling> time rows"
                     + (f" of commit {commit!r}" if commit else ""))
  if len(devices) != 1:
    raise ValueError(f"{path}: rows from several devices {sorted(devices)}")
  (device,) = devices
  device_kind = device.split(":", 1)[1] if ":" in device else device
  entries = {}
  for case, measured in mosaic.items():
    measured = [m for m in measured if (case, m[2]) in triton]
    if not measured:
      continue  # no Triton time of the same run to compare with
    case_rule, shape, dtypes = case
    bt, n_in, n_out = _csv_shape(shape, path)
    act, w, slots = _backends_dtypes(dtypes)
    quantized = any(not jnp.issubdtype(jnp.dtype(d), jnp.floating)
                    for d in slots)
    chosen = [m for m in measured if not m[0].approx_math]
    if not chosen:
      continue  # approximate arithmetic only: not for the cache
    if pick == "default":
      if case_rule not in RULES:
        raise ValueError(f"{path}: case {case_rule!r} is not a rule name; "
                         "pick='default' needs the rule")
      default = mosaic_kernel.default_config(
          act, mosaic_kernel.smem_dtypes(RULES[case_rule], w, slots), bt=bt,
          shape=(n_in, n_out), quantized=quantized)
      chosen = [m for m in chosen if m[0] == default] or chosen
    cfg, t, run = min(chosen, key=lambda m: m[1])  # first of equals
    timings = {}
    for c, tc, _ in measured:
      timings[c.label] = min(tc, timings.get(c.label, tc))
    key = cache_key(rule or case_rule, bt, n_in, n_out, w, slots)
    _put(entries, key, _entry(cfg, t, timings, bt,
                              triton_time_us=round(triton[(case, run)], 4),
                              run=run[0]), path)
  if not entries:
    raise ValueError(f"{path}: no forge_mosaic_<tiling> row has a "
                     "forge_triton row of the same case and run")
  source = {
      "kind": "benchmarks.backends CSV",
      "csv": _display_path(path),
      "device": device,
      "versions": "; ".join(sorted(versions)),
      "measured": ", ".join(sorted(stamps)),
      "metric": (f"{metric} of the fused AdamW step, us; triton_time_us: the "
                 "forge_triton row of the same case and run"),
      "pick": MOSAIC_PICKS[pick],
  }
  if commit is not None:
    source["commit"] = commit
  source_id = f"{os.path.basename(path)}@{min(stamps)}"
  return device_kind, source_id, source, entries


def _to_us(unit: str) -> float:
  return {"us": 1.0, "ms": 1e3, "s": 1e6}[unit]


def _display_path(path: str) -> str:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = os.path.abspath(path)
  return os.path.relpath(p, root) if p.startswith(root + os.sep) else p


def _versions() -> str:
  parts = [f"python {platform.python_version()}", f"jax {jax.__version__}"]
  for mod in ("jaxlib", "triton"):
    try:
      parts.append(f"{mod} {__import__(mod).__version__}")
    except Exception:  # noqa: BLE001 -- optional
      pass
  return "; ".join(parts)


# The CLI's --rule names: every registered regime-1/2 rule and variant, by
# rule name (the name its cache entries are keyed by).
RULES: dict[str, UpdateRule] = {
    r.name: r for r in families.optax_rules(regimes=(1, 2)).values()}


def _parse_shape(s: str) -> tuple[int, int]:
  m = re.match(r"^(\d+)x(\d+)$", s)
  if not m:
    raise argparse.ArgumentTypeError(f"shape {s!r} is not INxOUT")
  n_in, n_out = int(m.group(1)), int(m.group(2))
  if n_in < 1 or n_out < 1:
    raise argparse.ArgumentTypeError(f"shape {s!r}: both sizes must be >= 1")
  return n_in, n_out


def positive_int(s: str) -> int:
  """argparse ``type=``: an int >= 1 (a clean usage error otherwise)."""
  try:
    v = int(s)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
  if v < 1:
    raise argparse.ArgumentTypeError(f"{v} must be >= 1")
  return v


# The dtypes the kernel stores W and its slots in.
STATE_DTYPES = ("float32", "bfloat16", "float16")


def _label_arg(label: str) -> BlockConfig | MosaicConfig:
  """A ``--config`` label: with a ``/`` a Mosaic GPU tiling
  (``128x128x64/4,r2``), else a Triton one (``64x128x32,g1,w4,s4``)."""
  try:
    if "/" in label:
      return MosaicConfig.from_label(label)
    return parse_label(label)
  except ValueError as e:  # a bad label or an invalid knob value
    raise argparse.ArgumentTypeError(str(e)) from None


def default_out() -> str | None:
  """Where the CLI writes without ``--out``: ``$FORGE_AUTOTUNE_CACHE`` when
  set (``lookup`` reads it first), else the shipped cache of a source
  checkout; ``None`` for an installed package (the shipped file then sits in
  site-packages, where writing it would be lost on reinstall or fail)."""
  env = os.environ.get(ENV_VAR)
  if env:
    return env
  parts = os.path.normpath(os.path.abspath(SHIPPED_CACHE)).split(os.sep)
  if "site-packages" in parts or "dist-packages" in parts:
    return None
  return SHIPPED_CACHE


# The CLI's measurement defaults (refused, not defaulted, with --from-csv /
# --merge, which measure nothing).
_CLI_DEFAULTS = dict(
    shapes=[(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)],
    tokens=[512, 2048], rule="adamw", w_dtype="bfloat16",
    slot_dtype="bfloat16", backend=TRITON)


def _import_csv(data: dict, path: str, args) -> str:
  """Merges the entries of one ``--from-csv`` file into ``data``; returns
  what was merged, in words."""
  rule = ANY_RULE if args.any_rule else None
  if "backends" in csv_benchmarks(path):
    pick = args.mosaic_pick or "fastest"
    kind, sid, source, entries = mosaic_winners_from_csv(
        path, rule=rule, commit=args.commit,
        pick="fastest" if pick == "faster" else pick)
    if pick == "faster":  # keep the entries already held that are faster
      held = data["devices"].get(kind, {}).get(MOSAIC_GPU, {})
      entries = {k: e for k, e in entries.items()
                 if k not in held or held[k].get("time_us") is None
                 or e["time_us"] < held[k]["time_us"]}
      source = dict(source, pick=CLI_MOSAIC_PICKS[pick])
    merge(data, kind, sid, source, entries, MOSAIC_GPU)
    faster = sum(e["time_us"] < e["triton_time_us"] for e in entries.values())
    return (f"{len(entries)} Mosaic GPU entries for {kind!r} ({faster} "
            "measured faster than Triton)")
  kind, sid, source, entries = winners_from_csv(path, rule=rule or "adamw",
                                                commit=args.commit)
  merge(data, kind, sid, source, entries)
  return f"{len(entries)} winners for {kind!r}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      prog="python -m pallas_kernels.autotune",
      description="Tune the fused kernel's tilings on this GPU (or import a "
      "benchmarks/kernel.py or benchmarks.backends CSV) and merge the "
      "winners into a cache JSON.")
  p.add_argument("--out", default=None,
                 help=f"cache JSON to merge into (default: ${ENV_VAR} when "
                 "set, else the shipped one in a source checkout; an "
                 "installed package needs --out or the variable)")
  p.add_argument("--from-csv", nargs="+", metavar="CSV",
                 help="take the winners from benchmarks/kernel.py CSVs "
                 "(Triton tilings) or benchmarks.backends CSVs (Mosaic GPU "
                 "tilings, each against the Triton kernel of the same run) "
                 "instead of measuring")
  p.add_argument("--commit", default=None,
                 help="with --from-csv: only the rows of this commit (the "
                 "CSV's commit column)")
  p.add_argument("--mosaic-pick", choices=sorted(CLI_MOSAIC_PICKS),
                 default=None,
                 help="with --from-csv of a benchmarks.backends CSV: the "
                 "tiling an entry takes: the fastest measured (default); "
                 "the kernel's default tiling where measured; or "
                 "'faster': the fastest measured, only where it beats the "
                 "entry already in --out")
  p.add_argument("--merge", nargs="+", metavar="JSON",
                 help="merge other cache files (e.g. a tuning run's --out) "
                 "instead of measuring")
  # Measurement choices (default None: refused with --from-csv / --merge).
  p.add_argument("--backend", choices=[TRITON, MOSAIC_GPU, "both"],
                 help="the kernel(s) to tune (default: triton). mosaic_gpu "
                 "(Hopper) also times the Triton kernel's tiling for each "
                 "case, which each Mosaic GPU entry records beside its own")
  p.add_argument("--shapes", nargs="+", type=_parse_shape, metavar="INxOUT",
                 help="default: 4096x4096 4096x1024 4096x14336 14336x4096")
  p.add_argument("--tokens", nargs="+", type=positive_int,
                 help="default: 512 2048")
  p.add_argument("--rule", choices=sorted(RULES), help="default: adamw")
  p.add_argument("--w-dtype", choices=STATE_DTYPES,
                 help="default: bfloat16")
  p.add_argument("--slot-dtype", choices=STATE_DTYPES,
                 help="dtype of every slot of the rule (default bfloat16)")
  p.add_argument("--act-dtype", choices=STATE_DTYPES,
                 help="dtype of x and dy (default: --w-dtype's; an fp32 "
                 "weight in mixed precision: bfloat16, which the Mosaic GPU "
                 "kernel needs). The cache key does not record it: entries "
                 "serve every activation dtype")
  p.add_argument("--any-rule", action="store_true",
                 help="store the winners under rule \"any\" (used for every "
                 "rule without its own entry)")
  p.add_argument("--config", nargs="+", metavar="LABEL", default=None,
                 type=_label_arg,
                 help="candidates instead of CONFIG_SPACE and "
                 "MOSAIC_CONFIG_SPACE: Triton labels such as "
                 "64x128x32,g1,w4,s4,e,o2, Mosaic GPU labels (with a '/') "
                 "such as 128x128x64/4,e64x32,r2,s8 (a quick re-tune; a "
                 "backend tuned with no label of its kind takes its whole "
                 "space)")
  args = p.parse_args(argv)
  if args.from_csv and args.config:
    p.error("--config chooses tilings to measure; --from-csv measures "
            "nothing (it reads the CSVs' own tilings)")
  if args.merge and args.config:
    p.error("--config chooses tilings to measure; --merge measures nothing")
  if not args.from_csv:
    for flag, value in (("--commit", args.commit),
                        ("--mosaic-pick", args.mosaic_pick)):
      if value is not None:
        p.error(f"{flag} chooses the rows of --from-csv CSVs; it needs "
                "--from-csv")
  if args.from_csv or args.merge:
    # These choose what to measure; --from-csv and --merge measure nothing.
    given = ["--" + dest.replace("_", "-") for dest in _CLI_DEFAULTS
             if getattr(args, dest) is not None]
    if args.merge and args.any_rule:
      given.append("--any-rule")
    if args.act_dtype is not None:
      given.append("--act-dtype")
    if given:
      p.error(f"{', '.join(given)} choose(s) what to measure; --from-csv "
              "and --merge measure nothing")
  for dest, value in _CLI_DEFAULTS.items():
    if getattr(args, dest) is None:
      setattr(args, dest, value)
  if not (args.from_csv or args.merge):
    buckets = {}
    for bt in args.tokens:
      other = buckets.setdefault(bt_bucket(bt), bt)
      if other != bt:
        p.error(f"--tokens {other} and {bt} share one cache entry (BT "
                f"{bt_bucket(bt)}: the cache keys BT by the next power of "
                "two); give one of them")
  tuned = [TRITON, MOSAIC_GPU] if args.backend == "both" else [args.backend]
  triton_configs = [c for c in args.config or () if isinstance(c, BlockConfig)]
  mosaic_configs = [c for c in args.config or ()
                    if isinstance(c, MosaicConfig)]
  for backend, given in ((TRITON, triton_configs),
                         (MOSAIC_GPU, mosaic_configs)):
    if given and backend not in tuned:
      p.error(f"--config {label_of(given[0])} is a {backend} tiling, but "
              f"--backend {args.backend} does not tune {backend}: add "
              f"--backend {backend} or both")
  approx = [c.label for c in mosaic_configs if c.approx_math]
  if approx:
    p.error(f"--config {approx[0]}: approx_math (,ax) changes the rule's "
            "arithmetic, and the cache keeps the reference's; time such a "
            "tiling with benchmarks.backends --mosaic instead")
  if args.out is None:
    args.out = default_out()
    if args.out is None:
      p.error(f"the shipped cache {SHIPPED_CACHE} is inside an installed "
              f"package: pass --out FILE, or set ${ENV_VAR}=FILE (lookup() "
              "reads that file first)")
  out_dir = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(out_dir):
    p.error(f"--out {args.out}: folder {out_dir} does not exist")
  if os.path.isdir(args.out):
    p.error(f"--out {args.out} is a folder; give a JSON file's path")
  if not os.access(out_dir, os.W_OK):
    p.error(f"--out {args.out}: folder {out_dir} is not writable")

  try:  # refused before anything is measured (read again at each write)
    _read_or_empty(args.out)
  except (OSError, ValueError) as e:
    p.error(f"--out: {e}")
  if args.from_csv or args.merge:
    def add(data):
      for path in args.from_csv or ():
        try:
          print(f"{path}: {_import_csv(data, path, args)}")
        except (OSError, ValueError) as e:
          p.error(f"--from-csv {path}: {e}")
      for path in args.merge or ():
        try:
          n = merge_file(data, path)
        except (OSError, ValueError) as e:
          p.error(str(e))
        print(f"{path}: {n} entries merged")
    try:
      update_file(args.out, add)
    except (OSError, ValueError) as e:
      print(f"error: could not write --out {args.out}: {e}",
            file=sys.stderr)
      return 2
    print(f"wrote {args.out}")
    return 0

  kind = current_device_kind()
  if kind is None:
    print(f"error: autotuning needs a GPU (the default JAX backend is "
          f"{jax.default_backend()!r}); nothing measured, {args.out} "
          "unchanged.", file=sys.stderr)
    return 2
  if MOSAIC_GPU in tuned:
    cc = compute_capability()
    if cc is None or cc < MOSAIC_MIN_CAPABILITY:
      have = "no compute capability" if cc is None else f"{cc[0]}.{cc[1]}"
      print(f"error: --backend {args.backend}: the Mosaic GPU kernel needs "
            f"a GPU of compute capability 9.0 or newer (Hopper); {kind} "
            f"reports {have}. Tune --backend triton there; nothing "
            f"measured, {args.out} unchanged.", file=sys.stderr)
      return 2
  rule = RULES[args.rule]
  slots = (args.slot_dtype,) * len(rule.slots)
  stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
  sid = f"autotune@{stamp}"
  source = {"kind": "python -m pallas_kernels.autotune",
            "device": f"{jax.devices()[0].platform}:{kind}",
            "versions": _versions(), "measured": stamp,
            "metric": "median of 5 calls of a 20-step fori_loop, us per step"}
  entries, mosaic_entries = {}, {}
  print(f"device {kind}; {source['versions']}", flush=True)
  for (n_in, n_out) in args.shapes:
    for bt in args.tokens:
      print(f"{args.rule} BT={bt} {n_in}x{n_out} w={args.w_dtype} "
            f"slots={args.slot_dtype}", flush=True)
      key = cache_key(ANY_RULE if args.any_rule else rule, bt, n_in, n_out,
                      args.w_dtype, slots)
      res = None
      if TRITON in tuned:
        res = tune(bt, n_in, n_out, args.w_dtype, slots, rule,
                   configs=triton_configs or None, verbose=True,
                   act_dtype=args.act_dtype)
        entries[key] = _entry(
            res.best, res.best_s * 1e6,
            {config_label(c): t * 1e6 for c, t in res.timings.items()}, bt,
            failed=sorted(config_label(c) for c in res.failures))
        print(f"  best {config_label(res.best)}: {res.best_s * 1e6:.1f} us",
              flush=True)
      if MOSAIC_GPU in tuned:
        if res is None:  # the Triton kernel as it would run: its tiling
          # (the cache files that exist: --out may not yet)
          base = lookup(bt, n_in, n_out, args.w_dtype, slots, rule,
                        paths=cache_paths(missing_ok=True))
          if base is None:
            base = BlockConfig.compiled_default(bt, n_in, n_out,
                                                dtype_name(args.w_dtype))
          print(f"  triton {config_label(base)} (its tiling for the case):",
                flush=True)
          res = tune(bt, n_in, n_out, args.w_dtype, slots, rule,
                     configs=[base], verbose=True, act_dtype=args.act_dtype)
        try:
          mres = tune(bt, n_in, n_out, args.w_dtype, slots, rule,
                      configs=mosaic_configs or None, verbose=True,
                      backend=MOSAIC_GPU, act_dtype=args.act_dtype)
        except RuntimeError as e:
          print(f"  mosaic_gpu: no entry ({e})", flush=True)
        else:
          mosaic_entries[key] = _entry(
              mres.best, mres.best_s * 1e6,
              {c.label: t * 1e6 for c, t in mres.timings.items()}, bt,
              triton_time_us=round(res.best_s * 1e6, 4),
              triton_config=config_label(res.best),
              failed=sorted(c.label for c in mres.failures))
          print(f"  best mosaic_gpu {mres.best.label}: "
                f"{mres.best_s * 1e6:.1f} us (triton "
                f"{res.best_s * 1e6:.1f} us)", flush=True)
      def add(data):
        merge(data, kind, sid, source, entries)
        if mosaic_entries:
          merge(data, kind, sid, source, mosaic_entries, MOSAIC_GPU)
      try:  # after every case: a long run keeps its results (read again
        # first: another run's entries written meanwhile are kept)
        update_file(args.out, add)
      except (OSError, ValueError) as e:
        print(f"error: could not write --out {args.out}: {e}; stopped "
              "after this case", file=sys.stderr)
        return 2
  print(f"wrote {len(entries)} Triton and {len(mosaic_entries)} Mosaic GPU "
        f"entries for {kind!r} to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
