r"""Where does the fused kernel's epilogue lose bandwidth? (a probe)

    ./dev.sh python -m benchmarks.epilogue_probe --out out/probe   # on a GPU

Two measurements, side by side in one process, written to
``OUT/probe.csv`` (device and versions in every row):

* ``elementwise``: a Pallas-Triton AdamW kernel with *no* GEMM -- it reads a
  stored bf16 ``G`` and ``W, m, v`` in (rows x cols) blocks and writes
  ``W, m, v`` -- against XLA's fused elementwise AdamW on the same arrays.
  If Pallas-Triton blocks reach XLA's bandwidth, the fused kernel's slower
  epilogue comes from what the GEMM leaves behind (the accumulator's layout,
  registers), not from Pallas-Triton memory access as such.
* ``fused``: the fused kernel at the given tilings and token counts
  (``BT = 16`` isolates the epilogue), beside XLA's unfused step.
* ``--once``: every kernel above runs exactly once, untimed, for a
  profiler; registers per thread, programs per SM, warps active and DRAM
  throughput then come from Nsight Compute::

      ncu --csv --log-file ncu.csv --metrics launch__registers_per_thread,...\
          python -m benchmarks.epilogue_probe --once --tokens 16 ...
      python -m benchmarks.ncu_summary ncu.csv --kernels elementwise_adamw \
          fused_wgrad_adamw --out summary.csv

  The profile behind docs/perf_notes.md ran ``--once --tokens 16 512
  --elementwise 32x128,w4 64x128,w4`` with the default ``--config`` list.

(XLA's ``--xla_dump_to`` does not include the PTX of a Pallas-Triton custom
call, so the kernel's code is not read here.)
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import pallas_kernels as pk
from benchmarks import common, paths
from benchmarks.kernel import hparams, make_state

# The tilings profiled for docs/perf_notes.md: 64 vs 32 accumulator elements
# per thread, and column sub-tiles (docs/perf_notes.md, variants 8-11).
DEFAULT_CONFIGS = [
    "64x128x32,g1,w4,s4,e",
    "64x128x32,g1,w4,s4,e,o2",
    "64x128x32,g1,w4,s2,e",
    "64x64x32,g1,w4,s4,e",
    "32x128x32,g1,w4,s4,e",
    "128x128x32,g1,w4,s4,e,o2",
    "128x256x32,g8,w8,s4,e,o4",
]
ELEMENTWISE_BLOCKS = ["64x128,w4", "128x128,w8", "32x128,w4", "16x512,w4",
                      "64x256,w8", "8x1024,w4", "32x1024,w8"]


def elementwise_adamw(g, w, m, v, h, bm, bn, warps):
  """AdamW on stored ``g`` in (bm, bn) blocks; W, m, v updated in place."""
  n_in, n_out = w.shape
  if n_in % bm or n_out % bn:
    raise ValueError(f"block {bm}x{bn} does not divide the {n_in}x{n_out} "
                     "arrays (this probe has no masks)")
  tiles_out = n_out // bn

  def kernel(g_ref, h_ref, w_ref, m_ref, v_ref, w_out, m_out, v_out):
    i = pl.program_id(0)
    t = (pl.ds((i // tiles_out) * bm, bm), pl.ds((i % tiles_out) * bn, bn))
    gg = plgpu.load(g_ref.at[t]).astype(jnp.float32)
    old = [plgpu.load(r.at[t]).astype(jnp.float32) for r in (w_ref, m_ref, v_ref)]
    w_new, (m_new, v_new) = pk.ADAMW.update(gg, old[0], tuple(old[1:]),
                                            pk.ADAMW.unpack(h_ref))
    for r, val in zip((w_out, m_out, v_out), (w_new, m_new, v_new)):
      plgpu.store(r.at[t], val.astype(r.dtype))

  return pl.pallas_call(
      kernel,
      out_shape=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (w, m, v)),
      grid=(n_in // bm * tiles_out,),
      input_output_aliases={2: 0, 3: 1, 4: 2},
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      interpret=jax.default_backend() != "gpu",
      name="elementwise_adamw",
  )(g, h, w, m, v)


def _run_once(step, state):
  """Run ``step`` once, untimed (``--once``: a profiler does the measuring)."""
  jax.block_until_ready(jax.jit(step, donate_argnums=0)(state))
  return None, None


def probe_elementwise(res, n_in, n_out, blocks, once=False):
  timer = _run_once if once else common.time_loop
  h = hparams()
  x, dy, w, m, v = make_state(512, n_in, n_out, jnp.bfloat16)
  g = jnp.dot(x.T, dy)
  nbytes = n_in * n_out * 2 * 7  # read G, W, m, v; write W, m, v (bf16)
  shape = f"{n_in}x{n_out}"

  def xla(s):
    g, w, m, v = s
    w, (m, v) = pk.ADAMW.apply(g, w, (m, v), h)
    return g, w, m, v

  fresh = lambda: tuple(jnp.copy(a) for a in (g, w, m, v))  # loops donate
  q, _ = timer(xla, fresh())
  rows = [("xla_adamw", q)]
  for spec in blocks:
    (bm, bn), warps = map(int, spec.split(",")[0].split("x")), int(spec.split(",w")[1])

    def step(s, bm=bm, bn=bn, warps=warps):
      g, w, m, v = s
      w, m, v = elementwise_adamw(g, w, m, v, h, bm, bn, warps)
      return g, w, m, v

    try:
      q, _ = timer(step, fresh())
    except Exception as e:  # noqa: BLE001 -- report and go on
      print(f"elementwise {spec}: failed: {type(e).__name__}: {str(e)[:300]}")
      continue
    rows.append((f"pallas_elementwise[{spec}]", q))
  for prov, q in rows:
    if q is None:
      print(f"elementwise {prov}: ran once")
      continue
    res.add("elementwise", prov, shape, "bf16", "time",
            tuple(t * 1e6 for t in q), "us")
    res.add("elementwise", prov, shape, "bf16", "bandwidth",
            nbytes / q[1] / 1e9, "GB/s")
    print(f"elementwise {prov:34s} {shape}: {q[1]*1e6:7.1f} us "
          f"{nbytes/q[1]/1e12:5.2f} TB/s", flush=True)


def _forge_step(s, h, cfg):
  x, dy, w, m, v = s
  w, (m, v) = pk.fused_wgrad_update(x, dy, w, (m, v), h, rule=pk.ADAMW,
                                    config=cfg)
  return x, dy, w, m, v


def probe_fused(res, n_in, n_out, tokens, labels, once=False):
  timer = _run_once if once else common.time_loop
  h = hparams()
  shape_name = f"{n_in}x{n_out}"
  for bt in tokens:
    state = lambda: make_state(bt, n_in, n_out, jnp.bfloat16)
    shape = f"BT={bt} {shape_name}"

    def xla_unfused(s):
      x, dy, w, m, v = s
      w, (m, v) = pk.ADAMW.apply(jnp.dot(x.T, dy), w, (m, v), h)
      return x, dy, w, m, v

    q, _ = timer(xla_unfused, state())
    if q is None:  # --once
      for label in labels:
        cfg = pk.tuning_cache.parse_label(label)
        timer(lambda s, cfg=cfg: _forge_step(s, h, cfg), state())
        print(f"fused {shape} {label}: ran once", flush=True)
      continue
    xla_t = q[1]
    res.add("fused", "xla_unfused", shape, "bf16", "time",
            tuple(t * 1e6 for t in q), "us")
    print(f"fused {shape:20s} xla_unfused {xla_t*1e6:8.1f} us", flush=True)
    for label in labels:
      cfg = pk.tuning_cache.parse_label(label)

      try:
        q, _ = timer(lambda s, cfg=cfg: _forge_step(s, h, cfg), state())
      except Exception as e:  # noqa: BLE001 -- report and go on
        print(f"fused {shape} {label}: failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      res.add("fused", f"forge[{label}]", shape, "bf16", "time",
              tuple(t * 1e6 for t in q), "us")
      res.add("fused", f"forge[{label}]", shape, "bf16", "speedup_vs_xla",
              xla_t / q[1], "x")
      print(f"fused {shape:20s} {label:28s} {q[1]*1e6:8.1f} us "
            f"{xla_t/q[1]:5.2f}x", flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_dir, default="out/probe")
  p.add_argument("--shape", default="4096x4096")
  p.add_argument("--tokens", type=common.positive_int, nargs="+",
                 default=[16, 512, 2048])
  p.add_argument("--config", nargs="+", default=DEFAULT_CONFIGS, metavar="LABEL")
  p.add_argument("--elementwise", nargs="*", default=ELEMENTWISE_BLOCKS,
                 metavar="BMxBN,wW")
  p.add_argument("--once", action="store_true",
                 help="run each kernel once, untimed (under a profiler)")
  args = p.parse_args(argv)
  try:
    n_in, n_out = map(int, args.shape.split("x"))
    if n_in < 1 or n_out < 1:
      raise ValueError
  except ValueError:
    p.error(f"--shape {args.shape!r} is not INxOUT (positive ints)")
  for spec in args.elementwise:
    try:
      dims = [int(v) for v in spec.split(",")[0].split("x")]
      if len(dims) != 2 or int(spec.split(",w")[1]) < 1:
        raise ValueError(spec)
    except (ValueError, IndexError):
      p.error(f"--elementwise {spec!r} is not BMxBN,wW (e.g. 32x128,w4)")
  for label in args.config:
    try:
      pk.tuning_cache.parse_label(label)
    except ValueError as e:
      p.error(f"--config: {e}")
  if jax.default_backend() != "gpu":
    print("benchmarks/epilogue_probe.py needs a GPU; nothing measured.",
          file=sys.stderr)
    return 1
  os.makedirs(args.out, exist_ok=True)
  res = common.Results(os.path.join(args.out, "probe.csv"), "epilogue_probe")
  print(f"device {res.device}; {res.versions}")
  if args.elementwise:
    probe_elementwise(res, n_in, n_out, args.elementwise, args.once)
  probe_fused(res, n_in, n_out, args.tokens, args.config, args.once)
  return 0


if __name__ == "__main__":
  sys.exit(main())
