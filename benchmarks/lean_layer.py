"""A lean layer of forge_torch's form: the least host time such a layer takes.

forge_torch.Linear checks, at every forward and every update, everything a
correct in-place update depends on (the optimizer's param groups and
options, the weight's state tensors and step count, autocast, hooks, the
launch's key). This module keeps only the per-layer work that a path
validated once per step would keep, to measure what such a design would
cost (benchmarks/torch_overhead.py's and benchmarks/torch_e2e.py's ``lean``
arms):

  forward   the compiling flag, grad mode, the weight's plan (one dict
            lookup) and its one use per step, a minimal autograd Function
            that saves the input and the weight;
  backward  the input's gradient, the engine's will-execute check, one
            update per step, the operands' shapes (their dtypes and devices
            checked where the shapes change), the launch's pointers and the
            version bumps of the weight and its two slots;
  step()    torch's AdamW for the other parameters, and the managed
            weights' step counts advanced in one op.

On the CPU the launch is stood in and nothing is updated. On CUDA the
backward launches forge_torch's compiled kernel on torch's current stream
(resolved once per layer shape by two steps of a forge_torch layer, its
scalars fixed in a device vector): the weight and its slots are updated,
with no check beyond these. Not an optimizer: what it leaves out is what
forge_torch checks so that nothing goes silently wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

# A launch's operands (dy, x, hyperparameters, w, exp_avg, exp_avg_sq),
# then its in-place results, as the compiled kernel takes them.
_ORDER = (0, 1, 2, 3, 4, 5, 3, 4, 5)


def real_launch(n_in: int, n_out: int, bt: int, dtype):
  """``(launch_ptrs, keep)``: ``launch_ptrs(stream, ptrs)`` enqueues the
  compiled direct kernel that forge_torch.AdamW's update of an
  ``n_in -> n_out`` layer at ``bt`` rows takes on CUDA (``ptrs``: dy, x,
  hyperparameters, w, exp_avg, exp_avg_sq), resolved by two steps of such
  a layer (and a third backward); ``keep`` is the device vector of that
  step's scalars (the kernel reads it at ``keep.data_ptr()``)."""
  import forge_torch  # noqa: PLC0415

  layer = forge_torch.Linear(n_in, n_out, bias=False).to("cuda", dtype)
  opt = forge_torch.AdamW(layer.parameters(), lr=1e-3, fused=True)
  x = torch.randn(bt, n_in, device="cuda", dtype=dtype)
  for _ in range(2):
    layer(x).float().square().mean().backward()
    opt.step()
  # A third backward: step() drops the step's scalars, the update forms
  # them again (read here before the next step() drops them).
  layer(x).float().square().mean().backward()
  plan = opt._forge_plans.get(layer.weight)  # noqa: SLF001
  shared = opt._forge_scalars.get(0)  # noqa: SLF001
  if plan is None or plan.launch is None or shared is None or not (
      shared.scalars):
    raise RuntimeError("lean on CUDA: forge_torch's update took no direct "
                       f"launch here ({forge_torch.bridge_stats})")
  scalars = next(iter(shared.scalars.values()))
  keep = torch.from_numpy(scalars.packed(plan.rule).copy()).cuda()
  return plan.launch.kernel.launch_ptrs, keep


def make(device: str = "cpu", bt: int = 0):
  """``(LeanLinear, LeanAdamW, convert)``: the lean layer (a bias-free
  ``nn.Linear``), an optimizer over models holding it (torch's AdamW, plus
  the managed weights' step counts) and ``convert(model)``, which makes
  every bias-free ``nn.Linear`` of ``model`` a lean one in place. ``bt``:
  the rows every layer's input has (CUDA: the launches are compiled for
  it)."""
  is_compiling = torch.compiler.is_compiling
  grad_enabled = torch.is_grad_enabled
  will_execute = torch._C._will_engine_execute_node  # noqa: SLF001
  bump = torch._C._increment_version  # noqa: SLF001
  plans = {}
  launches = {}  # (n_in, n_out, dtype) -> (launch_ptrs, keep)
  if device == "cuda":
    from forge_torch import _bridge  # noqa: PLC0415
    raw_stream = _bridge._raw_stream  # noqa: SLF001

  class Plan:
    __slots__ = ("optimizer", "slots", "used", "updated", "x_shape",
                 "dy_shape", "dtype", "device", "device_index", "launch",
                 "h")

  def plan_for(w, plan=None):
    plan = plan or Plan()
    plan.optimizer = getattr(plan, "optimizer", None)
    plan.used = plan.updated = -1
    plan.x_shape = plan.dy_shape = None
    plan.slots = (torch.zeros_like(w), torch.zeros_like(w))
    plan.dtype, plan.device = w.dtype, w.device
    plan.device_index = w.get_device()
    plan.launch, plan.h = None, 4096
    if w.is_cuda:
      key = (w.shape[1], w.shape[0], w.dtype)
      if key not in launches:
        launches[key] = real_launch(w.shape[1], w.shape[0], bt, w.dtype)
      launch_ptrs, keep = launches[key]
      plan.launch, plan.h = launch_ptrs, keep.data_ptr()
    plans[id(w)] = plan

  class LeanAdamW(torch.optim.AdamW):
    def __init__(self, params, **kw):
      super().__init__(params, **kw)
      self.generation = 0
      managed = [w for g in self.param_groups for w in g["params"]
                 if id(w) in plans]
      for w in managed:
        plans[id(w)].optimizer = self
      device = managed[0].device if managed else "cpu"
      self.counts = torch.zeros(len(managed), device=device)

    def step(self, closure=None):
      self.generation += 1
      self.counts.add_(1)
      return super().step(closure)

  class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, plan):
      ctx.save_for_backward(input, weight)
      ctx.plan = plan
      return F.linear(input, weight)

    @staticmethod
    def backward(ctx, grad_output):
      x, w = ctx.saved_tensors
      plan = ctx.plan
      grad_input = grad_output.matmul(w)
      if not will_execute(ctx.next_functions[1][0]):
        return grad_input, None, None
      generation = plan.optimizer.generation
      if plan.updated == generation:
        raise RuntimeError("a second update in one step")
      if grad_output.shape != plan.dy_shape or x.shape != plan.x_shape:
        if not (grad_output.dtype == x.dtype == plan.dtype
                and grad_output.device == x.device == plan.device):
          raise TypeError("the operands' dtypes or devices differ")
        plan.dy_shape, plan.x_shape = grad_output.shape, x.shape
      x, dy = x.contiguous(), grad_output.contiguous()
      m, v = plan.slots
      # torch's weight is (out, in): the kernel forms its gradient
      # dy^T x, so dy takes the kernel's x operand (as forge_torch's).
      ptrs = [dy.data_ptr(), x.data_ptr(), plan.h, w.data_ptr(),
              m.data_ptr(), v.data_ptr()]
      if plan.launch is not None:
        plan.launch(raw_stream(plan.device_index), ptrs)
      else:  # stood in: the kernel's order, as a real launch gathers it
        buffers = [ptrs[i] for i in _ORDER]
        del buffers
      bump((w, m, v))
      plan.updated = generation
      return grad_input, None, None

  class LeanLinear(torch.nn.Linear):
    def __init__(self, *args, **kw):
      super().__init__(*args, **kw)
      if self.bias is not None:
        raise ValueError("the lean layer has no bias")
      plan_for(self.weight)

    def _apply(self, fn, recurse=True):  # .to(dtype): the plan follows
      old = id(self.weight)
      out = super()._apply(fn, recurse)
      plan_for(self.weight, plans.pop(old))
      return out

    @property
    def plan(self):
      """The weight's plan (its slots: ``plan.slots``)."""
      return plans[id(self.weight)]

    def forward(self, input):
      w = self._parameters["weight"]
      if is_compiling() or not grad_enabled():
        return F.linear(input, w)
      plan = plans.get(id(w))
      if plan is None or not w.requires_grad:
        return F.linear(input, w)
      generation = plan.optimizer.generation
      if plan.used == generation:
        raise RuntimeError("called a second time in one step")
      plan.used = generation
      return Fn.apply(input, w, plan)

  def convert(model: torch.nn.Module) -> list[str]:
    names = []
    for name, m in model.named_modules():
      if type(m) is torch.nn.Linear and m.bias is None:
        m.__class__ = LeanLinear
        plan_for(m.weight)
        names.append(name)
    return names

  return LeanLinear, LeanAdamW, convert
