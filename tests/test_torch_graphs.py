"""forge_torch in CUDA graphs: Adam / AdamW with fused=True, capturable=True.

The fused updates of managed layers are recorded with the rest of a training
step (``torch.cuda.graph``); each replay forms its step's scalars on the GPU
from the step count and launches the Mosaic GPU kernel directly. CPU tests
check the options, the refusals and that the scalars formed by GPU-style
tensor work equal the eager step's bit for bit; the GPU tests replay.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import forge_torch  # noqa: E402
from forge_torch import optim as _optim  # noqa: E402
from pallas_kernels.rules import pack_host  # noqa: E402
from tests.tolerances import rel_err, tol  # noqa: E402

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("cls", [forge_torch.Adam, forge_torch.AdamW])
def test_capturable_is_taken_with_fused(cls):
  layer = forge_torch.Linear(4, 3)
  opt = cls(layer.parameters(), fused=True, capturable=True)
  assert opt.param_groups[0]["capturable"] and opt.managed_params == [
      layer.weight]
  with pytest.raises(ValueError, match="does not support capturable=True: "
                     "capturable: a CUDA graph can record FORGE's fused "
                     "updates only for Adam and AdamW with fused=True"):
    cls(layer.parameters(), capturable=True)


def test_capturable_is_refused_by_the_other_families():
  layer = forge_torch.Linear(4, 3)
  with pytest.raises(ValueError, match="does not support capturable=True"):
    forge_torch.RMSprop(layer.parameters(), capturable=True)


@pytest.mark.parametrize("decoupled,maximize,tensor_lr", [
    (True, False, False), (False, True, False), (True, False, True)],
    ids=["adamw", "adam-maximize", "adamw-tensor-lr"])
@pytest.mark.parametrize("t", [1, 2, 7, 1000])
def test_captured_scalars_are_the_eager_scalars_bit_for_bit(
    decoupled, maximize, tensor_lr, t):
  # _forge_captured_hparams runs torch ops on the step tensor's device (the
  # GPU in a graph; the CPU here, where _device_powf's torch.pow is the
  # CPU's): the vector it forms equals the host vector of the eager step.
  cls = forge_torch.AdamW if decoupled else forge_torch.Adam
  layer = forge_torch.Linear(4, 3)
  lr = torch.tensor(3e-3, dtype=torch.float64) if tensor_lr else 3e-3
  opt = cls(layer.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
            weight_decay=0.1, maximize=maximize, fused=True)
  group = opt.param_groups[0]
  device = torch.device("cpu")
  rule = _optim._torch_rule("adamw" if decoupled else "adam", amsgrad=False,
                            cuda_fused=True)
  # The eager step's scalars, as _forge_hparams forms them for CUDA fused.
  beta1, beta2, values = opt._forge_betas(group)
  values.update(_optim._cuda_fused_adam_scalars(
      group, beta1, beta2, float(t), device, decoupled))
  eager = pack_host(rule, values)
  # The eager vector takes numpy's sqrt, correctly rounded as CUDA's sqrtf
  # is; torch's CPU sqrt is not always (torch 2.14 on AVX-512 rounds
  # sqrt(1 - 0.95**2) up an ulp). Here the captured ops run on the CPU, so
  # the expected vector takes that one value from torch's CPU sqrt, within
  # an ulp of the eager one. (On the GPU the vectors are equal as they are:
  # test_gpu_cuda_graph_replays_equal_eager_steps.)
  at = rule.hparams.index("bc2_sqrt")
  bc2 = np.float32(1) - _optim._device_powf(
      float(np.float32(group["betas"][1])), float(t), "cpu")
  expected = eager.copy()
  expected[at] = torch.sqrt(torch.tensor(bc2, dtype=torch.float32)).item()
  assert abs(expected[at] - eager[at]) <= np.spacing(np.float32(eager[at]))
  step = torch.tensor(float(t - 1), dtype=torch.float32)  # holds t - 1
  got = opt._forge_captured_hparams(group, rule, step)
  assert got.dtype == torch.float32 and got.shape == expected.shape
  np.testing.assert_array_equal(got.numpy(), expected)
  assert got[rule.hparams.index("step_size")] != 0


def test_check_capture_says_what_cannot_be_recorded():
  layer = forge_torch.Linear(4, 3)
  plain = forge_torch.AdamW(layer.parameters())
  with pytest.raises(RuntimeError, match="fused=True, capturable=True"):
    plain._forge_check_capture(layer.weight, "l")
  other = forge_torch.Linear(4, 3)
  fresh = forge_torch.AdamW(other.parameters(), fused=True, capturable=True)
  with pytest.raises(RuntimeError, match="run a step eagerly before "
                     "capturing"):
    fresh._forge_check_capture(other.weight, "l")
  third = forge_torch.Linear(4, 3)
  rms = forge_torch.RMSprop(third.parameters())
  with pytest.raises(RuntimeError, match="forge_torch.RMSprop forms its "
                     "step's scalars on the host"):
    rms._forge_check_capture(third.weight, "l")


def test_a_captured_update_refuses_differentiable_set_later():
  """As an eager update does (test_unsupported_options_raise), before it
  reads the weight's state."""
  layer = forge_torch.Linear(4, 3)
  opt = forge_torch.AdamW(layer.parameters(), fused=True, capturable=True)
  opt.param_groups[0]["differentiable"] = True
  with pytest.raises(ValueError, match="does not support differentiable"):
    opt._forge_captured_update(layer.weight, torch.randn(2, 3),
                               torch.randn(2, 4), config=None, layer="l")


def test_a_capture_the_kernel_does_not_cover_is_refused_naming_the_layer(
    monkeypatch):
  """The case found only at the launch (the Mosaic GPU kernel does not
  cover it, so no direct launch can be recorded) is refused as the other
  capture refusals are, naming the layer (the bridge's own message names
  none); nothing is marked updated."""
  from forge_torch import _bridge  # noqa: PLC0415

  layer = forge_torch.Linear(4, 3)
  opt = forge_torch.AdamW(layer.parameters(), fused=True, capturable=True)
  layer(torch.randn(2, 4)).square().sum().backward()
  opt.step()

  def refuse(*args, **kwargs):
    raise _bridge.CaptureRefused("only a direct launch can be, and "
                                 "the case is not covered")

  monkeypatch.setattr(_bridge, "fused_update", refuse)
  # (The GPU forms the captured vector; here the launch refuses first.)
  monkeypatch.setattr(opt, "_forge_captured_hparams",
                      lambda group, rule, step: torch.zeros(1))
  with pytest.raises(RuntimeError, match=r"^forge_torch.Linear blocks\.0: "
                     "its fused update cannot be recorded in this CUDA "
                     "graph: only a direct launch can be, and the case is "
                     "not covered$"):
    opt._forge_captured_update(layer.weight, torch.randn(2, 3),
                               torch.randn(2, 4), config=None,
                               layer="blocks.0")
  assert layer.weight not in opt._forge_updated
  # The bridge's own message, for a direct caller of fused_update.
  e = _bridge.CaptureRefused("why")
  assert isinstance(e, RuntimeError) and e.reason == "why"
  assert str(e) == ("forge_torch: this fused update cannot be recorded in "
                    "a CUDA graph: why")


# --- GPU --------------------------------------------------------------------


def _model(seed):
  torch.manual_seed(seed)
  model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
  model = model.cuda().to(torch.bfloat16)
  forge_torch.convert(model)
  return model


def _batches(n):
  g = torch.Generator(device="cuda").manual_seed(1)
  return [(torch.randn(512, 256, device="cuda", generator=g).bfloat16(),
           torch.randn(512, 256, device="cuda", generator=g).bfloat16())
          for _ in range(n)]


def _train_step(model, opt, x, y):
  loss = F.mse_loss(model(x).float(), y.float())
  loss.backward()
  opt.step()
  return loss


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_cuda_graph_replays_equal_eager_steps():
  """A whole training step (forward, backward with the fused updates,
  step() for the biases) captured once and replayed gives the parameters
  and optimizer state of the same steps run eagerly."""
  stats = forge_torch.bridge_stats
  batches = _batches(8)
  eager, graphed = _model(0), _model(0)
  kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True,
            capturable=True)
  opt_e = forge_torch.AdamW(eager.parameters(), **kw)
  opt_g = forge_torch.AdamW(graphed.parameters(), **kw)
  static_x, static_y = (torch.empty_like(t) for t in batches[0])
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):  # warm-up, eagerly (as torch asks)
    for x, y in batches[:3]:
      static_x.copy_(x)
      static_y.copy_(y)
      opt_g.zero_grad(set_to_none=True)
      _train_step(graphed, opt_g, static_x, static_y)
  torch.cuda.current_stream().wait_stream(side)
  for x, y in batches[:3]:
    opt_e.zero_grad(set_to_none=True)
    _train_step(eager, opt_e, x, y)
  graph = torch.cuda.CUDAGraph()
  opt_g.zero_grad(set_to_none=True)
  stats.reset()
  with torch.cuda.graph(graph):
    _train_step(graphed, opt_g, static_x, static_y)
  assert stats.direct == stats.calls == 2, (stats, stats.direct_unavailable)
  before = [p.detach().float() for p in graphed.parameters()]
  assert all(torch.equal(a.float(), b) for a, b in
             zip(eager.parameters(), before))  # the same warm-up steps
  stats.reset()
  for x, y in batches[3:]:
    static_x.copy_(x)
    static_y.copy_(y)
    graph.replay()
    opt_e.zero_grad(set_to_none=True)
    _train_step(eager, opt_e, x, y)
  torch.cuda.synchronize()
  # The eager model's 5 steps x 2 layers; the replays run no host work of
  # the bridge.
  assert stats.calls == stats.direct == 10
  bitwise = []
  for (name, pe), pg, p0 in zip(eager.named_parameters(),
                                graphed.parameters(), before):
    # What the five replayed steps changed, against the eager steps'
    # change: stale scalars (the step count of the capture, say) would
    # scale every update.
    delta_g = pg.detach().float() - p0
    delta_e = pe.detach().float() - p0
    assert delta_e.abs().max() > 0, name
    assert rel_err(delta_g.cpu(), delta_e.cpu()) <= tol("bfloat16"), name
    se, sg = opt_e.state[pe], opt_g.state[pg]
    assert float(se["step"]) == float(sg["step"]) == 8.0, name
    for k in ("exp_avg", "exp_avg_sq"):
      assert rel_err(sg[k].float().cpu(), se[k].float().cpu()) <= tol(
          "bfloat16"), (name, k)
    bitwise.append(torch.equal(pe, pg))
  print("bitwise equal per parameter:", bitwise)


def _assert_capture_refused(model, opt, match):
  """One eager step (state and kernels exist), then a step captured on a
  side stream: refused with ``match``, the first layer's weight left as it
  was."""
  (x, y), = _batches(1)
  _train_step(model, opt, x, y)
  opt.zero_grad(set_to_none=True)
  w0 = model[0].weight.detach().clone()
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with pytest.raises(RuntimeError, match=match):
    with torch.cuda.stream(side), torch.cuda.graph(torch.cuda.CUDAGraph()):
      _train_step(model, opt, x, y)
  torch.cuda.synchronize()
  assert torch.equal(model[0].weight, w0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_capture_of_a_non_capturable_group_is_refused():
  model = _model(0)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-3, fused=True)
  _assert_capture_refused(
      model, opt, "cannot be recorded in this CUDA graph: its param group "
      "was not built with fused=True, capturable=True")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device for torch")
def test_gpu_capture_of_a_case_the_kernel_does_not_cover_names_the_layer():
  """A layer given a Triton tiling takes no direct launch, so its update
  cannot be recorded: refused inside the capture naming the layer, the
  weight left as it was."""
  import pallas_kernels  # noqa: PLC0415

  model = _model(0)
  model[0].block_config = pallas_kernels.BlockConfig.default(512, 256, 512)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-3, fused=True,
                          capturable=True)
  _assert_capture_refused(
      model, opt, "forge_torch.Linear 0: its fused update cannot be "
      "recorded in this CUDA graph: only a direct launch of the Mosaic GPU "
      "kernel can be, and the Mosaic GPU kernel does not cover this case")
