r"""The fused AdamW step on each kernel backend against XLA's GEMM + AdamW.

    ./dev.sh python -m benchmarks.backends --out out/bench/backends.csv

One layer at the Llama-3.1-8B projection shapes (``--shapes``: others):
XLA's ``dot(x.T, dy)``
followed by the rule applied elementwise, the Triton kernel
(``backend="triton"``, its tuned tiling) and the Mosaic GPU kernel
(``backend="mosaic_gpu"``, each ``--mosaic`` tiling), side by side in one
process, bf16 ``x``, ``dy``, ``W`` (``--weights fp32``: an fp32 ``W``, as
in mixed precision with fp32 parameters) and bf16, fp32 or int8 moments (int8:
codes with one fp32 scale per 64-element block, ``forge_jax.adamw(...,
moments="int8")``'s state; XLA's arm is then the GEMM followed by
``pallas_kernels.lowp.apply``, the dequantize-update-requantize reference;
the Mosaic GPU kernel takes them in its streamed epilogue with sub-tiles 64
columns wide, ``eMx64``), or ``mu-bf16`` moments (``m`` bf16 and ``v`` in
``W``'s dtype: ``optax.adamw(..., mu_dtype=jnp.bfloat16)``'s state over
fp32 parameters). ``--rules`` alone adds SGD (``W`` alone) and SGD with
momentum (``W`` and one slot) beside AdamW (``W`` and two; ``--rules sgd``
names some): what each
streamed state array costs. Each arm's result is compared with XLA's before
it is timed (``W`` and the slots, int8 ones dequantized, within bf16
rounding: 2 % relative to the largest element; and ``W``'s update, ``W``
after the step minus before, within 2 % of the reference's in norm with
an fp32 ``W``, 10 % with a bf16 one: ``check_result``): an arm off by more
is not timed (its error rows alone are written) and makes the command
exit 1. Needs a Hopper GPU.

``--plot PNG`` draws the CSV: per case (AdamW at the Llama-3.1-8B shapes,
each BT, bf16 and fp32 moments; with an fp32 W, fp32 and ``mu-bf16``
moments), the latest run that measured it, XLA's
time divided by the Triton kernel's and by the fastest Mosaic GPU tiling's
(of those with the reference's arithmetic: no ``,ax``).
``--replot --out CSV --plot PNG`` draws an existing CSV without measuring
(no GPU needed); ``--table --out CSV`` prints the same ratios as Markdown
tables, with the commit of each case's run (the tables of
docs/benchmarks.md's kernel section).

``--auto`` adds the arm a call without ``backend`` or ``config`` takes
(``backend=None``: the autotune cache's entry for the case, else its
nearest entry's tiling, else the Triton kernel), named by that choice:
``forge_auto_mosaic_<label>`` or ``forge_auto_triton``. With ``--mosaic``
and no tilings, the Mosaic GPU kernel runs in that arm alone: what a user
gets at shapes the cache was not measured at.

``--kernels`` also traces each arm (``jax.profiler``: 20 steps of the same
donated loop) and writes its GPU kernels' time per step (``kernel_time``,
µs: the step without the loop's launch gaps) and their number
(``kernels``), printing the three largest by name: the fused step's own
kernel beside XLA's GEMM and AdamW fusion.

``--once`` runs each arm of each case exactly once, untimed and unchecked,
writing nothing: for a profiler. Nsight Compute on one tiling's kernel
(the Mosaic GPU kernels are named ``anonymous_mosaic_gpu_kernel``)::

    ncu -k regex:mosaic_gpu --set full --import-source no \
        ./dev.sh python -m benchmarks.backends --once --tokens 512 \
        --moments bf16 --shapes "q/o 4096x4096" --mosaic LABEL

(add ``--page source --print-source sass --csv`` for the stall samples of
each instruction).
"""

import argparse
import math
import os
import sys
import warnings

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks import common, paths
from pallas_kernels import lowp, quant

RULE = pk.ADAMW
# Timing only: plausible AdamW hyperparameters.
HPARAMS = RULE.pack(lr=1e-4, b1=0.9, b2=0.999, one_minus_b1=0.1,
                    one_minus_b2=0.001, eps=1e-8, eps_root=0.0,
                    weight_decay=1e-2, bc1=0.1, bc2=0.001, bc1_next=0.19)
# --rules: AdamW (the default), and the rules that stream fewer state
# arrays (SGD: W alone; SGD with momentum: W and one slot), which show what
# each state array costs the fused step.
RULES = ("adamw", "sgd_momentum", "sgd")
# tile_m x tile_n x tile_k / pipeline steps, then knobs.
# The default tilings (mosaic_kernel.default_config: the ping-pong
# schedule) up to 1024 tokens and beyond.
MOSAIC_DEFAULT = ("128x128x64/4,e64x32,pp",
                  "128x128x64/4,e64x32,s8,pn,pp,nb")


def parse_mosaic(label: str) -> pk.MosaicConfig:
  """``MxNxK/STEPS`` with optional ``,wgW`` (compute warpgroups), ``,dD``
  (delay_release), ``,eMxN`` (epilogue sub-tile), ``,bB`` (state
  buffers), ``,rR`` (a ring of R streamed state sub-tiles) and ``,sS``
  (tile order: snaking bands S tile columns wide) knobs, ``,pn``
  (prefetch the next tile's state), ``,pp`` (the ping-pong schedule) and
  ``,lp`` (the epilogue looped over its sub-tiles):
  :meth:`MosaicConfig.from_label`, as an argparse type."""
  try:
    return pk.MosaicConfig.from_label(label)
  except ValueError as e:
    raise argparse.ArgumentTypeError(
        f"--mosaic {label!r}: expected {pk.MosaicConfig.LABEL_FORM}, "
        f"e.g. 128x128x64/3 or 128x128x64/4,e64x32,s8,pp ({e})")


def _rule(name: str):
  """The rule ``--rules`` names and its (timing-only) hyperparameters."""
  if name == "adamw":
    return RULE, HPARAMS
  from pallas_kernels import autotune  # noqa: PLC0415
  rule = autotune.RULES[name]
  return rule, autotune._tuning_hparams(rule)  # noqa: SLF001


INT8 = quant.MomentFormat("int8")


WEIGHTS = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def _state(bt, n_in, n_out, moments, rule=RULE, weights="bf16"):
  """x, dy (bf16), W (``weights``: "bf16" or "fp32") and the rule's slots:
  ``moments`` "bf16", "fp32", "int8" (``quant.quantize``'d, the
  second-moment slots as such) or "mu-bf16" (the slot ``mu`` bf16, the
  others in W's dtype, as optax's ``mu_dtype``)."""
  k = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(k[0], (bt, n_in), jnp.bfloat16)
  dy = jax.random.normal(k[1], (bt, n_out), jnp.bfloat16)
  w = jax.random.normal(k[2], (n_in, n_out), WEIGHTS[weights])
  mu = 0.1 * jax.random.normal(k[3], (n_in, n_out))
  nu = 0.1 * jax.random.uniform(k[4], (n_in, n_out))
  slots = []
  for name, v in zip(rule.slots, (mu, nu)):
    if moments == "int8":
      slots.append(quant.quantize(
          v, INT8, second_moment=name in rule.second_moments))
    elif moments == "mu-bf16":
      slots.append(v.astype(jnp.bfloat16 if name == "mu"
                            else WEIGHTS[weights]))
    else:
      slots.append(v.astype(jnp.bfloat16 if moments == "bf16"
                            else jnp.float32))
  return x, dy, w, tuple(slots)


_MOMENTS = {("bfloat16", "bfloat16"): "bf16", ("float32", "float32"): "fp32",
            ("bfloat16", "float32"): "m bf16 v fp32"}


def _moments_label(dtypes: str) -> str | None:
  """The moments of a ``backends`` row's ``dtypes`` (as
  ``pallas_kernels.autotune`` reads them) as :func:`latest_ratios` keys
  them: ``"bf16"``, ``"fp32"``, ``"m bf16 v fp32"`` (``mu-bf16``), each with
  ``", W fp32"`` for an fp32 weight; ``None`` for others (int8 moments,
  other rules' slot counts)."""
  from pallas_kernels import autotune  # noqa: PLC0415
  try:
    _, w, slots = autotune._backends_dtypes(dtypes)  # noqa: SLF001
  except ValueError:
    return None
  moments = _MOMENTS.get(slots)
  if moments is None:
    return None
  return moments + (", W fp32" if w == "float32" else "")


def _dtypes_field(moments: str, weights: str, n_slots: int) -> str:
  """A row's ``dtypes``: ``"x,dy,W bf16; m,v fp32"``, ``"x,dy bf16; W fp32;
  m bf16; v fp32"`` (``mu-bf16``), ``"...; 1 slot(s) fp32"`` (a rule's
  slots by number)."""
  operands = ("x,dy,W bf16" if weights == "bf16" else
              f"x,dy bf16; W {weights}")
  if moments == "mu-bf16":
    return f"{operands}; m bf16; v {weights}"
  if n_slots == 2:
    return f"{operands}; m,v {moments}"
  return f"{operands}; {n_slots} slot(s) {moments}"


def _floats(slots):
  """The slots as float arrays (int8 ones dequantized)."""
  return [quant.dequantize(a, INT8) if isinstance(a, quant.Quantized) else a
          for a in slots]


def _arms(mosaic_cfgs, rule=RULE, hparams=HPARAMS, auto=None):
  def xla(s):
    x, dy, w, slots = s
    g = jnp.dot(x.T, dy, preferred_element_type=jnp.float32)
    if any(isinstance(a, quant.Quantized) for a in slots):
      plan, _ = lowp.plan_state(slots, rule, w, where="benchmarks.backends")
      w, slots = lowp.apply(rule, plan, g, w, slots, hparams)
    else:
      w, slots = rule.apply(g, w, slots, hparams)
    return x, dy, w, slots

  def fused(backend, cfg=None):
    def step(s):
      x, dy, w, slots = s
      w, slots = pk.fused_wgrad_update(x, dy, w, slots, hparams, rule=rule,
                                       backend=backend, config=cfg)
      return x, dy, w, slots
    return step

  arms = {"xla_unfused": xla, "forge_triton": fused("triton")}
  for label, cfg in mosaic_cfgs:
    arms[f"forge_mosaic_{label}"] = fused("mosaic_gpu", cfg)
  if auto is not None:
    arms[auto] = fused(None)
  return arms


def auto_arm(state, rule=RULE) -> str:
  """``--auto``'s arm for a case (``state``: its arrays, or their shapes
  and dtypes): ``fused_wgrad_update`` with ``backend=None``, named by what
  it takes there (``forge_auto_triton``, ``forge_auto_mosaic_<label>``)."""
  x, dy, w, slots = state
  choice = pk.describe_backend(x, dy, w, slots, rule=rule)
  if choice.backend == "triton":
    return "forge_auto_triton"
  return f"forge_auto_mosaic_{choice.config.label}"


def _traced_kernels(step, state, n_steps: int = 20):
  """:func:`common.per_step_kernels` of ``n_steps`` steps of ``step`` in the timed
  loop's form (one jitted, donated ``fori_loop``, compiled and run once
  before the traced call)."""
  loop = jax.jit(lambda s: jax.lax.fori_loop(0, n_steps,
                                             lambda i, s: step(s), s),
                 donate_argnums=0)
  state = jax.block_until_ready(loop(state))
  _, gpu, _ = common.traced(lambda: jax.block_until_ready(loop(state)))
  return common.per_step_kernels(gpu, n_steps)


def _max_rel_err(got, ref):
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


# An arm's result against XLA's: W and the slots (int8 ones dequantized)
# within bf16 rounding of the reference's, relative to their largest
# element. This alone cannot see W's update, which at the timing
# hyperparameters (lr 1e-4) is about 1e-4 of W's largest element with AdamW
# and 1e-3 with SGD: an arm that left W as it was would pass.
MAX_REL_ERR = 2e-2
# So W's update too: ``W after - W before`` against the reference's, in
# norm, relative to the norm of the reference's update. An fp32 W's update
# differs from the reference's by fp32 rounding alone; a bf16 W rounds its
# update to whole units in the last place, and where W + update lands near
# a rounding tie the two sides' fp32 rounding (a few units of fp32's last
# place) can round it either way: a whole bf16 unit, which puts about 1 % on
# the ratio. A skipped update makes it 1, a halved or doubled one 0.5 and 1
# (with a bf16 W more: its rounding moves with the update).
UPDATE_RTOL = {"float32": 2e-2, "bfloat16": 0.1}


def update_rel_err(before, got, ref) -> float:
  """``||got - ref|| / ||ref - before||``: how far an arm's step of an array
  from ``before`` (``got``) lands from the reference's (``ref``), relative
  to the reference's update (0 where both left it as it was, inf where the
  reference left it and the arm did not)."""
  before, got, ref = (np.asarray(a, np.float64) for a in (before, got, ref))
  off, step = np.linalg.norm(got - ref), np.linalg.norm(ref - before)
  if step == 0:
    return 0.0 if off == 0 else math.inf
  return float(off / step)


def check_result(before, out, ref):
  """An arm's state ``out`` (``(x, dy, W, slots)``, one step from
  ``before``) against the reference's ``ref``: ``(err, update_err, ok)``
  with ``err`` the largest :func:`_max_rel_err` of W and the slots,
  ``update_err`` W's :func:`update_rel_err`, ``ok`` whether they are within
  :data:`MAX_REL_ERR` and W's dtype's :data:`UPDATE_RTOL`."""
  err = max(_max_rel_err(a, b) for a, b in
            zip((out[2], *_floats(out[3])), (ref[2], *_floats(ref[3]))))
  update_err = update_rel_err(before[2], out[2], ref[2])
  tol = UPDATE_RTOL[jnp.dtype(before[2].dtype).name]
  return err, update_err, err <= MAX_REL_ERR and update_err <= tol


# The arms that time a Mosaic GPU tiling (named by its label); the autotuner
# reads them from the CSV (pallas_kernels.autotune.mosaic_winners_from_csv).
MOSAIC_ARMS = ("forge_mosaic_", "forge_auto_mosaic_")


def _cases(shapes: dict) -> set[str]:
  """The ``INxOUT`` case names of a ``{name: (in, out)}`` shape table."""
  return {f"{n_in}x{n_out}" for n_in, n_out in shapes.values()}


def _all_latest_runs(rows):
  """:func:`latest_runs` of every AdamW case, whatever its shape: one pass
  over ``rows`` (which may be a one-shot iterator)."""
  runs = {}
  for r in rows:
    bt, _, shape = r["shape"].partition(" ")
    if (r["benchmark"] != "backends" or r["case"] != "adamw"
        or r["metric"] != "time"):
      continue
    moments = _moments_label(r["dtypes"])
    if moments is None:
      continue
    key = (moments, int(bt[3:]), shape)
    run = runs.setdefault(key, {}).setdefault(r["timestamp"],
                                              (r["commit"], {}))
    run[1][r["provider"]] = float(r["p50"])
  return {key: by_run[max(by_run)] for key, by_run in runs.items()}


def _select(runs: dict, beyond: bool = False, shapes: set | None = None):
  """The cases of :func:`_all_latest_runs`' ``runs`` that
  :func:`latest_runs` keeps for ``beyond`` and ``shapes``."""
  if shapes is None:
    llama = _cases(common.LLAMA8B_SHAPES)
    # (beyond: the decoder's shapes have their own table, _grid's)
    others = llama | _cases(common.DECODER_SHAPES)
    keep = (lambda shape: shape not in others) if beyond else (
        lambda shape: shape in llama)
  else:
    keep = lambda shape: shape in shapes
  return {key: run for key, run in runs.items() if keep(key[2])}


def latest_runs(rows, beyond: bool = False, shapes: set | None = None):
  """Per AdamW case (as :func:`latest_ratios` keys them), the commit of the
  latest run (timestamp) that timed it and that run's p50 per arm:
  ``{(moments, bt, shape): (commit, {provider: p50 in µs})}``. The cases
  at the Llama-3.1-8B shapes, or (``beyond``) at the others but the
  decoder's (its own table), or at ``shapes`` (``INxOUT`` names) if
  given."""
  return _select(_all_latest_runs(rows), beyond, shapes)


def _ratios(runs: dict, beyond: bool = False, shapes: set | None = None):
  """:func:`latest_ratios` of :func:`latest_runs`' ``runs`` (selected for
  the same ``beyond`` and ``shapes``)."""
  out = {}
  for key, (_, arms) in runs.items():
    if "xla_unfused" not in arms or shapes is None and beyond and not any(
        a.startswith("forge_auto_") for a in arms):
      continue
    xla = arms["xla_unfused"]
    mosaic = {}
    for a, t in arms.items():
      label = next((a[len(p):] for p in MOSAIC_ARMS if a.startswith(p)),
                   None)
      if label is not None and not parse_mosaic(label).approx_math:
        mosaic[label] = min(t, mosaic.get(label, t))
    best = min(mosaic, key=mosaic.get) if mosaic else None
    out[key] = (xla / arms["forge_triton"] if "forge_triton" in arms
                else None, xla / mosaic[best] if best else None, best)
  return out


def latest_ratios(rows, beyond: bool = False, shapes: set | None = None):
  """Per AdamW case at a Llama-3.1-8B shape with bf16 or fp32 moments
  (``beyond``: at any other shape but the decoder's, in runs with
  ``--auto``'s arm), ``{(moments, bt, shape): (triton, mosaic, label)}``
  from the latest run
  (timestamp) that timed it: XLA's p50 over the Triton kernel's and over
  the fastest Mosaic GPU tiling's (``label``; ``--auto``'s arm counts as
  its tiling; not counting ``approx_math`` ones) in that run (``None``
  where the run lacks the arm). ``moments`` is ``"bf16"``, ``"fp32"`` or
  ``"m bf16 v fp32"`` (``--moments mu-bf16``), with ``", W fp32"`` for an
  fp32 weight (``--weights fp32``). (int8
  moments' XLA arm is the quantized reference, not XLA's AdamW: left
  out.) ``shapes``: the cases at these ``INxOUT`` shapes instead, in any
  run."""
  return _ratios(latest_runs(rows, beyond, shapes), beyond, shapes)


def _ratio(r: float | None) -> str:
  return "—" if r is None else f"{r:.2f}×"


def _grid(runs: dict, shapes: dict) -> list[str]:
  """:func:`latest_ratios` at ``shapes`` (``{name: (in, out)}``) of
  :func:`_all_latest_runs`' ``runs`` as Markdown lines: one per moments
  and BT, a column per shape."""
  runs = _select(runs, shapes=_cases(shapes))
  ratios = _ratios(runs, shapes=_cases(shapes))
  if not ratios:
    return []
  commits = {k: c for k, (c, _) in runs.items()}
  names = {f"{n_in}x{n_out}": name.split()[-2] for name, (n_in, n_out) in
           shapes.items()}
  out = ["| moments | BT | " + " | ".join(
      f"{s.replace('x', ' × ')} ({n})" for s, n in names.items())
         + " | commit |",
         "|---|---|" + "---|" * len(names) + "---|"]
  for moments, bt in sorted({k[:2] for k in ratios}):
    cells = []
    for s in names:
      r = ratios.get((moments, bt, s))
      cells.append("" if r is None else
                   f"{f'**{_ratio(r[1])}**' if r[2] else '—'} "
                   f"({_ratio(r[0])})")
    runs = sorted({commits[k] for k in ratios if k[:2] == (moments, bt)})
    out.append(f"| {moments} | {bt} | " + " | ".join(cells) + " | "
               + ", ".join(f"`{c}`" for c in runs) + " |")
  return out


def table(rows) -> str:
  """:func:`latest_ratios` of ``rows`` as Markdown tables, each line naming
  the commits of its runs: at the Llama-3.1-8B shapes and at the 0.886 B
  decoder's (one line per moments and BT: the fastest Mosaic GPU tiling's
  speed against XLA's GEMM + AdamW, XLA's time over its time, with the
  Triton kernel's in parentheses), then at the other shapes that runs
  with ``--auto`` timed (one line per case, the tiling ``backend=None``
  took). Empty if ``rows`` have no such case. Reads ``rows`` once (they
  may be a one-shot iterator)."""
  runs = _all_latest_runs(rows)
  tables = [_grid(runs, common.LLAMA8B_SHAPES),
            _grid(runs, common.DECODER_SHAPES)]
  beyond = _select(runs, beyond=True)
  other = _ratios(beyond, beyond=True)
  if other:
    commits = {k: c for k, (c, _) in beyond.items()}
    lines = ["| in × out | BT | moments | Mosaic GPU, speed vs XLA "
             "| its tiling | Triton, speed vs XLA | commit |",
             "|---|---|---|---|---|---|---|"]
    area = lambda s: math.prod(map(int, s.split("x")))
    for key in sorted(other, key=lambda k: (k[0], k[1], area(k[2]), k[2])):
      triton, mosaic, label = other[key]
      moments, bt, s = key
      lines.append(f"| {s.replace('x', ' × ')} | {bt} | {moments} | "
                   + (f"**{_ratio(mosaic)}** | `{label}`" if label
                      else "— | —")
                   + f" | {_ratio(triton)} | `{commits[key]}` |")
    tables.append(lines)
  return "\n\n".join("\n".join(t) for t in tables if t)


def _tick(moments: str) -> str:
  """A :func:`latest_ratios` moments key as a tick label, one dtype a line."""
  return moments.replace(", ", "\n").replace(" v ", "\nv ")


def plot(csv_path: str, png_path: str) -> bool:
  """Draws :func:`latest_ratios` of ``csv_path`` to ``png_path``: the
  Llama-3.1-8B shapes, and below them (where the CSV has any) the other
  shapes; False (nothing drawn) if the CSV has no such case."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  runs = _all_latest_runs(common.read_rows(csv_path))
  panels = [(r, b) for b in (False, True)
            if (r := _ratios(_select(runs, beyond=b), beyond=b))]
  if not panels:
    return False
  # The shapes by name (q/o, k/v, up/gate, down), in that order.
  names = {f"{n_in}x{n_out}": (i, name.split()[0]) for i, (name, (
      n_in, n_out)) in enumerate(common.LLAMA8B_SHAPES.items())}
  width = max(8, 0.55 * max(len(r) for r, _ in panels))
  fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                           figsize=(width, 4.5 * len(panels)))
  for ax, (ratios, beyond) in zip(axes[:, 0], panels):
    if beyond:
      area = lambda s: math.prod(map(int, s.split("x")))
      keys = sorted(ratios, key=lambda k: (k[0], k[1], area(k[2]), k[2]))
      ticks = [f"{s}\n{bt}\n{_tick(m)}" for m, bt, s in keys]
    else:
      keys = sorted(ratios, key=lambda k: (k[0], k[1], names[k[2]][0]))
      ticks = [f"{names[s][1]}\n{bt}\n{_tick(m)}" for m, bt, s in keys]
    xs = range(len(keys))
    mosaic_name = ("Mosaic GPU kernel, the tiling backend=None takes"
                   if beyond else "Mosaic GPU kernel, fastest tiling")
    for i, (arm, name) in enumerate([(0, "Triton kernel"),
                                     (1, mosaic_name)]):
      ax.bar([x + (i - 0.5) * 0.4 for x in xs],
             [ratios[k][arm] or 0.0 for k in keys], 0.4, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(ticks, fontsize=7)
    ax.set_xlabel("weight in x out, BT, moments" if beyond else
                  "Llama-3.1-8B projection, BT, moments")
    ax.set_ylabel("XLA GEMM + AdamW time / fused step time")
    ax.set_title(
        "Other shapes, as backend=None takes them (--auto): the cache's "
        "entry for the case, else its nearest entry's tiling" if beyond else
        "One layer's fused AdamW step against XLA (higher is faster; the "
        "latest run per case)", fontsize=9)
    ax.legend(fontsize=8)
  common.save_figure(fig, png_path)
  return True


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", type=paths.out_file, default="out/bench/backends.csv")
  p.add_argument("--plot", type=paths.out_file,
                 metavar="PNG", help="also draw the CSV here")
  p.add_argument("--replot", action="store_true",
                 help="draw --out to --plot without measuring")
  p.add_argument("--table", action="store_true",
                 help="print --out's latest ratios per case as Markdown, "
                 "without measuring")
  p.add_argument("--kernels", action="store_true",
                 help="also trace each arm: its GPU kernels' time per step")
  p.add_argument("--once", action="store_true",
                 help="run each arm once, untimed, writing nothing (for a "
                 "profiler)")
  p.add_argument("--tokens", type=common.positive_int, nargs="+",
                 default=[512, 2048, 4096])
  p.add_argument("--shapes", nargs="+", default=list(common.LLAMA8B_SHAPES),
                 help="Llama-3.1-8B shape names (the default), 'decoder' for "
                 "the 0.886 B decoder's four, or any 'NAME NxM'")
  p.add_argument("--moments", nargs="+", default=["bf16", "fp32"],
                 choices=["bf16", "fp32", "int8", "mu-bf16"],
                 help="the slots' dtypes; mu-bf16: AdamW's m in bf16 and v "
                 "in W's dtype (optax's mu_dtype=bfloat16)")
  p.add_argument("--weights", default="bf16", choices=sorted(WEIGHTS),
                 help="W's dtype (x and dy are bf16)")
  p.add_argument("--rules", nargs="*", default=["adamw"], choices=RULES,
                 help="the update rules timed (default AdamW; --rules "
                 "alone: all three, SGD and SGD with momentum beside "
                 "AdamW)")
  p.add_argument("--auto", action="store_true",
                 help="also time backend=None (the backend and tiling a "
                 "call without them takes), named by its choice")
  p.add_argument("--mosaic", nargs="*", default=list(MOSAIC_DEFAULT),
                 help="Mosaic GPU tilings (none: no tiling of its own), "
                 f"{pk.MosaicConfig.LABEL_FORM}")
  args = p.parse_args(argv)
  if not args.rules:  # --rules alone: every rule
    args.rules = list(RULES)
  if args.table:
    if not os.path.exists(args.out):
      p.error(f"--table: no CSV at {args.out}")
    text = table(common.read_rows(args.out))
    if not text:
      print(f"--table: {args.out} has no AdamW rows at the Llama-3.1-8B "
            "or the decoder's shapes, nor from --auto runs", file=sys.stderr)
      return 1
    print(text)
    if not args.replot:
      return 0
  if args.replot:
    if not args.plot:
      p.error("--replot needs --plot PNG")
    if not os.path.exists(args.out):
      p.error(f"--replot: no CSV at {args.out}")
    if not plot(args.out, args.plot):
      print(f"--replot: {args.out} has no AdamW rows at the Llama-3.1-8B "
            "shapes; nothing plotted", file=sys.stderr)
      return 1
    return 0
  try:
    mosaic_cfgs = [(m, parse_mosaic(m)) for m in args.mosaic]
  except argparse.ArgumentTypeError as e:
    p.error(str(e))
  names = [n for s in args.shapes for n in (
      common.DECODER_SHAPES if s == "decoder" else [s])]
  try:
    shapes = {n: common.parse_shape(n) for n in names}
  except ValueError as e:
    p.error(str(e))
  if "mu-bf16" in args.moments:
    if args.weights == "bf16":
      p.error("--moments mu-bf16 with a bf16 W is --moments bf16; give "
              "--weights fp32")
    no_mu = [r for r in args.rules if "mu" not in _rule(r)[0].slots]
    if no_mu:
      p.error(f"--moments mu-bf16: rule(s) {', '.join(no_mu)} have no "
              "slot mu; it is AdamW's")
  if jax.default_backend() != "gpu":
    print("benchmarks.backends needs a GPU; nothing measured.",
          file=sys.stderr)
    return 1
  if args.once:
    return _run_once(args, mosaic_cfgs, shapes)
  res = common.Results(args.out, "backends")
  wrong = []
  for rule_name, moments in [(r, m) for r in args.rules
                             for m in args.moments]:
    rule, hparams = _rule(rule_name)
    dtypes = _dtypes_field(moments, args.weights, len(rule.slots))
    state = lambda bt, n_in, n_out, m=moments, r=rule: _state(
        bt, n_in, n_out, m, r, args.weights)
    for name, (n_in, n_out) in shapes.items():
      for bt in args.tokens:
        shape = f"BT={bt} {n_in}x{n_out}"
        arms = _arms(mosaic_cfgs, rule, hparams, auto_arm(jax.eval_shape(
            lambda: state(bt, n_in, n_out)), rule) if args.auto else None)
        before = state(bt, n_in, n_out)
        ref = jax.jit(arms["xla_unfused"])(state(bt, n_in, n_out))
        times = {}
        for arm, step in arms.items():
          try:
            out = jax.jit(step)(state(bt, n_in, n_out))
            err, update_err, ok = check_result(before, out, ref)
            if not ok:  # a wrong result is not timed (nor tabulated)
              wrong.append(f"{shape} {rule_name} {moments} {arm}: error "
                           f"{err:.2g}, W's update off by {update_err:.2g}")
              res.add(rule_name, arm, shape, dtypes, "max_rel_err_vs_xla",
                      err, "")
              res.add(rule_name, arm, shape, dtypes,
                      "update_rel_err_vs_xla", update_err, "")
              print(f"{shape} {rule_name} {moments} {arm}: WRONG, error "
                    f"{err:.2g}, W's update off by {update_err:.2g}; not "
                    "timed", flush=True)
              continue
            (q, _) = common.time_loop(step, state(bt, n_in, n_out))
          except ValueError as e:  # a tiling this case does not allow
            print(f"{shape} {rule_name} {moments} {arm}: skipped ({e})",
                  flush=True)
            continue
          times[arm] = q[1]
          res.add(rule_name, arm, shape, dtypes, "time",
                  tuple(t * 1e6 for t in q), "us")
          res.add(rule_name, arm, shape, dtypes, "max_rel_err_vs_xla", err,
                  "")
          res.add(rule_name, arm, shape, dtypes, "update_rel_err_vs_xla",
                  update_err, "")
          ratio = times["xla_unfused"] / q[1]
          if arm != "xla_unfused":
            res.add(rule_name, arm, shape, dtypes, "speedup_vs_xla", ratio,
                    "x")
          print(f"{shape:22s} {rule_name} {moments} {arm:28s} "
                f"{q[1]*1e6:8.1f} us {ratio:5.2f}x vs xla  err {err:.1e}, "
                f"update {update_err:.1e}",
                flush=True)
          if args.kernels:
            ks = _traced_kernels(step, state(bt, n_in, n_out))
            total = sum(k[2] for k in ks)
            res.add(rule_name, arm, shape, dtypes, "kernel_time", total, "us")
            res.add(rule_name, arm, shape, dtypes, "kernels",
                    sum(k[1] for k in ks), "")
            print(f"{'':22s} kernels {total:8.1f} us per step: " + ", ".join(
                f"{name[:40]} {c:.2g}x {t:.1f} us" for name, c, t in ks[:3]),
                flush=True)
  if args.plot:
    plot(args.out, args.plot)
  if wrong:
    print("WRONG RESULTS:\n  " + "\n  ".join(wrong), flush=True)
    return 1
  return 0


def _run_once(args, mosaic_cfgs, shapes) -> int:
  """``--once``: each arm of each case run once (compiled first; the
  compilation launches nothing)."""
  for rule_name, moments in [(r, m) for r in args.rules
                             for m in args.moments]:
    rule, hparams = _rule(rule_name)
    for arm, step in _arms(mosaic_cfgs, rule, hparams).items():
      for n_in, n_out in shapes.values():
        for bt in args.tokens:
          what = f"BT={bt} {n_in}x{n_out} {rule_name} {moments} {arm}"
          state = jax.block_until_ready(_state(bt, n_in, n_out, moments,
                                               rule, args.weights))
          try:
            f = jax.jit(step).lower(state).compile()
          except ValueError as e:  # a tiling this case does not allow
            print(f"{what}: skipped ({e})", flush=True)
            continue
          jax.block_until_ready(f(state))
          print(f"{what}: ran once", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
