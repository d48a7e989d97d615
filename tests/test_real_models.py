"""What real Flax models hand make_step (CPU, fp32, tiny widths): an optimizer
wrapped in optax.inject_hyperparams (the learning rate logged and changed
between steps), boxed parameters (nn.with_logical_partitioning), and
ScannedBlocks with nn.scan's metadata_params. Each against optax +
jax.value_and_grad."""

import functools
from typing import Any
import warnings

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
from tests.harness import mse, reference_step
from tests.tolerances import assert_close, assert_trees_close, rel_err, tol

RTOL = tol(jnp.float32)


def batches(n, d_in=5, d_out=3, rows=8, seed=1):
  k = jax.random.split(jax.random.key(seed), 2 * n)
  return [(jax.random.normal(k[2 * i], (rows, d_in)),
           jax.random.normal(k[2 * i + 1], (rows, d_out))) for i in range(n)]


def is_box(x):
  return isinstance(x, flax.core.meta.AxisMetadata)


def names_of(tree):
  """The boxes' names, by path (plain leaves: None)."""
  return jax.tree.map(lambda b: b.names if is_box(b) else None, tree,
                      is_leaf=is_box)


class MLP(nn.Module):
  dense: type
  kernel_init: Any = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x):
    x = nn.relu(self.dense(12, kernel_init=self.kernel_init)(x))
    return self.dense(3, kernel_init=self.kernel_init)(x)


# --- optax.inject_hyperparams -------------------------------------------------


@pytest.mark.parametrize("factory,kwargs", [
    ("adamw", dict(learning_rate=1e-2, weight_decay=0.1)),
    ("sgd", dict(learning_rate=5e-2, momentum=0.9)),
    ("lion", dict(learning_rate=1e-3, weight_decay=0.1)),
    ("adamw", dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 4))),
], ids=["adamw", "sgd-momentum", "lion", "adamw-schedule"])
def test_injected_hyperparameters_drive_the_kernels(factory, kwargs):
  bs = batches(6)
  forge_tx = optax.inject_hyperparams(getattr(forge_jax, factory))(**kwargs)
  optax_tx = optax.inject_hyperparams(getattr(optax, factory))(**kwargs)
  v = MLP(nn.Dense).init(jax.random.key(0), bs[0][0])
  fs = jax.jit(forge_jax.make_step(mse(MLP(forge_jax.Dense)), forge_tx))
  rs = jax.jit(reference_step(mse(MLP(nn.Dense)), optax_tx))
  vf, sf = v, forge_tx.init(v["params"])
  vr, sr = v, optax_tx.init(v["params"])
  for i, b in enumerate(bs):
    if i == 3:  # as a Flax user changes the learning rate mid-run
      for s in (sf, sr):
        s.hyperparams["learning_rate"] = 3 * s.hyperparams["learning_rate"]
    _, vf, sf = fs(vf, sf, b)
    _, vr, sr = rs(vr, sr, b)
  assert jax.tree.structure(sf) == jax.tree.structure(sr)
  assert_trees_close(vf, vr, RTOL, "variables")
  assert_trees_close(sf, sr, RTOL, "opt_state")
  assert rel_err(vf["params"]["Dense_0"]["kernel"],
                 v["params"]["Dense_0"]["kernel"]) > 1e-3  # it trained


def test_injected_learning_rate_change_reaches_the_kernels():
  # Not the initial value baked in: with the rate set to 0 the kernels stay.
  (x, y), = batches(1)
  tx = optax.inject_hyperparams(forge_jax.adamw)(learning_rate=1e-2)
  v = MLP(forge_jax.Dense).init(jax.random.key(0), x)
  s = tx.init(v["params"])
  s.hyperparams["learning_rate"] = 0.0
  _, v2, _ = jax.jit(forge_jax.make_step(mse(MLP(forge_jax.Dense)), tx))(
      v, s, (x, y))
  assert_trees_close(v2, v, 0.0, "variables")


@pytest.mark.parametrize("factory", [
    optax.adamw, functools.partial(optax.adamw, b1=0.8),
    lambda learning_rate: optax.adamw(learning_rate)],
    ids=["optax", "partial", "own"])
def test_inject_hyperparams_of_an_optax_factory_is_refused(factory):
  # (optax's optimizers are optax.chains: not the message for a chain
  # holding a forge_jax transform)
  tx = optax.inject_hyperparams(factory)(learning_rate=1e-3)
  with pytest.raises(TypeError, match="Wrap the forge_jax factory"):
    forge_jax.make_step(mse(MLP(forge_jax.Dense)), tx)


def test_injected_transform_needs_its_own_state():
  (x, y), = batches(1)
  tx = optax.inject_hyperparams(forge_jax.adamw)(learning_rate=1e-2)
  v = MLP(forge_jax.Dense).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match="InjectStatefulHyperparamsState"):
    forge_jax.make_step(mse(MLP(forge_jax.Dense)), tx)(
        v, forge_jax.adamw(1e-2).init(v["params"]), (x, y))


# --- Boxed parameters ---------------------------------------------------------

LOGICAL = nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                       ("embed", "mlp"))


@pytest.mark.parametrize("make", [
    lambda m: m.adamw(1e-2, weight_decay=0.1),
    lambda m: m.sgd(5e-2, momentum=0.9),
    lambda m: m.lion(1e-3),
], ids=["adamw", "sgd-momentum", "lion"])
def test_init_of_boxed_params_is_optax_init(make):
  v = MLP(forge_jax.Dense, LOGICAL).init(jax.random.key(0), jnp.ones((2, 5)))
  got, want = make(forge_jax).init(v["params"]), make(optax).init(v["params"])
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert names_of(got) == names_of(want)
  assert_trees_close(got, want, 0.0, "opt_state")


@pytest.mark.parametrize("inject", [False, True], ids=["plain", "injected"])
def test_boxed_params_train_as_optax_on_their_values_and_stay_boxed(inject):
  bs = batches(4)
  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  forge_tx, optax_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
  if inject:
    forge_tx = optax.inject_hyperparams(forge_jax.adamw)(**kw)
    optax_tx = optax.inject_hyperparams(optax.adamw)(**kw)
  boxed = MLP(forge_jax.Dense, LOGICAL).init(jax.random.key(0), bs[0][0])
  plain = flax.core.meta.unbox(boxed)
  fs = jax.jit(forge_jax.make_step(mse(MLP(forge_jax.Dense, LOGICAL)),
                                   forge_tx))
  rs = jax.jit(reference_step(mse(MLP(nn.Dense)), optax_tx))
  vf, sf = boxed, forge_tx.init(boxed["params"])
  vr, sr = plain, optax_tx.init(plain["params"])
  for b in bs:
    _, vf, sf = fs(vf, sf, b)
    _, vr, sr = rs(vr, sr, b)
  # The boxes come back, with their names, in params and state alike.
  assert names_of(vf) == names_of(boxed)
  assert names_of(sf) == names_of(forge_tx.init(boxed["params"]))
  assert isinstance(vf["params"]["Dense_1"]["kernel"],
                    nn.LogicallyPartitioned)
  assert_trees_close(flax.core.meta.unbox(vf), vr, RTOL, "variables")
  assert_trees_close(flax.core.meta.unbox(sf), sr, RTOL, "opt_state")


# --- ScannedBlocks with metadata_params ---------------------------------------

D, H, L = 8, 16, 2
LAYERS = {nn.PARTITION_NAME: "layers"}


class Block(nn.Module):
  dense: type

  @nn.compact
  def __call__(self, h):
    u = nn.relu(self.dense(H, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))(h))
    return h + self.dense(D, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("mlp", "embed")))(u)


def _body(module, carry, _):
  return module.block(name="block")(carry), None


class FlaxScan(nn.Module):
  """The reference: flax's nn.scan over the same block, as the docs write it."""
  block: Any
  num_layers: int

  @nn.compact
  def __call__(self, x):
    y, _ = nn.scan(nn.remat(_body), variable_axes={"params": 0},
                   split_rngs={"params": True}, length=self.num_layers,
                   metadata_params=LAYERS)(self, x, None)
    return y


class Tower(nn.Module):
  scanned: bool  # ScannedBlocks of forge_jax.Dense, or FlaxScan of nn.Dense

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    if self.scanned:
      h = forge_jax.ScannedBlocks(lambda **kw: Block(forge_jax.Dense, **kw),
                                  num_layers=L, metadata_params=LAYERS,
                                  name="blocks")(h)
    else:
      h = FlaxScan(lambda **kw: Block(nn.Dense, **kw), num_layers=L,
                   name="blocks")(h)
    return nn.Dense(3)(h)


def test_scanned_blocks_metadata_params_match_nn_scan_and_train():
  bs = batches(3)
  forge_v = Tower(True).init(jax.random.key(0), bs[0][0])
  flax_v = Tower(False).init(jax.random.key(0), bs[0][0])
  # The same boxed tree as nn.scan's: the inserted axis named 'layers'.
  assert jax.tree.structure(forge_v) == jax.tree.structure(flax_v)
  assert names_of(forge_v) == names_of(flax_v)
  kernel = forge_v["params"]["blocks"]["block"]["Dense_0"]["kernel"]
  assert kernel.names == ("layers", "embed", "mlp")
  assert kernel.value.shape == (L, D, H)
  assert_trees_close(forge_v, flax_v, 0.0, "initial variables")

  vr = _train_boxed_like_optax(Tower(True), Tower(False), forge_v,
                               flax_v, bs)
  assert rel_err(flax.core.meta.unbox(kernel),
                 vr["params"]["blocks"]["block"]["Dense_0"]["kernel"]) > 1e-3


def _train_boxed_like_optax(forge_model, ref_model, forge_v, ref_v, bs):
  """AdamW steps of the boxed ``forge_v`` by the FORGE step of
  ``forge_model`` (every kernel fused, boxes and names kept) against optax
  on ``ref_model`` from the unboxed ``ref_v``: every variable and state
  leaf within the fp32 tolerance. Returns the reference's variables."""
  tx_kw = dict(learning_rate=1e-2, weight_decay=0.1)
  forge_tx, optax_tx = forge_jax.adamw(**tx_kw), optax.adamw(**tx_kw)
  step = forge_jax.make_step(mse(forge_model), forge_tx)
  fs = jax.jit(step)
  rs = jax.jit(reference_step(mse(ref_model), optax_tx))
  plain = flax.core.meta.unbox(ref_v)
  vf, sf = forge_v, forge_tx.init(forge_v["params"])
  vr, sr = plain, optax_tx.init(plain["params"])
  for b in bs:
    _, vf, sf = fs(vf, sf, b)
    _, vr, sr = rs(vr, sr, b)
  assert step.standard_layers == []  # the kernels took the fused path
  assert names_of(vf) == names_of(forge_v)
  assert_trees_close(flax.core.meta.unbox(vf), vr, RTOL, "variables")
  assert_trees_close(flax.core.meta.unbox(sf), sr, RTOL, "opt_state")
  return vr


def test_multisteps_of_an_injected_transform_is_refused_with_the_fix():
  tx = optax.inject_hyperparams(forge_jax.adamw)(learning_rate=1e-3)
  with pytest.raises(TypeError, match="Pass a schedule instead"):
    forge_jax.MultiSteps(tx, 2)


# --- A third-party Transformer LM, converted, its blocks in ScannedBlocks -----


def test_converted_lm_with_scanned_blocks_keeps_its_boxes_and_trains():
  """tests/third_party_lm.py's LM (nn.with_logical_partitioning everywhere)
  with its blocks stacked by ScannedBlocks (metadata_params) and
  make_step(..., convert=True), against the same LM stacked by nn.scan +
  optax: the same boxed tree, 10 equal fp32 steps. Every projection is
  fused: in the blocks the MLP's nn.Dense layers and the attention's
  nn.DenseGeneral layers (3-axis kernels, stepped as (L, n_in, n_out)
  views of their stacks); nothing is reported as skipped."""
  from tests import third_party_lm as tp
  forge_model = tp.LM(stack=lambda block, n, name: forge_jax.ScannedBlocks(
      block, n, metadata_params=LAYERS, name=name))
  flax_model = tp.LM(stack=FlaxScan)
  bs = tp.batches(10)
  boxed = tp.init(forge_model, bs[0][0])
  # nn.scan's tree: the same boxes, with the stacked axis named 'layers'.
  assert names_of(boxed) == names_of(jax.eval_shape(
      lambda t: flax_model.init(jax.random.key(0), t, train=False), bs[0][0]))
  attn = boxed["params"]["blocks"]["block"]["MultiHeadDotProductAttention_0"]
  assert attn["query"]["kernel"].names == ("layers", "embed", "joined_kv")
  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  forge_tx, optax_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
  step = forge_jax.make_step(tp.next_token_loss(forge_model), forge_tx,
                             convert=True)
  vf, sf = boxed, forge_tx.init(boxed["params"])
  with warnings.catch_warnings():
    warnings.simplefilter("error", forge_jax.ConvertSkipWarning)
    traced, fs = tp.compiled(step, vf, sf, bs[0])
  # 4 attention + 2 MLP stacks in the backward loop, and the head.
  assert str(traced.jaxpr).count("pallas_call") == 7
  attention = "blocks/block/MultiHeadDotProductAttention_0/"
  assert step.converted == sorted(
      ["Dense_0", "blocks/block/Dense_0", "blocks/block/Dense_1"]
      + [attention + p for p in ("key", "out", "query", "value")])
  assert step.skipped == {} and step.standard_layers == []
  plain = flax.core.meta.unbox(boxed)
  vr, sr = plain, optax_tx.init(plain["params"])
  _, rs = tp.compiled(reference_step(tp.next_token_loss(flax_model), optax_tx),
                      vr, sr, bs[0])
  for b in bs:
    _, vf, sf = fs(vf, sf, b)
    _, vr, sr = rs(vr, sr, b)
  assert names_of(vf) == names_of(boxed)
  assert names_of(sf) == names_of(forge_tx.init(boxed["params"]))
  assert_trees_close(flax.core.meta.unbox(vf), vr, RTOL, "variables")
  assert_trees_close(flax.core.meta.unbox(sf), sr, RTOL, "opt_state")
  blocks = lambda t: t["params"]["blocks"]["block"]
  for layer in (("Dense_1",), ("MultiHeadDotProductAttention_0", "query"),
                ("MultiHeadDotProductAttention_0", "out")):
    get = lambda t: functools.reduce(lambda n, k: n[k], layer,
                                     blocks(t))["kernel"]
    assert rel_err(get(vr), get(plain)) > 1e-3, layer  # it trained


class _ScaledDense(nn.Module):
  """A bf16 scale (optax's to update) before an fp32 kernel (FORGE's)."""
  dense: Any = forge_jax.Dense

  @nn.compact
  def __call__(self, x):
    s = self.param("scale", nn.initializers.ones, (12,), jnp.bfloat16)
    return self.dense(8, use_bias=False)(x * s.astype(jnp.float32))


def test_injected_float_hyperparameters_with_narrower_other_params():
  """optax casts a Python-float (or scheduled) injected hyperparameter to
  the widest dtype of the parameters it updates; beside an fp32 FORGE
  kernel the others are bf16 here, so the step refuses, naming the fix
  (hyperparam_dtype), and with it matches optax."""
  x, y = jnp.linspace(-1, 1, 48).reshape(4, 12), jnp.zeros((4, 8))
  loss = lambda m: (lambda v, b: jnp.mean((m.apply(v, b[0]) - b[1]) ** 2))
  v = _ScaledDense().init(jax.random.key(0), x)

  def run(forge, **inject):
    tx = optax.inject_hyperparams(
        forge_jax.adamw if forge else optax.adamw, **inject)(
            learning_rate=1e-2)
    model = _ScaledDense() if forge else _ScaledDense(dense=nn.Dense)
    s = tx.init(v["params"])
    s.hyperparams["b2"] = 0.999  # a Python float: optax casts it
    if forge:
      step = forge_jax.make_step(loss(model), tx)
      return jax.jit(step)(v, s, (x, y))[1]["params"]
    g = jax.grad(loss(model))(v, (x, y))["params"]
    u, _ = tx.update(g, s, v["params"])
    return optax.apply_updates(v["params"], u)

  with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
    run(True)
  got, want = (run(f, hyperparam_dtype=jnp.float32) for f in (True, False))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.isfinite(np.asarray(a, np.float32)).all()
    err = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()
    assert err <= tol(jnp.float32) * np.abs(np.asarray(b, np.float64)).max()


class _NoBiasBf16(nn.Module):
  """Every parameter a bf16 FORGE kernel (no bias, no other parameter)."""
  dense: Any = forge_jax.Dense

  @nn.compact
  def __call__(self, x):
    x = nn.relu(self.dense(16, use_bias=False, param_dtype=jnp.bfloat16)(x))
    return self.dense(4, use_bias=False, param_dtype=jnp.bfloat16)(x)


def test_injected_hyperparameters_of_an_all_forge_model_keep_their_dtype():
  """Every parameter a bf16 FORGE kernel: optax, given none of them, would
  keep the injected hyperparameters as float32 (the widest dtype of no
  parameter); the state keeps them in bf16, as optax's own step does, so
  that a learning rate set as a Python float (0.3, 0.30078125 in bf16)
  steps the kernels as with hyperparam_dtype=jnp.bfloat16, bit for bit."""
  x = jax.random.normal(jax.random.key(1), (8, 12))
  y = jnp.linspace(-1, 1, 32).reshape(8, 4)
  loss = lambda m: (lambda v, b: jnp.mean(
      (m.apply(v, b[0]).astype(jnp.float32) - b[1]) ** 2))
  v = _NoBiasBf16(dense=nn.Dense).init(jax.random.key(0), x)

  def run(forge, **inject):
    tx = optax.inject_hyperparams(
        forge_jax.sgd if forge else optax.sgd, **inject)(
            learning_rate=0.01, momentum=0.9)
    model = _NoBiasBf16() if forge else _NoBiasBf16(dense=nn.Dense)
    state, variables = tx.init(v["params"]), v
    step = jax.jit(forge_jax.make_step(loss(model), tx)) if forge else None
    for i in range(3):
      if i == 1:
        state.hyperparams["learning_rate"] = 0.3
      if forge:
        _, variables, state = step(variables, state, (x, y))
      else:
        g = jax.grad(loss(model))(variables, (x, y))["params"]
        u, state = tx.update(g, state, variables["params"])
        variables = {"params": optax.apply_updates(variables["params"], u)}
    return variables["params"], state.hyperparams

  got, hps = run(True)
  _, want_hps = run(False)
  for k, h in want_hps.items():
    assert hps[k].dtype == h.dtype == jnp.bfloat16, k
    assert float(hps[k]) == float(h), k
  pinned, _ = run(True, hyperparam_dtype=jnp.bfloat16)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(pinned), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))


class _HalfWide(nn.Module):
  """A bf16 kernel (FORGE's, deferred under Adafactor) in an fp32 model."""
  dense: Any = forge_jax.Dense

  @nn.compact
  def __call__(self, x):
    x = nn.relu(self.dense(24, param_dtype=jnp.bfloat16, use_bias=False)(x))
    return self.dense(7)(x)


def test_injected_deferred_family_casts_hyperparameters_as_optax():
  """An injected regime-3 family (Adafactor, run by optax per kernel):
  without hyperparam_dtype a scheduled learning rate is cast to the whole
  tree's widest dtype, fp32, for the bf16 kernel too (0.0123 is
  0.012268... in bf16), as in optax's own step: the same weights as with
  hyperparam_dtype=jnp.float32, bit for bit, and optax's within bf16."""
  x = jax.random.normal(jax.random.key(1), (6, 10))
  y = jnp.linspace(-1, 1, 42).reshape(6, 7)
  loss = lambda m: (lambda v, b: jnp.mean((m.apply(v, b[0]) - b[1]) ** 2))
  v = _HalfWide(dense=nn.Dense).init(jax.random.key(0), x)

  def run(forge, hyperparam_dtype):
    tx = optax.inject_hyperparams(
        forge_jax.adafactor if forge else optax.adafactor,
        static_args=("min_dim_size_to_factor",),
        hyperparam_dtype=hyperparam_dtype)(
            learning_rate=optax.constant_schedule(0.0123),
            min_dim_size_to_factor=4, multiply_by_parameter_scale=False)
    model = _HalfWide() if forge else _HalfWide(dense=nn.Dense)
    if forge:
      step = jax.jit(forge_jax.make_step(loss(model), tx))
    else:
      def step(v, s, b):
        g = jax.grad(loss(model))(v, b)["params"]
        u, s = tx.update(g, s, v["params"])
        return None, {"params": optax.apply_updates(v["params"], u)}, s
    w, s = v, tx.init(v["params"])
    for _ in range(2):
      _, w, s = step(w, s, (x, y))
    return w["params"]["Dense_0"]["kernel"]

  got = run(True, None)
  assert got.dtype == jnp.bfloat16
  assert np.array_equal(np.asarray(got, np.float32),
                        np.asarray(run(True, jnp.float32), np.float32))
  assert_close(got, run(False, None))  # bf16 tolerance



class StackTower(nn.Module):
  fused: bool

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    h = forge_jax.ScannedDenseStack(
        D, L, activation=jnp.tanh, fused=self.fused, metadata_params=LAYERS,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "mlp")),
        name="stack")(h)
    return nn.Dense(3)(h)


def test_scanned_dense_stack_metadata_params_box_and_train():
  """A ScannedDenseStack with a boxed kernel_init: metadata_params names
  the stacked axis as nn.scan's does (without it flax cannot stack the
  boxes), and the fused step trains the boxed tree as optax trains the
  stack's nn.scan (fused=False), boxes kept."""
  bs = batches(3)
  forge_v = StackTower(True).init(jax.random.key(0), bs[0][0])
  kernel = forge_v["params"]["stack"]["kernel"]
  assert kernel.names == ("layers", "embed", "mlp")
  assert kernel.value.shape == (L, D, D)
  vr = _train_boxed_like_optax(StackTower(True), StackTower(False),
                               forge_v, forge_v, bs)
  assert rel_err(flax.core.meta.unbox(kernel),
                 vr["params"]["stack"]["kernel"]) > 1e-3
