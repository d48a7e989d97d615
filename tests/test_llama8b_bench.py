"""benchmarks/llama8b.py at its tiny config on the CPU: the optax and the
int8 FORGE arms run in this process, agree at the first step, and write
their rows and plot (the bf16-moment FORGE arm is the same path without
quantization)."""

from benchmarks import common, e2e, llama8b


def test_the_arms_run_and_write_rows(tmp_path, capsys):
  out, png = tmp_path / "l.csv", tmp_path / "l.png"
  # wgrad="xla": the FORGE arms without Pallas interpret mode (the fused
  # kernel in a scanned decoder is tested in tests/test_e2e_bench.py and,
  # with int8 moments, tests/test_scan_low_precision.py).
  rc = llama8b.main(["--tiny", "--in-process", "--wgrad", "xla", "--steps",
                     "1", "--warmup", "1", "--arms", "optax", "forge_int8",
                     "--out", str(out), "--plot", str(png)])
  text = capsys.readouterr().out
  assert rc == 0, text
  rows = common.read_rows(out)
  cfg = llama8b.TINY
  arms = {"optax": "optax", "forge_int8": "forge_int8-xla"}
  assert {r["provider"] for r in rows} == set(arms.values())
  for r in rows:
    assert r["benchmark"] == "llama8b" and r["case"] == "llama-86K BT=16"
    assert r["shape"] == "L2 d64 h4/kv2 ffn128 V96 B2x8 scanned (remat)"
    assert r["device"] == "cpu:cpu" and "jax " in r["versions"] and r["commit"]
  by = {(a, r["metric"]): r for r in rows for a in arms
        if arms[a] == r["provider"]}
  first = {a: float(by[(a, "loss_first")]["p50"]) for a in arms}
  assert first["optax"] == first["forge_int8"]
  for arm in arms:
    assert float(by[(arm, "loss_final")]["p50"]) < first[arm]
    assert float(by[(arm, "param_count")]["p50"]) == e2e.param_count(cfg)
    assert float(by[(arm, "step_time")]["p50"]) > 0
  assert "m=int8" in by[("forge_int8", "step_time")]["dtypes"].replace(
      "bfloat16/", "")
  # The table beside the paper's figures, and the plot.
  assert "FORGE (int8)" in text and "35.32" in text and "134.3" in text
  assert png.stat().st_size > 0
