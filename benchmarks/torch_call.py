"""One forge_torch fused update per call: host time and step time.

    ./dev.sh python -m benchmarks.torch_call --out out/bench/torch_call.csv

Per ``nn.Linear`` shape (``in x out``; the Llama-3.1-8B projections by
default, ``--shapes``) and token count, side by side in one process, bf16
``x``, ``dy``, ``W`` and moments, torch AdamW's scalars for each step:

  torch              ``torch.matmul(grad_output.T, input, out=W.grad)``
                     (cuBLAS) then ``torch.optim.AdamW(fused=True).step()``
  forge_torch        ``forge_torch``'s fused update as its optimizers call it
                     (the direct launch of the Mosaic GPU kernel where it
                     applies: ``forge_torch.bridge_stats.direct``), the
                     next step's hyperparameters each call (a new vector
                     each time)
  forge_torch_shared the same with one hyperparameter vector for every call:
                     the other managed layers of a param group in one step
  forge_torch_dlpack the same through DLPack and JAX
                     (``forge_torch.set_direct_launch(False)``)
  jax                the same Mosaic GPU kernel and tiling called from JAX
                     (50 steps in one jitted loop: no host work per step)

Metrics: ``step`` -- GPU time per step (CUDA events around 50 back-to-back
steps, p20/p50/p80 over ``--reps`` loops; the jax arm: wall time of the
jitted loop); ``host`` -- host time per call (the Python loop's wall time
before the GPU is waited for; the torch arms only). Each arm's result after
one step is checked against the jax arm's (the same kernel: bit-identical
for forge_torch; torch within bf16 rounding) before anything is timed.
``--plot PNG`` draws step and host times. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, paths

ARMS = ("torch", "forge_torch", "forge_torch_shared", "forge_torch_dlpack",
        "jax")
LR, B1, B2, EPS, WD, STEP = 1e-4, 0.9, 0.999, 1e-8, 1e-2, 10


def _hparams(step):
  from pallas_kernels import torch_rules  # noqa: PLC0415
  return torch_rules.adamw_hparams(lr=LR, beta1=B1, beta2=B2, eps=EPS,
                                   weight_decay=WD, step=step)


def _state(bt, n_in, n_out, seed=0):
  """grad_output (BT, out), input (BT, in), weight and moments (out, in)."""
  import torch  # noqa: PLC0415
  g = torch.Generator(device="cuda").manual_seed(seed)
  go = torch.randn(bt, n_out, device="cuda", generator=g).bfloat16()
  inp = torch.randn(bt, n_in, device="cuda", generator=g).bfloat16()
  w = (0.02 * torch.randn(n_out, n_in, device="cuda", generator=g)).bfloat16()
  m = (1e-3 * torch.randn(n_out, n_in, device="cuda", generator=g)).bfloat16()
  v = (1e-6 * torch.rand(n_out, n_in, device="cuda", generator=g)).bfloat16()
  return go, inp, w, m, v


def _time(step, n_inner, reps):
  """(step p20/p50/p80, host p20/p50/p80) seconds per call."""
  import torch  # noqa: PLC0415
  for _ in range(n_inner):
    step()
  torch.cuda.synchronize()
  gpu, host = [], []
  for _ in range(reps):
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n_inner):
      step()
    host.append((time.perf_counter() - t0) / n_inner)
    end.record()
    end.synchronize()
    gpu.append(start.elapsed_time(end) * 1e-3 / n_inner)
  return common.quantiles(gpu), common.quantiles(host)


def _forge_arm(tensors, rule, shared: bool = False):
  """One update per call, the next step's hyperparameters each time (a new
  vector per call: the case that installs one in the direct launch's ring),
  or with ``shared`` the first step's vector every time; direct or through
  DLPack as ``forge_torch.set_direct_launch`` says."""
  from forge_torch import _bridge  # noqa: PLC0415
  go, inp, w, m, v = tensors
  t = [STEP]
  first = _hparams(STEP)

  def step():
    h = first if shared else _hparams(t[0])
    _bridge.fused_update(go, inp, w, (m, v), h, rule=rule)
    t[0] += 1

  return step


def _launch_path(arm: str):
  """``forge_torch.set_direct_launch`` for ``arm`` (restored on exit)."""
  import contextlib  # noqa: PLC0415
  import forge_torch  # noqa: PLC0415

  @contextlib.contextmanager
  def scope():
    was = forge_torch.set_direct_launch(arm != "forge_torch_dlpack")
    try:
      yield
    finally:
      forge_torch.set_direct_launch(was)
  return scope()


def _arm(arm: str, tensors, rule):
  """The step function of a timed torch-side ``arm``."""
  if arm == "torch":
    return _torch_arm(tensors)
  return _forge_arm(tensors, rule, shared=arm == "forge_torch_shared")


def _torch_arm(tensors):
  from benchmarks import kernel  # noqa: PLC0415
  assert (kernel.LR, kernel.B1, kernel.B2, kernel.EPS) == (LR, B1, B2, EPS)
  go, inp, w, m, v = tensors
  # W.grad = grad_output^T input, as torch's Linear forms it.
  step, (W, _, _) = kernel.torch_adamw_arm(go, inp, w, m, v, first_step=STEP,
                                           weight_decay=WD)
  tensors[2] = W.data  # the arm's weight, which the check reads
  return step


def _jax_arm(tensors, rule, cfg):
  """The same kernel from JAX: ``step(state) -> state`` for common.time_loop,
  and the JAX state."""
  import pallas_kernels as pk  # noqa: PLC0415
  arrays = [jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16)
            for t in tensors]
  h = jnp.asarray(_hparams(STEP))

  def step(s):
    go, inp, w, m, v = s
    w, (m, v) = pk.fused_wgrad_update(go, inp, w, (m, v), h, rule=rule,
                                      config=cfg, backend="mosaic_gpu")
    return go, inp, w, m, v

  return step, tuple(arrays)


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench_case(res, bt, n_in, n_out, arms, n_inner, reps) -> bool:
  """Checks and times one shape; ``False`` if an arm's result is off."""
  import torch  # noqa: PLC0415
  import forge_torch  # noqa: PLC0415
  from forge_torch import _bridge, _direct  # noqa: PLC0415
  from pallas_kernels import torch_rules  # noqa: PLC0415
  rule = torch_rules.adam_rule(amsgrad=False)
  shape = f"BT={bt} {n_in}x{n_out}"
  dtypes = "w=bf16,m/v=bf16"
  ok = True
  # One step of each arm from the same state: the forge_torch arms against
  # the jax arm (the same kernel), the torch arm within bf16 rounding.
  base = _state(bt, n_in, n_out)
  results, cfg = {}, None
  for arm in ("forge_torch", "forge_torch_shared", "forge_torch_dlpack",
              "torch"):
    tensors = [t.clone() for t in base]
    _bridge.STATS.reset()
    with _launch_path(arm):
      _arm(arm, tensors, rule)()
    torch.cuda.synchronize()
    if arm == "forge_torch":
      if _bridge.STATS.direct != 1:
        why = (_direct.unavailable()
               or "the Mosaic GPU kernel does not cover this case")
        print(f"{shape}: forge_torch did not launch directly ({why}); its "
              "rows are the DLPack path's")
      else:
        cfg = next(k[1] for k in _direct._KERNELS
                   if k[0][1:4] == (bt, n_out, n_in))
    results[arm] = tensors[2].float().cpu().numpy()
  if cfg is None:
    cfg = forge_torch_default_cfg(bt, n_out, n_in, rule)
  step, state = _jax_arm(base, rule, cfg)
  ref = np.asarray(step(state)[2].astype(jnp.float32))
  for arm, got in results.items():
    err = _rel(got, ref)
    # forge_torch: the same kernel and tiling, bit for bit; the DLPack path
    # may take another tiling or backend, torch rounds G to bf16.
    bar = 0.0 if arm in ("forge_torch", "forge_torch_shared") else 2e-2
    print(f"{shape}: {arm} vs jax (tiling {cfg.label}): rel err {err:.2e}")
    if err > bar and arm in arms:
      print(f"  {arm} is off by {err:.2e} (> {bar:g}): not timed",
            file=sys.stderr)
      ok = False
      arms = [a for a in arms if a != arm]
  for arm in arms:
    if arm == "jax":
      q, _ = common.time_loop(step, state, n_inner, reps)
      res.add(f"tiling {cfg.label}", arm, shape, dtypes, "step", q, "s")
      continue
    tensors = [t.clone() for t in base]
    fn = _arm(arm, tensors, rule)
    _bridge.STATS.reset()
    with _launch_path(arm):
      gpu, host = _time(fn, n_inner, reps)
    case = (f"direct {_bridge.STATS.direct}/{_bridge.STATS.calls}"
            if arm.startswith("forge") else "cuBLAS + AdamW(fused=True)")
    res.add(case, arm, shape, dtypes, "step", gpu, "s")
    res.add(case, arm, shape, dtypes, "host", host, "s")
    print(f"{shape} {arm:>18}: step {gpu[1] * 1e6:8.1f} us  host "
          f"{host[1] * 1e6:8.1f} us  ({case})")
    del fn, tensors
  return ok


def forge_torch_default_cfg(bt, n_in, n_out, rule):
  """The Mosaic GPU tiling for the kernel's (in, out) where forge_torch did
  not launch directly (its default for the case)."""
  import pallas_kernels as pk  # noqa: PLC0415
  held = pk.mosaic_kernel.smem_dtypes(rule, jnp.bfloat16, [jnp.bfloat16] * 2)
  return pk.mosaic_kernel.default_config(jnp.bfloat16, held, bt)


def plot(src: str, dst: str) -> int:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  rows = [r for r in common.read_rows(src)
          if r.get("benchmark") == "torch_call"]
  if not rows:
    print(f"{src} has no torch_call rows; nothing plotted", file=sys.stderr)
    return 1
  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.4 * len(shapes)), 4.5))
  for ax, metric, arms in ((axes[0], "step", ARMS),
                           (axes[1], "host", ARMS[:-1])):
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
      vals = []
      for s in shapes:
        v = [float(r["p50"]) * 1e6 for r in rows
             if (r["shape"], r["provider"], r["metric"]) == (s, arm, metric)]
        vals.append(v[-1] if v else 0.0)
      ax.bar([j + i * width for j in range(len(shapes))], vals, width,
             label=arm)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax.set_xticklabels([s.replace(" ", "\n") for s in shapes], fontsize=7)
    ax.set_ylabel(f"median {metric} time per call (µs)")
    ax.set_yscale("log")
    ax.set_title({"step": "GPU time per step", "host": "host time per call"
                  }[metric], fontsize=9)
  axes[0].legend(fontsize=7)
  fig.suptitle(f"forge_torch fused AdamW update, one layer "
               f"({rows[0]['device']})", fontsize=9)
  common.save_figure(fig, dst)
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file,
                 default="out/bench/torch_call.csv")
  p.add_argument("--tokens", type=common.positive_int, nargs="+",
                 default=[512, 2048])
  p.add_argument("--shapes", nargs="+", default=list(common.LLAMA8B_SHAPES),
                 help="nn.Linear in x out: names of common.LLAMA8B_SHAPES "
                 "or DECODER_SHAPES, or INxOUT")
  p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
  p.add_argument("--steps", type=common.positive_int, default=50,
                 help="calls per timed loop")
  p.add_argument("--reps", type=common.positive_int, default=7,
                 help="timed loops per arm")
  p.add_argument("--plot", type=paths.out_file, metavar="PNG", default=None,
                 help="also plot the CSV (all its torch_call rows)")
  p.add_argument("--replot", action="store_true",
                 help="only plot --out to --plot; measure nothing")
  args = p.parse_args(argv)
  for name in args.shapes:
    try:
      common.parse_shape(name)
    except ValueError as e:
      p.error(str(e))
  if args.replot:
    if not args.plot:
      p.error("--replot needs --plot PNG")
    if not os.path.exists(args.out):
      p.error(f"--replot: no CSV at {args.out}")
    return plot(args.out, args.plot)
  try:
    import torch  # noqa: PLC0415
  except ImportError as e:
    p.error(f"torch cannot be imported ({e}); install the 'torch' extra")
  if not torch.cuda.is_available() or jax.default_backend() != "gpu":
    print("benchmarks/torch_call.py needs a CUDA GPU for both torch and JAX; "
          "nothing measured.", file=sys.stderr)
    return 1
  res = common.Results(args.out, "torch_call",
                       device=f"gpu:{torch.cuda.get_device_name()}")
  ok = True
  for bt in args.tokens:
    for name in args.shapes:
      n_in, n_out = common.parse_shape(name)
      ok &= bench_case(res, bt, n_in, n_out, list(args.arms), args.steps,
                       args.reps)
  if args.plot:
    plot(args.out, args.plot)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
