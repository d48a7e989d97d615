"""make_step with the inputs Flax / optax users hand it (CPU, fp32): callable
weight-decay masks that read leaves, FrozenDict params, truthy-int masks,
boxed parameters, optax.inject_hyperparams, a loss_fn that does not read its variables, a second model
built from forge_jax.Dense, vmap / casts inside loss_fn, the transform
as an optax GradientTransformation, float64 FORGE layers, an opt_state whose
tree is not the parameters', and a teacher applied in loss_fn."""

import warnings
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
from tests.harness import mse, reference_step
from tests.tolerances import assert_trees_close, tol

RTOL = tol(jnp.float32)  # fp32 parity (step counts compare exactly)


class MLP(nn.Module):
  dense: type
  kw: dict | None = None

  @nn.compact
  def __call__(self, x):
    kw = self.kw or {}
    x = nn.relu(self.dense(70, **kw)(x))
    return self.dense(5, **kw)(x)


def batches(n=2, seed=1):
  out, k = [], jax.random.key(seed)
  for _ in range(n):
    k1, k2, k = jax.random.split(k, 3)
    out.append((jax.random.normal(k1, (48, 37)),
                jax.random.normal(k2, (48, 5))))
  return out


def train_both(forge_tx, optax_tx, kw=None, freeze=False, unbox=False):
  bs = batches()
  mf, mr = MLP(forge_jax.Dense, kw), MLP(nn.Dense, kw)
  v = mr.init(jax.random.key(0), bs[0][0])
  if unbox:
    v = flax.core.meta.unbox(v)
  if freeze:
    v = flax.core.freeze(v)
  fs = jax.jit(forge_jax.make_step(mse(mf), forge_tx))
  rs = jax.jit(reference_step(mse(mr), optax_tx))
  run_both(fs, forge_tx, rs, optax_tx, v, bs)


def run_both(fs, forge_tx, rs, ref_tx, v, bs):
  """Runs the FORGE step ``fs`` and the reference step ``rs`` from ``v``
  over batches ``bs`` and asserts variables and optimizer states close."""
  vf, sf = v, forge_tx.init(v["params"])
  vr, sr = v, ref_tx.init(v["params"])
  for b in bs:
    _, vf, sf = fs(vf, sf, b)
    _, vr, sr = rs(vr, sr, b)
  assert_trees_close(vf, vr, RTOL, what="variables")
  assert_trees_close(sf, sr, RTOL, what="opt_state")


def leafwise_mask(params):
  # Flax's documented way to build an optax mask: it reads every leaf.
  return flax.traverse_util.path_aware_map(lambda path, x: x.ndim > 1, params)


def test_callable_mask_reading_leaves_adamw():
  train_both(forge_jax.adamw(1e-2, weight_decay=0.1, mask=leafwise_mask),
             optax.adamw(1e-2, weight_decay=0.1, mask=leafwise_mask))


def test_callable_mask_reading_leaves_deferred_family():
  kw = dict(weight_decay_rate=0.1, weight_decay_mask=leafwise_mask,
            min_dim_size_to_factor=8)
  train_both(forge_jax.adafactor(1e-2, **kw), optax.adafactor(1e-2, **kw))


def test_frozendict_params_with_a_callable_mask():
  mask = lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
  train_both(forge_jax.adamw(1e-2, weight_decay=0.1, mask=mask),
             optax.adamw(1e-2, weight_decay=0.1, mask=mask), freeze=True)


def test_integer_mask_leaves_as_optax_takes_them():
  v = MLP(nn.Dense).init(jax.random.key(0), jnp.ones((1, 37)))
  mask = jax.tree.map(lambda a: int(a.ndim > 1), v["params"])  # 1 / 0
  train_both(forge_jax.adamw(1e-2, weight_decay=0.1, mask=mask),
             optax.adamw(1e-2, weight_decay=0.1, mask=mask))


PARTITIONED = dict(kernel_init=nn.with_partitioning(
    nn.initializers.lecun_normal(), (None, "model")))


def test_boxed_params_train_boxed_and_as_unboxed():
  # Boxed (nn.with_partitioning) params train as optax trains them, boxes
  # kept; unboxed first, they train exactly as nn.Dense + optax too.
  train_both(forge_jax.adamw(1e-2), optax.adamw(1e-2), kw=PARTITIONED)
  train_both(forge_jax.adamw(1e-2), optax.adamw(1e-2), kw=PARTITIONED,
             unbox=True)
  model = MLP(forge_jax.Dense, PARTITIONED)
  (x, y), = batches(1)
  v = model.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-2)
  _, v2, _ = forge_jax.make_step(mse(model), tx)(v, tx.init(v["params"]),
                                                 (x, y))
  kernel = v2["params"]["Dense_0"]["kernel"]
  assert isinstance(kernel, nn.Partitioned)
  assert kernel.names == (None, "model")


def test_loss_fn_that_does_not_read_its_variables_is_refused():
  # A closed-over copy of the variables: optax would see a zero gradient;
  # FORGE would return zero kernels. Refused.
  model = MLP(forge_jax.Dense)
  (x, y), = batches(1)
  v = model.init(jax.random.key(0), x)
  captured = jax.tree.map(jnp.copy, v)

  def loss_fn(variables, batch):
    del variables
    return jnp.mean((model.apply(captured, batch[0]) - batch[1]) ** 2)

  tx = forge_jax.adamw(1e-2)
  with pytest.raises(ValueError, match="never read.*close over"):
    forge_jax.make_step(loss_fn, tx)(v, tx.init(v["params"]), (x, y))


def test_forge_layer_of_a_second_model_is_refused_clearly():
  class Teacher(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.Dense(5, name="teacher_head")(x)

  (x, y), = batches(1)
  student = MLP(forge_jax.Dense)
  vs = student.init(jax.random.key(0), x)
  vt = Teacher().init(jax.random.key(1), x)

  def loss_fn(variables, batch):
    t = jax.lax.stop_gradient(Teacher().apply(vt, batch[0]))
    return jnp.mean((student.apply(variables, batch[0]) - t) ** 2)

  tx = forge_jax.adamw(1e-2)
  with pytest.raises(ValueError, match="'teacher_head'.*no kernel at that"):
    forge_jax.make_step(loss_fn, tx)(vs, tx.init(vs["params"]), (x, y))


def test_one_model_applied_to_two_parts_of_the_variables_is_named():
  """A model applied to two sub-trees of ``variables["params"]`` names its
  layers from each part, so both applies find their kernels at paths the
  step's params do not hold: refused as such, with the fix, not as one
  layer called twice (whose fix, ``shared="standard"``, fails there too)."""
  class One(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.Dense(5)(x)

  one = One()
  (x, y), = batches(1)
  x = x[:, :5]
  v = {"params": {"a": one.init(jax.random.key(0), x)["params"],
                  "b": one.init(jax.random.key(1), x)["params"]}}

  def loss_fn(variables, batch):
    h = one.apply({"params": variables["params"]["a"]}, batch[0])
    return jnp.mean(one.apply({"params": variables["params"]["b"]}, h) ** 2)

  tx = forge_jax.adamw(1e-2)
  with pytest.raises(ValueError, match=(
      r"'Dense_0' was called by loss_fn, but variables\['params'\] has no "
      r"kernel at that path.*applied to part of the variables.*submodules "
      r"of one model")) as info:
    forge_jax.make_step(loss_fn, tx)(v, tx.init(v["params"]), (x, y))
  assert "more than once" not in str(info.value)


@pytest.mark.parametrize("how", ["vmap", "cast"])
def test_kernel_reaching_its_layer_transformed_names_the_reader(how):
  model = MLP(forge_jax.Dense)
  (x, y), = batches(1)
  v = model.init(jax.random.key(0), x)

  def loss_fn(variables, batch):
    if how == "vmap":
      out = jax.vmap(lambda xi: model.apply(variables, xi))(batch[0])
    else:
      p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables["params"])
      out = model.apply({"params": p}, batch[0].astype(jnp.bfloat16))
    return jnp.mean((out.astype(jnp.float32) - batch[1]) ** 2)

  tx = forge_jax.adamw(1e-2)
  reader = "convert_element_type" if how == "cast" else ""
  with pytest.raises(ValueError, match=f"read by: {reader}.*vmap"):
    forge_jax.make_step(loss_fn, tx)(v, tx.init(v["params"]), (x, y))


def test_the_transform_is_an_optax_gradient_transformation():
  tx = forge_jax.adamw(1e-3, weight_decay=1e-2)
  assert isinstance(tx, optax.GradientTransformation)
  init_fn, update_fn = tx
  assert init_fn is tx.init and update_fn is tx.update
  assert tx.spec.family == "adamw"
  assert tx._replace(init=tx.init).spec is tx.spec
  # It composes as optax transforms do (make_step refuses the chain itself).
  chained = optax.chain(optax.clip(1.0), tx)
  ref = optax.chain(optax.clip(1.0), optax.adamw(1e-3, weight_decay=1e-2))
  params = {"w": jnp.linspace(-2.0, 2.0, 6).reshape(3, 2)}
  u, _ = chained.update(params, chained.init(params), params)
  u_ref, _ = ref.update(params, ref.init(params), params)
  assert_trees_close(u, u_ref, tol(jnp.float32), "chained updates")
  with pytest.raises(TypeError, match="forge_jax transform"):
    forge_jax.make_step(lambda v, b: 0.0, chained)


# --- named-axis maps are refused ----------------------------------------------


@pytest.mark.parametrize("mapper", ["pmap", "vmap"])
def test_a_named_axis_map_is_refused(mapper):
  """Under pmap (or any map with an axis name) each replica's FORGE kernels
  would step from that replica's own x^T dy: nothing to average, replicas
  drift apart silently. make_step refuses, naming the way that works."""
  model = MLP(forge_jax.Dense)
  (x, y), = batches(1)
  v = model.init(jax.random.key(0), x)
  tx = forge_jax.sgd(0.1)
  step = forge_jax.make_step(
      lambda v, b: jax.lax.pmean(mse(model)(v, b), "d"), tx)
  stack = lambda t: jax.tree.map(lambda a: a[None], t)
  mapped = (jax.pmap(step, axis_name="d") if mapper == "pmap"
            else jax.vmap(step, axis_name="d"))
  with pytest.raises(ValueError, match=r"named-axis map.*NamedSharding"):
    mapped(stack(v), stack(tx.init(v["params"])), stack((x, y)))


def test_plain_vmap_and_jit_are_not_refused():
  """No axis name in scope: the check does not fire (jit here)."""
  model = MLP(forge_jax.Dense)
  (x, y), = batches(1)
  v = model.init(jax.random.key(0), x)
  tx = forge_jax.sgd(0.1)
  loss, _, _ = jax.jit(forge_jax.make_step(mse(model), tx))(
      v, tx.init(v["params"]), (x, y))
  assert jnp.isfinite(loss)


def test_inject_hyperparams_trains_and_an_optax_factory_is_refused():
  # optax.inject_hyperparams of a forge_jax factory trains as optax's does
  # (tests/test_real_models.py changes the rate mid-run); of an optax
  # factory it is refused, naming the fix.
  train_both(optax.inject_hyperparams(forge_jax.adamw)(learning_rate=1e-3),
             optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))
  tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
  with pytest.raises(TypeError, match="Wrap the forge_jax factory"):
    forge_jax.make_step(mse(MLP(forge_jax.Dense)), tx)


def train_in_dtype(forge_tx, optax_tx, param_dtype, steps, jit=True):
  """FORGE's step and optax's reference step of the MLP with
  ``param_dtype`` parameters, each ``steps`` batches from one
  initialisation (jitted, or eager); returns ``(vf, sf, vr, sr)``."""
  kw = {"param_dtype": param_dtype}
  bs = batches(steps)
  mf, mr = MLP(forge_jax.Dense, kw), MLP(nn.Dense, kw)
  v = mr.init(jax.random.key(0), bs[0][0])
  wrap = jax.jit if jit else (lambda f: f)
  fs = wrap(forge_jax.make_step(mse(mf), forge_tx))
  rs = wrap(reference_step(mse(mr), optax_tx))
  vf, sf = v, forge_tx.init(v["params"])
  vr, sr = v, optax_tx.init(v["params"])
  for b in bs:
    _, vf, sf = fs(vf, sf, b)
    _, vr, sr = rs(vr, sr, b)
  return vf, sf, vr, sr


def assert_like_optax(vf, sf, vr, sr, param_dtype, same_dtypes=True):
  """Variables and state within ``param_dtype``'s bar of optax's; with
  ``same_dtypes``, the state's dtypes optax's leaf by leaf."""
  if same_dtypes:
    dtypes = lambda t: jax.tree.map(lambda a: jnp.dtype(a.dtype), t)
    assert dtypes(sf) == dtypes(sr)
  bar = tol(param_dtype)
  assert_trees_close(vf, vr, bar, what="variables")
  assert_trees_close(sf, sr, bar, what="opt_state")


def test_inject_hyperparams_widens_bf16_moments_as_optax():
  """With ``hyperparam_dtype=float32`` optax's injected hyperparameters are
  float32 arrays that are not weakly typed, so its step keeps a bfloat16
  parameter's first moment in float32 from the first step on (no
  mu_dtype; without it a bfloat16 model's hyperparameters are bfloat16,
  b2 rounds to 1 and optax's step is NaN). The FORGE
  kernels' state follows it: the same dtypes leaf by leaf (a checkpoint of
  either fits the other), the values within the bf16 bar (FORGE's G is
  float32, optax's gradient bfloat16)."""
  hp = dict(learning_rate=1e-2, weight_decay=0.1)
  forge_tx = optax.inject_hyperparams(
      forge_jax.adamw, hyperparam_dtype=jnp.float32)(**hp)
  optax_tx = optax.inject_hyperparams(
      optax.adamw, hyperparam_dtype=jnp.float32)(**hp)
  vf, sf, vr, sr = train_in_dtype(forge_tx, optax_tx, jnp.bfloat16, 3)
  mu = sr.inner_state[0].mu
  assert mu["Dense_0"]["kernel"].dtype == jnp.float32  # (optax's widening)
  assert_like_optax(vf, sf, vr, sr, jnp.bfloat16)


def _inject32(family):
  return lambda lib, **kw: optax.inject_hyperparams(
      getattr(lib, family), hyperparam_dtype=jnp.float32)(**kw)


def _factory(family, **fixed):
  return lambda lib, **kw: getattr(lib, family)(**fixed, **kw)


@pytest.mark.parametrize("make,kw", [
    # A hyperparameter that is not weakly typed (a NumPy float32 scalar)
    # promotes a bf16 moment it multiplies to float32: regime 1 (the
    # kernel's slots), regime 3 (optax's update, stored back in them).
    (_factory("sgd", momentum=np.float32(0.9)), dict(learning_rate=5e-2)),
    (_factory("adamw", b1=np.float32(0.9)), dict(learning_rate=1e-2)),
    (_factory("rmsprop", decay=np.float32(0.9)), dict(learning_rate=1e-2)),
    (_factory("lars", momentum=np.float32(0.9)), dict(learning_rate=5e-2)),
    # Injected float32 hyperparameters, regime 3.
    (_inject32("lars"), dict(learning_rate=5e-2)),
    (_inject32("sm3"), dict(learning_rate=5e-2)),
], ids=["sgd", "adamw", "rmsprop", "lars", "lars_injected", "sm3_injected"])
def test_a_bf16_models_state_keeps_optaxs_promoted_dtypes(make, kw):
  """Where optax's step promotes a bfloat16 parameter's state to float32
  and keeps it there (a float32 hyperparameter that is not weakly typed,
  no mu_dtype), the FORGE kernels' state does too: the same dtypes leaf
  by leaf (they had stayed bfloat16, rounded at every step), the values
  within the bf16 bar."""
  forge_tx, optax_tx = make(forge_jax, **kw), make(optax, **kw)
  vf, sf, vr, sr = train_in_dtype(forge_tx, optax_tx, jnp.bfloat16, 3)
  kernel_state = [a.dtype for k, a in jax.tree_util.tree_leaves_with_path(sr)
                  if "kernel" in jax.tree_util.keystr(k)]
  assert jnp.float32 in kernel_state  # (optax's widening)
  assert_like_optax(vf, sf, vr, sr, jnp.bfloat16)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_an_eager_injected_step_may_branch_on_a_hyperparameter(param_dtype):
  """optax's Adafactor branches in Python on min_dim_size_to_factor, which
  injection makes an array: an eager step (a concrete state) runs, as
  optax's eager update does, and matches it (the widening of the state
  never traces it)."""
  make = lambda lib: optax.inject_hyperparams(  # noqa: E731
      lib.adafactor, hyperparam_dtype=jnp.float32)(learning_rate=1e-2)
  assert_like_optax(*train_in_dtype(make(forge_jax), make(optax),
                                    param_dtype, 2, jit=False),
                    param_dtype, same_dtypes=False)


def test_a_state_made_by_another_transforms_init_is_refused_naming_it():
  """SGD with momentum's state given to SGD without: its trace holds arrays
  for the kernels that this transform does not update; refused, naming
  the init to use (optax ignores the extra field)."""
  model = MLP(forge_jax.Dense)
  (x, y), = batches(1)
  v = model.init(jax.random.key(0), x)
  step = forge_jax.make_step(mse(model), forge_jax.sgd(0.1))
  with pytest.raises(ValueError, match="this transform's init"):
    step(v, forge_jax.sgd(0.1, momentum=0.9).init(v["params"]), (x, y))


@pytest.mark.parametrize("clipped_state", [True, False],
                         ids=["clipped_state_plain_step",
                              "plain_state_clipped_step"])
def test_a_clipped_chains_state_and_a_plain_one_are_not_exchanged(
    clipped_state):
  """A clipped chain's state, optax.chain(clip_by_global_norm, adamw),
  given to a step built with adamw alone is refused naming the cause
  (optax's chain update would fail without it); the plain state given to
  the clipped step is refused as a state of another form."""
  model = MLP(forge_jax.Dense)
  (x, y), = batches(1)
  v = model.init(jax.random.key(0), x)
  plain = forge_jax.adamw(1e-2)
  clipped = optax.chain(forge_jax.clip_by_global_norm(1.0),
                        forge_jax.adamw(1e-2))
  if clipped_state:
    step = forge_jax.make_step(mse(model), plain)
    with pytest.raises(TypeError, match=(
        r"opt_state is a tuple of 2 where init\(\) makes a tuple of 3"
        r"(.|\n)*clipped chain")):
      step(v, clipped.init(v["params"]), (x, y))
  else:
    step = forge_jax.make_step(mse(model), clipped)
    with pytest.raises(ValueError, match="this transform's init"):
      step(v, plain.init(v["params"]), (x, y))
  # Each with its own state: runs.
  tx = plain if clipped_state else clipped
  loss, _, _ = step(v, tx.init(v["params"]), (x, y))
  assert bool(jnp.isfinite(loss))


@pytest.mark.parametrize("param_dtype,b1", [
    (jnp.float32, 0.9), (jnp.bfloat16, 0.9), (jnp.bfloat16, np.float32(0.9))],
    ids=["fp32", "bf16", "bf16_promoted"])
def test_an_eager_step_whose_init_reads_arrays_with_numpy_matches_optax(
    param_dtype, b1):
  """A weight-decay mask that reads its leaves with NumPy works on concrete
  arrays (an eager step) but not on shapes alone: the state check that
  traces ``init`` skips it, and so does the reading of a bf16 model's
  state dtypes from optax's update (which then runs it); the eager step
  equals optax's, in optax's dtypes (a float32 b1 promotes ``mu``)."""
  def mask(params):
    return jax.tree.map(lambda a: bool(np.asarray(a).ndim > 1), params)

  forge_tx = forge_jax.adamw(1e-2, b1=b1, weight_decay=0.1, mask=mask)
  optax_tx = optax.adamw(1e-2, b1=b1, weight_decay=0.1, mask=mask)
  assert_like_optax(*train_in_dtype(forge_tx, optax_tx, param_dtype, 2,
                                    jit=False), param_dtype)


# --- has_aux: BatchNorm statistics, metrics -----------------------------------


class BNNet(nn.Module):
  dense: type

  @nn.compact
  def __call__(self, x, train: bool = True):
    # No bias before BatchNorm: its gradient is zero up to rounding, which
    # Adam would scale to +-lr in either arm alike -- noise, not a check.
    x = self.dense(70, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return self.dense(5)(nn.relu(x))


def _aux_pair(loss, model_cls, bs):
  """Jitted has_aux steps, optax's and FORGE's (AdamW), and their start
  ``(variables, opt_state)`` twice: ``(v0, step_o, step_f, (vo, so, vf, sf))``."""
  v0 = model_cls(nn.Dense).init(jax.random.key(0), bs[0][0])
  tx_o, tx_f = optax.adamw(1e-2), forge_jax.adamw(1e-2)
  step_f = jax.jit(forge_jax.make_step(loss(model_cls(forge_jax.Dense)), tx_f,
                                       has_aux=True))
  step_o = jax.jit(reference_step(loss(model_cls(nn.Dense)), tx_o,
                                  has_aux=True))
  return v0, step_o, step_f, (v0, tx_o.init(v0["params"]), v0,
                              tx_f.init(v0["params"]))


def test_has_aux_carries_batch_stats_like_optax():
  def loss(model):
    def loss_fn(variables, batch):
      x, y = batch
      out, updates = model.apply(variables, x, mutable=["batch_stats"])
      return jnp.mean((out - y) ** 2), (updates["batch_stats"], out.mean())
    return loss_fn

  bs = batches(3)
  v0, step_o, step_f, (vo, so, vf, sf) = _aux_pair(loss, BNNet, bs)
  for batch in bs:
    (lo, (stats_o, mo)), vo, so = step_o(vo, so, batch)
    (lf, (stats_f, mf)), vf, sf = step_f(vf, sf, batch)
    # The caller puts the new statistics back, as with optax.
    vo = {**vo, "batch_stats": stats_o}
    vf = {**vf, "batch_stats": stats_f}
    assert jnp.allclose(lf, lo, rtol=RTOL) and jnp.allclose(mf, mo, rtol=RTOL)
  assert_trees_close(vf, vo, RTOL, "variables")
  assert_trees_close(sf, so, RTOL, "opt_state")
  assert not jnp.allclose(vf["batch_stats"]["BatchNorm_0"]["mean"],
                          v0["batch_stats"]["BatchNorm_0"]["mean"])


def test_has_aux_must_be_a_bool():
  with pytest.raises(TypeError, match="has_aux must be a bool"):
    forge_jax.make_step(mse(MLP(forge_jax.Dense)), forge_jax.adamw(1e-2),
                        has_aux="yes")


@pytest.mark.parametrize("stop", [False, True], ids=["plain", "stop_gradient"])
def test_an_aux_metric_reading_a_kernel_is_not_a_second_consumer(stop):
  """A logged weight norm in aux (never differentiated), or any
  stop_gradient read, passes no cotangent to the kernel: the layer stays
  fused and the step matches optax."""
  def loss(model):
    def loss_fn(variables, batch):
      x, y = batch
      k = variables["params"]["Dense_0"]["kernel"]
      if stop:
        k = jax.lax.stop_gradient(k)
      out = model.apply(variables, x)
      return jnp.mean((out - y) ** 2), jnp.sqrt(jnp.sum(k ** 2))
    return loss_fn

  bs = batches(3)
  _, step_o, step_f, (vo, so, vf, sf) = _aux_pair(loss, MLP, bs)
  for batch in bs:
    (_, norm_o), vo, so = step_o(vo, so, batch)
    (_, norm_f), vf, sf = step_f(vf, sf, batch)
    assert jnp.allclose(norm_f, norm_o, rtol=RTOL)
  assert_trees_close(vf, vo, RTOL, "variables")
  assert_trees_close(sf, so, RTOL, "opt_state")


def test_differentiating_the_step_is_refused_clearly():
  """jax.grad through a FORGE step (a meta-gradient): the in-place fused
  update has no derivative; the error says so instead of a Pallas one."""
  (x, y), = batches(1)
  model = MLP(forge_jax.Dense)
  v = model.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(mse(model), tx)

  def post_step_loss(v):
    _, v2, _ = step(v, tx.init(v["params"]), (x, y))
    return mse(MLP(nn.Dense))(v2, (x, y))

  with pytest.raises(NotImplementedError, match="being differentiated"):
    jax.grad(post_step_loss)(v)


def test_differentiating_a_scanned_stack_step_is_refused_clearly():
  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.ScannedDenseStack(features=8, num_layers=2)(x)

  model, x, y = Stack(), jnp.ones((4, 8)), jnp.zeros((4, 8))
  v = model.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(
      lambda v, b: jnp.mean((model.apply(v, b[0]) - b[1]) ** 2), tx)

  def post_step_sum(v):
    _, v2, _ = step(v, tx.init(v["params"]), (x, y))
    return jnp.sum(v2["params"]["ScannedDenseStack_0"]["kernel"])

  with pytest.raises(NotImplementedError,
                     match="ScannedDenseStack.*being differentiated"):
    jax.grad(post_step_sum)(v)


# --- batch values, FrozenDict, frozen and fused=False layers, MultiSteps ----


class DropMLP(nn.Module):
  dense: type

  @nn.compact
  def __call__(self, x, train):
    x = nn.relu(self.dense(11)(x))
    x = nn.Dropout(0.5, deterministic=not train)(x)
    return self.dense(5)(x)


def _loss_with_python_flag(model):
  def loss_fn(v, batch):
    x, y, train = batch  # `train` is a Python bool, used in an `if`
    rngs = {"dropout": jax.random.key(1)} if train else {}
    return jnp.mean((model.apply(v, x, train, rngs=rngs) - y) ** 2)
  return loss_fn


def test_an_unjitted_step_keeps_python_values_in_the_batch():
  """As jax.value_and_grad does: a Python flag in `batch` stays Python (the
  discovery pass abstracted the whole batch: TracerBoolConversionError)."""
  x, y = batches(1)[0]
  batch = (x, y, True)
  v = DropMLP(nn.Dense).init(jax.random.key(0), x, False)
  ref_tx, tx = optax.adam(1e-2), forge_jax.adam(1e-2)
  _, ref_v, ref_s = reference_step(
      _loss_with_python_flag(DropMLP(nn.Dense)), ref_tx)(
          v, ref_tx.init(v["params"]), batch)
  _, f_v, f_s = forge_jax.make_step(
      _loss_with_python_flag(DropMLP(forge_jax.Dense)), tx)(
          v, tx.init(v["params"]), batch)
  assert_trees_close(f_v, ref_v, RTOL, "variables")
  assert_trees_close(f_s, ref_s, RTOL, "opt_state")


def test_frozendict_variables_come_back_frozen_so_a_scan_carries_them():
  x, y = batches(1)[0]
  v = flax.core.freeze(MLP(forge_jax.Dense).init(jax.random.key(0), x))
  tx = forge_jax.adam(1e-2)
  step = forge_jax.make_step(mse(MLP(forge_jax.Dense)), tx)

  def body(carry, b):
    loss, vv, ss = step(*carry, b)
    return (vv, ss), loss

  (v2, _), losses = jax.lax.scan(body, (v, tx.init(v["params"])),
                                 (jnp.stack([x, x]), jnp.stack([y, y])))
  assert isinstance(v2, flax.core.FrozenDict)
  assert jax.tree.structure(v2) == jax.tree.structure(v)
  assert losses[1] < losses[0]


def test_every_layer_fused_false_gives_the_optax_step():
  """A config switch turning every layer's fusion off (to A/B the fused
  path) gets optax's step (it raised 'no forge_jax.Dense layer')."""
  x, y = batches(1)[0]
  v = MLP(nn.Dense).init(jax.random.key(0), x)
  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  tx, ref_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
  _, f_v, f_s = forge_jax.make_step(
      mse(MLP(forge_jax.Dense, {"fused": False})), tx)(
          v, tx.init(v["params"]), (x, y))
  _, ref_v, ref_s = reference_step(mse(MLP(nn.Dense)), ref_tx)(
      v, ref_tx.init(v["params"]), (x, y))
  assert_trees_close(f_v, ref_v, RTOL, "variables")
  assert_trees_close(f_s, ref_s, RTOL, "opt_state")


def _loss_freezing_first_layer(model):
  def loss_fn(v, b):
    p = dict(v["params"])
    p["Dense_0"] = jax.lax.stop_gradient(p["Dense_0"])
    return jnp.mean((model.apply({**v, "params": p}, b[0]) - b[1]) ** 2)
  return loss_fn


@pytest.mark.parametrize("shared", ["error", "standard"])
def test_a_layer_frozen_by_stop_gradient_gets_optaxs_zero_gradient_update(
    shared):
  """optax gives the frozen kernel a zero gradient (AdamW: weight decay
  only); it was refused as 'did not read its kernel through its fused op'.
  It takes the standard path without a SharedWeightsWarning."""
  x, y = batches(1)[0]
  v = MLP(nn.Dense).init(jax.random.key(0), x)
  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  tx, ref_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
  _, ref_v, ref_s = reference_step(
      _loss_freezing_first_layer(MLP(nn.Dense)), ref_tx)(
          v, ref_tx.init(v["params"]), (x, y))
  step = forge_jax.make_step(_loss_freezing_first_layer(
      MLP(forge_jax.Dense)), tx, shared=shared)
  with warnings.catch_warnings():
    warnings.simplefilter("error", forge_jax.SharedWeightsWarning)
    _, f_v, f_s = step(v, tx.init(v["params"]), (x, y))
  assert_trees_close(f_v, ref_v, RTOL, "variables")
  assert_trees_close(f_s, ref_s, RTOL, "opt_state")
  assert step.standard_layers == ["Dense_0"]
  # (not vacuous: the frozen kernel moved by weight decay alone, the other
  # one by its gradient)
  k0 = v["params"]["Dense_0"]["kernel"]
  assert_trees_close(f_v["params"]["Dense_0"]["kernel"], k0 * (1 - 1e-2 * 0.1),
                     RTOL, "frozen kernel")


def test_forge_multisteps_has_optaxs_has_updated():
  x, y = batches(1)[0]
  v = MLP(forge_jax.Dense).init(jax.random.key(0), x)
  tx = forge_jax.MultiSteps(forge_jax.adam(1e-2), 2)
  ref = optax.MultiSteps(optax.adam(1e-2), 2)
  step = jax.jit(forge_jax.make_step(mse(MLP(forge_jax.Dense)), tx))
  state = tx.init(v["params"])
  seen = []
  for _ in range(4):
    _, v, state = step(v, state, (x, y))
    seen.append(bool(tx.has_updated(state)))
    assert bool(tx.has_updated(state)) == bool(ref.has_updated(state))
  assert seen == [False, True, False, True]


def test_forge_multisteps_has_optaxs_attributes():
  """inner_opt and gradient_transformation(), as optax.MultiSteps has:
  code written for optax's reads them unchanged."""
  inner = forge_jax.adam(1e-2)
  tx = forge_jax.MultiSteps(inner, 2)
  assert tx.inner_opt is inner
  gt = tx.gradient_transformation()
  assert isinstance(gt, optax.GradientTransformation)
  assert gt.init is tx.init and gt.update is tx.update
  x, _ = batches(1)[0]
  params = MLP(forge_jax.Dense).init(jax.random.key(0), x)["params"]
  ref = optax.MultiSteps(optax.adam(1e-2), 2)
  assert (jax.tree.structure(gt.init(params))
          == jax.tree.structure(ref.gradient_transformation().init(params)))


def test_optax_multisteps_is_refused_naming_forge_multisteps():
  """optax.MultiSteps, also as its gradient_transformation(), gets the
  advice to use forge_jax.MultiSteps; accumulation's state given to a
  step whose transform does not accumulate is refused naming both (it
  was read as the transform's, and blamed on a layer's fusing)."""
  ms = optax.MultiSteps(forge_jax.adamw(1e-3), 2)
  for tx in (ms, ms.gradient_transformation()):
    with pytest.raises(TypeError, match=r"use forge_jax\.MultiSteps"):
      forge_jax.make_step(lambda v, b: 0.0, tx)
  model = MLP(forge_jax.Dense)
  (x, y), = batches(1)
  variables = model.init(jax.random.key(0), x)
  accumulating = forge_jax.MultiSteps(forge_jax.adamw(1e-3), 2)
  step = forge_jax.make_step(mse(model), forge_jax.adamw(1e-3))
  with pytest.raises(TypeError, match=(
      r"opt_state is gradient accumulation's state \(an "
      r"optax.MultiStepsState(.|\n)*does not accumulate")):
    step(variables, accumulating.init(variables["params"]), (x, y))
  # The accumulating step takes it.
  loss, _, state = forge_jax.make_step(mse(model), accumulating)(
      variables, accumulating.init(variables["params"]), (x, y))
  assert isinstance(state, optax.MultiStepsState) and bool(
      jnp.isfinite(loss))


def test_a_forge_transformation_without_a_spec_is_refused_plainly():
  """ForgeTransformation wrapped around an optax transform by hand carries
  no ForgeSpec: make_step (also made by an injected factory) and
  MultiSteps refuse it saying so (they raised an AttributeError on its
  spec), and so does the NNX optimizer."""
  from flax import nnx  # noqa: PLC0415
  tx = forge_jax.ForgeTransformation(*optax.adamw(1e-3))
  injected = optax.inject_hyperparams(
      lambda learning_rate: forge_jax.ForgeTransformation(
          *optax.adamw(learning_rate)))(learning_rate=1e-3)
  for build in (lambda: forge_jax.make_step(lambda v, b: 0.0, tx),
                lambda: forge_jax.make_step(lambda v, b: 0.0, injected),
                lambda: forge_jax.MultiSteps(tx, 2),
                lambda: forge_jax.nnx.Optimizer(
                    nnx.Linear(3, 2, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)):
    with pytest.raises(TypeError, match=r"no ForgeSpec \(spec=None\)"):
      build()


def test_a_frozen_layer_with_a_regulariser_on_its_kernel_is_optaxs_step():
  """The layer reads its kernel through stop_gradient and a loss term reads
  it directly (an L2 penalty): the standard path, as optax (it raised 'did
  not read its kernel through its fused op', even with shared='standard')."""
  x, y = batches(1)[0]
  v = MLP(nn.Dense).init(jax.random.key(0), x)

  def loss(model):
    def loss_fn(v, b):
      p = dict(v["params"])
      penalty = 1e-2 * jnp.sum(p["Dense_0"]["kernel"] ** 2)
      p["Dense_0"] = jax.lax.stop_gradient(p["Dense_0"])
      out = model.apply({**v, "params": p}, b[0])
      return jnp.mean((out - b[1]) ** 2) + penalty
    return loss_fn

  tx, ref_tx = forge_jax.adam(1e-2), optax.adam(1e-2)
  _, ref_v, ref_s = reference_step(loss(MLP(nn.Dense)), ref_tx)(
      v, ref_tx.init(v["params"]), (x, y))
  step = forge_jax.make_step(loss(MLP(forge_jax.Dense)), tx)
  _, f_v, f_s = step(v, tx.init(v["params"]), (x, y))
  assert_trees_close(f_v, ref_v, RTOL, "variables")
  assert_trees_close(f_s, ref_s, RTOL, "opt_state")
  assert step.standard_layers == ["Dense_0"]


class _WithEmptyLayer(nn.Module):
  """A Dense of no output features beside the input (its kernel has no
  elements), then a Dense over both."""
  dense: Any

  @nn.compact
  def __call__(self, x):
    h = self.dense(0)(x)
    return self.dense(3)(jnp.concatenate([x, h], -1))


def test_a_layer_with_an_empty_kernel_takes_the_standard_path():
  """A kernel with no elements has nothing for the fused kernel to update:
  the layer takes the standard path (listed in standard_layers, without a
  shared-weights warning) and the step matches optax."""
  x, y = jnp.linspace(-1, 1, 20).reshape(4, 5), jnp.zeros((4, 3))
  mf, mr = _WithEmptyLayer(forge_jax.Dense), _WithEmptyLayer(nn.Dense)
  v = mr.init(jax.random.key(0), x)
  tx_f, tx_o = forge_jax.adamw(1e-2), optax.adamw(1e-2)
  step = forge_jax.make_step(mse(mf), tx_f)
  with warnings.catch_warnings():
    warnings.simplefilter("error", forge_jax.SharedWeightsWarning)
    _, vf, sf = jax.jit(step)(v, tx_f.init(v["params"]), (x, y))
  assert step.standard_layers == ["Dense_0"]
  _, vr, sr = jax.jit(reference_step(mse(mr), tx_o))(
      v, tx_o.init(v["params"]), (x, y))
  assert_trees_close(vf, vr, RTOL, what="variables")
  assert_trees_close(sf, sr, RTOL, what="opt_state")


_SCHEDULE = optax.linear_schedule(1e-2, 0.0, 10)


@pytest.mark.parametrize("made_by, stepped_by, match", [
    (lambda: forge_jax.adamw(1e-2), lambda: forge_jax.adamw(
        1e-2, moments="int8"),
     r"forge_jax.adamw: opt_state is a tuple of optax states.* this "
     r"transform keeps low-precision state, a LowPrecisionState_mu_nu"),
    (lambda: forge_jax.adamw(1e-2, moments="int8"),
     lambda: forge_jax.adamw(1e-2),
     r"forge_jax.adamw: opt_state holds a low-precision state "
     r"\(LowPrecisionState_mu_nu.*this transform keeps optax's state"),
    (lambda: forge_jax.adamw(1e-2), lambda: forge_jax.adamw(_SCHEDULE),
     r"opt_state has no ScaleByScheduleState"),
], ids=["optax_state_to_int8", "int8_state_to_optax", "no_schedule_count"])
def test_an_opt_state_of_another_format_is_refused_naming_the_fix(
    made_by, stepped_by, match):
  """An opt_state whose format is not the transform's (made with other
  moments=, or without the step count a schedule reads) is refused as make_step
  refuses other mismatches: was it made by this transform's init()?"""
  model = forge_jax.Dense(3)
  x = jnp.linspace(-1, 1, 20).reshape(4, 5)
  v = model.init(jax.random.key(0), x)
  step = forge_jax.make_step(lambda v, b: jnp.mean(model.apply(v, b) ** 2),
                             stepped_by())
  with pytest.raises(ValueError, match=match + r".*was it made by this "
                     r"transform's init\(\)\?"):
    jax.jit(step)(v, made_by().init(v["params"]), x)


# --- float64 layers, mismatched opt_state trees, teachers ---------------------


class _Stacked(nn.Module):
  """A ScannedDenseStack in the dtype under test (its input in it too: the
  scan's carry keeps one dtype)."""
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    x = x.astype(self.param_dtype)
    return forge_jax.ScannedDenseStack(
        37, 2, param_dtype=self.param_dtype)(x)[..., :5]


@pytest.mark.parametrize("layer", ["Dense", "DenseGeneral",
                                   "ScannedDenseStack"])
def test_a_float64_forge_layer_is_refused_naming_it_its_dtype_and_the_fix(
    layer):
  """With x64 on, a FORGE layer of float64 parameters (float32 inputs) is
  refused naming the layer, its kernel dtype, the dtypes the fused kernel
  takes and the fix (it said 'x is float64: ... cast it first'); with
  fused=False it trains as optax does, in float64."""
  (x, y), = batches(1)
  with jax.enable_x64(True):
    f64 = {"param_dtype": jnp.float64}
    model, name, kind = {
        "Dense": (MLP(forge_jax.Dense, f64), "Dense_0", "forge_jax.Dense"),
        "DenseGeneral": (MLP(forge_jax.DenseGeneral, f64), "DenseGeneral_0",
                         "forge_jax.DenseGeneral"),
        "ScannedDenseStack": (_Stacked(jnp.float64), "ScannedDenseStack_0",
                              "forge_jax.ScannedDenseStack"),
    }[layer]
    v = model.init(jax.random.key(0), x)
    tx = forge_jax.adamw(1e-2)
    with pytest.raises(TypeError, match=(
        f"{kind} at '{name}': its kernel dtype is float64: the fused kernel "
        r"computes in fp32 and stores fp32, bf16 or fp16 \(give this layer "
        r"param_dtype float32 or bfloat16.*or fused=False")):
      forge_jax.make_step(mse(model), tx)(v, tx.init(v["params"]), (x, y))
    if layer != "Dense":
      return
    kw = dict(learning_rate=1e-2, weight_decay=0.1)
    tx, ref_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
    _, f_v, f_s = forge_jax.make_step(
        mse(MLP(forge_jax.Dense, {**f64, "fused": False})), tx)(
            v, tx.init(v["params"]), (x, y))
    _, ref_v, ref_s = reference_step(mse(MLP(nn.Dense, f64)), ref_tx)(
        v, ref_tx.init(v["params"]), (x, y))
    assert f_v["params"]["Dense_0"]["kernel"].dtype == jnp.float64
    assert_trees_close(f_v, ref_v, tol(jnp.float64), "variables")
    assert_trees_close(f_s, ref_s, tol(jnp.float64), "opt_state")


@pytest.mark.parametrize("param_dtype", [jnp.float8_e4m3fn,
                                         jnp.float8_e5m2])
def test_an_8_bit_float_forge_layer_is_refused_naming_it(param_dtype):
  """A FORGE layer of 8-bit float parameters (bf16 computation) is refused
  naming the layer, its kernel dtype and the fix (it failed inside the
  kernel's call, on the optimizer's moments, naming neither)."""
  (x, y), = batches(1)
  model = MLP(forge_jax.Dense, {"param_dtype": param_dtype,
                                "dtype": jnp.bfloat16})
  v = model.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-2)
  name = jnp.dtype(param_dtype).name
  with pytest.raises(TypeError, match=(
      f"forge_jax.Dense at 'Dense_0': its kernel dtype is {name}: the fused "
      r"kernel reads and stores fp32, bf16 or fp16 weights and activations "
      r"\(give this layer param_dtype float32 or bfloat16")):
    forge_jax.make_step(mse(model), tx)(v, tx.init(v["params"]), (x, y))


def test_a_float64_input_names_the_input_and_its_fix():
  """With x64 on, float32 parameters and a float64 input (the layer sets no
  dtype): the computation dtype comes from the input, and the refusal says
  so and how to fix it (cast the input or set dtype), not only the
  param_dtype advice, which this layer already follows."""
  (x, y), = batches(1)
  with jax.enable_x64(True):
    model = MLP(forge_jax.Dense, {})
    v = model.init(jax.random.key(0), x)
    x64 = jnp.asarray(x, jnp.float64)
    tx = forge_jax.adamw(1e-2)
    with pytest.raises(TypeError, match=(
        r"forge_jax.Dense at 'Dense_0': its computation dtype is float64 "
        r"\(from its float64 input and float32 kernel: the layer sets no "
        r"dtype\): the fused kernel computes in fp32 and stores fp32, bf16 or "
        r"fp16 \(cast the input to float32 or bfloat16, or give the layer "
        r"dtype=jnp.float32; give this layer param_dtype")):
      forge_jax.make_step(mse(model), tx)(v, tx.init(v["params"]), (x64, y))


def _without_layer(state, name):
  """``state`` (adamw's) with the ``mu`` and ``nu`` entries of layer
  ``name`` left out."""
  adam = state[0]
  mu, nu = dict(adam.mu), dict(adam.nu)
  del mu[name], nu[name]
  return (adam._replace(mu=mu, nu=nu),) + tuple(state[1:])


_WHOLE_VARIABLES = (
    r"it has no entry for the parameters at \['Dense_0'\]; it has an entry "
    r"at \['params'\], which the parameters lack\. Its tree has a top-level "
    r"'params' key.*tx\.init\(variables\[\"params\"\]\), not "
    r"tx\.init\(variables\)")


@pytest.mark.parametrize("tx_of, made, field, match", [
    (lambda: forge_jax.adamw(1e-2), "whole_variables", "mu",
     _WHOLE_VARIABLES),
    (lambda: forge_jax.MultiSteps(forge_jax.sgd(1e-2, momentum=0.9), 2,
                                  mode="momentum"),
     "whole_variables", "trace", _WHOLE_VARIABLES),
    (lambda: forge_jax.adamw(1e-2), "entry_missing", "mu",
     r"it has no entry for the parameters at \['Dense_1'\]\. Was it made by "
     r"this transform's init\(\) on these parameters "
     r"\(tx\.init\(variables\[\"params\"\]\)"),
], ids=["adamw_whole_variables", "multisteps_momentum_whole_variables",
        "adamw_entry_missing"])
def test_an_opt_state_whose_tree_is_not_the_params_names_where(
    tx_of, made, field, match):
  """An opt_state whose moments' tree is not the parameters' -- built with
  tx.init(variables), or missing a layer's entry -- is refused naming the
  field, the first path where it departs and (for the first) the
  tx.init(variables["params"]) fix; it said "opt_state has no ['mu', 'nu']
  field(s)", though the fields exist."""
  (x, y), = batches(1)
  model = MLP(forge_jax.Dense)
  v = model.init(jax.random.key(0), x)
  tx = tx_of()
  state = (tx.init(v) if made == "whole_variables"
           else _without_layer(tx.init(v["params"]), "Dense_1"))
  with pytest.raises(ValueError, match=(
      rf"the tree of opt_state's '{field}' field does not match the "
      r"parameters' tree: " + match)):
    jax.jit(forge_jax.make_step(mse(model), tx))(v, state, (x, y))


def _distillation(student, teacher, teacher_variables):
  """MSE to the targets plus MSE to ``teacher`` applied to its own
  variables under stop_gradient."""
  def loss_fn(variables, batch):
    x, y = batch
    s = student.apply(variables, x)
    t = jax.lax.stop_gradient(teacher.apply(teacher_variables, x))
    return jnp.mean((s - y) ** 2) + jnp.mean((s - t) ** 2)
  return loss_fn


def test_a_teacher_of_forge_layers_is_named_in_the_second_call_error():
  """The model applied twice, the second time to a teacher's variables: the
  error says a second model's application counts and names the fixes that
  keep the student fused; a layer called twice on its own kernel does not
  get that note."""
  bs = batches(1)
  model = MLP(forge_jax.Dense)
  v = model.init(jax.random.key(0), bs[0][0])
  tv = model.init(jax.random.key(5), bs[0][0])
  tx = forge_jax.adamw(1e-2)
  with pytest.raises(ValueError, match=(
      r"forge_jax.Dense at 'Dense_0' is called more than once.*"
      r"shared=\"standard\".*Its calls read different kernel arrays.*"
      r"teacher.*flax\.linen\.Dense layers \(or forge_jax\.Dense\(\.\.\., "
      r"fused=False\)\).*outside loss_fn.*convert=True")):
    forge_jax.make_step(_distillation(model, model, tv), tx)(
        v, tx.init(v["params"]), bs[0])

  def twice(variables, batch):
    x, y = batch
    return jnp.mean((model.apply(variables, x) + model.apply(variables, -x)
                     - y) ** 2)

  with pytest.raises(ValueError, match="is called more than once") as info:
    forge_jax.make_step(twice, tx)(v, tx.init(v["params"]), bs[0])
  assert "teacher" not in str(info.value)

  class Remat(nn.Module):  # one layer called twice beneath nn.remat: each
    @nn.compact            # call reads the transform's copy of its kernel
    def __call__(self, x):
      d = nn.remat(forge_jax.Dense)(5, name="d")
      return d(x) + d(-x)

  remat = Remat()
  rv = remat.init(jax.random.key(0), bs[0][0])
  with pytest.raises(ValueError, match="is called more than once") as info:
    forge_jax.make_step(mse(remat), tx)(rv, tx.init(rv["params"]), bs[0])
  assert "teacher" not in str(info.value)


@pytest.mark.parametrize("teacher", ["nn.Dense", "fused=False", "outside"])
def test_a_teacher_without_forge_layers_keeps_the_student_fused(teacher):
  """The fixes the error names: the teacher built from nn.Dense or
  fused=False layers, or its output computed outside loss_fn, trains as
  optax does, and both student layers stay fused."""
  bs = batches(2)
  mf, mr = MLP(forge_jax.Dense), MLP(nn.Dense)
  v = mr.init(jax.random.key(0), bs[0][0])
  tv = mr.init(jax.random.key(5), bs[0][0])
  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  tx, ref_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
  if teacher == "outside":
    def loss_fn(variables, batch):
      x, y, t = batch
      s = mf.apply(variables, x)
      return jnp.mean((s - y) ** 2) + jnp.mean((s - t) ** 2)
    step = forge_jax.make_step(loss_fn, tx)
    # Outside a step forge_jax.Dense is nn.Dense: the teacher is mf itself.
    run = jax.jit(lambda v, s, b: step(v, s, (*b, jax.lax.stop_gradient(
        mf.apply(tv, b[0])))))
  else:
    tm = (mr if teacher == "nn.Dense"
          else MLP(forge_jax.Dense, {"fused": False}))
    step = forge_jax.make_step(_distillation(mf, tm, tv), tx)
    run = jax.jit(step)
  ref = jax.jit(reference_step(_distillation(mr, mr, tv), ref_tx))
  run_both(run, tx, ref, ref_tx, v, bs)
  assert step.standard_layers == []
  traced = run.trace(v, tx.init(v["params"]), bs[0])
  assert str(traced.jaxpr).count("pallas_call") == 2
