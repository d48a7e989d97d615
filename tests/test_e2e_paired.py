"""benchmarks/e2e_paired.py: every arm in one process, timed in alternating
rounds; the per-round ratios in its CSV follow from its own block rows."""

import csv
import json
import math
import statistics

import pytest

from benchmarks import e2e, e2e_paired
from tests.test_e2e_bench import SMOKE_FLAGS

ARMS = ["optax", "forge-xla", "forge"]


def _rows(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def test_round_orders_reverse_every_other_round():
  assert e2e_paired.round_orders(["a", "b", "c"], 3) == [
      ["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_paired_ratios_divide_block_medians_round_by_round():
  blocks = {"optax": [[2.0, 4.0, 3.0], [1.0, 1.0, 9.0]],
            "forge": [[3.0, 3.0, 30.0], [0.5, 0.5, 0.5]]}
  assert e2e_paired.paired_ratios(blocks, "forge") == [1.0, 0.5]
  with pytest.raises(ValueError):  # a round missing on one side
    e2e_paired.paired_ratios({"optax": [[1.0]], "forge": []}, "forge")


def test_single_process_writes_consistent_rows(tmp_path, capsys):
  out = tmp_path / "p.csv"
  rc = e2e_paired.main(["--single", "--arms", *ARMS, "--bt", "16",
                        *SMOKE_FLAGS, "--rounds", "3", "--block", "2",
                        "--warmup", "1", "--out", str(out),
                        "--hlo-dir", str(tmp_path / "hlo")])
  assert rc == 0
  line = next(l for l in capsys.readouterr().out.splitlines()
              if l.startswith(e2e_paired.RESULT_TAG))
  result = json.loads(line[len(e2e_paired.RESULT_TAG):])
  rows = _rows(out)
  assert {r["benchmark"] for r in rows} == {"e2e_paired"}
  by = {(r["provider"], r["metric"]): r for r in rows}
  for arm in ARMS:
    assert (tmp_path / "hlo" / f"{arm}.hlo.txt").read_text().startswith(
        "HloModule")
    assert {f"block_time_round{i}" for i in range(3)} <= {
        m for (a, m) in by if a == arm}
    st = by[(arm, "step_time")]
    assert float(st["p20"]) <= float(st["p50"]) <= float(st["p80"])
    assert math.isfinite(float(by[(arm, "loss_final")]["p50"]))
    assert by[(arm, "loss_first")]["p50"] == by[("optax", "loss_first")]["p50"] \
        or math.isclose(float(by[(arm, "loss_first")]["p50"]),
                        float(by[("optax", "loss_first")]["p50"]),
                        rel_tol=e2e.FIRST_LOSS_RTOL)
  # Each FORGE arm's ratio per round is its block median over optax's of the
  # same round (the CSV keeps 6 significant digits).
  for arm in ("forge-xla", "forge"):
    ratios = [float(by[(arm, f"block_time_round{i}")]["p50"])
              / float(by[("optax", f"block_time_round{i}")]["p50"])
              for i in range(3)]
    assert float(by[(arm, "ratio_to_optax")]["p50"]) == pytest.approx(
        statistics.median(ratios), rel=1e-4)
    fr = by[(arm, "faster_rounds")]
    assert fr["unit"] == "of 3"
    assert int(float(fr["p50"])) == sum(x < 1 for x in ratios)
    # Pipelined: per round, the arm's time per step over optax's.
    piped = [t / o for t, o in zip(result["piped"][arm],
                                   result["piped"]["optax"])]
    assert result["piped_ratios"][arm] == pytest.approx(piped)
    assert float(by[(arm, "pipelined_ratio_to_optax")]["p50"]) == \
        pytest.approx(statistics.median(piped), rel=1e-4)
    assert int(float(by[(arm, "pipelined_faster_rounds")]["p50"])) == sum(
        x < 1 for x in piped)
  for arm in ARMS:
    assert len(result["piped"][arm]) == 3 and len(result["blocks"][arm]) == 3
    assert all(len(b) == 2 for b in result["blocks"][arm])
    assert float(by[(arm, "pipelined_step_time")]["p50"]) == pytest.approx(
        statistics.median(result["piped"][arm]) * 1e3, rel=1e-4)
    assert [float(by[(arm, f"pipelined_time_round{i}")]["p50"])
            for i in range(3)] == pytest.approx(
                [t * 1e3 for t in result["piped"][arm]], rel=1e-4)
    # warm-up 1 + 3 rounds x (2 synced + 2 pipelined) losses, all finite
    assert len(result["losses"][arm]) == 13
    assert all(math.isfinite(l) for l in result["losses"][arm])
  assert ("optax", "ratio_to_optax") not in by


def test_driver_pools_processes_and_plots(tmp_path, capsys):
  # The scanned stack: the cheapest model to compile in each of the two
  # processes (the decoder runs in test_single_process_writes_consistent_rows).
  out, png = tmp_path / "p.csv", tmp_path / "p.png"
  rc = e2e_paired.main(["--arms", "optax", "forge-xla", "--model", "stack",
                        "--stack-layers", "2", "--stack-width", "24",
                        "--bt", "10", "--rounds", "2", "--block", "2",
                        "--warmup", "1", "--processes", "2",
                        "--out", str(out), "--plot", str(png)])
  text = capsys.readouterr().out
  assert rc == 0, text
  assert "2 process(es) x 2 rounds x 2 steps" in text
  assert "first-step losses agree" in text
  assert "\nsynced (" in text and "\npipelined (" in text
  # One line per arm; forge-xla's lists its two processes' median ratios.
  line = next(l for l in text.splitlines() if l.startswith("forge-xla "))
  assert line.rstrip().endswith(tuple("0123456789")) and "/4" in line
  rows = _rows(out)
  # One timestamp per process (Results stamps to the second: the two
  # processes each take longer than that).
  assert len({r["timestamp"] for r in rows}) == 2
  assert sum(r["metric"] == "ratio_to_optax" for r in rows) == 2
  assert sum(r["metric"] == "pipelined_ratio_to_optax" for r in rows) == 2
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_relative_paths_are_the_callers(tmp_path, monkeypatch):
  """The processes run in the repository; --out and --hlo-dir given
  relative to the caller's directory reach them as absolute paths."""
  monkeypatch.chdir(tmp_path)
  args = e2e_paired.parse_args(["--out", "rel/p.csv", "--hlo-dir", "hlo"])
  argv = e2e_paired._process_argv(args, 1)
  assert argv[argv.index("--out") + 1] == str(tmp_path / "rel" / "p.csv")
  assert argv[argv.index("--hlo-dir") + 1] == str(tmp_path / "hlo" / "p1")
  stack = e2e_paired.parse_args(["--model", "stack", "--stack-update",
                                  "layer", "--bt", "10"])
  argv = e2e_paired._process_argv(stack, 0)
  assert argv[argv.index("--stack-update") + 1] == "layer"
  assert argv[argv.index("--model") + 1] == "stack"
  cell = e2e._cell_argv(e2e.parse_args(["--out", "e.csv"]), "optax", 512)
  assert cell[cell.index("--out") + 1] == str(tmp_path / "e.csv")


def test_every_model_flag_reaches_the_processes():
  """The driver's processes measure the model asked for: the dtype flags
  (mixed precision, optax's mu_dtype) reach them too."""
  args = e2e_paired.parse_args(["--param-dtype", "float32",
                                "--mu-dtype", "bfloat16"])
  argv = e2e_paired._process_argv(args, 0)
  assert argv[argv.index("--param-dtype") + 1] == "float32"
  assert argv[argv.index("--mu-dtype") + 1] == "bfloat16"
  plain = e2e_paired._process_argv(e2e_paired.parse_args([]), 0)
  assert "--param-dtype" not in plain and "--mu-dtype" not in plain


def test_driver_reports_a_failed_process(tmp_path, capsys):
  rc = e2e_paired.main(["--arms", "optax", "forge", "--bt", "16",
                        *SMOKE_FLAGS, "--rounds", "1", "--block", "1",
                        "--timeout", "0.5", "--out", str(tmp_path / "p.csv")])
  assert rc == 1
  assert "FAILED process 0: timeout after" in capsys.readouterr().out


def test_scanned_stack_model(tmp_path, capsys):
  """--model stack: the scanned stack's arms from one init (equal first
  losses), rows labelled as the stack."""
  out = tmp_path / "p.csv"
  rc = e2e_paired.main(["--single", "--model", "stack", "--stack-layers",
                        "3", "--stack-width", "24", "--bt", "10",
                        "--rounds", "2", "--block", "2", "--warmup", "1",
                        "--out", str(out)])
  assert rc == 0
  line = next(l for l in capsys.readouterr().out.splitlines()
              if l.startswith(e2e_paired.RESULT_TAG))
  result = json.loads(line[len(e2e_paired.RESULT_TAG):])
  assert result["stack"] == [3, 24, "auto"]
  firsts = {arm: result["losses"][arm][0] for arm in ARMS}
  for arm in ARMS:
    assert firsts[arm] == pytest.approx(firsts["optax"],
                                        rel=e2e.FIRST_LOSS_RTOL)
    assert result["losses"][arm][-1] < result["losses"][arm][0]
  rows = _rows(out)
  assert {r["case"] for r in rows} == {"stack-3x24^2 BT=10"}
  assert all("ScannedDenseStack" in r["shape"] for r in rows)
  assert {r["unit"] for r in rows if r["metric"] == "loss_first"} == {
      "mean(y^2)"}


@pytest.mark.parametrize("argv, message", [
    (["--arms", "forge", "forge-xla"], "must include optax"),
    (["--arms", "optax"], "must include optax and at least one FORGE arm"),
    (["--arms", "optax", "forge", "forge"], "names an arm twice"),
    (["--bt", "100"], "not a multiple of --seq"),
    (["--rounds", "0"], "--rounds: 0 must be >= 1"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
  with pytest.raises(SystemExit):
    e2e_paired.parse_args(argv)
  assert message in capsys.readouterr().err


def test_single_process_exits_1_when_first_losses_differ(monkeypatch, capsys):
  fake = dict(arms=["optax", "forge"], losses={"optax": [2.0, 1.0],
                                               "forge": [2.1, 1.0]})
  monkeypatch.setattr(e2e_paired, "run_process", lambda *a, **k: fake)
  assert e2e_paired.main(["--single", "--arms", "optax", "forge"]) == 1
  assert "first-step loss of ['forge'] differs" in capsys.readouterr().err
  fake["losses"]["forge"][0] = 2.0
  assert e2e_paired.main(["--single", "--arms", "optax", "forge"]) == 0
