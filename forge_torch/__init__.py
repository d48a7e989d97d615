"""FORGE for PyTorch: ``nn.Linear`` layers whose backward applies the optimizer.

* :class:`Linear` -- a drop-in for ``torch.nn.Linear``;
* :func:`convert` -- turns a model's eligible ``nn.Linear`` layers into it;
* :func:`set_sync_mode` / :func:`get_sync_mode` -- how the fused update is
  ordered with torch's CUDA stream (``"stream"``, the default, or ``"host"``;
  process default from ``$FORGE_TORCH_SYNC``);
* :class:`SGD`, :class:`Adagrad`, :class:`RMSprop`, :class:`Adam`,
  :class:`AdamW`, :class:`Adamax`, :class:`NAdam`, :class:`RAdam` -- the
  ``torch.optim`` optimizers of those names, driving those layers;
* :func:`is_forge_weight` -- whether a parameter is a ``forge_torch.Linear``
  weight; ``bridge_stats`` -- the bridge's counters (calls, in-place writes,
  copies back), as ``benchmarks/torch_memory.py`` reports them.

The fused kernel is the JAX/Pallas one (``pallas_kernels``), called on the
torch tensors through DLPack (:mod:`forge_torch._bridge`). torch is an
optional dependency of the project: only this package imports it.

Importing this package sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless
set) so that JAX, sharing the GPU with torch, does not reserve 75% of its
memory; it only takes effect if JAX has not initialised its GPU backend yet.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from forge_torch._bridge import STATS as bridge_stats  # noqa: E402
from forge_torch._bridge import get_sync_mode, set_sync_mode  # noqa: E402
from forge_torch.linear import Linear, convert, is_forge_weight  # noqa: E402
from forge_torch.optim import (  # noqa: E402
    SGD,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    NAdam,
    RAdam,
    RMSprop,
)

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Adamax", "Linear", "NAdam",
           "RAdam", "RMSprop", "bridge_stats", "convert", "get_sync_mode",
           "is_forge_weight", "set_sync_mode"]
