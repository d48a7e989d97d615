"""benchmarks/e2e.py: the Llama-style decoder's two arms agree, and the driver
writes its CSV rows (one subprocess per cell; failures recorded)."""

import csv
import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from benchmarks import e2e
from tests.tolerances import assert_trees_close, tol

TINY = e2e.Config(layers=2, d_model=32, heads=4, kv_heads=2, ffn=48, vocab=61,
                  seq=8, dtype="float32")
TINY_FLAGS = ["--layers", "2", "--d-model", "32", "--heads", "4",
              "--kv-heads", "2", "--ffn", "48", "--vocab", "61", "--seq", "8"]
# The drivers' tests (a subprocess per cell or process, each compiling its
# arms): one block, the smallest decoder that runs every code path.
SMOKE = dataclasses.replace(TINY, layers=1)
SMOKE_FLAGS = ["--layers", "1", *TINY_FLAGS[2:]]
STEPS = 3
# A larger rate than the benchmark's, so that 3 steps move every parameter.
HPARAMS = dict(learning_rate=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


TINY_SCAN = dataclasses.replace(TINY, scan=True)


def _train(arm, variables, batch, cfg=TINY):
  step, tx = e2e.build_arm(arm, cfg, HPARAMS)
  step = jax.jit(step, donate_argnums=(0, 1))
  variables = jax.tree.map(jnp.array, variables)  # own buffers: donated
  opt_state = tx.init(variables["params"])
  losses = []
  for _ in range(STEPS):
    loss, variables, opt_state = step(variables, opt_state, batch)
    losses.append(float(loss))
  return losses, variables, opt_state


def _trained(cfg):
  with jax.default_matmul_precision("highest"):
    init = e2e.init_variables(cfg, seed=0)
    batch = e2e.make_batch(cfg, batch_size=2, seed=0)
    return init, {arm: _train(arm, init, batch, cfg) for arm in e2e.ARMS}


@pytest.fixture(scope="module")
def trained():
  return _trained(TINY)


@pytest.fixture(scope="module")
def trained_scanned():
  return _trained(TINY_SCAN)


def test_param_count_matches_the_tree():
  # The Decoder's tree, abstractly (init_variables builds the same tree:
  # test_init_builds_the_decoders_tree_with_flax_initialisers).
  n = sum(a.size for a in jax.tree.leaves(e2e.abstract_variables(TINY)))
  assert n == e2e.param_count(TINY)
  # The default config is the 0.5-1B Llama-style decoder.
  assert 0.5e9 <= e2e.param_count(e2e.Config()) <= 1e9


def test_init_builds_the_decoders_tree_with_flax_initialisers():
  """init_variables builds the tree piece by piece (one Block.init for all
  blocks): the Decoder's shapes and dtypes, a fresh draw per block, norms at
  one, kernels and the embedding at variance 1 / d_model (flax's defaults)."""
  cfg = dataclasses.replace(TINY, d_model=64, ffn=96)
  v = e2e.init_variables(cfg, seed=3)
  spec = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)
  assert spec(v) == spec(e2e.abstract_variables(cfg))
  p = v["params"]
  assert not jnp.array_equal(p["block_0"]["mlp"]["up"]["kernel"],
                             p["block_1"]["mlp"]["up"]["kernel"])
  assert jnp.all(p["block_1"]["attn_norm"]["scale"] == 1)
  assert jnp.all(p["final_norm"]["scale"] == 1)
  up = p["block_1"]["mlp"]["up"]["kernel"].astype(jnp.float32)
  assert abs(float(jnp.std(up)) * cfg.d_model ** 0.5 - 1) < 0.1
  emb = p["embed"]["embedding"].astype(jnp.float32)
  assert abs(float(jnp.std(emb)) * cfg.d_model ** 0.5 - 1) < 0.1
  # Every leaf drawn as Decoder.init draws it (the tree built at once).
  whole = jax.jit(e2e.Decoder(cfg, nn.Dense).init)(
      jax.random.key(3), jnp.zeros((1, cfg.seq), jnp.int32))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(v),
                          jax.tree.leaves(whole)):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    assert abs(float(jnp.std(a)) - float(jnp.std(b))) <= (
        0.1 * float(jnp.std(b)) + 1e-6), jax.tree_util.keystr(path)
    if "kernel" in jax.tree_util.keystr(path):  # truncated: a hard bound
      assert float(jnp.max(jnp.abs(a))) <= 1.01 * float(jnp.max(jnp.abs(b))), \
          jax.tree_util.keystr(path)
  # Same seed, same draw; another seed, another.
  again = e2e.init_variables(cfg, seed=3)["params"]["lm_head"]["kernel"]
  assert jnp.array_equal(again, p["lm_head"]["kernel"])
  other = e2e.init_variables(cfg, seed=4)["params"]["lm_head"]["kernel"]
  assert not jnp.array_equal(other, p["lm_head"]["kernel"])


def _arm_jaxpr(arm: str, cfg=TINY) -> str:
  """The text of one step's jaxpr for ``arm`` on the tiny decoder, traced
  on the variables' and state's shapes (nothing initialised or compiled)."""
  step, tx = e2e.build_arm(arm, cfg, HPARAMS)
  variables = e2e.abstract_variables(cfg)
  batch = e2e.make_batch(cfg, 2)
  return str(jax.make_jaxpr(step)(
      variables, jax.eval_shape(tx.init, variables["params"]), batch))


def test_forge_arm_runs_fused_kernels():
  # 7 projections per block + the head, each with its own fused backward.
  assert _arm_jaxpr("forge").count("pallas_call") >= 7 * TINY.layers + 1


def test_scanned_decoder_stacks_the_blocks_and_fuses_inside_the_loop():
  v = e2e.init_variables(TINY_SCAN)["params"]
  assert not any(k.startswith("block_") for k in v)
  up = v["blocks"]["block"]["mlp"]["up"]["kernel"]
  assert up.shape == (TINY.layers, TINY.d_model, TINY.ffn)
  assert not jnp.array_equal(up[0], up[1])  # a fresh draw per block
  # Decay on kernels and the embedding, not on the (stacked) norm scales.
  mask = e2e.decay_mask(v)
  assert mask["blocks"]["block"]["mlp"]["up"]["kernel"] is True
  assert mask["blocks"]["block"]["attn_norm"]["scale"] is False
  assert mask["embed"]["embedding"] is True
  # One loop body: 7 projections' fused kernels, + the head's.
  text = _arm_jaxpr("forge", TINY_SCAN)
  assert text.count("pallas_call") == 8, text.count("pallas_call")
  assert "pallas_call" not in _arm_jaxpr("forge-xla", TINY_SCAN)


def test_forge_xla_arm_runs_no_fused_kernel():
  assert "pallas_call" not in _arm_jaxpr("forge-xla")


@pytest.mark.parametrize("scanned", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("arm", ["forge", "forge-xla"])
def test_forge_equals_optax_after_three_steps(request, arm, scanned):
  init, runs = request.getfixturevalue(
      "trained_scanned" if scanned else "trained")
  (fl, fv, fs), (ol, ov, os_) = runs[arm], runs["optax"]
  assert fl[0] == ol[0]  # same init, same batch, same forward
  assert all(math.isfinite(l) for l in fl + ol) and fl[-1] < fl[0]
  fp32 = tol(jnp.float32)
  assert_trees_close(fv["params"], ov["params"], rtol=fp32, what="params")
  assert_trees_close(fs[0].mu, os_[0].mu, rtol=fp32, what="mu")
  assert_trees_close(fs[0].nu, os_[0].nu, rtol=fp32, what="nu")
  assert int(fs[0].count) == int(os_[0].count) == STEPS
  # Every kernel moved (the FORGE path updated them, not left them as init).
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fv["params"]),
                          jax.tree.leaves(init["params"])):
    assert not jnp.array_equal(a, b), jax.tree_util.keystr(path)


def test_both_arms_store_moments_in_the_param_dtype():
  for dtype in ("bfloat16", "float32"):
    cfg = dataclasses.replace(TINY, dtype=dtype)
    params = e2e.abstract_variables(cfg)["params"]
    for arm in e2e.ARMS:
      state = jax.eval_shape(e2e.make_tx(arm, cfg).init, params)
      for leaf in jax.tree.leaves((state[0].mu, state[0].nu)):
        assert leaf.dtype == jnp.dtype(dtype), (arm, dtype)


def test_mixed_precision_keeps_fp32_params_and_moments_and_trains():
  """--param-dtype float32 --dtype bfloat16: fp32 parameters and moments in
  every arm, bf16 activations; FORGE's update forms G from the bf16
  operands in fp32 where optax's gradient is the bf16 GEMM's rounded
  output, so the arms agree to bf16's tolerance, not fp32's."""
  cfg = dataclasses.replace(TINY, dtype="bfloat16", param_dtype="float32")
  params = e2e.abstract_variables(cfg)["params"]
  assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  logits = jax.eval_shape(e2e.Decoder(cfg).apply, {"params": params},
                          jnp.zeros((1, cfg.seq), jnp.int32))
  assert logits.dtype == jnp.bfloat16
  init, runs = _trained(cfg)
  (fl, fv, fs), (ol, ov, os_) = runs["forge"], runs["optax"]
  assert fl[0] == ol[0] and fl[-1] < fl[0] and ol[-1] < ol[0]
  for leaf in jax.tree.leaves((fv, fs[0].mu, fs[0].nu)):
    assert leaf.dtype == jnp.float32
  assert_trees_close(fv["params"], ov["params"], rtol=tol(jnp.bfloat16),
                     what="params")


def test_mu_dtype_keeps_m_alone_in_it():
  """--mu-dtype bfloat16 over fp32 parameters: m bf16, v fp32 in every arm
  (optax's mu_dtype), and the arms train alike to bf16's tolerance."""
  cfg = dataclasses.replace(TINY, dtype="bfloat16", param_dtype="float32",
                            mu_dtype="bfloat16")
  params = e2e.abstract_variables(cfg)["params"]
  for arm in e2e.ARMS:
    state = jax.eval_shape(e2e.make_tx(arm, cfg).init, params)
    assert {a.dtype for a in jax.tree.leaves(state[0].mu)} == {
        jnp.dtype(jnp.bfloat16)}, arm
    assert {a.dtype for a in jax.tree.leaves(state[0].nu)} == {
        jnp.dtype(jnp.float32)}, arm
  init, runs = _trained(cfg)
  (fl, fv, fs), (ol, ov, _) = runs["forge"], runs["optax"]
  assert fl[0] == ol[0] and fl[-1] < fl[0] and ol[-1] < ol[0]
  assert_trees_close(fv["params"], ov["params"], rtol=tol(jnp.bfloat16),
                     what="params")
  args = e2e.parse_args(["--mu-dtype", "bfloat16", "--param-dtype",
                         "float32"])
  assert e2e.config_of(args).mdtype == jnp.bfloat16
  argv = e2e._cell_argv(args, "forge", 512)  # noqa: SLF001
  assert argv[argv.index("--mu-dtype") + 1] == "bfloat16"


def _rows(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def test_driver_runs_a_cell_and_writes_rows(tmp_path, capsys):
  out = tmp_path / "e2e.csv"
  png = tmp_path / "e2e.png"
  # With --autotune-cache: XLA must accept the flag (it tunes on GPUs only).
  rc = e2e.main(["--arms", "forge", "--bt", "16", *SMOKE_FLAGS,
                 "--steps", "2", "--out", str(out), "--plot", str(png),
                 "--autotune-cache", str(tmp_path / "autotune")])
  text = capsys.readouterr().out
  assert rc == 0, text
  # The cell reports where its wall time went.
  assert re.search(r"phases \(s\) setup \d+\.\d, compile \d+\.\d, "
                   r"init \d+\.\d, steps \d+\.\d", text), text
  rows = _rows(out)
  metrics = {r["metric"] for r in rows}
  assert {"step_time", "temp_memory", "argument_memory", "output_memory",
          "alias_memory", "compile_time", "loss_first", "loss_final",
          "param_count"} <= metrics
  for r in rows:
    assert r["benchmark"] == "e2e" and r["provider"] == "forge"
    assert r["case"].endswith("BT=16") and "B2x8" in r["shape"]
    assert "m=bfloat16,v=bfloat16" in r["dtypes"]
    assert math.isfinite(float(r["p50"]))
  by = {r["metric"]: r for r in rows}
  assert float(by["step_time"]["p20"]) <= float(by["step_time"]["p50"]) \
      <= float(by["step_time"]["p80"])
  assert int(float(by["param_count"]["p50"])) == e2e.param_count(SMOKE)
  if jax.default_backend() == "cpu":
    assert "peak_memory" not in metrics  # no allocator statistics on CPU
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_autotune_cache_reaches_the_cells_xla_flags(monkeypatch, tmp_path):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  env = e2e._subprocess_env(str(tmp_path / "at"))
  assert env["XLA_FLAGS"] == (f"--xla_dump_to=/tmp/x {e2e.AUTOTUNE_CACHE_FLAG}"
                              f"={tmp_path / 'at'}")
  assert e2e._subprocess_env()["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
  monkeypatch.delenv("XLA_FLAGS")
  monkeypatch.chdir(tmp_path)
  assert e2e._subprocess_env("rel")["XLA_FLAGS"] == (
      f"{e2e.AUTOTUNE_CACHE_FLAG}={tmp_path / 'rel'}")  # made absolute
  assert "XLA_FLAGS" not in e2e._subprocess_env()
  monkeypatch.setenv("HOME", str(tmp_path))
  assert e2e._subprocess_env("~/at")["XLA_FLAGS"].endswith(
      f"={tmp_path / 'at'}")
  with pytest.raises(SystemExit):  # XLA_FLAGS would split the path
    e2e.parse_args(["--autotune-cache", str(tmp_path / "a b")])


def test_driver_records_a_timed_out_cell(tmp_path):
  out = tmp_path / "e2e.csv"
  rc = e2e.main(["--arms", "optax", "--bt", "16", *SMOKE_FLAGS,
                 "--cell-timeout", "0.5", "--budget", "100", "--out", str(out)])
  assert rc == 1
  (row,) = _rows(out)
  assert row["metric"] == "failed" and row["provider"] == "optax"
  assert row["unit"].startswith("timeout after")
  assert math.isnan(float(row["p50"]))


def test_repeat_alternates_rounds_and_reports_the_median_cell(
    tmp_path, monkeypatch, capsys):
  """--repeat 3: rounds of every arm, reversed every other round; the table
  shows each (arm, BT)'s median cell and lists every cell's p50; the plot
  draws those same cells, not older rows of the CSV."""
  from benchmarks import common
  times = {"forge-xla": iter([12.0, 10.0, 14.0]),
           "optax": iter([20.0, 30.0, 25.0])}
  order, plotted = [], []
  out, png = tmp_path / "e.csv", tmp_path / "e.png"
  case, shape = "llama-tiny BT=16", "L2 d32 B2x8 unrolled"

  def add_rows(arm, t, stamp):
    res = common.Results(str(out), "e2e")
    res.stamp = stamp
    res.add(case, arm, shape, "float32", "step_time", (t, t, t), "ms")
    res.add(case, arm, shape, "float32", "temp_memory", t / 10, "MiB")

  add_rows("forge-xla", 99.0, "2000-01-01T00:00:00+00:00")  # an older run

  def cell(args, arm, bt, timeout):
    order.append(arm)
    t = next(times[arm])
    stamp = f"2030-01-01T00:00:{len(order):02d}+00:00"
    add_rows(arm, t, stamp)
    return dict(arm=arm, bt=bt, step_ms=(t - 1, t, t + 1), peak_bytes=None,
                mem=dict(temp=2**20, argument=0, output=0, alias=0),
                losses=[2.0, 1.0], compile_s=0.1,
                params=e2e.param_count(TINY), device="cpu", backend="cpu",
                stamp=stamp), None

  real_plot = e2e.plot
  monkeypatch.setattr(e2e, "run_driver_cell", cell)
  monkeypatch.setattr(e2e, "plot", lambda csv_path, png_path, pick=None: (
      plotted.append(pick), real_plot(csv_path, png_path, pick)))
  rc = e2e.main(["--arms", "forge-xla", "optax", "--bt", "16", "--repeat",
                 "3", *TINY_FLAGS, "--out", str(out), "--plot", str(png)])
  text = capsys.readouterr().out
  assert rc == 0, text
  assert order == ["forge-xla", "optax", "optax", "forge-xla", "forge-xla",
                   "optax"]
  assert ("forge-xla step p50 per cell (ms, in run order): 12.00, 10.00, "
          "14.00") in text
  assert "optax step p50 per cell (ms, in run order): 20.00, 30.00, 25.00" \
      in text
  table = [l for l in text.splitlines() if "step p50 (ms)" in l]
  assert table and table[0].split()[-3:] == ["12.00", "25.00", "0.480"], table
  assert "6 cells ok, 0 failed" in text
  (pick,) = plotted
  bars = e2e.bar_rows(str(out), pick)
  assert float(bars[(16, "forge-xla", "step_time")]["p50"]) == 12.0
  assert float(bars[(16, "forge-xla", "temp_memory")]["p50"]) == 1.2
  assert float(bars[(16, "optax", "step_time")]["p50"]) == 25.0
  # --replot: every cell is of this checkout's commit (one run), so the
  # newest row of each key.
  newest = e2e.bar_rows(str(out))
  assert float(newest[(16, "forge-xla", "step_time")]["p50"]) == 14.0
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replot_draws_each_bts_bars_from_one_run(tmp_path, capsys):
  """--replot draws each BT's bars from one run (consecutive rows of one
  commit, device and versions; a failed cell's row, without a commit, does
  not end one): of the runs with the most of --arms at that BT, the newest,
  named under the BT. Newer runs with fewer arms do not lend their bars to
  an older run's group."""
  from benchmarks import common
  out, png = tmp_path / "e.csv", tmp_path / "e.png"
  res = common.Results(str(out), "e2e")
  n = [0]

  def cell(commit, bt, arm, t, metric="step_time"):
    n[0] += 1
    res.commit, res.stamp = commit, f"2030-01-01T00:{n[0]:02d}:00+00:00"
    shape = f"L2 d32 B{bt // 8}x8 unrolled"
    if metric == "failed":
      res.add(f"llama-tiny BT={bt}", arm, shape, "params=float32", "failed",
              math.nan, "timeout after 150 s")
      return
    res.add(f"llama-tiny BT={bt}", arm, shape, "float32", metric,
            (t, t, t), "ms")
    res.add(f"llama-tiny BT={bt}", arm, shape, "float32", "temp_memory",
            t / 10, "MiB")

  for arm, t in (("optax", 10.0), ("forge", 11.0), ("forge-xla", 12.0)):
    cell("aaa", 512, arm, t)
  for arm, t in (("optax", 20.0), ("forge", 21.0)):
    cell("aaa", 2048, arm, t)
  cell("bbb", 512, "optax", 13.0)
  cell("", 512, "forge-xla", 0.0, "failed")
  cell("bbb", 512, "forge", 14.0)
  cell("ccc", 512, "forge-xla", 15.0)  # a run of one arm
  cell("ddd", 2048, "forge", 25.0)

  def p50s(rows, bt):
    return {k[1]: float(r["p50"]) for k, r in rows.items()
            if k[0] == bt and k[2] == "step_time"}

  # Every arm: BT 512's three arms from the one run that has all three.
  rows = e2e.bar_rows(str(out))
  assert p50s(rows, 512) == {"optax": 10.0, "forge": 11.0, "forge-xla": 12.0}
  assert p50s(rows, 2048) == {"optax": 20.0, "forge": 21.0}
  assert float(rows[(512, "forge-xla", "temp_memory")]["p50"]) == 1.2
  assert e2e.bt_commits(rows) == {512: "aaa", 2048: "aaa"}
  # Two arms: the newest run that has both.
  rows = e2e.bar_rows(str(out), arms=("optax", "forge"))
  assert p50s(rows, 512) == {"optax": 13.0, "forge": 14.0}
  assert e2e.bt_commits(rows) == {512: "bbb", 2048: "aaa"}
  # One arm: its newest run.
  rows = e2e.bar_rows(str(out), arms=("forge-xla",))
  assert p50s(rows, 512) == {"forge-xla": 15.0}
  assert e2e.main(["--replot", "--out", str(out), "--plot", str(png),
                   "--arms", "optax", "forge"]) == 0
  text = capsys.readouterr().out
  assert "BT=512: forge, optax from the run at bbb" in text, text
  assert "BT=2048: forge, optax from the run at aaa" in text, text
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_optax_cells_are_listed_once_beside_two_forge_arms(
    tmp_path, monkeypatch, capsys):
  times = {"forge": iter([15.0, 16.0]), "forge-xla": iter([13.0, 14.0]),
           "optax": iter([14.0, 14.5])}

  def cell(args, arm, bt, timeout):
    t = next(times[arm])
    return dict(arm=arm, bt=bt, step_ms=(t, t, t), peak_bytes=None,
                mem=dict(temp=0, argument=0, output=0, alias=0),
                losses=[2.0, 1.0], compile_s=0.1,
                params=e2e.param_count(TINY), device="cpu", backend="cpu"), None

  monkeypatch.setattr(e2e, "run_driver_cell", cell)
  rc = e2e.main(["--arms", "optax", "forge", "forge-xla", "--bt", "16",
                 "--repeat", "2", *TINY_FLAGS, "--out", str(tmp_path / "e.csv")])
  text = capsys.readouterr().out
  assert rc == 0, text
  assert text.count("optax step p50 per cell") == 1, text
  assert text.count("forge step p50 per cell") == 1, text
  assert text.count("forge-xla step p50 per cell") == 1, text
  assert text.count(" / optax (p50 step time") == 2, text


def test_a_timed_out_cell_takes_what_it_started_with_it(tmp_path, monkeypatch):
  """On the H200, after a cell was killed at its timeout, every later cell
  hung. A cell runs in its own process group now, and a timeout kills the
  group: here a cell that started a long-lived child."""
  import os
  import sys
  import time
  pid_file = tmp_path / "child.pid"
  code = ("import subprocess, sys, time; "
          "p = subprocess.Popen([sys.executable, '-c', "
          "'import time; time.sleep(120)']); "
          f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
  monkeypatch.setattr(e2e, "_cell_argv",
                      lambda args, arm, bt: [sys.executable, "-c", code])
  t0 = time.perf_counter()
  args = e2e.parse_args(["--bt", "16", *TINY_FLAGS])
  r, reason = e2e.run_driver_cell(args, "optax", 16, timeout=5)
  assert r is None and reason == "timeout after 5 s"
  assert time.perf_counter() - t0 < 60
  child = int(pid_file.read_text())
  for _ in range(50):  # reaped by init once killed
    try:
      os.kill(child, 0)
    except ProcessLookupError:
      break
    time.sleep(0.1)
  else:
    os.kill(child, 9)
    raise AssertionError(f"the cell's child {child} outlived the cell")
