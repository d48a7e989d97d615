"""Bad arguments to the kernel API are refused in plain words, naming what
is wrong and what is taken instead; :func:`pallas_kernels.describe_backend`
tells (and refuses) what the kernel call does. CPU, Pallas interpret mode,
tiny shapes."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import (ADAMW, MosaicConfig, families, mosaic_kernel,
                            quant, torch_rules, triton_kernel, tuning_cache)
from tests.harness import spy_launches
from tests.tolerances import assert_update_close

BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
  monkeypatch.delenv(tuning_cache.BACKEND_ENV_VAR, raising=False)


def _hparams():
  return ADAMW.pack(lr=1e-2, b1=0.9, b2=0.999, one_minus_b1=0.1,
                    one_minus_b2=0.001, eps=1e-8, eps_root=0.0,
                    weight_decay=1e-2, bc1=0.1, bc2=0.001, bc1_next=0.19)


def _case(seed, bt, n_in, n_out, x_dtype=jnp.float32):
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  x = jax.random.normal(k[0], (bt, n_in), x_dtype)
  dy = jax.random.normal(k[1], (bt, n_out), x_dtype)
  w = jax.random.normal(k[2], (n_in, n_out))
  mu = 0.1 * jax.random.normal(k[3], (n_in, n_out))
  nu = jnp.abs(0.1 * jax.random.normal(k[4], (n_in, n_out)))
  return x, dy, w, (mu, nu)


def _calls(x, dy, w, slots):
  """The four entry points on one case, each taking ``rule=`` and more
  keywords."""
  h = _hparams()
  g = jnp.dot(x.T, dy)
  return {
      "fused_wgrad_update": lambda **kw: pk.fused_wgrad_update(
          x, dy, w, slots, h, interpret=True, **kw),
      "fused_wgrad_update_reference": lambda **kw: (
          pk.fused_wgrad_update_reference(x, dy, w, slots, h, **kw)),
      "unfused_wgrad_update": lambda **kw: pk.unfused_wgrad_update(
          x, dy, w, slots, h, **kw),
      "stored_g_update": lambda **kw: pk.stored_g_update(
          g, w, slots, h, interpret=True, **kw),
      "describe_backend": lambda **kw: pk.describe_backend(
          x, dy, w, slots, interpret=True, **kw),
  }


# --- the rule ----------------------------------------------------------------


@pytest.mark.parametrize("rule,got", [("adamw", "str"), (None, "NoneType")])
def test_a_rule_that_is_not_an_update_rule_is_refused(rule, got):
  for name, call in _calls(*_case(0, 8, 16, 32)).items():
    with pytest.raises(TypeError, match=re.escape(
        f"{name}: rule must be an UpdateRule (e.g. pallas_kernels.ADAMW), "
        f"got {got}")):
      call(rule=rule)
  # The backend choice asks the same check.
  with pytest.raises(TypeError, match="^select_backend: rule must be an "
                     "UpdateRule"):
    pk.select_backend(8, 16, 32, jnp.float32, [jnp.float32] * 2, rule,
                      jnp.float32, where="select_backend")


# --- storage dtypes ----------------------------------------------------------


_NARROW = [d for d in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e3m4",
                       "float8_e8m0fnu", "float4_e2m1fn", "float8_e4m3b11fnuz")
           if hasattr(jnp, d)]


@pytest.mark.parametrize("dtype", _NARROW)
def test_a_plain_slot_or_weight_in_a_narrow_float_is_refused(dtype):
  x, dy, w, (mu, nu) = _case(1, 8, 16, 32)
  h = _hparams()
  for fn, kw in ((pk.fused_wgrad_update, dict(interpret=True)),
                 (pk.fused_wgrad_update_reference, {})):
    with pytest.raises(TypeError, match=(
        rf"slot 'mu' is {dtype}; a weight and a plain slot must be float32, "
        r"bfloat16 or float16 .* pass a pallas_kernels.quant.Quantized "
        "pair")):
      fn(x, dy, w, (mu.astype(dtype), nu), h, rule=ADAMW, **kw)
    with pytest.raises(TypeError, match=(
        rf"^w is {dtype}; a weight and a plain slot must be float32, "
        r"bfloat16 or float16 \(")):
      fn(x, dy, w.astype(dtype), (mu, nu), h, rule=ADAMW, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_plain_slots_of_the_storage_dtypes_still_step(dtype):
  x, dy, w, (mu, nu) = _case(2, 8, 16, 32)
  slots = (mu.astype(dtype), nu.astype(dtype))
  got = pk.fused_wgrad_update(x, dy, w, slots, _hparams(), rule=ADAMW,
                              interpret=True)
  want = pk.fused_wgrad_update_reference(x, dy, w, slots, _hparams(),
                                         rule=ADAMW)
  olds = jax.tree.leaves((w, slots))
  for a, b, old, what in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                             olds, ("w", "mu", "nu"), strict=True):
    assert a.dtype == b.dtype == old.dtype, what
    # (The step against the reference's, at the stored dtype's tolerance.)
    assert_update_close(a, b, old, what=what)


def test_shape_only_stand_ins_and_torch_tensors_are_refused_by_name():
  """describe_backend takes jax.ShapeDtypeStruct stand-ins; the update
  itself needs values: a stand-in (or a torch tensor) for x, the weight or
  a slot is refused naming the operand, where it failed deep inside."""
  torch = pytest.importorskip("torch")
  x, dy, w, slots = _case(0, 8, 16, 24)
  sds = jax.ShapeDtypeStruct
  cases = [
      ("x", dict(x=sds(x.shape, x.dtype)), "x is a jax.ShapeDtypeStruct"),
      ("w", dict(w=sds(w.shape, w.dtype)), "w is a jax.ShapeDtypeStruct"),
      ("slot", dict(slots=(slots[0], sds(w.shape, w.dtype))),
       r"slots\[1\] is a jax.ShapeDtypeStruct"),
      ("torch", dict(x=torch.zeros(x.shape)), "x is a Tensor from torch"),
  ]
  # Inside a quantized slot's pair: its codes or its scale, by field.
  q = quant.quantize(slots[0], quant.MomentFormat("int8"))
  cases += [
      ("codes", dict(slots=(q._replace(q=sds(q.q.shape, q.q.dtype)),
                            slots[1])),
       r"slots\[0\]\.q is a jax.ShapeDtypeStruct"),
      ("scale", dict(slots=(q._replace(scale=torch.zeros(q.scale.shape)),
                            slots[1])),
       r"slots\[0\]\.scale is a Tensor from torch")]
  for label, change, match in cases:
    args = dict(x=x, dy=dy, w=w, slots=slots, hparams=_hparams())
    args.update(change)
    for fn in (pk.fused_wgrad_update, pk.fused_wgrad_update_reference):
      with pytest.raises(TypeError, match=match):
        fn(**args, rule=ADAMW, **({"interpret": True}
                                   if fn is pk.fused_wgrad_update else {}))
  with pytest.raises(TypeError, match="g is a jax.ShapeDtypeStruct"):
    pk.stored_g_update(sds(w.shape, w.dtype), w, slots, _hparams(),
                       rule=ADAMW, interpret=True)
  # The clipping norm's kernel takes what the updates take.
  for fn in (functools.partial(pk.wgrad_sqnorm, interpret=True),
             pk.wgrad_sqnorm_reference):
    with pytest.raises(TypeError, match="dy is a Tensor from torch"):
      fn(x, torch.zeros(dy.shape))
    with pytest.raises(TypeError, match="x must be an array, got list"):
      fn(np.asarray(x).tolist(), dy)


def test_x_and_dy_without_a_common_dtype_are_refused():
  x, dy, w, slots = _case(3, 8, 16, 32)
  with pytest.raises(TypeError, match="x is float8_e4m3fn and dy float32, "
                     "which JAX does not promote to a common dtype"):
    pk.fused_wgrad_update(x.astype(jnp.float8_e4m3fn), dy, w, slots,
                          _hparams(), rule=ADAMW, interpret=True)
  # The clipping norm's kernel, which runs first in a clipped step.
  with pytest.raises(TypeError, match="x is float8_e4m3fn and dy float32, "
                     "which JAX does not promote to a common dtype"):
    pk.wgrad_sqnorm(x.astype(jnp.float8_e4m3fn), dy, interpret=True)


def test_a_moment_formats_block_is_a_power_of_two_int():
  for bad in (True, 0, 48, 64.0):
    with pytest.raises(ValueError, match="must be a positive power of two"):
      quant.MomentFormat("int8", block=bad)


# --- describe_backend --------------------------------------------------------


@pytest.mark.parametrize("block", [64, 256])
def test_describe_backend_takes_formats_and_tells_the_tiling_that_runs(
    monkeypatch, block):
  # 256-element blocks: the call widens the default 128-column tiles to
  # one block; describe_backend reports that tiling, not the unfitted one.
  x, dy, w, (mu, nu) = _case(4, 8, 16, 300)
  fmt = quant.MomentFormat("int8", block=block)
  slots = (quant.quantize(mu, fmt), quant.quantize(nu, fmt,
                                                   second_moment=True))
  choice = pk.describe_backend(x, dy, w, slots, rule=ADAMW, interpret=True,
                               formats=(fmt, fmt))
  seen = spy_launches(monkeypatch, triton_kernel)
  pk.fused_wgrad_update(x, dy, w, slots, _hparams(), rule=ADAMW,
                        interpret=True, formats=(fmt, fmt))
  assert choice.backend == "triton"
  assert seen == [choice.config]
  assert choice.config.block_out == max(128, block)
  if block != 64:  # not the default format: without formats, refused
    with pytest.raises(ValueError, match="^describe_backend: the scale of "
                       "quantized slot 'mu'.*pass formats="):
      pk.describe_backend(x, dy, w, slots, rule=ADAMW, interpret=True)


def test_describe_backend_tells_the_mosaic_tiling_that_runs(monkeypatch):
  x, dy, w, slots = _case(5, 16, 64, 128, BF16)
  choice = pk.describe_backend(x, dy, w, slots, rule=ADAMW, interpret=True,
                               backend="mosaic_gpu")
  seen = spy_launches(monkeypatch, mosaic_kernel)
  pk.fused_wgrad_update(x, dy, w, slots, _hparams(), rule=ADAMW,
                        interpret=True, backend="mosaic_gpu")
  assert choice.backend == "mosaic_gpu" and seen == [choice.config]


def _message(excinfo, where):
  text = str(excinfo.value)
  assert text.startswith(where), text
  return text[len(where):]


def test_describe_backend_refuses_what_the_call_refuses():
  # fp32 x on the Mosaic GPU backend: the call raises; so does
  # describe_backend, with the same words under its own name.
  x, dy, w, slots = _case(6, 8, 64, 128)
  with pytest.raises(ValueError) as call:
    pk.fused_wgrad_update(x, dy, w, slots, _hparams(), rule=ADAMW,
                          interpret=True, backend="mosaic_gpu")
  with pytest.raises(ValueError, match=r"^describe_backend\(backend="
                     r"'mosaic_gpu'\): x and dy are float32") as described:
    pk.describe_backend(x, dy, w, slots, rule=ADAMW, interpret=True,
                        backend="mosaic_gpu")
  assert (_message(described, "describe_backend")
          == _message(call, "fused_wgrad_update"))
  # Its other errors name it too.
  with pytest.raises(ValueError, match="^describe_backend: backend='cuda'"):
    pk.describe_backend(x, dy, w, slots, rule=ADAMW, backend="cuda")
  with pytest.raises(TypeError, match=r"^describe_backend\(config=\.\.\.\)"):
    pk.describe_backend(x, dy, w, slots, rule=ADAMW, config=(64, 128))
  with pytest.raises(TypeError, match="^describe_backend: formats is one "
                     "MomentFormat"):
    pk.describe_backend(x, dy, w, slots, rule=ADAMW,
                        formats=quant.MomentFormat())


# --- no tokens ---------------------------------------------------------------


def test_no_tokens_on_the_mosaic_backend_checks_its_arguments():
  # fp32 x and dy: refused with 8 tokens, and the same with none.
  _, _, w, slots = _case(7, 8, 64, 128)
  errors = []
  for bt in (0, 8):
    x, dy, _, _ = _case(7, bt, 64, 128)
    with pytest.raises(ValueError, match=r"^fused_wgrad_update\(backend="
                       r"'mosaic_gpu'\): x and dy are float32") as e:
      pk.fused_wgrad_update(x, dy, w, slots, _hparams(), rule=ADAMW,
                            interpret=True, backend="mosaic_gpu")
    errors.append(str(e.value))
  assert errors[0] == errors[1]


COLUMN_SPLIT = MosaicConfig(tile_m=64, tile_n=128, steps=2)


@pytest.mark.parametrize("config", [None, COLUMN_SPLIT],
                         ids=["default", "column-split"])
def test_no_tokens_on_the_mosaic_backend_still_steps(config):
  # bf16 operands: taken; without tokens there is no K loop to check, so
  # the column split's need of more K steps than its release delay (with
  # 16 tokens, one K step: refused) is no refusal either.
  x, dy, w, slots = _case(8, 0, 64, 128, BF16)
  w, slots = w.astype(BF16), tuple(a.astype(BF16) for a in slots)
  h = _hparams()
  if config is not None:
    x16, dy16, _, _ = _case(8, 16, 64, 128, BF16)
    with pytest.raises(ValueError, match="needs more than 1 K step"):
      pk.fused_wgrad_update(x16, dy16, w, slots, h, rule=ADAMW,
                            interpret=True, config=config)
  got = pk.fused_wgrad_update(x, dy, w, slots, h, rule=ADAMW, interpret=True,
                              backend="mosaic_gpu", config=config)
  want = pk.fused_wgrad_update_reference(x, dy, w, slots, h, rule=ADAMW)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))


def test_one_k_step_on_the_column_split_names_the_pingpong_knob():
  # MosaicConfig() is the column split; only default_config's tilings are
  # ping-pong: the message says how to ask for it.
  assert not MosaicConfig().pingpong
  assert mosaic_kernel.default_config(BF16, [jnp.float32] * 3, 16).pingpong
  x, dy, w, slots = _case(9, 16, 64, 128, BF16)
  with pytest.raises(ValueError, match=re.escape(
      "use the ping-pong schedule (',pp': pingpong=True, as "
      "mosaic_kernel.default_config's tilings have; MosaicConfig() "
      "defaults to the column split) or delay_release=0 (',d0')")):
    pk.fused_wgrad_update(x, dy, w, slots, _hparams(), rule=ADAMW,
                          interpret=True, config=MosaicConfig())


# --- arguments of the wrong form ---------------------------------------------


def test_one_format_for_all_slots_is_refused():
  x, dy, w, (mu, nu) = _case(10, 8, 16, 32)
  fmt = quant.MomentFormat()
  slots = (quant.quantize(mu, fmt), nu)
  with pytest.raises(TypeError, match=re.escape(
      "fused_wgrad_update: formats is one MomentFormat (int8, block 64), "
      "not one per slot: give one MomentFormat or None per slot of rule "
      "'adamw' ('mu', 'nu'), e.g. formats=(fmt,) * 2")):
    pk.fused_wgrad_update(x, dy, w, slots, _hparams(), rule=ADAMW,
                          interpret=True, formats=fmt)
  # One per slot (None: a plain slot) runs.
  pk.fused_wgrad_update(x, dy, w, slots, _hparams(), rule=ADAMW,
                        interpret=True, formats=(fmt, None))


def test_a_quantized_slot_as_a_plain_tuple_is_refused():
  x, dy, w, (mu, nu) = _case(11, 8, 16, 32)
  q = quant.quantize(mu, quant.MomentFormat())
  for fn, kw in ((pk.fused_wgrad_update, dict(interpret=True)),
                 (pk.fused_wgrad_update_reference, {})):
    with pytest.raises(TypeError, match=(
        r"slot 'mu' is a plain tuple of two entries; a quantized slot must "
        r"be a pallas_kernels.quant.Quantized\(q, scale\)")):
      fn(x, dy, w, (tuple(q), nu), _hparams(), rule=ADAMW, **kw)
    with pytest.raises(TypeError, match="slot 'nu' must be an array"):
      fn(x, dy, w, (mu, "nu"), _hparams(), rule=ADAMW, **kw)


def test_a_weight_that_is_not_an_array_is_refused_in_plain_words():
  """w as None or a list: the refusal x gets, from every entry point that
  refuses a list x (the state's plan read w.shape first: an
  AttributeError)."""
  x, dy, w, _ = _case(13, 8, 16, 32)
  sgd = pk.sgd_rule()
  h = sgd.pack(lr=0.1)
  for bad in (None, w.tolist()):
    name = type(bad).__name__
    for fn, kw in ((pk.fused_wgrad_update, dict(interpret=True)),
                   (pk.fused_wgrad_update_reference, {}),
                   (pk.unfused_wgrad_update, {})):
      with pytest.raises(TypeError, match=f"w must be an array, got {name}"):
        fn(x, dy, bad, (), h, rule=sgd, **kw)
  # stored_g_update takes nested lists as arrays (its own test), not None.
  with pytest.raises(TypeError, match="w must be an array, got NoneType"):
    pk.stored_g_update(w, None, (), h, rule=sgd, interpret=True)
  with pytest.raises(TypeError, match="g must be an array, got NoneType"):
    pk.stored_g_update(None, w, (), h, rule=sgd, interpret=True)


def test_slots_that_are_not_a_sequence_are_refused():
  x, dy, w, (mu, nu) = _case(12, 8, 16, 32)
  sgd = pk.sgd_rule()
  with pytest.raises(TypeError, match=r"fused_wgrad_update: slots must be an "
                     r"empty sequence, \(\), for rule 'sgd'.*got None"):
    pk.fused_wgrad_update(x, dy, w, None, sgd.pack(lr=0.1), rule=sgd,
                          interpret=True)
  with pytest.raises(TypeError, match=r"stored_g_update: slots must be a "
                     r"sequence with one entry per slot of rule 'adamw', "
                     r"\('mu', 'nu'\).*got None"):
    pk.stored_g_update(w, w, None, _hparams(), rule=ADAMW, interpret=True)
  with pytest.raises(TypeError, match="slots must be .* got one "
                     "pallas_kernels.quant.Quantized pair"):
    pk.fused_wgrad_update_reference(
        x, dy, w, quant.quantize(mu, quant.MomentFormat()), _hparams(),
        rule=ADAMW)
  # One bare array (an array iterates over its rows): refused as one array.
  with pytest.raises(TypeError, match=re.escape(
      "slots must be a sequence with one entry per slot of rule 'adamw', "
      "('mu', 'nu')")) as e:
    pk.fused_wgrad_update(x, dy, w, mu, _hparams(), rule=ADAMW,
                          interpret=True)
  assert "got one array of shape (16, 32); wrap it as (slot,)" in str(
      e.value)


def test_a_hyperparameter_of_several_values_is_refused():
  lr = jax.random.uniform(jax.random.PRNGKey(13), (3,))
  with pytest.raises(ValueError, match=re.escape(
      "rule 'sgd': hyperparameter 'lr' must be a scalar (shape (); one value "
      "for the whole weight), got shape (3,)")):
    pk.sgd_rule().pack(lr=lr)
  # One value, of shape () or (1,), packs as before.
  np.testing.assert_array_equal(pk.sgd_rule().pack(lr=lr[:1]),
                                pk.sgd_rule().pack(lr=lr[0]))


def test_torch_rules_default_to_torchs_options():
  # torch.optim's defaults: amsgrad=False, momentum=0, nesterov=False,
  # centered=False -- the same rule objects as the options spelled out.
  assert families.get("adam").torch_rule() is torch_rules.adam_rule(False)
  assert families.get("adamw").torch_rule() is torch_rules.adam_rule(
      amsgrad=False, cuda_fused=False)
  assert families.get("sgd").torch_rule() is torch_rules.sgd_rule(False,
                                                                  False)
  assert families.get("sgd_momentum").torch_rule() is torch_rules.sgd_rule(
      momentum=True, nesterov=False)
  assert families.get("rmsprop").torch_rule() is torch_rules.rmsprop_rule(
      centered=False, momentum=False)
  assert torch_rules.rmsprop_rule(True, True) is torch_rules.rmsprop_rule(
      centered=True, momentum=True)
  # as optax_rule() takes optax's defaults
  assert families.get("adam").optax_rule().name == "adam"
