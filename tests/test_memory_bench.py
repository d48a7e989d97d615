"""benchmarks/memory.py's HLO checks, on the CPU: the weight-gradient GEMM
detector counts one per layer on the standard path and none with FORGE."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import memory


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_weight_gradient_gemms_found_for_optax_and_absent_for_forge(optimizer):
  # (BT above the kernel's token chunk: interpret mode lowers the kernel to
  # HLO, whose dots then see [64, 64] chunks, not the [BT, 64] activations.)
  width, tokens, layers = 64, 96, 3
  steps, model = memory.arms(width, layers, optimizer)
  x = jnp.ones((tokens, width), jnp.bfloat16)
  counts = {}
  for name, (step, tx) in steps.items():
    variables = model.init(jax.random.key(0), x)
    opt_state = tx.init(variables["params"])
    hlo = jax.jit(step).lower(variables, opt_state, x).compile().as_text()
    counts[name] = len(memory.weight_gradient_gemms(hlo, tokens, width))
  assert counts == {"optax": layers, "forge": 0}, counts


def test_weight_gradient_gemm_detector_reads_hlo_lines():
  hlo = "\n".join([
      "%g = bf16[8,8]{1,0} dot(bf16[4,8]{1,0} %x, bf16[4,8]{1,0} %dy), lhs_contracting_dims={0}",
      "%h = (bf16[8,8]{1,0}, s8[32]{0}) custom-call(bf16[4,8]{1,0} %x, bf16[4,8]{1,0} %dy), custom_call_target=\"__cublas$gemm\"",
      "%dx = bf16[4,8]{1,0} dot(bf16[4,8]{1,0} %dy, bf16[8,8]{1,0} %w)",
      "%ns = bf16[8,8]{1,0} dot(bf16[8,8]{1,0} %b, bf16[8,8]{1,0} %b)",
  ])
  assert len(memory.weight_gradient_gemms(hlo, 4, 8)) == 2
