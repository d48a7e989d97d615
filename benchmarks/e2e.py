"""End to end: a Llama-style Flax decoder's training step, FORGE vs optax.adamw.

    ./dev.sh python -m benchmarks.e2e --out E.csv --plot E.png

A Llama-style decoder (token embedding; per block RMSNorm -> GQA attention
with rotary embeddings through ``jax.nn.dot_product_attention(is_causal=True)``
-> residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; untied LM
head), bf16 parameters and activations (``--param-dtype float32``: fp32
parameters and moments, bf16 activations: mixed precision), fp32 loss
(softmax cross-entropy on fp32 logits). The arms run the same model,
initialisation, batch and AdamW hyperparameters (m and v both stored in
the parameters' dtype; ``--mu-dtype``: m in its own, as optax's
``mu_dtype``):

  forge      every projection (q, k, v, o, gate, up, down, LM head) is a
             ``forge_jax.Dense(use_bias=False)``; ``forge_jax.make_step``
             with ``forge_jax.adamw`` -- each kernel is updated inside its
             backward by the fused kernel.
  forge-xla  the same, with ``make_step(..., wgrad="xla")``: each kernel's
             update, still inside its backward, is XLA's GEMM storing that
             layer's gradient and an elementwise AdamW reading it.
  optax      the same projections as ``flax.linen.Dense``;
             ``jax.value_and_grad`` + ``optax.adamw``.

Every arm's step is ``jax.jit(step, donate_argnums=(0, 1))``; embeddings and norm
scales take optax's own update in both. The blocks are unrolled, or with
``--scan`` scanned: one ``(L, ...)`` stack per parameter, each block
recomputed in the backward -- flax's ``nn.scan(nn.remat(block))`` + optax
against ``forge_jax.ScannedBlocks`` (the same scan outside a step; inside,
one reverse loop that recomputes each block and updates its projections'
stacked kernels and moments in place).

The driver runs one subprocess per (arm, BT) cell (``--cell``; same Python,
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so the allocator's peak reflects
use), each under a timeout. A cell compiles the step (compile time), reads its
``memory_analysis()``, runs 2 warm-up steps and ``--steps`` timed steps
(``block_until_ready`` per step) and reads the device allocator's
``peak_bytes_in_use`` (not available on CPU); it prints where its wall
time went (``phases``: start-up, compile, init, steps). Each cell appends its rows to
the CSV through ``benchmarks.common.Results`` (benchmark ``e2e``): metrics
``step_time`` (ms, p20/p50/p80), ``peak_memory``, ``temp_memory``,
``argument_memory``, ``output_memory``, ``alias_memory`` (MiB),
``compile_time`` (s), ``loss_first`` / ``loss_final`` (nats: the first
warm-up step's loss and the last timed step's) and ``param_count``. A cell
that fails or times out gets one row with metric ``failed``, NaN values and
the reason in ``unit``. ``--repeat N`` runs every cell N times, in rounds of
all arms whose order is reversed every other round (fresh process and
compile each time): one compile's step time can sit several percent from
another's. The driver prints a table of each FORGE arm beside optax (the
median cell of each -- the lower middle one of an even count -- with every
cell's p50 listed under ``--repeat``), plots the same cells, and checks that
the arms start from the same loss. ``--autotune-cache DIR`` makes every
cell share XLA's GEMM autotuning choices (see its help). Exit status: 0 if every cell ran and the
first-step losses agree, else 1.

``--replot --out CSV --plot PNG`` draws a CSV without running anything,
each BT's bars from one run (consecutive rows of one commit, device and
versions): of the runs with the most of ``--arms`` at that BT, the newest,
its commit written under the BT.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime as _dt
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any

_T_IMPORT = time.perf_counter()  # a cell's clock starts here (see run_cell)

# Cells run in the repository (``python -m benchmarks.e2e --cell``).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import forge_jax  # noqa: E402
from benchmarks import common, paths  # noqa: E402

ARMS = ("forge", "forge-xla", "optax")
# make_step's wgrad of each FORGE arm.
WGRAD = {"forge": "fused", "forge-xla": "xla"}
RESULT_TAG = "E2E_CELL_RESULT "
# Both arms' first-step losses come from the same forward on the same
# initialisation; only XLA's fusion / GEMM-algorithm choices may differ.
FIRST_LOSS_RTOL = 2e-3
# AdamW hyperparameters, identical in every arm.
HPARAMS = dict(learning_rate=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


# --------------------------------------------------------------------------
# The model


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 16
  d_model: int = 2048
  heads: int = 16
  kv_heads: int = 8
  ffn: int = 5632
  vocab: int = 32000
  seq: int = 512
  dtype: str = "bfloat16"          # activations, and params, m / v unless:
  param_dtype: str | None = None   # params and m / v (mixed precision)
  mu_dtype: str | None = None      # AdamW's m alone (None: the params')
  attn_impl: str | None = None     # jax.nn.dot_product_attention's (None: XLA)
  rope_theta: float = 10000.0
  # The blocks scanned (one (L, ...) stack per parameter, each block
  # recomputed in the backward) instead of unrolled.
  scan: bool = False

  def __post_init__(self):
    if self.d_model % self.heads or self.heads % self.kv_heads:
      raise ValueError("d_model must be a multiple of heads, heads of kv_heads")
    if (self.d_model // self.heads) % 2:
      raise ValueError("head_dim must be even (rotary embedding)")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.heads

  @property
  def jdtype(self):
    return jnp.dtype(self.dtype)

  @property
  def pdtype(self):
    """The parameters' (and the moments') dtype."""
    return jnp.dtype(self.param_dtype or self.dtype)

  @property
  def mdtype(self):
    """AdamW's ``mu_dtype`` (``v`` stays in the parameters' dtype, as optax
    keeps it)."""
    return jnp.dtype(self.mu_dtype) if self.mu_dtype else self.pdtype


def layout(cfg: Config) -> str:
  """How the blocks are laid out, as the CSV's shape column says it."""
  return "scanned (remat)" if cfg.scan else "unrolled"


def param_count(cfg: Config) -> int:
  """Parameters of :class:`Decoder` (embedding, blocks, final norm, head)."""
  d, hd = cfg.d_model, cfg.head_dim
  attn = d * cfg.heads * hd * 2 + d * cfg.kv_heads * hd * 2
  block = attn + 3 * d * cfg.ffn + 2 * d
  return 2 * cfg.vocab * d + cfg.layers * block + d


class RMSNorm(nn.Module):
  dtype: Any
  eps: float = 1e-6
  param_dtype: Any = None  # (None: dtype)

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],),
                       self.param_dtype or self.dtype)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(self.dtype)


def rotary(x, theta: float):
  """Rotary position embedding of ``x`` ``(batch, seq, heads, head_dim)``
  (the half-split form), computed in fp32."""
  seq, hd = x.shape[1], x.shape[-1]
  freqs = theta ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _proj(dense, cfg: Config, features: int, name: str):
  return dense(features, use_bias=False, dtype=cfg.jdtype,
               param_dtype=cfg.pdtype, name=name)


class Attention(nn.Module):
  cfg: Config
  dense: Any

  @nn.compact
  def __call__(self, x):
    c, (b, t, _) = self.cfg, x.shape
    q = _proj(self.dense, c, c.heads * c.head_dim, "q")(x)
    k = _proj(self.dense, c, c.kv_heads * c.head_dim, "k")(x)
    v = _proj(self.dense, c, c.kv_heads * c.head_dim, "v")(x)
    q = rotary(q.reshape(b, t, c.heads, c.head_dim), c.rope_theta)
    k = rotary(k.reshape(b, t, c.kv_heads, c.head_dim), c.rope_theta)
    v = v.reshape(b, t, c.kv_heads, c.head_dim)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                     implementation=c.attn_impl)
    return _proj(self.dense, c, c.d_model, "o")(o.reshape(b, t, -1))


class MLP(nn.Module):
  cfg: Config
  dense: Any

  @nn.compact
  def __call__(self, x):
    c = self.cfg
    gate = _proj(self.dense, c, c.ffn, "gate")(x)
    up = _proj(self.dense, c, c.ffn, "up")(x)
    return _proj(self.dense, c, c.d_model, "down")(nn.silu(gate) * up)


class Block(nn.Module):
  cfg: Config
  dense: Any

  @nn.compact
  def __call__(self, x):
    x = x + Attention(self.cfg, self.dense, name="attn")(
        RMSNorm(self.cfg.jdtype, param_dtype=self.cfg.pdtype,
                name="attn_norm")(x))
    return x + MLP(self.cfg, self.dense, name="mlp")(
        RMSNorm(self.cfg.jdtype, param_dtype=self.cfg.pdtype,
                name="mlp_norm")(x))


class _ScanBody(nn.Module):
  """flax's scan body for the scanned optax arm: one block, named ``block``
  (``forge_jax.ScannedBlocks``' tree)."""

  cfg: Config

  @nn.compact
  def __call__(self, x, _):
    return Block(self.cfg, nn.Dense, name="block")(x), None


class Decoder(nn.Module):
  """Llama-style decoder; ``dense`` (``forge_jax.Dense`` or
  ``flax.linen.Dense``) is the class of every projection and of the head --
  the only difference between the arms' models (same parameter tree).

  With ``cfg.scan`` the blocks are one scanned stack named ``blocks``
  (parameters ``blocks/block/...``, each stacked ``(L, ...)``), every block
  recomputed in the backward: flax's ``nn.scan(nn.remat(...))`` for the optax
  arm, ``forge_jax.ScannedBlocks`` (which is that scan outside a step, and
  recomputes each block in its fused backward) for the FORGE arms."""

  cfg: Config
  dense: Any = nn.Dense

  @nn.compact
  def __call__(self, tokens):
    c = self.cfg
    x = nn.Embed(c.vocab, c.d_model, dtype=c.jdtype, param_dtype=c.pdtype,
                 name="embed")(tokens)
    if c.scan and self.dense is nn.Dense:
      x, _ = nn.scan(nn.remat(_ScanBody), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=c.layers)(
                         c, name="blocks")(x, None)
    elif c.scan:
      x = forge_jax.ScannedBlocks(
          functools.partial(Block, c, self.dense), c.layers,
          name="blocks")(x)
    for i in range(0 if c.scan else c.layers):
      x = Block(c, self.dense, name=f"block_{i}")(x)
    x = RMSNorm(c.jdtype, param_dtype=c.pdtype, name="final_norm")(x)
    return _proj(self.dense, c, c.vocab, "lm_head")(x)


# --------------------------------------------------------------------------
# The two arms


def make_loss(model: nn.Module):
  def loss_fn(variables, batch):
    tokens, targets = batch
    logits = model.apply(variables, tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets).mean()
  return loss_fn


def decay_mask(params):
  """Weight decay on matrices (projections, head, embedding), not on norms
  (by name: a scanned model's norm scales are stacked matrices)."""
  return jax.tree_util.tree_map_with_path(
      lambda kp, p: getattr(kp[-1], "key", None) in ("kernel", "embedding"),
      params)


def make_tx(arm: str, cfg: Config, hparams: dict | None = None):
  """The arm's AdamW: ``mu_dtype`` = the parameters' dtype (or
  ``cfg.mu_dtype``), so m and v (which optax keeps in the parameters'
  dtype) are stored alike in every arm."""
  h = dict(HPARAMS if hparams is None else hparams)
  lr = h.pop("learning_rate")
  make = forge_jax.adamw if arm in WGRAD else optax.adamw
  return make(lr, mu_dtype=cfg.mdtype, mask=decay_mask, **h)


def build_arm(arm: str, cfg: Config, hparams: dict | None = None):
  """``(step, tx)`` of one arm, unjitted; ``step(variables, opt_state,
  batch) -> (loss, variables, opt_state)``, ``opt_state = tx.init(params)``.
  Jit it as ``jax.jit(step, donate_argnums=(0, 1))``."""
  if arm not in ARMS:
    raise ValueError(f"unknown arm {arm!r}; expected one of {ARMS}")
  tx = make_tx(arm, cfg, hparams)
  if arm in WGRAD:
    return forge_jax.make_step(make_loss(Decoder(cfg, forge_jax.Dense)), tx,
                               wgrad=WGRAD[arm]), tx
  return common.optax_step(make_loss(Decoder(cfg, nn.Dense)), tx), tx


def make_batch(cfg: Config, batch_size: int, seed: int = 0):
  """``(tokens, targets)``, int32 ``(batch_size, seq)``: random tokens and
  their next-token targets (the same batch every step: the loss must fall)."""
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, cfg.vocab, (batch_size, cfg.seq + 1), dtype=np.int32)
  return jnp.asarray(toks[:, :-1]), jnp.asarray(toks[:, 1:])


def init_variables(cfg: Config, seed: int = 0, abstract=None):
  """The decoder's variables (one init for every arm: same tree), built
  piece by piece with flax's own initialisers: the embedding, then every
  block from one jitted ``Block.init`` (key ``fold_in(key, i)``), the final
  norm and the head. With one jitted ``Decoder.init``, which compiled the
  random initialisers of all 16 blocks as one program, the init phase took
  43-55 s of a 65-89 s cell on the H200, where the step compiled in 15-22 s;
  block by block, 4-6 s. ``abstract``: the Decoder's
  :func:`abstract_variables`, if the caller has them (checked against)."""
  c = cfg
  k_embed, k_blocks, k_head = jax.random.split(jax.random.key(seed), 3)
  tokens = jnp.zeros((1, c.seq), jnp.int32)
  x = jnp.zeros((1, c.seq, c.d_model), c.jdtype)
  embed = nn.Embed(c.vocab, c.d_model, dtype=c.jdtype, param_dtype=c.pdtype)
  block_init = jax.jit(Block(c, nn.Dense).init)
  params = {"embed": jax.jit(embed.init)(k_embed, tokens)["params"]}
  blocks = [block_init(jax.random.fold_in(k_blocks, i), x)["params"]
            for i in range(c.layers)]
  if c.scan:
    params["blocks"] = {"block": jax.tree.map(lambda *a: jnp.stack(a),
                                              *blocks)}
  else:
    params.update({f"block_{i}": b for i, b in enumerate(blocks)})
  del blocks
  # RMSNorm's scale starts at ones and draws nothing from its key.
  params["final_norm"] = jax.jit(RMSNorm(c.jdtype, param_dtype=c.pdtype).init)(
      k_head, x)["params"]
  params["lm_head"] = jax.jit(_proj(nn.Dense, c, c.vocab, "lm_head").init)(
      k_head, x)["params"]
  variables = {"params": params}
  spec = lambda tree: jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)
  if abstract is None:
    abstract = abstract_variables(cfg)
  if spec(variables) != spec(abstract):  # the Decoder's tree
    raise AssertionError("init_variables built a tree other than the "
                         "Decoder's")
  return variables


def abstract_variables(cfg: Config):
  model = Decoder(cfg, nn.Dense)
  return jax.eval_shape(model.init, jax.random.key(0),
                        jnp.zeros((1, cfg.seq), jnp.int32))


# --------------------------------------------------------------------------
# One cell (one subprocess)


def _size(n: int) -> str:
  return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _mib(n):
  return None if n is None else n / 2**20


def _moment_dtypes(opt_state) -> str:
  adam = opt_state[0]  # optax.adamw: chain(scale_by_adam, decay, lr)
  mu = {str(a.dtype) for a in jax.tree.leaves(adam.mu)}
  nu = {str(a.dtype) for a in jax.tree.leaves(adam.nu)}
  return f"m={'/'.join(sorted(mu))},v={'/'.join(sorted(nu))}"


def _peak_bytes():
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # noqa: BLE001 -- not every backend has stats
    return None
  return None if not stats else stats.get("peak_bytes_in_use")


def compile_abstract(step, tx, cfg: Config, batch, abs_vars=None):
  """``step`` jitted (variables and optimizer state donated) and compiled
  against abstract arguments, before any state exists: allocations made
  while compiling (e.g. GEMM autotuning) then do not stack on the state.
  Returns ``(abstract variables, jitted, compiled, memory analysis in bytes
  ({"temp", "argument", "output", "alias"}), compile seconds)``."""
  if abs_vars is None:
    abs_vars = abstract_variables(cfg)
  abs_state = jax.eval_shape(tx.init, abs_vars["params"])
  jitted = jax.jit(step, donate_argnums=(0, 1))
  t0 = time.perf_counter()
  compiled = jitted.lower(abs_vars, abs_state, batch).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  mem = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
         for k in ("temp", "argument", "output", "alias")}
  return abs_vars, jitted, compiled, mem, compile_s


def run_cell(arm: str, bt: int, cfg: Config, steps: int, warmup: int,
             out: str | None, seed: int = 0) -> dict:
  """Compiles, measures and runs one (arm, BT) cell in this process; writes
  its rows to ``out`` (if given) and returns the figures."""
  if bt % cfg.seq:
    raise ValueError(f"BT={bt} is not a multiple of seq={cfg.seq}")
  batch_size = bt // cfg.seq
  jax.devices()  # start the backend here: its start-up counts as setup
  t_start = time.perf_counter()
  step, tx = build_arm(arm, cfg)
  batch = make_batch(cfg, batch_size, seed)

  abs_vars, jitted, compiled, mem, compile_s = compile_abstract(step, tx, cfg,
                                                               batch)

  t_compiled = time.perf_counter()
  variables = init_variables(cfg, seed, abstract=abs_vars)
  opt_state = jax.jit(tx.init)(variables["params"])
  jax.block_until_ready((variables, opt_state))
  t_init = time.perf_counter()
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(variables))
  dtypes = (f"params={cfg.pdtype.name},{_moment_dtypes(opt_state)},"
            + (f"activations={cfg.dtype}," if cfg.param_dtype else "")
            + "logits/loss=float32")

  times, losses, variables, opt_state = common.timed_steps(
      compiled, variables, opt_state, batch, warmup, steps)
  peak = _peak_bytes()
  q = tuple(t * 1e3 for t in common.quantiles(times))
  # Where a cell's wall time goes (seconds): imports (since this module was
  # imported: a cell's own process) and the backend's start-up; building,
  # tracing, lowering and compiling the step (GEMM autotuning included);
  # initialising the variables and optimizer state; the warm-up and timed
  # steps.
  phases = dict(setup=t_start - _T_IMPORT, compile=t_compiled - t_start,
                init=t_init - t_compiled, steps=time.perf_counter() - t_init)

  r = dict(arm=arm, bt=bt, batch=batch_size, seq=cfg.seq, params=n_params,
           dtypes=dtypes, compile_s=compile_s, step_ms=q,
           peak_bytes=peak, mem=mem, losses=losses, phases=phases,
           device=common.device_name(), backend=jax.default_backend())
  if out:
    res = common.Results(out, "e2e")
    r["stamp"] = res.stamp  # the `timestamp` of this cell's rows
    case = f"llama-{_size(n_params)} BT={bt}"
    shape = (f"L{cfg.layers} d{cfg.d_model} h{cfg.heads}/kv{cfg.kv_heads} "
             f"ffn{cfg.ffn} V{cfg.vocab} B{batch_size}x{cfg.seq} {layout(cfg)}")
    add = lambda metric, v, unit: res.add(case, arm, shape, dtypes, metric,
                                          v, unit)
    add("step_time", q, "ms")
    if peak is not None:
      add("peak_memory", _mib(peak), "MiB")
    for k in ("temp", "argument", "output", "alias"):
      add(f"{k}_memory", _mib(mem[k]), "MiB")
    add("compile_time", compile_s, "s")
    add("loss_first", losses[0], "nats")
    add("loss_final", losses[-1], "nats")
    add("param_count", float(n_params), "params")
  return r


# --------------------------------------------------------------------------
# The driver


def _failed_row(path: str, arm: str, bt: int, cfg: Config, device: str,
                reason: str) -> None:
  new = not os.path.exists(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a", newline="") as f:
    w = csv.DictWriter(f, common.CSV_FIELDS)
    if new:
      w.writeheader()
    w.writerow(dict(
        benchmark="e2e", case=f"llama-{_size(param_count(cfg))} BT={bt}",
        provider=arm,
        shape=(f"L{cfg.layers} d{cfg.d_model} h{cfg.heads}/kv{cfg.kv_heads} "
               f"ffn{cfg.ffn} V{cfg.vocab} B{bt // cfg.seq}x{cfg.seq} {layout(cfg)}"),
        dtypes=f"params={cfg.pdtype.name}", metric="failed", p20="nan", p50="nan",
        p80="nan", unit=reason, device=device, versions=common.versions(),
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(
            timespec="seconds"), commit=common.commit()))


def _cell_argv(args, arm: str, bt: int) -> list[str]:
  argv = [sys.executable, "-m", "benchmarks.e2e", "--cell", "--arm", arm,
          "--bt", str(bt), "--steps", str(args.steps), "--warmup",
          str(args.warmup), "--seed", str(args.seed), "--dtype", args.dtype]
  for flag in ("layers", "d_model", "heads", "kv_heads", "ffn", "vocab", "seq"):
    argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
  if args.attn_impl:
    argv += ["--attn-impl", args.attn_impl]
  if args.param_dtype:
    argv += ["--param-dtype", args.param_dtype]
  if args.mu_dtype:
    argv += ["--mu-dtype", args.mu_dtype]
  if args.scan:
    argv += ["--scan"]
  if args.out:  # cells run in the repository: a path relative to the caller
    argv += ["--out", os.path.abspath(args.out)]
  return argv


def _reason(rc: int, log: str) -> str:
  lines = [l.strip() for l in log.splitlines() if l.strip()]
  errs = [l for l in lines if "Error" in l or "error" in l or "Killed" in l]
  last = (errs or lines or ["no output"])[-1]
  return f"exit {rc}: {last}"[:300]


AUTOTUNE_CACHE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"


def _subprocess_env(autotune_cache: str | None = None) -> dict:
  """The environment of the driver's subprocesses (cells, the device probe,
  run in the repository): JAX allocating as it goes, unbuffered output;
  with ``autotune_cache``, XLA's per-fusion autotune cache in that directory
  (added to any ``XLA_FLAGS`` already set)."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONUNBUFFERED="1")
  if autotune_cache:
    path = os.path.abspath(os.path.expanduser(autotune_cache))
    if any(ch.isspace() for ch in path):  # XLA_FLAGS splits on whitespace
      raise ValueError(f"--autotune-cache {path!r}: XLA_FLAGS cannot carry "
                       "a path with whitespace; choose another directory")
    flag = f"{AUTOTUNE_CACHE_FLAG}={path}"
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS"), flag) if f)
  return env


def probe_device(timeout: float = 120.0) -> str:
  """``common.device_name()`` asked of a subprocess, as the cells run (the
  driver keeps JAX off the GPU): for failed rows written before any cell
  succeeded. ``"unknown"`` if even that fails within ``timeout`` s."""
  env = _subprocess_env()
  try:
    out = subprocess.run(
        [sys.executable, "-c",
         "from benchmarks import common; print(common.device_name())"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  lines = out.stdout.strip().splitlines()
  return lines[-1] if out.returncode == 0 and lines else "unknown"


def _kill_group(proc) -> None:
  """SIGKILL a cell's process group (``start_new_session``: group id = the
  cell's pid), so that nothing the cell started keeps running on the GPU."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


@contextlib.contextmanager
def _terminate_as_exit():
  """SIGTERM raises ``SystemExit`` (status 143) while a cell runs, so the
  driver killed by it leaves through the cell's cleanup as on Ctrl-C,
  instead of dying at once with the cell still running. (The main thread
  only: elsewhere Python cannot set a handler, and nothing changes.)"""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def leave(signum, frame):
    raise SystemExit(128 + signum)

  before = signal.signal(signal.SIGTERM, leave)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, before)


def run_tagged(argv: list[str], env: dict, timeout: float, label: str,
               tag: str):
  """Runs ``argv`` in the repository in its own process group under
  ``timeout`` s, echoing its output (``   | ``-indented) except the line
  that starts with ``tag``, whose JSON rest is the result. Returns
  ``(result or None, reason)``; ``label`` names it in the closing line."""
  t0 = time.perf_counter()
  with tempfile.TemporaryFile("w+") as logf, _terminate_as_exit():
    # Its own process group: a timeout kills the process and everything it
    # started (compiler subprocesses), not the process alone. (Its own
    # session also keeps a terminal's Ctrl-C from reaching it: the driver,
    # interrupted or terminated, kills the group as it leaves.)
    proc = subprocess.Popen(argv, env=env, stdout=logf,
                            stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)
    try:
      rc = proc.wait(timeout=timeout)
      reason = None
    except subprocess.TimeoutExpired:
      _kill_group(proc)
      rc = proc.wait()
      reason = f"timeout after {timeout:.0f} s"
    finally:
      _kill_group(proc)  # whatever it left running
    logf.seek(0)
    log = logf.read()
  result = None
  for line in log.splitlines():
    if line.startswith(tag):
      result = json.loads(line[len(tag):])
    else:
      print(f"   | {line}")
  print(f"   [{label}: {time.perf_counter() - t0:.1f} s, exit {rc}]",
        flush=True)
  if result is not None:
    return result, None
  return None, reason or _reason(rc, log)


def run_driver_cell(args, arm: str, bt: int, timeout: float):
  """Runs one cell in a subprocess; returns ``(result or None, reason)``."""
  argv = _cell_argv(args, arm, bt)
  print(f"== cell {arm} BT={bt} (timeout {timeout:.0f} s): "
        f"{' '.join(argv[1:])}", flush=True)
  return run_tagged(argv, _subprocess_env(args.autotune_cache), timeout,
                    f"{arm} BT={bt}", RESULT_TAG)


def _fmt(v, spec=".1f"):
  return "n/a" if v is None else format(v, spec)


def median_cell(cells: list) -> dict:
  """The cell whose p50 step time is the median of ``cells`` (the lower
  middle one of an even count): a (arm, BT)'s figures under ``--repeat``."""
  return sorted(cells, key=lambda r: r["step_ms"][1])[(len(cells) - 1) // 2]


def summarize(results: dict, bts, cells: dict | None = None) -> bool:
  """Prints each FORGE arm beside optax; returns whether first-step losses
  agree. ``results[(arm, bt)]``: the cell shown (under ``--repeat``, the
  median cell); ``cells[(arm, bt)]``: every cell, whose p50s are listed
  when there are several."""
  ok = True
  forge_arms = [a for a in WGRAD if any((a, bt) in results for bt in bts)]
  for i, arm in enumerate(forge_arms or ["forge"]):
    # optax's per-cell p50s are listed under the first table only.
    ok &= _summarize_arm(results, bts, arm, cells or {}, list_optax=i == 0)
  return ok


def _summarize_arm(results: dict, bts, arm: str, cells: dict,
                   list_optax: bool = True) -> bool:
  ok = True
  print(f"\n{arm} / optax (p50 step time; compiled-step temporaries; "
        "allocator peak; compile time)")
  print(f"{'BT':>6} {'metric':<16} {arm:>12} {'optax':>12} {'ratio':>8}")
  for bt in bts:
    f, o = results.get((arm, bt)), results.get(("optax", bt))
    def row(name, fv, ov, spec=".1f"):
      ratio = (f"{fv / ov:8.3f}" if fv is not None and ov not in (None, 0)
               else f"{'n/a':>8}")
      print(f"{bt:>6} {name:<16} {_fmt(fv, spec):>12} {_fmt(ov, spec):>12} "
            f"{ratio}")
    for name in (arm, "optax") if list_optax else (arm,):
      if len(cells.get((name, bt), ())) > 1:
        p50s = ", ".join(f"{r['step_ms'][1]:.2f}" for r in cells[(name, bt)])
        print(f"{bt:>6} {name} step p50 per cell (ms, in run order): {p50s}; "
              "the table shows the median cell")
    g = lambda r, fn: None if r is None else fn(r)
    row("step p50 (ms)", g(f, lambda r: r["step_ms"][1]),
        g(o, lambda r: r["step_ms"][1]), ".2f")
    row("peak (MiB)", g(f, lambda r: _mib(r["peak_bytes"])),
        g(o, lambda r: _mib(r["peak_bytes"])))
    row("temp (MiB)", g(f, lambda r: _mib(r["mem"]["temp"])),
        g(o, lambda r: _mib(r["mem"]["temp"])))
    row("compile (s)", g(f, lambda r: r["compile_s"]),
        g(o, lambda r: r["compile_s"]))
    row("loss first", g(f, lambda r: r["losses"][0]),
        g(o, lambda r: r["losses"][0]), ".5f")
    row("loss final", g(f, lambda r: r["losses"][-1]),
        g(o, lambda r: r["losses"][-1]), ".5f")
    if f is not None and o is not None:
      ok &= first_losses_agree(bt, arm, f["losses"][0], "optax",
                               o["losses"][0])
      for name, r in ((arm, f), ("optax", o)):
        if not r["losses"][-1] < r["losses"][0]:
          print(f"{bt:>6} warning: {name} loss did not fall "
                f"({r['losses'][0]:.5f} -> {r['losses'][-1]:.5f})")
      if f["peak_bytes"] is not None and o["peak_bytes"] is not None:
        print(f"{bt:>6} acceptance: {arm} step time <= optax: "
              f"{f['step_ms'][1] <= o['step_ms'][1]}; {arm} peak <= optax: "
              f"{f['peak_bytes'] <= o['peak_bytes']}")
  return ok


def first_losses_agree(bt: int, name: str, loss: float, ref_name: str,
                       ref_loss: float) -> bool:
  """Whether two arms' first-step losses (the same initialisation and
  batch) agree within :data:`FIRST_LOSS_RTOL`; prints the comparison."""
  rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
  same = rel <= FIRST_LOSS_RTOL
  print(f"{bt:>6} first-step loss {name} {loss!r} vs {ref_name} "
        f"{ref_loss!r}: rel diff {rel:.2e} ({'OK' if same else 'MISMATCH'}, "
        f"tol {FIRST_LOSS_RTOL:g})")
  return same


def _bt_arm(row) -> tuple[int, str]:
  """A per-BT row's ``(BT, arm)`` (its case e.g. ``"llama-886M BT=512"``,
  or ``"... BT=512 CUDA graph"``)."""
  return int(row["case"].split("BT=")[1].split()[0]), row["provider"]


def bar_rows(csv_path: str, pick: dict | None = None,
             benchmark: str = "e2e", arms=None) -> dict:
  """``{(BT, arm, metric): row}`` that :func:`plot` draws from
  ``benchmark``'s per-BT rows, each BT's from one run, so that a BT's bars
  are of one commit, device and versions. A run is a stretch of
  consecutive rows of one commit, device and versions (a driver run
  appends its cells one after another; failed cells' rows, which hold no
  figures and may lack the commit, are left out). Per BT: of the runs
  with the most of ``arms`` (default: every arm the CSV has) at that BT,
  the newest; in it the newest row of each key. With ``pick`` (``{(BT,
  arm): timestamp}``, the cells a driver run reports), the rows of those
  cells only."""
  last, runs, run, key = {}, [], None, None
  for r in common.read_rows(csv_path):  # in file order: newest last
    if r["benchmark"] != benchmark or "BT=" not in r["case"]:
      continue
    bt, arm = _bt_arm(r)
    if arms is not None and arm not in arms:
      continue
    if pick is not None:
      if pick.get((bt, arm)) == r["timestamp"]:
        last[(bt, arm, r["metric"])] = r
      continue
    if r["metric"] == "failed":
      continue
    if (r["commit"], r["device"], r["versions"]) != key:
      key, run = (r["commit"], r["device"], r["versions"]), {}
      runs.append(run)
    run[(bt, arm, r["metric"])] = r
  if pick is not None:
    return last
  for bt in sorted({k[0] for run in runs for k in run}):
    has = [{k[1] for k in run if k[0] == bt} for run in runs]
    i = max(range(len(runs)), key=lambda i: (len(has[i]), i))
    last.update({k: r for k, r in runs[i].items() if k[0] == bt})
  return last


def bt_commits(rows: dict) -> dict:
  """``{BT: "commit, ..."}``: the commits of :func:`bar_rows`' ``rows`` at
  each BT, in the order the rows name them."""
  out = {}
  for (bt, _, _), r in rows.items():
    if r["commit"]:
      out.setdefault(bt, {})[r["commit"]] = None
  return {bt: ", ".join(c) for bt, c in out.items()}


def plot(csv_path: str, png_path: str, pick: dict | None = None,
         arms=None) -> dict:
  """Bar chart of an e2e CSV: p50 step time and peak memory (temporaries
  where the backend has no allocator peak) per BT and arm, each BT's bars
  from one run, the commit under the BT (:func:`bar_rows`: the newest run
  with the most of ``arms``, or the cells ``pick`` names; the driver
  passes the median cell of each (arm, BT)). Returns the rows drawn."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  last = bar_rows(csv_path, pick, arms=arms)
  bts = sorted({k[0] for k in last})
  commits = bt_commits(last)
  has_peak = any(k[2] == "peak_memory" for k in last)
  mem_metric = "peak_memory" if has_peak else "temp_memory"
  panels = (("step_time", "median step time (ms)"),
            (mem_metric, f"{'allocator peak' if has_peak else 'compiled temporaries'} (MiB)"))
  fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
  arms = [a for a in ARMS if any(k[1] == a for k in last)]
  width = 0.8 / max(len(arms), 1)
  colors = {"forge": "tab:orange", "forge-xla": "tab:blue", "optax": "gray"}
  for ax, (metric, label) in zip(axes, panels):
    for i, arm in enumerate(arms):
      # A cell that did not run (or failed) gets no bar, not a 0.
      vals = [float(last[(bt, arm, metric)]["p50"]) if (bt, arm, metric) in last
              else float("nan") for bt in bts]
      bars = ax.bar([j + i * width for j in range(len(bts))], vals, width,
                    label=arm, color=colors[arm])
      ax.bar_label(bars, labels=["" if v != v else f"{v:.1f}" for v in vals],
                   fontsize=7)
    ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(bts))])
    ax.set_xticklabels([f"BT={bt}" + (f"\n{commits[bt]}" if bt in commits
                                       else "") for bt in bts])
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
  any_row = next(iter(last.values()), None)
  device = any_row["device"] if any_row else "?"
  shape = any_row["shape"].rsplit(" B", 1)[0] if any_row else ""
  dtypes = dict(kv.split("=", 1) for kv in (
      any_row["dtypes"].split(",") if any_row else []) if "=" in kv)
  if "activations" in dtypes:  # (--param-dtype)
    shape += f"; {dtypes['params']} params, {dtypes['activations']} activations"
  fig.suptitle(f"Llama-style decoder training step ({shape}): FORGE vs "
               f"optax.adamw on {device}\neach BT's bars from one run, its "
               "commit under the BT", fontsize=9)
  common.save_figure(fig, png_path)
  return last


def _seconds(minimum_exclusive: bool):
  """An argparse type: seconds > 0 (or >= 0)."""
  def parse(s: str) -> float:
    v = float(s)
    if not (v > 0 if minimum_exclusive else v >= 0):
      raise argparse.ArgumentTypeError(
          f"{s!r} is not {'>' if minimum_exclusive else '>='} 0")
    return v
  return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
  """The decoder's :class:`Config` options (``config_of`` reads them)."""
  d = Config()
  p.add_argument("--layers", type=common.positive_int, default=d.layers)
  p.add_argument("--d-model", type=common.positive_int, default=d.d_model)
  p.add_argument("--heads", type=common.positive_int, default=d.heads)
  p.add_argument("--kv-heads", type=common.positive_int, default=d.kv_heads)
  p.add_argument("--ffn", type=common.positive_int, default=d.ffn)
  p.add_argument("--vocab", type=common.positive_int, default=d.vocab)
  p.add_argument("--seq", type=common.positive_int, default=d.seq)
  p.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float32"),
                 help="activations, and parameters and moments unless "
                 "--param-dtype")
  p.add_argument("--param-dtype", default=None,
                 choices=("bfloat16", "float32"),
                 help="parameters and AdamW moments (mixed precision: "
                 "--dtype bfloat16 --param-dtype float32)")
  p.add_argument("--mu-dtype", default=None, choices=("bfloat16", "float32"),
                 help="AdamW's first moment alone (optax's mu_dtype; v stays "
                 "in the parameters' dtype), default the parameters' dtype")
  p.add_argument("--attn-impl", default=None, choices=("xla", "cudnn"),
                 help="jax.nn.dot_product_attention implementation "
                 "(default: JAX's choice, XLA)")
  p.add_argument("--scan", action="store_true",
                 help="scan the blocks (each recomputed in the backward): "
                 "nn.scan(nn.remat(block)) + optax against "
                 "forge_jax.ScannedBlocks; default: unrolled")


def parse_args(argv):
  p = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=common.DefaultsFormatter)
  p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
  p.add_argument("--bt", type=common.positive_int, nargs="+", default=[512, 2048],
                 help="tokens per step (multiples of --seq)")
  add_model_args(p)
  p.add_argument("--steps", type=common.positive_int, default=10, help="timed steps per cell")
  p.add_argument("--warmup", type=common.positive_int, default=2)
  p.add_argument("--repeat", type=common.positive_int, default=1,
                 help="run every (arm, BT) cell this many times, in rounds "
                 "of all arms (order reversed every other round), each a "
                 "fresh process and compile; the table and plot show the "
                 "median cell (of an even count the faster middle one: "
                 "prefer an odd N), and the per-cell p50s are listed")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=paths.out_file, default="out/bench/e2e.csv")
  p.add_argument("--plot", type=paths.out_file, default=None, metavar="PNG")
  p.add_argument("--replot", action="store_true",
                 help="only plot --out into --plot; run nothing. Each BT's "
                 "bars come from one run: of the runs with the most of "
                 "--arms at that BT, the newest")
  p.add_argument("--cell-timeout", type=_seconds(True), default=150.0,
                 help="seconds per cell subprocess")
  p.add_argument("--budget", type=_seconds(False), default=0.0,
                 help="seconds for all cells (0: none); a cell gets at most "
                 "what is left, and one with < 10 s left is recorded failed")
  p.add_argument("--autotune-cache", type=paths.out_dir, metavar="DIR",
                 default=None,
                 help="XLA's per-fusion GEMM autotune cache for every cell, "
                 "shared by all arms: the first compile of a fusion "
                 "autotunes it and writes its choice, later cells (and "
                 "later runs) load it, so repeated cells of one arm run "
                 "the same GEMM choices (on the H200, 7 of 106 fusions "
                 "chose differently between two fresh compiles, and the "
                 "losses with them). Without it every compile autotunes "
                 "afresh, as a user's does. A loaded cache also shortens the "
                 "compile, so compile times are then not comparable "
                 "between cells. GPU only; elsewhere nothing is tuned")
  p.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  try:
    config_of(args)
    _subprocess_env(args.autotune_cache)  # refuses a path XLA cannot take
  except ValueError as e:
    p.error(str(e))
  if args.replot and not os.path.exists(args.out):
    p.error(f"--replot: no CSV at {args.out}")
  for bt in args.bt:
    if bt % args.seq:
      p.error(f"--bt {bt} is not a multiple of --seq {args.seq}")
  return args


def config_of(args) -> Config:
  return Config(layers=args.layers, d_model=args.d_model, heads=args.heads,
                kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab,
                seq=args.seq, dtype=args.dtype,
                param_dtype=args.param_dtype, mu_dtype=args.mu_dtype,
                attn_impl=args.attn_impl,
                scan=args.scan)


def main(argv=None) -> int:
  args = parse_args(argv)
  cfg = config_of(args)
  if args.cell:
    r = run_cell(args.arm, args.bt[0], cfg, args.steps, args.warmup, args.out,
                 args.seed)
    print(f"{r['arm']} BT={r['bt']} on {r['device']}: {r['params']:,} params "
          f"({r['dtypes']}); compile {r['compile_s']:.1f} s; step p50 "
          f"{r['step_ms'][1]:.2f} ms; temp {_mib(r['mem']['temp']):.1f} MiB; "
          f"peak {_fmt(_mib(r['peak_bytes']))} MiB; losses "
          f"{' '.join(f'{l:.4f}' for l in r['losses'])}; phases (s) "
          + ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items()))
    print(RESULT_TAG + json.dumps(r), flush=True)
    return 0

  if args.replot:
    if not args.plot:
      print("--replot needs --plot PNG", file=sys.stderr)
      return 2
    if not any(r.get("benchmark") == "e2e" for r in common.read_rows(args.out)):
      print(f"--replot: {args.out} has no e2e rows; nothing plotted",
            file=sys.stderr)
      return 1
    drawn = plot(args.out, args.plot, arms=args.arms)
    for bt, commit in sorted(bt_commits(drawn).items()):
      arms = [a for a in ARMS if (bt, a, "step_time") in drawn]
      print(f"BT={bt}: {', '.join(arms)} from the run at {commit}")
    return 0

  n = param_count(cfg)
  print(f"model: Llama-style decoder, {n:,} parameters ({n / 1e9:.3f} B): "
        f"{cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads / "
        f"{cfg.kv_heads} kv heads (head_dim {cfg.head_dim}), ffn {cfg.ffn}, "
        f"vocab {cfg.vocab}, seq {cfg.seq}; {cfg.pdtype.name} params and v, "
        f"{cfg.mdtype.name} m, "
        f"{cfg.dtype} activations; fp32 "
        f"loss; {layout(cfg)}. AdamW {HPARAMS}, decay on matrices only.")
  print(f"cells: arms {args.arms} x BT {args.bt}; {args.warmup} warm-up + "
        f"{args.steps} timed steps each; CSV {args.out}", flush=True)
  start = time.perf_counter()
  cells, failed, device = {}, [], "unknown"
  probed = False  # the device is asked of a subprocess at most once
  # --repeat: rounds of every arm, the order reversed every other round.
  rounds = [args.arms if i % 2 == 0 else args.arms[::-1]
            for i in range(args.repeat)]
  for bt in args.bt:
    for arm in (a for order in rounds for a in order):
      timeout = args.cell_timeout
      left = args.budget - (time.perf_counter() - start)
      if args.budget > 0 and left < 10:
        r, reason = None, f"skipped: --budget {args.budget:g} s spent"
        print(f"== cell {arm} BT={bt}: {reason}")
      else:
        if args.budget > 0:
          timeout = min(timeout, left)
        r, reason = run_driver_cell(args, arm, bt, timeout)
      if r is None:
        failed.append((arm, bt, reason))
        print(f"   FAILED {arm} BT={bt}: {reason}", flush=True)
        if device == "unknown" and not probed and not reason.startswith(
            "skipped"):
          probed = True
          left = (args.budget - (time.perf_counter() - start)
                  if args.budget > 0 else 120.0)
          if left >= 10:  # within what is left of --budget
            device = probe_device(timeout=min(120.0, left))
        _failed_row(args.out, arm, bt, cfg, device, reason)
      else:
        cells.setdefault((arm, bt), []).append(r)
        device = r["device"]
        if r["params"] != n:
          print(f"   warning: cell counted {r['params']:,} params, "
                f"expected {n:,}")
  results = {k: median_cell(v) for k, v in cells.items()}
  same = summarize(results, args.bt, cells)
  for arm, bt, reason in failed:
    print(f"failed cell {arm} BT={bt}: {reason}")
  n_ok = sum(len(v) for v in cells.values())
  print(f"wrote {args.out} ({n_ok} cells ok, {len(failed)} failed) in "
        f"{time.perf_counter() - start:.0f} s")
  if args.plot and results:
    # The cells the table shows (one per (arm, BT); under --repeat, the
    # median cell), not older rows of the CSV.
    plot(args.out, args.plot, pick={(bt, arm): r.get("stamp")
                                    for (arm, bt), r in results.items()})
  return 0 if same and not failed else 1


if __name__ == "__main__":
  sys.exit(main())
