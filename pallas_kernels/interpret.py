"""Whether the kernels run compiled or in Pallas interpret mode.

Without a GPU the kernels run in Pallas interpret mode: the same results,
far slower. The first kernel that runs so because no GPU was found (not
because its caller passed ``interpret=True``) gives one
:class:`InterpretModeWarning` per process.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

__all__ = ["InterpretModeWarning", "default_interpret", "check_interpret",
           "warn_interpret_once"]


class InterpretModeWarning(UserWarning):
  """A kernel runs in Pallas interpret mode because no GPU was found."""


_warned = False


def default_interpret() -> bool:
  """Pallas interpret mode unless the default backend is a GPU."""
  return jax.default_backend() != "gpu"


def check_interpret(interpret, where: str) -> bool | None:
  """``interpret`` if it is ``True``, ``False`` or ``None``.

  Args:
    interpret: the caller's ``interpret=`` argument.
    where: the function whose argument it is, for the error.

  Returns:
    ``interpret`` as a ``bool``, or ``None`` (interpret mode when there is no
    GPU).

  Raises:
    TypeError: anything else (a string such as ``"false"``, a number), which
      would otherwise be read by its truth.
  """
  if interpret is None:
    return None
  if not isinstance(interpret, (bool, np.bool_)):
    raise TypeError(
        f"{where}(interpret=...) takes True, False or None (None: interpret "
        f"mode when there is no GPU); got {interpret!r}")
  return bool(interpret)


def warn_interpret_once() -> None:
  """Gives the :class:`InterpretModeWarning` if this process has not yet."""
  global _warned
  if _warned:
    return
  _warned = True
  warnings.warn(
      f"no GPU found (JAX's default backend is {jax.default_backend()!r}): "
      "the pallas_kernels kernels run in Pallas interpret mode, which gives "
      "the same results but is far slower. Run on a GPU for speed (on an "
      "NVIDIA GPU JAX needs its CUDA plugin: pip install 'jax[cuda13]', "
      "or forge-jax's cuda extra); to silence this notice, pass "
      "interpret=True or filter "
      "pallas_kernels.InterpretModeWarning.", InterpretModeWarning,
      stacklevel=4)
