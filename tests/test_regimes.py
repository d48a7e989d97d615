"""The regime classifier (pallas_kernels.regimes) and the family registry's
declarations (pallas_kernels.families): family -> regime against the paper's
tables."""
import pytest

from pallas_kernels import (FAMILIES, Declaration, ExecutionPath, Reads, Regime,
                            classify)

# Written from the paper independently of the module: Appendix I table ("reg."
# column) for the thirteen measured/classified families plus Scion/Muon/LARS;
# Adam and Adamax from DESIGN.md section 1 (regime 1, coordinate-wise); global-norm
# clipping from Appendix A's regime-4 row ("A reads a gradient statistic across layers").
PAPER_TABLE = {
    "sgd": 1, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1, "adam": 1, "adamw": 1,
    "adamax": 1, "nadam": 1, "radam": 1, "lion": 1,
    "lamb": 2, "muon": 2, "scion": 2,
    "adam_mini": 3, "adafactor": 3, "adalomo": 3, "sm3": 3, "lars": 3,
    "global_norm_clip": 4,
}

PATHS = {1: ExecutionPath.EPILOGUE, 2: ExecutionPath.EPILOGUE_THEN_LAYER_PASS,
         3: ExecutionPath.DEFERRED_PER_LAYER, 4: ExecutionPath.AFTER_BACKWARD}

C, LS, LG, GG = Reads.COORDINATE, Reads.LAYER_STATE, Reads.LAYER_GRADIENT, Reads.GLOBAL_GRADIENT


def test_families_cover_exactly_the_paper_table():
  assert set(FAMILIES) == set(PAPER_TABLE)


@pytest.mark.parametrize("family,expected", sorted(PAPER_TABLE.items()))
def test_family_regime_matches_paper(family, expected):
  r = classify(family)
  assert isinstance(r, Regime)
  assert (r.family, r.number, r.path) == (family, expected, PATHS[expected])
  assert r.declaration is FAMILIES[family]
  assert f"regime {expected}" in r.reason and r.reason.endswith(".")


def test_paths_describe_what_each_regime_implies():
  assert "G never stored" in ExecutionPath.EPILOGUE.description
  assert "never reads G" in ExecutionPath.EPILOGUE_THEN_LAYER_PASS.description
  assert "one layer" in ExecutionPath.DEFERRED_PER_LAYER.description
  assert "whole backward" in ExecutionPath.AFTER_BACKWARD.description
  assert len({p.value for p in ExecutionPath}) == 4


@pytest.mark.parametrize("alias,family", [
    ("sgd-momentum", "sgd_momentum"), ("SGD_Momentum", "sgd_momentum"),
    ("global-norm-clipping", "global_norm_clip"), ("clip_by_global_norm", "global_norm_clip"),
    ("adam-mini", "adam_mini"), ("AdamW", "adamw"), ("  Muon ", "muon"), ("LAMB", "lamb"),
    ("NAdamW", "adamw"),  # forge_jax.nadamw / optax.nadamw: AdamW's reads and writes
])
def test_aliases_and_case(alias, family):
  assert classify(alias).family == family
  assert classify(alias).number == PAPER_TABLE[family]


def test_unknown_family_lists_known_ones():
  with pytest.raises(ValueError) as exc:
    classify("shampoo")
  msg = str(exc.value)
  assert "shampoo" in msg
  for name in PAPER_TABLE:
    assert name in msg


def test_non_string_rejected():
  with pytest.raises(TypeError):
    classify(3)


@pytest.mark.parametrize("state,update,expected", [
    ({C}, {C}, 1),                 # both tile-local
    ((), (), 1),                   # stateless, reads nothing beyond constants
    ({C}, {C, LS}, 2),             # U reads a layer of the state
    ({C, LG}, {C}, 3),             # A reads a layer gradient statistic
    ({C, LG}, {C, LS}, 3),         # ... and U a layer of state: still 3
    ({C}, {C, LG}, 3),             # U reading G == A writing it into state (App. A.1)
    ({C, LS}, {C}, 3),             # A reads a layer statistic of state: not tile-local
    ({C, GG}, {C}, 4),             # global-norm clipping
    ({C}, {C, GG}, 4),
    ({C, LG, GG}, {C, LS}, 4),     # global dominates
])
def test_custom_declaration_rule_branches(state, update, expected):
  r = classify(Declaration(state, update, False, "custom test"))
  assert (r.family, r.number, r.path) == ("custom", expected, PATHS[expected])
  assert isinstance(r.declaration.state_reads, frozenset)


def test_declaration_is_frozen_and_validated():
  d = Declaration({C}, {C}, True, "x")
  import dataclasses
  with pytest.raises(dataclasses.FrozenInstanceError):
    d.affine_in_grad = False
  with pytest.raises(TypeError):
    Declaration({"coordinate"}, {C}, False, "")
  assert Declaration(C, LS, False, "").update_reads == frozenset({LS})
  for bad in (None, "coordinate", 3):
    with pytest.raises(TypeError, match=r"Declaration.state_reads must be a "
                       r"Reads member or a collection of them"):
      Declaration(bad, {C}, False, "")


def test_affine_in_grad():
  assert FAMILIES["sgd_momentum"].affine_in_grad is True
  assert FAMILIES["muon"].affine_in_grad is True
  assert FAMILIES["sgd"].affine_in_grad is True
  assert FAMILIES["scion"].affine_in_grad is True
  for name in ("adam", "adamw", "adagrad", "lamb", "adafactor", "lars", "global_norm_clip"):
    assert FAMILIES[name].affine_in_grad is False, name


def test_lars_state_update_reads_gradient_norm():
  # Paper App. I: LARS "A reads ||G||, per layer" -> the deferred path.
  assert LG in FAMILIES["lars"].state_reads
  assert LG not in FAMILIES["lamb"].state_reads and LS in FAMILIES["lamb"].update_reads


# --- the family registry ------------------------------------------------------


def test_registry_is_the_one_list_of_families():
  from pallas_kernels import families
  assert list(FAMILIES) == list(families.REGISTRY)
  for name, f in families.REGISTRY.items():
    assert f.name == name and FAMILIES[name] is f.declaration
    assert classify(name) == f.regime
    for alias in f.aliases:
      assert families.ALIASES[alias] == name
      assert classify(alias).family == name
  with pytest.raises(TypeError):
    families.REGISTRY["sgd"] = None  # read-only views
  with pytest.raises(TypeError):
    FAMILIES["sgd"] = None


def test_registry_rules_fit_their_regime():
  """A regime-1 rule updates the weight in the epilogue; a regime-2 rule
  advances the state only; regimes 3 and 4 have no kernel rule."""
  from pallas_kernels import families
  for name, f in families.REGISTRY.items():
    n = f.regime.number
    if f.optax is not None and n <= 2:  # forge_jax fuses it: it has a rule
      assert f.optax_factory is not None, name
    if n > 2:
      assert f.optax_factory is None and f.torch_factory is None, name
    if f.torch_factory is not None:  # (its rules: tests/test_torch_families.py)
      assert n == 1, name
    if f.optax_factory is None:
      with pytest.raises(ValueError, match=name):
        f.optax_rule()
      continue
    assert f.optax_rule().updates_weight == (n == 1), name
  rules = families.optax_rules()
  assert rules["nadam"].name == "adam_nesterov"
  assert rules["nadamw"].name == "adamw_nesterov"
  assert rules["rmsprop_centered"].name == "rmsprop_centered"
  assert set(families.optax_rules(regimes=(1,))) == set(rules) - {
      "lamb", "muon", "scion"}


def test_registry_tuning_alias():
  from pallas_kernels import families
  assert families.get("adam").tuned_as == "adamw"
  assert families.get("NAdam").tuned_as == "adamw"
  assert families.get("adamw").tuned_as is None  # tuned under its own name
  assert families.get("lion").tuned_as is None
  assert families.get("adafactor").tuned_as is None  # no kernel rule
