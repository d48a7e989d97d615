"""Classify optimizer families into FORGE's four regimes (paper, Appendix A.2).

A step is a state update ``S' = A(S, G)`` then a weight update ``W' = U(W, S')``.
The regime follows from what ``A`` and ``U`` *read*, declared per family, and
fixes how much of the gradient ``G`` must ever be resident (Appendix A table).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Reads", "Declaration", "ExecutionPath", "Regime", "FAMILIES", "ALIASES", "classify"]


class Reads(enum.Enum):
    """What a state or weight update reads beyond constants and hyperparameters."""
    COORDINATE = "the coordinate's own gradient, state and weight"
    LAYER_STATE = "a row/matrix/layer statistic of the state or weights (never of G)"
    LAYER_GRADIENT = "a statistic of one layer's gradient (row/col sums, block means, ||G||)"
    GLOBAL_GRADIENT = "a gradient statistic across layers (e.g. global-norm clipping)"


C, LS, LG, GG = Reads.COORDINATE, Reads.LAYER_STATE, Reads.LAYER_GRADIENT, Reads.GLOBAL_GRADIENT


@dataclass(frozen=True)
class Declaration:
    """What an optimizer's state update ``A`` and weight update ``U`` read.

    Args:
        state_reads: ``Reads`` values that ``A`` reads (any iterable; stored as frozenset).
        update_reads: ``Reads`` values that ``U`` reads.
        affine_in_grad: ``A(S, G) = A0(S) + c*G`` on the persistent state, so
            micro-batch gradients can be accumulated straight into the state.
        note: free-text justification (paper reference).
    """
    state_reads: frozenset
    update_reads: frozenset
    affine_in_grad: bool = False
    note: str = ""

    def __post_init__(self):
        for name in ("state_reads", "update_reads"):
            value = getattr(self, name)
            value = frozenset([value] if isinstance(value, Reads) else value)
            bad = [r for r in value if not isinstance(r, Reads)]
            if bad:
                raise TypeError(f"Declaration.{name} must contain Reads members, got {bad!r}")
            object.__setattr__(self, name, value)


class ExecutionPath(enum.Enum):
    """Where the optimizer step runs; the value is a one-line description."""
    EPILOGUE = "optimizer applied in the weight-gradient kernel's epilogue; G never stored"
    EPILOGUE_THEN_LAYER_PASS = ("state updated in the epilogue; a per-layer pass over the "
                                "state/weights then forms the update; never reads G")
    DEFERRED_PER_LAYER = ("the layer's G is formed, consumed and freed inside that layer's "
                          "backward; at most one layer's gradient live")
    AFTER_BACKWARD = "needs every layer's gradient: the standard path, after the whole backward"

    @property
    def description(self) -> str:
        """The one-line description of this path."""
        return self.value


PATH_FOR_REGIME = {1: ExecutionPath.EPILOGUE, 2: ExecutionPath.EPILOGUE_THEN_LAYER_PASS,
                   3: ExecutionPath.DEFERRED_PER_LAYER, 4: ExecutionPath.AFTER_BACKWARD}


@dataclass(frozen=True)
class Regime:
    """The classification of one family: regime number, execution path and why."""
    family: str
    number: int
    path: ExecutionPath
    declaration: Declaration
    reason: str


def _d(a, u, affine, note):
    return Declaration(frozenset(a), frozenset(u), affine, note)


# Paper, Appendix I table (+ Section 2, Appendix A Definition 1). Adam and Adamax
# are not rows of that table; both are coordinate-wise (each coordinate's update
# reads only that coordinate's G and state), hence regime 1. global_norm_clip is the paper's regime-4 condition ("A reads a
# gradient statistic across layers", Appendix A; Section 5 "cross-layer statistics").
FAMILIES: dict[str, Declaration] = {
    "sgd": _d({C}, {C}, True, "W' = W - lr*(G + wd*W): affine in G, no state"),
    "sgd_momentum": _d({C}, {C}, True, "heavy ball b = mu*b + G: affine (Prop. 2(iii))"),
    "adagrad": _d({C}, {C}, False, "v += G^2: coordinate-wise, quadratic in G"),
    "rmsprop": _d({C}, {C}, False, "v = a*v + (1-a)*G^2: coordinate-wise, quadratic"),
    "adam": _d({C}, {C}, False, "m, v coordinate-wise; v quadratic in G"),
    "adamw": _d({C}, {C}, False, "Adam + decoupled decay (reads W_pq only)"),
    "adamax": _d({C}, {C}, False, "u = max(b2*u, |G|): coordinate-wise, not affine"),
    "nadam": _d({C}, {C}, False, "Nesterov Adam: coordinate-wise moments"),
    "radam": _d({C}, {C}, False, "rectification term depends on the step count only"),
    # Lion: m' = b2*m + (1-b2)*G is affine, but U = sign(b1*m + (1-b1)*G) also
    # needs G (or the pre-update m) next to m', so accumulating straight into m
    # would need a second parameter-sized buffer: not marked affine.
    "lion": _d({C}, {C}, False, "sign of an interpolation of m and G; coordinate-wise"),
    "lamb": _d({C}, {C, LS}, False, "Adam moments; U reads ||W|| and ||update|| per layer (App. I)"),
    "muon": _d({C}, {C, LS}, True, "B = mu*B + G affine; Newton-Schulz over the matrix of B"),
    "scion": _d({C}, {C, LS}, True, "momentum EMA affine in G; U is an LMO over the matrix of S'"),
    "adam_mini": _d({C, LG}, {C, LS}, False, "A: block mean of G^2; U: its block's scalar"),
    "adafactor": _d({C, LG}, {C, LS}, False, "A: row/col sums of G^2; U: row and column of S'"),
    "adalomo": _d({C, LG}, {C, LS}, False, "A: row/col sums of G^2 (factored); U: row/col of S'"),
    "sm3": _d({C, LG}, {C, LS}, False, "A: row/col max of G^2 cover sets; U: row/col of S'"),
    # LARS: the trust ratio eta*||W|| / (||G|| + wd*||W||) scales the gradient
    # *before* it enters the momentum, so A reads ||G|| (App. I table "||G||, per
    # layer"; Section 2.2 "LARS ..., which reads ||G||"; App. A Definition 1).
    "lars": _d({C, LS, LG}, {C, LS}, False, "momentum of trust-ratio-scaled G; ratio reads ||W||, ||G||"),
    "global_norm_clip": _d({C, GG}, {C}, False, "G scaled by min(1, c/||G||_global) over all layers"),
}

ALIASES: dict[str, str] = {
    "sgdm": "sgd_momentum", "momentum": "sgd_momentum", "sgd_w_momentum": "sgd_momentum",
    "sgd_with_momentum": "sgd_momentum", "heavy_ball": "sgd_momentum",
    "adammini": "adam_mini", "adam_w": "adamw",
    # NAdamW: AdamW's reads and writes, with the Nesterov term (forge_jax.nadamw).
    "nadamw": "adamw",
    "global_norm_clipping": "global_norm_clip", "clip_by_global_norm": "global_norm_clip",
    "clip_grad_norm": "global_norm_clip", "global_clip": "global_norm_clip",
}


def _normalize(name: str) -> str:
    key = name.strip().lower().replace("-", "_").replace(" ", "_").strip("_")
    return ALIASES.get(key, key)


def _rule(decl: Declaration) -> tuple[int, str]:
    """Apply the regime rule to a declaration; return (number, reason)."""
    if GG in decl.state_reads or GG in decl.update_reads:
        return 4, "it reads a gradient statistic across layers, so it can run only after the whole backward"
    # U reading G is indistinguishable from A writing G into state (App. A.1), so
    # a layer-gradient statistic read by either side is regime 3.
    if LG in decl.state_reads or LG in decl.update_reads:
        return 3, ("its state update reads a statistic of one layer's gradient, which no tile can close, "
                   "so it runs deferred inside that layer's backward")
    # Interpretation: the paper's regimes 1-2 require A tile-local (Definition 1:
    # reads only the matching coordinate of S, G, W); an A reading a layer
    # statistic of state/weights is not tile-local and the paper documents no
    # such case as regime 2, so it is conservatively deferred per layer (regime 3).
    if LS in decl.state_reads:
        return 3, ("its state update reads a layer statistic of the state/weights, so it is not tile-local "
                   "and runs deferred inside that layer's backward")
    if LS in decl.update_reads:
        return 2, ("its state update is tile-local but its weight update reads a row/matrix/layer of the "
                   "state, so the state is updated in the epilogue and the weights in a per-layer pass")
    return 1, "its state and weight updates are both tile-local, so the whole step fuses into the epilogue"


def classify(family: str | Declaration) -> Regime:
    """Classify an optimizer family (or a custom declaration) into its FORGE regime.

    Args:
        family: a known family name (case-insensitive; ``-``/``_``/space alike;
            aliases such as ``"clip_by_global_norm"``), or a ``Declaration``
            for a user-defined optimizer (reported as family ``"custom"``).

    Returns:
        A ``Regime`` with the number (1-4), its ``ExecutionPath`` and a reason.

    Raises:
        ValueError: the name is not a known family.
        TypeError: ``family`` is neither a string nor a ``Declaration``.
    """
    if isinstance(family, Declaration):
        name, decl = "custom", family
    elif isinstance(family, str):
        name = _normalize(family)
        if name not in FAMILIES:
            raise ValueError(f"unknown optimizer family {family!r}; known families: "
                             f"{', '.join(sorted(FAMILIES))} (or pass a Declaration)")
        decl = FAMILIES[name]
    else:
        raise TypeError(f"classify() takes a family name or a Declaration, got {type(family).__name__}")
    number, why = _rule(decl)
    return Regime(name, number, PATH_FOR_REGIME[number], decl, f"{name} is regime {number}: {why}.")
