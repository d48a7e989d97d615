"""FORGE for JAX: Flax layers whose backward applies the optimizer.

* :class:`Dense` -- a drop-in for ``flax.linen.Dense``;
* :class:`DenseGeneral` -- a drop-in for ``flax.linen.DenseGeneral`` when it
  is one GEMM (no ``batch_dims``, trailing contracted axes);
* :class:`ScannedDenseStack` -- ``L`` Dense layers stacked as ``nn.scan``
  stacks them, whose backward updates the stacked kernel and slots in place;
* :class:`ScannedBlocks` -- ``L`` copies of any block (a decoder layer) stacked
  and scanned, whose backward updates the stacked kernels of the block's
  FORGE Dense layers, and their slots, in place;
* :func:`adamw` (and the other optax families below) -- the optax transform
  itself, plus what FORGE layers need to drive it;
* :func:`make_step` -- the training step that ties them together (with
  ``convert=True``, an unmodified model's ``nn.Dense`` and
  ``nn.DenseGeneral`` layers run as FORGE layers: ``docs/adopting.md``);
* :func:`clip_by_global_norm` -- ``optax.clip_by_global_norm``, chained
  before a forge_jax transform: ``make_step`` then runs each step in two
  passes, a norm pass and the clipped fused update (``docs/clipping.md``);
* :class:`MeshLayout` -- where the step's arrays live on a device mesh
  (data-, tensor- and fully-sharded parallel: ``make_step(...,
  mesh_layout=...)``);
* :func:`MultiSteps` -- gradient accumulation over K micro-batches (the
  FORGE ``optax.MultiSteps``: an fp32 accumulator per kernel, or straight
  into SGD's momentum);
* :func:`classify`, :func:`refuse_reason` -- which regime a family is in, and
  why forge_jax refuses one (global-norm clipping: regime 4);
* ``forge_jax.nnx`` -- the same for Flax NNX (``forge_jax.nnx.Linear``,
  ``Optimizer``, ``make_step``, ``convert``), imported on first use.

Asking for a known family that forge_jax does not provide (e.g.
``forge_jax.global_norm_clip``, the regime-4 family, which runs only as
:func:`clip_by_global_norm` in a chain) raises an ``AttributeError`` that
says why.
"""

# Importing the layer modules (blocks, dense, scan) registers their fused
# backward functions with the single-use check (forge_jax._usage), which
# make_step runs; the check itself imports no layer.
from forge_jax._sharding import MeshLayout
from forge_jax.accumulate import MultiSteps
from forge_jax.blocks import ScannedBlocks
from forge_jax.clip import clip_by_global_norm
from forge_jax.dense import Dense
from forge_jax.dense_general import DenseGeneral
from forge_jax.scan import ScannedDenseStack
from forge_jax._convert import ConvertSkipWarning
from forge_jax.step import SharedWeightsWarning, make_step
from forge_jax.transforms import (
    ForgeSpec,
    ForgeTransformation,
    adafactor,
    adagrad,
    adalomo,
    adam,
    adam_mini,
    adamax,
    adamw,
    lamb,
    lars,
    lion,
    muon,
    nadam,
    nadamw,
    radam,
    refuse_reason,
    rmsprop,
    scion,
    sgd,
    sm3,
)
from pallas_kernels import classify

__all__ = ["clip_by_global_norm", "Dense", "DenseGeneral", "MeshLayout", "MultiSteps", "ForgeSpec", "ForgeTransformation", "ScannedBlocks",
           "ConvertSkipWarning", "ScannedDenseStack", "SharedWeightsWarning",
           "adafactor", "adagrad", "adam", "adamax", "adamw", "classify",
           "lamb", "lion", "make_step", "muon", "nadam", "nadamw", "radam", "refuse_reason",
           "rmsprop", "sgd", "sm3", "adalomo", "adam_mini", "lars", "scion"]


def __getattr__(name):
  if name == "nnx":  # imported on first use: flax.nnx adds to import time
    import importlib
    return importlib.import_module("forge_jax.nnx")
  # A known optimizer family (or alias) that forge_jax does not provide gets
  # the reason, e.g. forge_jax.global_norm_clip -> regime 4, two passes.
  if not name.startswith("_"):
    import pallas_kernels
    try:
      pallas_kernels.classify(name)
    except (ValueError, TypeError):
      pass
    else:
      reason = refuse_reason(name)
      if reason is None:  # implemented, under its canonical name
        family = pallas_kernels.classify(name).family
        use = ("forge_jax.sgd(learning_rate, momentum=...)"
               if family == "sgd_momentum" else f"forge_jax.{family}(...)")
        reason = f"the {family!r} family is implemented as {use}"
      raise AttributeError(f"forge_jax has no {name!r}: {reason}")
  raise AttributeError(f"module 'forge_jax' has no attribute {name!r}")
