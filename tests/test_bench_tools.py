"""Benchmark tools on the CPU: benchmarks/epilogue_probe.py's GEMM-free Pallas
AdamW against the rule's reference (interpret mode), benchmarks/ncu_summary.py's
reading of an Nsight Compute CSV log, benchmarks/suite.sh's shape, and
benchmarks/backends.py's check of each arm's result and its --table."""

import io
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from benchmarks import backends, common, epilogue_probe, ncu_summary
from benchmarks.kernel import hparams
from tests.tolerances import assert_close


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bm,bn,warps", [(16, 32, 4), (32, 16, 2)])
def test_elementwise_adamw_matches_the_rule(dtype, bm, bn, warps):
  k = jax.random.split(jax.random.key(3), 4)
  shape = (64, 96)
  g = jax.random.normal(k[0], shape, dtype)
  w = jax.random.normal(k[1], shape, dtype)
  m = (0.1 * jax.random.normal(k[2], shape)).astype(dtype)
  v = (0.01 * jax.random.uniform(k[3], shape)).astype(dtype)
  h = hparams()
  ref_w, (ref_m, ref_v) = pk.ADAMW.apply(g, w, (m, v), h)
  got = epilogue_probe.elementwise_adamw(g, w, m, v, h, bm, bn, warps)
  for name, a, r, old in zip("wmv", got, (ref_w, ref_m, ref_v), (w, m, v)):
    assert a.dtype == old.dtype and a.shape == old.shape
    assert_close(a, r, what=name)
    assert not jnp.array_equal(a, old), f"{name} was not updated"


def test_elementwise_adamw_refuses_blocks_that_do_not_divide():
  a = jnp.zeros((64, 96), jnp.float32)
  with pytest.raises(ValueError, match="block 32x64 does not divide"):
    epilogue_probe.elementwise_adamw(a, a, a, a, hparams(), 32, 64, 4)


_NCU_LOG = '''==PROF== Connected to process 1 (python3)
==PROF== Disconnected from process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","loop_fusion","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","m","gpu__time_duration.sum","ns","2,912"
"1","1","python3","h","fused_wgrad_adamw","1","7","(128, 1, 1)","(2048, 1, 1)","0","9.0","m","launch__registers_per_thread","register/thread","255"
"1","1","python3","h","fused_wgrad_adamw","1","7","(128, 1, 1)","(2048, 1, 1)","0","9.0","m","gpu__time_duration.sum","ns","94,144"
"2","1","python3","h","fused_wgrad_adamw","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","m","launch__registers_per_thread","register/thread","167"
"2","1","python3","h","fused_wgrad_adamw","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","m","gpu__time_duration.sum","ns","81,504"
'''


def test_ncu_summary_keeps_named_launches_in_order(tmp_path):
  log = tmp_path / "ncu.csv"
  log.write_text(_NCU_LOG)
  launches = ncu_summary.read_launches(str(log), ["fused_wgrad"])
  assert [r["id"] for r in launches] == [1, 2]
  assert launches[0]["metrics"] == {"launch__registers_per_thread": "255",
                                    "gpu__time_duration.sum": "94144"}
  assert launches[1]["grid"] == "(4096, 1, 1)"
  assert len(ncu_summary.read_launches(str(log))) == 3  # no filter: all
  out = io.StringIO()
  ncu_summary.write_summary(launches, out, ["64x128", "64x64"])
  lines = out.getvalue().splitlines()
  assert lines[0] == ("kernel,label,block,grid,device,cc,"
                      "gpu__time_duration.sum,launch__registers_per_thread")
  assert lines[2] == ('fused_wgrad_adamw,64x64,"(128, 1, 1)","(4096, 1, 1)",'
                      'cuda:0,9.0,81504,167')
  out = io.StringIO()
  ncu_summary.write_summary(launches, out, device="NVIDIA H200")
  assert out.getvalue().splitlines()[1].startswith(
      'fused_wgrad_adamw,,"(128, 1, 1)","(2048, 1, 1)",NVIDIA H200 (cuda:0),9.0,')
  with pytest.raises(ValueError, match="1 labels for 2 kept launches"):
    ncu_summary.write_summary(launches, io.StringIO(), ["only one"])


def test_ncu_summary_rejects_a_file_without_the_csv_header(tmp_path):
  log = tmp_path / "ncu.log"
  log.write_text("==ERROR== profiling failed\n")
  with pytest.raises(ValueError, match="no ncu CSV header"):
    ncu_summary.read_launches(str(log))


def test_suite_script_is_valid_bash_and_runs_existing_benchmarks():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = os.path.join(root, "benchmarks", "suite.sh")
  assert os.access(script, os.X_OK)
  subprocess.run(["bash", "-n", script], check=True)
  text = open(script).read()
  # Every benchmark runs as a module (no script paths, no PYTHONPATH).
  assert not re.search(r"benchmarks/\w+\.py|PYTHONPATH", text)
  used = set(re.findall(r'"\$PY" -m benchmarks\.(\w+)', text))
  assert used == {"kernel", "plot", "e2e", "scan_memory", "e2e_paired",
                  "backends", "torch_call", "torch_e2e"}, used
  for name in used:
    assert os.path.exists(os.path.join(root, "benchmarks", f"{name}.py")), name


def _run_suite(tmp_path, parts, fail=None):
  """benchmarks/suite.sh OUT PARTS with a stand-in interpreter that logs
  each command line (and exits 3 for the module ``fail``): the process and
  the logged lines."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  log = tmp_path / "calls.log"
  fake = tmp_path / "fakepython"
  fake.write_text("#!/usr/bin/env bash\n"
                  f"echo \"$*\" >> {log}\n"
                  + (f"case \"$2\" in {fail}) exit 3;; esac\n" if fail else "")
                  + "exit 0\n")
  fake.chmod(0o755)
  p = subprocess.run(["bash", os.path.join(root, "benchmarks", "suite.sh"),
                      str(tmp_path / "out"), *parts],
                     env=dict(os.environ, PYTHON=str(fake)),
                     capture_output=True, text=True, timeout=60)
  return p, log.read_text().splitlines()


def test_suite_runs_the_parts_asked_for_and_goes_on_after_a_failure(
    tmp_path):
  """A stand-in interpreter logs each benchmark command (and fails the
  scanned stack's memory benchmark): `suite.sh OUT scan e2e` runs the e2e
  and scan parts' commands in the suite's order, not the kernel's, keeps
  going after the failure and exits 1."""
  p, lines = _run_suite(tmp_path, ["scan", "e2e"],
                        fail="benchmarks.scan_memory")
  assert p.returncode == 1, p.stdout + p.stderr
  # The GPU check (-c), then each benchmark as a module (-m NAME).
  calls = [l.split()[1] if l.startswith("-m ") else l.split()[0]
           for l in lines]
  assert calls == ["-c", "benchmarks.e2e", "benchmarks.e2e",
                   "benchmarks.e2e", "benchmarks.scan_memory",
                   "benchmarks.e2e_paired", "benchmarks.e2e_paired",
                   "benchmarks.e2e", "benchmarks.e2e", "benchmarks.e2e"]
  paired = [l for l in lines if l.startswith("-m benchmarks.e2e_paired ")]
  assert all("--model stack" in l for l in paired)
  assert ["--bt 512" in paired[0], "--bt 2048" in paired[1]] == [True, True]
  # The e2e part's cells unrolled, the scan part's the scanned decoder.
  e2e = [l for l in lines if l.startswith("-m benchmarks.e2e ")]
  assert ["--scan" in l for l in e2e] == [False] * 3 + [True] * 2 + [False]
  assert "e2e_scan.csv" in e2e[-1] and "--replot" in e2e[-1]
  assert "suite: scan part done" in p.stdout


def test_suite_backends_and_torch_parts(tmp_path):
  """`suite.sh OUT torch backends` runs the backends part (seven
  benchmarks.backends calls: the decoder's shapes, then an fp32 weight,
  then backend=None's choice beyond the cache), then the torch part
  (torch_call with its plot, torch_e2e with --check at BT 512 and 2048)."""
  p, lines = _run_suite(tmp_path, ["torch", "backends"])
  assert p.returncode == 0, p.stdout + p.stderr
  lines = [l for l in lines if l.startswith("-m ")]
  assert [l.split()[1] for l in lines] == (
      ["benchmarks.backends"] * 7 + ["benchmarks.torch_call",
                                     "benchmarks.torch_e2e"])
  assert "--moments bf16 int8" in lines[0] and "e64x64" in lines[0]
  assert "--shapes decoder" in lines[3] and "32000x2048" in lines[4]
  assert "--weights fp32 --moments fp32 mu-bf16 --auto" in lines[5]
  assert "--auto --mosaic --shapes" in lines[6] and "768x3072" in lines[6]
  assert "--plot" in lines[7]
  assert "--check" in lines[8] and "--bt 512 2048" in lines[8]


def test_suite_script_refuses_an_unknown_part_before_anything_runs(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = subprocess.run(["bash", os.path.join(root, "benchmarks", "suite.sh"),
                      str(tmp_path / "out"), "kernel", "scna"],
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 2
  assert ("unknown part 'scna' (parts: kernel e2e scan backends torch)"
          in p.stderr)
  assert not (tmp_path / "out").exists()


def test_rows_record_a_backend_forced_by_the_environment(monkeypatch):
  monkeypatch.delenv("FORGE_BACKEND", raising=False)
  assert "FORGE_BACKEND" not in common.versions()
  monkeypatch.setenv("FORGE_BACKEND", "mosaic_gpu")
  assert common.versions().endswith("; FORGE_BACKEND=mosaic_gpu")


def test_commit_names_an_archived_tree_by_its_own_commit(tmp_path,
                                                         monkeypatch):
  """Rows name the commit whose code ran: in a checkout, its HEAD; in a
  tree that `git archive` exported (benchmarks/COMMIT, export-subst), the
  archived commit, even where that tree sits inside another checkout."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "benchmarks", "COMMIT")) as f:
    assert f.read().strip() == "$Format:%h$"  # unexported: the placeholder
  with open(os.path.join(root, ".gitattributes")) as f:
    assert "benchmarks/COMMIT export-subst" in f.read().splitlines()
  stamp = tmp_path / "COMMIT"
  stamp.write_text("$Format:%h$\n")
  monkeypatch.setattr(common, "_ARCHIVE_STAMP", str(stamp))
  assert not common.commit().startswith("$")  # the checkout's, or unknown
  stamp.write_text("abc1234\n")
  assert common.commit() == "abc1234"


def test_backends_rules_alone_times_every_rule(capsys):
  """--rules alone (as the docs quote it) names all three rules: here
  the mu-bf16 check then refuses the two without a slot mu."""
  from benchmarks import backends
  with pytest.raises(SystemExit) as e:
    backends.main(["--rules", "--moments", "mu-bf16", "--weights", "fp32"])
  assert e.value.code == 2
  assert ("rule(s) sgd_momentum, sgd have no slot mu"
          in capsys.readouterr().err)


def test_backends_table_reads_the_csvs_rows_once():
  """--table reads the CSV's rows in one pass: the committed CSV's tables
  (those docs/benchmarks.md shows) from an iterable that can be walked once
  are the same as from its list of rows."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rows = common.read_rows(os.path.join(root, "benchmarks", "results", "h200",
                                       "backends.csv"))
  passes = []

  class Rows:
    def __iter__(self):
      passes.append(1)
      return iter(rows)

  assert backends.table(Rows()) == backends.table(rows)
  assert len(passes) == 1
  assert backends.table(iter(rows)) == backends.table(rows)


def _backends_state(rule, weights):
  return backends._state(64, 128, 256, "bf16", rule, weights)


@pytest.mark.parametrize("weights", ["bf16", "fp32"])
@pytest.mark.parametrize("rule_name", ["adamw", "sgd"])
def test_backends_check_sees_a_skipped_or_misscaled_update_of_w(
    rule_name, weights):
  """At the timing hyperparameters (lr 1e-4) W's update is far below bf16
  rounding of W's largest element, so W against the reference alone cannot
  see it skipped; W's update against the reference's does, for a bf16 W
  (whose update rounds to whole units in the last place) as for an fp32
  one. The Triton kernel (interpret mode) passes."""
  rule, h = backends._rule(rule_name)
  xla = jax.jit(backends._arms([], rule, h)["xla_unfused"])
  before = _backends_state(rule, weights)
  ref = xla(_backends_state(rule, weights))
  assert not jnp.array_equal(ref[2], before[2])
  x, dy, w, slots = _backends_state(rule, weights)
  w, slots = pk.fused_wgrad_update(x, dy, w, slots, h, rule=rule,
                                   backend="triton", interpret=True)
  err, update_err, ok = backends.check_result(before, (x, dy, w, slots), ref)
  assert ok and err <= backends.MAX_REL_ERR, (err, update_err)
  assert update_err <= backends.UPDATE_RTOL[jnp.dtype(w.dtype).name]
  # The slots stepped, W left as it was: within bf16 rounding of W's
  # largest element, but none of the update.
  skipped = (*ref[:2], before[2], ref[3])
  err, update_err, ok = backends.check_result(before, skipped, ref)
  assert err <= backends.MAX_REL_ERR and update_err == 1.0 and not ok
  # Half the learning rate.
  half = h.at[rule.hparams.index("lr")].multiply(0.5)
  halved = jax.jit(backends._arms([], rule, half)["xla_unfused"])(
      _backends_state(rule, weights))
  err, update_err, ok = backends.check_result(before, halved, ref)
  assert err <= backends.MAX_REL_ERR and update_err > 0.3 and not ok
  # Nothing to compare with: both left W as it was; only the arm moved it.
  assert backends.update_rel_err(before[2], before[2], before[2]) == 0.0
  assert backends.update_rel_err(before[2], ref[2], before[2]) == float("inf")


def test_backends_run_refuses_to_time_an_arm_that_skips_the_update_of_w(
    tmp_path, monkeypatch, capsys):
  """A run (on the CPU, standing in for the GPU, timing stubbed) writes only
  the error rows of an arm that steps the slots but leaves W as it was,
  says so and exits 1; the reference and the Triton kernel (interpret
  mode) are timed."""

  class GpuJax:  # the module as backends uses it, reporting a GPU
    def __getattr__(self, name):
      return getattr(jax, name)

    @staticmethod
    def default_backend():
      return "gpu"

  real_arms = backends._arms

  def arms(mosaic_cfgs, rule, hparams, auto=None):
    xla = real_arms([], rule, hparams)["xla_unfused"]

    def triton(s):
      x, dy, w, slots = s
      w, slots = pk.fused_wgrad_update(x, dy, w, slots, hparams, rule=rule,
                                       backend="triton", interpret=True)
      return x, dy, w, slots

    def skips_w(s):
      x, dy, _, slots = xla(s)
      return x, dy, s[2], slots

    return {"xla_unfused": xla, "forge_triton": triton,
            "forge_skips_w": skips_w}

  monkeypatch.setattr(backends, "jax", GpuJax())
  monkeypatch.setattr(backends, "_arms", arms)
  monkeypatch.setattr(common, "time_loop",
                      lambda step, state: ((1e-6, 2e-6, 3e-6), state))
  out = tmp_path / "b.csv"
  assert backends.main(["--tokens", "64", "--shapes", "t 128x256",
                        "--moments", "bf16", "--mosaic", "--out",
                        str(out)]) == 1
  text = capsys.readouterr().out
  assert "forge_skips_w: WRONG" in text and "WRONG RESULTS" in text
  rows = common.read_rows(str(out))
  metrics = lambda arm: {r["metric"]: float(r["p50"]) for r in rows
                         if r["provider"] == arm}
  assert set(metrics("forge_skips_w")) == {"max_rel_err_vs_xla",
                                           "update_rel_err_vs_xla"}
  assert metrics("forge_skips_w")["update_rel_err_vs_xla"] == 1.0
  for arm in ("xla_unfused", "forge_triton"):
    assert "time" in metrics(arm), arm
    assert metrics(arm)["update_rel_err_vs_xla"] <= 0.1, arm
