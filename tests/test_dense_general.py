"""forge_jax.DenseGeneral against flax.linen.DenseGeneral (+ optax.adamw)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
from tests import harness
from forge_jax import _context
from forge_jax.dense import _Static, _fused_linear
import pallas_kernels as pk
from tests.harness import mse, reference_step, step_once
from tests.tolerances import assert_close, assert_trees_close, rel_err, tol

# (layer kwargs, input shape): a kernel (6, 3, 5); a kernel (4, 6, 7) with
# tokens (B, T).
CASES = [
    (dict(features=(3, 5), axis=-1), (10, 6)),
    (dict(features=7, axis=(-2, -1)), (2, 5, 4, 6)),
]
IDS = ["axis-1_features(3,5)", "axis(-2,-1)_features7_tokens(B,T)"]


def _x(shape, seed=1):
  return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.parametrize("kwargs,shape", CASES, ids=IDS)
def test_param_tree_and_output_are_nn_dense_general(kwargs, shape):
  x = _x(shape)
  ref = nn.DenseGeneral(**kwargs).init(jax.random.key(0), x)
  got = forge_jax.DenseGeneral(**kwargs).init(jax.random.key(0), x)
  assert jax.tree.structure(got) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(
      forge_jax.DenseGeneral(**kwargs).apply(got, x),
      nn.DenseGeneral(**kwargs).apply(ref, x))


def test_attributes_mirror_nn_dense_general():
  harness.assert_mirrors_flax_fields(forge_jax.DenseGeneral, nn.DenseGeneral)


@pytest.mark.parametrize("kwargs,shape", CASES, ids=IDS)
def test_fused_op_output_dx_and_kernel_shape(kwargs, shape):
  """The fused op on the kernel parameter itself (viewed as a matrix inside
  the op): output and dx equal nn.DenseGeneral's, and the new kernel comes
  back in the parameter's shape, equal to the matrix kernel's update."""
  x = _x(shape)
  layer = nn.DenseGeneral(**kwargs)
  params = layer.init(jax.random.key(0), x)["params"]
  kernel = params["kernel"]
  n_axes = len(kwargs["axis"]) if isinstance(kwargs["axis"], tuple) else 1
  n_in = int(np.prod(shape[len(shape) - n_axes:]))
  gemm = (n_in, kernel.size // n_in)
  lead = shape[:len(shape) - n_axes]
  c = jax.random.normal(jax.random.key(2), layer.apply({"params": params},
                                                       x).shape)
  h = forge_jax.adamw(1e-2).spec.hparams(optax.adamw(1e-2).init(params))

  def inputs_of(k):
    return _context.LayerInputs(
        slots=(jnp.zeros_like(k), jnp.zeros_like(k)),
        hparams=pk.ADAMW.pack(**h), touched=jnp.zeros(()))

  def ref_loss(x):
    return jnp.sum(layer.apply({"params": params}, x) * c)

  def fused(static, out_shape):
    def loss(x, k, inputs):
      y = _fused_linear(static, x.reshape(lead + (n_in,)), k, inputs)
      return jnp.sum((y.reshape(out_shape) + params["bias"]) * c)
    return loss

  general = _Static(path=("DenseGeneral_0",), rule=pk.ADAMW,
                    dtype=jnp.float32, precision=None, config=None, gemm=gemm,
                    kind="forge_jax.DenseGeneral")
  matrix = _Static(path=("DenseGeneral_0",), rule=pk.ADAMW,
                   dtype=jnp.float32, precision=None, config=None)
  with _context.step_context(_context.StepContext("fused", rule=pk.ADAMW)):
    y_ref, dx_ref = jax.value_and_grad(ref_loss)(x)
    y_got, (dx, new_kernel, new_inputs) = jax.value_and_grad(
        fused(general, c.shape), argnums=(0, 1, 2))(x, kernel,
                                                    inputs_of(kernel))
    k2 = kernel.reshape(gemm)
    _, (_, new_k2, new_in2) = jax.value_and_grad(
        fused(matrix, c.shape), argnums=(0, 1, 2))(x, k2, inputs_of(k2))
  assert_close(y_got, y_ref, tol(jnp.float32), "output")
  assert_close(dx, dx_ref, tol(jnp.float32), "dx")
  assert new_kernel.shape == kernel.shape
  assert not np.allclose(new_kernel, kernel)  # the kernel came back updated
  np.testing.assert_array_equal(new_kernel, new_k2.reshape(kernel.shape))
  for s, s2 in zip(new_inputs.slots, new_in2.slots):
    assert s.shape == kernel.shape
    np.testing.assert_array_equal(s, s2.reshape(kernel.shape))


class Net(nn.Module):
  """An ordinary Dense (its gradient checks the fused layer's dx), then the
  DenseGeneral under test."""
  general: type
  kwargs: dict

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(x.shape[-1])(x))
    return self.general(**self.kwargs)(x)


@pytest.mark.parametrize("kwargs,shape", CASES, ids=IDS)
def test_training_matches_optax_adamw_fp32(kwargs, shape):
  ref_model, f_model = Net(nn.DenseGeneral, kwargs), Net(forge_jax.DenseGeneral,
                                                         kwargs)
  x0 = _x(shape)
  variables = ref_model.init(jax.random.key(0), x0)
  out_shape = ref_model.apply(variables, x0).shape
  keys = jax.random.split(jax.random.key(3), 6)
  batches = [(_x(shape, int(i)), jax.random.normal(keys[i + 3], out_shape))
             for i in range(3)]
  tx_kwargs = dict(learning_rate=1e-2, weight_decay=1e-2)
  ref_tx, f_tx = optax.adamw(**tx_kwargs), forge_jax.adamw(**tx_kwargs)
  ref_step = jax.jit(reference_step(mse(ref_model), ref_tx))
  f_step = jax.jit(forge_jax.make_step(mse(f_model), f_tx))
  ref_v, f_v = variables, jax.tree.map(jnp.copy, variables)
  ref_s, f_s = ref_tx.init(variables["params"]), f_tx.init(variables["params"])
  for batch in batches:
    ref_loss, ref_v, ref_s = ref_step(ref_v, ref_s, batch)
    f_loss, f_v, f_s = f_step(f_v, f_s, batch)
  assert_close(f_loss, ref_loss, tol(jnp.float32), "last loss")
  assert jax.tree.structure(f_s) == jax.tree.structure(ref_s)
  assert_trees_close(f_v, ref_v, tol(jnp.float32), "params")
  assert_trees_close(f_s, ref_s, tol(jnp.float32), "opt_state")
  kernel = f_v["params"]["DenseGeneral_0"]["kernel"]
  assert kernel.shape == variables["params"]["DenseGeneral_0"]["kernel"].shape
  assert rel_err(kernel, variables["params"]["DenseGeneral_0"]["kernel"]) > 1e-3


@pytest.mark.parametrize("kwargs,shape,what", [
    (dict(features=3, batch_dims=(0,)), (4, 5), "batch_dims"),
    (dict(features=3, axis=-2), (4, 5, 6), "axis"),
    (dict(features=3, axis=(1, -1)), (2, 4, 5, 6), "axis"),
    (dict(features=3, axis=(-1, -2)), (4, 5, 6), "axis"),
], ids=["batch_dims", "axis-2", "axis(1,-1)", "axis(-1,-2)"])
def test_refuses_what_is_not_one_gemm(kwargs, shape, what):
  x = _x(shape)
  y = nn.DenseGeneral(**kwargs).apply(
      nn.DenseGeneral(**kwargs).init(jax.random.key(0), x), x)
  with pytest.raises(ValueError, match=rf"forge_jax.DenseGeneral at .*{what}"
                     r".*use flax.linen.DenseGeneral, or fused=False"):
    step_once(forge_jax.DenseGeneral(**kwargs), forge_jax.adamw(1e-2),
              (x, jnp.zeros_like(y)))
  # fused=False is nn.DenseGeneral's own step.
  step_once(forge_jax.DenseGeneral(**kwargs, fused=False),
            forge_jax.adamw(1e-2), (x, jnp.zeros_like(y)))


def test_boxed_kernel_init_keeps_its_box_and_trains():
  # nn.with_logical_partitioning returns a box from the initializer; the
  # fused layer reshapes the boxed value as nn.DenseGeneral does.
  names = ("embed", "heads", "kv")
  kwargs = dict(features=7, axis=(-2, -1), kernel_init=(
      nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)))
  ref_model = Net(nn.DenseGeneral, kwargs)
  f_model = Net(forge_jax.DenseGeneral, kwargs)
  x = _x((2, 5, 4, 6))
  variables = ref_model.init(jax.random.key(0), x)
  got = f_model.init(jax.random.key(0), x)
  box = got["params"]["DenseGeneral_0"]["kernel"]
  assert isinstance(box, nn.LogicallyPartitioned) and box.names == names
  assert jax.tree.structure(got) == jax.tree.structure(variables)
  y = jax.random.normal(jax.random.key(5), ref_model.apply(variables, x).shape)
  tx_kwargs = dict(learning_rate=1e-2, weight_decay=1e-2)
  ref_tx, f_tx = optax.adamw(**tx_kwargs), forge_jax.adamw(**tx_kwargs)
  ref_loss, ref_v, ref_s = jax.jit(reference_step(mse(ref_model), ref_tx))(
      variables, ref_tx.init(variables["params"]), (x, y))
  f_loss, f_v, f_s = jax.jit(forge_jax.make_step(mse(f_model), f_tx))(
      got, f_tx.init(got["params"]), (x, y))
  assert_close(f_loss, ref_loss, tol(jnp.float32), "loss")
  assert f_v["params"]["DenseGeneral_0"]["kernel"].names == names
  assert_trees_close(f_v, ref_v, tol(jnp.float32), "params")
  assert_trees_close(f_s, ref_s, tol(jnp.float32), "opt_state")


def _train(step, variables, state, batches):
  step = jax.jit(step)
  for batch in batches:
    loss, variables, state = step(variables, state, batch)
  return loss, variables, state


def test_small_kernel_of_several_feature_axes_takes_int8_moments():
  """A kernel (16, 4, 8) has several feature axes, the last of 8 elements
  (not a multiple of the 64-element quantization block), but 512 elements:
  too few for quantized moments (4096), so its moments are float arrays,
  with no blocks to misalign. It is fused under moments="int8" and trains as
  on the standard path (fused=False) and as optax.adamw."""
  kwargs = dict(features=(4, 8))
  x0 = _x((6, 16))
  variables = Net(nn.DenseGeneral, kwargs).init(jax.random.key(0), x0)
  keys = jax.random.split(jax.random.key(3), 3)
  batches = [(_x((6, 16), i + 1), jax.random.normal(keys[i], (6, 4, 8)))
             for i in range(3)]
  tx_kwargs = dict(learning_rate=1e-2, weight_decay=1e-2)
  tx = forge_jax.adamw(**tx_kwargs, moments="int8")
  state = tx.init(variables["params"])
  mu = state.mu["DenseGeneral_0"]["kernel"]
  assert not isinstance(mu, pk.quant.Quantized) and mu.shape == (16, 4, 8)
  fused_step = forge_jax.make_step(mse(Net(forge_jax.DenseGeneral, kwargs)),
                                  tx)
  fused = _train(fused_step, variables, state, batches)
  assert fused_step.standard_layers == []  # fused, not moved to optax's
  standard = _train(forge_jax.make_step(
      mse(Net(forge_jax.DenseGeneral, dict(kwargs, fused=False))), tx),
      variables, state, batches)
  optax_tx = optax.adamw(**tx_kwargs)
  ref = _train(reference_step(mse(Net(nn.DenseGeneral, kwargs)), optax_tx),
               variables, optax_tx.init(variables["params"]), batches)
  assert_close(fused[0], ref[0], tol(jnp.float32), "last loss")
  assert_trees_close(fused[1], ref[1], tol(jnp.float32), "params vs optax")
  assert_trees_close(fused[1], standard[1], tol(jnp.float32), "params")
  assert_trees_close(fused[2], standard[2], tol(jnp.float32), "opt_state")
  kernel = fused[1]["params"]["DenseGeneral_0"]["kernel"]
  assert rel_err(kernel, variables["params"]["DenseGeneral_0"]["kernel"]) > 1e-3


def test_large_misaligned_kernel_is_refused_under_int8_moments():
  """A kernel (16, 4, 96): 6144 elements get quantized moments, whose
  64-element blocks along its last axis (96 elements) are not blocks of the
  fused kernel's (16, 384) rows: refused, in plain words; fused=False steps
  it."""
  x = _x((6, 16))
  y = jnp.zeros((6, 4, 96))
  tx = forge_jax.adamw(1e-2, moments="int8")
  layer = forge_jax.DenseGeneral(features=(4, 96))
  variables = layer.init(jax.random.key(0), x)
  state = tx.init(variables["params"])
  assert isinstance(state.mu["kernel"], pk.quant.Quantized)
  with pytest.raises(ValueError, match=r"forge_jax.DenseGeneral at .*several "
                     r"feature axes, the last of 96 elements, not a multiple "
                     r"of 64.*fused=False"):
    forge_jax.make_step(mse(layer), tx)(variables, state, (x, y))
  standard = forge_jax.DenseGeneral(features=(4, 96), fused=False)
  forge_jax.make_step(mse(standard), tx)(variables, state, (x, y))


class _TiedGeneral(nn.Module):
  """A DenseGeneral whose kernel is read again outside the layer."""

  @nn.compact
  def __call__(self, x):
    layer = forge_jax.DenseGeneral(features=(2, 3), name="proj")
    h = layer(x)
    kernel = layer.variables["params"]["kernel"]
    return h.reshape(*h.shape[:-2], 6) + x @ kernel.reshape(x.shape[-1], 6)


def test_a_shared_kernel_is_refused_naming_the_layers_kind():
  """The single-use check names the layer as what it is: here a
  DenseGeneral, not a Dense."""
  x = _x((4, 5))
  with pytest.raises(ValueError, match="the kernel of forge_jax.DenseGeneral "
                     "at 'proj' is also read outside its own layer"):
    step_once(_TiedGeneral(), forge_jax.adamw(1e-2),
              (x, jnp.zeros((4, 6), jnp.float32)))
