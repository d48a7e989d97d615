"""The native host path: a managed layer's per-call host work, in C++.

An update that repeats its weight's plan (``_ForgeOptimizer._forge_run_plan``
and the direct relaunch it ends in) spends tens of microseconds of Python
per layer on its checks and bookkeeping, and a forward's checks and count
(``_forge_before_forward``) a few more, which an eager step pays once per
managed layer: on a host-bound step that is the difference between FORGE's
step and torch's fused optimizer. ``_hot.cpp`` does the same work in C++
(the same objects read, the same checks, the same launch and bookkeeping)
and falls back to the Python path, having done nothing, wherever a check
fails or a case is not one it takes: the Python path is its reference and
handles everything else (the first update of a param group in a step, the
DLPack path, a lock held by another thread, every refusal).

It is compiled by ``torch.utils.cpp_extension.load`` (a C++ compiler and
ninja) when the first kernel is launched directly on a GPU, once per
machine and torch version (cached under torch's extension directory,
``$TORCH_EXTENSIONS_DIR``). A machine where it cannot be built keeps the
Python path, with the reason in ``forge_torch.bridge_stats.native_unavailable``;
``$FORGE_TORCH_NATIVE=0`` keeps the Python path from the start.
``bridge_stats.native`` counts the updates it launched.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import sys
import threading

ENV_VAR = "FORGE_TORCH_NATIVE"
SOURCE = pathlib.Path(__file__).with_name("_hot.cpp")
NAME = "forge_torch_native"

# While the native path is built and on (None: the Python path only):
# run_plan(optimizer, weight, grad_output, input, config) -> bool, and
# before_forward(optimizer, weight, input, amp) -> the forward's generation,
# None or NotImplemented (_ForgeOptimizer._forge_before_forward's result, or
# not taken: the Python method then runs).
run_plan = None
before_forward = None
_LOCK = threading.Lock()
_MODULE = None  # the built extension
_FAILED: str | None = None  # why it could not be built
# Off by $FORGE_TORCH_NATIVE=0 (read at import) or set_enabled(False).
_OFF: str | None = (f"${ENV_VAR}=0" if os.environ.get(ENV_VAR, "1").strip()
                    == "0" else None)


# (clip, bridge, direct, optim, ring type): the modules whose objects the
# native path reads, bound by the forge_torch package (this module imports
# none of them).
_BOUND: tuple | None = None


def bind(clip, bridge, direct, optim) -> None:
  """Names the modules the native path reads: ``forge_torch._clip``,
  ``_bridge``, ``_direct`` and ``optim`` (called once, by the package's
  ``__init__``)."""
  global _BOUND
  _BOUND = (clip, bridge, direct, optim, bridge._HparamsRing)


def unavailable() -> str | None:
  """Why updates do not take the native host path, or ``None``."""
  if run_plan is not None:
    return None
  if _OFF or _FAILED:
    return _OFF or _FAILED
  return ("off within forge_torch._hot.using(False)" if _MODULE is not None
          else "not built yet (it is built when the first kernel is "
          "launched directly)")


def ensure_built(build_directory: str | None = None) -> bool:
  """Builds and binds the native path, once per process and unless it is
  off, and puts it in use; whether it is in use. A later call changes
  nothing (:func:`set_enabled` and :func:`using` switch it); a build that
  fails leaves the Python path in use and says why (:func:`unavailable`)."""
  global run_plan, before_forward, _MODULE, _FAILED
  if _MODULE is not None or _FAILED is not None or _OFF is not None:
    return run_plan is not None
  with _LOCK:
    if _MODULE is None and _FAILED is None:
      try:
        if _BOUND is None:
          raise RuntimeError("forge_torch._hot.bind() was not called (the "
                             "forge_torch package calls it on import)")
        module = _load(build_directory)
        module.setup(*_BOUND)
      except Exception as e:  # noqa: BLE001 -- no compiler, ninja, headers
        _FAILED = (f"the native host path could not be built "
                   f"({type(e).__name__}: {str(e).strip()[:400]})")
        return False
      _MODULE = module
      run_plan, before_forward = module.run_plan, module.before_forward
  return run_plan is not None


def _switch(on: bool, build_directory: str | None = None) -> None:
  global run_plan, before_forward
  if not on:
    run_plan = before_forward = None
  elif _MODULE is None:
    ensure_built(build_directory)
  else:
    run_plan, before_forward = _MODULE.run_plan, _MODULE.before_forward


def _load(build_directory: str | None):
  from torch.utils import cpp_extension  # noqa: PLC0415
  if build_directory is not None:
    os.makedirs(build_directory, exist_ok=True)
  # torch runs `ninja` from $PATH, where the ninja wheel's (the torch
  # extra's) is not while its environment is not activated: its directory
  # is added for the build.
  path = os.environ.get("PATH", "")
  if shutil.which("ninja") is None:
    try:
      import ninja  # noqa: PLC0415
      bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
      bin_dir = os.path.dirname(sys.executable)
    os.environ["PATH"] = bin_dir + os.pathsep + path
  try:
    return cpp_extension.load(
        name=NAME, sources=[str(SOURCE)], extra_cflags=["-O2"],
        build_directory=build_directory, verbose=False)
  finally:
    os.environ["PATH"] = path


def set_enabled(enabled: bool) -> bool:
  """Turns the native path on or off for this process (off: the Python path
  runs every call); returns whether it was in use. Turning it on builds it
  now if it was not built yet; a build that failed stays failed."""
  global _OFF
  if not isinstance(enabled, bool):
    raise TypeError(f"set_native_path takes True or False, got {enabled!r}")
  was = run_plan is not None
  with _LOCK:
    _OFF = None if enabled else "turned off by forge_torch.set_native_path"
  _switch(enabled)
  return was


@contextlib.contextmanager
def using(enabled: bool, build_directory: str | None = None):
  """Within the block, the native path on (built first if it was not, where
  it can be and is not turned off: the block gets whether it is on) or
  off; after it, as it was before (for benchmarks and tests that compare
  the two paths in one process)."""
  global run_plan, before_forward
  saved = run_plan, before_forward
  _switch(enabled and _OFF is None, build_directory)
  try:
    yield run_plan is not None
  finally:
    run_plan, before_forward = saved
