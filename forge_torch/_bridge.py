"""DLPack bridge: runs ``pallas_kernels.fused_wgrad_update`` on torch tensors.

torch and JAX share the tensors through DLPack, never through host memory.
On the GPU the jitted call donates the weight and its slots, which the kernel
aliases to its outputs: it writes the torch tensors' own memory (a
:class:`ViewCache` keeps those views for the next call). An output that does
not alias is copied back with ``tensor.copy_`` and counted in :data:`STATS`;
on the CPU (Pallas interpret mode) every result is copied back.

:func:`set_sync_mode` orders the kernel with torch's current CUDA stream:
``"stream"`` through DLPack's stream handshake, GPU-side, or ``"host"``
through host synchronisations (default: ``$FORGE_TORCH_SYNC``, else
``"stream"``); where stream ordering is unavailable the bridge warns once and
uses host mode. ``docs/torch.md`` explains both modes and their sources.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import os
import threading
import warnings
from typing import Sequence

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
import torch

import pallas_kernels
from forge_torch import _direct
from forge_torch import _hot
from pallas_kernels import mosaic_kernel, torch_rules, tuning_cache
from pallas_kernels.quant import Quantized
from pallas_kernels.rules import UpdateRule

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Codes of a quantized slot (pallas_kernels.quant): torch dtype -> JAX dtype.
# float8 codes cross DLPack as their uint8 bit pattern (not every torch /
# JAX pair exchanges float8 through DLPack) and are bitcast inside the call.
CODE_DTYPES = {torch.int8: jnp.dtype(jnp.int8),
               torch.float8_e4m3fn: jnp.dtype(jnp.float8_e4m3fn),
               torch.float8_e5m2: jnp.dtype(jnp.float8_e5m2)}


# --------------------------------------------------------------------------
# Sync mode.
# --------------------------------------------------------------------------

SYNC_MODES = ("stream", "host")
SYNC_ENV = "FORGE_TORCH_SYNC"


def _check_mode(mode, source: str) -> str:
  if not isinstance(mode, str) or mode not in SYNC_MODES:
    choices = ", ".join(map(repr, SYNC_MODES))
    raise ValueError(
        f"forge_torch: {source} must be one of {choices} (GPU-side stream "
        f"ordering, or host synchronisations around each fused update); got "
        f"{mode!r}")
  return mode


def _mode_from_env() -> str:
  value = os.environ.get(SYNC_ENV, "").strip().lower()
  return _check_mode(value, f"${SYNC_ENV}") if value else "stream"


_SYNC_MODE = _mode_from_env()
# Why stream mode is unavailable in this process (then host mode is used), or
# None. Set once, by the first CUDA call that finds a piece missing.
_STREAM_FALLBACK: str | None = None


def set_sync_mode(mode: str) -> str:
  """How the bridge orders the fused kernel with torch's CUDA stream.

  Args:
    mode: ``"stream"`` (the default): GPU-side ordering through DLPack's
      stream handshake, no host synchronisation; ``"host"``: synchronise
      torch's current stream before and JAX's results after each fused update
      that goes through DLPack (the original, simplest behaviour). A direct
      launch (:func:`forge_torch.set_direct_launch`) is ordered on torch's
      current stream in either mode. See :mod:`forge_torch._bridge`.
      The process default comes from ``$FORGE_TORCH_SYNC`` (read at import).

  Returns:
    The previous mode.

  Raises:
    ValueError: ``mode`` is not one of :data:`SYNC_MODES`.
  """
  global _SYNC_MODE
  _check_mode(mode, "the sync mode")
  with _LOCK:
    previous, _SYNC_MODE = _SYNC_MODE, mode
  return previous


def get_sync_mode(effective: bool = False) -> str:
  """The sync mode set (``effective=True``: the one CUDA calls through
  DLPack use, i.e. ``"host"`` if stream mode was requested but is
  unavailable here)."""
  if effective and _SYNC_MODE == "stream" and _STREAM_FALLBACK is not None:
    return "host"
  return _SYNC_MODE


def _stream_unavailable(reason: str) -> None:
  global _STREAM_FALLBACK
  with _LOCK:
    first = _STREAM_FALLBACK is None
    if first:
      _STREAM_FALLBACK = reason
  if first:
    warnings.warn(
        f"forge_torch: stream-ordered sync is unavailable ({reason}); the "
        "bridge synchronises the host around each fused update instead "
        "(sync mode 'host')", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _tfrt_gpu_client() -> bool:
  """Whether JAX's GPU client is the TFRT one (``jaxlib/xla_client.py`` reads
  this variable when it creates the client)."""
  value = os.environ.get("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", "0").strip()
  try:
    return bool(int(value))
  except ValueError:
    return value.lower() in ("true", "yes")


_DEVICE_STREAM_OK: dict = {}


def _device_has_ready_stream(device) -> bool:
  """Whether ``jax.dlpack.from_dlpack`` orders imports on ``device`` (it
  passes this stream to torch, and None -- no ordering -- when it fails)."""
  ok = _DEVICE_STREAM_OK.get(device)
  if ok is None:
    try:
      ok = bool(device.get_stream_for_external_ready_events())
    except Exception:  # noqa: BLE001 -- jaxlib raises its own error types
      ok = False
    _DEVICE_STREAM_OK[device] = ok
  return ok


def _torch_stream_handle(stream: torch.cuda.Stream) -> int:
  """``stream`` for ``__dlpack__(stream=...)`` (the DLPack convention: ``1``
  for CUDA's legacy default stream, whose handle is 0)."""
  handle = stream.cuda_stream
  return 1 if handle == 0 else handle


# --------------------------------------------------------------------------
# DLPack and the cached JAX call.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class BridgeStats:
  """Counters of the bridge (per state tensor: the weight and each rule slot).

  Attributes:
    calls: fused updates run.
    in_place: tensors the kernel wrote in place (JAX output aliases torch).
    copied: tensors copied back from a fresh JAX buffer (always on CPU; on
      the GPU only if XLA declined a donation).
    not_donated_warnings: JAX "donated buffers were not usable" warnings seen.
    donation_errors: donated calls JAX rejected (the bridge then stops
      donating for the rest of the process and copies back).
    direct: of ``calls``, those that launched the Mosaic GPU kernel
      directly on the torch tensors (:mod:`forge_torch._direct`); the others
      went through DLPack and JAX.
    direct_unavailable: why no call launches directly in this process
      (``None`` while direct launches are possible; they also need a Hopper
      GPU and a case the Mosaic GPU kernel covers, see ``docs/torch.md``).
    native: of ``direct``, those launched by the native host path (an
      update repeating its plan, checked and launched in C++:
      :mod:`forge_torch._hot`); the others ran their host work in Python.
    native_unavailable: why updates do not take the native host path
      (``None`` while they can: built, and on).
  """

  calls: int = 0
  in_place: int = 0
  copied: int = 0
  not_donated_warnings: int = 0
  donation_errors: int = 0
  direct: int = 0
  native: int = 0

  @property
  def direct_unavailable(self) -> str | None:
    return _direct.unavailable()

  @property
  def native_unavailable(self) -> str | None:
    return _hot.unavailable()

  def reset(self) -> None:
    self.calls = self.in_place = self.copied = 0
    self.not_donated_warnings = self.donation_errors = 0
    self.direct = self.native = 0


STATS = BridgeStats()
_LOCK = threading.Lock()
# Per thread, while a staged update runs (fused_update): the addresses of
# the tensors its kernel call wrote in place, so that those of its aligned
# copies count as copied back instead. ``None`` otherwise.
_WRITTEN_IN_PLACE = threading.local()
_DONATION_BROKEN = False
_NOT_DONATED = "donated buffers were not usable"


def _contiguous(t: torch.Tensor) -> torch.Tensor:
  t = t.detach()
  return t if t.is_contiguous() else t.contiguous()


def _to_jax(t: torch.Tensor) -> jax.Array:
  """A zero-copy JAX view of a contiguous, detached torch tensor."""
  try:
    return jax.dlpack.from_dlpack(t)
  except RuntimeError as e:  # jaxlib raises XlaRuntimeError, a RuntimeError
    if t.is_cuda:
      raise RuntimeError(
          "forge_torch could not hand a CUDA tensor to JAX through DLPack "
          f"({e}). Does this JAX install have its CUDA backend "
          "(`jax.devices()` should list GPUs)?") from e
    # CPU: e.g. an unaligned view; a fresh allocation is aligned (and CPU
    # work is synchronous, so the clone's lifetime needs no care).
    return jax.dlpack.from_dlpack(t.clone())


class _Jitted:
  """A jitted fused update and whether it has been called (compiled) yet."""

  __slots__ = ("fn", "warm")

  def __init__(self, fn):
    self.fn = fn
    self.warm = False


def _low_precision_fn(rule: UpdateRule, config, interpret: bool,
                      layout: tuple, sr: bool):
  """The fused update on flat slot arrays: per slot of ``layout``, ``None``
  (one float array) or the codes' JAX dtype name (two arrays, codes --
  float8 ones as their uint8 bits -- and scales, passed to the kernel as a
  ``Quantized`` pair); ``sr``: an extra ``uint32[2]`` argument holds the
  stochastic-rounding ``(seed, step)``. Returns the flat slots likewise."""

  def fn(x, dy, w, flat, hparams, seed_step=None):
    slots, i = [], 0
    for kind in layout:
      if kind is None:
        slots.append(flat[i])
        i += 1
        continue
      q, scale = flat[i], flat[i + 1]
      i += 2
      if q.dtype != jnp.dtype(kind):
        q = lax.bitcast_convert_type(q, jnp.dtype(kind))
      slots.append(Quantized(q, scale))
    w_new, new = pallas_kernels.fused_wgrad_update(
        x, dy, w, tuple(slots), hparams, rule=rule, config=config,
        interpret=interpret,
        stochastic_rounding=(seed_step[0], seed_step[1]) if sr else None)
    out = []
    for s in new:
      if isinstance(s, Quantized):
        q = s.q
        if q.dtype != jnp.int8:
          q = lax.bitcast_convert_type(q, jnp.uint8)
        out += [q, s.scale]
      else:
        out.append(s)
    return w_new, tuple(out)

  return fn


@functools.lru_cache(maxsize=None)
def _jitted(key, rule: UpdateRule, config, interpret: bool,
            donate: bool, layout: tuple | None = None,
            sr: bool = False) -> _Jitted:
  """One jitted fused update per (device, shapes, dtypes, rule, config);
  ``layout``, ``sr``: quantized slots and stochastic rounding
  (:func:`_low_precision_fn`)."""
  del key  # part of the cache key only; jit specialises on it as well
  if layout is not None:
    return _Jitted(jax.jit(
        _low_precision_fn(rule, config, interpret, layout, sr),
        donate_argnums=(2, 3) if donate else ()))
  fn = functools.partial(pallas_kernels.fused_wgrad_update, rule=rule,
                         config=config, interpret=interpret)
  if not rule.updates_weight:
    # A state-only rule (gradient accumulation's) reads no weight and
    # writes none: only the slots are donated and returned.
    update = fn
    fn = lambda x, dy, w, slots, hparams: (  # noqa: E731
        None, update(x, dy, w, slots, hparams)[1])
    return _Jitted(jax.jit(fn, donate_argnums=(3,) if donate else ()))
  return _Jitted(jax.jit(fn, donate_argnums=(2, 3) if donate else ()))


def _entry(key, rule, config, interpret, donate, layout, sr) -> _Jitted:
  """:func:`_jitted`'s entry; the low-precision arguments only where set."""
  if layout is None:
    return _jitted(key, rule, config, interpret, donate)
  return _jitted(key, rule, config, interpret, donate, layout, sr)


def _run(entry: _Jitted, args) -> tuple:
  """``entry.fn(*args)``; JAX's "donated buffers were not usable" warning is
  counted (and swallowed) on the first call, the one that lowers and compiles
  (JAX warns at lowering, ``jax/_src/interpreters/mlir.py``); later calls hit
  jit's cache and skip the warnings bookkeeping."""
  if entry.warm:
    return entry.fn(*args)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = entry.fn(*args)
  entry.warm = True
  not_donated = 0
  for c in caught:
    if _NOT_DONATED in str(c.message):
      not_donated += 1
    else:
      warnings.warn_explicit(c.message, c.category, c.filename, c.lineno)
  if not_donated:
    with _LOCK:
      STATS.not_donated_warnings += not_donated
  return out


# Device copies of packed hparams vectors: every managed layer of one param
# group gets the same vector in a step, so one host-to-device transfer serves
# them all. JAX arrays are immutable; keyed by the exact bytes.
_HPARAMS: dict = {}
_HPARAMS_MAX = 256


def _device_hparams(hparams, device) -> jax.Array:
  if isinstance(hparams, jax.Array):
    return hparams
  vec = np.ascontiguousarray(hparams, dtype=np.float32)
  key = (device, vec.shape, vec.tobytes())
  hit = _HPARAMS.get(key)
  if hit is None:
    hit = jax.device_put(vec, device)
    with _LOCK:
      if len(_HPARAMS) >= _HPARAMS_MAX:
        _HPARAMS.pop(next(iter(_HPARAMS)))
      _HPARAMS[key] = hit
  return hit


# Whether fused_update reuses a ViewCache's views ("0" in $FORGE_TORCH_VIEWS
# turns it off, to measure or rule out the reuse; read at import).
REUSE_VIEWS = os.environ.get("FORGE_TORCH_VIEWS", "1").strip() != "0"


class ViewCache:
  """JAX views of one weight's state tensors that the kernel updated in place.

  On CUDA a donated call returns JAX arrays that alias the torch tensors'
  memory (the weight and its optimizer state). Passing those arrays back as
  the next call's inputs skips their DLPack imports, most of the bridge's
  host time per call (``docs/torch.md``, Streams). ``x`` and ``dy`` are still
  imported fresh on every call; their imports order the kernel after all
  torch work queued before the call, including reads and writes of the
  weight. A view is reused only while it is alive and still points at the
  tensor's current memory (``data_ptr``, shape, dtype, device); anything else
  is imported again. Each call replaces the whole set, so a cache holds at
  most one view per state tensor of one weight. ``forge_torch``'s optimizers
  keep one per managed weight, weakly keyed by the parameter, so the views
  (which keep the storage they alias alive) last no longer than the
  parameter or the optimizer. Copies and pickles of a cache are empty.
  """

  __slots__ = ("_views", "hits", "misses")

  def __init__(self):
    self._views: dict = {}
    self.hits = self.misses = 0

  @staticmethod
  def _key(t: torch.Tensor):
    return (t.data_ptr(), tuple(t.shape), t.dtype, t.device)

  def get(self, t: torch.Tensor) -> jax.Array | None:
    """The live view of ``t``'s current memory, or None."""
    a = self._views.get(self._key(t))
    if a is not None and (a.is_deleted()
                          or a.unsafe_buffer_pointer() != t.data_ptr()):
      a = None
    if a is None:
      self.misses += 1
    else:
      self.hits += 1
    return a

  def replace(self, pairs) -> None:
    """Keep exactly these ``(tensor, view)`` pairs (the last call's)."""
    self._views = {self._key(t): a for t, a in pairs}

  def clear(self) -> None:
    self._views = {}

  def discard(self, t: torch.Tensor) -> None:
    """Drops the view of ``t``, so that it no longer keeps ``t``'s memory
    alive (a buffer about to be freed)."""
    self._views.pop(self._key(t), None)

  def __len__(self) -> int:
    return len(self._views)

  def __deepcopy__(self, memo):
    return ViewCache()

  def __reduce__(self):
    return (ViewCache, ())


def fused_update(x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor,
                 slots: Sequence[torch.Tensor | Quantized], hparams, *,
                 rule: UpdateRule = torch_rules.adam_rule(amsgrad=False),
                 config: pallas_kernels.BlockConfig | None = None,
                 views: ViewCache | None = None,
                 stochastic_rounding: tuple[int, int] | None = None) -> bool:
  """``w, slots <- rule(w, slots, G = x^T dy)`` on torch tensors, in place.

  Args:
    x: ``(BT, n_in)`` torch tensor (for a torch ``Linear``: ``grad_output``).
    dy: ``(BT, n_out)`` (for a torch ``Linear``: the layer input). ``x``
      and ``dy`` may be bfloat16 beside a float32 ``w`` and slots
      (``torch.autocast``): ``G`` is accumulated in fp32 either way.
    w: ``(n_in, n_out)`` weight, updated in place (for a torch ``Linear``:
      ``weight`` ``(out, in)`` itself, so ``G`` is torch's own weight grad);
      only read for its shape by a rule with ``updates_weight=False``.
    slots: the rule's state tensors, ``w``'s shape, updated in place; a
      quantized slot (``pallas_kernels.quant``) is a
      ``pallas_kernels.quant.Quantized(q, scale)`` pair of torch tensors:
      codes ``q`` of ``w``'s shape (int8, float8_e4m3fn or float8_e5m2)
      and float32 ``scale`` ``(n_in, ceil(n_out / 64))``, one per 64
      consecutive elements of a row of ``w`` (for a torch ``Linear``: along
      its ``in`` dimension). Quantized slots run through DLPack on the
      kernel the backend choice takes (never a direct launch).
    hparams: the rule's packed fp32 vector (numpy, or a JAX array on the
      tensors' device); inside CUDA-graph capture, a float32 CUDA tensor on
      ``w``'s device that the captured work fills (the kernel reads it at
      each replay).
    rule, config: the kernel's update rule and tiling.
    views: this weight's :class:`ViewCache` (CUDA): the state's JAX views
      from the last in-place call are reused instead of imported again, and
      this call's are kept. None: import every tensor (the default).
    stochastic_rounding: ``None`` (round to nearest), or ``(seed, step)``,
      integers: a bfloat16 ``w`` is stored by stochastic rounding
      (``pallas_kernels.quant.stochastic_round_to_bf16``) with these.

  On CUDA the kernel is ordered with torch's current stream as the sync mode
  says (:func:`set_sync_mode`): either way, work torch queued on that stream
  before this call runs before the kernel, and work queued after it runs
  after the kernel.

  Returns:
    ``True`` if every state tensor the rule writes was written in place by
    the kernel, ``False`` if any had to be copied back.
  """
  if not _plain_and_valid(x, dy, w, slots):
    # Quantized slots, or a check below fails: each one, in order.
    floats = [s for s in slots if not isinstance(s, Quantized)]
    for name, t in (("x", x), ("dy", dy), ("w", w),
                    *((f"slot {i}", s) for i, s in enumerate(floats))):
      # JAX would import float64 as float32 (x64 off) and the result would
      # be copied back: fp32 arithmetic on float64 tensors, silently.
      check_dtype(t, f"fused_update's {name}")
    for i, s in enumerate(slots):
      if isinstance(s, Quantized):
        _check_quantized(s, w, f"fused_update's slot {i}")
    for t in (w, *_flat_slots(slots)):
      if not t.is_contiguous():
        raise ValueError("forge_torch: weight and optimizer state must be "
                         "contiguous to be updated in place")
  if stochastic_rounding is not None:
    seed, step = stochastic_rounding
    stochastic_rounding = (int(seed) % 2**32, int(step) % 2**32)
  staged = _aligned_stand_ins(x, dy, w, slots)
  if staged is not None:
    # An operand at an address the kernel's TMA copies cannot take: the
    # update runs on aligned copies, and the tensors it writes are copied
    # back, on torch's current stream. The weight's cached JAX views (of
    # memory this call does not use) are dropped: they would keep it alive.
    if views is not None:
      views.clear()
    x_run, dy_run, w_run, slots_run = staged
    written = [*zip(_flat_slots(slots), _flat_slots(slots_run))]
    if rule.updates_weight:
      written.append((w, w_run))
    written = [(dst, src) for dst, src in written
               if src.data_ptr() != dst.data_ptr()]
    _WRITTEN_IN_PLACE.ptrs = logged = set()
    try:
      ok = _update_on_device(x_run, dy_run, w_run, slots_run, hparams, rule,
                             config, None, stochastic_rounding)
    finally:
      _WRITTEN_IN_PLACE.ptrs = None
    with torch.no_grad():
      for dst, src in written:
        dst.copy_(src)
    # A copy the kernel wrote in place was copied back all the same.
    moved = sum(src.data_ptr() in logged for _, src in written)
    with _LOCK:
      STATS.in_place -= moved
      STATS.copied += moved
    return ok and not written
  return _update_on_device(x, dy, w, slots, hparams, rule, config, views,
                           stochastic_rounding)


def _update_on_device(x, dy, w, slots, hparams, rule, config, views,
                      stochastic_rounding) -> bool:
  if w.is_cuda and w.device.index != torch.cuda.current_device():
    # torch's __dlpack__ exports only tensors of the current device, and
    # orders them with that device's current stream.
    with torch.cuda.device(w.device):
      return _fused_update(x, dy, w, slots, hparams, rule, config, views,
                           stochastic_rounding)
  return _fused_update(x, dy, w, slots, hparams, rule, config, views,
                       stochastic_rounding)


def _misaligned(t: torch.Tensor) -> bool:
  """Whether ``t``'s data is not at a 16-byte aligned address (a view at an
  odd offset into a flat buffer); an empty tensor never is."""
  return bool(t.data_ptr() & 15) and t.numel() > 0


def _aligned_stand_ins(x, dy, w, slots):
  """``None`` where every plain operand is at a 16-byte aligned address
  (the usual case: torch's allocators align every block); else the
  operands ``(x, dy, w, slots)`` with each misaligned one replaced by an
  aligned contiguous copy. The Mosaic GPU kernel's TMA copies cannot take
  a misaligned address (a CUDA error that ends the process's use of the
  GPU), launched directly or through DLPack alike; a quantized slot's
  codes and scales are replaced alike."""
  if not any(map(_misaligned, (x, dy, w, *_flat_slots(slots)))):
    return None

  def aligned(t):
    if isinstance(t, Quantized):
      return Quantized(aligned(t.q), aligned(t.scale))
    if not _misaligned(t):
      return t
    return t.clone(memory_format=torch.contiguous_format)

  return aligned(x), aligned(dy), aligned(w), [aligned(s) for s in slots]


def _plain_and_valid(x, dy, w, slots) -> bool:
  """Whether every slot is a plain tensor and :func:`fused_update`'s checks
  all pass (the usual case, told without forming their messages)."""
  if x.dtype not in SUPPORTED_DTYPES or dy.dtype not in SUPPORTED_DTYPES or (
      w.dtype not in SUPPORTED_DTYPES or not w.is_contiguous()):
    return False
  for s in slots:
    if not isinstance(s, torch.Tensor) or (
        s.dtype not in SUPPORTED_DTYPES or not s.is_contiguous()):
      return False
  return True


def _check_quantized(s: Quantized, w: torch.Tensor, what: str) -> None:
  """A quantized slot's codes and scales fit weight ``w`` (kernel layout)."""
  q, scale = s
  n_in, n_out = w.shape[-2:]
  want = (*w.shape[:-1], -(-n_out // 64))
  if (not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor)
      or q.dtype not in CODE_DTYPES or tuple(q.shape) != tuple(w.shape)
      or scale.dtype != torch.float32 or tuple(scale.shape) != want
      or q.device != w.device or scale.device != w.device):
    raise TypeError(
        f"forge_torch: {what} is a quantized moment whose codes are "
        f"{getattr(q, 'dtype', type(q))}{list(getattr(q, 'shape', ()))} and "
        f"scales {getattr(scale, 'dtype', type(scale))}"
        f"{list(getattr(scale, 'shape', ()))}; for a weight "
        f"{list(w.shape)} on {w.device} they must be int8, float8_e4m3fn or "
        f"float8_e5m2 codes of the weight's shape and float32 scales "
        f"{list(want)} (one per 64 elements of a row), on its device")


def _flat_slots(slots) -> list[torch.Tensor]:
  """The slots' tensors, a quantized slot as its codes then its scales
  (float8 codes as their uint8 bits: what crosses DLPack)."""
  flat = []
  for s in slots:
    if isinstance(s, Quantized):
      q = s.q if s.q.dtype == torch.int8 else s.q.view(torch.uint8)
      flat += [q, s.scale]
    else:
      flat.append(s)
  return flat


# --------------------------------------------------------------------------
# Direct launch (Hopper): the Mosaic GPU kernel on the torch tensors.
# --------------------------------------------------------------------------

def _direct_config(bt, n_in, n_out, x_dtype, w, slots, rule, config, device):
  """The Mosaic GPU tiling a direct launch takes for this case, or ``None``.

  Without a tiling from the caller, Mosaic GPU where it covers the case on
  a GPU of compute capability 9.0 or newer, with the tiling
  ``backend="mosaic_gpu"`` takes in JAX
  (:func:`pallas_kernels.tuning_cache.mosaic_tiling`: the cached tiling for
  the case, else the nearest cached entry's that covers it, else the
  default one). Unlike in JAX (where the backend follows the
  autotune cache's kernel times), a torch call prefers it whenever it
  applies, because launching it directly saves more host time per call than
  the two kernels' times differ by. A Triton tiling (``config``) or
  ``$FORGE_BACKEND=triton`` keeps the DLPack path. Called once per case
  (:func:`_resolve`; the fast path caches the result)."""
  cfg = None
  env = tuning_cache.env_backend()
  xd = _direct.jnp_dtype(x_dtype)
  state = [jax.ShapeDtypeStruct(tuple(t.shape), _direct.jnp_dtype(t.dtype))
           for t in (w, *slots)]
  if (isinstance(config, (mosaic_kernel.MosaicConfig, type(None)))
      and env in (None, tuning_cache.MOSAIC_GPU)
      and torch.cuda.get_device_capability(device) >= (9, 0)
      and xd is not None and None not in [s.dtype for s in state]):
    cfg = config
    if cfg is None:  # as JAX's backend="mosaic_gpu" takes it
      cfg, _ = tuning_cache.mosaic_tiling(
          bt, n_in, n_out, state[0].dtype, [s.dtype for s in state[1:]],
          rule, xd, device_kind=torch.cuda.get_device_name(device))
    if mosaic_kernel.unsupported(bt, n_in, n_out, xd, state[0], state[1:],
                                 rule, cfg, stacked=False, g_stored=False):
      cfg = None
  return cfg


def _raw_stream(device_index: int) -> int:
  """torch's current CUDA stream on ``device_index``, as its raw handle."""
  return torch.cuda.current_stream(device_index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):
  # The same, without making a Stream object (a few microseconds per call).
  _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811


class _HparamsRing:
  """Hyperparameter vectors for direct launches on one device and stream,
  in a ring of ``SIZE`` rows of pinned host memory that the kernels read
  directly (zero copy: under CUDA's unified addressing, memory that torch
  pins through ``cudaHostAlloc`` is readable by kernels at its host
  address). A vector among the last ``SIZE`` distinct ones is served from
  its row (every managed layer of a param group gets the same vector in a
  step); a new one is written into the next row, once every launch that
  read the row's previous vector has finished. That is known from events
  recorded on the ring's stream when vectors are installed: the first
  recorded after a row's last launch completes after it (in practice long
  before it is needed, so waiting on it does not block). No host-to-device
  copy is enqueued per step.

  Per call this costs a dictionary lookup; per new vector a row write and
  an event record."""

  SIZE = 64

  def __init__(self, device, length: int, stream: torch.cuda.Stream,
               pin_memory: bool = True):
    # (pin_memory=False: a ring of ordinary host memory, which no kernel
    # can read; for the tests of its bookkeeping on a machine without CUDA.)
    self.host = torch.empty((self.SIZE, length), dtype=torch.float32,
                            pin_memory=pin_memory)
    self.host_np = self.host.numpy()
    base, row = self.host.data_ptr(), self.host.stride(0) * 4
    self.ptrs = [base + i * row for i in range(self.SIZE)]
    self.stream = stream
    self.keys: list = [None] * self.SIZE
    self.index: dict = {}
    self.next = 0
    # Launches so far, the number of the last launch that read each row,
    # and (launches before it, event) per installation, oldest first.
    self.launches = 0
    self.last_use = [0] * self.SIZE
    self.marks: collections.deque = collections.deque()
    # The last fixed vector served, its row and that row's key then.
    self.last_vec, self.last_row, self.last_key = None, 0, None

  def get(self, vec: np.ndarray, fixed: bool = False) -> int:
    """The device address of the row holding ``vec``, for the launch the
    caller enqueues next on the ring's stream. ``fixed``: ``vec`` is never
    written (an update plan's packed scalars), so the same object as the
    last fixed one -- the next layer of its param group in a step -- is
    served from the row it went to, while that row still holds it."""
    i = self.last_row
    if not fixed or vec is not self.last_vec or (
        self.keys[i] is not self.last_key):
      key = vec.tobytes()
      i = self.index.get(key)
      if i is None:
        i = self._install(key, vec)
      if fixed:  # (the row's own key object: the one _install stored)
        self.last_vec, self.last_row, self.last_key = vec, i, self.keys[i]
    self.launches += 1
    self.last_use[i] = self.launches
    return self.ptrs[i]

  def _install(self, key: bytes, vec: np.ndarray) -> int:
    i, self.next = self.next, (self.next + 1) % self.SIZE
    if self.keys[i] is not None:
      self._wait_for(self.last_use[i])
      del self.index[self.keys[i]]
    self.host_np[i] = vec
    self.keys[i] = key
    self.index[key] = i
    event = torch.cuda.Event()
    event.record(self.stream)
    self.marks.append((self.launches, event))
    return i

  def _wait_for(self, launch: int) -> None:
    """Returns once launch number ``launch`` has finished on the GPU."""
    # Events recorded before that launch was enqueued do not cover it; a
    # later one covers it and every launch before.
    while self.marks and self.marks[0][0] < launch:
      self.marks.popleft()
    if self.marks:
      self.marks[0][1].synchronize()
    else:
      self.stream.synchronize()


class _Launch:
  """A resolved direct launch: the compiled kernel, the number of state
  tensors it writes and the hyperparameter ring it reads host vectors from
  (made at the first such vector: a launch recorded in a CUDA graph reads
  a device tensor instead)."""

  __slots__ = ("kernel", "n_state", "ring", "ring_key", "key")

  def __init__(self, kernel, n_state, ring_key):
    self.kernel, self.n_state = kernel, n_state
    self.ring, self.ring_key = None, ring_key
    self.key = None  # its _launch_key, once cached in _LAUNCHES

  def host_ring(self) -> "_HparamsRing":
    if self.ring is None:
      device_index, _, length = self.ring_key
      with _LOCK:
        ring = _RINGS.get(self.ring_key)
        if ring is None:
          device = torch.device("cuda", device_index)
          ring = _RINGS[self.ring_key] = _HparamsRing(
              device, length, torch.cuda.current_stream(device))
      self.ring = ring
    return self.ring


# Fast path: _launch_key(...) -> _Launch, or None for the DLPack path.
_LAUNCHES: dict = {}


def _launch_key(x2, dy2, w, slots, device_index: int, stream: int,
                n_hparams: int, rule, config) -> tuple:
  """What a cached direct launch was resolved for (:data:`_LAUNCHES`): the
  operands' shapes and dtypes, the weight's and each slot's strides, each
  slot's device, the stream, the length of the hyperparameter vector, the
  rule and the tiling. The compiled kernel reads the weight and the slots
  at their pointers as dense row-major arrays of the weight's shape on its
  device, which :func:`_resolve` checks once per key: a weight or slot laid
  out otherwise has a key of its own, never another layout's launch.
  (``x2`` and ``dy2`` are made contiguous before every launch, so their
  strides do not matter; a ``(..., n)`` one, which :func:`relaunch` takes,
  is keyed by the 2-d shape it has as the kernel reads it, ``(rows, n)``.)"""
  return (_rows_shape(x2), _rows_shape(dy2), x2.dtype, dy2.dtype, w.shape,
          w.stride(),
          w.dtype, *[(s.shape, s.stride(), s.dtype, s.get_device())
                     for s in slots],
          device_index, stream, n_hparams, rule, config)


def _rows_shape(t: torch.Tensor):
  """``t``'s shape as a ``(rows, n)`` operand: its own where 2-d, else
  ``(numel / n, n)`` (equal to the ``torch.Size`` of its 2-d reshape; no
  reshape formed), or ``None`` for an empty last dimension."""
  s = t.shape
  if len(s) == 2:
    return s
  return (t.numel() // s[-1], s[-1]) if s and s[-1] else None


def _direct_layout_ok(x2, dy2, w, slots, device_index: int) -> bool:
  """Whether the compiled kernel can take these operands by pointer: a 2-d
  weight and slots of its shape, contiguous, on its device; ``x2`` and
  ``dy2`` of one dtype, with ``w``'s rows and columns as their columns
  (any strides: they are made contiguous before the launch)."""
  if w.dim() != 2 or x2.dim() != 2 or dy2.dim() != 2:
    return False
  n_in, n_out = w.shape
  if (x2.shape[0] == 0 or x2.shape[1] != n_in or dy2.shape[1] != n_out
      or dy2.shape[0] != x2.shape[0] or x2.dtype != dy2.dtype
      or not w.is_contiguous() or w.get_device() != device_index):
    return False
  return all(s.shape == w.shape and s.is_contiguous()
             and s.get_device() == device_index for s in slots)


def _resolve(x2, dy2, w, slots, n_hparams: int, rule, config,
             device_index: int, stream: int):
  """The launch for a case not seen before: the tiling and the compiled
  kernel; ``None`` where the case takes the DLPack path (among them any
  layout the kernel cannot take by pointer: :func:`_direct_layout_ok`)."""
  if not _direct_layout_ok(x2, dy2, w, slots, device_index):
    return None
  bt = x2.shape[0]
  n_in, n_out = w.shape
  device = torch.device("cuda", device_index)
  key = (device, bt, n_in, n_out, x2.dtype, w.dtype,
         tuple(s.dtype for s in slots), rule, config)
  cfg = _direct_config(bt, n_in, n_out, x2.dtype, w, slots, rule, config,
                       device)
  if cfg is None:
    return None
  kernel = _direct.kernel_for(
      (key, cfg, (n_hparams,)), lambda: _direct.DirectKernel(
          device, x2.shape, dy2.shape, x2.dtype,
          [(tuple(t.shape), t.dtype) for t in (w, *slots)], n_hparams,
          rule, cfg))
  if kernel is None or kernel.writes_outputs:
    # (A rule's write-only outputs, Muon's, come back through DLPack.)
    return None
  return _Launch(kernel, len(slots) + (1 if rule.updates_weight else 0),
                 (device_index, stream, n_hparams))


_RINGS: dict = {}


def _direct_update(x, dy, w, slots, hparams, rule, config,
                   stochastic_rounding=None) -> bool:
  """Launches the Mosaic GPU kernel directly on the torch tensors, in place,
  on torch's current stream; ``False`` (nothing done) where the case takes
  the DLPack path -- always for quantized slots and stochastic rounding,
  which the Mosaic GPU kernel does not support. ``hparams``: a host vector
  (served from the pinned ring), or a float32 CUDA tensor on the weight's
  device that the kernel reads in place (CUDA-graph capture)."""
  if _direct.unavailable() is not None or isinstance(hparams, jax.Array):
    return False
  if stochastic_rounding is not None or any(
      isinstance(s, Quantized) for s in slots):
    return False
  if x.dtype != dy.dtype or x.dim() < 1 or dy.dim() < 1:
    return False
  x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
  dy2 = dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])
  device_index = w.get_device()
  if x.get_device() != device_index or dy.get_device() != device_index:
    return False  # (the DLPack path says which tensor is elsewhere)
  stream = _raw_stream(device_index)
  on_device = isinstance(hparams, torch.Tensor)
  if on_device:
    if (hparams.dtype != torch.float32 or hparams.dim() != 1
        or hparams.get_device() != device_index
        or not hparams.is_contiguous()):
      raise ValueError(
          f"forge_torch: device hyperparameters must be a contiguous 1-d "
          f"float32 tensor on the weight's device cuda:{device_index}; got "
          f"{hparams.dtype}{list(hparams.shape)} on {hparams.device}")
    vec, n_hparams = hparams, hparams.shape[0]
  else:
    vec = np.ascontiguousarray(hparams, dtype=np.float32)
    n_hparams = vec.shape[0]
  key = _launch_key(x2, dy2, w, slots, device_index, stream, n_hparams,
                    rule, config)
  launch = _LAUNCHES.get(key, False)
  if launch is False:
    launch = _resolve(x2, dy2, w, slots, n_hparams, rule, config,
                      device_index, stream)
    with _LOCK:
      first = _LAUNCHES.get(key, False)
      if first is False:
        if launch is not None:
          launch.key = key
        _LAUNCHES[key] = launch
      else:  # another thread resolved the case meanwhile: its launch is
        # the one kept (this one, never launched, is unloaded when dropped;
        # replacing that one could unload it with its launches queued)
        launch = first
  if launch is None or not _launch_on(launch, stream, x2, dy2, w, slots,
                                     vec, on_device):
    return False
  logged = getattr(_WRITTEN_IN_PLACE, "ptrs", None)
  if logged is not None:  # (a staged update: fused_update counts its copies)
    logged.update(t.data_ptr() for t in (w, *slots))
  return True


def _launch_on(launch: _Launch, stream: int, x2, dy2, w, slots, vec,
               on_device: bool, fixed: bool = False) -> bool:
  """Enqueues ``launch`` on ``stream``; ``vec``: a host vector (served from
  the pinned ring; ``fixed``: one never written, see
  :meth:`_HparamsRing.get`) or, ``on_device``, a CUDA tensor the kernel
  reads. ``False`` (nothing done) where an operand's address is not 16-byte
  aligned (a view at an odd offset into a flat buffer): the kernel's TMA
  copies need aligned ones (a misaligned one is a CUDA error that ends the
  process's use of the GPU). :func:`fused_update` stages such operands
  through aligned copies first (:func:`_aligned_stand_ins`), so only
  :func:`relaunch` meets them here; its caller then takes that path."""
  # Non-contiguous operands are copied (on this stream, before the launch).
  x2, dy2 = x2.contiguous(), dy2.contiguous()
  ptrs = [x2.data_ptr(), dy2.data_ptr(), 0, w.data_ptr(),
          *[s.data_ptr() for s in slots]]
  if functools.reduce(operator.or_, ptrs) & 15:
    return False
  ring = None if on_device else launch.host_ring()
  with _LOCK:
    ptrs[2] = vec.data_ptr() if on_device else ring.get(vec, fixed)
    launch.kernel.launch_ptrs(stream, ptrs)
    STATS.calls += 1
    STATS.direct += 1
    STATS.in_place += launch.n_state
  return True


def resolved_launch(x2, dy2, w, slots, n_hparams: int, rule, config):
  """The direct launch a call with these (2-d) operands took on torch's
  current stream, or ``None`` (none was resolved for them, or they take the
  DLPack path): what :func:`relaunch` repeats."""
  if not w.is_cuda:
    return None
  device_index = w.get_device()
  launch = _LAUNCHES.get(_launch_key(
      x2, dy2, w, slots, device_index, _raw_stream(device_index), n_hparams,
      rule, config))
  return launch or None


_current_device = getattr(torch._C, "_cuda_getDevice",
                          torch.cuda.current_device)
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing",
                            torch.cuda.is_current_stream_capturing)


def relaunch(launch: _Launch, x2, dy2, w, slots, vec: np.ndarray, rule,
             config) -> bool:
  """The fused update of :func:`fused_update` by ``launch`` (from
  :func:`resolved_launch`) with the float32 host vector ``vec``, where the
  call resolves to that very launch now: the same shapes, dtypes, layouts,
  devices and stream, direct launches on, not capturing, the weight's
  device current. ``False`` (nothing done) otherwise: the caller then takes
  :func:`fused_update`'s path. ``vec``: the plan's packed scalars, which
  are never written (the ring serves them from their row: ``fixed``).
  ``x2``, ``dy2`` may be ``(..., n)``: taken as ``(rows, n)`` (the
  kernel reads them at their pointers, made contiguous)."""
  device_index = launch.ring_key[0]
  if (_direct.unavailable() is not None
      or _current_device() != device_index
      or x2.get_device() != device_index
      or dy2.get_device() != device_index
      or _stream_capturing()):
    return False
  stream = _raw_stream(device_index)
  # (Compared with the key it was cached under, which _LAUNCHES maps to it.)
  if launch.key != _launch_key(x2, dy2, w, slots, device_index, stream,
                               vec.shape[0], rule, config):
    return False
  return _launch_on(launch, stream, x2, dy2, w, slots, vec, False,
                    fixed=True)


def _capturing() -> bool:
  """Whether torch's current CUDA stream is recording a CUDA graph (never
  before CUDA is initialised: asking would initialise it)."""
  return (torch.cuda.is_initialized()
          and torch.cuda.is_current_stream_capturing())


def _captured_update(x, dy, w, slots, hparams, rule, config,
                     stochastic_rounding) -> None:
  """A fused update recorded in the CUDA graph being captured: only a
  direct launch can be (the DLPack path runs JAX work and host
  synchronisation), reading its hyperparameters from a device tensor that
  the captured work fills, so that each replay reads the values of its own
  step."""
  if not (isinstance(hparams, torch.Tensor) and hparams.is_cuda):
    raise RuntimeError(
        "forge_torch: a fused update inside CUDA-graph capture needs its "
        "hyperparameters as a CUDA tensor formed by the captured work (a "
        "host vector would be read as it was at capture, at every replay). "
        "forge_torch.Adam and AdamW with fused=True, capturable=True form "
        "them so; other optimizers cannot be captured")
  if _direct_update(x, dy, w, slots, hparams, rule, config,
                    stochastic_rounding):
    return
  why = _direct.unavailable() or (
      "the Mosaic GPU kernel does not cover this case (it needs a GPU of "
      "compute capability 9.0 or newer, bfloat16 or float16 operands of one "
      "dtype, plain (not quantized) state, no stochastic rounding, no "
      "Triton config, $FORGE_BACKEND not triton, BT a multiple of 8 and "
      f"in, out of 64; here x {tuple(x.shape)} {x.dtype}, weight "
      f"{tuple(w.shape)} {w.dtype})")
  raise CaptureRefused(
      "only a direct launch of the Mosaic GPU kernel can be, and " + why)


class CaptureRefused(RuntimeError):
  """A fused update that cannot be recorded in the CUDA graph being
  captured; ``reason`` says why (a managed layer's update re-raises it
  naming the layer)."""

  def __init__(self, reason: str):
    super().__init__("forge_torch: this fused update cannot be recorded in "
                     "a CUDA graph: " + reason)
    self.reason = reason


def _fused_update(x, dy, w, slots, hparams, rule, config, views,
                  stochastic_rounding=None) -> bool:
  global _DONATION_BROKEN
  if w.is_cuda:
    if _capturing():
      _captured_update(x, dy, w, slots, hparams, rule, config,
                       stochastic_rounding)
      return True
    if _direct_update(x, dy, w, slots, hparams, rule, config,
                      stochastic_rounding):
      return True
  # Quantized slots / stochastic rounding: the slots' static layout (per
  # slot None or its codes' dtype), else None (the plain call).
  layout = None
  if stochastic_rounding is not None or any(
      isinstance(s, Quantized) for s in slots):
    layout = tuple(CODE_DTYPES[s.q.dtype].name if isinstance(s, Quantized)
                   else None for s in slots)
  slots = _flat_slots(slots)
  # The tensors the kernel writes: the weight (unless the rule is
  # state-only) and the slots.
  tensors = (w, *slots) if rule.updates_weight else tuple(slots)
  cuda = w.is_cuda
  stream = torch.cuda.current_stream() if cuda else None
  ordered = False  # stream-ordered (no host sync) for this call
  if cuda:
    if _SYNC_MODE == "stream" and _STREAM_FALLBACK is None:
      if _tfrt_gpu_client():
        _stream_unavailable(
            "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT is set: that client "
            "ignores the DLPack import stream")
      else:
        ordered = True
    if not ordered:
      # Everything torch queued on its current stream (the producer of x and
      # dy, and the grad_input GEMM that reads the pre-update w) must be done
      # before the kernel reads x, dy and overwrites w.
      stream.synchronize()
  # Every torch tensor handed to JAX stays referenced here until the end of
  # this call (stream mode: until torch's stream waits on the kernel).
  x_c, dy_c = _contiguous(x), _contiguous(dy)
  held = [x_c, dy_c, *(t.detach() for t in (w, *slots))]
  xj = _to_jax(x_c)
  device = next(iter(xj.devices()))
  if ordered and not _device_has_ready_stream(device):
    _stream_unavailable(
        f"{device} has no stream for external ready events, so JAX would not "
        "wait for torch's stream")
    ordered = False
    stream.synchronize()  # before any JAX work on the imports
  dyj = _to_jax(dy_c)
  interpret = not cuda
  # XLA:CPU does not alias donated DLPack imports: nothing to gain there.
  donate = cuda and not _DONATION_BROKEN
  # The state's views from the last in-place call (ViewCache), else imports.
  # x and dy above are always imported now: they carry the ordering.
  reuse = views is not None and donate and REUSE_VIEWS
  state = [views.get(t) if reuse else None for t in held[2:]]
  wj, *sj = [_to_jax(t) if a is None else a for t, a in zip(held[2:], state)]
  sj = tuple(sj)
  hp = _device_hparams(hparams, device)
  extra = ()
  if stochastic_rounding is not None:
    extra = (jax.device_put(np.asarray(stochastic_rounding, np.uint32),
                            device),)
  sr = stochastic_rounding is not None
  key = (device, x_c.shape, dy_c.shape, x_c.dtype, dy_c.dtype,
         tuple((t.shape, t.dtype) for t in tensors))
  try:
    w_new, s_new = _run(_entry(key, rule, config, interpret, donate, layout,
                               sr), (xj, dyj, wj, sj, hp, *extra))
  except (RuntimeError, ValueError) as e:
    if not donate or "donat" not in str(e).lower():
      raise
    # This JAX refuses to donate DLPack-imported buffers: copy back from
    # now on (counted in STATS; the GPU tests report it).
    _DONATION_BROKEN = True
    donate = False
    with _LOCK:
      STATS.donation_errors += 1
    xj, dyj = _to_jax(x_c), _to_jax(dy_c)
    wj = _to_jax(held[2])
    sj = tuple(_to_jax(s) for s in held[3:])
    w_new, s_new = _run(_entry(key, rule, config, interpret, donate, layout,
                               sr), (xj, dyj, wj, sj, hp, *extra))
  outs = (w_new, *s_new) if rule.updates_weight else tuple(s_new)
  if ordered:
    handle = _torch_stream_handle(stream)
    try:
      for o in outs:
        # GPU-side: torch's stream waits for the kernel's completion event.
        # The capsule is dropped unconsumed (its deleter frees it).
        o.__dlpack__(stream=handle)
    except Exception as e:  # noqa: BLE001 -- jaxlib's own error types
      ordered = False
      jax.block_until_ready(outs)  # this call: ordered by the host instead
      if "unimplemented" not in str(e).lower():
        raise
      _stream_unavailable(f"jax.Array.__dlpack__(stream=...) failed: {e}")
    else:
      for t in held:
        # A no-op for memory allocated on this stream; otherwise torch's
        # allocator keeps it until this stream has passed the kernel.
        t.record_stream(stream)
  else:
    jax.block_until_ready(outs)
  all_in_place = True
  n_in_place = n_copied = 0
  kept = []  # the in-place results: the next call's inputs (ViewCache)
  logged = getattr(_WRITTEN_IN_PLACE, "ptrs", None)
  for t, o in zip(tensors, outs):
    if donate and o.unsafe_buffer_pointer() == t.data_ptr():
      n_in_place += 1
      kept.append((t, o))
      if logged is not None:
        logged.add(t.data_ptr())
      continue
    all_in_place = False
    n_copied += 1
    with torch.no_grad():
      # torch.from_dlpack orders torch's stream after `o` (see above).
      t.copy_(torch.from_dlpack(o))
  if not rule.updates_weight and reuse and donate:
    kept.append((held[2], wj))  # read only: still a view of w's memory
  if views is not None:
    views.replace(kept if reuse and donate else ())
  if n_copied and cuda:
    # `o` is freed when this call returns; the copies must have read it.
    stream.synchronize()
  del held
  with _LOCK:
    STATS.calls += 1
    STATS.in_place += n_in_place
    STATS.copied += n_copied
  return all_in_place


def check_dtype(t: torch.Tensor, what: str) -> None:
  if t.dtype not in SUPPORTED_DTYPES:
    raise TypeError(
        f"forge_torch: {what} has dtype {t.dtype}; FORGE-managed weights must "
        "be torch.float32 or torch.bfloat16 (keep other layers as nn.Linear)")


__all__ = ["BridgeStats", "CODE_DTYPES", "STATS", "SUPPORTED_DTYPES",
           "SYNC_MODES",
           "ViewCache", "check_dtype", "fused_update", "get_sync_mode",
           "set_sync_mode"]
