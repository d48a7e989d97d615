"""Which kernel backend ``fused_wgrad_update`` takes: Mosaic GPU tiling
labels, ``select_backend`` (on a stand-in GPU), ``$FORGE_BACKEND``, a
config's type, and the kernel call taking what was chosen."""

import dataclasses
import json
import random
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import (autotune, fused_wgrad, lowp, mosaic_kernel, quant,
                            tuning_cache)
from tests.harness import spy_launches
from tests.test_kernel import adamw_hparams, check_against_reference, make_case

M = pk.MosaicConfig
BF16, F32 = "bfloat16", "float32"
# The shipped cache's Mosaic GPU tilings (benchmarks/results/h200/backends.csv).
# 4096^2, BT 512, bf16 moments: five K steps, the ring across tiles.
SHORT = M.from_label("128x64x64/5,pn,pp,lp,nb")
# The MLP shapes at BT 512 (and every Llama shape at BT 256): 64 x 128
# tiles in clusters of two, five K steps.
SHORT_MLP = M.from_label("64x128x64/5,c2,pp,lp,nb")
LONG = M.from_label("128x128x64/4,e64x32,r2,s8")  # column split, streamed
# BT 2048, bf16 (4096 x 14336, 14336 x 4096): 64 x 64 epilogue sub-tiles,
# the ring across tiles, no automatic barriers.
LONG_PP = M.from_label("128x128x64/4,s8,pn,pp,nb")
# BT 2048, fp32 moments: ping-pong, rolled 64 x 64 sub-tiles, bands of 8.
LONG_F32 = M.from_label("128x128x64/4,s8,pp,lp,nb")
# BT 2048 at 4096^2 (and BT 1024 at 4096^2 and 4096 x 1024), bf16: rolled
# 64 x 32 sub-tiles, the ring across tiles.
LONG_ROLLED = M.from_label("128x128x64/4,e64x32,s8,pn,pp,lp,nb")


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
  monkeypatch.delenv(tuning_cache.BACKEND_ENV_VAR, raising=False)
  monkeypatch.delenv(tuning_cache.ENV_VAR, raising=False)
  tuning_cache.clear_cache()
  yield
  tuning_cache.clear_cache()


def _gpu(monkeypatch, capability="9.0", kind="NVIDIA H200"):
  """A stand-in GPU device: ``compute_capability=None`` leaves the
  attribute out."""
  device = types.SimpleNamespace(platform="gpu", device_kind=kind)
  if capability is not None:
    device.compute_capability = capability
  monkeypatch.setattr(tuning_cache, "_gpu_device", lambda: device)


def _choose(bt=512, n_in=4096, n_out=4096, slots=(BF16, BF16), *,
            rule=pk.ADAMW, x_dtype=BF16, interpret=False, w=BF16, **kw):
  return tuning_cache.select_backend(bt, n_in, n_out, w, slots, rule,
                                     x_dtype, interpret=interpret, **kw)


def _triton_config(bt=512, n_in=4096, n_out=4096, slots=(BF16, BF16),
                   interpret=False):
  return pk.select_config(bt, n_in, n_out, BF16, slots, pk.ADAMW,
                          interpret=interpret)


# --- labels ------------------------------------------------------------------


def _random_configs(n, seed=0):
  """``n`` distinct valid MosaicConfigs drawn over every knob."""
  rng = random.Random(seed)
  out = set()
  while len(out) < n:
    try:
      out.add(M(tile_m=rng.choice([64, 128, 192, 256]),
                tile_n=rng.choice([64, 128, 192, 256, 384]),
                tile_k=rng.choice([64, 128]), steps=rng.randint(1, 5),
                epi_m=rng.choice([8, 16, 32, 64, 128]),
                epi_n=rng.choice([32, 64, 128]),
                compute_wgs=rng.choice([None, 1, 2, 3, 4]),
                delay_release=rng.choice([0, 1]),
                state_buffers=rng.choice([1, 2]),
                prefetch_next=rng.choice([False, True]),
                state_ring=rng.choice([0, 0, 1, 2, 5, 8]),
                band=rng.choice([1, 1, 3, 8, 16]),
                no_barriers=rng.choice([False, True]),
                approx_math=rng.choice([False, False, True])))
    except ValueError:
      pass  # an invalid combination
  return sorted(out, key=lambda c: c.label)


def test_labels_round_trip_every_knob():
  configs = _random_configs(300) + autotune.mosaic_config_space()
  for cfg in configs:
    assert M.from_label(cfg.label) == cfg, cfg.label
    assert M.from_label(cfg.label).label == cfg.label
  assert len({c.label for c in configs}) == len(set(configs))
  # Every field (a knob added later included) is off its default in some
  # drawn config, so the round trip above covers it.
  default = M()
  for field in dataclasses.fields(M):
    # (compute_wgs's default follows tile_n)
    off = [getattr(c, field.name) != getattr(
        M(tile_n=c.tile_n) if field.name == "compute_wgs" else default,
        field.name) for c in configs]
    assert any(off), field.name
  assert default.label == "128x128x64/3"
  assert LONG.label == "128x128x64/4,e64x32,r2,s8"
  assert M.from_label("64x192x64/2,wg3,d0,b2,pn") == M(
      tile_m=64, tile_n=192, steps=2, compute_wgs=3, delay_release=0,
      state_buffers=2, prefetch_next=True)
  # Knobs in any order, defaults spelt out: the same tiling, one label.
  odd = M.from_label(" 128x128x64/3,s1,r0,e64x64,d1,wg2,b1 ")
  assert odd == default and odd.label == "128x128x64/3"
  assert M.from_label("64x128x64/4,pn,s8,b2").label == "64x128x64/4,b2,s8,pn"


@pytest.mark.parametrize("label,match", [
    ("64x128/2", "the tile '64x128' is not NxNxN"),
    ("128x128x64", "no '/STEPS'"),
    ("", "no '/STEPS'"),
    ("128x128x64/four", "the step count 'four' is not N"),
    ("128x128x64/4,q2", "unknown knob 'q2'"),
    ("128x128x64/4,", "unknown knob ''"),
    ("128x128x64/4,e64", "the value after 'e' in knob 'e64' is not NxN"),
    ("128x128x64/4,r-1", "the value after 'r' in knob 'r-1' is not N"),
    ("128x128x64/4,r2,r3", "knob 'r3' is given twice"),
    ("\uff11\uff12\uff18x128x64/4", "is not NxNxN"),
    ("96x128x64/4", "tile_m=96 must be a positive multiple of 64"),
    ("128x128x64/0", "steps=0 must be >= 1"),
    ("128x128x64/4,pn", "prefetch_next needs state_buffers=2"),
    ("128x128x64/4,b2,r2", "state_ring streams the state"),
    (None, "is a string"),
])
def test_bad_labels_are_refused_in_plain_words(label, match):
  with pytest.raises(ValueError, match=match):
    M.from_label(label)


@pytest.mark.parametrize("knobs,match", [
    (dict(epi_m=0), "epi_m=0 must be positive"),
    (dict(epi_n=-64), "epi_n=-64 must be positive"),
    (dict(epi_n=64.0), "epi_n=64.0 must be a Python int"),
    (dict(compute_wgs=2.0), "compute_wgs=2.0 must be a Python int"),
    (dict(state_ring=True), "state_ring=True must be a Python int"),
    (dict(band=np.int64(2)), "band=.*2.* must be a Python int"),
    (dict(delay_release=0.0), "delay_release=0.0 must be a Python int"),
    (dict(prefetch_next=1), "prefetch_next=1 must be True or False"),
])
def test_bad_knobs_are_refused_by_the_config_itself(knobs, match):
  """Every count a Python int, every switch a bool, the epilogue sub-tile
  positive: refused when the tiling is built, naming the knob, not deep in
  the kernel (a float epilogue width, a zero that divides)."""
  with pytest.raises(ValueError, match=match):
    M(**knobs)


def test_backends_benchmark_parses_with_the_shared_labels(capsys):
  from benchmarks import backends
  for cfg in _random_configs(20, seed=1):
    assert backends.parse_mosaic(cfg.label) == cfg
  import argparse
  with pytest.raises(argparse.ArgumentTypeError,
                     match=r"expected MxNxK/STEPS.*unknown knob 'x1'"):
    backends.parse_mosaic("64x128x64/2,x1")


# --- select_backend on a stand-in GPU ----------------------------------------


@pytest.mark.parametrize("capability,interpret,backend,reason", [
    ("9.0", False, "mosaic_gpu", "measured 82.9 us against the Triton "
     "kernel's 105.5 us on NVIDIA H200"),
    ("10.0", False, "mosaic_gpu", "measured 82.9 us"),
    ("9.0", True, "triton", "interpret mode"),
    ("8.0", False, "triton", "compute capability is 8.0; the Mosaic GPU "
     "kernel needs 9.0 or newer"),
    (None, False, "triton", "reports its compute capability"),
    ("gfx90a", False, "triton", "reports its compute capability"),
], ids=["sm90", "sm100", "sm90-interpret", "sm80", "no-capability",
        "not-nvidia"])
def test_the_device_decides_whether_mosaic_is_considered(
    monkeypatch, capability, interpret, backend, reason):
  _gpu(monkeypatch, capability)
  choice = _choose(interpret=interpret)
  assert choice.backend == backend
  assert reason in choice.reason
  if backend == "mosaic_gpu":
    assert choice.config == SHORT
  else:
    assert choice.config == _triton_config(interpret=interpret)


def test_no_gpu_at_all_takes_triton():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU")
  assert tuning_cache.compute_capability() is None
  choice = _choose()
  assert choice.backend == "triton" and choice.config == _triton_config()


@pytest.mark.parametrize("case,backend,config,reason", [
    (dict(bt=2048, n_in=14336), "mosaic_gpu", LONG_PP, "500.4 us against"),
    # BT 1024 (the bucket of 513 to 1024 tokens) takes its own entries,
    # and so does BT 256 (129 to 256).
    (dict(bt=768, n_out=1024), "mosaic_gpu", LONG_ROLLED, "29.5 us against"),
    (dict(bt=192, n_in=14336), "mosaic_gpu", SHORT_MLP, "235.2 us against"),
    # BT 1536 is in the 2048 bucket and a multiple of the 64-row K step.
    (dict(bt=1536, n_out=14336), "mosaic_gpu", LONG_PP, "513.1 us against"),
    (dict(bt=2048, slots=(F32, F32)), "mosaic_gpu", LONG_F32, "171.1 us"),
    # An fp32 weight (bf16 x and dy: mixed precision) with fp32 moments.
    (dict(w=F32, slots=(F32, F32)), "mosaic_gpu",
     M.from_label("64x128x64/4,pp,lp"), "136.2 us against"),
    (dict(bt=1024, w=F32, slots=(F32, F32)), "mosaic_gpu", LONG_F32,
     "adamw|bt2048|4096x4096|w=float32|slots=float32,float32"),
    # An fp32 weight with bf16 m and fp32 v (optax's mu_dtype=bfloat16).
    (dict(w=F32, slots=(BF16, F32)), "mosaic_gpu",
     M.from_label("64x128x64/5,c2,pp,lp,nb"), "120.2 us against"),
    (dict(bt=64, w=F32, slots=(BF16, F32), n_out=1024), "mosaic_gpu",
     M.from_label("128x128x64/4,pp,lp"),
     "adamw|bt512|4096x1024|w=float32|slots=bfloat16,float32"),
    (dict(stacked=True), "mosaic_gpu", SHORT, "82.9 us"),
    (dict(rule=pk.adam_rule()), "mosaic_gpu", SHORT, "82.9 us"),
    # Measured slower than the Triton kernel in the same run.
    (dict(bt=2048, n_in=2048, n_out=1024), "triton", None,
     "128x128x64/4,e64x32,pp,lp measured 30.5 us against the Triton "
     "kernel's 29.9 us"),
    # In a cached BT bucket, not a multiple of the K step: the bucket's
    # entry (the last K step's rows past BT are zero-filled) ...
    (dict(bt=1400, n_out=14336), "mosaic_gpu", LONG_PP, "513.1 us against"),
    # ... but BT must be a multiple of 8 (TMA moves x in 8-row pieces).
    (dict(bt=1500, n_out=14336), "triton", None,
     "does not cover this case: x is 1500 x 4096 bfloat16"),
    (dict(x_dtype=F32), "triton", None, "bfloat16 or float16 operands"),
    # No entry for the case: the nearest entry's tiling (another BT bucket
    # first, then another shape).
    (dict(bt=8192), "mosaic_gpu", M.from_label(
        "128x128x64/4,e64x32,s8,pn,pp,nb"), "its nearest entry that covers "
     "it, adamw|bt4096|4096x4096|w=bfloat16|slots=bfloat16,bfloat16, has "
     "the tiling 128x128x64/4,e64x32,s8,pn,pp,nb, which measured 248.7 us "
     "against the Triton kernel's 299.3 us there"),
    (dict(bt=64, n_in=14336), "mosaic_gpu", SHORT_MLP,
     "adamw|bt256|14336x4096"),
    (dict(n_in=768, n_out=3072), "mosaic_gpu", M.from_label(
        "64x128x64/4,e64x32,pp"), "adamw|bt512|2048x1024"),
    (dict(bt=1024, slots=(F32, F32)), "mosaic_gpu", LONG_F32,
     "adamw|bt2048|4096x4096|w=bfloat16|slots=float32,float32"),
    # TMA cannot move x in whole 8 x 64 pieces at in = 100; no entry is
    # Lion's.
    (dict(n_in=100), "triton", None, "no Mosaic GPU entry for this case on "
     "NVIDIA H200, nor one for another BT or shape whose tiling covers it"),
    (dict(rule=pk.lion_rule(), slots=(BF16,)), "triton", None,
     "no Mosaic GPU entry"),
    (dict(g_stored=True), "triton", None, "a stored gradient"),
    (dict(bt=0), "triton", None, "no tokens"),
], ids=["down-2048", "bt-768-k/v", "bt-192-down", "up-1536", "fp32-moments",
        "fp32-weight", "fp32-weight-bt-1024-nearest", "mu-bf16",
        "mu-bf16-bt-64-nearest", "stacked",
        "adam-tuned-as",
        "measured-slower", "ragged-bt", "bt-not-8", "fp32-x", "bt-8192-nearest",
        "bt-64-nearest", "gpt2-fc-nearest", "fp32-bt-1024-nearest",
        "in-100", "lion", "stored-g", "no-tokens"])
def test_the_cache_decides_per_case(monkeypatch, case, backend, config,
                                    reason):
  _gpu(monkeypatch)
  choice = _choose(**case)
  assert choice.backend == backend, choice.reason
  assert reason in choice.reason
  if config is not None:
    assert choice.config == config
  else:
    assert isinstance(choice.config, pk.BlockConfig)


def test_another_hopper_without_entries_takes_triton(monkeypatch):
  _gpu(monkeypatch, kind="NVIDIA H100 80GB HBM3")
  choice = _choose()
  assert choice.backend == "triton"
  assert "no Mosaic GPU entry for this case on NVIDIA H100" in choice.reason


def _cache_with(tmp_path, monkeypatch, n_in, n_out, cfg, time_us,
                triton_time_us):
  """A ``$FORGE_AUTOTUNE_CACHE`` with one Mosaic GPU entry (BT 512)."""
  data = autotune._empty_cache()
  key = tuning_cache.cache_key(pk.ADAMW, 512, n_in, n_out, BF16, (BF16, BF16))
  autotune.merge(data, "NVIDIA H200", "test", {"kind": "test"}, {key: {
      "config": dataclasses.asdict(cfg), "time_us": time_us,
      "triton_time_us": triton_time_us}}, "mosaic_gpu")
  path = tmp_path / "mine.json"
  autotune.write(str(path), data)
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(path))
  tuning_cache.clear_cache()


def test_an_entry_the_kernel_cannot_run_is_not_taken(tmp_path, monkeypatch):
  # A (hand-written) entry, faster, for in=100: TMA cannot move x in whole
  # 8 x 64 pieces, so the kernel call would refuse it.
  _gpu(monkeypatch)
  _cache_with(tmp_path, monkeypatch, 100, 4096, SHORT, 1.0, 2.0)
  choice = _choose(n_in=100)
  assert choice.backend == "triton"
  assert "does not cover this case" in choice.reason
  assert "x is 512 x 100 bfloat16" in choice.reason
  # The same entry where the tiles divide: taken; the user's cache file
  # comes before the shipped one.
  _cache_with(tmp_path, monkeypatch, 4096, 4096, LONG, 1.0, 2.0)
  assert _choose().config == LONG
  # Without a Triton time to compare with, the entry selects nothing.
  _cache_with(tmp_path, monkeypatch, 4096, 4096, LONG, 1.0, None)
  choice = _choose()
  assert choice.backend == "triton" and "unrecorded" in choice.reason


def test_a_nearest_tiling_reaching_far_past_the_weight_is_not_taken(
    tmp_path, monkeypatch):
  # The one entry (4096 x 4096) has 128-row tiles: 1.6 % past a 4032-row
  # weight (taken), a third past a 192-row one (not taken: its measurement
  # says little of a case padded that much).
  _gpu(monkeypatch)
  cfg = M.from_label("128x128x64/4,e64x32,pp")
  _cache_of(tmp_path, monkeypatch, {
      "adamw|bt512|4096x4096|w=bfloat16|slots=bfloat16,bfloat16": (
          cfg.label, 1.0, 2.0)})
  near = _choose(n_in=4032)
  assert near.backend == "mosaic_gpu" and near.config == cfg
  assert mosaic_kernel.overreach(4032, 4096, 128, 128) < 1 / 16
  assert mosaic_kernel.overreach(192, 4096, 128, 128) == pytest.approx(1 / 3)
  far = _choose(n_in=192)
  assert far.backend == "triton"
  assert "nor one for another BT or shape whose tiling covers it" in (
      far.reason)


def _cache_of(tmp_path, monkeypatch, entries):
  """A ``$FORGE_AUTOTUNE_CACHE`` holding ``entries``, ``{key: (label,
  time_us, triton_time_us)}``, for the H200, and nothing of the shipped
  cache (:func:`tuning_cache.cache_paths` reads that file alone)."""
  data = autotune._empty_cache()
  autotune.merge(data, "NVIDIA H200", "test", {"kind": "test"}, {
      key: {"config": dataclasses.asdict(M.from_label(label)),
            "time_us": t, "triton_time_us": tt}
      for key, (label, t, tt) in entries.items()}, "mosaic_gpu")
  path = tmp_path / "near.json"
  autotune.write(str(path), data)
  monkeypatch.setattr(tuning_cache, "cache_paths", lambda: [str(path)])
  tuning_cache.clear_cache()


def test_nearest_entries_by_bt_then_size_then_aspect(tmp_path, monkeypatch):
  key = lambda bt, n_in, n_out, slots="bfloat16,bfloat16", rule="adamw": (
      f"{rule}|bt{bt}|{n_in}x{n_out}|w=bfloat16|slots={slots}")
  _cache_of(tmp_path, monkeypatch, {
      key(512, 4096, 4096): ("128x64x64/5,pn,pp,lp,nb", 80.0, 100.0),
      key(512, 1024, 4096): ("64x128x64/4,e64x32,pp", 30.0, 40.0),
      key(512, 4096, 1024): ("128x128x64/4,e64x32,pp", 30.0, 40.0),
      key(2048, 4096, 4096): ("128x128x64/4,s8,pn,pp,nb", 150.0, 200.0),
      key(512, 4096, 4096, "float32,float32"): ("128x128x64/4,pp,lp",
                                                 120.0, 150.0),
      key(512, 4096, 4096, "", "sgd"): ("64x64x64/3", 1.0, 2.0),
      # int8 moments: the nearer tiling's sub-tiles are not a scale block
      # (64 columns) wide.
      key(512, 4096, 4096, "int8,int8"): ("128x128x64/4,e64x32,pp", 1.0,
                                          2.0),
      key(512, 4096, 1024, "int8,int8"): ("64x128x64/4,pp,lp", 1.0, 2.0),
      key(1024, 4096, 1024): ("64x64x64/4,e64x32,pp", 50.0, 45.0),
  })
  near = lambda bt, n_in, n_out, slots=(BF16, BF16), rule=pk.ADAMW: [
      k for k, _ in tuning_cache.nearest_mosaic(
          bt, n_in, n_out, BF16, slots, rule, device_kind="NVIDIA H200")]
  # The BT bucket first (1024 is as far from 512 as from 2048: then the
  # size decides, then the larger bucket), then the size, then the aspect
  # ratio; only the same rule and dtypes.
  assert near(512, 4096, 4096) == [
      key(512, 4096, 4096), key(512, 1024, 4096), key(512, 4096, 1024),
      key(1024, 4096, 1024), key(2048, 4096, 4096)]
  assert near(768, 4096, 4096)[:3] == [key(1024, 4096, 1024),
                                       key(2048, 4096, 4096),
                                       key(512, 4096, 4096)]
  assert near(512, 2048, 1024)[:3] == [
      key(512, 4096, 1024), key(512, 1024, 4096), key(512, 4096, 4096)]
  assert near(512, 1024, 2048)[:2] == [key(512, 1024, 4096),
                                       key(512, 4096, 1024)]
  assert near(4096, 2048, 2048)[0] == key(2048, 4096, 4096)
  assert near(512, 64, 64, (F32, F32)) == [
      key(512, 4096, 4096, "float32,float32")]
  assert near(512, 4096, 4096, (), pk.sgd_rule()) == [
      key(512, 4096, 4096, "", "sgd")]
  assert near(512, 4096, 4096, (BF16,), pk.lion_rule()) == []
  assert near(512, 0, 4096) == []  # (a weight with no elements)
  assert tuning_cache.nearest_mosaic(512, 4096, 4096, BF16, (BF16, BF16),
                                     pk.ADAMW, device_kind="NVIDIA H100"
                                     ) == []
  # nearest_covering: only entries faster than the Triton kernel (not
  # BT 1024's), and only tilings that divide the case.
  covering = lambda *a, **k: tuning_cache.nearest_covering(
      *a, device_kind="NVIDIA H200", **k)[0]
  assert covering(1024, 4096, 1024, BF16, (BF16, BF16), pk.ADAMW,
                  BF16) == key(512, 4096, 1024)
  # 192 x 4096: 128-row tiles do not divide it; 64 x 128 ones do.
  assert covering(512, 192, 4096, BF16, (BF16, BF16), pk.ADAMW,
                  BF16) == key(512, 1024, 4096)
  i8 = (jnp.int8, jnp.int8)
  assert covering(2048, 4096, 4096, BF16, i8, pk.ADAMW, BF16) == key(
      512, 4096, 4096, "int8,int8")
  assert covering(2048, 4096, 4096, BF16, i8, pk.ADAMW, BF16,
                  low_precision=True) == key(512, 4096, 1024, "int8,int8")
  assert tuning_cache.nearest_covering(512, 96, 4096, BF16, (BF16, BF16),
                                       pk.ADAMW, BF16,
                                       device_kind="NVIDIA H200") is None
  # select_backend on the stand-in H200 takes that tiling.
  _gpu(monkeypatch)
  choice = _choose(512, 192, 4096)
  assert choice.backend == "mosaic_gpu"
  assert choice.config == M.from_label("64x128x64/4,e64x32,pp")
  assert _choose(512, 96, 4096).backend == "triton"


def test_environment_override(monkeypatch):
  _gpu(monkeypatch)
  monkeypatch.setenv("FORGE_BACKEND", "triton")
  choice = _choose()
  assert choice == ("triton", _triton_config(), "$FORGE_BACKEND=triton")
  # mosaic_gpu where the cache would not choose it: the cache's tiling for
  # the case, else the kernel's default tiling.
  monkeypatch.setenv("FORGE_BACKEND", "mosaic_gpu")
  choice = _choose(bt=2048, n_in=2048, n_out=1024)
  assert choice.backend == "mosaic_gpu" and choice.config == M.from_label(
      "128x128x64/4,e64x32,pp,lp")
  assert choice.reason.startswith("$FORGE_BACKEND=mosaic_gpu")
  _gpu(monkeypatch, "8.0")
  # No entry for BT 128: the nearest entry's tiling (BT 256's) ...
  choice = _choose(bt=128, n_out=1024)
  assert choice.backend == "mosaic_gpu" and choice.config == SHORT_MLP
  assert choice.reason.endswith("the tiling of the autotune cache's nearest "
                                "entry, adamw|bt256|4096x1024|w=bfloat16|"
                                "slots=bfloat16,bfloat16")
  # ... and without one (no Lion entries): the kernel's default tiling.
  choice = _choose(bt=128, rule=pk.lion_rule(), slots=(BF16,))
  assert choice.backend == "mosaic_gpu"
  assert choice.config == mosaic_kernel.default_config(
      jnp.bfloat16, [jnp.bfloat16] * 2, bt=128, shape=(4096, 4096))
  # An explicit config or backend comes first.
  assert _choose(config=pk.BlockConfig()).backend == "triton"
  assert _choose(backend="triton").backend == "triton"
  monkeypatch.setenv("FORGE_BACKEND", " ")
  assert _choose().backend == "triton"  # empty: unset
  monkeypatch.setenv("FORGE_BACKEND", "cuda")
  with pytest.raises(ValueError, match="FORGE_BACKEND='cuda' is not a "
                     "kernel backend: set it to 'triton' or 'mosaic_gpu'"):
    _choose()


def test_a_config_picks_its_own_backend():
  blocks, mosaic = pk.BlockConfig(32, 64, 32), M(tile_m=64, tile_n=64)
  assert _choose(config=blocks) == ("triton", blocks,
                                    "config is a BlockConfig")
  assert _choose(config=mosaic)[:2] == ("mosaic_gpu", mosaic)
  assert _choose(config=mosaic, backend="mosaic_gpu").config == mosaic
  with pytest.raises(TypeError, match=r"fused_wgrad_update\(backend="
                     r"'triton'\): config must be a BlockConfig .* got a "
                     r"MosaicConfig \(64x64x64/3\)"):
    _choose(config=mosaic, backend="triton")
  with pytest.raises(TypeError, match=r"\(backend='mosaic_gpu'\): config "
                     r"must be a MosaicConfig .* got a BlockConfig"):
    _choose(config=blocks, backend="mosaic_gpu")
  with pytest.raises(TypeError, match=r"\(config=...\): config must be a "
                     "pallas_kernels.BlockConfig .*MosaicConfig"):
    _choose(config="64x128x64/4")
  with pytest.raises(ValueError, match="backend='cuda'; use None"):
    _choose(backend="cuda")


def test_explicit_mosaic_takes_the_cached_tiling_compiled_only(monkeypatch):
  _gpu(monkeypatch)
  slots = (F32, F32)
  # The fp32-moment entry at BT 2048 is not the kernel's default tiling.
  compiled = _choose(bt=2048, slots=slots, backend="mosaic_gpu")
  assert compiled.config == LONG_F32
  assert "the autotune cache's tiling" in compiled.reason
  interpreted = _choose(bt=2048, slots=slots, backend="mosaic_gpu",
                        interpret=True)
  assert interpreted.config == mosaic_kernel.default_config(
      jnp.bfloat16, [jnp.bfloat16, jnp.float32, jnp.float32], bt=2048)
  assert interpreted.config != LONG_F32


def test_int8_state_on_mosaic_takes_the_int8_tiling(monkeypatch):
  """Low-precision state asked onto the Mosaic GPU kernel by name takes its
  int8 default tiling (64 x 128 tiles, 64 x 64 sub-tiles one scale block
  wide, rolled), not the cache's fp32-moment entry for the same logical
  dtypes; left to backend=None it stays on Triton."""
  _gpu(monkeypatch)
  slots = (F32, F32)  # int8 moments' logical dtype
  assert _choose(bt=2048, slots=slots, backend="mosaic_gpu").config == (
      LONG_F32)
  fmt = quant.MomentFormat("int8")
  plan, _ = lowp.plan_state(
      tuple(quant.quantize(jnp.ones((64, 128)), fmt, second_moment=k == 1)
            for k in range(2)), pk.ADAMW, jnp.ones((64, 128), BF16),
      where="test")
  for bt, n_in, n_out in [(2048, 4096, 4096), (512, 4096, 1024),
                          (512, 14336, 4096)]:
    choice = _choose(bt=bt, n_in=n_in, n_out=n_out, slots=slots,
                     backend="mosaic_gpu", low_precision=True)
    assert choice.config == M.from_label(
        f"64x128x64/4,e64x64,{'s8,' if bt > 1024 else ''}pp,lp")
    assert "default tiling" in choice.reason
    assert mosaic_kernel.low_precision_problem(plan, choice.config) is None
    assert _choose(bt=bt, n_in=n_in, n_out=n_out, slots=slots,
                   low_precision=True).backend == "triton"
  # backend=None: int8 moments the kernel takes (mosaic_slot_dtypes) are
  # looked up by their codes' dtype, Mosaic GPU where an entry measured it
  # faster with them; state it does not take stays on Triton.
  i8 = (jnp.int8, jnp.int8)
  choice = _choose(n_in=14336, slots=slots, low_precision=True,
                   mosaic_slot_dtypes=i8)
  assert choice.backend == "mosaic_gpu" and "measured" in choice.reason
  assert choice.config == M.from_label("64x128x64/4,pp,lp,nb")
  assert mosaic_kernel.low_precision_problem(plan, choice.config) is None
  assert _choose(n_in=14336, slots=slots, low_precision=True).reason == (
      lowp.MOSAIC_REFUSAL)
  # No int8 entry at BT 2048: the nearest one's (BT 512's) tiling.
  unmeasured = _choose(bt=2048, slots=slots, low_precision=True,
                       mosaic_slot_dtypes=i8)
  assert unmeasured.backend == "mosaic_gpu"
  assert unmeasured.config == M.from_label("64x128x64/4,pp,lp,nb")
  assert "nearest entry that covers it, adamw|bt512|4096x4096|w=bfloat16|" \
      "slots=int8,int8" in unmeasured.reason
  # Where 64 x 128 tiles do not divide the weight: the first that does.
  assert _choose(n_in=192, n_out=64 * 5, slots=slots, backend="mosaic_gpu",
                 low_precision=True).config.tile_n == 64
  # 4096 x 4160, which the cached int8 tilings' 64 x 128 tiles reach past:
  # int8 moments need tiles that divide the weight (their scales are
  # written by plain stores), so neither choice takes such a tiling (which
  # the call would refuse), and the default's 128 x 64 tiles divide it.
  for choice in (_choose(n_out=4160, slots=slots, low_precision=True,
                         mosaic_slot_dtypes=i8),
                 _choose(n_out=4160, slots=slots, backend="mosaic_gpu",
                         low_precision=True)):
    assert choice.backend == "mosaic_gpu", choice.reason
    cfg = choice.config
    assert 4096 % cfg.tile_m == 0 and 4160 % cfg.tile_n == 0, cfg.label
  assert (cfg.tile_m, cfg.tile_n) == (128, 64)


def test_describe_backend_reads_shapes_and_dtypes(monkeypatch):
  _gpu(monkeypatch)
  S = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  slots = (S((4096, 4096), bf),) * 2
  # (8, 64) tokens: BT 512.
  choice = pk.describe_backend(S((8, 64, 4096), bf), S((8, 64, 4096), bf),
                               S((4096, 4096), bf), slots, rule=pk.ADAMW,
                               interpret=False)
  assert choice[:2] == ("mosaic_gpu", SHORT)
  stacked = pk.describe_backend(
      S((512, 4096), bf), S((512, 4096), bf), S((3, 4096, 4096), bf),
      (S((3, 4096, 4096), bf),) * 2, rule=pk.ADAMW, interpret=False, layer=1)
  assert stacked.backend == "mosaic_gpu"
  # x bf16 and dy fp32 are promoted to fp32, which the kernel does not take.
  mixed = pk.describe_backend(S((512, 4096), bf), S((512, 4096), jnp.float32),
                              S((4096, 4096), bf), slots, rule=pk.ADAMW,
                              interpret=False)
  assert mixed.backend == "triton" and "float32" in mixed.reason


# --- the kernel call takes what was chosen -----------------------------------


def test_fused_wgrad_update_runs_the_chosen_backend(monkeypatch):
  mosaic_calls = spy_launches(monkeypatch, fused_wgrad.mosaic_kernel)
  triton_calls = spy_launches(monkeypatch, fused_wgrad.triton_kernel)
  x, dy, w, slots = make_case(31, (64,), 64, 128, (jnp.bfloat16,) * 4)
  h = adamw_hparams()
  # $FORGE_BACKEND=mosaic_gpu in interpret mode: the Mosaic GPU kernel, its
  # default tiling for the case, matching the reference.
  monkeypatch.setenv("FORGE_BACKEND", "mosaic_gpu")
  check_against_reference(x, dy, w, slots, h, pk.ADAMW, interpret=True)
  assert mosaic_calls == [mosaic_kernel.default_config(
      jnp.bfloat16, [jnp.bfloat16] * 3, bt=64, shape=(64, 128))]
  assert not triton_calls
  # A Triton tiling beats the variable.
  blocks = pk.BlockConfig(32, 64, 32)
  pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW, config=blocks,
                        interpret=True)
  assert triton_calls == [blocks]
  # A case the kernel does not cover fails, naming the variable.
  xo, dyo, wo, slotso = make_case(32, (64,), 100, 128,
                                  (jnp.bfloat16,) * 4)
  with pytest.raises(ValueError, match=r"x is 64 x 100 bfloat16.*"
                     r"\$FORGE_BACKEND=mosaic_gpu.*unset \$FORGE_BACKEND"):
    pk.fused_wgrad_update(xo, dyo, wo, slotso, h, rule=pk.ADAMW,
                          interpret=True)
  monkeypatch.setenv("FORGE_BACKEND", "bogus")
  with pytest.raises(ValueError, match="FORGE_BACKEND='bogus'"):
    pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW, interpret=True)
  # Unset, on the CPU: Triton, whatever the cache holds.
  monkeypatch.delenv("FORGE_BACKEND")
  pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW, interpret=True)
  assert len(triton_calls) == 2 and len(mosaic_calls) == 1
  assert triton_calls[1] == pk.BlockConfig.default(64, 64, 128)


def test_inside_shard_map_the_choice_is_triton(monkeypatch):
  # On a Hopper at a case the cache sends to Mosaic GPU, operands that vary
  # over a mesh axis (shard_map) take Triton: jax's mpmd_map refuses refs
  # that vary over mesh axes.
  _gpu(monkeypatch)
  assert _choose().backend == "mosaic_gpu"
  inside = _choose(varying=True)
  assert inside.backend == "triton" and "shard_map" in inside.reason
  # Asked for explicitly, it fails in plain words (a one-device mesh: the
  # typing is the same as on eight).
  mesh = jax.make_mesh((1,), ("d",))
  x, dy, w, slots = make_case(33, (64,), 64, 128, (jnp.bfloat16,) * 4)
  h = adamw_hparams()
  spec = jax.sharding.PartitionSpec(None, "d")

  def step(dy, w, m, v):
    return pk.fused_wgrad_update(x, dy, w, (m, v), h, rule=pk.ADAMW,
                                 backend="mosaic_gpu", interpret=True)[0]
  sharded = jax.shard_map(step, mesh=mesh, in_specs=(spec,) * 4,
                          out_specs=spec)
  with pytest.raises(ValueError, match="inside shard_map.*backend='triton'"):
    jax.jit(sharded).lower(*jax.device_put(
        (dy, w, *slots), jax.sharding.NamedSharding(mesh, spec)))


def test_shipped_mosaic_entries_select_mosaic_only_where_faster():
  with open(tuning_cache.SHIPPED_CACHE) as f:
    entries = json.load(f)["devices"]["NVIDIA H200"]["mosaic_gpu"]
  mosaic = tuning_cache.load(tuning_cache.SHIPPED_CACHE)["mosaic"]
  faster = {key for (kind, key), e in mosaic.items() if e.faster_than_triton}
  assert len(entries) == 73 and len(faster) == 71
  assert set(entries) - faster == {
      "adamw|bt2048|2048x1024|w=bfloat16|slots=bfloat16,bfloat16",
      "adamw|bt512|2048x1024|w=float32|slots=bfloat16,float32"}


# --- GPU ---------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_backend_none_takes_mosaic_at_a_shipped_case():
  if tuning_cache.current_device_kind() != "NVIDIA H200":
    pytest.skip("the shipped Mosaic GPU entries are the H200's")
  x, dy, w, slots = make_case(33, (512,), 4096, 4096, (jnp.bfloat16,) * 4)
  h = adamw_hparams()
  choice = pk.describe_backend(x, dy, w, slots, rule=pk.ADAMW)
  assert choice.backend == "mosaic_gpu" and choice.config == SHORT, choice
  text = jax.jit(lambda *a: pk.fused_wgrad_update(
      *a[:3], a[3:], h, rule=pk.ADAMW)).lower(x, dy, w, *slots).as_text()
  assert "mosaic_gpu" in text and "xla.gpu.triton" not in text
  check_against_reference(x, dy, w, slots, h, pk.ADAMW, interpret=False)


def _shipped_mosaic_tilings():
  """Each distinct (tiling label, weight dtype, (m, v) dtypes) of the
  shipped cache's Mosaic GPU entries; an int8-moment entry's tiling with
  bf16 moments (its int8 epilogue compiled against the reference:
  tests/test_low_precision.py)."""
  with open(tuning_cache.SHIPPED_CACHE) as f:
    entries = json.load(f)["devices"]["NVIDIA H200"]["mosaic_gpu"]
  out = set()
  for key, e in entries.items():
    w = key.split("|")[3].split("=")[1]
    slots = tuple(F32 if d == F32 else BF16
                  for d in key.split("|")[4].split("=")[1].split(",") if d)
    if len(slots) != 2:  # SGD (none), SGD with momentum (one)
      slots = (slots[0] if slots else BF16,) * 2
    out.add((M(**e["config"]).label, w, slots))
  return sorted(out)


@pytest.mark.gpu
@pytest.mark.parametrize("label,w_dtype,state", _shipped_mosaic_tilings(),
                         ids=lambda v: ",".join(v) if isinstance(v, tuple)
                         else None)
def test_gpu_every_shipped_mosaic_tiling_matches_the_reference(
    label, w_dtype, state):
  # Compiled, AdamW with the entries' weight and moments dtypes at a shape
  # every shipped tiling divides (clusters take tile rows in pairs): the
  # cache never hands out an untested kernel.
  cfg = M.from_label(label)
  x, dy, w, slots = make_case(13, (256,), 512, 384,
                              (jnp.bfloat16, jnp.dtype(w_dtype),
                               *map(jnp.dtype, state)))
  check_against_reference(x, dy, w, slots, adamw_hparams(), pk.ADAMW,
                          config=cfg, interpret=False, backend="mosaic_gpu")


def test_forge_jax_layers_train_the_same_on_the_mosaic_backend(monkeypatch):
  # A Dense layer and a scanned stack (stacked state, layer=i inside the
  # scan) through make_step, in interpret mode: the Mosaic GPU kernel
  # ($FORGE_BACKEND) gives the Triton kernel's parameters and state.
  import flax.linen as nn
  import numpy as np
  import forge_jax

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      kw = dict(dtype=BF16, param_dtype=BF16)
      x = nn.relu(forge_jax.Dense(128, **kw)(x))
      return forge_jax.ScannedDenseStack(features=128, num_layers=2, **kw)(x)

  net = Net()
  x = jax.random.normal(jax.random.key(0), (64, 128), BF16)
  loss = lambda v, b: jnp.mean(net.apply(v, b).astype(jnp.float32) ** 2)
  tx = forge_jax.adamw(1e-2)
  results = {}
  for backend in ("triton", "mosaic_gpu"):
    monkeypatch.setenv("FORGE_BACKEND", backend)
    calls = spy_launches(monkeypatch, getattr(fused_wgrad, {
        "triton": "triton_kernel", "mosaic_gpu": "mosaic_kernel"}[backend]))
    variables = net.init(jax.random.key(1), x)
    state = tx.init(variables["params"])
    _, variables, state = jax.jit(forge_jax.make_step(loss, tx))(
        variables, state, x)
    assert len(calls) == 2  # the Dense layer's and the stack's kernel
    results[backend] = jax.tree.leaves((variables, state))
    monkeypatch.undo()
  for a, b in zip(results["triton"], results["mosaic_gpu"]):
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))


def test_nearest_entries_tie_as_the_exact_lookup_orders_rules(tmp_path,
                                                              monkeypatch):
  """Entries as near as each other: the rule's own first, then its
  ``tuned_as`` rule's, then ``"any"``'s -- the exact lookup's order, not
  the keys' spelling ("adamw|" sorts before "adam|", "any|" before
  "sgd|")."""
  key = lambda rule, slots="bfloat16,bfloat16": (
      f"{rule}|bt512|4096x4096|w=bfloat16|slots={slots}")
  entry = ("128x64x64/5,pn,pp,lp,nb", 80.0, 100.0)
  _cache_of(tmp_path, monkeypatch, {
      key("adam"): entry, key("adamw"): entry, key("any"): entry,
      key("sgd", ""): entry, key("any", ""): entry})
  near = lambda rule, slots: [k for k, _ in tuning_cache.nearest_mosaic(
      256, 4096, 4096, BF16, slots, rule, device_kind="NVIDIA H200")]
  adam = pk.adam_rule()
  assert adam.tuned_as is not None
  assert near(adam, (BF16, BF16)) == [key("adam"), key("adamw"), key("any")]
  assert near(pk.sgd_rule(), ()) == [key("sgd", ""), key("any", "")]


def test_a_cache_file_with_an_approx_math_tiling_is_refused(tmp_path):
  """The cache keeps the reference's arithmetic: a Mosaic GPU entry with
  approx_math (,ax), hand-written or merged, makes the file invalid."""
  data = autotune._empty_cache()
  key = tuning_cache.cache_key(pk.ADAMW, 512, 4096, 4096, BF16, (BF16, BF16))
  autotune.merge(data, "NVIDIA H200", "test", {"kind": "test"}, {key: {
      "config": dataclasses.asdict(M.from_label("128x128x64/4,pp,ax")),
      "time_us": 1.0, "triton_time_us": 2.0}}, "mosaic_gpu")
  with pytest.raises(ValueError, match="approx_math"):
    tuning_cache.validated(data, "mine.json")


def test_a_dtype_alias_takes_the_heuristic_on_a_cache_miss(monkeypatch):
  """``select_config`` accepts dtype names ("bf16") as the cache lookup
  does, also where the cache has no entry and the heuristic decides."""
  _gpu(monkeypatch)
  got = pk.select_config(512, 4000, 4000, "bf16", ("bf16", "bf16"),
                         pk.ADAMW, interpret=False)
  assert got == pk.BlockConfig.compiled_default(512, 4000, 4000,
                                                jnp.bfloat16)
