"""FORGE kernels: fused weight-gradient + optimizer-update Pallas kernels.

No flax, optax or torch imports here: ``forge_jax`` and ``forge_torch`` are
thin framework layers over these kernels.
"""

from pallas_kernels.fused_wgrad import (
    BlockConfig,
    default_interpret,
    fused_wgrad_update,
    fused_wgrad_update_reference,
    select_config,
)
from pallas_kernels.regimes import (
    Declaration,
    ExecutionPath,
    FAMILIES,
    Reads,
    Regime,
    classify,
)
from pallas_kernels.rules import (
    ADAMW,
    HPARAM_VECTOR_LEN,
    UpdateRule,
    adagrad_rule,
    adam_rule,
    adamax_rule,
    adamw_rule,
    lamb_rule,
    lion_rule,
    muon_rule,
    radam_rule,
    rmsprop_rule,
    sgd_rule,
)

__all__ = [
    "ADAMW", "BlockConfig", "Declaration", "ExecutionPath", "FAMILIES",
    "HPARAM_VECTOR_LEN", "Reads", "Regime", "UpdateRule", "adagrad_rule",
    "adam_rule", "adamax_rule", "adamw_rule", "classify", "default_interpret",
    "fused_wgrad_update", "fused_wgrad_update_reference", "lamb_rule",
    "lion_rule", "muon_rule", "radam_rule", "rmsprop_rule", "select_config", "sgd_rule",
]
