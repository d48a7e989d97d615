"""Gradient accumulation (``forge_jax.MultiSteps``) against optax.

* K = 4 micro-batches through the 37 -> 70 -> 130 -> 5 MLP (fp32, odd widths),
  two full cycles (8 calls): after each cycle, params and ``tx``'s own state
  equal ONE optax step on the concatenated batch; after *every* call, the
  loss, params and state equal ``optax.MultiSteps`` (exact mode: the whole
  state, running-mean accumulators included); the weights do not move
  (bitwise) on non-final micro-steps. Exact mode: AdamW (schedule, weight-decay
  mask), centered RMSprop with momentum, LAMB and Muon (regime 2), Adafactor
  (regime 3), a ScannedDenseStack; momentum mode: SGD with momentum.
* A K schedule (a callable, as in optax), both modes.
* An inf in a non-final micro-batch: the documented difference from optax
  (FORGE's kernels unchanged until the cycle's last micro-step).
* The kernel: each wrapped rule in the fused kernel (interpret mode) equals
  ``fused_wgrad_update_reference`` on final and non-final micro-steps, and
  lowers for CUDA (one Triton kernel) without a GPU.
* Memory: exact mode holds one fp32 accumulator per kernel; momentum mode none.
* Refusals, each with its message.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import forge_jax
import pallas_kernels as pk
from pallas_kernels import rules
from tests.harness import (MLP, WIDTHS, lower_rule_for_cuda, reference_step,
                           triton_calls)
from tests.harness import decay_kernels_only as _decay_kernels_only
from tests.harness import mse as _mse
from tests.test_kernel import adamw_hparams, make_case
from tests.tolerances import assert_close, tol, worst_leaf

F32_TOL = tol(jnp.float32)
K = 4
CYCLES = 2
MICRO_BT = 12  # tokens per micro-batch; K of them make the 48-token batch


def _schedule(base):
  return optax.linear_schedule(base, base / 10, CYCLES)


# name -> (forge_jax family, optax transform, args, kwargs, mode)
VARIANTS = {
    "adamw_exact": ("adamw", optax.adamw, (_schedule(1e-2),),
                    dict(weight_decay=1e-2, mask=_decay_kernels_only),
                    "exact"),
    "rmsprop_centered_momentum_exact": (
        "rmsprop", optax.rmsprop, (_schedule(3e-3),),
        # (Not bias_correction: its first centered step divides by
        # nu_hat - mu_hat**2 = g**2 - g**2, which amplifies the rounding
        # difference between a mean of means and the batch gradient.)
        dict(centered=True, momentum=0.8), "exact"),
    "sgd_momentum_momentum": ("sgd", optax.sgd, (_schedule(5e-2),),
                              dict(momentum=0.9), "momentum"),
    "sgd_momentum_exact": ("sgd", optax.sgd, (_schedule(5e-2),),
                           dict(momentum=0.9), "exact"),
    "lamb_exact": ("lamb", optax.lamb, (_schedule(1e-2),),
                   dict(weight_decay=1e-2, mask=_decay_kernels_only), "exact"),
    "muon_exact": ("muon", optax.contrib.muon, (_schedule(2e-2),),
                   dict(weight_decay=1e-2,
                        weight_decay_mask=_decay_kernels_only), "exact"),
    "adafactor_exact": ("adafactor", optax.adafactor, (_schedule(1e-2),),
                        dict(min_dim_size_to_factor=32, momentum=0.9),
                        "exact"),
}


def _transforms(name, every_k=K):
  family, optax_fn, args, kwargs, mode = VARIANTS[name]
  inner = getattr(forge_jax, family)(*args, **kwargs)
  optax_tx = optax_fn(*args, **kwargs)
  return (forge_jax.MultiSteps(inner, every_k, mode=mode), optax_tx,
          optax.MultiSteps(optax_tx, every_k), mode)


@pytest.fixture(scope="module")
def data():
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  xs = jax.random.normal(kx, (CYCLES * K, MICRO_BT, WIDTHS[0]))
  ys = jax.random.normal(ky, (CYCLES * K, MICRO_BT, WIDTHS[-1]))
  variables = MLP(nn.Dense).init(kp, xs[0])
  return xs, ys, variables


def _comparable(state, mode, final):
  """The leaves of a MultiSteps state that optax.MultiSteps also has and
  that mean the same. Momentum mode holds no ``acc_grads``, and before a
  cycle's last micro-step its momentum holds the partial sum that optax
  keeps in ``acc_grads``."""
  if mode == "exact":
    return state
  if not final:
    return (state.mini_step, state.gradient_step)
  return (state.mini_step, state.gradient_step, state.inner_opt_state)


def _same_bits(a, b):
  return all(bool(jnp.all(x == y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _optax_runs(optax_tx, optax_ms, data, model, cycles, every_k):
  """optax.MultiSteps' loss, variables and state after every call, and one
  optax step per cycle on the concatenated batch: its variables and state
  after each cycle."""
  xs, ys, variables = data
  ms_step = jax.jit(reference_step(_mse(model(nn.Dense)),
                                   optax_ms.gradient_transformation()))
  one_step = jax.jit(reference_step(_mse(model(nn.Dense)), optax_tx))
  v_ms, s_ms = variables, optax_ms.init(variables["params"])
  v_one, s_one = variables, optax_tx.init(variables["params"])
  calls, cycle_ends, call = [], [], 0
  for cycle in range(cycles):
    first = call
    for _ in range(int(every_k(cycle))):
      l_ms, v_ms, s_ms = ms_step(v_ms, s_ms, (xs[call], ys[call]))
      calls.append((float(l_ms), v_ms, s_ms))
      call += 1
    # The cycle equals one optax step on the concatenated (equal-sized)
    # micro-batches: the mean of their mean losses is the batch's mean loss.
    batch = (xs[first:call].reshape(-1, xs.shape[-1]),
             ys[first:call].reshape(-1, ys.shape[-1]))
    _, v_one, s_one = one_step(v_one, s_one, batch)
    cycle_ends.append((v_one, s_one))
  return calls, cycle_ends


def _run_cycles(forge_tx, optax_tx, optax_ms, mode, data, model=MLP,
                cycles=CYCLES, every_k=lambda step: K, wgrad="fused",
                optax_runs=None):
  """Runs FORGE and optax.MultiSteps side by side, call by call, and one
  optax step per cycle on the concatenated batch. Returns the worst relative
  errors (vs optax.MultiSteps, vs the one-step reference). ``optax_runs``:
  ``(cache, key)``, optax's runs kept in ``cache[key]`` for the other calls
  with that key."""
  xs, ys, variables = data
  forge = jax.jit(forge_jax.make_step(_mse(model(forge_jax.Dense)), forge_tx,
                                      wgrad=wgrad),
                  donate_argnums=(0, 1))
  if optax_runs is None:
    ref_calls, ref_cycles = _optax_runs(optax_tx, optax_ms, data, model,
                                        cycles, every_k)
  else:
    cache, key = optax_runs
    if key not in cache:
      cache[key] = _optax_runs(optax_tx, optax_ms, data, model, cycles,
                               every_k)
    ref_calls, ref_cycles = cache[key]
  v_f = jax.tree.map(jnp.copy, variables)
  s_f = forge_tx.init(v_f["params"])
  worst_ms, worst_one, call = 0.0, 0.0, 0
  for cycle in range(cycles):
    k = int(every_k(cycle))
    for i in range(k):
      before = jax.tree.map(jnp.copy, v_f)
      batch = (xs[call], ys[call])
      l_f, v_f, s_f = forge(v_f, s_f, batch)
      l_ms, v_ms, s_ms = ref_calls[call]
      call += 1
      np.testing.assert_allclose(float(l_f), l_ms, rtol=F32_TOL)
      if i < k - 1:
        assert _same_bits(v_f, before), (
            f"call {call}: weights moved on a non-final micro-step")
      assert int(s_f.mini_step) == (i + 1) % k
      assert int(s_f.gradient_step) == cycle + (i == k - 1)
      for what, a, e in (("params", v_f, v_ms),
                         ("opt_state", _comparable(s_f, mode, i == k - 1),
                          _comparable(s_ms, mode, i == k - 1))):
        err, where = worst_leaf(a, e)
        assert err <= F32_TOL, (
            f"call {call}: {what} vs optax.MultiSteps: worst {where}: {err:.3g}")
        worst_ms = max(worst_ms, err)
    # The cycle equals one optax step on the concatenated micro-batches, up
    # to the order of G's sums (a mean of micro-batch means against one
    # mean; Adam's normalisation magnifies it where G's terms cancel):
    # no further from it than optax.MultiSteps' own cycle is, within the
    # fp32 bar.
    v_one, s_one = ref_cycles[cycle]
    for what, a, m, e in (
        ("params", v_f, v_ms, v_one),
        ("inner state", s_f.inner_opt_state, s_ms.inner_opt_state, s_one)):
      err, where = worst_leaf(a, e)
      reordered, _ = worst_leaf(m, e)
      assert err <= F32_TOL + reordered, (
          f"cycle {cycle}: {what} vs one step on the concatenated batch: "
          f"worst {where}: {err:.3g} (optax.MultiSteps: {reordered:.3g})")
      worst_one = max(worst_one, err)
  assert not _same_bits(v_f, variables), "training did not move the weights"
  if mode == "exact":  # the accumulators are reset at the end of a cycle
    assert not any(np.any(np.asarray(a)) for a in jax.tree.leaves(
        s_f.acc_grads))
  return worst_ms, worst_one


@pytest.fixture(scope="module")
def optax_runs():
  """optax's runs of each variant, made once for both wgrad settings and
  both modes (a variant's name is its optax transform's, then its mode)."""
  return {}


def _optax_key(name):
  return name.removesuffix("_" + VARIANTS[name][-1])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_k_micro_steps_equal_one_step_on_the_concatenated_batch(
    name, data, optax_runs):
  forge_tx, optax_tx, optax_ms, mode = _transforms(name)
  worst_ms, worst_one = _run_cycles(
      forge_tx, optax_tx, optax_ms, mode, data,
      optax_runs=(optax_runs, _optax_key(name)))
  print(f"{name}: worst rel err vs optax.MultiSteps {worst_ms:.2e}, "
        f"vs one step on the concatenated batch {worst_one:.2e}")


@pytest.mark.parametrize("name", ["adamw_exact", "sgd_momentum_momentum"])
def test_k_micro_steps_with_xla_wgrad(name, data, optax_runs):
  forge_tx, optax_tx, optax_ms, mode = _transforms(name)
  _run_cycles(forge_tx, optax_tx, optax_ms, mode, data, wgrad="xla",
              optax_runs=(optax_runs, _optax_key(name)))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw_exact", "sgd_momentum_momentum",
                                  "muon_exact"])
def test_k_micro_steps_on_gpu(name, data):
  """The same parity with the compiled Triton kernels (fp32, IEEE dots)."""
  assert jax.default_backend() == "gpu"
  forge_tx, optax_tx, optax_ms, mode = _transforms(name)
  _run_cycles(forge_tx, optax_tx, optax_ms, mode, data)


@pytest.mark.parametrize("name", ["adamw_exact", "sgd_momentum_momentum"])
def test_k_schedule(name, data):
  """every_k_schedule as a callable of the gradient step (2, then 3, 3):
  K is a runtime value, so one compiled step serves every cycle."""
  every_k = lambda step: jnp.where(step == 0, 2, 3)
  forge_tx, optax_tx, optax_ms, mode = _transforms(name, every_k)
  _run_cycles(forge_tx, optax_tx, optax_ms, mode, data, every_k=every_k)


def test_scanned_stack_exact_mode():
  """A ScannedDenseStack's stacked kernel accumulates like any FORGE kernel."""
  _scanned_stack_exact_mode()


@pytest.mark.gpu
def test_scanned_stack_exact_mode_on_gpu():
  """The same with the compiled kernels (the stack stepped in place)."""
  assert jax.default_backend() == "gpu"
  _scanned_stack_exact_mode()


def _scanned_stack_exact_mode():
  from tests.test_scan import Model

  class Scanned(nn.Module):
    dense: type

    @nn.compact
    def __call__(self, x):
      return Model(forge=self.dense is forge_jax.Dense, width=16,
                   num_layers=2, name="m")(x)

  kx, ky, kp = jax.random.split(jax.random.key(3), 3)
  xs = jax.random.normal(kx, (K, MICRO_BT, WIDTHS[0]))
  ys = jax.random.normal(ky, (K, MICRO_BT, 5))
  variables = Scanned(nn.Dense).init(kp, xs[0])
  sched = _schedule(1e-2)
  forge_tx = forge_jax.MultiSteps(
      forge_jax.adamw(sched, weight_decay=1e-2, mask=_decay_kernels_only), 2)
  optax_tx = optax.adamw(sched, weight_decay=1e-2, mask=_decay_kernels_only)
  _run_cycles(forge_tx, optax_tx, optax.MultiSteps(optax_tx, 2), "exact",
              (xs, ys, variables), model=Scanned, cycles=2,
              every_k=lambda step: 2)


@pytest.mark.parametrize("mode", ["exact", "momentum"])
def test_scanned_blocks_accumulate(mode):
  """ScannedBlocks' stacked kernels accumulate like any FORGE kernel (exact:
  the fp32 accumulators; momentum: straight into SGD's momentum)."""
  from tests.test_blocks import Model as BlocksModel

  class Scanned(nn.Module):
    dense: type

    @nn.compact
    def __call__(self, x):
      return BlocksModel(forge=self.dense is forge_jax.Dense, num_layers=2,
                         name="m")(x)

  kx, ky, kp = jax.random.split(jax.random.key(4), 3)
  xs = jax.random.normal(kx, (K, MICRO_BT, WIDTHS[0]))
  ys = jax.random.normal(ky, (K, MICRO_BT, 5))
  variables = Scanned(nn.Dense).init(kp, xs[0])
  sched = _schedule(1e-2)
  if mode == "exact":
    make = lambda m: m.adamw(sched, weight_decay=1e-2,
                             mask=_decay_kernels_only)
  else:
    make = lambda m: m.sgd(sched, momentum=0.9)
  optax_tx = make(optax)
  forge_tx = forge_jax.MultiSteps(make(forge_jax), 2, mode=mode)
  _run_cycles(forge_tx, optax_tx, optax.MultiSteps(optax_tx, 2), mode,
              (xs, ys, variables), model=Scanned, cycles=2,
              every_k=lambda step: 2)


def DeadHeadMLP(dense):  # noqa: N802 -- used like the model class
  """The MLP plus a FORGE layer whose output never reaches the loss."""
  return MLP(dense, dead_head=True)


def test_untouched_layer_accumulates_zero_gradients(data):
  """Remark 1: a layer whose backward never runs gets what optax.MultiSteps
  gives a zero gradient (its running mean decays, weight decay applies)."""
  xs, ys, _ = data
  variables = DeadHeadMLP(nn.Dense).init(jax.random.key(5), xs[0])
  forge_tx, optax_tx, optax_ms, mode = _transforms("adamw_exact")
  _run_cycles(forge_tx, optax_tx, optax_ms, mode, (xs, ys, variables),
              model=DeadHeadMLP, cycles=1)


@pytest.mark.parametrize("with_params", [True, False])
@pytest.mark.parametrize("mode", ["exact", "momentum"])
def test_update_on_plain_gradients_is_optax_multisteps(mode, with_params, data):
  """Outside make_step the transform is an optax transform: its update on
  plain gradients (every parameter, none fused) is optax.MultiSteps', with
  or without params (optax's update(grads, state)). K may be any integral
  type."""
  params = data[2]["params"]
  # Without params, a family that reads no W (optax's adamw needs params).
  inner, ref = ((forge_jax.adamw(1e-2), optax.adamw(1e-2))
                if mode == "exact" and with_params
                else (forge_jax.sgd(5e-2, momentum=0.9),
                      optax.sgd(5e-2, momentum=0.9)))
  tx = forge_jax.MultiSteps(inner, np.int64(3), mode=mode)
  ms = optax.MultiSteps(ref, 3)
  p, s, p_ref, s_ref = params, tx.init(params), params, ms.init(params)
  update, update_ref = jax.jit(tx.update), jax.jit(ms.update)
  for i in range(6):
    g = jax.tree.map(lambda a: jax.random.normal(jax.random.key(i), a.shape),
                     params)
    u, s = update(g, s, p) if with_params else update(g, s)
    p = optax.apply_updates(p, u)
    u_ref, s_ref = (update_ref(g, s_ref, p_ref) if with_params
                    else update_ref(g, s_ref))
    p_ref = optax.apply_updates(p_ref, u_ref)
    final = i % 3 == 2
    assert worst_leaf(p, p_ref)[0] <= F32_TOL
    assert worst_leaf(_comparable(s, mode, final),
                      _comparable(s_ref, mode, final))[0] <= F32_TOL
  assert int(s.gradient_step) == 2


@pytest.mark.parametrize("name", ["adamw_exact", "sgd_momentum_momentum"])
def test_a_non_finite_micro_batch_shows_in_the_kernels_at_the_cycles_end(
    name, data):
  """The one documented difference from ``optax.MultiSteps``
  (docs/accumulation.md): an inf in a non-final micro-batch. optax
  multiplies that micro-step's update by zero, so its weights turn
  non-finite at once (0 x inf is NaN); FORGE's kernels are written back
  unchanged, bit for bit, and turn non-finite at the cycle's last
  micro-step, from the non-finite mean (exact mode: the FORGE kernels'
  running means are then 0, as after every cycle)."""
  xs, ys, variables = data
  forge_tx, _, optax_ms, mode = _transforms(name, every_k=2)
  forge = jax.jit(forge_jax.make_step(_mse(MLP(forge_jax.Dense)), forge_tx))
  ref = jax.jit(reference_step(_mse(MLP(nn.Dense)),
                               optax_ms.gradient_transformation()))
  batches = [(xs[0], ys[0].at[0, 0].set(jnp.inf)), (xs[1], ys[1])]
  v, s = variables, forge_tx.init(variables["params"])
  v_ref, s_ref = variables, optax_ms.init(variables["params"])
  kernels = lambda t: [t[f"Dense_{i}"]["kernel"] for i in range(3)]
  finite = lambda a: bool(jnp.all(jnp.isfinite(a)))
  _, v, s = forge(v, s, batches[0])
  _, v_ref, s_ref = ref(v_ref, s_ref, batches[0])
  assert _same_bits(kernels(v["params"]), kernels(variables["params"]))
  assert not any(map(finite, kernels(v_ref["params"])))
  _, v, s = forge(v, s, batches[1])  # the cycle's last micro-step
  _, v_ref, s_ref = ref(v_ref, s_ref, batches[1])
  assert not any(map(finite, kernels(v["params"])))
  assert not any(map(finite, kernels(v_ref["params"])))
  if mode == "exact":
    assert all(bool(jnp.all(a == 0)) for a in kernels(s.acc_grads))
    assert not any(map(finite, kernels(s_ref.acc_grads)))


def test_memory_exact_holds_fp32_accumulators_momentum_holds_none(data):
  params = data[2]["params"]
  kernels = [a for a in jax.tree.leaves(params) if a.ndim == 2]
  exact = forge_jax.MultiSteps(forge_jax.adamw(1e-3), K).init(params)
  acc = jax.tree.leaves(exact.acc_grads)
  assert all(a.dtype == jnp.float32 for a in acc)
  acc_kernel_bytes = sum(a.nbytes for a in acc if a.ndim == 2)
  assert acc_kernel_bytes == 4 * sum(a.size for a in kernels)
  inner = forge_jax.sgd(1e-2, momentum=0.9)
  momentum = forge_jax.MultiSteps(inner, K, mode="momentum").init(params)
  assert momentum.acc_grads == ()
  assert (sum(a.nbytes for a in jax.tree.leaves(momentum))
          == sum(a.nbytes for a in jax.tree.leaves(inner.init(params)))
          + 2 * 4)  # mini_step, gradient_step


# --- the wrapped rules in the fused kernel -------------------------------------


def _wrapped_cases():
  sgd = pk.sgd_rule(momentum=True)
  return {
      "adamw_accumulate": (
          rules.accumulating(pk.ADAMW),
          lambda n, final: rules.accumulating(pk.ADAMW).pack(
              **pk.ADAMW.unpack(adamw_hparams()), acc_n=n, acc_final=final)),
      "sgd_momentum_accumulate": (
          rules.momentum_accumulating(sgd, "decay"),
          lambda n, final: rules.momentum_accumulating(sgd, "decay").pack(
              lr=3e-2, decay=0.9, acc_scale=1 / K, acc_first=n == 1,
              acc_final=final)),
  }


@pytest.mark.parametrize("final", [False, True], ids=["non_final", "final"])
@pytest.mark.parametrize("name", sorted(_wrapped_cases()))
def test_wrapped_rule_kernel_matches_reference(name, final):
  rule, hparams = _wrapped_cases()[name]
  x, dy, w, (mu, nu) = make_case(11, (37,), 70, 130, (jnp.float32,) * 4)
  slots = (mu, nu)[:len(rule.slots)] if name.startswith("sgd") else (
      0.1 * nu, mu, nu)  # (acc, mu, nu)
  # non-final: the second micro-step (Adam) / the first (SGD: the decay).
  n = K if final else (1 if name.startswith("sgd") else 2)
  h = hparams(n, final)
  got_w, got = pk.fused_wgrad_update(x, dy, w, slots, h, rule=rule,
                                     interpret=True)
  ref_w, ref = pk.fused_wgrad_update_reference(x, dy, w, slots, h, rule=rule)
  assert_close(got_w, ref_w, what="w")
  for s_name, g, r in zip(rule.slots, got, ref):
    assert_close(g, r, what=s_name)
  if final:
    assert not np.allclose(got_w, w)
  else:
    np.testing.assert_array_equal(got_w, w)  # the weight waits
  if name.startswith("adamw"):
    g = jnp.dot(x.T, dy, precision=jax.lax.Precision.HIGHEST)
    mean = slots[0] + (g - slots[0]) / n
    if final:  # the family's own rule on the mean; the accumulator resets
      want_w, want = pk.ADAMW.apply(mean, w, slots[1:],
                                    h[:len(pk.ADAMW.hparams)])
      assert_close(got_w, want_w, what="w vs adamw on the mean")
      for g_, r in zip(got[1:], want):
        assert_close(g_, r, what="slots vs adamw on the mean")
      np.testing.assert_array_equal(got[0], 0.0)
    else:  # only the running mean moves
      assert_close(got[0], mean, what="acc")
      for g_, s in zip(got[1:], slots[1:]):
        np.testing.assert_array_equal(g_, s)


@pytest.mark.parametrize("name", sorted(_wrapped_cases()))
def test_wrapped_rule_lowers_for_cuda_without_a_gpu(name):
  rule = _wrapped_cases()[name][0]
  assert len(triton_calls(lower_rule_for_cuda(rule))) == 1


def test_wrapper_rules_check_their_names():
  with pytest.raises(ValueError, match="no hyperparameter 'beta'"):
    rules.momentum_accumulating(pk.sgd_rule(momentum=True), "beta")
  with pytest.raises(ValueError, match="already uses the names"):
    rules.accumulating(rules.accumulating(pk.ADAMW))


# --- refusals -------------------------------------------------------------------


@pytest.mark.parametrize("make,exc,match", [
    (lambda: forge_jax.MultiSteps(optax.adamw(1e-3), K), TypeError,
     "wraps a forge_jax transform.*optax.MultiSteps"),
    (lambda: forge_jax.MultiSteps(forge_jax.adamw(1e-3), 0), ValueError,
     "every_k_schedule=0 must be >= 1"),
    (lambda: forge_jax.MultiSteps(forge_jax.adamw(1e-3), 2.0), TypeError,
     "must be an int >= 1.*float"),
    (lambda: forge_jax.MultiSteps(forge_jax.adamw(1e-3), True), TypeError,
     "must be an int >= 1.*bool"),
    (lambda: forge_jax.MultiSteps(forge_jax.adamw(1e-3), K, mode="sum"),
     ValueError, "unknown mode 'sum'"),
    (lambda: forge_jax.MultiSteps(
        forge_jax.MultiSteps(forge_jax.adamw(1e-3), 2), 2), ValueError,
     "already accumulates"),
    (lambda: forge_jax.MultiSteps(forge_jax.adamw(1e-3), K, mode="momentum"),
     ValueError, "cannot accumulate 'adamw' into its momentum.*mode='exact'"),
    (lambda: forge_jax.MultiSteps(forge_jax.sgd(1e-2, momentum=0.9,
                                                nesterov=True), K,
                                  mode="momentum"),
     ValueError, "nesterov=True"),
    (lambda: forge_jax.MultiSteps(forge_jax.sgd(1e-2), K, mode="momentum"),
     ValueError, "no momentum to accumulate into"),
    (lambda: forge_jax.MultiSteps(forge_jax.muon(1e-2), K, mode="momentum"),
     ValueError, "'muon'.*Nesterov.*AdamW"),
    (lambda: forge_jax.MultiSteps(forge_jax.adafactor(), K, mode="momentum"),
     ValueError, "cannot accumulate 'adafactor'"),
], ids=["optax_tx", "k0", "k_float", "k_bool", "mode", "nested",
        "momentum_adamw", "momentum_nesterov", "momentum_plain_sgd",
        "momentum_muon", "momentum_adafactor"])
def test_refusals(make, exc, match):
  with pytest.raises(exc, match=match):
    make()


def test_optax_multisteps_of_an_injected_transform_says_what_to_use():
  """optax.MultiSteps around inject_hyperparams(forge_jax.adamw): the
  refusal's advice, forge_jax.MultiSteps, would be refused in turn for the
  injected transform; it says to give the transform a schedule."""
  inner = optax.inject_hyperparams(forge_jax.adamw)(learning_rate=1e-3)
  model = MLP(forge_jax.Dense)
  with pytest.raises(TypeError, match="forge_jax.MultiSteps.*"
                     "inject_hyperparams.*schedule"):
    forge_jax.make_step(_mse(model), optax.MultiSteps(inner, K))
  with pytest.raises(TypeError) as plain:
    forge_jax.make_step(_mse(model), optax.MultiSteps(
        forge_jax.adamw(1e-3), K))
  assert "inject_hyperparams" not in str(plain.value)


_CLIP_CHAINS = {
    "forge_clip": lambda: optax.chain(forge_jax.clip_by_global_norm(1.0),
                                      forge_jax.adamw(1e-3)),
    "optax_clip": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                      forge_jax.adamw(1e-3)),
    "clip_alone": lambda: forge_jax.clip_by_global_norm(1.0),
    "nested_chain": lambda: optax.chain(optax.chain(
        forge_jax.clip_by_global_norm(1.0), forge_jax.adamw(1e-3))),
}


@pytest.mark.parametrize("make", _CLIP_CHAINS.values(), ids=_CLIP_CHAINS)
def test_clipping_with_accumulation_is_refused_naming_what_runs(make):
  """Global-norm clipping with accumulation is refused in both nestings
  with the same plain message, which names the forms that run (not the
  other nesting)."""
  with pytest.raises(TypeError) as inner:
    forge_jax.MultiSteps(make(), K)
  model = MLP(forge_jax.Dense)
  with pytest.raises(TypeError) as outer:
    forge_jax.make_step(_mse(model), optax.chain(
        forge_jax.clip_by_global_norm(1.0),
        forge_jax.MultiSteps(forge_jax.adamw(1e-3), K)))
  # optax.MultiSteps around the chain: the same refusal, not the advice to
  # use forge_jax.MultiSteps that a plain transform gets.
  with pytest.raises(TypeError) as optax_outer:
    forge_jax.make_step(_mse(model), optax.MultiSteps(make(), K))
  for e, who, given in ((inner, "forge_jax.MultiSteps", "forge_jax"),
                        (outer, "make_step", "forge_jax"),
                        (optax_outer, "make_step", "optax")):
    msg = str(e.value)
    assert msg.startswith(who + ": global-norm clipping together with "
                          f"gradient accumulation ({given}.MultiSteps) is "
                          "not supported"), msg
    assert "use optax.MultiSteps" not in msg
    for form in ("optax.chain(forge_jax.clip_by_global_norm(max_norm), "
                 "forge_jax.adamw(...))",
                 "forge_jax.MultiSteps(forge_jax.adamw(...), k)",
                 "jax.value_and_grad"):
      assert form in msg, (form, msg)


def test_clipping_with_accumulation_runs_with_optax_on_the_same_model(data):
  """The form the refusal above names for both together: the model of
  forge_jax.Dense layers, outside make_step, with jax.value_and_grad and
  optax.MultiSteps(optax.chain(clip, optax.adamw)), trains exactly as the
  same model of nn.Dense layers."""
  xs, ys, variables = data
  # The mean gradient's norm is above 0.1 in both cycles: both clip.
  tx = optax.MultiSteps(optax.chain(forge_jax.clip_by_global_norm(0.1),
                                    optax.adamw(1e-2)), K)

  def train(dense):
    loss_fn = _mse(MLP(dense))
    step = jax.jit(lambda p, s, b: _optax_step(loss_fn, tx, p, s, b))
    params, state = variables["params"], tx.init(variables["params"])
    for x, y in zip(xs, ys):
      params, state = step(params, state, (x, y))
    return params, state

  got, state = train(forge_jax.Dense)
  want, _ = train(nn.Dense)
  assert int(state.gradient_step) == CYCLES
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  assert worst_leaf(got, variables["params"])[0] > 1e-3  # they moved


def _optax_step(loss_fn, tx, params, state, batch):
  grads = jax.grad(lambda p: loss_fn({"params": p}, batch))(params)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def test_update_accepts_optax_extra_args_in_every_mode():
  # A forge_jax transform is an optax GradientTransformationExtraArgs, so
  # optax.chain hands its update extra keyword arguments (value=..., as
  # reduce_on_plateau needs); both modes take them, as optax.MultiSteps does.
  params = {"w": jnp.ones((3, 4)), "b": jnp.zeros((4,))}
  grads = jax.tree.map(jnp.ones_like, params)
  assert set(forge_jax.accumulate.MODES) == {"exact", "momentum"}
  for mode in forge_jax.accumulate.MODES:
    chained = optax.chain(forge_jax.MultiSteps(
        forge_jax.sgd(0.1, momentum=0.9), 2, mode=mode))
    state = chained.init(params)
    updates, state = chained.update(grads, state, params, value=jnp.array(1.0))
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    # Micro-step 1 of 2 only accumulates; micro-step 2 steps (the mean of two
    # unit gradients is 1: SGD's first momentum step moves by -lr).
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates)), mode
    updates, _ = chained.update(grads, state, params, value=jnp.array(1.0))
    for u in jax.tree.leaves(updates):
      assert jnp.allclose(u, -0.1), (mode, u)


# --- a rule whose hyperparameters fill the vector -----------------------------


@pytest.mark.parametrize("nesterov", [False, True])
def test_multisteps_accepts_a_rule_that_fills_the_vector(nesterov):
  """A rule whose hyperparameters + acc_n, acc_final fill the 16-entry
  vector exactly is accepted: the accumulator's slot name "acc" is not a
  hyperparameter (it was counted as one, which refused MultiSteps(radam)
  when a runtime round_mu made RAdam's 14; the flag is static now, and
  RAdam has 13)."""
  rule = pk.radam_rule(nesterov=nesterov)
  full = dataclasses.replace(
      rule, hparams=rule.hparams + tuple(
          f"pad{i}" for i in range(rules.HPARAM_VECTOR_LEN - 2
                                   - len(rule.hparams))))
  assert len(rules.accumulating(full).hparams) == rules.HPARAM_VECTOR_LEN
  assert len(rules.accumulating(rule).hparams) <= rules.HPARAM_VECTOR_LEN
  forge_jax.MultiSteps(forge_jax.radam(1e-3, nesterov=nesterov), 2)
  with pytest.raises(ValueError, match="already uses the names \\['acc'\\]"):
    rules.accumulating(dataclasses.replace(rule, slots=("acc", "nu")))
