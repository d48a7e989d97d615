"""Every regime-1 family: FORGE transform + kernel against optax itself.

Each family (and its code-changing options) is checked two ways:

* one step of one layer: the fused kernel (and its jnp reference) fed the
  ``ForgeSpec``'s slots and hyperparameters, against the optax transform's own
  update of the same weight from the same non-trivial state;
* 20 training steps of a 3-layer MLP with odd widths: ``forge_jax.Dense`` +
  ``forge_jax.<family>`` + ``make_step`` against ``flax.linen.Dense`` +
  ``optax.<family>`` from the same init and data, with a learning-rate
  schedule; every parameter and every optimizer-state leaf must agree.
"""

import inspect
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
import pallas_kernels as pk
from forge_jax import step as forge_step
from tests.harness import (MLP, lower_rule_for_cuda, reference_step,
                           run_reference, train_side_by_side, triton_calls)
from tests.harness import decay_kernels_only as _decay_kernels_only
from tests.harness import mse as _mse
from tests.tolerances import assert_update_close, tol, worst_leaf

F32_TOL = tol(jnp.float32)
STEPS = 20


def _schedule(base):
  return optax.linear_schedule(base, base / 10, STEPS)


# name -> (family, base learning rate, options). Every code-changing option of
# every family appears at least once.
VARIANTS = {
    "sgd": ("sgd", 5e-2, {}),
    "sgd_momentum": ("sgd", 5e-2, dict(momentum=0.9)),
    "sgd_nesterov": ("sgd", 5e-2, dict(momentum=0.9, nesterov=True)),
    "adagrad": ("adagrad", 5e-2, {}),
    "rmsprop": ("rmsprop", 3e-3, {}),
    "rmsprop_centered": ("rmsprop", 3e-3, dict(centered=True)),
    "rmsprop_momentum_nesterov": ("rmsprop", 3e-3,
                                  dict(momentum=0.9, nesterov=True)),
    "rmsprop_eps_outside_sqrt_bias_correction": (
        "rmsprop", 3e-3,
        dict(eps_in_sqrt=False, bias_correction=True, initial_scale=1.0)),
    # (eps large: the first centered step's variance is the difference of
    # two equal roundings, g^2 - g^2, so with a tiny eps each step's size
    # hangs on the last bit of that cancellation, and the loss explodes.)
    "rmsprop_centered_momentum_bias_correction": (
        "rmsprop", 3e-3,
        dict(centered=True, momentum=0.8, bias_correction=True, eps=1e-1)),
    "adam": ("adam", 1e-2, dict(eps_root=1e-12)),
    "nadam": ("nadam", 1e-2, {}),
    "adamw": ("adamw", 1e-2, dict(weight_decay=1e-2,
                                  mask=_decay_kernels_only)),
    "nadamw": ("nadamw", 1e-2, dict(weight_decay=_schedule(1e-2),
                                    mask=_decay_kernels_only)),
    "adamax": ("adamax", 1e-2, {}),
    # b2 = 0.99: rho_t crosses the threshold at step 6, so both RAdam
    # branches run within 20 steps.
    "radam": ("radam", 1e-2, dict(b2=0.99)),
    "radam_nesterov": ("radam", 1e-2, dict(nesterov=True)),
    "lion": ("lion", 3e-3, dict(weight_decay=_schedule(1e-2),
                                mask=_decay_kernels_only)),
}

FAMILY_NAMES = sorted({f for f, _, _ in VARIANTS.values()})


def _transforms(name):
  family, lr, kw = VARIANTS[name]
  sched = _schedule(lr)
  return (getattr(forge_jax, family)(sched, **kw),
          getattr(optax, family)(sched, **kw))


_worst_leaf = worst_leaf


def _assert_trees_close(actual, expected, what):
  err, where = _worst_leaf(actual, expected)
  assert err <= F32_TOL, f"{what}: worst leaf {where}: rel err {err:.3g}"
  return err


# --- API ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_signature_and_defaults_match_optax(family):
  def params(fn):
    return [(p.name, p.kind, p.default)
            for p in inspect.signature(fn).parameters.values()]

  # forge_jax's keyword-only low-precision options (docs/optimizers.md)
  # come last, after optax's own parameters.
  extra = [("moments", inspect.Parameter.KEYWORD_ONLY, None),
           ("stochastic_rounding", inspect.Parameter.KEYWORD_ONLY, False),
           ("seed", inspect.Parameter.KEYWORD_ONLY, None)]
  ours = params(getattr(forge_jax, family))
  n = len(params(getattr(optax, family)))
  assert ours[:n] == params(getattr(optax, family))
  assert ours[n:] in (extra, extra[:2])


def test_slot_fields_may_name_the_state_class():
  """Two states of a chain with a ``mu``: a (class, field) pair picks one."""
  params = {"w": jnp.ones((3, 2))}
  state = optax.chain(optax.scale_by_adam(), optax.scale_by_lion()).init(
      params)
  with pytest.raises(ValueError, match="more than one 'mu'"):
    forge_step._slot_trees(state, ("mu",))
  lion_mu = (optax.ScaleByLionState, "mu")
  found = forge_step._slot_trees(state, (lion_mu, "nu"))
  assert found[lion_mu] is state[1].mu and found["nu"] is state[0].nu
  rebuilt = forge_step._map_slot_trees(
      state, (lion_mu,), lambda f, t: jax.tree.map(lambda a: a + 1, t))
  assert float(rebuilt[1].mu["w"][0, 0]) == 1.0
  assert float(rebuilt[0].mu["w"][0, 0]) == 0.0


# --- one step of one layer against optax --------------------------------------


def _warm_state(tx, params, steps=8):
  """A state after a few optax steps on random gradients: non-zero slots, and
  a step count past RAdam's rectification threshold."""
  state = tx.init(params)
  for i in range(steps):
    g = jax.tree.map(
        lambda a: jax.random.normal(jax.random.key(100 + i), a.shape), params)
    _, state = tx.update(g, state, params)
  return state


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rule_matches_optax_one_step(name):
  forge_tx, optax_tx = _transforms(name)
  spec = forge_tx.spec
  k = jax.random.split(jax.random.key(len(name)), 3)
  x = jax.random.normal(k[0], (37, 70))
  dy = jax.random.normal(k[1], (37, 130))
  # Small weights: one step then moves them by a visible fraction, and the
  # step itself is compared below (assert_update_close), so an error in the
  # update cannot hide under the tolerance of the whole weight.
  w = 1e-2 * jax.random.normal(k[2], (70, 130))
  params = {"w": w}
  state = _warm_state(optax_tx, params)

  slot_trees = forge_step._slot_trees(state, spec.slot_fields)
  slots = tuple(slot_trees[f]["w"] for f in spec.slot_fields)
  h = spec.hparams(state)
  if "rectify" in h:
    assert h["rectify"], "this step should exercise RAdam's rectified branch"
  h = spec.rule.pack(**h)
  got = pk.fused_wgrad_update(x, dy, w, slots, h, rule=spec.rule)
  ref = pk.fused_wgrad_update_reference(x, dy, w, slots, h, rule=spec.rule)

  g = jnp.dot(x.T, dy, precision=jax.lax.Precision.HIGHEST)
  updates, new_state = optax_tx.update({"w": g}, state, params)
  new_trees = forge_step._slot_trees(new_state, spec.slot_fields)
  want = (optax.apply_updates(params, updates)["w"],
          tuple(new_trees[f]["w"] for f in spec.slot_fields))

  _assert_trees_close(ref, want, f"{name} reference vs optax")
  _assert_trees_close(got, want, f"{name} kernel vs optax")
  assert_update_close(ref[0], want[0], w, f"{name} reference's update")
  assert_update_close(got[0], want[0], w, f"{name} kernel's update")
  assert not np.allclose(got[0], w), "the step did not move the weight"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rule_lowers_for_cuda_without_a_gpu(name):
  """Deviceless AOT lowering catches Triton lowering errors on the CPU."""
  rule = _transforms(name)[0].spec.rule
  assert len(triton_calls(lower_rule_for_cuda(rule))) == 1


# --- 20 training steps of an MLP against flax + optax -------------------------


@pytest.fixture(scope="module")
def data():
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  xs = jax.random.normal(kx, (STEPS, 48, 37))
  ys = jax.random.normal(ky, (STEPS, 48, 5))
  variables = MLP(nn.Dense).init(kp, xs[0])
  return xs, ys, variables


@pytest.fixture(scope="module")
def optax_runs():
  """optax's run of each variant, made once for both wgrad settings."""
  return {}


@pytest.mark.parametrize("wgrad", ["fused", "xla"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_mlp_training_matches_optax(name, wgrad, data, optax_runs):
  _train_against_optax(name, wgrad, data, optax_runs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_mlp_training_matches_optax_on_gpu(name, data):
  """The same 20 steps with the compiled kernels, both sides' GEMMs in
  full fp32 (no TF32)."""
  assert jax.default_backend() == "gpu"
  with jax.default_matmul_precision("highest"):
    _train_against_optax(name, "fused", data, {})


def _train_against_optax(name, wgrad, data, optax_runs):
  xs, ys, variables = data
  forge_tx, optax_tx = _transforms(name)
  ref_loss = _mse(MLP(nn.Dense))

  ref_step = jax.jit(reference_step(ref_loss, optax_tx))
  batches = [(xs[i], ys[i]) for i in range(STEPS)]
  if name not in optax_runs:
    optax_runs[name] = run_reference(ref_step, variables, optax_tx, batches)

  forge = jax.jit(forge_jax.make_step(_mse(MLP(forge_jax.Dense)), forge_tx,
                                      wgrad=wgrad),
                  donate_argnums=(0, 1))

  (v_f, s_f), (v_ref, s_ref), losses = train_side_by_side(
      forge, ref_step, variables, forge_tx, optax_tx, batches,
      reference=optax_runs[name])
  np.testing.assert_allclose(*zip(*losses), rtol=F32_TOL)
  p_err = _assert_trees_close(v_f, v_ref, f"{name} params")
  s_err = _assert_trees_close(s_f, s_ref, f"{name} opt_state")
  print(f"{name} ({wgrad}): worst rel err params {p_err:.2e}, "
        f"state {s_err:.2e}")


# --- a bf16 moment slot with fp32 parameters ---------------------------------
# optax updates a moment as `(1 - decay) * g + decay * t` with `t` the stored
# moment: with a bf16 `t` the Python-float decay is weakly typed to bf16
# (0.9 -> 0.8984375), and the product `decay * t` is a bf16 op. The epilogue
# used the exact decay: from one state, 11-22 % of the bf16 moment elements
# and the fp32 update (up to 1.3e-3 relative) differed from optax's.
# forge_jax now packs the rounded decay for the stored moment (`b1_m`,
# `decay_m`; lion's b1 and b2) and sets the rule's static flag that rounds
# the product to the moment's dtype (on the H200 optax's jitted step rounds
# it, while XLA's CPU backend keeps it in fp32 under jit). The reference is
# optax op by op, i.e. every op rounded to its dtype, on either backend.

LOW_PRECISION_SLOTS = {
    "adam": (forge_jax.adam, optax.adam, (1e-2,), dict(mu_dtype=jnp.bfloat16)),
    "adamw": (forge_jax.adamw, optax.adamw, (1e-2,),
              dict(mu_dtype=jnp.bfloat16, weight_decay=1e-2)),
    "nadam": (forge_jax.adam, optax.adam, (1e-2,),
              dict(mu_dtype=jnp.bfloat16, nesterov=True)),
    "sgd_momentum": (forge_jax.sgd, optax.sgd, (5e-2,),
                     dict(momentum=0.9, accumulator_dtype=jnp.bfloat16)),
    "sgd_nesterov": (forge_jax.sgd, optax.sgd, (5e-2,),
                     dict(momentum=0.9, nesterov=True,
                          accumulator_dtype=jnp.bfloat16)),
    "lion": (forge_jax.lion, optax.lion, (3e-3,), dict(mu_dtype=jnp.bfloat16)),
    "muon": (forge_jax.muon, optax.contrib.muon, (2e-2,),
             dict(mu_dtype=jnp.bfloat16)),
}


class _OneLayer(nn.Module):
  dense: type

  @nn.compact
  def __call__(self, x):
    return self.dense(130, use_bias=False)(x)


@pytest.mark.parametrize("name", sorted(LOW_PRECISION_SLOTS))
def test_bf16_moment_with_fp32_params_steps_like_optax(name):
  """One step of an fp32 layer from the same warmed-up optax state: the fp32
  weight update within the fp32 bound, every bf16 moment element within one
  ulp of optax's."""
  _check_one_step(name, *LOW_PRECISION_SLOTS[name])


def _check_one_step(name, f_fn, o_fn, args, kw, jit_reference=False):
  forge_tx, optax_tx = f_fn(*args, **kw), o_fn(*args, **kw)
  k = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(k[0], (37, 70))
  dy = jax.random.normal(k[1], (37, 130))
  variables = _OneLayer(nn.Dense).init(k[2], x)
  params = variables["params"]
  state = optax_tx.init(params)
  for i in range(5):  # a state with non-trivial moments
    g = jax.tree.map(lambda a, i=i: jax.random.normal(
        jax.random.key(100 + i), a.shape), params)
    _, state = jax.jit(optax_tx.update)(g, state, params)
  loss = lambda model: (lambda v, b: jnp.sum(model.apply(v, b) * dy))
  # optax op by op: each op rounds to its dtype, `decay * t` to bf16. (Under
  # jit, XLA's CPU backend keeps that product in fp32 -- excess precision --
  # where its GPU backend rounds it; the kernel follows the program.)
  ref = reference_step(loss(_OneLayer(nn.Dense)), optax_tx)
  if jit_reference:
    _, v_r, s_r = jax.jit(ref)(variables, state, x)
  else:
    with jax.disable_jit():
      _, v_r, s_r = ref(variables, state, x)
  _, v_f, s_f = jax.jit(forge_jax.make_step(loss(_OneLayer(forge_jax.Dense)),
                                            forge_tx))(variables, state, x)
  w0 = params["Dense_0"]["kernel"]
  assert_update_close(v_f["params"]["Dense_0"]["kernel"],
                      v_r["params"]["Dense_0"]["kernel"], w0, what="kernel")
  moments = [(a, b, c) for a, b, c in zip(
      jax.tree.leaves(s_f), jax.tree.leaves(s_r), jax.tree.leaves(state))
      if a.dtype == jnp.bfloat16]
  assert moments, "no bf16 moment in the state"
  for got, want, old in moments:
    assert_update_close(got, want, old, what=f"{name} bf16 moment")
  # Equal elements, not just within an ulp: on the CPU they are all equal;
  # another summation order of G flips a rounding now and then, the exact
  # decay flipped 11-22 % of them (lion's update, a sign, hid it), the
  # unrounded product 17 % of lion's on the H200.
  differing = sum(int((a != b).sum()) for a, b, _ in moments)
  total = sum(a.size for a, _, _ in moments)
  assert differing <= 0.01 * total, (
      f"{name}: {differing} of {total} bf16 moment elements differ")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LOW_PRECISION_SLOTS))
def test_bf16_moment_steps_like_jitted_optax_on_gpu(name):
  """On the GPU optax is run jitted, as users run it: XLA's GPU backend
  rounds `decay * t` to bf16 like the op-by-op program (without the rounded
  product every family but the exact-decay ones failed here)."""
  _check_one_step(name, *LOW_PRECISION_SLOTS[name], jit_reference=True)


@pytest.mark.parametrize("b1", [
    0.9, np.float32(0.9), jnp.float32(0.9), jnp.asarray(0.9), jnp.array(0.9),
    jnp.bfloat16(0.9), jnp.asarray(0.9, jnp.bfloat16)],
    ids=["python_float", "numpy_scalar", "jax_scalar", "weak_jax_asarray",
         "weak_jax_array", "bf16_scalar", "bf16_jax_array"])
def test_only_a_decay_that_keeps_the_moment_dtype_is_rounded(b1):
  """optax forms `b1 * mu` in a bf16 mu's dtype (b1 and the product rounded)
  when JAX's promotion keeps bf16: a Python float, a weak JAX scalar
  (`jnp.asarray(0.9)`) or a bf16 b1; a NumPy / JAX float32 scalar
  promotes the product to fp32 with b1 exact (a rounding that ignored the
  type, or missed the weak JAX scalar and the bf16 one, was 1.1e-3 and
  7.7e-4 off)."""
  _check_one_step(f"adam b1={b1!r}", forge_jax.adam, optax.adam, (1e-2,),
                  dict(b1=b1, mu_dtype=jnp.bfloat16))


def test_weakly_typed_jax_momentum_rounds_the_sgd_trace():
  _check_one_step("sgd weak jax momentum", forge_jax.sgd, optax.sgd, (5e-2,),
                  dict(momentum=jnp.asarray(0.9),
                       accumulator_dtype=jnp.bfloat16))


def test_lion_sign_sees_the_rounded_b1_product():
  """Lion's update is a sign, which hides most of round_b1 in the test
  above: here `(1 - b1) * g + b1 * m` is put near 0, so the sign depends on
  `b1 * m` being rounded to bf16 as optax rounds it (with round_b1 ignored,
  4056 of 4096 signs differ). The rule and its hyperparameters are
  forge_jax.lion's own (a hand-built rule would leave the flag forge_jax
  sets untested)."""
  b1, b2 = 0.9, 0.99
  m = jax.random.normal(jax.random.key(0), (64, 64)).astype(jnp.bfloat16)
  p = np.float32(0.8984375) * np.asarray(m, np.float32)  # exact b1_m * m
  g = jnp.asarray(-p / np.float32(0.1), jnp.float32)     # makes the sum ~ 0
  params = {"w": jnp.zeros_like(g)}
  ref_tx = optax.lion(1.0, b1=b1, b2=b2, mu_dtype=jnp.bfloat16)
  spec = forge_jax.lion(1.0, b1=b1, b2=b2, mu_dtype=jnp.bfloat16).spec
  state = ref_tx.init(params)
  state = (state[0]._replace(mu={"w": m}), *state[1:])
  with jax.disable_jit():
    u_ref, _ = ref_tx.update({"w": g}, state, params)
  slots = tuple(forge_step._slot_trees(state, spec.slot_fields)[f]["w"]
                for f in spec.slot_fields)
  h = spec.rule.pack(**spec.hparams(state))
  w_new, _ = spec.rule.apply(g, params["w"], slots, h)
  differ = int((np.sign(np.asarray(w_new))
                != np.sign(np.asarray(u_ref["w"]))).sum())
  assert differ <= 0.01 * g.size, f"{differ} of {g.size} signs differ"


def test_each_family_sets_its_rounding_flags():
  """Which static rounding flags forge_jax sets: 1 where optax forms
  `decay * moment` in a narrower-than-fp32 moment's dtype, else 0; kept
  through MultiSteps."""
  bf16 = jnp.bfloat16
  static = lambda tx: dict(tx.spec.rule.static)
  assert static(forge_jax.lion(1e-3, mu_dtype=bf16)) == {"round_b1": 1.0,
                                                         "round_b2": 1.0}
  assert static(forge_jax.lion(1e-3)) == {"round_b1": 0.0, "round_b2": 0.0}
  assert static(forge_jax.adamw(1e-3, mu_dtype=bf16)) == {"round_mu": 1.0}
  assert static(forge_jax.adamw(1e-3, mu_dtype=jnp.float32)) == {
      "round_mu": 0.0}
  assert static(forge_jax.adam(1e-3, b1=np.float32(0.9), mu_dtype=bf16)) == {
      "round_mu": 0.0}  # a NumPy fp32 decay: the product is promoted
  assert static(forge_jax.sgd(1e-3, momentum=0.9,
                              accumulator_dtype=bf16)) == {"round_trace": 1.0}
  assert static(forge_jax.muon(1e-3, mu_dtype=bf16)) == {"round_mu": 1.0}
  assert static(forge_jax.MultiSteps(forge_jax.lion(1e-3, mu_dtype=bf16),
                                     2)) == {"round_b1": 1.0, "round_b2": 1.0}


# XLA's excess-precision pass (SimplifyFPConversions; on by default on the
# GPU) drops an f32 -> bf16 -> f32 convert pair, which would silently undo
# the rounded product in every jnp path that jits UpdateRule.apply (the
# reference, the zero-token path, an unreached head, MultiSteps for other
# parameters). XLA's CPU backend runs the pass with its oneDNN rewrite on,
# which shows it without a GPU.
_ROUNDING_PROG = """
import jax, jax.numpy as jnp, numpy as np
import pallas_kernels as pk
rule = pk.adam_rule().with_static(round_mu=1.0)
b1, b2, t = 0.9, 0.999, 4
h = rule.pack(lr=1e-2, b1=b1, b2=b2, one_minus_b1=1 - b1, one_minus_b2=1 - b2,
              eps=1e-8, eps_root=0.0, bc1=1 - b1**t, bc2=1 - b2**t,
              bc1_next=1 - b1**(t + 1), b1_m=0.8984375)
k = jax.random.split(jax.random.key(0), 4)
g, w = jax.random.normal(k[0], (64, 64)), jax.random.normal(k[1], (64, 64))
mu = (0.3 * jax.random.normal(k[2], (64, 64))).astype(jnp.bfloat16)
nu = 0.1 * jax.random.uniform(k[3], (64, 64))
with jax.disable_jit():
  eager, _ = rule.apply(g, w, (mu, nu), h)
jitted, _ = jax.jit(rule.apply)(g, w, (mu, nu), h)
e, j, w0 = (np.asarray(a, np.float64) for a in (eager, jitted, w))
print("REL", np.linalg.norm(j - e) / np.linalg.norm(e - w0))
# Canary: does this XLA drop a bare f32 -> bf16 -> f32 convert pair?
pair = jax.jit(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32))(g)
print("PAIR_DROPPED", int(bool((np.asarray(pair) != np.asarray(
    np.asarray(g).astype(jnp.bfloat16), np.float32)).any())))
"""


@pytest.mark.parametrize("flags", [
    "", "--xla_cpu_experimental_onednn_custom_call=true"],
    ids=["cpu_default", "excess_precision_pass_on"])
def test_jitted_rule_keeps_the_rounded_product(flags):
  """The jitted rule equals the op-by-op one. ``cpu_default`` is the
  baseline (the pass off); ``excess_precision_pass_on`` is the case that
  fails if the rounding is left to a convert pair XLA may drop: it needs a
  CPU whose oneDNN build runs the pass (bf16 support), and skips, saying
  so, elsewhere."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
             PYTHONPATH=root)
  out = subprocess.run([sys.executable, "-c", _ROUNDING_PROG], env=env,
                       cwd=root, capture_output=True, text=True, timeout=300)
  if flags and "Unknown flag" in out.stderr:
    pytest.skip(f"this jaxlib has no {flags}")
  assert out.returncode == 0, out.stderr[-2000:]
  rel = float(out.stdout.split("REL")[1].split()[0])
  dropped = int(out.stdout.split("PAIR_DROPPED")[1])
  if flags and not dropped:
    # The pass needs a oneDNN build and a CPU with bf16 support: without it
    # the check below could not fail.
    pytest.skip("XLA's excess-precision pass is not active on this CPU")
  # An fp32 fusion may move an ulp; a dropped bf16 rounding moves ~1e-3.
  assert rel < tol(jnp.float32), (
      f"XLA_FLAGS={flags!r}: jitted update {rel:.2e} off op by op")
