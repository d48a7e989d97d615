"""The low-precision state reference (pallas_kernels.quant): blocked int8 and
fp8 moments, and stochastic rounding to bf16.

The codes are checked bit for bit against a NumPy transcription of the
arithmetic the module documents (NumPy keeps subnormals, XLA on the CPU
flushes them: agreeing shows the documented threshold makes that moot), and
against the error bounds the formats promise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import quant
from pallas_kernels.quant import MomentFormat, Quantized
from tests.tolerances import SR_MEAN_ATOL

KINDS = quant.KINDS
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
NP_DTYPE = {"int8": np.int8, "fp8_e4m3": jnp.float8_e4m3fn,
            "fp8_e5m2": jnp.float8_e5m2}
# (mantissa bits, smallest normal exponent) of the fp8 formats.
FP8 = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}
BLOCK = 64
# Values exactly halfway between two codes (in a block whose absmax is QMAX,
# so x * r == x) and the codes they round to, half to even.
TIES = {
    "int8": ([2.5, 3.5, -0.5, -2.5, 0.5, -126.5], [2, 4, 0, -2, 0, -126]),
    "fp8_e4m3": ([1.0625, -1.1875, 3 * 2.0 ** -10, 2.0 ** -10,
                  -5 * 2.0 ** -10, 1.5],
                 [1.0, -1.25, 2.0 ** -8, 0.0, -2.0 ** -8, 1.5]),
    "fp8_e5m2": ([1.125, -1.375, 3 * 2.0 ** -17, 2.0 ** -17, -5 * 2.0 ** -17,
                  1.5],
                 [1.0, -1.5, 2.0 ** -15, 0.0, -2.0 ** -15, 1.5]),
}


def np_quantize(x, kind, second=False, v_floor=1):
  """The module docstring's steps 1-7, in NumPy float32."""
  x = np.asarray(x, np.float32)
  out = x.shape[-1]
  nb = -(-out // BLOCK)
  xb = np.zeros(x.shape[:-1] + (nb * BLOCK,), np.float32)
  xb[..., :out] = x
  xb = xb.reshape(x.shape[:-1] + (nb, BLOCK))
  bad = ~np.isfinite(xb).all(-1, keepdims=True)
  if second:
    xb = np.where(xb > 0, xb, np.float32(0))
  with np.errstate(invalid="ignore", over="ignore"):
    a = np.where(np.isfinite(xb), np.abs(xb), np.float32(0)).max(
        -1, keepdims=True)
    live = ~bad & (a >= np.float32(2.0 ** -90))
    qmax = np.float32(QMAX[kind])
    scale = np.where(live, a * np.float32(1 / QMAX[kind]), np.float32(0))
    scale = np.where(bad, np.float32(np.nan), scale)
    r = qmax / np.where(live, a, np.float32(1))
    y = np.where(live, np.clip(xb * r, -qmax, qmax), np.float32(0))
  if second and v_floor:
    if kind == "int8":
      f = np.float32(v_floor)
    else:
      f = np.array(v_floor, np.uint8).view(NP_DTYPE[kind]).astype(np.float32)
    y = np.where(live, np.maximum(y, f), np.float32(0))
  if kind == "int8":
    q = np.rint(y).astype(np.int8)
  else:
    q = y.astype(NP_DTYPE[kind])
    q = np.where(q.astype(np.float32) == 0, np.zeros((), q.dtype), q)
  q = q.reshape(x.shape[:-1] + (nb * BLOCK,))[..., :out]
  return q, scale[..., 0]


def bits(a):
  """Bit patterns, so that nan == nan and -0.0 != 0.0."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def moments(kind, seed):
  """(3, 2, 200) moments: 4 blocks per row (the last 8 wide) at magnitudes
  from 2**-60 to 2**60, and blocks that exercise each documented case."""
  rng = np.random.default_rng(seed)
  mag = np.exp2(rng.uniform(-60, 60, (3, 2, 4, 1)))
  x = (rng.standard_normal((3, 2, 4, BLOCK)) * mag).astype(np.float32)
  # Within-block spread: some entries many orders smaller.
  x *= np.exp2(-rng.integers(0, 24, x.shape) * (rng.random(x.shape) < 0.3))
  x = x.reshape(3, 2, 4 * BLOCK)[..., :200].copy()
  x[0, 0, 0:64] = 0.0                                     # zero block
  x[0, 1, 0:64] = rng.standard_normal(64) * 1e-29         # below 2**-90
  x[1, 0, 64:128] = rng.standard_normal(64) * 1e-41       # subnormals only
  x[1, 1, 64:80] = rng.standard_normal(16) * 1e-40        # subnormals in a
  x[1, 1, 80] = 3.0                                       # live block
  x[1, 1, 81:84] = [-0.0, -1e-12, 1e-12]                  # tiny, signed zero
  x[2, 0, 0:64] = 0.0                                     # ties: r == 1
  x[2, 0, 0] = QMAX[kind]
  x[2, 0, 1:7] = TIES[kind][0]
  x[2, 1, 64:128] = rng.standard_normal(64)
  x[2, 1, 70] = np.nan                                    # diverged blocks
  x[2, 1, 192] = -np.inf                                  # (partial block)
  return x


@pytest.mark.parametrize("kind", KINDS)
def test_codes_follow_the_documented_arithmetic_bit_for_bit(kind):
  fmt = MomentFormat(kind)
  x = moments(kind, 0)
  v = np.where(x == x, np.abs(x) ** 2, x).astype(np.float32)  # keeps nan, inf
  v[0, 0, 64:70] = [-1.0, -0.0, 0.0, -1e-30, 2.0, -np.inf]  # a bad block too
  cases = [(x, False, 1), (v, True, 1), (v, True, 0), (v, True, 3)]
  f = jax.jit(quant.quantize, static_argnums=1,
              static_argnames="second_moment")
  for data, second, v_floor in cases:
    fmt_c = MomentFormat(kind, v_floor=v_floor)
    got = f(data, fmt_c, second_moment=second)
    q_ref, s_ref = np_quantize(data, kind, second, v_floor)
    assert isinstance(got, Quantized)
    assert got.q.dtype == fmt.dtype == np.dtype(NP_DTYPE[kind])
    assert got.q.shape == data.shape
    assert got.scale.dtype == np.float32 and got.scale.shape == (3, 2, 4)
    np.testing.assert_array_equal(bits(got.q), bits(q_ref),
                                  err_msg=f"codes, second={second}")
    np.testing.assert_array_equal(bits(got.scale), bits(s_ref),
                                  err_msg=f"scales, second={second}")
  # The ties of block (2, 0) (absmax == QMAX, so r == 1): half to even.
  q = np.asarray(f(x, fmt).q[2, 0, :7]).astype(np.float32)
  expected = [QMAX[kind]] + TIES[kind][1]
  np.testing.assert_array_equal(q, np.float32(expected))


def test_mosaic_epilogue_quantizer_gives_the_same_bits():
  """The Mosaic GPU epilogue's int8 quantizer (one block per row of a
  sub-tile, one reduction per row) against the documented arithmetic, on
  the same special blocks: zero, tiny, subnormal, ties, NaN, -inf, negative
  second moments; each v_floor."""
  from pallas_kernels import mosaic_kernel
  x = moments("int8", 3)[..., :192].reshape(-1, BLOCK)
  # Blocks whose entries are +-absmax or a ulp below it, at random absmax
  # (x * r lands at or a rounding above qmax: the codes must stay 127).
  rng = np.random.default_rng(4)
  m = np.exp2(rng.uniform(-80, 80, (40, 1))).astype(np.float32)
  edge = m * rng.choice([-1.0, 1.0], (40, BLOCK)).astype(np.float32)
  edge[:, 1::3] = np.nextafter(edge[:, 1::3], np.float32(0))
  x = np.concatenate([x, edge]).astype(np.float32)
  with np.errstate(over="ignore"):  # the largest square to inf: bad blocks
    v = np.where(x == x, np.abs(x) ** 2, x).astype(np.float32)
  v[0, 0:6] = [-1.0, -0.0, 0.0, -1e-30, 2.0, -np.inf]  # a bad block
  v[3, 0:3] = [-1.0, -0.0, 4.0]                        # negatives, live
  assert v[3, 3:].min() >= 0 and np.isfinite(v[3]).all()
  for data, second, v_floor in [(x, False, 1), (v, True, 1), (v, True, 0),
                                (v, True, 3)]:
    fmt = MomentFormat("int8", v_floor=v_floor)
    q, s = jax.jit(mosaic_kernel._quantize_rows, static_argnums=(1, 2))(
        jnp.asarray(data), fmt, second)
    q_ref, s_ref = np_quantize(data, "int8", second, v_floor)
    np.testing.assert_array_equal(bits(q), bits(q_ref),
                                  err_msg=f"codes, second={second}")
    np.testing.assert_array_equal(bits(s), bits(s_ref.reshape(-1)),
                                  err_msg=f"scales, second={second}")
  assert np.isnan(np.asarray(s)).any() and (np.asarray(s) == 0).any()


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_bounds_and_special_blocks(kind):
  fmt = MomentFormat(kind)
  x = moments(kind, 1)
  qx = quant.quantize(x, fmt)
  d = np.asarray(quant.dequantize(qx, fmt), np.float64)
  s = np.repeat(np.asarray(qx.scale, np.float64), BLOCK, -1)[..., :200]
  a = s * QMAX[kind] / (1 - 2.0 ** -23)  # >= the block's absmax
  x64 = x.astype(np.float64)
  ok = np.isfinite(s) & (s > 0)
  assert ok.sum() > 0.7 * ok.size  # all but the special blocks
  if kind == "int8":
    bound = s / 2 + 2.0 ** -21 * a
  else:
    mant, emin = FP8[kind]
    t = np.where(ok, np.abs(x64) / np.where(ok, s, 1), 1) * (1 + 2.0 ** -20)
    ulp = np.exp2(np.maximum(np.floor(np.log2(np.maximum(t, 1e-300))), emin)
                  - mant)
    bound = s * ulp / 2 + 2.0 ** -21 * a
  err = np.abs(d - x64)
  assert (err[ok] <= bound[ok]).all(), np.max((err - bound)[ok])
  # Negative and positive values keep their sign (or become +0).
  q = np.asarray(qx.q).astype(np.float32)
  assert (np.sign(q[ok]) * np.sign(x[ok]) >= 0).all()
  assert (q[ok & (x > 0)] >= 0).all() and (q[ok & (x < 0)] <= 0).all()
  assert (q[ok & (x < 0)] < 0).any() and (q[ok & (x > 0)] > 0).any()
  # Each live block's largest magnitude takes the largest code.
  blocks = np.pad(np.abs(q), [(0, 0), (0, 0), (0, 56)]).reshape(3, 2, 4, 64)
  live = np.isfinite(np.asarray(qx.scale)) & (np.asarray(qx.scale) > 0)
  np.testing.assert_array_equal(blocks.max(-1)[live], QMAX[kind])
  # Special blocks: zeros and below 2**-90 -> scale 0, q +0, values 0;
  # a nan or inf anywhere -> scale nan, q +0, the whole block nan.
  sc = np.asarray(qx.scale)
  for r, c, blk in [(0, 0, 0), (0, 1, 0), (1, 0, 1)]:
    assert sc[r, c, blk] == 0
    assert (bits(qx.q)[r, c, blk * 64:blk * 64 + 64] == 0).all()
    assert (d[r, c, blk * 64:blk * 64 + 64] == 0).all()
  for c, blk in [(1, 1), (1, 3)]:
    assert np.isnan(sc[2, c, blk])
    assert (bits(qx.q)[2, c, blk * 64:blk * 64 + 64] == 0).all()
    assert np.isnan(d[2, c, blk * 64:min(blk * 64 + 64, 200)]).all()
  # Up to fp32's largest value, finite moments stay finite.
  top = np.arange(0x7F7FFFFF - 4095, 0x7F80_0000, dtype=np.uint32)
  xt = np.zeros((4096, 64), np.float32)
  xt[:, 0], xt[:, 1] = top.view(np.float32), -top.view(np.float32) / 3
  dt = np.asarray(quant.dequantize(quant.quantize(xt, fmt), fmt))
  assert np.isfinite(dt).all()
  assert (np.abs(dt[:, 0] - xt[:, 0]) <= 2.0 ** -21 * xt[:, 0]).all()
  # The subnormals of a live block (flushed or not) store +0.
  assert (bits(qx.q)[1, 1, 64:80] == 0).all() and bits(qx.q)[1, 1, 81] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_column_tiles_give_the_same_bits(kind):
  """Quantizing 64-aligned column tiles (the last one partial) separately
  gives the whole array's codes and scales: nothing reduces past a block."""
  fmt = MomentFormat(kind)
  rng = np.random.default_rng(2)
  x = (rng.standard_normal((2, 7, 300)) * np.exp2(
      rng.uniform(-30, 30, (2, 7, 300)))).astype(np.float32)
  v = (x * x).astype(np.float32)
  for data, second in [(x, False), (v, True)]:
    whole = quant.quantize(data, fmt, second_moment=second)
    tiles = [quant.quantize(data[..., c0:c1], fmt, second_moment=second)
             for c0, c1 in [(0, 128), (128, 192), (192, 256), (256, 300)]]
    np.testing.assert_array_equal(
        bits(whole.q), bits(np.concatenate([t.q for t in tiles], -1)))
    np.testing.assert_array_equal(
        bits(whole.scale), bits(np.concatenate([t.scale for t in tiles], -1)))
  # The per-block function on a (rows, k, block) view of a tile: the same.
  q_b, s_b = quant.quantize_blocks(x[0, :, :256].reshape(7, 4, 64), fmt)
  whole = quant.quantize(x[0], fmt)
  np.testing.assert_array_equal(bits(q_b.reshape(7, 256)),
                                bits(whole.q[:, :256]))
  np.testing.assert_array_equal(bits(s_b), bits(whole.scale[:, :4]))
  np.testing.assert_array_equal(
      bits(quant.dequantize_blocks(q_b, s_b).reshape(7, 256)),
      bits(quant.dequantize(whole, fmt)[:, :256]))


@pytest.mark.parametrize("kind", KINDS)
def test_second_moment_is_nonnegative_and_floored(kind):
  rng = np.random.default_rng(3)
  # Within each block, entries 2**-40 .. 1 times the block's scale: most
  # would round to zero without the floor.
  v = np.exp2(rng.uniform(-40, 0, (8, 192)) + rng.uniform(-20, 20, (8, 1)))
  v = v.astype(np.float32)
  v[:, ::17] *= -1.0   # negative (invalid) entries are stored as +0 ...
  v[:, 5] = -0.0       # ... then floored like any other small entry
  fmt = MomentFormat(kind)
  qv = quant.quantize(v, fmt, second_moment=True)
  d = np.asarray(quant.dequantize(qv, fmt))
  s = np.repeat(np.asarray(qv.scale), 64, -1)
  qf = np.asarray(qv.q).astype(np.float32)
  assert (s > 0).all()
  assert (bits(qv.q) >= 1).all() and (qf > 0).all()  # sign bit clear, >= 1
  floor = 1.0 if kind == "int8" else 2.0 ** (-9 if kind == "fp8_e4m3" else -16)
  assert fmt.floor_value == floor
  assert qf.min() == floor and (qf[v <= 0] == floor).all()
  assert (d >= floor * s * (1 - 2.0 ** -23)).all()
  # Never below 2/3 of the fp32 value (up to fp32 rounding): 1/sqrt(v)
  # grows by at most sqrt(3/2).
  pos = v > 0
  assert (d[pos] >= (2 / 3) * v[pos] * (1 - 2.0 ** -20)).all()
  # Without the floor, the same moment stores zeros (what the floor is for);
  # a floor of 3 codes stores at least the third positive code.
  q0 = quant.quantize(v, MomentFormat(kind, v_floor=0), second_moment=True)
  assert (np.asarray(q0.q).astype(np.float32)[pos] == 0).mean() > 0.1
  assert (bits(q0.q)[v <= 0] == 0).all()
  q3 = quant.quantize(v, MomentFormat(kind, v_floor=3), second_moment=True)
  assert (bits(q3.q) >= 3).all() and (bits(q3.q) == 3).any()


def test_format_checks_and_policy():
  with pytest.raises(ValueError, match="kind 'int4'"):
    MomentFormat("int4")
  with pytest.raises(ValueError, match="block=48.*power of two"):
    MomentFormat(block=48)
  with pytest.raises(ValueError, match="v_floor=128.*between 0"):
    MomentFormat(v_floor=128)
  with pytest.raises(ValueError, match="v_floor=127.*123"):
    MomentFormat("fp8_e5m2", v_floor=127)
  with pytest.raises(ValueError, match="float64|int32"):
    quant.quantize(np.ones((4, 64), np.int32), MomentFormat())
  fmt = MomentFormat()
  qx = quant.quantize(np.ones((4, 70), np.float32), fmt)
  with pytest.raises(ValueError, match="stores float8_e4m3fn"):
    quant.dequantize(qx, MomentFormat("fp8_e4m3"))
  with pytest.raises(ValueError, match=r"need float32\[4, 2\]"):
    quant.dequantize(Quantized(qx.q, qx.scale[:, :1]), fmt)
  # bf16 is widened exactly: the same codes as its fp32 values.
  xb = jnp.linspace(-3, 5, 4 * 70, dtype=jnp.bfloat16).reshape(4, 70)
  np.testing.assert_array_equal(
      quant.quantize(xb, fmt).q, quant.quantize(xb.astype(np.float32), fmt).q)
  # Tiny weights (biases) keep float moments; the scale counts blocks.
  assert not fmt.quantizes((64, 63)) and fmt.quantizes((64, 64))
  assert fmt.quantizes((4096,)) and not fmt.quantizes((4095,))
  assert fmt.scale_shape((3, 5, 129)) == (3, 5, 3)
  assert [MomentFormat(k).inv_qmax for k in KINDS] == [
      float(np.float32(1 / QMAX[k])) for k in KINDS]


# --- stochastic rounding ----------------------------------------------------

ULP = 2.0 ** -9  # bf16's ulp on [0.25, 0.5)


def test_stochastic_rounding_is_unbiased():
  """1e5 samples per value, over element indices and over steps: the mean
  error is within SR_MEAN_ATOL of zero, for values that round-to-nearest
  misses by 10x that or more."""
  base = np.float32(0.3125)  # on the bf16 grid
  fracs = np.array([0.2, 0.37, 0.5, 0.81])
  xs = np.concatenate([base + fracs * ULP, -(base + fracs * ULP)])
  xs = xs.astype(np.float32)
  rne_err = xs.astype(jnp.bfloat16).astype(np.float64) - xs
  assert (np.abs(rne_err) >= 10 * SR_MEAN_ATOL).all()
  n = 100_000
  idx = jnp.arange(n, dtype=jnp.uint32)
  over_index = jax.jit(jax.vmap(
      lambda x: quant.stochastic_round_to_bf16(jnp.full((n,), x), 7, 3, idx)))
  over_step = jax.jit(jax.vmap(
      lambda x: jax.vmap(lambda s: quant.stochastic_round_to_bf16(
          x, 7, s, jnp.uint32(12345)))(jnp.arange(n))))
  for samples in (over_index(xs), over_step(xs)):
    r = np.asarray(samples).astype(np.float64)
    lo = np.trunc(xs / ULP) * ULP  # the two neighbours (magnitude-wise)
    assert ((np.abs(r - lo[:, None]) == 0) |
            (np.abs(r - lo[:, None]) == ULP)).all()
    mean_err = r.mean(1) - xs
    assert (np.abs(mean_err) <= SR_MEAN_ATOL).all(), mean_err
    # Rounds up (in magnitude) with probability frac, within 5 sigma.
    up = (np.abs(r) > np.abs(xs)[:, None]).mean(1)
    f = np.tile(fracs, 2)
    assert (np.abs(up - f) <= 5 * np.sqrt(f * (1 - f) / n)).all()


def test_stochastic_rounding_is_deterministic_per_seed_step_index():
  x = jnp.full((64, 128), np.float32(0.3125 + 0.5 * ULP))
  idx = quant.global_index(x.shape)
  sr = jax.jit(quant.stochastic_round_to_bf16)
  a = sr(x, 1, 10, idx)
  np.testing.assert_array_equal(bits(a), bits(sr(x, 1, 10, idx)))
  for other in (sr(x, 1, 11, idx), sr(x, 2, 10, idx)):
    assert 0.4 < float(jnp.mean(a != other)) < 0.6
  h = quant.counter_hash(1, 10, idx)
  assert h.dtype == jnp.uint32
  assert float(jnp.mean(h != quant.counter_hash(1, 11, idx))) > 0.999
  # Seeds and steps are taken modulo 2**32, traced or not.
  np.testing.assert_array_equal(
      quant.counter_hash(-1, 2 ** 32 + 5, idx),
      jax.jit(quant.counter_hash)(jnp.uint32(2 ** 32 - 1), jnp.int32(5), idx))


def test_stochastic_rounding_tile_by_tile_with_global_indices():
  """A stack (2, 24, 200) rounded whole, and tile by tile (row tiles of
  stacked layers, column tiles) with global indices: the same bits."""
  rng = np.random.default_rng(4)
  x = rng.standard_normal((2, 24, 200)).astype(np.float32)
  whole = quant.stochastic_round_to_bf16(x, 3, 9, quant.global_index(x.shape))
  out = np.zeros(x.shape, jnp.bfloat16)
  for layer in range(2):
    for i0 in (0, 8, 16):
      for c0, c1 in [(0, 64), (64, 192), (192, 200)]:
        idx = quant.global_index((8, c1 - c0), layer * 24 + i0, c0, 200)
        out[layer, i0:i0 + 8, c0:c1] = quant.stochastic_round_to_bf16(
            x[layer, i0:i0 + 8, c0:c1], 3, 9, idx)
  np.testing.assert_array_equal(bits(whole), bits(out))
  np.testing.assert_array_equal(
      quant.global_index((2, 3), 4, 5, 10),
      np.array([[45, 46, 47], [55, 56, 57]], np.uint32))
  with pytest.raises(ValueError, match="n_cols"):
    quant.global_index((2, 8), 0, 4, 10)
  with pytest.raises(ValueError, match="broadcast"):
    quant.stochastic_round_to_bf16(x, 0, 0, quant.global_index((24, 100)))


def test_stochastic_rounding_special_values():
  rng = np.random.default_rng(5)
  # Values already in bf16 (normal, subnormal, zeros, extremes) unchanged.
  exact = rng.standard_normal(512).astype(jnp.bfloat16).astype(np.float32)
  extremes = np.array([0.0, -0.0, np.inf, -np.inf, 2.0 ** -133, -2.0 ** -126,
                       float(jnp.finfo(jnp.bfloat16).max)], np.float32)
  exact = np.concatenate([exact, extremes])
  idx = jnp.arange(exact.size, dtype=jnp.uint32)
  for step in range(4):
    got = quant.stochastic_round_to_bf16(exact, 0, step, idx)
    np.testing.assert_array_equal(bits(got),
                                  bits(exact.astype(jnp.bfloat16)))
  # nan stays nan, whatever its payload (low-bit payloads would truncate to
  # inf, all-ones ones carry into the sign); signs are kept.
  nans = np.array([0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF],
                  np.uint32).view(np.float32)
  got = quant.stochastic_round_to_bf16(nans, 0, 0, jnp.arange(5))
  assert np.isnan(np.asarray(got, np.float32)).all()
  x = rng.standard_normal(4096).astype(np.float32)
  got = np.asarray(quant.stochastic_round_to_bf16(x, 0, 1, jnp.arange(4096)),
                   np.float32)
  assert (np.sign(got) == np.sign(x)).all()
  assert (np.abs(got - x) < np.abs(x) * 2.0 ** -7).all()
  big = np.array([np.uint32(0x7F7FFFFF).view(np.float32)] * 64)
  got = np.asarray(quant.stochastic_round_to_bf16(big, 0, 0, jnp.arange(64)),
                   np.float32)
  assert set(np.unique(got)) <= {float(jnp.finfo(jnp.bfloat16).max), np.inf}
  with pytest.raises(ValueError, match="float32"):
    quant.stochastic_round_to_bf16(x.astype(jnp.bfloat16), 0, 0,
                                   jnp.arange(4096))


def test_runs_inside_a_kernel_on_tiles():
  """The quantizer and the rounding run inside a Pallas kernel (interpret
  mode) on (8, 128) tiles, with traced offsets: the whole-array bits."""
  rng = np.random.default_rng(6)
  x = (rng.standard_normal((16, 256)) * np.exp2(
      rng.uniform(-8, 8, (16, 256)))).astype(np.float32)
  fmt = MomentFormat("fp8_e4m3")

  def body(x_ref, q_ref, s_ref, w_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    tile = x_ref[...]
    q, s = quant.quantize(tile, fmt, second_moment=True)
    q_ref[...], s_ref[...] = q, s
    idx = quant.global_index(tile.shape, i * 8, j * 128, 256)
    w_ref[...] = quant.stochastic_round_to_bf16(tile, 5, 6, idx)

  v = x * x
  q, s, w = pl.pallas_call(
      body, grid=(2, 2),
      in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j)),
                 pl.BlockSpec((8, 2), lambda i, j: (i, j)),
                 pl.BlockSpec((8, 128), lambda i, j: (i, j))],
      out_shape=[jax.ShapeDtypeStruct(v.shape, fmt.dtype),
                 jax.ShapeDtypeStruct((16, 4), jnp.float32),
                 jax.ShapeDtypeStruct(v.shape, jnp.bfloat16)],
      interpret=True)(v)
  ref = quant.quantize(v, fmt, second_moment=True)
  np.testing.assert_array_equal(bits(q), bits(ref.q))
  np.testing.assert_array_equal(bits(s), bits(ref.scale))
  np.testing.assert_array_equal(
      bits(w), bits(quant.stochastic_round_to_bf16(
          v, 5, 6, quant.global_index(v.shape))))


@pytest.mark.gpu
def test_gpu_reference_gives_the_cpu_bits():
  """The reference compiled for the GPU (its division, fp8 conversion and
  subnormal handling) gives the CPU's codes, scales and rounded bits."""
  gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
  x = np.concatenate([moments(k, 7) for k in KINDS], axis=0)
  idx = quant.global_index(x.shape)
  for kind in KINDS:
    fmt = MomentFormat(kind)
    for data, second in [(x, False), (np.abs(x) * x, True)]:
      fn = jax.jit(lambda d, fmt=fmt, second=second: quant.quantize(
          d, fmt, second_moment=second))
      on_gpu = fn(jax.device_put(data, gpu))
      on_cpu = fn(jax.device_put(data, cpu))
      np.testing.assert_array_equal(bits(on_gpu.q), bits(on_cpu.q))
      np.testing.assert_array_equal(bits(on_gpu.scale), bits(on_cpu.scale))
  sr = jax.jit(quant.stochastic_round_to_bf16)
  np.testing.assert_array_equal(
      bits(sr(jax.device_put(x, gpu), 3, 4, idx)),
      bits(sr(jax.device_put(x, cpu), 3, 4, idx)))
