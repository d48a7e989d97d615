"""Global-norm gradient clipping in two passes: the squared-norm kernel and
forge_jax's ``clip_by_global_norm`` chain against optax's (forge_torch's
``max_grad_norm=``: tests/test_torch_clipping.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
import pallas_kernels as pk
from forge_jax import clip as jclip
from tests import harness
from tests.harness import MLP, WIDTHS, mse, reference_step
from tests.tolerances import assert_close, rel_err, tol, worst_leaf

F32 = tol(jnp.float32)


# --- the squared-norm kernel ---------------------------------------------------


def _operands(lead, n_in, n_out, dtype, seed=0):
  kx, kd = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(kx, (*lead, n_in), dtype),
          jax.random.normal(kd, (*lead, n_out), dtype))


def test_sqnorm_kernel_matches_its_reference_per_tile():
  """bf16 operands over two token axes, tiles no dimension divides, in
  groups along ``in``. (fp32 operands and the default tiling: the MLP
  parity test below, whose trajectory depends on every norm.)"""
  lead, n_in, n_out, dtype = (3, 17), 96, 40, jnp.bfloat16
  config = pk.BlockConfig(32, 16, 16, group_in=2)
  x, dy = _operands(lead, n_in, n_out, dtype)
  bt = int(np.prod(lead))
  parts = pk.wgrad_sqnorm(x, dy, config=config, interpret=True, partials=True)
  want = pk.wgrad_sqnorm_reference(x, dy, partials=True, block_in=32,
                                   block_out=16)
  assert parts.shape == (3, 3)  # ceil(96 / 32), ceil(40 / 16)
  assert parts.dtype == jnp.float32
  assert bool(jnp.all(parts > 0))  # every tile holds part of G
  assert_close(parts, want, F32, "per-tile sums")
  total = pk.wgrad_sqnorm(x, dy, config=config, interpret=True)
  # The total is the norm of G = x^T dy formed in fp32 (float64 check).
  g = np.asarray(x, np.float64).reshape(bt, n_in).T @ np.asarray(
      dy, np.float64).reshape(bt, n_out)
  assert rel_err(total, np.sum(g * g)) <= F32


def test_sqnorm_kernel_edge_cases_and_refusals():
  x, dy = _operands((0,), 20, 30, jnp.float32)
  assert float(pk.wgrad_sqnorm(x, dy, interpret=True)) == 0.0
  assert pk.wgrad_sqnorm(x, dy, interpret=True, partials=True).shape == (1, 1)
  x, dy = _operands((9,), 20, 30, jnp.float32)
  with pytest.raises(ValueError, match="split_out.*epilogue"):
    pk.wgrad_sqnorm(x, dy, interpret=True,
                    config=pk.BlockConfig(16, 32, 16, split_out=2))
  with pytest.raises(TypeError, match="wgrad_sqnorm: config must be a "
                     "pallas_kernels.BlockConfig"):
    pk.wgrad_sqnorm(x, dy, interpret=True, config={"block_in": 16})
  with pytest.raises(ValueError, match="leading"):
    pk.wgrad_sqnorm(x, dy[:5], interpret=True)
  with pytest.raises(TypeError, match="floating"):
    pk.wgrad_sqnorm(x.astype(jnp.int32), dy, interpret=True)
  for bad in (0, -16, 16.0, True):
    with pytest.raises(ValueError, match="block_in must be a positive int"):
      pk.wgrad_sqnorm_reference(x, dy, partials=True, block_in=bad)
  with pytest.raises(ValueError, match="block_out must be a positive int"):
    pk.wgrad_sqnorm_reference(x, dy, partials=True, block_out=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sqnorm_kernel_lowers_to_triton_for_cuda(dtype):
  """Deviceless lowering for an H200 catches Triton lowering errors. (Under
  an explicit-axes abstract mesh, as tests/harness.lower_for_cuda uses,
  JAX's Triton lowering of a reduction copies the operand's 2-D sharding
  onto the reduced value and fails; the kernel sees no mesh on a GPU.)"""
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Auto,),
                      abstract_device=AbstractDevice("NVIDIA H200", 132,
                                                     "gpu"))
  sh = NamedSharding(mesh, P())
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(lambda x, dy: pk.wgrad_sqnorm(x, dy, interpret=False)).trace(
        spec(300, 70), spec(300, 130)).lower(
            lowering_platforms=("cuda",)).as_text()
  assert [l for l in text.splitlines() if "xla.gpu.triton" in l]
  assert "wgrad_sqnorm" in text


def test_grad_scaled_rule_scales_g_before_the_update():
  base = pk.adamw_rule()
  rule = pk.grad_scaled(base)
  assert rule is pk.grad_scaled(base)  # cached: one compiled kernel
  assert rule.hparams == base.hparams + ("gscale_div", "gscale_mul")
  assert (rule.slots, rule.tuned_as) == (base.slots, "adamw")
  k = jax.random.split(jax.random.key(3), 4)
  g, w, mu, nu = (jax.random.normal(ki, (7, 9)) for ki in k)
  nu = jnp.abs(nu)
  h = dict(lr=1e-2, b1=0.9, b2=0.999, one_minus_b1=0.1, one_minus_b2=0.001,
           eps=1e-8, eps_root=0.0, weight_decay=1e-2, bc1=0.1, bc2=0.001,
           bc1_next=0.19)
  same = rule.apply(g, w, (mu, nu), rule.pack(**h, gscale_div=1.0,
                                              gscale_mul=1.0))
  want = base.apply(g, w, (mu, nu), base.pack(**h))
  for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)  # factors 1: bit for bit
  got = rule.apply(g, w, (mu, nu), rule.pack(**h, gscale_div=3.0,
                                             gscale_mul=0.5))
  want = base.apply((g / 3.0) * 0.5, w, (mu, nu), base.pack(**h))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="already uses"):
    pk.grad_scaled(rule)


# --- forge_jax -------------------------------------------------------------------


def _batches(steps, seed=1, n=24):
  """Batches whose targets change scale, so the gradient norm swings."""
  k = jax.random.split(jax.random.key(seed), 2 * steps)
  return [(jax.random.normal(k[2 * i], (n, WIDTHS[0])),
           (1.0 + 2.0 * (i % 3)) * jax.random.normal(k[2 * i + 1],
                                                      (n, WIDTHS[-1])))
          for i in range(steps)]


def _norm_fn(loss_fn):
  """``(variables, batch) -> the global norm of the params' gradient``."""
  return jax.jit(lambda v, b: optax.tree.norm(jax.grad(loss_fn)(v, b)["params"]))


def _train_pair(ref_model, f_model, make_opt, clip, batches, wgrad="fused"):
  """optax's chain(clip_by_global_norm(m), opt) against the FORGE step with
  ``clip(m)`` before ``make_opt(forge_jax)``, ``m`` the median of the
  gradient norms at the initial parameters (so that some steps clip and
  others do not). Returns (forge state, reference state, the reference's
  norms, m, losses, the FORGE step's jaxpr)."""
  variables = ref_model.init(jax.random.key(0), batches[0][0])
  loss_ref = mse(ref_model)
  norm = _norm_fn(loss_ref)
  m = float(np.median([float(norm(variables, b)) for b in batches]))
  ref_tx = optax.chain(optax.clip_by_global_norm(m), make_opt(optax))
  f_tx = optax.chain(clip(m), make_opt(forge_jax))
  ref_step = jax.jit(reference_step(loss_ref, ref_tx))
  v_ref, s_ref = variables, ref_tx.init(variables["params"])
  v_f = jax.tree.map(jnp.copy, variables)
  s_f = f_tx.init(v_f["params"])
  traced = jax.jit(forge_jax.make_step(mse(f_model), f_tx, wgrad=wgrad),
                   donate_argnums=(0, 1)).trace(v_f, s_f, batches[0])
  f_step = traced.lower().compile()
  norms, losses = [], []
  for b in batches:
    norms.append(float(norm(v_ref, b)))
    l_ref, v_ref, s_ref = ref_step(v_ref, s_ref, b)
    l_f, v_f, s_f = f_step(v_f, s_f, b)
    losses.append((float(l_f), float(l_ref)))
  return (v_f, s_f), (v_ref, s_ref), norms, m, losses, traced.jaxpr.jaxpr


def _assert_clipped_parity(got, ref, norms, m, losses):
  # Not vacuous: the clipping acted in some steps and not in others.
  assert any(n >= m for n in norms) and any(n < m for n in norms), (norms, m)
  for l_f, l_ref in losses:
    assert rel_err(l_f, l_ref) <= F32
  (v_f, s_f), (v_ref, s_ref) = got, ref
  err, where = worst_leaf((v_f["params"], s_f), (v_ref["params"], s_ref))
  assert err <= F32, (err, where)


def test_jax_clipped_adamw_matches_optax_chain_without_a_weight_gradient():
  """The odd-width MLP, fp32, every parameter and moment after 10 steps:
  optax.chain(forge_jax.clip_by_global_norm(m), forge_jax.adamw(...))
  against optax.chain(optax.clip_by_global_norm(m), optax.adamw(...)). The
  step runs three norm kernels and three fused updates and forms no weight
  gradient outside them (optax's step, by the same detector, forms all
  three)."""
  make = lambda lib: lib.adamw(3e-2, weight_decay=1e-2,
                               mask=lambda p: jax.tree.map(
                                   lambda a: a.ndim > 1, p))
  batches = _batches(10)
  got, ref, norms, m, losses, jaxpr = _train_pair(
      MLP(nn.Dense), MLP(forge_jax.Dense), make,
      forge_jax.clip_by_global_norm, batches)
  _assert_clipped_parity(got, ref, norms, m, losses)

  bt = batches[0][0].shape[0]
  shapes = {(WIDTHS[i], WIDTHS[i + 1]) for i in range(3)}
  assert harness.kernel_gradient_dots(jaxpr, shapes, bt) == []
  kernels = sorted(e.params["name"] for e in harness.jaxpr_eqns(jaxpr)
                   if e.primitive.name == "pallas_call")
  assert kernels == (["fused_wgrad_adamw_clipped"] * 3
                     + ["wgrad_sqnorm"] * 3), kernels
  ref = jax.make_jaxpr(jax.grad(mse(MLP(nn.Dense))))(got[0], batches[0]).jaxpr
  assert sorted(harness.kernel_gradient_dots(ref, shapes, bt)) == sorted(
      shapes)


_REGIME_2 = {
    "lamb": lambda lib: lib.lamb(3e-3, weight_decay=1e-2),
    "muon": lambda lib: (optax.contrib if lib is optax else lib).muon(2e-2),
    # No optax transform: forge_jax's own, run by optax on nn.Dense.
    "scion": lambda lib: forge_jax.scion(2e-3),
}


@pytest.mark.parametrize("family", sorted(_REGIME_2))
def test_jax_clipped_regime_2_families_match_the_optax_chain(family):
  """The regime-2 families (their layer pass reads the clipped moments),
  clipped in some of 6 steps: every parameter and state leaf as the optax
  chain's."""
  got, ref, norms, m, losses, _ = _train_pair(
      MLP(nn.Dense), MLP(forge_jax.Dense), _REGIME_2[family],
      forge_jax.clip_by_global_norm, _batches(6))
  _assert_clipped_parity(got, ref, norms, m, losses)


class _Stacked(nn.Module):
  """Dense(37 -> 24), a scanned stack of three 24-wide layers, Dense(-> 5):
  forge_jax's layers and ScannedDenseStack, or flax's own nn.scan."""
  forge: bool

  @nn.compact
  def __call__(self, x):
    dense = forge_jax.Dense if self.forge else nn.Dense
    x = nn.relu(dense(24)(x))
    x = forge_jax.ScannedDenseStack(24, 3, fused=self.forge, name="stack")(x)
    return dense(5)(x)


def test_optax_clip_scanned_stack_and_injected_hyperparams_match():
  """optax's own clip_by_global_norm, recognised in the chain, before
  optax.inject_hyperparams(forge_jax.adamw), on a ScannedDenseStack between
  two Dense layers (wgrad="xla": the norm pass sums the stack's layers in
  its backward loop), against the same chain of optax's transforms."""
  make = lambda lib: optax.inject_hyperparams(lib.adamw)(learning_rate=2e-2)
  k = jax.random.split(jax.random.key(5), 16)
  batches = [(jax.random.normal(k[2 * i], (16, 37)),
              (1.0 + 2.0 * (i % 3)) * jax.random.normal(k[2 * i + 1],
                                                         (16, 5)))
             for i in range(8)]
  got, ref, norms, m, losses, _ = _train_pair(
      _Stacked(False), _Stacked(True), make, optax.clip_by_global_norm,
      batches, wgrad="xla")
  _assert_clipped_parity(got, ref, norms, m, losses)


def test_clipped_scanned_stack_keeps_one_set_of_saved_activations():
  """A bf16 ScannedDenseStack's clipped step, compiled (wgrad="xla",
  stack_update="slice": plain XLA, no interpreter copies), holds less than
  one saved-activation stack (L, tokens, features) of temporaries beyond the
  unclipped step's. lax.scan starts its stacked outputs from a constant,
  which XLA made at the start of the step: the update pass's two stacks were
  live through the whole norm pass (two stacks more). The stacks now come
  from scan.scan_saving, equal to lax.scan bit for bit."""
  from forge_jax import scan as jscan  # noqa: PLC0415
  layers, width, bt = 3, 40, 200
  model = forge_jax.ScannedDenseStack(width, layers, use_bias=False,
                                      dtype=jnp.bfloat16,
                                      param_dtype=jnp.bfloat16,
                                      stack_update="slice")
  x = jax.random.normal(jax.random.key(3), (bt, width), jnp.bfloat16)
  variables = model.init(jax.random.key(4), x)
  loss_fn = lambda v, b: jnp.mean(model.apply(v, b).astype(jnp.float32) ** 2)
  temp = {}
  for clip in (False, True):
    tx = forge_jax.adamw(1e-3)
    if clip:
      tx = optax.chain(forge_jax.clip_by_global_norm(1.0), tx)
    step = jax.jit(forge_jax.make_step(loss_fn, tx, wgrad="xla"),
                   donate_argnums=(0, 1))
    compiled = step.lower(variables, tx.init(variables["params"]), x).compile()
    temp[clip] = compiled.memory_analysis().temp_size_in_bytes
  stack = layers * bt * width * 2
  assert temp[True] - temp[False] < stack, (temp, stack)

  def body(c, p):
    w, k = p
    c = jnp.tanh(c @ w) + k
    return c, (c.astype(jnp.bfloat16), jnp.sum(c, axis=0), None)

  kw, kc, kk = jax.random.split(jax.random.key(6), 3)
  per_layer = (jax.random.normal(kw, (5, 7, 7)),
               jax.random.randint(kk, (5,), -3, 4))
  c0 = jax.random.normal(kc, (3, 7))
  got = jscan.scan_saving(body, c0, per_layer, per_layer[0])
  want = jax.lax.scan(body, c0, per_layer)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g, np.float32),
                                  np.asarray(w, np.float32))


@pytest.mark.parametrize("chain,match", [
    (lambda: optax.chain(forge_jax.adamw(1e-3),
                         forge_jax.clip_by_global_norm(1.0)),
     "after the optimizer.*clip the optimizer's updates"),
    (lambda: optax.chain(optax.clip_by_global_norm(1.0),
                         forge_jax.clip_by_global_norm(1.0),
                         forge_jax.adamw(1e-3)),
     "holds 2 global-norm clippings"),
    (lambda: optax.chain(forge_jax.clip_by_global_norm(1.0)),
     "holds 0 forge_jax optimizers"),
    (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.clip(1.0),
                         forge_jax.adamw(1e-3)),
     "1 transform.*forge_jax cannot drive"),
    (lambda: optax.chain(forge_jax.clip_by_global_norm(1.0),
                         forge_jax.MultiSteps(forge_jax.adamw(1e-3), 2)),
     "^make_step: global-norm clipping together with gradient accumulation "
     ".*not supported.*What runs"),
    # The accumulation made by an injected factory: the same refusal.
    (lambda: optax.chain(
        forge_jax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(lambda learning_rate: forge_jax.MultiSteps(
            forge_jax.adamw(learning_rate), 2))(learning_rate=1e-3)),
     "^make_step: global-norm clipping together with gradient accumulation "
     ".*not supported.*What runs"),
    (lambda: forge_jax.MultiSteps(
        optax.chain(forge_jax.clip_by_global_norm(1.0),
                    forge_jax.adamw(1e-3)), 2),
     "^forge_jax.MultiSteps: global-norm clipping together with gradient "
     "accumulation .*not supported.*What runs"),
    (lambda: optax.chain(forge_jax.clip_by_global_norm(1.0),
                         forge_jax.adafactor(1e-3)),
     "'adafactor'.*not supported"),
    (lambda: forge_jax.clip_by_global_norm(1.0),
     "make_step needs a forge_jax transform.*ClipByGlobalNorm"),
    # An injected max_norm (either clipping), or a factory that makes the
    # whole chain: named, with the form that runs.
    (lambda: optax.chain(
        optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=1.0),
        forge_jax.adamw(1e-3)),
     r"clipping inside optax.inject_hyperparams \(an injected or scheduled "
     r"max_norm\) is not supported"),
    (lambda: optax.chain(
        optax.inject_hyperparams(forge_jax.clip_by_global_norm)(max_norm=1.0),
        forge_jax.adamw(1e-3)),
     r"clipping inside optax.inject_hyperparams \(an injected or scheduled "
     r"max_norm\) is not supported"),
    (lambda: optax.inject_hyperparams(
        lambda learning_rate, max_norm: optax.chain(
            forge_jax.clip_by_global_norm(max_norm),
            forge_jax.adamw(learning_rate)))(learning_rate=1e-3, max_norm=1.0),
     "makes an optax.chain, not a forge_jax transform: inject the forge_jax "
     "factory alone"),
])
def test_unsupported_clipping_forms_are_refused_with_the_fix(chain, match):
  with pytest.raises(TypeError, match=match) as e:
    forge_jax.make_step(mse(MLP(forge_jax.Dense)), chain())
  assert "clip_by_global_norm(max_norm)" in str(e.value)


def test_clip_transform_is_optax_clip_and_checks_max_norm():
  tx = forge_jax.clip_by_global_norm(0.5)
  assert isinstance(tx, optax.GradientTransformation) and tx.max_norm == 0.5
  updates = {"a": jnp.arange(6.0).reshape(2, 3), "b": -jnp.ones(4)}
  got, _ = tx.update(updates, tx.init(updates))
  want, _ = optax.clip_by_global_norm(0.5).update(updates, None)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  chain = optax.chain(optax.clip_by_global_norm(2.5), forge_jax.sgd(0.1))
  found = jclip.recognise(chain)
  assert found.max_norm == 2.5 and found.index == 1
  assert found.member.spec.family == "sgd"
  assert jclip.recognise(forge_jax.adamw(1e-3)) is None
  assert jclip.recognise(optax.chain(optax.clip(1.0), optax.sgd(0.1))) is None
  for bad, exc in ((0.0, ValueError), (-1.0, ValueError),
                   (float("nan"), ValueError), ("1", TypeError),
                   (True, TypeError), (np.ones(2), TypeError)):
    with pytest.raises(exc, match="max_norm"):
      forge_jax.clip_by_global_norm(bad)
    if exc is ValueError:  # optax's own, in a chain, is checked too
      with pytest.raises(exc, match="max_norm"):
        jclip.recognise(optax.chain(optax.clip_by_global_norm(bad),
                                    forge_jax.sgd(0.1)))


# --- GPU --------------------------------------------------------------------------


@pytest.mark.gpu
def test_clipped_step_on_gpu_matches_optax_and_adds_no_gradient_buffer():
  """Compiled on the GPU: the clipped fp32 MLP step matches optax's chain
  (the Triton norm and update kernels), and a ScannedBlocks model too; a
  bf16 4096x4096 layer's clipped step holds no kernel-sized
  temporary beyond the unclipped FORGE step's (no gradient buffer: at most
  the second pass's activations) and updates W, mu and nu in their donated
  buffers."""
  import re  # noqa: PLC0415
  with jax.default_matmul_precision("highest"):
    make = lambda lib: lib.adamw(3e-2, weight_decay=1e-2)
    got, ref, norms, m, losses, _ = _train_pair(
        MLP(nn.Dense), MLP(forge_jax.Dense), make,
        forge_jax.clip_by_global_norm, _batches(12))
    _assert_clipped_parity(got, ref, norms, m, losses)
    # ScannedBlocks (its norm pass sums each FORGE Dense over the blocks),
    # on the stacks in place (stack_update="layer" on a GPU).
    from tests.test_blocks import Model  # noqa: PLC0415
    got, ref, norms, m, losses, _ = _train_pair(
        Model(False, num_layers=3), Model(True, num_layers=3), make,
        forge_jax.clip_by_global_norm, _batches(8))
    _assert_clipped_parity(got, ref, norms, m, losses)

  n, bt = 4096, 512

  class One(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.Dense(n, use_bias=False, param_dtype=jnp.bfloat16,
                             dtype=jnp.bfloat16)(x)

  x = jnp.ones((bt, n), jnp.bfloat16)
  variables = One().init(jax.random.key(0), x)
  loss_fn = lambda v, b: jnp.mean(One().apply(v, b).astype(jnp.float32) ** 2)
  compiled = {}
  for clip in (False, True):
    tx = forge_jax.adamw(1e-3)
    if clip:
      tx = optax.chain(forge_jax.clip_by_global_norm(1.0), tx)
    jitted = jax.jit(forge_jax.make_step(loss_fn, tx), donate_argnums=(0, 1))
    opt_state = tx.init(variables["params"])
    compiled[clip] = jitted.lower(variables, opt_state, x).compile()
  temp = {c: compiled[c].memory_analysis().temp_size_in_bytes
          for c in compiled}
  print(f"temp: unclipped {temp[False] / 2**20:.1f} MiB, clipped "
        f"{temp[True] / 2**20:.1f} MiB")
  kernel_bytes = n * n * 2
  assert temp[True] < temp[False] + kernel_bytes // 2, temp
  hlo = compiled[True].as_text()
  kernel_sized = [l.strip()[:160] for l in hlo.splitlines()
                  if re.search(rf"= (bf16|f32)\[{n},{n}\]", l)
                  and not re.search(r"parameter\(|get-tuple-element\(|bitcast\(",
                                    l)]
  assert not kernel_sized, kernel_sized
  leaves = lambda v, s: jax.tree.leaves((v["params"], s[1][0].mu, s[1][0].nu))
  opt_state = tx.init(variables["params"])
  ptrs = [a.unsafe_buffer_pointer() for a in leaves(variables, opt_state)]
  _, new_v, new_s = jitted(variables, opt_state, x)
  assert [a.unsafe_buffer_pointer() for a in leaves(new_v, new_s)] == ptrs
