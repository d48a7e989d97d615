"""Whether the kernels run compiled or in Pallas interpret mode.

Without a GPU the kernels run in Pallas interpret mode: the same results,
far slower. The first kernel that runs so because no GPU was found (not
because its caller passed ``interpret=True``) gives one
:class:`InterpretModeWarning` per process.
"""

from __future__ import annotations

import warnings

import jax

__all__ = ["InterpretModeWarning", "default_interpret", "warn_interpret_once"]


class InterpretModeWarning(UserWarning):
  """A kernel runs in Pallas interpret mode because no GPU was found."""


_warned = False


def default_interpret() -> bool:
  """Pallas interpret mode unless the default backend is a GPU."""
  return jax.default_backend() != "gpu"


def warn_interpret_once() -> None:
  """Gives the :class:`InterpretModeWarning` if this process has not yet."""
  global _warned
  if _warned:
    return
  _warned = True
  warnings.warn(
      f"no GPU found (JAX's default backend is {jax.default_backend()!r}): "
      "the pallas_kernels kernels run in Pallas interpret mode, which gives "
      "the same results but is far slower. Run on a GPU for speed; to "
      "silence this notice, pass interpret=True or filter "
      "pallas_kernels.InterpretModeWarning.", InterpretModeWarning,
      stacklevel=4)
