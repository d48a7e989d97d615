"""Bad inputs to the kernel API, the torch bridge and the commands (CPU):
each is refused with a message (an argparse-style exit, a ValueError or a
TypeError), never a crash deep inside or a silently wrong result."""
import csv

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import ADAMW, BlockConfig

H = ADAMW.pack(lr=1e-2, b1=0.9, b2=0.999, one_minus_b1=0.1,
               one_minus_b2=0.001, eps=1e-8, eps_root=0.0, bc1=0.1,
               bc2=0.001, bc1_next=0.19, weight_decay=1e-2)


def _refuses_cleanly(fn, *args):
  """A bad flag ends in an argparse-style exit (SystemExit, code != 0) or a
  non-zero return code; any other exception is a crash."""
  try:
    rc = fn(*args)
  except SystemExit as e:
    rc = e.code
  assert rc not in (0, None), f"accepted (rc={rc!r})"


def _usage_error(capsys, flag, fn, *args):
  """``fn(*args)`` refuses ``flag`` as argparse does: exit code 2 and a
  message naming the flag (a refusal for another reason, such as no GPU,
  does not count)."""
  with pytest.raises(SystemExit) as e:
    fn(*args)
  assert e.value.code == 2
  assert flag in capsys.readouterr().err


# --- pallas_kernels ----------------------------------------------------------


@pytest.mark.parametrize("kwargs", [dict(num_warps=4.0), dict(num_warps=True),
                                    dict(group_in=True)])
def test_blockconfig_rejects_non_int_knobs(kwargs):
  with pytest.raises(ValueError, match="must be"):
    BlockConfig(**kwargs)


def test_hparams_not_an_array_fails_with_a_message():
  x, dy, w = jnp.ones((5, 20)), jnp.ones((5, 24)), jnp.ones((20, 24))
  with pytest.raises((TypeError, ValueError), match="hparams"):
    pk.fused_wgrad_update(x, dy, w, (w, w), list(np.asarray(H)), rule=ADAMW,
                          interpret=True)


@pytest.mark.parametrize("n_in,n_out", [(0, 24), (20, 0)])
def test_zero_size_weight_fails_with_a_message(n_in, n_out):
  x, dy = jnp.ones((5, n_in)), jnp.ones((5, n_out))
  w = jnp.ones((n_in, n_out))
  with pytest.raises(ValueError, match="zero-size"):
    pk.fused_wgrad_update(x, dy, w, (w, w), H, rule=ADAMW, interpret=True)


# --- forge_torch._bridge.fused_update ----------------------------------------


def test_bridge_refuses_float64_instead_of_computing_in_fp32():
  torch = pytest.importorskip("torch")
  from forge_torch import _bridge
  from pallas_kernels.torch_rules import adamw_hparams
  x = torch.randn(8, 20, dtype=torch.float64)
  dy = torch.randn(8, 24, dtype=torch.float64)
  w = torch.randn(20, 24, dtype=torch.float64)
  s = [torch.zeros_like(w), torch.zeros_like(w)]
  h = adamw_hparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, step=1)
  # JAX would import them as float32 and copy fp32 results back.
  with pytest.raises(TypeError, match="float64"):
    _bridge.fused_update(x, dy, w, s, h)


# --- ./dev.sh train (examples/train_digits.py) --------------------------------


def test_demo_batch_size_too_large_is_a_usage_error(tmp_path):
  from examples import train_digits as demo
  _refuses_cleanly(demo.main, ["--steps", "1", "--batch-size", "5000",
                               "--no-progress", "--out", str(tmp_path)])


def test_demo_bench_steps_zero_does_not_crash(tmp_path):
  from examples import train_digits as demo
  argv = ["--steps", "1", "--hidden", "8", "--batch-size", "16", "--bench",
          "on", "--bench-steps", "0", "--no-progress", "--out", str(tmp_path)]
  with pytest.raises(SystemExit) as e:  # a usage error, not a crash
    demo.main(argv)
  assert e.value.code == 2


# --- benchmarks/kernel.py (CPU smoke mode, --torch on) ------------------------

_K = ["--torch", "on", "--shapes", "40x24", "--tokens", "16", "--moments",
      "bfloat16", "--configs", "1", "--steps", "2", "--reps", "2",
      "--ceiling-mib", "1"]


@pytest.mark.parametrize("bad", [
    ["--moments", "foo"], ["--config", "64x128"], ["--steps", "0"],
    ["--reps", "0"], ["--ceiling-mib", "0"], ["--configs", "0"]])
def test_kernel_bench_bad_flags_refuse(bad, tmp_path, monkeypatch):
  pytest.importorskip("torch")  # kernel.py imports it for its torch arms
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  from benchmarks import kernel
  _refuses_cleanly(kernel.main, _K + bad + ["--out", str(tmp_path / "k.csv")])


# --- benchmarks/e2e.py ---------------------------------------------------------


@pytest.mark.parametrize("bad", [
    ["--bt", "16", "--seq", "0"],
    ["--d-model", "64", "--heads", "3"],
])
def test_e2e_bad_flags_refuse(bad, tmp_path, capsys):
  from benchmarks import e2e
  _usage_error(capsys, bad[-2], e2e.main,
               bad + ["--out", str(tmp_path / "e.csv")])


def test_e2e_replot_missing_csv_refuses(tmp_path):
  from benchmarks import e2e
  _refuses_cleanly(e2e.main, ["--replot", "--out", str(tmp_path / "no.csv"),
                              "--plot", str(tmp_path / "p.png")])


# --- benchmarks/e2e_profile.py -------------------------------------------------


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU refusal")
def test_e2e_profile_refuses_on_cpu_before_running_the_model(monkeypatch):
  # GPU only (docs/benchmarks.md): it must not build and run the 0.89 B
  # model in interpret mode first.
  from benchmarks import e2e_profile as ep

  def boom(*a, **k):
    raise AssertionError("profile_arm ran on a CPU-only machine")
  monkeypatch.setattr(ep, "profile_arm", boom)
  _refuses_cleanly(ep.main, ["--layers", "1", "--out", "/dev/null"])


def test_e2e_profile_warmup_zero_is_a_usage_error(capsys):
  from benchmarks import e2e_profile as ep
  _usage_error(capsys, "--warmup", ep.main,
               ["--layers", "1", "--warmup", "0", "--steps", "1",
                "--arms", "forge", "--out", "/dev/null"])


# --- python -m pallas_kernels.autotune -----------------------------------------


def test_autotune_from_csv_missing_file_is_a_usage_error(tmp_path):
  from pallas_kernels import autotune
  _refuses_cleanly(autotune.main, ["--from-csv", str(tmp_path / "no.csv"),
                                   "--out", str(tmp_path / "t.json")])


def test_autotune_from_csv_without_rows_is_a_usage_error(tmp_path):
  from pallas_kernels import autotune
  p = tmp_path / "empty.csv"
  with open(p, "w", newline="") as f:
    csv.writer(f).writerow(["benchmark", "case", "provider", "shape",
                            "dtypes", "metric", "p20", "p50", "p80", "unit",
                            "device", "versions", "timestamp"])
  _refuses_cleanly(autotune.main, ["--from-csv", str(p), "--out",
                                   str(tmp_path / "t.json")])
