"""forge_torch's own host time per managed layer, against nn.Linear's.

    ./dev.sh python -m benchmarks.torch_overhead --out O.csv
    ./dev.sh python -m benchmarks.torch_overhead --device cuda --out O.csv

A stack of ``--layers`` small ``--width x --width`` linear layers (no bias)
trained ``--steps`` steps after ``--warmup`` steps (on ``--bt`` rows, 2-d;
with ``--seq S`` 3-d, ``BT / S`` sequences of ``S`` rows, as a
transformer's layers take them), in two arms:

  torch   ``nn.Linear`` + ``torch.optim.AdamW`` (``fused=True`` on CUDA);
  forge   ``forge_torch.Linear`` + ``forge_torch.AdamW`` (the same);
  python  (``--arms ... python``) forge with its native host path off
          (``forge_torch.set_native_path(False)``): the update plan's
          checks and launch, and the forward's checks, in Python, as a
          machine without a C++ compiler runs them (forge takes the native
          path on CUDA and with ``--launch direct``, building it first);
  floor   (``--arms ... floor``) the least a Python layer of FORGE's form
          costs: a minimal ``torch.autograd.Function`` whose forward is
          ``F.linear`` and whose backward forms the input's gradient and no
          update (``torch.optim.AdamW``, with no gradient to step);
  lean    (``--arms ... lean``) that Function with the per-layer work a
          path validated once per step would keep (one use and one update
          per step, the operands' shapes, the engine's will-execute check,
          the launch's pointers, the version bumps; the step counts once
          per ``step()``; benchmarks/lean_layer.py): a measure of such a
          design. On the CPU its launch is stood in; on CUDA it launches
          forge_torch's compiled kernel on torch's current stream, so it
          updates the weight and its slots with no check beyond these: the
          least host time a Python layer of FORGE's form with the real
          launch takes.

On the CPU, ``--launch`` says what stands in for the fused update:

  stub    (float32) ``forge_torch._bridge.fused_update`` is replaced by a
          function that does nothing: what remains is the layer's and the
          optimizer's own Python (bookkeeping, checks, hyperparameter
          packing) around the update;
  direct  (bfloat16) the update takes the path of a direct launch on a
          Hopper GPU (``forge_torch._bridge``'s launch cache, operand
          checks, hyperparameter ring, update plans), with only the compiled
          kernel's launch and the pinned ring's memory stood in for.

On CUDA (``--device cuda``: bfloat16 parameters and AdamW state, ``--bt``
rows) nothing stands in: the forge arm launches the fused kernel (directly,
on a Hopper GPU), and the layers are small enough that the GPU waits on the
host, so the figures are the host's work per layer, launches included.

The figures are host time per layer per step, split into the forward, the
backward, ``step()`` and ``zero_grad()`` (``perf_counter`` around each,
medians over the steps). ``--profile N`` prints the forge arm's N
functions of most own time (cProfile, over the timed steps of one more
run).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from benchmarks import common, paths

PHASES = ("forward", "backward", "step", "zero_grad")
ARMS = ("torch", "forge", "python", "floor", "lean")


class _StandInKernel:
  """A compiled direct kernel's launch, done nothing."""

  writes_outputs = False
  c_launch = None  # (launched through launch_ptrs)

  def launch_ptrs(self, stream, ptrs):
    del stream, ptrs


class _StandInRing:
  """The pinned hyperparameter ring: its lookup by the vector's bytes,
  skipped for the fixed vector it served last."""

  last = None

  def get(self, vec, fixed=False):
    if not (fixed and vec is self.last):
      vec.tobytes()
      self.last = vec if fixed else None
    return 4096


def _direct_stand_in(bridge, direct, kernel=None, ring=None, stream=0):
  """Patches ``forge_torch._bridge`` so that CPU tensors take the direct
  launch's path, the launch and the ring stood in for; returns a function
  that undoes it. ``kernel(n_slots)`` and ``ring(ring_key)`` make a
  resolved launch's kernel and hyperparameter ring (default: the stand-ins
  above, which do nothing); ``stream``: the raw stream the path sees, on
  device -1. (Names an older commit lacks are set, then removed: the same
  command measures it too.)"""
  missing = object()
  saved = {name: getattr(bridge, name, missing) for name in (
      "_raw_stream", "_resolve", "_fused_update", "resolved_launch",
      "_current_device", "_stream_capturing", "_LAUNCHES")}
  unavailable = direct.unavailable
  kernel = kernel or (lambda n_slots: _StandInKernel())
  ring = ring or (lambda ring_key: _StandInRing())

  def resolve(x2, dy2, w, slots, n_hparams, rule, config, device_index,
              stream):
    launch = bridge._Launch(kernel(len(slots)), 1 + len(slots),
                            (device_index, stream, n_hparams))
    launch.ring = ring(launch.ring_key)
    return launch

  def fused_update(x, dy, w, slots, hparams, rule, config, views,
                   stochastic_rounding=None):
    del views
    if not bridge._direct_update(x, dy, w, slots, hparams, rule, config,
                                 stochastic_rounding):
      raise RuntimeError("the direct path did not take this update")
    return True

  def resolved_launch(x2, dy2, w, slots, n_hparams, rule, config):
    return bridge._LAUNCHES.get(bridge._launch_key(
        x2, dy2, w, slots, -1, stream, n_hparams, rule, config)) or None

  direct.unavailable = lambda: None
  bridge._raw_stream = lambda device_index: stream
  bridge._resolve = resolve
  bridge._fused_update = fused_update
  bridge.resolved_launch = resolved_launch
  bridge._current_device = lambda: -1
  bridge._stream_capturing = lambda: False
  bridge._LAUNCHES = {}

  def undo():
    direct.unavailable = unavailable
    for name, value in saved.items():
      if value is missing:
        delattr(bridge, name)
      else:
        setattr(bridge, name, value)
  return undo


def _floor_linear():
  """An ``nn.Linear`` whose forward is a minimal autograd Function that
  saves what FORGE's backward reads (input and weight) and returns only the
  input's gradient: forge_torch's layer without its checks, bookkeeping and
  update."""
  import torch  # noqa: PLC0415
  import torch.nn.functional as F  # noqa: PLC0415,N812

  class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight):
      ctx.save_for_backward(input, weight)
      return F.linear(input, weight)

    @staticmethod
    def backward(ctx, grad_output):
      _, weight = ctx.saved_tensors
      return grad_output.matmul(weight), None

  class FloorLinear(torch.nn.Linear):
    def forward(self, input):
      return Fn.apply(input, self.weight)

  return FloorLinear


def run_arm(arm: str, layers: int, width: int, steps: int, warmup: int,
            device: str = "cpu", bt: int = 4, profile: int = 0,
            launch: str = "stub", seq: int = 0) -> dict[str, float]:
  """Seconds per layer per step for each phase (median over ``steps``).
  ``seq``: the input is ``(bt // seq, seq, width)`` (0: ``(bt, width)``)."""
  from forge_torch import _hot  # noqa: PLC0415

  # The native host path is built by the first direct launch: on CUDA, and
  # on the CPU for the direct launch's stand-in ("python": off; with the
  # update stubbed, off too, as on a machine without a GPU).
  with _hot.using(arm == "forge" and (device == "cuda" or launch == "direct")):
    return _run_arm(arm, layers, width, steps, warmup, device, bt, profile,
                    launch, seq)


def _run_arm(arm, layers, width, steps, warmup, device, bt, profile, launch,
             seq):
  import torch  # noqa: PLC0415
  import forge_torch  # noqa: PLC0415
  from forge_torch import _direct  # noqa: PLC0415
  from forge_torch import optim as forge_optim  # noqa: PLC0415

  torch.manual_seed(0)
  forge = arm in ("forge", "python")
  cuda = device == "cuda"
  dtype = (torch.bfloat16 if cuda or launch == "direct"
           else torch.float32)
  optimizer = forge_torch.AdamW if forge else torch.optim.AdamW
  if arm == "lean":
    from benchmarks import lean_layer  # noqa: PLC0415
    linear, optimizer, _ = lean_layer.make(device, bt)
  else:
    linear = (forge_torch.Linear if forge else _floor_linear()
              if arm == "floor" else torch.nn.Linear)
  model = torch.nn.Sequential(*[linear(width, width, bias=False)
                                for _ in range(layers)]).to(device, dtype)
  opt = optimizer(model.parameters(), lr=1e-3,
                  **({"fused": True} if cuda else {}))
  x = torch.randn(*((bt // seq, seq) if seq else (bt,)), width,
                  device=device, dtype=dtype)
  real = forge_optim._bridge.fused_update  # noqa: SLF001
  undo = None
  if not cuda and launch == "stub":
    forge_optim._bridge.fused_update = lambda *a, **k: True  # noqa: SLF001
  elif not cuda and forge:
    undo = _direct_stand_in(forge_optim._bridge, _direct)  # noqa: SLF001
  profiler = None
  try:
    times = {p: [] for p in PHASES}
    for i in range(warmup + steps):
      if i == warmup and profile and forge:
        import cProfile  # noqa: PLC0415
        profiler = cProfile.Profile()
        profiler.enable()
      t0 = time.perf_counter()
      loss = model(x).float().square().mean()
      t1 = time.perf_counter()
      loss.backward()
      t2 = time.perf_counter()
      opt.step()
      t3 = time.perf_counter()
      opt.zero_grad(set_to_none=True)
      t4 = time.perf_counter()
      if i >= warmup:
        for p, a, b in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4)):
          times[p].append((b - a) / layers)
      if cuda and i % 10 == 9:
        torch.cuda.synchronize()  # (the queue never grows long)
    if cuda:
      torch.cuda.synchronize()
  finally:
    forge_optim._bridge.fused_update = real  # noqa: SLF001
    if undo is not None:
      undo()
    if profiler is not None:
      import pstats  # noqa: PLC0415
      profiler.disable()
      pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
  if forge and cuda:
    print(f"forge: {forge_torch.bridge_stats}", flush=True)
  return {p: statistics.median(v) for p, v in times.items()}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file,
                 default="out/bench/torch_overhead.csv")
  p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
  p.add_argument("--launch", default=None, choices=("stub", "direct"),
                 help="on the CPU: what stands in for the fused update "
                 "(default: stub)")
  p.add_argument("--layers", type=common.positive_int, default=20)
  p.add_argument("--width", type=common.positive_int, default=None,
                 help="16 on the CPU, 256 on CUDA")
  p.add_argument("--bt", type=common.positive_int, default=None,
                 help="rows of the batch: 4 on the CPU, 64 on CUDA")
  p.add_argument("--seq", type=common.positive_int, default=None,
                 help="the batch as BT / SEQ sequences of SEQ rows: 3-d "
                 "activations (batch, sequence, width), as a transformer's "
                 "layers take them (default: 2-d, BT x width)")
  p.add_argument("--steps", type=common.positive_int, default=200)
  p.add_argument("--warmup", type=common.positive_int, default=5)
  p.add_argument("--repeat", type=common.positive_int, default=1,
                 help="runs of each arm, alternating; the figures are each "
                 "phase's least median over them")
  p.add_argument("--profile", type=common.non_negative_int, default=0,
                 metavar="N")
  p.add_argument("--arms", nargs="+", choices=ARMS,
                 default=["torch", "forge"],
                 help="python: forge with its native host path off "
                 "(forge_torch.set_native_path(False)); "
                 "floor: a minimal autograd Function with no update; "
                 "lean: that Function with the per-layer checks and "
                 "launch of a path validated once per step (CUDA: the real "
                 "launch)")
  args = p.parse_args(argv)
  cuda = args.device == "cuda"
  if cuda and args.launch is not None:
    p.error("--launch is for the CPU: on CUDA the fused kernel is launched")
  args.launch = args.launch or "stub"
  width = args.width or (256 if cuda else 16)
  bt = args.bt or (64 if cuda else 4)
  seq = args.seq or 0
  if seq and bt % seq:
    p.error(f"--seq {seq} must divide the batch's rows (--bt {bt})")
  if cuda:
    import torch  # noqa: PLC0415
    if not torch.cuda.is_available():
      print("torch_overhead --device cuda: no CUDA device "
            "(torch.cuda.is_available() is False); nothing measured. Leave "
            "--device out for the CPU's figures.", file=sys.stderr)
      return 1
    device_label = f"cuda:{torch.cuda.get_device_name()}"
  else:
    device_label = f"cpu:{platform.machine()}"
  res = common.Results(args.out, "torch_overhead", device=device_label)
  case = ("per layer per step, host time, fused update launched" if cuda
          else "per layer per step, fused update stubbed"
          if args.launch == "stub" else
          "per layer per step, direct launch path, kernel launch stood in")
  shape = (f"{args.layers} x Linear({width}, {width}), BT {bt}"
           + (f" ({bt // seq} x {seq})" if seq else ""))
  dtypes = "bfloat16" if cuda or args.launch == "direct" else "float32"
  arms = [a for a in ARMS if a in args.arms]
  runs = {arm: [] for arm in arms}
  for r in range(args.repeat):
    for arm in arms:
      runs[arm].append(run_arm(arm, args.layers, width, args.steps,
                               args.warmup, args.device, bt,
                               args.profile if r == args.repeat - 1 else 0,
                               args.launch, seq))
  totals = {}
  for arm, rs in runs.items():
    t = {k: min(r[k] for r in rs) for k in rs[0]}
    totals[arm] = sum(t.values())
    for phase, v in t.items():
      res.add(case, arm, shape, dtypes, phase, v * 1e6, "us")
    res.add(case, arm, shape, dtypes, "total", totals[arm] * 1e6, "us")
    print(f"{arm:>5}: " + "  ".join(f"{k} {v * 1e6:6.1f}" for k, v in
                                     t.items())
          + f"  total {totals[arm] * 1e6:6.1f} us per layer per step",
          flush=True)
  for arm in arms[1:]:
    print(f"{arm} - {arms[0]}: {(totals[arm] - totals[arms[0]]) * 1e6:.1f} "
          "us per layer per step", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
