"""benchmarks/launch_overhead.py on the CPU (interpret mode): its two chains
do the same update, it writes a row per N, arm and metric (saying that the
GPU-only kernel time and count are not measured) and plots them, and a
malformed shape or a replot without a plot is a usage error."""

import csv

import jax
import jax.numpy as jnp
import pytest

from benchmarks import common, launch_overhead
from benchmarks.kernel import hparams
from tests.tolerances import assert_close, assert_update_close


def test_the_fused_and_xla_chains_do_the_same_update():
  k = jax.random.split(jax.random.key(5), 5)
  x = jax.random.normal(k[0], (24, 40), jnp.bfloat16)
  dys = [jax.random.normal(jax.random.fold_in(k[1], i), (24, 72),
                           jnp.bfloat16) for i in range(2)]  # one per layer
  ws = [jax.random.normal(jax.random.fold_in(k[2], i), (40, 72), jnp.bfloat16)
        for i in range(2)]
  ms = [(0.1 * jax.random.normal(jax.random.fold_in(k[3], i), (40, 72))
         ).astype(jnp.bfloat16) for i in range(2)]
  vs = [(0.01 * jax.random.uniform(jax.random.fold_in(k[4], i), (40, 72))
         ).astype(jnp.bfloat16) for i in range(2)]
  arms = launch_overhead.chains("triton")
  fused = arms["fused"](x, dys, ws, ms, vs, hparams())
  xla = arms["xla"](x, dys, ws, ms, vs, hparams())
  for i in range(2):
    assert_update_close(fused[0][i], xla[0][i], ws[i], what=f"W[{i}]")
    assert_close(fused[1][i], xla[1][i], what=f"m[{i}]")
    assert_close(fused[2][i], xla[2][i], what=f"v[{i}]")


def test_writes_a_row_per_chain_length_arm_and_metric(tmp_path, capsys):
  out = tmp_path / "l.csv"
  png = tmp_path / "l.png"
  assert launch_overhead.main(["--n", "1", "2", "--tokens", "16", "--shapes",
                               "32x24", "--reps", "2", "--out", str(out),
                               "--plot", str(png)]) == 0
  assert png.stat().st_size > 0  # (off the GPU: the blocked-on time alone)
  with open(out, newline="") as f:
    rows = list(csv.DictReader(f))
  got = {(r["case"], r["provider"], r["metric"]) for r in rows}
  assert got == {(f"N={n}", arm, m) for n in (1, 2)
                 for arm in ("fused (triton)", "xla")
                 for m in launch_overhead.METRICS}
  assert len(rows) == len(got)
  for r in rows:
    p20, p50, p80 = (float(r[q]) for q in ("p20", "p50", "p80"))
    assert 0 < p20 <= p50 <= p80, r
    assert r["unit"] == "us" and r["shape"] == "BT=16 32x24"
  captured = capsys.readouterr()
  assert "excess" in captured.out
  # The GPU-only metric is said to be missing, not silently left out.
  assert "kernels, launches not measured" in captured.err


@pytest.mark.parametrize("bad", [["--shapes", "1024"], ["--shapes", "0x8"],
                                 ["--shapes", "axb"], ["--tokens", "0"]])
def test_a_malformed_shape_is_a_usage_error(tmp_path, bad):
  with pytest.raises(SystemExit) as e:
    launch_overhead.main(bad + ["--out", str(tmp_path / "l.csv")])
  assert e.value.code == 2
  assert not (tmp_path / "l.csv").exists()


def test_replot_splits_the_blocked_on_time_where_kernel_rows_exist(tmp_path):
  # A GPU run's rows (kernels measured) and a CPU run's (none): both plot.
  out, png = tmp_path / "l.csv", tmp_path / "l.png"
  res = common.Results(str(out), "launch_overhead")
  for shape, metrics in (("BT=512 1024x1024", ("synced", "kernels")),
                         ("BT=16 32x24", ("synced",))):
    for arm in ("fused (mosaic_gpu)", "xla"):
      for n in (8, 113):
        for metric in metrics:
          v = 20.0 if metric == "synced" else 12.0
          res.add(f"N={n}", arm, shape, "w=bf16,m/v=bf16", metric,
                  (v, v, v), "us")
  assert launch_overhead.main(["--replot", "--out", str(out), "--plot",
                               str(png)]) == 0
  assert png.stat().st_size > 0


def test_replot_needs_a_plot_and_rows(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    launch_overhead.main(["--replot", "--out", str(tmp_path / "l.csv")])
  assert e.value.code == 2
  assert "--replot needs --plot" in capsys.readouterr().err
  empty = tmp_path / "e.csv"
  empty.write_text("benchmark,case\nother,x\n")
  assert launch_overhead.main(["--replot", "--out", str(empty), "--plot",
                               str(tmp_path / "e.png")]) == 1
  assert "no launch_overhead rows" in capsys.readouterr().err
  assert not (tmp_path / "e.png").exists()
