"""Fused weight-gradient + AdamW step vs XLA's unfused GEMM + AdamW, one layer.

    ./dev.sh python -m benchmarks.kernel --out out/bench/kernel.csv

Per (shape, tokens, dtypes) it times, side by side in one process:
  xla_unfused   G = x^T dy (bf16, cuBLAS) then AdamW elementwise (one jit)
  xla_gemm      the GEMM alone;  xla_adamw: the elementwise AdamW alone
  forge         the fused Pallas kernel (best of the configs tried:
                CONFIGS, or --config LABEL...)
  forge_mainloop  the same kernel storing G instead of updating (main loop)
and, with torch (--torch, default: when torch has CUDA; bf16 moments only):
  torch         torch.matmul(x.T, dy, out=W.grad) (cuBLAS, bf16 G) then
                torch.optim.AdamW(fused=True).step()
  forge_torch   the same fused kernel on the torch tensors through the
                forge_torch bridge (DLPack, in place; the forge row's tiling),
                the bridge's per-call host work and stream ordering (its
                sync mode) included
and the achieved bandwidth (bytes the arm's step must move / time) against
the measured copy ceiling. Each JAX time is a quantile of 7 timed calls of a
50-step fori_loop; each torch time of 7 timed 50-step Python loops (CUDA
events). --torch on without CUDA runs every arm on the CPU (Pallas interpret
mode): a smoke test of this script, its times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks import common, paths

# G stored as the new "weight": the fused kernel's main loop alone.
WGRAD_ONLY = pk.UpdateRule(name="wgrad_only", slots=(), hparams=(),
                           update=lambda g, w, slots, h: (g, ()))

# The curated tilings timed per case (the best is the `forge` row): the
# winners of the tiling sweep over the four shapes x BT (docs/perf_notes.md)
# and the plain 64x128x64 tile (the interpret-mode heuristic, the first
# default).
CONFIGS = [
    pk.BlockConfig(64, 64, 64, 1, 4, 3, stream_state=True),
    pk.BlockConfig(64, 128, 32, 1, 4, 4, stream_state=True, split_out=2),
    pk.BlockConfig(128, 256, 32, 8, 8, 4, stream_state=True, split_out=4),
    pk.BlockConfig(128, 256, 64, 8, 8, 3, stream_state=True, split_out=2),
    pk.BlockConfig(64, 128, 64, 1, 4, 3),
]


# AdamW's hyperparameters, every arm; STEP: the (1-based) step timed (the
# torch arms count on from it, as a training loop does).
LR, B1, B2, EPS, WD, STEP = 1e-4, 0.9, 0.999, 1e-8, 1e-4, 10


# --config auto: the Triton tiling fused_wgrad_update picks by itself for the
# case.
AUTO = "auto"


def hparams():
  b1, b2, t = B1, B2, STEP
  return pk.ADAMW.pack(lr=LR, b1=b1, b2=b2, one_minus_b1=1 - b1,
                       one_minus_b2=1 - b2, eps=EPS, eps_root=0.0,
                       weight_decay=WD, bc1=1 - b1**t, bc2=1 - b2**t,
                       bc1_next=1 - b1**(t + 1))


def step_bytes(bt, n_in, n_out, moment_itemsize, fused=True):
  """HBM bytes one step must move: x and dy read once, bf16 W and both
  moments read and written; the unfused step also writes the bf16 G and reads
  it back (GEMM, then the elementwise AdamW)."""
  n = bt * (n_in + n_out) * 2 + n_in * n_out * 2 * (2 + 2 * moment_itemsize)
  return n if fused else n + 2 * n_in * n_out * 2


def make_state(bt, n_in, n_out, moment_dtype):
  k = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(k[0], (bt, n_in), jnp.bfloat16)
  dy = jax.random.normal(k[1], (bt, n_out), jnp.bfloat16)
  w = (0.02 * jax.random.normal(k[2], (n_in, n_out))).astype(jnp.bfloat16)
  m = (1e-3 * jax.random.normal(k[3], (n_in, n_out))).astype(moment_dtype)
  v = (1e-6 * jax.random.uniform(k[4], (n_in, n_out))).astype(moment_dtype)
  return x, dy, w, m, v


# --------------------------------------------------------------------------
# The torch arms (torch imported lazily: the JAX arms need no torch).
# --------------------------------------------------------------------------


def torch_device(mode):
  """``"cuda"``, ``"cpu"`` or ``None`` (no torch arms) for ``--torch MODE``."""
  if mode == "off":
    return None
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    if mode == "on":
      raise
    return None
  if torch.cuda.is_available():
    return "cuda"
  return "cpu" if mode == "on" else None


def to_torch(arrays, device, dtype=None):
  """torch copies of JAX arrays (exact: bf16 and fp32 go through fp32)."""
  import numpy as np  # noqa: PLC0415
  import torch  # noqa: PLC0415
  out = []
  for a in arrays:
    t = torch.from_numpy(np.asarray(a.astype(jnp.float32)).copy())
    out.append(t.to(device=device, dtype=dtype or getattr(
        torch, jnp.dtype(a.dtype).name)).contiguous())
  return out


def torch_adamw_arm(x, dy, w, m, v, first_step=STEP, weight_decay=WD):
  """The torch arm: ``W.grad = x^T dy`` by cuBLAS into a preallocated buffer,
  then ``torch.optim.AdamW(fused=True).step()`` (moments in W's dtype, as
  torch keeps them), from state ``w, m, v`` at step ``first_step``.
  Returns ``(step, (W, exp_avg, exp_avg_sq))``; ``step()`` runs one step."""
  import torch  # noqa: PLC0415
  W = torch.nn.Parameter(w.clone())
  gbuf = torch.zeros_like(W)
  opt = torch.optim.AdamW([W], lr=LR, betas=(B1, B2), eps=EPS,
                          weight_decay=weight_decay, fused=True)
  # One step lets torch create its state (its dtypes, devices, the fused
  # on-device step count); then load the benchmark's state into it.
  W.grad = gbuf
  opt.step()
  st = opt.state[W]
  with torch.no_grad():
    W.copy_(w)
    st["exp_avg"].copy_(m)
    st["exp_avg_sq"].copy_(v)
    st["step"].fill_(first_step - 1)

  def step():
    with torch.no_grad():
      torch.matmul(x.T, dy, out=gbuf)
      W.grad = gbuf
      opt.step()

  return step, (W, st["exp_avg"], st["exp_avg_sq"])


def forge_torch_arm(x, dy, w, m, v, config=None, first_step=STEP):
  """The forge_torch arm: ``forge_torch._bridge.fused_update`` (the fused
  kernel through DLPack, in place, ordered with torch's stream per the
  bridge's sync mode)
  with torch AdamW's scalars for each step, built per call as
  ``forge_torch.optim`` does. Returns ``(step, (W, exp_avg, exp_avg_sq))``."""
  from forge_torch import _bridge  # noqa: PLC0415
  from pallas_kernels import torch_rules  # noqa: PLC0415
  W, exp_avg, exp_avg_sq = w.clone(), m.clone(), v.clone()
  t = [first_step]

  def step():
    h = torch_rules.adamw_hparams(lr=LR, beta1=B1, beta2=B2, eps=EPS,
                                  weight_decay=WD, step=t[0])
    _bridge.fused_update(x, dy, W, (exp_avg, exp_avg_sq), h,
                         rule=torch_rules.adam_rule(amsgrad=False),
                         config=config)
    t[0] += 1

  return step, (W, exp_avg, exp_avg_sq)


def time_torch(step, device, n_inner=50, n_outer=7):
  """Seconds per step, (p20, p50, p80): one warm-up loop of ``n_inner``
  steps (compiles the bridge's kernel), then ``n_outer`` timed loops, each
  between two CUDA events on torch's current stream (``perf_counter`` on the
  CPU)."""
  import time  # noqa: PLC0415
  import torch  # noqa: PLC0415
  cuda = device == "cuda"
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  for _ in range(n_inner):
    step()
  sync()
  times = []
  for _ in range(n_outer):
    sync()
    if cuda:
      start = torch.cuda.Event(enable_timing=True)
      end = torch.cuda.Event(enable_timing=True)
      start.record()
      for _ in range(n_inner):
        step()
      end.record()
      end.synchronize()
      times.append(start.elapsed_time(end) * 1e-3 / n_inner)  # ms -> s
    else:
      t0 = time.perf_counter()
      for _ in range(n_inner):
        step()
      times.append((time.perf_counter() - t0) / n_inner)
  return common.quantiles(times)


def bench_torch(bt, n_in, n_out, config, device, n_inner, n_outer):
  """The two torch arms' (p20, p50, p80) seconds, and the bridge's STATS
  (in place / copied back) over the forge_torch arm."""
  from forge_torch import _bridge  # noqa: PLC0415
  tensors = to_torch(make_state(bt, n_in, n_out, jnp.bfloat16), device)
  times = {}
  step, _ = torch_adamw_arm(*tensors)
  times["torch"] = time_torch(step, device, n_inner, n_outer)
  del step
  _bridge.STATS.reset()
  step, _ = forge_torch_arm(*tensors, config=config)
  times["forge_torch"] = time_torch(step, device, n_inner, n_outer)
  stats = dataclasses.replace(_bridge.STATS)
  return times, stats


def bench_case(res, name, bt, n_in, n_out, moment_dtype, configs, ceiling,
               torch_dev=None, n_inner=50, n_outer=7):
  h = hparams()
  dtypes = f"w=bf16,m/v={jnp.dtype(moment_dtype).name}"
  shape = f"BT={bt} {n_in}x{n_out}"
  x, dy, w, m, v = make_state(bt, n_in, n_out, moment_dtype)

  def xla_unfused(s):
    x, dy, w, m, v = s
    g = jnp.dot(x.T, dy)  # bf16 G in HBM, as the standard path stores it
    w, (m, v) = pk.ADAMW.apply(g, w, (m, v), h)
    return x, dy, w, m, v

  def xla_gemm(s):
    x, dy, w, m, v = s
    return x, dy, jnp.dot(x.T, dy) + w * 0, m, v  # keep w's buffer live

  def xla_adamw(s):  # the state's first entry holds a stored bf16 G here
    g, dy, w, m, v = s
    w, (m, v) = pk.ADAMW.apply(g, w, (m, v), h)
    return g, dy, w, m, v

  def forge(cfg):
    def step(s):
      x, dy, w, m, v = s
      w, (m, v) = pk.fused_wgrad_update(x, dy, w, (m, v), h, rule=pk.ADAMW,
                                        config=cfg)
      return x, dy, w, m, v
    return step

  def mainloop(cfg):
    def step(s):
      x, dy, w, m, v = s
      w, () = pk.fused_wgrad_update(x, dy, w, (), jnp.zeros(
          pk.HPARAM_VECTOR_LEN, jnp.float32), rule=WGRAD_ONLY, config=cfg)
      return x, dy, w, m, v
    return step

  state = lambda: make_state(bt, n_in, n_out, moment_dtype)
  loop = lambda fn, s: common.time_loop(fn, s, n_inner, n_outer)
  times = {}
  for prov, fn in (("xla_unfused", xla_unfused), ("xla_gemm", xla_gemm)):
    times[prov], _ = loop(fn, state())
  x, dy, w, m, v = state()
  times["xla_adamw"], _ = loop(xla_adamw, (jnp.dot(x.T, dy), dy, w, m, v))
  best = None
  # "auto": the tiling a user's call gets (the autotune cache, else the
  # heuristic), resolved for this case; duplicates are timed once.
  resolved = []
  for cfg in configs:
    if cfg == AUTO:
      cfg = pk.select_config(bt, n_in, n_out, jnp.bfloat16,
                             [moment_dtype] * 2, pk.ADAMW)
      print(f"  {shape} {dtypes}: auto = {pk.tuning_cache.config_label(cfg)}")
    if cfg not in resolved:
      resolved.append(cfg)
  for cfg in resolved:
    try:
      q, _ = loop(forge(cfg), state())
    except Exception as e:  # noqa: BLE001 -- a config may not compile
      print(f"  {shape} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}")
      continue
    res.add(name, f"forge[{pk.tuning_cache.config_label(cfg)}]", shape,
            dtypes, "time", tuple(t * 1e6 for t in q), "us")
    if best is None or q[1] < best[0][1]:
      best = (q, cfg)
  if best is None:
    raise RuntimeError(f"{shape} {dtypes}: no tiling of {configs} ran")
  times["forge"], best_cfg = best
  times["forge_mainloop"], _ = loop(mainloop(best_cfg), state())
  stats = None
  if torch_dev is not None and jnp.dtype(moment_dtype) != jnp.bfloat16:
    # torch AdamW keeps exp_avg / exp_avg_sq in the parameter's dtype (bf16
    # here): it has no bf16-W / fp32-moment configuration to time.
    print(f"  {shape} {dtypes}: torch arms skipped (torch AdamW keeps its "
          "moments in the weight's dtype: bf16 moments only)")
  elif torch_dev is not None:
    torch_times, stats = bench_torch(bt, n_in, n_out, best_cfg, torch_dev,
                                     n_inner, n_outer)
    times.update(torch_times)
  for prov, q in times.items():
    res.add(name, prov, shape, dtypes, "time", tuple(t * 1e6 for t in q), "us")
  mb = jnp.dtype(moment_dtype).itemsize
  # Bandwidth: the bytes the arm's step must move (the fused kernel's for
  # forge / forge_torch, the unfused GEMM + AdamW's for xla_unfused / torch)
  # per median time, and that as a share of the measured copy ceiling.
  nbytes = {"forge": step_bytes(bt, n_in, n_out, mb),
            "xla_unfused": step_bytes(bt, n_in, n_out, mb, fused=False)}
  if "torch" in times:
    nbytes["forge_torch"] = nbytes["forge"]
    nbytes["torch"] = nbytes["xla_unfused"]
  pct = {}
  for prov, n in nbytes.items():
    res.add(name, prov, shape, dtypes, "bandwidth", n / times[prov][1] / 1e9,
            "GB/s")
    pct[prov] = 100 * n / times[prov][1] / ceiling
    res.add(name, prov, shape, dtypes, "pct_copy_ceiling", pct[prov], "%")
  gbps = nbytes["forge"] / times["forge"][1] / 1e9
  speedup = times["xla_unfused"][1] / times["forge"][1]
  res.add(name, "forge", shape, dtypes, "speedup_vs_xla", speedup, "x")
  us = {prov: q[1] * 1e6 for prov, q in times.items()}
  print(f"{name:20s} {shape:22s} {dtypes:18s} xla {us['xla_unfused']:8.1f}us"
        f"  gemm {us['xla_gemm']:7.1f}  adamw {us['xla_adamw']:7.1f}"
        f"  forge {us['forge']:8.1f} (mainloop {us['forge_mainloop']:7.1f})"
        f"  {speedup:5.2f}x  {gbps:6.0f} GB/s {pct['forge']:5.1f}%"
        f"  best {best_cfg}", flush=True)
  if "torch" in times:
    vs_torch = times["torch"][1] / times["forge_torch"][1]
    kernel_vs_torch = times["torch"][1] / times["forge"][1]
    res.add(name, "forge_torch", shape, dtypes, "speedup_vs_torch", vs_torch,
            "x")
    res.add(name, "forge", shape, dtypes, "speedup_vs_torch", kernel_vs_torch,
            "x")
    print(f"{'':20s} {'':22s} {'':18s} torch {us['torch']:6.1f}us"
          f" ({pct['torch']:4.1f}%)  forge_torch {us['forge_torch']:8.1f}us"
          f" ({pct['forge_torch']:4.1f}%)  torch/forge_torch {vs_torch:5.2f}x"
          f"  torch/forge {kernel_vs_torch:5.2f}x  bridge: {stats.calls} calls,"
          f" {stats.in_place} in place, {stats.copied} copied back"
          f" [{torch_dev}]", flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file, default="out/bench/kernel.csv")
  p.add_argument("--tokens", type=common.positive_int, nargs="+", default=list(common.TOKENS))
  p.add_argument("--shapes", nargs="+", default=list(common.LLAMA8B_SHAPES))
  p.add_argument("--moments", nargs="+", default=["bfloat16", "float32"])
  p.add_argument("--configs", type=common.positive_int, default=len(CONFIGS),
                 help="how many of the curated configs to try")
  p.add_argument("--config", nargs="+", default=None, metavar="LABEL",
                 help="tilings to try instead, as labels such as "
                 "64x128x64,g1,w4,s3; appended knobs: ',p' prefetch, ',e' "
                 "stream_state, ',oN' split_out=N (docs/perf_notes.md); "
                 "'auto': the Triton tiling the kernel picks by itself "
                 "(the autotune cache, else the heuristic; this benchmark "
                 "times the Triton kernel, benchmarks.backends the Mosaic "
                 "GPU one)")
  p.add_argument("--torch", choices=("auto", "on", "off"), default="auto",
                 help="the torch arms (torch: cuBLAS + AdamW(fused=True); "
                 "forge_torch: the kernel through the forge_torch bridge), "
                 "bf16 moments only. auto: when torch has CUDA; on: also "
                 "without CUDA, every arm then on the CPU (a smoke test)")
  p.add_argument("--steps", type=common.positive_int, default=50,
                 help="steps per timed loop (every arm)")
  p.add_argument("--reps", type=common.positive_int, default=7,
                 help="timed loops per arm: p20/p50/p80 over them")
  p.add_argument("--ceiling-mib", type=common.positive_int, default=2048,
                 help="size of the copy measuring the bandwidth ceiling")
  args = p.parse_args(argv)
  for m in args.moments:
    try:
      if not jnp.issubdtype(jnp.dtype(m), jnp.floating):
        raise TypeError(m)
    except TypeError:
      p.error(f"--moments: {m!r} is not a float dtype (bfloat16, float32)")
  if args.config:
    for label in args.config:
      if label != AUTO:
        try:
          pk.tuning_cache.parse_label(label)
        except ValueError as e:
          p.error(f"--config: {e}")
  for name in args.shapes:
    try:
      common.parse_shape(name)
    except ValueError as e:
      p.error(str(e))
  if args.config and args.configs != len(CONFIGS):
    p.error("--configs picks among the curated tilings; --config names them")
  if args.configs > len(CONFIGS):
    p.error(f"--configs {args.configs}: there are {len(CONFIGS)} curated "
            "tilings")
  if args.torch != "off":
    # JAX and torch share the GPU: JAX allocates as it goes instead of taking
    # 75 % of the memory before torch allocates its tensors (forge_torch sets
    # this on import too, but it is imported here only after JAX started).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  try:
    torch_dev = torch_device(args.torch)
  except ImportError as e:
    p.error(f"--torch on: torch cannot be imported ({e}); install the "
            "'torch' extra or use --torch off")
  if jax.default_backend() != "gpu" and not (args.torch == "on"
                                             and torch_dev == "cpu"):
    print("benchmarks/kernel.py needs a GPU; nothing measured (--torch on "
          "runs every arm on the CPU, a smoke test).", file=sys.stderr)
    return 1
  if args.torch == "auto" and torch_dev is None:
    print("torch arms off: torch not installed or without CUDA")
  shapes = {name: common.parse_shape(name) for name in args.shapes}
  configs = ([c if c == AUTO else pk.tuning_cache.parse_label(c)
              for c in args.config]
             if args.config else CONFIGS[:args.configs])
  res = common.Results(args.out, "kernel")
  nbytes = args.ceiling_mib << 20
  ceiling = common.copy_ceiling_bytes_per_s(nbytes)
  size = (f"{args.ceiling_mib >> 10}GiB" if args.ceiling_mib % 1024 == 0
          else f"{args.ceiling_mib}MiB")
  res.add("copy", "xla_copy", size, "f32", "bandwidth", ceiling / 1e9, "GB/s")
  print(f"device {res.device}; copy ceiling {ceiling/1e12:.2f} TB/s; "
        f"torch arms: {torch_dev or 'off'}; {res.versions}")
  for moments, name, bt in itertools.product(args.moments, args.shapes,
                                             args.tokens):
    n_in, n_out = shapes[name]
    bench_case(res, name, bt, n_in, n_out, jnp.dtype(moments),
               configs, ceiling, torch_dev, args.steps, args.reps)
  return 0


if __name__ == "__main__":
  sys.exit(main())
