"""Global-norm gradient clipping in two passes: the squared-norm kernel,
forge_jax's ``clip_by_global_norm`` chain against optax's, and forge_torch's
``max_grad_norm=`` against ``clip_grad_norm_`` + the torch optimizer."""

import copy
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import forge_jax
import forge_torch
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


# --- forge_torch ---------------------------------------------------------------


def _torch_mlp():
  """WIDTHS, ReLUs, a dropout after the first: layers at 0, 3 and 5."""
  return torch.nn.Sequential(
      torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.ReLU(),
      torch.nn.Dropout(0.25), torch.nn.Linear(WIDTHS[1], WIDTHS[2]),
      torch.nn.ReLU(), torch.nn.Linear(WIDTHS[2], WIDTHS[3]))


def _torch_batches(steps, seed=1, n=24):
  g = torch.Generator().manual_seed(seed)
  return [(torch.randn(n, WIDTHS[0], generator=g),
           (1.0 + 2.0 * (i % 3)) * torch.randn(n, WIDTHS[-1], generator=g))
          for i in range(steps)]


def _torch_loss(model, batch):
  x, y = batch
  return ((model(x) - y) ** 2).mean()


def test_torch_max_grad_norm_matches_clip_grad_norm_and_adamw():
  """The odd-width MLP, fp32, 10 steps: forge_torch.AdamW(max_grad_norm=m)
  stepping a closure equals torch's loop with clip_grad_norm_(params, m)
  before torch.optim.AdamW.step(), in every parameter and state tensor.
  The first and last layers are managed (their norms measured by the
  kernel), the middle one a plain nn.Linear (its norm from its .grad). A
  dropout draws the same masks in both closure calls (torch's generator is
  rewound), so the measured norm is that of the applied gradient."""
  _check_torch_parity("cpu")


def _check_torch_parity(device: str) -> None:
  torch.manual_seed(0)
  batches = [tuple(t.to(device) for t in b) for b in _torch_batches(10)]
  kw = dict(lr=3e-2, weight_decay=1e-2)
  # max_norm: the median norm of an unclipped run, so both cases happen.
  probe = _torch_mlp().to(device)
  ref = copy.deepcopy(probe)
  model = copy.deepcopy(probe)
  probe_opt, norms = torch.optim.AdamW(probe.parameters(), **kw), []
  for i, b in enumerate(batches):
    torch.manual_seed(100 + i)
    probe_opt.zero_grad()
    _torch_loss(probe, b).backward()
    norms.append(float(torch.nn.utils.get_total_norm(
        [p.grad for p in probe.parameters()])))
    probe_opt.step()
  m = float(np.median(norms))

  forge_torch.convert(model, exclude=["3"])
  opt = forge_torch.AdamW(model.parameters(), **kw, max_grad_norm=m)
  ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
  assert opt.managed_params == [model[0].weight, model[5].weight]
  ref_norms = []
  for i, b in enumerate(batches):
    torch.manual_seed(100 + i)  # the same dropout masks in both models
    ref_opt.zero_grad()
    l_ref = _torch_loss(ref, b)
    l_ref.backward()
    ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(),
                                                          m)))
    ref_opt.step()

    def closure(b=b):
      opt.zero_grad()
      loss = _torch_loss(model, b)
      loss.backward()
      return loss

    torch.manual_seed(100 + i)
    loss = opt.step(closure)
    assert rel_err(float(loss.detach()), float(l_ref.detach())) <= F32
    assert rel_err(float(opt.last_grad_norm), ref_norms[-1]) <= F32
  assert any(n >= m for n in ref_norms) and any(n < m for n in ref_norms)
  for (name, p), q in zip(model.named_parameters(), ref.parameters(),
                          strict=True):
    assert_close(p.detach().cpu().numpy(), q.detach().cpu().numpy(), F32,
                 name)
    for key, want in ref_opt.state[q].items():
      assert_close(opt.state[p][key].cpu().numpy(), want.cpu().numpy(), F32,
                   f"{name} {key}")
  assert all(p.grad is None for p in opt.managed_params)
  assert model[3].weight.grad is not None  # the plain layer's, clipped


def test_torch_max_grad_norm_refuses_misuse_with_the_fix():
  model = torch.nn.Sequential(forge_torch.Linear(8, 6), torch.nn.Tanh(),
                              torch.nn.Linear(6, 3))
  sig = inspect.signature(forge_torch.SGD).parameters["max_grad_norm"]
  assert sig.default is None
  for bad, exc in ((0.0, ValueError), (-2.0, ValueError),
                   (float("inf"), ValueError), ("1", TypeError)):
    with pytest.raises(exc, match="max_grad_norm"):
      forge_torch.SGD(model.parameters(), lr=0.1, max_grad_norm=bad)
  opt = forge_torch.SGD(model.parameters(), lr=0.1, max_grad_norm=1.0)
  assert copy.deepcopy(opt).max_grad_norm == 1.0
  x = torch.randn(5, 8)
  with pytest.raises(RuntimeError, match=r"optimizer\.step\(closure\)"):
    opt.step()
  opt.accumulate_steps = 2
  with pytest.raises(RuntimeError, match="accumulate_steps > 1"):
    opt.step(lambda: model(x).square().mean().backward())
  opt.accumulate_steps = 1
  # A backward outside step(closure) cannot clip: refused in the backward.
  with pytest.raises(RuntimeError, match=r"Linear.*max_grad_norm.*step\(closure\)"):
    model(x).square().mean().backward()
  # torch's own clipping of a managed weight says what to use instead.
  other = torch.nn.Sequential(forge_torch.Linear(8, 3))
  other_opt = forge_torch.SGD(other.parameters(), lr=0.1)
  other(x).square().mean().backward()
  with pytest.raises(RuntimeError, match=r"max_grad_norm=.*step\(closure\)"):
    torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
  other_opt.step()


def test_torch_max_grad_norm_forms_a_fresh_state_for_distributed_checkpoint():
  """torch.distributed.checkpoint forms a fresh optimizer's state by
  step() without a closure from zero gradients (at lr 0): with
  max_grad_norm that step runs as is (clipping zeros changes nothing), so
  saving and restoring a clipped run through it works and continues as
  the unbroken run; a nonzero gradient without a closure is refused."""
  from torch.distributed.checkpoint import state_dict as dcp  # noqa: PLC0415

  def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(forge_torch.Linear(8, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 3))

  x = torch.randn(5, 8)
  model = make()
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5)
  before = [p.detach().clone() for p in model.parameters()]
  dcp.get_optimizer_state_dict(model, opt)  # a fresh optimizer's state
  assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
  assert opt.param_groups[0]["lr"] == 1e-2 and opt.state

  def closure(m, o):
    def run():
      o.zero_grad()
      loss = m(x).square().mean()
      loss.backward()
      return loss
    return run

  opt.step(closure(model, opt))
  saved = copy.deepcopy(dcp.get_optimizer_state_dict(model, opt))
  restored = make()
  restored.load_state_dict(model.state_dict())
  new = forge_torch.AdamW(restored.parameters(), lr=1e-2, max_grad_norm=0.5)
  dcp.set_optimizer_state_dict(restored, new, saved)
  for m, o in ((model, opt), (restored, new)):
    o.step(closure(m, o))
  for p, q in zip(restored.parameters(), model.parameters()):
    assert torch.equal(p, q)
  model[2].weight.grad = torch.ones_like(model[2].weight)
  with pytest.raises(RuntimeError, match=r"optimizer\.step\(closure\)"):
    opt.step()
  # With int8 moments (a weight of 4096 elements or more): the zero
  # gradient's fused step, unclipped.
  big = torch.nn.Sequential(forge_torch.Linear(96, 64))
  for options in (dict(moments="int8"),
                  dict(stochastic_rounding=True, seed=1)):
    big.to(torch.bfloat16 if "seed" in options else torch.float32)
    quantized = forge_torch.AdamW(big.parameters(), lr=1e-2,
                                  max_grad_norm=0.5, **options)
    dcp.get_optimizer_state_dict(big, quantized)
    assert quantized.param_groups[0]["lr"] == 1e-2
    assert quantized.state[big[0].weight]["exp_avg"].dtype == (
        torch.int8 if "moments" in options else torch.bfloat16)


def test_torch_max_grad_norm_refuses_prepared_weights_before_any_pass(
    monkeypatch):
  """Weights prepared for data parallelism (prepare_ddp / prepare_fsdp)
  refuse clipping in their reduction whatever the group's size (a process
  group of one rank included): refused by step(closure) up front, before
  the closure runs, not after its two calls' side effects."""
  model = torch.nn.Sequential(forge_torch.Linear(8, 6), torch.nn.Tanh(),
                              torch.nn.Linear(6, 3))
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
  monkeypatch.setattr(forge_torch.distributed, "is_data_parallel",
                      lambda p: p is model[0].weight)
  calls = []

  def closure():
    calls.append(1)
    loss = model(torch.randn(5, 8)).square().mean()
    loss.backward()
    return loss

  with pytest.raises(RuntimeError, match=(
      r"max_grad_norm is not supported with the data parallelism(.|\n)*"
      r"whatever the process group's size")):
    opt.step(closure)
  assert calls == []


def test_torch_max_grad_norm_keeps_zero_gradients_of_unreached_params():
  """A closure zeroing with zero_grad(set_to_none=False) leaves torch a zero
  .grad on a layer its backward no longer reaches, which torch's AdamW
  steps from zero (decay and momentum): both passes start from such zero
  tensors, so the plain bias and the managed weight of a layer used in the
  first step only match torch's zero_grad / clip_grad_norm_ / step loop."""
  torch.manual_seed(0)

  class Net(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.fc, self.side = torch.nn.Linear(9, 7), torch.nn.Linear(9, 7)

    def forward(self, x, use_side):
      return self.fc(x) + self.side(x) if use_side else self.fc(x)

  ref = Net()
  model = copy.deepcopy(ref)
  forge_torch.convert(model)
  kw = dict(lr=1e-2, weight_decay=0.1)
  opt = forge_torch.AdamW(model.parameters(), **kw, max_grad_norm=0.5)
  ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
  x, y = torch.randn(8, 9), torch.randn(8, 7)
  for use in (True, False, False):
    ref_opt.zero_grad(set_to_none=False)
    ((ref(x, use) - y) ** 2).mean().backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()

    def closure(use=use):
      opt.zero_grad(set_to_none=False)
      loss = ((model(x, use) - y) ** 2).mean()
      loss.backward()
      return loss

    opt.step(closure)
  for (name, p), q in zip(model.named_parameters(), ref.parameters(),
                          strict=True):
    assert_close(p.detach().numpy(), q.detach().numpy(), F32, name)
  assert model.side.bias.grad is not None and not model.side.bias.grad.any()


def test_torch_max_grad_norm_steps_managed_weights_alone_from_zero():
  """An optimizer over managed weights alone, stepped without a closure
  after zero_grad(set_to_none=False) (no layer run): torch's step from
  those zero gradients (Adam's momentum moves the weight), as with other
  parameters beside them, not a refusal asking for a closure."""
  torch.manual_seed(0)
  ref = torch.nn.Sequential(torch.nn.Linear(6, 5, bias=False))
  model = copy.deepcopy(ref)
  forge_torch.convert(model)
  ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
  opt = forge_torch.Adam(model.parameters(), lr=1e-2, max_grad_norm=1.0)
  x = torch.randn(4, 6)
  ref_opt.zero_grad(set_to_none=False)
  ref(x).sum().backward()
  torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
  ref_opt.step()

  def closure():
    opt.zero_grad(set_to_none=False)
    loss = model(x).sum()
    loss.backward()
    return loss

  opt.step(closure)
  before = model[0].weight.detach().clone()
  for o in (ref_opt, opt):
    o.zero_grad(set_to_none=False)
    o.step()
  assert not torch.equal(model[0].weight, before)
  assert_close(model[0].weight.detach().numpy(),
               ref[0].weight.detach().numpy(), F32, "weight")
  assert torch.equal(opt.state[model[0].weight]["step"],
                     ref_opt.state[ref[0].weight]["step"])


def test_torch_max_grad_norm_refuses_another_optimizers_layer_in_closure():
  """A managed layer of a second forge_torch optimizer in the closure of a
  clipped step would be updated by both passes: refused in the first
  pass's backward, before any update, naming the layer and the fix."""
  torch.manual_seed(0)
  model = torch.nn.Sequential(forge_torch.Linear(8, 6), torch.nn.Tanh(),
                              forge_torch.Linear(6, 3))
  opt_a = forge_torch.AdamW(model[0].parameters(), lr=1e-2,
                            max_grad_norm=1.0)
  opt_b = forge_torch.AdamW(model[2].parameters(), lr=1e-2)
  w_b = model[2].weight.detach().clone()
  x = torch.randn(5, 8)

  def closure():
    opt_a.zero_grad()
    opt_b.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    return loss

  with pytest.raises(RuntimeError, match=(
      r"Linear\(6, 3\), managed by another forge_torch\.AdamW, ran in the "
      r"closure of a forge_torch\.AdamW\.step\(closure\) with max_grad_norm"
      r".*Build one optimizer")):
    opt_a.step(closure)
  assert torch.equal(model[2].weight, w_b) and len(opt_b.state) == 0


# --- GPU --------------------------------------------------------------------------


@pytest.mark.gpu
def test_clipped_step_on_gpu_matches_optax_and_adds_no_gradient_buffer():
  """Compiled on the GPU: the clipped fp32 MLP step matches optax's chain
  (the Triton norm and update kernels), a ScannedBlocks model too, and
  forge_torch's max_grad_norm matches clip_grad_norm_ + AdamW on CUDA
  tensors; a bf16 4096x4096 layer's clipped step holds no kernel-sized
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
  _check_torch_parity("cuda")

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


def test_torch_a_closure_that_raised_leaves_the_step_callable():
  """An exception inside ``opt.step(closure)`` (the norm pass here) leaves
  no forward counted nor norm kept: the next ``step(closure)`` runs as
  torch's retry would, and the weights match torch's clipped step."""
  torch.manual_seed(0)
  ref = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(),
                            torch.nn.Linear(6, 3))
  model = copy.deepcopy(ref)
  forge_torch.convert(model)
  x, y = torch.randn(5, 8), torch.randn(5, 3)
  opt = forge_torch.Adam(model.parameters(), lr=1e-2, max_grad_norm=0.1)
  o_r = torch.optim.Adam(ref.parameters(), lr=1e-2)

  def failing():
    torch.nn.functional.mse_loss(model(x), y).backward()
    raise ValueError("a bad batch (simulated)")

  with pytest.raises(ValueError, match="simulated"):
    opt.step(failing)
  opt.step(lambda: torch.nn.functional.mse_loss(model(x), y).backward())
  torch.nn.functional.mse_loss(ref(x), y).backward()
  torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
  o_r.step()
  for a, b in zip(model.parameters(), ref.parameters()):
    assert (a - b).norm() <= tol(jnp.float32) * b.norm()


def test_torch_a_second_backward_in_the_norm_pass_says_nothing_applied():
  """A closure that runs backward twice through one forward
  (retain_graph=True) fails in the clipped step's first pass, whose first
  backward only measured the norm: the message says so and that the
  weights are unchanged (they are); a correct closure then steps."""
  torch.manual_seed(0)
  model = torch.nn.Sequential(forge_torch.Linear(8, 6), torch.nn.Tanh(),
                              forge_torch.Linear(6, 3))
  x, y = torch.randn(5, 8), torch.randn(5, 3)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1)
  before = [p.detach().clone() for p in model.parameters()]

  def twice():
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    loss.backward()

  with pytest.raises(RuntimeError, match=r"first pass of a clipped step "
                     r"\(max_grad_norm\).*measured the gradient's norm.*"
                     r"Nothing has been applied"):
    opt.step(twice)
  for a, b in zip(model.parameters(), before):
    assert torch.equal(a, b)
  opt.step(lambda: torch.nn.functional.mse_loss(model(x), y).backward())
  assert opt.state[model[0].weight]["step"].item() == 1
  assert not torch.equal(model[0].weight, before[0])


def test_torch_clip_guard_sees_accumulated_managed_weights():
  """A step of accumulate_steps micro-batches cut short: the managed
  weights' gradients sit in their buffers, not in .grad, so torch's
  clip_grad_norm_ over them is refused (it would clip the others alone)."""
  model = torch.nn.Sequential(forge_torch.Linear(8, 6), torch.nn.Tanh(),
                              torch.nn.Linear(6, 3))
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  opt.accumulate_steps = 2
  model(torch.randn(5, 8)).square().mean().backward()
  with pytest.raises(RuntimeError, match="accumulation buffer"):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def _buffered_model(kind: str) -> torch.nn.Module:
  """Two managed layers around a layer with buffers: BatchNorm1d (running
  statistics, num_batches_tracked) or a spectral_norm-parametrized
  nn.Linear (its power-iteration vectors, advanced by each forward)."""
  if kind == "batchnorm":
    mid = torch.nn.BatchNorm1d(WIDTHS[1])
  else:
    mid = torch.nn.utils.parametrizations.spectral_norm(
        torch.nn.Linear(WIDTHS[1], WIDTHS[1]))
  # (after the Tanh: a bias right before a BatchNorm has no gradient but
  # rounding noise, which Adam's normalisation would amplify)
  return torch.nn.Sequential(
      torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.Tanh(), mid,
      torch.nn.Linear(WIDTHS[1], WIDTHS[3]))


@pytest.mark.parametrize("kind", ["batchnorm", "spectral_norm"])
def test_torch_restore_buffers_advances_them_once_as_torch_does(kind):
  """``restore_buffers=model``: each clipped step leaves the model's
  buffers where torch's one-pass loop (clip_grad_norm_ + AdamW) leaves
  them, so parameters, optimizer state, buffers and the eval-mode output
  match torch's after 6 steps. Without it the first pass advances them
  too: BatchNorm counts two batches a step, and spectral_norm's second
  pass runs from other vectors than torch's."""
  torch.manual_seed(0)
  batches = _torch_batches(6, seed=2)
  ref = _buffered_model(kind)
  model, plain = copy.deepcopy(ref), copy.deepcopy(ref)
  for m in (model, plain):
    forge_torch.convert(m, exclude=["2"])
  kw = dict(lr=2e-2, weight_decay=1e-2, max_grad_norm=0.5)
  opt = forge_torch.AdamW(model.parameters(), **kw, restore_buffers=model)
  plain_opt = forge_torch.AdamW(plain.parameters(), **kw)
  assert opt.restore_buffers is model and plain_opt.restore_buffers is None
  assert opt.managed_params == [model[0].weight, model[3].weight]
  ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-2, weight_decay=1e-2)
  clipped = []
  for b in batches:
    ref_opt.zero_grad()
    l_ref = _torch_loss(ref, b)
    l_ref.backward()
    clipped.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(),
                                                        0.5)) > 0.5)
    ref_opt.step()
    for o, m in ((opt, model), (plain_opt, plain)):
      loss = o.step(lambda o=o, m=m, b=b: (
          o.zero_grad(), l := _torch_loss(m, b), l.backward(), l)[-1])
    assert rel_err(float(opt.last_grad_norm), float(
        plain_opt.last_grad_norm)) <= F32 or kind == "spectral_norm"
  assert any(clipped)  # the coefficient was applied
  bufs = lambda m: dict(m.named_buffers())
  assert bufs(model).keys() == bufs(ref).keys() and bufs(ref)
  for name, want in bufs(ref).items():
    assert_close(bufs(model)[name].double().numpy(), want.double().numpy(),
                 F32, name)
  for (name, p), q in zip(model.named_parameters(), ref.parameters(),
                          strict=True):
    assert_close(p.detach().numpy(), q.detach().numpy(), F32, name)
    for key, want in ref_opt.state[q].items():
      assert_close(opt.state[p][key].numpy(), want.numpy(), F32,
                   f"{name} {key}")
  x = batches[0][0]
  outs = []
  for m in (model, ref, plain):
    m.eval()
    with torch.no_grad():
      outs.append(m(x).numpy())
  assert_close(outs[0], outs[1], F32, "eval output")
  # The default (no restore_buffers): the first pass advanced them too.
  assert rel_err(outs[2], outs[1]) > 1e-3
  if kind == "batchnorm":
    assert int(plain[2].num_batches_tracked) == 2 * len(batches)
    assert int(model[2].num_batches_tracked) == len(batches)


def test_torch_restore_buffers_refusals_copies_and_a_raising_pass():
  """restore_buffers takes a module or None (inert without max_grad_norm),
  not changed in the middle of a step; a deepcopy of the model and
  the optimizer together restores the copied model's buffers; a first call
  that raises leaves the buffers as the step found them."""
  model = _buffered_model("batchnorm")
  forge_torch.convert(model)
  with pytest.raises(TypeError, match="restore_buffers must be a torch.nn"):
    forge_torch.SGD(model.parameters(), lr=0.1, max_grad_norm=1.0,
                    restore_buffers=list(model.buffers()))
  with pytest.raises(TypeError, match=r"ModuleList\(\[model_a, model_b"):
    forge_torch.SGD(model.parameters(), lr=0.1, restore_buffers=[model])
  x, y = _torch_batches(1, seed=3)[0]
  # Without max_grad_norm the closure runs once: nothing to restore.
  opt = forge_torch.SGD(model.parameters(), lr=0.1, restore_buffers=model)
  _torch_loss(model, (x, y)).backward()
  opt.step()
  assert int(model[2].num_batches_tracked) == 1
  opt.max_grad_norm = 1.0
  out = model(x)  # a forward of a managed layer, its graph kept: mid-step
  with pytest.raises(RuntimeError, match="restore_buffers cannot change"):
    opt.restore_buffers = None
  del out  # (its graph freed without a backward: the step starts afresh)
  model2, opt2 = copy.deepcopy((model, opt))
  assert opt2.restore_buffers is model2 and opt2.max_grad_norm == 1.0
  del opt
  before = {k: v.clone() for k, v in model2.named_buffers()}

  def failing():
    _torch_loss(model2, (x, y)).backward()
    raise ValueError("a bad batch (simulated)")

  with pytest.raises(ValueError, match="simulated"):
    opt2.step(failing)
  for name, buf in model2.named_buffers():
    assert torch.equal(buf, before[name]), name
  opt2.step(lambda: _torch_loss(model2, (x, y)).backward())
  assert int(model2[2].num_batches_tracked) == int(
      before["2.num_batches_tracked"]) + 1


class _OddBuffers(torch.nn.Module):
  """Buffers a forward changes in each way a module may: one registered as
  None and filled, one written through .data, one reassigned, one
  registered by the forward, and a broadcast (stride-0) one only read."""

  def __init__(self, width):
    super().__init__()
    self.register_buffer("first", None)
    self.register_buffer("ema", torch.zeros(width))
    self.register_buffer("count", torch.zeros((), dtype=torch.int64))
    self.register_buffer("scale", torch.ones(width).expand(4, width),
                         persistent=False)

  def forward(self, x):
    # (first and seen start from the first batch, then move with each:
    # a second pass that found them set would move them on.)
    with torch.no_grad():
      if self.first is None:
        self.first = x.mean(0).clone()
      else:
        self.first = 0.5 * self.first + x.mean(0)
      self.ema.data.mul_(0.5).add_(0.5 * x.mean(0))
      self.count = self.count + 1
      if not hasattr(self, "seen"):
        self.register_buffer("seen", x[:1].clone())
      else:
        self.seen.mul_(0.5).add_(x[:1])
    return (x * self.scale[0] + 0.1 * self.ema - 0.1 * self.first
            + 0.1 * self.seen)


def test_torch_restore_buffers_puts_back_every_kind_of_buffer_change():
  """Against torch's one-pass loop (clip_grad_norm_ + AdamW), 3 steps: the
  buffers of _OddBuffers and of a LazyBatchNorm1d (materialised by the
  first forward, after the optimizer was built) end as torch's, and so do
  losses and parameters; the read-only broadcast buffer is not written
  (a write to it would raise)."""
  torch.manual_seed(0)

  def build():
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.Tanh(),
        _OddBuffers(WIDTHS[1]), torch.nn.LazyBatchNorm1d(affine=False),
        torch.nn.Linear(WIDTHS[1], WIDTHS[3]))

  ref = build()
  model = build()
  model.load_state_dict(ref.state_dict())
  forge_torch.convert(model)
  opt = forge_torch.AdamW(model.parameters(), lr=2e-2, max_grad_norm=0.5,
                          restore_buffers=model)
  ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-2)
  for b in _torch_batches(3, seed=4):
    ref_opt.zero_grad()
    l_ref = _torch_loss(ref, b)
    l_ref.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()
    loss = opt.step(lambda b=b: (
        opt.zero_grad(), l := _torch_loss(model, b), l.backward(), l)[-1])
    assert rel_err(float(loss.detach()), float(l_ref.detach())) <= F32
  want = dict(ref.named_buffers())
  got = dict(model.named_buffers())
  assert got.keys() == want.keys() and "2.seen" in got and "3.running_mean" in got
  for name, w in want.items():
    assert_close(got[name].double().numpy(), w.double().numpy(), F32, name)
  for (name, p), q in zip(model.named_parameters(), ref.parameters(),
                          strict=True):
    assert_close(p.detach().numpy(), q.detach().numpy(), F32, name)
