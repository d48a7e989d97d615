"""FORGE for JAX: Flax layers whose backward applies the optimizer.

* :class:`Dense` -- a drop-in for ``flax.linen.Dense``;
* :func:`adamw` -- ``optax.adamw`` that also drives FORGE layers;
* :func:`make_step` -- the training step that ties them together.
"""

from forge_jax.dense import Dense
from forge_jax.step import make_step
from forge_jax.transforms import (
    ForgeSpec,
    ForgeTransformation,
    adagrad,
    adam,
    adamax,
    adamw,
    lion,
    nadam,
    nadamw,
    radam,
    rmsprop,
    sgd,
)
from pallas_kernels import classify

__all__ = ["Dense", "ForgeSpec", "ForgeTransformation", "adagrad", "adam",
           "adamax", "adamw", "classify", "lion", "make_step", "nadam",
           "nadamw", "radam", "rmsprop", "sgd"]
