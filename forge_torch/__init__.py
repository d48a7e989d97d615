"""FORGE for PyTorch: ``nn.Linear`` layers whose backward applies the optimizer.

* :class:`Linear` -- a drop-in for ``torch.nn.Linear``;
* :func:`convert` -- turns a model's eligible ``nn.Linear`` layers into it;
* :func:`set_sync_mode` / :func:`get_sync_mode` -- how the fused update is
  ordered with torch's CUDA stream (``"stream"``, the default, or ``"host"``;
  process default from ``$FORGE_TORCH_SYNC``) where it goes through DLPack;
* :func:`set_direct_launch` -- on a Hopper GPU the Mosaic GPU kernel is
  launched straight on the torch tensors, without JAX at call time (on by
  default; ``$FORGE_TORCH_DIRECT=0`` or ``set_direct_launch(False)`` turns it
  off);
* :func:`set_native_path` -- an update that repeats its weight's last one
  (every update of a managed layer from its third step on, but a param
  group's first in each step) runs its checks and direct launch in C++,
  compiled with the first direct launch (on by default where it can be
  built; ``$FORGE_TORCH_NATIVE=0`` or ``set_native_path(False)`` keeps them
  in Python);
* :class:`SGD`, :class:`Adagrad`, :class:`RMSprop`, :class:`Adam`,
  :class:`AdamW`, :class:`Adamax`, :class:`NAdam`, :class:`RAdam` -- the
  ``torch.optim`` optimizers of those names, driving those layers (gradient
  accumulation over K micro-batches: ``optimizer.accumulate_steps = K``;
  ``torch.autocast(dtype=torch.bfloat16)`` works on the layers);
* :mod:`forge_torch.distributed` -- ``prepare_ddp`` / ``wrap_ddp``: training
  under ``DistributedDataParallel``, the managed weights' gradients averaged
  over the ranks one layer at a time before their update; ``prepare_fsdp``:
  under FSDP2's ``fully_shard``, each rank's shard updated as FSDP
  reduce-scatters its gradient;
* :class:`ConvertSkipWarning` -- :func:`convert` left layers on the
  standard path (``convert(...).skipped`` says why);
* :func:`is_forge_weight` -- whether a parameter is a ``forge_torch.Linear``
  weight; ``bridge_stats`` -- the bridge's counters (calls, in-place writes,
  copies back), as ``benchmarks/torch_memory.py`` reports them.

The fused kernel is the JAX/Pallas one (``pallas_kernels``): launched
directly on the torch tensors where it is the Mosaic GPU kernel
(:mod:`forge_torch._direct`), else called on them through DLPack
(:mod:`forge_torch._bridge`). torch is an
optional dependency of the project: only this package imports it.

Importing this package wraps ``torch.nn.utils.clip_grad_norm_``,
``clip_grad_value_`` and ``clip_grads_with_norm_`` so that they raise, instead
of silently skipping, when given a weight whose update FORGE already applied
in backward (:mod:`forge_torch._clip`); other calls are unchanged.

Importing this package sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless
set) so that JAX, sharing the GPU with torch, does not reserve 75% of its
memory; it only takes effect if JAX has not initialised its GPU backend yet.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
  import torch  # noqa: F401
except ImportError as e:
  raise ImportError(
      "forge_torch needs PyTorch, an optional dependency of forge-jax: "
      "install it with the torch extra (from a clone: pip install "
      "'.[torch]'), or pip install torch") from e

from forge_torch._bridge import STATS as bridge_stats  # noqa: E402
from forge_torch._bridge import get_sync_mode, set_sync_mode  # noqa: E402
from forge_torch._direct import set_enabled as set_direct_launch  # noqa: E402
from forge_torch._hot import set_enabled as set_native_path  # noqa: E402
from forge_torch import _bridge, _clip, _direct, _hot  # noqa: E402
from forge_torch import distributed  # noqa: E402
from forge_torch import optim  # noqa: E402
from forge_torch.linear import (  # noqa: E402
    ConvertSkipWarning,
    Linear,
    convert,
    is_forge_weight,
)
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

_clip.install()
_hot.bind(_clip, _bridge, _direct, optim)

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Adamax", "ConvertSkipWarning",
           "Linear", "NAdam", "RAdam", "RMSprop", "bridge_stats", "convert",
           "distributed",
           "get_sync_mode", "is_forge_weight", "set_direct_launch",
           "set_native_path", "set_sync_mode"]
