"""forge_torch (Linear + AdamW through the DLPack bridge) against torch and forge_jax."""

import copy
import gc
import io

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
from tests.tolerances import tol  # noqa: E402

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


def test_no_grad_forwards_are_not_counted():
  model = forge_copy(make_mlp())
  opt = forge_torch.AdamW(model.parameters())
  x, y = batches(1)[0]
  with torch.no_grad():
    model(x)
    model(x)
  model.eval()
  with torch.inference_mode():
    model(x)
  model.train()
  F.mse_loss(model(x), y).backward()
  opt.step()


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
  assert loss_err <= 1e-4, loss_err
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


# --- misuse ---------------------------------------------------------------------


# amsgrad and maximize are supported (fused exactly); their parity with torch
# is tested in tests/test_torch_families.py.
@pytest.mark.parametrize("kwargs", [dict(capturable=True),
                                    dict(differentiable=True)])
def test_unsupported_options_raise(kwargs):
  layer = forge_torch.Linear(4, 3)
  with pytest.raises(ValueError, match="does not support"):
    forge_torch.AdamW(layer.parameters(), **kwargs)
  opt = forge_torch.AdamW([layer.bias])
  with pytest.raises(ValueError, match="does not support"):
    opt.add_param_group({"params": [layer.weight], **kwargs})


def _layer_and_opt(**kw):
  torch.manual_seed(0)
  layer = forge_torch.Linear(6, 4, **kw)
  return layer, forge_torch.AdamW(layer.parameters())


def test_layer_used_twice_before_step_raises():
  layer, _ = _layer_and_opt()
  x = torch.randn(3, 6)
  layer(x)
  with pytest.raises(RuntimeError, match="second time before optimizer.step"):
    layer(x)


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


def test_second_backward_through_one_graph_raises():
  layer, _ = _layer_and_opt()
  out = layer(torch.randn(3, 6)).sum()
  out.backward(retain_graph=True)
  with pytest.raises(RuntimeError, match="backward ran twice"):
    out.backward()


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
  with pytest.raises(TypeError, match="input dtype"):
    layer(torch.randn(3, 6, dtype=torch.bfloat16))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_cuda_input_on_cpu_weight_raises():
  layer, _ = _layer_and_opt()
  with pytest.raises(RuntimeError, match="input is on cuda"):
    layer(torch.randn(3, 6, device="cuda"))


def test_autocast_raises():
  layer, _ = _layer_and_opt()
  with torch.autocast("cpu", dtype=torch.bfloat16):
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
  assert torch.allclose((layer.weight - w0).abs(), torch.full_like(w0, 0.1),
                        rtol=1e-4)


def test_newest_optimizer_owns_the_weight():
  layer, old = _layer_and_opt()
  new = forge_torch.AdamW(layer.parameters(), lr=0.5)
  layer(torch.randn(3, 6)).sum().backward()
  new.step()
  assert layer.weight in new.state and len(old.state) == 0
  assert old.managed_params == []


# --- GPU (H200): zero copy, streams, parity on CUDA --------------------------------


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
  # Memory safety of the aliasing: after dropping every JAX reference and
  # allocating on both sides, the torch tensors still hold their values.
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
