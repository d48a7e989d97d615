"""The paper's headline in JAX: a Llama-3.1-8B-shaped decoder's training step
on one GPU, scanned, optax.adamw vs FORGE vs FORGE with int8 moments.

    ./dev.sh python -m benchmarks.llama8b --out L.csv [--plot L.png] \\
        [--tokens 512] [--layers 32] [--arms optax forge forge_int8]
    ./dev.sh python -m benchmarks.llama8b --tiny --in-process   # CPU smoke run

The model is benchmarks/e2e.py's Llama-style decoder (its ``Config``,
``Decoder``, ``Block``, loss, batch, AdamW hyperparameters and weight-decay
mask) at Llama-3.1-8B's shape: 32 blocks, d_model 4096, 32 heads / 8 KV
heads (head_dim 128), SwiGLU MLP 14336, vocab 128256, RMSNorm, rotary
embeddings (theta 500000), an untied head; random weights, bf16 parameters
and activations, fp32 loss, batch 1 x sequence 512 (``--tokens`` = batch x
``--seq``). The blocks are scanned, one ``(L, ...)`` stack per parameter,
each block recomputed in the backward. Arms, from the same initialisation
and batch:

  optax       flax's ``nn.scan(nn.remat(block))`` with ``flax.linen.Dense``
              projections, ``jax.value_and_grad`` + ``optax.adamw`` with
              ``mu_dtype=bfloat16`` (m and v both bf16): the standard
              scanned model, whose scan transpose writes every block's
              projection gradients into a stacked gradient pool.
  forge       ``forge_jax.ScannedBlocks`` of the same block with
              ``forge_jax.Dense`` projections (and a ``forge_jax.Dense``
              head), ``forge_jax.make_step`` + ``forge_jax.adamw``, bf16
              moments: each layer's stacked W, m, v updated in place in the
              backward loop.
  forge_int8  the same with ``forge_jax.adamw(..., moments="int8")``: int8
              moments with one fp32 scale per 64 elements, requantized in
              the same epilogue; the embedding and the norm scales take the
              transform's own int8 update.

One subprocess per arm (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, so the
allocator's peak reflects use; ``--in-process`` runs them here, one after
another, for a CPU smoke run). A cell compiles the step against abstract
arguments (compile time, ``memory_analysis()``), builds the variables
(stacked block by block inside one program, never two copies of the
blocks) and the optimizer state, reads the allocator's ``bytes_in_use``
(the state) and ``peak_bytes_in_use``, runs ``--warmup`` and ``--steps``
timed steps (``block_until_ready`` each) and reads the peak again: the
peak over the steps, which the initialisation's stays below (a cell whose
peak the steps did not raise says so). Rows (benchmark ``llama8b``, with
device, versions and commit: ``benchmarks.common.Results``): ``step_time``
(ms, p20/p50/p80), ``peak_memory``, ``state_memory``, ``step_peak`` (the
peak above the state), ``temp_memory``, ``argument_memory``,
``output_memory``, ``alias_memory`` (MiB), ``compile_time`` (s),
``loss_first`` / ``loss_final`` (nats), ``param_count``; a cell that fails
or times out gets one row with metric ``failed`` and the reason. The
driver prints each arm beside the paper's Table 1 (torch on one H200:
fused AdamW 60.08 GB / 134.3 ms, FORGE 48.36 GB / 110.2 ms, FORGE int8
35.32 GB / 155.0 ms), plots both, and checks that every arm's first-step
loss equals optax's (``benchmarks.e2e.first_losses_agree``). Exit status:
0 if every cell ran and the first losses agree, else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import warnings

_T_IMPORT = time.perf_counter()

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import forge_jax  # noqa: E402
from benchmarks import common, e2e, paths  # noqa: E402

ARMS = ("optax", "forge", "forge_int8")
RESULT_TAG = "LLAMA8B_CELL_RESULT "
BENCHMARK = "llama8b"

# Llama-3.1-8B's shape (8.03 B parameters), scanned.
LLAMA_8B = e2e.Config(layers=32, d_model=4096, heads=32, kv_heads=8,
                      ffn=14336, vocab=128256, seq=512, dtype="bfloat16",
                      rope_theta=500000.0, scan=True)
# A CPU smoke config: every kernel stack of at least 4096 elements (int8
# moments apply everywhere), the fused kernels in Pallas interpret mode.
TINY = dataclasses.replace(LLAMA_8B, layers=2, d_model=64, heads=4,
                           kv_heads=2, ffn=128, vocab=96, seq=8)
TINY_TOKENS = 16

# The paper's Table 1 (torch, one NVIDIA H200, batch 1 x sequence 512, BF16;
# mean over three runs, each the median of 20 steps): (its arm, peak GB as
# printed, step ms).
PAPER = {
    "optax": ("fused AdamW", 60.08, 134.3),
    "forge": ("FORGE", 48.36, 110.2),
    "forge_int8": ("FORGE (int8)", 35.32, 155.0),
}


# --------------------------------------------------------------------------
# The arms


def make_tx(arm: str, cfg: e2e.Config, hparams: dict | None = None):
  """The arm's AdamW (benchmarks/e2e.py's hyperparameters and decay mask):
  bf16 moments (``mu_dtype``; optax keeps ``nu`` in the parameters' dtype),
  or int8 moments for ``forge_int8``."""
  h = dict(e2e.HPARAMS if hparams is None else hparams)
  lr = h.pop("learning_rate")
  if arm == "optax":
    return optax.adamw(lr, mu_dtype=cfg.jdtype, mask=e2e.decay_mask, **h)
  if arm == "forge":
    return forge_jax.adamw(lr, mu_dtype=cfg.jdtype, mask=e2e.decay_mask, **h)
  if arm == "forge_int8":
    return forge_jax.adamw(lr, moments="int8", mask=e2e.decay_mask, **h)
  raise ValueError(f"unknown arm {arm!r}; expected one of {ARMS}")


def build_arm(arm: str, cfg: e2e.Config, wgrad: str = "fused",
              hparams: dict | None = None):
  """``(step, tx)`` of one arm, unjitted (jit it with the state donated);
  the FORGE arms' ``make_step`` takes ``wgrad``."""
  if not cfg.scan:
    raise ValueError("benchmarks.llama8b measures the scanned decoder "
                     "(Config.scan=True)")
  tx = make_tx(arm, cfg, hparams)
  if arm == "optax":
    return common.optax_step(e2e.make_loss(e2e.Decoder(cfg, nn.Dense)),
                             tx), tx
  return forge_jax.make_step(
      e2e.make_loss(e2e.Decoder(cfg, forge_jax.Dense)), tx,
      wgrad=wgrad), tx


@functools.lru_cache(maxsize=4)
def abstract_variables(cfg: e2e.Config):
  """``e2e.abstract_variables``, traced once per config in a process."""
  return e2e.abstract_variables(cfg)


@functools.lru_cache(maxsize=4)
def _initialisers(cfg: e2e.Config):
  """The jitted initialisers of :func:`init_variables` (one compile per
  config in a process)."""
  c = cfg
  x = jnp.zeros((1, c.seq, c.d_model), c.jdtype)
  embed = nn.Embed(c.vocab, c.d_model, dtype=c.jdtype, param_dtype=c.jdtype)
  block = e2e.Block(c, nn.Dense)
  head = e2e._proj(nn.Dense, c, c.vocab, "lm_head")  # noqa: SLF001
  return dict(
      embed=jax.jit(lambda k: embed.init(
          k, jnp.zeros((1, c.seq), jnp.int32))["params"]),
      blocks=jax.jit(lambda k: jax.lax.map(
          lambda i: block.init(jax.random.fold_in(k, i), x)["params"],
          jnp.arange(c.layers))),
      final_norm=jax.jit(lambda k: e2e.RMSNorm(c.jdtype).init(k, x)[
          "params"]),
      lm_head=jax.jit(lambda k: head.init(k, x)["params"]))


def init_variables(cfg: e2e.Config, seed: int = 0):
  """The scanned decoder's variables, with ``e2e.init_variables``' keys and
  flax's initialisers (block ``i`` from ``fold_in(key, i)``), but the block
  stack built inside one program, block by block (``lax.map``): no list of
  blocks next to their stack, so the initialisation's allocator peak stays
  below the training step's. Every arm starts from these variables."""
  init = _initialisers(cfg)
  k_embed, k_blocks, k_head = jax.random.split(jax.random.key(seed), 3)
  variables = {"params": {
      "embed": init["embed"](k_embed),
      "blocks": {"block": init["blocks"](k_blocks)},
      "final_norm": init["final_norm"](k_head),
      "lm_head": init["lm_head"](k_head)}}
  spec = lambda t: jax.tree.map(lambda a: (a.shape, str(a.dtype)), t)
  if spec(variables) != spec(abstract_variables(cfg)):
    raise AssertionError("init_variables built a tree other than the "
                         "Decoder's")
  return variables


def moment_dtypes(opt_state) -> str:
  """``m=...,v=...``: the dtypes of the moments' arrays (codes, not their
  fp32 scales) in an optax or low-precision AdamW state."""
  found = {"mu": set(), "nu": set()}
  flat, _ = jax.tree_util.tree_flatten_with_path(opt_state)
  for kp, a in flat:
    names = [getattr(k, "name", None) for k in kp]
    for slot in found:
      if slot in names and names[-1] != "scale":
        found[slot].add(str(a.dtype))
  return ",".join(f"{'m' if s == 'mu' else 'v'}={'/'.join(sorted(d))}"
                  for s, d in found.items())


def _restart_clock() -> None:
  """A cell's ``setup`` phase runs from the module's import (a cell's own
  process), or from the end of the previous cell run in this process."""
  global _T_IMPORT
  _T_IMPORT = time.perf_counter()


def _memory_stats() -> dict:
  try:
    return jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 -- not every backend has stats
    return {}


# --------------------------------------------------------------------------
# One cell


def case_of(cfg: e2e.Config, tokens: int) -> str:
  if dataclasses.replace(cfg, seq=LLAMA_8B.seq) == LLAMA_8B:
    name = "llama-3.1-8B"
  else:
    name = f"llama-{e2e._size(e2e.param_count(cfg))}"  # noqa: SLF001
  return f"{name} BT={tokens}"


def shape_of(cfg: e2e.Config, tokens: int) -> str:
  return (f"L{cfg.layers} d{cfg.d_model} h{cfg.heads}/kv{cfg.kv_heads} "
          f"ffn{cfg.ffn} V{cfg.vocab} B{tokens // cfg.seq}x{cfg.seq} "
          f"{e2e.layout(cfg)}")


def run_cell(arm: str, cfg: e2e.Config, tokens: int, steps: int, warmup: int,
             out: str | None, wgrad: str = "fused", seed: int = 0) -> dict:
  """Compiles, measures and runs one arm in this process; writes its rows
  to ``out`` (if given) and returns the figures."""
  if tokens % cfg.seq:
    raise ValueError(f"--tokens {tokens} is not a multiple of --seq {cfg.seq}")
  jax.devices()
  t_start = time.perf_counter()
  step, tx = build_arm(arm, cfg, wgrad)
  batch = e2e.make_batch(cfg, tokens // cfg.seq, seed)
  # Compiled against abstract arguments, before any state exists.
  _, jitted, compiled, mem, compile_s = e2e.compile_abstract(
      step, tx, cfg, batch, abs_vars=abstract_variables(cfg))

  t_compiled = time.perf_counter()
  variables = init_variables(cfg, seed)
  opt_state = jax.jit(tx.init)(variables["params"])
  jax.block_until_ready((variables, opt_state, batch))
  t_init = time.perf_counter()
  before = _memory_stats()
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(variables))
  dtypes = (f"params={cfg.dtype},{moment_dtypes(opt_state)},"
            "logits/loss=float32")
  times, losses, variables, opt_state = common.timed_steps(
      compiled, variables, opt_state, batch, warmup, steps)
  after = _memory_stats()
  peak = after.get("peak_bytes_in_use")
  state = before.get("bytes_in_use")
  init_peak = before.get("peak_bytes_in_use")
  q = tuple(t * 1e3 for t in common.quantiles(times))
  r = dict(
      arm=arm, tokens=tokens, batch=tokens // cfg.seq, seq=cfg.seq,
      params=n_params, dtypes=dtypes, wgrad=wgrad, compile_s=compile_s,
      step_ms=q, peak_bytes=peak, state_bytes=state, init_peak_bytes=init_peak,
      # The steps raised the peak above the initialisation's (else the peak
      # is the initialisation's, an upper bound of the steps').
      peak_from_steps=(None if peak is None or init_peak is None
                       else peak > init_peak),
      mem=mem, losses=losses, device=common.device_name(),
      backend=jax.default_backend(),
      phases=dict(setup=t_start - _T_IMPORT, compile=t_compiled - t_start,
                  init=t_init - t_compiled,
                  steps=time.perf_counter() - t_init))
  _restart_clock()  # the next cell run in this process (--in-process)
  if out:
    res = common.Results(out, BENCHMARK)
    r["stamp"] = res.stamp
    provider = arm if arm == "optax" or wgrad == "fused" else f"{arm}-{wgrad}"
    add = lambda metric, v, unit: res.add(case_of(cfg, tokens), provider,
                                          shape_of(cfg, tokens), dtypes,
                                          metric, v, unit)
    mib = lambda b: b / 2**20
    add("step_time", q, "ms")
    if peak is not None:
      add("peak_memory", mib(peak), "MiB" if r["peak_from_steps"] is not False
          else "MiB (the initialisation's peak)")
    if state is not None:
      add("state_memory", mib(state), "MiB")
      if peak is not None:
        add("step_peak", mib(peak - state), "MiB")
    for k in ("temp", "argument", "output", "alias"):
      add(f"{k}_memory", mib(mem[k]), "MiB")
    add("compile_time", compile_s, "s")
    add("loss_first", losses[0], "nats")
    add("loss_final", losses[-1], "nats")
    add("param_count", float(n_params), "params")
  return r


# --------------------------------------------------------------------------
# The driver


def _gib(b):
  return None if b is None else b / 2**30


def summarize(results: dict, tokens: int) -> bool:
  """Prints every arm beside the paper's figures; returns whether every
  arm's first-step loss agrees with optax's."""
  f = lambda v, spec: "n/a" if v is None else format(v, spec)
  base = results.get("optax")
  print(f"\nBT {tokens}: this run (peak: the allocator's over the steps; "
        "temp: the compiled step's temporaries) beside the paper's Table 1 "
        "(torch, one H200, BT 512; its peaks in GB as printed)")
  print(f"{'arm':<11} {'peak GiB':>9} {'step-peak GiB':>13} {'temp GiB':>9} "
        f"{'step p50 ms':>11} {'÷ optax':>15} | {'paper':<13} "
        f"{'peak GB':>8} {'step ms':>8} {'÷ fused AdamW':>15}")
  for arm in ARMS:
    r = results.get(arm)
    name, p_gb, p_ms = PAPER[arm]
    _, b_gb, b_ms = PAPER["optax"]
    if r is None:
      ours = f"{'(not run)':<11} {'':>9} {'':>13} {'':>9} {'':>11} {'':>15}"
    else:
      peak, state = r["peak_bytes"], r["state_bytes"]
      step_peak = None if peak is None or state is None else peak - state
      ratio = "n/a"
      if base is not None and base["peak_bytes"] and peak is not None:
        ratio = (f"{peak / base['peak_bytes']:.2f}x, "
                 f"{r['step_ms'][1] / base['step_ms'][1]:.2f}x")
      elif base is not None:
        ratio = f"-, {r['step_ms'][1] / base['step_ms'][1]:.2f}x"
      ours = (f"{arm:<11} {f(_gib(peak), '.2f'):>9} "
              f"{f(_gib(step_peak), '.2f'):>13} "
              f"{f(_gib(r['mem']['temp']), '.2f'):>9} "
              f"{r['step_ms'][1]:>11.2f} {ratio:>15}")
    print(f"{ours} | {name:<13} {p_gb:>8.2f} {p_ms:>8.1f} "
          f"{f'{p_gb / b_gb:.2f}x, {p_ms / b_ms:.2f}x':>15}")
  ok = True
  for arm in ARMS:
    r = results.get(arm)
    if r is None:
      continue
    if r["peak_from_steps"] is False:
      print(f"{arm}: the steps did not raise the allocator's peak above the "
            "initialisation's; its peak is an upper bound of the steps'")
    if arm != "optax" and base is not None:
      ok &= e2e.first_losses_agree(tokens, arm, r["losses"][0], "optax",
                                   base["losses"][0])
    if not r["losses"][-1] < r["losses"][0]:
      print(f"{arm}: warning: the loss did not fall "
            f"({r['losses'][0]:.5f} -> {r['losses'][-1]:.5f})")
  return ok


def plot(csv_path: str, png_path: str, pick: dict | None = None) -> None:
  """Two panels, peak memory (GiB; the compiled temporaries where the
  backend has no allocator peak) and p50 step time (ms): each arm's bar
  (from one run, or the cells ``pick`` names, as
  ``benchmarks.e2e.bar_rows`` reads them) beside the paper's, hatched."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  rows = e2e.bar_rows(csv_path, pick, benchmark=BENCHMARK)
  bts = sorted({k[0] for k in rows})
  if not bts:
    raise ValueError(f"{csv_path} has no {BENCHMARK} rows to plot")
  bt = bts[-1]
  providers = [p for p in dict.fromkeys(k[1] for k in rows if k[0] == bt)]
  has_peak = any(k[2] == "peak_memory" for k in rows)
  mem_metric = "peak_memory" if has_peak else "temp_memory"
  panels = ((mem_metric, 2**-10, "allocator peak (GiB)" if has_peak
             else "compiled temporaries (GiB)", 1),
            ("step_time", 1.0, "median step time (ms)", 2))
  fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
  colors = {"optax": "gray", "forge": "tab:orange", "forge_int8": "tab:green"}
  for ax, (metric, scale, label, paper_i) in zip(axes, panels):
    xs = range(len(providers))
    ours = [float(rows[(bt, p, metric)]["p50"]) * scale
            if (bt, p, metric) in rows else float("nan") for p in providers]
    arm_of = lambda p: p.rsplit("-", 1)[0] if p not in PAPER else p
    paper = [PAPER[arm_of(p)][paper_i] if arm_of(p) in PAPER else float("nan")
             for p in providers]
    bars = ax.bar([x - 0.2 for x in xs], ours, 0.4, label="this run",
                  color=[colors.get(arm_of(p), "tab:blue") for p in providers])
    ax.bar_label(bars, labels=["" if v != v else f"{v:.1f}" for v in ours],
                 fontsize=7)
    bars = ax.bar([x + 0.2 for x in xs], paper, 0.4, fill=False, hatch="//",
                  label="paper (torch, H200)")
    ax.bar_label(bars, labels=["" if v != v else f"{v:.1f}" for v in paper],
                 fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(providers)
    ax.set_ylabel(label + (" / paper GB" if paper_i == 1 else ""))
    ax.legend(fontsize=8)
  row = next(iter(rows.values()))
  fig.suptitle(f"{row['case']} ({row['shape']}) training step on "
               f"{row['device']}", fontsize=9)
  common.save_figure(fig, png_path)


def _failed_row(path: str, cfg: e2e.Config, arm: str, tokens: int,
                wgrad: str, device: str, reason: str) -> None:
  res = common.Results(path, BENCHMARK, device=device)
  provider = arm if arm == "optax" or wgrad == "fused" else f"{arm}-{wgrad}"
  res.add(case_of(cfg, tokens), provider, shape_of(cfg, tokens),
          f"params={cfg.dtype}", "failed", float("nan"), reason[:300])


def _cell_argv(args, arm: str) -> list[str]:
  argv = [sys.executable, "-m", "benchmarks.llama8b", "--cell", "--arm", arm,
          "--tokens", str(args.tokens), "--seq", str(args.seq), "--layers",
          str(args.layers), "--steps", str(args.steps), "--warmup",
          str(args.warmup), "--seed", str(args.seed), "--wgrad", args.wgrad]
  if args.tiny:
    argv.append("--tiny")
  if args.out:
    argv += ["--out", os.path.abspath(args.out)]
  return argv


def config_of(args) -> e2e.Config:
  base = TINY if args.tiny else LLAMA_8B
  return dataclasses.replace(base, layers=args.layers, seq=args.seq)


def parse_args(argv):
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0], formatter_class=common.DefaultsFormatter)
  p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
  p.add_argument("--tokens", type=common.positive_int, default=None,
                 help="tokens per step, a multiple of --seq (default 512; "
                 f"--tiny: {TINY_TOKENS})")
  p.add_argument("--seq", type=common.positive_int, default=None,
                 help=f"sequence length (default {LLAMA_8B.seq}; --tiny: "
                 f"{TINY.seq})")
  p.add_argument("--layers", type=common.positive_int, default=None,
                 help=f"blocks (default {LLAMA_8B.layers}; --tiny: "
                 f"{TINY.layers})")
  p.add_argument("--tiny", action="store_true",
                 help="a tiny decoder of the same structure (d_model 64, "
                 "vocab 96): a smoke run on the CPU, kernels in Pallas "
                 "interpret mode")
  p.add_argument("--wgrad", choices=("fused", "xla"), default="fused",
                 help="make_step's wgrad for the FORGE arms")
  p.add_argument("--steps", type=common.positive_int, default=10,
                 help="timed steps per cell")
  p.add_argument("--warmup", type=common.positive_int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=paths.out_file, default="out/bench/llama8b.csv")
  p.add_argument("--plot", type=paths.out_file, default=None, metavar="PNG",
                 help="default: --out with .png")
  p.add_argument("--in-process", action="store_true",
                 help="run the cells in this process, one after another, "
                 "instead of one subprocess each (a later cell's allocator "
                 "peak then includes the earlier cells')")
  p.add_argument("--cell-timeout", type=float, default=1200.0,
                 help="seconds per cell subprocess")
  p.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  base = TINY if args.tiny else LLAMA_8B
  args.layers = args.layers or base.layers
  args.seq = args.seq or base.seq
  args.tokens = args.tokens or (TINY_TOKENS if args.tiny else 512)
  if args.tokens % args.seq:
    p.error(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}")
  if args.cell_timeout <= 0:
    p.error(f"--cell-timeout {args.cell_timeout:g} must be > 0")
  if args.plot is None:
    args.plot = os.path.splitext(args.out)[0] + ".png"
  return args


def _print_cell(r: dict) -> None:
  gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"
  print(f"{r['arm']} BT={r['tokens']} on {r['device']}: {r['params']:,} "
        f"params ({r['dtypes']}); compile {r['compile_s']:.1f} s; step p50 "
        f"{r['step_ms'][1]:.2f} ms; peak {gib(r['peak_bytes'])} GiB, state "
        f"{gib(r['state_bytes'])} GiB, temp {gib(r['mem']['temp'])} GiB; "
        f"losses {' '.join(f'{l:.4f}' for l in r['losses'])}; phases (s) "
        + ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items()),
        flush=True)


def main(argv=None) -> int:
  args = parse_args(argv)
  cfg = config_of(args)
  if args.cell:
    r = run_cell(args.arm, cfg, args.tokens, args.steps, args.warmup,
                 args.out, args.wgrad, args.seed)
    _print_cell(r)
    print(RESULT_TAG + json.dumps(r), flush=True)
    return 0

  n = e2e.param_count(cfg)
  print(f"model: {case_of(cfg, args.tokens)}: {n:,} parameters "
        f"({n / 1e9:.3f} B), {cfg.layers} blocks scanned, d_model "
        f"{cfg.d_model}, {cfg.heads} heads / {cfg.kv_heads} kv heads, MLP "
        f"{cfg.ffn}, vocab {cfg.vocab}, batch {args.tokens // cfg.seq} x seq "
        f"{cfg.seq}; bf16 params; AdamW {e2e.HPARAMS}. Arms {args.arms}; "
        f"{args.warmup} warm-up + {args.steps} timed steps; CSV {args.out}",
        flush=True)
  results, failed, device = {}, [], "unknown"
  for arm in args.arms:
    if args.in_process:
      print(f"== cell {arm} (in this process)", flush=True)
      try:
        r, reason = run_cell(arm, cfg, args.tokens, args.steps, args.warmup,
                             args.out, args.wgrad, args.seed), None
        _print_cell(r)
      except Exception as e:  # noqa: BLE001 -- recorded as a failed cell
        r, reason = None, f"{type(e).__name__}: {e}"
    else:
      argv_ = _cell_argv(args, arm)
      print(f"== cell {arm} (timeout {args.cell_timeout:.0f} s): "
            f"{' '.join(argv_[1:])}", flush=True)
      r, reason = e2e.run_tagged(argv_, e2e._subprocess_env(),  # noqa: SLF001
                                 args.cell_timeout, arm, RESULT_TAG)
    if r is None:
      failed.append((arm, reason))
      print(f"   FAILED {arm}: {reason}", flush=True)
      if device == "unknown":
        device = (common.device_name() if args.in_process
                  else e2e.probe_device())
      _failed_row(args.out, cfg, arm, args.tokens, args.wgrad, device,
                  reason)
    else:
      results[arm] = r
      device = r["device"]
  same = summarize(results, args.tokens)
  for arm, reason in failed:
    print(f"failed cell {arm}: {reason}")
  if results:
    provider = lambda a: a if a == "optax" or args.wgrad == "fused" else (
        f"{a}-{args.wgrad}")
    plot(args.out, args.plot, pick={(args.tokens, provider(a)): r["stamp"]
                                    for a, r in results.items()})
  return 0 if same and not failed else 1


if __name__ == "__main__":
  sys.exit(main())
