"""forge_torch's optimizer families against their torch.optim counterparts.

Every family (SGD, Adagrad, RMSprop, Adam, AdamW, Adamax, NAdam, RAdam) and its
main options: a small fp32 MLP (odd widths 37->70->130->5, batch 48) trained 20
steps with forge_torch.Linear + forge_torch.<Family> and with nn.Linear +
torch.optim.<Family> from the same init, data and LR schedule; every parameter
and every state tensor must agree to the fp32 bar. Plus constructor
signatures, state_dict interchange with the torch optimizer, and the refused
options.
"""

import copy
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import forge_torch  # noqa: E402
from forge_torch import optim as forge_optim  # noqa: E402
from pallas_kernels import families  # noqa: E402
from pallas_kernels import torch_rules as _rules  # noqa: E402
from tests.test_torch_bridge import (  # noqa: E402
    batches, forge_copy, make_mlp, train)
from tests.tolerances import assert_close, rel_err, tol  # noqa: E402

FP32_TOL = tol(jnp.float32)
CUDA = torch.cuda.is_available()
FAMILIES = ("SGD", "Adagrad", "RMSprop", "Adam", "AdamW", "Adamax", "NAdam",
            "RAdam")


def test_the_optimizers_are_the_registrys_torch_families():
  """forge_torch has an optimizer for each registered family with a torch
  rule, named as the registry names its torch.optim class, and each takes
  its rules from that family (the registry is the one list of families)."""
  torch_names = {f.torch for f in families.REGISTRY.values()
                 if f.torch is not None}
  assert torch_names == set(FAMILIES)
  assert all(f.torch_factory is not None for f in families.REGISTRY.values()
             if f.torch is not None)
  for family in FAMILIES:
    cls = getattr(forge_torch, family)
    assert issubclass(cls, getattr(torch.optim, family))
    opt = cls(forge_torch.Linear(4, 3).parameters())
    entries = [f for f in families.REGISTRY.values() if f.torch == family]
    assert opt._forge_rule(opt.param_groups[0]) in [
        f.torch_rule(**options) for f in entries
        for options in _default_options(f.name)], family


def _default_options(family: str) -> list[dict]:
  """The options forge_torch's optimizers pass at torch's defaults."""
  return {"sgd": [dict(nesterov=False)],
          "sgd_momentum": [dict(nesterov=False)],
          "rmsprop": [dict(centered=False, momentum=False)],
          "adam": [dict(amsgrad=False, cuda_fused=False)],
          "adamw": [dict(amsgrad=False, cuda_fused=False)]}.get(family, [{}])


def _has_option(family: str, option: str) -> bool:
  return option in inspect.signature(getattr(torch.optim, family)).parameters


def _case(id_, family, kwargs, split=False, sched="lambda"):
  marks = [pytest.mark.skipif(not _has_option(family, k),
                              reason=f"torch.optim.{family} has no {k}")
           for k in kwargs]
  return pytest.param(family, kwargs, split, sched, id=id_, marks=marks)


WD = 1e-2
CASES = [
    _case("sgd", "SGD", dict(lr=0.05)),
    _case("sgd-momentum-dampening-wd", "SGD",
          dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=WD),
          split=True, sched="cosine"),
    _case("sgd-nesterov-wd-maximize", "SGD",
          dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=WD,
               maximize=True)),
    _case("sgd-momentum-foreach", "SGD",
          dict(lr=0.05, momentum=0.8, foreach=True)),
    _case("adagrad", "Adagrad",
          dict(lr=0.05, lr_decay=1e-2, weight_decay=WD,
               initial_accumulator_value=0.1), split=True),
    _case("rmsprop-wd", "RMSprop", dict(lr=1e-3, weight_decay=WD)),
    _case("rmsprop-centered", "RMSprop", dict(lr=1e-3, centered=True)),
    _case("rmsprop-momentum", "RMSprop", dict(lr=1e-3, momentum=0.9),
          split=True, sched="cosine"),
    _case("rmsprop-centered-momentum-maximize", "RMSprop",
          dict(lr=1e-3, alpha=0.9, centered=True, momentum=0.5,
               weight_decay=WD, maximize=True)),
    _case("adam-wd", "Adam", dict(lr=1e-2, weight_decay=WD), split=True),
    _case("adam-amsgrad-maximize", "Adam",
          dict(lr=1e-2, amsgrad=True, maximize=True)),
    _case("adam-decoupled", "Adam",
          dict(lr=1e-2, weight_decay=WD, decoupled_weight_decay=True)),
    # fused=True: on CUDA, torch's fused kernel and forge's cuda_fused rule;
    # on CPU, torch's CPU fused kernel (the for-loop arithmetic).
    _case("adam-fused", "Adam", dict(lr=1e-2, weight_decay=WD, fused=True)),
    _case("adamw-fused-amsgrad-maximize", "AdamW",
          dict(lr=1e-2, weight_decay=WD, amsgrad=True, maximize=True,
               fused=True), sched="cosine"),
    _case("adamw-amsgrad", "AdamW", dict(lr=1e-2, amsgrad=True),
          sched="cosine"),
    pytest.param("AdamW", dict(lr=1e-2, weight_decay=0.1), "coupled",
                 "lambda", id="adamw-group-coupled",
                 marks=pytest.mark.skipif(
                     not issubclass(torch.optim.AdamW, torch.optim.Adam),
                     reason="this torch's AdamW reads no "
                     "decoupled_weight_decay")),
    _case("adamax-wd", "Adamax", dict(lr=1e-2, weight_decay=WD), split=True),
    _case("nadam-wd", "NAdam", dict(lr=1e-2, weight_decay=WD)),
    _case("nadam-decoupled", "NAdam",
          dict(lr=1e-2, weight_decay=WD, decoupled_weight_decay=True,
               momentum_decay=8e-3), split=True, sched="cosine"),
    # Tensor betas: torch forms NAdam's mu in the tensor's dtype (float32),
    # and mu_product from it; forge_torch does the same. (The for-loop path:
    # torch 2.11's foreach NAdam, its CUDA default, refuses tensor betas.)
    _case("nadam-tensor-betas", "NAdam",
          dict(lr=1e-2, betas=(torch.tensor(0.8), torch.tensor(0.99)),
               foreach=False)),
    # Tensor betas in Adam, Adamax, RAdam: torch's for-loop step keeps them
    # tensors, so its bias corrections (RAdam: rho too) are float32 tensor
    # arithmetic (1 - 0.999**t loses digits there); forge_torch forms them
    # the same way.
    _case("adam-tensor-betas", "Adam",
          dict(lr=0.3, betas=(torch.tensor(0.9), torch.tensor(0.999)),
               foreach=False)),
    _case("adamax-tensor-betas", "Adamax",
          dict(lr=0.3, betas=(torch.tensor(0.9), torch.tensor(0.999)),
               foreach=False)),
    _case("radam-tensor-betas", "RAdam",
          dict(lr=0.3, betas=(torch.tensor(0.9), torch.tensor(0.999)),
               foreach=False)),
    _case("radam-wd", "RAdam", dict(lr=1e-2, weight_decay=WD)),
    _case("radam-decoupled", "RAdam",
          dict(lr=1e-2, weight_decay=WD, decoupled_weight_decay=True),
          split=True),
]

SCHEDULERS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: min(1.0, (s + 1) / 5) * 0.9**s),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
        o, T_max=20, eta_min=1e-4),
}


def groups(model, split, kwargs):
  ps = list(model.parameters())
  if not split:
    return ps
  if isinstance(split, dict):  # one group with these keys added
    return [{"params": ps, **split}]
  if split == "coupled":  # AdamW reads decoupled_weight_decay per group
    return [{"params": ps[:2]},
            {"params": ps[2:], "decoupled_weight_decay": False}]
  return [{"params": ps[:2]},
          {"params": ps[2:4], "lr": 2 * kwargs["lr"]},
          {"params": ps[4:], "weight_decay": 0.0}]


def np32(t) -> np.ndarray:
  return t.detach().cpu().float().numpy()


def run_family(family, kwargs, split=False, sched="lambda", device="cpu",
               steps=20):
  """Trains torch vs forge_torch; asserts parity; returns relative errors."""
  ref = make_mlp(device)
  fm = forge_copy(ref)
  init = copy.deepcopy(ref)
  o_ref = getattr(torch.optim, family)(groups(ref, split, kwargs), **kwargs)
  o_f = getattr(forge_torch, family)(groups(fm, split, kwargs), **kwargs)
  assert len(o_f.managed_params) == 3
  s_ref, s_f = SCHEDULERS[sched](o_ref), SCHEDULERS[sched](o_f)
  data = batches(steps, device)
  train(ref, o_ref, s_ref, data)
  calls = forge_torch.bridge_stats.calls
  train(fm, o_f, s_f, data)
  # Every managed weight took the fused path, every step.
  assert forge_torch.bridge_stats.calls - calls == 3 * steps
  errs = {}
  for (name, pf), pr, p0 in zip(fm.named_parameters(), ref.parameters(),
                                init.parameters()):
    assert rel_err(np32(pf), np32(p0)) > 1e-3, f"{name} did not move"
    errs[name] = rel_err(np32(pf), np32(pr))
    sf, sr = o_f.state.get(pf, {}), o_ref.state.get(pr, {})
    assert list(sf) == list(sr), f"{name}: state keys {list(sf)} != {list(sr)}"
    for k, vr in sr.items():
      vf = sf[k]
      assert (vf.dtype, vf.device, vf.shape) == (vr.dtype, vr.device, vr.shape)
      if vr.dim() == 0:  # step, mu_product: the same scalar ops as torch
        assert torch.equal(vf, vr), (name, k, vf, vr)
      else:
        errs[f"{name}.{k}"] = rel_err(np32(vf), np32(vr))
  for name, (pf, pr) in zip([n for n, _ in fm.named_parameters()],
                            zip(fm.parameters(), ref.parameters())):
    assert_close(np32(pf), np32(pr), FP32_TOL, what=f"{family} {name}")
    for k, vr in o_ref.state.get(pr, {}).items():
      if vr.dim():
        assert_close(np32(o_f.state[pf][k]), np32(vr), FP32_TOL,
                     what=f"{family} {name}.{k}")
  sd_f, sd_r = o_f.state_dict(), o_ref.state_dict()
  assert sd_f["param_groups"] == sd_r["param_groups"]
  assert sd_f["state"].keys() == sd_r["state"].keys()
  return errs


@pytest.mark.parametrize("family,kwargs,split,sched", CASES)
def test_fp32_parity_with_torch(family, kwargs, split, sched):
  errs = run_family(family, kwargs, split, sched)
  worst = max(errs, key=errs.get)
  print(f"{family} {kwargs}: worst relative error {errs[worst]:.3g} ({worst})")


# Every torch family's options, at values other than their defaults.
OTHER_OPTIONS = dict(
    momentum=0.5, dampening=0.5, nesterov=True, lr_decay=0.5,
    initial_accumulator_value=0.5, alpha=0.5, centered=True, amsgrad=True,
    betas=(0.5, 0.5), eps=0.5, momentum_decay=0.5, fused=True,
    capturable=True, decoupled_weight_decay=True, differentiable=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_groups_keys_the_family_does_not_define_are_ignored_as_torch_does(
    family):
  """A param group holding options of other families (a config shared
  between them: Adamax has no decoupled_weight_decay, RMSprop no fused,
  SGD no capturable): torch's family reads none of them, nor does
  forge_torch's -- it trains as torch's, with its state where torch keeps
  it, and none is refused."""
  defaults = getattr(torch.optim, family)(
      [torch.nn.Parameter(torch.zeros(1))]).defaults
  foreign = {k: v for k, v in OTHER_OPTIONS.items() if k not in defaults}
  assert foreign
  lr = 0.05 if family in ("SGD", "Adagrad") else 1e-2
  run_family(family, dict(lr=lr, weight_decay=WD), split=foreign)
  if "eps" not in defaults:  # a check of an option it has not: not made
    getattr(forge_torch, family)(
        [{"params": [torch.nn.Parameter(torch.zeros(2))], "eps": 1e-40}])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_count_is_on_the_weights_device_only_where_fused_is_an_option(
    family):
  """``fused=True`` in a group puts a new step count on the weight's
  device (torch's fused kernels read it there) in the families that have
  the option; the others keep it on the CPU, as torch does, whatever the
  group holds. (A ``meta`` weight stands in for a GPU one.)"""
  defaults = getattr(torch.optim, family)(
      [torch.nn.Parameter(torch.zeros(1))]).defaults
  opt = getattr(forge_torch, family)([torch.nn.Parameter(torch.zeros(3, 2))],
                                     lr=1e-3)
  p = torch.nn.Parameter(torch.zeros(3, 2, device="meta"))
  state = opt._forge_init_state(p, {**opt.param_groups[0], "fused": True,
                                    "momentum": 0.9})
  if "step" not in state:  # (SGD keeps none)
    return
  want = "meta" if "fused" in defaults else "cpu"
  assert state["step"].device.type == want, (family, state["step"].device)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_fp32_parity_all_families():
  """Every case on CUDA in one test (one process warm-up, shared compiles).

  torch defaults to its ``foreach`` implementations on CUDA, which reassociate
  a few scalar products; the bar is the same.
  """
  stats = forge_torch.bridge_stats
  stats.reset()
  failures, worst, absent = {}, {}, []
  for case in CASES:
    family, kwargs, split, sched = case.values
    if any(not _has_option(family, k) for k in kwargs):
      absent.append(case.id)  # this torch lacks the option (as on the CPU)
      continue
    try:
      errs = run_family(family, kwargs, split, sched, device="cuda")
      w = max(errs, key=errs.get)
      worst[case.id] = (errs[w], w)
    except AssertionError as e:
      failures[case.id] = str(e)
  for cid, (err, where) in worst.items():
    print(f"{cid}: worst relative error {err:.3g} ({where})")
  print("bridge:", stats, "; not in this torch:", absent)
  assert not failures, failures
  assert len(worst) == len(CASES) - len(absent) > 0
  assert stats.copied == 0, f"zero copy lost on some rule: {stats}"


# --- torch's CUDA fused Adam kernel ---------------------------------------------


def _ieee(fn, *xs):
  """One fp32 operation (or one fma): computed in fp64, rounded once to fp32.

  fp64 holds an fp32 product exactly and rounds a sum, quotient or square
  root of fp32 values so that the fp32 rounding after it is the correct one
  (53 >= 2 * 24 + 2); an fma can differ only in rare double-rounding ties.
  """
  return fn(*(x.double() for x in xs)).float()


class CudaFusedAdamEmulation(torch.optim.Optimizer):
  """torch's CUDA ``fused=True`` Adam/AdamW (torch >= 2.11) as IEEE fp32 ops.

  Runs on any device (the CPU tests use it as the reference for the
  cuda_fused rule; the GPU test checks it against torch's real kernel).

  Per element, as ``aten/src/ATen/native/cuda/fused_adam_utils.cuh``
  computes it (and its SASS in torch 2.14 shows): every hyperparameter cast
  to fp32 first; ``grad = -grad`` if maximize; Adam ``grad = fma(param, wd,
  grad)`` / AdamW ``param = fma(param, -(lr * wd), param)``;
  ``exp_avg = fma(b1, exp_avg, fma(-b1, grad, grad))``;
  ``exp_avg_sq = fma(b2, exp_avg_sq, fma(-b2, grad * grad, grad * grad))``;
  ``bc1 = 1 - powf(b1, t)``, ``bc2_sqrt = sqrtf(1 - powf(b2, t))``;
  ``denom = sqrt(v) / bc2_sqrt + eps`` (``v`` the amsgrad max if on);
  ``param -= (exp_avg * (lr / bc1)) / denom``.
  """

  def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8,
               weight_decay=0.0, amsgrad=False, maximize=False,
               decoupled=False):
    super().__init__(params, dict(lr=lr, betas=betas, eps=eps,
                                  weight_decay=weight_decay, amsgrad=amsgrad,
                                  maximize=maximize, decoupled=decoupled))

  @torch.no_grad()
  def step(self):
    for group in self.param_groups:
      for p in group["params"]:
        if p.grad is None:
          continue
        # fp32 scalars on p's device: torch.pow of two device tensors is the
        # device's powf, as in the kernel.
        f32 = lambda x: torch.tensor(x, dtype=torch.float32,  # noqa: E731
                                     device=p.device)
        b1, b2 = (f32(b) for b in group["betas"])
        lr, wd, eps = (f32(group[k]) for k in ("lr", "weight_decay", "eps"))
        st = self.state[p]
        if not st:
          st.update(step=f32(0.0), exp_avg=torch.zeros_like(p),
                    exp_avg_sq=torch.zeros_like(p))
          if group["amsgrad"]:
            st["max_exp_avg_sq"] = torch.zeros_like(p)
        st["step"] += 1
        w, g = p.detach().clone(), p.grad.clone()
        if group["maximize"]:
          g = -g
        if group["weight_decay"] != 0:
          if group["decoupled"]:
            lr_wd = _ieee(torch.mul, lr, wd)
            w = _ieee(lambda a, b: a - b * a, w, lr_wd)
          else:
            g = _ieee(lambda a, b, c: a * b + c, w, wd, g)
        m = _ieee(lambda b, m, i: b * m + i, b1, st["exp_avg"],
                  _ieee(lambda b, x: x - b * x, b1, g))
        gg = _ieee(torch.mul, g, g)
        v = _ieee(lambda b, v, i: b * v + i, b2, st["exp_avg_sq"],
                  _ieee(lambda b, x: x - b * x, b2, gg))
        bc1 = _ieee(lambda p: 1 - p, torch.pow(b1, st["step"]))
        bc2_sqrt = _ieee(lambda p: torch.sqrt(1 - p), torch.pow(b2, st["step"]))
        step_size = _ieee(torch.div, lr, bc1)
        if group["amsgrad"]:
          st["max_exp_avg_sq"] = torch.maximum(st["max_exp_avg_sq"], v)
          vv = st["max_exp_avg_sq"]
        else:
          vv = v
        denom = _ieee(torch.add, _ieee(torch.div, _ieee(torch.sqrt, vv),
                                       bc2_sqrt), eps)
        upd = _ieee(torch.div, _ieee(torch.mul, m, step_size), denom)
        p.copy_(_ieee(torch.sub, w, upd))
        st["exp_avg"], st["exp_avg_sq"] = m, v


@pytest.mark.parametrize("family", ["Adam", "AdamW"])
def test_cuda_fused_adam_picks_the_cuda_kernel_rule(family):
  """fused=True on a CUDA weight -> the cuda_fused rule; anything else -> the
  for-loop rule (torch's CPU fused kernel is the for-loop arithmetic)."""
  cls = getattr(forge_torch, family)
  cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
  for amsgrad in (False, True):
    fused = cls(forge_torch.Linear(4, 3).parameters(), fused=True,
                amsgrad=amsgrad)
    foreach = cls(forge_torch.Linear(4, 3).parameters(), foreach=True,
                  amsgrad=amsgrad)
    g, h = fused.param_groups[0], foreach.param_groups[0]
    assert fused._forge_rule(g, cuda) is _rules.adam_rule(
        amsgrad=amsgrad, cuda_fused=True)
    loop = _rules.adam_rule(amsgrad=amsgrad)
    assert fused._forge_rule(g, cpu) is loop
    assert fused._forge_rule(g) is loop
    assert foreach._forge_rule(h, cuda) is loop


EMULATED = [
    ("Adam", dict(lr=1e-2, weight_decay=WD)),
    ("AdamW", dict(lr=1e-2, weight_decay=WD, amsgrad=True, maximize=True))]


@pytest.mark.parametrize("family,kwargs", EMULATED)
def test_cuda_fused_rule_matches_the_cuda_kernel_arithmetic(family, kwargs,
                                                            monkeypatch):
  """The cuda_fused rule, forced on CPU, against the emulated CUDA kernel.

  And torch's for-loop/foreach arithmetic against the same emulation: it
  misses the fp32 bar in ``exp_avg_sq`` (torch's fused and foreach Adam
  differ by ~1.3e-5 there at beta2 = 0.999, which is what the H200 showed
  before the cuda_fused rule existed). Bias-free MLP: every parameter is
  managed, so the emulation is the whole reference.
  """
  monkeypatch.setattr(forge_optim, "_torch_cuda_fused",
                      lambda group, device: bool(group.get("fused")))
  ref = make_mlp(bias=False)
  fm, loop = forge_copy(ref), copy.deepcopy(ref)
  o_ref = CudaFusedAdamEmulation(ref.parameters(),
                                 decoupled=family == "AdamW", **kwargs)
  o_f = getattr(forge_torch, family)(fm.parameters(), fused=True, **kwargs)
  o_loop = getattr(torch.optim, family)(loop.parameters(), foreach=True,
                                        **kwargs)
  assert [r.name for r in map(
      lambda p: o_f._forge_rule(o_f.param_groups[0], p.device),
      o_f.managed_params)] == [_rules.adam_rule(
          amsgrad=bool(kwargs.get("amsgrad")), cuda_fused=True).name] * 3
  data = batches(20)
  for m, o in ((ref, o_ref), (fm, o_f), (loop, o_loop)):
    train(m, o, SCHEDULERS["lambda"](o), data)
  loop_err = 0.0
  for (name, pf), pr, pl in zip(fm.named_parameters(), ref.parameters(),
                                loop.parameters()):
    assert_close(np32(pf), np32(pr), FP32_TOL, what=f"{family} {name}")
    for k, vr in o_ref.state[pr].items():
      if vr.dim():
        assert_close(np32(o_f.state[pf][k]), np32(vr), FP32_TOL,
                     what=f"{family} {name}.{k}")
    loop_err = max(loop_err, rel_err(np32(o_loop.state[pl]["exp_avg_sq"]),
                                     np32(o_ref.state[pr]["exp_avg_sq"])))
  assert loop_err > FP32_TOL, loop_err


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
@pytest.mark.parametrize("family,kwargs", EMULATED)
def test_gpu_emulation_is_torch_cuda_fused_adam(family, kwargs):
  """Pins the arithmetic the cuda_fused rule reproduces to torch's real kernel.

  torch's CUDA ``fused=True`` step against ``CudaFusedAdamEmulation`` on the
  same device, model and data (the fp32 bar; expected a few ulps). Also
  measures torch's own ``foreach``-vs-fused gap in ``exp_avg_sq`` (~1.3e-5,
  beyond the bar), which is why fused=True needs its own rule.
  """
  ref = make_mlp("cuda", bias=False)
  emu, loop = copy.deepcopy(ref), copy.deepcopy(ref)
  cls = getattr(torch.optim, family)
  opts = [cls(ref.parameters(), fused=True, **kwargs),
          CudaFusedAdamEmulation(emu.parameters(),
                                 decoupled=family == "AdamW", **kwargs),
          cls(loop.parameters(), foreach=True, **kwargs)]
  data = batches(20, "cuda")
  for m, o in zip((ref, emu, loop), opts):
    train(m, o, SCHEDULERS["lambda"](o), data)
  worst, gap = 0.0, 0.0
  for (name, pr), pe, pl in zip(ref.named_parameters(), emu.parameters(),
                                loop.parameters()):
    worst = max(worst, rel_err(np32(pe), np32(pr)))
    assert_close(np32(pe), np32(pr), FP32_TOL, what=f"{family} {name}")
    for k, vr in opts[0].state[pr].items():
      if vr.dim():
        worst = max(worst, rel_err(np32(opts[1].state[pe][k]), np32(vr)))
        assert_close(np32(opts[1].state[pe][k]), np32(vr), FP32_TOL,
                     what=f"{family} {name}.{k}")
    gap = max(gap, rel_err(np32(opts[2].state[pl]["exp_avg_sq"]),
                           np32(opts[0].state[pr]["exp_avg_sq"])))
  print(f"{family}: emulation vs torch CUDA fused {worst:.3g}; torch foreach "
        f"vs fused exp_avg_sq {gap:.3g}")
  assert gap > FP32_TOL, gap


@pytest.mark.parametrize("family,kwargs", [
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    # NAdam at its default lr: its step-1 update is ~1.6 lr per coordinate and
    # sign-like where |g| is tiny, so bf16 G rounding moves it by O(lr) (at
    # lr=1e-2 torch's own foreach and single-tensor NAdam differ by 1e-2).
    ("NAdam", dict(lr=2e-3, weight_decay=WD, decoupled_weight_decay=True))])
def test_bfloat16_matches_torch(family, kwargs):
  """bf16 weights and state: torch rounds after every op, the kernel once."""
  ref = make_mlp(dtype=torch.bfloat16)
  fm = forge_copy(ref)
  o_ref = getattr(torch.optim, family)(ref.parameters(), **kwargs)
  o_f = getattr(forge_torch, family)(fm.parameters(), **kwargs)
  data = batches(3, dtype=torch.bfloat16)
  train(ref, o_ref, None, data)
  train(fm, o_f, None, data)
  for (name, pf), pr in zip(fm.named_parameters(), ref.parameters()):
    assert pf.dtype == torch.bfloat16
    assert_close(np32(pf), np32(pr), tol(jnp.bfloat16), what=name)
    for k, v in o_ref.state[pr].items():
      assert o_f.state[pf][k].dtype == v.dtype, k


# --- the constructor is torch's -------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_subclass_signature_and_defaults_match_torch(family):
  cls, base = getattr(forge_torch, family), getattr(torch.optim, family)
  assert issubclass(cls, base)
  # torch's constructor, plus the keyword-only max_grad_norm (clipping) and
  # the low-precision state options.
  sig = inspect.signature(cls)
  params = dict(sig.parameters)
  for name, default in (("max_grad_norm", None), ("restore_buffers", None),
                        ("moments", None), ("stochastic_rounding", False),
                        ("seed", None)):
    extra = params.pop(name)
    assert (extra.kind, extra.default) == (inspect.Parameter.KEYWORD_ONLY,
                                           default), name
  assert sig.replace(parameters=list(params.values())) == inspect.signature(base)
  layer = forge_torch.Linear(4, 3)
  ours = cls(layer.parameters())
  theirs = base(forge_torch.Linear(4, 3).parameters())
  assert ours.defaults == theirs.defaults
  assert ours.managed_params == [layer.weight]


# --- checkpoints ----------------------------------------------------------------

MAIN = {"SGD": dict(lr=0.05, momentum=0.9), "Adagrad": dict(lr=0.05),
        "RMSprop": dict(lr=1e-3, centered=True, momentum=0.9),
        "Adam": dict(lr=1e-2, amsgrad=True), "AdamW": dict(lr=1e-2),
        "Adamax": dict(lr=1e-2), "NAdam": dict(lr=1e-2),
        "RAdam": dict(lr=1e-2)}


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_interchanges_with_torch(family):
  """forge_torch.<Family>'s checkpoint loads into torch's and back."""
  kw = MAIN[family]
  forge_cls, torch_cls = getattr(forge_torch, family), getattr(torch.optim,
                                                               family)
  data = batches(10)
  fm = forge_copy(make_mlp())
  o_f = forge_cls(fm.parameters(), **kw)
  train(fm, o_f, None, data[:5])
  ref = make_mlp()
  ref.load_state_dict(fm.state_dict())
  o_ref = torch_cls(ref.parameters(), **kw)
  o_ref.load_state_dict(copy.deepcopy(o_f.state_dict()))
  back = forge_copy(make_mlp())
  back.load_state_dict(ref.state_dict())
  o_back = forge_cls(back.parameters(), **kw)
  o_back.load_state_dict(copy.deepcopy(o_ref.state_dict()))
  assert len(o_back.managed_params) == 3
  for m, o in ((fm, o_f), (ref, o_ref), (back, o_back)):
    train(m, o, None, data[5:])
  for pf, pr, pb in zip(fm.parameters(), ref.parameters(), back.parameters()):
    assert_close(np32(pr), np32(pf), FP32_TOL, what=f"{family} torch-resumed")
    assert torch.equal(pb, pf)
    for k, v in o_f.state[pf].items():
      assert torch.equal(o_back.state[pb][k], v), k


@pytest.mark.parametrize("saved,loaded", [
    ("AdamW", "SGD"), ("AdamW", "RMSprop"), ("AdamW", "Adamax"),
    ("SGD", "AdamW")])
def test_another_familys_checkpoint_is_refused_and_changes_nothing(saved,
                                                                   loaded):
  """A checkpoint of another family is refused at load in plain words
  (not as a KeyError, nor later at the backward as a changed option), and
  the refused load leaves the optimizer as it was: it trains on as if the
  load had not been tried."""
  data = batches(6)
  fm = forge_copy(make_mlp())
  o_saved = getattr(forge_torch, saved)(fm.parameters(), **MAIN[saved])
  train(fm, o_saved, None, data[:2])
  checkpoint = copy.deepcopy(o_saved.state_dict())
  runs = []
  for attempt in (False, True):
    model = forge_copy(make_mlp())
    opt = getattr(forge_torch, loaded)(model.parameters(), **MAIN[loaded])
    train(model, opt, None, data[:2])
    if attempt:
      with pytest.raises(ValueError, match=r"load_state_dict: the "
                         r"checkpoint.*another optimizer family\?"):
        opt.load_state_dict(copy.deepcopy(checkpoint))
    train(model, opt, None, data[2:])
    runs.append((model, opt))
  (plain, o_plain), (tried, o_tried) = runs
  for p, q in zip(tried.parameters(), plain.parameters()):
    assert torch.equal(p, q)
    assert o_tried.state[p].keys() == o_plain.state[q].keys()


def test_a_checkpoint_of_another_shape_or_order_is_refused_at_load():
  """A checkpoint of a model with another layer width, or of the same
  model's param groups in another order (torch's loader pairs saved and
  current parameters in order), is refused at load naming the state and
  both shapes, and changes nothing."""
  from torch import nn  # noqa: PLC0415
  torch.manual_seed(0)

  def net(width):
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 3))
    forge_torch.convert(model)
    return model

  x, y = torch.randn(4, 8), torch.randn(4, 3)
  other = net(6)
  o_other = forge_torch.AdamW(other.parameters(), lr=1e-2)
  F.mse_loss(other(x), y).backward()
  o_other.step()
  model = net(5)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  F.mse_loss(model(x), y).backward()
  opt.step()
  before = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
  with pytest.raises(ValueError, match=r"'exp_avg' for 0\.weight is of shape "
                     r"\(6, 8\), the weight \(5, 8\): a checkpoint of "
                     r"another model"):
    opt.load_state_dict(copy.deepcopy(o_other.state_dict()))
  for k, v in opt.state[model[0].weight].items():
    assert torch.equal(v, before[k]), k
  # The same model, its groups [weights], [biases] saved and loaded as
  # [0.weight, 0.bias], [2.weight, 2.bias]: the biases' state would go to
  # the weights.
  twin = net(5)
  by_kind = [{"params": [twin[0].weight, twin[2].weight]},
             {"params": [twin[0].bias, twin[2].bias]}]
  o_twin = forge_torch.AdamW(by_kind, lr=1e-2)
  F.mse_loss(twin(x), y).backward()
  o_twin.step()
  by_layer = [{"params": [model[0].weight, model[0].bias]},
              {"params": [model[2].weight, model[2].bias]}]
  opt = forge_torch.AdamW(by_layer, lr=1e-2)
  with pytest.raises(ValueError, match=r"param groups in another order"):
    opt.load_state_dict(copy.deepcopy(o_twin.state_dict()))
  F.mse_loss(model(x), y).backward()  # trains on
  opt.step()


def test_sgd_without_momentum_keeps_no_state():
  model = forge_copy(make_mlp())
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  train(model, opt, None, batches(2))
  assert opt.state_dict()["state"] == {}


def test_adagrad_state_exists_from_construction_like_torch():
  layer = forge_torch.Linear(6, 4)
  opt = forge_torch.Adagrad(layer.parameters(), initial_accumulator_value=0.5)
  st = opt.state[layer.weight]
  assert st["step"].item() == 0 and torch.all(st["sum"] == 0.5)
  late = forge_torch.Linear(6, 4)
  opt.add_param_group({"params": [late.weight],
                       "initial_accumulator_value": 9.0})
  # Inputs below 1: each g**2 < 9, so "< 9.0" separates the defaults'
  # initial value (0.5) from the group's (9.0) whatever the draw.
  x = torch.rand(3, 6, generator=torch.Generator().manual_seed(0)) * 0.9
  late(x).sum().backward()
  opt.step()
  # torch's lazy init reads the *defaults'* initial value, not the group's.
  ref = torch.full_like(late.weight, 0.5)
  assert opt.state[late.weight]["step"].item() == 1
  assert torch.all(opt.state[late.weight]["sum"] > ref - 1e-6)
  assert torch.all(opt.state[late.weight]["sum"] < 9.0)


def _exact_batches(steps, n_in=8, n_out=6, batch=4, seed=3):
  """``(x, c)`` pairs for the loss ``(model(x) * c).sum()`` of a one-layer
  model: ``x`` on a grid of 1/4 in [-2, 2], ``c`` in {+-1, +-1/2}, so the
  weight gradient ``c^T x`` (multiples of 1/8 below 8 in magnitude) is exact
  in bfloat16 and does not depend on the weight: torch's bf16 ``grad`` is
  the fused update's fp32 ``G``."""
  g = torch.Generator().manual_seed(seed)
  signs = torch.tensor([-1.0, -0.5, 0.5, 1.0])
  return [(torch.randint(-8, 9, (batch, n_in), generator=g) / 4,
           signs[torch.randint(0, 4, (batch, n_out), generator=g)])
          for _ in range(steps)]


def _train_linear(model, opt, data, dtype):
  for x, c in data:
    (model(x.to(dtype)) * c.to(dtype)).sum().backward()
    opt.step()
    opt.zero_grad()


def _one_layer_pair():
  torch.manual_seed(0)
  ref = torch.nn.Sequential(torch.nn.Linear(8, 6))
  fm = copy.deepcopy(ref)
  assert forge_torch.convert(fm) == ["0"]
  return ref, fm


CAST_TO_BF16 = [
    # Adagrad's sum exists from construction: cast before any step.
    pytest.param("Adagrad", dict(lr=0.05, lr_decay=1e-2,
                                 initial_accumulator_value=0.1,
                                 maximize=True), 0, FP32_TOL, id="adagrad"),
    # torch's foreach form (its CUDA default) rounds grad * -clr to bfloat16
    # before dividing by std, one rounding the fused update does not make:
    # the weights agree to the bf16 bar, the fp32 sum to the fp32 one.
    pytest.param("Adagrad", dict(lr=0.05, foreach=True), 2,
                 tol(jnp.bfloat16), id="adagrad-foreach-after-steps"),
    pytest.param("SGD", dict(lr=0.05, momentum=0.9, nesterov=True), 2,
                 FP32_TOL, id="sgd-nesterov"),
    pytest.param("RMSprop", dict(lr=1e-2, momentum=0.5), 2, FP32_TOL,
                 id="rmsprop-momentum"),
]


@pytest.mark.parametrize("family,kwargs,before,weight_tol", CAST_TO_BF16)
def test_fp32_state_after_casting_the_model_to_bfloat16_trains_like_torch(
    family, kwargs, before, weight_tol):
  """The model cast to bfloat16 after its optimizer state was created
  (``before`` fp32 steps; Adagrad's ``sum`` exists from construction):
  torch's step keeps that state in float32 and computes in float32,
  rounding only the weight, and so does the fused update. With a weight
  gradient exact in bfloat16 (:func:`_exact_batches`) the state agrees to
  the fp32 bar and the bf16 weights are torch's (``weight_tol``)."""
  ref, fm = _one_layer_pair()
  o_ref = getattr(torch.optim, family)(ref.parameters(), **kwargs)
  o_f = getattr(forge_torch, family)(fm.parameters(), **kwargs)
  data = _exact_batches(before + 5)
  for m, o in ((ref, o_ref), (fm, o_f)):
    _train_linear(m, o, data[:before], torch.float32)
    m.to(torch.bfloat16)
  calls = forge_torch.bridge_stats.calls
  _train_linear(ref, o_ref, data[before:], torch.bfloat16)
  _train_linear(fm, o_f, data[before:], torch.bfloat16)
  assert forge_torch.bridge_stats.calls - calls == 5  # fused, every step
  w0 = ref[0].weight
  for (name, pf), pr in zip(fm.named_parameters(), ref.parameters()):
    assert pf.dtype == pr.dtype == torch.bfloat16
    assert_close(np32(pf), np32(pr), weight_tol, what=f"{family} {name}")
    for k, vr in o_ref.state[pr].items():
      vf = o_f.state[pf][k]
      assert (vf.dtype, vf.shape) == (vr.dtype, vr.shape), k
      if vr.dim():
        assert pr is not w0 or vr.dtype == torch.float32, k
        assert_close(np32(vf), np32(vr), FP32_TOL, what=f"{family} {name}.{k}")
      else:
        assert torch.equal(vf, vr), (name, k)


def test_bfloat16_state_beside_a_float32_weight_is_refused_with_the_fix():
  """A model built in bfloat16, its Adagrad made (``sum`` in bfloat16),
  then cast to float32: torch's step would keep rounding the sum and its
  square root to bfloat16, which the fused update does not reproduce, so
  it refuses before touching the weight, naming the fix; after that fix
  (the loader casts the state to the weights' dtype) it trains as torch
  does after the same fix."""
  ref, fm = _one_layer_pair()
  ref.to(torch.bfloat16)
  fm.to(torch.bfloat16)
  o_ref = torch.optim.Adagrad(ref.parameters(), lr=0.05)
  o_f = forge_torch.Adagrad(fm.parameters(), lr=0.05)
  for m in (ref, fm):
    m.to(torch.float32)
  (x, c), *rest = _exact_batches(4)
  w, s = fm[0].weight.detach().clone(), o_f.state[fm[0].weight]["sum"].clone()
  with pytest.raises(RuntimeError, match=(
      r"'sum' is torch.bfloat16, the weight torch.float32.*rounding each of "
      r"its operations.*optimizer.load_state_dict\("
      r"optimizer.state_dict\(\)\)")):
    (fm(x) * c).sum().backward()
  assert torch.equal(fm[0].weight, w)
  assert torch.equal(o_f.state[fm[0].weight]["sum"], s)
  o_f.zero_grad()
  o_f.step()  # the failed backward's step: the bias got no gradient
  for m, o in ((ref, o_ref), (fm, o_f)):
    o.load_state_dict(o.state_dict())
    _train_linear(m, o, rest, torch.float32)
  for pf, pr in zip(fm.parameters(), ref.parameters()):
    assert_close(np32(pf), np32(pr), FP32_TOL)
    assert o_f.state[pf]["sum"].dtype == torch.float32
    assert_close(np32(o_f.state[pf]["sum"]), np32(o_ref.state[pr]["sum"]),
                 FP32_TOL)


@pytest.mark.parametrize("family,kwargs,match", [
    ("Adam", dict(lr=1e-2), r"torch.optim.Adam refuses this mix too"),
    ("RMSprop", dict(lr=1e-2, centered=True),
     r"'grad_avg' .*torch.optim.RMSprop refuses this mix too"),
    ("Adagrad", dict(lr=1e-2, fused=True),
     r"torch.optim.Adagrad with fused=True refuses this mix too")])
def test_fp32_state_beside_bfloat16_weight_refused_where_torch_refuses(
    family, kwargs, match):
  """Where torch's own step refuses float32 state beside a bfloat16 weight
  (its lerp_ and fused kernels take one dtype), so does forge_torch's,
  before touching the weight."""
  ref, fm = _one_layer_pair()
  o_ref = getattr(torch.optim, family)(ref.parameters(), **kwargs)
  o_f = getattr(forge_torch, family)(fm.parameters(), **kwargs)
  data = _exact_batches(2)
  for m, o in ((ref, o_ref), (fm, o_f)):
    _train_linear(m, o, data[:1], torch.float32)
    m.to(torch.bfloat16)
  x, c = (t.to(torch.bfloat16) for t in data[1])
  with pytest.raises(RuntimeError):
    (ref(x) * c).sum().backward()
    o_ref.step()
  w = fm[0].weight.detach().clone()
  with pytest.raises(RuntimeError, match=match + r".*load_state_dict"):
    (fm(x) * c).sum().backward()
  assert torch.equal(fm[0].weight, w)


def test_option_turned_on_after_state_exists_raises_clearly():
  layer = forge_torch.Linear(6, 4)
  opt = forge_torch.RMSprop(layer.parameters())
  x = torch.randn(3, 6)
  layer(x).sum().backward()
  opt.step()
  opt.param_groups[0]["momentum"] = 0.9  # torch itself would KeyError
  with pytest.raises(RuntimeError, match="no 'momentum_buffer'"):
    layer(x).sum().backward()


# --- refused options --------------------------------------------------------------

REFUSED = [pytest.param(f, o, id=f"{f}-{o}") for f in FAMILIES
           for o in ("capturable", "differentiable") if _has_option(f, o)]


@pytest.mark.parametrize("family,option", REFUSED)
def test_refused_options_raise(family, option):
  cls = getattr(forge_torch, family)
  layer = forge_torch.Linear(4, 3)
  with pytest.raises(ValueError, match=f"does not support {option}=True"):
    cls(layer.parameters(), **{option: True})
  opt = cls([layer.bias])
  with pytest.raises(ValueError, match=f"does not support {option}=True"):
    opt.add_param_group({"params": [layer.weight], option: True})
  assert opt.managed_params == [] and len(opt.param_groups) == 1


@pytest.mark.parametrize("reset", ["none", "other_key", "old_checkpoint"])
def test_sgd_starts_a_missing_momentum_buffer_from_the_gradient(reset):
  """torch's SGD forms the momentum buffer from the gradient wherever the
  weight's state holds none (``state.get("momentum_buffer") is None``): a
  buffer reset to ``None`` between steps, a state holding other keys only,
  or a checkpoint of torch <= 2.0 saved without momentum (its buffers
  ``None``) resumed with momentum. forge_torch steps as torch does."""
  ref = make_mlp()
  fm = forge_copy(ref)
  opts = []
  for model, family in ((ref, torch.optim.SGD), (fm, forge_torch.SGD)):
    momentum = 0.0 if reset == "old_checkpoint" else 0.9
    opt = family(model.parameters(), lr=0.05, momentum=momentum,
                 dampening=0.25)
    if reset == "old_checkpoint":
      saved = opt.state_dict()
      saved["state"] = {i: {"momentum_buffer": None}
                        for i in range(len(list(model.parameters())))}
      opt.load_state_dict(saved)
      opt.param_groups[0]["momentum"] = 0.9
    elif reset == "other_key":
      for p in model.parameters():
        opt.state[p]["note"] = "kept"
    opts.append(opt)
  data = batches(3)
  for i, (x, y) in enumerate(data):
    for model, opt in zip((ref, fm), opts):
      if reset == "none" and i == 2:
        for p in model.parameters():
          opt.state[p]["momentum_buffer"] = None
      F.mse_loss(model(x), y).backward()
      opt.step()
      opt.zero_grad()
  for r, f in zip(ref.parameters(), fm.parameters()):
    assert_close(np32(f), np32(r), tol("float32"))
  for p in fm.parameters():
    state = opts[1].state[p]
    assert isinstance(state["momentum_buffer"], torch.Tensor)
    if reset == "other_key":
      assert state["note"] == "kept"
