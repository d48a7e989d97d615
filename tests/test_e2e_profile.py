"""benchmarks/e2e_profile.py and the trace tools of benchmarks/common.py:
the trace parsing, the traced run, the idle gaps, the report and the kernel
categories (CPU). The profile itself runs on a GPU (`python -m
benchmarks.e2e_profile`)."""

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


def test_trace_events_splits_the_gpu_events_from_the_host_events(tmp_path):
  events = [
      {"ph": "M", "name": "process_name", "pid": 1,
       "args": {"name": "/host:CPU"}},
      {"ph": "M", "name": "process_name", "pid": 2,
       "args": {"name": "/device:GPU:0"}},
      {"ph": "X", "pid": 1, "name": "host_op", "dur": 99.0},
      {"ph": "X", "pid": 2, "name": "loop_add_fusion", "ts": 20.0,
       "dur": 3.0},
      {"ph": "X", "pid": 2, "name": "fused_wgrad_adamw", "ts": 5.0,
       "dur": 12.5},
      {"ph": "i", "pid": 2, "name": "marker"},
  ]
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(d / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  gpu, host = common.trace_events(str(tmp_path))
  # Only the GPU's events, in order of start, with the start.
  assert gpu == [("fused_wgrad_adamw", 5.0, 12.5),
                 ("loop_add_fusion", 20.0, 3.0)]
  assert host == [("host_op", 0.0, 99.0)]


def test_idle_gaps_merge_overlapping_streams_and_name_the_neighbours():
  events = [("a", 0.0, 10.0),
            ("b", 4.0, 8.0),     # overlaps a, ends later (12)
            ("c", 5.0, 2.0),     # inside: changes nothing
            ("d", 20.0, 5.0),    # gap of 8 after b
            ("e", 26.0, 1.0)]    # gap of 1 after d
  span, busy, gaps = common.idle_gaps(events[::-1])  # any order
  assert span == 27.0 and busy == 12.0 + 5.0 + 1.0
  assert gaps == [(8.0, "b", "d", 12.0), (1.0, "d", "e", 25.0)]
  assert common.idle_gaps([]) == (0.0, 0.0, [])


def test_traced_returns_the_result_and_the_gpu_kernels(tmp_path):
  x = jnp.arange(3.0)
  result, kernels, host = common.traced(
      lambda: jax.block_until_ready(x * 2), keep=str(tmp_path / "kept"))
  assert result.tolist() == [0.0, 2.0, 4.0]
  assert host  # the host's events: the traced Python and jax's dispatch
  assert list((tmp_path / "kept").glob("*.trace.json.gz"))  # the trace kept
  if jax.default_backend() == "gpu":
    assert kernels and all(us >= 0 for _, _, us in kernels), kernels
  else:  # read from the trace all the same: no GPU events on the CPU
    assert kernels == []


def test_overlap_by_name_sums_the_time_inside_the_window():
  events = [("x", 0.0, 10.0), ("y", 8.0, 4.0), ("x", 11.0, 1.0),
            ("z", 30.0, 1.0)]
  # window [9, 12): x overlaps 1 + 1, y 3; z is outside
  assert common.overlap_by_name(events, 9.0, 12.0) == [("y", 1, 3.0),
                                                        ("x", 2, 2.0)]


def test_report_prints_the_idle_gaps_and_the_host_work_inside(capsys):
  def arm(kernel_ms, gap_ms):
    return dict(by_cat={"gemm": kernel_ms}, busy_ms=kernel_ms, idle_ms=gap_ms,
                wall_ms=kernel_ms + gap_ms, n_kernels=1.0,
                gaps=[(gap_ms, "gemm_a", "loop_add_fusion")],
                host_in_gap=[("Thunks::Prepare", 1, gap_ms / 2)],
                by_name={"gemm_a": kernel_ms}, per_step={"gemm_a": 1.0})
  ep.report({"optax": arm(2.0, 0.5), "forge": arm(1.5, 0.9)}, top=5)
  out = capsys.readouterr().out
  assert "GPU idle within the traced steps" in out
  assert "forge: the largest GPU idle gaps" in out
  assert "0.450  x1    Thunks::Prepare" in out
  assert "gemm_a  ->  loop_add_fusion" in out
