"""The one registry of optimizer families.

Per family (:class:`Family`): its :class:`~pallas_kernels.regimes.Declaration`
(what its updates read, which fixes its regime), the factory of its kernel
rule in optax's operation order (:mod:`pallas_kernels.rules`) and in
``torch.optim``'s (:mod:`pallas_kernels.torch_rules`), the optax transform
and the ``torch.optim`` class that ``forge_jax`` and ``forge_torch`` mirror
for it, and the other names :func:`classify` accepts. Everything that lists
families reads this table: :func:`classify` and :data:`FAMILIES`,
``forge_jax``'s implemented transforms, ``forge_torch``'s rule lookups, the
tuner's ``--rule`` names and ``benchmarks/families.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Iterable, Mapping

from pallas_kernels import rules, torch_rules
from pallas_kernels.regimes import Declaration, Reads, Regime, regime_of
from pallas_kernels.rules import UpdateRule

__all__ = ["ALIASES", "FAMILIES", "Family", "REGISTRY", "classify", "get",
           "optax_rules"]

RuleFactory = Callable[..., UpdateRule]


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
  """One optimizer family.

  Attributes:
    name: the canonical name (lower case, ``_`` between words).
    declaration: what its state and weight updates read.
    optax_factory: makes its kernel rule in optax's operation order (keyword
      options pick a variant, e.g. ``nesterov=True``); ``None`` where it has
      none (regimes 3 and 4, or not written yet).
    torch_factory: the same in ``torch.optim``'s operation order; ``None``
      where it has none.
    optax: the optax transform whose arithmetic ``optax_factory`` follows and
      that ``forge_jax`` wraps under the same name (``forge_jax.<optax>``);
      for a family optax lacks (Scion, Adam-mini, AdaLomo), the name of the
      optax-style transform ``forge_jax`` defines for it; ``None`` where
      ``forge_jax`` has none.
    torch: the ``torch.optim`` class that ``forge_torch`` subclasses under
      the same name; ``None`` where ``forge_torch`` has none.
    aliases: other names :func:`classify` accepts for it.
    variants: named option sets of ``optax_factory`` that the tuner and the
      benchmarks cover beside the default rule, e.g.
      ``{"rmsprop_centered": {"centered": True}}``.
  """

  name: str
  declaration: Declaration
  optax_factory: RuleFactory | None = None
  torch_factory: RuleFactory | None = None
  optax: str | None = None
  torch: str | None = None
  aliases: tuple[str, ...] = ()
  variants: Mapping[str, Mapping[str, Any]] = dataclasses.field(
      default_factory=dict)

  @property
  def regime(self) -> Regime:
    """Its :class:`~pallas_kernels.regimes.Regime`."""
    return regime_of(self.declaration, self.name)

  def optax_rule(self, **options) -> UpdateRule:
    """Its rule in optax's operation order, ``optax_factory(**options)``.

    Raises:
      ValueError: the family has no optax-order rule.
    """
    if self.optax_factory is None:
      raise ValueError(f"the {self.name!r} family has no kernel rule in "
                       f"optax's order ({self.regime.reason})")
    return self.optax_factory(**options)

  def torch_rule(self, **options) -> UpdateRule:
    """Its rule in ``torch.optim``'s operation order,
    ``torch_factory(**options)``; an option left out takes torch's default
    (e.g. ``amsgrad=False``), as an optax-order rule's takes optax's.

    Raises:
      ValueError: the family has no torch-order rule.
    """
    if self.torch_factory is None:
      raise ValueError(f"the {self.name!r} family has no kernel rule in "
                       "torch.optim's order")
    return self.torch_factory(**options)

  @property
  def tuned_as(self) -> str | tuple[str, ...] | None:
    """The rule(s) whose tuned tilings its default rule takes where the cache
    has none of its own (:attr:`UpdateRule.tuned_as`; set by the factory,
    since a variant with more state may differ), or ``None``."""
    if self.optax_factory is None:
      return None
    return self.optax_rule().tuned_as


C, LS, LG, GG = (Reads.COORDINATE, Reads.LAYER_STATE, Reads.LAYER_GRADIENT,
                 Reads.GLOBAL_GRADIENT)


def _d(a, u, affine, note):
  return Declaration(frozenset(a), frozenset(u), affine, note)


_p = functools.partial

# Paper, Appendix I table (+ Section 2, Appendix A Definition 1). Adam and
# Adamax are not rows of that table; both are coordinate-wise (each
# coordinate's update reads only that coordinate's G and state), hence regime
# 1. global_norm_clip is the paper's regime-4 condition ("A reads a gradient
# statistic across layers", Appendix A; Section 5 "cross-layer statistics").
_ENTRIES = (
    Family("sgd", _d({C}, {C}, True, "W' = W - lr*(G + wd*W): affine in G, no state"),
           optax_factory=_p(rules.sgd_rule, momentum=False),
           torch_factory=_p(torch_rules.sgd_rule, momentum=False),
           optax="sgd", torch="SGD"),
    Family("sgd_momentum",
           _d({C}, {C}, True, "heavy ball b = mu*b + G: affine (Prop. 2(iii))"),
           optax_factory=_p(rules.sgd_rule, momentum=True),
           torch_factory=_p(torch_rules.sgd_rule, momentum=True),
           optax="sgd", torch="SGD",
           aliases=("sgdm", "momentum", "sgd_w_momentum", "sgd_with_momentum",
                    "heavy_ball")),
    Family("adagrad", _d({C}, {C}, False, "v += G^2: coordinate-wise, quadratic in G"),
           optax_factory=rules.adagrad_rule,
           torch_factory=torch_rules.adagrad_rule,
           optax="adagrad", torch="Adagrad"),
    Family("rmsprop",
           _d({C}, {C}, False, "v = a*v + (1-a)*G^2: coordinate-wise, quadratic"),
           optax_factory=rules.rmsprop_rule,
           torch_factory=torch_rules.rmsprop_rule,
           optax="rmsprop", torch="RMSprop",
           variants={"rmsprop_centered": {"centered": True}}),
    Family("adam", _d({C}, {C}, False, "m, v coordinate-wise; v quadratic in G"),
           optax_factory=rules.adam_rule, torch_factory=torch_rules.adam_rule,
           optax="adam", torch="Adam"),
    # torch's AdamW is its Adam with decoupled weight decay: the same rule.
    Family("adamw", _d({C}, {C}, False, "Adam + decoupled decay (reads W_pq only)"),
           optax_factory=rules.adamw_rule, torch_factory=torch_rules.adam_rule,
           optax="adamw", torch="AdamW",
           # NAdamW: AdamW's reads and writes, with the Nesterov term
           # (forge_jax.nadamw).
           aliases=("adam_w", "nadamw"),
           variants={"nadamw": {"nesterov": True}}),
    Family("adamax", _d({C}, {C}, False, "u = max(b2*u, |G|): coordinate-wise, not affine"),
           optax_factory=rules.adamax_rule,
           torch_factory=torch_rules.adamax_rule,
           optax="adamax", torch="Adamax"),
    Family("nadam", _d({C}, {C}, False, "Nesterov Adam: coordinate-wise moments"),
           optax_factory=_p(rules.adam_rule, nesterov=True),
           torch_factory=torch_rules.nadam_rule,
           optax="nadam", torch="NAdam"),
    Family("radam",
           _d({C}, {C}, False, "rectification term depends on the step count only"),
           optax_factory=rules.radam_rule, torch_factory=torch_rules.radam_rule,
           optax="radam", torch="RAdam"),
    # Lion: m' = b2*m + (1-b2)*G is affine, but U = sign(b1*m + (1-b1)*G) also
    # needs G (or the pre-update m) next to m', so accumulating straight into
    # m would need a second parameter-sized buffer: not marked affine.
    Family("lion",
           _d({C}, {C}, False, "sign of an interpolation of m and G; coordinate-wise"),
           optax_factory=rules.lion_rule, optax="lion"),
    Family("lamb",
           _d({C}, {C, LS}, False,
              "Adam moments; U reads ||W|| and ||update|| per layer (App. I)"),
           optax_factory=rules.lamb_rule, optax="lamb"),
    Family("muon",
           _d({C}, {C, LS}, True, "B = mu*B + G affine; Newton-Schulz over the matrix of B"),
           optax_factory=rules.muon_rule, optax="muon"),
    # Scion, Adam-mini and AdaLomo have no optax transform: forge_jax defines
    # an optax-style one under the family's name (same init/update contract).
    Family("scion",
           _d({C}, {C, LS}, True, "momentum EMA affine in G; U is an LMO over the matrix of S'"),
           optax_factory=rules.scion_rule, optax="scion"),
    Family("adam_mini",
           _d({C, LG}, {C, LS}, False, "A: block mean of G^2; U: its block's scalar"),
           optax="adam_mini", aliases=("adammini",)),
    Family("adafactor",
           _d({C, LG}, {C, LS}, False, "A: row/col sums of G^2; U: row and column of S'"),
           optax="adafactor"),
    Family("adalomo",
           _d({C, LG}, {C, LS}, False, "A: row/col sums of G^2 (factored); U: row/col of S'"),
           optax="adalomo"),
    Family("sm3",
           _d({C, LG}, {C, LS}, False, "A: row/col max of G^2 cover sets; U: row/col of S'"),
           optax="sm3"),
    # LARS: the trust ratio eta*||W|| / (||G|| + wd*||W||) scales the gradient
    # *before* it enters the momentum, so A reads ||G|| (App. I table "||G||,
    # per layer"; Section 2.2 "LARS ..., which reads ||G||"; App. A
    # Definition 1).
    Family("lars",
           _d({C, LS, LG}, {C, LS}, False,
              "momentum of trust-ratio-scaled G; ratio reads ||W||, ||G||"),
           optax="lars"),
    Family("global_norm_clip",
           _d({C, GG}, {C}, False, "G scaled by min(1, c/||G||_global) over all layers"),
           aliases=("global_norm_clipping", "clip_by_global_norm",
                    "clip_grad_norm", "global_clip")),
)

REGISTRY: Mapping[str, Family] = types.MappingProxyType(
    {f.name: f for f in _ENTRIES})
"""Every declared family, by canonical name, in the paper table's order."""

FAMILIES: Mapping[str, Declaration] = types.MappingProxyType(
    {f.name: f.declaration for f in _ENTRIES})
"""The declared families: canonical name -> :class:`Declaration`."""

ALIASES: Mapping[str, str] = types.MappingProxyType(
    {a: f.name for f in _ENTRIES for a in f.aliases})
"""Other accepted names -> canonical name."""


def _normalize(name: str) -> str:
  key = name.strip().lower().replace("-", "_").replace(" ", "_").strip("_")
  return ALIASES.get(key, key)


def get(name: str) -> Family:
  """The registered family called ``name`` (case-insensitive; ``-``, ``_``
  and space alike; aliases such as ``"clip_by_global_norm"``).

  Raises:
    ValueError: the name is not a known family.
  """
  family = REGISTRY.get(_normalize(name))
  if family is None:
    raise ValueError(f"unknown optimizer family {name!r}; known families: "
                     f"{', '.join(sorted(REGISTRY))} (or pass a Declaration)")
  return family


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
    return regime_of(family)
  if isinstance(family, str):
    return get(family).regime
  raise TypeError(f"classify() takes a family name or a Declaration, got "
                  f"{type(family).__name__}")


def optax_rules(regimes: Iterable[int] = (1, 2)) -> dict[str, UpdateRule]:
  """Every family's optax-order rule and its named variants, for families
  of the given regimes: ``{family or variant name: rule}``, in registry
  order (e.g. ``"nadam"``: ``adam_rule(nesterov=True)``)."""
  regimes = set(regimes)
  out = {}
  for f in _ENTRIES:
    if f.optax_factory is None or f.regime.number not in regimes:
      continue
    out[f.name] = f.optax_rule()
    for name, options in f.variants.items():
      out[name] = f.optax_rule(**options)
  return out
