"""forge_torch (Linear + AdamW through the DLPack bridge) against torch and forge_jax."""

import contextlib
import copy
import dataclasses
import functools
import gc
import io
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flax.linen as nn_flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import forge_jax  # noqa: E402
import forge_torch  # noqa: E402
from tests.tolerances import RESIDUAL_LOSS_RTOL, tol  # noqa: E402

FP32_TOL = tol(jnp.float32)  # 1e-5, the project's fp32 parity bar
CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu,
       pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")]
WIDTHS = (37, 70, 130, 5)  # odd widths no block size divides
BATCH = 48


def rel(a, b) -> float:
  a, b = a.detach().double().cpu(), b.detach().double().cpu()
  d = b.norm().item()
  return (a - b).norm().item() / (d if d > 0 else 1.0)


def make_mlp(device="cpu", dtype=torch.float32, seed=0, bias=True,
             act=nn.ReLU):
  torch.manual_seed(seed)
  layers = []
  for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
    if i:
      layers.append(act())
    layers.append(nn.Linear(a, b, bias=bias))
  return nn.Sequential(*layers).to(device=device, dtype=dtype)


def forge_copy(model):
  f = copy.deepcopy(model)
  names = forge_torch.convert(f)
  assert names == ["0", "2", "4"]
  return f


def batches(steps, device="cpu", dtype=torch.float32, seed=1):
  """Random (x, y) pairs (regression onto noise)."""
  g = torch.Generator().manual_seed(seed)
  return [(torch.randn(BATCH, WIDTHS[0], generator=g).to(device, dtype),
           torch.randn(BATCH, WIDTHS[-1], generator=g).to(device, dtype))
          for _ in range(steps)]


def train(model, opt, sched, data):
  for x, y in data:
    loss = F.mse_loss(model(x).float(), y.float())
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
      sched.step()
  return loss


def param_groups(model, split):
  ps = list(model.parameters())
  if not split:
    return ps
  return [{"params": ps[:2]},
          {"params": ps[2:4], "lr": 2e-2, "betas": (0.8, 0.95), "eps": 1e-6},
          {"params": ps[4:], "weight_decay": 0.0}]


SCHEDULERS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: min(1.0, (s + 1) / 5) * 0.9**s),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
        o, T_max=20, eta_min=1e-4),
}


def run_parity(device, split, sched_name, steps=20, lr=1e-2):
  ref = make_mlp(device)
  fm = forge_copy(ref)
  init = copy.deepcopy(ref)
  o_ref = torch.optim.AdamW(param_groups(ref, split), lr=lr)
  o_f = forge_torch.AdamW(param_groups(fm, split), lr=lr)
  assert len(o_f.managed_params) == 3
  s_ref, s_f = SCHEDULERS[sched_name](o_ref), SCHEDULERS[sched_name](o_f)
  data = batches(steps, device)
  l_ref = train(ref, o_ref, s_ref, data)
  l_f = train(fm, o_f, s_f, data)
  errs = {"loss": rel(l_f, l_ref)}
  for (name, pf), pr, p0 in zip(fm.named_parameters(), ref.parameters(),
                                init.parameters()):
    errs[name] = rel(pf, pr)
    assert rel(pf, p0) > 1e-2, f"{name} did not move"
    sf, sr = o_f.state[pf], o_ref.state[pr]
    assert sf.keys() == sr.keys() == {"step", "exp_avg", "exp_avg_sq"}
    assert sf["step"].item() == sr["step"].item() == steps
    assert sf["step"].dtype == sr["step"].dtype
    assert sf["step"].device == sr["step"].device
    for k in ("exp_avg", "exp_avg_sq"):
      assert sf[k].dtype == sr[k].dtype and sf[k].device == sr[k].device
      errs[f"{name}.{k}"] = rel(sf[k], sr[k])
  for g_f, g_r in zip(o_f.param_groups, o_ref.param_groups):
    assert g_f["lr"] == g_r["lr"]
  bad = {k: v for k, v in errs.items() if not v <= FP32_TOL}
  assert not bad, f"relative errors above {FP32_TOL}: {bad}"
  return errs


# --- fp32 parity with torch.optim.AdamW ---------------------------------------


@pytest.mark.parametrize("split,sched_name", [(False, "lambda"),
                                              (True, "cosine")],
                         ids=["one-group+LambdaLR", "param-groups+Cosine"])
def test_fp32_parity_with_torch_adamw_cpu(split, sched_name):
  errs = run_parity("cpu", split, sched_name)
  print("max relative error:", max(errs.values()))


def test_managed_weight_grad_is_none_and_updated_in_backward():
  model = forge_copy(make_mlp())
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  w0 = [m.weight.detach().clone() for m in model[::2]]
  x, y = batches(1)[0]
  F.mse_loss(model(x), y).backward()
  for m, w in zip(model[::2], w0):
    assert m.weight.grad is None
    assert m.bias.grad is not None
    assert not torch.equal(m.weight, w)  # updated during backward
    assert opt.state[m.weight]["step"].item() == 1
    assert opt.state[m.bias] == {}  # bias: updated by step()
  b0 = model[0].bias.detach().clone()
  w_after_bwd = model[0].weight.detach().clone()
  opt.step()
  assert not torch.equal(model[0].bias, b0)
  assert torch.equal(model[0].weight, w_after_bwd)  # step() leaves it alone
  assert opt.state[model[0].bias]["step"].item() == 1


def _deferred_step_counts(device, monkeypatch=None):
  """A fused group's step tensors advanced at the step's end
  (forge_torch.optim._defers_step: on a GPU; forced on the CPU through
  ``monkeypatch``): what backward, state_dict, zero_grad and step see."""
  from forge_torch import optim as forge_optim
  if monkeypatch is not None:
    monkeypatch.setattr(forge_optim, "_defers_step", lambda step: True)
  ref = make_mlp(device)
  model = forge_copy(ref)
  kw = dict(lr=1e-2, fused=True)
  o_ref = torch.optim.AdamW(ref.parameters(), **kw)
  opt = forge_torch.AdamW(model.parameters(), **kw)
  data = batches(3, device)
  managed = [m.weight for m in model[::2]]

  def backward(i):
    x, y = data[i]
    F.mse_loss(model(x), y).backward()

  def torch_step(i):
    x, y = data[i]
    F.mse_loss(ref(x), y).backward()
    o_ref.step()
    o_ref.zero_grad()

  backward(0)
  steps = [opt.state[w]["step"] for w in managed]
  assert steps[0].device.type == torch.device(device).type
  assert all(s.item() == 0 for s in steps)  # updated, not yet counted
  saved = opt.state_dict()  # counts the updates applied
  assert [s["step"].item() for s in
          (saved["state"][i] for i in (0, 2))] == [1, 1]
  opt.step()
  opt.zero_grad()
  assert all(s.item() == 1 for s in steps)  # not counted twice
  torch_step(0)
  backward(1)
  steps[1].fill_(5.0)  # written meanwhile: kept as written
  opt.step()
  opt.zero_grad()
  torch_step(1)
  counts = [s.item() for s in steps]
  params = [p.detach().clone() for p in model.parameters()]
  backward(2)
  opt.zero_grad()  # counts the updates applied, as step() would
  assert [s.item() for s in steps] == [c + 1 for c in counts]
  return counts, params, list(ref.parameters())


def test_deferred_step_counts_on_the_cpu(monkeypatch):
  counts, params, ref = _deferred_step_counts("cpu", monkeypatch)
  assert counts == [2, 5, 2]
  for a, b in zip(params, ref):
    assert rel(a, b) <= tol(jnp.float32)


@pytest.mark.parametrize("deferred", [False, True], ids=["now", "deferred"])
def test_a_copy_between_backward_and_step_counts_the_updates_applied(
    deferred, monkeypatch):
  """``copy.deepcopy`` (pickling takes the same ``__getstate__``) of model
  and optimizer between ``backward()`` and ``step()``: the copy's step
  counts include the updates already applied, also where they are advanced
  at the step's end (a GPU; forced here), so that training on from the copy
  is training on from the original."""
  from forge_torch import optim as forge_optim
  if deferred:
    monkeypatch.setattr(forge_optim, "_defers_step", lambda step: True)
  # (No biases: torch's copy carries no .grad, so a bias's pending update
  # is not the copy's.)
  model = forge_copy(make_mlp(bias=False))
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2, fused=True)
  data = batches(5)

  def train(m, o, steps):
    for x, y in steps:
      F.mse_loss(m(x), y).backward()
      o.step()
      o.zero_grad()

  train(model, opt, data[:2])
  x, y = data[2]
  F.mse_loss(model(x), y).backward()  # the third update, applied
  model2, opt2 = copy.deepcopy((model, opt))
  for m, o in ((model, opt), (model2, opt2)):
    o.step()
    o.zero_grad()
    assert [o.state[l.weight]["step"].item() for l in m[::2]] == [3.0] * 3
    train(m, o, data[3:])
  for a, b in zip(model.parameters(), model2.parameters()):
    assert torch.equal(a, b)


def test_an_open_accumulation_window_refuses_a_load():
  """torch keeps a gradient-accumulation window in ``.grad`` through
  ``load_state_dict``; forge_torch's buffers of the managed weights would
  be lost there, so a load is refused until the step is finished or
  discarded, and then works. (A copy carries no window, as torch's copy
  carries no ``.grad``: the copy's next micro-batch is its first.)"""
  model = forge_copy(make_mlp())
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  opt.accumulate_steps = 2
  (x, y), = batches(1)
  saved = copy.deepcopy(opt.state_dict())
  F.mse_loss(model(x), y).backward()  # micro-batch 1 of 2
  with pytest.raises(RuntimeError, match=r"in the middle of a gradient-"
                     r"accumulation step \(1 of accumulate_steps=2 "
                     r"micro-batches.*optimizer\.step\(\).*zero_grad"):
    opt.load_state_dict(saved)
  model2, opt2 = copy.deepcopy((model, opt))
  assert not opt2._forge_micro
  assert all(p.grad is None for p in model2.parameters())
  opt.zero_grad()  # discarded: the load works
  opt.load_state_dict(saved)
  F.mse_loss(model(x), y).backward()
  opt.step()  # a step cut short: applied
  opt.load_state_dict(saved)


@gpu[0]
@gpu[1]
def test_gpu_step_counts_advance_at_the_step_end():
  counts, params, ref = _deferred_step_counts("cuda")
  assert counts == [2, 5, 2]
  for a, b in zip(params, ref):
    assert rel(a, b) <= tol(jnp.float32)


def test_three_d_input_and_no_bias_match_torch():
  ref = make_mlp(bias=False)
  fm = forge_copy(ref)
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  g = torch.Generator().manual_seed(3)
  for _ in range(3):
    x = torch.randn(4, 12, WIDTHS[0], generator=g)
    y = torch.randn(4, 12, WIDTHS[-1], generator=g)
    for m, o in ((ref, o_ref), (fm, o_f)):
      F.mse_loss(m(x), y).backward()
      o.step()
      o.zero_grad()
  for pf, pr in zip(fm.parameters(), ref.parameters()):
    assert rel(pf, pr) <= FP32_TOL


def test_bfloat16_matches_torch_adamw():
  ref = make_mlp(dtype=torch.bfloat16)
  fm = forge_copy(ref)
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  data = batches(3, dtype=torch.bfloat16)
  train(ref, o_ref, None, data)
  train(fm, o_f, None, data)
  for pf, pr in zip(fm.parameters(), ref.parameters()):
    assert pf.dtype == torch.bfloat16
    assert o_f.state[pf]["exp_avg"].dtype == torch.bfloat16
    assert rel(pf, pr) <= tol(jnp.bfloat16)


def test_layer_not_reaching_the_loss_is_skipped_like_torch():
  torch.manual_seed(0)
  used, unused = forge_torch.Linear(5, 3), forge_torch.Linear(5, 3)
  opt = forge_torch.AdamW(list(used.parameters()) + list(unused.parameters()))
  w = unused.weight.detach().clone()
  x = torch.randn(8, 5)
  unused(x)  # runs, but its output does not reach the loss
  used(x).sum().backward()
  opt.step()
  assert torch.equal(unused.weight, w) and opt.state[unused.weight] == {}
  assert opt.state[used.weight]["step"].item() == 1


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_matches_torch(reentrant):
  from torch.utils.checkpoint import checkpoint
  ref = make_mlp()
  fm = forge_copy(ref)
  models = []
  for m in (ref, fm):
    def fwd(x, m=m):
      h = checkpoint(lambda t: m[2](m[1](m[0](t))), x, use_reentrant=reentrant)
      return m[4](m[3](h))
    models.append(fwd)
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  for x, y in batches(3):
    x = x.requires_grad_(reentrant)  # reentrant needs an input requiring grad
    for fwd, o in zip(models, (o_ref, o_f)):
      F.mse_loss(fwd(x), y).backward()
      o.step()
      o.zero_grad()
  for pf, pr in zip(fm.parameters(), ref.parameters()):
    assert rel(pf, pr) <= FP32_TOL
    assert o_f.state[pf]["step"].item() == 3


def test_a_layer_reused_under_reentrant_checkpointing_is_refused_clearly():
  """Reentrant checkpointing runs the forward without autograd, so a layer
  reused within a step is not counted at its forwards: its second
  backward is refused, saying so and naming the fixes."""
  from torch.utils.checkpoint import checkpoint
  layer, _ = _layer_and_opt()
  x = torch.randn(3, 6, requires_grad=True)
  y = checkpoint(layer, x, use_reentrant=True)
  z = checkpoint(layer, x, use_reentrant=True)
  with pytest.raises(RuntimeError, match=r"Linear\(6, 4\): a second backward"
                     r".*reentrant torch.utils.checkpoint.*layer.fused = "
                     r"False"):
    (y + z).sum().backward()


def test_a_layer_reused_in_one_reentrant_checkpoint_region_is_refused_clearly():
  """A layer called twice inside one reentrant checkpoint region: both
  forwards are recomputed before either backward, and the second backward
  found the saved weight's version moved on by the first's update:
  autograd's in-place error, naming neither the layer nor a fix. FORGE's
  refusal instead."""
  from torch.utils.checkpoint import checkpoint
  torch.manual_seed(0)
  layer = forge_torch.Linear(6, 6)
  opt = forge_torch.AdamW(layer.parameters())  # noqa: F841 (kept alive)
  x = torch.randn(3, 6, requires_grad=True)
  y = checkpoint(lambda t: layer(torch.tanh(layer(t))), x, use_reentrant=True)
  with pytest.raises(RuntimeError, match=r"Linear\(6, 6\): a second backward"
                     r".*reentrant torch.utils.checkpoint"):
    y.sum().backward()


@pytest.mark.parametrize("inner,outer", [(False, False), (True, True),
                                         (False, True), (True, False)])
def test_nested_activation_checkpointing_matches_torch(inner, outer):
  """A checkpoint region inside another (each reentrant or not): the inner
  layers' forwards are recomputed more than once in one backward, each
  weight still updated once, as torch steps it."""
  from torch.utils.checkpoint import checkpoint
  ref = make_mlp()
  fm = forge_copy(ref)
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-2)

  def fwd(m, x):
    def region(t):
      return m[2](checkpoint(lambda u: m[1](m[0](u)), t,
                             use_reentrant=inner))
    return m[4](m[3](checkpoint(region, x, use_reentrant=outer)))

  for x, y in batches(2):
    x = x.requires_grad_(True)
    for m, o in ((ref, o_ref), (fm, o_f)):
      F.mse_loss(fwd(m, x), y).backward()
      o.step()
      o.zero_grad()
  for pf, pr in zip(fm.parameters(), ref.parameters()):
    assert rel(pf, pr) <= FP32_TOL
  assert all(o_f.state[p]["step"].item() == 2 for p in fm.parameters()
             if forge_torch.is_forge_weight(p))


def test_no_grad_forwards_are_not_counted():
  """Evaluation forwards (no_grad, inference_mode) neither count towards the
  one use per step nor touch the weights or state: the step equals torch's
  on the same model without them."""
  ref = make_mlp()
  model = forge_copy(ref)
  opt = forge_torch.AdamW(model.parameters())
  o_ref = torch.optim.AdamW(ref.parameters())
  x, y = batches(1)[0]
  before = [p.detach().clone() for p in model.parameters()]
  with torch.no_grad():
    model(x)
    model(x)
  model.eval()
  with torch.inference_mode():
    model(x)
  model.train()
  for p, b in zip(model.parameters(), before):
    assert torch.equal(p, b)
  F.mse_loss(model(x), y).backward()
  opt.step()
  F.mse_loss(ref(x), y).backward()
  o_ref.step()
  for pf, pr in zip(model.parameters(), ref.parameters()):
    assert rel(pf, pr) <= FP32_TOL
    assert opt.state[pf]["step"].item() == 1


# --- forge_torch vs forge_jax --------------------------------------------------


def teacher_batches(steps, device="cpu", dtype=torch.float32, seed=1):
  """(x, y) with y a smooth function of x (a well-conditioned regression)."""
  g = torch.Generator().manual_seed(seed)
  a = torch.randn(WIDTHS[0], WIDTHS[-1], generator=g) / WIDTHS[0]**0.5
  out = []
  for _ in range(steps):
    x = torch.randn(BATCH, WIDTHS[0], generator=g)
    out.append((x.to(device, dtype), (torch.sin(x @ a) + 1).to(device, dtype)))
  return out


class FlaxTanhMLP(nn_flax.Module):
  @nn_flax.compact
  def __call__(self, x):
    for i, w in enumerate(WIDTHS[1:]):
      x = forge_jax.Dense(w)(x)
      if i < len(WIDTHS) - 2:
        x = jnp.tanh(x)
    return x


def run_cross_framework(device, steps=20, lr=1e-3, wd=1e-2, seed=1):
  """forge_torch (torch.optim.AdamW's arithmetic) vs forge_jax (optax's).

  The two reference optimizers are not the same in fp32: optax computes the
  bias corrections ``1 - b**t`` in fp32 (``0.999f`` is not ``0.999``: ``bc2``
  differs by 1.3e-5 relative at ``t = 1``), torch in double, so the two
  trajectories drift apart by ~1e-6 per unit of ``lr * steps``; and ReLU
  kinks or near-zero gradients (Adam's ``m / sqrt(v)`` is then a sign) turn
  ulp-level differences of the two frameworks' forward GEMMs into O(lr)
  jumps. This test therefore uses a smooth activation, a smooth target and
  torch's default ``lr = 1e-3``, where plain optax.adamw and torch's AdamW
  themselves agree to the fp32 bar.
  """
  model = forge_copy(make_mlp(device, act=nn.Tanh))
  opt = forge_torch.AdamW(model.parameters(), lr=lr, weight_decay=wd)
  data = teacher_batches(steps, device, seed=seed)
  to_np = lambda t: t.detach().cpu().numpy()
  params = {f"Dense_{i}": {"kernel": jnp.asarray(to_np(m.weight).T),
                           "bias": jnp.asarray(to_np(m.bias))}
            for i, m in enumerate(model[::2])}
  tx = forge_jax.adamw(lr, weight_decay=wd)
  flax_model = FlaxTanhMLP()

  def loss_fn(variables, batch):
    x, y = batch
    return jnp.mean((flax_model.apply(variables, x) - y) ** 2)

  step = jax.jit(forge_jax.make_step(loss_fn, tx), donate_argnums=(0, 1))
  variables, opt_state = {"params": params}, tx.init(params)
  with jax.default_matmul_precision("highest"):
    for x, y in data:
      j_loss, variables, opt_state = step(
          variables, opt_state, (jnp.asarray(to_np(x)), jnp.asarray(to_np(y))))
  t_loss = train(model, opt, None, data)

  # The last loss is a small residual: its relative error is amplified.
  loss_err = abs(float(j_loss) - t_loss.item()) / abs(t_loss.item())
  assert loss_err <= RESIDUAL_LOSS_RTOL, loss_err
  errs = {}
  adam = opt_state[0]
  for i, m in enumerate(model[::2]):
    name = f"Dense_{i}"
    for leaf, t, tt in (("kernel", m.weight, True), ("bias", m.bias, False)):
      st = opt.state[t]
      for what, j_arr, t_arr in (
          ("", variables["params"][name][leaf], t),
          (".mu", adam.mu[name][leaf], st["exp_avg"]),
          (".nu", adam.nu[name][leaf], st["exp_avg_sq"])):
        j = torch.from_numpy(np.array(j_arr))
        errs[f"{name}.{leaf}{what}"] = rel(t_arr.T if tt else t_arr, j)
  bad = {k: v for k, v in errs.items() if not v <= FP32_TOL}
  assert not bad, f"relative errors above {FP32_TOL}: {bad}"
  return errs


def test_cross_framework_with_forge_jax_cpu():
  errs = run_cross_framework("cpu")
  print("max relative error:", max(errs.values()))


# --- checkpoints ----------------------------------------------------------------


def test_state_dict_round_trip_is_bit_identical():
  def fresh():
    model = forge_copy(make_mlp())
    opt = forge_torch.AdamW(param_groups(model, True), lr=1e-2)
    return model, opt, SCHEDULERS["cosine"](opt)

  data = batches(10)
  m1, o1, s1 = fresh()
  train(m1, o1, s1, data)

  m2, o2, s2 = fresh()
  train(m2, o2, s2, data[:5])
  buf = io.BytesIO()
  torch.save({"model": m2.state_dict(), "opt": o2.state_dict(),
              "sched": s2.state_dict()}, buf)
  del m2, o2, s2
  gc.collect()
  buf.seek(0)
  ckpt = torch.load(buf)
  m3, o3, s3 = fresh()
  m3.load_state_dict(ckpt["model"])
  o3.load_state_dict(ckpt["opt"])
  s3.load_state_dict(ckpt["sched"])
  assert len(o3.managed_params) == 3
  train(m3, o3, s3, data[5:])

  for (name, a), b in zip(m3.named_parameters(), m1.parameters()):
    assert torch.equal(a, b), name
    for k in ("step", "exp_avg", "exp_avg_sq"):
      assert torch.equal(o3.state[a][k], o1.state[b][k]), (name, k)
  sd1, sd3 = o1.state_dict(), o3.state_dict()
  assert sd1["param_groups"] == sd3["param_groups"]


def test_checkpoints_interchange_with_torch_adamw():
  """forge_torch.AdamW's state_dict is torch.optim.AdamW's, both ways."""
  data = batches(10)
  fm = forge_copy(make_mlp())
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  train(fm, o_f, None, data[:5])
  ref = make_mlp()
  ref.load_state_dict(fm.state_dict())
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  o_ref.load_state_dict(copy.deepcopy(o_f.state_dict()))
  back = forge_copy(make_mlp())
  back.load_state_dict(ref.state_dict())
  o_back = forge_torch.AdamW(back.parameters(), lr=1e-2)
  o_back.load_state_dict(copy.deepcopy(o_ref.state_dict()))
  train(fm, o_f, None, data[5:])
  train(ref, o_ref, None, data[5:])
  train(back, o_back, None, data[5:])
  for pf, pr, pb in zip(fm.parameters(), ref.parameters(), back.parameters()):
    assert rel(pr, pf) <= FP32_TOL
    assert torch.equal(pb, pf)


# --- convert() and the layer ----------------------------------------------------


def test_linear_is_a_drop_in_for_nn_linear():
  torch.manual_seed(0)
  ref = nn.Linear(11, 7)
  torch.manual_seed(0)
  got = forge_torch.Linear(11, 7)
  assert isinstance(got, nn.Linear)
  assert got.state_dict().keys() == ref.state_dict().keys()
  for a, b in zip(got.parameters(), ref.parameters()):
    assert torch.equal(a, b)
  x = torch.randn(3, 11)
  with torch.no_grad():  # without autograd no optimizer is needed
    assert torch.equal(got(x), ref(x))
  new = forge_torch.Linear.from_linear(ref)
  assert new.weight is ref.weight and new.bias is ref.bias
  assert forge_torch.is_forge_weight(new.weight)
  no_bias = forge_torch.Linear(4, 2, bias=False, dtype=torch.bfloat16)
  assert no_bias.bias is None and no_bias.weight.dtype == torch.bfloat16
  clone = copy.deepcopy(got)  # new Parameters, still FORGE weights
  assert clone.weight is not got.weight
  assert forge_torch.is_forge_weight(clone.weight)
  # A layer whose weight is not (yet) a Parameter of it: refused in words.
  with pytest.raises(ValueError, match="uninitialized LazyLinear"):
    forge_torch.Linear.from_linear(nn.LazyLinear(3))
  normed = torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
  with pytest.raises(ValueError, match="formed from others at each forward"):
    forge_torch.Linear.from_linear(normed)

  class Scaled(nn.Linear):  # a forward of its own, which FORGE's would drop
    def forward(self, x):
      return 2 * super().forward(x)

  with pytest.raises(TypeError, match="from_linear: its type is Scaled, a "
                     "subclass of nn.Linear whose forward may differ"):
    forge_torch.Linear.from_linear(Scaled(4, 3))
  with pytest.warns(forge_torch.ConvertSkipWarning, match="Scaled"):
    assert forge_torch.convert(nn.Sequential(Scaled(4, 3))) == []


def _assert_two_adamw_steps_alike(model, ref):
  """Two AdamW steps of ``model`` (forge_torch) and ``ref`` (torch) on a
  batch of token ids: every parameter within the fp32 bar."""
  o_ref = torch.optim.AdamW(ref.parameters(), lr=0.1)
  o_f = forge_torch.AdamW(model.parameters(), lr=0.1)
  ids = torch.tensor([[0, 1, 2], [3, 4, 0]])
  for _ in range(2):
    for m, o in ((ref, o_ref), (model, o_f)):
      m(ids).square().mean().backward()
      o.step()
      o.zero_grad()
  for p, q in zip(model.parameters(), ref.parameters(), strict=True):
    assert rel(p, q) <= FP32_TOL


class TiedAfterConvert(nn.Module):
  def __init__(self):
    super().__init__()
    self.emb = nn.Embedding(5, 3)
    self.fc = nn.Linear(3, 3)
    self.head = nn.Linear(3, 5, bias=False)

  def forward(self, ids):
    return self.head(torch.relu(self.fc(self.emb(ids))))


@pytest.mark.parametrize("then", ["nothing", "float", "to", "load", "copy"])
def test_a_weight_tied_by_hand_stays_unmanaged_through_replacements(then):
  """A weight assigned by hand after convert() (a head tied to the
  embedding) is not the layer's own: the layer runs its standard path,
  and stays on it where torch replaces or copies the Parameters
  (.float(), .to(), load_state_dict, deepcopy), which once marked the tied
  weight as managed (its fused update applied, then refused): trains as
  torch's model does."""
  torch.manual_seed(0)
  ref = TiedAfterConvert()
  ref.head.weight = ref.emb.weight
  torch.manual_seed(0)
  model = TiedAfterConvert()
  forge_torch.convert(model)
  model.head.weight = model.emb.weight
  assert not forge_torch.is_forge_weight(model.head.weight)
  for m in (ref, model):
    if then == "float":
      m.float()
    elif then == "to":
      m.to("cpu", torch.float32)
    elif then == "load":
      m.load_state_dict(copy.deepcopy(m.state_dict()))
  if then == "copy":
    ref, model = copy.deepcopy(ref), copy.deepcopy(model)
  assert not forge_torch.is_forge_weight(model.head.weight)
  assert forge_torch.is_forge_weight(model.fc.weight)  # its own, still
  _assert_two_adamw_steps_alike(model, ref)


class TiedToTheHead(nn.Module):
  """nanoGPT's tie, the embedding pointed at the head's weight, with
  ``head`` a ``forge_torch.Linear`` used as a drop-in (``Lin``)."""

  def __init__(self, lin):
    super().__init__()
    self.emb = nn.Embedding(5, 3)
    self.fc = lin(3, 3)
    self.head = lin(3, 5, bias=False)
    self.emb.weight = self.head.weight

  def forward(self, ids):
    return self.head(torch.relu(self.fc(self.emb(ids))))


def test_a_managed_weight_tied_to_another_module_leaves_its_fused_path():
  """A tie that points another module at a managed weight (a drop-in
  forge_torch.Linear head tied to the embedding; two layers tied after
  convert) is found by convert(), which puts the layer on the standard
  path (fused = False) and reports it: trains as torch's model does. Left
  unconverted, two managed layers tied after convert() are refused naming
  the tie, not a layer called twice."""
  torch.manual_seed(0)
  ref = TiedToTheHead(nn.Linear)
  torch.manual_seed(0)
  model = TiedToTheHead(forge_torch.Linear)
  with pytest.warns(forge_torch.ConvertSkipWarning, match="head"):
    names = forge_torch.convert(model)
  assert "weight appears 2 times" in names.skipped["head"]
  assert not model.head.fused and model.fc.fused
  _assert_two_adamw_steps_alike(model, ref)

  model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
  forge_torch.convert(model)
  model[2].weight = model[0].weight  # tied after convert()
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  with pytest.raises(RuntimeError, match=r"forge_torch.Linear 2 was called a "
                     r"second time.*Its weight is also that of "
                     r"forge_torch.Linear 0 \(one Parameter in two layers"):
    model(torch.randn(2, 4))
  with pytest.warns(forge_torch.ConvertSkipWarning):
    skipped = forge_torch.convert(model).skipped
  assert sorted(skipped) == ["0", "2"]
  del opt
  # A layer called twice is not taken for a tie (here the converted model
  # is the layer itself, whose path is "").
  layer = forge_torch.Linear(4, 4)
  forge_torch.convert(layer)
  opt = forge_torch.SGD(layer.parameters(), lr=0.1)
  out = layer(torch.randn(2, 4))
  with pytest.raises(RuntimeError, match="called a second time") as e:
    layer(out)
  assert "Its weight is also" not in str(e.value)
  del opt


class Tied(nn.Module):
  def __init__(self):
    super().__init__()
    self.emb = nn.Embedding(10, 16)
    self.body = nn.Linear(16, 16)
    self.shared = nn.Linear(16, 16)
    self.shared_again = self.shared  # one module registered (and used) twice
    self.head = nn.Linear(16, 10, bias=False)
    self.head.weight = self.emb.weight  # tied
    self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
    self.wide = nn.Linear(16, 16).double()
    self.tail = nn.Linear(16, 16)

  def forward(self, ids):
    h = self.emb(ids)
    h = self.body(h)
    h = self.shared_again(torch.relu(self.shared(h)))
    h = h + self.attn(h, h, h, need_weights=False)[0]
    h = h + self.wide(h.double()).float()
    h = self.tail(h)
    return self.head(h)


def test_convert_leaves_tied_and_shared_weights_unmanaged():
  model = Tied()
  body = model.body
  names = forge_torch.convert(model)
  assert names == ["body", "tail"]
  assert model.body is body and type(body) is forge_torch.Linear
  assert type(model.head) is nn.Linear and type(model.shared) is nn.Linear
  assert type(model.wide) is nn.Linear  # float64: not eligible
  assert type(model.attn.out_proj) is not forge_torch.Linear
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  assert {id(p) for p in opt.managed_params} == {id(model.body.weight),
                                                 id(model.tail.weight)}
  ids = torch.randint(0, 10, (2, 5))
  for _ in range(2):
    emb0 = model.emb.weight.detach().clone()
    model(ids).logsumexp(-1).mean().backward()
    assert model.body.weight.grad is None and model.tail.weight.grad is None
    assert model.emb.weight.grad is not None  # tied: standard path
    assert model.shared.weight.grad is not None
    opt.step()
    opt.zero_grad()
    assert not torch.equal(model.emb.weight, emb0)
  with pytest.raises(ValueError, match="from_linear"):
    forge_torch.convert(nn.Linear(3, 3))


def test_convert_leaves_a_parametrized_layer_and_its_state_alone():
  """A parametrized ``nn.Linear`` (``spectral_norm``: its ``weight`` runs a
  power iteration in training mode) is skipped without reading its weight,
  so ``convert`` leaves its parametrization's state as it was."""
  from torch.nn.utils.parametrizations import spectral_norm
  torch.manual_seed(0)
  model = nn.Sequential(nn.Linear(8, 16), spectral_norm(nn.Linear(16, 16)))
  sn = model[1].parametrizations.weight[0]
  u, v = sn._u.clone(), sn._v.clone()
  with pytest.warns(forge_torch.ConvertSkipWarning, match="1") as caught:
    skipped = forge_torch.convert(model).skipped
  assert list(skipped) == ["1"]
  assert torch.equal(sn._u, u) and torch.equal(sn._v, v)
  # Its reason names parametrize, not its type (a subclass parametrize made).
  assert "formed from others at each forward" in skipped["1"]
  assert "a subclass of nn.Linear" not in str(caught[0].message)


# --- misuse ---------------------------------------------------------------------


# amsgrad and maximize are supported (fused exactly); their parity with torch
# is tested in tests/test_torch_families.py. A subnormal eps: float32
# arithmetic that flushes subnormals (XLA on the CPU) would divide by zero.
@pytest.mark.parametrize("kwargs,match", [
    (dict(capturable=True), "does not support"),
    (dict(differentiable=True), "does not support"),
    (dict(eps=1e-40), "eps=1e-40 is below float32's smallest normal")],
    ids=["capturable", "differentiable", "subnormal-eps"])
def test_unsupported_options_raise(kwargs, match):
  layer = forge_torch.Linear(4, 3)
  with pytest.raises(ValueError, match=match):
    forge_torch.AdamW(layer.parameters(), **kwargs)
  if "eps" in kwargs:  # (a NumPy number too)
    with pytest.raises(ValueError, match=match):
      forge_torch.AdamW(layer.parameters(), eps=np.float64(kwargs["eps"]))
  opt = forge_torch.AdamW([layer.bias])
  with pytest.raises(ValueError, match=match):
    opt.add_param_group({"params": [layer.weight], **kwargs})
  # Set on the group after construction: refused at the update, whose
  # weight is left alone (with and without a plan from an earlier update).
  for family in (forge_torch.AdamW, forge_torch.NAdam):
    opt = family(layer.parameters())
    for _ in range(2):
      layer(torch.randn(2, 4)).sum().backward()
      opt.step()
    opt.param_groups[0].update(kwargs)
    before = layer.weight.detach().clone()
    with pytest.raises(ValueError, match=match):
      layer(torch.randn(2, 4)).sum().backward()
    assert torch.equal(layer.weight, before)


def _layer_and_opt(**kw):
  torch.manual_seed(0)
  layer = forge_torch.Linear(6, 4, **kw)
  return layer, forge_torch.AdamW(layer.parameters())


def test_layer_used_twice_before_step_raises():
  layer, _ = _layer_and_opt()
  x = torch.randn(3, 6)
  y = layer(x)  # its graph is alive: the step's one use of the weight
  with pytest.raises(RuntimeError, match="second time before optimizer.step"):
    layer(x)
  del y


def test_gradient_accumulation_raises():
  layer, opt = _layer_and_opt()
  x = torch.randn(3, 6)
  layer(x).sum().backward()
  with pytest.raises(RuntimeError, match="second time"):
    layer(x)
  opt.step()
  layer(x).sum().backward()  # fine again after step()
  opt.step()
  assert opt.state[layer.weight]["step"].item() == 2


@pytest.mark.parametrize("k", [1, 2])
def test_second_backward_through_one_graph_raises(k):
  """A second backward through one forward: refused naming the layer,
  saying what the first did with the gradient (applied, or with
  accumulation added to the buffer) and how to take an input's gradient
  too; a second forward-free autograd.grad(x) is refused alike."""
  layer, opt = _layer_and_opt()
  opt.accumulate_steps = k
  x = torch.randn(3, 6, requires_grad=True)
  out = layer(x).sum()
  out.backward(retain_graph=True)
  words = (r"forge_torch.Linear Linear\(6, 4\): backward ran twice.*"
           r"accumulate_steps > 1, added the gradient.*"
           r"torch.autograd.grad\(loss, inputs, retain_graph=True\)")
  with pytest.raises(RuntimeError, match=words):
    out.backward()
  with pytest.raises(RuntimeError, match=words):
    torch.autograd.grad(out, x)


def test_unsupported_dtype_raises():
  for dtype in (torch.float64, torch.float16):
    layer = forge_torch.Linear(6, 4, dtype=dtype)
    with pytest.raises(TypeError, match="float32 or torch.bfloat16"):
      forge_torch.AdamW(layer.parameters())
  layer, _ = _layer_and_opt()
  layer.weight.data = layer.weight.data.double()
  with pytest.raises(TypeError, match="float32 or torch.bfloat16"):
    layer(torch.randn(3, 6, dtype=torch.float64))


def test_device_and_dtype_mismatch_raise():
  layer, _ = _layer_and_opt()
  with pytest.raises(RuntimeError, match="input is on meta"):
    layer(torch.empty(3, 6, device="meta"))
  with pytest.raises(TypeError, match="input dtype") as e:
    layer(torch.randn(3, 6, dtype=torch.bfloat16))
  # nn.Linear raises a RuntimeError for mismatched dtypes: caught alike.
  assert isinstance(e.value, RuntimeError)
  with pytest.raises(RuntimeError, match="input dtype torch.float64"):
    layer(torch.randn(3, 6, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_cuda_input_on_cpu_weight_raises():
  layer, _ = _layer_and_opt()
  with pytest.raises(RuntimeError, match="input is on cuda"):
    layer(torch.randn(3, 6, device="cuda"))


def test_float16_autocast_raises():
  # bfloat16 autocast is supported: tests/test_torch_amp_accum.py.
  layer, _ = _layer_and_opt()
  with torch.autocast("cpu", dtype=torch.float16):
    with pytest.raises(RuntimeError, match="autocast"):
      layer(torch.randn(3, 6))


def test_unregistered_layer_raises():
  layer = forge_torch.Linear(6, 4)
  x = torch.randn(3, 6)
  with torch.no_grad():
    layer(x)  # fine without autograd
  with pytest.raises(RuntimeError, match="not registered in a forge_torch"):
    layer(x)
  torch.optim.AdamW(layer.parameters())  # a plain torch optimizer is not enough
  with pytest.raises(RuntimeError, match="not registered in a forge_torch"):
    layer(x)
  layer.fused = False  # the explicit way out: nn.Linear behaviour
  layer(x).sum().backward()
  assert layer.weight.grad is not None


def test_a_copy_of_a_trained_model_says_how_to_evaluate_it():
  """An averaged copy of a converted model (torch's SWA recipe) keeps its
  layers managed, with weights no optimizer holds: evaluated with autograd
  on it is refused, the message naming the copy and the ways to run it;
  under no_grad it runs, equal to the model it averaged."""
  from torch.optim import swa_utils  # noqa: PLC0415
  layer, opt = _layer_and_opt()
  x = torch.randn(3, 6)
  layer(x).square().sum().backward()
  opt.step()
  swa = swa_utils.AveragedModel(layer)
  with pytest.raises(RuntimeError, match=(
      r"not registered in a forge_torch optimizer.*copy of a converted "
      r"model.*AveragedModel.*torch\.no_grad\(\).*fused = False")):
    swa(x)
  with torch.no_grad():
    torch.testing.assert_close(swa(x), layer(x))


def test_tied_managed_weight_raises_at_step():
  layer, opt = _layer_and_opt()
  x = torch.randn(3, 6)
  (layer(x).sum() + (layer.weight ** 2).sum()).backward()  # a second consumer
  with pytest.raises(RuntimeError, match="tied or shared weight"):
    opt.step()


def test_converted_before_optimizer_only():
  model = make_mlp()
  opt = torch.optim.AdamW(model.parameters())
  forge_torch.convert(model)
  with pytest.raises(RuntimeError, match="after forge_torch.convert"):
    model(batches(1)[0][0])
  del opt


def test_add_param_group_registers_a_managed_weight():
  torch.manual_seed(0)
  layer = forge_torch.Linear(6, 4)
  opt = forge_torch.AdamW([layer.bias], lr=1e-2)
  assert opt.managed_params == []
  opt.add_param_group({"params": [layer.weight], "lr": 0.1,
                       "weight_decay": 0.0})
  assert opt.managed_params == [layer.weight]
  w0 = layer.weight.detach().clone()
  layer(torch.randn(3, 6)).sum().backward()
  opt.step()
  # Step 1 of Adam moves every coordinate by lr (m / sqrt(v) = sign(g)).
  # (|dw| = lr |g| / (|g| + eps): lr to ~1e-7 relative, in fp32)
  assert torch.allclose((layer.weight - w0).abs(), torch.full_like(w0, 0.1),
                        rtol=FP32_TOL, atol=0)


def test_newest_optimizer_owns_the_weight():
  """The newest forge_torch optimizer over a managed weight owns it: its
  backward runs that one's update. The older one's step() is refused while
  its groups still hold the weight (it would step believing it had updated
  it), naming the weight and the new owner; given the weight back (a
  group added), it steps again, and the other one is refused."""
  layer, old = _layer_and_opt()
  new = forge_torch.SGD(layer.parameters(), lr=0.5, momentum=0.9)
  layer(torch.randn(3, 6)).sum().backward()
  new.step()
  assert layer.weight in new.state and len(old.state) == 0
  assert old.managed_params == []
  with pytest.raises(RuntimeError, match=(
      r"forge_torch.AdamW.step\(\): the managed weights weight of shape "
      r"\(4, 6\) are in this "
      r"optimizer's param groups, but a forge_torch optimizer given them "
      r"later \(forge_torch.SGD\) took them over")):
    old.step()
  old.param_groups[0]["params"] = [layer.bias]  # torch's step: the bias
  old.step()
  old.add_param_group({"params": [layer.weight]})
  assert new.managed_params == [] and old.managed_params == [layer.weight]
  layer(torch.randn(3, 6)).sum().backward()
  old.step()
  with pytest.raises(RuntimeError, match=r"forge_torch.SGD.step\(\)"):
    new.step()  # its groups hold the weight, now old's again


# --- sync mode (how the fused update is ordered with torch's CUDA stream) -------


@contextlib.contextmanager
def sync_mode(mode):
  previous = forge_torch.set_sync_mode(mode)
  try:
    yield
  finally:
    forge_torch.set_sync_mode(previous)


def test_sync_mode_setting():
  from forge_torch import _bridge
  assert forge_torch.get_sync_mode() in _bridge.SYNC_MODES == ("stream", "host")
  with sync_mode("host"):
    assert forge_torch.get_sync_mode() == "host"
    assert forge_torch.get_sync_mode(effective=True) == "host"
    assert forge_torch.set_sync_mode("stream") == "host"
    assert forge_torch.get_sync_mode() == "stream"
    for bad in ("HOST", "sync", "", None, 1):
      with pytest.raises(ValueError, match="'stream', 'host'"):
        forge_torch.set_sync_mode(bad)
    assert forge_torch.get_sync_mode() == "stream"  # unchanged by the errors


def test_sync_mode_environment_default(monkeypatch):
  from forge_torch import _bridge
  monkeypatch.delenv(_bridge.SYNC_ENV, raising=False)
  assert _bridge._mode_from_env() == "stream"
  monkeypatch.setenv(_bridge.SYNC_ENV, " Host ")
  assert _bridge._mode_from_env() == "host"
  monkeypatch.setenv(_bridge.SYNC_ENV, "async")
  with pytest.raises(ValueError, match="FORGE_TORCH_SYNC must be one of"):
    _bridge._mode_from_env()


def test_stream_mode_prerequisite_checks():
  from types import SimpleNamespace

  from forge_torch import _bridge
  # DLPack passes CUDA's legacy default stream (handle 0) as 1.
  assert _bridge._torch_stream_handle(SimpleNamespace(cuda_stream=0)) == 1
  assert _bridge._torch_stream_handle(SimpleNamespace(cuda_stream=1234)) == 1234

  class Device:
    def __init__(self, get):
      self.get_stream_for_external_ready_events = get

  def unimplemented():
    raise RuntimeError("UNIMPLEMENTED: only implemented for GPU")

  for get, ok in ((lambda: 0x7f00, True), (lambda: 0, False),
                  (unimplemented, False)):
    assert _bridge._device_has_ready_stream(Device(get)) is ok
  # A JAX CPU device has no such stream: stream mode could not order there.
  assert not _bridge._device_has_ready_stream(jax.devices("cpu")[0])


class _FakeStream:
  """Stands in for torch.cuda.current_stream() in the mocked-CUDA test."""

  cuda_stream = 0  # CUDA's legacy default stream: DLPack passes it as 1

  def __init__(self):
    self.syncs = 0

  def synchronize(self):
    self.syncs += 1


def _mocked_cuda_bridge(monkeypatch, seed):
  """The bridge's CUDA branch on the CPU: torch's current stream faked
  (counting host syncs), tensors that say they are on CUDA (recording
  record_stream), JAX's kernel in interpret mode. ``run()`` makes one fused
  update on fresh state, checks it against a plain CPU call and returns the
  warnings it raised."""
  from forge_torch import _bridge, _direct
  from pallas_kernels import torch_rules as _rules
  recorded = []

  class CudaLike(torch.Tensor):
    @property
    def is_cuda(self):
      return True

    def record_stream(self, stream):
      recorded.append(stream)

  stream = _FakeStream()
  monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
  monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
  monkeypatch.setattr(_bridge, "_device_has_ready_stream", lambda d: True)
  monkeypatch.setattr(_bridge, "_STREAM_FALLBACK", None)
  # The DLPack path's control flow: no graph capture, no direct launch.
  monkeypatch.setattr(_bridge, "_capturing", lambda: False)
  monkeypatch.setattr(_direct, "_OFF", "the CUDA branch is mocked")
  jitted = _bridge._jitted  # CPU: interpret mode, nothing donated
  monkeypatch.setattr(_bridge, "_jitted",
                      lambda key, rule, config, interpret, donate:
                      jitted(key, rule, config, True, False))
  g = torch.Generator().manual_seed(seed)
  x, dy = torch.randn(16, 6, generator=g), torch.randn(16, 4, generator=g)
  w0 = torch.randn(6, 4, generator=g)
  h = _rules.adamw_hparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=1e-2, step=1)
  ref = (w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0))
  _bridge.fused_update(x, dy, ref[0], ref[1:], h)

  def run():
    state = [t.as_subclass(CudaLike) for t in
             (w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0))]
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      _bridge.fused_update(x.as_subclass(CudaLike), dy.as_subclass(CudaLike),
                           state[0], state[1:], h)
    for a, b in zip(state, ref):
      assert torch.equal(a.as_subclass(torch.Tensor), b)
    return [str(c.message) for c in caught]

  return types.SimpleNamespace(stream=stream, recorded=recorded, run=run)


def test_stream_mode_control_flow_with_mocked_cuda(monkeypatch):
  """The bridge's CUDA branch on the CPU, with torch's stream and JAX's
  buffer-to-stream wait mocked: stream mode waits on every result with
  torch's stream and pins every tensor it handed to JAX (record_stream),
  without a host sync; a missing wait (here the real CPU client's
  UNIMPLEMENTED) completes the call with host syncs, warns once and switches
  to host mode -- the results are right either way."""
  from jax._src import array as jax_array

  mock = _mocked_cuda_bridge(monkeypatch, seed=5)
  stream, recorded, run = mock.stream, mock.recorded, mock.run

  waits = []
  dlpack = jax_array.ArrayImpl.__dlpack__

  def fake_dlpack(self, *, stream=None, **kw):  # the GPU-side wait, mocked
    waits.append(stream)
    return dlpack(self, **kw)

  with sync_mode("stream"):
    with monkeypatch.context() as m:
      m.setattr(jax_array.ArrayImpl, "__dlpack__", fake_dlpack)
      assert run() == []
    # One wait per result with torch's stream (then torch.from_dlpack's own
    # for the CPU copy-back, streamless); x, dy, w and both slots pinned; the
    # only host sync is the copy-back's.
    assert waits[:3] == [1, 1, 1] and recorded == [stream] * 5
    assert stream.syncs == 1
    assert forge_torch.get_sync_mode(effective=True) == "stream"

    stream.syncs, recorded[:] = 0, []
    messages = run()  # the real CPU __dlpack__(stream=1): UNIMPLEMENTED
    assert len(messages) == 1 and "stream-ordered sync is unavailable" in (
        messages[0]) and "UNIMPLEMENTED" in messages[0]
    assert forge_torch.get_sync_mode() == "stream"
    assert forge_torch.get_sync_mode(effective=True) == "host"
    assert recorded == [] and stream.syncs == 1  # blocked, then copy-back sync

    stream.syncs = 0
    assert run() == []  # host mode now, silently: sync before + copy-back
    assert stream.syncs == 2 and recorded == []


def test_tfrt_gpu_client_falls_back_to_host_mode_with_mocked_cuda(monkeypatch):
  """With JAX's TFRT GPU client (whose view import ignores the DLPack stream)
  stream mode must not be trusted: the first call warns naming the variable
  and synchronises the host before the kernel (host mode), never silently
  unordered."""
  from forge_torch import _bridge
  mock = _mocked_cuda_bridge(monkeypatch, seed=6)
  monkeypatch.setattr(_bridge, "_tfrt_gpu_client", lambda: True)
  with sync_mode("stream"):
    messages = mock.run()  # results checked against a plain CPU call
    assert len(messages) == 1, messages
    assert "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT" in messages[0]
    assert forge_torch.get_sync_mode(effective=True) == "host"
  # Host mode: torch's stream synchronised before the kernel (then the CPU
  # copy-back's sync), nothing pinned by record_stream.
  assert mock.stream.syncs == 2 and mock.recorded == []


def test_host_and_stream_modes_give_identical_results_cpu():
  """CPU has no streams: both modes run the same path, bit for bit."""
  data = batches(4)
  results = {}
  for mode in ("host", "stream"):
    model = forge_copy(make_mlp())
    opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
    stats = forge_torch.bridge_stats
    stats.reset()
    with sync_mode(mode):
      train(model, opt, None, data)
    results[mode] = (model, opt, dataclasses.replace(stats))
  (m_h, o_h, st_h), (m_s, o_s, st_s) = results["host"], results["stream"]
  assert st_h == st_s and st_h.calls == 3 * 4
  assert st_h.copied == 3 * 3 * 4 and st_h.in_place == 0  # CPU copies back
  for (name, a), b in zip(m_h.named_parameters(), m_s.parameters()):
    assert torch.equal(a, b), name
    for k, v in o_h.state[a].items():
      assert torch.equal(v, o_s.state[b][k]), (name, k)


def test_fused_update_hparams_numpy_or_device_array_cpu():
  """hparams as numpy (converted once per distinct vector) or a JAX array."""
  from forge_torch import _bridge
  from pallas_kernels import torch_rules as _rules
  g = torch.Generator().manual_seed(5)
  x, dy = torch.randn(16, 6, generator=g), torch.randn(16, 4, generator=g)
  w0 = torch.randn(6, 4, generator=g)
  h = _rules.adamw_hparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=1e-2, step=1)
  outs = []
  for hp in (h, h.copy(), jax.numpy.asarray(h)):
    w, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    _bridge.fused_update(x, dy, w, (m, v), hp)
    outs.append((w, m, v))
  for other in outs[1:]:
    for a, b in zip(outs[0], other):
      assert torch.equal(a, b)
  assert not torch.equal(outs[0][0], w0)


# --- GPU: zero copy, streams, parity on CUDA -----------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_zero_copy_in_place(dtype):
  torch.manual_seed(0)
  layer = forge_torch.Linear(256, 384, device="cuda", dtype=dtype)
  ref = nn.Linear(256, 384, device="cuda", dtype=dtype)
  ref.load_state_dict(layer.state_dict())
  opt = forge_torch.AdamW(layer.parameters(), lr=1e-2)
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  x = torch.randn(512, 256, device="cuda", dtype=dtype)
  stats = forge_torch.bridge_stats
  ptrs = None
  for i in range(3):
    stats.reset()
    w_before = layer.weight.detach().clone()
    layer(x).float().square().mean().backward()
    if ptrs is None:
      st = opt.state[layer.weight]
      ptrs = [t.data_ptr() for t in (layer.weight, st["exp_avg"],
                                     st["exp_avg_sq"])]
    opt.step()
    opt.zero_grad()
    ref(x).float().square().mean().backward()
    o_ref.step()
    o_ref.zero_grad()
    st = opt.state[layer.weight]
    assert [t.data_ptr() for t in (layer.weight, st["exp_avg"],
                                   st["exp_avg_sq"])] == ptrs
    # The torch tensor sees the update.
    assert not torch.equal(layer.weight, w_before)
    assert rel(layer.weight, ref.weight) <= tol(
        jnp.float32 if dtype == torch.float32 else jnp.bfloat16)
    print(f"step {i}: bridge {stats}")
    assert stats.copied == 0 and stats.in_place == 3, (
        "zero-copy FAILED: XLA did not alias the donated DLPack buffers; the "
        f"bridge fell back to copying results back ({stats})")
  # The aliased memory stays torch's: once every JAX reference is gone, new
  # JAX and torch allocations must not land on (or free) the weight/moments.
  st = opt.state[layer.weight]
  snap = [t.detach().clone() for t in (layer.weight, st["exp_avg"],
                                       st["exp_avg_sq"])]
  gc.collect()
  junk = [jnp.full(tuple(layer.weight.shape), 7.0, jnp.float32)
          for _ in range(8)]
  junk_t = [torch.full_like(snap[0], 7.0) for _ in range(8)]
  jax.block_until_ready(junk)
  torch.cuda.synchronize()
  for a, b in zip((layer.weight, st["exp_avg"], st["exp_avg_sq"]), snap):
    assert torch.equal(a, b)
  del junk, junk_t


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_non_default_stream():
  ref = make_mlp("cuda")
  fm = forge_copy(ref)
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  data = batches(5, "cuda")
  train(ref, o_ref, None, data)
  torch.cuda.synchronize()
  s = torch.cuda.Stream()
  big = torch.randn(4096, 4096, device="cuda")
  with torch.cuda.stream(s):
    s.wait_stream(torch.cuda.default_stream())
    for x, y in data:
      # Long work queued on `s` right before the layer input is produced: if
      # the bridge did not wait for torch's stream, JAX would read x early.
      for _ in range(4):
        big = torch.tanh(big @ big * 1e-3)
      x = x + 0.0 * big[: x.shape[0], : x.shape[1]]
      loss = F.mse_loss(fm(x), y)
      loss.backward()
      o_f.step()
      o_f.zero_grad()
  torch.cuda.synchronize()
  for (name, pf), pr in zip(fm.named_parameters(), ref.parameters()):
    assert rel(pf, pr) <= FP32_TOL, name


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_fp32_parity_with_torch_adamw():
  forge_torch.bridge_stats.reset()
  errs = run_parity("cuda", True, "cosine")
  print("max relative error:", max(errs.values()), forge_torch.bridge_stats)
  # After dropping the first run's JAX references and allocating on both
  # sides (the allocators reuse what it freed), a second run on fresh
  # tensors still matches torch. (The first run's tensors are not re-read.)
  gc.collect()
  junk_j = jnp.ones((4096, 4096)).block_until_ready()
  junk_t = torch.ones(4096, 4096, device="cuda")
  del junk_j, junk_t
  errs2 = run_parity("cuda", False, "lambda")
  print("max relative error:", max(errs2.values()), forge_torch.bridge_stats)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_cross_framework_with_forge_jax():
  errs = run_cross_framework("cuda")
  print("max relative error:", max(errs.values()))


def _busy(big, n):
  """Queues ``n`` large matmuls on torch's current stream."""
  for _ in range(n):
    big = torch.tanh(big @ big * 1e-3)
  return big


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
@pytest.mark.parametrize("side_stream", [False, True],
                         ids=["current-stream", "side-stream"])
def test_gpu_stream_mode_race_detector(side_stream):
  """Stream mode orders JAX's kernel between torch's work, without a host sync.

  torch's stream is kept busy (30 large matmuls) ahead of the producer of
  ``x``/``dy`` and of a GEMM that reads the pre-update ``W``; the bridge is
  called right away, and right after it torch overwrites ``x``/``dy`` in place,
  frees and re-fills their memory, and reads ``W`` and the moments back. With
  any ordering missing, the kernel would read ``x``/``dy`` before they are
  written or after they are trashed, the GEMM would see the new ``W``, or the
  read-back would see the old one. The reference is the same kernel in host
  mode on the intended inputs (bit-identical: the kernel is deterministic).
  """
  from forge_torch import _bridge
  from pallas_kernels import torch_rules as _rules
  bt, n_in, n_out = 8192, 2048, 1024
  h = _rules.adamw_hparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=1e-2, step=3)
  stats = forge_torch.bridge_stats
  stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
  for rep in range(3):
    g = torch.Generator(device="cuda").manual_seed(100 + rep)
    x_true = torch.randn(bt, n_in, device="cuda", generator=g)
    dy_true = torch.randn(bt, n_out, device="cuda", generator=g)
    w0 = torch.randn(n_in, n_out, device="cuda", generator=g) * 0.1
    m0 = torch.randn(n_in, n_out, device="cuda", generator=g) * 1e-3
    v0 = torch.rand(n_in, n_out, device="cuda", generator=g) * 1e-4
    gi_ref = dy_true @ w0.T
    with sync_mode("host"):
      w_ref, m_ref, v_ref = w0.clone(), m0.clone(), v0.clone()
      _bridge.fused_update(x_true, dy_true, w_ref, (m_ref, v_ref), h)
    torch.cuda.synchronize()
    assert not torch.equal(w_ref, w0)

    w, m, v = w0.clone(), m0.clone(), v0.clone()
    big = torch.randn(4096, 4096, device="cuda", generator=g)
    torch.cuda.synchronize()
    stats.reset()
    with sync_mode("stream"), torch.cuda.stream(stream):
      if side_stream:
        stream.wait_stream(torch.cuda.default_stream())
      big = _busy(big, 30)
      z = 0.0 * big[0, 0]  # 0, but only once the whole chain has run
      x = x_true + z
      dy = dy_true + z
      gi = dy @ w.T  # must read the pre-update w (as grad_input does)
      all_in_place = _bridge.fused_update(x, dy, w, (m, v), h)
      # Right away: trash x and dy in place, free them, refill their memory.
      x.fill_(float("nan"))
      dy.mul_(-3.0)
      del x, dy
      trash = [torch.full((bt, n_in), 7.0, device="cuda"),
               torch.full((bt, n_out), -7.0, device="cuda")]
      got = [t.clone() for t in (w, m, v)]
      assert forge_torch.get_sync_mode(effective=True) == "stream", (
          "stream mode fell back to host mode on this stack: "
          f"{_bridge._STREAM_FALLBACK}")
    torch.cuda.synchronize()
    del trash
    assert all_in_place and stats.in_place == 3 and stats.copied == 0, stats
    # (An AdamW step moves W by ~10% here: far above GEMM rounding.)
    assert rel(gi, gi_ref) <= tol(jnp.float32), (
        f"rep {rep}: the GEMM queued before the fused update saw the new W")
    for name, a, b in zip(("w", "exp_avg", "exp_avg_sq"), got,
                          (w_ref, m_ref, v_ref)):
      assert torch.equal(a, b), (
          f"rep {rep}: {name} differs from the host-mode reference "
          f"(max abs diff {(a - b).abs().max().item():.3e}): a stream-ordering "
          "race between torch and the fused kernel")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_stream_and_host_modes_bit_identical(dtype):
  """A few steps of forge_torch.Linear training: the same bits in both modes."""
  data = batches(5, "cuda", dtype)
  runs = {}
  for mode in ("host", "stream"):
    model = forge_copy(make_mlp("cuda", dtype))
    opt = forge_torch.AdamW(param_groups(model, True), lr=1e-2)
    stats = forge_torch.bridge_stats
    stats.reset()
    with sync_mode(mode):
      train(model, opt, None, data)
      assert forge_torch.get_sync_mode(effective=True) == mode
    torch.cuda.synchronize()
    assert stats.copied == 0 and stats.in_place == 3 * 3 * 5, (mode, stats)
    runs[mode] = (model, opt)
  (m_h, o_h), (m_s, o_s) = runs["host"], runs["stream"]
  for (name, a), b in zip(m_h.named_parameters(), m_s.parameters()):
    assert torch.equal(a, b), name
    for k, val in o_h.state[a].items():
      assert torch.equal(val, o_s.state[b][k]), (name, k)


# --- ViewCache: the state's JAX views reused across calls -------------------


def test_view_cache_reuses_only_live_views_of_the_same_memory():
  """A view is handed back only while it is alive and still aliases the
  tensor's current memory; each ``replace`` keeps exactly the last call's
  views; copies and pickles are empty."""
  import pickle

  from forge_torch import _bridge
  cache = _bridge.ViewCache()
  t = torch.randn(8, 4)
  a = jax.dlpack.from_dlpack(t)
  if a.unsafe_buffer_pointer() != t.data_ptr():
    pytest.skip("this CPU client copied the DLPack import")
  assert cache.get(t) is None and cache.misses == 1
  cache.replace([(t, a)])
  assert cache.get(t) is a and cache.hits == 1 and len(cache) == 1
  # Same memory, seen through another tensor object (p.data each call).
  assert cache.get(t.detach()) is a
  # Another tensor (other memory): a miss, and the old view is not offered.
  u = t.clone()
  assert cache.get(u) is None
  # A view whose memory is not the tensor's any more is never reused.
  b = jax.numpy.zeros((8, 4))
  cache.replace([(t, b)])
  assert cache.get(t) is None
  # A deleted (e.g. donated) view is never reused.
  c = jax.dlpack.from_dlpack(t)
  cache.replace([(t, c)])
  c.delete()
  assert cache.get(t) is None
  cache.replace([(t, a)])
  assert len(copy.deepcopy(cache)) == 0 and len(copy.copy(cache)) == 0
  assert len(pickle.loads(pickle.dumps(cache))) == 0
  cache.replace(())
  assert len(cache) == 0 and cache.get(t) is None


def test_optimizer_keeps_one_view_cache_per_managed_weight():
  """forge_torch's optimizers pass each managed weight its own ViewCache (on
  the CPU it stays unused: nothing is written in place there), forget them
  with load_state_dict, and a weight moving to another optimizer leaves its
  cache behind."""
  from forge_torch import _bridge
  model = forge_copy(make_mlp())
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  data = batches(2)
  train(model, opt, None, data)
  views = opt._forge_views
  managed = opt.managed_params
  assert len(managed) == 3 and len(views) == 3
  for p in managed:
    cache = views[p]
    assert isinstance(cache, _bridge.ViewCache)
    # CPU: nothing is donated, the results are copied back; the cache is
    # not consulted and keeps nothing.
    assert (cache.misses, cache.hits, len(cache)) == (0, 0, 0)
  opt.load_state_dict(opt.state_dict())
  assert len(opt._forge_views) == 0
  train(model, opt, None, data[:1])
  assert len(opt._forge_views) == 3
  opt2 = forge_torch.AdamW(model.parameters(), lr=1e-2)
  assert len(opt._forge_views) == 0 and len(opt2._forge_views) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_reused_views_are_ordered_with_torch_writes():
  """With a ViewCache the state's JAX views are reused (no DLPack import of W
  and the moments after the first call), in stream mode, while torch keeps
  rewriting W and the moments between the calls on a busy stream and reads W
  in a GEMM right before each call. Bit-identical to host-mode calls without
  a cache. A tensor with new memory is imported again, and the old memory is
  left alone."""
  from forge_torch import _bridge
  from pallas_kernels import torch_rules as _rules
  bt, n_in, n_out = 4096, 2048, 1024
  g = torch.Generator(device="cuda").manual_seed(7)
  xs = [torch.randn(bt, n_in, device="cuda", generator=g) for _ in range(3)]
  dys = [torch.randn(bt, n_out, device="cuda", generator=g) for _ in range(3)]
  w0 = torch.randn(n_in, n_out, device="cuda", generator=g) * 0.1
  m0 = torch.randn(n_in, n_out, device="cuda", generator=g) * 1e-3
  v0 = torch.rand(n_in, n_out, device="cuda", generator=g) * 1e-4
  hs = [_rules.adamw_hparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=1e-2, step=t)
        for t in (1, 2, 3)]

  def between(w, m, v):  # torch's own writes of the state between steps
    w.mul_(0.5)
    m.add_(1e-3)
    v.mul_(2.0)

  with sync_mode("host"):
    ref = [w0.clone(), m0.clone(), v0.clone()]
    gi_ref = []
    for i in range(3):
      if i:
        between(*ref)
      gi_ref.append(dys[i] @ ref[0].T)
      _bridge.fused_update(xs[i], dys[i], ref[0], ref[1:], hs[i])
  torch.cuda.synchronize()

  cache = _bridge.ViewCache()
  w, m, v = w0.clone(), m0.clone(), v0.clone()
  big = torch.randn(4096, 4096, device="cuda", generator=g)
  stats = forge_torch.bridge_stats
  stats.reset()
  gi = []
  with sync_mode("stream"):
    for i in range(3):
      big = _busy(big, 10)
      z = 0.0 * big[0, 0]
      if i:
        between(w, m, v)
      gi.append((dys[i] + z) @ w.T)
      assert _bridge.fused_update(xs[i] + z, dys[i] + z, w, (m, v), hs[i],
                                  views=cache)
    got = [t.clone() for t in (w, m, v)]
    assert forge_torch.get_sync_mode(effective=True) == "stream"
  torch.cuda.synchronize()
  assert stats.in_place == 9 and stats.copied == 0, stats
  assert (cache.misses, cache.hits, len(cache)) == (3, 6, 3)
  for i in range(3):
    assert rel(gi[i], gi_ref[i]) <= tol(jnp.float32), (
        f"call {i}: the GEMM saw the new W")
  for name, a, b in zip(("w", "exp_avg", "exp_avg_sq"), got, ref):
    assert torch.equal(a, b), (
        f"{name} differs from host-mode calls without a cache (max abs diff "
        f"{(a - b).abs().max().item():.3e})")
  # New memory for W (as after `p.data = ...`): imported again; the old W
  # keeps its values.
  w_old = w
  w_new = w.clone()
  before = w_old.clone()
  assert _bridge.fused_update(xs[0], dys[0], w_new, (m, v), hs[0],
                              views=cache)
  torch.cuda.synchronize()
  assert torch.equal(w_old, before) and not torch.equal(w_new, before)
  assert cache.misses == 4 and cache.hits == 8  # w imported, m and v reused


# --- Direct launch: the Mosaic GPU kernel on the torch tensors ----------------


@contextlib.contextmanager
def direct_launch(enabled):
  was = forge_torch.set_direct_launch(enabled)
  try:
    yield
  finally:
    forge_torch.set_direct_launch(was)


def test_direct_launch_switch_and_cpu_path():
  """The switch takes booleans only and is reported; on the CPU every call
  goes through DLPack (the direct launch needs a Hopper GPU)."""
  with pytest.raises(TypeError, match="True or False"):
    forge_torch.set_direct_launch("no")
  stats = forge_torch.bridge_stats
  with direct_launch(False):
    assert "set_direct_launch" in stats.direct_unavailable
  model = forge_copy(make_mlp())
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  stats.reset()
  train(model, opt, None, batches(2))
  assert stats.calls == 3 * 2 and stats.direct == 0


def test_direct_launch_tiling_follows_the_backend_choice(monkeypatch):
  """A direct launch's tiling (on a stand-in H200): the autotune cache's
  entry for the case, else its nearest entry that covers it -- the tilings
  fused_wgrad_update(backend=None) takes in JAX -- else the kernel's
  default one; None (DLPack) where the Mosaic GPU kernel cannot run it."""
  from forge_torch import _bridge  # noqa: PLC0415
  from pallas_kernels import mosaic_kernel, tuning_cache  # noqa: PLC0415
  import pallas_kernels as pk  # noqa: PLC0415
  monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (9, 0))
  monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H200")
  monkeypatch.delenv(tuning_cache.BACKEND_ENV_VAR, raising=False)
  device = torch.device("meta")
  bf = torch.bfloat16

  def tiling(bt, n_in, n_out, rule=pk.ADAMW, slots=2):
    w = torch.empty(n_in, n_out, dtype=bf, device=device)
    return _bridge._direct_config(bt, n_in, n_out, bf, w, [w] * slots, rule,
                                  None, device)

  def jax_choice(bt, n_in, n_out):
    return tuning_cache.lookup_mosaic(
        bt, n_in, n_out, "bfloat16", ["bfloat16"] * 2, pk.ADAMW,
        device_kind="NVIDIA H200"), tuning_cache.nearest_covering(
            bt, n_in, n_out, "bfloat16", ["bfloat16"] * 2, pk.ADAMW,
            "bfloat16", device_kind="NVIDIA H200")

  exact, _ = jax_choice(512, 4096, 4096)
  assert tiling(512, 4096, 4096) == exact.config
  for case in [(64, 4096, 4096), (512, 768, 3072), (8192, 4096, 14336)]:
    exact, (_, near) = jax_choice(*case)
    assert exact is None and tiling(*case) == near.config
  # No Lion entries: the default tiling; 100 rows: TMA cannot move x's
  # 100-column rows in whole 64-column pieces.
  assert tiling(512, 4096, 4096, pk.lion_rule(), 1) == (
      mosaic_kernel.default_config(jnp.bfloat16, [jnp.bfloat16] * 2, 512,
                                   shape=(4096, 4096)))
  assert tiling(512, 100, 4096) is None


class _RecordingKernel:
  """Stands in for a compiled direct kernel: records its launches."""

  writes_outputs = False

  def __init__(self):
    self.launches = []

  def launch_ptrs(self, stream, ptrs):
    self.launches.append((stream, list(ptrs)))


@pytest.mark.parametrize("abi_v2", [False, True])
def test_the_runtimes_launch_gets_its_arguments_in_its_order(monkeypatch,
                                                             abi_v2):
  """``_direct._bind`` calls the Mosaic GPU runtime's launch with the
  arguments of its ABI, in order: jaxlib 0.11's ``(function, stream,
  ptrs)``, jaxlib 0.12's ``(kernel, function, stream, ptrs, device)``.
  (The runtime stood in for by ctypes callbacks: the real one needs a
  GPU.)"""
  import ctypes  # noqa: PLC0415
  from forge_torch import _direct  # noqa: PLC0415
  calls, unloaded = [], []
  ptrs_t = ctypes.POINTER(ctypes.c_void_p)
  if abi_v2:
    launch_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ptrs_t, ctypes.c_int)
    record = lambda k, f, s, p, d: calls.append((k, f, s, p[0], p[1], d))
  else:
    launch_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                ptrs_t)
    record = lambda f, s, p: calls.append((f, s, p[0], p[1]))
  launch_c = launch_t(record)
  # What MosaicGpuCompile returns: the function, the launch, the kernel.
  compiled = (ctypes.c_void_p * 3)(
      0x1111, ctypes.cast(launch_c, ctypes.c_void_p).value, 0x2222)

  def compile_fn(asm, size):
    assert (asm.value, size.value) == (b"module", 6)
    return ctypes.cast(compiled, ctypes.POINTER(ctypes.c_void_p))

  monkeypatch.setattr(_direct, "_runtime", lambda: (
      compile_fn, lambda handle: unloaded.append(handle), abi_v2))
  launch, tail, unload, c_entry = _direct._bind(b"module", 3)
  launch(0x77, (ctypes.c_void_p * 2)(0xA0, 0xB0), *tail)
  if abi_v2:
    assert calls == [(0x2222, 0x1111, 0x77, 0xA0, 0xB0, 3)]
  else:
    assert calls == [(0x1111, 0x77, 0xA0, 0xB0)] and tail == ()
  # The same launch's addresses, as the native host path calls it.
  assert c_entry == (compiled[1], abi_v2, 0x2222 if abi_v2 else None,
                     0x1111, 3)
  unload()
  assert len(unloaded) == 1


def test_the_launch_abi_is_the_installed_jaxlibs():
  """``_direct.launch_abi_v2`` reads jax's ``_ABI_V2`` where it has one and
  jax's version where not (jaxlib 0.12 dropped the flag: its launch
  takes the kernel and device always); on the installed jax, it picks the
  argument list jax's own torch launcher passes."""
  import inspect  # noqa: PLC0415
  import types  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import core  # noqa: PLC0415
  from forge_torch import _direct  # noqa: PLC0415
  bare = types.SimpleNamespace()
  assert not _direct.launch_abi_v2(bare, (0, 11, 2))
  assert _direct.launch_abi_v2(bare, (0, 12, 1))
  assert _direct.launch_abi_v2(bare, (1, 0))
  for flag in (False, True):
    assert _direct.launch_abi_v2(types.SimpleNamespace(_ABI_V2=flag),
                                 (0, 12)) is flag
  ours = _direct.launch_abi_v2(core, jax.__version_info__)
  own = getattr(core, "_compile_as_torch_gpu_kernel", None)
  source = inspect.getsource(own) if own is not None else ""
  if "launch_arg_types" not in source:
    pytest.skip("this jax's torch launcher lists no launch_arg_types")
  listed = source.split("launch_arg_types = [", 1)[1].split("]", 1)[0]
  n_args = sum("ctypes." in line for line in listed.splitlines())
  assert ours == (n_args == 5), listed


@pytest.mark.parametrize("rule_name", ["adamw", "accumulate"])
def test_a_direct_kernel_writes_its_state_in_place(rule_name):
  """The direct launch's kernel, lowered for a GPU on this machine: every
  state tensor the rule writes is an alias of its own argument, by fn's
  argument positions (x, dy, hparams, w, *slots) -- also for gradient
  accumulation's state-only rule, whose kernel never reads w (a lowering
  that dropped the unused argument shifted the positions, and the build
  refused the rule, switching direct launches off for the process)."""
  import jax.numpy as jnp  # noqa: PLC0415
  from forge_torch import _accumulate, _direct  # noqa: PLC0415
  from pallas_kernels import mosaic_kernel  # noqa: PLC0415
  from pallas_kernels import rules as rules_lib  # noqa: PLC0415
  rule, slots = {
      "adamw": (rules_lib.ADAMW, [torch.bfloat16] * 2),
      "accumulate": (_accumulate.sum_rule(), [torch.float32])}[rule_name]
  bt, n_in, n_out = 64, 256, 128
  cfg = mosaic_kernel.default_config(
      jnp.bfloat16, [_direct.jnp_dtype(d) for d in slots], bt,
      shape=(n_in, n_out))
  state = [((n_in, n_out), torch.bfloat16)] + [((n_in, n_out), d)
                                               for d in slots]
  _, operand_args, aliases, _, outputs = _direct.traced(
      (bt, n_in), (bt, n_out), torch.bfloat16, state,
      len(rule.hparams), rule, cfg, num_sms=8, platforms=("cuda",))
  first = 3 if rule.updates_weight else 4
  assert [operand_args[a] for a in aliases] == list(range(first, 3 + len(
      state)))
  assert outputs == list(range(len(aliases)))
  assert (3 in operand_args) == rule.updates_weight  # w read only if written


def test_direct_launch_cache_keys_each_operands_layout(monkeypatch):
  """A cached direct launch serves only operands laid out as the ones it
  was resolved for: a weight or slot of the same shape and dtype but other
  strides (a transposed view) is resolved anew, never launched by another
  layout's kernel. (The launch machinery stood in for on the CPU: the
  kernel by pointer needs a Hopper GPU.)"""
  from forge_torch import _bridge, _direct  # noqa: PLC0415
  import pallas_kernels as pk  # noqa: PLC0415
  monkeypatch.setattr(_direct, "unavailable", lambda: None)
  monkeypatch.setattr(_bridge, "_raw_stream", lambda device_index: 7)
  monkeypatch.setattr(_bridge, "_LAUNCHES", {})
  resolved, kernel = [], _RecordingKernel()

  def resolve(x2, dy2, w, slots, n_hparams, rule, config, device_index,
              stream):
    resolved.append([t.stride() for t in (w, *slots)])
    return _bridge._Launch(kernel, 1 + len(slots),
                           (device_index, stream, n_hparams))

  monkeypatch.setattr(_bridge, "_resolve", resolve)
  x, dy = torch.randn(8, 6), torch.randn(8, 4)
  hparams = torch.zeros(16)  # on the weight's device: no pinned ring
  w, m, v = (torch.randn(6, 4) for _ in range(3))
  wt = torch.randn(4, 6).t()  # (6, 4), strides (1, 6)
  mt = torch.randn(4, 6).t()

  def launch(w, m, v):
    return _bridge._direct_update(x, dy, w, [m, v], hparams, pk.ADAMW, None)

  assert launch(w, m, v) and launch(w, m, v)
  assert resolved == [[(4, 1)] * 3] and len(kernel.launches) == 2
  assert launch(wt, m, v)
  assert launch(w, mt, v)
  assert resolved == [[(4, 1)] * 3, [(1, 6), (4, 1), (4, 1)],
                      [(4, 1), (1, 6), (4, 1)]]
  key = functools.partial(_bridge._launch_key, x, dy, device_index=0,
                          stream=7, n_hparams=16, rule=pk.ADAMW, config=None)
  assert key(w, [m, v]) == key(torch.empty_like(w), [m, v])
  assert key(w, [m, v]) != key(w, [m, v.bfloat16()])
  assert key(w, [m, v]) != key(wt, [m, v]) != key(w, [mt, v])
  assert key(w, [m, v]) != _bridge._launch_key(
      x, dy.bfloat16(), w, [m, v], 0, 7, 16, pk.ADAMW, None)


def test_a_misaligned_operand_is_not_launched_directly(monkeypatch):
  """An operand whose address is not 16-byte aligned (a view at an odd
  offset into a flat buffer), which the kernel's TMA copies cannot read,
  is not launched directly (the caller then takes the DLPack path), with
  or without a cached launch for its layout; aligned ones are. (The
  launch machinery stood in for on the CPU.)"""
  from forge_torch import _bridge, _direct  # noqa: PLC0415
  import pallas_kernels as pk  # noqa: PLC0415
  monkeypatch.setattr(_direct, "unavailable", lambda: None)
  monkeypatch.setattr(_bridge, "_raw_stream", lambda device_index: 7)
  monkeypatch.setattr(_bridge, "_current_device", lambda: -1)
  monkeypatch.setattr(_bridge, "_stream_capturing", lambda: False)
  monkeypatch.setattr(_bridge, "_LAUNCHES", {})
  kernel = _RecordingKernel()
  monkeypatch.setattr(
      _bridge, "_resolve", lambda x2, dy2, w, slots, n, rule, config, d, s:
      _bridge._Launch(kernel, 1 + len(slots), (d, s, n)))
  x, dy = torch.randn(8, 64), torch.randn(8, 64)
  hparams = torch.zeros(16)
  flat = torch.zeros(3 * 64 * 64 + 1)
  w, m, v = (flat[1 + i * 4096:1 + (i + 1) * 4096].view(64, 64)
             for i in range(3))
  assert w.is_contiguous() and w.data_ptr() % 16 == 4
  aligned = [torch.zeros(64, 64) for _ in range(3)]
  for state in (w, m, v), (aligned[0], m, aligned[2]), (
      aligned[0], aligned[1], v):
    assert not _bridge._direct_update(x, dy, state[0], list(state[1:]),
                                      hparams, pk.ADAMW, None)
  assert not kernel.launches
  assert _bridge._direct_update(x, dy, aligned[0], aligned[1:], hparams,
                                pk.ADAMW, None)
  assert len(kernel.launches) == 1
  # A cached launch for the layout is not repeated on a misaligned input.
  [launch] = [v for v in _bridge._LAUNCHES.values() if v]
  odd = torch.zeros(8 * 64 + 2)[2:].view(8, 64)
  assert not _bridge.relaunch(launch, odd, dy, aligned[0], aligned[1:],
                              np.zeros(16, np.float32), pk.ADAMW, None)


def test_a_case_resolved_by_two_threads_keeps_the_first_launch(
    monkeypatch):
  """Two threads resolving the same new case at once: the one storing its
  launch second takes the first's (dropping its own, never launched),
  rather than replacing a launch the first may have queued already (whose
  module would be unloaded with it). (The launch machinery stood in for
  on the CPU.)"""
  from forge_torch import _bridge, _direct  # noqa: PLC0415
  import pallas_kernels as pk  # noqa: PLC0415
  monkeypatch.setattr(_direct, "unavailable", lambda: None)
  monkeypatch.setattr(_bridge, "_raw_stream", lambda device_index: 7)
  monkeypatch.setattr(_bridge, "_LAUNCHES", {})
  first, second = _RecordingKernel(), _RecordingKernel()
  kept = []

  def resolve(x2, dy2, w, slots, n_hparams, rule, config, device_index,
              stream):
    # While this thread compiled, another resolved the case and stored it.
    key = _bridge._launch_key(x2, dy2, w, slots, device_index, stream,
                              n_hparams, rule, config)
    other = _bridge._Launch(first, 1 + len(slots),
                            (device_index, stream, n_hparams))
    other.key = key
    _bridge._LAUNCHES[key] = other
    kept.append(other)
    return _bridge._Launch(second, 1 + len(slots),
                           (device_index, stream, n_hparams))

  monkeypatch.setattr(_bridge, "_resolve", resolve)
  x, dy = torch.randn(8, 6), torch.randn(8, 4)
  w, m, v = (torch.randn(6, 4) for _ in range(3))
  assert _bridge._direct_update(x, dy, w, [m, v], torch.zeros(16), pk.ADAMW,
                                None)
  assert len(first.launches) == 1 and not second.launches
  assert list(_bridge._LAUNCHES.values()) == kept


def _rebind_at_odd_offsets(tensors, fill=7.0):
  """Each tensor's values moved to a view into one flat buffer at an odd
  element offset (an address not 16-byte aligned), the buffer's other
  elements set to ``fill``; returns ``(views, flat, gaps)``, ``gaps`` the
  buffer's elements outside the views."""
  n = sum(t.numel() + 5 for t in tensors)
  t0 = tensors[0]
  flat = torch.full((n + 1,), fill, dtype=t0.dtype, device=t0.device)
  views, at, gaps = [], 1, torch.ones(n + 1, dtype=torch.bool)
  for t in tensors:
    v = flat[at:at + t.numel()].view(t.shape)
    v.copy_(t.detach())
    gaps[at:at + t.numel()] = False
    views.append(v)
    at += t.numel() + 3
    at += 1 - at % 2  # odd: 4 or 12 (float32), 2 to 14 (bfloat16) mod 16
  assert all(v.data_ptr() % 16 for v in views)
  return views, flat, gaps.to(flat.device)


def _odd_offset_parity(device, dtype, steps=4):
  """Two-layer models trained by forge_torch.AdamW with every managed
  weight, and from the second step its moments, viewed at odd offsets into
  flat buffers, against torch.optim.AdamW on plain tensors. Returns the
  largest relative error, whether the buffers' other elements stayed
  untouched, and the operands' addresses each fused update's kernel got."""
  from forge_torch import _bridge  # noqa: PLC0415
  torch.manual_seed(0)
  ref = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Tanh(),
                      nn.Linear(128, 64, bias=False)).to(device, dtype)
  model = copy.deepcopy(ref)
  forge_torch.convert(model)
  layers = (model[0], model[2])
  views, flat, gaps = _rebind_at_odd_offsets([m.weight for m in layers])
  for m, v in zip(layers, views):
    m.weight.data = v
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  seen = []
  inner = _bridge._update_on_device

  def recording(x, dy, w, slots, *args):
    seen.append([t.data_ptr() % 16 for t in (x, dy, w, *slots)])
    return inner(x, dy, w, slots, *args)

  state_flat = None
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(_bridge, "_update_on_device", recording)
    for step in range(steps):
      x = torch.randn(32, 64, device=device, dtype=dtype)
      for m, o in ((model, opt), (ref, o_ref)):
        m(x).float().square().mean().backward()
        o.step()
        o.zero_grad()
      if step == 0:  # the moments too, from here on
        st = [opt.state[m.weight] for m in layers]
        moments = [s[k] for s in st for k in ("exp_avg", "exp_avg_sq")]
        mviews, state_flat, state_gaps = _rebind_at_odd_offsets(moments)
        for s, (a, b) in zip(st, zip(mviews[::2], mviews[1::2])):
          s["exp_avg"], s["exp_avg_sq"] = a, b
  if device == "cuda":
    torch.cuda.synchronize()
  errs = [rel(a, b) for a, b in zip(model.parameters(), ref.parameters())]
  errs += [rel(opt.state[a][k], o_ref.state[b][k])
           for a, b in zip(model.parameters(), ref.parameters())
           for k in ("exp_avg", "exp_avg_sq")]
  untouched = (bool((flat[gaps] == 7.0).all())
               and bool((state_flat[state_gaps] == 7.0).all())
               and all(m.weight.data_ptr() == v.data_ptr()
                       for m, v in zip(layers, views)))
  return max(errs), untouched, seen


def test_operands_at_odd_offsets_are_staged_through_aligned_copies():
  """Managed weights and moments viewed at odd offsets into flat buffers
  (addresses not 16-byte aligned, which the Mosaic GPU kernel's TMA copies
  cannot take, launched directly or through DLPack) are updated through
  aligned copies, copied back in place: every kernel call gets aligned
  operands, the step matches torch's, and the buffers' other elements are
  untouched."""
  err, untouched, seen = _odd_offset_parity("cpu", torch.float32)
  assert seen and all(not any(a) for a in seen), seen
  assert len(seen) == 2 * 4
  assert err <= FP32_TOL
  assert untouched


def test_a_staged_update_counts_each_written_tensor_once():
  """An update staged through aligned copies gives the aligned update's
  values bit for bit, counts each tensor it writes once in the bridge's
  stats, and drops the weight's cached JAX views (which would keep memory
  it no longer uses alive); a misaligned input alone writes back
  nothing of its own."""
  from forge_torch import _bridge  # noqa: PLC0415
  from pallas_kernels import torch_rules as _rules  # noqa: PLC0415
  g = torch.Generator().manual_seed(5)
  x, dy = torch.randn(16, 6, generator=g), torch.randn(16, 4, generator=g)
  w0 = torch.randn(6, 4, generator=g)
  h = _rules.adamw_hparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=1e-2, step=1)
  want = [w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)]
  _bridge.fused_update(x, dy, want[0], want[1:], h)
  stats = forge_torch.bridge_stats
  for which in ("w", "x", "all"):
    state = [w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)]
    xs = x
    if which in ("w", "all"):
      [state[0]], _, _ = _rebind_at_odd_offsets([state[0]])
    if which in ("x", "all"):
      [xs], _, _ = _rebind_at_odd_offsets([x])
    if which == "all":
      state[1:], _, _ = _rebind_at_odd_offsets(state[1:])
    views = _bridge.ViewCache()
    views._views[("stale",)] = object()
    stats.reset()
    _bridge.fused_update(xs, dy, state[0], state[1:], h, views=views)
    assert stats.in_place + stats.copied == 3, (which, stats)
    assert len(views) == 0, which
    for a, b in zip(state, want):
      assert torch.equal(a, b), which


def test_a_staged_direct_launch_counts_its_copies_as_copied(monkeypatch):
  """On the direct launch (stood in for on the CPU: the kernel by pointer
  needs a Hopper GPU) every state tensor is written in place; in a staged
  update those of the aligned copies are copied back, and count so: with
  the weight misaligned, one copied and two in place; the kernel gets
  aligned addresses only."""
  from forge_torch import _bridge, _direct  # noqa: PLC0415
  import pallas_kernels as pk  # noqa: PLC0415
  monkeypatch.setattr(_direct, "unavailable", lambda: None)
  monkeypatch.setattr(_bridge, "_raw_stream", lambda device_index: 7)
  monkeypatch.setattr(_bridge, "_LAUNCHES", {})
  kernel = _RecordingKernel()
  monkeypatch.setattr(
      _bridge, "_resolve", lambda x2, dy2, w, slots, n, rule, config, d, s:
      _bridge._Launch(kernel, 1 + len(slots), (d, s, n)))
  monkeypatch.setattr(
      _bridge, "_fused_update",
      lambda x, dy, w, slots, hp, rule, config, views, sr=None:
      _bridge._direct_update(x, dy, w, slots, hp, rule, config, sr))
  x, dy = torch.randn(8, 64), torch.randn(8, 32)
  [w], _, _ = _rebind_at_odd_offsets([torch.randn(64, 32)])
  m, v = torch.zeros(64, 32), torch.zeros(64, 32)
  stats = forge_torch.bridge_stats
  stats.reset()
  assert not _bridge.fused_update(x, dy, w, [m, v], torch.zeros(16),
                                  rule=pk.ADAMW)
  assert (stats.direct, stats.in_place, stats.copied) == (1, 2, 1), stats
  [(_, ptrs)] = kernel.launches
  assert not any(p % 16 for p in ptrs), ptrs


def test_quantized_moments_at_odd_offsets_are_staged():
  """int8 moments whose codes and scales are views at odd offsets into a
  flat buffer (restored so, say) are staged too: every kernel call gets
  aligned operands, and the steps equal those of the same model whose
  state stays where the optimizer put it, bit for bit."""
  from forge_torch import _bridge  # noqa: PLC0415
  torch.manual_seed(0)
  base = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Tanh(),
                       nn.Linear(128, 64, bias=False))
  models = [copy.deepcopy(base) for _ in range(2)]
  opts = []
  for m in models:
    forge_torch.convert(m)
    opts.append(forge_torch.AdamW(m.parameters(), lr=1e-2, moments="int8"))
  seen = []
  inner = _bridge._update_on_device

  def recording(x, dy, w, slots, *args):
    seen.append([t.data_ptr() % 16 for t in
                 (x, dy, w, *_bridge._flat_slots(slots))])
    return inner(x, dy, w, slots, *args)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(_bridge, "_update_on_device", recording)
    for step in range(3):
      x = torch.randn(32, 64)
      for m, o in zip(models, opts):
        m(x).float().square().mean().backward()
        o.step()
        o.zero_grad()
      if step == 0:
        st = [opts[1].state[p] for p in models[1].parameters()]
        keys = [k for k in st[0] if k != "step"]
        assert {"exp_avg", "exp_avg_scale"} <= set(keys), keys
        views, _, _ = _rebind_at_odd_offsets(
            [s[k] for s in st for k in keys if s[k].dtype == torch.int8])
        views += _rebind_at_odd_offsets(
            [s[k] for s in st for k in keys if s[k].dtype != torch.int8])[0]
        it = iter(views)
        for dtype_int8 in (True, False):
          for s in st:
            for k in keys:
              if (s[k].dtype == torch.int8) == dtype_int8:
                s[k] = next(it)
        seen.clear()
  # Two steps after the rebinding, two layers, two models.
  assert len(seen) == 2 * 2 * 2 and all(not any(a) for a in seen), seen
  kept = {v.data_ptr() for v in views}
  assert all(s[k].data_ptr() in kept for s in st for k in keys)
  for p, q in zip(models[0].parameters(), models[1].parameters()):
    assert torch.equal(p, q)
    for k, v in opts[0].state[p].items():
      assert torch.equal(v, opts[1].state[q][k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_operands_at_odd_offsets_launch_directly():
  """As above on the GPU, in bfloat16: each update stages its misaligned
  operands and launches directly (Hopper), never faulting."""
  stats = forge_torch.bridge_stats
  stats.reset()
  err, untouched, seen = _odd_offset_parity("cuda", torch.bfloat16)
  assert len(seen) == 2 * 4 and all(not any(a) for a in seen), seen
  assert err <= tol(jnp.bfloat16), err
  assert untouched
  # The weights staged at every step, the moments from the second on.
  assert stats.in_place + stats.copied == 3 * stats.calls, stats
  assert stats.copied == 2 * 1 + 2 * 3 * 3, stats
  if torch.cuda.get_device_capability() >= (9, 0):
    assert stats.direct == stats.calls == 2 * 4, stats


class _FakeRing:
  """Stands in for the pinned hyperparameter ring: one address."""

  def get(self, vec, fixed=False):
    return 4096


def test_the_hyperparameter_ring_serves_fixed_vectors_from_live_rows(
    monkeypatch):
  """An update plan's packed vector (``fixed``: never written) is served
  again from the row it went to without a lookup -- but only while that
  row still holds it: once the ring has wrapped past the row, the vector
  is installed again, never read from a row rewritten with another one.
  Every address served holds the vector asked for. (Pinned memory and
  CUDA events stood in for on the CPU.)"""
  from forge_torch import _bridge  # noqa: PLC0415
  empty = torch.empty

  class Event:
    def record(self, stream):
      del stream

    def synchronize(self):
      pass

  monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k:
                      empty(*a, **k))
  monkeypatch.setattr(torch.cuda, "Event", Event)
  ring = _bridge._HparamsRing(torch.device("cpu"), 3, stream=None)
  row = {ptr: i for i, ptr in enumerate(ring.ptrs)}

  def held(ptr):
    return ring.host_np[row[ptr]]

  def vector(i):
    vec = np.full(3, i, np.float32)
    vec.flags.writeable = False
    return vec

  fixed = vector(-1)
  first = ring.get(fixed, fixed=True)
  assert ring.get(fixed, fixed=True) == first
  np.testing.assert_array_equal(held(first), fixed)
  for i in range(ring.SIZE):  # every row rewritten, the fixed one's too
    np.testing.assert_array_equal(held(ring.get(vector(i))), vector(i))
  again = ring.get(fixed, fixed=True)
  np.testing.assert_array_equal(held(again), fixed)
  assert np.array_equal(held(ring.get(fixed, fixed=True)), fixed)


def test_a_plan_repeats_a_direct_launch_only_for_the_same_call(monkeypatch):
  """``relaunch`` (an update plan's launch) launches the resolved kernel
  again only where the call would resolve to it now: the same operand
  shapes, dtypes and layouts, rule and tiling, on the same stream and
  current device, outside capture, with direct launches on; else it does
  nothing and says so. (The launch machinery stood in for on the CPU.)"""
  from forge_torch import _bridge, _direct  # noqa: PLC0415
  import pallas_kernels as pk  # noqa: PLC0415
  now = dict(off=None, stream=7, device=-1, capturing=False)
  monkeypatch.setattr(_direct, "unavailable", lambda: now["off"])
  monkeypatch.setattr(_bridge, "_raw_stream", lambda index: now["stream"])
  monkeypatch.setattr(_bridge, "_current_device", lambda: now["device"])
  monkeypatch.setattr(_bridge, "_stream_capturing",
                      lambda: now["capturing"])
  monkeypatch.setattr(_bridge, "_LAUNCHES", {})
  kernel = _RecordingKernel()

  def resolve(x2, dy2, w, slots, n_hparams, rule, config, device_index,
              stream):
    launch = _bridge._Launch(kernel, 1 + len(slots),
                             (device_index, stream, n_hparams))
    launch.ring = _FakeRing()
    return launch

  monkeypatch.setattr(_bridge, "_resolve", resolve)
  x, dy = torch.randn(8, 6), torch.randn(8, 4)
  w, m, v = (torch.randn(6, 4) for _ in range(3))
  vec = np.zeros(16, np.float32)
  assert _bridge._direct_update(x, dy, w, [m, v], vec, pk.ADAMW, None)
  [launch] = _bridge._LAUNCHES.values()
  calls = _bridge.STATS.calls

  def again(x=x, dy=dy, w=w, slots=(m, v), rule=pk.ADAMW, config=None):
    n = len(kernel.launches)
    done = _bridge.relaunch(launch, x, dy, w, list(slots), vec, rule, config)
    assert len(kernel.launches) == n + done
    return done

  assert again()
  assert kernel.launches[-1] == (7, [x.data_ptr(), dy.data_ptr(), 4096,
                                     w.data_ptr(), m.data_ptr(),
                                     v.data_ptr()])
  assert _bridge.STATS.calls == calls + 1
  xt = torch.randn(6, 8).t()  # any strides of x: made contiguous
  assert again(x=xt)
  assert kernel.launches[-1][1][0] != xt.data_ptr()
  assert not again(x=x[:4], dy=dy[:4])
  # A layer's (..., n) operands, taken as (rows, n) with no reshape: the
  # same launch where the rows are the same, at their own pointers.
  x3, dy3 = x.reshape(2, 4, 6).clone(), dy.reshape(4, 1, 2, 4).clone()
  assert again(x=x3, dy=dy3)
  assert kernel.launches[-1][1][:2] == [x3.data_ptr(), dy3.data_ptr()]
  assert not again(x=x3[:1], dy=dy3[:2])
  assert again(x=torch.randn(2, 2, 2, 6), dy=dy3)  # (any leading dims)
  assert not again(x=torch.randn(3, 2, 6), dy=dy3)
  assert not again(x=torch.randn(8, 0), dy=dy)
  assert not again(w=torch.randn(4, 6).t())
  assert not again(slots=(m, v.bfloat16()))
  assert not again(slots=(m,))
  assert not again(rule=pk.lion_rule())
  assert not again(config=pk.BlockConfig(32, 32, 32))
  usual = dict(now)
  for name, value in (("stream", 8), ("device", 0), ("capturing", True),
                      ("off", "turned off")):
    now[name] = value
    assert not again(), name
    now.update(usual)
  assert again()


@pytest.fixture
def direct_on_cpu(monkeypatch):
  """CPU tensors take the direct launch's path, the compiled kernel stood
  in for by one that records its launches (and updates nothing): returns
  it and the strides of the weight and slots of each launch resolved."""
  from forge_torch import _bridge, _direct  # noqa: PLC0415
  kernel, resolved = _RecordingKernel(), []
  monkeypatch.setattr(_direct, "unavailable", lambda: None)
  monkeypatch.setattr(_bridge, "_raw_stream", lambda index: 7)
  monkeypatch.setattr(_bridge, "_current_device", lambda: -1)
  monkeypatch.setattr(_bridge, "_stream_capturing", lambda: False)
  monkeypatch.setattr(_bridge, "_LAUNCHES", {})

  def resolve(x2, dy2, w, slots, n_hparams, rule, config, device_index,
              stream):
    resolved.append([t.stride() for t in (w, *slots)])
    launch = _bridge._Launch(kernel, 1 + len(slots),
                             (device_index, stream, n_hparams))
    launch.ring = _FakeRing()
    return launch

  def fused_update(x, dy, w, slots, hparams, rule, config, views,
                   stochastic_rounding=None):
    assert _bridge._direct_update(x, dy, w, slots, hparams, rule, config,
                                  stochastic_rounding)
    return True

  def resolved_launch(x2, dy2, w, slots, n_hparams, rule, config):
    return _bridge._LAUNCHES.get(_bridge._launch_key(
        x2, dy2, w, slots, -1, 7, n_hparams, rule, config)) or None

  monkeypatch.setattr(_bridge, "_resolve", resolve)
  monkeypatch.setattr(_bridge, "_fused_update", fused_update)
  monkeypatch.setattr(_bridge, "resolved_launch", resolved_launch)
  return kernel, resolved


def test_a_plan_launches_only_the_state_laid_out_as_its_key_says(
    monkeypatch, direct_on_cpu):
  """An update plan's direct launch (``relaunch``) takes the weight and
  slots wherever they are now, laid out as its key says (moved by
  ``.data =`` to other memory of the same layout: launched there); one laid
  out anew, at other memory or its own (transposed, in place; a view in
  another dtype), is refused before any launch, and the full path says
  why."""
  from forge_torch import _bridge  # noqa: PLC0415
  kernel, resolved = direct_on_cpu
  ran = []
  real = _bridge.relaunch

  def counted(*args):
    ran.append(real(*args))
    return ran[-1]

  monkeypatch.setattr(_bridge, "relaunch", counted)
  changes = (  # (the change, whether in place, what the full path says)
      (lambda m: setattr(m, "data", torch.zeros(
          8, 8, dtype=torch.bfloat16).t()), False, ValueError, "contiguous"),
      (lambda m: m.t_(), True, ValueError, "contiguous"),
      (lambda m: setattr(m, "data", m.data.view(torch.float16)), True,
       RuntimeError, "float16"))
  for change, in_place, error, match in changes:
    layer = forge_torch.Linear(8, 8, bias=False).bfloat16()
    opt = forge_torch.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(8, 8, dtype=torch.bfloat16)

    def step():
      n = len(kernel.launches)
      layer(x).float().square().mean().backward()
      opt.step()
      w = layer.weight
      st = opt.state[w]
      assert kernel.launches[n:] == [(7, [
          kernel.launches[-1][1][0], x.data_ptr(), 4096, w.data_ptr(),
          st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr()])]

    for _ in range(3):  # the full path, then the plan's launch
      step()
    assert ran[-1] is True
    m = opt.state[layer.weight]["exp_avg"]
    m.data = m.data.clone()  # moved, laid out as before
    layer.weight.data = layer.weight.data.clone()
    step()
    assert ran[-1] is True
    n, ptr = len(kernel.launches), m.data_ptr()
    change(m)
    assert (m.data_ptr() == ptr) == in_place
    with pytest.raises(error, match=match):
      layer(x).float().square().mean().backward()
    assert ran[-1] is False and len(kernel.launches) == n
  assert resolved == [[(8, 1)] * 3]


def test_direct_launch_is_resolved_only_for_dense_weight_and_slots():
  """The compiled kernel reads the weight and the slots by pointer as dense
  arrays of the weight's shape on its device: any other layout resolves to
  the DLPack path (None) before a kernel is looked for. x and dy may have
  any strides (they are made contiguous before a launch)."""
  from forge_torch import _bridge  # noqa: PLC0415
  import pallas_kernels as pk  # noqa: PLC0415
  x, dy = torch.randn(8, 6), torch.randn(8, 4)
  w, m = torch.randn(6, 4), torch.randn(6, 4)
  wt = torch.randn(4, 6).t()
  cpu = w.get_device()
  ok = functools.partial(_bridge._direct_layout_ok, device_index=cpu)
  assert ok(x, dy, w, [m, m])
  assert ok(torch.randn(6, 8).t(), dy, w, [m])  # any strides of x
  assert not ok(x, dy, wt, [m])
  assert not ok(x, dy, w, [wt])
  assert not ok(x, dy, w, [torch.randn(4, 6)])
  assert not ok(x, dy, w, [torch.randn(24)])
  assert not ok(x, dy[:4], w, [m])
  assert not ok(x, dy.bfloat16(), w, [m])
  assert not ok(x[:0], dy[:0], w, [m])
  assert not _bridge._direct_layout_ok(x, dy, w, [m], device_index=0)
  for slots, weight in (([m], wt), ([wt], w)):
    assert _bridge._resolve(x, dy, weight, slots, 16, pk.ADAMW, None, cpu,
                            7) is None


def _direct_case(seed, bt=512, n_in=384, n_out=256, state=torch.bfloat16):
  """x, dy (bf16, (BT, in), (BT, out)) and w, m, v (in, out) on CUDA."""
  g = torch.Generator(device="cuda").manual_seed(seed)
  x = torch.randn(bt, n_in, device="cuda", generator=g).bfloat16()
  dy = torch.randn(bt, n_out, device="cuda", generator=g).bfloat16()
  w = (0.05 * torch.randn(n_in, n_out, device="cuda", generator=g)).to(state)
  m = (1e-3 * torch.randn(n_in, n_out, device="cuda", generator=g)).to(state)
  v = (1e-5 * torch.rand(n_in, n_out, device="cuda", generator=g)).to(state)
  return x, dy, w, m, v


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
@pytest.mark.parametrize("state,shape", [
    (torch.bfloat16, (512, 384, 256)), (torch.float32, (512, 384, 256)),
    # BT not a multiple of the 64-row K step, out not of the tile: the
    # tiles reach past the tensors' edges.
    (torch.bfloat16, (1000, 1088, 1216))], ids=["bf16", "fp32", "ragged"])
def test_gpu_direct_launch_matches_the_jax_call(state, shape):
  """The direct launch writes the torch tensors in place (same pointers) with
  the bits of the same Mosaic GPU kernel called through JAX (DLPack path,
  the same tiling), and matches torch.optim.AdamW."""
  from forge_torch import _bridge, _direct
  from pallas_kernels import torch_rules as _rules
  h = _rules.adamw_hparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=1e-2, step=3)
  bt, n_in, n_out = shape
  x, dy, w0, m0, v0 = _direct_case(0, bt, n_in, n_out, state=state)
  stats = forge_torch.bridge_stats
  w, m, v = w0.clone(), m0.clone(), v0.clone()
  ptrs = [t.data_ptr() for t in (w, m, v)]
  stats.reset()
  assert _bridge.fused_update(x, dy, w, (m, v), h)
  assert stats.direct == 1 and stats.in_place == 3, (
      stats, stats.direct_unavailable)
  assert [t.data_ptr() for t in (w, m, v)] == ptrs
  assert not torch.equal(w, w0)
  # The tiling it launched (the cache key: the case, then the tiling).
  cfg = next(k[1] for k in _direct._KERNELS
             if k[0][1:6] == (bt, n_in, n_out, torch.bfloat16, state))
  with direct_launch(False):
    w2, m2, v2 = w0.clone(), m0.clone(), v0.clone()
    _bridge.fused_update(x, dy, w2, (m2, v2), h, config=cfg)
  torch.cuda.synchronize()
  for name, a, b in (("w", w, w2), ("exp_avg", m, m2), ("exp_avg_sq", v, v2)):
    assert torch.equal(a, b), name
  # torch's own AdamW on G = x^T dy.
  p = nn.Parameter(w0.clone())
  opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=1e-2)
  p.grad = (x.float().T @ dy.float()).to(state)
  opt.step()
  st = opt.state[p]
  with torch.no_grad():
    p.copy_(w0)
    st["exp_avg"].copy_(m0)
    st["exp_avg_sq"].copy_(v0)
    st["step"].fill_(2)
  opt.step()
  bar = tol(jnp.float32 if state == torch.float32 else jnp.bfloat16)
  # (fp32 state: G is accumulated in fp32 by the kernel, rounded to
  # fp32 by torch's reference: both from the same bf16 products.)
  assert rel(w, p) <= bar and rel(m, st["exp_avg"]) <= bar
  assert rel(v, st["exp_avg_sq"]) <= bar


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_direct_launch_hyperparameter_ring_wraps():
  """The kernel reads its hyperparameters from the ring's pinned host rows:
  with the GPU held busy so the host runs far ahead, more new vectors than
  the ring has rows (each row rewritten only after the launches that read
  it), and earlier vectors served again from their rows, every step equals
  the same kernel called through DLPack with the same vectors."""
  from forge_torch import _bridge, _direct
  from pallas_kernels import torch_rules as _rules
  new = [_rules.adamw_hparams(lr=1e-3 * (1 + 0.01 * i), beta1=0.9,
                              beta2=0.999, eps=1e-8, weight_decay=1e-2,
                              step=1 + i)
         for i in range(_bridge._HparamsRing.SIZE + 6)]
  hs = []
  for i, h in enumerate(new):
    hs += [h, new[i - 2]] if i % 10 == 3 else [h]  # a recent one again
  steps = len(hs)
  x, dy, w0, m0, v0 = _direct_case(5, bt=128, n_in=256, n_out=384)
  stats = forge_torch.bridge_stats
  w, m, v = w0.clone(), m0.clone(), v0.clone()
  stats.reset()
  torch.cuda.synchronize()
  torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued first
  for h in hs:
    assert _bridge.fused_update(x, dy, w, (m, v), h)
  assert stats.direct == steps, (stats, stats.direct_unavailable)
  cfg = next(k[1] for k in _direct._KERNELS
             if k[0][1:4] == (128, 256, 384))
  with direct_launch(False):
    w2, m2, v2 = w0.clone(), m0.clone(), v0.clone()
    for h in hs:
      _bridge.fused_update(x, dy, w2, (m2, v2), h, config=cfg)
  torch.cuda.synchronize()
  for name, a, b in (("w", w, w2), ("exp_avg", m, m2), ("exp_avg_sq", v, v2)):
    assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
@pytest.mark.parametrize("side_stream", [False, True],
                         ids=["current-stream", "side-stream"])
def test_gpu_direct_launch_race_detector(side_stream):
  """The direct launch runs on torch's current stream, in order: a busy
  stream ahead of the producers of x/dy and of a GEMM reading the
  pre-update W, and x/dy trashed right after the call, give the bits of a
  quiet call (the kernel is deterministic)."""
  from forge_torch import _bridge
  from pallas_kernels import torch_rules as _rules
  h = _rules.adamw_hparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=1e-2, step=3)
  stats = forge_torch.bridge_stats
  stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
  for rep in range(3):
    x_true, dy_true, w0, m0, v0 = _direct_case(10 + rep, bt=2048, n_in=1024,
                                               n_out=512)
    gi_ref = dy_true.float() @ w0.float().T
    ref = [t.clone() for t in (w0, m0, v0)]
    torch.cuda.synchronize()
    _bridge.fused_update(x_true, dy_true, ref[0], ref[1:], h)
    torch.cuda.synchronize()
    w, m, v = w0.clone(), m0.clone(), v0.clone()
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    stats.reset()
    with torch.cuda.stream(stream):
      if side_stream:
        stream.wait_stream(torch.cuda.default_stream())
      big = _busy(big, 30)
      z = (0.0 * big[0, 0]).bfloat16()
      x, dy = x_true + z, dy_true + z
      gi = dy.float() @ w.float().T  # must read the pre-update w
      _bridge.fused_update(x, dy, w, (m, v), h)
      x.fill_(float("nan"))
      dy.mul_(-3.0)
      del x, dy
      trash = [torch.full_like(x_true, 7.0), torch.full_like(dy_true, -7.0)]
      got = [t.clone() for t in (w, m, v)]
    torch.cuda.synchronize()
    del trash
    assert stats.direct == 1, (stats, stats.direct_unavailable)
    assert rel(gi, gi_ref) <= tol(jnp.float32), (
        f"rep {rep}: the GEMM queued before the fused update saw the new W")
    for name, a, b in zip(("w", "exp_avg", "exp_avg_sq"), got, ref):
      assert torch.equal(a, b), f"rep {rep}: {name}: a stream-ordering race"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_fused_update_refuses_graph_capture():
  from forge_torch import _bridge
  from pallas_kernels import torch_rules as _rules
  h = _rules.adamw_hparams(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=1e-2, step=1)
  x, dy, w, m, v = _direct_case(3)
  _bridge.fused_update(x, dy, w, (m, v), h)  # compiled outside the capture
  w0 = w.clone()
  s = torch.cuda.Stream()
  s.wait_stream(torch.cuda.current_stream())
  # A host vector would be read as it was at capture, at every replay.
  with pytest.raises(RuntimeError, match="CUDA-graph capture needs its "
                     "hyperparameters as a CUDA tensor"):
    with torch.cuda.stream(s), torch.cuda.graph(torch.cuda.CUDAGraph()):
      _bridge.fused_update(x, dy, w, (m, v), h)
  torch.cuda.synchronize()
  assert torch.equal(w, w0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_autocast_training_launches_directly():
  """fp32 layers under torch.autocast(bfloat16): bf16 x/dy beside fp32
  state, launched directly; the same as nn.Linear + torch AdamW under the
  same autocast within bf16's tolerance."""
  torch.manual_seed(0)
  ref = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 128)
                      ).cuda()
  fm = copy.deepcopy(ref)
  forge_torch.convert(fm)
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-3)
  stats = forge_torch.bridge_stats
  stats.reset()
  g = torch.Generator(device="cuda").manual_seed(1)
  for _ in range(4):
    x = torch.randn(512, 256, device="cuda", generator=g)
    for model, opt in ((ref, o_ref), (fm, o_f)):
      with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
      loss.backward()
      opt.step()
      opt.zero_grad()
  torch.cuda.synchronize()
  assert stats.calls == 8 and stats.direct == 8, (stats,
                                                  stats.direct_unavailable)
  for (name, a), b in zip(fm.named_parameters(), ref.parameters()):
    assert rel(a, b) <= tol(jnp.bfloat16), name


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
@pytest.mark.parametrize("side_stream", [False, True], ids=["default",
                                                            "side-stream"])
@pytest.mark.parametrize("shape", [(512, 256), (4, 128, 256)],
                         ids=["2d", "3d"])
@pytest.mark.parametrize("path", ["python", "native"])
def test_gpu_update_plans_relaunch_bit_for_bit(monkeypatch, side_stream,
                                               shape, path):
  """From each weight's third update on, its plan launches the compiled
  kernel again on torch's current stream -- in Python
  (``_bridge.relaunch``), or, on the native host path, in C++ for every
  update but the param group's first of each step (``forge_torch._hot``,
  built here if it was not) -- with the same bits as the full path (plans
  turned off), weights and AdamW state (fused=True: the step counts on the
  GPU, advanced at each step's end), on the default stream and on a side
  stream, with 2-d inputs and 3-d ones (taken by rows, not reshaped, where
  a plan repeats)."""
  from forge_torch import _bridge, _hot
  cls = forge_torch.optim._ForgeOptimizer
  run_plan, real_relaunch = cls._forge_run_plan, _bridge.relaunch
  native = None
  if path == "native":
    with _hot.using(True) as on:
      assert on, _hot.unavailable()
      native = _hot.run_plan

  def train(plans):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.GELU(),
                          nn.Linear(512, 128, bias=False)).cuda().bfloat16()
    forge_torch.convert(model)
    opt = forge_torch.AdamW(model.parameters(), lr=1e-3, fused=True)
    relaunched = []

    def relaunch(*args):
      relaunched.append(real_relaunch(*args))
      return relaunched[-1]

    monkeypatch.setattr(cls, "_forge_run_plan", run_plan if plans else (
        lambda *a: False))
    # (Off, the first kernel's build does not turn it on.)
    monkeypatch.setattr(_hot, "run_plan", native if plans else None)
    monkeypatch.setattr(_hot, "_OFF", None if native and plans else "off")
    stats = forge_torch.bridge_stats
    stats.reset()
    g = torch.Generator(device="cuda").manual_seed(1)
    stream = torch.cuda.Stream() if side_stream else (
        torch.cuda.current_stream())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), monkeypatch.context() as m:
      m.setattr(_bridge, "relaunch", relaunch)
      for _ in range(6):
        x = torch.randn(*shape, device="cuda", generator=g).bfloat16()
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    assert stats.calls == 12 and stats.direct == 12, (
        stats, stats.direct_unavailable)
    return model, opt, relaunched, stats.native

  planned, full = train(True), train(False)
  monkeypatch.setattr(cls, "_forge_run_plan", run_plan)
  # Steps 3 to 6 repeat both layers' plans; natively, all but the step's
  # first update (the last layer's: it forms the group's scalars).
  assert full[2:] == ([], 0)
  assert planned[2:] == (([True] * 8, 0) if native is None
                         else ([True] * 4, 4))
  for (name, a), b in zip(planned[0].named_parameters(),
                          full[0].parameters()):
    assert torch.equal(a, b), name
    sa, sb = planned[1].state[a], full[1].state[b]
    for k in ("step", "exp_avg", "exp_avg_sq"):
      assert torch.equal(sa[k], sb[k]), (name, k)
