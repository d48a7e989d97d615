"""The benchmark modules and dev.sh on bad input (CPU): an argparse-style
usage error or a clear message with a non-zero exit, never a traceback, and
nothing written that looks like a result."""

import argparse
import csv
import gzip
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
# The benchmarks run as modules from the repository root: no PYTHONPATH.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(args, env=ENV, **kw):
  return subprocess.run(args, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300, **kw)


def _rows(path):
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


# --- 1. memory.py: non-positive sizes -------------------------------------
@pytest.mark.parametrize("bad", [["--layers", "0"], ["--width", "0"],
                                 ["--tokens", "0"], ["--tokens", "-3"]])
def test_memory_rejects_nonpositive_sizes(tmp_path, bad):
  from benchmarks import memory
  args = ["--out", str(tmp_path / "m.csv"), "--width", "64", "--tokens", "16",
          "--layers", "1"] + bad
  with pytest.raises(SystemExit) as e:
    memory.main(args)
  assert e.value.code == 2


# --- 2. memory.py: --tokens == --width would make x @ W look like x^T dy -----
def test_memory_refuses_tokens_equal_to_width(tmp_path):
  from benchmarks import memory
  with pytest.raises(SystemExit) as e:
    memory.main(["--out", str(tmp_path / "m.csv"), "--width", "64",
                 "--tokens", "64", "--layers", "1"])
  assert e.value.code == 2
  assert not (tmp_path / "m.csv").exists()


# --- 3. scan_memory.py: sizes checked before any child process runs ------
def test_scan_memory_rejects_zero_tokens(tmp_path):
  from benchmarks import scan_memory
  out = tmp_path / "s.csv"
  with pytest.raises(SystemExit) as e:
    scan_memory.main(["--out", str(out), "--layers", "2", "--width", "64",
                      "--tokens", "0"])
  assert e.value.code == 2
  assert not out.exists()


# --- 4. bf16_error.py: --seeds and --steps must be >= 1 ------------------
@pytest.mark.parametrize("bad", [["--seeds", "0", "--steps", "1"],
                                 ["--seeds", "1", "--steps", "0"]])
def test_bf16_error_rejects_nonpositive_counts(tmp_path, bad):
  from benchmarks import bf16_error
  with pytest.raises(SystemExit) as e:
    bf16_error.main(["--out", str(tmp_path / "b.csv"), "--lrs", "1e-3"] + bad)
  assert e.value.code == 2


# --- 5. plot.py: argparse, a missing CSV, no kernel rows ------------------
def test_plot_help_is_not_a_traceback():
  p = _run([PY, "-m", "benchmarks.plot", "--help"])
  assert p.returncode == 0 and "usage" in p.stdout.lower(), p.stderr[-500:]


def test_plot_missing_args_is_usage_error():
  p = _run([PY, "-m", "benchmarks.plot"])
  assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-500:]


def test_plot_missing_csv_is_clean_error(tmp_path):
  p = _run([PY, "-m", "benchmarks.plot", str(tmp_path / "nope.csv"),
            str(tmp_path / "x.png")])
  assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-500:]


# --- 6. epilogue_probe.py: malformed --shape / --elementwise / --config -----
@pytest.mark.parametrize("bad", [["--shape", "abc"], ["--shape", "4096"],
                                 ["--elementwise", "64x128"],
                                 ["--config", "bogus"]])
def test_epilogue_probe_validates_flags(tmp_path, bad):
  from benchmarks import epilogue_probe
  with pytest.raises(SystemExit) as e:
    epilogue_probe.main(["--out", str(tmp_path)] + bad)  # (before the
  assert e.value.code == 2  # GPU check: without one they would exit 1)


# --- 7. ncu_summary.py: tracebacks, and a truncated --out --------------------
NCU = ('"ID","Kernel Name","Block Size","Grid Size","Metric Name","Metric Value"\n'
       '"0","fused_wgrad_adamw","(128, 1, 1)","(2048, 1, 1)",'
       '"launch__registers_per_thread","255"\n')


def test_ncu_summary_missing_log_is_clean_error(tmp_path):
  from benchmarks import ncu_summary
  try:
    rc = ncu_summary.main([str(tmp_path / "none.csv")])
  except SystemExit as e:
    rc = e.code

  assert rc not in (0, None)


def test_ncu_summary_not_a_ncu_log_is_clean_error(tmp_path):
  from benchmarks import ncu_summary
  log = tmp_path / "log.txt"
  log.write_text("just a stdout log\n")
  try:
    rc = ncu_summary.main([str(log)])
  except SystemExit as e:
    rc = e.code
  assert rc not in (0, None)


def test_ncu_summary_label_mismatch_keeps_out_file(tmp_path):
  from benchmarks import ncu_summary
  log, out = tmp_path / "ncu.csv", tmp_path / "summary.csv"
  log.write_text(NCU)
  out.write_text("previous summary\n")
  try:
    rc = ncu_summary.main([str(log), "--labels", "a", "b", "--out", str(out)])
  except SystemExit as e:
    rc = e.code
  except ValueError:
    rc = "traceback"
  assert rc not in (0, None, "traceback")
  assert out.read_text() == "previous summary\n"


# --- 8. torch_memory.py: --bt / --steps not validated -----------------------
@pytest.mark.parametrize("bad", [["--bt", "abc"], ["--bt", "0"],
                                 ["--steps", "0"]])
def test_torch_memory_validates_flags(tmp_path, monkeypatch, bad):
  torch = pytest.importorskip("torch")
  from benchmarks import torch_memory
  monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

  def no_child(*a, **k):
    raise AssertionError("bad flags reached the measurement")

  monkeypatch.setattr(torch_memory.subprocess, "run", no_child)
  monkeypatch.setattr(sys, "argv", ["torch_memory.py", "--out",
                                    str(tmp_path / "t.csv")] + bad)
  with pytest.raises(SystemExit) as e:
    torch_memory.main()
  assert e.value.code == 2


# --- 9. torch_memory.append_rows: old header-only / empty file ---------------
@pytest.mark.parametrize("existing", ["arm,device,bt\n", ""])
def test_torch_memory_append_rows_fixes_header(tmp_path, existing):
  pytest.importorskip("torch")
  from benchmarks import torch_memory
  out = tmp_path / "t.csv"
  out.write_text(existing)
  torch_memory.append_rows(str(out), [{"arm": "torch", "bt": 128,
                                       "peak_bytes": 1}])
  with open(out, newline="") as f:
    header = next(csv.reader(f))
  assert header == torch_memory.FIELDS


def test_torch_memory_keeps_the_committed_csvs_commit_column(tmp_path):
  """Rows appended to the committed CSV keep its header, the commit column
  included (an older FIELDS without it rewrote the file without it)."""
  pytest.importorskip("torch")
  from benchmarks import torch_memory
  committed = os.path.join(ROOT, "benchmarks", "results", "h200",
                           "torch_memory.csv")
  out = tmp_path / "t.csv"
  out.write_text(open(committed).read())
  before = _rows(out)
  torch_memory.append_rows(str(out), [{"arm": "torch", "bt": 128,
                                       "commit": "abc1234"}])
  after = _rows(out)
  assert "commit" in torch_memory.FIELDS
  assert [r["commit"] for r in after] == [r["commit"] for r in before] + [
      "abc1234"]


@pytest.mark.parametrize("module", ["launch_overhead", "torch_call"])
def test_replot_of_a_missing_csv_is_a_usage_error(tmp_path, module):
  if module == "torch_call":
    pytest.importorskip("torch")
  r = _run([PY, "-m", f"benchmarks.{module}", "--replot", "--out",
            str(tmp_path / "none.csv"), "--plot", str(tmp_path / "x.png")])
  assert r.returncode == 2, r.stderr
  assert "--replot: no CSV at" in r.stderr and "Traceback" not in r.stderr
  assert not (tmp_path / "x.png").exists()


def test_hlo_schedule_missing_or_truncated_file_is_a_clean_error(tmp_path):
  r = _run([PY, "-m", "benchmarks.hlo_schedule", str(tmp_path / "no.hlo")])
  assert r.returncode == 1
  assert "No such file" in r.stderr and "Traceback" not in r.stderr
  cut = tmp_path / "cut.hlo.gz"
  cut.write_bytes(gzip.compress(b"HloModule m\n" * 100)[:24])
  r = _run([PY, "-m", "benchmarks.hlo_schedule", str(cut)])
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("shape", ["0x32", "64x0"])
def test_low_precision_error_rejects_nonpositive_shapes(tmp_path, shape):
  out = tmp_path / "e.csv"
  r = _run([PY, "-m", "benchmarks.low_precision", "error", "--shape", shape,
            "--out", str(out)])
  assert r.returncode == 2 and "must be >= 1" in r.stderr, r.stderr
  assert not out.exists()


def test_help_states_each_default_once():
  """llama8b's flags whose help states their default (resolved after
  parsing) are not followed by argparse's "(default: None)"; the torch
  example's --dtype names the reference it is checked against."""
  for module in ("llama8b", "e2e", "e2e_paired", "torch_e2e"):
    r = _run([PY, "-m", f"benchmarks.{module}", "--help"])
    assert r.returncode == 0 and "(default: None)" not in r.stdout, (
        module, r.stdout)
  r = _run([PY, "-m", "examples.train_digits_torch", "--help"])
  assert r.returncode == 0 and "optax" not in r.stdout, r.stdout


# --- 10. suite.sh on a machine without a GPU ---------------------------------
def test_suite_without_gpu_says_so_cleanly(tmp_path):
  p = subprocess.run(["bash", "benchmarks/suite.sh", str(tmp_path / "suite")],
                     cwd=ROOT, env=dict(ENV, PYTHON=PY), capture_output=True,
                     text=True, timeout=300)
  out = p.stdout + p.stderr

  # FileNotFoundError on the kernel.csv that was never written (rc 1).
  assert "Traceback" not in out, out[-800:]
  assert p.returncode == 1, (p.returncode, out[-800:])
  assert "sees no GPU" in out, out[-800:]


# --- 11. dev.sh: --help is not an error; an unknown command is named --------
def test_dev_sh_help_exits_zero():
  p = _run(["bash", "dev.sh", "--help"])
  assert p.returncode == 0
  assert "./dev.sh train" in p.stdout and "FORGE_VENV" in p.stdout


def test_dev_sh_never_replaces_a_folder_that_is_not_a_virtualenv(tmp_path):
  """A mistyped FORGE_VENV (relative to the caller's directory) naming a
  folder with data in it is refused, not deleted to make a venv there."""
  victim = tmp_path / "data"
  victim.mkdir()
  (victim / "keep.txt").write_text("precious")
  p = subprocess.run(["bash", os.path.join(ROOT, "dev.sh"), "python", "-c",
                      "pass"], cwd=tmp_path, env=dict(ENV, FORGE_VENV="data"),
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 2 and "not a virtualenv" in p.stderr, p.stderr
  assert (victim / "keep.txt").read_text() == "precious"


def test_dev_sh_unknown_command_is_named():
  p = _run(["bash", "dev.sh", "bogus"])
  assert p.returncode != 0 and "bogus" in p.stderr


# --- 12. dev.sh: what it runs, and pip's progress in a few lines -----------
_PIP_OUTPUT = """Collecting jax>=0.11.2
  Downloading jax-0.11.2-py3-none-any.whl.metadata (13 kB)
  Downloading jax-0.11.2-py3-none-any.whl (2.6 MB)
  Using cached optax-0.2.8-py3-none-any.whl (300 kB)
Requirement already satisfied: numpy>=1.26 in ./lib/python3.12/site-packages
Installing collected packages: jax, optax, forge-jax
Successfully installed forge-jax-0.1.0 jax-0.11.2 optax-0.2.8
"""


def _stub_venv(tmp_path, pip_fails=False):
  """A virtualenv whose python logs its arguments (to ``calls.log``), answers
  dev.sh's version check with the real interpreter, and prints ``pip
  install``'s usual output (or fails) instead of installing anything."""
  venv, log = tmp_path / "venv", tmp_path / "calls.log"
  (venv / "bin").mkdir(parents=True)
  (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
  (tmp_path / "pip.out").write_text(_PIP_OUTPUT)
  pip = ('echo "ERROR: No matching distribution found for jax"; exit 1'
         if pip_fails else f'cat {tmp_path / "pip.out"}; exit 0')
  python = venv / "bin" / "python"
  python.write_text(
      "#!/usr/bin/env bash\n"
      f'[ "$1" = "-c" ] && exec {PY} "$@"\n'
      f'echo "$*" >> {log}\n'
      f'if [ "$1 $2 $3" = "-m pip install" ]; then {pip}; fi\n'
      "exit 0\n")
  python.chmod(0o755)
  return venv, log


def test_dev_sh_test_runs_pytest_on_workers_and_passes_arguments(tmp_path):
  venv, log = _stub_venv(tmp_path)
  (venv / ".forge-installed-demo-test-torch").touch()  # installed
  env = dict(ENV, FORGE_VENV=str(venv))
  for workers, want in (("3", "-n 3"), ("", None)):
    log.write_text("")
    p = _run(["bash", "dev.sh", "test", "-k", "x y"],
             env=dict(env, FORGE_TEST_WORKERS=workers))
    assert p.returncode == 0, p.stderr
    (line,) = log.read_text().splitlines()
    assert line.startswith("-m pytest -q -n ") and line.endswith(
        "--dist loadfile -k x y"), line
    if want:
      assert f" {want} " in line
    else:  # the CPU count (nproc), at most 4; one CPU: no workers (-n 0)
      cpus = int(subprocess.run(["nproc"], capture_output=True, text=True,
                                env=env).stdout)
      assert int(line.split()[4]) == (min(cpus, 4) if cpus > 1 else 0), line
  log.write_text("")
  p = _run(["bash", "dev.sh", "train", "--steps", "3"], env=env)
  assert p.returncode == 0, p.stderr
  assert log.read_text().splitlines() == [
      "-m examples.train_digits --steps 3"]


def test_dev_sh_install_prints_a_line_per_download(tmp_path):
  venv, log = _stub_venv(tmp_path)
  p = _run(["bash", "dev.sh", "train", "--help"],
           env=dict(ENV, FORGE_VENV=str(venv)))
  assert p.returncode == 0, p.stderr
  out = p.stdout.splitlines()
  assert "   Downloading jax-0.11.2-py3-none-any.whl (2.6 MB)" in out
  assert "   Using cached optax-0.2.8-py3-none-any.whl (300 kB)" in out
  assert "   installing 3 packages" in out and "   installed 3 packages" in out
  assert not [l for l in out if ".metadata" in l or "already satisfied" in l
              or "Collecting" in l], out
  assert (venv / ".forge-installed-demo").exists()
  assert "-m pip install --progress-bar off -e .[demo]" in log.read_text()
  assert "Requirement already satisfied" in (venv / ".forge-pip.log").read_text()


def test_dev_sh_install_failure_shows_pips_error(tmp_path):
  venv, _ = _stub_venv(tmp_path, pip_fails=True)
  p = _run(["bash", "dev.sh", "train"], env=dict(ENV, FORGE_VENV=str(venv)))
  assert p.returncode == 1
  assert "pip install --upgrade pip failed" in p.stderr
  assert "No matching distribution found for jax" in p.stderr
  assert not (venv / ".forge-installed-demo").exists()


# --- 13. clipping.py --replot: draws a CSV, refuses one without its rows -----
def _clipping_csv(path, rows):
  from benchmarks import common
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, common.CSV_FIELDS)
    w.writeheader()
    for bench, case, prov, metric, p50 in rows:
      w.writerow(dict(benchmark=bench, case=case, provider=prov,
                      shape=f"{case} L=2 BT=24 48x48", dtypes="bf16",
                      metric=metric, p20=p50, p50=p50, p80=p50,
                      unit="us" if metric == "time" else "MiB",
                      device="cpu:test", versions="v", timestamp="t",
                      commit="abc1234"))


def test_clipping_replot_draws_the_csv_and_refuses_one_without_its_rows(
    tmp_path, capsys):
  """--replot draws a CSV (two models, the scanned stack without its optax
  clipped arm: a missing bar, not an error; the newest of two rows wins),
  measuring nothing; a CSV with no model step-time rows (another benchmark's,
  or only the norm kernel's) exits 1 with the reason and writes no PNG, and
  --replot without --plot is a usage error."""
  from benchmarks import clipping
  rows = [("kernel", "layer", "forge", "time", 9.0),
          ("clipping", "layer", "forge", "time", 999.0)]  # older: superseded
  for i, (model, arm) in enumerate((m, a) for m in ("layer", "scan")
                                   for a in clipping.ARMS):
    if (model, arm) != ("scan", "optax_clipped"):
      rows += [("clipping", model, arm, "time", 100.0 + 37 * i),
               ("clipping", model, arm, "temp", 20.0 + 3 * i),
               ("clipping", model, arm, "wgrad_gemms", 1.0)]
  rows.append(("clipping", "norm_kernel", "wgrad_sqnorm", "time", 5.0))
  good = tmp_path / "clipping.csv"
  _clipping_csv(good, rows)
  last = clipping.plot_rows(str(good))
  assert float(last[("layer", "forge", "time")]["p50"]) == 100.0 + 37 * 2
  assert ("scan", "optax_clipped", "time") not in last
  assert {k[0] for k in last} == {"layer", "scan"}
  png = tmp_path / "sub" / "clipping.png"
  assert clipping.main(["--replot", "--out", str(good), "--plot",
                        str(png)]) == 0
  with open(png, "rb") as f:
    data = f.read()
  assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"

  for bad_rows in ([r for r in rows if r[0] == "kernel"],
                   [r for r in rows if r[1] == "norm_kernel"]):
    bad = tmp_path / "bad.csv"
    _clipping_csv(bad, bad_rows)
    out = tmp_path / "bad.png"
    capsys.readouterr()
    assert clipping.main(["--replot", "--out", str(bad), "--plot",
                          str(out)]) == 1
    assert "no clipping step-time rows" in capsys.readouterr().err
    assert not out.exists()
  with pytest.raises(SystemExit) as e:
    clipping.main(["--replot", "--out", str(good)])
  assert e.value.code == 2
  assert "--replot needs --plot" in capsys.readouterr().err


@pytest.mark.parametrize("launch", ["stub", "direct"])
def test_torch_overhead_writes_rows_and_restores_the_bridge(tmp_path,
                                                            launch):
  """Both stand-ins run both arms and leave forge_torch's bridge as it was;
  the direct one takes the direct launch's path for every update (its
  plans from the third step on)."""
  pytest.importorskip("torch")
  from benchmarks import torch_overhead
  from forge_torch import _bridge, _direct
  before = dict(vars(_bridge)), _direct.unavailable
  direct = _bridge.STATS.direct
  out = tmp_path / "o.csv"
  assert torch_overhead.main(["--out", str(out), "--layers", "2", "--steps",
                              "3", "--warmup", "1", "--launch",
                              launch]) == 0
  assert dict(vars(_bridge)) == before[0]
  assert _direct.unavailable is before[1]
  # 2 layers x 4 steps, every update launched (stood in for) directly
  assert _bridge.STATS.direct - direct == (8 if launch == "direct" else 0)
  with open(out) as f:
    rows = list(csv.DictReader(f))
  assert {(r["provider"], r["metric"]) for r in rows} == {
      (arm, m) for arm in ("torch", "forge")
      for m in (*torch_overhead.PHASES, "total")}
  assert all(float(r["p50"]) > 0 and r["unit"] == "us" for r in rows)
  assert {r["dtypes"] for r in rows} == {
      "float32" if launch == "stub" else "bfloat16"}


def test_torch_overhead_floor_arm_updates_nothing(tmp_path):
  """The floor arm trains nothing (its Function returns no weight
  gradient) and writes its rows beside the arms asked for."""
  torch = pytest.importorskip("torch")
  from benchmarks import torch_overhead
  layer = torch_overhead._floor_linear()(4, 3, bias=False)
  before = layer.weight.detach().clone()
  x = torch.randn(2, 4, requires_grad=True)
  layer(x).square().sum().backward()
  assert layer.weight.grad is None and torch.equal(layer.weight, before)
  torch.testing.assert_close(x.grad, 2 * (x @ before.t()) @ before)
  out = tmp_path / "o.csv"
  assert torch_overhead.main(["--out", str(out), "--layers", "2", "--steps",
                              "2", "--warmup", "1", "--arms", "floor",
                              "torch"]) == 0
  with open(out) as f:
    rows = list(csv.DictReader(f))
  assert {r["provider"] for r in rows} == {"torch", "floor"}


def test_torch_overhead_lean_arm_keeps_its_checks(tmp_path):
  """The lean arm (on the CPU: its launch stood in) updates nothing,
  returns the input's gradient, refuses a second use in one step and (by
  its version bumps) a second backward through one graph, steps its counts
  once per step() and writes its rows."""
  torch = pytest.importorskip("torch")
  from benchmarks import lean_layer, torch_overhead
  linear, optimizer, _ = lean_layer.make()
  layer = linear(4, 3, bias=False)
  opt = optimizer(layer.parameters(), lr=1e-3)
  before = layer.weight.detach().clone()
  x = torch.randn(2, 4, requires_grad=True)
  y = layer(x)
  with pytest.raises(RuntimeError, match="called a second time"):
    layer(x)
  y.square().sum().backward(retain_graph=True)
  assert layer.weight.grad is None and torch.equal(layer.weight, before)
  torch.testing.assert_close(x.grad, 2 * (x @ before.t()) @ before)
  # A second backward through the graph: the version bump refuses it.
  with pytest.raises(RuntimeError, match="modified by an inplace operation"):
    y.square().sum().backward()
  opt.step()
  assert opt.counts.tolist() == [1.0]
  layer(x).sum().backward()  # a new step: used and updated once again
  with pytest.raises(ValueError, match="no bias"):
    linear(4, 3)
  out = tmp_path / "o.csv"
  assert torch_overhead.main(["--out", str(out), "--layers", "2", "--steps",
                              "2", "--warmup", "1", "--arms", "lean",
                              "floor"]) == 0
  with open(out) as f:
    assert {r["provider"] for r in csv.DictReader(f)} == {"floor", "lean"}


def test_lean_convert_takes_the_bias_free_linears():
  """convert() makes every bias-free nn.Linear a lean layer (and those
  alone), each with its plan: a model converted trains its input's
  gradient through them."""
  torch = pytest.importorskip("torch")
  from benchmarks import lean_layer
  linear, optimizer, convert = lean_layer.make()
  model = torch.nn.Sequential(torch.nn.Linear(4, 5, bias=False),
                              torch.nn.Linear(5, 3),
                              torch.nn.Linear(3, 2, bias=False))
  assert convert(model) == ["0", "2"]
  assert [type(m) is linear for m in model] == [True, False, True]
  opt = optimizer(model.parameters(), lr=1e-3)
  x = torch.randn(2, 4, requires_grad=True)
  model(x).sum().backward()
  assert x.grad is not None and model[0].weight.grad is None
  assert model[1].weight.grad is not None  # the standard layer's
  opt.step()
  assert opt.counts.tolist() == [1.0, 1.0]


def _cuda():
  try:
    import torch  # noqa: PLC0415
  except ImportError:
    return False
  return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device for torch")
@pytest.mark.parametrize("n_in,n_out", [(256, 640), (640, 256), (384, 384)])
def test_gpu_lean_layer_launches_forge_torchs_update(n_in, n_out):
  """On CUDA the lean layer's backward launches forge_torch's compiled
  kernel with its operands in forge_torch's order: from the same weight,
  slots and batch, its update is forge_torch.AdamW's third step bit for
  bit (the scalars real_launch fixed are that step's), on non-square
  shapes both ways and a square one (where swapped operands give G^T)."""
  import torch  # noqa: PLC0415

  import forge_torch  # noqa: PLC0415
  from benchmarks import lean_layer  # noqa: PLC0415
  bt = 128
  torch.manual_seed(0)
  linear, optimizer, _ = lean_layer.make("cuda", bt)
  x = torch.randn(bt, n_in, device="cuda", dtype=torch.bfloat16)
  ref = forge_torch.Linear(n_in, n_out, bias=False).to("cuda", torch.bfloat16)
  opt = forge_torch.AdamW(ref.parameters(), lr=1e-3, fused=True)
  for _ in range(2):
    ref(x).float().square().mean().backward()
    opt.step()
  state = opt.state[ref.weight]
  lean = linear(n_in, n_out, bias=False).to("cuda", torch.bfloat16)
  lean_opt = optimizer(lean.parameters(), lr=1e-3, fused=True)
  plan = lean.plan
  with torch.no_grad():
    lean.weight.copy_(ref.weight)
    plan.slots[0].copy_(state["exp_avg"])
    plan.slots[1].copy_(state["exp_avg_sq"])
  before = lean.weight.detach().clone()
  ref(x).float().square().mean().backward()  # forge_torch's third update
  lean(x).float().square().mean().backward()
  torch.cuda.synchronize()
  assert not torch.equal(lean.weight, before)
  assert torch.equal(lean.weight, ref.weight)
  assert torch.equal(plan.slots[0], state["exp_avg"])
  assert torch.equal(plan.slots[1], state["exp_avg_sq"])
  del lean_opt


def test_torch_overhead_on_cuda_without_a_gpu_measures_nothing(
    tmp_path, capsys, monkeypatch):
  torch = pytest.importorskip("torch")
  from benchmarks import torch_overhead
  monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
  out = tmp_path / "o.csv"
  assert torch_overhead.main(["--device", "cuda", "--out", str(out)]) == 1
  assert "no CUDA device" in capsys.readouterr().err
  assert not out.exists()


def test_torch_overhead_refuses_a_stand_in_on_cuda(capsys):
  pytest.importorskip("torch")
  from benchmarks import torch_overhead
  with pytest.raises(SystemExit) as e:
    torch_overhead.main(["--device", "cuda", "--launch", "direct"])
  assert e.value.code == 2
  assert "--launch is for the CPU" in capsys.readouterr().err


# --- output paths: checked when the command line is parsed ----------------
# (module, the arguments before the output flag, the flag); each module's
# every flag that names a file or folder it writes.
OUTPUTS = [
    ("backends", [], "--out"), ("backends", [], "--plot"),
    ("bf16_error", [], "--out"),
    ("clipping", [], "--out"), ("clipping", [], "--plot"),
    ("e2e", [], "--out"), ("e2e", [], "--plot"),
    ("e2e_paired", [], "--out"), ("e2e_paired", [], "--plot"),
    ("e2e_profile", [], "--out"),
    ("epilogue_probe", [], "--out"),
    ("families", [], "--out"),
    ("kernel", [], "--out"),
    ("launch_overhead", [], "--out"), ("launch_overhead", [], "--plot"),
    ("llama8b", [], "--out"), ("llama8b", [], "--plot"),
    ("low_precision", ["error"], "--out"), ("low_precision", ["sr"], "--out"),
    ("memory", [], "--out"),
    ("ncu_summary", ["ncu.csv"], "--out"),
    ("plan_checks", [], "--out"), ("plan_checks", [], "--build-dir"),
    ("plot", ["k.csv"], None),
    ("scan_memory", [], "--out"),
    ("torch_call", [], "--out"), ("torch_call", [], "--plot"),
    ("torch_e2e", [], "--out"), ("torch_e2e", [], "--plot"),
    ("torch_e2e", [], "--out-dir"),
    ("torch_memory", [], "--out"),
    ("torch_overhead", [], "--out"),
    ("memory", [], "--hlo-dir"),
    ("e2e_paired", [], "--hlo-dir"), ("e2e_paired", [], "--autotune-cache"),
    ("e2e", [], "--autotune-cache"),
    ("e2e_profile", [], "--keep-trace"),
]
FOLDERS = {("epilogue_probe", "--out"), ("torch_e2e", "--out-dir"),
           ("memory", "--hlo-dir"), ("e2e_paired", "--hlo-dir"),
           ("e2e_paired", "--autotune-cache"), ("e2e", "--autotune-cache"),
           ("e2e_profile", "--keep-trace"), ("plan_checks", "--build-dir")}
# The flags that name a file or folder a benchmark writes.
OUTPUT_FLAGS = ("--out", "--plot", "--out-dir", "--hlo-dir", "--keep-trace",
                "--autotune-cache", "--build-dir")


def _parse_only(module, argv, monkeypatch):
  """Runs ``module``'s main on ``argv`` with everything after the parse
  refused: returns its exit code (argparse's 2) or fails."""
  import argparse
  import importlib
  if module.startswith("torch_"):
    pytest.importorskip("torch")
  mod = importlib.import_module(f"benchmarks.{module}")
  real = argparse.ArgumentParser.parse_args

  def parse_args(self, args=None, namespace=None):
    real(self, args, namespace)
    raise AssertionError(f"{module}: {argv} parsed; the path was not refused")

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
  with pytest.raises(SystemExit) as e:
    if module == "torch_memory":
      monkeypatch.setattr(sys, "argv", ["torch_memory.py", *argv])
      mod.main()
    else:
      mod.main(argv)
  return e.value.code


@pytest.mark.parametrize("module,before,flag", OUTPUTS)
def test_an_output_path_that_cannot_be_written_is_refused_before_running(
    tmp_path, monkeypatch, capsys, module, before, flag):
  """A folder where a file goes (a file where a folder goes), and a path
  under a regular file: one usage line naming the path, before anything is
  measured (a benchmark used to run, then fail writing its CSV or plot)."""
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  folder_flag = (module, flag) in FOLDERS
  wrong_kind = blocker if folder_flag else tmp_path
  for path, says in ((wrong_kind, "a file" if folder_flag else "a folder"),
                     (blocker / "sub" / "out.csv", "cannot write")):
    argv = before + ([str(path)] if flag is None else [flag, str(path)])
    if module == "plot":
      argv = ["k.csv", str(path)]
    assert _parse_only(module, argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert says in err and str(path) in err, err
    assert "Traceback" not in err
  assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_an_output_path_check_leaves_no_file_behind(tmp_path, monkeypatch):
  """The check creates a missing file (and its missing folders) to learn
  that it can be written, then removes them; an existing file is opened
  for appending and left as it was, and one that cannot be opened so (a
  read-only file system) is refused."""
  from benchmarks import paths
  new = tmp_path / "made" / "deeper" / "r.csv"
  assert paths.out_file(str(new)) == str(new)
  assert not (tmp_path / "made").exists()
  old = tmp_path / "old.csv"
  old.write_text("a,b\n1,2\n")
  with monkeypatch.context() as m:
    def refused(*a, **k):
      raise PermissionError(30, "Read-only file system")
    m.setattr(paths.os, "open", refused)
    with pytest.raises(argparse.ArgumentTypeError,
                       match="cannot write .*Read-only file system"):
      paths.out_file(str(old))
  assert paths.out_file(str(old)) == str(old)
  assert old.read_text() == "a,b\n1,2\n"
  assert paths.out_file_or_stdout("-") == "-"
  d = tmp_path / "d" / "e"
  assert paths.out_dir(str(d)) == str(d) and not (tmp_path / "d").exists()
  d.mkdir(parents=True)
  assert paths.out_dir(str(d)) == str(d) and os.listdir(d) == []
  assert sorted(os.listdir(tmp_path)) == ["d", "old.csv"]


def test_every_output_flag_is_checked_when_parsed():
  """Each benchmark flag that names a file or folder it writes (--out,
  --plot, --out-dir, --hlo-dir, --keep-trace, --autotune-cache,
  --build-dir) takes one of benchmarks/paths.py's types, and the test
  above covers it."""
  import re
  found, unchecked = set(), []
  bench = os.path.join(ROOT, "benchmarks")
  for name in sorted(os.listdir(bench)):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(bench, name)) as f:
      text = f.read()
    flags = "|".join(OUTPUT_FLAGS)
    for m in re.finditer(r'add_argument\(\s*"(' + flags + r')",'
                         r'([^)]*)', text):
      found.add((name[:-3], m.group(1)))
      if "type=paths." not in m.group(2):
        unchecked.append((name, m.group(1)))
  assert not unchecked
  assert found == {(m, f) for m, _, f in OUTPUTS if f is not None}


@pytest.mark.parametrize("module,flag", sorted(
    (m, f) for m, f in FOLDERS if f not in ("--out", "--out-dir")))
def test_an_impossible_output_folder_is_refused_when_parsed(
    monkeypatch, capsys, module, flag):
  """--hlo-dir, --keep-trace and --autotune-cache (a folder XLA reads and
  writes its autotune results in) name folders the run writes into: one
  that cannot be made (/proc/x) is a usage line, not a traceback after the
  measurement."""
  assert _parse_only(module, [flag, "/proc/x"], monkeypatch) == 2
  err = capsys.readouterr().err
  assert "cannot write '/proc/x'" in err and flag in err, err
  assert "Traceback" not in err


def test_an_existing_file_that_cannot_be_written_is_refused(
    tmp_path, monkeypatch, capsys):
  """An existing --out that takes no rows (/proc/version; a read-only file
  where the user is not root) is refused in words when parsed, not after
  the measurement with a traceback from the CSV append."""
  from benchmarks import paths
  if os.path.exists("/proc/version"):
    assert _parse_only("bf16_error", ["--out", "/proc/version"],
                       monkeypatch) == 2
    err = capsys.readouterr().err
    assert "cannot write '/proc/version'" in err, err
    assert "Traceback" not in err
  ro = tmp_path / "ro.csv"
  ro.write_text("a,b\n")
  with monkeypatch.context() as m:  # (root passes os.access on a 0o444 file)
    m.setattr(paths.os, "access", lambda path, mode: False)
    with pytest.raises(argparse.ArgumentTypeError,
                       match="exists and is not writable"):
      paths.out_file(str(ro))
  assert ro.read_text() == "a,b\n"


def test_families_tokens_must_be_positive(monkeypatch, capsys):
  for bad in ("0", "-512"):
    assert _parse_only("families", ["--tokens", bad], monkeypatch) == 2
    err = capsys.readouterr().err
    assert "--tokens" in err and "must be >= 1" in err, err


def test_a_pipe_or_device_given_as_output_is_taken_unopened(tmp_path):
  """An existing target that is no regular file (a FIFO, /dev/null) is
  taken as it is: never opened by the check (a reader waiting on a FIFO
  would get an end of file)."""
  from benchmarks import paths
  fifo = tmp_path / "fifo"
  os.mkfifo(fifo)
  assert paths.out_file(str(fifo)) == str(fifo)  # (opening it would block)
  assert paths.out_file(os.devnull) == os.devnull


def test_a_leading_tilde_is_expanded_before_the_check(tmp_path, monkeypatch):
  """``--out=~/x.csv`` (the shell expands no ``~`` after ``=``): the path
  checked and returned is the home folder's, and no ``./~`` is made."""
  from benchmarks import paths
  home, cwd = tmp_path / "home", tmp_path / "cwd"
  home.mkdir()
  cwd.mkdir()
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.chdir(cwd)
  assert paths.out_file("~/r/x.csv") == str(home / "r" / "x.csv")
  assert paths.out_dir("~/cache") == str(home / "cache")
  assert list(cwd.iterdir()) == [] and list(home.iterdir()) == []


def test_e2e_profile_top_zero_lists_no_kernels(monkeypatch):
  """``--top 0`` (only the totals) is a valid count."""
  import argparse
  from benchmarks import e2e_profile
  real = argparse.ArgumentParser.parse_args
  got = {}

  def parse_args(self, args=None, namespace=None):
    got["args"] = real(self, args, namespace)
    raise SystemExit(0)

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
  with pytest.raises(SystemExit) as e:
    e2e_profile.main(["--top", "0"])
  assert e.value.code == 0 and got["args"].top == 0


@pytest.mark.parametrize("flag", ["--layers", "--dim", "--steps"])
def test_torch_memory_counts_must_be_positive(monkeypatch, capsys, flag,
                                             tmp_path):
  assert _parse_only("torch_memory", ["--out", str(tmp_path / "m.csv"),
                                      flag, "0"], monkeypatch) == 2
  err = capsys.readouterr().err
  assert flag in err and "must be >= 1" in err, err


def test_torch_overhead_profile_must_not_be_negative(monkeypatch, capsys):
  assert _parse_only("torch_overhead", ["--profile", "-1"], monkeypatch) == 2
  err = capsys.readouterr().err
  assert "--profile" in err and "must be >= 0" in err, err
  from benchmarks import common
  assert common.non_negative_int("0") == 0


@pytest.mark.parametrize("module,argv", [
    ("bf16_error", ["--lrs", "-0.1"]), ("bf16_error", ["--lrs", "0"]),
    ("bf16_error", ["--lrs", "1e-3", "nan"]),
    ("low_precision", ["sr", "--out", "OUT", "--lr", "-1"]),
    ("low_precision", ["error", "--out", "OUT", "--lrs", "0"]),
])
def test_learning_rates_must_be_positive(tmp_path, monkeypatch, capsys,
                                         module, argv):
  argv = [str(tmp_path / "o.csv") if a == "OUT" else a for a in argv]
  assert _parse_only(module, argv, monkeypatch) == 2
  err = capsys.readouterr().err
  assert "must be a finite number > 0" in err and "Traceback" not in err, err
  assert os.listdir(tmp_path) == []


def test_suite_help_prints_its_usage_and_refuses_a_flag_for_a_folder(
    tmp_path):
  """suite.sh -h / --help prints its header comment (exit 0) instead of
  taking "--help" as the output folder; any other OUT_DIR starting with '-'
  is refused in words (exit 2); neither makes a folder or measures."""
  for flag in ("-h", "--help"):
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "suite.sh"),
                        flag], cwd=tmp_path, env=dict(ENV, PYTHON=PY),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "benchmarks/suite.sh [OUT_DIR [PART...]]" in p.stdout, p.stdout
    assert "set -euo" not in p.stdout and "sees no GPU" not in p.stderr
  p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "suite.sh"),
                      "--out"], cwd=tmp_path, env=dict(ENV, PYTHON=PY),
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 2, (p.returncode, p.stderr)
  assert "'--out' starts with '-'" in p.stderr, p.stderr
  assert os.listdir(tmp_path) == []
  assert not os.path.exists(os.path.join(ROOT, "--help"))
  assert not os.path.exists(os.path.join(ROOT, "--out"))


def test_scan_memory_cells_check_the_parents_out_not_the_default(
    tmp_path, monkeypatch):
  """scan_memory's cells get the parent's --out (absolute): a cell's
  command line is checked like the parent's, so a cell left with the
  default would check out/bench/ in the repository, failing where that
  cannot be written though the parent's --out can."""
  from benchmarks import scan_memory
  calls = []

  class Done:
    returncode = 0
    stdout = ('RESULT {"arm": "a", "temp": 1, "base": 1, "peak": 2, '
              '"step_peak": 1, "losses": [1.0], "device": "cpu:cpu"}')
    stderr = ""

  real = scan_memory.subprocess.run

  def run(cmd, **kw):
    if cmd[:3] != [sys.executable, "-m", "benchmarks.scan_memory"]:
      return real(cmd, **kw)  # (the CSV's commit column: git)
    calls.append(cmd)
    return Done()

  monkeypatch.setattr(scan_memory.subprocess, "run", run)
  out = tmp_path / "s.csv"
  scan_memory.main(["--out", str(out), "--layers", "2", "--width", "64",
                    "--tokens", "16"])
  assert len(calls) == 2 and out.exists()
  for cmd in calls:
    assert cmd[cmd.index("--out") + 1] == str(out)


_DRIVER = """
import signal, sys
from benchmarks import e2e
signal.signal(signal.SIGINT, signal.default_int_handler)
e2e.run_tagged([sys.executable, "-c",
                "import os, time; print(os.getpid(), flush=True); "
                "open(sys.argv[1], 'w').write(str(os.getpid())); "
                "time.sleep(120)", sys.argv[1]],
               None, 300, "cell", "TAG ")
"""


def _running(pid: int) -> bool:
  """Whether process ``pid`` runs (a zombie, killed and not yet reaped,
  does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_driver_stopped_by_a_signal_stops_its_cell(tmp_path, sig):
  """A cell runs in its own session, out of reach of a terminal's Ctrl-C:
  the driver interrupted (SIGINT) or terminated (SIGTERM) while it waits
  kills the cell's process group as it leaves."""
  import signal  # noqa: PLC0415
  import time  # noqa: PLC0415

  pid_file = tmp_path / "cell.pid"
  driver = subprocess.Popen(
      [PY, "-c", _DRIVER.replace("sys.argv[1]", repr(str(pid_file)))],
      cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
      assert driver.poll() is None and time.monotonic() < deadline, (
          driver.stdout.read() if driver.poll() is not None else "no cell")
      time.sleep(0.05)
    cell = int(pid_file.read_text())
    driver.send_signal(getattr(signal, sig))
    driver.wait(timeout=30)
    assert driver.returncode != 0
    deadline = time.monotonic() + 10
    while _running(cell) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not _running(cell), "the cell is still running"
  finally:
    if driver.poll() is None:
      driver.kill()


def test_plan_checks_times_both_arms_taking_every_plan(tmp_path):
  """benchmarks.plan_checks builds the native host path, times the plan's
  update in Python and natively with every call taking its plan (it
  raises otherwise) and writes a row per arm. Where no C++ compiler or
  ninja is found it is skipped, saying so."""
  pytest.importorskip("torch")
  import importlib.util  # noqa: PLC0415
  import shutil  # noqa: PLC0415
  if (shutil.which("ninja") is None
      and importlib.util.find_spec("ninja") is None) or (
          shutil.which("c++") is None and shutil.which("g++") is None):
    pytest.skip("benchmarks.plan_checks builds forge_torch's native host "
                "path: needs a C++ compiler and ninja")
  from benchmarks import common, plan_checks  # noqa: PLC0415
  out = tmp_path / "pc.csv"
  assert plan_checks.main(["--out", str(out), "--rounds", "2", "--calls",
                           "50", "--build-dir", str(tmp_path / "build")]) == 0
  rows = {r["provider"]: r for r in common.read_rows(str(out))}
  assert set(rows) == {"python", "native", "loop"}
  assert all(r["benchmark"] == "plan_checks" and r["metric"] == "call_time"
             and float(r["p50"]) > 0 for r in rows.values())
