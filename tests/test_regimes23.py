"""Regimes 2 and 3 (LAMB, Muon; Adafactor, SM3) against optax, and regime 4.

* 20 training steps of the 37 -> 70 -> 130 -> 5 MLP (batch 48, fp32, odd
  widths): ``forge_jax.Dense`` + ``forge_jax.<family>`` + ``make_step``
  against ``flax.linen.Dense`` + the optax transform, every parameter and
  every optimizer-state leaf within 1e-5 relative;
* the paths themselves, read off the step's jaxpr: regime 2 runs the fused
  kernel and never forms a kernel-shaped ``G`` (no ``dot_general`` contracts
  the token axis into a kernel-shaped output); regime 3 forms exactly one per
  FORGE layer, inside that layer's backward;
* Remark 1 (an untouched layer) on the regime-2 and -3 paths;
* regime 4 (global-norm clipping) is refused, and says why.
"""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import forge_jax
import pallas_kernels as pk
from tests import harness
from tests.harness import (MLP, WIDTHS, lower_rule_for_cuda, reference_step,
                           run_reference, train_side_by_side,
                           triton_calls)
from tests.harness import decay_kernels_only as _decay_kernels_only
from tests.harness import mse as _mse
from tests.tolerances import assert_update_close, rel_err, tol, worst_leaf

F32_TOL = tol(jnp.float32)
STEPS = 20
BT = 48  # tokens per step; no kernel dimension has this size
KERNEL_SHAPES = {(a, b) for a, b in zip(WIDTHS[:-1], WIDTHS[1:])}


def _schedule(base):
  return optax.linear_schedule(base, base / 10, STEPS)


# name -> (forge_jax family, optax transform, args, kwargs). A learning-rate
# schedule wherever the optax transform accepts one (optax.sm3 does not).
VARIANTS = {
    "lamb": ("lamb", optax.lamb, (_schedule(1e-2),),
             dict(weight_decay=1e-2, mask=_decay_kernels_only)),
    "muon": ("muon", optax.contrib.muon, (_schedule(2e-2),),
             dict(weight_decay=1e-2, weight_decay_mask=_decay_kernels_only)),
    "muon_no_nesterov_adaptive_rms": (
        "muon", optax.contrib.muon, (_schedule(2e-2),),
        dict(nesterov=False, adaptive=True, consistent_rms=0.2)),
    # optax.adafactor() as it comes: no learning rate, and with its default
    # min_dim_size_to_factor=128 none of these kernels is factored.
    "adafactor_default": ("adafactor", optax.adafactor, (), {}),
    "adafactor_factored_momentum_wd": (
        "adafactor", optax.adafactor, (_schedule(1e-2),),
        dict(min_dim_size_to_factor=32, momentum=0.9,
             weight_decay_rate=_schedule(1e-3),
             weight_decay_mask=_decay_kernels_only)),
    "adafactor_factored_off": (
        "adafactor", optax.adafactor, (_schedule(1e-2),),
        dict(factored=False, multiply_by_parameter_scale=False,
             clipping_threshold=None, decay_rate=0.7)),
    "sm3": ("sm3", optax.sm3, (3e-2,), {}),
}
FAMILIES = {"lamb": "lamb", "muon": "muon", "adafactor": "adafactor_default",
            "sm3": "sm3"}


def _transforms(name):
  family, optax_fn, args, kwargs = VARIANTS[name]
  return (getattr(forge_jax, family)(*args, **kwargs),
          optax_fn(*args, **kwargs))


@pytest.fixture(scope="module")
def data():
  return harness.mlp_data(STEPS, BT)


_worst_leaf = worst_leaf


@pytest.fixture(scope="module")
def optax_runs():
  """optax's run of each variant, made once for both wgrad settings."""
  return {}


def _train_both(name, data, model_kw=None, steps=STEPS, wgrad="fused",
                optax_runs=None):
  """``optax_runs``: a cache of optax's runs (the ``optax_runs`` fixture)."""
  xs, ys, variables = data
  model_kw = model_kw or {}
  forge_tx, optax_tx = _transforms(name)
  ref_loss = _mse(MLP(nn.Dense, **model_kw))

  ref_step = jax.jit(reference_step(ref_loss, optax_tx))

  forge = jax.jit(
      forge_jax.make_step(_mse(MLP(forge_jax.Dense, **model_kw)), forge_tx,
                          wgrad=wgrad),
      donate_argnums=(0, 1))
  if model_kw:
    variables = MLP(nn.Dense, **model_kw).init(jax.random.key(1), xs[0])
  batches = [(xs[i], ys[i]) for i in range(steps)]
  reference = None
  if optax_runs is not None:
    key = (name, tuple(sorted(model_kw.items())), steps)
    if key not in optax_runs:
      optax_runs[key] = run_reference(ref_step, variables, optax_tx, batches)
    reference = optax_runs[key]
  forge_state, ref_state, losses = train_side_by_side(
      forge, ref_step, variables, forge_tx, optax_tx, batches,
      reference=reference)
  np.testing.assert_allclose(*zip(*losses), rtol=F32_TOL)
  return forge_state, ref_state, variables


def _check_parity(name, data, **kw):
  (v_f, s_f), (v_ref, s_ref), v0 = _train_both(name, data, **kw)
  p_err, p_where = _worst_leaf(v_f, v_ref)
  s_err, s_where = _worst_leaf(s_f, s_ref)
  assert p_err <= F32_TOL, f"{name} params: worst {p_where}: {p_err:.3g}"
  assert s_err <= F32_TOL, f"{name} opt_state: worst {s_where}: {s_err:.3g}"
  # Not vacuous: every FORGE kernel moved.
  for layer in ("Dense_0", "Dense_1", "Dense_2"):
    assert rel_err(v_f["params"][layer]["kernel"],
                   v0["params"][layer]["kernel"]) > 1e-3, (name, layer)
  print(f"{name}: worst rel err params {p_err:.2e} ({p_where}), "
        f"state {s_err:.2e} ({s_where})")
  return p_err, s_err


def _check_each_step(name, data):
  """Each of the ``STEPS`` steps started from the reference's own state (its
  parameters and optimizer state after its previous step): FORGE's loss,
  its update of every parameter (the step itself, ``new - old``) and every
  optimizer-state leaf within ``F32_TOL`` of the reference's.

  The GPU compares so because a free-running comparison is not repeatable
  there at that tolerance: on an H100 the run came out one of two ways
  from one process to the next, and a trajectory such as
  ``optax.adafactor()``'s default one on this MLP (loss 1.3, then 297)
  grows a difference of a few 1e-7 in one step to 1e-3 in 20 steps. From
  the same state, each step's error is the update's own. Returns the worst
  (error, where) of the state."""
  xs, ys, variables = data
  forge_tx, optax_tx = _transforms(name)
  ref_step = jax.jit(reference_step(_mse(MLP(nn.Dense)), optax_tx))
  forge = jax.jit(forge_jax.make_step(_mse(MLP(forge_jax.Dense)), forge_tx))
  v, s = variables, optax_tx.init(variables["params"])
  # (The same tree: the state of one is the other's.)
  assert (jax.tree.structure(forge_tx.init(v["params"]))
          == jax.tree.structure(s)), name
  worst = (0.0, "")
  for i in range(STEPS):
    batch = (xs[i], ys[i])
    l_f, v_f, s_f = forge(v, s, batch)
    l_ref, v_next, s_next = ref_step(v, s, batch)
    np.testing.assert_allclose(float(l_f), float(l_ref), rtol=F32_TOL,
                               err_msg=f"{name} step {i} loss")
    for (path, new), want, old in zip(
        jax.tree_util.tree_leaves_with_path(v_f["params"]),
        jax.tree.leaves(v_next["params"]), jax.tree.leaves(v["params"])):
      where = f"{name} step {i} params{jax.tree_util.keystr(path)}"
      if "kernel" in where:  # (not vacuous: every FORGE kernel moves)
        assert rel_err(want, old) > 0, where
      assert_update_close(new, want, old, what=where)
    err, where = _worst_leaf(s_f, s_next)
    assert err <= F32_TOL, f"{name} step {i} opt_state: worst {where}: {err:.3g}"
    worst = max(worst, (err, f"step {i} opt_state{where}"))
    v, s = v_next, s_next
  return worst


# --- API ---------------------------------------------------------------------


@pytest.mark.parametrize("family,reference", [
    ("lamb", optax.lamb), ("muon", optax.contrib.muon),
    ("adafactor", optax.adafactor), ("sm3", optax.sm3)])
def test_signature_and_defaults_match_optax(family, reference):
  def params(fn):
    return [(p.name, p.kind, p.default)
            for p in inspect.signature(fn).parameters.values()]

  # forge_jax's keyword-only low-precision options, refused for these
  # families in plain words, come after optax's own parameters.
  extra = [("moments", inspect.Parameter.KEYWORD_ONLY, None),
           ("stochastic_rounding", inspect.Parameter.KEYWORD_ONLY, False)]
  assert params(getattr(forge_jax, family)) == params(reference) + extra


@pytest.mark.parametrize("family,regime", [
    ("lamb", 2), ("muon", 2), ("adafactor", 3), ("sm3", 3), ("adamw", 1)])
def test_spec_regime_is_the_classifiers(family, regime):
  name = FAMILIES.get(family)
  tx = _transforms(name)[0] if name else forge_jax.adamw(1e-3)
  assert tx.spec.regime == pk.classify(family).number == regime


def test_muon_weight_dimension_numbers_are_refused():
  from optax.contrib import MuonDimensionNumbers
  with pytest.raises(ValueError, match="muon_weight_dimension_numbers"):
    forge_jax.muon(1e-2, muon_weight_dimension_numbers=MuonDimensionNumbers())


# --- the regime-2 epilogue rules -------------------------------------------------


@pytest.mark.parametrize("config", [
    None, pk.BlockConfig(32, 64, 16, split_out=4, prefetch=True),
    pk.BlockConfig(16, 128, 32, group_in=2, split_out=2)],
    ids=["default", "o4-prefetch", "o2-grouped"])
@pytest.mark.parametrize("rule", [pk.lamb_rule(), pk.muon_rule(True),
                                  pk.muon_rule(False)], ids=lambda r: r.name)
def test_state_only_rule_kernel_matches_reference(rule, config):
  # (column sub-tiles: each writes its part of the slots and of Muon's
  # write-only output; ragged 70x130 leaves sub-tiles wholly outside)
  k = jax.random.split(jax.random.key(7), 4)
  x = jax.random.normal(k[0], (BT, 70))
  dy = jax.random.normal(k[1], (BT, 130))
  w = jax.random.normal(k[2], (70, 130))
  slots = tuple(jax.random.uniform(k[3], (70, 130)) for _ in rule.slots)
  h = rule.pack(**{n: 0.5 for n in rule.hparams})
  got = pk.fused_wgrad_update(x, dy, w, slots, h, rule=rule, config=config)
  ref = pk.fused_wgrad_update_reference(x, dy, w, slots, h, rule=rule)
  assert got[0] is w  # the kernel neither reads nor writes W
  assert len(got[1]) == len(rule.slots) + len(rule.outputs)
  for a, b in zip(got[1], ref[1]):
    assert rel_err(a, b) <= F32_TOL


@pytest.mark.parametrize("rule", [pk.lamb_rule(), pk.muon_rule(True)],
                         ids=lambda r: r.name)
def test_state_only_rule_lowers_for_cuda_without_a_gpu(rule):
  assert len(triton_calls(lower_rule_for_cuda(rule))) == 1


# --- 20 training steps against optax --------------------------------------------


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_mlp_training_matches_optax(name, data, optax_runs):
  _check_parity(name, data, optax_runs=optax_runs)


def test_each_step_from_the_references_state_matches_optax(data):
  """The comparison the GPU test makes (:func:`_check_each_step`), on the
  chaotic default Adafactor run."""
  _check_each_step("adafactor_default", data)


# wgrad="xla": regime 2's state advance from XLA's G, then the same layer
# pass. (Regime 3 forms G the same way under either setting.)
@pytest.mark.parametrize("name", ["lamb", "muon", "muon_no_nesterov_adaptive_rms"])
def test_mlp_training_matches_optax_with_xla_wgrad(name, data, optax_runs):
  _check_parity(name, data, wgrad="xla", optax_runs=optax_runs)


@pytest.mark.parametrize("name", ["lamb", "muon", "adafactor_factored_momentum_wd",
                                  "sm3"])
def test_untouched_layer_gets_the_zero_gradient_update(name, data):
  """Remark 1 on the regime-2 and -3 paths: a FORGE layer whose output never
  reaches the loss gets exactly optax's zero-gradient step."""
  (v_f, s_f), (v_ref, s_ref), v0 = _train_both(
      name, data, model_kw=dict(dead_head=True), steps=4)
  for what, a, e in (("params", v_f, v_ref), ("opt_state", s_f, s_ref)):
    err, where = _worst_leaf(a, e)
    assert err <= F32_TOL, f"{name} {what}: worst {where}: {err:.3g}"
  if name != "sm3":  # weight decay moved the dead kernel: not skipped
    assert rel_err(v_f["params"]["aux"]["kernel"],
                   v0["params"]["aux"]["kernel"]) > 0


# --- the paths, read off the jaxpr -------------------------------------------


def _kernel_gradient_dots(jaxpr):
  """The weight gradients ``G = x^T dy`` the step forms outside kernels."""
  return harness.kernel_gradient_dots(jaxpr, KERNEL_SHAPES, BT)


def _step_jaxpr(forge_tx, variables, batch):
  step = forge_jax.make_step(_mse(MLP(forge_jax.Dense)), forge_tx)
  return jax.make_jaxpr(step)(variables, forge_tx.init(variables["params"]),
                              batch).jaxpr


@pytest.mark.parametrize("family", ["lamb", "muon", "adafactor", "sm3"])
def test_regime_2_never_forms_a_kernel_gradient_regime_3_one_per_layer(
    family, data):
  xs, ys, variables = data
  forge_tx, optax_tx = _transforms(FAMILIES[family])
  jaxpr = _step_jaxpr(forge_tx, variables, (xs[0], ys[0]))
  dots = _kernel_gradient_dots(jaxpr)
  kernels = [e.params["name"] for e in harness.jaxpr_eqns(jaxpr)
             if e.primitive.name == "pallas_call"]

  # The detector is not vacuous: optax's own step forms the three Gs.
  def ref_step(v, s, b):
    g = jax.grad(_mse(MLP(nn.Dense)))(v, b)
    return optax_tx.update(g["params"], s, v["params"])
  ref = jax.make_jaxpr(ref_step)(variables, optax_tx.init(variables["params"]),
                                 (xs[0], ys[0])).jaxpr
  assert sorted(_kernel_gradient_dots(ref)) == sorted(KERNEL_SHAPES)

  if pk.classify(family).number == 2:
    assert dots == [], f"{family}: kernel-shaped G formed: {dots}"
    rule = forge_tx.spec.rule
    assert kernels == [f"fused_wgrad_{rule.name}"] * 3
  else:
    assert sorted(dots) == sorted(KERNEL_SHAPES), dots  # one per layer
    assert kernels == []


# --- regime 4 -------------------------------------------------------------------


def test_regime_4_is_refused_with_the_reason():
  why = forge_jax.refuse_reason("clip_by_global_norm")
  assert "regime 4" in why and "cannot be fused" in why
  assert "forge_jax.clip_by_global_norm(max_norm)" in why  # the two passes
  with pytest.raises(AttributeError, match="regime 4.*cannot be fused"):
    forge_jax.global_norm_clip  # noqa: B018
  assert not hasattr(forge_jax, "global_norm_clip")
  # A spec that claims a regime-4 family is refused too.
  with pytest.raises(ValueError, match="regime 4"):
    forge_jax.ForgeSpec(rule=None, slot_fields=None, hparams=lambda s: {},
                        family="global_norm_clip")
  # Global-norm clipping before an optax (not forge_jax) optimizer is not a
  # chain make_step can drive (tests/test_clipping.py: the one it runs).
  chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  with pytest.raises(TypeError, match="clip_by_global_norm.*forge_jax cannot drive"):
    forge_jax.make_step(_mse(MLP(forge_jax.Dense)), chain)


def test_the_transforms_are_the_registrys_optax_families():
  """forge_jax implements exactly the registered families that name an optax
  transform, under that name; each regime-1/2 one has its kernel rule."""
  from forge_jax import transforms
  registry = pk.families.REGISTRY
  assert transforms.IMPLEMENTED == {
      name: f.optax for name, f in registry.items() if f.optax is not None}
  for name, f in registry.items():
    if f.optax is None:
      assert forge_jax.refuse_reason(name) is not None, name
      continue
    assert callable(getattr(forge_jax, f.optax)), name
    assert forge_jax.refuse_reason(name) is None, name
    assert (f.optax_factory is not None) == (f.regime.number in (1, 2)), name


def test_refuse_reason_for_implemented_unimplemented_and_unknown(monkeypatch):
  for family in ("adamw", "sgd_momentum", "lamb", "muon", "adafactor", "sm3"):
    assert forge_jax.refuse_reason(family) is None, family
  # Every public transform's own name (nadamw included: an AdamW).
  for name in ("sgd", "adagrad", "rmsprop", "adam", "adamw", "adamax",
               "nadam", "nadamw", "radam", "lion", "lamb", "muon", "scion",
               "adafactor", "sm3", "adam_mini", "adalomo", "lars"):
    assert callable(getattr(forge_jax, name)), name
    assert forge_jax.refuse_reason(name) is None, name
  # A registered family without a transform is refused with its path.
  from forge_jax import transforms
  monkeypatch.delitem(transforms.IMPLEMENTED, "adam_mini")
  assert "does not implement 'adam_mini'" in forge_jax.refuse_reason(
      "adam_mini")
  assert "regime 3" in forge_jax.refuse_reason("adam_mini")
  with pytest.raises(AttributeError, match="does not implement 'adam_mini'"):
    forge_jax.adammini  # noqa: B018
  assert "unknown optimizer family" in forge_jax.refuse_reason("nope")
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    forge_jax.nope  # noqa: B018


@pytest.mark.parametrize("name,use", [
    ("sgd_momentum", r"forge_jax\.sgd\(learning_rate, momentum=\.\.\.\)"),
    ("adam_w", r"forge_jax\.adamw\(\.\.\.\)"),
    ("ADAMW", r"forge_jax\.adamw\(\.\.\.\)"),
])
def test_an_implemented_family_under_another_name_says_where_it_is(name, use):
  with pytest.raises(AttributeError, match=f"implemented as {use}") as e:
    getattr(forge_jax, name)
  assert "None" not in str(e.value)


@pytest.mark.parametrize("family,kw,dtype", [
    ("adafactor", dict(learning_rate=1e-2, min_dim_size_to_factor=4),
     "float64"),
    ("sm3", dict(learning_rate=1e-2), "float64"),
    ("adafactor", dict(learning_rate=1e-2, min_dim_size_to_factor=4),
     "complex64"),
], ids=["adafactor-f64", "sm3-f64", "adafactor-c64"])
def test_deferred_path_keeps_wide_gradients(family, kw, dtype):
  """Regime 3 forms G itself: in the kernel's own dtype when wider than fp32
  (float64 with x64, complex), as jax.grad hands it to optax."""
  with jax.enable_x64(dtype == "float64"):
    dt = jnp.dtype(dtype)
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (16, 11), dt)
    y = jax.random.normal(ky, (16, 5), dt)

    class Net(nn.Module):
      dense: type

      @nn.compact
      def __call__(self, h):
        return self.dense(5, param_dtype=dt)(jnp.tanh(self.dense(24, param_dtype=dt)(h)))

    def loss(model):
      return lambda v, b: jnp.mean(jnp.abs(model.apply(v, b[0]) - b[1]) ** 2)

    variables = Net(nn.Dense).init(jax.random.key(0), x)
    tx_f, tx_o = getattr(forge_jax, family)(**kw), getattr(optax, family)(**kw)

    @jax.jit
    def optax_step(variables):
      _, g = jax.value_and_grad(loss(Net(nn.Dense)))(variables, (x, y))
      u, _ = tx_o.update(g["params"], tx_o.init(variables["params"]),
                         variables["params"])
      return optax.apply_updates(variables["params"], u)

    want = optax_step(variables)
    _, got, _ = jax.jit(forge_jax.make_step(loss(Net(forge_jax.Dense)), tx_f))(
        variables, tx_f.init(variables["params"]), (x, y))
    bound = tol(jnp.float64 if dtype == "float64" else jnp.float32)
    for name in ("Dense_0", "Dense_1"):
      k = got["params"][name]["kernel"]
      assert k.dtype == dt
      # The step itself (new - old), so an error in the update cannot hide
      # under the tolerance of the whole kernel (complex too).
      w0 = np.asarray(variables["params"][name]["kernel"])
      step = np.asarray(want[name]["kernel"]) - w0
      err = np.linalg.norm(np.asarray(k) - w0 - step) / np.linalg.norm(step)
      assert np.linalg.norm(step) > 0, name
      assert err <= bound, (name, err)


# --- GPU ------------------------------------------------------------------------


@pytest.mark.gpu
def test_regime_2_and_3_families_match_optax_on_gpu(data):
  """All four families, 20 MLP steps each, on the GPU (Triton kernels),
  each step from the reference's state (:func:`_check_each_step` says why)."""
  errors = {}
  with jax.default_matmul_precision("highest"):
    for family, name in FAMILIES.items():
      errors[family] = _check_each_step(name, data)
  print("GPU parity (worst state error, where):", errors)

