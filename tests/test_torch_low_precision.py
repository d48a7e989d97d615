"""forge_torch optimizers with low-precision state: int8 / fp8 moments and
stochastic rounding of bfloat16 weights.

A small MLP (a 96 -> 64 forge_torch.Linear, whose 6144-element weight gets
quantized moments, then a 64 -> 7 one, which keeps float moments) trained a
few steps; before each step the managed weights and their state are copied
and the layers' operands captured, and the step is recomputed from them by
the pure reference of the quantized rule
(``pallas_kernels.fused_wgrad_update_reference``, the torch rule,
``Quantized`` slots, the optimizer's packed hyperparameters) and by the
kernel itself called from JAX. Plus the checkpoint round trip, loading a
float checkpoint, and the refusals.
"""

import copy
import io
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import forge_torch  # noqa: E402
import pallas_kernels  # noqa: E402
from pallas_kernels import quant  # noqa: E402
from pallas_kernels.quant import Quantized  # noqa: E402
from pallas_kernels.rules import pack_host  # noqa: E402
from tests.tolerances import assert_close, tol  # noqa: E402

CODES = {torch.int8: jnp.int8, torch.float8_e4m3fn: jnp.float8_e4m3fn}


def _jax(t: torch.Tensor) -> jax.Array:
  t = t.detach().cpu()
  if t.dtype in (torch.float8_e4m3fn, torch.bfloat16):
    bits = jnp.asarray(t.view(torch.uint8 if t.dtype.itemsize == 1
                              else torch.int16).numpy().copy())
    return lax.bitcast_convert_type(
        bits, CODES.get(t.dtype, jnp.bfloat16))
  return jnp.asarray(t.numpy().copy())


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _mlp(dtype, seed=0):
  torch.manual_seed(seed)
  return torch.nn.Sequential(
      forge_torch.Linear(96, 64), torch.nn.Tanh(),
      forge_torch.Linear(64, 7)).to(dtype)


def _batch(step, dtype):
  g = torch.Generator().manual_seed(100 + step)
  return (torch.randn(24, 96, generator=g).to(dtype),
          torch.randn(24, 7, generator=g).to(dtype))


def _loss(model, step, dtype, device="cpu"):
  x, y = (t.to(device) for t in _batch(step, dtype))
  return ((model(x).float() - y.float()) ** 2).mean()


def _quantized_state(opt, p, rule):
  st = opt.state[p]
  return tuple(Quantized(_jax(st[n]), _jax(st[n + "_scale"]))
               for n in rule.slots)


CASES = [
    # family, options, weight dtype
    pytest.param("AdamW", dict(lr=3e-3, weight_decay=0.05, moments="int8"),
                 torch.float32, id="adamw-int8-fp32"),
    pytest.param("Adam", dict(lr=3e-3, amsgrad=True, moments="fp8",
                              stochastic_rounding=True, seed=5),
                 torch.bfloat16, id="adam-amsgrad-fp8-sr-bf16"),
    # State created at construction, from a non-zero value.
    pytest.param("Adagrad", dict(lr=3e-2, initial_accumulator_value=1e-5,
                                 moments="int8"),
                 torch.float32, id="adagrad-int8-fp32"),
]


def _torch_scalars(family, group, t):
  """The rule's scalars for step ``t`` from torch's formulas (its for-loop
  step), read from the group's options alone: the reference does not
  share forge_torch's own scalar code."""
  lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
  sign = -1.0 if group["maximize"] else 1.0
  if family == "Adagrad":
    return {"grad_sign": sign, "weight_decay": wd, "eps": eps,
            "neg_clr": -lr / (1 + (t - 1) * group["lr_decay"])}
  b1, b2 = group["betas"]
  decoupled = family == "AdamW"
  return {"grad_sign": sign, "weight_decay": 0.0 if decoupled else wd,
          "decay": 1 - lr * wd if decoupled else 1.0,
          "one_minus_b1": 1 - b1, "b2": b2, "one_minus_b2": 1 - b2,
          "bc2_sqrt": (1 - b2**t) ** 0.5, "eps": eps,
          "neg_step_size": -lr / (1 - b1**t)}


def _parity(family, options, dtype, device, steps=3):
  model = _mlp(dtype).to(device)
  opt = getattr(forge_torch, family)(model.parameters(), **options)
  big, small = model[0].weight, model[2].weight
  fmt = quant.MomentFormat("int8" if options["moments"] == "int8"
                           else "fp8_e4m3")
  captured = {}

  def capture(module, inputs, output):
    captured["input"] = inputs[0].detach().clone()
    output.register_hook(lambda g: captured.__setitem__(
        "grad_output", g.detach().clone()))

  model[0].register_forward_hook(capture)
  group = opt.param_groups[0]
  rule = opt._forge_rule(group, big.device)
  sr_seed = (options.get("seed", 0)
             + zlib.crc32(b"param_groups[0][0]")) % 2**32
  for step in range(1, steps + 1):
    w0 = _jax(big)
    if step == 1:  # the initial state (zeros; Adagrad's initial value)
      init = options.get("initial_accumulator_value", 0.0)
      s0 = tuple(quant.quantize(jnp.full(big.shape, init), fmt,
                                second_moment=n in rule.second_moments)
                 for n in rule.slots)
    else:
      s0 = _quantized_state(opt, big, rule)
    _loss(model, step, dtype, device).backward()
    opt.step()
    opt.zero_grad()
    h = jnp.asarray(pack_host(rule, _torch_scalars(family, group,
                                                   float(step))))
    x, dy = _jax(captured["grad_output"]), _jax(captured["input"])
    sr = (sr_seed, step) if options.get("stochastic_rounding") else None
    reference = pallas_kernels.fused_wgrad_update_reference
    ref_w, ref_s = jax.jit(lambda *a: reference(
        *a, rule=rule, stochastic_rounding=sr))(x, dy, w0, s0, h)
    got_w, got_s = _jax(big), _quantized_state(opt, big, rule)
    what = f"{family} step {step}"
    assert_close(got_w, ref_w, tol(got_w.dtype), f"{what}: weight")
    if dtype == torch.bfloat16:  # the same random bits: the same roundings
      assert (_bits(got_w) != _bits(ref_w)).mean() < 1e-2, what
    for n, g, r in zip(rule.slots, got_s, ref_s):
      assert g.q.dtype == fmt.dtype and g.scale.dtype == jnp.float32
      assert_close(g.scale, r.scale, tol(jnp.float32), f"{what}: {n} scale")
      # G is summed in another order than the reference's: the stored codes
      # may be one step apart where a value sits on a rounding boundary.
      rq = np.asarray(r.q, np.float32)
      dq = np.abs(np.asarray(g.q, np.float32) - rq)
      one_step = (1.0 if fmt.kind == "int8"  # an e4m3fn ulp is <= |q| / 8
                  else np.maximum(np.abs(rq), 2.0 ** -6) * 2.0 ** -3)
      assert (dq <= one_step).all() and (dq > 0).mean() < 2e-3, (what, n)
    if device == "cpu":
      # The bridge runs exactly the kernel: the same call from JAX gives
      # the same bits.
      kw_w, kw_s = jax.jit(lambda *a: pallas_kernels.fused_wgrad_update(
          *a, rule=rule, interpret=True, stochastic_rounding=sr))(
              x, dy, w0, s0, h)
      assert (_bits(got_w) == _bits(kw_w)).all(), what
      for g, k in zip(got_s, kw_s):
        assert (_bits(g.q) == _bits(k.q)).all(), what
        assert (_bits(g.scale) == _bits(k.scale)).all(), what
    # The step moved the weight and the codes.
    assert (_bits(got_w) != _bits(w0)).mean() > 0.5
    assert (_bits(got_s[0].q) != _bits(s0[0].q)).mean() > 0.3
  # The small weight keeps float moments in its own dtype.
  first = rule.slots[0]
  st = opt.state[small]
  assert st[first].dtype == dtype and first + "_scale" not in st
  assert opt.state[big][first + "_scale"].shape == (64, 2)  # ceil(96 / 64)


@pytest.mark.parametrize("family, options, dtype", CASES)
def test_quantized_steps_match_the_reference_rule(family, options, dtype):
  _parity(family, options, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("family, options, dtype", CASES)
def test_quantized_steps_match_the_reference_rule_on_cuda(family, options,
                                                          dtype):
  if not torch.cuda.is_available():
    pytest.fail("torch has no CUDA device")
  forge_torch._bridge.STATS.reset()
  _parity(family, options, dtype, "cuda")
  assert forge_torch._bridge.STATS.direct == 0  # the Triton kernel


def _train(model, opt, steps, dtype, first=1):
  for step in range(first, first + steps):
    _loss(model, step, dtype).backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt):
  params = [p.detach().clone() for p in model.parameters()]
  state = [{k: v.clone() for k, v in opt.state[p].items()}
           for p in model.parameters()]
  return params, state


def test_a_checkpoint_restores_the_run_bit_for_bit():
  """Saved after step 3 (bf16 weights, fp8 moments, stochastic rounding),
  restored into a new model and optimizer: steps 4-6 equal the unbroken
  run's bit for bit, codes and float32 scales keep their dtypes."""
  dtype = torch.bfloat16
  options = dict(lr=3e-3, moments="fp8", stochastic_rounding=True, seed=3)
  model = _mlp(dtype)
  opt = forge_torch.AdamW(model.parameters(), **options)
  _train(model, opt, 3, dtype)
  buf = io.BytesIO()
  torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
  _train(model, opt, 3, dtype, first=4)
  want = _snapshot(model, opt)

  buf.seek(0)
  ckpt = torch.load(buf)
  model2 = _mlp(dtype, seed=1)
  model2.load_state_dict(ckpt["model"])
  opt2 = forge_torch.AdamW(model2.parameters(), **options)
  opt2.load_state_dict(ckpt["opt"])
  st = opt2.state[model2[0].weight]
  assert st["exp_avg"].dtype == torch.float8_e4m3fn
  assert st["exp_avg_sq_scale"].dtype == torch.float32
  saved = ckpt["opt"]["state"][0]["exp_avg_sq_scale"]
  assert torch.equal(st["exp_avg_sq_scale"], saved)  # not rounded to bf16
  _train(model2, opt2, 3, dtype, first=4)
  got = _snapshot(model2, opt2)
  for a, b in zip(got[0], want[0]):
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
  for sa, sb in zip(got[1], want[1]):
    assert sa.keys() == sb.keys()
    for k in sa:
      assert sa[k].dtype == sb[k].dtype, k
      assert torch.equal(sa[k].reshape(-1).view(torch.uint8),
                         sb[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_checkpoint_is_quantized_on_load(dtype):
  """torch.optim.AdamW's (float32) checkpoint loaded into forge_torch.AdamW(
  moments='int8'): the managed weight's moments become the quantizer's
  codes and scales of the saved float32 moments, also for a bfloat16
  model (not of torch's cast of them to the weight's dtype); the small
  weight's stay float."""
  model = _mlp(torch.float32)
  ref = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Tanh(),
                            torch.nn.Linear(64, 7))
  ref.load_state_dict(model.state_dict())
  model.to(dtype)
  topt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
  for step in (1, 2):
    _loss(ref, step, torch.float32).backward()
    topt.step()
    topt.zero_grad()
  opt = forge_torch.AdamW(model.parameters(), lr=1e-3, moments="int8")
  opt.load_state_dict(topt.state_dict())
  st = opt.state[model[0].weight]
  for name in ("exp_avg", "exp_avg_sq"):
    want = quant.quantize(jnp.asarray(topt.state[ref[0].weight][name]
                                      .numpy()), quant.MomentFormat("int8"),
                          second_moment=name == "exp_avg_sq")
    assert st[name].dtype == torch.int8
    assert (st[name].numpy() == np.asarray(want.q)).all()
    assert (st[name + "_scale"].numpy() == np.asarray(want.scale)).all()
  assert opt.state[model[2].weight]["exp_avg"].dtype == dtype


def test_refusals_and_warnings():
  model = _mlp(torch.float32)
  with pytest.raises(ValueError, match=r"moments='int4' is not supported.*"
                     r"'int8'.*'fp8'"):
    forge_torch.AdamW(model.parameters(), moments="int4")
  with pytest.raises(ValueError, match=r"stochastic_rounding=True stores "
                     r"bfloat16 weights.*torch\.float32.*model\.to"):
    forge_torch.Adam(model.parameters(), stochastic_rounding=True)
  with pytest.raises(ValueError, match="keeps no step count"):
    forge_torch.SGD(model.parameters(), lr=0.1, momentum=0.9,
                    stochastic_rounding=True)
  with pytest.raises(ValueError, match="keeps no moments"):
    forge_torch.SGD(model.parameters(), lr=0.1, moments="int8")
  with pytest.raises(TypeError, match="seed must be an integer"):
    forge_torch.AdamW(model.parameters(), moments="int8", seed=1.5)
  for seed in (0, 7):  # (an explicit 0 too: it seeds nothing either)
    with pytest.raises(ValueError, match=rf"seed={seed} without "
                       r"stochastic_rounding=True would do nothing"):
      forge_torch.AdamW(model.parameters(), moments="int8", seed=seed)
  # Left out: 0, and a copy of an optimizer without stochastic rounding
  # builds again.
  opt = forge_torch.AdamW(model.parameters(), moments="int8")
  assert opt.seed == 0 and copy.deepcopy(opt).seed == 0
  # A large parameter torch's own step updates keeps float moments: named
  # in one warning (the managed weights and small parameters are not).
  emb = torch.nn.Embedding(100, 64)
  with pytest.warns(UserWarning, match=r"1 parameter\(s\).*param_groups\[1\]"
                    r"\['params'\]\[0\] \(shape \(100, 64\)\): float moments"):
    forge_torch.AdamW([{"params": list(model.parameters())},
                       {"params": list(emb.parameters())}], moments="int8")


def test_gradient_accumulation_steps_the_quantized_state():
  """accumulate_steps=2 over two halves of a batch equals one step on the
  whole batch (the summed loss); the accumulated update still floors the
  second moment (no zero code in a block with a non-zero scale)."""
  x, y = _batch(1, torch.float32)
  models = [_mlp(torch.float32), _mlp(torch.float32)]
  opts = [forge_torch.AdamW(m.parameters(), lr=1e-2, moments="int8")
          for m in models]
  opts[0].accumulate_steps = 2
  for half in (slice(0, 12), slice(12, 24)):
    ((models[0](x[half]) - y[half]) ** 2).sum().backward()
  ((models[1](x) - y) ** 2).sum().backward()
  for opt in opts:
    opt.step()
  got, want = (o.state[m[0].weight] for o, m in zip(opts, models))
  assert_close(models[0][0].weight.detach().numpy(),
               models[1][0].weight.detach().numpy(), tol(jnp.float32),
               "weight")
  for name in ("exp_avg", "exp_avg_sq"):
    assert_close(got[name + "_scale"].numpy(), want[name + "_scale"].numpy(),
                 tol(jnp.float32), name)
    assert (got[name].int() - want[name].int()).abs().max() <= 1
  q, scale = got["exp_avg_sq"], got["exp_avg_sq_scale"]
  live = scale.repeat_interleave(64, dim=1)[:, :q.shape[1]] > 0
  assert live.any() and (q[live] >= 1).all()


def test_options_a_low_precision_run_cannot_honour_are_refused_in_words():
  """Centered RMSprop (its variance a difference of two quantized moments)
  with moments=; forge_torch's optimizer-wide options in a param group
  (constructor, add_param_group, a loaded checkpoint); a group option
  switched on after the quantized state exists (the slot it needs is
  missing); a managed layer run unfused whose moments would be codes, or
  whose bf16 weight is stochastically rounded."""
  model = _mlp(torch.float32)
  with pytest.raises(ValueError, match=r"centered=True is not supported.*"
                     r"sqrt\(square_avg - grad_avg\*\*2\)"):
    forge_torch.RMSprop(model.parameters(), centered=True, moments="int8")
  opt = forge_torch.RMSprop(model.parameters(), moments="fp8")
  with pytest.raises(ValueError, match="centered=True is not supported"):
    opt.add_param_group({"params": [forge_torch.Linear(4, 4).weight],
                         "centered": True})
  assert len(opt.param_groups) == 1
  sd = opt.state_dict()
  sd["param_groups"][0]["centered"] = True
  with pytest.raises(ValueError, match="centered=True is not supported"):
    opt.load_state_dict(sd)
  opt.param_groups[0]["centered"] = True  # before the first step
  with pytest.raises(ValueError, match="centered=True is not supported"):
    _loss(model, 1, torch.float32).backward()
  for key, value in (("moments", "int8"), ("stochastic_rounding", True),
                     ("seed", 3), ("max_grad_norm", 1.0)):
    with pytest.raises(ValueError, match=rf"{key} in a param group.*apply "
                       r"to the whole optimizer"):
      forge_torch.AdamW([{"params": list(model.parameters()), key: value}])
  opt = forge_torch.AdamW(model.parameters(), lr=1e-3, moments="int8")
  with pytest.raises(ValueError, match="moments in a param group"):
    opt.add_param_group({"params": [forge_torch.Linear(4, 4).weight],
                         "moments": None})
  sd = opt.state_dict()
  sd["param_groups"][0]["seed"] = 1
  with pytest.raises(ValueError, match="seed in a param group"):
    opt.load_state_dict(sd)

  _train(model, opt, 2, torch.float32)
  opt.param_groups[0]["amsgrad"] = True
  with pytest.raises(RuntimeError, match=r"has no 'max_exp_avg_sq'.*options "
                     r"\(e\.g\. momentum, centered, amsgrad\) changed"):
    # (the quantized layer alone: the float one has its own such check)
    model[0](_batch(3, torch.float32)[0]).square().sum().backward()
  opt.param_groups[0]["amsgrad"] = False

  for options, dtype, match in (
      (dict(moments="int8"), torch.float32, "codes, which torch.optim.AdamW"),
      (dict(stochastic_rounding=True), torch.bfloat16,
       "stochastic_rounding=True, which torch.optim.AdamW")):
    model = _mlp(dtype)
    opt = forge_torch.AdamW(model.parameters(), lr=1e-3, **options)
    model[0].fused = False  # from the first step: no state yet
    _loss(model, 1, dtype).backward()
    with pytest.raises(RuntimeError, match=rf"fused = False.*{match}"):
      opt.step()
    assert opt.state.get(model[0].weight, {}) == {}


def test_a_quantized_checkpoint_loads_into_plain_layers_dequantized():
  """A checkpoint of int8 moments loaded into a forge_torch optimizer over
  the same model with plain nn.Linear layers (torch's own step updates
  them): the codes are dequantized to the weight's dtype, the scales
  dropped, with moments=None and moments='int8' alike; saved again, it
  loads into torch.optim.AdamW."""
  model = _mlp(torch.float32)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-3, moments="int8")
  _train(model, opt, 2, torch.float32)
  saved = opt.state_dict()
  codes = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
  assert codes["exp_avg"].dtype == torch.int8
  plain = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Tanh(),
                              torch.nn.Linear(64, 7))
  plain.load_state_dict(model.state_dict())
  for moments in (None, "int8"):
    other = forge_torch.AdamW(plain.parameters(), lr=1e-3, moments=moments) \
        if moments is None else None
    if other is None:
      with pytest.warns(UserWarning, match="float moments"):
        other = forge_torch.AdamW(plain.parameters(), lr=1e-3,
                                  moments=moments)
    other.load_state_dict(saved)
    st = other.state[plain[0].weight]
    assert sorted(st) == ["exp_avg", "exp_avg_sq", "step"]
    for name in ("exp_avg", "exp_avg_sq"):
      want = codes[name].float() * codes[name + "_scale"].repeat_interleave(
          64, dim=-1)[:, :96]
      assert st[name].dtype == torch.float32
      assert torch.equal(st[name], want), name
  topt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
  topt.load_state_dict(other.state_dict())
  _loss(plain, 3, torch.float32).backward()
  topt.step()
  assert all(torch.isfinite(p).all() for p in plain.parameters())


@pytest.mark.parametrize("moments", [None, "int8"])
def test_nadam_on_bfloat16_weights_resumes_bit_for_bit(moments):
  """NAdam's float32 mu_product of a bfloat16 weight keeps its dtype
  through load_state_dict (torch's loader casts it to bfloat16, and the
  restored run drifted from the unbroken one): steps 3-4 after a restore
  equal the unbroken run's bit for bit, every parameter's."""
  dtype = torch.bfloat16
  options = dict(lr=3e-3, moments=moments)
  model = _mlp(dtype)
  opt = forge_torch.NAdam(model.parameters(), **options)
  _train(model, opt, 2, dtype)
  saved_model = copy.deepcopy(model.state_dict())
  saved = copy.deepcopy(opt.state_dict())
  _train(model, opt, 2, dtype, first=3)
  want = [p.detach().clone() for p in model.parameters()]

  model2 = _mlp(dtype, seed=1)
  model2.load_state_dict(saved_model)
  opt2 = forge_torch.NAdam(model2.parameters(), **options)
  opt2.load_state_dict(saved)
  for p in model2.parameters():
    assert opt2.state[p]["mu_product"].dtype == torch.float32
  _train(model2, opt2, 2, dtype, first=3)
  for a, b in zip(model2.parameters(), want):
    assert torch.equal(a.detach().view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("moments", [None, "int8"])
def test_codes_without_their_scales_are_refused_on_load(moments):
  """A (damaged) checkpoint holding a managed weight's int8 codes without
  their scales: refused by name, not read as float moments of up to 127
  (moments=None) or quantized again as values (moments='int8')."""
  model = _mlp(torch.float32)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-3, moments="int8")
  _train(model, opt, 2, torch.float32)
  saved = copy.deepcopy(opt.state_dict())
  del saved["state"][0]["exp_avg_scale"]
  other = forge_torch.AdamW(model.parameters(), lr=1e-3, moments=moments)
  with pytest.raises(ValueError, match=r"'exp_avg' as torch.int8 codes "
                     r"without their scales \('exp_avg_scale'\)"):
    other.load_state_dict(saved)


@pytest.mark.parametrize("moments", ["int8", "fp8", None])
def test_a_quantized_checkpoint_in_another_order_is_refused_at_load(moments):
  """int8 codes saved for a (64, 96) weight, loaded onto a (96, 64) one
  (the optimizer lists the weights in another order): refused at the load
  naming the shapes, as float moments are, whatever format the loading
  optimizer keeps; its state is left as it was."""
  torch.manual_seed(0)
  model = torch.nn.Sequential(
      forge_torch.Linear(96, 64, bias=False), torch.nn.Tanh(),
      forge_torch.Linear(64, 96, bias=False))
  first, last = model[0].weight, model[2].weight
  opt = forge_torch.AdamW([first, last], lr=1e-3, moments="int8")
  x = torch.randn(8, 96)
  model(x).square().mean().backward()
  opt.step()
  opt.zero_grad()
  assert opt.state[first]["exp_avg"].dtype == torch.int8
  saved = opt.state_dict()
  other = forge_torch.AdamW([last, first], lr=1e-3, moments=moments)
  with pytest.raises(ValueError, match=r"'exp_avg' for weight of shape "
                     r"\(96, 64\) is of shape \(64, 96\)(.|\n)*another order"):
    other.load_state_dict(copy.deepcopy(saved))
  assert not other.state


@pytest.mark.parametrize("options, dtype", [
    (dict(moments="int8"), torch.float32),
    (dict(stochastic_rounding=True, seed=5), torch.bfloat16),
], ids=["int8", "stochastic-rounding"])
def test_distributed_checkpoint_forms_and_restores_a_fresh_state(options,
                                                                  dtype):
  """torch.distributed.checkpoint's state-dict functions form a fresh
  optimizer's state by a step from zero gradients at lr 0, which torch's
  own step cannot take for codes or stochastic rounding: the step from
  G = 0 is applied fused, leaving the weights as they were and the lr
  restored; a run restored through them continues bit for bit."""
  from torch.distributed.checkpoint import state_dict as dcp  # noqa: PLC0415
  full = dcp.StateDictOptions(full_state_dict=True)
  model = _mlp(dtype)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-3, **options)
  before = [p.detach().clone() for p in model.parameters()]
  saved = dcp.get_optimizer_state_dict(model, opt, options=full)
  assert saved["state"]["0.weight"]["exp_avg"].dtype == (
      torch.int8 if "moments" in options else dtype)
  for p, q in zip(model.parameters(), before):
    assert torch.equal(p, q)
    assert p.grad is None
  assert opt.param_groups[0]["lr"] == 1e-3

  _train(model, opt, 2, dtype)
  saved = copy.deepcopy(dcp.get_optimizer_state_dict(model, opt,
                                                      options=full))
  restored = _mlp(dtype, seed=1)
  restored.load_state_dict(model.state_dict())
  opt2 = forge_torch.AdamW(restored.parameters(), lr=1e-3, **options)
  dcp.set_optimizer_state_dict(restored, opt2, saved, options=full)
  _train(model, opt, 2, dtype, first=3)
  _train(restored, opt2, 2, dtype, first=3)
  for p, q in zip(restored.parameters(), model.parameters()):
    assert torch.equal(p.view(torch.int16) if dtype == torch.bfloat16 else p,
                       q.view(torch.int16) if dtype == torch.bfloat16 else q)


@pytest.mark.parametrize("name,value", [("moments", "int8"),
                                        ("stochastic_rounding", True),
                                        ("seed", 3)])
def test_constructor_only_options_set_later_are_refused_in_words(name, value):
  """moments, stochastic_rounding and seed are read-only after
  construction (the state was formed under them): setting one says so,
  names the constructor argument and what can be set between steps,
  instead of Python's bare 'property has no setter'."""
  layer = forge_torch.Linear(8, 4)
  opt = forge_torch.AdamW(layer.parameters())
  before = getattr(opt, name)
  with pytest.raises(AttributeError, match=(
      rf"AdamW\.{name} is set when the optimizer is built.*{name}=\.\.\..*"
      "max_grad_norm, accumulate_steps and restore_buffers")):
    setattr(opt, name, value)
  assert getattr(opt, name) == before
