"""Paired end-to-end timing: every arm's training step compiled in one process
and timed in alternating blocks, so that drift falls on all arms alike.

    ./dev.sh python -m benchmarks.e2e_paired --bt 512 --processes 3 \\
        --out P.csv --plot P.png

Why. ``e2e.py`` runs one process and one compile per (arm, BT) cell: the
issue's protocol, and the only way to read each arm's own allocator peak. Its
step times move from cell to cell by more than the difference in question:
cells of one arm whose losses were identical to the last digit differed by
6.5 % (optax) and 7.5 % (fused) on the H200, where forge-xla and optax differ
by about 1 %. Cells run a minute apart, so anything that drifts over minutes
(clocks, temperature, other work on the host) lands on one arm's cell and not
the other's.

What this script does. It compiles every arm's step once in this process (the
model, initialisation, batch and AdamW settings of ``e2e.py``, whose model
options it takes), gives each arm its own copy of the same initial variables
(each step donates its state), runs ``--warmup`` steps of each, then
``--rounds`` rounds: a round is every arm's turn, in an order reversed every
other round (A B C, C B A, ...). A turn times ``--block`` steps two ways:

  synced     every step blocked on before the next is dispatched, as
             ``e2e.py`` times it: the step's latency, the host's dispatch of
             it included;
  pipelined  ``--block`` more steps dispatched back to back, one block on
             the last (the losses read after it): time per step as a
             training loop that does not wait on every loss sees it, the
             host's dispatch overlapping the device's work.

Each FORGE arm's ratio to optax is taken per round, each way (synced: the two
blocks' median step times; pipelined: their time per step), and reported as
p20/p50/p80 over the rounds with the count of rounds in which the arm was
faster. What a compile fixes (XLA's GEMM
autotuning choices, buffer assignment) is the same for every round of a
process; ``--processes N`` repeats the whole measurement in N fresh processes
(a fresh compile each) and pools their rounds. Peak memory is not measured
here: the arms share one allocator (``e2e.py`` measures it per cell).

``--model stack`` times ``scan_memory.py``'s scanned stack instead
(``--stack-layers`` bf16 ``--stack-width``-square kernels, no bias, ReLU,
``--bt`` tokens, loss ``mean(y**2)``; AdamW at the decoder's settings, m and
v in bf16, no mask): FORGE's ``ScannedDenseStack`` against the same module
with ``fused=False`` (``nn.scan``) + ``optax.adamw``, whose scan transpose
writes every layer's gradient into one stacked pool that the update reads
after the loop -- the case where XLA cannot consume each gradient right
after its GEMM.

CSV rows (benchmark ``e2e_paired``, ``benchmarks.common.Results``; one
timestamp per process): per arm ``step_time`` (ms, p20/p50/p80 of every synced
step), ``block_time_round<r>`` (ms, the round's synced block: p20/p50/p80 of
its steps), ``pipelined_step_time`` (ms, p20/p50/p80 over the rounds of the
pipelined blocks' time per step), ``pipelined_time_round<r>`` (ms, the
round's pipelined time per step), ``compile_time`` (s), ``loss_first`` /
``loss_final``; per FORGE arm ``ratio_to_optax`` and
``pipelined_ratio_to_optax`` (p20/p50/p80 over rounds), ``faster_rounds`` and
``pipelined_faster_rounds`` (counts; unit ``of <rounds>``). Exit status: 0 if every process ran and the arms'
first-step losses agree, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import common, e2e, paths

RESULT_TAG = "E2E_PAIRED_RESULT "
BENCHMARK = "e2e_paired"


def round_orders(arms, rounds: int) -> list[list[str]]:
  """The order of the arms in each round: as given, reversed every other
  round (so no arm always runs right after the same one)."""
  return [list(arms) if r % 2 == 0 else list(arms)[::-1]
          for r in range(rounds)]


def paired_ratios(blocks: dict, arm: str, ref: str = "optax") -> list[float]:
  """Per round, ``arm``'s block median over ``ref``'s (``blocks[arm][r]``:
  round ``r``'s step times, seconds)."""
  return [statistics.median(a) / statistics.median(o)
          for a, o in zip(blocks[arm], blocks[ref], strict=True)]


def pipelined_steps(step, variables, opt_state, batch, n: int):
  """``n`` steps dispatched back to back, one block on the last state:
  ``(seconds per step, losses, variables, opt_state)``."""
  losses = []
  t0 = time.perf_counter()
  for _ in range(n):
    loss, variables, opt_state = step(variables, opt_state, batch)
    losses.append(loss)
  jax.block_until_ready((losses, variables, opt_state))
  per_step = (time.perf_counter() - t0) / n
  return per_step, [float(l) for l in losses], variables, opt_state


def _compile(step, abstract_args, hlo_dir: str | None, arm: str):
  """``(compiled, seconds)``: ``jax.jit(step, donate_argnums=(0, 1))``
  compiled for ``abstract_args``; its scheduled HLO written to
  ``hlo_dir/<arm>.hlo.txt`` if asked."""
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      *abstract_args).compile()
  seconds = time.perf_counter() - t0
  if hlo_dir:
    os.makedirs(hlo_dir, exist_ok=True)
    with open(os.path.join(hlo_dir, f"{arm}.hlo.txt"), "w") as f:
      f.write(compiled.as_text())
  return compiled, seconds


def _own_copies(arms, init, txs) -> dict:
  """Each arm its own copy of ``init`` and its optimizer state (every step
  donates them)."""
  state = {}
  for arm in arms:
    v = jax.tree.map(lambda a: jnp.array(a, copy=True), init)
    state[arm] = (v, jax.jit(txs[arm].init)(v["params"]))
  jax.block_until_ready(state)
  return state


def build_decoder(arms, bt: int, cfg: e2e.Config, seed: int = 0,
                  hlo_dir: str | None = None):
  """``e2e.py``'s decoder arms: ``(compiled, state, batch, compile_s)``,
  dicts by arm but for the shared batch."""
  if bt % cfg.seq:
    raise ValueError(f"BT={bt} is not a multiple of seq={cfg.seq}")
  batch = e2e.make_batch(cfg, bt // cfg.seq, seed)
  abs_vars = e2e.abstract_variables(cfg)
  compiled, txs, compile_s = {}, {}, {}
  for arm in arms:
    step, txs[arm] = e2e.build_arm(arm, cfg)
    abs_state = jax.eval_shape(txs[arm].init, abs_vars["params"])
    compiled[arm], compile_s[arm] = _compile(
        step, (abs_vars, abs_state, batch), hlo_dir, arm)
  init = e2e.init_variables(cfg, seed, abstract=abs_vars)
  return compiled, _own_copies(arms, init, txs), batch, compile_s


def stack_model(layers: int, width: int, fused: bool,
                stack_update: str = "auto"):
  """The scanned stack of ``scan_memory.py``: ``layers`` bf16 ``width x
  width`` kernels, no bias, ReLU; ``fused=False`` is ``nn.scan`` of a
  Dense layer (the optax arm)."""
  import flax.linen as nn  # noqa: PLC0415
  import forge_jax  # noqa: PLC0415
  return forge_jax.ScannedDenseStack(
      width, layers, use_bias=False, activation=nn.relu, dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16, fused=fused, stack_update=stack_update)


def build_stack(arms, bt: int, layers: int, width: int, seed: int = 0,
                hlo_dir: str | None = None, stack_update: str = "auto"):
  """The scanned stack's arms (``stack_model``; loss ``mean(y**2)`` in fp32;
  AdamW at ``e2e.HPARAMS``, no mask, m and v in bf16): FORGE's
  ``make_step`` (``wgrad`` per arm) + ``forge_jax.adamw`` against
  ``jax.value_and_grad`` + ``optax.adamw``. Returns what
  :func:`build_decoder` does."""
  import optax  # noqa: PLC0415
  import forge_jax  # noqa: PLC0415
  x = jax.random.normal(jax.random.key(seed + 1), (bt, width), jnp.bfloat16)
  h = dict(e2e.HPARAMS)
  lr = h.pop("learning_rate")
  init = stack_model(layers, width, True).init(jax.random.key(seed), x)
  compiled, txs, compile_s = {}, {}, {}
  for arm in arms:
    model = stack_model(layers, width, fused=arm in e2e.WGRAD,
                        stack_update=stack_update)
    loss_fn = lambda v, b, model=model: jnp.mean(
        model.apply(v, b).astype(jnp.float32) ** 2)
    if arm in e2e.WGRAD:
      txs[arm] = forge_jax.adamw(lr, mu_dtype=jnp.bfloat16, **h)
      step = forge_jax.make_step(loss_fn, txs[arm], wgrad=e2e.WGRAD[arm])
    else:
      txs[arm] = optax.adamw(lr, mu_dtype=jnp.bfloat16, **h)
      step = common.optax_step(loss_fn, txs[arm])
    abs_state = jax.eval_shape(txs[arm].init, init["params"])
    compiled[arm], compile_s[arm] = _compile(step, (init, abs_state, x),
                                             hlo_dir, arm)
  return compiled, _own_copies(arms, init, txs), x, compile_s


def time_rounds(arms, compiled: dict, state: dict, batch, rounds: int,
                block: int, warmup: int) -> dict:
  """The measurement: ``warmup`` steps per arm, then the rounds (see the
  module docstring). Returns ``blocks`` (per arm, per round: the synced
  step times, s), ``piped`` (per arm, per round: pipelined seconds per
  step) and ``losses`` (per arm, every step's)."""
  losses = {arm: [] for arm in arms}
  for arm in arms:
    _, ls, v, s = common.timed_steps(compiled[arm], *state[arm], batch,
                                     warmup, 0)
    state[arm] = (v, s)
    losses[arm] += ls
  blocks = {arm: [] for arm in arms}
  piped = {arm: [] for arm in arms}
  for order in round_orders(arms, rounds):
    for arm in order:
      ts, ls, v, s = common.timed_steps(compiled[arm], *state[arm], batch,
                                        0, block)
      blocks[arm].append(ts)
      losses[arm] += ls
      t, ls, v, s = pipelined_steps(compiled[arm], v, s, batch, block)
      state[arm] = (v, s)
      piped[arm].append(t)
      losses[arm] += ls
  return dict(blocks=blocks, piped=piped, losses=losses)


def run_process(arms, bt: int, cfg: e2e.Config, rounds: int, block: int,
                warmup: int, seed: int = 0, out: str | None = None,
                hlo_dir: str | None = None, stack: tuple | None = None) -> dict:
  """Compiles every arm, runs the rounds in this process; writes its rows to
  ``out`` (if given) and returns the figures (JSON-serialisable). The
  decoder of ``cfg``, or with ``stack=(layers, width, stack_update)`` the
  scanned stack."""
  if stack is None:
    compiled, state, batch, compile_s = build_decoder(arms, bt, cfg, seed,
                                                      hlo_dir)
  else:
    layers, width, update = stack
    compiled, state, batch, compile_s = build_stack(
        arms, bt, layers, width, seed, hlo_dir, update)
  t = time_rounds(arms, compiled, state, batch, rounds, block, warmup)
  blocks, piped = t["blocks"], t["piped"]
  r = dict(arms=list(arms), bt=bt, rounds=rounds, block=block,
           blocks=blocks, piped=piped, losses=t["losses"], compile_s=compile_s,
           ratios={a: paired_ratios(blocks, a) for a in arms if a != "optax"},
           piped_ratios={a: [x / o for x, o in zip(piped[a], piped["optax"])]
                         for a in arms if a != "optax"},
           device=common.device_name(), stack=stack,
           scan=stack is None and cfg.scan)
  if out:
    _write_rows(out, r, cfg)
  return r


def _write_rows(out: str, r: dict, cfg: e2e.Config) -> None:
  res = common.Results(out, BENCHMARK)
  runs = f"{r['rounds']} rounds x {r['block']} steps"
  if r["stack"] is None:
    n = e2e.param_count(cfg)
    case = f"llama-{e2e._size(n)} BT={r['bt']}"
    shape = (f"L{cfg.layers} d{cfg.d_model} h{cfg.heads}/kv{cfg.kv_heads} "
             f"ffn{cfg.ffn} V{cfg.vocab} B{r['bt'] // cfg.seq}x{cfg.seq} "
             f"{e2e.layout(cfg)}; {runs}")
    dtypes = (f"params={cfg.pdtype.name},m={cfg.mdtype.name},"
              f"v={cfg.pdtype.name},"
              + (f"activations={cfg.dtype}," if cfg.param_dtype else "")
              + "logits/loss=float32")
  else:
    layers, width, update = r["stack"]
    case = f"stack-{layers}x{width}^2 BT={r['bt']}"
    shape = (f"{layers} x {width}x{width} ScannedDenseStack (nn.scan), no "
             f"bias, ReLU, {r['bt']} tokens, stack_update={update}; {runs}")
    dtypes = "params=bfloat16,m=bfloat16,v=bfloat16,loss=float32"
  ms = lambda ts: tuple(t * 1e3 for t in common.quantiles(ts))
  for arm in r["arms"]:
    add = lambda metric, q, unit: res.add(case, arm, shape, dtypes, metric,
                                          q, unit)
    blocks = r["blocks"][arm]
    add("step_time", ms([t for b in blocks for t in b]), "ms")
    for i, b in enumerate(blocks):
      add(f"block_time_round{i}", ms(b), "ms")
    add("pipelined_step_time", ms(r["piped"][arm]), "ms")
    for i, t in enumerate(r["piped"][arm]):
      add(f"pipelined_time_round{i}", t * 1e3, "ms")
    add("compile_time", r["compile_s"][arm], "s")
    unit = "nats" if r["stack"] is None else "mean(y^2)"
    add("loss_first", r["losses"][arm][0], unit)
    add("loss_final", r["losses"][arm][-1], unit)
    if arm in r["ratios"]:
      ratios = r["ratios"][arm]
      add("ratio_to_optax", common.quantiles(ratios), "x")
      add("faster_rounds", float(sum(x < 1 for x in ratios)),
          f"of {len(ratios)}")
      piped = r["piped_ratios"][arm]
      add("pipelined_ratio_to_optax", common.quantiles(piped), "x")
      add("pipelined_faster_rounds", float(sum(x < 1 for x in piped)),
          f"of {len(piped)}")
  r["stamp"] = res.stamp


# --------------------------------------------------------------------------
# The driver (--processes N)


def _process_argv(args, index: int) -> list[str]:
  argv = [sys.executable, "-m", "benchmarks.e2e_paired", "--single",
          "--arms", *args.arms, "--bt", str(args.bt), "--rounds",
          str(args.rounds), "--block", str(args.block), "--warmup",
          str(args.warmup), "--seed", str(args.seed),
          # processes run in the repository: paths relative to the caller
          "--out", os.path.abspath(args.out),
          "--layers", str(args.layers), "--d-model", str(args.d_model),
          "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
          "--ffn", str(args.ffn), "--vocab", str(args.vocab), "--seq",
          str(args.seq), "--dtype", args.dtype, "--model", args.model,
          "--stack-layers", str(args.stack_layers), "--stack-width",
          str(args.stack_width), "--stack-update", args.stack_update]
  if args.attn_impl:
    argv += ["--attn-impl", args.attn_impl]
  if args.param_dtype:
    argv += ["--param-dtype", args.param_dtype]
  if args.mu_dtype:
    argv += ["--mu-dtype", args.mu_dtype]
  if args.scan:
    argv += ["--scan"]
  if args.hlo_dir:
    argv += ["--hlo-dir", os.path.join(os.path.abspath(args.hlo_dir),
                                       f"p{index}")]
  return argv


def run_subprocess(args, index: int, timeout: float):
  """One process of the measurement; returns ``(result or None, reason)``."""
  print(f"== process {index} (timeout {timeout:.0f} s)", flush=True)
  return e2e.run_tagged(_process_argv(args, index),
                        e2e._subprocess_env(args.autotune_cache), timeout,
                        f"process {index}", RESULT_TAG)


def first_loss_mismatches(r: dict) -> list[tuple[str, float, float]]:
  """``(arm, its first-step loss, relative difference)`` for every arm of one
  process whose first-step loss differs from optax's by more than
  ``e2e.FIRST_LOSS_RTOL``."""
  lo = r["losses"]["optax"][0]
  rels = {a: abs(r["losses"][a][0] - lo) / max(abs(lo), 1e-30)
          for a in r["arms"]}
  return [(a, r["losses"][a][0], rel) for a, rel in rels.items()
          if rel > e2e.FIRST_LOSS_RTOL]


def _decoder_name(r: dict) -> str:
  return "decoder (scanned)" if r.get("scan") else "decoder"


def summarize(results: list[dict]) -> bool:
  """Prints the pooled table; returns whether the first-step losses agree
  (every process, every FORGE arm against optax)."""
  arms = results[0]["arms"]
  stack = results[0].get("stack")
  model = (_decoder_name(results[0]) if not stack
           else f"stack {stack[0]}x{stack[1]}^2")
  print(f"\npaired, {model}, BT {results[0]['bt']}: {len(results)} process(es) x "
        f"{results[0]['rounds']} rounds x {results[0]['block']} steps per "
        "arm and way; ratios to optax per round")
  for way, times_key, ratio_key in (
      ("synced (every step blocked on; p50 of every step)", "blocks",
       "ratios"),
      ("pipelined (steps dispatched back to back; p50 over rounds of the "
       "time per step)", "piped", "piped_ratios")):
    print(f"\n{way}")
    print(f"{'arm':<10} {'p50 (ms)':>9} {'ratio p20 / p50 / p80':>24}"
          f" {'faster rounds':>14} {'per process p50 ratio':>22}")
    for arm in arms:
      ts = [t for r in results for b in r[times_key][arm]
            for t in (b if isinstance(b, list) else [b])]
      line = f"{arm:<10} {statistics.median(ts) * 1e3:9.2f}"
      if arm != "optax":
        ratios = [x for r in results for x in r[ratio_key][arm]]
        q = common.quantiles(ratios)
        per = ", ".join(f"{statistics.median(r[ratio_key][arm]):.3f}"
                        for r in results)
        faster = f"{sum(x < 1 for x in ratios)}/{len(ratios)}"
        line += (f" {q[0]:8.3f} / {q[1]:.3f} / {q[2]:.3f}"
                 f" {faster:>14} {per:>22}")
      print(line)
  ok = True
  for i, r in enumerate(results):
    lo = r["losses"]["optax"][0]
    for arm, lf, rel in first_loss_mismatches(r):
      ok = False
      print(f"process {i}: first-step loss {arm} {lf!r} vs optax {lo!r}: "
            f"rel diff {rel:.2e} > {e2e.FIRST_LOSS_RTOL:g} (MISMATCH)")
    for arm in arms:
      if not r["losses"][arm][-1] < r["losses"][arm][0]:
        print(f"process {i}: warning: {arm} loss did not fall "
              f"({r['losses'][arm][0]:.5f} -> {r['losses'][arm][-1]:.5f})")
  if ok:
    print(f"first-step losses agree within {e2e.FIRST_LOSS_RTOL:g} in every "
          "process")
  return ok


def plot(results: list[dict], png_path: str) -> None:
  """Block median per round (rounds of all processes in sequence) and each
  FORGE arm's per-round ratio to optax."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  arms = results[0]["arms"]
  colors = {"forge": "tab:orange", "forge-xla": "tab:blue", "optax": "gray"}
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
  for arm in arms:
    med = [statistics.median(b) * 1e3 for r in results
           for b in r["blocks"][arm]]
    a1.plot(range(len(med)), med, ".-", label=arm, color=colors[arm])
    if arm != "optax":
      rat = [x for r in results for x in r["ratios"][arm]]
      a2.plot(range(len(rat)), rat, ".-", label=f"{arm} / optax, synced",
              color=colors[arm])
      rat = [x for r in results for x in r["piped_ratios"][arm]]
      a2.plot(range(len(rat)), rat, "x--", label=f"{arm} / optax, pipelined",
              color=colors[arm])
  n = results[0]["rounds"]
  for ax in (a1, a2):
    for i in range(1, len(results)):
      ax.axvline(i * n - 0.5, color="k", lw=0.5, ls=":")
    ax.set_xlabel("round (processes in sequence, dotted lines between)")
    ax.legend(fontsize=8)
  a1.set_ylabel(f"synced block median step time (ms, {results[0]['block']} "
                "steps)")
  a2.axhline(1.0, color="k", lw=0.8)
  a2.set_ylabel("ratio to optax, same round")
  stack = results[0].get("stack")
  model = (_decoder_name(results[0]) if not stack else
           f"scanned stack {stack[0]} x {stack[1]}²")
  fig.suptitle(f"Paired step time, {model}, BT {results[0]['bt']}, on "
               f"{results[0]['device']}", fontsize=9)
  common.save_figure(fig, png_path)


def parse_args(argv):
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=common.DefaultsFormatter)
  p.add_argument("--arms", nargs="+", default=list(e2e.ARMS),
                 choices=e2e.ARMS, help="must include optax and one FORGE arm")
  p.add_argument("--bt", type=common.positive_int, default=512,
                 help="tokens per step (a multiple of --seq)")
  p.add_argument("--model", choices=("decoder", "stack"), default="decoder",
                 help="decoder: e2e.py's Llama-style decoder (its options "
                 "below); stack: scan_memory.py's scanned stack of "
                 "--stack-layers bf16 --stack-width^2 kernels (ReLU, no "
                 "bias), --bt tokens, where nn.scan + optax keeps the whole "
                 "gradient pool")
  p.add_argument("--stack-layers", type=common.positive_int, default=16)
  p.add_argument("--stack-width", type=common.positive_int, default=4096)
  p.add_argument("--stack-update", choices=("auto", "layer", "slice"),
                 default="auto",
                 help="the FORGE arms' ScannedDenseStack stack_update (auto: "
                 "layer on a GPU, slice in interpret mode)")
  e2e.add_model_args(p)
  p.add_argument("--rounds", type=common.positive_int, default=12)
  p.add_argument("--block", type=common.positive_int, default=10,
                 help="timed steps per arm per round")
  p.add_argument("--warmup", type=common.positive_int, default=5,
                 help="steps per arm before the first round")
  p.add_argument("--processes", type=common.positive_int, default=1,
                 help="fresh processes (and compiles) whose rounds are "
                 "pooled; each is a subprocess under --timeout")
  p.add_argument("--timeout", type=e2e._seconds(True), default=300.0,
                 help="seconds per process")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=paths.out_file,
                 default="out/bench/e2e_paired.csv")
  p.add_argument("--plot", type=paths.out_file, default=None, metavar="PNG")
  p.add_argument("--hlo-dir", type=paths.out_dir, default=None, metavar="DIR",
                 help="write each arm's compiled (scheduled) HLO text there "
                 "(DIR/p<i>/<arm>.hlo.txt per process)")
  p.add_argument("--autotune-cache", type=paths.out_dir, metavar="DIR",
                 default=None,
                 help="as e2e.py's: XLA's per-fusion GEMM autotune cache, "
                 "shared by every process")
  p.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if "optax" not in args.arms or not set(args.arms) & set(e2e.WGRAD):
    p.error("--arms must include optax and at least one FORGE arm")
  if len(set(args.arms)) != len(args.arms):
    p.error("--arms names an arm twice")
  if args.model == "decoder" and args.bt % args.seq:
    p.error(f"--bt {args.bt} is not a multiple of --seq {args.seq}")
  try:
    e2e.config_of(args)
    e2e._subprocess_env(args.autotune_cache)
  except ValueError as err:
    p.error(str(err))
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  cfg = e2e.config_of(args)
  if args.single:
    stack = ((args.stack_layers, args.stack_width, args.stack_update)
             if args.model == "stack" else None)
    r = run_process(args.arms, args.bt, cfg, args.rounds, args.block,
                    args.warmup, args.seed, args.out, args.hlo_dir, stack)
    print(RESULT_TAG + json.dumps(r), flush=True)
    bad = [a for a, _, _ in first_loss_mismatches(r)]
    if bad:  # the driver reports it too, from the result above
      print(f"first-step loss of {bad} differs from optax's "
            f"{r['losses']['optax'][0]!r} by more than "
            f"{e2e.FIRST_LOSS_RTOL:g} (relative)", file=sys.stderr)
    return 1 if bad else 0
  model = (("the scanned decoder" if args.scan else "the decoder")
           if args.model == "decoder" else
           f"the scanned stack ({args.stack_layers} x {args.stack_width}^2)")
  print(f"paired e2e, {model}: arms {args.arms}, BT {args.bt}, {args.processes} "
        f"process(es) x {args.rounds} rounds x {args.block} steps (after "
        f"{args.warmup} warm-up steps per arm); CSV {args.out}", flush=True)
  results, failed = [], []
  for i in range(args.processes):
    r, reason = run_subprocess(args, i, args.timeout)
    if r is None:
      failed.append(reason)
      print(f"   FAILED process {i}: {reason}", flush=True)
    else:
      results.append(r)
  ok = bool(results) and summarize(results)
  if args.plot and results:
    plot(results, args.plot)
  for reason in failed:
    print(f"failed process: {reason}")
  return 0 if ok and not failed else 1


if __name__ == "__main__":
  sys.exit(main())
