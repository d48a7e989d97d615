"""End-to-end check of the PyTorch digits example
(`python -m examples.train_digits_torch`) with a tiny config."""
import csv
import math

import jax.numpy as jnp
import pytest

pytest.importorskip("torch")

from examples import train_digits_torch as demo  # noqa: E402
from tests.tolerances import tol  # noqa: E402

STEPS = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  out = tmp_path_factory.mktemp("demo_torch")
  result = demo.main([
      "--steps", str(STEPS), "--hidden", "32", "--batch-size", "32",
      "--log-every", "4", "--seed", "1", "--device", "cpu",
      "--out", str(out)])
  return out, result


def test_csv_has_one_finite_falling_loss_per_step_per_arm(run):
  out, result = run
  with open(out / "losses.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert {r["arm"] for r in rows} == {"forge", "torch"}
  for arm in ("forge", "torch"):
    losses = [float(r["loss"]) for r in rows if r["arm"] == arm]
    assert len(losses) == STEPS
    assert all(math.isfinite(l) for l in losses)
    assert losses[-1] < losses[0]
    assert losses == result["losses"][arm]


def test_fp32_arms_agree_and_every_weight_took_the_fused_update(run):
  _, result = run
  assert result["ok"] and result["dtype"] == "float32"
  # Each step against torch's from the same state: what the demo checks.
  assert len(result["step_diff_per_step"]) == STEPS
  assert result["step_diff"] <= tol(jnp.float32)
  assert result["max_rel_param_diff"] <= tol(jnp.float32)
  assert result["max_abs_param_diff"] <= tol(jnp.float32)
  # Three weights per step, each updated by the fused kernel in backward.
  assert result["fused_updates"] == 3 * STEPS
  for arm in ("forge", "torch"):
    assert 0.0 <= result["test_accuracy"][arm] <= 1.0


@pytest.mark.parametrize("argv,match", [
    (["--steps", "0"], "--steps, --batch-size and --hidden must be positive"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--log-every", "-1"], "--log-every must be >= 0"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_arguments_are_usage_errors(argv, match, capsys):
  with pytest.raises(SystemExit) as e:
    demo.main(argv)
  assert e.value.code == 2
  assert match in capsys.readouterr().err


def _lr_one_percent_high(real):
  class Off(real):
    def _forge_hparams(self, group, *args, **kwargs):
      return super()._forge_hparams({**group, "lr": 1.01 * group["lr"]},
                                    *args, **kwargs)
  return Off


def _moments_wiped_after_each_step(real):
  import torch  # noqa: PLC0415

  class Wiped(real):
    def step(self, *args, **kwargs):
      loss = super().step(*args, **kwargs)
      with torch.no_grad():
        for st in self.state.values():
          for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
              st[key].zero_()
      return loss
  return Wiped


@pytest.mark.parametrize("broken", [_lr_one_percent_high,
                                    _moments_wiped_after_each_step],
                         ids=["lr_1pct_high", "moments_wiped"])
def test_the_step_check_fails_on_a_broken_forge_arm(broken, monkeypatch,
                                                   tmp_path):
  """The demo's check can fail: a forge arm whose optimizer steps with a
  learning rate 1 % high, or whose moments are wiped after each step (a
  storage bug both sides would otherwise start the next comparison from:
  the check compares the optimizer state too), differs from torch's step
  from the same state beyond the bar (and the copy torch steps is not the
  forge arm's own)."""
  import forge_torch  # noqa: PLC0415
  monkeypatch.setattr(forge_torch, "AdamW", broken(forge_torch.AdamW))
  result = demo.main([
      "--steps", "4", "--hidden", "32", "--batch-size", "32",
      "--log-every", "0", "--seed", "1", "--device", "cpu",
      "--out", str(tmp_path)])
  assert not result["ok"]
  assert result["step_diff"] > tol(jnp.float32)
