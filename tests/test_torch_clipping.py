"""forge_torch's global-norm clipping (``max_grad_norm=``) in two passes
against ``clip_grad_norm_`` + the torch optimizer, and its refusals and
buffer handling (``restore_buffers``)."""

import copy
import inspect

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import forge_torch  # noqa: E402
from tests.harness import WIDTHS  # noqa: E402
from tests.tolerances import assert_close, rel_err, tol  # noqa: E402

F32 = tol(jnp.float32)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device for torch")
def test_torch_max_grad_norm_on_gpu_matches_clip_grad_norm_and_adamw():
  """The CPU parity test's loop on CUDA tensors (the fused updates and the
  norm kernels on the GPU)."""
  _check_torch_parity("cuda")
