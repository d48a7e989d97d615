"""Scion (regime 2), Adam-mini, AdaLomo and LARS (regime 3).

10 training steps of the 37 -> 70 -> 130 -> 5 MLP (batch 48, fp32, odd
widths), three arms from the same start, every parameter and every
optimizer-state leaf within 1e-5 relative:

* FORGE: ``forge_jax.Dense`` + ``forge_jax.<family>`` + ``make_step``;
* the same transform on ``flax.linen.Dense`` with ``jax.value_and_grad``
  (LARS: ``optax.lars`` itself);
* for the families optax lacks, an independent ``jnp`` reference written
  from the paper's update rule, fed the transform's gradients -- Scion:
  Pethick et al. 2025 (arXiv:2502.07529), SCG/uSCG with the spectral oracle
  for matrices and the RMS oracle for vectors; Adam-mini: Zhang et al. 2024
  (arXiv:2406.16793) Algorithm 1, one block per output neuron of a kernel
  and one per bias; AdaLomo: Lv et al. 2023 (arXiv:2310.10195), factored
  second moment, grouped update normalisation, relative step.

Also: Remark 1 (an untouched layer) on both paths, the paths read off the
step's jaxpr (Scion forms no kernel-shaped ``G``; the regime-3 families one
per layer, inside its backward), Adam-mini's per-head blocks on a
``DenseGeneral`` kernel, the registry entries and the refusals.
"""

import functools
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import forge_jax
import pallas_kernels as pk
from pallas_kernels import families
from tests import harness
from tests.harness import (MLP, WIDTHS, lower_rule_for_cuda, reference_step,
                           train_side_by_side, triton_calls)
from tests.harness import decay_kernels_only as _decay_kernels_only
from tests.harness import mse as _mse
from tests.tolerances import rel_err, tol, worst_leaf

F32_TOL = tol(jnp.float32)
STEPS = 10
BT = 48  # tokens per step; no kernel dimension has this size
NS = (3.4445, -4.7750, 2.0315)


def _schedule(base):
  return optax.linear_schedule(base, base / 10, STEPS)


def _whole_matrix_for_dense_1(path, p):
  """Adam-mini blocks: Dense_1's kernel one block, the rest the default."""
  keys = [getattr(k, "key", None) for k in path]
  return (0, 1) if keys == ["Dense_1", "kernel"] else None


# name -> (family, args, kwargs, reference). Reference: the paper's rule in
# plain jnp (below), or the optax transform itself for LARS.
VARIANTS = {
    "scion": ("scion", (_schedule(0.05),), dict(scale=3.0), "paper"),
    "scion_unconstrained": (
        "scion", (0.02,), dict(momentum=0.5, unconstrained=True, ns_steps=4),
        "paper"),
    "adam_mini": ("adam_mini", (_schedule(1e-2),),
                  dict(weight_decay=_schedule(1e-2), mask=_decay_kernels_only,
                       block_axes=_whole_matrix_for_dense_1), "paper"),
    "adalomo": ("adalomo", (_schedule(5e-2),),
                dict(weight_decay=1e-1, weight_decay_mask=_decay_kernels_only,
                     clipping_threshold=0.5), "paper"),
    "lars_nesterov_masks": (
        "lars", (_schedule(0.5),),
        dict(weight_decay=1e-3, weight_decay_mask=_decay_kernels_only,
             trust_coefficient=0.02, trust_ratio_mask=_decay_kernels_only,
             nesterov=True), "optax"),
}
REGIMES = {"scion": 2, "adam_mini": 3, "adalomo": 3, "lars": 3}


def _forge_tx(name):
  family, args, kwargs, _ = VARIANTS[name]
  return getattr(forge_jax, family)(*args, **kwargs)


@pytest.fixture(scope="module")
def data():
  return harness.mlp_data(STEPS, BT)


def _check(what, actual, expected):
  err, where = worst_leaf(actual, expected)
  assert err <= F32_TOL, f"{what}: worst leaf {where}: rel err {err:.3g}"
  return err


# --- the papers' update rules, in plain jnp ------------------------------------


def _rms(a):
  return jnp.sqrt(jnp.mean(a * a))


def _newton_schulz(d, coeffs, steps, eps):
  """The quintic Newton-Schulz iteration the Scion paper uses for U V^T."""
  x = d / (jnp.linalg.norm(d) + eps)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  a, b, c = coeffs
  for _ in range(steps):
    s = x @ x.T
    x = a * x + (b * s + c * s @ s) @ x
  return x.T if tall else x


class ScionRef:
  """SCG (constrained) / uSCG, Pethick et al. 2025: d = (1-a) d + a g;
  w = (1-lr) w + lr lmo(d), or w + lr lmo(d); the lmo of the radius-rho
  ball of the RMS->RMS operator norm for a (fan_in, fan_out) kernel,
  -rho sqrt(fan_out/fan_in) U V^T, of the RMS norm for a bias."""

  def __init__(self, lr, momentum=0.1, scale=1.0, unconstrained=False,
               ns_steps=5, eps=1e-8):
    self.lr, self.a, self.rho = lr, momentum, scale
    self.unconstrained, self.steps, self.eps = unconstrained, ns_steps, eps

  def init(self, params):
    return {"d": jax.tree.map(jnp.zeros_like, params)}

  def _lmo(self, d):
    if d.ndim == 2:
      fan_in, fan_out = d.shape
      return -self.rho * np.sqrt(fan_out / fan_in) * _newton_schulz(
          d, NS, self.steps, self.eps)
    return -self.rho * d / (_rms(d) + self.eps)

  def step(self, params, state, grads, t):
    lr = self.lr(t - 1) if callable(self.lr) else self.lr
    d = jax.tree.map(lambda g, d: (1 - self.a) * d + self.a * g, grads,
                     state["d"])
    shrink = 1.0 if self.unconstrained else 1.0 - lr
    params = jax.tree.map(lambda w, d: shrink * w + lr * self._lmo(d), params,
                          d)
    return params, {"d": d}

  @staticmethod
  def matches(opt_state, params):
    del params
    return {"d": opt_state[0].mu}


class AdamMiniRef:
  """Adam-mini, Zhang et al. 2024, Algorithm 1 with decoupled weight decay:
  m = (1-b1) g + b1 m; v_b = (1-b2) mean_b(g^2) + b2 v_b; w -= lr (m_hat /
  (sqrt(v_hat_b) + eps) + wd w). Blocks: one per output neuron of a kernel
  (a column of the (in, out) matrix), one per bias; Dense_1's kernel is one
  block (the variant's block_axes)."""

  def __init__(self, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
               mask=None, block_axes=None):
    del block_axes  # the partition is written out in _axes
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.wd, self.mask = weight_decay, mask

  @staticmethod
  def _axes(layer, name):
    """The axes one block spans: a bias (one axis) is one block; a kernel
    has one block per output neuron, except Dense_1's, one block."""
    return (0, 1) if layer == "Dense_1" and name == "kernel" else (0,)

  def init(self, params):
    return {"m": jax.tree.map(jnp.zeros_like, params),
            "v": {l: {n: jnp.zeros(np.delete(p.shape, self._axes(l, n)))
                      for n, p in d.items()} for l, d in params.items()}}

  def step(self, params, state, grads, t):
    lr, wd, decay = self.lr(t - 1), self.wd(t - 1), self.mask(params)
    new_p, m_all, v_all = {}, {}, {}
    for l in params:
      new_p[l], m_all[l], v_all[l] = {}, {}, {}
      for n, w in params[l].items():
        g, axes = grads[l][n], self._axes(l, n)
        m = (1 - self.b1) * g + self.b1 * state["m"][l][n]
        v = ((1 - self.b2) * jnp.mean(g * g, axis=axes)
             + self.b2 * state["v"][l][n])
        m_hat, v_hat = m / (1 - self.b1**t), v / (1 - self.b2**t)
        u = m_hat / (jnp.sqrt(jnp.expand_dims(v_hat, axes)) + self.eps)
        if decay[l][n]:
          u = u + wd * w
        new_p[l][n], m_all[l][n], v_all[l][n] = w - lr * u, m, v
    return new_p, {"m": m_all, "v": v_all}

  @staticmethod
  def matches(opt_state, params):
    del params
    return {"m": opt_state[0].mu, "v": opt_state[0].nu}


class AdaLomoRef:
  """AdaLomo, Lv et al. 2023: beta_t = 1 - t^-kappa; for a matrix r = beta r +
  (1-beta) rowmean(g^2 + e1), c = beta c + (1-beta) colmean(g^2 + e1),
  v = r c^T / mean(r); for a vector v = beta v + (1-beta)(g^2 + e1);
  u = g / sqrt(v), u /= max(1, RMS(u)/d) (per parameter: grouped);
  w = (1 - eta_t wd) w - eta_t u with eta_t = lr max(e2, RMS(w))."""

  def __init__(self, lr, decay_rate=0.8, eps=1e-30, min_scale=1e-3,
               clipping_threshold=1.0, weight_decay=0.0,
               weight_decay_mask=None):
    self.lr, self.kappa, self.e1, self.e2 = lr, decay_rate, eps, min_scale
    self.d, self.wd, self.mask = clipping_threshold, weight_decay, \
        weight_decay_mask

  def init(self, params):
    def one(p):
      if p.ndim == 2:
        return {"r": jnp.zeros(p.shape[0]), "c": jnp.zeros(p.shape[1])}
      return {"v": jnp.zeros_like(p)}
    return jax.tree.map(one, params)

  def step(self, params, state, grads, t):
    lr = self.lr(t - 1)
    beta = 1.0 - t ** (-self.kappa)
    decay = self.mask(params)
    new_p, new_s = {}, {}
    for l in params:
      new_p[l], new_s[l] = {}, {}
      for n, w in params[l].items():
        g, s = grads[l][n], state[l][n]
        sq = g * g + self.e1
        if w.ndim == 2:
          r = beta * s["r"] + (1 - beta) * jnp.mean(sq, axis=1)
          c = beta * s["c"] + (1 - beta) * jnp.mean(sq, axis=0)
          # 1 / sqrt(v) as sqrt(mean(r) / r) / sqrt(c): the product r c
          # of a zero gradient's (1 - beta) e1 terms underflows in fp32.
          inv = (jnp.sqrt(jnp.mean(r) / r)[:, None]
                 / jnp.sqrt(c)[None, :])
          new_s[l][n] = {"r": r, "c": c}
        else:
          v = beta * s["v"] + (1 - beta) * sq
          inv = 1 / jnp.sqrt(v)
          new_s[l][n] = {"v": v}
        u = g * inv
        u = u / jnp.maximum(1.0, _rms(u) / self.d)
        eta = lr * jnp.maximum(self.e2, _rms(w))
        wd = self.wd if decay[l][n] else 0.0
        new_p[l][n] = (1 - eta * wd) * w - eta * u
    return new_p, new_s

  @staticmethod
  def matches(opt_state, params):
    """The transform's factored state in the reference's terms (optax keeps
    the mean over the larger axis as ``v_row``)."""
    s = opt_state[0]
    out = {}
    for l, d in params.items():
      out[l] = {}
      for n, w in d.items():
        if w.ndim == 2:
          row, col = s.v_row[l][n], s.v_col[l][n]
          r, c = (row, col) if row.shape == w.shape[:1] else (col, row)
          out[l][n] = {"r": r, "c": c}
        else:
          out[l][n] = {"v": s.v[l][n]}
    return out


REFERENCES = {"scion": ScionRef, "adam_mini": AdamMiniRef,
              "adalomo": AdaLomoRef}


# --- the registry and the API -----------------------------------------------------


@pytest.mark.parametrize("family,regime", sorted(REGIMES.items()))
def test_registry_names_the_transform_and_its_path(family, regime):
  f = families.REGISTRY[family]
  assert f.optax == family and f.regime.number == regime
  assert forge_jax.refuse_reason(family) is None
  name = next(n for n, v in VARIANTS.items() if v[0] == family)
  tx = _forge_tx(name)
  assert isinstance(tx, optax.GradientTransformation)
  assert tx.spec.family == family and tx.spec.regime == regime
  if regime == 2:
    rule = f.optax_rule()
    assert rule.name == "scion_momentum" and not rule.updates_weight
    assert (tx.spec.rule.name, tx.spec.rule.slots, tx.spec.rule.hparams) == (
        rule.name, rule.slots, rule.hparams)
  else:
    assert f.optax_factory is None and tx.spec.rule is None
  assert pk.classify("Adam-Mini").family == "adam_mini"


def test_lars_signature_and_defaults_match_optax():
  def params(fn):
    return [(p.name, p.kind, p.default)
            for p in inspect.signature(fn).parameters.values()]

  # + forge_jax's keyword-only low-precision options (refused for LARS).
  extra = [("moments", inspect.Parameter.KEYWORD_ONLY, None),
           ("stochastic_rounding", inspect.Parameter.KEYWORD_ONLY, False)]
  assert params(forge_jax.lars) == params(optax.lars) + extra


# --- 10 MLP steps: FORGE, the transform, the paper's rule -------------------------

# name -> (wgrad, dead head). The dead head is a FORGE layer whose output
# never reaches the loss (Remark 1), for each family.
RUNS = {"scion": ("fused", True), "scion_unconstrained": ("xla", False),
        "adam_mini": ("fused", True), "adalomo": ("fused", True),
        "lars_nesterov_masks": ("fused", True)}


def _three_arms(name, data):
  """10 steps from the same start: FORGE (``forge_jax.Dense`` + make_step),
  the transform on ``flax.linen.Dense`` (LARS: ``optax.lars``), and the
  paper's rule in plain jnp fed the transform's gradients -- the same
  gradients, so that their difference is the update rules', not a
  cancelling gradient's."""
  xs, ys, _ = data
  wgrad, dead_head = RUNS[name]
  family, args, kwargs, reference = VARIANTS[name]
  tx = _forge_tx(name)
  std_tx = getattr(optax, family)(*args, **kwargs) if reference == "optax" \
      else tx
  paper = REFERENCES[family](*args, **kwargs) if reference == "paper" \
      else None
  loss = _mse(MLP(nn.Dense, dead_head=dead_head))
  variables = MLP(nn.Dense, dead_head=dead_head).init(jax.random.key(1), xs[0])

  @jax.jit
  def standard(v, s, batch):
    value, g = jax.value_and_grad(loss)(v, batch)
    u, s = std_tx.update(g["params"], s, v["params"])
    return value, {"params": optax.apply_updates(v["params"], u)}, s, g

  forge = jax.jit(forge_jax.make_step(
      _mse(MLP(forge_jax.Dense, dead_head=dead_head)), tx, wgrad=wgrad),
      donate_argnums=(0, 1))
  v_f, s_f = jax.tree.map(jnp.copy, variables), tx.init(variables["params"])
  v_s, s_s = variables, std_tx.init(variables["params"])
  if paper is not None:
    paper_step = jax.jit(paper.step)
    p_p, s_p = variables["params"], paper.init(variables["params"])
  for t in range(1, STEPS + 1):
    batch = (xs[t - 1], ys[t - 1])
    l_f, v_f, s_f = forge(v_f, s_f, batch)
    l_s, v_s, s_s, g = standard(v_s, s_s, batch)
    if paper is not None:
      with jax.default_matmul_precision("highest"):
        p_p, s_p = paper_step(p_p, s_p, g["params"], t)
    np.testing.assert_allclose(float(l_f), float(l_s), rtol=F32_TOL)
  return variables, (v_f, s_f), (v_s, s_s), (
      None if paper is None else (paper, p_p, s_p))


@pytest.mark.parametrize("name", sorted(RUNS))
def test_mlp_training_matches_the_transform_and_the_paper(name, data):
  """Every parameter and state leaf: FORGE against the transform, the
  transform against the paper's rule; an untouched layer gets the
  transform's zero-gradient step (Scion's shrink, the decays)."""
  v0, (v_f, s_f), (v_s, s_s), paper = _three_arms(name, data)
  p_err = _check(f"{name} params", v_f, v_s)
  s_err = _check(f"{name} opt_state", s_f, s_s)
  msg = f"{name} ({RUNS[name][0]}): params {p_err:.2e}, state {s_err:.2e}"
  if paper is not None:
    ref, p_p, s_p = paper
    pp_err = _check(f"{name} params vs the paper's rule", v_s["params"], p_p)
    ps_err = _check(f"{name} state vs the paper's rule",
                    ref.matches(s_s, v_s["params"]), s_p)
    msg += f"; vs the paper: params {pp_err:.2e}, state {ps_err:.2e}"
  for layer in ("Dense_0", "Dense_1", "Dense_2"):
    assert rel_err(v_f["params"][layer]["kernel"],
                   v0["params"][layer]["kernel"]) > 1e-3, (name, layer)
  if RUNS[name][1]:  # not skipped: the zero-gradient step moved it (decay)
    assert rel_err(v_f["params"]["aux"]["kernel"],
                   v0["params"]["aux"]["kernel"]) > 0
  print(msg)


# --- the paths, read off the jaxpr -------------------------------------------------


@pytest.mark.parametrize("name", ["scion", "adam_mini", "adalomo",
                                  "lars_nesterov_masks"])
def test_scion_forms_no_kernel_gradient_the_others_one_per_layer(name, data):
  xs, ys, variables = data
  tx = _forge_tx(name)
  step = forge_jax.make_step(_mse(MLP(forge_jax.Dense)), tx)
  jaxpr = jax.make_jaxpr(step)(variables, tx.init(variables["params"]),
                               (xs[0], ys[0])).jaxpr
  shapes = sorted(zip(WIDTHS[:-1], WIDTHS[1:]))
  dots = sorted(harness.kernel_gradient_dots(jaxpr, set(shapes), BT))
  kernels = [e.params["name"] for e in harness.jaxpr_eqns(jaxpr)
             if e.primitive.name == "pallas_call"]
  if tx.spec.regime == 2:
    assert dots == [] and kernels == ["fused_wgrad_scion_momentum"] * 3
  else:
    assert dots == shapes and kernels == []


def test_scion_rule_is_the_papers_average_and_lowers_for_cuda():
  """The state-only rule (its kernel runs in the MLP steps above): the
  average ``momentum * G + decay * d``, ``W`` untouched; and the kernel
  lowers for CUDA without a GPU (catches Triton lowering errors)."""
  rule = families.get("scion").optax_rule()
  k = jax.random.split(jax.random.key(3), 3)
  g, w, mu = (jax.random.normal(k[i], (70, 130)) for i in range(3))
  h = rule.pack(lr=0.1, momentum=0.3, decay=0.7, weight_decay=1.0)
  w_new, (mu_new,) = rule.apply(g, w, (mu,), h)
  assert w_new is w
  assert rel_err(mu_new, 0.3 * g + 0.7 * mu) <= F32_TOL
  assert len(triton_calls(lower_rule_for_cuda(rule))) == 1


# --- Adam-mini's per-head blocks on a DenseGeneral kernel ---------------------


class _Heads(nn.Module):
  general: type
  dense: type

  @nn.compact
  def __call__(self, x):
    h = self.general(features=(3, 7), name="qk")(x)  # kernel (37, 3, 7)
    return self.dense(5)(jnp.tanh(h).reshape(h.shape[:-2] + (21,)))


def _per_head(path, p):
  return (0, 2) if p.ndim == 3 else None


def test_adam_mini_per_head_blocks_on_a_dense_general_kernel(data):
  xs, ys, _ = data
  variables = _Heads(nn.DenseGeneral, nn.Dense).init(jax.random.key(2), xs[0])
  tx = forge_jax.adam_mini(1e-2, block_axes=_per_head)
  state = tx.init(variables["params"])
  assert state[0].nu["qk"]["kernel"].shape == (3,)  # one per head
  ref = jax.jit(reference_step(_mse(_Heads(nn.DenseGeneral, nn.Dense)), tx))
  step = forge_jax.make_step(
      _mse(_Heads(forge_jax.DenseGeneral, forge_jax.Dense)), tx)
  (v_f, s_f), (v_r, s_r), _ = train_side_by_side(
      jax.jit(step), ref, variables, tx, tx,
      [(xs[i], ys[i]) for i in range(2)])
  assert step.standard_layers == []  # both layers fused (deferred)
  _check("params", v_f, v_r)
  _check("opt_state", s_f, s_r)
  # The per-head second moment is the paper's: each head's mean of g^2.
  g = jax.grad(_mse(_Heads(nn.DenseGeneral, nn.Dense)))(
      variables, (xs[0], ys[0]))["params"]["qk"]["kernel"]
  _, _, s1 = ref(variables, tx.init(variables["params"]), (xs[0], ys[0]))
  want = (1 - 0.999) * jnp.mean(g * g, axis=(0, 2))
  assert rel_err(s1[0].nu["qk"]["kernel"], want) <= F32_TOL


# --- refusals ---------------------------------------------------------------------


def test_scion_refuses_a_kernel_of_more_than_two_axes_at_init():
  params = {"attn": {"kernel": jnp.ones((4, 2, 3))}, "b": jnp.ones(3)}
  with pytest.raises(ValueError, match=r"\['attn'\]\['kernel'\].*3 axes.*"
                     "spectral.*2-D kernel"):
    forge_jax.scion(0.1).init(params)


@pytest.mark.parametrize("ns_coeffs,ns_steps,match", [
    ("dion", 5, r"named coefficient presets"),
    ((1.0, 2.0), 5, r"shape \(3,\) or \(n, 3\), got \(2,\)"),
    (np.ones((2, 2, 3)), 5, r"got \(2, 2, 3\)"),
    # optax.contrib.muon refuses this too: a (n, 3) array runs n steps.
    (np.ones((5, 3)), 2, r"5 rows.*ns_steps=2"),
])
def test_scion_refuses_newton_schulz_coefficients_as_optax_does(
    ns_coeffs, ns_steps, match):
  with pytest.raises(ValueError, match=match):
    forge_jax.scion(0.1, ns_coeffs=ns_coeffs, ns_steps=ns_steps)


@pytest.mark.parametrize("kw,match", [
    (dict(momentum=0.0), r"momentum=0.0 is outside \(0, 1\]"),
    (dict(momentum=-0.5), r"momentum=-0.5"),
    (dict(momentum=2.0), r"momentum=2.0"),
    (dict(scale=0.0), r"scale=0.0 must be positive"),
    (dict(scale=-1.0), r"scale=-1.0"),
    (dict(momentum=jnp.float32(0.0)), r"momentum=0.0 is outside"),
    (dict(momentum=jnp.array(1.5)), r"momentum=1.5 is outside"),
    (dict(scale=np.array(-2.0)), r"scale=-2.0 must be positive"),
])
def test_scion_refuses_a_momentum_or_scale_out_of_range(kw, match):
  """Scion's alpha is the new gradient's weight in (0, 1] (at 0 no
  gradient reaches the weights) and its radius is positive (a negative one
  steps up the gradient): refused by the transform and its direction,
  while the edges and an injected (array) momentum are taken."""
  from forge_jax.transforms import scale_by_scion  # noqa: PLC0415
  for make in (functools.partial(forge_jax.scion, 0.1), scale_by_scion):
    with pytest.raises(ValueError, match=match):
      make(**kw)
  forge_jax.scion(0.1, momentum=1.0, scale=1e-3)
  optax.inject_hyperparams(forge_jax.scion)(learning_rate=0.1,
                                            momentum=0.5).init(
                                                {"w": jnp.ones((3, 2))})


def test_scion_takes_fewer_coefficient_rows_than_steps():
  # (2, 3) with ns_steps=5: two Newton-Schulz steps, as optax's muon runs.
  coeffs = np.array([[3.4445, -4.7750, 2.0315], [3.0, -3.2, 1.2]])
  tx = forge_jax.scion(0.1, ns_coeffs=coeffs, ns_steps=5)
  params = {"kernel": jnp.arange(12.0).reshape(4, 3) / 10}
  grads = {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
  updates, _ = tx.update(grads, tx.init(params), params)
  assert bool(jnp.all(jnp.isfinite(updates["kernel"])))
  assert float(jnp.abs(updates["kernel"]).max()) > 0


@pytest.mark.parametrize("block_axes,match", [
    (None, r"\['attn'\]\['kernel'\].*3 axes.*no default block.*block_axes"),
    (lambda path, p: (0, 3) if p.ndim == 3 else None,
     r"block_axes gave \(0, 3\).*\['attn'\]\['kernel'\]"),
    (lambda path, p: (1, -2) if p.ndim == 3 else None, r"distinct axes"),
    (lambda path, p: ("0",) if p.ndim == 3 else None, r"gave \('0',\)"),
])
def test_adam_mini_refuses_a_parameter_without_a_block(block_axes, match):
  params = {"attn": {"kernel": jnp.ones((4, 2, 3))}, "b": jnp.ones(3)}
  with pytest.raises(ValueError, match=match):
    forge_jax.adam_mini(1e-3, block_axes=block_axes).init(params)


# --- GPU ------------------------------------------------------------------------


@pytest.mark.gpu
def test_the_four_families_match_on_gpu(data):
  """Every run above, the fused kernel compiled for the GPU."""
  errors = {}
  with jax.default_matmul_precision("highest"):
    for name in RUNS:
      _, (v_f, s_f), (v_s, s_s), _ = _three_arms(name, data)
      errors[name] = (_check(f"{name} params", v_f, v_s),
                      _check(f"{name} opt_state", s_f, s_s))
  print("GPU parity (params, state):", errors)
