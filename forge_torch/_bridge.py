"""DLPack bridge: runs ``pallas_kernels.fused_wgrad_update`` on torch tensors.

torch and JAX share the tensors through DLPack (``jax.dlpack.from_dlpack`` /
``torch.from_dlpack``); nothing is converted through host memory.

* **GPU.** The JAX call is jitted with the weight and its state donated, and
  the kernel aliases them to its outputs (``input_output_aliases``), so the
  fused kernel writes the torch tensors' own memory. After the call the
  bridge checks ``unsafe_buffer_pointer()`` of each JAX output against the
  torch tensor's ``data_ptr()``; any output that does not alias (XLA declined
  the donation) is copied back with ``tensor.copy_`` and counted in
  :data:`STATS` (``copied``), so a lost zero-copy is visible, never silent.
* **CPU** (CI). The kernel runs in Pallas interpret mode; XLA's CPU client does
  not alias donated DLPack imports, so nothing is donated and the results
  (the weight and each state slot of the rule, e.g. ``exp_avg`` and
  ``exp_avg_sq`` for Adam) are copied back: one extra pass per state tensor
  over the weight's bytes per layer and step.
* **Streams.** ``torch.cuda.current_stream().synchronize()`` before JAX reads
  the tensors (``grad_output``, the layer input and the weight are produced or
  read by work queued on torch's stream, including ``grad_input = grad_output
  @ W`` which must see the *pre-update* ``W``), and ``block_until_ready()`` on
  the results before torch continues. Both are host synchronisations: simple
  and correct for any stream torch is using, at the cost of a short GPU bubble
  per managed layer per step.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from typing import Sequence

import numpy as np
import jax
import torch

import pallas_kernels
from pallas_kernels.rules import UpdateRule
# Re-exported: the original AdamW rule, and fused_update's default.
from forge_torch._rules import TORCH_ADAMW, torch_adamw_hparams

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


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
  """

  calls: int = 0
  in_place: int = 0
  copied: int = 0
  not_donated_warnings: int = 0
  donation_errors: int = 0

  def reset(self) -> None:
    self.calls = self.in_place = self.copied = 0
    self.not_donated_warnings = self.donation_errors = 0


STATS = BridgeStats()
_LOCK = threading.Lock()
_DONATION_BROKEN = False


def _to_jax(t: torch.Tensor) -> jax.Array:
  """A zero-copy JAX view of a contiguous torch tensor."""
  t = t.detach()
  if not t.is_contiguous():
    t = t.contiguous()
  try:
    return jax.dlpack.from_dlpack(t)
  except RuntimeError as e:  # jaxlib raises XlaRuntimeError, a RuntimeError
    if t.is_cuda:
      raise RuntimeError(
          "forge_torch could not hand a CUDA tensor to JAX through DLPack "
          f"({e}). Does this JAX install have its CUDA backend "
          "(`jax.devices()` should list GPUs)?") from e
    # CPU: e.g. an unaligned view; a fresh allocation is aligned.
    return jax.dlpack.from_dlpack(t.clone())


@functools.lru_cache(maxsize=None)
def _jitted(key, rule: UpdateRule, config, interpret: bool, donate: bool):
  """One jitted fused update per (platform, shapes, dtypes, rule, config)."""
  del key  # part of the cache key only; jit specialises on it as well
  fn = functools.partial(pallas_kernels.fused_wgrad_update, rule=rule,
                         config=config, interpret=interpret)
  return jax.jit(fn, donate_argnums=(2, 3) if donate else ())


def fused_update(x: torch.Tensor, dy: torch.Tensor, w: torch.Tensor,
                 slots: Sequence[torch.Tensor], hparams: np.ndarray, *,
                 rule: UpdateRule = TORCH_ADAMW,
                 config: pallas_kernels.BlockConfig | None = None) -> bool:
  """``w, slots <- rule(w, slots, G = x^T dy)`` on torch tensors, in place.

  Args:
    x: ``(BT, n_in)`` torch tensor (for a torch ``Linear``: ``grad_output``).
    dy: ``(BT, n_out)`` (for a torch ``Linear``: the layer input).
    w: ``(n_in, n_out)`` weight, updated in place (for a torch ``Linear``:
      ``weight`` ``(out, in)`` itself, so ``G`` is torch's own weight grad).
    slots: the rule's state tensors, ``w``'s shape, updated in place.
    hparams: the rule's packed fp32 vector (numpy).
    rule, config: the kernel's update rule and tiling.

  Returns:
    ``True`` if every state tensor was written in place by the kernel,
    ``False`` if any had to be copied back.
  """
  tensors = (w, *slots)
  for t in tensors:
    if not t.is_contiguous():
      raise ValueError("forge_torch: weight and optimizer state must be "
                       "contiguous to be updated in place")
  cuda = w.is_cuda
  if cuda:
    # Everything torch queued on its current stream (the producer of x and
    # dy, and the grad_input GEMM that reads the pre-update w) must be done
    # before the kernel reads x, dy and overwrites w.
    torch.cuda.current_stream(w.device).synchronize()
  global _DONATION_BROKEN
  xj, dyj = _to_jax(x), _to_jax(dy)
  wj = _to_jax(w)
  sj = tuple(_to_jax(s) for s in slots)
  platform = wj.devices().pop().platform
  interpret = platform == "cpu"
  # XLA:CPU does not alias donated DLPack imports: nothing to gain there.
  donate = not interpret and not _DONATION_BROKEN
  key = (platform, tuple(xj.shape), tuple(dyj.shape),
         tuple((a.shape, str(a.dtype)) for a in (xj, dyj, wj, *sj)))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      w_new, s_new = _jitted(key, rule, config, interpret, donate)(
          xj, dyj, wj, sj, hparams)
    except (RuntimeError, ValueError) as e:
      if not donate or "donat" not in str(e).lower():
        raise
      # This JAX refuses to donate DLPack-imported buffers: copy back from
      # now on (counted in STATS; the GPU tests report it).
      _DONATION_BROKEN = True
      donate = False
      with _LOCK:
        STATS.donation_errors += 1
      wj = _to_jax(w)
      sj = tuple(_to_jax(s) for s in slots)
      w_new, s_new = _jitted(key, rule, config, interpret, donate)(
          _to_jax(x), _to_jax(dy), wj, sj, hparams)
    outs = (w_new, *s_new)
    jax.block_until_ready(outs)
  not_donated = sum("donated buffers were not usable" in str(c.message)
                    for c in caught)
  for c in caught:
    if "donated buffers were not usable" not in str(c.message):
      warnings.warn_explicit(c.message, c.category, c.filename, c.lineno)
  all_in_place = True
  n_in_place = n_copied = 0
  for t, o in zip(tensors, outs):
    if donate and o.unsafe_buffer_pointer() == t.data_ptr():
      n_in_place += 1
      continue
    all_in_place = False
    n_copied += 1
    with torch.no_grad():
      t.copy_(torch.from_dlpack(o))
  if n_copied and cuda:
    torch.cuda.current_stream(w.device).synchronize()
  with _LOCK:
    STATS.calls += 1
    STATS.in_place += n_in_place
    STATS.copied += n_copied
    STATS.not_donated_warnings += not_donated
  return all_in_place


def check_dtype(t: torch.Tensor, what: str) -> None:
  if t.dtype not in SUPPORTED_DTYPES:
    raise TypeError(
        f"forge_torch: {what} has dtype {t.dtype}; FORGE-managed weights must "
        "be torch.float32 or torch.bfloat16 (keep other layers as nn.Linear)")


__all__ = ["BridgeStats", "STATS", "SUPPORTED_DTYPES", "TORCH_ADAMW",
           "check_dtype", "fused_update", "torch_adamw_hparams"]
