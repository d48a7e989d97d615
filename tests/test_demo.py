"""End-to-end check of the digits example (`python -m examples.train_digits`,
what `./dev.sh train` runs) with a tiny config."""
import csv
import math

import jax
import jax.numpy as jnp
import pytest

from examples import train_digits as demo
from tests.tolerances import tol

STEPS = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  out = tmp_path_factory.mktemp("demo")
  result = demo.main([
      "--steps", str(STEPS), "--hidden", "32", "--batch-size", "32",
      "--log-every", "4", "--seed", "1", "--no-progress", "--out", str(out)])
  return out, result


def test_writes_nonempty_plot_and_csv(run):
  out, result = run
  for name in ("losses.png", "losses.csv"):
    assert (out / name).is_file() and (out / name).stat().st_size > 0
  assert (out / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert result["png"] == str(out / "losses.png")


def test_csv_has_one_finite_loss_per_step_per_arm(run):
  out, _ = run
  with open(out / "losses.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  for arm in ("forge", "optax"):
    mine = [r for r in rows if r["arm"] == arm]
    assert [int(r["step"]) for r in mine] == list(range(STEPS))
    losses = [float(r["loss"]) for r in mine]
    assert all(math.isfinite(l) for l in losses)
    assert losses[-1] < losses[0]
  assert {r["arm"] for r in rows} == {"forge", "optax"}


def test_fp32_arms_agree(run):
  _, result = run
  assert result["ok"]
  assert result["dtype"] == "float32"
  # Each step against optax's from the same state: what the demo checks.
  assert len(result["step_diff_per_step"]) == STEPS
  assert result["step_diff"] == max(
      result["step_diff_per_step"])
  assert result["step_diff"] <= tol(jnp.float32)
  # The test also holds these 12 steps' trajectories to the fp32 bar (the
  # demo reports them: over long runs rounding compounds past it).
  assert result["max_rel_param_diff"] <= tol(jnp.float32)
  # (parameters are O(1): the absolute difference has the same bound)
  assert result["max_abs_param_diff"] <= tol(jnp.float32)
  for arm in ("forge", "optax"):
    assert len(result["losses"][arm]) == STEPS
    assert 0.0 <= result["test_accuracy"][arm] <= 1.0


def _assert_the_check_fails(out, steps: int) -> None:
  """The demo, run ``steps`` steps with a broken forge arm, fails its
  per-step check."""
  result = demo.main([
      "--steps", str(steps), "--hidden", "32", "--batch-size", "32",
      "--log-every", "0", "--seed", "1", "--no-progress", "--out", str(out)])
  assert not result["ok"]
  assert result["step_diff"] > tol(jnp.float32)


def test_the_step_check_fails_on_a_step_off_by_one_percent(monkeypatch,
                                                          tmp_path):
  """The demo's check can fail: a forge arm whose learning rate is 1 %
  high differs from optax's step from the same state beyond the bar."""
  real = demo.forge_jax.adamw
  monkeypatch.setattr(demo.forge_jax, "adamw", lambda lr, **kw: real(
      lambda t: 1.01 * lr(t), **kw))
  _assert_the_check_fails(tmp_path, STEPS)


def test_the_step_check_fails_on_a_state_not_advanced(monkeypatch,
                                                       tmp_path):
  """The check compares the optimizer state too: a forge arm that returns
  its old state (a storage bug both sides would otherwise start the next
  comparison from) fails."""
  real = demo.build_arms

  def build_arms(*args, **kwargs):
    arms, model = real(*args, **kwargs)
    step, tx = arms["forge"]

    def stale(variables, opt_state, batch):
      old = jax.tree.map(jnp.array, opt_state)  # (the step donates it)
      loss, variables, _ = step(variables, opt_state, batch)
      return loss, variables, old

    arms["forge"] = (stale, tx)
    return arms, model

  monkeypatch.setattr(demo, "build_arms", build_arms)
  _assert_the_check_fails(tmp_path, 4)


def test_plot_data_follow_the_run(run):
  """The figure's per-step series: the arms' parameter difference after
  every step (ending at the final one) and both arms' test accuracy, whose
  last point is the final accuracy."""
  _, result = run
  per_step = result["max_rel_param_diff_per_step"]
  assert len(per_step) == STEPS
  assert per_step[-1] == result["max_rel_param_diff"]
  assert all(0.0 <= d <= tol(jnp.float32) for d in per_step)
  for arm in ("forge", "optax"):
    curve = result["test_accuracy_curve"][arm]
    steps = [s for s, _ in curve]
    assert steps == sorted(steps) and steps[-1] == STEPS - 1
    assert curve[-1][1] == result["test_accuracy"][arm]
  assert demo.eval_steps(12) == list(range(12))
  assert demo.eval_steps(200, points=40) == list(range(4, 200, 5))
  assert demo.eval_steps(7, points=3) == [1, 3, 5, 6]


def test_a_missing_demo_extra_is_a_clear_error(monkeypatch, capsys):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "tqdm" else real(name, *a))
  with pytest.raises(SystemExit) as e:
    demo.main(["--steps", "1", "--no-progress"])
  assert e.value.code == 2
  assert "missing tqdm" in capsys.readouterr().err


def test_help_needs_no_demo_extra(monkeypatch, capsys):
  import importlib.util
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
  with pytest.raises(SystemExit) as e:
    demo.main(["--help"])
  assert e.value.code == 0 and "--steps" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr=-1e-3"], "--lr must be a finite number > 0"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0"),
    (["--steps", "0"], "must be positive"),
])
def test_bad_hyperparameters_are_argument_errors(args, message, capsys):
  with pytest.raises(SystemExit) as e:
    demo.main(args)
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_out_folder_under_a_file_is_an_argument_error(tmp_path, capsys):
  (tmp_path / "f").write_text("")
  with pytest.raises(SystemExit) as e:
    demo.main(["--out", str(tmp_path / "f" / "sub")])
  assert e.value.code == 2 and "is a file, not a folder" in (
      capsys.readouterr().err)


def test_an_unwritable_out_folder_fails_before_training(monkeypatch, capsys):
  monkeypatch.setattr(demo, "load_digits_split", lambda *a: pytest.fail(
      "trained before checking --out"))
  # /proc refuses new folders, even to root (whom os.access would let pass).
  with pytest.raises(SystemExit) as e:
    demo.main(["--steps", "1", "--no-progress", "--out", "/proc/forge_demo"])
  assert e.value.code == 2 and "is not writable" in capsys.readouterr().err


def test_a_nan_parameter_difference_is_reported_as_nan():
  a = {"w": jnp.array([1.0, jnp.nan]), "b": jnp.array([2.0])}
  b = {"w": jnp.array([1.0, 1.0]), "b": jnp.array([3.0])}
  d = demo.param_diff(a, b)
  assert math.isnan(d["max_abs"]) and math.isnan(d["max_rel"])
  assert d["worst_leaf"] == "['w']"
  same = demo.param_diff(b, b)
  assert same["max_abs"] == 0.0 and same["max_rel"] == 0.0
