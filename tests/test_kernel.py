"""The fused weight-gradient kernel against its pure-jnp reference."""

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import autotune, rules, tuning_cache
from pallas_kernels.reference import apply_rule
from tests.harness import lower_for_cuda, triton_calls
from tests.tolerances import assert_close, assert_update_close, tol

# (tokens..., in, out): odd sizes no block divides, sizes below the minimum
# block, leading batch dimensions, and one multi-tile case.
SHAPES = [
    ((37,), 70, 130),
    ((1,), 16, 16),
    ((3,), 5, 7),
    ((2, 19), 33, 17),
    ((100,), 64, 160),
]

# (x/dy dtype, w dtype, mu dtype, nu dtype)
DTYPES = [
    (jnp.float32, jnp.float32, jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.bfloat16),  # mu_dtype=f32
]


def adamw_hparams(rule=pk.ADAMW, lr=3e-2, wd=1e-2, t=3, b1=0.9, b2=0.999):
  return rule.pack(lr=lr, b1=b1, b2=b2, one_minus_b1=1 - b1,
                   one_minus_b2=1 - b2, eps=1e-8, eps_root=1e-12,
                   weight_decay=wd, bc1=1 - b1**t, bc2=1 - b2**t,
                   bc1_next=1 - b1**(t + 1))


def adamw64(g, w, mu, nu, lr=3e-2, wd=1e-2, t=3, b1=0.9, b2=0.999, eps=1e-8,
            eps_root=1e-12):
  """AdamW written out (optax's formula) in float64, for ``adamw_hparams()``:
  an expectation independent of the rule plumbing and of the kernel."""
  g, w, mu, nu = (np.asarray(a, np.float64) for a in (g, w, mu, nu))
  m = b1 * mu + (1 - b1) * g
  v = b2 * nu + (1 - b2) * g * g
  upd = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t) + eps_root) + eps)
  return w - lr * (upd + wd * w), m, v


def make_case(seed, tokens, n_in, n_out, dtypes):
  xd, wd, md, vd = dtypes
  k = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(k[0], (*tokens, n_in)).astype(xd)
  dy = jax.random.normal(k[1], (*tokens, n_out)).astype(xd)
  w = jax.random.normal(k[2], (n_in, n_out)).astype(wd)
  mu = (0.1 * jax.random.normal(k[3], (n_in, n_out))).astype(md)
  nu = (0.1 * jax.random.uniform(k[4], (n_in, n_out))).astype(vd)
  return x, dy, w, (mu, nu)


def check_against_reference(x, dy, w, slots, h, rule, config=None,
                            interpret=True, backend=None):
  got_w, got_slots = pk.fused_wgrad_update(
      x, dy, w, slots, h, rule=rule, config=config, interpret=interpret,
      backend=backend)
  ref_w, ref_slots = pk.fused_wgrad_update_reference(x, dy, w, slots, h,
                                                     rule=rule)
  assert got_w.dtype == w.dtype and got_w.shape == w.shape
  assert_close(got_w, ref_w, what="w")
  assert_update_close(got_w, ref_w, w, what="w")
  for name, g, r, s in zip(rule.slots, got_slots, ref_slots, slots):
    assert g.dtype == s.dtype and g.shape == s.shape
    assert_close(g, r, what=name)
    assert_update_close(g, r, s, what=name)
  # The step must have changed every state array (no silent no-op).
  assert not np.allclose(np.asarray(got_w, np.float32),
                         np.asarray(w, np.float32))
  for g, s in zip(got_slots, slots):
    assert not np.allclose(np.asarray(g, np.float32), np.asarray(s, np.float32))


@pytest.mark.parametrize("tokens,n_in,n_out", SHAPES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(
    jnp.dtype(t).name for t in d))
def test_kernel_matches_reference(tokens, n_in, n_out, dtypes):
  x, dy, w, slots = make_case(n_in * n_out, tokens, n_in, n_out, dtypes)
  check_against_reference(x, dy, w, slots, adamw_hparams(), pk.ADAMW)


def _dense_kernel_grad(x, dy, w):
  """The gradient ``jax.grad`` gives a Dense kernel ``w`` used as ``x @ w`` in
  ``x``'s dtype (fp32 products for fp32 operands)."""
  prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  _, vjp = jax.vjp(lambda k: jnp.matmul(x, k, precision=prec),
                   w.astype(x.dtype))
  return vjp(dy.astype(x.dtype))[0]


@pytest.mark.parametrize("tokens,n_in,n_out", SHAPES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(
    jnp.dtype(t).name for t in d))
def test_unfused_update_is_the_rule_on_the_gradient_jax_grad_gives(
    tokens, n_in, n_out, dtypes):
  x, dy, w, slots = make_case(n_in * n_out + 1, tokens, n_in, n_out, dtypes)
  h = adamw_hparams()
  # Both jitted, as in a step: XLA then fuses the transpose into the dot.
  got_w, got_slots = jax.jit(functools.partial(
      pk.unfused_wgrad_update, rule=pk.ADAMW))(x, dy, w, slots, h)
  g = jax.jit(_dense_kernel_grad)(x, dy, w)
  assert g.dtype == x.dtype  # bf16 operands: optax's bf16 gradient
  ref_w, ref_slots = pk.ADAMW.apply(g, w, slots, h)
  assert got_w.dtype == w.dtype and got_w.shape == w.shape
  assert_close(got_w, ref_w, what="w")
  assert_update_close(got_w, ref_w, w, what="w")
  for name, a, r, s in zip(pk.ADAMW.slots, got_slots, ref_slots, slots):
    assert a.dtype == s.dtype and a.shape == s.shape
    assert_close(a, r, what=name)
    assert_update_close(a, r, s, what=name)
  if dtypes == DTYPES[0]:  # fp32: the fused kernel's reference (fp32 G) too
    check_against_reference(x, dy, w, slots, h, pk.ADAMW)
    fused_w, _ = pk.fused_wgrad_update_reference(x, dy, w, slots, h,
                                                 rule=pk.ADAMW)
    assert_close(got_w, fused_w, what="w vs the fused reference")


@pytest.mark.parametrize("tokens,n_in,n_out", SHAPES)
@pytest.mark.parametrize("xd,wd", [(jnp.float32, jnp.float32),
                                   (jnp.bfloat16, jnp.bfloat16),
                                   (jnp.bfloat16, jnp.float32)],
                         ids=["f32", "bf16", "bf16-x-f32-w"])
def test_unfused_gradient_is_jax_grads_bit_for_bit(tokens, n_in, n_out, xd, wd):
  """SGD at lr 1 from W = 0 returns -G exactly (G's dtype is no wider than
  W's), so the unfused path's G can be compared bit for bit with the one
  jax.grad gives the kernel (both jitted, as in a step)."""
  x, dy, _, _ = make_case(n_in + n_out, tokens, n_in, n_out,
                          (xd, wd, wd, wd))
  w0 = jnp.zeros((n_in, n_out), wd)
  rule = pk.sgd_rule()
  got_w, _ = jax.jit(functools.partial(pk.unfused_wgrad_update, rule=rule))(
      x, dy, w0, (), rule.pack(lr=1.0))
  g = jax.jit(_dense_kernel_grad)(x, dy, w0)
  assert bool(jnp.any(g != 0))
  np.testing.assert_array_equal(np.asarray(-got_w, np.float32),
                                np.asarray(g.astype(wd), np.float32))


def test_unfused_update_of_one_layer_of_a_stack():
  x, dy, w, (mu, nu) = make_case(5, (21,), 20, 24, DTYPES[0])
  stack = lambda a: jnp.stack([a + 1, a, a - 1])
  h = adamw_hparams()
  got_w, (got_mu, got_nu) = pk.unfused_wgrad_update(
      x, dy, stack(w), (stack(mu), stack(nu)), h, rule=pk.ADAMW, layer=1)
  ref_w, (ref_mu, ref_nu) = pk.unfused_wgrad_update(x, dy, w, (mu, nu), h,
                                                    rule=pk.ADAMW)
  assert_close(got_w[1], ref_w)
  assert_close(got_mu[1], ref_mu)
  assert_close(got_nu[1], ref_nu)
  for i in (0, 2):  # the other layers untouched
    np.testing.assert_array_equal(np.asarray(got_w[i]), np.asarray(stack(w)[i]))
    np.testing.assert_array_equal(np.asarray(got_nu[i]),
                                  np.asarray(stack(nu)[i]))
  with pytest.raises(IndexError, match="out of range"):
    pk.unfused_wgrad_update(x, dy, stack(w), (stack(mu), stack(nu)), h,
                            rule=pk.ADAMW, layer=3)


# --- stored_g_update: the epilogue on a stored G ------------------------------

STORED_RULES = [pk.ADAMW, pk.sgd_rule(momentum=True, nesterov=True),
                pk.lion_rule(), pk.adagrad_rule(), pk.muon_rule()]


def _stored_hparams(rule):
  """The tuner's plausible hyperparameters with lr 3e-2: steps large enough
  that ``new - old`` is not lost to fp32 rounding of ``W``."""
  values = {**autotune._TUNING_HPARAMS, "lr": 3e-2}
  return rule.pack(**{n: values.get(n, 0.5) for n in rule.hparams})


def _stored_case(seed, layers, n_in, n_out, dtypes, rule):
  """A stored fp32-or-bf16 G (one layer) and ``layers`` stacked W and slots
  (``layers=None``: unstacked), random; second moments positive."""
  xd, wd, md, vd = dtypes
  k = jax.random.split(jax.random.key(seed), 2 + len(rule.slots))
  lead = () if layers is None else (layers,)
  g = jax.random.normal(k[0], (n_in, n_out)).astype(xd)
  w = jax.random.normal(k[1], (*lead, n_in, n_out)).astype(wd)
  slots = []
  for i, name in enumerate(rule.slots):
    a = 0.1 * jax.random.normal(k[2 + i], (*lead, n_in, n_out))
    slots.append((jnp.abs(a) if name in ("nu", "sum_of_squares") else a)
                 .astype(md if i == 0 else vd))
  return g, w, tuple(slots)


def _check_stored(rule, g, w, slots, h, layer, config=None, interpret=True,
                  backend=None):
  got_w, got_slots = pk.stored_g_update(g, w, slots, h, rule=rule,
                                        layer=layer, config=config,
                                        interpret=interpret, backend=backend)
  ref_w, ref_slots = apply_rule(rule, g, w, slots, h, layer)
  pick = (lambda a: a) if layer is None else (lambda a: a[layer])
  news = ((got_w, ref_w, w, "w"),) if rule.updates_weight else ()
  news += tuple(zip(got_slots, ref_slots, slots, rule.slots))
  for got, ref, old, what in news:
    assert got.shape == old.shape and got.dtype == old.dtype, what
    if what == "w" and rule.name == "lion" and got.dtype == jnp.bfloat16:
      # Lion steps W by lr * sign(c): where c rounds to ~0, the kernel's and
      # XLA's roundings may take different signs (a step of 2 lr).
      off = np.asarray(pick(got), np.float32) != np.asarray(pick(ref),
                                                            np.float32)
      assert off.mean() <= 1e-3, f"w: {int(off.sum())} of {off.size} differ"
      continue
    assert_close(pick(got), pick(ref), what=what)
    assert_update_close(pick(got), pick(ref), pick(old), what=what)
    assert not np.allclose(np.asarray(pick(got), np.float32),
                           np.asarray(pick(old), np.float32)), what
    if layer is not None:  # the other layers untouched, bit for bit
      for i in range(old.shape[0]):
        if i != layer:
          np.testing.assert_array_equal(np.asarray(got[i], np.float32),
                                        np.asarray(old[i], np.float32))
  if not rule.updates_weight:
    assert got_w is w
  for got, ref in zip(got_slots[len(slots):], ref_slots[len(slots):]):
    assert_close(got, ref, what="output")  # write-only outputs (mu_hat)


@pytest.mark.parametrize("rule", STORED_RULES, ids=lambda r: r.name)
@pytest.mark.parametrize("n_in,n_out,layers,layer", [
    (70, 130, 3, 1), (5, 7, None, None), (33, 17, 2, 0), (64, 160, 4, 3)])
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(
    jnp.dtype(t).name for t in d))
def test_stored_g_update_is_the_rule_on_that_g(rule, n_in, n_out, layers,
                                               layer, dtypes):
  """The fused kernel's epilogue on a stored G (interpret mode) against the
  rule as XLA code on the same G, for five families (one of them regime 2,
  with a write-only output), stacked and not, odd shapes."""
  g, w, slots = _stored_case(n_in + 7 * n_out, layers, n_in, n_out, dtypes,
                             rule)
  _check_stored(rule, g, w, slots, _stored_hparams(rule), layer)


@pytest.mark.parametrize("dtypes", [
    (jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32),  # bf16 G, fp32 W
    (jnp.float16, jnp.float16, jnp.float16, jnp.float16),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16, jnp.float32)],
    ids=["g-bf16-w-f32", "f16", "g-f32-w-bf16"])
def test_stored_g_update_mixed_dtypes(dtypes):
  """G's dtype need not be W's (fp32 parameters computed in bf16 give a
  bf16 G): it is read in fp32 either way."""
  g, w, slots = _stored_case(4, 3, 37, 150, dtypes, pk.ADAMW)
  _check_stored(pk.ADAMW, g, w, slots, adamw_hparams(), 0)


@pytest.mark.parametrize("config", [
    pk.BlockConfig(16, 16, 16, group_in=3),
    pk.BlockConfig(32, 64, 16, split_out=2, stream_state=True),
    pk.BlockConfig(16, 128, 16, split_out=4, prefetch=True)],
    ids=lambda c: tuning_cache.config_label(c))
def test_stored_g_update_tilings_agree(config):
  g, w, slots = _stored_case(3, 3, 70, 130, DTYPES[0], pk.ADAMW)
  _check_stored(pk.ADAMW, g, w, slots, adamw_hparams(), 2, config)


def test_stored_default_tiling_fits_the_problem():
  cfg = pk.BlockConfig.stored_default(4096, 4096)
  assert (cfg.block_in, cfg.block_out, cfg.num_warps) == (32, 128, 4)
  small = pk.BlockConfig.stored_default(5, 7)
  assert (small.block_in, small.block_out) == (16, 16)


@pytest.mark.parametrize("g_shape,w_shape,layer,exc,match", [
    ((20, 25), (3, 20, 24), 1, ValueError, r"g must have the shape of one "
     r"layer of w, \(20, 24\), got \(20, 25\)"),
    ((20, 24), (20, 24), 0, ValueError, r"w must be a stack"),
    ((20, 24), (3, 20, 24), 3, IndexError, "out of range"),
    ((3, 20, 24), (3, 20, 24), 0, ValueError, "g must have the shape"),
    ((20, 24), (24,), None, ValueError, r"w must be 2-D \(in, out\)"),
])
def test_stored_g_update_bad_inputs_fail_clearly(g_shape, w_shape, layer, exc,
                                                 match):
  w = jnp.ones(w_shape)
  with pytest.raises(exc, match=match):
    pk.stored_g_update(jnp.ones(g_shape), w, (w, w), adamw_hparams(),
                       rule=pk.ADAMW, layer=layer, interpret=True)
  with pytest.raises(TypeError, match="g must have a floating dtype"):
    pk.stored_g_update(jnp.ones((20, 24), jnp.int32), jnp.ones((20, 24)),
                       (jnp.ones((20, 24)),) * 2, adamw_hparams(),
                       rule=pk.ADAMW)
  # Nested lists and NumPy arrays are arrays like any other.
  w2 = np.ones((2, 3), np.float32)
  new_w, _ = pk.stored_g_update([[1.0] * 3] * 2, w2, (w2, w2),
                                adamw_hparams(), rule=pk.ADAMW, interpret=True)
  assert new_w.shape == (2, 3)


def test_nesterov_rule_matches_reference():
  rule = pk.adamw_rule(nesterov=True)
  x, dy, w, slots = make_case(1, (37,), 70, 130, DTYPES[0])
  check_against_reference(x, dy, w, slots, adamw_hparams(rule), rule)


@pytest.mark.parametrize("config", [
    pk.BlockConfig(block_in=16, block_out=16, block_bt=16, group_in=3),
    pk.BlockConfig(block_in=32, block_out=64, block_bt=16, group_in=2),
    pk.BlockConfig(block_in=128, block_out=16, block_bt=32),
    pk.BlockConfig(block_in=32, block_out=32, block_bt=16, group_in=2,
                   prefetch=True),
    pk.BlockConfig(block_in=16, block_out=64, block_bt=32, stream_state=True),
    pk.BlockConfig(block_in=32, block_out=64, block_bt=16, group_in=2,
                   split_out=2),
    pk.BlockConfig(block_in=16, block_out=128, block_bt=32, split_out=4,
                   prefetch=True),
])
def test_tilings_and_tile_orders_agree(config):
  # Many tiles, partial tiles on every edge, grouped orders with a ragged
  # last group: each output tile must be visited exactly once.
  x, dy, w, slots = make_case(2, (45,), 70, 130, DTYPES[0])
  check_against_reference(x, dy, w, slots, adamw_hparams(), pk.ADAMW, config)


def make_stacked_case(seed, layers, tokens, n_in, n_out, dtypes):
  cases = [make_case(seed + i, tokens, n_in, n_out, dtypes)
           for i in range(layers)]
  x, dy = cases[1][0], cases[1][1]
  w = jnp.stack([c[2] for c in cases])
  slots = tuple(jnp.stack([c[3][j] for c in cases]) for j in range(2))
  return x, dy, w, slots


@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(
    jnp.dtype(t).name for t in d))
@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("config", [
    None, pk.BlockConfig(32, 64, 16, split_out=4, stream_state=True)],
    ids=["default", "o4"])
def test_stacked_state_updates_one_layer_in_place(dtypes, traced, config):
  x, dy, w, slots = make_stacked_case(20, 3, (37,), 70, 130, dtypes)
  h = adamw_hparams()
  run = lambda layer: pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW,
                                            layer=layer, interpret=True,
                                            config=config)
  got_w, got_slots = (jax.jit(run)(jnp.int32(1)) if traced else run(1))
  ref_w, ref_slots = pk.fused_wgrad_update_reference(
      x, dy, w, slots, h, rule=pk.ADAMW, layer=1)
  assert got_w.shape == w.shape and got_w.dtype == w.dtype
  for got, ref, old, what in ((got_w, ref_w, w, "w"),
                              *zip(got_slots, ref_slots, slots, ("mu", "nu"))):
    assert_close(got[1], ref[1], what=f"{what}[1]")
    # The other layers are untouched, bit for bit.
    for i in (0, 2):
      np.testing.assert_array_equal(np.asarray(got[i], np.float32),
                                    np.asarray(old[i], np.float32))
    assert not np.allclose(np.asarray(got[1], np.float32),
                           np.asarray(old[1], np.float32))
  # The stacked reference equals the unstacked step on that layer.
  one_w, one_slots = pk.fused_wgrad_update_reference(
      x, dy, w[1], tuple(s[1] for s in slots), h, rule=pk.ADAMW)
  assert_close(ref_w[1], one_w, what="reference w[1]")


def test_stacked_zero_tokens_steps_only_that_layer():
  x, dy, w, slots = make_stacked_case(23, 2, (0,), 20, 24, DTYPES[0])
  got_w, _ = pk.fused_wgrad_update(x, dy, w, slots, adamw_hparams(),
                                   rule=pk.ADAMW, layer=0, interpret=True)
  ref_w, _, _ = adamw64(np.zeros(w.shape[1:]), w[0], *(s[0] for s in slots))
  assert_close(got_w[0], ref_w)
  assert not np.allclose(np.asarray(got_w[0]), np.asarray(w[0]))
  np.testing.assert_array_equal(np.asarray(got_w[1]), np.asarray(w[1]))


@pytest.mark.parametrize("layer,shape,exc,match", [
    (3, (3, 20, 24), IndexError, "layer=3 is out of range for 3 layers"),
    (-1, (3, 20, 24), IndexError, "out of range"),
    (0, (20, 24), ValueError, r"w must be a stack \(L, in, out\)"),
    (1.0, (3, 20, 24), TypeError, "layer must be an integer scalar"),
    (jnp.zeros(2, jnp.int32), (3, 20, 24), TypeError, "integer scalar"),
])
def test_stacked_bad_layer_fails_clearly(layer, shape, exc, match):
  x = jnp.ones((5, 20))
  dy = jnp.ones((5, 24))
  w = jnp.ones(shape)
  with pytest.raises(exc, match=match):
    pk.fused_wgrad_update(x, dy, w, (w, w), adamw_hparams(), rule=pk.ADAMW,
                          layer=layer, interpret=True)


def test_kernel_reference_is_independent_of_the_rule_plumbing():
  # Check the reference itself against hand-written AdamW (optax's formula).
  x, dy, w, (mu, nu) = make_case(3, (37,), 70, 130, DTYPES[0])
  g = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
  w_expected, m, v = adamw64(g, w, mu, nu)
  ref_w, (ref_m, ref_v) = pk.fused_wgrad_update_reference(
      x, dy, w, (mu, nu), adamw_hparams(), rule=pk.ADAMW)
  assert_close(ref_w, w_expected, what="w")
  assert_close(ref_m, m, what="mu")
  assert_close(ref_v, v, what="nu")


def test_zero_tokens_still_steps_the_optimizer():
  x, dy, w, slots = make_case(4, (0,), 20, 24, DTYPES[0])
  got_w, got_slots = pk.fused_wgrad_update(x, dy, w, slots, adamw_hparams(),
                                           rule=pk.ADAMW, interpret=True)
  # G = 0: moments decay, the bias-corrected step and weight decay still apply.
  ref_w, ref_m, ref_v = adamw64(np.zeros(w.shape), w, *slots)
  assert_close(got_w, ref_w, what="w")
  assert_close(got_slots[0], ref_m, what="mu")
  assert_close(got_slots[1], ref_v, what="nu")
  assert not np.allclose(np.asarray(got_w), np.asarray(w))


def test_hyperparameters_are_runtime_values():
  x, dy, w, slots = make_case(5, (37,), 70, 130, DTYPES[0])
  traces = []

  @jax.jit
  def step(h):
    traces.append(1)
    return pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW,
                                 interpret=True)

  w1, _ = step(adamw_hparams(lr=1e-2))
  w2, _ = step(adamw_hparams(lr=2e-2))
  assert len(traces) == 1, "a new learning rate must not retrace"
  # w' - w is (up to the decayed part) proportional to lr.
  d1 = np.asarray(w1) - np.asarray(w)
  d2 = np.asarray(w2) - np.asarray(w)
  # The differences carry the rounding of the stored fp32 w, whose size is
  # w's, not the update's: the table's fp32 bound, relative to ||w||.
  bound = tol(jnp.float32) * np.linalg.norm(np.asarray(w)) / np.linalg.norm(d1)
  assert_close(d2, 2 * d1, bound, what="w' - w at twice the lr")


def test_eager_calls_compile_once_per_case(caplog):
  """Called outside jit, the kernels compile at their first call and not
  again: neither for the same call nor for a new learning rate."""
  x, dy, w, slots = make_case(6, (12,), 24, 40, DTYPES[0])
  g = jnp.asarray(x).T @ jnp.asarray(dy)
  calls = (
      lambda h: pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW,
                                      interpret=True),
      lambda h: pk.stored_g_update(g, w, slots, h, rule=pk.ADAMW,
                                   interpret=True),
      lambda h: pk.wgrad_sqnorm(x, dy, interpret=True))
  first, second = adamw_hparams(lr=1e-2), adamw_hparams(lr=2e-2)
  for call in calls:
    jax.block_until_ready(call(first))
  with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles(True):
    for call in calls:
      jax.block_until_ready(call(first))
      jax.block_until_ready(call(second))
  compiled = [r.getMessage()[:80] for r in caplog.records
              if r.getMessage().startswith("Compiling")]
  assert not compiled, compiled


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_in=48), "block_in=48 must be a power of two >= 16"),
    (dict(block_out=8), "block_out=8 must be a power of two >= 16"),
    (dict(block_bt=0), "block_bt=0"),
    (dict(num_warps=3), "num_warps=3"),
    (dict(num_stages=0), "num_stages=0"),
    (dict(group_in=0), "group_in=0"),
    (dict(prefetch=1), "prefetch=1 must be a bool"),
    (dict(stream_state="yes"), "stream_state='yes' must be a bool"),
    (dict(split_out=3), "split_out=3 must be a power of two"),
    (dict(block_out=32, split_out=4), "sub-tiles of >= 16 columns"),
    (dict(block_in=np.int64(64)), "block_in=np.int64\\(64\\) must be a "
     "Python int .* got int64"),
])
def test_invalid_block_configs_fail_clearly(kwargs, match):
  with pytest.raises(ValueError, match=match):
    pk.BlockConfig(**kwargs)


@pytest.mark.parametrize("config", ["64x128x64", {"block_in": 64},
                                    (64, 128, 64)])
def test_a_config_that_is_not_a_block_config_is_refused(config):
  x, dy, w = jnp.ones((8, 16)), jnp.ones((8, 16)), jnp.ones((16, 16))
  with pytest.raises(TypeError, match=r"fused_wgrad_update\(config=\.\.\.\): "
                     "config must be a pallas_kernels.BlockConfig"):
    pk.fused_wgrad_update(x, dy, w, (jnp.zeros((16, 16)),) * 2,
                          jnp.zeros(pk.HPARAM_VECTOR_LEN), rule=pk.ADAMW,
                          config=config, interpret=True)


def test_fit_shrinks_blocks_and_split_out_to_the_problem():
  cfg = pk.BlockConfig(128, 256, 64, 8, 8, 3, stream_state=True, split_out=4)
  assert cfg.fit(4096, 4096, 4096) == cfg  # big enough: unchanged
  small = cfg.fit(bt=5, n_in=20, n_out=20)
  assert (small.block_in, small.block_out, small.block_bt,
          small.split_out) == (32, 32, 16, 2)
  assert (small.group_in, small.num_warps, small.stream_state) == (8, 8, True)


def test_default_config_fits_small_shapes():
  cfg = pk.BlockConfig.default(bt=3, n_in=5, n_out=1000)
  assert (cfg.block_in, cfg.block_out, cfg.block_bt) == (16, 128, 16)


@pytest.mark.parametrize("bt", [3, 512, 2048, 8192])
@pytest.mark.parametrize("n_in,n_out", [(5, 17), (16, 40), (4096, 4096),
                                        (700, 33)])
def test_compiled_default_is_valid_and_shrinks_to_fit(bt, n_in, n_out):
  cfg = pk.BlockConfig.compiled_default(bt, n_in, n_out, jnp.bfloat16)
  assert cfg.block_in <= max(16, 2 * n_in) and cfg.block_out <= max(
      16, 2 * n_out) and cfg.block_bt <= max(16, 2 * bt)
  assert cfg.block_out // cfg.split_out >= 16
  assert cfg.split_out > 1 or cfg.block_out < 64
  # fp32 weights keep the plain heuristic
  assert pk.BlockConfig.compiled_default(
      bt, n_in, n_out, jnp.float32) == pk.BlockConfig.default(bt, n_in, n_out)


@pytest.mark.parametrize("bt", [40, 2048])
def test_compiled_default_tilings_match_reference_in_interpret_mode(bt):
  x, dy, w, slots = make_case(12, (bt,), 70, 130, DTYPES[1])
  cfg = pk.BlockConfig.compiled_default(bt, 70, 130, jnp.bfloat16)
  check_against_reference(x, dy, w, slots, adamw_hparams(), pk.ADAMW, cfg)


def _bad_inputs():
  x, dy, w, slots = make_case(6, (8,), 16, 32, DTYPES[0])
  h = adamw_hparams()
  return [
      ((x[:, :15], dy, w, slots, h), ValueError, "x's last dimension 15"),
      ((x, dy[:, :31], w, slots, h), ValueError, "dy's last dimension 31"),
      ((x[:7], dy, w, slots, h), ValueError, "share leading"),
      ((x, dy, w[None], slots, h), ValueError, "w must be 2-D"),
      ((x, dy, w.astype(jnp.int32), slots, h), TypeError, "w must have a floating"),
      ((x.astype(jnp.int8), dy, w, slots, h), TypeError, "x must have a floating"),
      ((x, dy, w, slots[:1], h), ValueError, "needs slots"),
      ((x, dy, w, (slots[0], slots[1][:, :3]), h), ValueError, "slot 'nu' has shape"),
      ((x, dy, w, slots, h[:11]), ValueError, "rule.pack"),
      ((x, dy, w, slots, h.astype(jnp.bfloat16)), ValueError, "float32 vector"),
  ]


@pytest.mark.parametrize("case", range(10))
def test_bad_inputs_fail_clearly(case):
  args, exc, match = _bad_inputs()[case]
  with pytest.raises(exc, match=match):
    pk.fused_wgrad_update(*args, rule=pk.ADAMW, interpret=True)
  with pytest.raises(exc, match=match):
    pk.fused_wgrad_update_reference(*args, rule=pk.ADAMW)


def test_pack_names_missing_and_unexpected_hyperparameters():
  with pytest.raises(ValueError, match=r"missing \['bc1_next'\].*unexpected \['beta'\]"):
    pk.ADAMW.pack(lr=1, b1=1, b2=1, one_minus_b1=1, one_minus_b2=1, eps=1,
                  eps_root=1, weight_decay=1, bc1=1, bc2=1, beta=2)


@pytest.mark.parametrize("bad", [None, "1e-8", 1j, np.array([1j]),
                                 object()])
def test_pack_refuses_a_value_that_is_not_a_real_number_naming_it(bad):
  """A string, None, a complex or an object for a hyperparameter: refused
  naming the rule and the hyperparameter (a string was packed as its
  number; the rest failed inside JAX without either name)."""
  base = {n: 0.5 for n in pk.ADAMW.hparams}
  with pytest.raises(TypeError, match="rule 'adamw': hyperparameter 'eps'"):
    pk.ADAMW.pack(**dict(base, eps=bad))
  with pytest.raises(TypeError, match="static setting 'round_mu'"):
    pk.ADAMW.with_static(round_mu="yes")


def test_pack_and_with_static_take_any_real_number():
  """Fractions, Decimals, NumPy and JAX scalars pack as their value; a
  static setting takes NumPy and JAX scalars (and True as 1.0)."""
  from decimal import Decimal
  from fractions import Fraction
  base = {n: 0.5 for n in pk.ADAMW.hparams}
  i = pk.ADAMW.hparams.index("eps")
  for v, want in ((Fraction(1, 4), 0.25), (Decimal("0.5"), 0.5),
                  (np.float32(2), 2.0), (jnp.float32(3), 3.0)):
    assert float(pk.ADAMW.pack(**dict(base, eps=v))[i]) == want
  for v in (np.float32(1), np.int64(1), jnp.float32(1), True):
    assert dict(pk.ADAMW.with_static(round_mu=v).static)["round_mu"] == 1.0
  for v in (np.complex64(1 + 2j), 1j, "1"):  # (an imaginary part dropped)
    with pytest.raises(TypeError, match="static setting 'round_mu'"):
      pk.ADAMW.with_static(round_mu=v)
  with pytest.raises(TypeError, match="hyperparameter 'eps'"):
    pk.ADAMW.pack(**dict(base, eps=[np.complex64(1 + 2j)]))
  # A traced value packs (its dtype read, not its value).
  traced = jax.jit(lambda e: pk.ADAMW.pack(**dict(base, eps=e)))(
      jnp.float32(0.25))
  assert float(traced[i]) == 0.25


def test_pack_fills_defaults_taken_from_other_defaults():
  """``defaults`` (a <- b <- lr): a left-out name takes its source's value
  also where the source is itself a default, whatever their order."""
  rule = pk.UpdateRule(name="chained", slots=(), hparams=("lr", "a", "b"),
                       update=lambda g, w, slots, h: (w - h["lr"] * g,),
                       defaults=(("a", "b"), ("b", "lr")))
  assert rule.pack(lr=3.0)[:3].tolist() == [3.0, 3.0, 3.0]
  assert rule.pack(lr=3.0, b=2.0)[:3].tolist() == [3.0, 2.0, 2.0]


@pytest.mark.parametrize("name", ["__stored__", "__round_by_convert__"])
def test_a_rule_may_not_name_a_hyperparameter_as_unpacks_own_keys(name):
  """unpack() puts the slots' dtypes and the rounding mode under reserved
  names, over a hyperparameter of that name (a rule reading it got False:
  no update at all)."""
  with pytest.raises(ValueError, match="reserved"):
    pk.UpdateRule(name="bad", slots=(), hparams=("lr", name),
                  update=lambda g, w, slots, h: (w - h["lr"] * g,))


@pytest.mark.parametrize("dtypes", DTYPES[:2], ids=["f32", "bf16"])
def test_lowers_for_cuda_without_a_gpu(dtypes):
  """Deviceless AOT lowering catches Triton lowering errors on the CPU."""
  xd, wd, md, vd = dtypes
  specs = [((37, 70), xd), ((37, 130), xd), ((70, 130), wd), ((70, 130), md),
           ((70, 130), vd), ((pk.HPARAM_VECTOR_LEN,), jnp.float32)]
  args = [jax.ShapeDtypeStruct(s, d) for s, d in specs]

  def step(x, dy, w, mu, nu, h):
    return pk.fused_wgrad_update(x, dy, w, (mu, nu), h, rule=pk.ADAMW,
                                 interpret=False)

  text = lower_for_cuda(step, *args, donate_argnums=(2, 3, 4))
  assert len(triton_calls(text)) == 1, "expected exactly one Triton kernel"
  # W, mu and nu are written in place: three operand/output aliases.
  assert text.count("output_operand_alias") >= 3 or text.count(
      "operand_index") >= 3
  # The donated W/mu/nu parameters alias the outputs (no fresh buffers).
  assert text.count("tf.aliasing_output") == 3


# --- GPU ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,n_in,n_out", SHAPES + [
    ((512,), 1024, 768), ((2048,), 520, 390), ((2100,), 16, 40)])
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(
    jnp.dtype(t).name for t in d))
def test_compiled_kernel_matches_reference_on_gpu(tokens, n_in, n_out, dtypes):
  x, dy, w, slots = make_case(n_in + n_out, tokens, n_in, n_out, dtypes)
  check_against_reference(x, dy, w, slots, adamw_hparams(), pk.ADAMW,
                          interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    pk.BlockConfig(64, 128, 64, prefetch=True),
    pk.BlockConfig(128, 128, 64, 1, 8, 3, prefetch=True),
    pk.BlockConfig(128, 256, 64, 1, 8, 3, prefetch=True),
    pk.BlockConfig(64, 128, 64, stream_state=True),
    pk.BlockConfig(128, 128, 64, 8, 8, 3, prefetch=True, stream_state=True),
    pk.BlockConfig(64, 128, 32, 1, 4, 4, stream_state=True, split_out=2),
    pk.BlockConfig(128, 256, 64, 8, 8, 3, stream_state=True, split_out=4),
], ids=lambda c: tuning_cache.config_label(c))
@pytest.mark.parametrize("dtypes", DTYPES[:2], ids=["f32", "bf16"])
def test_compiled_knob_tilings_match_reference_on_gpu(config, dtypes):
  x, dy, w, slots = make_case(11, (300,), 520, 390, dtypes)
  check_against_reference(x, dy, w, slots, adamw_hparams(), pk.ADAMW,
                          config, interpret=False)


@pytest.mark.gpu
def test_compiled_stacked_kernel_updates_the_stack_in_place_on_gpu():
  x, dy, w, slots = make_stacked_case(30, 4, (256,), 512, 384, DTYPES[1])
  h = adamw_hparams()
  ref_w, ref_slots = pk.fused_wgrad_update_reference(
      x, dy, w, slots, h, rule=pk.ADAMW, layer=2)
  ptrs = [a.unsafe_buffer_pointer() for a in (w, *slots)]
  step = jax.jit(functools.partial(pk.fused_wgrad_update, rule=pk.ADAMW),
                 donate_argnums=(2, 3))
  new_w, new_slots = step(x, dy, w, slots, h, layer=jnp.int32(2))
  assert [a.unsafe_buffer_pointer() for a in (new_w, *new_slots)] == ptrs
  assert_close(new_w, ref_w, what="w stack")
  for got, ref in zip(new_slots, ref_slots):
    assert_close(got, ref, what="slot stack")


@pytest.mark.gpu
@pytest.mark.parametrize("rule", STORED_RULES[:3], ids=lambda r: r.name)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(
    jnp.dtype(t).name for t in d))
def test_compiled_stored_g_update_matches_the_rule_on_gpu(rule, dtypes):
  """Compiled: the default tiling (32x128) and a split one, on a ragged
  stacked case and on an unstacked one."""
  h = _stored_hparams(rule)
  g, w, slots = _stored_case(5, 3, 300, 390, dtypes, rule)
  _check_stored(rule, g, w, slots, h, 1, interpret=False)
  _check_stored(rule, g, w, slots, h, 2, interpret=False,
                config=pk.BlockConfig(64, 128, 16, split_out=2,
                                      stream_state=True))
  g, w, slots = _stored_case(6, None, 1024, 768, dtypes, rule)
  _check_stored(rule, g, w, slots, h, None, interpret=False)


@pytest.mark.gpu
def test_compiled_stored_g_update_updates_the_stack_in_place_on_gpu():
  g, w, slots = _stored_case(8, 4, 512, 384, DTYPES[1], pk.ADAMW)
  h = adamw_hparams()
  ref_w, ref_slots = apply_rule(pk.ADAMW, g, w, slots, h, 2)
  ptrs = [a.unsafe_buffer_pointer() for a in (w, *slots)]
  step = jax.jit(functools.partial(pk.stored_g_update, rule=pk.ADAMW),
                 donate_argnums=(1, 2))
  new_w, new_slots = step(g, w, slots, h, layer=jnp.int32(2))
  assert [a.unsafe_buffer_pointer() for a in (new_w, *new_slots)] == ptrs
  assert_close(new_w, ref_w, what="w stack")
  for got, ref in zip(new_slots, ref_slots):
    assert_close(got, ref, what="slot stack")


def _ragged_stacked_step(x, dy, w, h, mu, nu, layer):
  return pk.fused_wgrad_update(x, dy, w, (mu, nu), h, rule=pk.ADAMW,
                               layer=layer, interpret=False)


def test_ragged_stacked_kernel_lowers_for_cuda_without_a_gpu():
  """The stacked (layer=i) kernel on shapes no tile divides: its edge masks
  go through Triton's lowering (the GPU test below runs it)."""
  S = jax.ShapeDtypeStruct
  b16 = jnp.bfloat16
  text = lower_for_cuda(
      _ragged_stacked_step, S((300, 70), b16), S((300, 130), b16),
      S((3, 70, 130), b16), S((pk.HPARAM_VECTOR_LEN,), jnp.float32),
      S((3, 70, 130), b16), S((3, 70, 130), b16), S((), jnp.int32))
  assert len(triton_calls(text)) == 1


def test_static_layer_index_lowers_for_cuda_without_a_gpu():
  """A Python-int ``layer`` under an explicit-sharding mesh (the deviceless
  lowering's): its range check must not need a concrete jnp array."""
  S = jax.ShapeDtypeStruct
  b16 = jnp.bfloat16

  def step(x, dy, w, h, mu, nu):
    return _ragged_stacked_step(x, dy, w, h, mu, nu, 1)

  text = lower_for_cuda(
      step, S((300, 70), b16), S((300, 130), b16), S((3, 70, 130), b16),
      S((pk.HPARAM_VECTOR_LEN,), jnp.float32), S((3, 70, 130), b16),
      S((3, 70, 130), b16))
  assert len(triton_calls(text)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", DTYPES[:2], ids=["f32", "bf16"])
def test_compiled_ragged_stacked_kernel_matches_reference_on_gpu(dtypes):
  x, dy, w, slots = make_stacked_case(31, 3, (300,), 70, 130, dtypes)
  h = adamw_hparams()
  ref_w, ref_slots = pk.fused_wgrad_update_reference(
      x, dy, w, slots, h, rule=pk.ADAMW, layer=1)
  new_w, new_slots = jax.jit(_ragged_stacked_step)(
      x, dy, w, h, *slots, jnp.int32(1))
  assert_close(new_w, ref_w, what="w stack")
  assert_update_close(new_w[1], ref_w[1], w[1], what="w[1]")
  for got, ref, old in zip(new_slots, ref_slots, slots):
    assert_close(got, ref, what="slot stack")
    assert_update_close(got[1], ref[1], old[1], what="slot[1]")
  for i in (0, 2):  # the other layers untouched
    np.testing.assert_array_equal(np.asarray(new_w[i]), np.asarray(w[i]))


@pytest.mark.gpu
def test_compiled_kernel_updates_in_place_on_gpu():
  x, dy, w, slots = make_case(7, (256,), 512, 384, DTYPES[1])
  ptrs = [a.unsafe_buffer_pointer() for a in (w, *slots)]
  step = jax.jit(functools.partial(pk.fused_wgrad_update, rule=pk.ADAMW),
                 donate_argnums=(2, 3))
  new_w, new_slots = step(x, dy, w, slots, adamw_hparams())
  assert [a.unsafe_buffer_pointer() for a in (new_w, *new_slots)] == ptrs


# --- inputs a user may plausibly pass -----------------------------------------


@pytest.mark.parametrize("xd,dyd,wd", [
    (jnp.bfloat16, jnp.float32, jnp.float32),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16),
    (jnp.float16, jnp.bfloat16, jnp.bfloat16),
], ids=["bf16x-f32dy", "f32x-bf16dy", "f16x-bf16dy"])
def test_mixed_x_dy_dtypes_are_promoted_on_both_paths(xd, dyd, wd):
  """x and dy of different float dtypes: promoted to their common dtype (as
  jnp.dot does) before the kernel, so the compiled kernel lowers (its dot
  needs one operand dtype) and interpret mode matches the promoted reference."""
  x, dy, w, slots = make_case(7, (37,), 70, 130, (jnp.float32, jnp.float32,
                                                  wd, wd))
  x, dy = x.astype(xd), dy.astype(dyd)
  h = adamw_hparams()
  common = jnp.result_type(x, dy)
  ref_w, ref_s = pk.fused_wgrad_update_reference(
      x.astype(common), dy.astype(common), w, slots, h, rule=pk.ADAMW)
  got_w, got_s = pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW,
                                       interpret=True)
  assert_close(got_w, ref_w, what="w")
  for g, r in zip(got_s, ref_s):
    assert_close(g, r, what="slot")

  def step(x, dy, w, h, mu, nu):
    return pk.fused_wgrad_update(x, dy, w, (mu, nu), h, rule=pk.ADAMW,
                                 interpret=False)

  S = jax.ShapeDtypeStruct
  text = lower_for_cuda(step, S(x.shape, xd), S(dy.shape, dyd),
                        S(w.shape, wd), S((pk.HPARAM_VECTOR_LEN,), jnp.float32),
                        S(w.shape, wd), S(w.shape, wd))
  assert len(triton_calls(text)) == 1


def test_numpy_float64_state_is_canonicalised_without_x64():
  """NumPy float64 state with x64 off: JAX's float32, as everywhere in JAX."""
  x, dy, w, (mu, nu) = make_case(1, (21,), 19, 23, (jnp.float32,) * 4)
  h = adamw_hparams()
  ref_w, ref_s = pk.fused_wgrad_update_reference(x, dy, w, (mu, nu), h,
                                                 rule=pk.ADAMW)
  got_w, got_s = pk.fused_wgrad_update(
      x, dy, np.asarray(w, np.float64), (np.asarray(mu, np.float64), nu), h,
      rule=pk.ADAMW, interpret=True)
  assert got_w.dtype == jnp.float32 and got_s[0].dtype == jnp.float32
  assert_close(got_w, ref_w, what="w")
  for g, r in zip(got_s, ref_s):
    assert_close(g, r, what="slot")


@pytest.mark.parametrize("which", ["x", "w", "slot"])
def test_float64_is_refused_clearly_with_x64(which):
  with jax.enable_x64(True):
    x, dy = jnp.ones((5, 20)), jnp.ones((5, 24))
    w = jnp.ones((20, 24))
    mu, nu = jnp.zeros_like(w), jnp.zeros_like(w)
    arrays = dict(x=x, w=w, slot=mu)
    arrays[which] = arrays[which].astype(jnp.float64)
    with pytest.raises(TypeError, match="float64"):
      pk.fused_wgrad_update(arrays["x"], dy, arrays["w"], (arrays["slot"], nu),
                            adamw_hparams(), rule=pk.ADAMW, interpret=True)


@pytest.mark.parametrize("layer", [jnp.int32(3), jnp.int32(-1), np.array(3),
                                   np.array(-1), np.int64(-1)],
                         ids=["jnp3", "jnp-1", "np0d3", "np0d-1", "np-1"])
def test_concrete_out_of_range_layer_raises(layer):
  """Only a traced index is clamped; a concrete one out of range would update
  a different layer than asked, so it raises like a Python int does."""
  x, dy = jnp.ones((5, 20)), jnp.ones((5, 24))
  w = jnp.ones((3, 20, 24))
  with pytest.raises(IndexError, match="out of range"):
    pk.fused_wgrad_update(x, dy, w, (w, w), adamw_hparams(), rule=pk.ADAMW,
                          layer=layer, interpret=True)


@pytest.mark.gpu
def test_compiled_kernel_promotes_mixed_x_dy_on_gpu():
  x, dy, w, slots = make_case(5, (300,), 520, 390, (jnp.float32,) * 4)
  x = x.astype(jnp.bfloat16)  # bf16 activations, fp32 output gradient
  h = adamw_hparams()
  ref_w, ref_s = pk.fused_wgrad_update_reference(
      x.astype(jnp.float32), dy, w, slots, h, rule=pk.ADAMW)
  got_w, got_s = jax.jit(functools.partial(
      pk.fused_wgrad_update, rule=pk.ADAMW, interpret=False))(
          x, dy, w, slots, h)
  assert_close(got_w, ref_w, what="w")
  for g, r in zip(got_s, ref_s):
    assert_close(g, r, what="slot")


def test_a_stored_moment_decay_defaults_to_the_decay_itself():
  """`b1_m` (b1 as it multiplies the stored mu: forge_jax rounds it to a bf16
  mu's dtype, as optax's weakly typed `b1 * mu` does) may be left out of
  pack(): it is then b1, as for every fp32 moment."""
  base = dict(lr=1e-3, b1=0.9, b2=0.999, one_minus_b1=0.1, one_minus_b2=1e-3,
              eps=1e-8, eps_root=0.0, weight_decay=0.0, bc1=0.1, bc2=1e-3,
              bc1_next=0.19)
  h = pk.ADAMW.unpack(pk.ADAMW.pack(**base))
  assert float(h["b1_m"]) == float(h["b1"]) == np.float32(0.9)
  h = pk.ADAMW.unpack(pk.ADAMW.pack(**base, b1_m=0.8984375))
  assert float(h["b1_m"]) == 0.8984375 and float(h["b1"]) == np.float32(0.9)
  with pytest.raises(ValueError, match="default 'x_m' <- 'x'"):
    pk.UpdateRule(name="bad", slots=("m",), hparams=("lr",),
                  update=lambda g, w, s, h: (w, s), defaults=(("x_m", "x"),))


def _kernel_body(rule, dtype=jnp.bfloat16):
  """The jaxpr text of the compiled (not interpreted) kernel's body for
  ``rule`` with ``dtype`` weight and slots, traced without a GPU."""
  a = lambda *shape, d=dtype: jax.ShapeDtypeStruct(shape, d)
  f = functools.partial(pk.fused_wgrad_update, rule=rule, interpret=False,
                        config=pk.BlockConfig(block_in=64, block_out=64,
                                              block_bt=32))
  jaxpr = jax.make_jaxpr(f)(a(96, 64), a(96, 64), a(64, 64),
                            tuple(a(64, 64) for _ in rule.slots),
                            a(pk.HPARAM_VECTOR_LEN, d=jnp.float32))
  (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
  return f"name={call.params['name']}\n{call.params['jaxpr']}"


@pytest.mark.parametrize("n_in,n_out,masked", [
    (64, 64, False), (70, 130, True), (64, 130, True), (70, 64, True)])
def test_state_stores_are_masked_exactly_along_ragged_edges(n_in, n_out,
                                                            masked):
  """The compiled kernel's W/m/v stores carry a mask when a tile overhangs
  the array, and none when the tiles divide it (an unmasked store can be
  vectorised). Interpret mode absorbs out-of-bounds writes, so the CPU
  parity tests cannot see a missing store mask: this reads the kernel body
  traced for the GPU instead."""
  a = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  f = functools.partial(pk.fused_wgrad_update, rule=pk.ADAMW, interpret=False,
                        config=pk.BlockConfig(block_in=64, block_out=64,
                                              block_bt=32))
  jaxpr = jax.make_jaxpr(f)(a(96, n_in), a(96, n_out), a(n_in, n_out),
                            (a(n_in, n_out), a(n_in, n_out)),
                            a(pk.HPARAM_VECTOR_LEN))
  (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
  body = str(call.params["jaxpr"]).splitlines()
  # A store is a swap whose old value is dropped: `_:f32[64,64], ref[..] <-`.
  stores = [l for l in body if re.match(r"\s*_:f32\[64,64\], \w+\[.*<-", l)]
  assert len(stores) == 3, stores  # W, m, v
  assert all((" mask=" in l) == masked for l in stores), stores
  state_loads = [l for l in body if re.match(r"\s*\w+:f32\[64,64\] <-", l)]
  assert len(state_loads) == 3, state_loads
  assert all((" mask=" in l) == masked for l in state_loads), state_loads


def test_rounding_flags_are_static_and_a_zero_flag_emits_no_code():
  """The flags that round `decay * stored moment` (round_mu, ...) decide the
  kernel's code, so they are static settings of the rule, never packed: a
  0 flag (every rule's default; bf16 moments that follow the parameters)
  emits no rounding at all, a 1 flag one convert pair per product (a
  runtime flag slowed the kernel: docs/perf_notes.md)."""
  rounds = pk.ADAMW.with_static(round_mu=1.0)
  assert dict(pk.ADAMW.static) == {"round_mu": 0.0}
  assert dict(rounds.static) == {"round_mu": 1.0}
  assert rounds.hparams == pk.ADAMW.hparams and "round_mu" not in rounds.hparams
  to_bf16 = "new_dtype=bfloat16"
  plain, rounded = _kernel_body(pk.ADAMW), _kernel_body(rounds)
  assert rounded.count(to_bf16) == plain.count(to_bf16) + 1
  # The kernel's name says which code it is (profiles tell them apart).
  assert plain.startswith("name=fused_wgrad_adamw\n")
  assert rounded.startswith("name=fused_wgrad_adamw_round_mu\n")
  # fp32 moments have nothing to round, whatever the flag.
  body = lambda text: text.split("\n", 1)[1]
  assert body(_kernel_body(rounds, jnp.float32)) == body(
      _kernel_body(pk.ADAMW, jnp.float32))
  lion = pk.lion_rule().with_static(round_b1=1.0, round_b2=1.0)
  assert (_kernel_body(lion).count(to_bf16)
          == _kernel_body(pk.lion_rule()).count(to_bf16) + 2)
  # The accumulating wrappers keep the wrapped rule's settings.
  assert rules.accumulating(rounds).static == rounds.static
  sgd = pk.sgd_rule(momentum=True).with_static(round_trace=1.0)
  assert rules.momentum_accumulating(sgd, "decay").static == sgd.static


def test_static_settings_are_refused_where_they_do_not_belong():
  base = dict(lr=1e-3, b1=0.9, b2=0.999, one_minus_b1=0.1, one_minus_b2=1e-3,
              eps=1e-8, eps_root=0.0, weight_decay=0.0, bc1=0.1, bc2=1e-3,
              bc1_next=0.19)
  with pytest.raises(ValueError, match=r"\['round_mu'\] are static settings"):
    pk.ADAMW.pack(**base, round_mu=1.0)
  with pytest.raises(ValueError, match="static settings"):  # traced: refused
    jax.jit(lambda f: pk.ADAMW.pack(**base, round_mu=f))(0.0)
  # unpack() -> pack() round-trips: the rule's own static value is accepted.
  vec = pk.ADAMW.pack(**base)
  np.testing.assert_array_equal(pk.ADAMW.pack(**pk.ADAMW.unpack(vec)), vec)
  with pytest.raises(ValueError, match="no static settings \\['round_nu'\\]"):
    pk.ADAMW.with_static(round_nu=1.0)
  with pytest.raises(ValueError, match="no static settings"):
    pk.adamax_rule().with_static(round_mu=1.0)
  with pytest.raises(ValueError, match="also a hyperparameter"):
    pk.UpdateRule(name="bad", slots=("m",), hparams=("lr", "f"),
                  update=lambda g, w, s, h: (w, s), static=(("f", 0.0),))
  with pytest.raises(TypeError, match="Python number"):
    pk.UpdateRule(name="bad", slots=("m",), hparams=("lr",),
                  update=lambda g, w, s, h: (w, s),
                  static=(("f", jnp.float32(1)),))
  h = pk.ADAMW.with_static(round_mu=1.0).unpack(pk.ADAMW.pack(**base))
  assert h["round_mu"] == 1.0 and isinstance(h["round_mu"], float)


def test_a_rule_is_checked_where_it_is_made_and_where_it_runs():
  """Its names: tuples of distinct strings (a string is not a tuple of
  slot names). Its update's result, in the kernel and in the reference: one
  array of the tile's shape per slot and output. A factory returns one
  rule per variant (a new rule would be a new kernel build), and
  describe_backend checks stochastic_rounding as the call does."""
  update = lambda g, w, s, h: (w - h["lr"] * g, s)
  with pytest.raises(TypeError, match="slots must be a tuple of names"):
    pk.UpdateRule(name="bad", slots="mu", hparams=("lr",), update=update)
  with pytest.raises(TypeError, match="hparams must be a tuple of names"):
    pk.UpdateRule(name="bad", slots=("mu",), hparams="lr", update=update)
  with pytest.raises(ValueError, match=r"\['mu'\] are used more than once"):
    pk.UpdateRule(name="bad", slots=("mu",), hparams=("lr", "mu"),
                  update=update)
  F32 = (jnp.float32,) * 4
  x, dy, w, (mu, nu) = make_case(0, (5,), 9, 7, F32)
  for result, match in (
      (lambda g, w, s, h: (w - h["lr"] * g, s[:1]), "returned 1 arrays"),
      (lambda g, w, s, h: (w, (s[0], s[1], g)), "returned 3 arrays"),
      (lambda g, w, s, h: (w, (s[0], jnp.float32(0))),
       r"returned 'nu' of shape \(\) for a tile"),
  ):
    rule = pk.UpdateRule(name="custom", slots=("mu", "nu"), hparams=("lr",),
                         update=result)
    h = rule.pack(lr=0.1)
    kernel = functools.partial(pk.fused_wgrad_update, interpret=True)
    for fn in (kernel, pk.fused_wgrad_update_reference):
      with pytest.raises(ValueError, match=match):
        fn(x, dy, w, (mu, nu), h, rule=rule)
  assert pk.adamw_rule() is pk.adamw_rule() is pk.ADAMW
  assert pk.sgd_rule(True) is pk.sgd_rule(momentum=1)
  assert pk.sgd_rule() is not pk.sgd_rule(momentum=True)
  # Nesterov without momentum is plain SGD (as in optax): the same object.
  assert pk.sgd_rule(nesterov=True) is pk.sgd_rule()
  assert pk.sgd_rule(False, 1) is pk.sgd_rule()
  assert pk.rmsprop_rule(nesterov=True) is pk.rmsprop_rule()  # (alike)
  assert (pk.rmsprop_rule(centered=True, nesterov=True)
          is pk.rmsprop_rule(centered=True))
  for bad in (False, 0, "no"):
    with pytest.raises(TypeError, match="stochastic_rounding must be"):
      pk.describe_backend(x, dy, w.astype(jnp.bfloat16), (mu, nu),
                          rule=pk.ADAMW, stochastic_rounding=bad)


# --- interpret mode without a GPU ---------------------------------------------


def test_interpret_mode_without_a_gpu_warns_once(monkeypatch):
  """The first kernel run in interpret mode because no GPU was found warns
  (InterpretModeWarning), once per process; an explicit interpret=True does
  not. interpret= takes True, False or None, not a value's truth."""
  import warnings

  import pallas_kernels.fused_wgrad as fw
  from pallas_kernels import interpret
  monkeypatch.setattr(interpret, "_warned", False)
  monkeypatch.setattr(fw, "default_interpret", lambda: True)  # "no GPU"
  x, dy, w, slots = make_case(0, (8,), 16, 16, (jnp.float32,) * 4)
  h = adamw_hparams()
  g = jnp.ones((16, 16), jnp.float32)

  def interpret_warnings(**kw):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW, **kw)
      pk.stored_g_update(g, w, slots, h, rule=pk.ADAMW, **kw)
    return [c for c in caught
            if issubclass(c.category, pk.InterpretModeWarning)]

  assert interpret_warnings(interpret=True) == []
  (first,) = interpret_warnings()
  assert "interpret mode" in str(first.message)
  assert issubclass(pk.InterpretModeWarning, UserWarning)
  assert interpret_warnings() == []  # once per process
  for bad in ("false", 0, 1.0):
    for call in (lambda: pk.fused_wgrad_update(x, dy, w, slots, h,
                                               rule=pk.ADAMW, interpret=bad),
                 lambda: pk.stored_g_update(g, w, slots, h, rule=pk.ADAMW,
                                            interpret=bad),
                 lambda: pk.wgrad_sqnorm(x, dy, interpret=bad),
                 lambda: pk.describe_backend(x, dy, w, slots, rule=pk.ADAMW,
                                             interpret=bad)):
      with pytest.raises(TypeError, match="takes True, False or None"):
        call()
