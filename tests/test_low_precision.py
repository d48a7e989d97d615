"""Low-precision optimizer state: quantized (int8 / fp8) moments and
stochastic-rounded bf16 weights, in the Triton kernel's epilogue
(pallas_kernels.lowp), int8 moments in the Mosaic GPU kernel's, and in
forge_jax (forge_jax.low_precision).

The kernel runs in Pallas interpret mode and is compared with the pure-jnp
reference (pallas_kernels.quant's quantizer) bit for bit: the inputs are
small integers and multiples of 1/16, so that G = x^T dy is exact in fp32
whatever the summation order, and both sides are jitted, so that XLA
compiles their fp32 update alike."""
import dataclasses
import os
import pickle
import subprocess
import sys
import types
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

import forge_jax
import pallas_kernels as pk
from forge_jax import low_precision
from pallas_kernels import lowp, quant, torch_rules
from pallas_kernels.quant import MomentFormat, Quantized
from pallas_kernels.rules import pack_host
from tests.harness import lower_for_cuda, triton_calls
from tests.tolerances import RAGGED_SCALE_RTOL, SR_MEAN_ATOL, tol

# Every hyperparameter name the rules below read (each takes its own).
T = 3
VALUES = dict(
    lr=3e-2, b1=0.9, b2=0.999, one_minus_b1=0.1, one_minus_b2=0.001,
    eps=1e-8, eps_root=0.0, weight_decay=1e-2, bc1=1 - 0.9**T,
    bc2=1 - 0.999**T, bc1_next=1 - 0.9**(T + 1), b1_m=0.9,
    grad_sign=1.0, decay=1 - 3e-2 * 1e-2, bc2_sqrt=(1 - 0.999**T) ** 0.5,
    neg_step_size=-3e-2 / (1 - 0.9**T))


def bits(a):
  """Bit patterns (nan == nan, -0.0 != 0.0)."""
  a = np.atleast_1d(np.asarray(a))
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(got, ref, what):
  got, ref = jax.tree.leaves(got), jax.tree.leaves(ref)
  assert len(got) == len(ref)
  for i, (a, b) in enumerate(zip(got, ref)):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, i)
    diff = bits(a) != bits(b)
    assert not diff.any(), (f"{what}: leaf {i} ({a.dtype}) differs in "
                            f"{int(diff.sum())} of {diff.size} elements")


def exact_operands(seed, tokens, n_in, n_out):
  """x and dy whose G = x^T dy is exact in fp32 in any summation order; its
  row 0 is zero (so is the gradient of a zero moment block there)."""
  rng = np.random.default_rng(seed)
  x = rng.integers(-3, 4, (*tokens, n_in)).astype(np.float32)
  x[..., 0] = 0.0
  dy = (rng.integers(-8, 9, (*tokens, n_out)) / 16).astype(np.float32)
  return x, dy


def moments(seed, shape, rule):
  """fp32 values per slot: signed moments ~1e-2, second moments spanning
  six decades, each with a block of zeros (stored with scale 0)."""
  rng = np.random.default_rng(seed)
  out = []
  for name in rule.slots:
    if name in rule.second_moments:
      v = 1e-4 * np.exp2(rng.uniform(-20, 0, shape))
    else:
      v = 1e-2 * rng.standard_normal(shape)
    v = v.astype(np.float32)
    v[..., 0, :64] = 0.0
    out.append(v)
  return out


def quantized_slots(values, kinds, rule):
  return tuple(
      quant.quantize(v, MomentFormat(k), second_moment=n in rule.second_moments)
      if k is not None else jnp.asarray(v)
      for v, k, n in zip(values, kinds, rule.slots))


# (name, rule, per-slot kinds, weight dtype, stochastic rounding, tiling,
#  tokens, in, out, layer of an (L=3) stack, stored G)
CASES = [
    ("adamw-int8", pk.ADAMW, ("int8", "int8"), jnp.float32, False, None,
     (37,), 70, 130, None, False),
    ("torch-adam-fp8-sr", torch_rules.adam_rule(amsgrad=False),
     ("fp8_e4m3", "fp8_e5m2"), jnp.bfloat16, True,
     pk.BlockConfig(32, 128, 32, split_out=2), (2, 19), 33, 200, None, False),
    ("lion-int8-stack", pk.lion_rule(), ("int8",), jnp.bfloat16, True,
     pk.BlockConfig(16, 64, 16), (24,), 40, 100, 1, False),
    ("adagrad-e4m3-stored", pk.adagrad_rule(), ("fp8_e4m3",), jnp.float32,
     False, None, None, 50, 90, 2, True),
    # The Mosaic GPU kernel (its tiling picks it): int8 moments requantized
    # in its streamed epilogue, 64-column sub-tiles (one block per row), the
    # ping-pong schedule; 2-D, and layer 1 of a stack with a ring of one.
    ("adamw-int8-mosaic", pk.ADAMW, ("int8", "int8"), jnp.bfloat16, False,
     pk.MosaicConfig.from_label("64x128x64/2,pp,lp"), (2, 64), 128, 256,
     None, False),
    ("lion-int8-stack-mosaic", pk.lion_rule(), ("int8",), jnp.float32,
     False, pk.MosaicConfig.from_label("64x128x64/2,r1,pp"), (64,), 64, 256,
     1, False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_equals_reference_bit_for_bit(case):
  (_, rule, kinds, w_dtype, sr, config, tokens, n_in, n_out, layer,
   stored) = case
  shape = (n_in, n_out) if layer is None else (3, n_in, n_out)
  rng = np.random.default_rng(n_in * n_out)
  w = rng.standard_normal(shape).astype(w_dtype)
  slots = quantized_slots(moments(n_in, shape, rule), kinds, rule)
  # torch's AdamW: decoupled decay (``decay``), no coupled weight decay.
  h = pack_host(rule, {**VALUES, "weight_decay": 0.0}
                if rule.name.endswith("_torch") else VALUES)
  x, dy = exact_operands(n_out, tokens or (16,), n_in, n_out)
  if isinstance(config, pk.MosaicConfig):  # 16-bit operands (exact here)
    x, dy = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
  kw = dict(rule=rule, layer=layer, stochastic_rounding=(7, 11) if sr else None)
  if stored:
    g = jnp.dot(x.T, dy)  # exact
    got = jax.jit(lambda *a: pk.stored_g_update(
        g, *a, interpret=True, config=config, **kw))(w, slots, h)
    ref = jax.jit(lambda *a: pk.unfused_wgrad_update(x, dy, *a, **kw))(
        w, slots, h)
  else:
    got = jax.jit(lambda *a: pk.fused_wgrad_update(
        x, dy, *a, interpret=True, config=config, **kw))(w, slots, h)
    ref = jax.jit(lambda *a: pk.fused_wgrad_update_reference(
        x, dy, *a, **kw))(w, slots, h)
  assert_same_bits(got, ref, case[0])
  new_w, new_slots = got
  for s, k in zip(new_slots, kinds):
    assert isinstance(s, Quantized) and s.q.dtype == MomentFormat(k).dtype
  # The step did something: the weight and every slot's codes changed
  # (in the updated layer; the other layers of a stack are untouched).
  sel = (lambda a: a) if layer is None else (lambda a: a[layer])
  assert (bits(sel(new_w)) != bits(sel(w))).mean() > 0.5
  for s, old in zip(new_slots, slots):
    assert (bits(sel(s.q)) != bits(sel(old.q))).mean() > 0.3
    # Row 0's first block: zero moments, zero gradient -> stored as zeros.
    assert np.asarray(sel(s.scale))[0, 0] == 0.0
    assert (bits(sel(s.q))[0, :64] == 0).all()
  if layer is not None:
    for i in set(range(3)) - {layer}:
      assert_same_bits((new_w[i], [(s.q[i], s.scale[i]) for s in new_slots]),
                       (w[i], [(s.q[i], s.scale[i]) for s in slots]),
                       f"layer {i}")


def test_a_second_moment_is_named_by_the_rule():
  """Which slot is clamped and floored comes from the rule's metadata."""
  assert pk.ADAMW.second_moments == ("nu",)
  assert pk.lion_rule().second_moments == ()
  assert torch_rules.adam_rule(amsgrad=True).second_moments == (
      "exp_avg_sq", "max_exp_avg_sq")
  assert pk.grad_scaled(pk.adagrad_rule()).second_moments == (
      "sum_of_squares",)
  with pytest.raises(ValueError, match="not among its slots"):
    dataclasses.replace(pk.ADAMW, second_moments=("v",))
  # The same nu stored as a second moment (floored) or not: other codes.
  x, dy = exact_operands(0, (8,), 16, 64)
  w = np.ones((16, 64), np.float32)
  zero = quant.quantize(np.zeros((16, 64), np.float32), MomentFormat())
  h = pack_host(pk.ADAMW, VALUES)
  plain = dataclasses.replace(pk.ADAMW, second_moments=())
  _, (_, nu) = pk.fused_wgrad_update_reference(x, dy, w, (zero, zero), h,
                                               rule=pk.ADAMW)
  _, (_, nu0) = pk.fused_wgrad_update_reference(x, dy, w, (zero, zero), h,
                                                rule=plain)
  live = np.asarray(nu.scale)[:, :, None] > 0
  q, q0 = np.asarray(nu.q).reshape(16, 1, 64), np.asarray(nu0.q).reshape(
      16, 1, 64)
  assert (q[np.broadcast_to(live, q.shape)] >= 1).all()
  assert (q0 == 0).any()


def test_tilings_are_fitted_to_the_blocks_or_refused():
  plan = lowp.StatePlan((lowp.SlotPlan(MomentFormat(), False),))
  fit = lambda cfg, n_out: lowp.fit_tiling(cfg, plan, n_out)
  assert fit(pk.BlockConfig(64, 128, 32, split_out=4), 4096).split_out == 2
  assert fit(pk.BlockConfig(64, 128, 32, split_out=2), 4096).split_out == 2
  assert fit(pk.BlockConfig(64, 32, 32), 4096).block_out == 64
  small = fit(pk.BlockConfig(64, 64, 32, split_out=2), 40)  # one row tile
  assert (small.block_out, small.split_out) == (64, 1)
  assert fit(pk.BlockConfig(64, 32, 32), 20).block_out == 32  # row in one
  for cfg, n_out in [(pk.BlockConfig(64, 256, 32, split_out=8), 1000),
                     (pk.BlockConfig(32, 16, 16), 200)]:
    assert lowp.tiling_problem(cfg, plan, n_out) is not None
    assert lowp.tiling_problem(fit(cfg, n_out), plan, n_out) is None
  x, dy = exact_operands(0, (4,), 16, 100)
  q = quant.quantize(np.zeros((16, 100), np.float32), MomentFormat())
  with pytest.raises(ValueError, match=r"128 // 4 = 32 columns, which splits "
                     r"the 64-element blocks"):
    pk.fused_wgrad_update(x, dy, np.ones((16, 100), np.float32), (q, q),
                          pk.ADAMW.pack(**{n: VALUES[n] for n in
                                           pk.ADAMW.hparams}),
                          rule=pk.ADAMW, interpret=True,
                          config=pk.BlockConfig(16, 128, 16, split_out=4))


def test_mosaic_backend_refuses_what_it_cannot_take(monkeypatch):
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  dy = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
  qs = Quantized(jax.ShapeDtypeStruct((256, 256), jnp.int8),
                 jax.ShapeDtypeStruct((256, 4), jnp.float32))
  # Stochastic rounding: Triton, for that reason. int8 moments: like float
  # ones, Mosaic GPU only where the cache measured it faster on this GPU,
  # and here there is none.
  for slots, sr, why in [((w, w), (1, 2), lowp.MOSAIC_REFUSAL),
                         ((qs, qs), (1, 2), lowp.MOSAIC_REFUSAL),
                         ((qs, qs), None, "no NVIDIA GPU")]:
    choice = pk.describe_backend(x, dy, w, slots, rule=pk.ADAMW,
                                 interpret=False, stochastic_rounding=sr)
    assert choice.backend == "triton"
    assert choice.reason.startswith(why)
  # Asked for by name or through $FORGE_BACKEND: what the Mosaic GPU
  # kernel does not take is refused in plain words.
  xs, dys = (a.astype(jnp.bfloat16) for a in exact_operands(0, (64,), 64,
                                                            64))
  q = quant.quantize(np.zeros((64, 64), np.float32), MomentFormat())
  q8 = quant.quantize(np.zeros((64, 64), np.float32),
                      MomentFormat("fp8_e4m3"))
  w = np.ones((64, 64), jnp.bfloat16)
  h = pack_host(pk.ADAMW, VALUES)
  for slots, kw, msg in [
      ((q, q), dict(stochastic_rounding=(1, 2)),
       "stochastic rounding runs on the Triton backend"),
      ((q8, q), {}, "fp8 moments run on the Triton backend"),
      ((q, q), dict(config=pk.MosaicConfig.from_label("64x64x64/2,e64x32,pp")),
       "int8 moments need epilogue sub-tiles one block wide")]:
    with pytest.raises(ValueError, match=msg + r".*(backend='mosaic_gpu' was "
                       "passed|config is a MosaicConfig)"):
      pk.fused_wgrad_update(xs, dys, w, slots, h, rule=pk.ADAMW,
                            backend="mosaic_gpu", interpret=True, **kw)
  monkeypatch.setenv("FORGE_BACKEND", "mosaic_gpu")
  with pytest.raises(ValueError, match="a stored gradient with int8 moments "
                     r"runs on the Triton backend.*unset \$FORGE_BACKEND"):
    pk.stored_g_update(np.zeros((64, 64), np.float32), w, (q, q), h,
                       rule=pk.ADAMW, interpret=True)


@pytest.mark.parametrize("slots,kw,exc,match", [
    (lambda q: (q.q, q), {}, ValueError,
     "slot 'mu' is a plain int8 array.*Quantized"),
    (lambda q: (q, Quantized(q.q, q.scale[:, :1])), {}, ValueError,
     r"scale of quantized slot 'nu' is float32\[16, 1\].*float32\[16, 2\]"),
    (lambda q: (q, q), dict(stochastic_rounding=(0, 1)), ValueError,
     "stores a bfloat16 weight; this weight is float32"),
    (lambda q: (q, q), dict(stochastic_rounding=(0, 1.5)), TypeError,
     "step must be an integer scalar"),
    (lambda q: (q, q), dict(formats={"nu": MomentFormat("fp8_e4m3")}),
     ValueError, "format fp8_e4m3.*its codes are int8"),
    (lambda q: (q, np.zeros((16, 100), np.float32)),
     dict(formats=(None, MomentFormat())), ValueError, "is a plain array"),
])
def test_bad_low_precision_inputs_fail_clearly(slots, kw, exc, match):
  x, dy = exact_operands(0, (4,), 16, 100)
  q = quant.quantize(np.zeros((16, 100), np.float32), MomentFormat())
  with pytest.raises(exc, match=match):
    pk.fused_wgrad_update(x, dy, np.ones((16, 100), np.float32), slots(q),
                          pack_host(pk.ADAMW, VALUES), rule=pk.ADAMW,
                          interpret=True, **kw)


def test_quantized_kernel_lowers_for_cuda_without_a_gpu():
  """The Triton lowering of the quantized, stochastically rounded epilogue:
  one kernel, W and both (codes, scales) pairs aliased in place, and the
  correctly rounded reciprocal, int8 rounding and unfused dequantizing
  product as PTX."""
  s = jax.ShapeDtypeStruct
  shp = (70, 130)
  args = [s((37, 70), jnp.bfloat16), s((37, 130), jnp.bfloat16),
          s(shp, jnp.bfloat16), s(shp, jnp.int8), s((70, 3), jnp.float32),
          s(shp, jnp.float8_e5m2), s((70, 3), jnp.float32),
          s((pk.HPARAM_VECTOR_LEN,), jnp.float32), s((), jnp.int32)]

  def step(x, dy, w, mq, ms, vq, vs, h, t):
    return pk.fused_wgrad_update(
        x, dy, w, (Quantized(mq, ms), Quantized(vq, vs)), h, rule=pk.ADAMW,
        interpret=False, stochastic_rounding=(5, t))

  text = lower_for_cuda(step, *args, donate_argnums=(2, 3, 4, 5, 6))
  assert len(triton_calls(text)) == 1
  assert text.count("tf.aliasing_output") == 5
  for asm in ("div.rn.f32", "cvt.rni.f32.f32", "mul.rn.f32"):
    assert asm in text, asm


def test_a_seed_is_taken_modulo_2_to_the_32_in_eager_calls_too():
  """A Python seed of 2**31 or more (forge_jax's per-parameter seeds are)
  reaches the eager kernel as its uint32 (modulo 2**32), as under jit:
  the reference's bits; 2**32 + 7 rounds as 7 does."""
  rng = np.random.default_rng(3)
  w = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
  slots = (jnp.zeros((64, 64)), jnp.zeros((64, 64)))
  x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
  h = pack_host(pk.ADAMW, VALUES)
  run = lambda fn, seed, **kw: fn(x, dy, w, slots, h, rule=pk.ADAMW,
                                  stochastic_rounding=(seed, 11), **kw)
  for seed in (2**31 + 7, 2**32 + 7):
    got = run(pk.fused_wgrad_update, seed, interpret=True)
    assert_same_bits(got, run(pk.fused_wgrad_update_reference, seed), seed)
  assert_same_bits(run(pk.fused_wgrad_update, 2**32 + 7, interpret=True),
                   run(pk.fused_wgrad_update, 7, interpret=True), "mod")


def test_stochastic_rounding_in_the_kernel_is_unbiased_and_tiling_free():
  """The kernel's bf16 store of w' = w - 1 * g for two values a fraction f
  of a bf16 ulp (2**-9 at 0.3125) above 0.3125, 1e5 elements each: the
  mean of the 1e5 stored values minus the exact fp32 value is within
  SR_MEAN_ATOL (3e-5, about 1.5% of that ulp) of zero, where rounding to
  nearest errs by 0.2 and 0.3 ulp; each element is one of the two
  neighbours, up with probability f (5 sigma). The stored bits do not
  depend on the tiling and equal the reference's."""
  ulp = 2.0 ** -9
  fracs = np.array([0.8, 0.3])
  targets = (0.3125 + fracs * ulp).astype(np.float32)
  w = jnp.full((200, 1000), 0.3125, jnp.bfloat16)
  g = -np.repeat(fracs * ulp, 100)[:, None] * np.ones((1, 1000))
  g = g.astype(np.float32)
  rule = pk.sgd_rule()
  h = rule.pack(lr=1.0)
  store = lambda cfg: jax.jit(lambda g, w: pk.stored_g_update(
      g, w, (), h, rule=rule, config=cfg, interpret=True,
      stochastic_rounding=(123, 45))[0])(g, w)
  got = np.asarray(store(None), np.float64).reshape(2, 100_000)
  rne = targets.astype(jnp.bfloat16).astype(np.float64) - targets
  assert (np.abs(rne) >= 10 * SR_MEAN_ATOL).all()
  mean_err = got.mean(1) - targets
  assert (np.abs(mean_err) <= SR_MEAN_ATOL).all(), mean_err
  lo = 0.3125
  assert np.isin(got, [lo, lo + ulp]).all()
  up = (got > lo).mean(1)
  assert (np.abs(up - fracs) <= 5 * np.sqrt(fracs * (1 - fracs) / 1e5)).all()
  # Deterministic, the same bits under another tiling and in the
  # reference, and another step draws other bits.
  again = store(pk.BlockConfig(64, 256, 16, num_stages=1))
  assert_same_bits(again, got.reshape(200, 1000).astype(jnp.bfloat16),
                   "tilings")
  ref = lowp.apply(rule, lowp.StatePlan((), True), jnp.asarray(g), w, (), h,
                   sr=(123, 45))[0]
  assert_same_bits(ref, again, "reference")
  other = lowp.apply(rule, lowp.StatePlan((), True), jnp.asarray(g), w, (), h,
                     sr=(123, 46))[0]
  assert 0.3 < float(jnp.mean(other != ref)) < 0.6


# --- forge_jax ------------------------------------------------------------------


class Head(nn.Module):
  """An App. E-style model, scaled down: a hidden layer and a softmax head
  (``in -> 128 -> 64`` classes), weights N(0, 0.02); both kernels have
  8192 elements (quantized), the biases keep float moments. It computes in
  ``dtype`` (default: the parameters')."""
  dense: type
  param_dtype: object = jnp.float32
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    kw = dict(kernel_init=nn.initializers.normal(0.02),
              param_dtype=self.param_dtype,
              dtype=self.dtype or self.param_dtype)
    x = nn.relu(self.dense(128, **kw)(x))
    return self.dense(64, **kw)(x)


def ce_loss(model):
  def loss_fn(variables, batch):
    x, y = batch
    logits = model.apply(variables, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss_fn


def head_data(steps, bt=256, dtype=jnp.float32):
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  xs = jax.random.normal(kx, (steps, bt, 64)).astype(dtype)
  ys = jax.random.randint(ky, (steps, bt), 0, 64)
  variables = Head(nn.Dense, dtype).init(kp, xs[0])
  return xs, ys, variables


def train(tx, variables, xs, ys, steps, dtype=jnp.float32, state=None,
          first=0, step=None):
  """``steps - first`` FORGE steps of ``Head`` from ``variables``; returns
  ``(variables, state)``. ``step``: a jitted step to reuse (its compile)."""
  if step is None:
    step = jax.jit(forge_jax.make_step(
        ce_loss(Head(forge_jax.Dense, dtype)), tx))
  state = tx.init(variables["params"]) if state is None else state
  for i in range(first, steps):
    _, variables, state = step(variables, state, (xs[i], ys[i]))
  return variables, state


def rms_rel(a, b):
  a = np.concatenate([np.ravel(np.asarray(x, np.float64))
                      for x in jax.tree.leaves(a)])
  b = np.concatenate([np.ravel(np.asarray(x, np.float64))
                      for x in jax.tree.leaves(b)])
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_twenty_steps_against_fp32_state():
  """App. E's protocol (20 steps from the same seeded inputs against an
  fp32-state reference; rms-relative weight error), on a scaled-down model
  at lr 2.5e-4: the fp32 reference moves the weights by 6% of their norm.
  int8 moments <= 3e-3, fp8 (e4m3) <= 2.6e-2."""
  xs, ys, v0 = head_data(20)
  lr = 2.5e-4
  ref, _ = train(forge_jax.adamw(lr, weight_decay=0.0), v0, xs, ys, 20)
  moved = rms_rel(ref, v0)
  assert 0.03 < moved < 0.15
  for moments, bound in [("int8", 3e-3), ("fp8", 2.6e-2)]:
    tx = forge_jax.adamw(lr, weight_decay=0.0, moments=moments)
    got, state = train(tx, v0, xs, ys, 20)
    err = rms_rel(got, ref)
    assert 1e-5 < err <= bound, (moments, err)
    # One state format for the whole model: quantized kernels, float biases.
    kernel = state.mu["Dense_0"]["kernel"]
    assert isinstance(kernel, Quantized)
    assert kernel.q.dtype == MomentFormat(
        "fp8_e4m3" if moments == "fp8" else "int8").dtype
    assert state.nu["Dense_1"]["bias"].dtype == jnp.float32
    assert int(state.count) == 20


def _bound(new: Quantized, fmt: MomentFormat, second: bool, values):
  """|dequantize(new) - values| allowed per element: half a code step
  times the scale (fp8: half an ulp of the code) plus the quantizer's fp32
  term; a floored second moment may sit up to the floor above."""
  s = np.repeat(np.asarray(new.scale, np.float64), fmt.block, -1)[
      ..., :values.shape[-1]]
  a = s * fmt.qmax
  q = np.abs(np.asarray(new.q).astype(np.float64))
  if fmt.kind == "int8":
    step = np.ones_like(q)
  else:
    mant = {"fp8_e4m3": 3, "fp8_e5m2": 2}[fmt.kind]
    emin = {"fp8_e4m3": -6, "fp8_e5m2": -14}[fmt.kind]
    step = np.exp2(np.maximum(np.floor(np.log2(np.maximum(
        np.maximum(q, np.abs(values) / np.where(s > 0, s, 1)), 1e-30))),
        emin) - mant)
  bound = s * step / 2 + 2.0 ** -20 * a
  if second:
    bound = np.maximum(bound, s * fmt.floor_value)
  return bound


def test_resynced_steps_stay_within_the_quantizer_bound():
  """Each step, an fp32-state step (float32 moments: the same kernel and
  rule) starts from the dequantized quantized state: its new moments and
  the quantized step's dequantized ones differ by at most the quantizer's
  error bound, and the weights agree to fp32 rounding, for 100 steps."""
  xs, ys, v0 = head_data(10)
  fmt = MomentFormat("int8")
  tx_q = forge_jax.adamw(1e-3, moments="int8", weight_decay=1e-2)
  tx_f = forge_jax.adamw(1e-3, moments=jnp.float32, weight_decay=1e-2)
  step_q = jax.jit(forge_jax.make_step(ce_loss(Head(forge_jax.Dense)), tx_q))
  step_f = jax.jit(forge_jax.make_step(ce_loss(Head(forge_jax.Dense)), tx_f))
  deq = lambda t: jax.tree.map(
      lambda a: quant.dequantize(a, fmt) if isinstance(a, Quantized) else a,
      t, is_leaf=lambda a: isinstance(a, Quantized))
  v, s = v0, tx_q.init(v0["params"])
  worst = 0.0
  for i in range(100):
    batch = (xs[i % 10], ys[i % 10])
    s_f = tx_f.init(v["params"])._replace(count=s.count, mu=deq(s.mu),
                                          nu=deq(s.nu))
    _, v_f, s_f = step_f(v, s_f, batch)
    _, v, s = step_q(v, s, batch)
    assert rms_rel(v["params"], v_f["params"]) <= tol(jnp.float32)
    for name, second in (("mu", False), ("nu", True)):
      new = getattr(s, name)["Dense_0"]["kernel"]
      ref = np.asarray(getattr(s_f, name)["Dense_0"]["kernel"], np.float64)
      err = np.abs(np.asarray(quant.dequantize(new, fmt), np.float64) - ref)
      # (plus fp32 rounding of the two steps' own arithmetic)
      bound = _bound(new, fmt, second, ref) + 1e-5 * np.abs(ref)
      assert (err <= bound).all(), (i, name, float((err - bound).max()))
      worst = max(worst, float((err / np.maximum(bound, 1e-30)).max()))
  assert worst > 0.25  # the bound is not vacuous: errors come close to it


def test_checkpoint_at_step_10_restores_bit_identical_steps():
  """flax.serialization round trip of int8 state with stochastic rounding of
  bf16 weights: steps 11-20 from the restored state equal those of the
  uninterrupted run, bit for bit."""
  xs, ys, v0 = head_data(20, dtype=jnp.bfloat16)
  tx = forge_jax.adamw(1e-3, moments="int8", stochastic_rounding=True,
                       seed=3)
  step = jax.jit(forge_jax.make_step(
      ce_loss(Head(forge_jax.Dense, jnp.bfloat16)), tx))
  v10, s10 = train(tx, v0, xs, ys, 10, step=step)
  blob = serialization.to_bytes({"variables": v10, "opt_state": s10})
  target = {"variables": v0, "opt_state": tx.init(v0["params"])}
  restored = serialization.from_bytes(target, blob)
  assert_same_bits(restored, {"variables": v10, "opt_state": s10}, "restore")
  a = train(tx, v10, xs, ys, 20, state=s10, first=10, step=step)
  b = train(tx, restored["variables"], xs, ys, 20,
            state=restored["opt_state"], first=10, step=step)
  assert_same_bits(a, b, "steps 11-20")
  assert type(b[1]).__name__ == "LowPrecisionState"
  assert int(b[1].count) == 20


def test_forge_kernels_and_other_parameters_share_seeds_and_rounding():
  """The FORGE kernels and the transform's own update (every parameter
  that is not a FORGE kernel) draw the same stochastic-rounding bits for a
  parameter: its seed is (seed + crc32 of its key path), the step its
  1-based count. bf16 weights computing in fp32, one step: the two paths'
  fp32 updates of a kernel differ only by G's summation order, so their
  stored kernels agree but for a few elements; with another seed, in about
  40% of them."""
  assert low_precision.param_seed(5, (jax.tree_util.DictKey("a"),)) == (
      5 + zlib.crc32(b"['a']")) % 2 ** 32
  kx, ky = jax.random.split(jax.random.key(1))
  xs = jax.random.normal(kx, (2, 256, 64))
  ys = jax.random.randint(ky, (2, 256), 0, 64)
  v0 = Head(nn.Dense, jnp.bfloat16, jnp.float32).init(jax.random.key(2),
                                                      xs[0])
  tx = forge_jax.adamw(3e-3, stochastic_rounding=True, seed=9)
  step = jax.jit(forge_jax.make_step(
      ce_loss(Head(forge_jax.Dense, jnp.bfloat16, jnp.float32)), tx))
  _, fused, _ = step(v0, tx.init(v0["params"]), (xs[0], ys[0]))
  loss_fn = ce_loss(Head(nn.Dense, jnp.bfloat16, jnp.float32))
  # The fp32 gradient at the bf16 weights (jax.grad of a bf16 parameter
  # would round it to bf16, which the kernel does not).
  f32 = jax.tree.map(lambda a: a.astype(jnp.float32), v0)
  g = jax.grad(loss_fn)(f32, (xs[0], ys[0]))["params"]
  standard = {}
  for seed in (9, 10):
    t = forge_jax.adamw(3e-3, stochastic_rounding=True, seed=seed)
    u, _ = jax.jit(t.update)(g, t.init(v0["params"]), v0["params"])
    standard[seed] = optax.apply_updates(v0["params"], u)
  kernels = lambda t: [t["Dense_0"]["kernel"], t["Dense_1"]["kernel"]]
  for a, b, c in zip(kernels(fused["params"]), kernels(standard[9]),
                     kernels(standard[10])):
    assert a.dtype == b.dtype == jnp.bfloat16
    assert (bits(a) != bits(b)).mean() < 0.02
    assert (bits(c) != bits(b)).mean() > 0.2


def test_stochastic_rounding_tracks_the_fp32_master():
  """The digits MLP computing in bf16 at lr 1e-4, 50 steps: bf16 weights
  stored by stochastic rounding stay closer to the fp32-master trajectory
  than round-to-nearest ones, which lose the updates below half an ulp
  (benchmarks/low_precision.py sr measures 200 steps)."""
  from benchmarks.low_precision import sr_trajectories
  r = sr_trajectories(50, 1e-4, hidden=32, batch=64)
  assert r["sr"][-1] < 0.7 * r["rne"][-1], (r["sr"][-1], r["rne"][-1])
  assert r["sr"].mean() < r["rne"].mean()
  assert np.isfinite(r["loss"]).all() and r["loss"][-1] < r["loss"][0]


def test_families_with_moments_take_low_precision_state():
  """Families that keep moments run with quantized state in a FORGE step,
  its kernels and the standard path agreeing (fp32 weights, two steps)."""
  xs, ys, v0 = head_data(2)
  for tx in [forge_jax.sgd(1e-2, momentum=0.9, moments="int8"),
             forge_jax.lion(1e-4, moments="int8"),
             forge_jax.adagrad(1e-2, moments="fp8"),
             forge_jax.rmsprop(1e-3, momentum=0.9, moments="int8")]:
    got, state = train(tx, v0, xs, ys, 2)
    loss_fn = ce_loss(Head(nn.Dense))

    @jax.jit
    def standard_step(v, s, batch, tx=tx):
      g = jax.grad(loss_fn)(v, batch)["params"]
      u, s = tx.update(g, s, v["params"])
      return {"params": optax.apply_updates(v["params"], u)}, s

    v, s = v0, tx.init(v0["params"])
    for i in range(2):
      v, s = standard_step(v, s, (xs[i], ys[i]))
    family = tx.spec.family
    # The two paths agree to fp32's bar on the weights and on their
    # updates (which are small: SGD moves the head by about 1e-3), and
    # the weights did move, well beyond that bar.
    assert rms_rel(got, v) <= tol(jnp.float32), family
    delta = lambda p: jax.tree.map(lambda a, b: a - b, p, v0)
    assert rms_rel(delta(got), delta(v)) <= tol(jnp.float32), family
    assert rms_rel(got, v0) > 10 * tol(jnp.float32), family
    leaf = getattr(state, tx.spec.rule.slots[0])["Dense_1"]["kernel"]
    assert isinstance(leaf, Quantized), family


@pytest.mark.parametrize("make", [
    lambda: forge_jax.adamw(1e-3, moments="int8"),
    lambda: forge_jax.adamw(1e-3, moments=jnp.bfloat16),
    lambda: forge_jax.sgd(1e-2, momentum=0.9, stochastic_rounding=True)],
    ids=["int8", "bf16", "sr"])
def test_low_precision_transforms_take_optax_extra_arguments(make):
  """A low-precision transform is a GradientTransformationExtraArgs, as
  its type says: optax.chain hands it the extra arguments another member
  needs (reduce_on_plateau's value=), which it ignores."""
  tx = make()
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2),
            "b": jnp.ones((2,))}
  grads = jax.tree.map(lambda p: 0.1 * p + 0.05, params)
  alone, _ = tx.update(grads, tx.init(params), params)
  chained = optax.chain(tx, optax.contrib.reduce_on_plateau())
  got, _ = chained.update(grads, chained.init(params), params,
                          value=jnp.asarray(1.0))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(alone)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(got))


def test_unsupported_uses_are_refused_in_plain_words():
  with pytest.raises(ValueError, match="forge_jax.lamb: moments='int8'.*"
                     "supported for the families whose whole step runs in "
                     "the fused kernel's epilogue"):
    forge_jax.lamb(1e-3, moments="int8")
  with pytest.raises(ValueError, match="stochastic_rounding=True"):
    forge_jax.adafactor(stochastic_rounding=True)
  with pytest.raises(ValueError, match="moments='int4'; use 'int8'"):
    forge_jax.adamw(1e-3, moments="int4")
  with pytest.raises(ValueError, match="plain SGD has no state"):
    forge_jax.sgd(1e-3, moments="int8")
  for moments in ("int8", "fp8", ("int8", "fp8_e5m2")):
    with pytest.raises(ValueError, match=r"centered=True is not supported.*"
                       r"sqrt\(nu - mu\*\*2\)"):
      forge_jax.rmsprop(1e-3, centered=True, moments=moments)
  forge_jax.rmsprop(1e-3, centered=True, moments=jnp.bfloat16)  # floats
  # The kernel API refuses them too, for optax's and torch's formulas.
  x, dy = jnp.ones((4, 8)), jnp.ones((4, 16))
  w = jnp.zeros((8, 16))
  codes = quant.quantize(w, MomentFormat("int8"))
  centered = pk.rmsprop_rule(centered=True)
  # Rules derived from it (clipping, accumulation) refuse alike.
  for derived in (pk.grad_scaled(centered),
                  pk.rules.accumulating(centered),
                  pk.rules.momentum_accumulating(centered, "decay")):
    assert derived.no_quantized_state == centered.no_quantized_state
  for rule in (centered, torch_rules.rmsprop_rule(centered=True),
               pk.grad_scaled(torch_rules.rmsprop_rule(centered=True))):
    h = rule.pack(**dict.fromkeys(rule.hparams, 0.5))
    slots = [jnp.zeros_like(w)] * len(rule.slots)
    for i in range(len(slots)):
      quantized = [*slots[:i], codes, *slots[i + 1:]]
      with pytest.raises(ValueError, match=rf"slot {rule.slots[i]!r} is "
                         f"quantized, but rule {rule.name!r} cannot keep "
                         "quantized state: centered RMSprop"):
        pk.fused_wgrad_update(x, dy, w, quantized, h, rule=rule,
                              interpret=True)
  # seed= does nothing without stochastic rounding: refused, as is a seed
  # that is not an integer, whatever the other options.
  for kw in ({}, {"moments": "int8"}):
    with pytest.raises(ValueError, match=r"seed= is the stochastic-rounding "
                       r"seed and would do nothing"):
      forge_jax.adamw(1e-3, seed=3, **kw)
  for bad in ("abc", 1.5):
    with pytest.raises(TypeError, match="seed must be an integer"):
      forge_jax.adamw(1e-3, seed=bad)
  # mu_dtype (sgd: accumulator_dtype) and moments= both setting how the
  # first moment is stored: refused, naming both (either alone is taken).
  for make, option in ((forge_jax.adam, "mu_dtype"),
                       (forge_jax.adamw, "mu_dtype"),
                       (forge_jax.lion, "mu_dtype")):
    for moments in (jnp.float32, "int8"):
      with pytest.raises(ValueError, match=rf"{option}=.*and moments=.*both "
                         r"set how the moment 'mu' is stored"):
        make(1e-3, **{option: jnp.bfloat16}, moments=moments)
    make(1e-3, **{option: jnp.bfloat16})
    make(1e-3, moments=jnp.float32)
  with pytest.raises(ValueError, match=r"accumulator_dtype=.*both set how"):
    forge_jax.sgd(1e-3, momentum=0.9, accumulator_dtype=jnp.bfloat16,
                  moments=jnp.float32)
  tx = forge_jax.adamw(1e-3, moments="int8")
  with pytest.raises(ValueError, match="MultiSteps.*low-precision"):
    forge_jax.MultiSteps(tx, 2)
  x = jnp.ones((4, 64))
  # (Scanned stacks take low-precision state: tests/test_scan_low_precision.py.)
  # A DenseGeneral whose blocks along the kernel's last axis are not blocks
  # of the fused kernel's rows.
  layer = forge_jax.DenseGeneral(features=(2, 100))
  variables = layer.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="several feature axes, the last of "
                     "100 elements, not a multiple of 64"):
    forge_jax.make_step(lambda v, b: jnp.sum(layer.apply(v, b)), tx)(
        variables, tx.init(variables["params"]), x)


def test_moments_takes_dtypes_and_their_names_but_not_values():
  """moments= takes a float dtype as a dtype, a scalar type or its name
  (the form optax.inject_hyperparams leaves alone: a dtype is callable, so
  the wrapper would take it for a schedule); a value that has a dtype (an
  array, a NumPy or JAX scalar) and a mapping are refused with the
  moments= message, not taken as float32 moments or failed inside NumPy.
  stochastic_rounding= and MomentFormat's counts refuse a non-bool and a
  bool alike in the families that do not take them."""
  params = {"w": jnp.ones((64, 70))}
  for given in (jnp.bfloat16, jnp.dtype("bfloat16"), "bfloat16"):
    state = forge_jax.adamw(1e-3, moments=given).init(params)
    assert state.mu["w"].dtype == state.nu["w"].dtype == jnp.bfloat16
  for value in (np.float32(2.0), jnp.asarray(0.0), jnp.zeros((64, 70)),
                jnp.zeros((), jnp.bfloat16)):
    with pytest.raises(ValueError, match=r"moments=.* is a value, not a "
                       r"format or dtype.*moments='bfloat16'"):
      forge_jax.adamw(1e-3, moments=value)
  with pytest.raises(ValueError, match=r"moments=\{'mu'.*; use 'int8'"):
    forge_jax.adamw(1e-3, moments={"mu": "int8", "nu": "int8"})
  for name in ("float8_e4m3fn", "int4", "bfloat17"):  # not a kind or float
    with pytest.raises(ValueError, match=f"moments='{name}'; use 'int8'"):
      forge_jax.adamw(1e-3, moments=name)
  # Under optax.inject_hyperparams: the name works, the dtype is refused
  # naming the name.
  inject = optax.inject_hyperparams(forge_jax.adamw)
  state = inject(learning_rate=1e-3, moments="bfloat16").init(params)
  assert "moments" not in state.hyperparams
  assert state.inner_state.mu["w"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="give the dtype's name there, "
                     "moments='bfloat16'"):
    inject(learning_rate=1e-3, moments=jnp.bfloat16).init(params)
  # A non-bool stochastic_rounding= is a TypeError in every family.
  for make in (forge_jax.lamb, forge_jax.lars, forge_jax.adamw):
    for bad in (0, "no"):
      with pytest.raises(TypeError, match="stochastic_rounding must be True "
                         "or False"):
        make(1e-3, stochastic_rounding=bad)
  forge_jax.lamb(1e-3, stochastic_rounding=False)
  for field in ("v_floor", "min_size", "block"):
    with pytest.raises(ValueError, match=f"MomentFormat {field}=True"):
      MomentFormat("int8", **{field: True})


# Parameters with no elements: the bias of a Dense(0), its (n, 0) kernel, ...
EMPTY_SHAPES = {"cols": (4, 0), "bias": (0,), "rows": (0, 4), "mid": (2, 0, 3)}


@pytest.mark.parametrize("moments, sr", [
    (None, True),
    (MomentFormat("int8", min_size=0), False),
    (MomentFormat("fp8_e4m3", min_size=0), True),
], ids=["stochastic_rounding", "int8_min_size_0", "fp8_min_size_0_and_sr"])
def test_zero_size_parameters_are_stepped_as_no_ops(moments, sr):
  """A bf16 parameter with no elements is stepped as optax steps it, a
  no-op: empty updates, its state as init made it (with min_size=0, the
  empty codes and scales quant.quantize gives it) and the other
  parameters' steps as without it."""
  w = jnp.linspace(-1, 1, 12, dtype=jnp.bfloat16).reshape(4, 3)
  params = {"w": w, **{k: jnp.ones(s, jnp.bfloat16)
                       for k, s in EMPTY_SHAPES.items()}}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
  tx = forge_jax.adamw(1e-2, moments=moments, stochastic_rounding=sr)
  step = jax.jit(tx.update)
  s0 = tx.init(params)
  u1, s1 = step(grads, s0, params)
  u2, s2 = step(grads, s1, optax.apply_updates(params, u1))
  kinds = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)
  assert kinds(s0) == kinds(s1) == kinds(s2)
  for k, shape in EMPTY_SHAPES.items():
    assert u1[k].shape == u2[k].shape == shape, k
    if moments is not None:
      for name, second in (("mu", False), ("nu", True)):
        assert_same_bits(getattr(s0, name)[k], quant.quantize(
            jnp.zeros(shape), moments, second_moment=second), k)
  alone = {"w": w}
  u_w, s_w = jax.jit(tx.update)({"w": grads["w"]}, tx.init(alone), alone)
  assert_same_bits((u1["w"], s1.mu["w"], s1.nu["w"]),
                   (u_w["w"], s_w.mu["w"], s_w.nu["w"]), "w")


class _EmptyBranch(nn.Module):
  """A bf16 Dense of no output features beside the input, then a Dense
  over both."""
  dense: type
  empty: bool = True

  @nn.compact
  def __call__(self, x):
    dense = lambda n, name: self.dense(n, param_dtype=jnp.bfloat16,
                                       dtype=jnp.float32, name=name)
    if self.empty:
      x = jnp.concatenate([x, dense(0, "empty")(x)], -1)
    return dense(64, "out")(x)


@pytest.mark.parametrize("moments", [None, MomentFormat("int8", min_size=0)],
                         ids=["fp32_moments", "int8_min_size_0"])
def test_a_layer_with_an_empty_kernel_steps_with_stochastic_rounding(
    moments):
  """make_step moves a FORGE layer whose kernel has no elements to the
  standard path, the transform's own update: with stochastic rounding it
  is a no-op there, and the other layer steps as in the model without it."""
  kx, ky = jax.random.split(jax.random.key(3))
  x, y = jax.random.normal(kx, (16, 64)), jax.random.normal(ky, (16, 64))
  loss = lambda m: lambda v, b: jnp.mean((m.apply(v, b[0]) - b[1]) ** 2)
  tx = forge_jax.adamw(1e-2, moments=moments, stochastic_rounding=True)
  runs = {}
  for empty in (True, False):
    model = _EmptyBranch(forge_jax.Dense, empty)
    v = _EmptyBranch(nn.Dense, empty).init(jax.random.key(0), x)
    step = forge_jax.make_step(loss(model), tx)
    s = tx.init(v["params"])
    for _ in range(2):
      _, v, s = jax.jit(step)(v, s, (x, y))
    runs[empty] = (step, v, s)
  step, v, s = runs[True]
  assert step.standard_layers == ["empty"]
  assert v["params"]["empty"]["kernel"].shape == (64, 0)
  assert v["params"]["empty"]["bias"].shape == (0,)
  assert int(s.count) == 2
  _, v0, s0 = runs[False]
  assert_same_bits((v["params"]["out"], s.mu["out"], s.nu["out"]),
                   (v0["params"]["out"], s0.mu["out"], s0.nu["out"]), "out")


def test_low_precision_states_unpickle_in_a_fresh_process():
  """The state classes of the families that take moments= or
  stochastic_rounding= exist once forge_jax is imported: a pickled state
  loads in a process that has built no transform."""
  params = {"w": jnp.ones((64, 128)), "b": jnp.zeros((128,))}
  txs = [forge_jax.adamw(1e-3, moments="int8"),
         forge_jax.sgd(1e-3, stochastic_rounding=True),
         forge_jax.sgd(1e-3, momentum=0.9, moments="fp8"),
         forge_jax.rmsprop(1e-3, centered=True, momentum=0.9,
                           moments=jnp.bfloat16),
         forge_jax.adagrad(1e-2, moments="int8"),
         forge_jax.lion(1e-4, moments="int8")]
  states = [jax.device_get(tx.init(params)) for tx in txs]
  blob = pickle.dumps(states)
  code = ("import pickle, sys\n"
          "import forge_jax\n"
          "data = sys.stdin.buffer.read()\n"
          "states = pickle.loads(data)\n"
          "print([type(s).__qualname__ for s in states])\n"
          "print(pickle.dumps(states) == data)\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(forge_jax.__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (root, os.environ.get("PYTHONPATH")) if p))
  r = subprocess.run([sys.executable, "-c", code], input=blob,
                     capture_output=True, env=env, check=False)
  assert r.returncode == 0, r.stderr.decode()[-2000:]
  names, same = r.stdout.decode().strip().splitlines()[-2:]
  assert names == repr([type(s).__qualname__ for s in states])
  assert same == "True"
  assert "LowPrecisionState_mu_nu_trace" in names
  # Another slot tuple's class is made on first use.
  cls = low_precision.state_class(("a", "b"))
  assert cls is low_precision.state_class(("a", "b"))
  assert cls is low_precision.LowPrecisionState_a_b
  assert cls._fields == ("count", "a", "b")


def test_a_state_in_another_format_is_refused_in_plain_words():
  """tx.update with a state that another transform's init made (optax's
  state, another optimizer's, or moments in another format) names the
  mismatch and the fix, as make_step does for other mismatches."""
  params = {"w": jnp.ones((64, 128)), "b": jnp.zeros((128,))}
  grads = jax.tree.map(jnp.ones_like, params)
  int8 = forge_jax.adamw(1e-3, moments="int8")
  sr = forge_jax.adamw(1e-3, stochastic_rounding=True)
  fp8 = forge_jax.adamw(1e-3, moments="fp8")
  again = r": was it made by this transform's init\(\)\? Re-initialise it"
  for tx, made_by, match in [
      (int8, forge_jax.adamw(1e-3), r"opt_state is a tuple of optax states"
       r".*LowPrecisionState_mu_nu\(count, mu, nu\) with mu as int8 codes"),
      (int8, forge_jax.sgd(1e-3, momentum=0.9, moments="int8"),
       r"opt_state is a LowPrecisionState_trace\(count, trace\), another "
       "optimizer's low-precision state"),
      (int8, sr, r"mu of the parameter at \['w'\] holds a float32 array, "
       "where this transform keeps int8 codes"),
      (sr, int8, r"holds int8 codes, where this transform keeps a float "
       "array"),
      (fp8, int8, "holds int8 codes, where this transform keeps fp8_e4m3 "
       "codes")]:
    with pytest.raises(ValueError, match="forge_jax.adamw: .*" + match
                       + ".*" + again):
      tx.update(grads, made_by.init(params), params)


def test_nnx_optimizer_steps_quantized_state_outside_forge_layers():
  """flax.nnx holds a Quantized pair as a State {"q", "scale"}: a large
  parameter that no FORGE layer steps (an nnx.Embed table, an nnx.Linear)
  keeps quantized moments through nnx.Optimizer's update, which equals the
  transform's update of the plain trees."""
  from flax import nnx  # noqa: PLC0415

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(100, 64, rngs=rngs)
      self.out = nnx.Linear(64, 128, rngs=rngs)

    def __call__(self, x):
      return self.out(self.embed(x))

  model = Model(nnx.Rngs(0))
  tx = forge_jax.adamw(1e-2, moments="int8")
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  pure = lambda t: nnx.to_pure_dict(nnx.state(t, nnx.Param))
  state = tx.init(pure(model))
  x = jnp.arange(32) % 100
  for _ in range(2):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    p = pure(model)
    updates, state = tx.update(pure(grads), state, p)
    want = optax.apply_updates(p, updates)
    opt.update(model, grads)
  assert_same_bits(pure(model), want, "params")
  assert_same_bits(nnx.to_pure_dict(nnx.state(opt.opt_state)), state,
                   "opt_state")
  assert isinstance(state.mu["embed"]["embedding"], Quantized)


# --- GPU: the compiled Triton kernel -----------------------------------------


def _copy_rule():
  """m' = G, v' = G * G, W unchanged: single IEEE operations, so that the
  compiled kernel's quantized state can be compared bit for bit."""
  def update(g, w, slots, h):
    return w + 0.0 * h["lr"], (g, g * g)
  return pk.UpdateRule(name="lowp_copy", slots=("m", "v"), hparams=("lr",),
                       update=update, second_moments=("v",))


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", [("int8", "int8"), ("fp8_e4m3", "fp8_e5m2"),
                                   ("fp8_e4m3", "fp8_e4m3")])
def test_compiled_quantizer_equals_reference_bit_for_bit_on_gpu(kinds):
  """The compiled epilogue's quantizer (correctly rounded reciprocal,
  int8 rounding to nearest even, fp8 conversion, floor, special blocks)
  gives the reference's codes and scales bit for bit, on a stored G whose
  rows span 2**-100 .. 2**40 (a partial last block, zero rows)."""
  rng = np.random.default_rng(0)
  n_in, n_out = 96, 200
  g = (rng.standard_normal((n_in, n_out)) * np.exp2(
      rng.uniform(-100, 40, (n_in, 1)))).astype(np.float32)
  g[::7] = 0.0
  g[3, 5] = np.nan  # a diverged block: scale nan, codes +0
  rule = _copy_rule()
  w = np.ones((n_in, n_out), np.float32)
  slots = quantized_slots([np.zeros((n_in, n_out), np.float32)] * 2, kinds,
                          rule)
  h = rule.pack(lr=1.0)
  for cfg in (None, pk.BlockConfig(32, 128, 16, split_out=2, num_stages=1)):
    got = jax.jit(lambda *a: pk.stored_g_update(
        *a, rule=rule, config=cfg, interpret=False))(g, w, slots, h)
    ref = lowp.apply(rule, lowp.StatePlan(tuple(
        lowp.SlotPlan(MomentFormat(k), n in rule.second_moments)
        for k, n in zip(kinds, rule.slots))), jnp.asarray(g), w, slots, h)
    assert_same_bits(got, ref, f"{kinds} {cfg}")


@pytest.mark.gpu
def test_compiled_stochastic_rounding_equals_reference_on_gpu():
  """The compiled hash and rounding: SGD with lr 1 on a stored G (an exact
  fp32 update) stores the reference's bf16 bits, stacked and not."""
  rng = np.random.default_rng(1)
  w = rng.standard_normal((3, 130, 300)).astype(jnp.bfloat16)
  g = (rng.standard_normal((130, 300)) * 1e-3).astype(np.float32)
  rule = pk.sgd_rule()
  h = rule.pack(lr=1.0)
  for layer in (None, 2):
    ww = w[0] if layer is None else w
    got = jax.jit(lambda g, w, s: pk.stored_g_update(
        g, w, (), h, rule=rule, layer=layer, interpret=False,
        stochastic_rounding=(77, s)))(g, ww, jnp.int32(5))
    ref = lowp.apply(rule, lowp.StatePlan((), True), jnp.asarray(g), ww, (),
                     h, sr=(77, 5), layer=layer)
    assert_same_bits(got, ref, f"layer {layer}")


@pytest.mark.parametrize("bt", [512, 2048])
def test_scale_stores_stay_inside_the_scale_array(bt, monkeypatch):
  """A tile running past the weight's edge (out = 130 under the compiled
  default tilings for a bf16 weight: 128 x 2 and 256 x 4 sub-tiles) has
  sub-tiles wholly beyond it; their scale loads and stores must be masked,
  or on a GPU they land in the next row's first scale (interpret mode
  drops out-of-bounds stores, so the results alone cannot show it). Every
  scale store is recorded: each unmasked one stays inside the array."""
  from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415
  from pallas_kernels import triton_kernel  # noqa: PLC0415
  n_in, n_out = 16, 130
  n_sc = -(-n_out // 64)
  stores = []  # (masked, one past the last scale column written)

  def store(ref, val, mask=None, **kw):
    if tuple(getattr(ref, "ref", ref).shape) == (n_in, n_sc):
      cols = ref.transforms[-1].indices[1]
      jax.debug.callback(
          lambda c, masked=mask is not None: stores.append(
              (masked, int(c) + cols.size)), cols.start)
    return plgpu.store(ref, val, mask=mask, **kw)

  monkeypatch.setattr(triton_kernel, "plgpu", types.SimpleNamespace(**{
      **{k: getattr(plgpu, k) for k in dir(plgpu) if not k.startswith("__")},
      "store": store}))
  rule = pk.ADAMW
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, n_in)).astype(np.float32)
  dy = rng.standard_normal((8, n_out)).astype(np.float32)
  w = rng.standard_normal((n_in, n_out)).astype(jnp.bfloat16)
  slots = quantized_slots(moments(3, (n_in, n_out), rule), ("int8", "int8"),
                          rule)
  cfg = pk.BlockConfig.compiled_default(bt, n_in, n_out, jnp.bfloat16)
  assert n_out % cfg.block_out and cfg.split_out > 1, cfg
  out = pk.fused_wgrad_update(x, dy, w, slots, pack_host(rule, VALUES),
                              rule=rule, interpret=True, config=cfg)
  jax.block_until_ready(out)
  assert stores, "no scale store recorded"
  assert all(masked or end <= n_sc for masked, end in stores), (cfg, stores)


@pytest.mark.gpu
@pytest.mark.parametrize("kinds,w_dtype,sr,backend,bt,n_out", [
    (("int8", "int8"), jnp.float32, False, None, 512, 384),
    (("fp8_e4m3", "fp8_e4m3"), jnp.bfloat16, True, None, 512, 384),
    (("int8", "int8"), jnp.float32, False, "mosaic_gpu", 512, 384),
    # A tile past the weight's edge (130 outputs): the default tilings for
    # a bf16 weight have sub-tiles wholly beyond it.
    (("int8", "int8"), jnp.bfloat16, False, None, 512, 130),
    (("int8", "int8"), jnp.bfloat16, False, None, 2048, 130),
], ids=["int8", "fp8-sr", "int8-mosaic", "int8-ragged-512",
        "int8-ragged-2048"])
def test_compiled_fused_kernel_matches_reference_on_gpu(kinds, w_dtype, sr,
                                                        backend, bt, n_out):
  """The fused kernel compiled (bf16 operands; the Triton kernel, or the
  Mosaic GPU kernel asked for by name) against the reference: weights
  fp32-tight (bf16: rare rounding flips), scales within fp32 rounding,
  codes equal but where the compiled fp32 update (approximate division,
  fused multiply-adds) moves a value across a rounding boundary (at most
  one code step, in under 1% of elements)."""
  rng = np.random.default_rng(2)
  n_in = 256
  x = rng.standard_normal((bt, n_in)).astype(jnp.bfloat16)
  dy = rng.standard_normal((bt, n_out)).astype(jnp.bfloat16)
  w = rng.standard_normal((n_in, n_out)).astype(w_dtype)
  rule = pk.ADAMW
  slots = quantized_slots(moments(3, (n_in, n_out), rule), kinds, rule)
  h = pack_host(rule, VALUES)
  kw = dict(rule=rule, stochastic_rounding=(1, 2) if sr else None)
  got = jax.jit(lambda *a: pk.fused_wgrad_update(
      *a, interpret=False, backend=backend, **kw))(x, dy, w, slots, h)
  ref = jax.jit(lambda *a: pk.fused_wgrad_update_reference(*a, **kw))(
      x, dy, w, slots, h)
  w_got = np.asarray(got[0], np.float32)
  w_ref = np.asarray(ref[0], np.float32)
  if w_dtype == jnp.float32:
    assert np.linalg.norm(w_got - w_ref) <= tol(jnp.float32) * np.linalg.norm(
        w_ref)
  else:  # rounding nearly equal fp32 values to bf16: rare flips
    assert (bits(got[0]) != bits(ref[0])).mean() < 0.01
  whole = n_out // 64  # scale columns of whole 64-element blocks
  for (gq, gs), (rq, rs), k in zip(got[1], ref[1], kinds):
    # G summed in another order: the block maxima differ at fp32 rounding
    # of G, amplified where a moment is a small difference; a ragged last
    # block's maximum is over a few entries (RAGGED_SCALE_RTOL).
    gs, rs = np.asarray(gs), np.asarray(rs)
    np.testing.assert_allclose(gs[:, :whole], rs[:, :whole],
                               rtol=tol(jnp.float32))
    np.testing.assert_allclose(gs[:, whole:], rs[:, whole:],
                               rtol=RAGGED_SCALE_RTOL)
    a = np.asarray(gq).astype(np.float32)
    b = np.asarray(rq).astype(np.float32)
    if k == "int8":
      steps = np.abs(a - b)
    else:  # neighbouring fp8 codes are one bit pattern apart
      steps = np.abs(bits(gq).astype(np.int32) - bits(rq).astype(np.int32))
    assert steps.max() <= 1 and (steps > 0).mean() < 0.01, k


@pytest.mark.gpu
def test_compiled_mosaic_int8_special_blocks_on_gpu():
  """The compiled Mosaic GPU int8 epilogue (codes rounded by a float add
  and read from its bits; bit-exact on the CPU in tests/test_quant.py) on
  the blocks its selects handle: a NaN row of G (every block bad), a row
  whose G squared overflows (v's blocks bad, m's live) and a zero row over
  zero moments (dead blocks). Those blocks' scales and codes equal the
  reference's exactly; the other blocks as in the test above."""
  n_in, n_out = 256, 384
  x, dy = exact_operands(5, (512,), n_in, n_out)  # G's row 0 is zero
  x[:, 1:3] = 0.0
  x[7, 1] = np.nan      # G's row 1: NaN
  x[3, 2] = 2.0 ** 70   # G's row 2: finite, its square past fp32's range
  x, dy = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
  rule = pk.ADAMW
  values = moments(6, (n_in, n_out), rule)
  for v in values:
    v[0] = 0.0
  slots = quantized_slots(values, ("int8", "int8"), rule)
  w = np.random.default_rng(6).standard_normal((n_in, n_out)).astype(
      np.float32)
  h = pack_host(rule, VALUES)
  got = jax.jit(lambda *a: pk.fused_wgrad_update(
      *a, rule=rule, interpret=False, backend="mosaic_gpu"))(
          x, dy, w, slots, h)
  ref = jax.jit(lambda *a: pk.fused_wgrad_update_reference(*a, rule=rule))(
      x, dy, w, slots, h)
  w_got, w_ref = np.asarray(got[0]), np.asarray(ref[0])
  np.testing.assert_array_equal(np.isnan(w_got), np.isnan(w_ref))
  assert np.isnan(w_ref[1]).all() and np.isfinite(w_ref[2]).all()
  live = ~np.isnan(w_ref)
  assert np.linalg.norm(w_got[live] - w_ref[live]) <= tol(
      jnp.float32) * np.linalg.norm(w_ref[live])
  (mq, ms), (vq, vs) = got[1]
  (rmq, rms), (rvq, rvs) = ref[1]
  special = {"m": [0, 1], "v": [0, 1, 2]}
  for name, q, sc, rq, rsc in [("m", mq, ms, rmq, rms), ("v", vq, vs, rvq,
                                                            rvs)]:
    rows = special[name]
    q, sc, rq, rsc = (np.asarray(a) for a in (q, sc, rq, rsc))
    np.testing.assert_array_equal(bits(sc[rows]), bits(rsc[rows]),
                                  err_msg=name)
    np.testing.assert_array_equal(q[rows], rq[rows], err_msg=name)
    assert (q[rows] == 0).all(), name
    assert np.isnan(sc[1]).all() and (sc[0] == 0).all(), name
    rest = np.setdiff1d(np.arange(n_in), rows)
    np.testing.assert_allclose(sc[rest], rsc[rest], rtol=tol(jnp.float32))
    steps = np.abs(q[rest].astype(np.int32) - rq[rest].astype(np.int32))
    assert steps.max() <= 1 and (steps > 0).mean() < 0.01, name
  assert np.isfinite(np.asarray(ms)[2]).all()  # m's row 2 stays live
  assert np.isnan(np.asarray(vs)[2]).all()


def test_nnx_optimizer_keeps_quantized_state():
  """forge_jax.nnx: the same transform drives an NNX model (its state as
  NNX holds it); the kernels' moments stay quantized and the loss falls."""
  import forge_jax.nnx  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.a = forge_jax.nnx.Linear(64, 128, rngs=rngs)
      self.b = forge_jax.nnx.Linear(128, 8, rngs=rngs)

    def __call__(self, x):
      return self.b(jax.nn.relu(self.a(x)))

  model = Model(nnx.Rngs(0))
  opt = forge_jax.nnx.Optimizer(
      model, forge_jax.adamw(1e-2, moments="int8"), wrt=nnx.Param)
  step = forge_jax.nnx.make_step(
      lambda m, x, y: ((m(x) - y) ** 2).mean())
  train_step = nnx.jit(lambda m, o, x, y: step(m, o, x, y))
  x = jax.random.normal(jax.random.key(0), (32, 64))
  y = jax.random.normal(jax.random.key(1), (32, 8))
  losses = [float(train_step(model, opt, x, y)) for _ in range(3)]
  assert losses[2] < losses[0]
  # (NNX holds a Quantized pair as a State {"q", "scale"}.) Layer a's
  # kernel (8192 elements): int8 codes and per-block scales, for mu and nu.
  leaves = [(a.shape, a.dtype) for a in jax.tree.leaves(nnx.state(opt))]
  assert leaves.count(((64, 128), jnp.int8)) == 2
  assert leaves.count(((64, 2), jnp.float32)) == 2
