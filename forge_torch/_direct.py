"""Direct launch: the Mosaic GPU kernel on torch tensors, by pointer.

The DLPack bridge (:mod:`forge_torch._bridge`) hands torch's tensors to JAX
and runs a jitted JAX call: its host work per call (imports, dispatch,
stream handshakes) costs more than the kernel. On a Hopper GPU the fused
update here skips JAX at call time instead: the Mosaic GPU kernel
(:mod:`pallas_kernels.mosaic_kernel`) is traced and lowered by JAX once per
(device, shapes, dtypes, rule, tiling), its module compiled by the Mosaic
GPU runtime that jaxlib's CUDA plugin ships (the mechanism of
``jax.experimental.pallas.mosaic_gpu.as_torch_kernel``), and each call
launches it with the tensors' device pointers on torch's *current* stream
(``as_torch_kernel`` itself launches on the default stream). The weight and
the slots are the kernel's in-place operands: the launch writes the torch
tensors themselves.

What it takes from jax beyond the public API, each checked when a kernel is
first built (a missing piece makes the bridge keep the DLPack path for the
process, with the reason in ``forge_torch.bridge_stats.direct_unavailable``):
the lowered module's ``mosaic_gpu_v2`` custom call (its serialized module and
its operand/output aliasing), jaxlib's ``MosaicGpuCompile`` /
``MosaicGpuUnload`` entry points and the launch function's calling
convention (``jax.experimental.mosaic.gpu.core``'s, whose ABI changed in
jaxlib 0.12: kernel and device arguments added).

A kernel is launched directly only where the backend choice takes Mosaic
GPU (``forge_torch._bridge``'s ``_resolve``); everything else (the Triton
backend, the CPU, operands the Mosaic kernel does not take) goes through
DLPack.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import os
import threading
from typing import Sequence

import jax
import jax.numpy as jnp
import torch

from forge_torch import _hot
from pallas_kernels import mosaic_kernel
from pallas_kernels.rules import UpdateRule

ENV_VAR = "FORGE_TORCH_DIRECT"

_LOCK = threading.Lock()
# Why direct launches are off in this process, or None: turned off by
# $FORGE_TORCH_DIRECT=0 (read at import) or set_enabled(False) ...
_OFF: str | None = (f"${ENV_VAR}=0" if os.environ.get(ENV_VAR, "1").strip()
                    == "0" else None)
# ... or, for good, by a kernel whose launch this jax cannot prepare.
_BROKEN: str | None = None


def unavailable() -> str | None:
  """Why kernels are not launched directly in this process, or ``None``."""
  return _BROKEN or _OFF


def set_enabled(enabled: bool) -> bool:
  """Turns direct launches on or off (off: every fused update goes through
  DLPack and JAX); returns the switch's previous setting. Turning them on
  does not undo a failure to prepare a launch (:func:`unavailable` keeps
  saying why, and launches stay off)."""
  global _OFF
  if not isinstance(enabled, bool):
    raise TypeError(f"set_direct_launch takes True or False, got "
                    f"{enabled!r}")
  with _LOCK:
    was = _OFF is None
    _OFF = None if enabled else "turned off by forge_torch.set_direct_launch"
  return was


def _disable(reason: str) -> None:
  global _BROKEN
  with _LOCK:
    if _BROKEN is None:
      _BROKEN = reason


_TORCH_TO_JNP = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16,
                 torch.float16: jnp.float16}


def jnp_dtype(dtype: torch.dtype):
  return _TORCH_TO_JNP.get(dtype)


class _Unsupported(Exception):
  """The lowered module is not one the direct launch knows how to run."""


# --------------------------------------------------------------------------
# The Mosaic GPU runtime in jaxlib's CUDA plugin.
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _runtime():
  """``(compile, unload, abi_v2)`` from the plugin's shared library."""
  try:
    from jax.experimental.mosaic.gpu import core as mgpu_core
  except ImportError as e:
    raise _Unsupported(f"jax has no Mosaic GPU ({e})") from None
  library = None
  for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    try:
      plugin = __import__(name, fromlist=["_get_library_path"])
    except ImportError:
      continue
    library = plugin._get_library_path()
    break
  dll = ctypes.CDLL(library)  # None: symbols already in the process
  try:
    compile_fn, unload_fn = dll.MosaicGpuCompile, dll.MosaicGpuUnload
  except AttributeError as e:
    raise _Unsupported(f"jaxlib's CUDA plugin has no Mosaic GPU runtime "
                       f"entry point ({e})") from None
  compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
  compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
  unload_fn.argtypes = [compile_fn.restype]
  unload_fn.restype = None
  return compile_fn, unload_fn, launch_abi_v2(mgpu_core, jax.__version_info__)


def launch_abi_v2(mgpu_core, version: tuple[int, ...]) -> bool:
  """Whether the runtime's launch function takes ``(kernel, function,
  stream, ptrs, device)`` (jaxlib 0.12 on) rather than ``(function,
  stream, ptrs)``: ``mgpu_core._ABI_V2`` where jax defines it, else by
  ``version``, jax's (``jax.__version_info__``: jax and jaxlib release
  together; 0.12 defines no such flag, the new form is its only one)."""
  flag = getattr(mgpu_core, "_ABI_V2", None)
  if flag is not None:
    return bool(flag)
  return version >= (0, 12)


def _bind(module_asm: bytes, device_index: int):
  """Compiles a serialized Mosaic GPU module (on the current CUDA context's
  device, which the caller sets to ``device_index``); returns ``(launch,
  tail, unload)``: ``launch(stream, ptrs, *tail)`` enqueues the kernel (the
  ``ctypes`` function with its leading arguments bound, no Python frame of
  its own; ``tail`` is ``(device_index,)`` where the runtime's launch takes
  the device, else empty), ``unload()`` frees the module and ``c_entry``
  holds the launch's addresses for a caller in C++
  (:attr:`DirectKernel.c_launch`)."""
  compile_fn, unload_fn, abi_v2 = _runtime()
  compiled = compile_fn(ctypes.c_char_p(module_asm),
                        ctypes.c_int(len(module_asm)))
  if not compiled:
    raise RuntimeError("forge_torch: the Mosaic GPU runtime failed to "
                       "compile the fused kernel")
  function, launch_ptr = compiled[0], compiled[1]
  ptrs_t = ctypes.POINTER(ctypes.c_void_p)
  if abi_v2:  # launch(kernel, function, stream, ptrs, device)
    launch_c = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ptrs_t, ctypes.c_int)(
                                    launch_ptr)
    launch, tail = functools.partial(launch_c, compiled[2], function), (
        device_index,)
  else:  # launch(function, stream, ptrs), on the current context's device
    launch_c = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                ptrs_t)(launch_ptr)
    launch, tail = functools.partial(launch_c, function), ()
  # The same launch as addresses, for a caller in C++: (launch function,
  # abi_v2, kernel or None, function, device).
  c_entry = (launch_ptr, abi_v2, compiled[2] if abi_v2 else None, function,
             device_index)
  return launch, tail, functools.partial(unload_fn, compiled), c_entry


# --------------------------------------------------------------------------
# Tracing: the kernel's operands, outputs and in-place aliases.
# --------------------------------------------------------------------------


def _mosaic_call(fn, structs, platforms=None):
  """Lowers ``fn`` (one Mosaic GPU kernel and nothing else) and returns its
  serialized module, the argument index of each kernel operand, and per
  kernel result the operand it aliases (or ``None``) and its shape and dtype;
  plus which kernel results ``fn`` returns, in order. ``platforms``: as
  :func:`traced` takes them."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir import passmanager
  from jax._src.lib.mlir.dialects import func, hlo
  import jax.experimental.mosaic.gpu as mgpu

  # (keep_unused: the lowered main takes every argument of fn, so that its
  # argument indices are fn's even where the kernel reads one not at all,
  # the weight of a state-only rule.)
  module = jax.jit(fn, keep_unused=True).trace(*structs).lower(
      lowering_platforms=platforms).compiler_ir()
  with module.context:
    # jit outlines nested calls; inline them to see the kernel's operands.
    mgpu.dialect.register_inliner_extensions(module.context)
    passmanager.PassManager.parse(
        "builtin.module(inline{default-pipeline=})").run(module.operation)
    mains = [op for op in module.body.operations
             if isinstance(op, func.FuncOp) and op.name.value == "main"]
    if len(mains) != 1:
      raise _Unsupported("the lowered module has no single main function")
    [block] = mains[0].body.blocks
    args = list(block.arguments)
    call, returned = None, None
    for op in block.operations:
      if (isinstance(op, hlo.CustomCallOp)
          and op.call_target_name.value == "mosaic_gpu_v2"):
        if call is not None:
          raise _Unsupported("the lowered module has two Mosaic GPU kernels")
        call = op
      elif op.name in ("func.return", "sdy.return"):
        returned = list(op.operands)
      else:
        raise _Unsupported(f"the lowered module has an operation besides the "
                           f"kernel: {op.name}")
    if call is None or returned is None:
      raise _Unsupported("the lowered module has no Mosaic GPU kernel")
    operand_args = []
    for v in call.operands:
      if v not in args:
        raise _Unsupported("a kernel operand is not an argument")
      operand_args.append(args.index(v))
    results = list(call.results)
    aliases: list[int | None] = [None] * len(results)
    for attr in call.output_operand_aliases or []:
      alias = hlo.OutputOperandAlias(attr)
      if alias.operand_tuple_indices or len(alias.output_tuple_indices) > 1:
        raise _Unsupported("tupled aliases")
      [out_index] = alias.output_tuple_indices or (0,)
      aliases[out_index] = alias.operand_index
    types = []
    for r in results:
      ty = ir.RankedTensorType(r.type)
      types.append((tuple(ty.shape), _torch_dtype(ty.element_type)))
    try:
      outputs = [results.index(v) for v in returned]
    except ValueError:
      raise _Unsupported("the function returns a value the kernel did not "
                         "produce") from None
    module_asm = call.attributes["mhlo.backend_config"]["module"].value_bytes
  return module_asm, operand_args, aliases, types, outputs


def _torch_dtype(element_type):
  from jax._src.lib.mlir import ir
  if element_type == ir.F32Type.get():
    return torch.float32
  if element_type == ir.BF16Type.get():
    return torch.bfloat16
  if element_type == ir.F16Type.get():
    return torch.float16
  if isinstance(element_type, ir.IntegerType):
    return {8: torch.int8, 32: torch.int32}[ir.IntegerType(element_type).width]
  raise _Unsupported(f"kernel result element type {element_type}")


def traced(x_shape, dy_shape, x_dtype, state, hparams_size: int,
           rule: UpdateRule, cfg: mosaic_kernel.MosaicConfig, num_sms: int,
           platforms: tuple[str, ...] | None = None):
  """The fused update lowered as one Mosaic GPU kernel taking ``(x, dy,
  hparams, w, *slots)`` (``state``: ``(shape, torch dtype)`` of ``w`` and
  each slot), as :func:`_mosaic_call` returns it; raises ``_Unsupported``
  unless every state tensor the rule writes comes back as an alias of its
  own argument (written in place). ``platforms``: where to lower for, as
  ``jax.jit(...).lower(lowering_platforms=...)`` takes it (``None``: this
  process's default backend; ``("cuda",)`` lowers for a GPU on any
  machine)."""
  updates_weight = rule.updates_weight

  def fn(x, dy, h, *state_arrays):
    w, *slots = state_arrays
    w_new, rest = mosaic_kernel.launch(
        (x, dy), w, tuple(slots), h, rule=rule, cfg=cfg, interpret=False,
        num_sms=num_sms)
    return (w_new, *rest) if updates_weight else tuple(rest)

  x_dtype = jnp_dtype(x_dtype)
  structs = [jax.ShapeDtypeStruct(tuple(x_shape), x_dtype),
             jax.ShapeDtypeStruct(tuple(dy_shape), x_dtype),
             jax.ShapeDtypeStruct((hparams_size,), jnp.float32)]
  structs += [jax.ShapeDtypeStruct(tuple(shape), jnp_dtype(dtype))
              for shape, dtype in state]
  module_asm, operand_args, aliases, types, outputs = _mosaic_call(
      fn, structs, platforms)
  # The state the kernel writes in place must come back as aliases of its
  # own arguments (fn's: the lowered main keeps every one), else the launch
  # would write fresh buffers. (A state-only rule does not write w.)
  first_state = 3 if updates_weight else 4
  state_args = set(range(first_state, 3 + len(state)))
  aliased = {operand_args[a] for a in aliases if a is not None}
  if not state_args <= aliased:
    raise _Unsupported("the kernel does not update every state tensor in "
                       "place")
  return module_asm, operand_args, aliases, types, outputs


class DirectKernel:
  """One compiled fused update, launched on torch tensors.

  ``kernel(stream, x, dy, hparams, w, *slots)`` launches it on the CUDA
  stream ``stream`` (a raw handle: torch's current stream of the tensors'
  device) and returns the rule's write-only outputs (fresh tensors, Muon's
  ``mu_hat``); ``w`` (read only for its shape by a rule that does not update
  the weight) and the slots are updated in place.
  """

  def __init__(self, device: torch.device, x_shape, dy_shape, x_dtype,
               state, hparams_size: int, rule: UpdateRule,
               cfg: mosaic_kernel.MosaicConfig):
    self.device = device
    self.device_index = device.index if device.index is not None else (
        torch.cuda.current_device())
    num_sms = torch.cuda.get_device_properties(
        self.device_index).multi_processor_count
    module_asm, operand_args, aliases, types, outputs = traced(
        x_shape, dy_shape, x_dtype, state, hparams_size, rule, cfg, num_sms)
    self._operand_args = operand_args
    self._aliases = aliases
    self._types = types
    # The results fn returns that are not in-place state: the outputs.
    self._fresh = [i for i in outputs if aliases[i] is None]
    with torch.cuda.device(self.device_index):
      self._launch, self._tail, unload, self._c_entry = _bind(
          module_asm, self.device_index)
    self._unload = unload
    self._n_buffers = len(operand_args) + len(aliases)
    self._buffers_t = ctypes.c_void_p * self._n_buffers
    # Per buffer (operands, then results), the argument it points into;
    # only meaningful when every result aliases an operand.
    self.writes_outputs = any(a is None for a in aliases)
    self._order = list(operand_args) + [
        operand_args[a] for a in aliases if a is not None]
    # (At least x, dy and the hyperparameters: a tuple of pointers.)
    self._gather = operator.itemgetter(*self._order)
    # What the native host path (forge_torch/_hot.cpp) calls launch_ptrs's
    # launch with: (launch function, abi_v2, kernel, function, device,
    # order); none for a kernel with write-only outputs.
    self.c_launch = None if self.writes_outputs else (
        *self._c_entry, tuple(self._order))

  def launch_ptrs(self, stream: int, ptrs: Sequence[int]) -> None:
    """Launches on the CUDA stream whose raw handle is ``stream`` with the
    device addresses ``ptrs`` of ``(x, dy, hparams, w, *slots)``, for a
    rule without write-only outputs (the fast path of
    :func:`forge_torch._bridge._direct_update`: no tensor objects)."""
    if self.writes_outputs:
      raise ValueError("launch_ptrs: this kernel writes fresh outputs; "
                       "call it with tensors instead")
    self._launch(stream, self._buffers_t(*self._gather(ptrs)), *self._tail)

  def __call__(self, stream: int, *args: torch.Tensor) -> list[torch.Tensor]:
    """Launches on the CUDA stream whose raw handle is ``stream`` (the
    caller's current one on the tensors' device)."""
    buffers = (ctypes.c_void_p * self._n_buffers)()
    n_ops = len(self._operand_args)
    for i, a in enumerate(self._operand_args):
      buffers[i] = args[a].data_ptr()
    fresh = {}
    for j, alias in enumerate(self._aliases):
      if alias is None:
        shape, dtype = self._types[j]
        t = fresh[j] = torch.empty(shape, dtype=dtype, device=self.device)
        buffers[n_ops + j] = t.data_ptr()
      else:
        buffers[n_ops + j] = args[self._operand_args[alias]].data_ptr()
    self._launch(stream, buffers, *self._tail)
    return [fresh[j] for j in self._fresh]

  def __del__(self):
    unload = getattr(self, "_unload", None)
    if unload is not None:
      try:
        unload()
      except Exception:  # noqa: BLE001 -- interpreter shutdown
        pass


_KERNELS: dict = {}


def kernel_for(key, build) -> DirectKernel | None:
  """The kernel cached under ``key``, built by ``build()`` on first use;
  ``None`` once direct launches are off (a build that found the mechanism
  unsupported turns them off for the process, with the reason)."""
  k = _KERNELS.get(key)
  if k is not None:
    return k
  if unavailable() is not None:
    return None
  try:
    k = build()
  except _Unsupported as e:
    _disable(f"the fused kernel could not be launched directly: {e}")
    return None
  with _LOCK:
    _KERNELS[key] = k
  # The updates that will repeat this kernel's launch take the native host
  # path from now on, where it can be built (once per process).
  _hot.ensure_built()
  return k


def clear() -> None:
  """Drops the compiled kernels (each is unloaded when last referenced,
  after the GPU has finished the launches queued so far)."""
  if _KERNELS:
    torch.cuda.synchronize()
  with _LOCK:
    _KERNELS.clear()


__all__ = ["DirectKernel", "ENV_VAR", "clear", "jnp_dtype", "kernel_for",
           "set_enabled", "unavailable"]
