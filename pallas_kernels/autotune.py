"""The tuner of the fused kernel's tiling, and its command line.

* :data:`CONFIG_SPACE`: the curated candidate tilings (tile sizes, ``BT``
  chunk, warps, stages, tile order), as data.
* :func:`tune`: times each candidate with the real kernel on *scratch* arrays
  (fresh random arrays of the right shapes and dtypes; never the caller's
  weight or state), skips candidates that fail to compile, and returns the
  best with every timing. The timer is injectable (tests use a fake one).
* :func:`main`: measures on this GPU (or imports a benchmarks/kernel.py CSV,
  or merges other cache files) and merges the winners into a cache JSON,
  which :mod:`pallas_kernels.tuning_cache` reads.

Command line::

    # re-tune on this machine's GPU, merging into the JSON (refuses on CPU):
    python -m pallas_kernels.autotune --shapes 4096x4096 4096x14336 \\
        --tokens 512 2048 --out pallas_kernels/tuned_configs.json
    # a quick re-tune over chosen candidates instead of CONFIG_SPACE:
    python -m pallas_kernels.autotune --shapes 2048x5632 --tokens 512 \\
        --config 64x64x64,g1,w4,s3,e 64x128x32,g1,w4,s4,e,o2 --out JSON
    # rebuild the cache's entries from a benchmarks/kernel.py CSV:
    python -m pallas_kernels.autotune --from-csv kernel.csv --out JSON
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime as _dt
import json
import os
import platform
import re
import statistics
import sys
import time
from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import families
from pallas_kernels.fused_wgrad import fused_wgrad_update
from pallas_kernels.rules import UpdateRule
from pallas_kernels.tiling import BlockConfig
from pallas_kernels.tuning_cache import (
    ANY_RULE,
    ENV_VAR,
    FORMAT_VERSION,
    SHIPPED_CACHE,
    cache_key,
    clear_cache,
    config_label,
    current_device_kind,
    describe,
    dtype_name,
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


Timer = Callable[[Callable, tuple, BlockConfig], float]


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
  """

  best: BlockConfig
  best_s: float
  timings: dict[BlockConfig, float]
  failures: dict[BlockConfig, str]


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


def tune(bt: int, n_in: int, n_out: int, w_dtype, slot_dtypes: Sequence,
         rule: UpdateRule, *, configs: Iterable[BlockConfig] | None = None,
         timer: Timer | None = None, act_dtype=None,
         interpret: bool | None = None, verbose: bool = False) -> TuneResult:
  """Times the fused kernel for each candidate config and returns the best.

  Every candidate runs on its own fresh scratch arrays (:func:`scratch_state`:
  ``x``/``dy`` in ``act_dtype``, default ``w_dtype``); the caller's weight and
  state are never touched. ``w_dtype`` and ``slot_dtypes`` may be dtypes,
  dtype names or arrays (standing for their dtypes).

  Args:
    bt, n_in, n_out: tokens and the weight's shape ``(in, out)``.
    w_dtype, slot_dtypes: the weight's and the rule's slots' storage dtypes.
    rule: the optimizer rule the kernel's epilogue applies.
    configs: candidates (default :data:`CONFIG_SPACE`), clamped to the shape.
    timer: ``timer(step, state, config) -> seconds per step`` where
      ``step(state) -> state`` runs the kernel once on the scratch tuple
      ``state``; default :func:`loop_timer`. An exception counts as a failure.
    interpret: passed to the kernel (default: unless on a GPU).
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
  timer = loop_timer() if timer is None else timer
  h = _tuning_hparams(rule)

  def make_step(cfg):
    def step(state):
      x, dy, w, *slots = state
      w, new = fused_wgrad_update(x, dy, w, slots, h, rule=rule, config=cfg,
                                  interpret=interpret)
      return (x, dy, w, *new[:len(rule.slots)])
    return step

  timings, failures = {}, {}
  for cfg in candidates(bt, n_in, n_out, configs):
    state = scratch_state(bt, n_in, n_out, w_dtype, slot_dtypes, act_dtype)
    try:
      t = float(timer(make_step(cfg), state, cfg))
    except Exception as e:  # noqa: BLE001 -- a config may not compile
      failures[cfg] = f"{type(e).__name__}: {str(e)[:300]}"
      if verbose:
        print(f"  {config_label(cfg)}: failed: {failures[cfg]}", flush=True)
      continue
    finally:
      del state
    timings[cfg] = t
    if verbose:
      print(f"  {config_label(cfg)}: {t * 1e6:.1f} us", flush=True)
  if not timings:
    raise RuntimeError(
        f"no config ran for BT={bt} {n_in}x{n_out}: " + "; ".join(
            f"{config_label(c)}: {e}" for c, e in failures.items()))
  best = min(timings, key=timings.get)  # first of equals: the order tried
  return TuneResult(best, timings[best], timings, failures)


# --- writing the cache -------------------------------------------------------


def _empty_cache() -> dict:
  return {"format": FORMAT_VERSION,
          "about": ("forge-jax tuned BlockConfigs: devices[device_kind]"
                    "[\"entries\"][key], key = rule|btBUCKET|INxOUT|w=DTYPE|"
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
          entries: Mapping[str, dict]) -> dict:
  """Adds ``entries`` (key -> entry) and their source to ``data`` in place."""
  dev = data["devices"].setdefault(device_kind, {"sources": {}, "entries": {}})
  dev.setdefault("sources", {})[source_id] = source
  for key, entry in entries.items():
    dev.setdefault("entries", {})[key] = dict(entry, source=source_id)
  dev["entries"] = dict(sorted(dev["entries"].items()))
  return data


def merge_file(data: dict, path: str) -> int:
  """Merges another cache JSON (e.g. an autotune run's ``--out``) into ``data``.

  Every source keeps its own record, plus ``"file": path`` (where its
  measurements are kept); returns the number of entries merged.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"--merge: no such cache file {path!r}")
  other = _read_or_empty(path)
  n = 0
  for kind, dev in other["devices"].items():
    sources = dict(dev.get("sources", {}))
    entries_of = {sid: {} for sid in sources}
    for k, e in dev.get("entries", {}).items():
      sid = e.get("source")
      if sid not in sources:
        # An entry with no (or an unknown) source record, e.g. written by
        # hand: lookup() uses it, so it is merged, under a record saying so.
        sid = f"unrecorded@{path}"
        sources.setdefault(sid, {"kind": "entries without a source record"})
        entries_of.setdefault(sid, {})
      entries_of[sid][k] = {f: v for f, v in e.items() if f != "source"}
    for sid, entries in entries_of.items():
      merge(data, kind, sid, dict(sources[sid], file=path), entries)
      n += len(entries)
  return n


def write(path: str, data: dict) -> None:
  validated(data, path)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
  os.replace(tmp, path)
  clear_cache()


def _entry(cfg: BlockConfig, time_us: float, timings_us: Mapping[str, float],
           bt: int, **extra) -> dict:
  return {"config": dataclasses.asdict(cfg), "time_us": round(time_us, 4),
          "bt_measured": bt, **extra,
          "timings_us": {k: round(v, 4) for k, v in timings_us.items()}}


_SHAPE = re.compile(r"^BT=(\d+) (\d+)x(\d+)$")


def _csv_dtypes(field: str) -> tuple[str, tuple[str, ...]]:
  """``"w=bf16,m/v=bfloat16"`` -> ``("bfloat16", ("bfloat16", "bfloat16"))``."""
  parts = dict(p.split("=", 1) for p in field.split(","))
  w = dtype_name(parts.pop("w"))
  slots = []
  for names, d in parts.items():
    slots += [dtype_name(d)] * len(names.split("/"))
  return w, tuple(slots)


def winners_from_csv(path: str, rule: str = "adamw", metric: str = "p50"):
  """The best tiling per (shape, BT, dtypes) in a benchmarks/kernel.py CSV.

  Reads its ``forge[<config>]`` time rows (the fused AdamW step per curated
  config) and picks the lowest ``metric`` (the benchmark's own choice: p50,
  first of equals). Returns ``(device_kind, source, entries)``.
  """
  groups: dict[tuple, list] = {}
  devices, versions, stamps = set(), set(), set()
  with open(path, newline="") as f:
    reader = csv.DictReader(f)
    need = {"benchmark", "provider", "shape", "dtypes", "metric", metric,
            "unit", "device", "versions", "timestamp"}
    missing = sorted(need - set(reader.fieldnames or ()))
    if missing:
      raise ValueError(f"{path}: not a benchmarks/kernel.py CSV (no column "
                       f"{', '.join(missing)})")
    rows = list(reader)
  for r in rows:
    m = re.match(r"^forge\[(.+)\]$", r["provider"])
    if r["benchmark"] != "kernel" or r["metric"] != "time" or not m:
      continue
    groups.setdefault((r["shape"], r["dtypes"]), []).append(
        (parse_label(m.group(1)), float(r[metric]) * _to_us(r["unit"])))
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
    sm = _SHAPE.match(shape)
    if not sm:
      raise ValueError(f"{path}: unexpected shape {shape!r}")
    bt, n_in, n_out = (int(v) for v in sm.groups())
    w, slots = _csv_dtypes(dtypes)
    best_cfg, best_t = None, None
    for cfg, t in rows:
      if best_t is None or t < best_t:
        best_cfg, best_t = cfg, t
    key = cache_key(rule, bt, n_in, n_out, w, slots)
    entries[key] = _entry(best_cfg, best_t,
                          {config_label(c): t for c, t in rows}, bt)
  source = {
      "kind": "benchmarks/kernel.py CSV",
      "csv": _display_path(path),
      "device": device,
      "versions": "; ".join(sorted(versions)),
      "measured": ", ".join(sorted(stamps)),
      "metric": f"{metric} of the fused AdamW step per config, us",
  }
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
  """argparse ``type=``: an int >= 1 (a clean usage error otherwise); the
  benchmark CLIs use it too."""
  try:
    v = int(s)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
  if v < 1:
    raise argparse.ArgumentTypeError(f"{v} must be >= 1")
  return v


# The dtypes the kernel stores W and its slots in.
STATE_DTYPES = ("float32", "bfloat16", "float16")


def _label_arg(label: str) -> BlockConfig:
  try:
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
    slot_dtype="bfloat16")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      prog="python -m pallas_kernels.autotune",
      description="Tune the fused kernel's tiling on this GPU (or import a "
      "benchmarks/kernel.py CSV) and merge the winners into a cache JSON.")
  p.add_argument("--out", default=None,
                 help=f"cache JSON to merge into (default: ${ENV_VAR} when "
                 "set, else the shipped one in a source checkout; an "
                 "installed package needs --out or the variable)")
  p.add_argument("--from-csv", nargs="+", metavar="CSV",
                 help="take the winners from benchmarks/kernel.py CSVs "
                 "instead of measuring")
  p.add_argument("--merge", nargs="+", metavar="JSON",
                 help="merge other cache files (e.g. a tuning run's --out) "
                 "instead of measuring")
  # Measurement choices (default None: refused with --from-csv / --merge).
  p.add_argument("--shapes", nargs="+", type=_parse_shape, metavar="INxOUT",
                 help="default: 4096x4096 4096x1024 4096x14336 14336x4096")
  p.add_argument("--tokens", nargs="+", type=positive_int,
                 help="default: 512 2048")
  p.add_argument("--rule", choices=sorted(RULES), help="default: adamw")
  p.add_argument("--w-dtype", choices=STATE_DTYPES,
                 help="default: bfloat16")
  p.add_argument("--slot-dtype", choices=STATE_DTYPES,
                 help="dtype of every slot of the rule (default bfloat16)")
  p.add_argument("--any-rule", action="store_true",
                 help="store the winners under rule \"any\" (used for every "
                 "rule without its own entry)")
  p.add_argument("--config", nargs="+", metavar="LABEL", default=None,
                 type=_label_arg,
                 help="candidates instead of CONFIG_SPACE, as labels such as "
                 "64x128x32,g1,w4,s4,e,o2 (a quick re-tune)")
  args = p.parse_args(argv)
  if args.from_csv and args.config:
    p.error("--config chooses tilings to measure; --from-csv measures "
            "nothing (it reads the CSVs' own tilings)")
  if args.merge and args.config:
    p.error("--config chooses tilings to measure; --merge measures nothing")
  configs = args.config
  if args.from_csv or args.merge:
    # These choose what to measure; --from-csv and --merge measure nothing.
    given = ["--" + dest.replace("_", "-") for dest in _CLI_DEFAULTS
             if getattr(args, dest) is not None]
    if args.merge and args.any_rule:
      given.append("--any-rule")
    if given:
      p.error(f"{', '.join(given)} choose(s) what to measure; --from-csv "
              "and --merge measure nothing")
  for dest, value in _CLI_DEFAULTS.items():
    if getattr(args, dest) is None:
      setattr(args, dest, value)
  if args.out is None:
    args.out = default_out()
    if args.out is None:
      p.error(f"the shipped cache {SHIPPED_CACHE} is inside an installed "
              f"package: pass --out FILE, or set ${ENV_VAR}=FILE (lookup() "
              "reads that file first)")
  out_dir = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(out_dir):
    p.error(f"--out {args.out}: folder {out_dir} does not exist")

  try:
    data = _read_or_empty(args.out)
  except (OSError, ValueError) as e:
    p.error(f"--out: {e}")
  if args.from_csv or args.merge:
    for path in args.from_csv or ():
      try:
        kind, sid, source, entries = winners_from_csv(
            path, rule=ANY_RULE if args.any_rule else "adamw")
      except (OSError, ValueError) as e:
        p.error(f"--from-csv {path}: {e}")
      merge(data, kind, sid, source, entries)
      print(f"{path}: {len(entries)} winners for {kind!r}")
    for path in args.merge or ():
      try:
        n = merge_file(data, path)
      except (OSError, ValueError) as e:
        p.error(str(e))
      print(f"{path}: {n} entries merged")
    write(args.out, data)
    print(f"wrote {args.out}")
    return 0

  kind = current_device_kind()
  if kind is None:
    print(f"error: autotuning needs a GPU (the default JAX backend is "
          f"{jax.default_backend()!r}); nothing measured, {args.out} "
          "unchanged.", file=sys.stderr)
    return 2
  rule = RULES[args.rule]
  slots = (args.slot_dtype,) * len(rule.slots)
  stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
  sid = f"autotune@{stamp}"
  source = {"kind": "python -m pallas_kernels.autotune",
            "device": f"{jax.devices()[0].platform}:{kind}",
            "versions": _versions(), "measured": stamp,
            "metric": "median of 5 calls of a 20-step fori_loop, us per step"}
  entries = {}
  print(f"device {kind}; {source['versions']}", flush=True)
  for (n_in, n_out) in args.shapes:
    for bt in args.tokens:
      print(f"{args.rule} BT={bt} {n_in}x{n_out} w={args.w_dtype} "
            f"slots={args.slot_dtype}", flush=True)
      res = tune(bt, n_in, n_out, args.w_dtype, slots, rule,
                 configs=configs, verbose=True)
      key = cache_key(ANY_RULE if args.any_rule else rule, bt, n_in, n_out,
                      args.w_dtype, slots)
      entries[key] = _entry(
          res.best, res.best_s * 1e6,
          {config_label(c): t * 1e6 for c, t in res.timings.items()}, bt,
          failed=sorted(config_label(c) for c in res.failures))
      print(f"  best {config_label(res.best)}: {res.best_s * 1e6:.1f} us",
            flush=True)
      merge(data, kind, sid, source, entries)
      write(args.out, data)  # after every case: a long run keeps its results
  print(f"wrote {len(entries)} entries for {kind!r} to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
