"""forge_torch in real training code: gradient clipping, torch.compile,
convert()'s report of skipped layers, and errors that name layers by path."""
import copy
import io
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import forge_torch  # noqa: E402
from tests.tolerances import assert_close, tol  # noqa: E402


class Block(nn.Module):

  def __init__(self):
    super().__init__()
    self.fc1 = nn.Linear(8, 16)
    self.fc2 = nn.Linear(16, 4)

  def forward(self, x):
    return self.fc2(torch.relu(self.fc1(x)))


def _model():
  torch.manual_seed(0)
  return nn.Sequential(Block(), nn.Linear(4, 3))


def _backward(model):
  model(torch.randn(5, 8)).square().mean().backward()


def _assert_trained_alike(model, ref):
  """Every parameter of ``model`` within the fp32 parity bar of
  ``ref``'s (tests/tolerances.py), named where it is not."""
  for (name, p), q in zip(model.named_parameters(), ref.parameters(),
                          strict=True):
    assert_close(p.detach().cpu().numpy(), q.detach().cpu().numpy(),
                 tol(np.float32), what=name)


# --- gradient clipping ------------------------------------------------------------

@pytest.mark.parametrize("clip,name", [
    (lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0), "clip_grad_norm_"),
    (lambda ps: torch.nn.utils.clip_grad.clip_grad_norm_(ps, max_norm=1.0),
     "clip_grad_norm_"),
    (lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.1), "clip_grad_value_"),
    (lambda ps: torch.nn.utils.clip_grad_norm_(parameters=ps, max_norm=1.0),
     "clip_grad_norm_"),
    # (torch's own name for this one is a private function's)
    (lambda ps: torch.nn.utils.clip_grads_with_norm_(ps, 1.0,
                                                     torch.tensor(2.0)),
     "clip_grads_with_norm_"),
])
def test_clipping_a_fused_weight_is_refused_by_name(clip, name):
  model = _model()
  forge_torch.convert(model)
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  _backward(model)
  with pytest.raises(RuntimeError, match=rf"^torch\.nn\.utils\.{name}: .*"
                     r"0\.fc1\.weight, 0\.fc2\.weight, "
                     r"1\.weight\).*never exists as a \.grad.*exclude="):
    clip(model.parameters())
  # Clipping the other parameters on purpose is allowed.
  others = [p for p in model.parameters() if not forge_torch.is_forge_weight(p)]
  assert torch.isfinite(torch.nn.utils.clip_grad_norm_(others, 1.0))
  opt.step()
  opt.zero_grad()
  # After step() nothing is pending: clipping (no gradients) is torch's.
  assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0


def test_clipping_refuses_a_fused_weight_holding_a_stale_zero_grad():
  """A module's zero_grad(set_to_none=False) after a step its layers ran
  unfused leaves zero tensors as their grads; once the layers run fused
  again, those zeros are not the weights' gradients, and clipping them
  would leave the weights' real gradients out of the norm: refused."""
  model = _model()
  forge_torch.convert(model)
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  layers = (model[0].fc1, model[0].fc2, model[1])
  for layer in layers:
    layer.fused = False
  _backward(model)
  opt.step()
  model.zero_grad(set_to_none=False)
  assert all(torch.count_nonzero(layer.weight.grad) == 0 for layer in layers)
  for layer in layers:
    layer.fused = True
  _backward(model)
  with pytest.raises(RuntimeError, match=r"0\.fc1\.weight, 0\.fc2\.weight, "
                     r"1\.weight\).*never exists as a \.grad"):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_clipping_matches_torch_without_fused_weights():
  ref, model = _model(), _model()
  forge_torch.convert(model, exclude=["0", "1"])  # nothing managed
  assert not any(forge_torch.is_forge_weight(p) for p in model.parameters())
  forge_torch.SGD(model.parameters(), lr=0.1)
  torch.manual_seed(1)
  _backward(ref)
  torch.manual_seed(1)
  _backward(model)
  # A generator of parameters works as in torch (it is read once).
  got = torch.nn.utils.clip_grad_norm_((p for p in model.parameters()), 0.5)
  want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
  assert torch.equal(got, want)
  for p, q in zip(model.parameters(), ref.parameters()):
    assert torch.equal(p.grad, q.grad)


def test_a_layer_run_unfused_can_be_clipped():
  model = _model()
  forge_torch.convert(model)
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  for layer in (model[0].fc1, model[0].fc2, model[1]):
    layer.fused = False
  _backward(model)
  assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) > 0
  opt.step()


# --- torch.compile ----------------------------------------------------------------

@pytest.mark.parametrize("folded", [False, True],
                         ids=["as_is", "is_exporting_folded"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_keeps_the_fused_update(backend, folded, monkeypatch):
  """torch.compile runs each managed layer eagerly (a graph break), keeping
  its fused update. ``folded``: as Dynamo in torch 2.11 traces it,
  ``torch.compiler.is_exporting()`` is True under torch.compile too; the
  layer reads torch.export's own flag instead, and still updates."""
  if folded:
    monkeypatch.setattr(forge_torch.linear, "_is_exporting", lambda: True)
  torch._dynamo.reset()
  ref, model = _model(), _model()
  forge_torch.convert(model)
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
  compiled = torch.compile(model, backend=backend)
  for _ in range(2):
    x = torch.randn(5, 8)
    compiled(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert model[0].fc1.weight.grad is None  # FORGE's update, not .grad
    opt.step()
    opt.zero_grad()
    ref_opt.step()
    ref_opt.zero_grad()
  _assert_trained_alike(model, ref)


def test_a_compiled_step_holding_backward_keeps_the_fused_update():
  """torch.compile of a whole training step (forward, loss.backward(),
  step, zero_grad): the backward's fused update runs eagerly (Dynamo would
  trace the update's Python from the engine's call), equal to torch's."""
  torch._dynamo.reset()
  ref, model = _model(), _model()
  forge_torch.convert(model)
  opt = forge_torch.SGD(model.parameters(), lr=0.1, momentum=0.9)
  ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

  def train_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss

  compiled = torch.compile(train_step, backend="eager")
  updates = forge_torch.bridge_stats.calls
  for _ in range(2):
    x = torch.randn(5, 8)
    torch.testing.assert_close(compiled(model, opt, x),
                               train_step(ref, ref_opt, x))
  assert forge_torch.bridge_stats.calls - updates == 2 * 3  # fused updates
  _assert_trained_alike(model, ref)


@pytest.mark.parametrize("case", ["cut_short", "from_zero"])
def test_a_compiled_step_applies_its_own_fused_updates(case):
  """A compiled ``step()`` that applies fused updates itself -- a step cut
  short of its ``accumulate_steps`` micro-batches, or one after
  ``zero_grad(set_to_none=False)`` whose backward skipped a layer (torch
  steps it from a zero gradient) -- runs them eagerly (Dynamo cannot trace
  the kernel's call), equal to torch's compiled step."""
  torch._dynamo.reset()
  ref, model = _model(), _model()
  forge_torch.convert(model)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  pairs = ((model, opt), (ref, ref_opt))
  if case == "cut_short":
    opt.accumulate_steps = 3
    for _ in range(2):  # two of three micro-batches
      x = torch.randn(5, 8)
      for m, _o in pairs:
        (m(x).square().mean() / 3).backward()
  else:
    x = torch.randn(5, 8)
    for m, o in pairs:
      m(x).square().mean().backward()
      o.step()
      o.zero_grad(set_to_none=False)
    for m, _o in pairs:  # the head skipped: stepped from zero
      m[0](x).square().mean().backward()
  updates = forge_torch.bridge_stats.calls
  for _m, o in pairs:
    torch.compile(o.step, backend="eager")()
  assert forge_torch.bridge_stats.calls - updates == (
      3 if case == "cut_short" else 1)  # the step's own fused updates
  _assert_trained_alike(model, ref)


def test_a_compiled_clipped_step_runs_its_passes_eagerly():
  """``step(closure)`` with ``max_grad_norm`` inside a compiled function,
  compiled from its first call: the two passes run eagerly (a graph
  break), equal to torch's ``clip_grad_norm_`` + AdamW."""
  torch._dynamo.reset()
  ref, model = _model(), _model()
  forge_torch.convert(model)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.05)
  ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

  def clipped_step(x):
    def closure():
      opt.zero_grad()
      loss = model(x).square().mean()
      loss.backward()
      return loss
    return opt.step(closure)

  compiled = torch.compile(clipped_step, backend="eager")
  for _ in range(2):
    x = torch.randn(5, 8)
    compiled(x)
    ref_opt.zero_grad()
    ref(x).square().mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    assert_close(float(opt.last_grad_norm), float(norm), tol(np.float32),
                 what="the clipped step's gradient norm")
  _assert_trained_alike(model, ref)


def test_a_compiled_layer_that_trains_nothing_is_traced_whole():
  """Compiled under ``torch.no_grad()`` or with ``fused = False``, a
  managed layer is ``nn.Linear``: traced into the graph (``fullgraph=True``
  compiles), no use counted; training afterwards is FORGE's."""
  torch._dynamo.reset()
  ref, model = _model(), _model()
  forge_torch.convert(model)
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
  x = torch.randn(5, 8)
  with torch.no_grad():
    torch.testing.assert_close(
        torch.compile(model, backend="eager", fullgraph=True)(x), ref(x))
  torch._dynamo.reset()
  for m in model.modules():
    if isinstance(m, forge_torch.Linear):
      m.fused = False
  out = torch.compile(model, backend="eager", fullgraph=True)(x)
  torch.testing.assert_close(out, ref(x))
  del out
  for m in model.modules():
    if isinstance(m, forge_torch.Linear):
      m.fused = True
  updates = forge_torch.bridge_stats.calls
  for m, o in ((model, opt), (ref, ref_opt)):
    m(x).square().mean().backward()
    o.step()
    o.zero_grad()
  assert forge_torch.bridge_stats.calls - updates == 3  # fused updates
  _assert_trained_alike(model, ref)


@pytest.mark.parametrize("device,backend", [
    ("cpu", "aot_eager"),
    pytest.param("cuda", "inductor", marks=[
        pytest.mark.gpu, pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="needs a CUDA device for torch")])])
def test_compiled_autograd_keeps_the_fused_update(device, backend):
  """Compiled autograd (each ``loss.backward()``'s graph captured and
  compiled) calls the managed layer's backward from the captured graph;
  it runs eagerly there, as under torch.compile, and applies FORGE's
  update, equal to torch's (on CUDA with the Inductor backend, which
  generates the captured graph's kernels)."""
  from torch._dynamo import compiled_autograd  # noqa: PLC0415
  from torch._dynamo.utils import counters  # noqa: PLC0415
  enable = getattr(compiled_autograd, "_enable", None)
  if enable is None:
    pytest.skip(f"torch {torch.__version__} has no "
                "torch._dynamo.compiled_autograd._enable")
  torch._dynamo.reset()
  ref, model = _model().to(device), _model().to(device)
  forge_torch.convert(model)
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  captures = counters["compiled_autograd"]["captures"]
  updates = forge_torch.bridge_stats.calls
  for _ in range(3):
    x = torch.randn(5, 8, device=device)
    for m, o in ((model, opt), (ref, ref_opt)):
      with enable(torch.compile(backend=backend)):
        m(x).square().mean().backward()
      o.step()
      o.zero_grad()
    assert model[0].fc1.weight.grad is None  # FORGE's update, not .grad
  assert counters["compiled_autograd"]["captures"] > captures
  assert forge_torch.bridge_stats.calls - updates == 3 * 3  # fused updates
  _assert_trained_alike(model, ref)


def _traced(tracer: str, model, x):
  """``model`` traced by ``tracer``, as a callable graph."""
  from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415
  if tracer.startswith("export"):
    return torch.export.export(model, (x,),
                               strict=tracer == "export-strict").module()
  if tracer == "symbolic_trace":
    return torch.fx.symbolic_trace(model)
  return make_fx(model)(x)


@pytest.mark.parametrize("tracer", ["export", "export-strict",
                                    "symbolic_trace", "make_fx"])
def test_tracers_record_the_standard_layer(tracer):
  """torch.export (both modes) and the FX tracers (symbolic_trace,
  make_fx) trace a managed layer as nn.Linear, with a live optimizer and
  autograd on, and count no use of its weight: the graph gives nn.Linear's
  output, and the training step after it is FORGE's, equal to torch's."""
  ref, model = _model(), _model()
  forge_torch.convert(model)
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
  x = torch.randn(5, 8)
  torch.testing.assert_close(_traced(tracer, model, x)(x), ref(x))
  with torch.no_grad():
    torch.testing.assert_close(model(x), ref(x))
  for m in (model, ref):
    m(x).square().mean().backward()
  assert model[0].fc1.weight.grad is None  # FORGE's update, not .grad
  opt.step()
  ref_opt.step()
  _assert_trained_alike(model, ref)


def test_torch_jit_trace_records_the_standard_layer():
  """torch.jit.trace with autograd on records torch's linear, counts no use
  (a training step runs after it), and its trace gives the layer's output."""
  model = _model()
  forge_torch.convert(model)
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  x = torch.randn(5, 8)
  traced = torch.jit.trace(model, (x,))
  with torch.no_grad():
    torch.testing.assert_close(traced(x), model(x))
  before = model[1].weight.detach().clone()
  model(x).square().mean().backward()
  assert model[1].weight.grad is None
  assert not torch.equal(model[1].weight, before)  # updated by its backward
  opt.step()


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated")
def test_torch_jit_script_is_refused_in_plain_words():
  """torch.jit.script cannot compile the layer (its backward is Python):
  refused naming the layer and the tracers that work, and the model is
  left as it was (script would otherwise put what the layer's
  __prepare_scriptable__ returns in its place)."""
  model = _model()
  forge_torch.convert(model)
  with pytest.raises(RuntimeError, match=r"forge_torch.Linear 0\.fc1: "
                     r"torch.jit.script cannot compile it.*torch.jit.trace "
                     r"or torch.export"):
    torch.jit.script(model)
  assert type(model[0].fc1) is forge_torch.Linear


def test_import_does_not_load_dynamo():
  """Importing forge_torch leaves torch._dynamo (seconds to import) unloaded:
  the layer's compile guard above is applied at its first call, not at import.
  """
  code = ("import sys, forge_torch\n"
          "assert 'torch' in sys.modules and 'jax' in sys.modules\n"
          "print(sorted(m for m in sys.modules\n"
          "             if m == 'torch._dynamo' or m.startswith('torch._dynamo.')))")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = subprocess.run([sys.executable, "-c", code], cwd=root,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  assert p.stdout.strip() == "[]", p.stdout


# --- convert() reports what it skips ---------------------------------------------

def test_convert_reports_skipped_layers_with_reasons():
  model = _model()
  model.append(nn.Linear(3, 3).double())
  model.alias = model[0].fc2  # one module under two names
  with pytest.warns(forge_torch.ConvertSkipWarning) as record:
    names = forge_torch.convert(model)
  assert names == ["0.fc1", "1"]
  assert set(names.skipped) == {"0.fc2", "2"}
  assert "0.fc2.weight, alias.weight" in names.skipped["0.fc2"]
  assert "torch.float64" in names.skipped["2"]
  message = str(record[0].message)
  assert "0.fc2:" in message and "2: its weight is torch.float64" in message


def test_convert_says_so_when_the_model_has_no_linear_layer():
  """A model whose linear maps are another type (GPT-2's ``Conv1D``,
  ``x @ W + b`` with a 2-d weight) converts nothing: one warning says so,
  counting those layers by type; a model already holding forge_torch
  layers, or whose linears were all excluded, gets none."""
  class Conv1D(nn.Module):  # as transformers writes it
    def __init__(self, nf, nx):
      super().__init__()
      self.weight = nn.Parameter(torch.randn(nx, nf))
      self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
      return x @ self.weight + self.bias

  model = nn.Sequential(nn.Embedding(10, 4), Conv1D(8, 4), nn.GELU(),
                        Conv1D(4, 8), nn.LayerNorm(4))
  with pytest.warns(forge_torch.ConvertSkipWarning,
                    match=r"found no nn.Linear in this Sequential") as rec:
    assert forge_torch.convert(model) == []
  assert "Conv1D (2)" in str(rec[0].message)
  assert "Embedding" not in str(rec[0].message)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    forge_torch.convert(nn.Sequential(forge_torch.Linear(3, 3), nn.Tanh()))
    forge_torch.convert(nn.Sequential(nn.Linear(3, 3)), exclude="0")


def test_a_weight_made_non_contiguous_after_convert_is_refused_by_name():
  """A transposed tensor loaded with assign=True after convert(): the
  optimizer refuses it at construction, naming the weight; one swapped in
  later (.data) is refused at the forward, before any update of the step."""
  model = _model()
  forge_torch.convert(model)
  sd = model.state_dict()
  sd["0.fc1.weight"] = torch.randn(8, 16).t()
  model.load_state_dict(sd, assign=True)
  assert forge_torch.is_forge_weight(model[0].fc1.weight)
  with pytest.raises(ValueError, match=r"0\.fc1\.weight is not contiguous.*"
                     r"contiguous\(\)"):
    forge_torch.SGD(model.parameters(), lr=0.1)
  model = _model()
  forge_torch.convert(model)
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  before = [p.detach().clone() for p in model.parameters()]
  model[1].weight.data = torch.randn(4, 3).t()
  with pytest.raises(ValueError, match=r"forge_torch.Linear 1 is not "
                     "contiguous"):
    _backward(model)
  # Refused in the forward: no layer of the step was updated.
  assert all(torch.equal(p, q) for p, q in zip(model[0].parameters(), before))
  del opt


def test_weights_sliced_from_one_tensor_are_refused_by_the_optimizer():
  """Weights loaded with assign=True as slices of one tensor (a fused
  checkpoint split in two) share autograd's version counter: FORGE's
  in-place update of one would fail the other's backward, after some
  updates. The optimizer refuses them at construction, naming both; their
  clones train."""
  model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
  forge_torch.convert(model)
  fused = torch.randn(16, 8)
  sd = model.state_dict()
  sd["0.weight"], sd["2.weight"] = fused[:8], fused[8:]
  model.load_state_dict(sd, assign=True)
  match = (r"the managed 0\.weight is a slice of one tensor with other "
           r"parameters \(2\.weight\), sharing autograd's version counter")
  with pytest.raises(ValueError, match=match):
    forge_torch.SGD(model.parameters(), lr=0.1)
  # Whatever the order of the groups: the managed weight first, then the
  # other slice, a layer left unconverted, in a later group.
  other = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
  forge_torch.convert(other, exclude="2")
  other.load_state_dict({**other.state_dict(), "0.weight": fused[:8],
                         "2.weight": fused[8:]}, assign=True)
  with pytest.raises(ValueError, match=r"the managed 0\.weight is a slice "
                     r"of one tensor with other parameters \(a parameter "
                     r"of shape \(8, 8\)\)"):
    forge_torch.SGD([{"params": [other[0].weight]},
                     {"params": [other[2].weight]}], lr=0.1)
  # Slices read from one saved tensor (torch.load) share its memory but
  # not a version counter: they train, as torch's optimizer trains them.
  buffer = io.BytesIO()
  torch.save({"0.weight": fused[:8], "2.weight": fused[8:]}, buffer)
  buffer.seek(0)
  sd.update(torch.load(buffer))
  assert (sd["0.weight"].untyped_storage().data_ptr()
          == sd["2.weight"].untyped_storage().data_ptr())
  model.load_state_dict(sd, assign=True)
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  model(torch.randn(5, 8)).square().mean().backward()
  opt.step()
  assert not torch.equal(model[0].weight, fused[:8])


def test_convert_skips_a_non_contiguous_weight_with_the_fix():
  """A transposed view assigned as the weight: torch.optim trains it, the
  in-place kernel cannot, so convert() leaves the layer nn.Linear and says
  how to make it convertible."""
  model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
  model[0].weight = nn.Parameter(torch.randn(4, 8).t())
  with pytest.warns(forge_torch.ConvertSkipWarning, match="not contiguous"):
    names = forge_torch.convert(model)
  assert names == ["1"] and "contiguous()" in names.skipped["0"]
  assert type(model[0]) is nn.Linear


def test_convert_skips_weights_formed_at_each_forward_and_lazy_layers():
  """weight_norm, spectral_norm and prune (torch.nn.utils' hook-based
  forms) make the weight an attribute formed from other Parameters at each
  forward, which no optimizer holds: skipped with the reason (they were
  switched and reported converted, then trained unfused). A LazyLinear not
  yet materialised is skipped saying to run a forward first."""
  torch.manual_seed(0)
  model = nn.Sequential(nn.utils.weight_norm(nn.Linear(4, 6)),
                        nn.utils.spectral_norm(nn.Linear(6, 6)),
                        nn.Linear(6, 5), nn.LazyLinear(3))
  from torch.nn.utils import prune
  prune.l1_unstructured(model[2], "weight", amount=0.3)
  with pytest.warns(forge_torch.ConvertSkipWarning):
    names = forge_torch.convert(model)
  assert names == []
  for i in ("0", "1", "2"):
    assert "formed from others at each forward" in names.skipped[i], i
    assert type(model[int(i)]) is nn.Linear
  assert "run one forward first" in names.skipped["3"]
  with torch.no_grad():
    model(torch.randn(2, 4))
  with pytest.warns(forge_torch.ConvertSkipWarning):
    assert forge_torch.convert(model) == ["3"]


def test_a_weight_reparametrized_after_convert_warns_once():
  """prune (or a parametrization) applied after convert(): the layer's
  weight is formed at each forward, so it trains on the standard path,
  as torch would train it; the layer says so once, not silently."""
  from torch.nn.utils import parametrize, prune
  torch.manual_seed(0)
  ref = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
  model = copy.deepcopy(ref)
  assert forge_torch.convert(model) == ["0", "2"]
  for m in (ref, model):
    prune.l1_unstructured(m[0], "weight", amount=0.5)
    parametrize.register_parametrization(m[2], "weight", _Double())
  opt = forge_torch.AdamW(model.parameters(), lr=1e-2)
  ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
  x = torch.randn(5, 4)
  with pytest.warns(forge_torch.ConvertSkipWarning) as record:
    for _ in range(2):
      for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
  said = [str(r.message) for r in record
          if issubclass(r.category, forge_torch.ConvertSkipWarning)]
  assert len(said) == 2 and "Linear 0: its weight is no longer" in said[0]
  assert "Linear 2:" in said[1] and "before convert()" in said[1]
  _assert_trained_alike(model, ref)


class _Double(nn.Module):
  def forward(self, w):
    return 2 * w


def test_convert_exclude():
  model = _model()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # an exclusion is not warned about
    names = forge_torch.convert(model, exclude="0")
  assert names == ["1"] and names.skipped == {
      "0.fc1": "excluded (exclude='0')", "0.fc2": "excluded (exclude='0')"}
  assert type(model[0].fc1) is nn.Linear
  with pytest.raises(ValueError, match=r"no module of the model: \['head'\]"):
    forge_torch.convert(_model(), exclude=["head"])
  # "" names the model itself: every module is under it.
  names = forge_torch.convert(_model(), exclude="")
  assert names == [] and len(names.skipped) == 3
  # None excludes nothing; anything else but names is refused as such.
  assert forge_torch.convert(_model(), exclude=None) == ["0.fc1", "0.fc2",
                                                         "1"]
  for bad in (3, b"head", ["0", 1]):
    with pytest.raises(TypeError, match=r"exclude must be a module name \(a "
                       r"str\) or an iterable of them"):
      forge_torch.convert(_model(), exclude=bad)


def test_errors_name_the_layer_by_its_path():
  model = _model()
  forge_torch.convert(model)
  with pytest.raises(RuntimeError, match=r"forge_torch.Linear 0\.fc1 ran with "
                     "autograd on"):
    model(torch.randn(2, 8))
  opt = forge_torch.SGD(model.parameters(), lr=0.1)
  out = model(torch.randn(2, 8))  # its graph alive: the layer counts as used
  with pytest.raises(RuntimeError, match=r"^forge_torch.Linear 0\.fc1 was "
                     "called a second time"):
    model(torch.randn(2, 8))
  del out, opt
  # A layer built directly is named by its path once convert() has seen it.
  direct = nn.Sequential(forge_torch.Linear(8, 4))
  assert forge_torch.convert(direct) == []
  assert direct[0]._layer_name() == "0"
  assert forge_torch.Linear(8, 4)._layer_name() == "Linear(8, 4)"
