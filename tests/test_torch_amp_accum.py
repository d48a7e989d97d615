"""forge_torch under torch.autocast(bfloat16) and with gradient accumulation
(``optimizer.accumulate_steps``), alone, together and under torch.compile,
against eager torch (AMP) + torch.optim, on a GPT-style model whose head is
tied to its embedding."""

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import forge_torch  # noqa: E402
from tests.tolerances import tol  # noqa: E402

FP32 = tol(jnp.float32)   # 1e-5
BF16 = tol(jnp.bfloat16)  # the bf16 row: autocast parity
CUDA = torch.cuda.is_available()
# Odd sizes no block size divides. Every managed layer of every test is
# D x D and sees BT = 3 * CTX = 21 token rows, so that each rule compiles
# once (the kernels run in Pallas interpret mode on the CPU).
VOCAB, CTX, D = 23, 7, 20
BT = 3 * CTX


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
  """Tiny CPU ops: torch's intra-op threads only wait on each other (and on
  the other test process), several times slower than one thread."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(threads)


def rel(a, b) -> float:
  a, b = a.detach().double().cpu(), b.detach().double().cpu()
  d = b.norm().item()
  return (a - b).norm().item() / (d if d > 0 else 1.0)


# --- a GPT-style model --------------------------------------------------------


class Block(nn.Module):

  def __init__(self, d, heads=2):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
    # No key bias: softmax ignores it, so its gradient is rounding noise,
    # which Adam would amplify into full-size, run-dependent updates.
    self.q, self.v = nn.Linear(d, d), nn.Linear(d, d)
    self.k = nn.Linear(d, d, bias=False)
    self.proj = nn.Linear(d, d)
    self.fc, self.out = nn.Linear(d, d), nn.Linear(d, d)

  def forward(self, h):
    b, t, d = h.shape
    x = self.ln1(h)
    split = lambda z: z.view(b, t, self.heads, -1).transpose(1, 2)  # noqa: E731
    a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)),
                                       split(self.v(x)), is_causal=True)
    h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
    return h + self.out(F.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):

  def __init__(self, n_blocks=2):
    super().__init__()
    self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(CTX, D)
    self.blocks = nn.ModuleList(Block(D) for _ in range(n_blocks))
    self.ln_f = nn.LayerNorm(D)
    self.head = nn.Linear(D, VOCAB, bias=False)
    self.head.weight = self.tok.weight  # tied

  def forward(self, ids):
    h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
    for block in self.blocks:
      h = block(h)
    return self.head(self.ln_f(h))


def gpt_pair(device="cpu"):
  """A GPT and its forge_torch copy (the tied head stays nn.Linear)."""
  torch.manual_seed(0)
  ref = GPT().to(device)
  model = copy.deepcopy(ref)
  with pytest.warns(forge_torch.ConvertSkipWarning, match="head"):
    names = forge_torch.convert(model)
  assert "tied" in names.skipped["head"]
  assert len(names) == 12 and "head" not in names
  return ref, model


def gpt_data(micro_batches, device="cpu", seed=1):
  """Token ids and targets, ``micro_batches[i]`` micro-batches in step i."""
  g = torch.Generator().manual_seed(seed)
  return [[(torch.randint(0, VOCAB, (3, CTX), generator=g).to(device),
            torch.randint(0, VOCAB, (3, CTX), generator=g).to(device))
           for _ in range(k)] for k in micro_batches]


def record_kernel_operands(monkeypatch):
  """The dtypes of ``(x, dy)`` of every fused kernel call, in a list."""
  seen = []
  fused_update = forge_torch._bridge.fused_update

  def recording(x, dy, *args, **kwargs):
    seen.append((x.dtype, dy.dtype))
    return fused_update(x, dy, *args, **kwargs)

  monkeypatch.setattr(forge_torch._bridge, "fused_update", recording)
  return seen


def gpt_loss(model, ids, targets, k, amp):
  with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
    logits = model(ids)
  assert logits.dtype == (torch.bfloat16 if amp else torch.float32)
  return F.cross_entropy(logits.float().reshape(-1, VOCAB),
                         targets.reshape(-1)) / k


def train_gpt(run, opt, data, amp, managed=()):
  """torch's accumulation loop: K backwards of loss / K, then one step."""
  for micro_batches in data:
    for ids, targets in micro_batches:
      gpt_loss(run, ids, targets, len(micro_batches), amp).backward()
      assert all(p.grad is None for p in managed)  # FORGE's update, no .grad
    opt.step()
    opt.zero_grad()


# Adam turns a gradient element's sign into a full-size step, so where bf16
# rounding flips the sign of a near-zero element of torch's AMP gradient the
# weights part by about 2 * LR: a small LR keeps that within the bf16 row.
LR = 3e-3


def assert_gpt_parity(ref, model, o_ref, o_f, rtol, init=None):
  """The weights (``init``: their updates since ``init``'s copy, which a
  bf16 ``rtol`` must bound: the weights move a few % in these runs) and
  the optimizer state within ``rtol`` of torch's."""
  inits = init.parameters() if init is not None else ref.parameters()
  for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(),
                              inits, strict=True):
    assert p.dtype == torch.float32, name
    if init is None:
      assert rel(p, q) <= rtol, (name, rel(p, q))
    else:
      assert rel(p - p0, q - p0) <= rtol, (name, rel(p - p0, q - p0))
    sf, sr = o_f.state[p], o_ref.state[q]
    assert sf.keys() == sr.keys() == {"step", "exp_avg", "exp_avg_sq"}, name
    assert sf["step"].item() == sr["step"].item(), name
    for key in ("exp_avg", "exp_avg_sq"):
      assert sf[key].dtype == torch.float32, (name, key)
      assert rel(sf[key], sr[key]) <= rtol, (name, key, rel(sf[key], sr[key]))


@pytest.mark.parametrize("amp, k", [
    (False, 3),  # gradient accumulation alone: fp32 parity
    (True, 1),   # autocast alone
    (True, 3),   # both
], ids=["accumulate", "autocast", "autocast-accumulate"])
def test_gpt_parity_with_torch_amp_and_accumulation(amp, k, monkeypatch):
  ref, model = gpt_pair()
  init = copy.deepcopy(ref)
  o_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
  o_f = forge_torch.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
  o_f.accumulate_steps = k
  managed = o_f.managed_params
  assert len(managed) == 12
  data = gpt_data([k, k])
  calls = forge_torch.bridge_stats.calls
  operands = record_kernel_operands(monkeypatch)
  train_gpt(ref, o_ref, data, amp)
  train_gpt(model, o_f, data, amp, managed)
  # The fused path ran: one kernel call per managed layer per micro-batch
  # (K - 1 accumulating, then the update), on bf16 operands under autocast.
  assert forge_torch.bridge_stats.calls - calls == 12 * k * len(data)
  dtype = torch.bfloat16 if amp else torch.float32
  assert operands == [(dtype, dtype)] * (12 * k * len(data))
  for p, p0 in zip(model.parameters(), init.parameters()):
    assert rel(p, p0) > 1e-3  # everything trained, the tied pair included
  # The updates themselves, except under autocast with accumulation:
  # there bf16 rounding of torch's per-micro-batch G flips the sign of a
  # few near-zero elements of the summed gradient (0.3-0.5 % of them),
  # whose Adam steps then differ by 2 * LR, and the updates part by about
  # 10 %; the moments (checked) agree to about 1.5e-3, the weights to the
  # bf16 row.
  assert_gpt_parity(ref, model, o_ref, o_f, BF16 if amp else FP32,
                    None if amp and k > 1 else init)


def test_gpt_under_torch_compile_alone_then_with_each_then_all(monkeypatch):
  """One compiled model, four steps: compiled alone, with accumulation
  (fp32: parity 1e-5 after each), with autocast, with both (bf16 row). The
  managed layers run eagerly through a graph break, fused."""
  ref, model = gpt_pair()
  o_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
  o_f = forge_torch.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
  torch._dynamo.reset()
  run = torch.compile(model, backend="aot_eager")
  operands = record_kernel_operands(monkeypatch)
  schedule = [(False, 1), (False, 3), (True, 1), (True, 3)]
  data = gpt_data([k for _, k in schedule])
  for (amp, k), step in zip(schedule, data):
    o_f.accumulate_steps = k
    del operands[:]
    train_gpt(ref, o_ref, [step], amp)
    train_gpt(run, o_f, [step], amp, o_f.managed_params)
    dtype = torch.bfloat16 if amp else torch.float32
    assert operands == [(dtype, dtype)] * (12 * k), (amp, k)
    # Once a step ran under autocast, the trajectories part by bf16's
    # rounding of torch's G.
    assert_gpt_parity(ref, model, o_ref, o_f, BF16 if amp else FP32)


# --- autocast: one layer, element by element ---------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_autocast_layer_is_torch_autocast_linear_with_an_fp32_gradient(k):
  """Alone (K = 1) and accumulating K = 3 micro-batches: forward, input and
  bias gradients are torch's autocast linear's bit for bit; the weight and
  the moments are torch's AdamW on the sum of the fp32 G's formed from the
  bf16 operands (torch's AMP rounds each G to bf16 first)."""
  torch.manual_seed(0)
  ref = nn.Linear(D, D)
  layer = forge_torch.Linear.from_linear(copy.deepcopy(ref))
  o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  o_f = forge_torch.AdamW(layer.parameters(), lr=1e-2)
  o_f.accumulate_steps = k
  w_ptr = layer.weight.data_ptr()
  w_before = layer.weight.detach().clone()
  bf = torch.bfloat16
  g = torch.zeros(D, D)
  for i in range(k):
    x, dy = torch.randn(3, CTX, D), torch.randn(3, CTX, D)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
      y_ref, y = ref(xs[0]), layer(xs[1])
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    (y_ref.float() * dy).sum().backward()
    (y.float() * dy).sum().backward()
    assert xs[1].grad.dtype == torch.float32
    assert torch.equal(xs[1].grad, xs[0].grad)
    assert layer.weight.grad is None
    g += dy.to(bf).reshape(BT, D).float().t() @ x.to(bf).reshape(BT, D).float()
    if i < k - 1:
      assert torch.equal(layer.weight, w_before)  # accumulated only
  # Summed over the micro-batches in both, from bf16 values cast to fp32.
  assert torch.equal(layer.bias.grad, ref.bias.grad)
  assert rel(ref.weight.grad, g) <= BF16 and rel(ref.weight.grad, g) > 0
  expect = nn.Parameter(w_before.clone())
  o_exp = torch.optim.AdamW([expect], lr=1e-2)
  expect.grad = g
  o_exp.step()
  # In place in the fp32 weight and fp32 moments.
  assert layer.weight.dtype == torch.float32
  assert layer.weight.data_ptr() == w_ptr
  assert rel(layer.weight, expect) <= FP32
  for key in ("exp_avg", "exp_avg_sq"):
    assert o_f.state[layer.weight][key].dtype == torch.float32
    assert rel(o_f.state[layer.weight][key], o_exp.state[expect][key]) <= FP32
  o_f.step()
  o_ref.step()
  assert rel(layer.weight, ref.weight) <= BF16
  assert torch.equal(layer.bias, ref.bias)


def test_autocast_autograd_grad_returns_torchs_gradient():
  """``torch.autograd.grad`` of the weight under autocast: torch's own bf16
  gradient, in the weight's dtype, and no update."""
  torch.manual_seed(0)
  ref = nn.Linear(6, 5)
  layer = forge_torch.Linear.from_linear(copy.deepcopy(ref))
  opt = forge_torch.SGD(layer.parameters(), lr=0.1)
  assert opt.managed_params == [layer.weight]
  x = torch.randn(7, 6)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    want = torch.autograd.grad(ref(x).float().square().sum(), ref.weight)[0]
    got = torch.autograd.grad(layer(x).float().square().sum(), layer.weight)[0]
  assert got.dtype == torch.float32 and torch.equal(got, want)
  assert torch.equal(layer.weight, ref.weight)  # not updated


def test_autocast_refusals_name_the_fix():
  layer = forge_torch.Linear(6, 4)
  opt = forge_torch.AdamW(layer.parameters())
  with torch.autocast("cpu", dtype=torch.float16):
    with pytest.raises(RuntimeError, match=r"dtype=torch.float16 is not "
                       r"supported.*dtype=torch.bfloat16"):
      layer(torch.randn(3, 6))
  with torch.autocast("cpu", dtype=torch.bfloat16):
    with pytest.raises(TypeError, match=r"input dtype torch.float64 under "
                       "torch.autocast") as e:
      layer(torch.randn(3, 6, dtype=torch.float64))
    # Also what nn.Linear raises for mismatched dtypes.
    assert isinstance(e.value, RuntimeError)
  # A bfloat16 model under bfloat16 autocast: nothing to cast, still fused.
  del opt
  bf = forge_torch.Linear(D, D, dtype=torch.bfloat16)
  opt = forge_torch.AdamW(bf.parameters())
  w0 = bf.weight.detach().clone()
  with torch.autocast("cpu", dtype=torch.bfloat16):
    bf(torch.randn(BT, D)).float().sum().backward()
  assert bf.weight.grad is None and not torch.equal(bf.weight, w0)
  opt.step()


# --- gradient accumulation: semantics -----------------------------------------


class TwoHeads(nn.Module):
  """An MLP with a second head that only some micro-batches use."""

  def __init__(self):
    super().__init__()
    self.body = nn.Linear(D, D)
    self.head = nn.Linear(D, D)
    self.extra = nn.Linear(D, D)

  def forward(self, x, extra=False):
    h = torch.tanh(self.body(x))
    out = self.head(h).square().mean()
    return out + self.extra(h).square().mean() if extra else out


FAMILIES = {
    "sgd-nesterov": (torch.optim.SGD, forge_torch.SGD,
                     dict(lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=1e-2)),
    "adam-amsgrad": (torch.optim.Adam, forge_torch.Adam,
                     dict(lr=1e-2, amsgrad=True, weight_decay=1e-2)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_accumulation_is_torchs_sum_then_step(family):
  """K backwards then step() equal torch's accumulated step: a full cycle, a
  cycle cut short (step() applies the buffer) and a layer only one
  micro-batch reaches; between them the weights and the state stay."""
  torch_cls, forge_cls, kw = FAMILIES[family]
  torch.manual_seed(0)
  ref = TwoHeads()
  model = copy.deepcopy(ref)
  assert forge_torch.convert(model) == ["body", "head", "extra"]
  o_ref, o_f = torch_cls(ref.parameters(), **kw), forge_cls(
      model.parameters(), **kw)
  o_f.accumulate_steps = 3
  g = torch.Generator().manual_seed(2)
  # (micro-batches, which of them reach `extra`) per step.
  plan = [(3, {0, 1, 2}), (2, {0, 1}), (3, {1})]
  for step, (n, extra_at) in enumerate(plan):
    for i in range(n):
      x = torch.randn(BT, D, generator=g)
      ref(x, extra=i in extra_at).div(3).backward()
      before = {p: p.detach().clone() for p in model.parameters()}
      model(x, extra=i in extra_at).div(3).backward()
      last = i == 2
      for layer in (model.body, model.head, model.extra):
        w = layer.weight
        assert w.grad is None
        if not (last and (layer is not model.extra or i in extra_at)):
          # Accumulated only: the weight bit for bit, and in the first step
          # no optimizer state yet (torch creates it in step()).
          assert torch.equal(w, before[w]), (n, i)
          assert step > 0 or w not in o_f.state
    o_ref.step()
    o_f.step()
    o_ref.zero_grad()
    o_f.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(),
                            strict=True):
      assert rel(p, q) <= FP32, (name, rel(p, q))
      for key, s in o_ref.state[q].items():
        assert rel(o_f.state[p][key], s) <= FP32, (name, key)


def test_accumulation_opt_in_limits_and_errors():
  torch.manual_seed(0)
  layer = forge_torch.Linear(D, D)
  opt = forge_torch.AdamW(layer.parameters(), lr=1e-2)
  x = torch.randn(BT, D)
  # Not opted in: a second forward before step() stays an error that says
  # how to opt in.
  layer(x).sum().backward()
  with pytest.raises(RuntimeError, match=r"second time before optimizer.step"
                     r".*accumulate_steps = K"):
    layer(x)
  with pytest.raises(RuntimeError, match="cannot change in the middle"):
    opt.accumulate_steps = 2
  opt.step()
  for bad in (0, True, 2.0, np.int64(0)):
    with pytest.raises(ValueError, match="int >= 1"):
      opt.accumulate_steps = bad
  opt.accumulate_steps = np.int64(2)  # any integer type, stored as an int
  assert type(opt.accumulate_steps) is int
  assert copy.deepcopy(opt).accumulate_steps == 2
  # A forward whose graph is dropped stops counting; the limit is K.
  layer(x)
  for _ in range(2):
    layer(x).sum().backward()
  with pytest.raises(RuntimeError, match=r"called more than "
                     r"accumulate_steps=2 times before optimizer.step\(\)\. "
                     r"This step's update of the weight has been applied "
                     r"already \(by the backward of its use number 2\)"):
    layer(x)
  opt.step()
  assert opt.state[layer.weight]["step"].item() == 2
  # Before the K-th backward nothing is applied yet, and the message does
  # not say it is.
  alive = [layer(x) for _ in range(2)]  # two graphs kept, no backward
  with pytest.raises(RuntimeError, match=r"accumulate_steps=2 times before "
                     r"optimizer.step\(\)\. With gradient") as e:
    layer(x)
  assert "applied already" not in str(e.value) and len(alive) == 2


@pytest.mark.parametrize("k", [1, 2])
def test_a_new_optimizer_in_the_middle_of_a_step_is_refused(k):
  """An optimizer built over managed weights while their owner holds an
  accumulation window (or after a backward applied its update, before its
  step()): torch would step the new one from .grad, FORGE keeps these in
  the owner, so the new one would drop them -- refused, nothing taken;
  after the owner's step() it takes over."""
  torch.manual_seed(0)
  layer = forge_torch.Linear(D, D)
  owner = forge_torch.AdamW(layer.parameters(), lr=1e-2)
  owner.accumulate_steps = k
  layer(torch.randn(BT, D)).square().sum().backward()
  what = "micro-batch of its accumulate_steps" if k > 1 else "already applied"
  with pytest.raises(RuntimeError, match=(
      r"given the managed weight of shape \(\d+, \d+\) in the middle of a "
      rf"step(.|\n)*{what}(.|\n)*Call the owner's step\(\) first")):
    forge_torch.AdamW(layer.parameters(), lr=1e-2)
  second = forge_torch.SGD([{"params": [layer.bias]}], lr=0.1)
  with pytest.raises(RuntimeError, match="in the middle of a step"):
    second.add_param_group({"params": [layer.weight]})
  assert len(second.param_groups) == 1  # the refused group not kept
  assert forge_torch.optim._linear.owner_of(layer.weight) is owner
  # Groups checked before any is taken: an idle layer of an earlier group
  # stays its owner's while the refused constructor's error is alive.
  idle = forge_torch.Linear(D, D)
  idle_owner = forge_torch.AdamW(idle.parameters(), lr=1e-2)
  with pytest.raises(RuntimeError, match="in the middle of a step") as e:
    forge_torch.AdamW([{"params": [idle.weight]},
                       {"params": [layer.weight]}], lr=1e-2)
  assert e.value is not None
  assert forge_torch.optim._linear.owner_of(idle.weight) is idle_owner
  owner.step()
  owner.zero_grad()
  new = forge_torch.AdamW(layer.parameters(), lr=1e-2)
  assert forge_torch.optim._linear.owner_of(layer.weight) is new


def test_a_new_optimizer_after_zero_grad_takes_over():
  """After a backward and zero_grad() (a step skipped: torch would apply
  nothing of it, and FORGE's update, already applied, stays), a new
  optimizer takes the weights over."""
  layer = forge_torch.Linear(D, D)
  owner = forge_torch.AdamW(layer.parameters(), lr=1e-2)
  layer(torch.randn(BT, D)).square().sum().backward()
  owner.zero_grad()
  new = forge_torch.AdamW(layer.parameters(), lr=1e-2)
  assert forge_torch.optim._linear.owner_of(layer.weight) is new


def test_zero_grad_discards_the_accumulated_micro_batches_as_torch_does():
  torch.manual_seed(0)
  ref = nn.Linear(D, D)
  layer = forge_torch.Linear.from_linear(copy.deepcopy(ref))
  o_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
  o_f = forge_torch.SGD(layer.parameters(), lr=0.1, momentum=0.9)
  o_f.accumulate_steps = 2
  xs = torch.randn(3, BT, D)
  for m, opt in ((ref, o_ref), (layer, o_f)):
    m(xs[0]).square().sum().backward()
    opt.zero_grad()  # drops micro-batch 0
    for x in xs[1:]:
      m(x).square().sum().backward()
    opt.step()
  assert rel(layer.weight, ref.weight) <= FP32
  assert rel(o_f.state[layer.weight]["momentum_buffer"],
             o_ref.state[ref.weight]["momentum_buffer"]) <= FP32


@pytest.mark.parametrize("at_step", [0, 1])
def test_zero_grad_keeping_zeros_mid_window_steps_from_zero_as_torch(
    at_step):
  """zero_grad(set_to_none=False) in the middle of an accumulation window:
  torch keeps a zero .grad on every parameter a micro-batch reached and the
  next step() steps it from zero (its step count, AdamW's decay, the
  moments' decay); a managed weight with micro-batches accumulated does
  the same, in the first step (no state yet) and in a later one."""
  torch.manual_seed(0)
  ref = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 5))
  model = copy.deepcopy(ref)
  assert forge_torch.convert(model) == ["0", "2"]
  kw = dict(lr=0.1, weight_decay=0.5)
  o_ref = torch.optim.AdamW(ref.parameters(), **kw)
  o_f = forge_torch.AdamW(model.parameters(), **kw)
  o_f.accumulate_steps = 3
  g = torch.Generator().manual_seed(5)
  for step in range(at_step + 2):
    micro = 3 if step != at_step else 1
    for _ in range(micro):
      x = torch.randn(BT, D, generator=g)
      for m in (ref, model):
        m(x).square().mean().div(3).backward()
    if step == at_step:  # one micro-batch in, its gradients zeroed
      o_ref.zero_grad(set_to_none=False)
      o_f.zero_grad(set_to_none=False)
    o_ref.step()
    o_f.step()
    o_ref.zero_grad()
    o_f.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(),
                            strict=True):
      assert rel(p, q) <= FP32, (step, name, rel(p, q))
      for key, s in o_ref.state[q].items():
        assert rel(o_f.state[p][key], s) <= FP32, (step, name, key)


def test_a_tied_managed_weight_is_refused_with_accumulation():
  layer = forge_torch.Linear(D, D)
  opt = forge_torch.SGD(layer.parameters(), lr=0.1)
  opt.accumulate_steps = 2
  x = torch.randn(BT, D)
  F.linear(layer(x), layer.weight).sum().backward()  # a second, hand-tied use
  with pytest.raises(RuntimeError, match="tied or shared weight"):
    opt.step()


# --- on the GPU ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compile"])
def test_gpu_gpt_autocast_accumulation(compiled):
  """CUDA: autocast(bf16) + accumulation (K = 4, the last step cut short) on
  the GPT, against torch AMP + AdamW (fused=True: the managed weights follow
  its arithmetic), with every state tensor written in place."""
  ref, model = gpt_pair("cuda")
  o_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1,
                            fused=True)
  o_f = forge_torch.AdamW(model.parameters(), lr=LR, weight_decay=0.1,
                          fused=True)
  o_f.accumulate_steps = 4
  if compiled:
    torch._dynamo.reset()
  run = torch.compile(model) if compiled else model
  # The last step is cut short: step() applies the accumulated 3.
  data = gpt_data([4, 4, 3], device="cuda")
  stats = forge_torch.bridge_stats
  calls, copied = stats.calls, stats.copied
  train_gpt(ref, o_ref, data, amp=True)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # Dynamo's graph breaks
    train_gpt(run, o_f, data, amp=True, managed=o_f.managed_params)
  torch.cuda.synchronize()
  assert stats.calls - calls == 12 * (4 + 4 + 3) + 12
  assert stats.copied == copied, "a fused update was copied back"
  assert_gpt_parity(ref, model, o_ref, o_f, BF16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_accumulation_launches_directly():
  """bf16 layers with accumulate_steps = 2 on a Hopper GPU: the micro-batch
  sum into the fp32 buffer (a state-only kernel, which never reads the
  weight) and the update from it both launch directly, and direct launches
  stay on."""
  torch.manual_seed(0)
  fm = nn.Sequential(forge_torch.Linear(256, 512, bias=False), nn.Tanh(),
                     forge_torch.Linear(512, 256, bias=False)
                     ).cuda().bfloat16()
  opt = forge_torch.AdamW(fm.parameters(), lr=1e-3)
  opt.accumulate_steps = 2
  stats = forge_torch.bridge_stats
  stats.reset()
  g = torch.Generator(device="cuda").manual_seed(1)
  for _ in range(3):
    for _ in range(2):
      x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16,
                      generator=g)
      fm(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
  torch.cuda.synchronize()
  assert stats.calls == 12 and stats.direct == 12, (
      stats, stats.direct_unavailable)
  assert stats.direct_unavailable is None
