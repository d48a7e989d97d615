"""benchmarks/torch_e2e.py: the torch decoder is benchmarks/e2e.py's model,
the driver's CPU smoke run trains both arms alike and writes its rows and
plot, and bad flags (or no CUDA device) are refused in plain words."""

import contextlib
import csv
import io
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import forge_torch  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import common, e2e, torch_e2e  # noqa: E402
from tests.tolerances import assert_close, tol  # noqa: E402

FP32_TOL = tol(jnp.float32)
# One block, odd vocab: the smallest decoder that runs every code path.
SMOKE = e2e.Config(layers=1, d_model=32, heads=4, kv_heads=2, ffn=48,
                   vocab=61, seq=8, dtype="float32")
SMOKE_FLAGS = ["--layers", "1", "--d-model", "32", "--heads", "4",
               "--kv-heads", "2", "--ffn", "48", "--vocab", "61", "--seq", "8",
               "--dtype", "float32"]


def _flax_params(model: torch_e2e.Decoder) -> dict:
  """The torch decoder's weights as benchmarks/e2e.py's Decoder tree (flax
  kernels are ``(in, out)``: torch's weights transposed)."""
  w = lambda t: jnp.asarray(t.detach().numpy())
  dense = lambda lin: {"kernel": w(lin.weight).T}
  params = {"embed": {"embedding": w(model.embed.weight)},
            "final_norm": {"scale": w(model.final_norm.weight)},
            "lm_head": dense(model.lm_head)}
  for i, b in enumerate(model.blocks):
    params[f"block_{i}"] = {
        "attn_norm": {"scale": w(b.attn_norm.weight)},
        "mlp_norm": {"scale": w(b.mlp_norm.weight)},
        "attn": {n: dense(getattr(b.attn, n)) for n in "qkvo"},
        "mlp": {n: dense(getattr(b.mlp, n)) for n in ("gate", "up", "down")}}
  return {"params": params}


def test_the_torch_decoder_is_the_jax_benchmarks_model():
  """Same parameters as the JAX decoder at the benchmark's config (the
  0.886 B one, built on the meta device) and the same function: given the
  same weights, the same fp32 logits (RMSNorm, rotary, grouped-query
  attention, SwiGLU, untied head), random weights and tokens."""
  full = e2e.Config()
  model = torch_e2e.build_model(full, "meta")
  n = sum(p.numel() for p in model.parameters())
  assert n == e2e.param_count(full) == 886_114_304
  assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
  # Every projection and the head are managed: the pool is every parameter
  # but the embedding and the norm scales, 2 bytes each.
  assert len(torch_e2e.linear_names(model)) == 7 * full.layers + 1
  pool, total = torch_e2e.pool_bytes(model)
  d = full.d_model
  assert total == 2 * n
  assert pool == 2 * (n - full.vocab * d - (2 * full.layers + 1) * d)

  cfg = e2e.Config(layers=2, d_model=32, heads=4, kv_heads=2, ffn=48,
                   vocab=61, seq=8, dtype="float32")
  model = torch_e2e.build_model(cfg, "cpu", seed=3)
  with torch.no_grad():  # norm scales away from one, so that they count
    for name, p in model.named_parameters():
      if p.dim() == 1:
        p.uniform_(0.5, 1.5)
  tokens, _ = torch_e2e.make_batch(cfg, 3, "cpu", seed=5)
  with torch.no_grad():
    got = model(tokens).numpy()
  variables = _flax_params(model)
  abstract = e2e.abstract_variables(cfg)
  spec = lambda t: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), t)
  assert spec(variables) == spec(abstract)
  want = e2e.Decoder(cfg).apply(variables, jnp.asarray(tokens.numpy()))
  assert_close(got, want, FP32_TOL, what="logits")
  # The batch is benchmarks/e2e.py's for the same seed.
  jt, jy = e2e.make_batch(cfg, 3, seed=5)
  np.testing.assert_array_equal(tokens.numpy(), np.asarray(jt))
  assert torch_e2e.CHECK_RTOL == FP32_TOL


def _rows(path):
  with open(path, newline="") as f:
    reader = csv.DictReader(f)
    assert reader.fieldnames == common.CSV_FIELDS
    return list(reader)


def test_cpu_smoke_run_writes_rows_and_plot(tmp_path, capsys):
  """The driver on the CPU (fp32, one block), each arm's cell its own
  process: rows marked cpu, no memory rows (CUDA only), the arms' losses
  equal to fp32 parity and falling, every managed layer fused in every
  step, the gradient pool counted, the plot written."""
  out = tmp_path / "run"
  rc = torch_e2e.main(["--device", "cpu", *SMOKE_FLAGS, "--bt", "16",
                       "--steps", "2", "--warmup", "1", "--out-dir",
                       str(out)])
  text = capsys.readouterr().out
  assert rc == 0, text
  assert "timings are not GPU figures" in text
  rows = _rows(out / "torch_e2e.csv")
  assert {r["benchmark"] for r in rows} == {"torch_e2e"}
  assert all(r["device"].startswith("cpu:") for r in rows)
  assert all(r["commit"] and r["versions"] and r["timestamp"] for r in rows)

  cell = {(r["provider"], r["metric"]): r for r in rows}
  assert all(r["case"].endswith("BT=16") for r in rows)
  value = lambda arm, metric: float(cell[(arm, metric)]["p50"])
  for arm in torch_e2e.ARMS:
    assert value(arm, "param_count") == e2e.param_count(SMOKE)
    assert value(arm, "step_time") > 0
    assert cell[(arm, "step_time")]["unit"] == "ms"
    # The phases, host time only on the CPU, adding up to about the step.
    phases = [value(arm, f"host_{p}") for p in torch_e2e.PHASES]
    assert all(t > 0 for t in phases)
    assert not any((arm, f"gpu_{p}") in cell for p in torch_e2e.PHASES)
    assert sum(phases) <= 1.5 * float(cell[(arm, "step_time")]["p80"])
    assert value(arm, "loss_final") < value(arm, "loss_first")
    assert not any((arm, m) in cell for m in ("peak_memory", "base_memory",
                                              "after_backward"))
    assert "m=float32,v=float32" in cell[(arm, "step_time")]["dtypes"]
  for metric in ("loss_first", "loss_final"):
    a, b = value("forge", metric), value("torch", metric)
    assert abs(a - b) <= FP32_TOL * abs(b), (metric, a, b)
  pool, total = torch_e2e.pool_bytes(torch_e2e.build_model(SMOKE, "meta"))
  for arm in torch_e2e.ARMS:
    assert math.isclose(value(arm, "grad_pool"), pool / 2**20, rel_tol=1e-5)
    assert math.isclose(value(arm, "grad_total"), total / 2**20,
                        rel_tol=1e-5)
  assert value("forge", "bridge_calls") == 8  # 7 projections + the head
  assert ("torch", "bridge_calls") not in cell
  assert (out / "torch_e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _in_process(argv, env, timeout, label, tag):
  """benchmarks.e2e.run_tagged, but the cell runs in this process (the
  subprocess path is the smoke run's)."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    rc = torch_e2e.main(argv[argv.index("benchmarks.torch_e2e") + 1:])
  lines = [l for l in buf.getvalue().splitlines() if l.startswith(tag)]
  if rc or not lines:
    return None, f"exit {rc}"
  return json.loads(lines[-1][len(tag):]), None


@pytest.mark.parametrize("perturb", [False, True])
def test_check_compares_the_arms_at_fp32_parity(tmp_path, monkeypatch,
                                                capsys, perturb):
  """--check: both arms 3 steps on the tiny fp32 decoder; every parameter,
  update and loss within 1e-5 and the rows written. With the forge arm's
  learning rate off by 1e-4 (relative), the check fails the run."""
  monkeypatch.setattr(torch_e2e.e2e, "run_tagged", _in_process)
  if perturb:
    make = torch_e2e.make_optimizer

    def off(arm, model, hparams=None, **kw):
      if arm == "forge":
        hparams = dict(hparams or e2e.HPARAMS)
        hparams["learning_rate"] *= 1 + 1e-4
      return make(arm, model, hparams, **kw)

    monkeypatch.setattr(torch_e2e, "make_optimizer", off)
  out = tmp_path / "t.csv"
  rc = torch_e2e.main(["--device", "cpu", *SMOKE_FLAGS, "--bt", "8",
                       "--steps", "1", "--warmup", "1", "--check", "--out",
                       str(out)])
  text = capsys.readouterr().out
  parity = {r["metric"]: float(r["p50"]) for r in _rows(out)
            if r["metric"].startswith("parity_")}
  assert set(parity) == {"parity_param_err", "parity_update_err",
                         "parity_loss_err"}
  assert "fused calls 45 of 45" in text  # 15 managed layers x 3 steps
  if perturb:
    assert rc == 1
    assert parity["parity_update_err"] > FP32_TOL
    assert "FAILED: the parity check (--check) did not pass" in text
  else:
    assert rc == 0, text
    assert all(0 <= v <= FP32_TOL for v in parity.values()), parity
    assert "unmoved none: OK" in text


def test_failed_cells_get_rows_and_a_failing_exit(tmp_path, monkeypatch,
                                                  capsys):
  calls = []

  def fail(argv, env, timeout, label, tag):
    calls.append(label)
    return None, "exit 1: RuntimeError: out of memory"

  monkeypatch.setattr(torch_e2e.e2e, "run_tagged", fail)
  out = tmp_path / "t.csv"
  rc = torch_e2e.main(["--device", "cpu", *SMOKE_FLAGS, "--bt", "8", "16",
                       "--out", str(out), "--plot", str(tmp_path / "t.png")])
  assert rc == 1
  assert calls == ["torch BT=8", "forge BT=8", "torch BT=16", "forge BT=16"]
  rows = _rows(out)
  assert [(r["provider"], r["metric"], r["unit"]) for r in rows] == [
      (arm, "failed", "exit 1: RuntimeError: out of memory")
      for _ in (8, 16) for arm in torch_e2e.ARMS]
  assert all(r["device"].startswith("cpu:") and r["p50"] == "nan"
             for r in rows)
  assert "failed cell forge BT=16" in capsys.readouterr().out
  assert not (tmp_path / "t.png").exists()


def test_repeat_runs_rounds_and_pairs_them(tmp_path, monkeypatch, capsys):
  """--repeat: every cell N times in rounds of both arms, the order
  reversed every other round; the summary takes each arm's median cell and
  prints each round's ratio of the cells run side by side."""
  calls = []

  def fail(argv, env, timeout, label, tag):
    calls.append(label)
    return None, "exit 1: stopped"

  monkeypatch.setattr(torch_e2e.e2e, "run_tagged", fail)
  rc = torch_e2e.main(["--device", "cpu", *SMOKE_FLAGS, "--bt", "8",
                       "--repeat", "3", "--out", str(tmp_path / "t.csv")])
  assert rc == 1
  assert calls == ["torch BT=8 round 1", "forge BT=8 round 1",
                   "forge BT=8 round 2", "torch BT=8 round 2",
                   "torch BT=8 round 3", "forge BT=8 round 3"]
  cell = lambda ms: {"step_ms": [ms - 1, ms, ms + 1]}
  torch_cells = [(0, cell(60.0)), (1, cell(40.0)), (2, cell(50.0))]
  forge_cells = [(0, cell(66.0)), (1, cell(48.0)), (2, cell(50.0))]
  capsys.readouterr()
  torch_e2e.print_rounds({("torch", 8): torch_cells,
                          ("forge", 8): forge_cells}, [8])
  assert ("step forge/torch by round: 1.100 1.200 1.000; median 1.100 "
          "(torch 60.0 40.0 50.0 ms; forge 66.0 48.0 50.0 ms)"
          in capsys.readouterr().out)


def test_paired_times_both_arms_in_one_process(tmp_path, monkeypatch,
                                               capsys):
  """--paired: both arms in one process per round, step by step in
  alternation; each arm's step times and the per-pair ratio written under
  their own benchmark name (the plot of the same CSV takes only the
  cells); the first losses equal."""
  monkeypatch.setattr(torch_e2e.e2e, "run_tagged", _in_process)
  seen = []
  step_of = torch_e2e.loss_of

  def loss_of(model, tokens, targets):  # which arm steps, in order
    seen.append(isinstance(model.lm_head, forge_torch.Linear))
    return step_of(model, tokens, targets)

  monkeypatch.setattr(torch_e2e, "loss_of", loss_of)
  out = tmp_path / "t.csv"
  png = tmp_path / "paired.png"
  rc = torch_e2e.main(["--device", "cpu", *SMOKE_FLAGS, "--bt", "8",
                       "--steps", "4", "--warmup", "1", "--paired",
                       "--repeat", "2", "--out", str(out), "--plot",
                       str(png)])
  text = capsys.readouterr().out
  assert rc == 0, text
  # Per round: one warm-up step per arm, then pairs in alternating order.
  per_round = [False, True, False, True, True, False, False, True, True,
               False]
  assert seen == per_round * 2
  rows = _rows(out)
  assert {r["benchmark"] for r in rows} == {"torch_e2e_paired"}
  assert all(r["case"].endswith("BT=8 paired") for r in rows)
  got = [(r["provider"], r["metric"]) for r in rows]
  assert got == [("torch", "step_time"), ("torch", "loss_first"),
                 ("forge", "step_time"), ("forge", "loss_first"),
                 ("forge/torch", "step_ratio")] * 2
  for i in (0, 5):
    t, f, ratio = rows[i], rows[i + 2], rows[i + 4]
    assert float(t["p50"]) > 0 and float(f["p50"]) > 0
    assert float(ratio["p20"]) <= float(ratio["p50"]) <= float(ratio["p80"])
    assert abs(float(rows[i + 3]["p50"]) - float(rows[i + 1]["p50"])) <= (
        FP32_TOL * abs(float(rows[i + 1]["p50"])))
  assert "per-pair median ratio by round:" in text
  assert torch_e2e.bar_rows(str(out)) == {}
  # The plot draws the paired processes' ratios; redrawn from the CSV.
  assert png.stat().st_size > 0 and f"wrote {png}" in text
  png.unlink()
  assert torch_e2e.main(["--replot", "--paired", "--out", str(out),
                         "--plot", str(png)]) == 0
  assert png.stat().st_size > 0


def test_paired_lean_adds_the_bound_as_a_third_arm(tmp_path, monkeypatch,
                                                  capsys):
  """--paired --lean: a third model whose projections and head are lean
  layers, timed in the same alternation; its step times and lean/torch
  ratio written beside the others and drawn at its process's place."""
  monkeypatch.setattr(torch_e2e.e2e, "run_tagged", _in_process)
  from benchmarks import lean_layer  # noqa: F401
  seen = []
  step_of = torch_e2e.loss_of

  def loss_of(model, tokens, targets):  # which arm steps, in order
    head = type(model.lm_head)
    seen.append("forge" if head is forge_torch.Linear else
                "torch" if head is torch.nn.Linear else head.__name__)
    return step_of(model, tokens, targets)

  monkeypatch.setattr(torch_e2e, "loss_of", loss_of)
  out, png = tmp_path / "t.csv", tmp_path / "p.png"
  rc = torch_e2e.main(["--device", "cpu", *SMOKE_FLAGS, "--bt", "8",
                       "--steps", "2", "--warmup", "1", "--paired", "--lean",
                       "--out", str(out), "--plot", str(png)])
  text = capsys.readouterr().out
  assert rc == 0, text
  arms = ["torch", "forge", "LeanLinear"]
  assert seen == arms + arms + arms[::-1]
  got = [(r["provider"], r["metric"]) for r in _rows(out)]
  assert got == [("torch", "step_time"), ("torch", "loss_first"),
                 ("forge", "step_time"), ("forge", "loss_first"),
                 ("lean", "step_time"), ("lean", "loss_first"),
                 ("forge/torch", "step_ratio"), ("lean/torch", "step_ratio")]
  assert "lean bound: step p50" in text
  assert png.stat().st_size > 0
  # The plot draws the lean ratio at its process's place, beside forge's.
  points = torch_e2e.paired_points(_rows(out))
  assert sorted(p[:2] for p in points[8]) == [(0, "forge/torch"),
                                              (0, "lean/torch")]


def test_a_paired_plot_of_a_csv_without_paired_rows_draws_nothing(
    tmp_path, capsys):
  out, png = tmp_path / "t.csv", tmp_path / "t.png"
  common.Results(str(out), torch_e2e.BENCHMARK, device="cpu:x").add(
      "llama BT=8", "torch", "s", "d", "step_time", 1.0, "ms")
  assert torch_e2e.main(["--replot", "--paired", "--out", str(out),
                         "--plot", str(png)]) == 1
  assert "has no torch_e2e_paired step_ratio rows" in capsys.readouterr().err
  assert not png.exists()


@pytest.mark.parametrize("flags, words", [
    (["--paired", "--arms", "forge"], "--paired times both arms side by "
     "side: leave --arms out"),
    (["--paired", "--check"], "--paired times eager steps only"),
    (["--lean"], "--lean is a third arm of --paired"),
    (["--bt", "12"], "--bt 12 is not a multiple of --seq 8"),
    (["--d-model", "30"], "d_model must be a multiple of heads"),
    (["--bt", "0"], "0 must be >= 1"),
    (["--out-dir", "d", "--out", "x.csv"], "give --out-dir, or --out and "
     "--plot, not both"),
    (["--replot"], "--replot needs --plot PNG"),
    (["--graph"], "--graph records CUDA graphs: it needs --device cuda"),
])
def test_bad_flags_are_refused_in_plain_words(flags, words, capsys):
  with pytest.raises(SystemExit) as e:
    torch_e2e.main(["--device", "cpu", *SMOKE_FLAGS, *flags])
  assert e.value.code == 2
  assert words in capsys.readouterr().err


def test_no_cuda_device_is_refused_not_measured(tmp_path, monkeypatch,
                                                capsys):
  monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
  monkeypatch.setattr(torch_e2e.e2e, "run_tagged", lambda *a: pytest.fail(
      "a cell ran without a CUDA device"))
  out = tmp_path / "t.csv"
  assert torch_e2e.main([*SMOKE_FLAGS, "--bt", "16", "--out", str(out)]) == 1
  err = capsys.readouterr().err
  assert "no CUDA device" in err and "--device cpu" in err
  assert not out.exists()


# A small bf16 decoder for the GPU tests (its sequence of 16 tokens).
GPU_SMALL = ["--layers", "2", "--d-model", "256", "--heads", "4",
             "--kv-heads", "2", "--ffn", "512", "--seq", "16"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device for torch")
def test_gpu_small_run_saves_the_pool(tmp_path, capsys):
  """On the GPU (bf16, a small decoder, BT 32: few enough tokens that the
  weights' gradients, not the forward's activations, set torch's peak --
  at BT 128 both arms peak in the forward, at the same bytes): the parity
  check passes, every state tensor is written in place, the managed
  weights' gradients are gone after the backward and the forge arm's peak
  is the lower."""
  out = tmp_path / "run"
  rc = torch_e2e.main([*GPU_SMALL, "--vocab", "1000", "--bt", "32",
                       "--steps", "3", "--warmup", "2", "--check",
                       "--out-dir", str(out)])
  text = capsys.readouterr().out
  assert rc == 0, text
  cell = {(r["provider"], r["metric"]): float(r["p50"])
          for r in _rows(out / "torch_e2e.csv") if r["case"].endswith("BT=32")}
  assert cell[("forge", "bridge_copied")] == 0
  assert cell[("forge", "bridge_calls")] == 7 * 2 + 1
  pool = cell[("forge", "grad_pool")]
  gone = cell[("torch", "after_backward")] - cell[("forge", "after_backward")]
  assert gone >= 0.99 * pool, (gone, pool)
  assert cell[("forge", "peak_memory")] < cell[("torch", "peak_memory")]
  for arm in torch_e2e.ARMS:  # GPU time per phase beside the host's
    assert all(cell[(arm, f"gpu_{p}")] > 0 for p in torch_e2e.PHASES)
  assert (out / "torch_e2e.png").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device for torch")
def test_gpu_graph_cells_replay_a_captured_step(tmp_path, capsys):
  """--graph: each arm's step captured once (forge: its fused updates with
  the step's scalars formed on the GPU) and replayed; the replays train
  (the loss falls) and no fused update runs host work after the capture."""
  out = tmp_path / "run"
  # (A vocabulary of 1024: the head's kernel case must be one the Mosaic GPU
  # kernel tiles, the only one a graph can record.)
  rc = torch_e2e.main([*GPU_SMALL, "--vocab", "1024", "--bt", "64",
                       "--steps", "4", "--warmup", "2", "--graph",
                       "--out-dir", str(out)])
  text = capsys.readouterr().out
  assert rc == 0, text
  rows = [r for r in _rows(out / "torch_e2e.csv")
          if r["case"].endswith("BT=64 CUDA graph")]
  cell = {(r["provider"], r["metric"]): float(r["p50"]) for r in rows}
  for arm in torch_e2e.ARMS:
    assert cell[(arm, "step_time")] > 0 and cell[(arm, "gpu_replay")] > 0
    assert cell[(arm, "loss_final")] < cell[(arm, "loss_first")]
    assert (arm, "peak_memory") not in cell and cell[(arm, "peak_reserved")]
  assert cell[("forge", "bridge_calls")] == 0  # replays: no bridge calls
  assert (out / "torch_e2e.png").exists()
