"""The one per-dtype tolerance table every numerical test reads.

Errors are relative norms, ``||actual - expected|| / ||expected||``, of whole
arrays. fp32 parity with the reference optimizer is the project's bar (1e-5);
bf16 storage rounds each stored value to 8 mantissa bits (relative 2**-9), and
a changed summation order can flip that rounding, so bf16 comparisons of
stored values allow a few ulps.
"""

import jax.numpy as jnp
import numpy as np

TOLERANCES = {
    # float64 (x64 on): the deferred path keeps wide gradients; 2**-52 per
    # value, with room for a changed summation order over small arrays.
    jnp.dtype(jnp.float64): 1e-12,
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 1.6e-2,  # 2**-9 per value, a few ulps of slack
    jnp.dtype(jnp.float16): 4e-3,
}


# Stored 16-bit values computed in fp32 by two summation orders: the fp32
# values differ far less than one 16-bit ulp of the operands (the old value,
# the new ones), so their roundings are at most this many such ulps apart,
# element by element.
ULPS = {
    jnp.dtype(jnp.bfloat16): 1,
    jnp.dtype(jnp.float16): 1,
}


# A step sharded over devices against the same step on one device (fp32):
# the same arithmetic but for the order of the sums XLA splits across the
# devices (tests/test_distributed.py).
SHARDED_RTOL = 1e-6


# The relative error of a *derived* fp32 value that cancels: a training
# run's last loss, a small residual of the first, amplifies the parameters'
# relative error (checked at tol(float32)) by about first / last loss. Used
# for that one number only; the parameters and states keep tol(float32).
RESIDUAL_LOSS_RTOL = 1e-4


# The scale of a quantized moment's ragged last block (a few elements) in a
# compiled kernel against the reference: the maximum over those few moments
# keeps the relative error a changed summation order leaves in a G whose
# terms cancel (1e-5 to 1e-4 seen), where a whole block's maximum is a
# large, well-conditioned entry (tol(float32)). Far below one int8 code
# step (1/127) of the block.
RAGGED_SCALE_RTOL = 1e-3


# Stochastic rounding to bf16 is unbiased: the mean error of 1e5 rounded
# samples of one value stays within this of zero (an acceptance criterion;
# tests/test_quant.py picks values whose nearest rounding errs by >= 10x it).
SR_MEAN_ATOL = 3e-5


def tol(dtype) -> float:
  """The relative tolerance for values stored in ``dtype``."""
  return TOLERANCES[jnp.dtype(dtype)]


def rel_err(actual, expected) -> float:
  a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  if a.shape != e.shape:
    raise AssertionError(f"shape {a.shape} != expected {e.shape}")
  denom = np.linalg.norm(e)
  return float(np.linalg.norm(a - e) / (denom if denom > 0 else 1.0))


def assert_close(actual, expected, rtol=None, what="value"):
  """Asserts a relative-norm match; reports how many elements differ, and where."""
  rtol = tol(jnp.asarray(actual).dtype) if rtol is None else rtol
  err = rel_err(actual, expected)
  if not np.isfinite(err) or err > rtol:
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    diff = np.abs(a - e)
    bad = diff > rtol * (np.abs(e) + np.abs(e).mean() + 1e-30)
    worst = np.unravel_index(np.argmax(diff), diff.shape) if diff.size else ()
    raise AssertionError(
        f"{what}: relative error {err:.3g} > {rtol:.3g}; {int(bad.sum())} of "
        f"{diff.size} elements off; worst at {tuple(int(i) for i in worst)}: "
        f"{a[worst] if diff.size else None} vs {e[worst] if diff.size else None}")


def assert_trees_close(actual, expected, rtol=None, what="tree"):
  """`assert_close` on every leaf; names the leaf path of the first failure."""
  import jax
  a_leaves = jax.tree_util.tree_flatten_with_path(actual)[0]
  e_leaves, e_def = jax.tree_util.tree_flatten(expected)
  assert len(a_leaves) == len(e_leaves), (
      f"{what}: {len(a_leaves)} leaves vs {len(e_leaves)} expected")
  for (path, a), e in zip(a_leaves, e_leaves):
    assert_close(a, e, rtol, what=f"{what}{jax.tree_util.keystr(path)}")


def worst_leaf(actual, expected):
  """(relative error, key path) of the worst floating leaf of two trees.

  Integer leaves (step counts) must be equal and the tree structures, shapes
  and dtypes identical; a non-finite error fails at once.
  """
  import jax
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  worst = (0.0, "")
  for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual),
                          jax.tree.leaves(expected)):
    where = jax.tree_util.keystr(path)
    assert a.dtype == e.dtype and a.shape == e.shape, where
    if jnp.issubdtype(a.dtype, jnp.floating):
      err = rel_err(a, e)
      assert np.isfinite(err), f"{where}: not finite"
      worst = max(worst, (err, where))
    else:
      np.testing.assert_array_equal(a, e, err_msg=where)
  return worst


def assert_update_close(new, expected, old, what="value"):
  """The step itself, ``new - old``, against ``expected - old``: an error in
  the update can hide under the tolerance of the whole array when the update
  is small against the values. fp32 (and wider): relative norm of the
  updates. 16-bit storage: every element within ``ULPS`` ulps -- at the
  largest of its old, new and expected magnitudes, as a cancelling update
  (``b1 * m + (1 - b1) * g`` near 0) is only that exact -- of the expected
  one (the update may be a few ulps, so a relative norm would be too coarse)."""
  dtype = jnp.asarray(new).dtype
  n = np.asarray(jnp.asarray(new, jnp.float32), np.float64)
  e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  o = np.asarray(jnp.asarray(old, jnp.float32), np.float64)
  if jnp.dtype(dtype) not in ULPS:
    assert_close(n - o, e - o, tol(dtype), what=f"{what} update")
    return
  finfo = jnp.finfo(dtype)
  mag = np.maximum(np.maximum(np.abs(n), np.abs(e)), np.abs(o))
  # One ulp at each element's magnitude (subnormals: the smallest step).
  ulp = np.maximum(np.exp2(np.floor(np.log2(np.maximum(mag, finfo.tiny)))
                           - finfo.nmant), float(finfo.smallest_subnormal))
  off = np.abs(n - e) > ULPS[jnp.dtype(dtype)] * ulp
  if off.any():
    worst = np.unravel_index(np.argmax(np.abs(n - e) / ulp), n.shape)
    raise AssertionError(
        f"{what}: {int(off.sum())} of {off.size} elements more than "
        f"{ULPS[jnp.dtype(dtype)]} ulp from the expected value; worst at "
        f"{tuple(int(i) for i in worst)}: {n[worst]} vs {e[worst]} (old "
        f"{o[worst]})")
