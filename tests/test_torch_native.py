"""forge_torch's native host path (``forge_torch/_hot.cpp``) against the
Python path it stands in for, on the CPU.

The direct launch's path is taken by CPU tensors with only what needs a GPU
stood in for: the device and stream queries, the CUDA events of the
hyperparameter ring (a real ``_HparamsRing``, in ordinary host memory) and
the compiled kernel (a real ``DirectKernel`` whose runtime launch is a
``ctypes`` callback that records its arguments, so that both paths launch
through the same C function, the native one by address). Two identical
models are trained side by side, one with the native path and one without,
through the same changes between and during steps; every update must take
the same path (a plan, or the full path) in both, the launches must get the
same arguments (the same tensors, in the kernel's order, and the same
hyperparameters) and the bookkeeping (step counts and their records,
version counters, the bridge's counters) must agree after every step. The
bits of real launches are compared on the GPU
(``test_gpu_update_plans_relaunch_bit_for_bit``).
"""

import copy
import ctypes
import functools
import importlib.util
import operator
import shutil
import types

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import forge_torch  # noqa: E402
from forge_torch import _bridge, _direct, _hot  # noqa: E402
from forge_torch import optim as forge_optim  # noqa: E402
from benchmarks import torch_overhead  # noqa: E402

STREAM, DEVICE = 0x5000, -1


@pytest.fixture(scope="module")
def native(tmp_path_factory):
  """The native path's compiled functions, ``run_plan`` and
  ``before_forward`` (built once into the test session's temporary
  directory, which its worker processes share; the process-wide switch
  left as it was found)."""
  if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("the native host path is a C++ extension: building it needs "
                "a C++ compiler (c++ or g++ on the PATH)")
  if (shutil.which("ninja") is None
      and importlib.util.find_spec("ninja") is None):
    pytest.skip("the native host path is built with ninja: neither the "
                "ninja package (the torch extra's) nor one on the PATH")
  # (xdist: each worker's base directory is under the session's)
  build = tmp_path_factory.getbasetemp().parent / "forge_torch_native"
  with _hot.using(True, str(build)) as on:
    assert on, _hot.unavailable()
    fns = types.SimpleNamespace(run_plan=_hot.run_plan,
                                before_forward=_hot.before_forward)
  return fns


class _Event:
  """A CUDA event on the CPU: recorded, already complete."""

  def record(self, stream=None):
    del stream

  def synchronize(self):
    pass


class _Stream:

  def synchronize(self):
    pass


class _Recorder:
  """The runtime's launch: a ctypes callback recording each call's
  arguments as ``log`` entries ``(kernel, function, stream, device, buffer
  names)``, in the ABI of jaxlib 0.12 (``(kernel, function, stream, buffers,
  device)``) or, ``abi_v2=False``, 0.11's (``(function, stream, buffers)``:
  kernel and device logged as None)."""

  KERNEL, FUNCTION = 0x2222, 0x1111

  def __init__(self, abi_v2: bool = True):
    self.abi_v2 = abi_v2
    self.log = []
    self.tensors: dict[int, str] = {}  # address -> weight or state name
    self.rings: list = []
    self.sizes: dict[int, int] = {}  # function handle -> buffers
    ptrs_t = ctypes.POINTER(ctypes.c_void_p)
    if abi_v2:
      self.c_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, ptrs_t, ctypes.c_int)(
                                       self._record)
    else:
      self.c_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                   ptrs_t)(
          lambda f, s, b: self._record(None, f, s, b, None))
    self.address = ctypes.cast(self.c_fn, ctypes.c_void_p).value

  def name(self, address: int):
    """A buffer: a ring row's hyperparameters (their bytes), a weight or
    state tensor (its name), else ``"operand"`` (x, dy)."""
    for ring in self.rings:
      if address in ring.ptrs:
        return ("hparams", ring.host_np[ring.ptrs.index(address)].tobytes())
    return self.tensors.get(address, "operand")

  def _record(self, kernel, function, stream, buffers, device):
    n = self.sizes[function]
    self.log.append((kernel, function, stream, device,
                     tuple(self.name(buffers[i] or 0) for i in range(n))))

  def kernel(self, n_slots: int) -> _direct.DirectKernel:
    """A DirectKernel of ``(x, dy, hparams, w, *slots)`` whose buffers are
    its operands in a scrambled order, then the in-place outputs (the
    weight and the slots again), as a lowered kernel's are."""
    n = 4 + n_slots
    order = [3, 0, 2, 1, *range(4, n)] + list(range(3, n))
    function = self.FUNCTION + n_slots  # (one per buffer count)
    self.sizes[function] = len(order)
    k = object.__new__(_direct.DirectKernel)
    k.writes_outputs = False
    if self.abi_v2:
      k._launch = functools.partial(self.c_fn, self.KERNEL, function)
      k._tail = (DEVICE,)
    else:
      k._launch, k._tail = functools.partial(self.c_fn, function), ()
    k._buffers_t = ctypes.c_void_p * len(order)
    k._gather = operator.itemgetter(*order)
    k._unload = None
    k.c_launch = (self.address, self.abi_v2,
                  self.KERNEL if self.abi_v2 else None, function, DEVICE,
                  tuple(order))
    return k


@pytest.fixture
def stand_in(monkeypatch, request):
  """The direct launch's path on the CPU (see the module's docstring:
  ``benchmarks.torch_overhead``'s stand-in, with the recorder's kernels and
  real rings); returns the launch recorder (indirectly parametrized: the
  launch's ABI, jaxlib 0.12's by default)."""
  rec = _Recorder(getattr(request, "param", True))
  rings = {}  # ring key -> ring

  def ring(key):
    if key not in rings:
      rings[key] = _bridge._HparamsRing(None, key[2], _Stream(),
                                        pin_memory=False)
      rec.rings.append(rings[key])
    return rings[key]

  monkeypatch.setattr(torch.cuda, "Event", _Event)
  undo = torch_overhead._direct_stand_in(_bridge, _direct, kernel=rec.kernel,
                                         ring=ring, stream=STREAM)
  yield rec
  undo()


def _tensor_names(model, opt):
  """Address -> name of the model's weights and their optimizer state."""
  out = {}
  for name, p in model.named_parameters():
    out[p.data_ptr()] = name
    for k, v in opt.state.get(p, {}).items():
      if isinstance(v, torch.Tensor) and v.numel() > 1:
        out[v.data_ptr()] = f"{name}.{k}"
  return out


def _train(monkeypatch, rec, fns, family, kw, steps, change, shape_at):
  """Trains a three-layer converted bf16 MLP with ``forge_torch.<family>``
  for ``steps`` steps, ``change(i, model, opt)`` run before step ``i`` (or
  during its backward, see _CHANGES), with the native path's functions
  ``fns`` (or none). Returns per update ``(took a plan, natively)``, the
  launches, per step the bookkeeping and per forward ``(natively, the
  step it was counted in, the weight's uses counted then)``."""
  torch.manual_seed(3)
  model = nn.Sequential(nn.Linear(9, 16), nn.Tanh(), nn.Linear(16, 32),
                        nn.Tanh(), nn.Linear(32, 8)).bfloat16()
  forge_torch.convert(model)
  opt = getattr(forge_torch, family)(model.parameters(), **kw)
  cls = forge_optim._ForgeOptimizer
  real_run_plan, real_fused = cls._forge_run_plan, cls._forge_fused_update
  real_before = cls._forge_before_forward
  updates, current, declined = [], [None], [False]
  forwards = []

  def fused(self, p, grad_output, input, *, config, layer):
    if not declined[0]:  # (else the update the native call declined)
      current[0] = [False, False]
      updates.append(current[0])
    declined[0] = False
    return real_fused(self, p, grad_output, input, config=config,
                      layer=layer)

  def run_plan(self, *args):
    current[0][0] = real_run_plan(self, *args)
    return current[0][0]

  def native(*args):
    current[0] = [False, False]
    updates.append(current[0])
    took = fns.run_plan(*args)
    current[0][0] = current[0][1] = took
    declined[0] = not took
    return took

  def before(self, w, x, **kw):
    got = real_before(self, w, x, **kw)
    forwards.append((False, got, self._forge_calls.get(w)))
    return got

  def native_before(self, w, x, amp):
    got = fns.before_forward(self, w, x, amp)
    if got is not NotImplemented:
      forwards.append((True, got, self._forge_calls.get(w)))
    return got

  rec.log = []
  start = copy.copy(forge_torch.bridge_stats)
  books = []
  with monkeypatch.context() as m:
    m.setattr(cls, "_forge_fused_update", fused)
    m.setattr(cls, "_forge_run_plan", run_plan)
    m.setattr(cls, "_forge_before_forward", before)
    m.setattr(_hot, "run_plan", native if fns is not None else None)
    m.setattr(_hot, "before_forward",
              native_before if fns is not None else None)
    g = torch.Generator().manual_seed(4)
    for i in range(steps):
      hook = change(i, model, opt)
      rec.tensors = _tensor_names(model, opt)  # (after a change: reloaded)
      rows = 7 if i < shape_at else 5
      x = torch.randn(rows, 9, generator=g).bfloat16()
      if getattr(change, "transposed", False) and i >= 3:
        x = torch.randn(9, rows, generator=g).bfloat16().t()

      def closure(x=x, hook=hook):
        h = model[1](model[0](x))
        if hook is not None:  # (runs once the later layers' updates ran)
          h.register_hook(hook)
        loss = model[4](model[3](model[2](h))).float().square().mean()
        loss.backward()
        return loss

      if opt.max_grad_norm is None:
        closure()
        if hook is not None and getattr(change, "after", None):
          change.after(opt)
        opt.step()
      else:  # (the closure runs twice: the norm pass, then the update's)
        opt.step(closure)
      opt.zero_grad()
      books.append(_bookkeeping(model, opt, start))
  return [tuple(u) for u in updates], list(rec.log), books, forwards


def _bookkeeping(model, opt, start):
  """What a step leaves: per weight its version counter, its state's
  values (the step count's value, the other tensors' version counters)
  and the step count's record; the bridge's counters since ``start``."""
  out = []
  for name, p in model.named_parameters():
    st = opt.state.get(p, {})
    state = []
    for k in sorted(st):
      v = st[k]
      if not isinstance(v, torch.Tensor):
        state.append((k, v))
      elif v.numel() == 1:
        state.append((k, v.item()))
      else:  # (an inference tensor has no version counter)
        state.append((k, "inference" if v.is_inference() else v._version))
    step = st.get("step")
    record = (opt._forge_steps.get(step) if isinstance(step, torch.Tensor)
              else None)
    out.append((name, p._version, tuple(state),
                None if record is None else (record.value,
                                             record.version
                                             - step._version)))
  s = forge_torch.bridge_stats
  out.append(("stats", s.calls - start.calls, s.direct - start.direct,
              s.in_place - start.in_place))
  out.append(("pending", len(opt._forge_pending_steps)))
  return out


def _at(step, f):
  def change(i, model, opt):
    if i == step:
      return f(model, opt)
    return None
  change.__name__ = f.__name__
  change.after = getattr(f, "after", None)
  change.transposed = getattr(f, "transposed", False)
  return change


def _scale_lr(model, opt):
  for g in opt.param_groups:
    g["lr"] *= 0.5


def _weight_decay_set(model, opt):
  opt.param_groups[0]["weight_decay"] = 0.25


def _new_slots(model, opt):
  for st in opt.state.values():
    for k in list(st):
      if k != "step" and isinstance(st[k], torch.Tensor):
        st[k] = st[k].clone()


def _slots_made_in_inference_mode(model, opt):
  """The managed weights' state tensors made under torch.inference_mode():
  their version counters are not bumped (torch skips inference tensors),
  which the native path leaves to the Python path."""
  for p in opt.managed_params:
    st = opt.state[p]
    for k in list(st):
      if k != "step" and isinstance(st[k], torch.Tensor):
        with torch.inference_mode():
          st[k] = st[k].clone()


def _count_written(model, opt):
  for st in opt.state.values():
    if isinstance(st.get("step"), torch.Tensor):
      st["step"].fill_(1.0)


def _count_memory_replaced(model, opt):
  for st in opt.state.values():
    if isinstance(st.get("step"), torch.Tensor):
      st["step"].data = torch.full_like(st["step"], 50.0)


def _reload(model, opt):
  opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _group_added_first(model, opt):
  extra = nn.Parameter(torch.zeros(3))
  opt.add_param_group({"params": [extra], "lr": 1e-3})
  opt.param_groups.insert(0, opt.param_groups.pop())


def _clip_on(model, opt):
  opt.max_grad_norm = 0.05


def _accumulate_on(model, opt):
  opt.accumulate_steps = 2


def _lr_in_backward(model, opt):
  """The lr set once the last two layers' updates ran, before the first
  layer's (undone before step(), which refuses options changed since the
  backward): the first's update forms the group's scalars anew."""
  def hook(grad):
    opt.param_groups[0]["lr"] = 3e-3
  return hook


def _lr_back(opt):
  opt.param_groups[0]["lr"] = 1e-2


_lr_in_backward.after = _lr_back


def _nothing(model, opt):
  return None


def _transposed_input(model, opt):
  return None


_transposed_input.transposed = True

_CHANGES = [_nothing, _scale_lr, _weight_decay_set, _new_slots,
            _slots_made_in_inference_mode, _count_written, _count_memory_replaced, _reload,
            _group_added_first, _clip_on, _accumulate_on, _lr_in_backward,
            _transposed_input]


@pytest.mark.parametrize("change", _CHANGES, ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("deferred", [False, True],
                         ids=["count-on-host", "count-deferred"])
def test_the_native_path_takes_what_the_python_path_takes(
    monkeypatch, native, stand_in, change, deferred):
  """AdamW through a change at step 3 (between steps, or during the
  backward), its step counts advanced after each update (CPU counts) or at
  the step's end (as on a GPU): the same updates take a plan, the same
  launches and bookkeeping, with and without the native path; the native
  path takes every plan but each step's first update."""
  if deferred:
    monkeypatch.setattr(forge_optim, "_defers_step", lambda step: True)
  kw = dict(lr=1e-2, weight_decay=0.1)
  shape_at = 5 if change is _nothing else 99
  runs = [_train(monkeypatch, stand_in, fns, "AdamW", kw, 8,
                 _at(3, change), shape_at) for fns in (native, None)]
  (updates, log, books, fwd), (py_updates, py_log, py_books, py_fwd) = runs
  assert [u[0] for u in updates] == [u[0] for u in py_updates]
  assert not any(u[1] for u in py_updates)
  assert log == py_log
  assert books == py_books
  # The forwards: counted alike, in the same steps; natively all but each
  # step's first (which checks the groups' members) from step 1 on.
  assert [f[1:] for f in fwd] == [f[1:] for f in py_fwd]
  assert not any(f[0] for f in py_fwd)
  assert sum(f[0] for f in fwd) == 7 * 2 if change is _nothing else (
      sum(f[0] for f in fwd) >= 3 * 2)
  # The native path ran, and only where the Python path's plan would have:
  # unchanged, in steps 2 to 7 every update but the step's first (which
  # forms the group's scalars), except in step 5, whose new batch size
  # takes the full path; clipping and accumulation take no plans from step
  # 3 on.
  n_native = sum(u[1] for u in updates)
  assert all(u[0] for u in updates if u[1])
  if change is _nothing:
    assert n_native == 5 * 2, updates
  else:
    assert n_native >= 2 if change in (_clip_on, _accumulate_on) else 4, (
        updates)


@pytest.mark.parametrize("family,kw", [
    ("SGD", dict(lr=0.1, momentum=0.9)),  # no step count
    ("Adagrad", dict(lr=0.1)),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("RMSprop", dict(lr=1e-2, centered=True, momentum=0.5)),
])
def test_every_family_takes_the_same_path_natively(monkeypatch, native,
                                                   stand_in, family, kw):
  """Other families (SGD keeps no step count; Adagrad makes its state at
  construction; AMSGrad and centered RMSprop have three slots): the same
  plans, launches and bookkeeping with and without the native path."""
  runs = [_train(monkeypatch, stand_in, fns, family, kw, 6,
                 _at(99, _nothing), 99) for fns in (native, None)]
  (updates, log, books, fwd), (py_updates, py_log, py_books, py_fwd) = runs
  assert [u[0] for u in updates] == [u[0] for u in py_updates]
  assert log == py_log and books == py_books
  assert [f[1:] for f in fwd] == [f[1:] for f in py_fwd]
  assert sum(u[1] for u in updates) >= 2 * 2


@pytest.mark.parametrize("stand_in", [True, False], indirect=True,
                         ids=["abi-jaxlib-0.12", "abi-jaxlib-0.11"])
def test_the_native_path_launches_the_kernels_buffers_in_order(
    monkeypatch, native, stand_in):
  """A native launch calls the runtime's launch function with the
  arguments of its ABI and the kernel's buffers in the kernel's own order
  (operands, then the in-place outputs): the weight, the input, the
  hyperparameters' row, the gradient, the slots, then the weight and the
  slots again; as the Python path's launch does."""
  updates, log, _, _ = _train(monkeypatch, stand_in, native, "AdamW",
                              dict(lr=1e-2), 4, _at(99, _nothing), 99)
  # (The step's updates: the last layer's in Python, then the others'.)
  assert updates[-3:] == [(True, False), (True, True), (True, True)]
  kernel, function, stream, device, buffers = log[-1]
  assert (kernel, stream, device) == ((_Recorder.KERNEL, STREAM, DEVICE)
                                      if stand_in.abi_v2
                                      else (None, STREAM, None))
  assert log[-3][:4] == log[-1][:4]  # (the Python path's launch)
  name = buffers[0]
  assert name.endswith(".weight")
  assert buffers[1] == "operand" and buffers[3] == "operand"
  assert buffers[2][0] == "hparams"
  assert buffers[4:] == (f"{name}.exp_avg", f"{name}.exp_avg_sq", name,
                         f"{name}.exp_avg", f"{name}.exp_avg_sq")


class _HeldElsewhere:
  """The bridge's lock while another thread holds it, as a waiting
  acquire would find it once that thread is done."""

  def acquire(self, blocking=True):
    return blocking

  def release(self):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _lock_held(model, opt):
  """The bridge's lock held elsewhere when the first layer's update comes
  (after the later layers' updates of the step)."""
  def hook(grad):
    _bridge._LOCK = _HeldElsewhere()
  return hook


def test_the_native_path_leaves_a_held_lock_to_python(monkeypatch, native,
                                                      stand_in):
  """While another thread holds the bridge's lock (installing a ring row,
  say), the native path does nothing and the Python path, which waits for
  the lock, takes the plan."""
  monkeypatch.setattr(_bridge, "_LOCK", _bridge._LOCK)  # (restored after)
  updates, _, _, _ = _train(monkeypatch, stand_in, native, "AdamW",
                         dict(lr=1e-2), 4, _at(3, _lock_held), 99)
  # Step 3 (updates 9 to 11): the last layer's forms the step's scalars in
  # Python, the middle one's is native, the first layer's finds the lock
  # held; in step 2 it was native.
  assert updates[9:] == [(True, False), (True, True), (True, False)]
  assert updates[6:9] == [(True, False), (True, True), (True, True)]


def _hot_state(monkeypatch):
  """The native path's module state, restored after the test."""
  for name in ("run_plan", "before_forward", "_MODULE", "_FAILED", "_OFF"):
    monkeypatch.setattr(_hot, name, getattr(_hot, name))


def test_a_failed_build_keeps_the_python_path_and_says_why(monkeypatch):
  """Where the extension cannot be built (no compiler, say), the build's
  error is kept as the reason, every call stays on the Python path, and
  later calls do not try again."""
  _hot_state(monkeypatch)
  for name, value in (("run_plan", None), ("before_forward", None),
                      ("_MODULE", None), ("_FAILED", None), ("_OFF", None)):
    monkeypatch.setattr(_hot, name, value)
  tries = []

  def load(build_directory):
    tries.append(build_directory)
    raise RuntimeError("Error building extension: c++: command not found")

  monkeypatch.setattr(_hot, "_load", load)
  assert _hot.ensure_built() is False and _hot.ensure_built() is False
  assert len(tries) == 1
  why = forge_torch.bridge_stats.native_unavailable
  assert why.startswith("the native host path could not be built")
  assert "c++: command not found" in why
  assert _hot.run_plan is None and _hot.before_forward is None
  assert forge_torch.set_native_path(True) is False  # (still failed)
  assert forge_torch.bridge_stats.native_unavailable == why


def test_set_native_path_switches_it_and_says_so(monkeypatch, native):
  """``forge_torch.set_native_path`` turns the built path off (the reason
  in ``bridge_stats.native_unavailable``) and on again, returning whether
  it was on; it takes only True or False."""
  _hot_state(monkeypatch)
  monkeypatch.setattr(_hot, "_OFF", None)
  with _hot.using(True):
    pass
  forge_torch.set_native_path(True)
  assert forge_torch.bridge_stats.native_unavailable is None
  assert forge_torch.set_native_path(False) is True
  assert _hot.run_plan is None and _hot.before_forward is None
  assert forge_torch.bridge_stats.native_unavailable == (
      "turned off by forge_torch.set_native_path")
  with _hot.using(True) as on:  # (off: a comparison cannot turn it on)
    assert not on
  assert forge_torch.set_native_path(True) is False
  assert _hot.run_plan is not None and _hot.before_forward is not None
  with _hot.using(False) as on:
    assert not on and _hot.run_plan is None
  assert _hot.run_plan is not None
  with pytest.raises(TypeError, match="True or False"):
    forge_torch.set_native_path(1)
