"""Shared FORGE layers (paper Remark 2) and ``make_step(..., shared=...)``.

A FORGE layer called more than once in a step, or whose kernel is read by
anything but its own layer (a tied output head), cannot update its kernel
inside one backward: the gradient is a sum over consumers. ``shared="error"``
(default) refuses it, naming both fixes; ``shared="standard"`` moves it to
the standard path (ordinary gradient + the optax update), keeps every other
FORGE layer fused, and reports it (a ``SharedWeightsWarning`` per trace and
``step.standard_layers``). Parity: fp32, odd widths, against ``nn.Dense`` +
the optax transform (``tests.harness.reference_step``), every param and
state leaf.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import forge_jax
from forge_jax.step import SharedWeightsWarning
from tests.harness import mse, reference_step
from tests.tolerances import assert_close, assert_trees_close, tol

F32 = tol(jnp.float32)
KW = dict(learning_rate=1e-2, weight_decay=1e-2)


def _dense(dense, *args, **kwargs):
  if dense is nn.Dense:
    kwargs.pop("fused", None)
  return dense(*args, **kwargs)


class TiedEmbed(nn.Module):
  """Embedding-style input projection whose kernel is the output head (tied):
  29 -> 45 (embed) -> 61 -> 45 -> 29 (embed's kernel, transposed)."""
  dense: type = forge_jax.Dense
  embed_fused: bool = True

  @nn.compact
  def __call__(self, x):
    embed = _dense(self.dense, 45, name="embed", fused=self.embed_fused)
    h = nn.relu(embed(x))
    h = nn.relu(self.dense(61, name="mid")(h))
    h = self.dense(45, name="proj")(h)
    return h @ embed.variables["params"]["kernel"].T


class Twice(nn.Module):
  """A fused input layer, one module applied twice, a fused output layer:
  37 -> 33 (inp) -> 33 (shared) -> 33 (shared again) -> 5 (out)."""
  dense: type = forge_jax.Dense
  shared_fused: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.relu(self.dense(33, name="inp")(x))
    layer = _dense(self.dense, 33, name="shared", fused=self.shared_fused)
    x = nn.relu(layer(nn.relu(layer(x))))
    return self.dense(5, name="out")(x)


MODELS = {  # name -> (model class, d_in, d_out, the shared layer)
    "tied": (TiedEmbed, 29, 29, "embed"),
    "twice": (Twice, 37, 5, "shared"),
}


def _batches(d_in, d_out, steps, n=24, seed=3):
  k = jax.random.split(jax.random.key(seed), 2 * steps)
  return [(jax.random.normal(k[2 * i], (n, d_in)),
           jax.random.normal(k[2 * i + 1], (n, d_out))) for i in range(steps)]


def _pallas_calls(step, variables, opt_state, batch) -> int:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", SharedWeightsWarning)
    return str(jax.make_jaxpr(step)(variables, opt_state, batch)).count(
        "pallas_call")


def _run(model, tx, ref_model, ref_tx, batches, state_of=lambda s: s,
         **make_kwargs):
  """Trains both for len(batches) steps, checking the loss at every step and
  the params and ``state_of(opt_state)`` at the end."""
  variables = ref_model.init(jax.random.key(0), batches[0][0])
  ref_v, ref_s = variables, ref_tx.init(variables["params"])
  f_v, f_s = jax.tree.map(jnp.copy, variables), tx.init(variables["params"])
  step = forge_jax.make_step(mse(model), tx, **make_kwargs)
  traces = []

  def traced_step(*args):
    traces.append(1)
    return step(*args)

  f_step = jax.jit(traced_step, donate_argnums=(0, 1))
  ref_step = jax.jit(reference_step(mse(ref_model), ref_tx))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for batch in batches:
      ref_loss, ref_v, ref_s = ref_step(ref_v, ref_s, batch)
      f_loss, f_v, f_s = f_step(f_v, f_s, batch)
      assert_close(f_loss, ref_loss, F32, "loss")
  assert_trees_close(f_v, ref_v, F32, "params")
  assert_trees_close(state_of(f_s), state_of(ref_s), F32, "opt_state")
  shared_warnings = [w for w in caught
                     if issubclass(w.category, SharedWeightsWarning)]
  # One warning per trace of the step (jit traces it once, or twice when the
  # first compile of the process registers a new JAX config option).
  assert len(shared_warnings) == len(traces) >= 1, (
      len(traces), [str(w.message) for w in shared_warnings])
  assert len({str(w.message) for w in shared_warnings}) == 1
  return step, shared_warnings, variables


@pytest.mark.parametrize("name", sorted(MODELS))
def test_standard_fallback_matches_optax_and_keeps_the_rest_fused(name):
  model_cls, d_in, d_out, shared_layer = MODELS[name]
  batches = _batches(d_in, d_out, steps=5)
  step, caught, variables = _run(
      model_cls(), forge_jax.adamw(**KW), model_cls(dense=nn.Dense),
      optax.adamw(**KW), batches, shared="standard")
  # Reported: exactly the shared layer, in the warning and on the step (a
  # jit wrapper made from it shares the list).
  assert step.standard_layers == [shared_layer]
  assert jax.jit(step).standard_layers is step.standard_layers
  why = "kernel also read by" if name == "tied" else "called 2 times"
  assert f"'{shared_layer}' ({why}" in str(caught[0].message)
  # The other FORGE layers are still fused: as many fused kernels in the
  # step as with fused=False on the shared layer only (and some).
  tx = forge_jax.adamw(**KW)
  state = tx.init(variables["params"])
  got = _pallas_calls(step, variables, state, batches[0])
  manual = forge_jax.make_step(
      mse(model_cls(**{("embed_fused" if name == "tied"
                        else "shared_fused"): False})), tx)
  assert got == _pallas_calls(manual, variables, state, batches[0]) > 0
  assert manual.standard_layers == []


@pytest.mark.parametrize("family,kwargs", [
    ("lamb", dict(learning_rate=1e-2, weight_decay=1e-2)),  # regime 2
    ("adafactor", dict(learning_rate=1e-2, min_dim_size_to_factor=32)),  # 3
])
def test_standard_fallback_in_other_regimes(family, kwargs):
  batches = _batches(29, 29, steps=3)
  step, _, _ = _run(TiedEmbed(), getattr(forge_jax, family)(**kwargs),
                    TiedEmbed(dense=nn.Dense),
                    getattr(optax, family)(**kwargs), batches,
                    shared="standard")
  assert step.standard_layers == ["embed"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_default_refuses_shared_layers_naming_both_fixes(name):
  model_cls, d_in, d_out, shared_layer = MODELS[name]
  batch = _batches(d_in, d_out, steps=1)[0]
  model = model_cls()
  variables = model.init(jax.random.key(0), batch[0])
  tx = forge_jax.adamw(**KW)
  step = forge_jax.make_step(mse(model), tx)  # shared="error"
  what = "is also read" if name == "tied" else "is called more than once"
  with pytest.raises(ValueError, match=f"'{shared_layer}' {what}") as err:
    step(variables, tx.init(variables["params"]), batch)
  assert "fused=False" in str(err.value)
  assert 'shared="standard"' in str(err.value)


def test_stack_kernel_read_elsewhere_falls_back():
  """A ScannedDenseStack whose kernel is also read elsewhere: the stack
  takes the standard path (nn.scan + optax), the Dense layers stay fused."""

  class TiedStack(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(forge_jax.Dense(24, name="embed")(x))
      stack = forge_jax.ScannedDenseStack(24, 2, name="stack")
      h = forge_jax.Dense(7, name="head")(stack(h))
      return h + h[:, :1] * stack.variables["params"]["kernel"][0, :7, 0]

  model = TiedStack()
  batches = _batches(19, 7, steps=3)
  # Outside a FORGE step the forge_jax modules are nn.Dense / nn.scan.
  step, caught, _ = _run(model, forge_jax.adamw(**KW), model,
                         optax.adamw(**KW), batches, shared="standard")
  assert step.standard_layers == ["stack"]
  assert "'stack' (kernel also read by" in str(caught[0].message)


class _ClosingBlock(nn.Module):
  """Reads ``k``, a kernel of the model outside the stack (a tied
  projection), as a value it closes over."""
  k: jax.Array

  @nn.compact
  def __call__(self, x):
    h = x + 0.1 * jnp.tanh(x @ self.k.T) @ self.k
    return x + forge_jax.Dense(24, name="down")(nn.silu(forge_jax.Dense(
        24, name="up")(h)))


class KernelInClosure(nn.Module):
  """19 -> 24 (embed) -> 2 blocks reading embed's kernel -> 7 (head)."""

  @nn.compact
  def __call__(self, x):
    embed = forge_jax.Dense(24, name="embed")
    h = nn.relu(embed(x))
    h = forge_jax.ScannedBlocks(
        functools.partial(_ClosingBlock, embed.variables["params"]["kernel"]),
        2, name="layers")(h)
    return forge_jax.Dense(7, name="head")(h)


def test_a_kernel_a_scanned_blocks_closes_over_is_named_and_falls_back():
  """A FORGE kernel that a ScannedBlocks' blocks read as a value they close
  over (an operand of the stack's fused op, not one of its kernels): the
  refusal names that stack as the reader, not a second fused call;
  shared="standard" moves the layer to the standard path (the stack stays
  fused) and matches nn.scan + optax."""
  model = KernelInClosure()
  batches = _batches(19, 7, steps=3)
  variables = model.init(jax.random.key(0), batches[0][0])
  tx = forge_jax.adamw(**KW)
  with pytest.raises(ValueError) as err:
    forge_jax.make_step(mse(model), tx)(
        variables, tx.init(variables["params"]), batches[0])
  assert ("kernel of forge_jax.Dense at 'embed' is also read outside its own "
          "layer (by: forge_jax.ScannedBlocks at 'layers', whose blocks read "
          "it as a value they close over)") in str(err.value)
  assert "second fused call" not in str(err.value)
  # Outside a FORGE step the forge_jax modules are nn.Dense / nn.scan.
  step, caught, _ = _run(model, forge_jax.adamw(**KW), model,
                         optax.adamw(**KW), batches, shared="standard")
  assert step.standard_layers == ["embed"]
  assert ("'embed' (kernel also read by: forge_jax.ScannedBlocks at "
          "'layers', whose blocks read it") in str(caught[0].message)
  assert _pallas_calls(step, variables, tx.init(variables["params"]),
                       batches[0]) > 0  # the stack and the head stay fused


def test_warning_can_be_escalated_to_an_error():
  model = Twice()
  batch = _batches(37, 5, steps=1)[0]
  variables = model.init(jax.random.key(0), batch[0])
  tx = forge_jax.sgd(1e-2)
  step = forge_jax.make_step(mse(model), tx, shared="standard")
  with warnings.catch_warnings():
    warnings.simplefilter("error", SharedWeightsWarning)
    with pytest.raises(SharedWeightsWarning, match="'shared'"):
      step(variables, tx.init(variables["params"]), batch)


def test_every_layer_shared_is_plain_optax():
  """Nothing left to fuse: the step is the optax step (still reported)."""

  class OnlyShared(nn.Module):
    @nn.compact
    def __call__(self, x):
      layer = forge_jax.Dense(37, name="only")
      return layer(nn.relu(layer(x)))

  model = OnlyShared()
  batches = _batches(37, 37, steps=2)
  step, _, variables = _run(model, forge_jax.adamw(**KW), model,
                            optax.adamw(**KW), batches, shared="standard")
  assert step.standard_layers == ["only"]
  tx = forge_jax.adamw(**KW)
  assert _pallas_calls(step, variables, tx.init(variables["params"]),
                       batches[0]) == 0


@pytest.mark.parametrize("bad", ["fallback", "Standard", None, True])
def test_invalid_shared_policy_is_refused(bad):
  with pytest.raises(ValueError, match="shared=.*must be one of"):
    forge_jax.make_step(mse(Twice()), forge_jax.adamw(1e-3), shared=bad)


@pytest.mark.parametrize("mode", ["exact", "momentum"])
def test_multisteps_with_standard_fallback(mode):
  """forge_jax.MultiSteps + shared="standard" equals optax.MultiSteps (K=2,
  two cycles): the shared kernel accumulates through the optax update.
  (Momentum mode keeps no acc_grads: its inner state and counters are
  compared.)"""
  if mode == "exact":
    name, inner, ref_inner = "tied", forge_jax.adamw(**KW), optax.adamw(**KW)
  else:
    name = "twice"
    inner, ref_inner = (forge_jax.sgd(5e-2, momentum=0.9),
                        optax.sgd(5e-2, momentum=0.9))
  model_cls, d_in, d_out, shared_layer = MODELS[name]
  batches = _batches(d_in, d_out, steps=4, n=12)
  step, _, _ = _run(
      model_cls(), forge_jax.MultiSteps(inner, 2, mode=mode),
      model_cls(dense=nn.Dense), optax.MultiSteps(ref_inner, 2), batches,
      state_of=lambda s: s if mode == "exact" else (
          s.mini_step, s.gradient_step, s.inner_opt_state),
      shared="standard")
  assert step.standard_layers == [shared_layer]


def test_forge_dense_inside_users_nn_scan_falls_back():
  """flax traces an nn.scan body more than once, which discovery counts as
  a second call: with shared="standard" the scanned Dense takes the standard
  path (nn.scan + optax), the embedding stays fused."""
  from tests.test_scan import DenseInsideScan

  model = DenseInsideScan()
  batches = _batches(37, 64, steps=2, n=8)
  step, caught, _ = _run(model, forge_jax.adamw(**KW), model,
                         optax.adamw(**KW), batches, shared="standard")
  assert step.standard_layers == ["stack"]
  # (The calls counted are flax's traces of the body: the reason says where
  # the layer runs, not a count.)
  message = str(caught[0].message)
  assert "'stack' (inside a lifted transform that stacks its kernel, such " \
         "as nn.scan: stored (" in message, message
  assert "called 2 times" not in message
  # shared="error": refused saying the same.
  tx = forge_jax.adamw(**KW)
  variables = model.init(jax.random.key(0), batches[0][0])
  with pytest.raises(ValueError, match=r"'stack' runs inside a lifted "
                     r"transform that stacks its kernel, such as nn.scan: "
                     r"stored \(3, 64, 64\), each call reads \(64, 64\)"):
    forge_jax.make_step(mse(model), tx)(
        variables, tx.init(variables["params"]), batches[0])


# --- a layer under control flow -----------------------------------------------


class Cond(nn.Module):
  """A forge_jax.Dense that runs in one branch of nn.cond (a layer drop)."""
  dense: type

  @nn.compact
  def __call__(self, x, flag):
    d = self.dense(11)
    if self.is_initializing():
      d(x)
    x = nn.cond(flag, lambda m, x: nn.relu(m(x)), lambda m, x: x, d, x)
    return self.dense(5)(x)


def _cond_loss(model):
  def loss_fn(variables, batch):
    x, y, flag = batch
    return jnp.mean((model.apply(variables, x, flag) - y) ** 2)
  return loss_fn


def _cond_batches():
  k = jax.random.split(jax.random.key(3), 8)
  return [(jax.random.normal(k[2 * i], (6, 11)),
           jax.random.normal(k[2 * i + 1], (6, 5)), jnp.array(i % 2 == 1))
          for i in range(4)]


def test_a_layer_under_control_flow_is_refused_naming_it():
  bs = _cond_batches()
  model = Cond(forge_jax.Dense)
  v = model.init(jax.random.key(0), bs[0][0], True)
  tx = forge_jax.adamw(1e-2)
  with pytest.raises(ValueError, match=r"control flow.*cond.*fused=False"):
    forge_jax.make_step(_cond_loss(model), tx)(v, tx.init(v["params"]), bs[0])


def test_a_layer_under_control_flow_takes_the_standard_path_when_asked():
  bs = _cond_batches()
  model, ref = Cond(forge_jax.Dense), Cond(nn.Dense)
  v = model.init(jax.random.key(0), bs[0][0], True)
  tx, rtx = forge_jax.adamw(1e-2), optax.adamw(1e-2)
  step = forge_jax.make_step(_cond_loss(model), tx, shared="standard")
  jitted = jax.jit(step)  # one compile for the four steps
  rstep = jax.jit(reference_step(_cond_loss(ref), rtx))
  vf, sf, vr, sr = v, tx.init(v["params"]), v, rtx.init(v["params"])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for b in bs:  # the branch is taken on alternate steps
      _, vf, sf = jitted(vf, sf, b)
      _, vr, sr = rstep(vr, sr, b)
  assert any("control flow" in str(w.message) for w in caught)
  assert step.standard_layers == ["Dense_0"]
  assert_trees_close(vf, vr, tol(jnp.float32), "variables")
  assert_trees_close(sf, sr, tol(jnp.float32), "opt_state")
