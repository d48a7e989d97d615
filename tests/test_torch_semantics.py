"""forge_torch against torch's own semantics in training-loop patterns (CPU,
fp32): backward passes that do not ask for the weights' gradient, forwards
dropped without a backward, zero_grad(set_to_none=False), checkpoints with
refused options, and torch.amp.GradScaler (refused clearly)."""

import copy

import pytest

torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import forge_torch  # noqa: E402
from tests.tolerances import tol  # noqa: E402

TOL = tol(jnp.float32)


def rel(a, b) -> float:
  a, b = a.detach().double(), b.detach().double()
  d = b.norm().item()
  return (a - b).norm().item() / (d if d > 0 else 1.0)


def pair(seed=0):
  """(a torch MLP, a converted deep copy of it)."""
  torch.manual_seed(seed)
  ref = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 3))
  fm = copy.deepcopy(ref)
  assert forge_torch.convert(fm) == ["0", "2"]
  return ref, fm


def data(seed=1, n=5):
  g = torch.Generator().manual_seed(seed)
  return torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g)


def assert_models_close(fm, ref):
  for (name, pf), pr in zip(fm.named_parameters(), ref.parameters(),
                            strict=True):
    assert rel(pf, pr) <= TOL, (name, rel(pf, pr))


# --- backward passes that do not ask for the weight's gradient --------------


def test_autograd_grad_wrt_input_leaves_the_weights_alone():
  _, fm = pair()
  opt = forge_torch.Adam(fm.parameters(), lr=1e-2)
  before = [p.detach().clone() for p in fm.parameters()]
  x, y = data()
  x.requires_grad_(True)
  (gx,) = torch.autograd.grad(F.mse_loss(fm(x), y), x)
  assert gx.shape == x.shape and gx.abs().sum() > 0
  for p, b in zip(fm.parameters(), before):
    assert torch.equal(p, b)
  assert all(len(opt.state[p]) == 0 for p in opt.managed_params)


def test_backward_with_inputs_updates_only_what_it_names():
  _, fm = pair()
  opt = forge_torch.Adam(fm.parameters(), lr=1e-2)
  w0, w2 = fm[0].weight.detach().clone(), fm[2].weight.detach().clone()
  x, y = data()
  F.mse_loss(fm(x), y).backward(inputs=[fm[2].bias, fm[2].weight])
  assert torch.equal(fm[0].weight, w0)  # not asked for: untouched
  assert not torch.equal(fm[2].weight, w2)  # asked for: updated in backward
  assert fm[2].bias.grad is not None and fm[0].bias.grad is None
  opt.step()


def test_autograd_grad_wrt_the_weight_returns_torchs_gradient():
  ref, fm = pair()
  opt = forge_torch.Adam(fm.parameters(), lr=1e-2)
  w0 = fm[0].weight.detach().clone()
  x, y = data()
  got = torch.autograd.grad(F.mse_loss(fm(x), y), [fm[0].weight, fm[2].bias])
  want = torch.autograd.grad(F.mse_loss(ref(x), y),
                             [ref[0].weight, ref[2].bias])
  for g, w in zip(got, want):
    assert rel(g, w) <= TOL
  assert torch.equal(fm[0].weight, w0)  # asked for, not applied
  assert len(opt.state[fm[0].weight]) == 0
  F.mse_loss(fm(x), y).backward()  # the same step can still train
  opt.step()
  assert not torch.equal(fm[0].weight, w0)


def test_input_gradient_then_training_step_matches_torch():
  # FGSM-style: an input-gradient pass, then a training step on the
  # perturbed input, one optimizer step per batch.
  ref, fm = pair()
  o_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
  o_f = forge_torch.Adam(fm.parameters(), lr=1e-2)
  for m, o in ((ref, o_r), (fm, o_f)):
    for seed in (1, 2):
      x, y = data(seed)
      x.requires_grad_(True)
      (gx,) = torch.autograd.grad(F.mse_loss(m(x), y), x)
      F.mse_loss(m((x + 0.1 * gx.sign()).detach()), y).backward()
      o.step()
      o.zero_grad()
  assert_models_close(fm, ref)


# --- forwards dropped without a backward -------------------------------------


def test_a_skipped_batch_does_not_block_the_next():
  ref, fm = pair()
  o_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
  o_f = forge_torch.Adam(fm.parameters(), lr=1e-2)
  for m, o in ((ref, o_r), (fm, o_f)):
    for i, seed in enumerate((1, 2, 3)):
      x, y = data(seed)
      loss = F.mse_loss(m(x), y)
      if i == 1:  # judged bad (non-finite, an outlier): skipped
        del loss
        continue
      loss.backward()
      o.step()
      o.zero_grad()
  assert_models_close(fm, ref)


def test_a_forward_that_raised_can_be_retried():
  class FailOnce(nn.Module):
    failed = False

    def forward(self, h):
      if not self.failed:
        self.failed = True
        raise MemoryError("simulated OOM")
      return h

  ref, fm = pair()
  ref.append(FailOnce())
  fm.append(FailOnce())
  o_r = torch.optim.SGD(ref.parameters(), lr=0.1)
  o_f = forge_torch.SGD(fm.parameters(), lr=0.1)
  x, y = data()
  for m, o in ((ref, o_r), (fm, o_f)):
    for _ in range(2):
      try:
        loss = F.mse_loss(m(x), y)
      except MemoryError:
        o.zero_grad()
        continue
      loss.backward()
      o.step()
      o.zero_grad()
  assert_models_close(fm, ref)


def test_a_live_graph_still_counts_as_the_steps_one_use():
  _, fm = pair()
  opt = forge_torch.Adam(fm.parameters(), lr=1e-2)
  x, _ = data()
  out = fm(x)  # kept alive: its backward may still update the weights
  with pytest.raises(RuntimeError, match="second time before optimizer.step"):
    fm(x)
  del out  # dropped without a backward: the layer may run again
  fm(x).sum().backward()
  opt.step()


# --- zero_grad(set_to_none=False) --------------------------------------------


def test_stale_zero_grad_after_a_standard_step_is_not_a_second_consumer():
  # Step 1 runs layer 0 on the standard path (fused=False: torch's step
  # updates it); zero_grad(set_to_none=False) must not leave a zero .grad
  # that the next fused step would read as a tied weight's second gradient.
  ref, fm = pair()
  o_r = torch.optim.SGD(ref.parameters(), lr=0.1)
  o_f = forge_torch.SGD(fm.parameters(), lr=0.1)
  x, y = data()
  for i in range(3):
    fm[0].fused = i != 0
    for m, o in ((ref, o_r), (fm, o_f)):
      F.mse_loss(m(x), y).backward()
      o.step()
      o.zero_grad(set_to_none=False)
  assert_models_close(fm, ref)
  assert fm[0].weight.grad is None and fm[0].bias.grad is not None


@pytest.mark.parametrize("family,kwargs", [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    ("Adam", dict(lr=1e-2, weight_decay=1e-2))])
def test_a_modules_zero_grad_leaves_no_second_consumer(family, kwargs):
  """nn.Module.zero_grad(set_to_none=False) (the module's, which forge_torch
  does not see) leaves a zero .grad on a weight whose layer ran unfused.
  In the next step torch steps from 0 + G, which the fused update applied;
  step() drops the zero .grad instead of calling it a tied weight's second
  gradient, and torch's own step does not update the weight again (Adam
  would move it with a zero gradient)."""
  ref, fm = pair()
  o_r = getattr(torch.optim, family)(ref.parameters(), **kwargs)
  o_f = getattr(forge_torch, family)(fm.parameters(), **kwargs)
  x, y = data()
  for i in range(4):
    fm[0].fused = i != 0
    calls = forge_torch.bridge_stats.calls
    for m, o in ((ref, o_r), (fm, o_f)):
      F.mse_loss(m(x), y).backward()
      o.step()
      m.zero_grad(set_to_none=False)
    assert forge_torch.bridge_stats.calls - calls == (1 if i == 0 else 2)
  assert_models_close(fm, ref)
  for pf, pr in zip(fm.parameters(), ref.parameters()):
    for k, v in o_r.state[pr].items():
      assert rel(o_f.state[pf][k], v) <= TOL, k
  assert fm[0].weight.grad is None and fm[0].bias.grad is not None


def test_a_nonzero_leftover_grad_of_an_unfused_step_is_refused():
  """Without a zero_grad() after a step its layer ran unfused, the weight's
  .grad keeps that step's gradient, which torch would add to the next
  one's; the fused update cannot, so step() refuses, naming the cause."""
  _, fm = pair()
  opt = forge_torch.SGD(fm.parameters(), lr=0.1)
  x, y = data()
  fm[0].fused = False
  F.mse_loss(fm(x), y).backward()
  opt.step()
  fm[0].fused = True
  F.mse_loss(fm(x), y).backward()
  with pytest.raises(RuntimeError, match=(
      r"managed 0\.weight .*nonzero ordinary gradient.*gradient left from an "
      r"earlier step.*fused = False.*optimizer.zero_grad\(\)")):
    opt.step()


@pytest.mark.parametrize("case", ["leftover", "window", "int8", "clipped"])
def test_a_refused_ordinary_gradient_says_how_to_close_the_step(case):
  """step()'s refusals of a managed weight's ordinary gradient: a
  gradient left from an unfused step, a layer run unfused for one
  micro-batch of an accumulation window (named as such, not as an update
  applied), an unfused layer under quantized moments, a weight used twice
  in a clipped step's closure. Each says that the step stays open and how
  to close it; doing so (zero_grad(), then step(), or with max_grad_norm
  step(lambda: None)) lets training go on."""
  torch.manual_seed(0)
  width = 64 if case == "int8" else 8  # (int8 codes from 4096 elements)
  model = nn.Sequential(nn.Linear(width, width), nn.Tanh(),
                        nn.Linear(width, width))
  forge_torch.convert(model)
  g = torch.Generator().manual_seed(1)
  x, y = torch.randn(4, width, generator=g), torch.randn(4, width, generator=g)
  loss = lambda: F.mse_loss(model(x), y).backward()  # noqa: E731
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2,
                          moments="int8" if case == "int8" else None,
                          max_grad_norm=1.0 if case == "clipped" else None)
  close = opt.step
  if case == "clipped":
    def twice():  # the managed weight read again beside its layer
      opt.zero_grad()
      out = F.mse_loss(model(x), y) + model[2].weight.square().sum()
      out.backward()
      return out
    match = "nonzero ordinary gradient"
    step = lambda: opt.step(twice)  # noqa: E731
    close = lambda: opt.step(lambda: None)  # noqa: E731
  elif case == "window":
    opt.accumulate_steps = 2
    loss()
    model[2].fused = False
    loss()
    match = r"accumulation window \(accumulate_steps=2\).*fused = False"
  elif case == "leftover":
    model[2].fused = False
    loss()
    opt.step()  # (no zero_grad(): the unfused step's gradient stays)
    model[2].fused = True
    loss()
    match = "nonzero ordinary gradient"
  else:
    loss()
    opt.step()
    opt.zero_grad()
    model[2].fused = False
    loss()
    match = "int8 codes"
  if case != "clipped":
    step = opt.step
  how = (r"optimizer\.step\(lambda: None\)" if case == "clipped"
         else r"optimizer\.step\(\) again")
  with pytest.raises(RuntimeError, match=match + r".*step stays open.*"
                     r"optimizer\.zero_grad\(\).*" + how):
    step()
  opt.zero_grad()
  close()
  model[2].fused = True
  before = model[0].weight.detach().clone()
  if case == "clipped":
    opt.step(lambda: (opt.zero_grad(), loss()))
  else:
    for _ in range(opt.accumulate_steps):
      loss()
    opt.step()
  assert not torch.equal(model[0].weight, before)


def test_a_modules_zero_grad_then_a_step_without_the_layer_is_torchs():
  """A zero .grad left by the module's zero_grad(set_to_none=False) on a
  managed weight whose layer then runs no backward: torch steps the weight
  from the zero gradient (Adam's moments decay and move it), and so does
  forge_torch's step."""
  ref, fm = pair()
  o_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
  o_f = forge_torch.Adam(fm.parameters(), lr=1e-2)
  x, y = data()
  fm[2].fused = False
  for m, o in ((ref, o_r), (fm, o_f)):
    F.mse_loss(m(x), y).backward()
    o.step()
    m.zero_grad(set_to_none=False)
  fm[2].fused = True
  w2 = fm[2].weight.detach().clone()
  for m, o in ((ref, o_r), (fm, o_f)):
    h = m[1](m[0](x))  # layer 2 not run in this step
    F.mse_loss(h, torch.zeros_like(h)).backward()
    o.step()
  assert not torch.equal(fm[2].weight, w2)
  assert_models_close(fm, ref)
  assert o_f.state[fm[2].weight]["step"] == 2


@pytest.mark.parametrize("family,kwargs", [
    ("Adam", dict(lr=1e-2, weight_decay=1e-2)),
    ("SGD", dict(lr=0.1, momentum=0.9))])
def test_zero_grad_without_set_to_none_steps_a_skipped_layer_as_torch(
    family, kwargs):
  """optimizer.zero_grad(set_to_none=False) leaves torch a zero .grad on
  every parameter that had one: in a step a layer skips, torch steps its
  weight from zero (Adam's moments decay and move it, weight decay
  applies; SGD's momentum moves it), and so does forge_torch. After
  zero_grad() (set_to_none=True) the weight's .grad is None, and neither
  steps it until its layer runs again."""
  ref, fm = pair()
  o_r = getattr(torch.optim, family)(ref.parameters(), **kwargs)
  o_f = getattr(forge_torch, family)(fm.parameters(), **kwargs)
  x, y = data()
  # (layer 2 runs, the zero_grad after the step sets to None)
  plan = [(True, False), (False, False), (False, True), (False, False),
          (False, False), (True, False), (False, False)]
  moved = []
  for run, to_none in plan:
    w2 = fm[2].weight.detach().clone()
    for m, o in ((ref, o_r), (fm, o_f)):
      if run:
        loss = F.mse_loss(m(x), y)
      else:
        h = m[1](m[0](x))
        loss = F.mse_loss(h, torch.zeros_like(h))
      loss.backward()
      o.step()
      o.zero_grad(set_to_none=to_none)
    moved.append(not torch.equal(fm[2].weight, w2))
    assert_models_close(fm, ref)
  assert moved == [True, True, True, False, False, True, True]
  for pf, pr in zip(fm.parameters(), ref.parameters()):
    for k, v in o_r.state[pr].items():
      assert rel(o_f.state[pf][k], v) <= TOL, k
  assert fm[2].weight.grad is None


# --- checkpoints and loss scaling --------------------------------------------


@pytest.mark.parametrize("option", ["capturable", "differentiable"])
def test_load_state_dict_refuses_the_options_the_constructor_refuses(option):
  ref, fm = pair()
  sd = torch.optim.Adam(ref.parameters(), lr=1e-2,
                        **{option: True}).state_dict()
  opt = forge_torch.Adam(fm.parameters(), lr=1e-2)
  with pytest.raises(ValueError, match=option):
    opt.load_state_dict(sd)
  assert not opt.param_groups[0].get(option, False)


def test_load_hooks_run_where_torchs_loader_runs_them():
  """A load pre-hook sees the checkpoint before forge_torch's checks (one
  that turns an option the constructor refuses off loads, as in torch),
  with tensors in its state; a post-hook runs once the load has passed
  them, and not for a refused load."""
  ref, fm = pair()
  x, y = data()
  src = torch.optim.AdamW(ref.parameters(), lr=1e-2, capturable=True)
  seen = []

  def pre(opt, sd):
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
      g["capturable"] = False
    seen.append(("pre", sorted({type(v).__name__ for st in sd["state"].values()
                                for v in st.values()})))
    return sd

  opt = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  opt.register_load_state_dict_pre_hook(pre)
  opt.register_load_state_dict_post_hook(
      lambda o: seen.append(("post", o.param_groups[0]["capturable"])))
  opt.load_state_dict(src.state_dict())
  assert seen == [("pre", []), ("post", False)]
  # Quantized moments reach the hook as tensors (int8 codes, fp32 scales).
  layer = forge_torch.Linear(64, 64)
  q = forge_torch.AdamW(layer.parameters(), lr=1e-2, moments="int8")
  layer(torch.randn(4, 64)).square().mean().backward()
  q.step()
  dtypes = []
  q.register_load_state_dict_pre_hook(lambda o, sd: dtypes.extend(
      v.dtype for st in sd["state"].values() for v in st.values()))
  q.load_state_dict(q.state_dict())
  assert torch.int8 in dtypes and torch.float32 in dtypes
  # A refused load (another family's checkpoint) runs no post-hook.
  F.mse_loss(fm(x), y).backward()
  opt.step()
  opt.zero_grad()
  seen.clear()
  other = forge_torch.Adamax(fm.parameters(), lr=1e-2)
  other.register_load_state_dict_post_hook(lambda o: seen.append("post"))
  with pytest.raises(ValueError, match="not Adamax's"):
    other.load_state_dict(opt.state_dict())
  assert seen == [] and not other.state


def test_load_state_dict_in_the_middle_of_a_step_is_refused():
  """A load between a backward that updated managed weights and step()
  would leave them stepped from the replaced state (torch applies their
  gradients at step(), from the loaded one): refused, naming the fix, and
  so is a load inside a gradient-accumulation window. Between steps it
  loads."""
  _, fm = pair()
  opt = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  x, y = data()
  F.mse_loss(fm(x), y).backward()
  opt.step()
  opt.zero_grad()
  ckpt = copy.deepcopy(opt.state_dict())
  F.mse_loss(fm(x), y).backward()
  with pytest.raises(RuntimeError, match=(
      r"load_state_dict\(\) between a backward and optimizer\.step\(\).*"
      r"managed 0\.weight, 2\.weight.*Load before the forward")):
    opt.load_state_dict(ckpt)
  assert opt.state[fm[0].weight]["step"] == 2  # nothing loaded
  opt.step()
  opt.zero_grad()
  opt.load_state_dict(ckpt)
  assert opt.state[fm[0].weight]["step"] == 1
  opt.accumulate_steps = 2
  F.mse_loss(fm(x), y).backward()
  with pytest.raises(RuntimeError, match=(
      r"middle of a gradient-accumulation step \(1 of accumulate_steps=2")):
    opt.load_state_dict(ckpt)


def test_the_swap_conversion_flag_is_refused_clearly():
  """torch.__future__.set_swap_module_params_on_conversion(True) makes
  .to() and load_state_dict swap each parameter's tensor object, which
  torch refuses for a tensor with weak references (forge_torch keeps them
  for its weights): both are refused naming the layer and the fix."""
  _, fm = pair()
  sd = {k: v.clone() for k, v in fm.state_dict().items()}
  torch.__future__.set_swap_module_params_on_conversion(True)
  try:
    with pytest.raises(RuntimeError, match=(
        r"Linear 0: a conversion .* swaps the weight's tensor object.*"
        r"Turn that flag off")):
      fm.to(torch.float64)
    with pytest.raises(RuntimeError, match=(
        r"Linear 2: load_state_dict swaps the weight's tensor object")):
      fm.load_state_dict(sd)
  finally:
    torch.__future__.set_swap_module_params_on_conversion(False)
  fm.load_state_dict(sd)  # the flag off: in place
  assert fm[0].weight.dtype == torch.float32


def test_grad_scaler_is_refused_clearly():
  _, fm = pair()
  opt = forge_torch.SGD(fm.parameters(), lr=1e-2)
  x, y = data()
  scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
  scaler.scale(F.mse_loss(fm(x), y)).backward()
  with pytest.raises(RuntimeError, match="GradScaler"):
    scaler.step(opt)


# --- graphs used more than once, frozen weights, torch.func -----------------


def _pair_with_opts():
  ref, fm = pair()
  return (ref, fm, torch.optim.Adam(ref.parameters(), lr=1e-2),
          forge_torch.Adam(fm.parameters(), lr=1e-2))


def test_input_gradient_with_retain_graph_then_training_backward():
  ref, fm, o_r, o_f = _pair_with_opts()
  gxs = []
  for m, o in ((ref, o_r), (fm, o_f)):
    x, y = data()
    x.requires_grad_(True)
    loss = F.mse_loss(m(x), y)
    (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
    gxs.append(gx)
    loss.backward()  # the same graph, now training
    if m is fm:  # its update applied: a second forward is refused
      with pytest.raises(RuntimeError, match="called a second time"):
        fm(data()[0])
    o.step()
  assert rel(gxs[1], gxs[0]) <= TOL
  assert_models_close(fm, ref)
  F.mse_loss(fm(x), y).backward()  # a new step: allowed again


def test_jacobian_and_repeated_weight_gradients_through_one_graph():
  ref, fm, _, opt = _pair_with_opts()  # opt: kept alive, it owns the layers
  x, _ = data()
  jr = torch.autograd.functional.jacobian(ref, x)
  jf = torch.autograd.functional.jacobian(fm, x)
  assert rel(jf, jr) <= TOL
  sums = []
  for m in (ref, fm):
    y = m(x).square().mean()
    (g0,) = torch.autograd.grad(y, m[0].weight, retain_graph=True)
    (g1,) = torch.autograd.grad(y, m[0].weight)
    sums.append(g0 + g1)
  assert rel(sums[1], sums[0]) <= TOL
  assert_models_close(fm, ref)  # nothing applied


def test_weight_frozen_between_forward_and_backward_is_skipped():
  ref, fm, o_r, o_f = _pair_with_opts()
  for m, o in ((ref, o_r), (fm, o_f)):
    x, y = data()
    loss = F.mse_loss(m(x), y)
    m[0].weight.requires_grad_(False)
    loss.backward()
    o.step()
  assert_models_close(fm, ref)


@pytest.mark.parametrize("transform", ["vmap", "jacrev", "grad"])
def test_torch_func_transforms_run_the_plain_layer(transform):
  ref, fm, _, opt = _pair_with_opts()  # opt: kept alive, it owns the layers
  w0 = fm[0].weight.detach().clone()
  x, _ = data()
  outs = []
  for m in (ref, fm):
    if transform == "vmap":
      outs.append(torch.vmap(m)(x.reshape(1, *x.shape).expand(3, -1, -1)))
    elif transform == "jacrev":
      outs.append(torch.func.jacrev(m)(x[0]))
    else:
      b = m[2].bias.detach().clone()
      f = lambda b, m=m: torch.func.functional_call(
          m, {"2.bias": b}, (x,)).square().mean()
      outs.append(torch.func.grad(f)(b))
  assert rel(outs[1], outs[0]) <= TOL
  assert torch.equal(fm[0].weight, w0)  # nothing trained


def test_an_input_leaked_out_of_a_torch_func_transform_trains_like_torch():
  """A tensor that escaped a finished ``torch.func`` transform is a dead
  functorch wrapper, which torch's ``Function.apply`` unwraps before it
  records the graph: a managed layer does too (else the leaked input of a
  ``requires_grad`` tensor got no gradient), and trains as ``nn.Linear``."""
  ref, fm, o_r, o_f = _pair_with_opts()
  x0, y = data()
  grads = []
  for m, o in ((ref, o_r), (fm, o_f)):
    x = x0.clone().requires_grad_(True)
    leaked = []

    def f(t, leaked=leaked):
      leaked.append(t)
      return t.sum()

    torch.func.grad(f)(x)
    [dead] = leaked
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    F.mse_loss(m(dead), y).backward()
    o.step()
    o.zero_grad()
    grads.append(x.grad)
  assert fm[0].weight.grad is None  # updated by FORGE, no gradient formed
  assert grads[1] is not None and rel(grads[1], grads[0]) <= TOL
  assert_models_close(fm, ref)


# --- copies, hooks, double backward, distributed, late hyperparameters -------


def _train(model, opt, batches):
  for x, y in batches:
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def assert_states_close(o_f, fm, o_r, ref):
  for pf, pr in zip(fm.parameters(), ref.parameters()):
    sf, sr = o_f.state.get(pf, {}), o_r.state.get(pr, {})
    assert sorted(sf) == sorted(sr)
    for k, v in sr.items():
      if isinstance(v, torch.Tensor):
        assert rel(sf[k], v) <= TOL, k


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copied_model_and_optimizer_train_on_like_torch(how):
  import io
  ref, fm = pair()
  o_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
  o_f = forge_torch.Adam(fm.parameters(), lr=1e-2)
  batches = [data(seed) for seed in range(1, 5)]
  _train(ref, o_r, batches[:2])
  _train(fm, o_f, batches[:2])
  if how == "deepcopy":
    ref2, o_r2 = copy.deepcopy((ref, o_r))
    # optimizer first: the copy must mark the weights itself
    o_f2, fm2 = copy.deepcopy((o_f, fm))
  else:
    buf = io.BytesIO()
    torch.save({"m": fm, "o": o_f, "r": ref, "or": o_r}, buf)
    buf.seek(0)
    d = torch.load(buf, weights_only=False)
    fm2, o_f2, ref2, o_r2 = d["m"], d["o"], d["r"], d["or"]
  assert len(o_f2.managed_params) == 2
  assert all(p is q for p, q in zip(o_f2.managed_params,
                                    [fm2[0].weight, fm2[2].weight]))
  _train(ref2, o_r2, batches[2:])
  _train(fm2, o_f2, batches[2:])
  assert_models_close(fm2, ref2)
  assert_states_close(o_f2, fm2, o_r2, ref2)
  # the originals are untouched by the copies' training
  assert_models_close(fm, ref)


def test_a_copied_optimizer_alone_steps():
  """A deep copy of the optimizer (without its model) holds its own copies
  of the parameters and state: stepping it runs, and leaves the original
  model and optimizer as they were."""
  _, fm = pair()
  o_f = forge_torch.SGD(fm.parameters(), lr=0.1, momentum=0.9)
  _train(fm, o_f, [data()])
  params = [p.detach().clone() for p in fm.parameters()]
  bufs = [o_f.state[p]["momentum_buffer"].clone() for p in fm.parameters()]
  o2 = copy.deepcopy(o_f)
  copied = o2.param_groups[0]["params"]
  assert all(q is not p for q, p in zip(copied, fm.parameters()))
  for q in copied:  # a gradient on every copied parameter: step() moves them
    q.grad = torch.ones_like(q)
  before = [q.detach().clone() for q in copied]
  o2.step()
  assert any(not torch.equal(q, b) for q, b in zip(copied, before))
  for p, p0, b0 in zip(fm.parameters(), params, bufs):
    assert torch.equal(p, p0)
    assert torch.equal(o_f.state[p]["momentum_buffer"], b0)


@pytest.mark.parametrize("kind", ["register_hook", "post_accumulate"])
@pytest.mark.parametrize("when", ["before_forward", "after_forward"])
def test_a_gradient_hook_on_a_managed_weight_is_refused(kind, when):
  _, fm = pair()
  opt = forge_torch.SGD(fm.parameters(), lr=0.1, momentum=0.9)
  w = fm[0].weight

  def add_hook():
    if kind == "register_hook":
      w.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    else:
      w.register_post_accumulate_grad_hook(lambda p: None)

  x, y = data()
  w0 = w.detach().clone()
  if when == "before_forward":
    add_hook()
    with pytest.raises(RuntimeError, match="gradient hook"):
      fm(x)
  else:
    loss = F.mse_loss(fm(x), y)
    add_hook()
    with pytest.raises(RuntimeError, match="gradient hook"):
      loss.backward()
  # Refused before any update: the weight and its momentum are untouched.
  assert torch.equal(w, w0)
  assert "momentum_buffer" not in opt.state.get(w, {})


def test_double_backward_through_a_managed_layer_is_refused_clearly():
  _, fm = pair()
  opt = forge_torch.Adam(fm.parameters(), lr=1e-2)
  x, y = data()
  x.requires_grad_(True)
  loss = F.mse_loss(fm(x), y)
  with pytest.raises(RuntimeError, match="create_graph=True.*nn.Linear"):
    torch.autograd.grad(loss, x, create_graph=True)
  assert all(len(opt.state[p]) == 0 for p in opt.managed_params)


def test_multi_process_training_is_refused(monkeypatch):
  """DDP/FSDP reduce gradients across ranks before the update; a managed
  weight never has one, so each rank would step from its own shard."""
  _, fm = pair()
  dist = torch.distributed
  monkeypatch.setattr(dist, "is_available", lambda: True)
  monkeypatch.setattr(dist, "is_initialized", lambda: True)
  monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
  with pytest.raises(RuntimeError, match="one of 2 .*drift apart"):
    forge_torch.AdamW(fm.parameters(), lr=1e-2)
  # A process group started after the optimizer: refused at the update.
  monkeypatch.setattr(dist, "is_initialized", lambda: False)
  opt = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  monkeypatch.setattr(dist, "is_initialized", lambda: True)
  x, y = data()
  with pytest.raises(RuntimeError, match="one of 2"):
    F.mse_loss(fm(x), y).backward()
  assert all(len(opt.state[p]) == 0 for p in opt.managed_params)


@pytest.mark.parametrize("change", ["lr", "tensor_lr_in_place", "betas"])
def test_hyperparameters_changed_between_backward_and_step_are_refused(change):
  _, fm = pair()
  lr = torch.tensor(1e-2) if change == "tensor_lr_in_place" else 1e-2
  opt = forge_torch.Adam(fm.parameters(), lr=lr)
  x, y = data()
  _train(fm, opt, [(x, y)])  # a normal step first: no false alarm
  F.mse_loss(fm(x), y).backward()
  g = opt.param_groups[0]
  if change == "lr":
    g["lr"] = 5e-3
  elif change == "tensor_lr_in_place":
    g["lr"].mul_(0.5)
  else:
    g["betas"] = (0.8, 0.999)
  with pytest.raises(RuntimeError, match="changed between backward and"):
    opt.step()


def test_keys_the_family_does_not_read_may_change_between_backward_and_step():
  """A key torch's family does not define (a tag, a scheduler's note) set
  between backward and step() changes no update: step() runs on, as
  torch's does, and the training matches torch's."""
  ref, fm = pair()
  o_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
  o_f = forge_torch.Adam(fm.parameters(), lr=1e-2)
  for m, o in ((ref, o_r), (fm, o_f)):
    for i in range(3):
      x, y = data(seed=i + 1)
      F.mse_loss(m(x), y).backward()
      o.param_groups[0]["tag"] = f"encoder {i}"
      o.step()
      o.zero_grad()
  assert_models_close(fm, ref)


def test_hyperparameters_changed_before_the_forward_match_torch():
  """The supported place: set them before the forward (a warmup)."""
  ref, fm = pair()
  o_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
  o_f = forge_torch.Adam(fm.parameters(), lr=1e-2)
  for m, o in ((ref, o_r), (fm, o_f)):
    for i in range(4):
      for g in o.param_groups:
        g["lr"] = 1e-2 * (i + 1) / 4
      x, y = data(seed=i + 1)
      F.mse_loss(m(x), y).backward()
      o.step()
      o.zero_grad()
  assert_models_close(fm, ref)


def test_an_lr_set_between_two_layers_backwards_reaches_the_later_layer():
  """A group's scalars are computed once per step and reused by its other
  weights' updates only while its options are unchanged: an lr set during
  the backward (by a hook between the two layers' backwards, undone before
  step()) reaches the layer updated after it, as if each update read the
  group itself."""
  ref, fm = pair()
  o_f = forge_torch.Adam(fm.parameters(), lr=1e-2)
  o_r = torch.optim.Adam([{"params": [ref[0].weight]},
                          {"params": [ref[0].bias, ref[2].weight,
                                      ref[2].bias]}], lr=1e-2)
  g = o_f.param_groups[0]
  for i in range(2):  # step 1 creates the state, step 2 reads it
    lr0 = 1e-2 * (i + 2)  # what layer 0's weight steps with
    x, y = data(seed=i + 1)
    o_r.param_groups[0]["lr"] = lr0
    F.mse_loss(ref(x), y).backward()
    o_r.step()
    o_r.zero_grad()
    h = fm[1](fm[0](x))
    h.register_hook(lambda grad, lr0=lr0: g.__setitem__("lr", lr0))
    F.mse_loss(fm[2](h), y).backward()
    g["lr"] = 1e-2  # as the first update read it: step() accepts it
    o_f.step()
    o_f.zero_grad()
  assert_models_close(fm, ref)


def test_a_step_count_written_outside_the_optimizer_is_read_again():
  """The step count a fused update uses is kept on the host as the
  optimizer last wrote it; a state["step"] changed by anything else (here
  set back in place, as a user or a loaded checkpoint might) is read again,
  so the bias correction follows it as torch's does."""
  def set_back(step):  # before the third step: both counts set back to 1
    step.fill_(1.0)
  o_f = _train_with_a_step_count_changed(3, set_back, fused=True)
  assert all(st["step"].item() == 2.0 for st in o_f.state.values())


def _train_with_a_step_count_changed(steps, change, **kw):
  """AdamW(lr=1e-2, **kw) steps of torch's and forge_torch's on the same
  data, ``change(state["step"])`` applied to every count of both before the
  last step; asserts the models agree; returns forge_torch's optimizer."""
  ref, fm = pair()
  o_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, **kw)
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-2, **kw)
  for i in range(steps):
    for m, o in ((ref, o_r), (fm, o_f)):
      if i == steps - 1:
        for st in o.state.values():
          change(st["step"])
      x, y = data(seed=i + 1)
      F.mse_loss(m(x), y).backward()
      o.step()
      o.zero_grad()
  assert_models_close(fm, ref)
  return o_f


def test_a_step_count_given_new_memory_in_place_is_written_there():
  """A CPU step count is advanced through a view of its memory that the
  optimizer keeps; a state["step"] moved to new memory in place (set_,
  the same tensor object) gets its next count written to the new memory."""
  def move(step):  # before the fourth step: each count moved, value kept
    with torch.no_grad():
      step.set_(step.clone())
  o_f = _train_with_a_step_count_changed(4, move)
  assert all(st["step"].item() == 4.0 for st in o_f.state.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_fused_group_trains_without_host_synchronisation():
  """With a fused group the step count lives on the device: after the first
  step (which creates the state), a whole training step of managed layers
  makes torch wait for the GPU nowhere (torch's sync debug mode raises on
  any synchronising call)."""
  torch.manual_seed(0)
  model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(),
                        nn.Linear(512, 256, bias=False)).cuda().bfloat16()
  assert forge_torch.convert(model) == ["0", "2"]
  opt = forge_torch.AdamW(model.parameters(), lr=1e-3, fused=True)
  x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
  for i in range(3):
    if i == 2:
      torch.cuda.set_sync_debug_mode("error")
    try:
      model(x).float().square().mean().backward()
      opt.step()
      opt.zero_grad(set_to_none=True)
    finally:
      torch.cuda.set_sync_debug_mode("default")
  torch.cuda.synchronize()
  assert forge_torch.bridge_stats.direct > 0, (
      forge_torch.bridge_stats.direct_unavailable)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_step_from_zero_launches_the_fused_update():
  """After zero_grad(set_to_none=False), a bf16 layer skipped in a step is
  stepped from a zero gradient by one fused update on the GPU: AdamW's
  closed form from the state before, within bf16."""
  torch.manual_seed(0)
  model = nn.Sequential(nn.Linear(128, 256, bias=False), nn.Tanh(),
                        nn.Linear(256, 128, bias=False)).cuda().bfloat16()
  assert forge_torch.convert(model) == ["0", "2"]
  lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.99), 1e-8, 0.1
  opt = forge_torch.AdamW(model.parameters(), lr=lr, betas=(b1, b2),
                          eps=eps, weight_decay=wd, fused=True)
  x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
  model(x).float().square().mean().backward()
  opt.step()
  opt.zero_grad(set_to_none=False)
  w = model[2].weight
  st = opt.state[w]
  w0, m0, v0 = (t.detach().float().clone()
                for t in (w, st["exp_avg"], st["exp_avg_sq"]))
  calls = forge_torch.bridge_stats.calls
  model[1](model[0](x)).float().square().mean().backward()  # 2 skipped
  opt.step()
  torch.cuda.synchronize()
  assert forge_torch.bridge_stats.calls - calls == 2  # layer 0, then 2
  m, v = b1 * m0, b2 * v0
  expect = w0 * (1 - lr * wd) - lr * (m / (1 - b1 ** 2)) / (
      (v / (1 - b2 ** 2)).sqrt() + eps)
  assert rel(w, expect) <= tol(jnp.bfloat16)
  assert rel(st["exp_avg"], m) <= tol(jnp.bfloat16)
  assert rel(st["exp_avg_sq"], v) <= tol(jnp.bfloat16)
  assert int(st["step"]) == 2 and not torch.equal(w.float(), w0)


def test_meta_device_init_then_to_empty_keeps_the_layers_managed():
  """Build on the meta device, convert, materialise with to_empty(): the new
  weight Parameters are the layers' weights and stay FORGE-managed."""
  with torch.device("meta"):
    ref = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 3))
  fm = copy.deepcopy(ref)
  assert forge_torch.convert(fm) == ["0", "2"]
  ref.to_empty(device="cpu")
  fm.to_empty(device="cpu")
  torch.manual_seed(0)
  for p in ref.parameters():
    nn.init.normal_(p, std=0.3)
  with torch.no_grad():
    for pf, pr in zip(fm.parameters(), ref.parameters()):
      pf.copy_(pr)
  o_f = forge_torch.Adam(fm.parameters(), lr=1e-2)
  o_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
  assert o_f.managed_params == [fm[0].weight, fm[2].weight]
  for seed in (1, 2):
    x, y = data(seed)
    for m, o in ((ref, o_r), (fm, o_f)):
      F.mse_loss(m(x), y).backward()
      o.step()
      o.zero_grad()
  assert_models_close(fm, ref)


def test_load_state_dict_assign_keeps_the_layer_managed():
  ref, fm = pair()
  fm.load_state_dict(copy.deepcopy(ref.state_dict()), assign=True)
  opt = forge_torch.SGD(fm.parameters(), lr=0.1)
  assert opt.managed_params == [fm[0].weight, fm[2].weight]


def test_a_weight_assigned_by_hand_runs_the_standard_path():
  """`layer.weight = p` (e.g. tying to an embedding after convert) is not
  marked: that layer trains like nn.Linear under torch's step."""
  ref, fm = pair()
  fm[2].weight = nn.Parameter(fm[2].weight.detach().clone())
  o_f = forge_torch.Adam(fm.parameters(), lr=1e-2)
  o_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
  assert o_f.managed_params == [fm[0].weight]
  x, y = data()
  for m, o in ((ref, o_r), (fm, o_f)):
    F.mse_loss(m(x), y).backward()
    o.step()
  assert_models_close(fm, ref)


# --- the version counter ------------------------------------------------------


def _pair_opt(model_fn, opt_name, seed=0, **kw):
  torch.manual_seed(seed)
  m_t = model_fn()
  m_f = copy.deepcopy(m_t)
  forge_torch.convert(m_f)
  return (m_t, getattr(torch.optim, opt_name)(m_t.parameters(), **kw), m_f,
          getattr(forge_torch, opt_name)(m_f.parameters(), **kw))


class _DetachedReuse(nn.Module):
  """``b``'s weight is also read, detached, *earlier* in the graph: that
  read's backward runs after ``b``'s fused update."""

  def __init__(self):
    super().__init__()
    self.a = nn.Linear(4, 4)
    self.b = nn.Linear(4, 4)

  def forward(self, x):
    h = self.a(x) @ self.b.weight.detach().t()
    return self.b(torch.tanh(h))


def test_a_detached_read_of_an_updated_weight_is_refused_not_silent():
  """It computed ``a``'s gradient from ``b``'s updated weight (0.23 off
  torch after one SGD step); the update now bumps the version counter and
  autograd refuses the stale saved tensor."""
  *_, m_f, o_f = _pair_opt(_DetachedReuse, "SGD", lr=0.5)
  with pytest.raises(RuntimeError, match="modified by an inplace operation"):
    m_f(torch.randn(3, 4)).pow(2).sum().backward()


def test_the_fused_update_bumps_the_weight_and_state_versions_like_torch():
  m_t, o_t, m_f, o_f = _pair_opt(lambda: nn.Sequential(nn.Linear(4, 3)),
                                 "Adam", lr=0.1)
  x = torch.randn(2, 4)
  v_t, v_f = m_t[0].weight._version, m_f[0].weight._version
  m_t(x).sum().backward()
  o_t.step()
  m_f(x).sum().backward()
  o_f.step()
  assert m_t[0].weight._version > v_t
  assert m_f[0].weight._version > v_f, "the weight changed, its version not"
  versions = [o_f.state[m_f[0].weight][k]._version
              for k in ("exp_avg", "exp_avg_sq")]
  m_f(x).sum().backward()
  assert [o_f.state[m_f[0].weight][k]._version
          for k in ("exp_avg", "exp_avg_sq")] > versions
  assert rel(m_f[0].weight, m_t[0].weight) > 0  # (moved; parity: elsewhere)


def test_forward_mode_ad_through_a_managed_layer_is_f_linear():
  """A forward-mode dual input (torch.autograd.forward_ad): the layer is
  F.linear, as nn.Linear (it raised torch's 'implement the jvp' error)."""
  import torch.autograd.forward_ad as fwAD
  m_t, _, m_f, _ = _pair_opt(lambda: nn.Sequential(nn.Linear(5, 3)), "Adam")
  x = torch.randn(4, 5)
  with fwAD.dual_level():
    want = fwAD.unpack_dual(m_t(fwAD.make_dual(x, torch.ones_like(x)))).tangent
  with fwAD.dual_level():
    got = fwAD.unpack_dual(m_f(fwAD.make_dual(x, torch.ones_like(x)))).tangent
  torch.testing.assert_close(got, want)


def test_a_hand_tied_weight_used_earlier_in_the_graph_is_refused():
  """The other use's backward runs after the fused update: autograd refuses
  the stale saved weight (docs/torch.md), where the 'tied or shared weight'
  error of opt.step() is not reached. Either way, not silent."""
  torch.manual_seed(0)
  layer = forge_torch.Linear(6, 6)
  opt = forge_torch.AdamW(layer.parameters())  # owns the weight
  x = torch.randn(3, 6, requires_grad=True)
  h = F.linear(x, layer.weight)  # the tied use, earlier in the graph
  with pytest.raises(RuntimeError, match="modified by an inplace operation"):
    layer(torch.tanh(h)).sum().backward()
  assert opt.state[layer.weight]["step"].item() == 1  # the update that ran


# --- skipped steps, discarded optimizers, block configs, zero sizes -----------


def test_a_skipped_step_is_named_in_the_next_forwards_error():
  """Skipping opt.step() after a non-finite loss does not undo the update
  the backward made; the next forward's error names that cause."""
  _, fm = pair()
  opt = forge_torch.AdamW(fm.parameters(), lr=1e-3)
  x, y = data()
  (F.mse_loss(fm(x), y) * float("nan")).backward()
  assert not torch.isfinite(fm[0].weight).all()  # updated in backward
  opt.zero_grad()  # ... and opt.step() skipped
  with pytest.raises(RuntimeError, match="already applied this step's "
                     "update.*a step was skipped.*check the loss before "
                     "backward"):
    fm(x)


def test_a_skipped_loss_still_referenced_is_named_in_the_next_error():
  """A loop that skips a non-finite loss before backward() but keeps the
  variable: the next forward runs while the skipped loss (reassigned only
  after it) still holds the first forward's graph. The error says so, and
  not that a step was skipped (no backward ran, nothing was updated); with
  the loss dropped the loop trains (test_a_skipped_batch_does_not_block_
  the_next)."""
  _, fm = pair()
  opt = forge_torch.AdamW(fm.parameters(), lr=1e-3)
  x, y = data()
  before = fm[0].weight.detach().clone()
  loss = F.mse_loss(fm(x), y)  # judged bad: skipped, but kept  # noqa: F841
  with pytest.raises(RuntimeError, match=r"graph of its first call in this "
                     r"step is alive.*a loss skipped after a non-finite "
                     r"check.*del loss") as e:
    loss = F.mse_loss(fm(x), y)
  assert "step was skipped" not in str(e.value)
  assert torch.equal(fm[0].weight, before)
  del opt
  # Under gradient accumulation the same hint.
  _, fm = pair()
  opt = forge_torch.AdamW(fm.parameters(), lr=1e-3)
  opt.accumulate_steps = 2
  F.mse_loss(fm(x), y).backward()
  loss = F.mse_loss(fm(x), y)  # noqa: F841
  with pytest.raises(RuntimeError, match=r"accumulate_steps=2 times.*a loss "
                     r"skipped after a non-finite check.*del loss") as e:
    loss = F.mse_loss(fm(x), y)
  assert "applied already" not in str(e.value)


def test_a_collected_throwaway_optimizer_hands_the_weights_back():
  """A second forge optimizer over the same weights takes them over; once it
  is garbage-collected, they belong to the first one again, which trains
  exactly as torch's AdamW."""
  import gc
  ref, fm = pair()
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  o_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  throwaway = forge_torch.SGD(fm.parameters(), lr=0.1)
  assert forge_torch.linear.owner_of(fm[0].weight) is throwaway
  assert o_f.managed_params == []
  del throwaway
  gc.collect()
  assert forge_torch.linear.owner_of(fm[0].weight) is o_f
  assert len(o_f.managed_params) == 2
  _train(fm, o_f, [data(s) for s in range(3)])
  _train(ref, o_r, [data(s) for s in range(3)])
  assert_models_close(fm, ref)


def test_a_block_config_of_the_wrong_type_is_refused_where_it_is_given():
  with pytest.raises(TypeError, match="forge_torch.Linear: block_config must "
                     "be a pallas_kernels.BlockConfig or None, got tuple"):
    forge_torch.Linear(8, 4, block_config=(64, 128, 64))
  with pytest.raises(TypeError, match="forge_torch.convert: block_config"):
    forge_torch.convert(nn.Sequential(nn.Linear(8, 4)),
                        block_config={"block_in": 64})
  with pytest.raises(TypeError, match="block_config must be"):
    forge_torch.Linear.from_linear(nn.Linear(8, 4), block_config="64x128x64")


@pytest.mark.parametrize("n_in,n_out", [(0, 4), (4, 0)])
def test_a_zero_size_linear_trains_as_nn_linear(n_in, n_out):
  torch.manual_seed(0)
  ref = nn.Sequential(nn.Linear(n_in, n_out), nn.Linear(n_out, 3))
  fm = copy.deepcopy(ref)
  # The zero-size layers stay nn.Linear; (0, 4) leaves Linear(4, 3) to fuse.
  assert forge_torch.convert(fm) == (["1"] if n_out else [])
  layer = forge_torch.Linear(n_in, n_out)
  assert not forge_torch.is_forge_weight(layer.weight)  # nothing to fuse
  o_f = forge_torch.AdamW(fm.parameters(), lr=1e-2)
  o_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  x, y = torch.randn(5, n_in), torch.randn(5, 3)
  for model, opt in ((fm, o_f), (ref, o_r)):
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
  assert_models_close(fm, ref)


def test_device_powf_computes_a_block_of_steps_per_round_trip(monkeypatch):
  """The fused-Adam bias corrections' pow(beta, t), by torch's own kernel:
  equal to the one-step computation for every t, and computed once per
  block of steps (a device round trip waits for the GPU)."""
  import numpy as np
  from forge_torch import optim as forge_optim
  monkeypatch.setattr(forge_optim, "_POWF", {})
  calls = []
  real_pow = torch.pow
  monkeypatch.setattr(torch, "pow", lambda *a: calls.append(1) or
                      real_pow(*a))
  block = forge_optim._POWF_BLOCK
  for base in (0.9, 0.999):
    for t in (1.0, 2.0, block - 1.0, float(block), block + 1.0, 3.5, 0.1):
      want = np.float32(real_pow(torch.tensor(base, dtype=torch.float32),
                                 torch.tensor(t, dtype=torch.float32)).item())
      assert forge_optim._device_powf(base, t, "cpu") == want, (base, t)
  # Per beta: the block from t=1 (up to t=block), the next from block + 1,
  # one from 3.5; for 0.1 (no fp32 number) a block, then that t alone.
  assert len(calls) == 2 * 5


def test_editing_param_groups_keeps_each_weight_with_its_own_options():
  """A param group removed from ``param_groups`` (the list edited, as
  torch allows): every other managed weight still takes its own group's
  options, as torch's step does; a weight left in no group is refused
  at its layer's forward."""
  torch.manual_seed(0)
  ref = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 11),
                      nn.Tanh(), nn.Linear(11, 3))
  fm = copy.deepcopy(ref)
  forge_torch.convert(fm)
  groups = lambda m: [{"params": list(m[i].parameters()), "lr": lr}
                      for i, lr in ((0, 0.5), (2, 0.1), (4, 0.01))]
  o_r = torch.optim.SGD(groups(ref), lr=0.1, momentum=0.9)
  o_f = forge_torch.SGD(groups(fm), lr=0.1, momentum=0.9)
  x, y = data()
  for step in range(4):
    if step == 1:
      del o_r.param_groups[0], o_f.param_groups[0]
      with pytest.raises(RuntimeError, match="none of its param_groups"):
        fm(x)
      fm[0].fused = False  # (torch: its parameters are no longer stepped)
    for m, o in ((ref, o_r), (fm, o_f)):
      o.zero_grad()
      F.mse_loss(m(x), y).backward()
      o.step()
  assert_models_close(fm, ref)


def test_an_update_that_raised_leaves_no_fresh_state_behind(monkeypatch):
  """The first update of a weight creates its state (SGD's momentum buffer,
  whose first step is torch's ``clone(grad)``); if that update raises (an
  out-of-memory, say), no state is left, and the retried step is still
  torch's first one."""
  from forge_torch import optim as forge_optim  # noqa: PLC0415
  ref, fm = pair()
  kw = dict(lr=0.1, momentum=0.9, dampening=0.5)
  o_r, o_f = torch.optim.SGD(ref.parameters(), **kw), forge_torch.SGD(
      fm.parameters(), **kw)
  x, y = data()
  real = forge_optim._bridge.fused_update  # noqa: SLF001
  calls = []

  def fail_once(*a, **k):
    calls.append(1)
    if len(calls) == 1:
      raise RuntimeError("out of memory (simulated)")
    return real(*a, **k)

  monkeypatch.setattr(forge_optim._bridge,  # noqa: SLF001
                      "fused_update", fail_once)
  try:  # (the graph is freed with the exception: the batch is skipped)
    F.mse_loss(fm(x), y).backward()
  except RuntimeError as e:
    assert "simulated" in str(e)
  else:
    pytest.fail("the simulated failure did not surface")
  assert all(len(o_f.state[p]) == 0 for p in o_f.managed_params)
  o_f.zero_grad()
  for _ in range(3):
    for m, o in ((ref, o_r), (fm, o_f)):
      F.mse_loss(m(x), y).backward()
      o.step()
      o.zero_grad()
  assert_models_close(fm, ref)


def test_a_copied_optimizer_keeps_the_last_clipped_norm():
  """``last_grad_norm`` (max_grad_norm's last measured norm) survives
  ``copy.deepcopy`` of the optimizer, as its other settings do."""
  _, fm = pair()
  opt = forge_torch.AdamW(fm.parameters(), lr=1e-2, max_grad_norm=1.0)
  x, y = data()
  opt.step(lambda: F.mse_loss(fm(x), y).backward())
  assert opt.last_grad_norm is not None
  twin = copy.deepcopy(opt)
  assert torch.equal(twin.last_grad_norm, opt.last_grad_norm)
  assert twin.max_grad_norm == 1.0
  assert copy.deepcopy(forge_torch.SGD(fm.parameters(), lr=0.1)
                       ).last_grad_norm is None


# --- update plans: a weight's next plain update repeats its last one --------


def _count_plans(monkeypatch, plans=True) -> list:
  """Records, per plain update, whether its plan ran (``plans=False``: none
  may run; every update then takes the full path)."""
  cls = forge_torch.optim._ForgeOptimizer
  run_plan = cls._forge_run_plan
  ran = []

  def counted(self, *args):
    ran.append(plans and run_plan(self, *args))
    return ran[-1]

  monkeypatch.setattr(cls, "_forge_run_plan", counted)
  return ran


def _train_planned(monkeypatch, family, kw, steps, between=None, plans=True,
                   named=False):
  """``steps`` steps of a three-layer converted MLP (odd widths, random
  data) with ``forge_torch.<family>(**kw)``; ``between(i, model, opt)``
  runs before step ``i`` (with ``max_grad_norm`` set, the step takes a
  closure). ``plans=False``: every update takes the full path. ``named``:
  the optimizer built from ``model.named_parameters()``. Returns the
  model, the optimizer and how many updates their plan ran."""
  torch.manual_seed(3)
  model = nn.Sequential(nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, 6),
                        nn.Tanh(), nn.Linear(6, 5))
  assert forge_torch.convert(model) == ["0", "2", "4"]
  opt = getattr(forge_torch, family)(
      model.named_parameters() if named else model.parameters(), **kw)
  with monkeypatch.context() as m:
    ran = _count_plans(m, plans)
    g = torch.Generator().manual_seed(4)
    for i in range(steps):
      if between is not None:
        between(i, model, opt)
      x, y = torch.randn(7, 9, generator=g), torch.randn(7, 5, generator=g)

      def closure():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

      if opt.max_grad_norm is None:
        closure()
        opt.step()
      else:  # the forward and backward run twice
        opt.step(closure)
      opt.zero_grad()
  return model, opt, sum(ran)


def _assert_same_training(a, b):
  """Two (model, optimizer) pairs hold bit-identical weights and state."""
  (ma, oa), (mb, ob) = a, b
  for (name, pa), pb in zip(ma.named_parameters(), mb.parameters()):
    assert torch.equal(pa, pb), name
    sa, sb = oa.state[pa], ob.state[pb]
    assert sorted(sa) == sorted(sb), name
    for k in sa:
      va, vb = sa[k], sb[k]
      assert (torch.equal(va, vb) if isinstance(va, torch.Tensor)
              else va == vb), (name, k)


@pytest.mark.parametrize("family,kw", [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.01)),
    ("RMSprop", dict(lr=1e-2, centered=True, momentum=0.5)),
    ("RAdam", dict(lr=1e-2)),
])
def test_repeated_updates_take_their_plan_bit_for_bit(monkeypatch, family,
                                                     kw):
  """From a weight's third update on (the first creates its state, the
  second finds it and keeps the plan; Adagrad's state is made at
  construction: from the second), each update repeats the last one's plan:
  the same bits as the full path, step after step (SGD's, which keeps no
  step count, too)."""
  steps = 5
  planned = _train_planned(monkeypatch, family, kw, steps)
  full = _train_planned(monkeypatch, family, kw, steps, plans=False)
  _assert_same_training(planned[:2], full[:2])
  expected = (steps - 1 if family == "Adagrad" else steps - 2) * 3
  assert planned[2] == expected


def test_an_optimizer_of_named_parameters_takes_its_plans(monkeypatch):
  """Built from named_parameters() (torch keeps the names in each group,
  a list): the same plans, and bits, as from parameters()."""
  kw, steps = dict(lr=1e-2, weight_decay=0.1), 4
  named = _train_planned(monkeypatch, "AdamW", kw, steps, named=True)
  plain = _train_planned(monkeypatch, "AdamW", kw, steps)
  _assert_same_training(named[:2], plain[:2])
  assert named[2] == plain[2] == (steps - 2) * 3


def test_plans_advance_deferred_step_counts_as_the_full_path(monkeypatch):
  """On a GPU a weight's step count is advanced with the others' at the
  step's end (one launch), not after its update; a plan defers it the
  same way (here CPU counts deferred as GPU ones are): the same bits and
  counts as the full path."""
  monkeypatch.setattr(forge_torch.optim, "_defers_step", lambda step: True)
  kw = dict(lr=1e-2, weight_decay=0.1)
  planned = _train_planned(monkeypatch, "AdamW", kw, 5)
  full = _train_planned(monkeypatch, "AdamW", kw, 5, plans=False)
  _assert_same_training(planned[:2], full[:2])
  assert planned[2] == 3 * 3
  assert all(st["step"].item() == 5.0 for st in planned[1].state.values())


def _scale_lr(opt):
  for g in opt.param_groups:
    g["lr"] *= 0.5


def _new_slots(opt):
  for st in opt.state.values():
    for k in ("exp_avg", "exp_avg_sq"):
      st[k] = st[k].clone()


def _count_back(opt):
  for st in opt.state.values():
    st["step"].fill_(1.0)


def _reload(opt):
  opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _step_memory_replaced(opt):  # .data =: no version bump, new memory
  for st in opt.state.values():
    st["step"].data = torch.full_like(st["step"], 50.0)


def _new_group(opt):  # added first: the managed weights' group moves
  extra = nn.Parameter(torch.zeros(3))
  opt.add_param_group({"params": [extra], "lr": 1e-3})
  opt.param_groups.insert(0, opt.param_groups.pop())


def _clip_on(opt):
  opt.max_grad_norm = 0.05


def _accumulate_on(opt):  # each step then applies its one micro-batch
  opt.accumulate_steps = 2


@pytest.mark.parametrize("change", [
    _scale_lr, _new_slots, _count_back, _step_memory_replaced, _reload,
    _new_group, _clip_on, _accumulate_on,
], ids=["lr", "slots-replaced", "step-count-written", "step-count-data-set",
        "load_state_dict", "group-added", "max_grad_norm",
        "accumulate_steps"])
def test_a_change_between_steps_is_seen_by_the_plan(monkeypatch, change):
  """What a plan repeats is checked before it runs: an lr set (a
  scheduler), state tensors replaced, a step count written, a loaded state
  dict, a new param group, clipping or accumulation turned on -- each
  between two steps with plans in use -- trains bit for bit as the full
  path does, and the plans run again once the change has been taken in
  (clipping, accumulation: never, while it is on)."""
  def between(i, model, opt):
    if i == 3:
      change(opt)

  kw = dict(lr=1e-2, weight_decay=0.1)

  def train(plans):
    return _train_planned(monkeypatch, "AdamW", kw, 6, between, plans)

  planned, full = train(True), train(False)
  _assert_same_training(planned[:2], full[:2])
  if change is _step_memory_replaced:  # counted on from 50, as torch does
    assert all(st["step"].item() == 53.0
               for st in planned[1].state.values())
  # Of the six steps, the first creates the state, the second makes the
  # plans and the third runs them; after the change the full path runs
  # once (making the plans again), then the plans (clipping, accumulation:
  # never; a new lr: the plans run on, forming the group's scalars anew).
  assert planned[2] == {_clip_on: 3, _accumulate_on: 3,
                        _scale_lr: 3 * 4}.get(change, 3 * 3)


def test_plans_run_under_an_lr_scheduler(monkeypatch):
  """An lr scheduler replaces the group's lr every step: the plans run on
  (the group's scalars formed anew by the step's first update), with the
  full path's bits."""
  def schedule(i, model, opt):
    if i == 0:
      opt.scheduler = torch.optim.lr_scheduler.LambdaLR(
          opt, lambda n: 1.0 / (1 + n))
    else:
      opt.scheduler.step()

  kw = dict(lr=1e-2, weight_decay=0.1)
  planned = _train_planned(monkeypatch, "AdamW", kw, 6, schedule)
  full = _train_planned(monkeypatch, "AdamW", kw, 6, schedule, plans=False)
  _assert_same_training(planned[:2], full[:2])
  assert planned[1].param_groups[0]["lr"] == pytest.approx(1e-2 / 6)
  assert planned[2] == 4 * 3


def _same_as_the_full_path(train) -> list:
  """``train(plans)`` -> ``(model, optimizer, ran)``, with plans and
  without: the same bits; returns whether each update's plan ran."""
  planned, full = train(True), train(False)
  _assert_same_training(planned[:2], full[:2])
  assert not any(full[2])
  return planned[2]


def test_a_layer_on_3d_inputs_repeats_its_plan(monkeypatch):
  """A transformer's (batch, sequence, features) activations: each update
  after a weight's first repeats its plan (taking the operands as rows),
  with the bits of the full path."""
  def train(plans):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 3))
    forge_torch.convert(model)
    opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with monkeypatch.context() as m:
      ran = _count_plans(m, plans)
      for _ in range(4):
        x = torch.randn(2, 5, 6, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt, ran

  ran = _same_as_the_full_path(train)
  assert ran == [True] * 4  # (the third step on: as for 2-d inputs)


@pytest.mark.parametrize("option,value", [("momentum", 0.0),
                                          ("nesterov", True)],
                         ids=["momentum-off", "nesterov-on"])
def test_a_plan_made_under_other_options_is_not_run_with_the_new_rule(
    monkeypatch, option, value):
  """A group option that changes the rule (SGD's momentum, nesterov) set
  between steps, in a step where one layer does not run: the other
  layer's update forms the group's new rule; the skipped layer's plan,
  made under the old rule, is not run with the new rule's scalars when
  the layer runs again (its update takes the full path): the bits of
  training with no plans."""
  def train(plans):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(4, 3))
    forge_torch.convert(model)
    opt = forge_torch.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    with monkeypatch.context() as m:
      ran = _count_plans(m, plans)
      for i in range(6):
        x = torch.randn(5, 4, generator=g)
        if i == 3:
          opt.param_groups[0][option] = value
        # The first layer skips step 3. (Its forward first, its backward
        # last: in step 4 the second layer's plan runs first, under the
        # new rule.)
        first = model[0](x).square().sum() if i != 3 else 0.0
        loss = first + model[1](x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt, ran

  ran = _same_as_the_full_path(train)
  assert any(ran)


def test_a_group_dict_replaced_within_a_step_is_read_again(monkeypatch):
  """param_groups rebuilt between two backwards of one step (the two
  weights trading groups of other lrs): the later update reads its new
  group, as the full path does, not the group its plan was made in."""
  def train(plans):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=False),
                          nn.Linear(4, 3, bias=False))
    forge_torch.convert(model)
    a, b = model[0].weight, model[1].weight
    opt = forge_torch.SGD([{"params": [a], "lr": 0.1},
                           {"params": [b], "lr": 0.01}], momentum=0.9)
    g = torch.Generator().manual_seed(1)
    with monkeypatch.context() as m:
      ran = _count_plans(m, plans)
      for i in range(4):
        x = torch.randn(5, 4, generator=g)
        la, lb = model[0](x).square().sum(), model[1](x).square().sum()
        la.backward()
        if i == 3:
          g0, g1 = opt.param_groups
          opt.param_groups[:] = [{**g0, "params": [b]}, {**g1, "params": [a]}]
        lb.backward()
        opt.step()
        opt.zero_grad()
    return model, opt, ran

  ran = _same_as_the_full_path(train)
  assert ran[-1] is False and sum(ran) == 3


def test_a_weight_moved_to_another_group_by_its_params_list_takes_it(
    monkeypatch):
  """A managed weight moved to another param group by editing the groups'
  ``"params"`` lists between steps (the group dicts and the list the
  same objects) is stepped with its new group's options from the next
  step on, as torch.optim steps it, plans or not."""
  def train(plans, family=forge_torch.AdamW, linear=forge_torch.Linear):
    torch.manual_seed(0)
    a, b = linear(7, 5, bias=False), linear(7, 5, bias=False)
    opt = family([{"params": [a.weight]}, {"params": [b.weight], "lr": 0.3}],
                 lr=0.01)
    g = torch.Generator().manual_seed(1)
    with monkeypatch.context() as m:
      ran = _count_plans(m, plans)
      for i in range(5):
        x = torch.randn(3, 7, generator=g)
        if i == 2:
          opt.param_groups[0]["params"].remove(a.weight)
          opt.param_groups[1]["params"].append(a.weight)
        (a(x).square().sum() + b(x).square().sum()).backward()
        opt.step()
        opt.zero_grad()
    return nn.Sequential(a, b), opt, ran

  ran = _same_as_the_full_path(train)
  # Steps 3 and 4: step 1's plans were dropped when step 2 read the
  # groups again (its updates took the full path and made new ones).
  assert sum(ran) == 2 * 2
  ref = train(False, torch.optim.AdamW, nn.Linear)[0]
  for pf, pr in zip(train(True)[0].parameters(), ref.parameters()):
    assert rel(pf, pr) <= TOL


def test_a_weight_appended_to_a_groups_params_list_is_trained():
  """A managed weight left out of the optimizer (frozen at first), then
  appended to a param group's ``"params"`` list -- torch.optim trains such
  a parameter from the next step on -- is registered at its layer's next
  forward and trained as torch's; one appended to two forge_torch
  optimizers' groups is refused, naming the fix."""
  def train(family, linear):
    torch.manual_seed(0)
    body, head = linear(7, 6), linear(6, 5, bias=False)
    head.weight.requires_grad_(False)
    opt = family(body.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
      if i == 2:
        head.weight.requires_grad_(True)
        opt.param_groups[0]["params"].append(head.weight)
      head(torch.tanh(body(torch.randn(3, 7, generator=g)))).square().sum(
          ).backward()
      opt.step()
      opt.zero_grad()
    return nn.Sequential(body, head), opt

  model, opt = train(forge_torch.AdamW, forge_torch.Linear)
  ref, ref_opt = train(torch.optim.AdamW, nn.Linear)
  assert any(p is model[1].weight for p in opt.managed_params)
  for pf, pr in zip(model.parameters(), ref.parameters()):
    assert rel(pf, pr) <= TOL
  sf, sr = opt.state[model[1].weight], ref_opt.state[ref[1].weight]
  assert rel(sf["exp_avg_sq"], sr["exp_avg_sq"]) <= TOL
  assert float(sf["step"]) == float(sr["step"]) == 2.0

  lin = forge_torch.Linear(7, 5)
  first = forge_torch.SGD([lin.bias], lr=0.1)
  second = forge_torch.SGD([lin.bias], lr=0.1)
  for o in (first, second):
    o.param_groups[0]["params"].append(lin.weight)
  with pytest.raises(RuntimeError, match="groups of 2 forge_torch optimizers"):
    lin(torch.randn(3, 7))

  # Appended to a second optimizer's list while the first still holds it
  # (torch's two optimizers would each step it): refused by the second,
  # at its step() when none of its layers ran, else at their forward.
  held = forge_torch.Linear(7, 5)
  owner = forge_torch.AdamW(held.parameters(), lr=0.01)
  other = forge_torch.AdamW([nn.Parameter(torch.zeros(2))], lr=0.01)
  other.param_groups[0]["params"].append(held.weight)
  held(torch.randn(3, 7)).square().sum().backward()
  owner.step()
  with pytest.raises(RuntimeError, match=(
      r"in this optimizer's param_groups\[0\] \(appended(.|\n)*"
      "forge_torch.AdamW holds it in its own groups")):
    other.step()
  mine = forge_torch.Linear(7, 5)
  other = forge_torch.AdamW(mine.parameters(), lr=0.01)
  other.param_groups[0]["params"].append(held.weight)
  with pytest.raises(RuntimeError, match="holds it in its own groups"):
    mine(torch.randn(3, 7))


def test_appended_weights_in_a_shared_block_moved_and_resumed():
  """Appended weights beyond the plain case: parameters bound to slices of
  one memory block (their counters their own: registering one during a
  forward must not bump the others', which earlier layers' graphs saved);
  a weight moved from one optimizer's list to another's, its layer the
  first to run (trained by the second from that forward on, as torch's
  two optimizers train it); an int8 state resumed into an optimizer whose
  list the weight was appended to before the load (its codes loaded as
  codes, the step then equal to the uninterrupted one)."""
  def block(family, linear):
    torch.manual_seed(0)
    body, head = linear(7, 6, bias=False), linear(6, 5, bias=False)
    buf = torch.randn(72)
    with torch.no_grad():
      body.weight.data = buf[:42].view(6, 7)
      head.weight.data = buf[42:].view(5, 6)
    head.weight.requires_grad_(False)
    opt = family([body.weight], lr=0.01)
    for i in range(4):
      if i == 2:
        head.weight.requires_grad_(True)
        opt.param_groups[0]["params"].append(head.weight)
      head(torch.tanh(body(torch.ones(3, 7) * i))).square().sum().backward()
      opt.step()
      opt.zero_grad()
    return body, head

  for pf, pr in zip(block(forge_torch.AdamW, forge_torch.Linear),
                    block(torch.optim.AdamW, nn.Linear)):
    assert rel(pf.weight, pr.weight) <= TOL

  def moved(family, linear, first):
    # ``first``: the moved layer runs first in the step, else after a
    # layer of the optimizer it moves to (which reads its lists first).
    torch.manual_seed(0)
    head, body = linear(7, 6, bias=False), linear(6, 5)
    own = [] if first else list(body.parameters())
    a = family([head.weight, *([] if own else body.parameters())], lr=0.01)
    b = family([nn.Parameter(torch.zeros(1)), *own], lr=0.05)
    for i in range(4):
      if i == 2:
        a.param_groups[0]["params"].remove(head.weight)
        b.param_groups[0]["params"].append(head.weight)
      x = torch.ones(3, 7) * (i + 1)
      if first:
        loss = head(x).square().sum() + body(x[:, :6]).square().sum()
      else:
        loss = body(x[:, :6]).square().sum() + head(x).square().sum()
      loss.backward()
      for o in (a, b):
        o.step()
        o.zero_grad()
    return head, b

  for first in (True, False):
    (hf, bf), (hr, br) = (moved(forge_torch.AdamW, forge_torch.Linear, first),
                          moved(torch.optim.AdamW, nn.Linear, first))
    assert rel(hf.weight, hr.weight) <= TOL, first
    assert float(bf.state[hf.weight]["step"]) == 2.0

  def make():
    torch.manual_seed(0)
    body, head = forge_torch.Linear(8, 64), forge_torch.Linear(64, 64,
                                                               bias=False)
    head.weight.requires_grad_(False)
    return body, head, forge_torch.AdamW(body.parameters(), lr=0.01,
                                         moments="int8")

  def train(body, head, opt, i):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
    head(torch.tanh(body(x))).square().sum().backward()
    opt.step()
    opt.zero_grad()

  body, head, opt = make()
  for i in range(3):
    if i == 1:
      head.weight.requires_grad_(True)
      opt.param_groups[0]["params"].append(head.weight)
    train(body, head, opt, i)
  saved = (copy.deepcopy(body.state_dict()), copy.deepcopy(head.state_dict()),
           copy.deepcopy(opt.state_dict()))
  train(body, head, opt, 3)
  body2, head2, opt2 = make()
  body2.load_state_dict(saved[0])
  head2.load_state_dict(saved[1])
  head2.weight.requires_grad_(True)
  opt2.param_groups[0]["params"].append(head2.weight)
  opt2.load_state_dict(saved[2])
  assert opt2.state[head2.weight]["exp_avg"].dtype == torch.int8
  train(body2, head2, opt2, 3)
  assert torch.equal(head2.weight, head.weight)
  for k, v in opt.state[head.weight].items():
    assert torch.equal(opt2.state[head2.weight][k], v), k


def test_a_slot_refused_by_a_changed_option_is_refused_with_plans():
  """A bfloat16 weight with float32 momentum (allowed unfused) and then
  ``fused=True`` set on its group, which refuses that mix as torch's fused
  SGD does: the next update raises, whether or not a plan was made for
  the weight (none is made for a slot unlike its weight)."""
  torch.manual_seed(0)
  lin = forge_torch.Linear(7, 5, bias=False)
  opt = forge_torch.SGD(lin.parameters(), lr=0.01, momentum=0.9)
  x = torch.randn(3, 7)
  lin(x).square().sum().backward()  # float32 momentum
  opt.step()
  lin.to(torch.bfloat16)
  for _ in range(2):  # a plan would be made and run here
    lin(x.bfloat16()).float().square().sum().backward()
    opt.step()
  opt.param_groups[0]["fused"] = True
  with pytest.raises(RuntimeError, match="momentum_buffer' is torch.float32"):
    lin(x.bfloat16()).float().square().sum().backward()


def test_an_lr_set_during_a_backward_reaches_the_later_plans(monkeypatch):
  """A plan uses its group's shared scalars only while the group holds the
  very same options, else forms them anew: an lr set between two layers'
  backwards (undone before step()) reaches the layers updated after it,
  plans or not."""
  def train(plans):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, 6),
                          nn.Tanh(), nn.Linear(6, 5))
    forge_torch.convert(model)
    opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(4)
    group = opt.param_groups[0]
    with monkeypatch.context() as m:
      ran = _count_plans(m, plans)
      for i in range(5):
        x, y = torch.randn(7, 9, generator=g), torch.randn(7, 5, generator=g)
        h = model[1](model[0](x))
        if i >= 3:  # layer 0's update steps with a larger lr
          h.register_hook(lambda grad: group.__setitem__("lr", 5e-2))
        F.mse_loss(model[2:](h), y).backward()
        group["lr"] = 1e-2
        opt.step()
        opt.zero_grad()
    return model, opt, sum(ran)

  planned, full = train(True), train(False)
  _assert_same_training(planned[:2], full[:2])
  # Steps 2 to 4: every layer's plan; in steps 3 and 4 layer 0's (after
  # the lr set) and then the next step's first forms the group's scalars
  # anew.
  assert planned[2] == 3 * 3
