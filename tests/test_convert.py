"""make_step(..., convert=True): an unmodified flax.linen model's nn.Dense and
nn.DenseGeneral layers (its own, and those Flax builds inside
nn.MultiHeadDotProductAttention) trained as FORGE layers, against optax +
jax.value_and_grad (CPU, fp32, tiny widths); what cannot be fused stays on
the standard path and is reported. The scanned variant of the LM is in
test_real_models.py."""

import warnings

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
import optax
import pytest

import forge_jax
from tests import third_party_lm as tp
from tests.harness import MLP, mse, reference_step
from tests.tolerances import assert_close, assert_trees_close, rel_err, tol

RTOL = tol(jnp.float32)


def is_box(x):
  return isinstance(x, flax.core.meta.AxisMetadata)


def names_of(tree):
  """The boxes' names, by path (plain leaves: None)."""
  return jax.tree.map(lambda b: b.names if is_box(b) else None, tree,
                      is_leaf=is_box)


def kernel_layers(params):
  """The names of the layers with a ``kernel`` parameter (the projections)."""
  return sorted("/".join(k.key for k in kp[:-1])
                for kp, _ in jax.tree_util.tree_leaves_with_path(
                    params, is_leaf=is_box) if kp[-1].key == "kernel")


def fused_calls(traced) -> int:
  """The number of fused kernel calls in a traced step's jaxpr."""
  return str(traced.jaxpr).count("pallas_call")


def trace(step, *args):
  """``jax.jit(step)`` traced on ``args`` (the step's reports are set), and
  its number of fused kernel calls."""
  traced = jax.jit(step).trace(*args)
  return traced, fused_calls(traced)


def train_side_by_side(step, reference, v_forge, s_forge, v_ref, s_ref, bs):
  """Both steps compiled (the FORGE one first: its reports are then set) and
  run over ``bs``; returns the FORGE step's traced form and both ends
  ``(loss, variables, opt_state)``."""
  traced, fs = tp.compiled(step, v_forge, s_forge, bs[0])
  _, rs = tp.compiled(reference, v_ref, s_ref, bs[0])
  for b in bs:
    lf, v_forge, s_forge = fs(v_forge, s_forge, b)
    lr, v_ref, s_ref = rs(v_ref, s_ref, b)
  return traced, (lf, v_forge, s_forge), (lr, v_ref, s_ref)


# --- The third-party Transformer LM -------------------------------------------


def train_lm(model, steps=10, **tx_kw):
  """Trains ``model`` (boxed parameters, dropout on) ``steps`` steps with
  ``forge_jax.adamw`` + ``make_step(..., convert=True)`` and with
  ``optax.adamw`` + ``jax.value_and_grad`` from the same start; returns the
  step, its fused-call count, both ends and the start."""
  bs = tp.batches(steps)
  boxed = tp.init(model, bs[0][0])
  plain = flax.core.meta.unbox(boxed)
  forge_tx, optax_tx = forge_jax.adamw(**tx_kw), optax.adamw(**tx_kw)
  step = forge_jax.make_step(tp.next_token_loss(model), forge_tx, convert=True)
  traced, forge, ref = train_side_by_side(
      step, reference_step(tp.next_token_loss(model), optax_tx), boxed,
      forge_tx.init(boxed["params"]), plain, optax_tx.init(plain["params"]),
      bs)
  return step, fused_calls(traced), forge, ref, boxed


def test_third_party_lm_trains_as_optax_with_every_projection_fused():
  """Embedding, nn.MultiHeadDotProductAttention, nn.Dense MLP, LayerNorm,
  dropout with an rng, nn.with_logical_partitioning: 10 fp32 steps equal
  optax's on every parameter and moment, with all 13 projections (4
  attention nn.DenseGeneral + 2 MLP nn.Dense per block, the head) fused."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", forge_jax.ConvertSkipWarning)
    step, calls, (lf, vf, sf), (lr, vr, sr), boxed = train_lm(
        tp.LM(), learning_rate=1e-2, weight_decay=0.1)
  projections = kernel_layers(boxed["params"])
  assert len(projections) == 2 * 6 + 1
  assert step.converted == projections
  assert step.skipped == {} and step.standard_layers == []
  assert calls == len(projections)
  # Same tree, same boxes and names: the model's own variables, trained.
  assert jax.tree.structure(vf, is_leaf=is_box) == jax.tree.structure(
      boxed, is_leaf=is_box)
  assert names_of(vf) == names_of(boxed)
  assert names_of(sf) == names_of(forge_jax.adamw(1e-2).init(boxed["params"]))
  assert_close(lf, lr, RTOL, "last loss")
  assert_trees_close(flax.core.meta.unbox(vf), vr, RTOL, "variables")
  assert_trees_close(flax.core.meta.unbox(sf), sr, RTOL, "opt_state")
  query = ("params", "Block_1", "MultiHeadDotProductAttention_0", "query",
           "kernel")
  get = lambda t: flax.core.meta.unbox(t)[query[0]][query[1]][query[2]][
      query[3]][query[4]]
  assert get(vf).shape == get(boxed).shape == (16, 2, 8)
  assert rel_err(get(vf), get(boxed)) > 1e-3  # it trained


@pytest.mark.gpu
def test_third_party_lm_matches_optax_compiled_on_gpu():
  with jax.default_matmul_precision("highest"):
    step, calls, (lf, vf, sf), (lr, vr, sr), boxed = train_lm(
        tp.LM(d_model=64, d_ff=96, num_heads=4), learning_rate=1e-3,
        weight_decay=0.1)
  assert calls == len(kernel_layers(boxed["params"])) and step.skipped == {}
  assert_trees_close(flax.core.meta.unbox(vf), vr, RTOL, "variables")
  assert_trees_close(flax.core.meta.unbox(sf), sr, RTOL, "opt_state")


# --- What stays on the standard path ------------------------------------------


def custom_dot(lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None):
  """A user's dot_general (here plain lax.dot_general: a quantised matmul
  would stand here)."""
  return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                         preferred_element_type=preferred_element_type)


class Mixed(nn.Module):
  """Layers convert=True fuses, layers it cannot, and a FORGE layer."""

  @nn.compact
  def __call__(self, x):  # (4, 3, 6)
    h = nn.relu(nn.Dense(8)(x))
    heads = nn.DenseGeneral((2, 3), name="heads")(h)  # kernel (8, 2, 3)
    per_batch = nn.DenseGeneral(6, batch_dims=(0,), name="per_batch")(h)
    over_time = nn.DenseGeneral(6, axis=-2, name="over_time")(h)  # (4, 8, 6)
    custom = nn.Dense(6, dot_general=custom_dot, name="custom")(h)
    own = forge_jax.Dense(6, name="own")(h)
    return (heads.reshape(custom.shape) + per_batch + custom + own
            + over_time.mean(axis=1, keepdims=True))


def mixed_data(steps):
  k = jax.random.split(jax.random.key(3), 2 * steps)
  return [(jax.random.normal(k[2 * i], (4, 3, 6)),
           jax.random.normal(k[2 * i + 1], (4, 3, 6))) for i in range(steps)]


def add_one(next_fun, args, kwargs, context):
  """An interceptor (an adapter, say) adding 1 to every Dense output."""
  out = next_fun(*args, **kwargs)
  if (isinstance(context.module, (nn.Dense, nn.DenseGeneral))
      and context.method_name == "__call__"):
    out = out + 1.0
  return out


def test_what_cannot_be_fused_trains_as_optax_and_is_reported():
  """Fused and unfused layers side by side train as optax does; the unfused
  ones are reported once, with their reasons. An interceptor entered outside
  the step, and capture_intermediates, see each layer's call once, as
  without FORGE."""
  bs = mixed_data(3)
  model = Mixed()
  v = model.init(jax.random.key(0), bs[0][0])

  def loss_fn(variables, batch):
    out, state = model.apply(variables, batch[0], capture_intermediates=True,
                             mutable=["intermediates"])
    return jnp.mean((out - batch[1]) ** 2), state["intermediates"]

  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  forge_tx, optax_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
  step = forge_jax.make_step(loss_fn, forge_tx, has_aux=True, convert=True)
  with pytest.warns(forge_jax.ConvertSkipWarning) as record, \
      nn.intercept_methods(add_one):  # entered while both steps are traced
    traced, ((lf, aux_f), vf, sf), ((lr, aux_r), vr, sr) = train_side_by_side(
        step, reference_step(loss_fn, optax_tx, has_aux=True), v,
        forge_tx.init(v["params"]), v, optax_tx.init(v["params"]), bs)
  skips = [w for w in record if w.category is forge_jax.ConvertSkipWarning]
  assert len(skips) == 1  # once per trace
  message = str(skips[0].message)
  for name in ("per_batch", "over_time", "custom"):
    assert f"  {name}: " in message
  assert step.converted == ["Dense_0", "heads"]  # `own` was FORGE already
  assert sorted(step.skipped) == ["custom", "over_time", "per_batch"]
  assert "batch_dims=(0,)" in step.skipped["per_batch"]
  assert "axis=-2" in step.skipped["over_time"]
  assert "not the input's trailing axes" in step.skipped["over_time"]
  assert "custom dot_general" in step.skipped["custom"]
  assert fused_calls(traced) == 3  # Dense_0, heads, own
  assert jax.tree.structure(aux_f) == jax.tree.structure(aux_r)
  assert len(aux_f["heads"]["__call__"]) == 1
  assert_trees_close(aux_f, aux_r, RTOL, "intermediates")
  assert_close(lf, lr, RTOL, "last loss")
  assert_trees_close(vf, vr, RTOL, "variables")
  assert_trees_close(sf, sr, RTOL, "opt_state")
  for name in ("per_batch", "heads"):
    assert rel_err(vf["params"][name]["kernel"],
                   v["params"][name]["kernel"]) > 1e-3


class PlainSubclass(nn.Dense):
  pass


class WrappingSubclass(nn.Dense):
  def __call__(self, x):
    return 2.0 * super().__call__(x)


class FromSetup(nn.Module):
  def setup(self):
    self.dense = nn.Dense(7)

  def __call__(self, x):
    return self.dense(x)


class Shapes(nn.Module):
  """nn.Dense written the ways models write it."""

  @nn.compact
  def __call__(self, x):
    x = FromSetup(name="from_setup")(x)
    x = nn.remat(nn.Dense)(6, name="rematted")(x)
    x = PlainSubclass(5, name="plain_subclass")(x)
    x = WrappingSubclass(4, name="wrapping_subclass")(x)
    return nn.remat(nn.DenseGeneral)((1, 3), name="rematted_general")(x)


def test_layers_from_setup_remat_and_subclasses_are_converted():
  x = jax.random.normal(jax.random.key(1), (6, 8))
  v = jax.jit(Shapes().init)(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(lambda v, x: jnp.mean(Shapes().apply(v, x) ** 2),
                             tx, convert=True)
  _, calls = trace(step, v, tx.init(v["params"]), x)
  assert step.converted == [
      "from_setup/dense", "plain_subclass", "rematted", "rematted_general",
      "wrapping_subclass"] == kernel_layers(v["params"])
  assert step.skipped == {} and calls == 5


class HeadsBlock(nn.Module):
  """A scanned block with one 3-axis nn.DenseGeneral kernel, (8, 2, 4)."""

  @nn.compact
  def __call__(self, h):
    return h + nn.DenseGeneral((2, 4), name="heads")(h).reshape(h.shape)


class Heads(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = forge_jax.ScannedBlocks(HeadsBlock, 2, name="blocks")(nn.Dense(8)(x))
    return nn.DenseGeneral((2, 3), name="heads")(h)  # kernel (8, 2, 3)


@pytest.mark.parametrize("family", ["adamw", "muon"])
def test_dense_general_kernels_of_three_axes_are_converted_but_for_muon(
    family):
  """A 3-axis nn.DenseGeneral kernel is converted, in a ScannedBlocks block
  as in the model (its stack stepped as (L, n_in, n_out) views); under
  Muon, which optax applies to the kernel as it is, both stay standard and
  are reported."""
  x = jnp.ones((4, 3, 6))
  v = Heads().init(jax.random.key(0), x)
  tx = getattr(forge_jax, family)(1e-2)
  step = forge_jax.make_step(
      lambda v, x: jnp.mean(Heads().apply(v, x) ** 2), tx, convert=True)
  if family == "adamw":
    with warnings.catch_warnings():
      warnings.simplefilter("error", forge_jax.ConvertSkipWarning)
      _, calls = trace(step, v, tx.init(v["params"]), x)
    assert step.converted == ["Dense_0", "blocks/block/heads", "heads"]
    assert step.skipped == {} and calls == 3
    return
  with pytest.warns(forge_jax.ConvertSkipWarning, match="heads: .*Muon"):
    _, calls = trace(step, v, tx.init(v["params"]), x)
  assert step.converted == ["Dense_0"] and calls == 1
  assert sorted(step.skipped) == ["blocks/block/heads", "heads"]
  for why in step.skipped.values():
    assert "orthogonalizes a matrix" in why


class Teacher(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(5, name="teacher_head")(x)


def test_a_second_model_in_the_loss_is_not_converted():
  x, y = jax.random.normal(jax.random.key(1), (6, 37)), jnp.zeros((6, 5))
  student = MLP(nn.Dense)
  v = student.init(jax.random.key(0), x)
  tv = Teacher().init(jax.random.key(1), x)

  def loss_fn(variables, batch):
    x, y = batch
    target = lax.stop_gradient(Teacher().apply(tv, x))  # a frozen teacher
    return jnp.mean((student.apply(variables, x) - target - y) ** 2)

  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(loss_fn, tx, convert=True)
  with pytest.warns(forge_jax.ConvertSkipWarning, match="teacher_head"):
    _, calls = trace(step, v, tx.init(v["params"]), (x, y))
  assert step.converted == ["Dense_0", "Dense_1", "Dense_2"]
  assert list(step.skipped) == ["teacher_head"]
  assert "not in the step's variables['params']" in step.skipped["teacher_head"]
  assert calls == 3


def ema_distillation(model):
  """``loss_fn(variables, (x, teacher))``: the student, ``model`` on the
  step's variables, regressed on a teacher of the same architecture (the
  student's exponential moving average: the same parameter paths, other
  arrays) applied to its own variables inside the loss."""
  def loss_fn(variables, batch):
    x, teacher = batch
    target = lax.stop_gradient(model.apply(teacher, x))
    return jnp.mean((model.apply(variables, x) - 2.0 * target) ** 2)
  return loss_fn


@pytest.mark.parametrize("dense", [nn.Dense, nn.remat(nn.Dense)],
                         ids=["dense", "remat"])
def test_a_same_architecture_teacher_in_the_loss_stays_nn_dense(dense):
  """An EMA (mean-teacher) model of the student's architecture, applied to
  its own variables in the loss: its layers sit at the student's paths but
  read other arrays, so they run as plain nn.Dense, and only the student's
  are fused (also beneath nn.remat, where each layer reads the transform's
  copy of its kernel). Three steps, the teacher moved between them, equal
  optax + the unconverted model; nothing shared, skipped or moved."""
  model = MLP(dense)
  keys = jax.random.split(jax.random.key(2), 3)
  xs = [jax.random.normal(k, (6, 37)) for k in keys]
  v = model.init(jax.random.key(0), xs[0])
  loss_fn = ema_distillation(model)
  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  forge_tx, optax_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
  step = forge_jax.make_step(loss_fn, forge_tx, convert=True)
  forge_step = jax.jit(step)
  ref_step = jax.jit(reference_step(loss_fn, optax_tx))
  vf, sf = v, forge_tx.init(v["params"])
  vr, sr = v, optax_tx.init(v["params"])
  ema = jax.tree.map(lambda a: 0.5 * a, v)
  with warnings.catch_warnings():
    warnings.simplefilter("error", forge_jax.ConvertSkipWarning)
    warnings.simplefilter("error", forge_jax.SharedWeightsWarning)
    _, calls = trace(step, vf, sf, (xs[0], ema))
    for x in xs:
      lf, vf, sf = forge_step(vf, sf, (x, ema))
      lr, vr, sr = ref_step(vr, sr, (x, ema))
      ema = jax.tree.map(lambda t, s: 0.9 * t + 0.1 * s, ema, vf)
  layers = kernel_layers(v["params"])
  assert len(layers) == 3 and step.converted == layers
  assert step.skipped == {} and step.standard_layers == []
  assert calls == 3  # the student's layers
  assert_close(lf, lr, RTOL, "last loss")
  assert_trees_close(vf, vr, RTOL, "variables")
  assert_trees_close(sf, sr, RTOL, "opt_state")
  assert rel_err(vf["params"][layers[0]]["kernel"],
                 v["params"][layers[0]]["kernel"]) > 1e-3


def test_the_model_applied_under_jax_checkpoint_is_converted():
  """loss_fn handing the step's variables to jax.checkpoint(model.apply):
  the layers read the checkpoint's tracers of the same values (a trace
  opened beneath the step's), so the path decides and every layer is
  fused; the step equals optax's on the unconverted model."""
  model = MLP(nn.Dense)
  x, y = jax.random.normal(jax.random.key(1), (6, 37)), jnp.ones((6, 5))
  v = model.init(jax.random.key(0), x)

  def loss_fn(variables, batch):
    out = jax.checkpoint(model.apply)(variables, batch[0])
    return jnp.mean((out - batch[1]) ** 2)

  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  forge_tx, optax_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
  step = forge_jax.make_step(loss_fn, forge_tx, convert=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error", forge_jax.ConvertSkipWarning)
    _, calls = trace(step, v, forge_tx.init(v["params"]), (x, y))
    lf, vf, sf = jax.jit(step)(v, forge_tx.init(v["params"]), (x, y))
  lr, vr, sr = jax.jit(reference_step(loss_fn, optax_tx))(
      v, optax_tx.init(v["params"]), (x, y))
  layers = kernel_layers(v["params"])
  assert step.converted == layers and step.skipped == {} and calls == 3
  assert_close(lf, lr, RTOL, "loss")
  assert_trees_close(vf, vr, RTOL, "variables")
  assert_trees_close(sf, sr, RTOL, "opt_state")


def test_a_layer_given_changed_parameters_stays_nn_dense():
  """A layer whose kernel loss_fn changes before apply (here frozen with
  stop_gradient) reads another array than the step's: it runs as nn.Dense,
  reported, and the step equals optax's; the other layers are fused."""
  model = MLP(nn.Dense)
  x, y = jax.random.normal(jax.random.key(1), (6, 37)), jnp.ones((6, 5))
  v = model.init(jax.random.key(0), x)

  def loss_fn(variables, batch):
    params = dict(variables["params"])
    params["Dense_0"] = lax.stop_gradient(params["Dense_0"])
    return mse(model)({"params": params}, batch)

  kw = dict(learning_rate=1e-2, weight_decay=0.1)
  forge_tx, optax_tx = forge_jax.adamw(**kw), optax.adamw(**kw)
  step = forge_jax.make_step(loss_fn, forge_tx, convert=True)
  with pytest.warns(forge_jax.ConvertSkipWarning, match="Dense_0"):
    _, calls = trace(step, v, forge_tx.init(v["params"]), (x, y))
  assert step.converted == ["Dense_1", "Dense_2"] and calls == 2
  assert list(step.skipped) == ["Dense_0"]
  assert "another array" in step.skipped["Dense_0"]
  lf, vf, sf = jax.jit(step)(v, forge_tx.init(v["params"]), (x, y))
  lr, vr, sr = jax.jit(reference_step(loss_fn, optax_tx))(
      v, optax_tx.init(v["params"]), (x, y))
  assert_close(lf, lr, RTOL, "loss")
  assert_trees_close(vf, vr, RTOL, "variables")
  assert_trees_close(sf, sr, RTOL, "opt_state")


class HalvedUnderRemat(nn.Module):
  """A layer reading half its kernel (nn.map_variables) beneath nn.remat."""

  @nn.compact
  def __call__(self, x):
    half = lambda vs: jax.tree.map(lambda a: 0.5 * a if a.ndim == 2 else a,
                                   vs)
    layer = nn.remat(nn.map_variables(nn.Dense, "params", trans_in_fn=half,
                                      init=True))
    return nn.Dense(5, name="head")(layer(8, name="mv")(x))


@pytest.mark.parametrize("shared", ["error", "standard"])
def test_a_converted_layer_its_fused_op_does_not_read_names_the_fix_that_works(
    shared):
  """A converted layer that reads a function of its kernel beneath
  nn.remat is refused under either shared policy: the note names the fix
  that works (forge_jax.Dense(..., fused=False)), not shared='standard'."""
  model = HalvedUnderRemat()
  x, y = jax.random.normal(jax.random.key(1), (6, 7)), jnp.ones((6, 5))
  v = model.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(mse(model), tx, convert=True, shared=shared)
  with pytest.raises(ValueError, match="'mv' did not read its kernel") as e:
    jax.jit(step)(v, tx.init(v["params"]), (x, y))
  note = str(e.value).split("make_step(..., convert=True) ran")[-1]
  assert "holds under shared='standard' too" in note
  assert "forge_jax.Dense(..., fused=False)" in note
  assert "build the step with shared='standard'" not in str(e.value)


class Twice(nn.Module):
  """A converted layer called twice (shared), beside one called once."""

  @nn.compact
  def __call__(self, x):
    shared = nn.Dense(37, name="shared")
    return nn.Dense(5, name="head")(shared(nn.relu(shared(x))))


def test_converted_lists_only_the_layers_that_ran_fused():
  """shared="standard" moves a converted layer called twice to the standard
  path: it is in step.standard_layers, and not in step.converted."""
  x, y = jax.random.normal(jax.random.key(1), (6, 37)), jnp.zeros((6, 5))
  model = Twice()
  v = model.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(mse(model), tx, convert=True, shared="standard")
  with pytest.warns(forge_jax.SharedWeightsWarning, match="shared"):
    _, calls = trace(step, v, tx.init(v["params"]), (x, y))
  assert step.converted == ["head"] and calls == 1
  assert step.standard_layers == ["shared"] and step.skipped == {}


def test_an_interceptor_entered_inside_the_loss_keeps_its_layers_standard():
  """FORGE cannot run beneath another method interceptor: those layers stay
  nn.Dense; here that is every layer, so the step says so."""
  x, y = jax.random.normal(jax.random.key(1), (6, 37)), jnp.zeros((6, 5))
  model = MLP(nn.Dense)
  v = model.init(jax.random.key(0), x)

  def scale(next_fun, args, kwargs, context):
    return 2.0 * next_fun(*args, **kwargs)

  def loss_fn(variables, batch):
    with nn.intercept_methods(scale):
      return mse(model)(variables, batch)

  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(loss_fn, tx, convert=True)
  with pytest.raises(ValueError, match=r"no forge_jax.Dense layer.*convert="
                     r"True\) found only layers it cannot fuse.*'Dense_0' "
                     r"\(nn.Dense: another method interceptor"):
    step(v, tx.init(v["params"]), (x, y))


def test_convert_must_be_a_bool():
  with pytest.raises(TypeError, match="convert must be a bool"):
    forge_jax.make_step(mse(MLP(nn.Dense)), forge_jax.adamw(1e-2),
                        convert="yes")


# --- Layers that read another kernel than the step's, or run under a vmap ----


class _Encoder(nn.Module):
  """A pretrained model with a layer of the student's first layer's name."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(x)  # Dense_0


class _Lifted(nn.Module):
  """A converted head beside a layer ``case`` keeps off the fused path."""
  case: str
  frozen: object = None  # the encoder's variables ("nested_apply")

  @nn.compact
  def __call__(self, x):
    if self.case == "nn_vmap_stacked":  # an ensemble: a kernel per member
      h = nn.vmap(nn.Dense, variable_axes={"params": 0},
                  split_rngs={"params": True}, in_axes=None, out_axes=0,
                  axis_size=2)(6, name="hidden")(x).mean(0)
    elif self.case == "nn_vmap_broadcast":  # one kernel, mapped inputs
      h = nn.vmap(nn.Dense, variable_axes={"params": None},
                  split_rngs={"params": False}, in_axes=0,
                  out_axes=0)(6, name="hidden")(x[None].repeat(2, 0)).mean(0)
    elif self.case == "map_variables":  # the layer reads a function of it
      h = nn.map_variables(
          nn.Dense, "params", init=True,
          trans_in_fn=lambda vs: jax.tree.map(lambda a: 0.5 * a, vs))(
              6, name="hidden")(x)
    elif self.case == "nested_apply":  # another model applied in a module
      f = lax.stop_gradient(_Encoder().apply(self.frozen, x))
      h = jnp.concatenate([nn.Dense(2)(x), f], -1)  # Dense_0: the student's
    else:  # a quantized DenseGeneral whose last feature axis is 16 wide
      h = nn.DenseGeneral((4, 16), name="hidden")(x).reshape(x.shape[0], 64)
    return nn.Dense(3, name="head")(nn.tanh(h))


@pytest.mark.parametrize("case,skipped,why", [
    ("nn_vmap_stacked", "hidden", "slice or function of it"),
    ("nn_vmap_broadcast", "hidden", "runs under a vmap"),
    ("map_variables", "hidden", "slice or function of it"),
    ("nested_apply", None, None),
    ("int8_dense_general", "hidden", "not a multiple of 64"),
])
def test_a_layer_reading_another_kernel_or_vmapped_is_skipped(case, skipped,
                                                              why):
  """Each such layer is reported with its reason and steps on the standard
  path, the head beside it fused, both as optax (2 steps): an nn.vmap
  ensemble's member reads a slice of the kernel; a broadcast nn.vmap maps
  the layer's inputs; nn.map_variables hands the layer a function of its
  kernel; int8 moments of a DenseGeneral kernel (64, 4, 16) have blocks
  that are not its matrix rows'. A pretrained encoder applied inside a
  module to its own variables has a layer of the student's first layer's
  name: the encoder's runs standard, unreported (it shares the name), the
  student's is fused."""
  x = jax.random.normal(jax.random.key(1), (6, 64))
  bs = [(x, jnp.full((6, 3), 0.5)), (-x, jnp.full((6, 3), -0.5))]
  frozen = _Encoder().init(jax.random.key(7), x)
  model = _Lifted(case, frozen)
  v = model.init(jax.random.key(0), x)

  def loss_fn(variables, batch):
    return jnp.mean((model.apply(variables, batch[0]) - batch[1]) ** 2)

  kw = dict(moments="int8") if case == "int8_dense_general" else {}
  forge_tx = forge_jax.adamw(1e-2, **kw)
  optax_tx = forge_tx if kw else optax.adamw(1e-2)
  step = forge_jax.make_step(loss_fn, forge_tx, convert=True)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", forge_jax.ConvertSkipWarning)
    traced, (lf, vf, sf), (lr, vr, sr) = train_side_by_side(
        step, reference_step(loss_fn, optax_tx), v,
        forge_tx.init(v["params"]), v, optax_tx.init(v["params"]), bs)
  skips = [str(w.message) for w in caught
           if w.category is forge_jax.ConvertSkipWarning]
  if skipped is None:
    assert step.skipped == {} and skips == []
  else:
    assert list(step.skipped) == [skipped]
    assert why in step.skipped[skipped]
    assert len(skips) == 1 and f"  {skipped}: " in skips[0]
  want = ["Dense_0", "head"] if case == "nested_apply" else ["head"]
  assert step.converted == want
  assert fused_calls(traced) == len(want)
  assert_close(lf, lr, RTOL, "last loss")
  assert_trees_close(vf, vr, RTOL, "variables")
  if not kw:
    assert_trees_close(sf, sr, RTOL, "opt_state")
  for name in {skipped or "Dense_0", "head"}:
    assert rel_err(vf["params"][name]["kernel"],
                   v["params"][name]["kernel"]) > 1e-3


def test_a_model_applied_under_jax_vmap_is_refused_with_the_reason():
  """jax.vmap of model.apply inside loss_fn (per-example application): no
  layer can be fused, and the step's error lists each with the reason."""
  x = jax.random.normal(jax.random.key(1), (4, 37))
  model = MLP(nn.Dense)
  v = model.init(jax.random.key(0), x)

  def loss_fn(variables, batch):
    return jnp.mean(jax.vmap(lambda xi: model.apply(variables, xi))(batch)
                    ** 2)

  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(loss_fn, tx, convert=True)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", forge_jax.ConvertSkipWarning)
    with pytest.raises(ValueError, match=r"'Dense_0' \(nn.Dense: it runs "
                       r"under a vmap opened inside loss_fn"):
      step(v, tx.init(v["params"]), x)


def test_a_refusal_of_a_converted_layer_gives_the_fixes_that_apply():
  """A converted layer refused by a FORGE check (an RNN cell's layers, run
  at each time step) is a flax layer: the error adds that it has no fused
  attribute and names shared='standard', which then trains it as optax."""
  class Rnn(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3, name="head")(nn.RNN(nn.SimpleCell(6), name="rnn")(x))

  x = jax.random.normal(jax.random.key(1), (2, 3, 5))
  model = Rnn()
  v = model.init(jax.random.key(0), x)

  def loss_fn(variables, batch):
    return jnp.mean(model.apply(variables, batch) ** 2)

  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(loss_fn, tx, convert=True)
  with pytest.raises(ValueError, match=r"(?s)called more than once.*"
                     r"convert=True\) ran 'SimpleCell_0/[hi]'.*no fused "
                     r"attribute.*shared='standard'"):
    step(v, tx.init(v["params"]), x)
  step = forge_jax.make_step(loss_fn, tx, convert=True, shared="standard")
  with pytest.warns(forge_jax.SharedWeightsWarning):
    _, (lf, vf, _), (lr, vr, _) = train_side_by_side(
        step, reference_step(loss_fn, optax.adamw(1e-2)), v,
        tx.init(v["params"]), v, optax.adamw(1e-2).init(v["params"]), [x])
  assert step.standard_layers == ["SimpleCell_0/h", "SimpleCell_0/i"]
  assert step.converted == ["head"]
  assert_close(lf, lr, RTOL, "loss")
  assert_trees_close(vf, vr, RTOL, "variables")


class _Lora(nn.Dense):
  """A LoRA layer: its own product, nn.Dense's __call__ never called."""
  rank: int = 2

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", self.kernel_init,
                        (x.shape[-1], self.features))
    a = self.param("lora_a", nn.initializers.normal(0.1),
                   (x.shape[-1], self.rank))
    b = self.param("lora_b", nn.initializers.normal(0.1),
                   (self.rank, self.features))
    return x @ kernel + (x @ a) @ b


def test_a_subclass_that_never_calls_nn_dense_is_reported():
  """A subclass whose __call__ computes its own product runs as written and
  is reported (it is not a FORGE layer); one that calls super().__call__
  is converted; both train as optax."""
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.tanh(_Lora(6, name="lora")(x))
      return WrappingSubclass(3, name="wrapping")(h)

  x = jax.random.normal(jax.random.key(1), (5, 8))
  bs = [(x, jnp.ones((5, 3))), (-x, -jnp.ones((5, 3)))]
  model = Model()
  v = model.init(jax.random.key(0), x)

  def loss_fn(variables, batch):
    return jnp.mean((model.apply(variables, batch[0]) - batch[1]) ** 2)

  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(loss_fn, tx, convert=True)
  with pytest.warns(forge_jax.ConvertSkipWarning, match="lora: _Lora"):
    traced, (lf, vf, sf), (lr, vr, sr) = train_side_by_side(
        step, reference_step(loss_fn, optax.adamw(1e-2)), v,
        tx.init(v["params"]), v, optax.adamw(1e-2).init(v["params"]), bs)
  assert step.converted == ["wrapping"]
  assert list(step.skipped) == ["lora"]
  assert "does not call nn.Dense.__call__" in step.skipped["lora"]
  assert fused_calls(traced) == 1
  assert_close(lf, lr, RTOL, "last loss")
  assert_trees_close(vf, vr, RTOL, "variables")
  assert_trees_close(sf, sr, RTOL, "opt_state")
