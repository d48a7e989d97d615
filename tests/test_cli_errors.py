"""The command-line entry points refuse bad input with a usage error (exit 2)
or a clean message instead of a traceback: the autotuner, benchmarks/kernel.py,
plot.py, e2e.py and the digits example (./dev.sh train)."""

import csv
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import HAS_GPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
# The benchmarks run as modules from the repository root: no PYTHONPATH.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

# A benchmarks/kernel.py CSV (the copy ceiling and two time rows, as an H200
# run writes them) and, beside it, a torch_memory.py CSV: a CSV of another
# kind.
_VERSIONS = "python 3.12.3; jax 0.11.2; jaxlib 0.11.2"
_KERNEL_ROWS = [
    ["kernel", "copy", "xla_copy", "2GiB", "f32", "bandwidth", "4028.43",
     "4028.43", "4028.43", "GB/s"],
    ["kernel", "q/o 4096x4096", "forge[64x128x64,g1,w4,s3]",
     "BT=512 4096x4096", "w=bf16,m/v=bfloat16", "time", "123.814", "124.05",
     "124.96", "us"],
    ["kernel", "q/o 4096x4096", "xla_unfused", "BT=512 4096x4096",
     "w=bf16,m/v=bfloat16", "time", "101.5", "102.0", "102.9", "us"],
]


@pytest.fixture
def kernel_csv(tmp_path):
  path = tmp_path / "kernel.csv"
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["benchmark", "case", "provider", "shape", "dtypes", "metric",
                "p20", "p50", "p80", "unit", "device", "versions",
                "timestamp"])
    for row in _KERNEL_ROWS:
      w.writerow(row + ["gpu:NVIDIA H200", _VERSIONS,
                        "2026-11-29T09:20:37+00:00"])
  return str(path)


@pytest.fixture
def torch_memory_csv(tmp_path):
  path = tmp_path / "torch_memory.csv"
  path.write_text(
      "arm,device,torch_version,jax_version,layers,dim,bt,dtype,peak_bytes\n"
      "torch,NVIDIA H200,2.11.0+cu130,0.11.2,8,4096,2048,bfloat16,"
      "1174410240\n")
  return str(path)

# benchmarks/kernel.py's CPU smoke mode (as tests/test_inputs_and_clis.py).
SMOKE = ["--torch", "on", "--tokens", "16", "--moments", "bfloat16",
         "--configs", "1", "--steps", "1", "--reps", "1", "--ceiling-mib", "1"]


def _run(args):
  return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True,
                        text=True, timeout=300)


def _code(fn, argv):
  """Exit code of a CLI main: its return value or SystemExit's code;
  any other exception propagates (that is the defect)."""
  try:
    return fn(argv)
  except SystemExit as e:
    return e.code


# --- pallas_kernels/autotune.py main ----------------------------------------

def test_autotune_from_csv_of_wrong_kind_is_usage_error(tmp_path,
                                                        torch_memory_csv):
  """A CSV that is not a kernel.py CSV (e.g. the torch_memory.csv shipped
  beside kernel.csv) is a usage error (it was a KeyError traceback)."""
  from pallas_kernels import autotune
  assert _code(autotune.main, ["--from-csv", torch_memory_csv,
                               "--out", str(tmp_path / "a.json")]) == 2


def test_autotune_out_in_missing_directory_is_usage_error(tmp_path,
                                                          kernel_csv):
  """--out in a folder that does not exist is refused before anything is
  read or measured (it was a FileNotFoundError from write(), on the GPU path
  after the first tuned case)."""
  from pallas_kernels import autotune
  out = tmp_path / "nodir" / "a.json"
  assert _code(autotune.main,
               ["--from-csv", kernel_csv, "--out", str(out)]) == 2


def test_autotune_out_that_cannot_be_written_is_a_plain_error(
    tmp_path, kernel_csv, capsys, monkeypatch):
  """--out naming a folder is a usage error; a write that fails (a full
  disk, a folder the user cannot write) says so in one line, not a
  traceback from write()."""
  from pallas_kernels import autotune
  assert _code(autotune.main, ["--from-csv", kernel_csv,
                               "--out", str(tmp_path)]) == 2
  assert "is a folder" in capsys.readouterr().err

  def full(*a, **k):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(autotune.json, "dump", full)
  out = tmp_path / "a.json"
  assert _code(autotune.main, ["--from-csv", kernel_csv,
                               "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "could not write --out" in err and "No space left" in err
  assert "Traceback" not in err and not out.exists()
  assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_autotune_from_csv_refuses_measurement_only_flags(tmp_path,
                                                          kernel_csv):
  """--rule lion (and --shapes/--tokens/--w-dtype/--slot-dtype) with
  --from-csv were accepted and silently ignored (the entries went under
  'adamw'). They are refused, as --config is."""
  from pallas_kernels import autotune
  assert _code(autotune.main, ["--from-csv", kernel_csv, "--rule", "lion",
                               "--out", str(tmp_path / "b.json")]) == 2


# --- benchmarks/plot.py -------------------------------------------------------

def test_plot_non_kernel_csv_is_clean_error(tmp_path):
  """plot.py on a file without the kernel CSV columns: a message, exit 1."""
  text = tmp_path / "notes.md"
  text.write_text("# notes\n\nnot a CSV of kernel rows\n")
  p = _run([PY, "-m", "benchmarks.plot", str(text), str(tmp_path / "x.png")])
  assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-400:]


def test_plot_into_missing_directory(tmp_path, kernel_csv):
  """A PNG path in a missing folder: the folder is created, as Results does
  for CSVs (it was a FileNotFoundError from savefig)."""
  png = tmp_path / "nodir" / "x.png"
  p = _run([PY, "-m", "benchmarks.plot", kernel_csv, str(png)])
  assert "Traceback" not in p.stderr, p.stderr[-400:]
  assert p.returncode == 0 and png.exists(), p.stderr[-400:]


# --- benchmarks/kernel.py -----------------------------------------------------

def test_kernel_zero_size_shape_is_usage_error(tmp_path):
  """--shapes 't 0x24' is a usage error before any row is written (it was a
  RuntimeError after the copy-ceiling row)."""
  from benchmarks import kernel
  out = tmp_path / "k.csv"
  assert _code(kernel.main, SMOKE + ["--shapes", "t 0x24",
                                     "--out", str(out)]) == 2
  assert not out.exists()


def test_kernel_torch_on_without_torch_is_clean_error(tmp_path, monkeypatch,
                                                      capsys):
  """--torch on where torch cannot be imported: a usage error, not the
  ImportError's traceback (nor the no-GPU refusal, which also exits
  non-zero)."""
  from benchmarks import kernel
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
  rc = _code(kernel.main, SMOKE + ["--shapes", "t 40x24",
                                   "--out", str(tmp_path / "k.csv")])
  assert rc == 2
  assert "torch cannot be imported" in capsys.readouterr().err


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_kernel_without_gpu_exits_nonzero(tmp_path):
  """No GPU, default --torch auto: 'needs a GPU; nothing measured' and a
  non-zero exit, as suite.sh (1) and the autotuner (2)."""
  from benchmarks import kernel
  assert _code(kernel.main, ["--out", str(tmp_path / "k.csv")]) not in (0, None)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
@pytest.mark.parametrize("name,args", [
    ("families", []), ("clipping", []), ("epilogue_probe", []),
    ("backends", ["--tokens", "64"])])
def test_gpu_benchmarks_without_gpu_exit_nonzero(tmp_path, capsys, name,
                                                 args):
  """Every benchmark that needs a GPU says so on stderr and exits 1 without
  one, as kernel.py does (a script, suite.sh among them, must not take
  "nothing measured" for a run), and writes no CSV."""
  import importlib
  mod = importlib.import_module(f"benchmarks.{name}")
  out = tmp_path / "o"
  assert _code(mod.main, args + ["--out", str(out)]) == 1
  assert "needs a GPU" in capsys.readouterr().err
  assert not out.exists()


def test_torch_memory_without_cuda_exits_nonzero(tmp_path, capsys,
                                                 monkeypatch):
  """torch_memory, likewise, without CUDA (its children never start)."""
  torch = pytest.importorskip("torch")
  if torch.cuda.is_available():
    pytest.skip("checks the no-GPU path")
  from benchmarks import torch_memory
  out = tmp_path / "t.csv"
  monkeypatch.setattr(sys, "argv", ["torch_memory.py", "--out", str(out)])
  assert _code(lambda argv: torch_memory.main(), None) == 1
  assert "Nothing measured" in capsys.readouterr().err
  assert not out.exists()


def test_torch_e2e_without_torch_says_so_and_exits_1(monkeypatch):
  """Run as a command without torch: one line naming the missing extra
  and exit status 1 (a string exit code), not an ImportError traceback."""
  import runpy
  monkeypatch.setitem(sys.modules, "torch", None)
  monkeypatch.delitem(sys.modules, "benchmarks.torch_e2e", raising=False)
  with pytest.raises(SystemExit) as e:
    runpy.run_module("benchmarks.torch_e2e", run_name="__main__")
  assert isinstance(e.value.code, str)  # printed to stderr, status 1
  assert "needs torch" in e.value.code and "Nothing measured" in e.value.code


def test_kernel_configs_beyond_curated_list_is_refused(tmp_path):
  """--configs beyond the curated tilings is refused (it was clamped)."""
  from benchmarks import kernel
  assert _code(kernel.main, SMOKE + ["--configs", "99", "--shapes", "t 40x24",
                                     "--out", str(tmp_path / "k.csv")]) == 2


# --- benchmarks/e2e.py --------------------------------------------------------

TINY = ["--layers", "1", "--d-model", "64", "--heads", "2", "--kv-heads", "1",
        "--ffn", "64", "--vocab", "64", "--seq", "16", "--bt", "16"]


def test_e2e_failed_rows_carry_the_device(tmp_path, monkeypatch):
  """docs/benchmarks.md promises device, versions and commit in every row:
  a failed cell before any successful one asks a subprocess for the device
  (it was written as 'unknown'), and carries the commit."""
  from benchmarks import e2e
  monkeypatch.setattr(e2e, "run_driver_cell",
                      lambda args, arm, bt, timeout: (None, "exit 1: boom"))
  out = tmp_path / "e.csv"
  e2e.main(TINY + ["--out", str(out)])
  with open(out, newline="") as f:
    rows = list(csv.DictReader(f))
  assert rows and all(r["device"] not in ("", "unknown") for r in rows), \
      [r["device"] for r in rows]
  # ... and the commit, as every row does.
  assert all(r["commit"] for r in rows), [r["commit"] for r in rows]


def test_e2e_replot_of_a_non_e2e_csv_refuses(tmp_path, kernel_csv):
  """--replot on a CSV without e2e rows plots nothing and fails."""
  from benchmarks import e2e
  png = tmp_path / "e.png"
  rc = _code(e2e.main, ["--replot", "--out", kernel_csv, "--plot", str(png)])
  assert rc not in (0, None) and not png.exists()


@pytest.mark.parametrize("bad", [["--cell-timeout", "0"],
                                 ["--cell-timeout", "-5"],
                                 ["--budget", "-1"]])
def test_e2e_nonpositive_timeouts_are_usage_errors(bad):
  """--cell-timeout 0/-5 (every cell would 'time out' at once) and --budget
  -1 (silently 'no budget') are usage errors."""
  from benchmarks import e2e
  with pytest.raises(SystemExit) as e:
    e2e.parse_args(TINY + bad)
  assert e.value.code == 2


# --- examples/train_digits.py (./dev.sh train) ------------------------------

def test_demo_out_that_is_a_file_is_usage_error(tmp_path):
  """--out naming an existing file is refused before training (it trained
  both arms, then died in os.makedirs)."""
  from examples import train_digits as demo
  f = tmp_path / "afile"
  f.write_text("x")
  with pytest.raises(SystemExit) as e:
    demo.main(["--steps", "1", "--hidden", "8", "--batch-size", "16",
               "--no-progress", "--out", str(f)])
  assert e.value.code == 2


def test_demo_negative_log_every_is_usage_error():
  """--log-every -1 is a usage error (it logged every step: i % -1 == 0)."""
  from examples import train_digits as demo
  with pytest.raises(SystemExit) as e:
    demo.parse_args(["--log-every", "-1"])
  assert e.value.code == 2


# --- e2e.py's device probe for failed rows (review of its own change) -------

TINY_E2E = ["--layers", "1", "--d-model", "64", "--heads", "2", "--kv-heads",
            "1", "--ffn", "64", "--vocab", "64", "--seq", "16"]


def _failing_cells(e2e, monkeypatch, cell_s=0.0):
  def cell(args, arm, bt, timeout):
    time.sleep(cell_s)
    return None, f"timeout after {timeout:.0f} s"
  monkeypatch.setattr(e2e, "run_driver_cell", cell)


def test_e2e_probe_is_not_repeated_for_every_failed_or_skipped_cell(
    tmp_path, monkeypatch):
  """A probe that fails (returns 'unknown': the GPU is wedged, the very case
  in which cells time out) is not retried for every later failed cell (each
  a fresh JAX start of up to 120 s): once per driver."""
  from benchmarks import e2e
  _failing_cells(e2e, monkeypatch)
  calls = []
  monkeypatch.setattr(e2e, "probe_device",
                      lambda **kw: calls.append(1) or "unknown")
  e2e.main(TINY_E2E + ["--bt", "16", "32", "--arms", "optax", "forge",
                   "--out", str(tmp_path / "e.csv")])
  assert len(calls) <= 1, f"probe_device ran {len(calls)} times in one driver"


def test_e2e_probe_respects_the_budget(tmp_path, monkeypatch):
  """--budget bounds the driver (suite.sh: --budget 250 and 170; a caller
  may run it under an outer `timeout` only a little above its --budget):
  the probe's subprocess gets at most what is left of it."""
  from benchmarks import e2e
  _failing_cells(e2e, monkeypatch)
  seen = []
  real_run = subprocess.run

  def fake_run(cmd, *a, **kw):
    if "device_name" in " ".join(map(str, cmd)):
      seen.append(kw.get("timeout"))
      raise subprocess.TimeoutExpired(cmd, kw.get("timeout") or 0)
    return real_run(cmd, *a, **kw)
  monkeypatch.setattr(e2e.subprocess, "run", fake_run)
  e2e.main(TINY_E2E + ["--bt", "16", "--arms", "optax", "--budget", "30",
                   "--out", str(tmp_path / "e.csv")])
  assert seen, "probe_device was not called"
  assert all(t is not None and t <= 30 for t in seen), (
      f"probe timeouts {seen} s exceed the 30 s --budget")


def test_e2e_no_probe_once_the_budget_is_spent(tmp_path, monkeypatch):
  """A cell skipped with 'skipped: --budget N s spent' runs nothing, and
  starts no device probe either."""
  from benchmarks import e2e
  _failing_cells(e2e, monkeypatch, cell_s=0.3)
  monkeypatch.setattr(e2e.time, "perf_counter",
                      iter(range(0, 10_000, 100)).__next__)  # 100 s per read
  probes = []
  monkeypatch.setattr(e2e, "probe_device",
                      lambda **kw: probes.append(1) or "unknown")
  e2e.main(TINY_E2E + ["--bt", "16", "32", "64", "--arms", "optax",
                   "--budget", "150", "--out", str(tmp_path / "e.csv")])
  # The clock reads 100 s apart: the 150 s budget is spent by the time cell
  # 1 fails, so no probe starts.
  assert probes == [], f"{len(probes)} probes after the budget was spent"
