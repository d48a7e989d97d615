"""FORGE kernels: fused weight-gradient + optimizer-update Pallas kernels.

No flax, optax or torch imports here: ``forge_jax`` and ``forge_torch`` are
thin framework layers over these kernels. The public names:

* :func:`fused_wgrad_update` -- the kernel (``G = x^T dy`` in registers, the
  rule applied in its epilogue, ``W`` and the slots updated in place);
  :func:`fused_wgrad_update_reference` -- its pure-``jnp`` reference;
  :func:`unfused_wgrad_update` -- the same step unfused (XLA's GEMM stores
  ``G``, the rule's elementwise update reads it; for a layer of a stack,
  :func:`stored_g_update` does, in place); :func:`stored_g_update` -- the
  kernel's epilogue alone, on a gradient already in memory;
  :class:`BlockConfig` -- its tiling (:class:`MosaicConfig` for the Mosaic
  GPU backend, ``backend="mosaic_gpu"``); :func:`select_config` -- the Triton
  tiling it picks (the autotune cache, else a heuristic);
  :func:`select_backend` -- the backend (and tiling) it takes without one
  (Mosaic GPU where the autotune cache measured it faster on this Hopper GPU,
  or, for a case it has no entry for, its nearest entry did; else Triton;
  ``$FORGE_BACKEND`` overrides), :func:`describe_backend` --
  which it takes for given arguments, and why; :func:`default_interpret` --
  whether it runs in Pallas interpret mode (no GPU; the first kernel run so
  gives an :class:`InterpretModeWarning`).
* :class:`UpdateRule` -- one optimizer family's elementwise epilogue, with
  ``pack(...)`` making its runtime hyperparameter vector (float32, length
  :data:`HPARAM_VECTOR_LEN`); the families' rule factories ``sgd_rule``,
  ``adagrad_rule``, ``rmsprop_rule``, ``adam_rule``, ``adamw_rule``,
  ``adamax_rule``, ``radam_rule``, ``lion_rule`` (regime 1), ``lamb_rule``,
  ``muon_rule``, ``scion_rule`` (regime 2); :data:`ADAMW` = ``adamw_rule()``;
  :mod:`pallas_kernels.torch_rules` -- the rules in ``torch.optim``'s order.
* :func:`wgrad_sqnorm` -- ``sum((x^T dy) ** 2)`` without storing ``x^T dy``
  (the first pass of global-norm clipping; :func:`wgrad_sqnorm_reference`
  its reference), and :func:`grad_scaled` -- a rule stepping from the
  clipped gradient, its factors in the hyperparameter vector.
* :func:`classify` -- a family's :class:`Regime` (which path it takes, an
  :class:`ExecutionPath`) from its :class:`Declaration` of what its updates
  read (:class:`Reads`); :data:`FAMILIES` -- the declared families;
  :mod:`pallas_kernels.families` -- the family registry (a :class:`Family`
  per family: declaration, rule factories, mirrored transforms).
* :mod:`pallas_kernels.quant` -- the reference of low-precision optimizer
  state (blocked int8/fp8 moments, stochastic rounding to bf16);
  :mod:`pallas_kernels.lowp` -- the same in the Triton kernel's epilogue (a
  slot passed as ``quant.Quantized(q, scale)``, ``stochastic_rounding=(seed,
  step)``).
* :mod:`pallas_kernels.tuning_cache` -- the cache of tuned tilings;
  :mod:`pallas_kernels.autotune` -- the tuner and its CLI.
"""

import importlib as _importlib

# Pallas modules that register a jit-key config option when first imported,
# which JAX otherwise imports lazily during the first pallas_call lowering:
# registering an option changes JAX's trace-cache key, so the first jitted
# step that ran a kernel would be traced and compiled a second time on its
# next call. Importing them up front keeps one compile per step.
for _name in ("jax._src.pallas.fuser",):
  try:
    _importlib.import_module(_name)
  except ImportError:  # another JAX version: nothing to pre-register
    pass

# Submodules reachable as attributes (pallas_kernels.families.REGISTRY, ...).
from pallas_kernels import families, lowp, quant, torch_rules, tuning_cache  # noqa: F401
from pallas_kernels.families import FAMILIES, Family, classify
from pallas_kernels.mosaic_kernel import MosaicConfig
from pallas_kernels.fused_wgrad import (
    BackendChoice,
    BlockConfig,
    default_interpret,
    describe_backend,
    fused_wgrad_update,
    fused_wgrad_update_reference,
    select_backend,
    select_config,
    stored_g_update,
    unfused_wgrad_update,
)
from pallas_kernels.interpret import InterpretModeWarning
from pallas_kernels.sqnorm_kernel import wgrad_sqnorm, wgrad_sqnorm_reference
from pallas_kernels.regimes import (
    Declaration,
    ExecutionPath,
    Reads,
    Regime,
)
from pallas_kernels.rules import (
    ADAMW,
    HPARAM_VECTOR_LEN,
    UpdateRule,
    adagrad_rule,
    adam_rule,
    adamax_rule,
    adamw_rule,
    grad_scaled,
    lamb_rule,
    lion_rule,
    muon_rule,
    scion_rule,
    radam_rule,
    rmsprop_rule,
    sgd_rule,
)

__all__ = [
    "ADAMW", "BackendChoice", "BlockConfig", "MosaicConfig", "Declaration", "ExecutionPath", "FAMILIES",
    "Family", "HPARAM_VECTOR_LEN", "InterpretModeWarning", "Reads", "Regime",
    "UpdateRule", "adagrad_rule", "adam_rule", "adamax_rule", "adamw_rule",
    "classify", "default_interpret", "describe_backend", "fused_wgrad_update",
    "fused_wgrad_update_reference", "lamb_rule", "lion_rule", "muon_rule", "scion_rule",
    "radam_rule", "rmsprop_rule", "select_backend", "select_config",
    "sgd_rule",
    "stored_g_update", "unfused_wgrad_update", "grad_scaled", "wgrad_sqnorm",
    "wgrad_sqnorm_reference",
]
