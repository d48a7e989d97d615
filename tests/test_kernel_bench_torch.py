"""benchmarks/kernel.py's torch arms on the CPU: ``torch`` (cuBLAS-style
``G = x^T dy`` + ``torch.optim.AdamW(fused=True)``) and ``forge_torch`` (the
fused kernel through the forge_torch bridge).

* The script end to end with ``--torch on`` on a tiny odd shape: every arm
  runs (Pallas interpret mode), the CSV gains the torch rows with the usual
  columns, fp32 moments get no torch rows, and plot.py draws the CSV.
* The two arms time the same computation: one step of each from the same
  fp32 state gives the same weight and moments (fp32 bar).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import common, kernel, plot  # noqa: E402
from tests.tolerances import assert_close  # noqa: E402


def test_kernel_script_times_the_torch_arms(tmp_path, monkeypatch, capsys):
  # kernel.main sets this default for the GPU; keep the test process's env.
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  out = tmp_path / "kernel.csv"
  rc = kernel.main(["--torch", "on", "--shapes", "t 40x24", "--tokens", "16",
                    "--moments", "bfloat16", "float32", "--configs", "1",
                    "--steps", "2", "--reps", "3", "--ceiling-mib", "8",
                    "--out", str(out)])
  assert rc == 0
  printed = capsys.readouterr().out
  assert "torch/forge_torch" in printed
  assert "torch arms skipped" in printed  # the fp32-moment case
  rows = common.read_rows(str(out))
  assert rows and list(rows[0]) == common.CSV_FIELDS
  bf16 = "w=bf16,m/v=bfloat16"
  for r in rows:
    assert r["benchmark"] == "kernel"
    assert r["device"] == common.device_name()
    assert f"torch {torch.__version__}" in r["versions"]
    assert f"jax {jax.__version__}" in r["versions"]
  by = {(r["provider"], r["dtypes"], r["metric"]): r for r in rows}
  for prov in ("torch", "forge_torch"):
    r = by[(prov, bf16, "time")]
    assert (r["case"], r["shape"], r["unit"]) == ("t 40x24", "BT=16 40x24",
                                                  "us")
    q = [float(r[k]) for k in ("p20", "p50", "p80")]
    assert all(math.isfinite(v) and v > 0 for v in q), r
    assert q[0] <= q[1] <= q[2], r
    for metric, unit in (("bandwidth", "GB/s"), ("pct_copy_ceiling", "%")):
      r = by[(prov, bf16, metric)]
      assert r["unit"] == unit and float(r["p50"]) > 0, r
  ratio = by[("forge_torch", bf16, "speedup_vs_torch")]
  assert ratio["unit"] == "x" and float(ratio["p50"]) > 0
  # Same bytes as the JAX arm it mirrors, so the bandwidths compare.
  for jax_arm, torch_arm in (("forge", "forge_torch"), ("xla_unfused", "torch")):
    bw = lambda p: float(by[(p, bf16, "bandwidth")]["p50"])
    t = lambda p: float(by[(p, bf16, "time")]["p50"])
    assert bw(jax_arm) * t(jax_arm) == pytest.approx(
        bw(torch_arm) * t(torch_arm), rel=1e-4)
  # torch AdamW keeps its moments in the weight's dtype: no fp32-moment rows.
  f32 = "w=bf16,m/v=float32"
  assert ("forge", f32, "time") in by
  assert not [r for r in rows if r["dtypes"] == f32
              and r["provider"] in ("torch", "forge_torch")]
  png = tmp_path / "kernel.png"
  assert plot.main([str(out), str(png)]) == 0
  assert png.stat().st_size > 0


def test_step_bytes():
  fused = kernel.step_bytes(512, 4096, 1024, 2)
  assert fused == 512 * (4096 + 1024) * 2 + 4096 * 1024 * 2 * 6
  assert kernel.step_bytes(512, 4096, 1024, 2, fused=False) == (
      fused + 2 * 4096 * 1024 * 2)
  assert common.parse_shape("q/o 4096x4096") == (4096, 4096)
  assert common.parse_shape("t 40x24") == (40, 24)
  assert [common.parse_shape(n) for n in common.DECODER_SHAPES] == list(
      common.DECODER_SHAPES.values())
  with pytest.raises(ValueError, match="neither one of"):
    common.parse_shape("q/o")


def test_torch_and_forge_torch_arms_compute_the_same_step():
  """One step of each arm from the same fp32 start (moments mid-run, step
  ``kernel.STEP``): same W, exp_avg, exp_avg_sq to the fp32 bar."""
  bt, n_in, n_out = 19, 40, 24
  x, dy, w, m, v = kernel.make_state(bt, n_in, n_out, jnp.float32)
  # make_state's x, dy, w are bf16: widen to fp32 and make them moved-from.
  state = kernel.to_torch((x, dy, w, m, v), "cpu", torch.float32)
  start = [t.clone() for t in state]
  torch_step, torch_out = kernel.torch_adamw_arm(*state)
  forge_step, forge_out = kernel.forge_torch_arm(*state)
  torch_step()
  forge_step()
  for t, s in zip(state, start):  # the arms copied their inputs
    assert torch.equal(t, s)
  for name, got, want, old in zip(("W", "exp_avg", "exp_avg_sq"), forge_out,
                                  torch_out, start[2:]):
    got, want = got.detach(), want.detach()
    assert got.dtype == want.dtype == torch.float32
    assert not torch.equal(want, old), f"{name} did not move"
    assert_close(np.asarray(got), np.asarray(want), what=name)
    # The step itself (W moves by ~0.2 % of its norm here): same update.
    assert_close(np.asarray(got - old), np.asarray(want - old),
                 what=f"{name} update")


def test_config_auto_times_the_tiling_the_kernel_picks(tmp_path, capsys):
  # On the CPU the kernel's own pick is BlockConfig.default, clamped to the
  # problem; "auto" must time exactly that tiling, once even if listed twice.
  import pallas_kernels as pk  # noqa: PLC0415
  out = tmp_path / "kernel.csv"
  picked = pk.tuning_cache.config_label(pk.select_config(
      16, 40, 24, jnp.bfloat16, [jnp.bfloat16] * 2, pk.ADAMW))
  rc = kernel.main(["--torch", "on", "--shapes", "t 40x24", "--tokens", "16",
                    "--moments", "bfloat16", "--config", "auto", picked,
                    "--steps", "1", "--reps", "2", "--ceiling-mib", "8",
                    "--out", str(out)])
  assert rc == 0
  assert f"auto = {picked}" in capsys.readouterr().out
  provs = [r["provider"] for r in common.read_rows(str(out))
           if r["metric"] == "time" and r["provider"].startswith("forge[")]
  assert provs == [f"forge[{picked}]"]
