"""benchmarks/e2e_profile.py: the trace parsing, the traced run and the
kernel categories (CPU). The profile itself runs on a GPU (`python -m benchmarks.e2e_profile`)."""

import gzip
import json

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks import e2e_profile as ep


def test_categories_from_kernel_names():
  cases = {
      "fused_wgrad_adamw": "forge kernel",
      "anonymous_mosaic_gpu_kernel": "forge kernel",
      "stored_g_update_adamw": "forge stored-G update",
      "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopB_TNN": "gemm",
      "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
      "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention",
      "loop_multiply_fusion_12": ep.OTHER,
      "input_reduce_fusion": ep.OTHER,
      "Memset (Device)": "copy/memset",
  }
  for name, cat in cases.items():
    assert ep.category(name) == cat, name


def test_gpu_kernels_reads_only_gpu_events(tmp_path):
  events = [
      {"ph": "M", "name": "process_name", "pid": 1,
       "args": {"name": "/host:CPU"}},
      {"ph": "M", "name": "process_name", "pid": 2,
       "args": {"name": "/device:GPU:0"}},
      {"ph": "X", "pid": 1, "name": "host_op", "dur": 99.0},
      {"ph": "X", "pid": 2, "name": "fused_wgrad_adamw", "dur": 12.5},
      {"ph": "X", "pid": 2, "name": "loop_add_fusion", "dur": 3.0},
      {"ph": "i", "pid": 2, "name": "marker"},
  ]
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(d / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  assert common.gpu_kernels(str(tmp_path)) == [("fused_wgrad_adamw", 12.5),
                                           ("loop_add_fusion", 3.0)]


def test_traced_returns_the_result_and_the_gpu_kernels():
  x = jnp.arange(3.0)
  result, kernels = common.traced(lambda: jax.block_until_ready(x * 2))
  assert result.tolist() == [0.0, 2.0, 4.0]
  if jax.default_backend() == "gpu":
    assert kernels and all(us >= 0 for _, us in kernels), kernels
  else:  # read from the trace all the same: no GPU events on the CPU
    assert kernels == []
