"""The cache of tuned tilings, and the backend and tiling a kernel takes
when given none.

``tuned_configs.json`` ships beside this module, keyed by device kind
(``jax.devices()[0].device_kind``, e.g. ``"NVIDIA H200"``) and then by
:func:`cache_key` ``(rule, BT bucket, in, out, w dtype, slot dtypes)``:
``devices[kind]["entries"]`` holds the Triton kernel's tilings
(:class:`~pallas_kernels.tiling.BlockConfig`), ``devices[kind]["mosaic_gpu"]``
the Mosaic GPU kernel's (:class:`~pallas_kernels.mosaic_kernel.MosaicConfig`),
each with its measured time and the Triton kernel's time in the same run.
``$FORGE_AUTOTUNE_CACHE`` names another file of the same form (e.g. a
re-tuned one) that is consulted first. :func:`lookup` returns the cached
Triton tiling or ``None``, :func:`lookup_mosaic` the cached Mosaic GPU
entry or ``None``, :func:`nearest_mosaic` the entries of other cases
nearest to one the cache has no entry for; :func:`select_config` is the
Triton tiling ``fused_wgrad_update`` takes without a ``config``,
:func:`select_backend`
the backend (and its tiling) it takes without a ``backend``. The tuner that
writes the cache is :mod:`pallas_kernels.autotune`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import re
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import lowp, mosaic_kernel
from pallas_kernels.checks import check_rule
from pallas_kernels.interpret import check_interpret, default_interpret
from pallas_kernels.mosaic_kernel import MosaicConfig
from pallas_kernels.rules import UpdateRule, tuned_names
from pallas_kernels.tiling import BlockConfig, next_pow2

SHIPPED_CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             "tuned_configs.json")
ENV_VAR = "FORGE_AUTOTUNE_CACHE"
FORMAT_VERSION = 1
ANY_RULE = "any"
# The kernel backends, and the variable that picks one for calls that name
# none.
TRITON, MOSAIC_GPU = "triton", "mosaic_gpu"
BACKENDS = (TRITON, MOSAIC_GPU)
BACKEND_ENV_VAR = "FORGE_BACKEND"
# The Mosaic GPU kernel needs Hopper (sm_90) or newer.
MOSAIC_MIN_CAPABILITY = (9, 0)

__all__ = ["ANY_RULE", "BACKENDS", "BACKEND_ENV_VAR", "BackendChoice",
           "ENV_VAR", "FORMAT_VERSION", "MOSAIC_GPU", "MosaicEntry",
           "SHIPPED_CACHE", "TRITON", "bt_bucket", "cache_key", "cache_paths",
           "clear_cache", "compute_capability", "config_label",
           "current_device_kind", "describe", "dtype_name", "env_backend",
           "load", "lookup", "lookup_mosaic", "mosaic_tiling",
           "nearest_covering", "nearest_mosaic", "parse_label", "read_json",
           "select_backend", "select_config", "validated"]

_DTYPE_ALIASES = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32",
                  "f16": "float16", "fp16": "float16"}


def config_label(cfg: BlockConfig) -> str:
  """``64x128x64,g1,w4,s3``: the form benchmarks/kernel.py's CSV uses."""
  return (f"{cfg.block_in}x{cfg.block_out}x{cfg.block_bt},g{cfg.group_in},"
          f"w{cfg.num_warps},s{cfg.num_stages}" + (",p" if cfg.prefetch else "")
          + (",e" if cfg.stream_state else "")
          + (f",o{cfg.split_out}" if cfg.split_out > 1 else ""))


_LABEL = re.compile(
    r"^(\d+)x(\d+)x(\d+),g(\d+),w(\d+),s(\d+)(,p)?(,e)?(?:,o(\d+))?$")


def parse_label(label: str) -> BlockConfig:
  """The :class:`BlockConfig` a :func:`config_label` names.

  Raises:
    ValueError: ``label`` is not of that form, or names an invalid tiling.
  """
  m = _LABEL.match(label.strip())
  if not m:
    raise ValueError(f"not a config label: {label!r}")
  *ints, prefetch, stream, split = m.groups()
  return BlockConfig(*(int(v) for v in ints), prefetch=prefetch is not None,
                     stream_state=stream is not None,
                     split_out=int(split) if split else 1)


# --- the cache ---------------------------------------------------------------


def dtype_name(d) -> str:
  """The canonical dtype name of a dtype, a dtype name (``"bf16"`` and the
  like included) or an array (its dtype)."""
  d = getattr(d, "dtype", d)  # an array (or ShapeDtypeStruct) stands for its dtype
  if isinstance(d, str):
    d = _DTYPE_ALIASES.get(d, d)
  return jnp.dtype(d).name


def bt_bucket(bt: int) -> int:
  """Tokens are bucketed to the next power of two."""
  return next_pow2(max(1, int(bt)))


def _rule_name(rule) -> str:
  if rule is None:
    return ANY_RULE
  return rule if isinstance(rule, str) else rule.name


def cache_key(rule, bt: int, n_in: int, n_out: int, w_dtype,
              slot_dtypes: Sequence) -> str:
  """``"adamw|bt512|4096x4096|w=bfloat16|slots=bfloat16,bfloat16"``.

  ``rule`` is an :class:`~pallas_kernels.rules.UpdateRule`, its name, or
  ``None`` for ``"any"`` (an entry valid for every rule); ``bt`` is bucketed (:func:`bt_bucket`).
  A rule's static settings (``round_mu``, ...) are not in the key: the
  kernels they distinguish share the family's tiling (whether a rounding
  kernel would tune differently has not been measured).
  """
  return (f"{_rule_name(rule)}|bt{bt_bucket(bt)}|{int(n_in)}x{int(n_out)}|"
          + _dtypes_key(w_dtype, slot_dtypes))


def _dtypes_key(w_dtype, slot_dtypes: Sequence) -> str:
  """The dtypes' part of a :func:`cache_key`: ``"w=...|slots=..."``."""
  slots = ",".join(dtype_name(d) for d in slot_dtypes)
  return f"w={dtype_name(w_dtype)}|slots={slots}"


_parsed: dict[str, dict] = {}


def clear_cache() -> None:
  """Forgets the parsed JSON files (after one was rewritten)."""
  _parsed.clear()


def describe(path: str) -> str:
  """``path``, marked as ``$FORGE_AUTOTUNE_CACHE``'s where it is that."""
  env = os.environ.get(ENV_VAR)
  if env and os.path.abspath(env) == os.path.abspath(path):
    return f"{path} (${ENV_VAR})"
  return path


def read_json(path: str):
  """The JSON at ``path``; a ``ValueError`` naming it if it is not JSON."""
  with open(path) as f:
    try:
      return json.load(f)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError and
      # UnicodeDecodeError are ValueErrors, as is an integer too long to
      # read; nesting too deep for the parser is a RecursionError)
      raise ValueError(f"{describe(path)}: not a valid JSON file "
                       f"({type(e).__name__}: {str(e)[:200]}); not a forge "
                       "autotune cache") from None


def load(path: str) -> dict:
  """The parsed cache file at ``path`` (memoised; validates every entry)."""
  path = os.path.abspath(path)
  if path not in _parsed:
    _parsed[path] = validated(read_json(path), describe(path))
  return _parsed[path]


@dataclasses.dataclass(frozen=True)
class MosaicEntry:
  """A cached Mosaic GPU tiling for one case.

  Attributes:
    config: the tiling.
    time_us: its measured time per step, microseconds (``None`` if not
      recorded).
    triton_time_us: the Triton kernel's time for the same case in the same
      run, microseconds (``None`` if not recorded). The entry selects the Mosaic GPU
      kernel for ``backend=None`` only when both are recorded and
      ``time_us < triton_time_us``.
  """

  config: MosaicConfig
  time_us: float | None = None
  triton_time_us: float | None = None

  @property
  def faster_than_triton(self) -> bool:
    """Whether it measured faster than the Triton kernel (both times
    recorded)."""
    return (self.time_us is not None and self.triton_time_us is not None
            and self.time_us < self.triton_time_us)


def _time(entry: dict, name: str) -> float | None:
  v = entry.get(name)
  if v is None:
    return None
  if (isinstance(v, bool) or not isinstance(v, (int, float))
      or not 0 < v < math.inf):
    raise ValueError(f"{name} must be a positive, finite number of "
                     f"microseconds, got {v!r}")
  return float(v)


def validated(data: dict, where: str) -> dict:
  """The parsed form of a cache file's ``data``: ``{"data": data,
  "configs": {(device kind, key): BlockConfig}, "mosaic": {(device kind,
  key): MosaicEntry}}``.

  Raises:
    ValueError: naming ``where``, when ``data`` is not a valid cache.
  """
  if (not isinstance(data, dict) or isinstance(data.get("format"), bool)
      or data.get("format") != FORMAT_VERSION):
    raise ValueError(f"{where}: not a format-{FORMAT_VERSION} forge autotune "
                     "cache (a JSON object with \"format\": 1)")
  devices = data.get("devices", {})
  if not isinstance(devices, dict):
    raise ValueError(f"{where}: \"devices\" must be an object (device kind "
                     f"-> entries), got {type(devices).__name__}")
  configs, mosaic = {}, {}
  for kind, dev in devices.items():
    entries = dev.get("entries", {}) if isinstance(dev, dict) else None
    sources = dev.get("sources", {}) if isinstance(dev, dict) else None
    mosaic_entries = (dev.get(MOSAIC_GPU, {}) if isinstance(dev, dict)
                      else None)
    if not all(isinstance(d, dict)
               for d in (entries, sources, mosaic_entries)):
      raise ValueError(
          f"{where}: devices[{kind!r}] must be an object whose \"entries\", "
          f"\"sources\" and \"{MOSAIC_GPU}\" (if present) are objects")
    for sid, record in sources.items():
      if not isinstance(record, dict):
        raise ValueError(
            f"{where}: devices[{kind!r}] sources[{sid!r}] must be an object "
            f"(the source's record), got {type(record).__name__}")
    for key, entry in (*entries.items(), *mosaic_entries.items()):
      source = entry.get("source") if isinstance(entry, dict) else None
      if source is not None and not isinstance(source, str):
        raise ValueError(
            f"{where}: bad entry {kind!r} / {key!r}: \"source\" must name "
            f"a record of \"sources\" (a string), got {source!r}")
    for key in (*entries, *mosaic_entries):
      canonical = _canonical_key(key)
      if canonical != key:
        hint = (f"; cache_key writes it {canonical!r}, which a lookup "
                "would find" if canonical else "")
        raise ValueError(
            f"{where}: bad key {kind!r} / {key!r}: expected "
            "'RULE|btBT|INxOUT|w=DTYPE|slots=DTYPES' with BT a power of two, "
            "IN and OUT positive and canonical dtype names "
            f"(pallas_kernels.tuning_cache.cache_key's form){hint}")
    for key, entry in entries.items():
      try:
        configs[(kind, key)] = BlockConfig(**entry["config"])
        _time(entry, "time_us")
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad entry {kind!r} / {key!r}: {e}") from e
    for key, entry in mosaic_entries.items():
      try:
        mosaic[(kind, key)] = MosaicEntry(
            MosaicConfig(**entry["config"]), _time(entry, "time_us"),
            _time(entry, "triton_time_us"))
      except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: bad {MOSAIC_GPU} entry {kind!r} / "
                         f"{key!r}: {e}") from e
      if mosaic[(kind, key)].config.approx_math:
        raise ValueError(
            f"{where}: {MOSAIC_GPU} entry {kind!r} / {key!r} uses "
            "approx_math (,ax), which changes the rule's arithmetic; a "
            "cache holds tilings with the reference's only")
  return {"data": data, "configs": configs, "mosaic": mosaic}


def cache_paths(missing_ok: bool = False) -> list[str]:
  """The files :func:`lookup` consults, first match wins: the one named by
  ``$FORGE_AUTOTUNE_CACHE`` (if set), then the shipped one.

  Raises:
    FileNotFoundError: the variable names no file (``missing_ok``: that
      file is left out instead, as the tuner does before writing it).
  """
  paths = []
  env = os.environ.get(ENV_VAR)
  if env and not (missing_ok and not os.path.isfile(env)):
    if not os.path.isfile(env):
      raise FileNotFoundError(
          f"${ENV_VAR}={env!r} does not name a file (unset it to use only "
          "the shipped cache)")
    paths.append(env)
  paths.append(SHIPPED_CACHE)
  return paths


def lookup(bt: int, n_in: int, n_out: int, w_dtype, slot_dtypes: Sequence,
           rule=None, *, device_kind: str | None = None,
           paths: Sequence[str] | None = None) -> BlockConfig | None:
  """The cached tuned config for this problem on ``device_kind``, or ``None``.

  Tries the rule's own entry, then (an
  :class:`~pallas_kernels.rules.UpdateRule` with
  ``tuned_as``) the entries of the rules it names, in order, then an
  ``"any"``-rule entry, in each
  file of ``paths`` (default :func:`cache_paths`). ``device_kind=None``
  means the current device, and on a CPU (or anything but a GPU) nothing
  matches.
  """
  return _lookup("configs", bt, n_in, n_out, w_dtype, slot_dtypes, rule,
                 device_kind, paths)


def lookup_mosaic(bt: int, n_in: int, n_out: int, w_dtype,
                  slot_dtypes: Sequence, rule=None, *,
                  device_kind: str | None = None,
                  paths: Sequence[str] | None = None) -> MosaicEntry | None:
  """The cached Mosaic GPU entry for this problem on ``device_kind``, or
  ``None``: the same keys, files and order as :func:`lookup`."""
  return _lookup("mosaic", bt, n_in, n_out, w_dtype, slot_dtypes, rule,
                 device_kind, paths)


def _lookup(table, bt, n_in, n_out, w_dtype, slot_dtypes, rule, device_kind,
            paths):
  if device_kind is None:
    device_kind = current_device_kind()
    if device_kind is None:
      return None
  keys = [cache_key(rule, bt, n_in, n_out, w_dtype, slot_dtypes)]
  for name in tuned_names(rule):
    keys.append(cache_key(name, bt, n_in, n_out, w_dtype, slot_dtypes))
  if _rule_name(rule) != ANY_RULE:
    keys.append(cache_key(None, bt, n_in, n_out, w_dtype, slot_dtypes))
  for path in (cache_paths() if paths is None else paths):
    found = load(path)[table]
    for key in keys:
      hit = found.get((device_kind, key))
      if hit is not None:
        return hit
  return None


_KEY = re.compile(r"(?P<rule>[^|]+)\|bt(?P<bt>\d+)\|(?P<n_in>\d+)x"
                  r"(?P<n_out>\d+)\|w=(?P<w>[^|]+)\|slots=(?P<slots>[^|]*)")


def _canonical_key(key) -> str | None:
  """``key`` as :func:`cache_key` writes the case it names (a lookup finds
  only that form), or ``None`` where it names none: not of the form, a size
  below 1, a dtype that is no dtype."""
  m = _KEY.fullmatch(key) if isinstance(key, str) else None
  if m is None or not all(int(m[n]) >= 1 for n in ("bt", "n_in", "n_out")):
    return None
  try:
    return cache_key(m["rule"], int(m["bt"]), int(m["n_in"]),
                     int(m["n_out"]), m["w"],
                     m["slots"].split(",") if m["slots"] else ())
  except TypeError:  # not a dtype name
    return None


def nearest_mosaic(bt: int, n_in: int, n_out: int, w_dtype,
                   slot_dtypes: Sequence, rule=None, *,
                   device_kind: str | None = None,
                   paths: Sequence[str] | None = None
                   ) -> list[tuple[str, MosaicEntry]]:
  """The cached Mosaic GPU entries of the same rule (its own, its
  ``tuned_as`` rules' or ``"any"``), weight dtype and slot dtypes on
  ``device_kind``, at every BT bucket and shape, nearest first: by the
  distance of the BT buckets, then of the weights' sizes ``in * out``, then
  of their aspect ratios ``in / out`` (each on a log scale); on a tie the
  larger BT bucket first (at BT 1024 the BT 2048 tilings measured faster
  than the BT 512 ones at the four Llama-3.1-8B shapes), then earlier files
  of ``paths``. ``(key, entry)`` pairs; ``[]`` off a GPU.

  :func:`select_backend` takes the first whose tiling covers a case the
  cache has no entry for."""
  if device_kind is None:
    device_kind = current_device_kind()
  if device_kind is None or n_in < 1 or n_out < 1:  # (no weight: no size)
    return []
  # The rule's own entries first, then its tuned_as rule's, then "any"
  # (lookup's order) where the distances tie.
  names = tuned_names(rule)
  rules = {ANY_RULE: len(names) + 1,
           **{_rule_name(name): rank for rank, name in enumerate(names, 1)},
           _rule_name(rule): 0}
  dtypes = _dtypes_key(w_dtype, slot_dtypes)
  log = math.log2
  found = {}
  for rank, path in enumerate(cache_paths() if paths is None else paths):
    for (kind, key), entry in load(path)["mosaic"].items():
      m = _KEY.fullmatch(key)
      if (kind != device_kind or m is None or key in found
          or m["rule"] not in rules
          or f"w={m['w']}|slots={m['slots']}" != dtypes):
        continue
      e_bt, e_in, e_out = int(m["bt"]), int(m["n_in"]), int(m["n_out"])
      found[key] = ((abs(log(bt_bucket(bt)) - log(e_bt)),
                     abs(log(n_in * n_out) - log(e_in * e_out)),
                     abs(log(n_in / n_out) - log(e_in / e_out)), -e_bt,
                     rank, rules[m["rule"]], key),
                    entry)
  return [(key, entry) for key, (_, entry) in
          sorted(found.items(), key=lambda kv: kv[1][0])]


def _gpu_device():
  """``jax.devices()[0]`` when the default backend is a GPU, else ``None``."""
  if jax.default_backend() != "gpu":
    return None
  return jax.devices()[0]


def current_device_kind() -> str | None:
  """``jax.devices()[0].device_kind`` when the default backend is a GPU, else
  ``None`` (tuned entries are for GPUs; CPU/interpret uses the heuristic)."""
  device = _gpu_device()
  return None if device is None else device.device_kind


def compute_capability() -> tuple[int, int] | None:
  """The GPU's compute capability, e.g. ``(9, 0)`` on an H100 or H200, from
  its JAX device's ``compute_capability`` (``"9.0"``); ``None`` without a
  GPU, or when the device does not report one in that form (a GPU that is
  not NVIDIA's, say)."""
  device = _gpu_device()
  text = getattr(device, "compute_capability", None)
  if not isinstance(text, str):
    return None
  m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text)
  return (int(m.group(1)), int(m.group(2))) if m else None


def _check_case(where: str, bt, n_in, n_out, w_dtype, slot_dtypes, rule,
                x_dtype=None) -> tuple:
  """Refuses a case no kernel call could have, naming the argument, before
  an answer is formed from it (in interpret mode nothing else reads the
  dtypes): sizes that are not non-negative integers, names that are not
  dtypes, a rule that is neither ``None``, a name nor an
  :class:`~pallas_kernels.rules.UpdateRule`. Returns ``slot_dtypes`` as a
  tuple (``None``: no slots)."""
  for name, v in (("bt", bt), ("n_in", n_in), ("n_out", n_out)):
    try:  # (a NumPy or concrete JAX integer too, and a whole float: 512.0)
      if isinstance(v, (bool, np.bool_)):
        raise TypeError
      try:
        whole = operator.index(v) == v
      except TypeError:  # a real float of no dimensions only (not a
        # string, a complex, a boolean array)
        real = isinstance(v, float) or jnp.issubdtype(
            getattr(v, "dtype", np.object_), jnp.floating)
        whole = real and np.ndim(v) == 0 and float(v).is_integer()
    except (TypeError, ValueError, OverflowError):
      whole = False
    if not whole or v < 0:
      traced = (" (a traced value: the kernel and its tiling are chosen "
                "when tracing, from the static shapes; pass the Python int, "
                "e.g. x.shape[0])"
                if isinstance(v, jax.core.Tracer) else "")
      raise ValueError(f"{where}: {name}={v!r} must be a non-negative "
                       f"integer{traced}")
  if rule is not None and not isinstance(rule, (str, UpdateRule)):
    raise TypeError(f"{where}: rule={rule!r:.80} must be an UpdateRule, its "
                    "name or None")
  if slot_dtypes is None:  # (taken as no slots, as before this check)
    slot_dtypes = ()
  try:
    if isinstance(slot_dtypes, (str, bytes)):
      raise TypeError
    slot_dtypes = tuple(slot_dtypes)  # (a generator: read once, here)
  except TypeError:
    raise TypeError(f"{where}: slot_dtypes={slot_dtypes!r:.80} must be a "
                    "sequence of dtypes, one per slot") from None
  named = [("w_dtype", w_dtype)] + [(f"slot_dtypes[{i}]", d)
                                    for i, d in enumerate(slot_dtypes)]
  if x_dtype is not None:
    named.append(("x_dtype", x_dtype))
  for name, d in named:
    try:
      dtype_name(d)
    except TypeError as e:
      raise TypeError(f"{where}: {name}={d!r:.80} is not a dtype ({e})"
                      ) from None
  return slot_dtypes


def select_config(bt: int, n_in: int, n_out: int, w_dtype, slot_dtypes,
                  rule=None, *, interpret: bool | None = None) -> BlockConfig:
  """The tiling ``fused_wgrad_update`` uses when given no ``config``.

  On a GPU (not in interpret mode): the autotuned winner cached for this
  device kind and problem (:func:`lookup`: ``$FORGE_AUTOTUNE_CACHE``
  first, then the shipped ``tuned_configs.json``), else the heuristic
  :meth:`BlockConfig.compiled_default`. In interpret mode (default: when
  there is no GPU) always :meth:`BlockConfig.default`. Runs at trace time;
  the parsed JSON is cached.

  Args:
    bt, n_in, n_out: tokens and the weight's shape ``(in, out)``.
    w_dtype, slot_dtypes: the weight's and the slots' storage dtypes.
    rule: the :class:`~pallas_kernels.rules.UpdateRule` (or its name, or
      ``None`` for any rule).
    interpret: whether the kernel runs in Pallas interpret mode.

  Returns:
    A :class:`BlockConfig` fitted to the problem.
  """
  slot_dtypes = _check_case("select_config", bt, n_in, n_out, w_dtype,
                            slot_dtypes, rule)
  interpret = check_interpret(interpret, "select_config")
  if interpret is None:
    interpret = default_interpret()
  if not interpret:
    cfg = lookup(bt, n_in, n_out, w_dtype, slot_dtypes, rule)
    if cfg is not None:
      return cfg
    return BlockConfig.compiled_default(bt, n_in, n_out,
                                        dtype_name(w_dtype))
  return BlockConfig.default(bt, n_in, n_out)


# --- the backend -------------------------------------------------------------


class BackendChoice(NamedTuple):
  """The kernel backend a ``fused_wgrad_update`` call takes.

  Attributes:
    backend: ``"triton"`` or ``"mosaic_gpu"``.
    config: its tiling: a :class:`~pallas_kernels.tiling.BlockConfig` for
      Triton, a :class:`~pallas_kernels.mosaic_kernel.MosaicConfig` for
      Mosaic GPU.
    reason: why, in words.
  """

  backend: str
  config: BlockConfig | MosaicConfig
  reason: str


def env_backend() -> str | None:
  """The backend ``$FORGE_BACKEND`` names (``"triton"`` or
  ``"mosaic_gpu"``), or ``None`` when it is unset or empty.

  Raises:
    ValueError: it names anything else.
  """
  value = os.environ.get(BACKEND_ENV_VAR, "").strip()
  if not value:
    return None
  if value not in BACKENDS:
    raise ValueError(
        f"${BACKEND_ENV_VAR}={value!r} is not a kernel backend: set it to "
        f"'triton' or 'mosaic_gpu', or unset it to let each call choose "
        "(the Mosaic GPU kernel where the autotune cache measured it, or "
        "the nearest case it holds, faster on this GPU, else Triton)")
  return value


def _mosaic_shapes(n_in, n_out, w_dtype, slot_dtypes):
  """Stand-ins of ``w`` and the slots (the Mosaic checks read their
  dtypes)."""
  w = jax.ShapeDtypeStruct((n_in, n_out), dtype_name(w_dtype))
  slots = [jax.ShapeDtypeStruct((n_in, n_out), dtype_name(d))
           for d in slot_dtypes]
  return w, slots


def _mosaic_default(bt, n_in, n_out, w_dtype, slot_dtypes, rule, x_dtype,
                    g_stored, low_precision=False) -> MosaicConfig:
  held = mosaic_kernel.smem_dtypes(rule, dtype_name(w_dtype),
                                   [dtype_name(d) for d in slot_dtypes])
  if g_stored:
    return mosaic_kernel.stored_config(n_in, n_out,
                                       held + [jnp.dtype(x_dtype)])
  return mosaic_kernel.default_config(dtype_name(x_dtype), held, bt=bt,
                                     shape=(n_in, n_out),
                                     quantized=low_precision)


def select_backend(bt: int, n_in: int, n_out: int, w_dtype, slot_dtypes,
                   rule, x_dtype, *, interpret: bool | None = None,
                   stacked: bool = False, g_stored: bool = False,
                   config=None, backend: str | None = None,
                   varying: bool = False,
                   where: str = "fused_wgrad_update",
                   low_precision: bool = False,
                   mosaic_slot_dtypes: Sequence | None = None
                   ) -> BackendChoice:
  """The backend and tiling a kernel call takes; runs at trace time.

  In order, the first that applies:

  1. ``backend="triton"`` or ``"mosaic_gpu"``: that backend, with
     ``config`` if given (of that backend's type), else its tiling for the
     case (Triton: :func:`select_config`; Mosaic GPU: the cached entry's
     tiling on a GPU where it covers the case, else the nearest entry's
     (:func:`nearest_covering`), else
     :func:`~pallas_kernels.mosaic_kernel.default_config`; with
     ``low_precision``, the entry measured with ``mosaic_slot_dtypes``, else
     that default's int8 tiling, ``quantized=True``).
  2. ``config`` given: the backend of its type (a ``BlockConfig`` is a
     Triton tiling, a ``MosaicConfig`` a Mosaic GPU one).
  3. ``$FORGE_BACKEND`` set to ``triton`` or ``mosaic_gpu``: as if that
     were passed as ``backend``.
  4. Otherwise Mosaic GPU only when all hold: compiled (not interpret
     mode), outside ``shard_map`` (``varying``: jax's ``mpmd_map``, which
     the Mosaic GPU kernel is built on, refuses state refs that vary over
     a mesh axis), on a GPU of compute capability 9.0 or newer, a kernel that
     forms ``G`` (not a stored gradient), the autotune cache holds a Mosaic
     GPU entry for the case on this device kind (:func:`lookup_mosaic`)
     that measured faster than the Triton kernel in the same run, and the
     Mosaic GPU kernel covers the case with that tiling
     (:func:`~pallas_kernels.mosaic_kernel.unsupported`) -- or, where the
     cache has no entry for the case (another BT bucket or shape), the
     nearest entry of the same rule and dtypes that measured faster than
     the Triton kernel and whose tiling covers the case
     (:func:`nearest_covering`; docs/benchmarks.md has the cases measured
     beyond the cache's own) -- and no slot is
     quantized nor the weight stored by stochastic rounding
     (``low_precision``), except int8 moments the kernel takes
     (``mosaic_slot_dtypes``), which an entry measured with them selects
     as any other. Else Triton with :func:`select_config`'s tiling.

  A backend chosen by 1 to 3 is not second-guessed: a case the Mosaic GPU
  kernel does not cover then fails when it is called (``ValueError`` with
  the reason), never falls back.

  Args:
    bt, n_in, n_out: tokens and the weight's shape ``(in, out)``.
    w_dtype, slot_dtypes: the weight's and the slots' storage dtypes.
    rule: the :class:`~pallas_kernels.rules.UpdateRule`.
    x_dtype: the dtype of ``x`` and ``dy`` (with ``g_stored``, ``G``'s).
    interpret: Pallas interpret mode (default: when there is no GPU).
    stacked: the state is a stack of layers (``layer=i``).
    g_stored: the gradient is already in memory (``stored_g_update``).
    varying: the operands vary over a ``shard_map`` mesh axis.
    low_precision: a slot is quantized, or the weight is stored by
      stochastic rounding (:mod:`pallas_kernels.lowp`).
    mosaic_slot_dtypes: with ``low_precision``, the slots' dtypes as the
      Mosaic GPU kernel holds them (int8 codes), given when it takes this
      state (int8 moments, no stochastic rounding: ``mosaic_kernel.
      low_precision_problem(plan)`` is ``None``); its autotune cache keys
      such cases by them. ``None``: it does not take it.
    config: the caller's tiling, or ``None``.
    backend: the caller's backend, or ``None``.
    where: the call named in error messages.

  Returns:
    A :class:`BackendChoice` ``(backend, config, reason)``.

  Raises:
    ValueError: ``backend`` or ``$FORGE_BACKEND`` names no backend.
    TypeError: ``config`` is not a tiling of the chosen backend.
  """
  slot_dtypes = _check_case(where, bt, n_in, n_out, w_dtype, slot_dtypes,
                            rule, x_dtype)
  interpret = check_interpret(interpret, where)
  if interpret is None:
    interpret = default_interpret()
  if backend is not None and backend not in BACKENDS:
    raise ValueError(f"{where}: backend={backend!r}; use None, 'triton' or "
                     "'mosaic_gpu'")
  if config is not None and not isinstance(config, (BlockConfig,
                                                    MosaicConfig)):
    raise TypeError(
        f"{where}(config=...): config must be a "
        "pallas_kernels.BlockConfig (a Triton tiling), a "
        "pallas_kernels.MosaicConfig (a Mosaic GPU tiling) or None, got "
        f"{type(config).__name__} {config!r:.80}")
  check_rule(rule, where)

  # The slots as the Mosaic GPU kernel holds them (int8 codes), by which
  # its cache entries are keyed.
  held_slots = (mosaic_slot_dtypes if low_precision
                and mosaic_slot_dtypes is not None else slot_dtypes)

  def triton_default():
    # The Triton kernel's tiling for the case: a stored G's epilogue-only
    # default, else the tuned or heuristic one.
    if g_stored:
      return BlockConfig.stored_default(n_in, n_out)
    return select_config(bt, n_in, n_out, w_dtype, slot_dtypes, rule,
                         interpret=interpret)

  if backend is not None:
    how = f"backend={backend!r} was passed"
  elif config is not None:
    backend = MOSAIC_GPU if isinstance(config, MosaicConfig) else TRITON
    how = f"config is a {type(config).__name__}"
  else:
    backend = env_backend()
    how = f"${BACKEND_ENV_VAR}={backend}"
  if backend == TRITON:
    if isinstance(config, MosaicConfig):
      raise TypeError(
          f"{where}(backend='triton'): config must be a BlockConfig (a "
          f"Triton tiling), got a MosaicConfig ({config.label}); pass "
          "backend='mosaic_gpu' for it, or leave backend=None (a config "
          "picks its own backend)")
    return BackendChoice(TRITON, config or triton_default(), how)
  if backend == MOSAIC_GPU:
    if isinstance(config, BlockConfig):
      raise TypeError(
          f"{where}(backend='mosaic_gpu'): config must be a MosaicConfig (a "
          f"Mosaic GPU tiling), got a BlockConfig ({config_label(config)}); "
          "pass backend='triton' for it, or leave backend=None (a config "
          "picks its own backend)")
    if config is not None:
      return BackendChoice(MOSAIC_GPU, config, how)
    # (Low-precision state: an entry measured with it, else the int8
    # default; in interpret mode, the default.)
    cfg, source = mosaic_tiling(
        bt, n_in, n_out, w_dtype, held_slots, rule, x_dtype,
        stacked=stacked, g_stored=g_stored, low_precision=low_precision,
        cached=not (interpret or (low_precision
                                  and mosaic_slot_dtypes is None)))
    return BackendChoice(MOSAIC_GPU, cfg, f"{how}; {source}")
  # No backend asked for: the faster for the case, as far as it is known.
  triton = lambda why: BackendChoice(TRITON, triton_default(), why)
  if low_precision and mosaic_slot_dtypes is None:
    return triton(lowp.MOSAIC_REFUSAL)
  if interpret:
    return triton("interpret mode: the Mosaic GPU kernel is chosen only when "
                  "compiled for a GPU")
  if varying:
    return triton("inside shard_map: the Mosaic GPU kernel cannot take state "
                  "that varies over a mesh axis")
  capability = compute_capability()
  if capability is None:
    return triton("no NVIDIA GPU that reports its compute capability")
  if capability < MOSAIC_MIN_CAPABILITY:
    return triton(f"the GPU's compute capability is "
                  f"{capability[0]}.{capability[1]}; the Mosaic GPU kernel "
                  "needs 9.0 or newer (Hopper)")
  if g_stored:
    return triton("a stored gradient: the autotune cache has no Mosaic GPU "
                  "measurements for it")
  if bt < 1:
    return triton("no tokens")
  entry = lookup_mosaic(bt, n_in, n_out, w_dtype, held_slots, rule)
  kind = current_device_kind()
  if entry is None:
    near = nearest_covering(bt, n_in, n_out, w_dtype, held_slots, rule,
                            x_dtype, stacked=stacked,
                            low_precision=low_precision)
    if near is None:
      return triton(f"the autotune cache has no Mosaic GPU entry for this "
                    f"case on {kind}, nor one for another BT or shape whose "
                    "tiling covers it")
    key, entry = near
    return BackendChoice(
        MOSAIC_GPU, entry.config,
        f"the autotune cache has no Mosaic GPU entry for this case on "
        f"{kind}; its nearest entry that covers it, {key}, has the tiling "
        f"{entry.config.label}, which measured {_us(entry.time_us)} against "
        f"the Triton kernel's {_us(entry.triton_time_us)} there")
  label = entry.config.label
  if not entry.faster_than_triton:
    return triton(f"the autotune cache's Mosaic GPU tiling {label} measured "
                  f"{_us(entry.time_us)} against the Triton kernel's "
                  f"{_us(entry.triton_time_us)} on {kind}")
  why = _mosaic_refusal(entry.config, bt, n_in, n_out, w_dtype, held_slots,
                        rule, x_dtype, stacked, g_stored, low_precision)
  if why is not None:
    return triton(f"the autotune cache's Mosaic GPU tiling {label} does not "
                  f"cover this case: {why}")
  return BackendChoice(
      MOSAIC_GPU, entry.config,
      f"the autotune cache's Mosaic GPU tiling {label} measured "
      f"{_us(entry.time_us)} against the Triton kernel's "
      f"{_us(entry.triton_time_us)} on {kind}")


def _us(t: float | None) -> str:
  return "an unrecorded time" if t is None else f"{t:.1f} us"


def _mosaic_refusal(cfg, bt, n_in, n_out, w_dtype, slot_dtypes, rule,
                    x_dtype, stacked, g_stored, low_precision=False
                    ) -> str | None:
  """Why the Mosaic GPU kernel with tiling ``cfg`` does not cover the case
  (with ``low_precision``, int8 moments' needs too), or ``None``."""
  w, slots = _mosaic_shapes(n_in, n_out, w_dtype, slot_dtypes)
  why = mosaic_kernel.unsupported(bt, n_in, n_out, dtype_name(x_dtype), w,
                                  slots, rule, cfg, stacked=stacked,
                                  g_stored=g_stored)
  if why is None and low_precision:
    why = mosaic_kernel.int8_tiling_problem(cfg)
  return why


def mosaic_tiling(bt, n_in, n_out, w_dtype, slot_dtypes, rule, x_dtype, *,
                  stacked: bool = False, g_stored: bool = False,
                  low_precision: bool = False, cached: bool = True,
                  device_kind: str | None = None
                  ) -> tuple[MosaicConfig, str]:
  """The Mosaic GPU tiling a case takes when the kernel is asked for by
  name without a tiling (``backend="mosaic_gpu"``; ``forge_torch``'s direct
  launch), and where it comes from, in words: the autotune cache's entry
  for the case where its tiling covers it, else the nearest entry's
  (:func:`nearest_covering`), else the kernel's default tiling for the
  case (``cached=False`` or a stored gradient: the default)."""
  if cached and not g_stored:
    entry = lookup_mosaic(bt, n_in, n_out, w_dtype, slot_dtypes, rule,
                          device_kind=device_kind)
    if entry is not None and _mosaic_refusal(
        entry.config, bt, n_in, n_out, w_dtype, slot_dtypes, rule, x_dtype,
        stacked, False, low_precision) is None:
      return entry.config, "the autotune cache's tiling"
    near = nearest_covering(bt, n_in, n_out, w_dtype, slot_dtypes, rule,
                            x_dtype, stacked=stacked,
                            low_precision=low_precision,
                            device_kind=device_kind)
    if near is not None:
      return (near[1].config,
              f"the tiling of the autotune cache's nearest entry, {near[0]}")
  return (_mosaic_default(bt, n_in, n_out, w_dtype, slot_dtypes, rule,
                          x_dtype, g_stored, low_precision),
          "the default tiling for the case")


def nearest_covering(bt, n_in, n_out, w_dtype, slot_dtypes, rule, x_dtype, *,
                     stacked: bool = False, low_precision: bool = False,
                     device_kind: str | None = None
                     ) -> tuple[str, MosaicEntry] | None:
  """The first of :func:`nearest_mosaic`'s entries that measured faster
  than the Triton kernel and whose tiling covers this case (with
  ``low_precision``, int8 moments' too), reaching past the weight's edges
  by at most ``mosaic_kernel.MAX_OVERREACH`` of it (a tiling measured on
  another shape), as ``(key, entry)``; ``None`` if none does."""
  for key, entry in nearest_mosaic(bt, n_in, n_out, w_dtype, slot_dtypes,
                                   rule, device_kind=device_kind):
    cfg = entry.config
    if mosaic_kernel.overreach(n_in, n_out, cfg.tile_m, cfg.tile_n) > (
        mosaic_kernel.MAX_OVERREACH):
      continue
    if entry.faster_than_triton and _mosaic_refusal(
        entry.config, bt, n_in, n_out, w_dtype, slot_dtypes, rule, x_dtype,
        stacked, False, low_precision) is None:
      return key, entry
  return None
