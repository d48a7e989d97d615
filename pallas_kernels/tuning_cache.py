"""The cache of tuned tilings, and the tiling a kernel takes when given none.

``tuned_configs.json`` ships beside this module, keyed by device kind
(``jax.devices()[0].device_kind``, e.g. ``"NVIDIA H200"``) and then by
:func:`cache_key` ``(rule, BT bucket, in, out, w dtype, slot dtypes)``.
``$FORGE_AUTOTUNE_CACHE`` names another file of the same form (e.g. a
re-tuned one) that is consulted first. :func:`lookup` returns the cached
:class:`~pallas_kernels.tiling.BlockConfig` or ``None``;
:func:`select_config` is the tiling ``fused_wgrad_update`` takes without a
``config``. The tuner that writes the cache is
:mod:`pallas_kernels.autotune`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.interpret import default_interpret
from pallas_kernels.tiling import BlockConfig, next_pow2

SHIPPED_CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             "tuned_configs.json")
ENV_VAR = "FORGE_AUTOTUNE_CACHE"
FORMAT_VERSION = 1
ANY_RULE = "any"

__all__ = ["ANY_RULE", "ENV_VAR", "FORMAT_VERSION", "SHIPPED_CACHE",
           "bt_bucket", "cache_key", "cache_paths", "clear_cache", "config_label",
           "current_device_kind", "describe", "dtype_name", "load", "lookup",
           "parse_label", "read_json", "select_config", "validated"]

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
  slots = ",".join(dtype_name(d) for d in slot_dtypes)
  return (f"{_rule_name(rule)}|bt{bt_bucket(bt)}|{int(n_in)}x{int(n_out)}|"
          f"w={dtype_name(w_dtype)}|slots={slots}")


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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{describe(path)}: not a valid JSON file ({e}); "
                       "not a forge autotune cache") from None


def load(path: str) -> dict:
  """The parsed cache file at ``path`` (memoised; validates every entry)."""
  path = os.path.abspath(path)
  if path not in _parsed:
    _parsed[path] = validated(read_json(path), describe(path))
  return _parsed[path]


def validated(data: dict, where: str) -> dict:
  """The parsed form of a cache file's ``data``: ``{"data": data,
  "configs": {(device kind, key): BlockConfig}}``.

  Raises:
    ValueError: naming ``where``, when ``data`` is not a valid cache.
  """
  if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
    raise ValueError(f"{where}: not a format-{FORMAT_VERSION} forge autotune "
                     "cache (a JSON object with \"format\": 1)")
  devices = data.get("devices", {})
  if not isinstance(devices, dict):
    raise ValueError(f"{where}: \"devices\" must be an object (device kind "
                     f"-> entries), got {type(devices).__name__}")
  configs = {}
  for kind, dev in devices.items():
    entries = dev.get("entries", {}) if isinstance(dev, dict) else None
    sources = dev.get("sources", {}) if isinstance(dev, dict) else None
    if not isinstance(entries, dict) or not isinstance(sources, dict):
      raise ValueError(
          f"{where}: devices[{kind!r}] must be an object whose \"entries\" and "
          "\"sources\" are objects")
    for key, entry in entries.items():
      try:
        configs[(kind, key)] = BlockConfig(**entry["config"])
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad entry {kind!r} / {key!r}: {e}") from e
  return {"data": data, "configs": configs}


def cache_paths() -> list[str]:
  """The files :func:`lookup` consults, first match wins: the one named by
  ``$FORGE_AUTOTUNE_CACHE`` (if set), then the shipped one."""
  paths = []
  env = os.environ.get(ENV_VAR)
  if env:
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
  ``tuned_as``) that rule's entry, then an ``"any"``-rule entry, in each
  file of ``paths`` (default :func:`cache_paths`). ``device_kind=None``
  means the current device, and on a CPU (or anything but a GPU) nothing
  matches.
  """
  if device_kind is None:
    device_kind = current_device_kind()
    if device_kind is None:
      return None
  keys = [cache_key(rule, bt, n_in, n_out, w_dtype, slot_dtypes)]
  tuned_as = getattr(rule, "tuned_as", None)
  if tuned_as is not None:
    keys.append(cache_key(tuned_as, bt, n_in, n_out, w_dtype, slot_dtypes))
  if _rule_name(rule) != ANY_RULE:
    keys.append(cache_key(None, bt, n_in, n_out, w_dtype, slot_dtypes))
  for path in (cache_paths() if paths is None else paths):
    configs = load(path)["configs"]
    for key in keys:
      cfg = configs.get((device_kind, key))
      if cfg is not None:
        return cfg
  return None


def current_device_kind() -> str | None:
  """``jax.devices()[0].device_kind`` when the default backend is a GPU, else
  ``None`` (tuned entries are for GPUs; CPU/interpret uses the heuristic)."""
  if jax.default_backend() != "gpu":
    return None
  return jax.devices()[0].device_kind


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
  if interpret is None:
    interpret = default_interpret()
  if not interpret:
    cfg = lookup(bt, n_in, n_out, w_dtype, slot_dtypes, rule)
    if cfg is not None:
      return cfg
    return BlockConfig.compiled_default(bt, n_in, n_out, w_dtype)
  return BlockConfig.default(bt, n_in, n_out)
