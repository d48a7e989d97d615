"""forge_jax.ScannedBlocks: a scanned stack of heterogeneous blocks whose
backward updates every FORGE Dense's stacked kernel and slots in place,
against the same blocks under flax's own nn.scan(nn.remat(...)) + optax."""

import functools
import re
from typing import Any
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
from pallas_kernels.quant import Quantized
from tests.harness import (assert_pool_saved_in_place, lower_for_cuda, mse,
                           reference_step, run_reference, shared_reference,
                           train_side_by_side, triton_calls)
from tests.test_forge_jax import SCHEDULE, optax_step
from tests.tolerances import assert_trees_close, rel_err, tol

D = 24  # the carry width; the block's other widths are odd


class Block(nn.Module):
  """A residual block: a norm scale, an up projection (bias, 2D + 3 wide),
  a down projection (no bias), a side projection that never fuses, and a
  plain flax layer. With ``general``, up and down are DenseGeneral layers
  with 3-axis kernels, as attention's projections are: up ``D -> (3, 17)``
  (kernel ``(D, 3, 17)``, bias ``(3, 17)``), down ``(3, 17) -> D`` over the
  two trailing axes (kernel ``(3, 17, D)``)."""
  dense: type = nn.Dense
  side: bool = True
  general: bool = False
  dtype: jnp.dtype = None
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    s = self.param("scale", nn.initializers.ones, (x.shape[-1],),
                   self.param_dtype)
    h = x * s.astype(x.dtype)
    if self.general:
      general = (forge_jax.DenseGeneral if self.dense is forge_jax.Dense
                 else nn.DenseGeneral)
      a = general((3, 17), name="up", **kw)(h)  # 3 * 17 == 2 * D + 3
      y = general(D, axis=(-2, -1), use_bias=False, name="down",
                  **kw)(nn.silu(a))
    else:
      a = self.dense(2 * D + 3, name="up", **kw)(h)
      y = self.dense(D, use_bias=False, name="down", **kw)(nn.silu(a))
    if self.side:
      side = (forge_jax.Dense(D, fused=False, name="side", **kw)
              if self.dense is forge_jax.Dense else
              nn.Dense(D, name="side", **kw))
      y = y + 0.5 * side(h)
    g = nn.Dense(D, name="gate", **kw)(h)  # flax's own: the standard path
    return x + y * nn.sigmoid(g)


class _FlaxBody(nn.Module):
  """The reference scan body (flax only): ``make(name='block')``."""
  make: object

  @nn.compact
  def __call__(self, h, _):
    return self.make(name="block")(h), None


def flax_scan(make, length, name):
  """The reference every FORGE model here is compared with: flax's own
  ``nn.scan(nn.remat(...))`` of ``length`` blocks ``make(name='block')``,
  named ``name``; returns ``carry -> carry``."""
  scanned = nn.scan(nn.remat(_FlaxBody), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=length)(make,
                                                                name=name)
  return lambda x: scanned(x, None)[0]


class Model(nn.Module):
  """Dense(in -> D) -> L blocks -> Dense(D -> out); ``forge``: the FORGE
  layers and ``ScannedBlocks``, else flax's ``nn.scan(nn.remat(...))``."""
  forge: bool = False
  num_layers: int = 3
  d_out: int = 5
  block_kw: dict = None
  stack_update: str = "auto"

  @nn.compact
  def __call__(self, x):
    dense = forge_jax.Dense if self.forge else nn.Dense
    kw = dict(self.block_kw or {})
    x = nn.relu(dense(D, name="embed")(x))
    if self.forge:
      x = forge_jax.ScannedBlocks(
          functools.partial(Block, forge_jax.Dense, **kw), self.num_layers,
          stack_update=self.stack_update, name="layers")(x)
    else:
      x = flax_scan(functools.partial(Block, **kw), self.num_layers,
                    "layers")(x)
    return dense(self.d_out, name="head")(x)


def _data(steps, lead=(48,), d_in=37, d_out=5, seed=1):
  k = jax.random.split(jax.random.key(seed), 2 * steps)
  return [(jax.random.normal(k[2 * i], (*lead, d_in)),
           jax.random.normal(k[2 * i + 1], (*lead, d_out)))
          for i in range(steps)]


def _train(make_tx, steps=5, lead=(48,), model_kw={}, wgrad="fused",
           shared="error", fused_ops=None, optax_runs=None, **tx_kw):
  """FORGE's model and flax's trained side by side; ``fused_ops``: how many
  fused Pallas kernels the FORGE step's program must call (one per fused
  layer, the stacked ones once, inside the backward loop), checked when
  given. ``optax_runs``: ``(cache, key)``, flax's run kept in ``cache[key]``
  for the other calls with that key (the same reference: flax's model does
  not read ``stack_update``)."""
  batches = _data(steps, lead)
  ref_model, f_model = Model(False, **model_kw), Model(True, **model_kw)
  variables = ref_model.init(jax.random.key(0), batches[0][0])
  ref_tx = getattr(optax, make_tx)(**tx_kw)
  f_tx = getattr(forge_jax, make_tx)(**tx_kw)
  ref_step = optax_step(mse(ref_model), ref_tx)
  reference = None if optax_runs is None else shared_reference(
      *optax_runs, ref_step, variables, ref_tx, batches)
  f_step = jax.jit(forge_jax.make_step(mse(f_model), f_tx, wgrad=wgrad,
                                       shared=shared),
                   donate_argnums=(0, 1))
  if fused_ops is not None:
    traced = f_step.trace(variables, f_tx.init(variables["params"]),
                          batches[0])
    assert str(traced.jaxpr).count("pallas_call") == fused_ops
    f_step = traced.lower().compile()
  (f_v, f_s), (ref_v, ref_s), losses = train_side_by_side(
      f_step, ref_step, variables, f_tx, ref_tx, batches,
      reference=reference)
  return variables, (ref_v, ref_s), (f_v, f_s), losses


def _assert_parity(init, ref, got, losses, dtype=jnp.float32):
  (ref_v, ref_s), (f_v, f_s) = ref, got
  assert jax.tree.structure(f_s) == jax.tree.structure(ref_s)
  assert rel_err(losses[-1][0], losses[-1][1]) <= tol(dtype)
  assert_trees_close(f_v, ref_v, tol(dtype), "params")
  assert_trees_close(f_s, ref_s, tol(dtype), "opt_state")
  # Not vacuous: every layer of every FORGE kernel stack moved.
  blocks = f_v["params"]["layers"]["block"]
  for name in ("up", "down"):
    k0 = init["params"]["layers"]["block"][name]["kernel"]
    for i in range(k0.shape[0]):
      assert rel_err(blocks[name]["kernel"][i], k0[i]) > 1e-3, (name, i)


def test_param_tree_output_and_gradients_are_flax_nn_scan():
  x = jax.random.normal(jax.random.key(0), (4, 6, 37))
  ref = Model(False).init(jax.random.key(1), x)
  got = Model(True).init(jax.random.key(1), x)
  assert jax.tree.structure(got) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)
  assert got["params"]["layers"]["block"]["up"]["kernel"].shape == (3, D,
                                                                     2 * D + 3)
  loss = lambda m: (lambda v: mse(m)(v, (x, 1.0)))
  # Jitted: one program per side instead of one per op.
  out_grads = lambda m: jax.jit(lambda v: (m.apply(v, x),
                                           jax.grad(loss(m))(v)))(ref)
  (got_out, got_grads), (ref_out, ref_grads) = (out_grads(Model(True)),
                                                out_grads(Model(False)))
  assert_trees_close(got_out, ref_out, 0.0, "output")
  assert_trees_close(got_grads, ref_grads, 0.0, "grads")


@pytest.fixture(scope="module")
def optax_runs():
  """flax's runs of the reference models, each made once."""
  return {}


@pytest.mark.parametrize("stack_update,wgrad,general", [
    ("layer", "fused", True), ("layer", "xla", False),
    ("slice", "fused", False), ("slice", "xla", True)])
def test_matches_flax_scan_optax_adamw_fp32(stack_update, wgrad, general,
                                            optax_runs):
  """``general``: the block's up and down projections are fused
  DenseGeneral layers with 3-axis kernels, stepped as (L, n_in, n_out)
  views of their stacks; both stack_update modes and both wgrad settings
  see one of them."""
  init, ref, got, losses = _train(
      "adamw", steps=5, lead=(4, 12), wgrad=wgrad,
      model_kw=dict(stack_update=stack_update,
                    block_kw=dict(general=general)),
      # embed and head, and up and down inside the backward loop
      fused_ops=4 if wgrad == "fused" else None,
      optax_runs=(optax_runs, ("adamw", general)),
      learning_rate=1e-2, weight_decay=1e-2)
  blocks = init["params"]["layers"]["block"]
  assert blocks["up"]["kernel"].shape == ((3, D, 3, 17) if general
                                          else (3, D, 2 * D + 3))
  assert blocks["down"]["kernel"].shape == ((3, 3, 17, D) if general
                                            else (3, 2 * D + 3, D))
  _assert_parity(init, ref, got, losses)


def test_matches_with_a_schedule_and_a_mask_over_more_steps():
  mask = lambda p: jax.tree.map(lambda a: a.ndim > 2, p)  # stacked matrices
  init, ref, got, losses = _train(
      "adamw", steps=12, model_kw=dict(num_layers=4),
      learning_rate=SCHEDULE, weight_decay=0.1, mask=mask)
  _assert_parity(init, ref, got, losses)


@pytest.mark.parametrize("make_tx,tx_kw", [
    ("sgd", dict(learning_rate=5e-2, momentum=0.9, nesterov=True)),
    ("lion", dict(learning_rate=1e-3, weight_decay=0.1)),
    ("adam", dict(learning_rate=1e-2)),
])
def test_other_regime_1_families_match(make_tx, tx_kw):
  init, ref, got, losses = _train(make_tx, steps=4, **tx_kw)
  _assert_parity(init, ref, got, losses)


def test_bf16_params_and_moments_match_within_the_bf16_tolerance():
  kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  batches = [(x.astype(jnp.bfloat16), y) for x, y in _data(4, (4, 8))]
  ref_model = Model(False, block_kw=kw)
  f_model = Model(True, block_kw=kw)
  variables = ref_model.init(jax.random.key(0), batches[0][0])
  tx_kw = dict(learning_rate=1e-2, weight_decay=1e-2, mu_dtype=jnp.bfloat16)
  ref_tx, f_tx = optax.adamw(**tx_kw), forge_jax.adamw(**tx_kw)
  f_step = jax.jit(forge_jax.make_step(mse(f_model), f_tx))
  (f_v, f_s), (ref_v, ref_s), _ = train_side_by_side(
      f_step, optax_step(mse(ref_model), ref_tx), variables, f_tx, ref_tx,
      batches)
  blocks = lambda v: v["params"]["layers"]["block"]
  assert blocks(f_v)["up"]["kernel"].dtype == jnp.bfloat16
  assert_trees_close(blocks(f_v), blocks(ref_v), tol(jnp.bfloat16), "params")
  assert_trees_close(f_s[0].mu["layers"], ref_s[0].mu["layers"],
                     tol(jnp.bfloat16), "mu")
  assert_trees_close(f_s[0].nu["layers"], ref_s[0].nu["layers"],
                     tol(jnp.bfloat16), "nu")
  assert rel_err(blocks(f_v)["up"]["kernel"],
                 blocks(variables)["up"]["kernel"]) > 1e-3


class SharedBlock(nn.Module):
  """A FORGE Dense called twice in one block (a shared layer)."""

  @nn.compact
  def __call__(self, x):
    shared = forge_jax.Dense(D, name="twice")
    return x + shared(nn.relu(shared(x))) + forge_jax.Dense(D, name="once")(x)


class SharedModel(nn.Module):
  forge: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, name="embed")(x)
    if self.forge:
      x = forge_jax.ScannedBlocks(SharedBlock, 2, name="layers")(x)
    else:
      # Outside a step forge_jax.Dense is nn.Dense: the same block.
      x = flax_scan(SharedBlock, 2, "layers")(x)
    return nn.Dense(5, name="head")(x)


def test_a_dense_called_twice_in_the_block_is_refused_with_its_path():
  x, y = _data(1)[0]
  model = SharedModel()
  variables = model.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(mse(model), tx)
  with pytest.raises(ValueError, match="layers/block/twice.*more than once"):
    step(variables, tx.init(variables["params"]), (x, y))


def test_shared_standard_moves_the_shared_dense_and_keeps_parity():
  batches = _data(4)
  # Outside a step both models are flax's nn.scan (same tree, same init).
  variables = SharedModel(False).init(jax.random.key(0), batches[0][0])
  tx_kw = dict(learning_rate=1e-2, weight_decay=1e-2)
  ref_tx, f_tx = optax.adamw(**tx_kw), forge_jax.adamw(**tx_kw)
  step = forge_jax.make_step(mse(SharedModel()), f_tx, shared="standard")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    (f_v, f_s), (ref_v, ref_s), _ = train_side_by_side(
        jax.jit(step), optax_step(mse(SharedModel(False)), ref_tx),
        variables, f_tx, ref_tx, batches)
  assert any("layers/block/twice" in str(w.message) for w in caught)
  assert step.standard_layers == ["layers/block/twice"]
  assert_trees_close(f_v, ref_v, tol(jnp.float32), "params")
  assert_trees_close(f_s, ref_s, tol(jnp.float32), "opt_state")


def test_non_regime_1_family_is_refused_with_the_fix():
  x, y = _data(1)[0]
  model = Model(True)
  variables = model.init(jax.random.key(0), x)
  tx = forge_jax.lamb(1e-2)
  with pytest.raises(ValueError, match="regime-1 families only.*fused=False"):
    forge_jax.make_step(mse(model), tx)(variables,
                                        tx.init(variables["params"]), (x, y))


class Widen(nn.Module):
  @nn.compact
  def __call__(self, x):
    return forge_jax.Dense(D + 1, name="w")(x)


class Nested(nn.Module):
  @nn.compact
  def __call__(self, x):
    return forge_jax.ScannedBlocks(Block, 2, name="inner")(x)


class StackInside(nn.Module):
  @nn.compact
  def __call__(self, x):
    return forge_jax.ScannedDenseStack(D, 2, name="stack")(x)


@pytest.mark.parametrize("block,match", [
    (Widen, r"maps its input float32\[4, 24\] to float32\[4, 25\]"),
    (Nested, "'layers/block/inner': .*cannot be nested.*Python loop"),
    (StackInside, "cannot sit inside a forge_jax.ScannedBlocks"),
])
def test_unsupported_blocks_are_refused_in_a_step(block, match):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.ScannedBlocks(block, 2, name="layers")(x)

  x = jnp.ones((4, D))
  model = M()
  tx = forge_jax.adamw(1e-2)
  loss = lambda v, b: jnp.mean(model.apply(v, b) ** 2)
  if block is Widen:  # refused at init already (the scan's carry)
    with pytest.raises(ValueError, match=(
        r"ScannedBlocks at 'layers': a scan's carry changes type in this "
        r"stack\. .*its input's shape, dtype and sharding \(float32\[4,24\]\)"
        r".*float32\[4,25\]")):
      model.init(jax.random.key(0), x)
    variables = {"params": {"layers": {"block": {"w": {
        "kernel": jnp.ones((2, D, D + 1)), "bias": jnp.ones((2, D + 1))}}}}}
  else:
    variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=match):
    forge_jax.make_step(loss, tx)(variables, tx.init(variables["params"]), x)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(stack_update="layers"), ValueError, "stack_update='layers' must be"),
    (dict(num_layers=0), ValueError, "num_layers=0 must be an int >= 1"),
    (dict(num_layers=True), ValueError, "num_layers=True must be an int"),
    (dict(block="Block"), TypeError, "block must be a Flax module class"),
])
def test_bad_settings_are_refused_at_init(kw, exc, match):
  blocks = forge_jax.ScannedBlocks(**{"block": Block, "num_layers": 2, **kw})
  with pytest.raises(exc, match=match):
    blocks.init(jax.random.key(0), jnp.ones((3, D)))


def test_a_rematerialised_block_class_is_refused_naming_the_class():
  """ScannedBlocks(nn.remat(Block)): every layer reads its kernel through
  the remat; the refusal says to pass Block itself (the stack recomputes
  each block already)."""
  batches = _data(1)
  model = _scanned_model(nn.remat(Block), True)
  variables = _scanned_model(Block, False).init(jax.random.key(0),
                                                batches[0][0])
  tx = forge_jax.adamw(1e-2)
  with pytest.raises(ValueError, match=r"transform CheckpointBlock of Block "
                     r"\(nn.remat\(Block\), say\); pass Block itself"):
    forge_jax.make_step(mse(model), tx)(variables, tx.init(
        variables["params"]), batches[0])


class MaskedBlock(nn.Module):
  """A block written for nn.scan(..., in_axes=nn.broadcast): a mask
  argument."""

  @nn.compact
  def __call__(self, x, mask):
    return x + forge_jax.Dense(D)(jnp.where(mask, x, 0.0))


def test_a_block_taking_more_than_the_carry_is_refused_naming_the_fix():
  with pytest.raises(TypeError, match=r"MaskedBlock.__call__ takes \['x', "
                     r"'mask'\].*a field 'mask', given as functools.partial"
                     r"\(MaskedBlock, mask=...\)"):
    forge_jax.ScannedBlocks(MaskedBlock, 2).init(jax.random.key(0),
                                                 jnp.ones((3, D)))


def test_a_numpy_integer_number_of_layers_is_taken():
  """As nn.scan's length: an int or a NumPy integer."""
  got = forge_jax.ScannedBlocks(Block, np.int64(3)).init(
      jax.random.key(0), jnp.ones((3, D)))
  assert {a.shape[0] for a in jax.tree.leaves(got)} == {3}


class DeadBlocks(nn.Module):
  """The blocks' output does not reach the loss (Remark 1)."""
  forge: bool = True

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(D, name="embed")(x))
    if self.forge:
      forge_jax.ScannedBlocks(functools.partial(Block, forge_jax.Dense), 2,
                              name="layers")(h)
    else:
      flax_scan(Block, 2, "layers")(h)
    return nn.Dense(5, name="head")(h)


def test_untouched_blocks_get_the_zero_gradient_update():
  batches = _data(3)
  variables = DeadBlocks(False).init(jax.random.key(0), batches[0][0])
  tx_kw = dict(learning_rate=1e-2, weight_decay=0.1)
  ref_tx, f_tx = optax.adamw(**tx_kw), forge_jax.adamw(**tx_kw)
  (f_v, f_s), (ref_v, ref_s), _ = train_side_by_side(
      jax.jit(forge_jax.make_step(mse(DeadBlocks()), f_tx)),
      optax_step(mse(DeadBlocks(False)), ref_tx), variables, f_tx, ref_tx,
      batches)
  assert_trees_close(f_v, ref_v, tol(jnp.float32), "params")
  assert_trees_close(f_s, ref_s, tol(jnp.float32), "opt_state")
  # Weight decay alone moved the FORGE kernels (not vacuous).
  k0 = variables["params"]["layers"]["block"]["up"]["kernel"]
  k1 = f_v["params"]["layers"]["block"]["up"]["kernel"]
  assert 0 < rel_err(k1, k0) < 1e-2


def _plain_blocks(forge, layers, n, dtype, stack_update="auto",
                  general=False):
  """``layers`` blocks ``x + down(relu(up(x)))``, no biases: up ``n -> 2n``
  and down ``2n -> n`` (``general``: DenseGeneral layers, up ``n -> (2,
  n)`` and down ``(2, n) -> n``, whose kernels are viewed as the same (n,
  2n) and (2n, n) matrices)."""
  class Blk(nn.Module):
    dense: type

    @nn.compact
    def __call__(self, x):
      kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype)
      if not general:
        h = self.dense(2 * n, name="up", **kw)(x)
        return x + self.dense(n, name="down", **kw)(nn.relu(h))
      dg = (forge_jax.DenseGeneral if self.dense is forge_jax.Dense
            else nn.DenseGeneral)
      h = dg((2, n), name="up", **kw)(x)
      return x + dg(n, axis=(-2, -1), name="down", **kw)(nn.relu(h))

  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      if forge:
        return forge_jax.ScannedBlocks(
            functools.partial(Blk, forge_jax.Dense), layers,
            stack_update=stack_update, name="layers")(x)
      return flax_scan(functools.partial(Blk, nn.Dense), layers, "layers")(x)

  return M()


@pytest.mark.parametrize("general", [False, True], ids=["dense", "general"])
def test_blocks_step_lowers_for_cuda_without_a_gpu(monkeypatch, general):
  """Deviceless AOT lowering: one Triton kernel per FORGE layer of the block,
  each given the (L, in, out) stacks that the backward loop carries (a
  DenseGeneral's (L, *in_dims, *features) stacks viewed so)."""
  import pallas_kernels.fused_wgrad as fw
  monkeypatch.setattr(fw, "default_interpret", lambda: False)
  model = _plain_blocks(True, 4, 256, jnp.bfloat16, general=general)
  x = jnp.ones((64, 256), jnp.bfloat16)
  variables = model.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-3)
  opt_state = tx.init(variables["params"])
  loss_fn = lambda v, b: jnp.mean(model.apply(v, b).astype(jnp.float32) ** 2)
  text = lower_for_cuda(forge_jax.make_step(loss_fn, tx), variables,
                        opt_state, x, donate_argnums=(0, 1))
  triton = triton_calls(text)
  assert len(triton) == 2, len(triton)
  assert sum("tensor<4x512x256xbf16>" in t for t in triton) == 1
  assert sum("tensor<4x256x512xbf16>" in t for t in triton) == 1
  # Two kernels (W, mu, nu each) and the count: the donated inputs alias.
  assert text.count("tf.aliasing_output") == 7


def _blocks_step_compiled(forge, layers, n, bt, dtype, wgrad="fused",
                          general=False):
  model = _plain_blocks(forge, layers, n, dtype, general=general)
  x = jnp.ones((bt, n), dtype)
  variables = model.init(jax.random.key(0), x)
  make = forge_jax.adamw if forge else optax.adamw
  tx = make(1e-3, mu_dtype=dtype)
  opt_state = tx.init(variables["params"])
  loss_fn = lambda v, b: jnp.mean(model.apply(v, b).astype(jnp.float32) ** 2)
  step = (forge_jax.make_step(loss_fn, tx, wgrad=wgrad) if forge
          else reference_step(loss_fn, tx))
  jitted = jax.jit(step, donate_argnums=(0, 1))
  compiled = jitted.lower(variables, opt_state, x).compile()
  return compiled, (jitted, variables, opt_state, x)


@pytest.mark.gpu
@pytest.mark.parametrize("general", [False, True], ids=["dense", "general"])
@pytest.mark.parametrize("wgrad", ["fused", "xla"])
def test_scanned_blocks_have_no_gradient_pool_on_gpu(wgrad, general):
  """The pool saved and the stacks updated in place, with either wgrad
  ("xla": XLA's GEMM, then stored_g_update on the stacks), for Dense and
  DenseGeneral (3-axis kernels, reshaped views of their stacks) layers; no
  stack-sized copy inside the compiled step's loops."""
  layers, n, bt = 8, 2048, 512
  pool = layers * 2 * (2 * n * n) * 2  # up + down kernels, bf16
  forge, run = _blocks_step_compiled(True, layers, n, bt, jnp.bfloat16,
                                     wgrad, general)
  ref, _ = _blocks_step_compiled(False, layers, n, bt, jnp.bfloat16,
                                 general=general)
  assert_pool_saved_in_place(forge, ref, run, pool, n * 2 * n * 2)


@pytest.mark.gpu
@pytest.mark.parametrize("general", [False, True], ids=["dense", "general"])
@pytest.mark.parametrize("wgrad", ["fused", "xla"])
def test_matches_flax_scan_optax_adamw_fp32_on_gpu(wgrad, general):
  init, ref, got, losses = _train(
      "adamw", steps=5, lead=(4, 12), wgrad=wgrad,
      model_kw=dict(block_kw=dict(general=general)),
      learning_rate=SCHEDULE, weight_decay=1e-2)
  _assert_parity(init, ref, got, losses)


def _xla_wgrad_step(stack_update, layers, n, bt, general=False):
  model = _plain_blocks(True, layers, n, jnp.bfloat16, stack_update, general)
  x = jnp.ones((bt, n), jnp.bfloat16)
  variables = model.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-3, mu_dtype=jnp.bfloat16)
  loss_fn = lambda v, b: jnp.mean(model.apply(v, b).astype(jnp.float32) ** 2)
  return (forge_jax.make_step(loss_fn, tx, wgrad="xla"), variables,
          tx.init(variables["params"]), x)


@pytest.mark.parametrize("general", [False, True], ids=["dense", "general"])
def test_xla_wgrad_slice_mode_loop_copies_no_stack(monkeypatch, general):
  """make_step(wgrad="xla") on a scanned stack, stack_update="slice": XLA
  used to fuse each layer's update into the write-back of its slice and
  copy every W/m/v stack on every loop iteration. The new slices are
  materialised first (`scan.update_layer`): no array of a stack's size is
  copied inside any while-loop body of the compiled step. DenseGeneral
  layers (``general``): their (L, *in_dims, *features) stacks enter and
  leave the backward loop as (L, n_in, n_out) views, and no array of a
  stack's size is copied anywhere in the program (the reshapes are
  bitcasts)."""
  from benchmarks import hlo_schedule
  import pallas_kernels.fused_wgrad as fw
  # No Pallas call on this path: it compiles on the CPU as on a GPU.
  monkeypatch.setattr(fw, "default_interpret", lambda: False)
  layers, n = 4, 64
  step, variables, opt_state, x = _xla_wgrad_step("slice", layers, n, 32,
                                                  general)
  text = jax.jit(step, donate_argnums=(0, 1)).lower(
      variables, opt_state, x).compile().as_text()
  stack_bytes = layers * n * 2 * n * 2  # one (L, n, 2n) bf16 stack
  copies = hlo_schedule.loop_copies(text, stack_bytes)
  assert copies == [], copies
  anywhere = [(c, name, t)
              for c, instrs in hlo_schedule.computations(text).items()
              for name, t, op, _, _ in instrs
              if op == "copy" and hlo_schedule.nbytes(t) >= stack_bytes]
  assert anywhere == [], anywhere
  # Not vacuous: the program holds the stacks in the parameters' shapes.
  shapes = ("[4,64,2,64]", "[4,2,64,64]") if general else ("[4,64,128]",)
  assert all(f"bf16{s}" in text for s in shapes)


@pytest.mark.parametrize("general", [False, True], ids=["dense", "general"])
def test_xla_wgrad_layer_mode_updates_the_stacks_in_place(monkeypatch,
                                                          general):
  """wgrad="xla", stack_update="layer" (the default): XLA's GEMM forms
  layer i's G and `pallas_kernels.stored_g_update` (the fused kernel's
  epilogue) updates layer i of the carried W/m/v stacks in place (XLA's
  elementwise rule plus a dynamic-update-slice per array would copy every
  new slice into its stack). Deviceless lowering: one stored-G Triton
  kernel per FORGE layer, each taking a 2-D G and the (L, in, out) stacks
  (a DenseGeneral's viewed so), aliased in place, and no
  dynamic-update-slice of a weight stack."""
  import pallas_kernels.fused_wgrad as fw
  monkeypatch.setattr(fw, "default_interpret", lambda: False)
  step, variables, opt_state, x = _xla_wgrad_step("layer", 4, 256, 64,
                                                  general)
  text = lower_for_cuda(step, variables, opt_state, x, donate_argnums=(0, 1))
  triton = triton_calls(text)
  assert len(triton) == 2, len(triton)
  assert "stored_g_update_adamw" in text and "fused_wgrad" not in text
  for g, stack in (("512x256", "4x512x256"), ("256x512", "4x256x512")):
    ((call,),) = [[t for t in triton if f"(tensor<{g}xbf16>" in t]]
    assert call.count(f"tensor<{stack}xbf16>") == 6  # W, m, v in and out
    assert call.count("operand_index") == 3  # each output aliases its input
  updates = [l for l in text.splitlines() if "dynamic_update_slice" in l]
  stacks = ("4x512x256", "4x256x512", "4x2x256x256", "4x256x2x256")
  assert not [l for l in updates if any(s in l for s in stacks)]


# --- Blocks FORGE cannot fuse as they stand --------------------------------


class TiedBlock(nn.Module):
  """Reads its FORGE Dense's kernel a second time (a tied projection)."""
  dense: type = nn.Dense

  @nn.compact
  def __call__(self, x):
    d = self.dense(D, use_bias=False, name="d")
    h = jnp.tanh(d(x))
    return x + 0.5 * h @ d.variables["params"]["kernel"].T + (
        self.dense(D, name="e")(x))


class _MLP(nn.Module):
  dense: type

  @nn.compact
  def __call__(self, x):
    return self.dense(D, name="down")(nn.silu(self.dense(2 * D, name="up")(x)))


class RematInsideBlock(nn.Module):
  """A FORGE Dense under nn.remat inside the block."""
  dense: type = nn.Dense

  @nn.compact
  def __call__(self, x):
    return x + nn.remat(_MLP)(self.dense, name="mlp")(x) + self.dense(
        D, name="e")(x)


def _scanned_model(block_cls, forge, num_layers=2):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(D, name="embed")(x)
      if forge:
        x = forge_jax.ScannedBlocks(
            functools.partial(block_cls, forge_jax.Dense), num_layers,
            name="layers")(x)
      else:
        x = flax_scan(functools.partial(block_cls, nn.Dense), num_layers,
                      "layers")(x)
      return nn.Dense(5, name="head")(x)

  return M()


@pytest.mark.parametrize("block_cls,path,match", [
    (TiedBlock, "layers/block/d", "is also read inside the block"),
    (RematInsideBlock, "layers/block/mlp/up",
     "is read through .* inside the block .*remove that transform"),
])
def test_a_kernel_the_block_reads_otherwise_is_refused_or_moved(
    block_cls, path, match):
  """A FORGE kernel the block also reads elsewhere (tied), or reads through
  a transform (nn.remat inside the block): the layer's own x and dy cannot
  give its update. shared="error" refuses it with the path; "standard"
  moves it to optax's path (the others stay fused) and matches flax's
  nn.scan + optax."""
  batches = _data(3)
  variables = _scanned_model(block_cls, False).init(jax.random.key(0),
                                                    batches[0][0])
  tx_kw = dict(learning_rate=1e-2, weight_decay=1e-2)
  ref_tx, f_tx = optax.adamw(**tx_kw), forge_jax.adamw(**tx_kw)
  model = _scanned_model(block_cls, True)
  with pytest.raises(ValueError, match=f"{path}.*{match}"):
    forge_jax.make_step(mse(model), f_tx)(
        variables, f_tx.init(variables["params"]), batches[0])
  step = forge_jax.make_step(mse(model), f_tx, shared="standard")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    (f_v, f_s), (ref_v, ref_s), _ = train_side_by_side(
        jax.jit(step), optax_step(mse(_scanned_model(block_cls, False)),
                                  ref_tx), variables, f_tx, ref_tx, batches)
  assert path in step.standard_layers
  assert "layers/block/e" not in step.standard_layers  # still fused
  assert any(path in str(w.message) for w in caught)
  assert_trees_close(f_v, ref_v, tol(jnp.float32), "params")
  assert_trees_close(f_s, ref_s, tol(jnp.float32), "opt_state")


class TupleBlock(nn.Module):
  @nn.compact
  def __call__(self, c):
    h, m = c
    return h + forge_jax.Dense(D, name="p")(h) * m, m


class DropoutBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dropout(0.1, deterministic=False)(forge_jax.Dense(
        D, name="p")(x))


class CustomDotBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + forge_jax.Dense(D, name="p", dot_general=jax.lax.dot_general)(x)


class LeadingAxisBlock(nn.Module):
  """A DenseGeneral contracting the input's leading axis: not one GEMM."""

  @nn.compact
  def __call__(self, x):
    return x + forge_jax.DenseGeneral(x.shape[0], axis=0, name="p")(x).T


class BadConfigBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + forge_jax.Dense(D, name="p", block_config={"block_in": 32})(x)


def test_a_carry_that_is_not_one_array_is_refused_at_init():
  blocks = forge_jax.ScannedBlocks(TupleBlock, 2)
  x = jnp.ones((3, D))
  with pytest.raises(TypeError, match="the carry must be one array"):
    blocks.init(jax.random.key(0), (x, x))


def test_a_block_changing_the_carry_dtype_is_refused_at_init():
  """A block whose output dtype is not its input's (a bf16 layer on an fp32
  carry) is refused at init naming the module and both dtypes (it was
  jax's scan error, naming neither the module nor the fix)."""
  class Cast(nn.Module):
    @nn.compact
    def __call__(self, h):
      return forge_jax.Dense(D, dtype=jnp.bfloat16, name="p")(h)

  blocks = forge_jax.ScannedBlocks(Cast, 2, name="layers")
  with pytest.raises(ValueError, match=(
      r"ScannedBlocks at '<root>': a scan's carry changes type .* "
      r"\(float32\[3,24\]\).*bfloat16")):
    blocks.init(jax.random.key(0), jnp.ones((3, D)))


def test_a_block_returning_a_tuple_is_refused_at_init_naming_the_module():
  """A block returning a tuple where its carry is one array: refused at
  init naming the module (it was jax's scan error alone)."""
  class Pair(nn.Module):
    @nn.compact
    def __call__(self, h):
      h = forge_jax.Dense(D, name="p")(h)
      return h, h

  blocks = forge_jax.ScannedBlocks(Pair, 2, name="layers")
  with pytest.raises(ValueError, match=(
      r"ScannedBlocks at '<root>': a scan's carry changes type .*one array"
      r".*same pytree structure")):
    blocks.init(jax.random.key(0), jnp.ones((3, D)))


def test_a_module_instance_as_block_is_refused():
  blocks = forge_jax.ScannedBlocks(Block(forge_jax.Dense), 2)
  with pytest.raises(TypeError, match=r"not a module instance \(Block"):
    blocks.init(jax.random.key(0), jnp.ones((3, D)))


def _step_on(block, fused=True, **step_kw):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.ScannedBlocks(block, 2, fused=fused, name="layers")(x)

  model = M()
  x = jnp.ones((4, D))
  variables = model.init({"params": jax.random.key(0),
                          "dropout": jax.random.key(1)}, x)
  tx = forge_jax.adamw(1e-2)
  loss = lambda v, b: jnp.mean(model.apply(
      v, b, rngs={"dropout": jax.random.key(2)}) ** 2)
  return forge_jax.make_step(loss, tx, **step_kw)(
      variables, tx.init(variables["params"]), x)


def test_a_block_that_draws_randomness_is_refused_with_the_fix():
  with pytest.raises(ValueError, match="no randomness.*fused=False"):
    _step_on(DropoutBlock)
  loss, _, _ = _step_on(DropoutBlock, fused=False)  # flax's scan: runs
  assert np.isfinite(float(loss))


@pytest.mark.parametrize("block,match", [
    (CustomDotBlock, "Dense at 'layers/block/p'.*custom dot_general"),
    (LeadingAxisBlock, "DenseGeneral at 'layers/block/p': axis=0 .*trailing"),
], ids=["custom-dot", "leading-axis"])
def test_fused_false_runs_a_block_that_cannot_be_fused(block, match):
  with pytest.raises(ValueError, match=match):
    _step_on(block)
  loss, _, _ = _step_on(block, fused=False)
  assert np.isfinite(float(loss))


def test_errors_inside_the_block_name_the_layer_by_its_full_path():
  with pytest.raises(TypeError, match="Dense at 'layers/block/p'.*block_config"):
    _step_on(BadConfigBlock)


class TwoStacks(nn.Module):
  """Two ScannedBlocks of different lengths (one of a single block) in one
  model, each with its own parameters and slots."""
  forge: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(D, name="embed")(x)
    for name, length in (("first", 1), ("second", 3)):
      if self.forge:
        x = forge_jax.ScannedBlocks(
            functools.partial(Block, forge_jax.Dense), length, name=name)(x)
      else:
        x = flax_scan(Block, length, name)(x)
    return nn.Dense(5, name="head")(x)


def test_two_stacks_one_of_a_single_block_match():
  batches = _data(4)
  variables = TwoStacks(False).init(jax.random.key(0), batches[0][0])
  assert variables["params"]["first"]["block"]["up"]["kernel"].shape[0] == 1
  tx_kw = dict(learning_rate=1e-2, weight_decay=1e-2)
  ref_tx, f_tx = optax.adamw(**tx_kw), forge_jax.adamw(**tx_kw)
  step = forge_jax.make_step(mse(TwoStacks()), f_tx)
  (f_v, f_s), (ref_v, ref_s), _ = train_side_by_side(
      jax.jit(step, donate_argnums=(0, 1)),
      optax_step(mse(TwoStacks(False)), ref_tx), variables, f_tx, ref_tx,
      batches)
  assert step.standard_layers == []
  assert_trees_close(f_v, ref_v, tol(jnp.float32), "params")
  assert_trees_close(f_s, ref_s, tol(jnp.float32), "opt_state")
  for name in ("first", "second"):
    k0 = variables["params"][name]["block"]["down"]["kernel"]
    assert rel_err(f_v["params"][name]["block"]["down"]["kernel"], k0) > 1e-3


class _GatedDropoutBlock(nn.Module):
  """Dropout only where apply gave a 'dropout' stream (has_rng)."""
  dropout: bool = True

  @nn.compact
  def __call__(self, x):
    h = forge_jax.Dense(x.shape[-1], name="up")(x)
    if self.dropout:
      h = nn.Dropout(0.5, deterministic=not self.has_rng("dropout"))(h)
    return x + h


@pytest.mark.parametrize("dropout", [True, False])
def test_a_block_drawing_from_the_given_streams_is_refused(dropout):
  """In a FORGE step the blocks run with their parameters alone: a block
  whose dropout is keyed on has_rng would silently run without it, so it
  is refused with the fix; a block that draws nothing trains although
  apply was given the stream (for dropout elsewhere in the model)."""
  m = forge_jax.ScannedBlocks(functools.partial(_GatedDropoutBlock,
                                                dropout=dropout), 2)
  x = jnp.linspace(-1, 1, 64).reshape(4, 16)
  v = m.init(jax.random.key(0), x)
  loss = lambda v, b: jnp.mean(
      m.apply(v, b, rngs={"dropout": jax.random.key(3)}) ** 2)
  tx = forge_jax.adamw(1e-2)
  step = forge_jax.make_step(loss, tx)
  if dropout:
    with pytest.raises(ValueError, match=r"random streams \['dropout'\].*"
                       "fused=False"):
      step(v, tx.init(v["params"]), x)
  else:
    value, _, _ = step(v, tx.init(v["params"]), x)
    assert jnp.isfinite(value)


def test_muon_on_a_scanned_stack_is_refused_with_the_fix():
  """optax's Muon keeps a stacked (L, in, out) kernel in its AdamW branch,
  which the stacked path does not step: refused, naming fused=False."""
  m = forge_jax.ScannedDenseStack(16, 2)
  x = jnp.linspace(-1, 1, 64).reshape(4, 16)
  v = m.init(jax.random.key(0), x)
  tx = forge_jax.muon(1e-2)
  step = forge_jax.make_step(lambda v, b: jnp.mean(m.apply(v, b) ** 2), tx)
  with pytest.raises(ValueError, match="fused=False"):
    step(v, tx.init(v["params"]), x)


# --- A block reading traced values it is not given (its closure) -----------


def _closing_block(dense, gain, offset, pos):
  """A block class that reads, through its Python closure, ``gain`` (a
  parameter of the model outside the stack), ``offset`` (from the batch
  only) and ``pos`` (integers), and through its ``cond`` attribute an
  adaLN-style shift and scale computed from parameters outside the stack."""

  class ClosingBlock(nn.Module):
    cond: jax.Array

    @nn.compact
    def __call__(self, x):
      shift, scale = jnp.split(self.cond, 2, axis=-1)
      h = x * (1 + scale) + shift + offset + 1e-2 * pos
      a = dense(2 * D + 3, name="up")(h)
      return x + gain * dense(D, use_bias=False, name="down")(nn.silu(a))

  return ClosingBlock


class ClosingModel(nn.Module):
  """Dense(in -> D) -> L closing blocks -> Dense(D -> out); ``forge``:
  ``ScannedBlocks``, else flax's ``nn.scan(nn.remat(...))``."""
  forge: bool = False
  num_layers: int = 3

  @nn.compact
  def __call__(self, x):
    dense = forge_jax.Dense if self.forge else nn.Dense
    h = nn.relu(dense(D, name="embed")(x))
    cond = nn.Dense(2 * D, name="cond")(jnp.tanh(x[..., :8]))
    gain = self.param("gain", nn.initializers.constant(0.5), (D,))
    offset = jnp.tanh(jnp.mean(x, axis=-1, keepdims=True))
    pos = jnp.arange(D)
    block = functools.partial(_closing_block(dense, gain, offset, pos),
                              cond=cond)
    if self.forge:
      h = forge_jax.ScannedBlocks(block, self.num_layers, name="layers")(h)
    else:
      h = flax_scan(block, self.num_layers, "layers")(h)
    return dense(5, name="head")(h)


@pytest.mark.parametrize("wgrad,clip", [("fused", False), ("xla", True)],
                         ids=["fused", "xla-clipped"])
def test_a_block_closing_over_traced_values_matches_flax_scan(wgrad, clip):
  """A block reading values of the step it is not given (a conditioning
  vector and a gain computed from parameters outside the stack, a batch
  statistic, integer positions) gets them as inputs of the stack's
  custom_vjp: the FORGE kernels stay fused and every parameter, the
  closure's sources included, matches flax's nn.scan + optax (also in a
  clipped step, whose norm pass sums the closure's gradient too)."""
  batches = _data(3, (4, 12))
  variables = ClosingModel(False).init(jax.random.key(0), batches[0][0])
  tx_kw = dict(learning_rate=1e-2, weight_decay=1e-2)
  ref_tx, f_tx = optax.adamw(**tx_kw), forge_jax.adamw(**tx_kw)
  if clip:
    ref_tx = optax.chain(optax.clip_by_global_norm(0.05), ref_tx)
    f_tx = optax.chain(forge_jax.clip_by_global_norm(0.05), f_tx)
  step = forge_jax.make_step(mse(ClosingModel(True)), f_tx, wgrad=wgrad)
  (f_v, f_s), (ref_v, ref_s), losses = train_side_by_side(
      jax.jit(step, donate_argnums=(0, 1)),
      optax_step(mse(ClosingModel(False)), ref_tx), variables, f_tx, ref_tx,
      batches)
  assert step.standard_layers == []
  assert rel_err(losses[-1][0], losses[-1][1]) <= tol(jnp.float32)
  assert_trees_close(f_v, ref_v, tol(jnp.float32), "params")
  assert_trees_close(f_s, ref_s, tol(jnp.float32), "opt_state")
  # Not vacuous: the closure's sources and every FORGE layer moved.
  params, init = f_v["params"], variables["params"]
  assert rel_err(params["gain"], init["gain"]) > 1e-3
  assert rel_err(params["cond"]["kernel"], init["cond"]["kernel"]) > 1e-3
  for name in ("up", "down"):
    k0 = init["layers"]["block"][name]["kernel"]
    for i in range(k0.shape[0]):
      assert rel_err(params["layers"]["block"][name]["kernel"][i],
                     k0[i]) > 1e-3, (name, i)


def test_only_a_block_with_a_closure_is_traced_again(monkeypatch):
  """The trace that finds a block's FORGE layers also finds what it reads
  from its closure: a block reading only its carry and parameters is not
  traced again; one with a closure has its functions traced with those
  values as arguments."""
  calls = []
  traced = forge_jax.ScannedBlocks._traced
  monkeypatch.setattr(forge_jax.ScannedBlocks, "_traced",
                      lambda self, *a: calls.append(self.path) or traced(
                          self, *a))
  batch = _data(1, (4, 12))[0]
  for model, again in ((Model, False), (ClosingModel, True)):
    variables = model(False).init(jax.random.key(0), batch[0])
    tx = forge_jax.adamw(1e-2)
    jax.jit(forge_jax.make_step(mse(model(True)), tx)).trace(
        variables, tx.init(variables["params"]), batch)
    assert bool(calls) == again, model.__name__
    calls.clear()


class _MaskBlock(nn.Module):
  """Reads a mask of the batch it is not given (never differentiated)."""
  mask: jax.Array

  @nn.compact
  def __call__(self, x):
    return x + forge_jax.Dense(D, name="p")(nn.silu(x)) * self.mask.astype(
        x.dtype)


class _MaskModel(nn.Module):
  mask_dtype: Any

  @nn.compact
  def __call__(self, x):
    mask = (jnp.abs(x) > 0.1).astype(self.mask_dtype)
    h = forge_jax.ScannedBlocks(functools.partial(_MaskBlock, mask), 4,
                                name="layers")(x)
    return forge_jax.Dense(3, name="head")(h)


def test_a_closure_value_not_differentiated_gets_no_gradient_formed():
  """A float value the block reads but the loss is not differentiated by (a
  mask of the batch) costs the backward no gradient: the compiled step does
  no more work than with the same mask as integers (whose gradient is never
  formed). Forming it anyway cost about 9 % more here."""
  x = jax.random.normal(jax.random.key(0), (8, D))
  y = jnp.zeros((8, 3))
  flops = {}
  for dtype in (jnp.int32, jnp.float32):
    model = _MaskModel(dtype)
    v = model.init(jax.random.key(1), x)
    tx = forge_jax.adamw(1e-3)
    step = forge_jax.make_step(
        lambda params, b, m=model: jnp.mean((m.apply(params, b[0]) - b[1])
                                            ** 2), tx)
    compiled = jax.jit(step).lower(v, tx.init(v["params"]), (x, y)).compile()
    flops[dtype] = compiled.cost_analysis()["flops"]
  assert 0 < flops[jnp.float32] <= flops[jnp.int32], flops


class _CallsParentBlock(nn.Module):
  """Calls ``shared``, a Dense of the model outside the block (passed as an
  attribute); or, given that Dense's parameters (a dict of arrays), applies
  them as arrays."""
  shared: Any = None

  @nn.compact
  def __call__(self, x):
    if isinstance(self.shared, nn.Module):
      s = self.shared(x)
    else:
      s = x @ self.shared["kernel"] + self.shared["bias"]
    h = x + 0.1 * s
    return x + forge_jax.Dense(D, name="down")(nn.silu(forge_jax.Dense(
        D, name="up")(h)))


class _ParentModuleModel(nn.Module):
  """A Dense of the model read by every block: ``how`` ``"flax"``: flax's
  nn.scan of blocks calling the module; ``"module"``: ScannedBlocks of the
  same; ``"arrays"``: ScannedBlocks of blocks given its parameters."""
  how: str = "flax"
  fused: bool = True

  @nn.compact
  def __call__(self, x):
    shared = nn.Dense(D, name="shared")
    h = jnp.tanh(shared(x))
    block = functools.partial(_CallsParentBlock, (
        shared.variables["params"] if self.how == "arrays" else shared))
    if self.how == "flax":
      return flax_scan(block, 2, "layers")(h)
    return forge_jax.ScannedBlocks(block, 2, fused=self.fused,
                                   name="layers")(h)


def test_a_block_calling_a_module_of_the_model_is_refused_naming_the_fixes():
  """A block calling a module defined outside it (the model's Dense, passed
  as an attribute) cannot run layer by layer with its own parameters: the
  step refuses it naming that module and the fixes, not dropout or
  batch_stats; both fixes, the module's parameters passed as arrays (fused)
  and fused=False, train as flax's nn.scan + optax."""
  batches = _data(3, (4, 12), d_in=D, d_out=D)
  variables = _ParentModuleModel().init(jax.random.key(0), batches[0][0])
  tx_kw = dict(learning_rate=1e-2, weight_decay=1e-2)
  ref_tx, f_tx = optax.adamw(**tx_kw), forge_jax.adamw(**tx_kw)
  with pytest.raises(ValueError) as refused:
    forge_jax.make_step(mse(_ParentModuleModel("module")), f_tx)(
        variables, f_tx.init(variables["params"]), batches[0])
  message = str(refused.value)
  assert re.search(r"ScannedBlocks at 'layers': the block calls a module "
                   r"that is not its own, its attribute 'shared' \(the Dense "
                   r"at 'shared'\), defined outside the block.*output outside "
                   r"the stack.*variables\['params'\].*fused=False", message)
  assert "dropout" not in message and "batch_stats" not in message
  ref_step = optax_step(mse(_ParentModuleModel()), ref_tx)
  reference = run_reference(ref_step, variables, ref_tx, batches)
  for model in (_ParentModuleModel("arrays"),
                _ParentModuleModel("module", fused=False)):
    step = forge_jax.make_step(mse(model), f_tx)
    (f_v, f_s), (ref_v, ref_s), losses = train_side_by_side(
        jax.jit(step), ref_step, variables, f_tx, ref_tx, batches,
        reference=reference)
    assert step.standard_layers == []
    assert rel_err(losses[-1][0], losses[-1][1]) <= tol(jnp.float32)
    assert_trees_close(f_v, ref_v, tol(jnp.float32), "params")
    assert_trees_close(f_s, ref_s, tol(jnp.float32), "opt_state")
    # Not vacuous: the shared module and the stacked kernels moved.
    params, init = f_v["params"], variables["params"]
    assert rel_err(params["shared"]["kernel"], init["shared"]["kernel"]) > 1e-3
    assert rel_err(params["layers"]["block"]["up"]["kernel"],
                   init["layers"]["block"]["up"]["kernel"]) > 1e-3


# --- A block with batch_stats ------------------------------------------------


class BNBlock(nn.Module):
  """A residual block with a BatchNorm (training mode: it updates its
  running statistics, the ``batch_stats`` collection)."""
  dense: type = nn.Dense

  @nn.compact
  def __call__(self, x):
    # No bias before BatchNorm: its gradient is zero up to rounding, which
    # Adam would scale to +-lr in either arm alike.
    y = self.dense(D, use_bias=False, name="p")(x)
    return x + nn.BatchNorm(use_running_average=False, momentum=0.9,
                            name="bn")(nn.silu(y))


class BNModel(nn.Module):
  """Dense(in -> D) -> 2 BatchNorm blocks -> Dense(D -> out); ``forge``:
  ``ScannedBlocks(..., fused=fused)``, else flax's ``nn.scan(nn.remat(...))``
  with the parameters and the statistics stacked per layer."""
  forge: bool = False
  fused: bool = True

  @nn.compact
  def __call__(self, x):
    dense = forge_jax.Dense if self.forge else nn.Dense
    h = nn.relu(dense(D, name="embed")(x))
    if self.forge:
      h = forge_jax.ScannedBlocks(functools.partial(BNBlock, forge_jax.Dense),
                                  2, fused=self.fused, name="layers")(h)
    else:
      h = nn.scan(nn.remat(_FlaxBody),
                  variable_axes={"params": 0, "batch_stats": 0},
                  split_rngs={"params": True}, length=2)(
                      BNBlock, name="layers")(h, None)[0]
    return dense(5, name="head")(h)


def _bn_loss(model):
  def loss_fn(variables, batch):
    x, y = batch
    out, updates = model.apply(variables, x, mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2), updates["batch_stats"]
  return loss_fn


class SowBlock(nn.Module):
  """A residual block that sows a per-layer value (an auxiliary loss)."""
  dense: type = nn.Dense

  @nn.compact
  def __call__(self, x):
    y = self.dense(D, name="p")(x)
    self.sow("intermediates", "act", jnp.mean(y ** 2))
    return x + y


class SowModel(nn.Module):
  forge: bool = False

  @nn.compact
  def __call__(self, x):
    if self.forge:
      return forge_jax.ScannedBlocks(functools.partial(SowBlock,
                                                       forge_jax.Dense),
                                     3, name="layers")(x)
    return nn.scan(nn.remat(_FlaxBody),
                   variable_axes={"params": 0, "intermediates": 0},
                   split_rngs={"params": True}, length=3)(
                       SowBlock, name="layers")(x, None)[0]


def test_sown_values_are_stacked_per_layer_or_refused_in_a_step():
  """A block's sown values are stacked per layer as flax's nn.scan stacks
  every collection it lists (outside a step); a FORGE step whose apply
  asks for them is refused (it keeps no collection but the parameters),
  where they would be lost."""
  x = jax.random.normal(jax.random.key(1), (2, D))
  variables = SowModel().init(jax.random.key(0), x)
  params = {"params": variables["params"]}
  want = SowModel().apply(params, x, mutable=["intermediates"])
  got = SowModel(True).apply(params, x, mutable=["intermediates"])
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.shape == b.shape and rel_err(a, b) <= tol(jnp.float32)

  def loss_fn(v, x):
    y, sown = SowModel(True).apply(v, x, mutable=["intermediates"])
    return jnp.mean(y ** 2), sown

  tx = forge_jax.adamw(1e-3)
  with pytest.raises(ValueError, match=r"'layers': the block writes the "
                     r"collections \['intermediates'\].*fused=False"):
    forge_jax.make_step(loss_fn, tx, has_aux=True)(
        params, tx.init(params["params"]), x)


def test_a_block_with_batch_stats_is_refused_and_runs_with_fused_false():
  """A FORGE step runs each fused block with its parameters alone, so a
  block with batch_stats is refused, naming fused=False; with fused=False
  the stack is flax's nn.scan with the statistics stacked per layer as the
  parameters (the tree of nn.scan(..., variable_axes={'params': 0,
  'batch_stats': 0})), and a has_aux step (the model's other FORGE layers
  fused) matches that scan + optax, statistics included."""
  batches = _data(3, (4, 12))
  x = batches[0][0]
  variables = BNModel(False).init(jax.random.key(0), x)
  got = BNModel(True, fused=False).init(jax.random.key(0), x)
  assert jax.tree.structure(got) == jax.tree.structure(variables)
  assert got["batch_stats"]["layers"]["block"]["bn"]["mean"].shape == (2, D)
  tx_kw = dict(learning_rate=1e-2, weight_decay=1e-2)
  ref_tx, f_tx = optax.adamw(**tx_kw), forge_jax.adamw(**tx_kw)
  with pytest.raises(ValueError, match=r"layers'.*batch_stats.*fused=False: "
                     r".*batch_stats stacked per layer"):
    forge_jax.make_step(_bn_loss(BNModel(True)), f_tx, has_aux=True)(
        variables, f_tx.init(variables["params"]), batches[0])
  step = forge_jax.make_step(_bn_loss(BNModel(True, fused=False)), f_tx,
                             has_aux=True)
  f_step = jax.jit(step)
  ref_step = jax.jit(reference_step(_bn_loss(BNModel(False)), ref_tx,
                                    has_aux=True))
  v_f, s_f = variables, f_tx.init(variables["params"])
  v_r, s_r = variables, ref_tx.init(variables["params"])
  for batch in batches:
    (l_f, stats_f), v_f, s_f = f_step(v_f, s_f, batch)
    (l_r, stats_r), v_r, s_r = ref_step(v_r, s_r, batch)
    v_f, v_r = {**v_f, "batch_stats": stats_f}, {**v_r, "batch_stats": stats_r}
    assert rel_err(l_f, l_r) <= tol(jnp.float32)
  assert step.standard_layers == []
  assert_trees_close(v_f, v_r, tol(jnp.float32), "variables")
  assert_trees_close(s_f, s_r, tol(jnp.float32), "opt_state")
  # Not vacuous: the statistics and the stacked kernels moved.
  mean = lambda v: v["batch_stats"]["layers"]["block"]["bn"]["mean"]
  assert rel_err(mean(v_f), mean(variables)) > 1e-3
  kernel = lambda v: v["params"]["layers"]["block"]["p"]["kernel"]
  assert rel_err(kernel(v_f), kernel(variables)) > 1e-3


# --- A stack inside the block ------------------------------------------------


class OuterBlock(nn.Module):
  """A block holding a ``dense`` layer and an inner stack of two
  ``Block``s, ``how``: ``"scanned"`` a ScannedBlocks (refused in a step),
  ``"unrolled"`` a Python loop of blocks of ``dense`` layers, ``"flax"``
  flax's nn.scan of blocks of flax's own layers."""
  dense: type = nn.Dense
  how: str = "unrolled"

  @nn.compact
  def __call__(self, x):
    x = x + jnp.tanh(self.dense(D, name="mix")(x))
    if self.how == "scanned":
      return forge_jax.ScannedBlocks(functools.partial(Block, self.dense), 2,
                                     name="inner")(x)
    if self.how == "unrolled":
      for j in range(2):
        x = Block(self.dense, name=f"inner_{j}")(x)
      return x
    return flax_scan(Block, 2, "inner")(x)


def _outer_model(forge, how):
  return _scanned_model(functools.partial(OuterBlock, how=how), forge)


@pytest.mark.parametrize("how", ["unrolled", "flax"])
def test_a_nested_stack_is_refused_naming_the_fixes_which_train(how):
  """A ScannedBlocks inside a ScannedBlocks block is refused with its full
  path and two fixes, each of which trains and matches flax's nested
  nn.scan + optax: the inner blocks unrolled in the outer block (their
  FORGE layers fused by the outer stack), or the inner stack as flax's
  nn.scan of flax's own layers (the standard path)."""
  batches = _data(2, (4, 12))
  x = batches[0][0]
  nested = _outer_model(True, "scanned")
  v = nested.init(jax.random.key(0), x)
  tx = forge_jax.adamw(1e-2)
  with pytest.raises(ValueError, match=r"ScannedBlocks at 'layers/block/inner'"
                     r": .*cannot be nested.*Python loop.*flax's nn.scan"):
    forge_jax.make_step(mse(nested), tx)(v, tx.init(v["params"]), batches[0])
  variables = _outer_model(False, how).init(jax.random.key(0), x)
  tx_kw = dict(learning_rate=1e-2, weight_decay=1e-2)
  ref_tx, f_tx = optax.adamw(**tx_kw), forge_jax.adamw(**tx_kw)
  step = jax.jit(forge_jax.make_step(mse(_outer_model(True, how)), f_tx))
  traced = step.trace(variables, f_tx.init(variables["params"]), batches[0])
  # Inside the backward loop: mix, and unrolled up and down of both copies.
  assert str(traced.jaxpr).count("pallas_call") == (5 if how == "unrolled"
                                                    else 1)
  (f_v, f_s), (ref_v, ref_s), _ = train_side_by_side(
      step, optax_step(mse(_outer_model(False, how)), ref_tx), variables,
      f_tx, ref_tx, batches)
  assert_trees_close(f_v, ref_v, tol(jnp.float32), "params")
  assert_trees_close(f_s, ref_s, tol(jnp.float32), "opt_state")


# --- Low-precision moments of a DenseGeneral in the block ---------------------


class _GeneralBlock(nn.Module):
  """A DenseGeneral ``D -> features`` (several feature axes), then flax's
  own DenseGeneral back to the carry's width."""
  features: tuple = (2, 8)

  @nn.compact
  def __call__(self, h):
    a = forge_jax.DenseGeneral(self.features, name="up")(h)
    return h + nn.DenseGeneral(h.shape[-1], axis=(-2, -1),
                               name="down")(nn.silu(a))


def _general_model(features, fused=True):
  class M(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.ScannedBlocks(
          functools.partial(_GeneralBlock, features), 2, fused=fused,
          name="layers")(x)

  return M()


def test_a_small_dense_general_of_several_feature_axes_takes_int8_moments():
  """A stacked kernel (2, 16, 2, 8): several feature axes, the last of 8
  elements (not a multiple of the 64-element quantization block), but 512
  elements, too few for quantized moments (4096): its moments are float
  arrays, with no blocks to misalign. It is fused under moments="int8" and
  trains as the same stack with fused=False (the same transform on the
  standard path)."""
  x = jax.random.normal(jax.random.key(0), (6, 16))
  variables = _general_model((2, 8)).init(jax.random.key(1), x)
  tx = forge_jax.adamw(1e-2, weight_decay=1e-2, moments="int8")
  state = tx.init(variables["params"])
  mu = state.mu["layers"]["block"]["up"]["kernel"]
  assert not isinstance(mu, Quantized) and mu.shape == (2, 16, 2, 8)
  keys = jax.random.split(jax.random.key(2), 3)
  batches = [(jax.random.normal(k, (6, 16)), jnp.zeros((6, 16)))
             for k in keys]
  got = {}
  for fused in (True, False):
    raw = forge_jax.make_step(mse(_general_model((2, 8), fused)), tx)
    step = jax.jit(raw)
    v, s = variables, state
    for batch in batches:
      loss, v, s = step(v, s, batch)
    got[fused] = loss, v, s
    if fused:  # fused, not moved to optax's path
      assert raw.standard_layers == []
  assert rel_err(got[True][0], got[False][0]) <= tol(jnp.float32)
  assert_trees_close(got[True][1], got[False][1], tol(jnp.float32), "params")
  assert_trees_close(got[True][2], got[False][2], tol(jnp.float32),
                     "opt_state")
  kernel = lambda v: v["params"]["layers"]["block"]["up"]["kernel"]
  for i in range(2):  # not vacuous: both layers moved
    assert rel_err(kernel(got[True][1])[i], kernel(variables)[i]) > 1e-3


def test_a_large_misaligned_dense_general_is_refused_under_int8_moments():
  """A stacked kernel (2, 16, 4, 96): 12288 elements get quantized moments,
  whose 64-element blocks along its last axis (96 elements) are not blocks
  of the fused kernel's (16, 384) rows: refused, naming the layer and the
  fix; fused=False steps it."""
  x = jax.random.normal(jax.random.key(0), (6, 16))
  variables = _general_model((4, 96)).init(jax.random.key(1), x)
  tx = forge_jax.adamw(1e-2, moments="int8")
  state = tx.init(variables["params"])
  mu = state.mu["layers"]["block"]["up"]["kernel"]
  assert isinstance(mu, Quantized) and mu.q.shape == (2, 16, 4, 96)
  batch = (x, jnp.zeros((6, 16)))
  with pytest.raises(ValueError, match=r"DenseGeneral at 'layers/block/up' "
                     r".*several feature axes, the last of 96 elements, not "
                     r"a multiple of 64.*fused=False"):
    forge_jax.make_step(mse(_general_model((4, 96))), tx)(variables, state,
                                                          batch)
  loss, _, _ = forge_jax.make_step(mse(_general_model((4, 96), False)), tx)(
      variables, state, batch)
  assert np.isfinite(float(loss))
