"""The Llama-style decoder's training step in torch: forge_torch vs AdamW.

forge_torch (``convert`` + ``forge_torch.AdamW``) against
``torch.optim.AdamW(fused=True)``, end to end.

    ./dev.sh python -m benchmarks.torch_e2e --out-dir out/bench/torch_e2e --check

The model is benchmarks/e2e.py's decoder (its :class:`benchmarks.e2e.Config`,
by default the 0.886 B one: 16 blocks, d_model 2048, 16 query / 8 key-value
heads, SwiGLU ffn 5632, vocab 32000, sequence 512, untied LM head) written in
plain torch: ``nn.Embedding``; per block RMSNorm (fp32 arithmetic, eps 1e-6)
-> attention (bias-free ``q, k, v, o``; rotary embedding, half-split form, in
fp32; ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``)
-> residual -> RMSNorm -> SwiGLU MLP (``gate, up, down``) -> residual; final
RMSNorm; ``lm_head``. Initialised at flax's default scales (normal, variance
1 / fan-in for the projections and the head, 1 / d_model for the embedding;
norms at one). The dtype policy is the JAX benchmark's: bf16 parameters and
activations, AdamW's ``exp_avg`` / ``exp_avg_sq`` in the parameters' dtype
(bf16: torch keeps its moments in the parameter's dtype, as the JAX arms do
with ``mu_dtype=bf16``), logits cast to fp32 for the loss (mean softmax
cross-entropy on random tokens and their next-token targets: benchmarks/e2e.py's
``make_batch`` draw). ``--dtype float32`` runs everything in fp32.

Arms, from the same initialisation and batch, with benchmarks/e2e.py's AdamW
hyperparameters (lr 3e-4, betas 0.9 / 0.95, eps 1e-8, weight decay 0.1 on the
matrices -- embedding, projections, head -- and none on the norms):

  torch   ``torch.optim.AdamW(fused=True)``: ``loss.backward()`` writes every
          parameter's gradient, ``opt.step()`` applies them.
  forge   ``forge_torch.convert(model)`` (every projection and the LM head
          become managed ``forge_torch.Linear`` layers, updated inside their
          backward by the fused kernel) + ``forge_torch.AdamW(fused=True)``,
          whose ``step()`` applies torch's fused AdamW to the rest (the
          embedding and the norm scales).

Every (arm, BT) cell runs in its own subprocess (``--cell``; the same Python,
``XLA_PYTHON_CLIENT_PREALLOCATE=false``). A cell builds the model, runs
``--warmup`` steps (the first creates the optimizer state and compiles the
fused kernel for each layer shape), then ``--steps`` timed steps. Step time:
on CUDA, CUDA events recorded on torch's current stream around each step
(``loss``, ``backward()``, ``step()``, ``zero_grad(set_to_none=True)``), the
host waiting for the end event after every step (each step starts on an idle
GPU, as benchmarks/e2e.py blocks on every step); on the CPU, ``perf_counter``.
Per phase (forward: the loss; backward; optimizer: ``step()`` and
``zero_grad``), rows ``host_<phase>`` (the host's time from the phase's
start to its last call's return) and on CUDA ``gpu_<phase>`` (the GPU's,
between events recorded at the same points): where a phase's GPU time
equals its host time the GPU waited on the host (the phase is host-bound);
where it is longer the host ran ahead.

Peak memory is ``torch.cuda.max_memory_allocated()`` over one *whole
steady-state step*: the counter is reset right before each timed step -- at a
step boundary, where only the parameters, the optimizer state and the batch
are allocated (``base_memory``) -- and read once that step has finished; the
row holds the largest of the timed steps' peaks (equal in a steady state; the
driver notes it when not). The warm-up steps are outside it (the first one
creates the optimizer state and makes torch's one-off allocations). It is
torch's caching allocator's count: JAX's own allocations (the fused kernel
writes torch's memory in place) are a separate row, ``jax_peak_memory``, JAX's
peak over the cell's process. ``after_backward`` is the allocated bytes right
after ``backward()`` of the last timed step, where the torch arm holds every
gradient and the forge arm none of the managed weights'.

The gradient pool (``grad_pool``) is the bytes of the managed weights (every
projection and the head: what FORGE never writes); ``grad_total`` is the bytes
of every parameter's gradient in the torch arm (the pool plus the embedding's
and the norms'). Whether the *peak* drops by the whole pool depends on where
each arm peaks (see docs/benchmarks.md and benchmarks/torch_memory.py).

CSV rows (``benchmarks.common.Results``, benchmark ``torch_e2e``; device,
versions, commit, timestamp): ``step_time`` (ms, p20/p50/p80),
``peak_memory``, ``peak_reserved``, ``base_memory``, ``after_backward``,
``grad_pool``, ``grad_total`` (MiB), ``jax_peak_memory`` (MiB, forge arm),
``bridge_calls`` / ``bridge_direct`` / ``bridge_copied`` (forge arm, per
timed step: fused-kernel calls, those of them launched directly on the torch
tensors (Hopper), and state tensors copied back because XLA did not write torch's memory
in place -- 0 on a GPU, always > 0 on the CPU), ``loss_first`` / ``loss_final``
(nats) and ``param_count``. The memory rows are CUDA-only. A failed cell gets a
``failed`` row with the reason in ``unit``. ``--check`` first runs the arms for
3 steps from one initialisation on a tiny fp32 decoder (its own subprocess, on
the same device) and compares every parameter and its update (``parity_*``
rows; fail above 1e-5 relative). ``--plot PNG`` draws the step time and peak
memory per BT with forge / torch ratios.

``--paired`` times the step another way: both arms in one process per BT
(and per ``--repeat`` round), two models from the same initialisation, their
steps timed one by one in alternation (torch then forge, forge then torch,
...), so that the host's drift between processes, which moves single cells
by several percent where both arms are host-bound, reaches both alike.
Rows (benchmark ``torch_e2e_paired``, case ``... paired``, which the bar
plot does not read): each arm's ``step_time`` and ``loss_first``, and
``step_ratio`` (provider ``forge/torch``: the quantiles of each forge step
over the torch step beside it). No memory rows (both models are resident);
the torch arm then runs with JAX started in its process. With ``--plot
PNG`` (or ``--replot --paired --plot PNG``) it draws every paired process's
ratio in the CSV instead, in the order they ran, by commit.

``--paired --lean`` adds a third model to each process, timed in the same
alternation: ``lean``, the decoder with every projection and the head a
lean layer of forge_torch's form (benchmarks/lean_layer.py: the fused
kernel launched in backward with only the per-layer work a path validated
once per step would keep) and torch's fused AdamW for the rest. It is a
bound, not an optimizer: the least host time an eager Python layer of
FORGE's form with the real launch takes here (its hyperparameters are
fixed, so its loss drifts from the others'). Its rows: provider ``lean``
``step_time`` and ``step_ratio`` ``lean/torch``, which the paired plot
draws beside the process's forge/torch ratio (hollow squares).

Without CUDA the benchmark refuses to run, exit status 1 (no figure would be
a GPU figure); ``--device cpu`` runs it on the CPU as a smoke test (the fused
kernel in Pallas interpret mode: slow, for tiny ``--layers`` / ``--d-model``
...), whose rows carry a ``cpu:`` device and no memory rows. Exit status: 0
if every cell ran, the arms' first losses agree and ``--check`` (if asked)
passed, else 1; 2 for bad flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

# A cell's clock starts here (its phases are printed).
_T_IMPORT = time.perf_counter()

import numpy as np  # noqa: E402

try:
  import torch  # noqa: E402
except ImportError as e:  # run as a command: one line, exit 1, as the rest
  if __name__ == "__main__":
    sys.exit(f"benchmarks/torch_e2e.py needs torch ({e}); install the "
             "'torch' extra. Nothing measured.")
  raise
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from benchmarks import common, e2e, paths  # noqa: E402

BENCHMARK = "torch_e2e"
PAIRED_BENCHMARK = "torch_e2e_paired"
ARMS = ("torch", "forge")
# A step's phases: the loss (forward), backward() (forge: the fused updates
# inside it), step() + zero_grad().
PHASES = ("forward", "backward", "optimizer")
RESULT_TAG = "TORCH_E2E_CELL_RESULT "
# --check: the project's fp32 parity bar (tests/tolerances.py, float32).
CHECK_RTOL = 1e-5
CHECK_STEPS = 3
# benchmarks/e2e.py's tests' tiny decoder (odd vocab: no block divides it).
CHECK_CONFIG = e2e.Config(layers=2, d_model=32, heads=4, kv_heads=2, ffn=48,
                          vocab=61, seq=8, dtype="float32")
CHECK_BATCH = 2
# A larger rate than the benchmark's, so that 3 steps move every weight well
# above fp32 rounding; the other hyperparameters are the benchmark's.
CHECK_LR = 1e-2
MIB = 2**20


# --------------------------------------------------------------------------
# The model


class RMSNorm(nn.Module):
  """benchmarks/e2e.py's RMSNorm: fp32 arithmetic, the result in the input's
  dtype."""

  def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
    super().__init__()
    self.eps = eps
    self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
    return (y * self.weight.float()).to(x.dtype)


def rotary_tables(seq: int, head_dim: int, theta: float, device):
  """``(cos, sin)``, fp32 ``(seq, 1, head_dim // 2)``: e2e.rotary's angles."""
  freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32,
                                  device=device) / head_dim)
  pos = torch.arange(seq, dtype=torch.float32, device=device)
  angles = pos[:, None] * freqs[None, :]
  return torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
  """Rotary embedding of ``x`` ``(batch, seq, heads, head_dim)``, half-split
  form, in fp32 (as e2e.rotary)."""
  x1, x2 = x.float().chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class Attention(nn.Module):

  def __init__(self, cfg: e2e.Config, **kw):
    super().__init__()
    self.cfg = cfg
    d, hd = cfg.d_model, cfg.head_dim
    self.q = nn.Linear(d, cfg.heads * hd, bias=False, **kw)
    self.k = nn.Linear(d, cfg.kv_heads * hd, bias=False, **kw)
    self.v = nn.Linear(d, cfg.kv_heads * hd, bias=False, **kw)
    self.o = nn.Linear(cfg.heads * hd, d, bias=False, **kw)

  def forward(self, x, cos, sin):
    c, (b, t, _) = self.cfg, x.shape
    q = rotary(self.q(x).view(b, t, c.heads, c.head_dim), cos, sin)
    k = rotary(self.k(x).view(b, t, c.kv_heads, c.head_dim), cos, sin)
    v = self.v(x).view(b, t, c.kv_heads, c.head_dim)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=True, enable_gqa=True)
    return self.o(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):

  def __init__(self, cfg: e2e.Config, **kw):
    super().__init__()
    self.gate = nn.Linear(cfg.d_model, cfg.ffn, bias=False, **kw)
    self.up = nn.Linear(cfg.d_model, cfg.ffn, bias=False, **kw)
    self.down = nn.Linear(cfg.ffn, cfg.d_model, bias=False, **kw)

  def forward(self, x):
    return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):

  def __init__(self, cfg: e2e.Config, **kw):
    super().__init__()
    self.attn_norm = RMSNorm(cfg.d_model, **kw)
    self.attn = Attention(cfg, **kw)
    self.mlp_norm = RMSNorm(cfg.d_model, **kw)
    self.mlp = MLP(cfg, **kw)

  def forward(self, x, cos, sin):
    x = x + self.attn(self.attn_norm(x), cos, sin)
    return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
  """benchmarks/e2e.py's Llama-style decoder (same parameters, same names
  but torch's ``weight``), untied head."""

  def __init__(self, cfg: e2e.Config, device=None):
    super().__init__()
    if cfg.scan or cfg.attn_impl:
      raise ValueError("the torch decoder is unrolled, with torch's SDPA: "
                       "Config.scan and Config.attn_impl do not apply")
    kw = dict(device=device, dtype=getattr(torch, cfg.dtype))
    self.cfg = cfg
    self.embed = nn.Embedding(cfg.vocab, cfg.d_model, **kw)
    self.blocks = nn.ModuleList(Block(cfg, **kw) for _ in range(cfg.layers))
    self.final_norm = RMSNorm(cfg.d_model, **kw)
    self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False, **kw)
    cos, sin = rotary_tables(cfg.seq, cfg.head_dim, cfg.rope_theta, device)
    self.register_buffer("rope_cos", cos, persistent=False)
    self.register_buffer("rope_sin", sin, persistent=False)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, self.rope_cos, self.rope_sin)
    return self.lm_head(self.final_norm(x))


def linear_names(model: nn.Module) -> list[str]:
  """The model's ``nn.Linear`` modules: what ``forge_torch.convert`` manages."""
  return [n for n, m in model.named_modules() if type(m) is nn.Linear]


def build_model(cfg: e2e.Config, device: str, seed: int = 0) -> Decoder:
  """The decoder on ``device``, initialised from ``seed`` at flax's default
  scales (normal; variance 1 / fan-in, 1 / d_model for the embedding)."""
  torch.manual_seed(seed)
  model = Decoder(cfg, device=device)
  with torch.no_grad():
    for m in model.modules():
      if isinstance(m, nn.Linear):
        m.weight.normal_(0.0, m.in_features ** -0.5)
    model.embed.weight.normal_(0.0, cfg.d_model ** -0.5)
  return model


def make_batch(cfg: e2e.Config, batch_size: int, device: str, seed: int = 0):
  """``(tokens, targets)``, int64 ``(batch_size, seq)``: the tokens
  benchmarks/e2e.py's ``make_batch`` draws for the same seed."""
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, cfg.vocab, (batch_size, cfg.seq + 1), dtype=np.int32)
  toks = torch.from_numpy(toks.astype(np.int64)).to(device)
  return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def loss_of(model: Decoder, tokens, targets) -> torch.Tensor:
  logits = model(tokens).float()
  return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                         targets.reshape(-1))


def train_step(model: Decoder, opt, tokens, targets) -> torch.Tensor:
  """One eager training step (the loss, ``backward()``, ``step()``,
  ``zero_grad(set_to_none=True)``); returns the loss."""
  loss = loss_of(model, tokens, targets)
  loss.backward()
  opt.step()
  opt.zero_grad(set_to_none=True)
  return loss


def make_optimizer(arm: str, model: Decoder, hparams: dict | None = None,
                   capturable: bool = False):
  """The arm's AdamW over ``model`` (``forge``: after converting it, in
  place): weight decay on matrices, none on the norm scales; ``fused=True``
  in both arms (in the forge arm it picks torch's fused kernel for the
  embedding and the norms, and its arithmetic for the managed weights);
  ``capturable``: for a step recorded in a CUDA graph."""
  if arm not in ARMS:
    raise ValueError(f"unknown arm {arm!r}; expected one of {ARMS}")
  groups, kw = _adamw_options(model, hparams, capturable)
  if arm == "torch":
    return torch.optim.AdamW(groups, **kw)
  import forge_torch  # noqa: PLC0415 -- the torch arm never starts JAX
  expected = linear_names(model)
  converted = forge_torch.convert(model)
  if sorted(converted) != sorted(expected) or converted.skipped:
    raise RuntimeError(
        "forge_torch.convert did not manage every projection and the head: "
        f"converted {sorted(converted)}, expected {sorted(expected)}, left on "
        f"the standard path {dict(converted.skipped)}")
  return forge_torch.AdamW(groups, **kw)


def _adamw_options(model: nn.Module, hparams: dict | None = None,
                   capturable: bool = False) -> tuple[list, dict]:
  """``(param_groups, options)`` of every arm's AdamW over ``model``:
  weight decay on matrices, none on the norm scales, ``fused=True``."""
  h = dict(e2e.HPARAMS if hparams is None else hparams)
  groups = [
      {"params": [p for p in model.parameters() if p.dim() >= 2],
       "weight_decay": h["weight_decay"]},
      {"params": [p for p in model.parameters() if p.dim() < 2],
       "weight_decay": 0.0}]
  kw = dict(lr=h["learning_rate"], betas=(h["b1"], h["b2"]), eps=h["eps"],
            fused=True, capturable=capturable)
  return groups, kw


def pool_bytes(model: nn.Module) -> tuple[int, int]:
  """``(grad_pool, grad_total)``: the bytes of the managed weights' gradients
  (every ``nn.Linear`` / ``forge_torch.Linear`` weight) and of every
  trainable parameter's."""
  pool = sum(m.weight.numel() * m.weight.element_size()
             for m in model.modules() if isinstance(m, nn.Linear))
  total = sum(p.numel() * p.element_size() for p in model.parameters()
              if p.requires_grad)
  return pool, total


def device_label(device: str) -> str:
  """The rows' device column: ``cuda:<GPU name>`` or ``cpu:<machine>``."""
  if device == "cuda":
    return f"cuda:{torch.cuda.get_device_name()}"
  return f"cpu:{platform.processor() or platform.machine() or 'unknown'}"


# --------------------------------------------------------------------------
# One cell (one subprocess)


def _moment_dtypes(opt) -> str:
  names = lambda key: "/".join(sorted({str(s[key].dtype).replace("torch.", "")
                                       for s in opt.state.values()
                                       if key in s}))
  return f"m={names('exp_avg')},v={names('exp_avg_sq')}"


def run_cell(arm: str, bt: int, cfg: e2e.Config, steps: int, warmup: int,
             device: str, seed: int = 0, graph: bool = False) -> dict:
  """Builds, warms up and times one (arm, BT) cell in this process; returns
  its figures (see the module docstring). ``graph``: the warm-up steps run
  eagerly on a side stream, then one whole step is captured in a CUDA
  graph, and the timed steps are its replays."""
  if bt % cfg.seq:
    raise ValueError(f"BT={bt} is not a multiple of seq={cfg.seq}")
  cuda = device == "cuda"
  if graph and not cuda:
    raise ValueError("--graph captures CUDA graphs: it needs --device cuda")
  t_start = time.perf_counter()
  model = build_model(cfg, device, seed)
  n_params = sum(p.numel() for p in model.parameters())
  pool, total = pool_bytes(model)
  opt = make_optimizer(arm, model, capturable=graph)
  stats = None
  if arm == "forge":
    import forge_torch  # noqa: PLC0415
    stats = forge_torch.bridge_stats
  tokens, targets = make_batch(cfg, bt // cfg.seq, device, seed)
  after_backward = [None]

  def step(mark=lambda: None):
    # mark(): the end of a phase (forward, backward; the optimizer's ends
    # with the step).
    loss = loss_of(model, tokens, targets)
    mark()
    loss.backward()
    mark()
    if cuda:
      after_backward[0] = torch.cuda.memory_allocated()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  t_built = time.perf_counter()
  phases = PHASES
  if graph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch asks before capture
      losses = [step().item() for _ in range(warmup)]
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
      static_loss = loss_of(model, tokens, targets)
      static_loss.backward()  # (the gradients live in the graph's pool)
      opt.step()
    phases = ("replay",)

    def step(mark=lambda: None):  # noqa: F811 -- the replayed step
      cuda_graph.replay()
      return static_loss
  else:
    losses = [step().item() for _ in range(warmup)]  # .item() waits for it
  if cuda:
    torch.cuda.synchronize()
  t_warm = time.perf_counter()
  if stats is not None:
    stats.reset()
  base = torch.cuda.memory_allocated() if cuda else None
  times, peaks, reserved = [], [], []
  host_ms = {p: [] for p in phases}
  gpu_ms = {p: [] for p in phases} if cuda else None
  for _ in range(steps):
    # Per phase: the host's time from its start to its last call's return,
    # and (CUDA) the GPU's between events recorded at the same points.
    marks = []
    events = []

    def mark():
      marks.append(time.perf_counter())
      if cuda:
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
    if cuda:
      torch.cuda.reset_peak_memory_stats()
      mark()
      loss = step(mark)
      mark()
      events[-1].synchronize()
      times.append(events[0].elapsed_time(events[-1]))  # ms
      peaks.append(torch.cuda.max_memory_allocated())
      reserved.append(torch.cuda.max_memory_reserved())
    else:
      mark()
      loss = step(mark)
      mark()
      times.append((marks[-1] - marks[0]) * 1e3)
    for i, p in enumerate(phases):
      host_ms[p].append((marks[i + 1] - marks[i]) * 1e3)
      if cuda:
        gpu_ms[p].append(events[i].elapsed_time(events[i + 1]))
    losses.append(loss.item())
  t_end = time.perf_counter()
  if graph:  # replays allocate nothing: the graph's pool is reserved
    peaks, after_backward[0] = [], None
  r = dict(arm=arm, bt=bt, batch=bt // cfg.seq, seq=cfg.seq, params=n_params,
           device=device_label(device), cuda=cuda, graph=graph,
           dtypes=(f"params={cfg.dtype},{_moment_dtypes(opt)},"
                   "logits/loss=float32"),
           step_ms=common.quantiles(times), losses=losses,
           host_ms={p: common.quantiles(v) for p, v in host_ms.items()},
           gpu_ms=None if gpu_ms is None else {
               p: common.quantiles(v) for p, v in gpu_ms.items()},
           grad_pool_bytes=pool, grad_total_bytes=total,
           peak_bytes=max(peaks) if peaks else None,
           peak_spread_bytes=(max(peaks) - min(peaks)) if peaks else None,
           peak_reserved_bytes=max(reserved) if reserved else None,
           base_bytes=base, after_backward_bytes=after_backward[0],
           jax_peak_bytes=None, bridge_calls=None, bridge_direct=None,
           bridge_copied=None,
           sync=None,
           phases=dict(setup=t_start - _T_IMPORT, build=t_built - t_start,
                       warmup=t_warm - t_built, steps=t_end - t_warm))
  if stats is not None:
    import forge_torch  # noqa: PLC0415
    r.update(bridge_calls=stats.calls / steps,
             bridge_direct=stats.direct / steps,
             bridge_copied=stats.copied / steps,
             sync=forge_torch.get_sync_mode(effective=True),
             jax_peak_bytes=e2e._peak_bytes() if cuda else None)
  return r


def run_paired(bt: int, cfg: e2e.Config, steps: int, warmup: int,
               device: str, seed: int = 0, lean: bool = False) -> dict:
  """Both arms in this process (``--paired``): two models from the same
  initialisation and one batch, warmed up, then timed step by step in
  alternation (torch then forge, then forge then torch, ...), so that the
  host's drift reaches both arms alike; returns each arm's step times and
  the quantiles of the per-pair ratios (forge's step over the torch step
  beside it). Memory is not measured: both models are resident. The torch
  arm runs with JAX started in the process (by forge_torch), which a torch
  cell never does. ``lean``: a third model, the lean bound (module
  docstring), timed in the same alternation."""
  if bt % cfg.seq:
    raise ValueError(f"BT={bt} is not a multiple of seq={cfg.seq}")
  cuda = device == "cuda"
  arms = ARMS + (("lean",) if lean else ())
  models = {arm: build_model(cfg, device, seed) for arm in arms}
  opts = {arm: make_optimizer(arm, models[arm]) for arm in ARMS}
  if lean:
    opts["lean"] = make_lean_optimizer(models["lean"], bt, device)
  tokens, targets = make_batch(cfg, bt // cfg.seq, device, seed)

  def step(arm):
    return train_step(models[arm], opts[arm], tokens, targets)

  losses = {arm: [] for arm in arms}
  for _ in range(warmup):
    for arm in arms:
      losses[arm].append(step(arm).item())  # .item() waits for it
  times = {arm: [] for arm in arms}
  for i in range(steps):
    for arm in (arms if i % 2 == 0 else arms[::-1]):
      if cuda:
        start, end = (torch.cuda.Event(enable_timing=True),
                      torch.cuda.Event(enable_timing=True))
        start.record()
        loss = step(arm)
        end.record()
        end.synchronize()
        times[arm].append(start.elapsed_time(end))  # ms
      else:
        t0 = time.perf_counter()
        loss = step(arm)
        times[arm].append((time.perf_counter() - t0) * 1e3)
      losses[arm].append(loss.item())
  ratios = [f / t for f, t in zip(times["forge"], times["torch"])]
  r = dict(bt=bt, device=device_label(device), cuda=cuda,
           params=sum(p.numel() for p in models["torch"].parameters()),
           dtypes=(f"params={cfg.dtype},{_moment_dtypes(opts['torch'])},"
                   "logits/loss=float32"),
           step_ms={arm: common.quantiles(times[arm]) for arm in arms},
           ratio=common.quantiles(ratios), losses=losses)
  if lean:
    r["lean_ratio"] = common.quantiles(
        [f / t for f, t in zip(times["lean"], times["torch"])])
  return r


def make_lean_optimizer(model: Decoder, bt: int, device: str):
  """The lean bound's optimizer over ``model``, whose projections and head
  it makes lean layers in place (benchmarks/lean_layer.py; on CUDA their
  launches are compiled for ``bt`` rows): torch's fused AdamW with every
  arm's groups and options (:func:`_adamw_options`)."""
  from benchmarks import lean_layer  # noqa: PLC0415
  _, lean_adamw, convert = lean_layer.make(device, bt)
  expected = linear_names(model)
  converted = convert(model)
  if sorted(converted) != sorted(expected):
    raise RuntimeError(f"the lean layer took {sorted(converted)}, expected "
                       f"{sorted(expected)}")
  groups, kw = _adamw_options(model)
  return lean_adamw(groups, **kw)


def check_parity(device: str, seed: int = 0) -> dict:
  """Both arms for :data:`CHECK_STEPS` steps from one initialisation, on
  :data:`CHECK_CONFIG` (fp32) on ``device``: the worst relative error (norm)
  of a parameter and of a parameter's update (``new - initial``), forge
  against torch, each with the parameter's name; both arms' losses; the
  fused-kernel calls; ``ok`` when both errors are within
  :data:`CHECK_RTOL`, the losses agree as closely, every parameter moved in
  both arms and every managed layer was updated by the fused kernel in every
  step."""
  cfg = CHECK_CONFIG
  hparams = dict(e2e.HPARAMS, learning_rate=CHECK_LR)
  tokens, targets = make_batch(cfg, CHECK_BATCH, device, seed)
  init = build_model(cfg, device, seed).state_dict()
  trained, losses, calls = {}, {}, 0
  for arm in ARMS:
    model = build_model(cfg, device, seed + 1)  # overwritten: one init
    model.load_state_dict(init)
    managed = len(linear_names(model))
    opt = make_optimizer(arm, model, hparams)
    if arm == "forge":
      import forge_torch  # noqa: PLC0415
      forge_torch.bridge_stats.reset()
    losses[arm] = []
    for _ in range(CHECK_STEPS):
      losses[arm].append(train_step(model, opt, tokens, targets).item())
    if arm == "forge":
      calls = forge_torch.bridge_stats.calls
    trained[arm] = {n: p.detach().double().cpu()
                    for n, p in model.named_parameters()}
  init = {n: t.double().cpu() for n, t in init.items()}

  def rel(a, b):
    d = float(b.norm())
    return float((a - b).norm()) / (d if d > 0 else 1.0)

  t, f = trained["torch"], trained["forge"]
  param = max((rel(f[n], t[n]), n) for n in t)
  update = max((rel(f[n] - init[n], t[n] - init[n]), n) for n in t)
  unmoved = [f"{arm}:{n}" for arm in ARMS for n in t
             if torch.equal(trained[arm][n], init[n])]
  loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses["forge"],
                                                      losses["torch"]))
  ok = (param[0] <= CHECK_RTOL and update[0] <= CHECK_RTOL
        and loss_err <= CHECK_RTOL and not unmoved
        and calls == managed * CHECK_STEPS)
  return dict(device=device_label(device), param_err=param[0],
              param_worst=param[1], update_err=update[0],
              update_worst=update[1], loss_err=loss_err, losses=losses,
              unmoved=unmoved, fused_calls=calls,
              expected_calls=managed * CHECK_STEPS, ok=ok)


# --------------------------------------------------------------------------
# The driver


def case_of(cfg: e2e.Config, bt: int, graph: bool = False) -> str:
  return (f"llama-{e2e._size(e2e.param_count(cfg))} BT={bt}"
          + (" CUDA graph" if graph else ""))


def shape_of(cfg: e2e.Config, bt: int) -> str:
  return (f"L{cfg.layers} d{cfg.d_model} h{cfg.heads}/kv{cfg.kv_heads} "
          f"ffn{cfg.ffn} V{cfg.vocab} B{bt // cfg.seq}x{cfg.seq} untied")


def write_cell_rows(path: str, cfg: e2e.Config, r: dict) -> str:
  """Appends one cell's rows to the CSV at ``path``; returns their
  timestamp."""
  res = common.Results(path, BENCHMARK, device=r["device"])
  bt = r["bt"]
  add = lambda metric, v, unit: res.add(case_of(cfg, bt, r.get("graph")),
                                        r["arm"],
                                        shape_of(cfg, bt), r["dtypes"],
                                        metric, v, unit)
  add("step_time", tuple(r["step_ms"]), "ms")
  for p in r["host_ms"]:
    add(f"host_{p}", tuple(r["host_ms"][p]), "ms")
    if r["gpu_ms"] is not None:
      add(f"gpu_{p}", tuple(r["gpu_ms"][p]), "ms")
  for metric, key in (("peak_memory", "peak_bytes"),
                      ("peak_reserved", "peak_reserved_bytes"),
                      ("base_memory", "base_bytes"),
                      ("after_backward", "after_backward_bytes"),
                      ("grad_pool", "grad_pool_bytes"),
                      ("grad_total", "grad_total_bytes"),
                      ("jax_peak_memory", "jax_peak_bytes")):
    if r[key] is not None:
      add(metric, r[key] / MIB, "MiB")
  if r["bridge_calls"] is not None:
    add("bridge_calls", r["bridge_calls"], f"per step (sync {r['sync']})")
    add("bridge_copied", r["bridge_copied"], f"per step (sync {r['sync']})")
    add("bridge_direct", r["bridge_direct"],
        "per step: of bridge_calls, those launched directly")
  add("loss_first", r["losses"][0], "nats")
  add("loss_final", r["losses"][-1], "nats")
  add("param_count", float(r["params"]), "params")
  return res.stamp


def write_paired_rows(path: str, cfg: e2e.Config, r: dict) -> None:
  """One ``--paired`` process's rows: each arm's ``step_time`` and the
  per-pair ratio ``step_ratio`` (provider ``forge/torch``; with the lean
  bound also ``lean/torch``), case ``... paired``, benchmark
  ``torch_e2e_paired`` (which the bar plot does not read;
  :func:`plot_paired` does)."""
  res = common.Results(path, PAIRED_BENCHMARK, device=r["device"])
  case = case_of(cfg, r["bt"]) + " paired"
  shape = shape_of(cfg, r["bt"])
  for arm in r["step_ms"]:
    res.add(case, arm, shape, r["dtypes"], "step_time",
            tuple(r["step_ms"][arm]), "ms")
    res.add(case, arm, shape, r["dtypes"], "loss_first", r["losses"][arm][0],
            "nats")
  res.add(case, "forge/torch", shape, r["dtypes"], "step_ratio",
          tuple(r["ratio"]), "forge step / the torch step beside it")
  if "lean_ratio" in r:
    res.add(case, "lean/torch", shape, r["dtypes"], "step_ratio",
            tuple(r["lean_ratio"]), "lean step / the torch step beside it")


def write_check_rows(path: str, r: dict) -> None:
  c = CHECK_CONFIG
  res = common.Results(path, BENCHMARK, device=r["device"])
  case = f"parity check {CHECK_STEPS} steps"
  shape = shape_of(c, c.seq * CHECK_BATCH)
  dtypes = "params=float32,m=float32,v=float32,logits/loss=float32"
  res.add(case, "forge", shape, dtypes, "parity_param_err", r["param_err"],
          f"rel. vs torch, worst {r['param_worst']}")
  res.add(case, "forge", shape, dtypes, "parity_update_err", r["update_err"],
          f"rel. vs torch, worst {r['update_worst']}")
  res.add(case, "forge", shape, dtypes, "parity_loss_err", r["loss_err"],
          "rel. vs torch")


def write_failed_row(path: str, cfg: e2e.Config, arm: str, bt: int,
                     device: str, reason: str, graph: bool = False) -> None:
  res = common.Results(path, BENCHMARK, device=device)
  res.add(case_of(cfg, bt, graph), arm, shape_of(cfg, bt), f"params={cfg.dtype}",
          "failed", math.nan, reason)


def _cell_argv(args, cell: str, bt: int | None = None) -> list[str]:
  argv = [sys.executable, "-m", "benchmarks.torch_e2e", "--cell", cell,
          "--device", args.device, "--seed", str(args.seed)]
  if cell == "check":
    return argv
  argv += ["--bt", str(bt), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--dtype", args.dtype]
  if args.graph:
    argv.append("--graph")
  if cell == "paired" and args.lean:
    argv.append("--lean")
  for flag in ("layers", "d_model", "heads", "kv_heads", "ffn", "vocab", "seq"):
    argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
  return argv


def _mib(v):
  return None if v is None else v / MIB


def summarize(results: dict, bts) -> bool:
  """Prints forge beside torch per BT; returns whether the first losses
  agree wherever both arms ran."""
  ok = True
  fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
  print(f"\n{'BT':>6} {'metric':<22} {'torch':>12} {'forge':>12} "
        f"{'forge/torch':>12}")
  for bt in bts:
    t, f = results.get(("torch", bt)), results.get(("forge", bt))
    get = lambda r, fn: None if r is None or fn(r) is None else fn(r)

    def row(name, fn, spec=".1f"):
      tv, fv = get(t, fn), get(f, fn)
      ratio = fmt(fv / tv if fv is not None and tv else None, ".3f")
      print(f"{bt:>6} {name:<22} {fmt(tv, spec):>12} {fmt(fv, spec):>12} "
            f"{ratio:>12}")
    row("step p50 (ms)", lambda r: r["step_ms"][1], ".2f")
    gpu = any(r is not None and r["gpu_ms"] is not None for r in (t, f))
    for p in (t or f or {"host_ms": PHASES})["host_ms"]:
      row(f"  {p} host (ms)", lambda r, p=p: r["host_ms"][p][1], ".2f")
      if gpu:
        row(f"  {p} GPU (ms)", lambda r, p=p: (
            None if r["gpu_ms"] is None else r["gpu_ms"][p][1]), ".2f")
    row("peak (MiB)", lambda r: _mib(r["peak_bytes"]))
    row("peak reserved (MiB)", lambda r: _mib(r["peak_reserved_bytes"]))
    row("after backward (MiB)", lambda r: _mib(r["after_backward_bytes"]))
    row("base (MiB)", lambda r: _mib(r["base_bytes"]))
    row("loss first", lambda r: r["losses"][0], ".5f")
    row("loss final", lambda r: r["losses"][-1], ".5f")
    for r in (t, f):
      if r is not None and r["peak_spread_bytes"]:
        print(f"{bt:>6} note: {r['arm']}'s timed steps peaked "
              f"{_mib(r['peak_spread_bytes']):.1f} MiB apart (not a steady "
              "state); the row holds the largest")
    if f is not None and f["bridge_copied"]:
      print(f"{bt:>6} note: the bridge copied {f['bridge_copied']:g} state "
            "tensors back per step (XLA did not write torch's memory in "
            "place: expected on the CPU, a lost zero copy on a GPU)")
    if t is None or f is None:
      continue
    pool = f["grad_pool_bytes"]
    print(f"{bt:>6} gradient pool (managed weights) {pool / MIB:.1f} MiB = "
          f"{pool / f['grad_total_bytes']:.1%} of torch's gradients "
          f"({f['grad_total_bytes'] / MIB:.1f} MiB)")
    if t["peak_bytes"] and f["peak_bytes"]:
      saved = t["peak_bytes"] - f["peak_bytes"]
      gone = t["after_backward_bytes"] - f["after_backward_bytes"]
      print(f"{bt:>6} peak saved {saved / MIB:.1f} MiB = {saved / pool:.1%} "
            f"of the pool; after backward {gone / MIB:.1f} MiB = "
            f"{gone / pool:.1%} of the pool")
    ok &= e2e.first_losses_agree(bt, "forge", f["losses"][0], "torch",
                                 t["losses"][0])
  return ok


def print_rounds(runs: dict, bts) -> None:
  """Per BT, each round's forge/torch step-time ratio (cells run side by
  side) and their median."""
  for bt in bts:
    t = dict(runs.get(("torch", bt), []))
    f = dict(runs.get(("forge", bt), []))
    ratios = [f[i]["step_ms"][1] / t[i]["step_ms"][1]
              for i in sorted(set(t) & set(f))]
    if ratios:
      print(f"{bt:>6} step forge/torch by round: "
            + " ".join(f"{x:.3f}" for x in ratios)
            + f"; median {statistics.median(ratios):.3f} (torch "
            + " ".join(f"{t[i]['step_ms'][1]:.1f}" for i in sorted(t))
            + " ms; forge "
            + " ".join(f"{f[i]['step_ms'][1]:.1f}" for i in sorted(f))
            + " ms)")


def bar_rows(csv_path: str, pick: dict | None = None) -> dict:
  """``{(BT, arm, metric): row}`` of a torch_e2e CSV, each BT's from one
  run (``benchmarks.e2e.bar_rows``: of the runs with the most arms at that
  BT, the newest), or with ``pick`` (``{(BT, arm): timestamp}``) those
  cells' rows."""
  return e2e.bar_rows(csv_path, pick, benchmark=BENCHMARK)


def plot(csv_path: str, png_path: str, pick: dict | None = None) -> bool:
  """Bar chart of a torch_e2e CSV: p50 step time and peak memory per BT and
  arm (each BT's from one run, its commit under the BT, or the cells
  ``pick`` names), each forge bar labelled with its ratio to torch's. False
  (nothing written) without step rows."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  last = bar_rows(csv_path, pick)
  bts = sorted({k[0] for k in last if k[2] == "step_time"})
  if not bts:
    print(f"plot: {csv_path} has no torch_e2e step_time rows; nothing "
          "plotted", file=sys.stderr)
    return False
  commits = e2e.bt_commits(last)
  fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
  colors = {"torch": "gray", "forge": "tab:orange"}
  width = 0.4
  val = lambda bt, arm, metric: (float(last[(bt, arm, metric)]["p50"])
                                 if (bt, arm, metric) in last else math.nan)
  # A CUDA graph's replays allocate nothing: its cells have the reserved
  # peak (the graph's pool) instead.
  memory = (("peak_memory", "torch allocator peak over a step (MiB)")
            if any(k[2] == "peak_memory" for k in last) else
            ("peak_reserved", "torch allocator reserved (MiB), graph pool "
             "included"))
  for ax, (metric, label) in zip(axes, (
      ("step_time", "median step time (ms)"), memory)):
    ax.set_ylabel(label)
    if all(math.isnan(val(bt, a, metric)) for bt in bts for a in ARMS):
      ax.text(0.5, 0.5, f"no {metric} rows\n(measured on CUDA only)",
              ha="center", va="center", transform=ax.transAxes)
      ax.set_xticks([])
      ax.set_yticks([])
      continue
    for i, arm in enumerate(ARMS):
      vals = [val(bt, arm, metric) for bt in bts]
      labels = []
      for bt, v in zip(bts, vals):
        base = val(bt, "torch", metric)
        if math.isnan(v):
          labels.append("")
        elif arm == "forge" and base > 0:  # False for NaN
          labels.append(f"{v:.1f}\n{v / base:.2f}x")
        else:
          labels.append(f"{v:.1f}")
      # A cell that did not run (or failed) gets no bar, not a 0.
      bars = ax.bar([j + i * width for j in range(len(bts))], vals, width,
                    label=arm, color=colors[arm])
      ax.bar_label(bars, labels=labels, fontsize=7)
    if metric == memory[0]:
      # Where forge's bar would end if its peak lost the whole pool.
      for j, bt in enumerate(bts):
        ideal = val(bt, "torch", metric) - val(bt, "torch", "grad_pool")
        if not math.isnan(ideal):
          ax.hlines(ideal, j + width / 2, j + 3 * width / 2, colors="k",
                    linestyles="--", label="torch - gradient pool"
                    if j == 0 else None)
    ax.set_xticks([j + width / 2 for j in range(len(bts))])
    ax.set_xticklabels([f"BT={bt}" + (f"\n{commits[bt]}" if bt in commits
                                       else "") for bt in bts])
    ax.margins(y=0.15)
    ax.legend(fontsize=8, loc="lower right")
  any_row = next(iter(last.values()))
  pool = next((float(r["p50"]) for k, r in last.items()
               if k[2] == "grad_pool"), math.nan)
  shape = any_row["shape"].rsplit(" B", 1)[0]
  graph = (", the step captured in a CUDA graph"
           if any_row["case"].endswith("CUDA graph") else "")
  fig.suptitle(f"Llama-style decoder training step in torch ({shape}; "
               f"gradient pool {pool:.4g} MiB{graph}): forge_torch vs "
               f"AdamW(fused=True) on {any_row['device']}; labels: forge / "
               "torch", fontsize=8)
  common.save_figure(fig, png_path)
  return True


def paired_points(rows) -> dict[int, list[tuple]]:
  """Per BT, the ``--paired`` processes' ratio rows in the order they ran:
  ``(x, provider, commit, p20, p50, p80)``, ``x`` the process's index
  (its ``forge/torch`` row's; a ``lean/torch`` row, written by the same
  process with the same timestamp, takes that process's ``x``)."""
  rows = [r for r in rows if r["benchmark"] == PAIRED_BENCHMARK
          and r["metric"] == "step_ratio"
          and r["provider"] in ("forge/torch", "lean/torch")]
  rows.sort(key=lambda r: r["timestamp"])
  points: dict[int, list[tuple]] = {}
  where: dict[tuple, int] = {}
  for r in rows:
    if r["provider"] != "forge/torch":
      continue
    bt = int(r["case"].split("BT=")[1].split()[0])
    mine = points.setdefault(bt, [])
    x = where[(r["timestamp"], r["case"])] = len(mine)
    mine.append((x, "forge/torch", r["commit"],
                 *(float(r[q]) for q in ("p20", "p50", "p80"))))
  for r in rows:
    x = where.get((r["timestamp"], r["case"]))
    if r["provider"] == "lean/torch" and x is not None:
      bt = int(r["case"].split("BT=")[1].split()[0])
      points[bt].append((x, "lean/torch", r["commit"],
                         *(float(r[q]) for q in ("p20", "p50", "p80"))))
  return points


def plot_paired(csv_path: str, png_path: str) -> bool:
  """Every ``--paired`` process's forge/torch ratio in a torch_e2e CSV, in
  the order they ran: the median of its pairs, with their p20-p80 range,
  coloured by commit, one panel per BT; a process run with ``--lean`` also
  its lean/torch ratio (hollow squares). False (nothing written) without
  paired rows."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  rows = common.read_rows(csv_path)
  points = paired_points(rows)
  if not points:
    print(f"plot: {csv_path} has no {PAIRED_BENCHMARK} step_ratio rows; "
          "nothing plotted", file=sys.stderr)
    return False
  bts = sorted(points)
  commits = list(dict.fromkeys(p[2] for bt in bts for p in sorted(
      points[bt])))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  if len(commits) > len(colors):  # (no two commits in one colour)
    colors = [plt.get_cmap("tab20")(i % 20) for i in range(len(commits))]
  fig, axes = plt.subplots(1, len(bts), figsize=(6.5 * len(bts) + 1, 3.6),
                           squeeze=False)
  for ax, bt in zip(axes[0], bts):
    for provider in ("forge/torch", "lean/torch"):
      lean = provider == "lean/torch"
      for commit in commits:
        mine = [p for p in points[bt] if p[1] == provider and p[2] == commit]
        if not mine:
          continue
        xs, p20, p50, p80 = ([p[i] for p in mine] for i in (0, 3, 4, 5))
        color = colors[commits.index(commit) % len(colors)]
        ax.errorbar(xs, p50, yerr=[[m - lo for m, lo in zip(p50, p20)],
                                   [hi - m for m, hi in zip(p50, p80)]],
                    fmt="s" if lean else "o", capsize=3, color=color,
                    mfc="none" if lean else color,
                    label=f"{commit}, lean bound" if lean else commit)
    ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    ax.set_xlabel("process, in the order run")
    ax.set_ylabel("step / torch step beside it")
    ax.set_title(f"BT={bt}", fontsize=9)
    ax.legend(fontsize=7, title="commit", title_fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
  first = next(r for r in rows if r["benchmark"] == PAIRED_BENCHMARK)
  shape = first["shape"].rsplit(" B", 1)[0]
  fig.suptitle(f"Llama-style decoder's eager step in torch ({shape}),\n"
               f"both arms in one process, on {first['device']}: "
               "forge_torch / AdamW(fused=True),\nper process the median "
               "pair ratio (p20-p80); squares: the lean bound", fontsize=8)
  common.save_figure(fig, png_path)
  return True


def parse_args(argv):
  d = e2e.Config()
  p = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=common.DefaultsFormatter)
  p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
  p.add_argument("--bt", type=common.positive_int, nargs="+",
                 default=[512, 2048], help="tokens per step (batch x seq; "
                 "multiples of --seq)")
  for flag, what in (("layers", "decoder blocks"),
                     ("d_model", "model width"),
                     ("heads", "query heads (divide --d-model)"),
                     ("kv_heads", "key/value heads (divide --heads)"),
                     ("ffn", "SwiGLU hidden width"),
                     ("vocab", "vocabulary size"),
                     ("seq", "sequence length")):
    p.add_argument(f"--{flag.replace('_', '-')}", type=common.positive_int,
                   default=getattr(d, flag), help=what)
  p.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float32"),
                 help="parameters, activations and AdamW moments")
  p.add_argument("--steps", type=common.positive_int, default=20,
                 help="timed steps per cell")
  p.add_argument("--warmup", type=common.positive_int, default=3,
                 help="untimed steps first (the first creates the optimizer "
                 "state and compiles the fused kernel)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                 help="cpu: a smoke run of tiny models (rows marked cpu; "
                 "no memory rows)")
  p.add_argument("--check", action="store_true",
                 help=f"first run both arms {CHECK_STEPS} steps on a tiny "
                 f"fp32 decoder and compare the parameters (<= {CHECK_RTOL:g}"
                 " relative)")
  p.add_argument("--out", type=paths.out_file, default=None,
                 help="CSV (appended; default out/bench/torch_e2e.csv)")
  p.add_argument("--plot", type=paths.out_file, default=None, metavar="PNG")
  p.add_argument("--out-dir", type=paths.out_dir, default=None, metavar="DIR",
                 help="write DIR/torch_e2e.csv and DIR/torch_e2e.png "
                 "(instead of --out and --plot)")
  p.add_argument("--replot", action="store_true",
                 help="only plot the CSV into the PNG; run nothing")
  p.add_argument("--cell-timeout", type=common.positive_int, default=300,
                 help="seconds per cell subprocess")
  p.add_argument("--repeat", type=common.positive_int, default=1,
                 help="run every cell this many times, in rounds of both "
                 "arms (order reversed every other round), as "
                 "benchmarks.e2e does: both arms are host-bound and their "
                 "step times drift with the host's load, so each round's "
                 "ratio pairs cells run side by side; the table and plot "
                 "show each arm's median cell, and every round's ratio is "
                 "printed")
  p.add_argument("--graph", action="store_true",
                 help="capture one whole step (loss, backward, step()) in a "
                 "CUDA graph after the warm-up and time its replays, in "
                 "both arms (their AdamW with capturable=True): the host's "
                 "Python leaves the step. CUDA only; the rows' case says "
                 "CUDA graph, peak_memory is left out (replays allocate "
                 "nothing) and peak_reserved holds the graph's pool")
  p.add_argument("--paired", action="store_true",
                 help="time both arms in one process per BT (and per "
                 "--repeat round), step by step in alternation, instead of "
                 "one process per cell: each pair of steps runs side by "
                 "side, so the host's drift reaches both arms alike; writes "
                 "each arm's step_time and the per-pair step_ratio (case "
                 "'... paired'); no memory rows; --plot draws every paired "
                 "process's ratio in the CSV")
  p.add_argument("--lean", action="store_true",
                 help="with --paired: a third model, the lean bound (a "
                 "layer of forge_torch's form with only the per-layer work "
                 "of a path validated once per step; see the module "
                 "docstring), its step_time and step_ratio lean/torch")
  p.add_argument("--cell", choices=(*ARMS, "check", "paired"),
                 help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.out_dir is not None:
    if args.out is not None or args.plot is not None:
      p.error("give --out-dir, or --out and --plot, not both")
    args.out = os.path.join(args.out_dir, "torch_e2e.csv")
    args.plot = os.path.join(args.out_dir, "torch_e2e.png")
  if args.out is None:
    args.out = os.path.join("out", "bench", "torch_e2e.csv")
  try:
    config_of(args)
  except ValueError as e:
    p.error(f"model flags: {e} (--d-model, --heads, --kv-heads)")
  for bt in args.bt:
    if bt % args.seq:
      p.error(f"--bt {bt} is not a multiple of --seq {args.seq}: a step is "
              "a whole number of sequences")
  if args.cell in (*ARMS, "paired") and len(args.bt) != 1:
    p.error("--cell runs one BT")
  if args.paired and sorted(args.arms) != sorted(ARMS):
    p.error("--paired times both arms side by side: leave --arms out")
  if args.lean and not (args.paired or args.cell == "paired"):
    p.error("--lean is a third arm of --paired")
  if args.paired and (args.graph or args.check):
    p.error("--paired times eager steps only: not with --graph or --check")
  if args.graph and args.device != "cuda":
    p.error("--graph records CUDA graphs: it needs --device cuda")
  if args.replot:
    if not args.plot:
      p.error("--replot needs --plot PNG (or --out-dir)")
    if not os.path.exists(args.out):
      p.error(f"--replot: no CSV at {args.out}")
  return args


def config_of(args) -> e2e.Config:
  return e2e.Config(layers=args.layers, d_model=args.d_model,
                    heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn,
                    vocab=args.vocab, seq=args.seq, dtype=args.dtype)


def _run_check(args) -> bool:
  print(f"== parity check: both arms {CHECK_STEPS} steps on a tiny fp32 "
        f"decoder on {args.device}", flush=True)
  r, reason = e2e.run_tagged(_cell_argv(args, "check"), e2e._subprocess_env(),
                             args.cell_timeout, "check", RESULT_TAG)
  if r is None:
    print(f"   check FAILED to run: {reason}")
    return False
  write_check_rows(args.out, r)
  print(f"   parameters: worst rel. error {r['param_err']:.2e} "
        f"({r['param_worst']}); updates: {r['update_err']:.2e} "
        f"({r['update_worst']}); losses {r['loss_err']:.2e}; fused calls "
        f"{r['fused_calls']} of {r['expected_calls']}; unmoved "
        f"{r['unmoved'] or 'none'}: {'OK' if r['ok'] else 'FAILED'} (bar "
        f"{CHECK_RTOL:g})")
  return r["ok"]


def _run_cell_process(args, cell: str, bt: int, rnd: int):
  """Runs ``--cell cell`` at ``bt`` (round ``rnd``) in its subprocess;
  returns its result (``None`` if it failed), the reason it failed and its
  label."""
  argv = _cell_argv(args, cell, bt)
  where = f"{cell} BT={bt}" + (f" round {rnd + 1}" if args.repeat > 1
                               else "")
  print(f"== cell {where} (timeout {args.cell_timeout} s): "
        f"{' '.join(argv[1:])}", flush=True)
  r, reason = e2e.run_tagged(argv, e2e._subprocess_env(), args.cell_timeout,
                             where, RESULT_TAG)
  return r, reason, where


def _main_paired(args, cfg: e2e.Config) -> int:
  """``--paired``: one process per BT and round, both arms in it."""
  ok = True
  for bt in args.bt:
    ratios = []
    for rnd in range(args.repeat):
      r, reason, where = _run_cell_process(args, "paired", bt, rnd)
      if r is None:
        ok = False
        print(f"   FAILED {where}: {reason}", flush=True)
        common.Results(args.out, PAIRED_BENCHMARK,
                       device=device_label(args.device)).add(
            case_of(cfg, bt) + " paired", "forge/torch", shape_of(cfg, bt),
            f"params={cfg.dtype}", "failed", math.nan, reason)
        continue
      write_paired_rows(args.out, cfg, r)
      t, f = r["step_ms"]["torch"], r["step_ms"]["forge"]
      ratios.append(r["ratio"][1])
      print(f"   step p50 torch {t[1]:.2f} ms, forge {f[1]:.2f} ms; per "
            f"pair forge/torch p20/p50/p80 {r['ratio'][0]:.3f} / "
            f"{r['ratio'][1]:.3f} / {r['ratio'][2]:.3f}", flush=True)
      if "lean_ratio" in r:
        q = r["lean_ratio"]
        print(f"   lean bound: step p50 {r['step_ms']['lean'][1]:.2f} ms; "
              f"per pair lean/torch p20/p50/p80 {q[0]:.3f} / {q[1]:.3f} / "
              f"{q[2]:.3f}", flush=True)
      ok &= e2e.first_losses_agree(bt, "forge", r["losses"]["forge"][0],
                                   "torch", r["losses"]["torch"][0])
    if len(ratios) > 1:
      print(f"{bt:>6} per-pair median ratio by round: "
            + " ".join(f"{x:.3f}" for x in ratios)
            + f"; median {statistics.median(ratios):.3f}")
  print(f"wrote {args.out}")
  if args.plot:
    ok &= plot_paired(args.out, args.plot)
  return 0 if ok else 1


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.replot:
    draw = plot_paired if args.paired else plot
    return 0 if draw(args.out, args.plot) else 1
  if args.device == "cuda" and not torch.cuda.is_available():
    print("torch_e2e: no CUDA device (torch.cuda.is_available() is False), "
          "so nothing can be measured as a GPU figure. Run it on a GPU, or "
          "pass --device cpu for a smoke run of a tiny model (its rows say "
          "cpu).", file=sys.stderr)
    return 1
  cfg = config_of(args)
  if args.cell == "check":
    print(RESULT_TAG + json.dumps(check_parity(args.device, args.seed)),
          flush=True)
    return 0
  if args.cell == "paired":
    r = run_paired(args.bt[0], cfg, args.steps, args.warmup, args.device,
                   args.seed, lean=args.lean)
    print(RESULT_TAG + json.dumps(r), flush=True)
    return 0
  if args.cell:
    r = run_cell(args.cell, args.bt[0], cfg, args.steps, args.warmup,
                 args.device, args.seed, graph=args.graph)
    print(f"{r['arm']} BT={r['bt']} on {r['device']}: {r['params']:,} params "
          f"({r['dtypes']}); step p50 {r['step_ms'][1]:.2f} ms; peak "
          f"{_mib(r['peak_bytes'])} MiB; losses "
          f"{' '.join(f'{l:.4f}' for l in r['losses'])}; phases (s) "
          + ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items()),
          flush=True)
    print(RESULT_TAG + json.dumps(r), flush=True)
    return 0

  n = e2e.param_count(cfg)
  print(f"model: Llama-style decoder in torch, {n:,} parameters "
        f"({n / 1e9:.3f} B): {cfg.layers} layers, d_model {cfg.d_model}, "
        f"{cfg.heads} heads / {cfg.kv_heads} kv heads, ffn {cfg.ffn}, vocab "
        f"{cfg.vocab}, seq {cfg.seq}; {cfg.dtype} params, m, v; fp32 loss; "
        f"AdamW {e2e.HPARAMS}, decay on matrices, fused=True; device "
        f"{args.device}")
  print(f"cells: arms {args.arms} x BT {args.bt}"
        + (f" x {args.repeat} rounds" if args.repeat > 1 else "")
        + f"; {args.warmup} warm-up + {args.steps} timed steps each; CSV "
        f"{args.out}", flush=True)
  if args.device == "cpu":
    print("CPU smoke run: the timings are not GPU figures (rows marked cpu)")
  if args.paired:
    return _main_paired(args, cfg)
  start = time.perf_counter()
  checked = _run_check(args) if args.check else True
  runs, failed, device, stamps = {}, [], None, {}
  for bt in args.bt:
    for rnd in range(args.repeat):
      for arm in (args.arms if rnd % 2 == 0 else args.arms[::-1]):
        r, reason, where = _run_cell_process(args, arm, bt, rnd)
        if r is None:
          failed.append((arm, bt, reason))
          print(f"   FAILED {where}: {reason}", flush=True)
          write_failed_row(args.out, cfg, arm, bt,
                           device or device_label(args.device), reason,
                           graph=args.graph)
          continue
        device = r["device"]
        runs.setdefault((arm, bt), []).append((rnd, r))
        stamps[id(r)] = write_cell_rows(args.out, cfg, r)
        if r["params"] != n:
          print(f"   warning: cell counted {r['params']:,} params, expected "
                f"{n:,}")
  results = {key: e2e.median_cell([r for _, r in cells])
             for key, cells in runs.items()}
  picks = {(bt, arm): stamps[id(r)] for (arm, bt), r in results.items()}
  same = summarize(results, args.bt)
  if args.repeat > 1:
    print_rounds(runs, args.bt)
  for arm, bt, reason in failed:
    print(f"failed cell {arm} BT={bt}: {reason}")
  print(f"wrote {args.out} ({sum(map(len, runs.values()))} cells ok, "
        f"{len(failed)} failed) "
        f"in {time.perf_counter() - start:.0f} s")
  if args.plot and results:
    plot(args.out, args.plot, pick=picks)
  if not checked:
    print("FAILED: the parity check (--check) did not pass")
  return 0 if same and checked and not failed else 1


if __name__ == "__main__":
  sys.exit(main())
