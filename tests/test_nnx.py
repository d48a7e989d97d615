"""forge_jax.nnx: Linear + Optimizer + make_step against nnx.Linear +
nnx.Optimizer + optax with ordinary gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import forge_jax
import forge_jax.nnx as fnx
from forge_jax import _sharding
from tests import harness
from tests.tolerances import rel_err, tol, worst_leaf


class MLP(nnx.Module):
  """``harness.WIDTHS`` (no kernel dimension a power of two), a BatchNorm
  (state the step writes back; before a Linear, not after one, whose bias
  gradient it would cancel to rounding noise) and a head whose output never
  reaches the loss (paper Remark 1)."""

  def __init__(self, linear, rngs):
    w = harness.WIDTHS
    self.layers = nnx.List([linear(a, b, rngs=rngs)
                            for a, b in zip(w, w[1:])])
    self.norm = nnx.BatchNorm(w[1], rngs=rngs)
    self.dead = linear(w[2], w[3], rngs=rngs)

  def __call__(self, x):
    x = self.norm(nnx.relu(self.layers[0](x)))
    x = nnx.relu(self.layers[1](x))
    self.dead(x)
    return self.layers[2](x)


class Block(nnx.Module):
  """Pre-norm causal self-attention (q, k, v, o projections) and an MLP
  under ``jax.checkpoint``; dropout on the attention output (RNG state the
  step writes back). The key
  projection has no bias: softmax cancels a key bias, whose gradient is then
  rounding noise that Adam would amplify in both arms alike."""

  def __init__(self, d, heads, ff, rngs):
    self.heads = heads
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.q = nnx.Linear(d, d, rngs=rngs)
    self.k = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.v = nnx.Linear(d, d, rngs=rngs)
    self.o = nnx.Linear(d, d, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, ff, rngs=rngs)
    self.down = nnx.Linear(ff, d, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    h = self.ln1(x)
    heads = lambda a: a.reshape(b, t, self.heads, d // self.heads)
    q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    x = x + self.drop(self.o(a.reshape(b, t, d)))
    # Rematerialised (paper Remark 3: the recomputation precedes the update).
    mlp = jax.checkpoint(lambda h: self.down(nnx.gelu(self.up(h))))
    return x + mlp(self.ln2(x))


class Transformer(nnx.Module):
  """An input projection, two blocks, a final layer norm and a head: 14
  ``nnx.Linear`` layers."""

  def __init__(self, rngs, d_in=11, d=24, heads=3, ff=40, n_out=7):
    self.embed = nnx.Linear(d_in, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, heads, ff, rngs) for _ in range(2)])
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, n_out, rngs=rngs)

  def __call__(self, x):
    x = self.embed(x)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln(x))


def mse(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def cross_entropy(model, x, labels):
  return optax.softmax_cross_entropy_with_integer_labels(
      model(x), labels).mean()


def mlp_data(steps, seed=1):
  k = jax.random.split(jax.random.key(seed), 2 * steps)
  w = harness.WIDTHS
  return [(jax.random.normal(k[2 * i], (48, w[0])),
           jax.random.normal(k[2 * i + 1], (48, w[-1]))) for i in range(steps)]


def token_data(steps, seed=2):
  k = jax.random.split(jax.random.key(seed), 2 * steps)
  return [(jax.random.normal(k[2 * i], (2, 6, 11)),
           jax.random.randint(k[2 * i + 1], (2, 6), 0, 7))
          for i in range(steps)]


def matrices_only(params):
  return jax.tree.map(lambda p: p.ndim > 1, params)


def all_but_the_first_layer(params):
  """A mask written against the state as ``nnx.Optimizer.update`` passes
  it (``nnx.State`` levels, list index 0 an int): no weight decay on
  ``layers[0]``."""
  mask = jax.tree.map(lambda p: True, params)
  mask["layers"][0] = jax.tree.map(lambda p: False, params.layers[0])
  return mask


def train_side_by_side(ref_model, forge_model, optax_tx, forge_tx, loss_fn,
                       batches, **step_kwargs):
  """Trains ``ref_model`` with ``nnx.value_and_grad`` + ``nnx.Optimizer``
  (optax) and ``forge_model`` with ``forge_jax.nnx.make_step``, both under
  ``nnx.jit``, over the same batches; checks the last losses agree and the
  FORGE step was traced once. Returns ``(ref_opt, forge_opt, step)``; the
  models are updated in place."""
  ref_opt = nnx.Optimizer(ref_model, optax_tx, wrt=nnx.Param)
  forge_opt = fnx.Optimizer(forge_model, forge_tx, wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, optimizer, *batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, *batch)
    optimizer.update(model, grads)
    return loss

  traces = []

  def counted(*args):
    traces.append(1)
    return loss_fn(*args)

  step = fnx.make_step(counted, **step_kwargs)
  forge_step = nnx.jit(step)
  structure = lambda opt: jax.tree.structure(nnx.as_pure(opt.opt_state))
  ref_structure, counts = structure(ref_opt), []
  for batch in batches:
    ref_loss = ref_step(ref_model, ref_opt, *batch)
    forge_loss = forge_step(forge_model, forge_opt, *batch)
    assert np.isfinite(float(forge_loss))
    counts.append(len(traces))
    if len(counts) == 1:  # an update may write lists back as states
      retraced = structure(ref_opt) != ref_structure
  assert rel_err(forge_loss, ref_loss) <= tol(jnp.float32)
  # The jitted step was traced for its first call only (no retrace, no
  # recompile, although each call writes new values into the model); once
  # more for the second where nnx's own optimizer changed the structure of
  # its state in the first (SM3's lists), as it did for the reference.
  assert counts[0] > 0 and counts[-1] == counts[1] == counts[0] * (
      1 + retraced), counts
  return ref_opt, forge_opt, step


def _state(node):
  """Every array of ``node`` but RNG keys (compared through their counts)."""
  return nnx.as_pure(nnx.state(node, nnx.Not(nnx.RngKey)))


def assert_same_training(ref_model, forge_model, ref_opt, forge_opt,
                         start):
  """Parameters, batch statistics, RNG counts, optimizer moments and step
  counts equal to the fp32 tolerance, and the kernels moved from
  ``start``."""
  err, where = worst_leaf(_state(forge_model), _state(ref_model))
  assert err <= tol(jnp.float32), (err, where)
  err, where = worst_leaf(_state(forge_opt), _state(ref_opt))
  assert err <= tol(jnp.float32), (err, where)
  moved = [rel_err(a, b) for a, b in zip(
      jax.tree.leaves(nnx.as_pure(nnx.state(forge_model, nnx.Param))),
      jax.tree.leaves(start)) if a.ndim == 2]
  # Every kernel but an unused one (which plain SGD leaves as it is).
  assert sum(m > 1e-3 for m in moved) >= len(moved) - 1, moved


# --- Parity -------------------------------------------------------------------


@pytest.mark.parametrize("make_tx", [
    lambda m: m.adamw(optax.warmup_cosine_decay_schedule(0.0, 2e-2, 2, 8),
                      weight_decay=1e-2, mask=matrices_only),
    lambda m: m.sgd(5e-2, momentum=0.9, nesterov=True),
    # Gradient norms 3.2, 2.8, 3.1, 2.3, 1.7, 2.4: the first three steps
    # clip, the others do not.
    lambda m: optax.chain(m.clip_by_global_norm(2.5),
                          m.adamw(2e-2, weight_decay=1e-2,
                                  mask=matrices_only)),
    # Its accumulators per axis are lists, which an nnx update writes back
    # as int-keyed states.
    lambda m: m.sm3(1e-1),
    lambda m: m.adamw(2e-2, weight_decay=0.5, mask=all_but_the_first_layer),
], ids=["adamw-schedule-mask", "sgd-nesterov", "clipped-adamw-mask", "sm3",
        "adamw-path-mask"])
def test_mlp_trains_like_nnx_and_optax(make_tx):
  """Families of the registry: AdamW with a schedule and a callable mask,
  SGD with Nesterov momentum, SM3 (lists in its state); AdamW with a
  callable mask behind global-norm clipping, and with one written against
  nnx.State (the step's trees are string-keyed dicts: the mask sees them
  as nnx.Optimizer shows them)."""
  ref_model = MLP(nnx.Linear, nnx.Rngs(0))
  forge_model = MLP(fnx.Linear, nnx.Rngs(0))
  start = jax.tree.leaves(nnx.as_pure(nnx.state(ref_model, nnx.Param)))
  dead = ref_model.dead.kernel[...]
  ref_opt, forge_opt, _ = train_side_by_side(
      ref_model, forge_model, make_tx(optax), make_tx(forge_jax), mse,
      mlp_data(6))
  assert_same_training(ref_model, forge_model, ref_opt, forge_opt, start)
  # The unused head got the gradient-free part of the step, weight decay
  # (Remark 1), equal to optax's above.
  spec = getattr(make_tx(forge_jax), "spec", None)  # None: the AdamW chain
  if spec is None or spec.family == "adamw":
    assert rel_err(forge_model.dead.kernel[...], dead) > 1e-6


def test_a_transform_run_inside_loss_fn_sees_its_own_keys():
  """The model state's keys are for the step's transform only: a forge_jax
  transform that loss_fn runs on a tree of its own (int-keyed here) sees
  that tree as it is (its mask's answer was string-keyed, and init
  failed)."""
  seen = []

  def mask(p):
    seen.append(list(p))
    return jax.tree.map(lambda x: True, p)

  inner_tx = forge_jax.adamw(1e-2, mask=mask)

  def loss(model, x, y):
    inner_tx.init({0: jnp.ones((3,))})
    return mse(model, x, y)

  model = MLP(fnx.Linear, nnx.Rngs(0))
  opt = fnx.Optimizer(model, forge_jax.adamw(1e-2), wrt=nnx.Param)
  x, y = mlp_data(1)[0]
  assert np.isfinite(float(fnx.make_step(loss)(model, opt, x, y)))
  assert seen and all(keys == [0] for keys in seen)


def test_adam_mini_block_axes_reading_the_key_path_as_nnx_spells_it():
  """Adam-mini's ``block_axes`` sees key paths as ``nnx.Optimizer`` shows
  them (list index 0 an int), also inside the step, whose trees are
  string-keyed: here one block per input row of ``layers[0]`` only, its
  state laid out and trained as under ``nnx.Optimizer`` (the step raised
  on the state's other layout)."""
  def axes(path, p):
    first = path[0].key == "layers" and path[1].key == 0
    return (1,) if first and p.ndim == 2 else None

  ref_model = MLP(nnx.Linear, nnx.Rngs(0))
  forge_model = MLP(fnx.Linear, nnx.Rngs(0))
  start = jax.tree.leaves(nnx.as_pure(nnx.state(ref_model, nnx.Param)))
  make_tx = lambda: forge_jax.adam_mini(1e-2, block_axes=axes)
  ref_opt, forge_opt, _ = train_side_by_side(
      ref_model, forge_model, make_tx(), make_tx(), mse, mlp_data(3))
  assert_same_training(ref_model, forge_model, ref_opt, forge_opt, start)
  w = harness.WIDTHS
  shapes = {jax.tree_util.keystr(kp): leaf.shape for kp, leaf in
            jax.tree_util.tree_flatten_with_path(
                nnx.as_pure(forge_opt.opt_state))[0]}
  # (in, out) kernels: a second moment per input row of layers[0], per
  # output column of layers[1] (the default).
  assert shapes["[0].nu['layers'][0]['kernel']"] == (w[0],)
  assert shapes["[0].nu['layers'][1]['kernel']"] == (w[2],)


def test_converted_transformer_trains_like_nnx_and_optax():
  ref_model = Transformer(nnx.Rngs(0, dropout=1))
  forge_model = fnx.convert(Transformer(nnx.Rngs(0, dropout=1)))
  start = jax.tree.leaves(nnx.as_pure(nnx.state(ref_model, nnx.Param)))
  kwargs = dict(learning_rate=1e-2, weight_decay=1e-2, mask=matrices_only)
  ref_opt, forge_opt, step = train_side_by_side(
      ref_model, forge_model, optax.adamw(**kwargs),
      forge_jax.adamw(**kwargs), cross_entropy, token_data(6))
  assert_same_training(ref_model, forge_model, ref_opt, forge_opt, start)
  assert int(forge_opt.step[...]) == 6
  assert step.standard_layers == []


# --- The fused path ran -------------------------------------------------------


def _dot_shapes(jaxpr):
  """Output shapes of every dot_general of a jaxpr, nested ones included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield tuple(eqn.outvars[0].aval.shape)
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _dot_shapes(inner)


def _functional(step, model, optimizer):
  """``step`` as a function of the pure state of (model, optimizer)."""
  graphdef, state = nnx.split((model, optimizer))

  def fn(state, *batch):
    m, o = nnx.merge(graphdef, state)
    return step(m, o, *batch), nnx.state((m, o))

  return fn, nnx.as_pure(state)


def _kernel_shapes(model):
  """The kernels' shapes, both ways round (JAX's transpose of a dot may
  form the weight gradient transposed)."""
  shapes = {tuple(layer.kernel.shape) for _, layer in nnx.iter_graph(model)
            if isinstance(layer, nnx.Linear)}
  return shapes | {s[::-1] for s in shapes}


@pytest.mark.parametrize("family, wgrad", [
    ("adamw", "fused"), ("adamw", "xla"), ("muon", "fused")])
def test_step_runs_one_fused_kernel_per_linear_and_forms_no_gradient(
    family, wgrad):
  """wgrad="fused": one Pallas call per Linear that reaches the loss and no
  kernel-shaped GEMM (no weight gradient); wgrad="xla": the reverse. The
  reference step forms those gradients, so the count is not vacuous. Muon
  (regime 2): its optax state nests one partition per label, which the step
  reads the slots from and writes them back to."""
  model = MLP(fnx.Linear, nnx.Rngs(0))
  optimizer = fnx.Optimizer(model, getattr(forge_jax, family)(1e-3),
                            wrt=nnx.Param)
  batch = mlp_data(1)[0]
  fn, state = _functional(fnx.make_step(mse, wgrad=wgrad), model, optimizer)
  jaxpr = jax.make_jaxpr(fn)(state, *batch)
  kernels = _kernel_shapes(model)
  grads = [s for s in _dot_shapes(jaxpr.jaxpr) if s in kernels]
  fused = str(jaxpr).count("pallas_call")
  if family == "muon":  # Newton-Schulz has kernel-shaped products of its own
    assert fused == 3
    return
  assert (fused, len(grads)) == ((3, 0) if wgrad == "fused" else (0, 3))

  ref_def, ref_state = nnx.split(MLP(nnx.Linear, nnx.Rngs(0)))
  ref_jaxpr = jax.make_jaxpr(
      lambda state, x, y: nnx.grad(mse)(nnx.merge(ref_def, state), x, y))(
          nnx.as_pure(ref_state), *batch)
  assert len([s for s in _dot_shapes(ref_jaxpr.jaxpr) if s in kernels]) == 3


def test_step_lowers_for_cuda_with_one_triton_kernel_per_linear(monkeypatch):
  """Deviceless lowering for an H200 (no GPU needed): the compiled kernel,
  not the interpreter, once per Linear that reaches the loss."""
  import pallas_kernels.fused_wgrad as fw
  monkeypatch.setattr(fw, "default_interpret", lambda: False)
  model = MLP(fnx.Linear, nnx.Rngs(0))
  optimizer = fnx.Optimizer(model, forge_jax.adamw(1e-3), wrt=nnx.Param)
  fn, state = _functional(fnx.make_step(mse), model, optimizer)
  text = harness.lower_for_cuda(fn, state, *mlp_data(1)[0])
  assert len(harness.triton_calls(text)) == 3


# --- The layer ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(use_bias=False),
    dict(param_dtype=jnp.bfloat16, dtype=jnp.float32,
         bias_init=nnx.initializers.normal(1.0))], ids=["no-bias", "bf16"])
def test_linear_is_nnx_linear_outside_a_step(kwargs):
  ref = nnx.Linear(13, 9, rngs=nnx.Rngs(3), **kwargs)
  got = fnx.Linear(13, 9, rngs=nnx.Rngs(3), **kwargs)
  ref_state, got_state = nnx.state(ref), nnx.state(got)
  assert jax.tree.structure(got_state) == jax.tree.structure(ref_state)
  is_variable = lambda v: isinstance(v, nnx.Variable)
  for a, b in zip(jax.tree.leaves(got_state, is_leaf=is_variable),
                  jax.tree.leaves(ref_state, is_leaf=is_variable)):
    assert type(a) is type(b) is nnx.Param
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
    np.testing.assert_array_equal(a[...], b[...])
  x = jax.random.normal(jax.random.key(4), (2, 5, 13))
  np.testing.assert_array_equal(got(x), ref(x))
  assert (got.fused, got.block_config) == (True, None)


def test_linear_refuses_bad_options():
  with pytest.raises(TypeError, match="fused must be a bool"):
    fnx.Linear(3, 4, fused="yes", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="block_in=48"):
    fnx.Linear(3, 4, rngs=nnx.Rngs(0), block_config=__import__(
        "pallas_kernels").BlockConfig(block_in=48))


def test_convert_changes_every_nnx_linear_in_place():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.shared = nnx.Linear(4, 4, rngs=rngs)
      self.again = self.shared  # one layer, two references
      self.stack = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
      self.general = nnx.LinearGeneral(4, 4, rngs=rngs)

  model = Model(nnx.Rngs(0))
  kernel = model.stack[1].kernel
  before = nnx.as_pure(nnx.state(model))
  assert fnx.convert(model) is model
  assert type(model.shared) is type(model.stack[0]) is fnx.Linear
  assert model.again is model.shared
  assert type(model.general) is nnx.LinearGeneral
  assert model.stack[1].kernel is kernel and model.stack[1].fused
  after = nnx.as_pure(nnx.state(model))
  assert jax.tree.structure(after) == jax.tree.structure(before)
  assert all(a is b for a, b in zip(jax.tree.leaves(after),
                                    jax.tree.leaves(before)))


# --- Shared layers (paper Remark 2) -------------------------------------------


class Twice(nnx.Module):
  def __init__(self, linear, rngs):
    self.first = linear(37, 37, rngs=rngs)
    self.hidden = linear(37, 37, rngs=rngs)
    self.head = linear(37, 5, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.hidden(nnx.relu(self.first(x))))
    return self.head(nnx.relu(self.hidden(x)))


def test_a_linear_called_twice_is_refused_or_moved_to_the_standard_path():
  batches = mlp_data(3)
  model = Twice(fnx.Linear, nnx.Rngs(0))
  optimizer = fnx.Optimizer(model, forge_jax.adamw(1e-2), wrt=nnx.Param)
  with pytest.raises(ValueError, match=(
      r"forge_jax.nnx.Linear at 'hidden' is called more than once(.|\n)*"
      r"forge_jax.nnx.make_step\(\.\.\., shared=\"standard\"\)")):
    fnx.make_step(mse)(model, optimizer, *batches[0])

  ref_model = Twice(nnx.Linear, nnx.Rngs(0))
  forge_model = Twice(fnx.Linear, nnx.Rngs(0))
  start = jax.tree.leaves(nnx.as_pure(nnx.state(ref_model, nnx.Param)))
  with pytest.warns(forge_jax.SharedWeightsWarning, match="'hidden'"):
    ref_opt, forge_opt, step = train_side_by_side(
        ref_model, forge_model, optax.adamw(1e-2), forge_jax.adamw(1e-2),
        mse, batches, shared="standard")
  assert step.standard_layers == ["hidden"]
  assert_same_training(ref_model, forge_model, ref_opt, forge_opt, start)


def test_refusals_give_nnx_advice(monkeypatch):
  """Refusals shared with the linen step say what applies to an NNX model:
  no mesh layout, no linen scanned stacks, nnx.vmap, the layer's dtype; and
  the optimizer's refusal of optax.MultiSteps names its caller once."""
  model = nnx.Sequential(fnx.Linear(3, 5, rngs=nnx.Rngs(0)),
                         fnx.Linear(5, 2, rngs=nnx.Rngs(1)))
  optimizer = fnx.Optimizer(model, forge_jax.adamw(1e-3), wrt=nnx.Param)
  x, y = jnp.ones((4, 3)), jnp.ones((4, 2))
  linen = ("ScannedDenseStack", "nn.vmap", "model.apply", "data_axes=",
           "forge_jax.Dense")

  def refusal(loss_fn, *args):
    with pytest.raises(ValueError) as e:
      fnx.make_step(loss_fn)(model, optimizer, *args)
    msg = str(e.value)
    assert not [w for w in linen if w in msg], msg
    return msg

  def looped(model, x, y):  # the model under control flow
    return jax.lax.fori_loop(0, 2, lambda i, loss: loss + mse(model, x, y),
                             0.0)

  def per_example(model, x, y):  # the model under jax.vmap
    return jnp.mean(jax.vmap(lambda r: mse(model, r[None], y[:1]))(x))

  assert "supported in Flax linen only" in refusal(looped, x, y)
  assert "jax.vmap / nnx.vmap over the model" in refusal(per_example, x, y)
  assert "give the layer param_dtype" in refusal(per_example, x, y)
  named = jax.vmap(lambda x, y: fnx.make_step(mse)(model, optimizer, x, y),
                   axis_name="batch")
  with pytest.raises(ValueError, match="takes no mesh layout") as e:
    named(x[None], y[None])
  assert not [w for w in linen if w in str(e.value)], str(e.value)

  class Mesh:  # the step's arrays seen on a mesh of two devices
    axis_names, axis_sizes = ("data",), (2,)

  monkeypatch.setattr(_sharding, "_mesh_of", lambda leaf: Mesh())
  assert "takes no mesh layout" in refusal(mse, x, y)
  monkeypatch.undo()
  with pytest.raises(TypeError) as e:
    fnx.Optimizer(model, optax.MultiSteps(forge_jax.adamw(1e-3), 2),
                  wrt=nnx.Param)
  assert str(e.value).startswith(
      "forge_jax.nnx.Optimizer: optax.MultiSteps cannot drive"), e.value


def test_a_kernel_reached_first_at_another_path_is_reported():
  """A kernel Variable also held by an attribute that the graph visits
  first: the step finds it there, not under its layer, so the layer runs
  unfused; it is listed in standard_layers with a warning naming both
  paths, and trains as optax does."""

  class Aliased(nnx.Module):
    def __init__(self, linear, rngs):
      self.z = linear(5, 8, rngs=rngs)
      self.out = linear(8, 3, rngs=rngs)
      self.a_kernel = self.z.kernel  # visited before "z"

    def __call__(self, x):
      return self.out(nnx.relu(self.z(x)))

  ref_model = Aliased(nnx.Linear, nnx.Rngs(0))
  forge_model = Aliased(fnx.Linear, nnx.Rngs(0))
  start = jax.tree.leaves(nnx.as_pure(nnx.state(ref_model, nnx.Param)))
  key = jax.random.key(3)
  batches = [(jax.random.normal(jax.random.fold_in(key, i), (6, 5)),
              jnp.ones((6, 3))) for i in range(3)]
  with pytest.warns(forge_jax.SharedWeightsWarning,
                    match="'z' is reached first at 'a_kernel'"):
    ref_opt, forge_opt, step = train_side_by_side(
        ref_model, forge_model, optax.adam(1e-2), forge_jax.adam(1e-2), mse,
        batches)
  assert step.standard_layers == ["z"]
  assert_same_training(ref_model, forge_model, ref_opt, forge_opt, start)


def test_accumulation_trains_like_optax_multisteps():
  """forge_jax.MultiSteps(adamw, 2) in an NNX optimizer against
  optax.MultiSteps: the same training, and tx.has_updated reads the NNX
  optimizer's state as optax's does."""
  ref_model = MLP(nnx.Linear, nnx.Rngs(0))
  forge_model = MLP(fnx.Linear, nnx.Rngs(0))
  start = jax.tree.leaves(nnx.as_pure(nnx.state(ref_model, nnx.Param)))
  ref_tx = optax.MultiSteps(optax.adamw(2e-2), 2)
  forge_tx = forge_jax.MultiSteps(forge_jax.adamw(2e-2), 2)
  ref_opt = nnx.Optimizer(ref_model, ref_tx, wrt=nnx.Param)
  forge_opt = fnx.Optimizer(forge_model, forge_tx, wrt=nnx.Param)
  step = nnx.jit(fnx.make_step(mse))

  @nnx.jit
  def ref_step(model, optimizer, *batch):
    optimizer.update(model, nnx.grad(mse)(model, *batch))

  updated = []
  for batch in mlp_data(4):
    ref_step(ref_model, ref_opt, *batch)
    step(forge_model, forge_opt, *batch)
    updated.append(bool(forge_tx.has_updated(forge_opt.opt_state)))
    assert updated[-1] == bool(
        ref_tx.has_updated(nnx.as_pure(ref_opt.opt_state)))
  assert updated == [False, True, False, True]
  assert_same_training(ref_model, forge_model, ref_opt, forge_opt, start)


def test_a_kernel_read_outside_its_layer_is_refused_in_nnx_terms():
  def tied(model, x, y):  # a penalty on the head's kernel: a second reader
    return mse(model, x, y) + jnp.sum(model.layers[2].kernel[...] ** 2)

  model = MLP(fnx.Linear, nnx.Rngs(0))
  optimizer = fnx.Optimizer(model, forge_jax.adamw(1e-3), wrt=nnx.Param)
  with pytest.raises(ValueError, match=(
      r"kernel of forge_jax.nnx.Linear at 'layers/2' is also read outside "
      r"its own layer(.|\n)*fused=False(.|\n)*forge_jax.nnx.make_step")):
    fnx.make_step(tied)(model, optimizer, *mlp_data(1)[0])


# --- Plain-words refusals -----------------------------------------------------


def _mask_tree(model):
  return matrices_only(nnx.as_pure(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("make_tx, match", [
    (lambda model: optax.adamw(1e-3), "needs a forge_jax transform"),
    (lambda model: forge_jax.adamw(1e-3, mask=_mask_tree(model)),
     "callable mask"),
    # The optimizer of a clipping chain is checked as the optimizer alone.
    (lambda model: optax.chain(
        forge_jax.clip_by_global_norm(1.0),
        forge_jax.adamw(1e-3, weight_decay=0.5, mask=_mask_tree(model))),
     "callable mask"),
    (lambda model: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(forge_jax.adamw)(
            1e-3, weight_decay=0.5, mask=_mask_tree(model))),
     "callable mask"),
], ids=["optax-transform", "mask-tree", "clip-chain-mask-tree",
        "clip-chain-injected-mask-tree"])
def test_optimizer_refuses_a_transform_forge_cannot_drive(make_tx, match):
  model = MLP(fnx.Linear, nnx.Rngs(0))
  tx = make_tx(model)
  with pytest.raises(TypeError, match="forge_jax.nnx.Optimizer:? .*" + match
                     ) as e:
    fnx.Optimizer(model, tx, wrt=nnx.Param)
  assert "make_step needs" not in str(e.value), e.value
  # The same through a plain nnx.Optimizer, when the step runs.
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  with pytest.raises(TypeError, match="forge_jax.nnx.make_step:? .*" + match
                     ) as e:
    fnx.make_step(mse)(model, optimizer, *mlp_data(1)[0])
  # Named as the caller called it, not as linen's make_step.
  assert str(e.value).startswith("forge_jax.nnx.make_step"), e.value
  assert " make_step needs" not in str(e.value), e.value


def test_an_unconverted_model_is_refused_naming_its_linear_layers():
  model = MLP(nnx.Linear, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, forge_jax.adamw(1e-3), wrt=nnx.Param)
  with pytest.raises(ValueError, match=(
      r"no forge_jax.nnx.Linear layer; its nnx.Linear layers \('dead', "
      r"'layers/0', 'layers/1', 'layers/2'\)(.|\n)*forge_jax.nnx.convert")):
    fnx.make_step(mse)(model, optimizer, *mlp_data(1)[0])


class _Holder(nnx.Module):
  def __init__(self, rngs):
    self.backbone = fnx.convert(MLP(nnx.Linear, rngs))

  def __call__(self, x):
    return self.backbone(x)


@pytest.mark.parametrize("made_for", ["submodule", "holder"])
def test_an_optimizer_made_for_another_module_is_refused(made_for):
  """The optimizer built for a submodule and the step run on the model
  holding it, or the reverse: refused in plain words (was a bare
  KeyError), before anything is updated."""
  holder = _Holder(nnx.Rngs(0))
  model, other = ((holder, holder.backbone) if made_for == "submodule"
                  else (holder.backbone, holder))
  optimizer = fnx.Optimizer(other, forge_jax.adamw(1e-3), wrt=nnx.Param)
  x, y = mlp_data(1)[0]
  missing = "'backbone'" if made_for == "submodule" else "'dead', 'layers'"
  with pytest.raises(ValueError, match=(
      rf"optimizer's state is not laid out as the model's trained "
      rf"parameters: it has no entry for \[{missing}(.|\n)*made for this "
      "model")):
    fnx.make_step(mse)(model, optimizer, x, y)


_NOT_IN_MODEL = (r"forge_jax.nnx.Linear\(37, 70\) was called inside a FORGE "
                 r"step but is not a layer of the model passed to the step")


@pytest.mark.parametrize("call, match", [
    ("closure", _NOT_IN_MODEL), ("nnx.remat", _NOT_IN_MODEL),
    ("none", "loss_fn called none of the model's forge_jax.nnx.Linear "
     "layers")], ids=["closure", "nnx.remat", "no-layer-called"])
def test_a_layer_not_called_through_the_stepped_model_is_refused(call, match):
  model = MLP(fnx.Linear, nnx.Rngs(0))
  optimizer = fnx.Optimizer(model, forge_jax.adamw(1e-3), wrt=nnx.Param)

  def loss_fn(m, x, y):
    if call == "closure":  # the outer model, not the one the step passes
      return mse(model, x, y)
    if call == "none":
      return jnp.mean(y ** 2)
    return jnp.mean((nnx.remat(lambda m, x: m(x))(m, x) - y) ** 2)

  with pytest.raises(ValueError, match=match):
    fnx.make_step(loss_fn)(model, optimizer, *mlp_data(1)[0])


def test_a_float64_linear_is_refused_naming_it_its_dtype_and_the_fix():
  """With x64 on, a forge_jax.nnx.Linear of float64 parameters is refused
  naming the layer, its kernel dtype and the fix (it said 'x is float64:
  ... cast it first')."""
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.a = fnx.Linear(37, 8, rngs=rngs)
      self.b = fnx.Linear(8, 5, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
      return self.b(self.a(x))

  x, y = mlp_data(1)[0]
  with jax.enable_x64(True):
    model = Model(nnx.Rngs(0))
    optimizer = fnx.Optimizer(model, forge_jax.sgd(1e-2), wrt=nnx.Param)
    with pytest.raises(TypeError, match=(
        r"forge_jax.nnx.Linear at 'b': its kernel dtype is float64: the "
        r"fused kernel computes in fp32 and stores fp32, bf16 or fp16 "
        r"\(give this layer param_dtype float32 or bfloat16.*fused=False")):
      fnx.make_step(mse)(model, optimizer, x, y)


def test_custom_dot_general_is_refused_unless_unfused():
  def dot(*args, **kwargs):
    return jax.lax.dot_general(*args, **kwargs)

  class Model(nnx.Module):
    def __init__(self, fused, rngs):
      self.a = fnx.Linear(37, 8, rngs=rngs)
      self.b = fnx.Linear(8, 5, dot_general=dot, fused=fused, rngs=rngs)

    def __call__(self, x):
      return self.b(self.a(x))

  batch = mlp_data(1)[0]
  model = Model(True, nnx.Rngs(0))
  optimizer = fnx.Optimizer(model, forge_jax.sgd(1e-2), wrt=nnx.Param)
  with pytest.raises(ValueError, match=(
      "forge_jax.nnx.Linear at 'b': a custom dot_general cannot be fused")):
    fnx.make_step(mse)(model, optimizer, *batch)
  model = Model(False, nnx.Rngs(0))
  optimizer = fnx.Optimizer(model, forge_jax.sgd(1e-2), wrt=nnx.Param)
  step = fnx.make_step(mse)
  fn, state = _functional(step, model, optimizer)
  assert str(jax.make_jaxpr(fn)(state, *batch)).count("pallas_call") == 1


def test_step_arguments_are_checked():
  with pytest.raises(ValueError, match="shared='twice' must be one of"):
    fnx.make_step(mse, shared="twice")
  with pytest.raises(ValueError, match="wgrad='gemm' must be one of"):
    fnx.make_step(mse, wgrad="gemm")
  model = MLP(fnx.Linear, nnx.Rngs(0))
  optimizer = fnx.Optimizer(model, forge_jax.adamw(1e-3), wrt=nnx.Param)
  with pytest.raises(TypeError, match="second argument must be an "
                     "nnx.Optimizer"):
    fnx.make_step(mse)(model, forge_jax.adamw(1e-3), *mlp_data(1)[0])
  assert forge_jax.nnx is fnx


# --- GPU ----------------------------------------------------------------------


@pytest.mark.gpu
def test_mlp_trains_like_nnx_and_optax_compiled_on_gpu():
  """The compiled Triton kernel (not the interpreter), jitted with the model
  and optimizer donated."""
  kwargs = dict(learning_rate=1e-2, weight_decay=1e-2, mask=matrices_only)
  ref_model = MLP(nnx.Linear, nnx.Rngs(0))
  forge_model = MLP(fnx.Linear, nnx.Rngs(0))
  start = jax.tree.leaves(nnx.as_pure(nnx.state(ref_model, nnx.Param)))
  ref_opt = nnx.Optimizer(ref_model, optax.adamw(**kwargs), wrt=nnx.Param)
  forge_opt = fnx.Optimizer(forge_model, forge_jax.adamw(**kwargs),
                            wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, optimizer, *batch):
    loss, grads = nnx.value_and_grad(mse)(model, *batch)
    optimizer.update(model, grads)
    return loss

  forge_step = nnx.jit(fnx.make_step(mse), donate_argnums=(0, 1))
  for batch in mlp_data(8):
    ref_step(ref_model, ref_opt, *batch)
    forge_step(forge_model, forge_opt, *batch)
  assert_same_training(ref_model, forge_model, ref_opt, forge_opt, start)


class _DropoutMLP(nnx.Module):
  """Dropout that draws from an ``nnx.Rngs`` given at call time."""

  def __init__(self, linear, rngs):
    self.a = linear(5, 7, rngs=rngs)
    self.drop = nnx.Dropout(0.5)
    self.b = linear(7, 3, rngs=rngs)

  def __call__(self, x, rngs=None):
    return self.b(self.drop(nnx.relu(self.a(x)), rngs=rngs))


def test_nnx_objects_among_the_arguments_are_merged_and_updated():
  """An ``nnx.Rngs`` and a teacher module with its own dropout passed to
  loss_fn as arguments, 3 jitted steps: losses, parameters, optimizer state
  and both argument objects' RNG counts as nnx.value_and_grad +
  nnx.Optimizer leaves them (the teacher untrained)."""
  def loss_fn(model, teacher, x, y, rngs):
    return jnp.mean((model(x, rngs=rngs) + teacher(x) - y) ** 2)

  def teacher():
    return nnx.Sequential(nnx.Linear(5, 3, rngs=nnx.Rngs(1)),
                          nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=2)))

  ref, got = _DropoutMLP(nnx.Linear, nnx.Rngs(0)), _DropoutMLP(fnx.Linear,
                                                              nnx.Rngs(0))
  start = jax.tree.leaves(nnx.as_pure(nnx.state(ref, nnx.Param)))
  ref_opt = nnx.Optimizer(ref, optax.adamw(1e-2), wrt=nnx.Param)
  got_opt = fnx.Optimizer(got, forge_jax.adamw(1e-2), wrt=nnx.Param)
  step = fnx.make_step(loss_fn)

  @nnx.jit
  def ref_step(model, opt, teacher, x, y, rngs):
    loss, grads = nnx.value_and_grad(loss_fn)(model, teacher, x, y, rngs)
    opt.update(model, grads)
    return loss

  @nnx.jit
  def got_step(model, opt, teacher, x, y, rngs):
    return step(model, opt, teacher, x, y, rngs)

  ref_args = (teacher(), nnx.Rngs(dropout=5))
  got_args = (teacher(), nnx.Rngs(dropout=5))
  for i in range(3):
    x = jax.random.normal(jax.random.key(i), (4, 5))
    y = jnp.ones((4, 3))
    lr = ref_step(ref, ref_opt, ref_args[0], x, y, ref_args[1])
    lf = got_step(got, got_opt, got_args[0], x, y, got_args[1])
    assert rel_err(lf, lr) <= tol(jnp.float32), i
  for a, b in zip(got_args, ref_args):
    err, where = worst_leaf(_state(a), _state(b))
    assert err <= tol(jnp.float32), (err, where)
  assert int(got_args[1].dropout.count[...]) == 3
  assert int(got_args[0].layers[1].rngs.count[...]) == 3
  assert_same_training(ref, got, ref_opt, got_opt, start)


class _Teacher(nnx.Module):
  """A module that holds another module it is given (the student's own
  LayerNorm, in the test below)."""

  def __init__(self, norm):
    self.norm = norm

  def __call__(self, x):
    return self.norm(x)


class _Normed(nnx.Module):
  def __init__(self, rngs):
    self.a = fnx.Linear(6, 6, rngs=rngs)
    self.norm = nnx.LayerNorm(6, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.a(x))


@pytest.mark.parametrize("shared", ["module", "rngs", "two_arguments"])
def test_an_argument_sharing_a_variable_is_refused(shared):
  """An NNX object among loss_fn's arguments that holds a Variable of the
  model (or of another such argument) is passed apart from it: its copy
  would be written back over the model's update (silently, the shared
  LayerNorm kept its old scale). Refused, naming both places, as
  nnx.value_and_grad refuses such aliasing."""
  model = _Normed(nnx.Rngs(0))
  opt = fnx.Optimizer(model, forge_jax.sgd(0.5), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (8, 6))
  if shared == "module":
    args, match = (_Teacher(model.norm),), (
        r"argument 2 .*_Teacher.*'norm/(bias|scale)'.*the model holds at "
        r"'norm/(bias|scale)'.*nnx.clone")
  elif shared == "rngs":
    rngs = nnx.Rngs(dropout=3)
    model.rngs = rngs
    args, match = (rngs,), (r"argument 2 .*Rngs.*'dropout/(count|key)'.*"
                            r"'rngs/dropout/(count|key)'")
  else:
    teacher = _Teacher(nnx.LayerNorm(6, rngs=nnx.Rngs(1)))
    args, match = (teacher, _Teacher(teacher.norm)), (
        r"argument 3 .*that loss_fn's argument 2 .* holds")

  def loss_fn(model, *teachers):
    out = model(x)
    for t in teachers:
      out = out + t(x)
    return jnp.mean(out ** 2)

  with pytest.raises(ValueError, match=match):
    nnx.jit(fnx.make_step(loss_fn))(model, opt, *args)


def test_stochastic_rounding_seeds_list_items_as_the_optimizer_does():
  """bf16 layers in an nnx.List (integer keys in the NNX state, string keys
  in the step's tree): a step draws the stochastic-rounding bits that
  nnx.Optimizer.update draws with the same transform (one seed per
  parameter path, an integer key hashed as its string): bit for bit."""
  class Stack(nnx.Module):
    def __init__(self, linear, rngs):
      self.layers = nnx.List([linear(24, 24, param_dtype=jnp.bfloat16,
                                     rngs=rngs) for _ in range(2)])

    def __call__(self, x):
      for layer in self.layers:
        x = nnx.relu(layer(x))
      return x.astype(jnp.float32)

  def make_tx():
    return forge_jax.adamw(1e-2, weight_decay=0.1, stochastic_rounding=True)

  ref, got = Stack(nnx.Linear, nnx.Rngs(0)), Stack(fnx.Linear, nnx.Rngs(0))
  ref_opt = nnx.Optimizer(ref, make_tx(), wrt=nnx.Param)
  got_opt = fnx.Optimizer(got, make_tx(), wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, opt, x, y):
    grads = nnx.grad(mse)(model, x, y)
    opt.update(model, grads)

  got_step = nnx.jit(fnx.make_step(mse))
  x = jax.random.normal(jax.random.key(1), (8, 24))
  y = jax.random.normal(jax.random.key(2), (8, 24))
  start = np.asarray(ref.layers[0].kernel[...], np.float32)
  ref_step(ref, ref_opt, x, y)
  got_step(got, got_opt, x, y)
  for i in range(2):
    a = np.asarray(got.layers[i].kernel[...], np.float32)
    b = np.asarray(ref.layers[i].kernel[...], np.float32)
    np.testing.assert_array_equal(a, b)
  assert np.abs(np.asarray(ref.layers[0].kernel[...], np.float32)
                - start).max() > 0


def _message_texts() -> list[str]:
  """Every string literal in forge_jax's modules other than nnx.py (implicit
  concatenations joined; an f-string's literal parts each)."""
  import ast
  import pathlib
  texts = []
  for path in pathlib.Path(forge_jax.__file__).parent.glob("*.py"):
    if path.name == "nnx.py":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and isinstance(node.value, str):
        texts.append(node.value)
  return texts


def test_the_phrases_nnx_rewords_are_in_make_steps_messages():
  """forge_jax.nnx words make_step's refusals in NNX terms by replacing
  phrases of them: each phrase must still be in a message make_step can
  raise, or a rewording of that message would leave it in linen terms
  unnoticed."""
  texts = _message_texts()
  phrases = [old for old, _ in fnx._RENAMES] + [fnx._NO_LAYER_CALLED,
                                                "make_step needs"]
  missing = [p for p in phrases if not any(p in t for t in texts)]
  assert not missing, missing
