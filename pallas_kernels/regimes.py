"""Classify optimizer families into FORGE's four regimes (paper, Appendix A.2).

A step is a state update ``S' = A(S, G)`` then a weight update ``W' = U(W, S')``.
The regime follows from what ``A`` and ``U`` *read*, declared per family
(:class:`Declaration`), and fixes how much of the gradient ``G`` must ever be
resident (Appendix A table). :func:`regime_of` is that rule; the declared
families and :func:`pallas_kernels.classify` (by name) are in the family
registry, :mod:`pallas_kernels.families`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Reads", "Declaration", "ExecutionPath", "Regime", "PATH_FOR_REGIME",
           "regime_of"]


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

  Raises:
    TypeError: a read that is not a ``Reads`` member.
  """
  state_reads: frozenset
  update_reads: frozenset
  affine_in_grad: bool = False
  note: str = ""

  def __post_init__(self):
    for name in ("state_reads", "update_reads"):
      value = getattr(self, name)
      if isinstance(value, (str, bytes)) or not (
          isinstance(value, Reads) or hasattr(value, "__iter__")):
        raise TypeError(f"Declaration.{name} must be a Reads member or a "
                        f"collection of them, got {value!r}")
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


def regime_of(declaration: Declaration, family: str = "custom") -> Regime:
  """The regime of an optimizer that reads what ``declaration`` says.

  Args:
    declaration: what its state and weight updates read.
    family: its name, as the ``Regime`` reports it (``"custom"`` for a
      user-defined optimizer).

  Returns:
    A ``Regime`` with the number (1-4), its ``ExecutionPath`` and a reason.

  Raises:
    TypeError: ``declaration`` is not a ``Declaration``.
  """
  if not isinstance(declaration, Declaration):
    raise TypeError(f"regime_of() takes a Declaration, got {type(declaration).__name__}")
  number, why = _rule(declaration)
  return Regime(family, number, PATH_FOR_REGIME[number], declaration,
                f"{family} is regime {number}: {why}.")
