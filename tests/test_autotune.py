"""The autotuner: its config spaces, the shipped cache, lookup and tune()."""

import csv
import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import autotune, tuning_cache
from tests.test_kernel import adamw_hparams, check_against_reference, make_case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tuning sources the shipped cache was built from (kept under
# benchmarks/results/h200/autotune).
AUTOTUNE = os.path.join("benchmarks", "results", "h200", "autotune")
H200_CSV = os.path.join(ROOT, AUTOTUNE, "kernel.csv")
# The shipped cache: the first H200 sweep, then the variant sweeps merged over
# it in this order (a later CSV's winner replaces an earlier one's).
H200_CSVS = [H200_CSV] + [os.path.join(ROOT, AUTOTUNE, f"variants_{s}.csv")
                          for s in "acbd"]
# The autotuner's tuning of the e2e decoder's own shapes, then a wider tuning
# of those shapes at BT 512, whose winners replace the first one's there.
H200_TUNED = [os.path.join(AUTOTUNE, "decoder_shapes_tuned.json"),
              os.path.join(AUTOTUNE, "decoder_shapes_bt512_tuned.json")]
# The Mosaic GPU entries: the kernel's default tilings per case in the
# benchmarks.backends run of commit ddd1e56, each beside the Triton kernel.
BACKENDS_CSV = os.path.join("benchmarks", "results", "h200", "backends.csv")
MOSAIC_FROM_CSV = ["--from-csv", BACKENDS_CSV, "--commit", "ddd1e56",
                   "--mosaic-pick", "default"]
# Then the run of commit 9228555 (the ping-pong schedule beside the previous
# defaults, BT 512 and 2048): its fastest tiling per case it measured
# replaces the entry.
MOSAIC_PINGPONG_FROM_CSV = ["--from-csv", BACKENDS_CSV, "--commit", "9228555",
                            "--mosaic-pick", "fastest"]
# Then the run of commit c7c1567 (the rolled epilogue beside the ping-pong
# defaults, BT 512, 2048 and 4096, fp32 moments at BT 512, SGD and SGD with
# momentum): its fastest tiling per case it measured replaces the entry.
MOSAIC_ROLLED_FROM_CSV = ["--from-csv", BACKENDS_CSV, "--commit", "c7c1567",
                          "--mosaic-pick", "fastest"]
# Then the run of commit ee3c82c (the 0.886 B decoder's shapes, BT 512 and
# 2048), that of commit 0eff7ae (BT 512, the 64x64 epilogue sub-tile beside
# the default, bf16 and int8 moments), that of commit fee8919 (BT 512, int8
# moments on smaller ping-pong tiles and the state ring, and bf16 ones at
# 4096x4096) and that of commit 1b02eba (BT 512, bf16 moments on the
# smaller tiles at the other three shapes), and that of commit 846ff5a
# (BT 512, int8 and bf16 moments on 64x128 and 128x64 ping-pong tiles, the
# int8 epilogue's scales loaded by TMA), that of commit 868c0e8 (without
# automatic barriers, BT 512 and 2048; the LM head), that of commit
# 0764b56 (the ring across tiles, BT 512, 2048 and 4096), that of commit
# de106a3 (clusters of two programs, BT 512, 2048 and 4096), those of
# commit 57fa5c9 (fp32 moments on the ping-pong schedule, BT 512, 2048 and
# 4096) and that of commit 51674fc (the decoder's shapes at BT 512 on the
# newer tilings), each the fastest tiling per case it measured.
MOSAIC_LATER_FROM_CSV = [
    ["--from-csv", BACKENDS_CSV, "--commit", c, "--mosaic-pick", "fastest"]
    for c in ("ee3c82c", "0eff7ae", "fee8919", "1b02eba", "846ff5a",
              "868c0e8", "0764b56", "de106a3", "57fa5c9", "51674fc")] + [
    # Five K steps and the ring across tiles at BT 512 (commit b0561ee),
    # then the 64 x 64 epilogue sub-tile at BT 2048 (commit 47b2950): only
    # where faster than the entry held.
    ["--from-csv", BACKENDS_CSV, "--commit", c, "--mosaic-pick", "faster"]
    for c in ("b0561ee", "47b2950")] + [
    # The shipped BT 512 and 2048 tilings at BT 1024 (commit 01d5aaf) and
    # the BT 512 ones at BT 256 (commit 3cc5976), buckets no entry held,
    # then an fp32 weight with fp32 moments at BT 512 and 2048 (commit
    # cad4866), then with bf16 m and fp32 v (commit be43b4d), dtypes no
    # entry held: each case's fastest.
    ["--from-csv", BACKENDS_CSV, "--commit", c, "--mosaic-pick", "fastest"]
    for c in ("01d5aaf", "3cc5976", "cad4866", "be43b4d")] + [
    # bf16 m and fp32 v over an fp32 weight at the decoder's shapes, with
    # the --auto arm's tilings among the candidates (commit 2d3c6f2): only
    # where faster than the entry held.
    ["--from-csv", BACKENDS_CSV, "--commit", "2d3c6f2", "--mosaic-pick",
     "faster"]]
BF16 = ("bfloat16", "bfloat16")


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
  monkeypatch.delenv(tuning_cache.ENV_VAR, raising=False)
  tuning_cache.clear_cache()
  yield
  tuning_cache.clear_cache()


def _shipped():
  with open(tuning_cache.SHIPPED_CACHE) as f:
    return json.load(f)


# --- the shipped cache -------------------------------------------------------


def test_config_space_is_valid_and_distinct():
  space = autotune.config_space()
  assert len(space) == len(set(space)) >= 6
  for cfg in space:
    assert tuning_cache.parse_label(tuning_cache.config_label(cfg)) == cfg


def test_labels_round_trip_every_knob():
  cfg = pk.BlockConfig(64, 128, 32, 4, 8, 2, prefetch=True, stream_state=True,
                       split_out=2)
  assert tuning_cache.config_label(cfg) == "64x128x32,g4,w8,s2,p,e,o2"
  assert tuning_cache.parse_label("64x128x32,g4,w8,s2,p,e,o2") == cfg
  assert tuning_cache.parse_label("64x128x32,g1,w4,s4,o4").split_out == 4


def test_shipped_json_loads_and_every_entry_is_a_valid_block_config():
  data = _shipped()
  assert data["format"] == tuning_cache.FORMAT_VERSION
  configs = tuning_cache.load(tuning_cache.SHIPPED_CACHE)["configs"]
  assert configs, "the shipped cache is empty"
  for (kind, key), cfg in configs.items():
    assert isinstance(cfg, pk.BlockConfig)
    entry = data["devices"][kind]["entries"][key]
    # (a knob added after an entry was written takes its default)
    assert cfg == pk.BlockConfig(**entry["config"])
    assert entry["config"].items() <= dataclasses.asdict(cfg).items()
    assert entry["source"] in data["devices"][kind]["sources"]
    # the recorded winner is the fastest of the timings recorded beside it
    assert entry["time_us"] == min(entry["timings_us"].values())
    assert tuning_cache.config_label(cfg) in entry["timings_us"]
    rule, bt, shape, w, slots = key.split("|")
    assert bt.startswith("bt")
    assert tuning_cache.bt_bucket(int(bt[2:])) == int(bt[2:])


def test_shipped_json_holds_the_h200_sweep_with_provenance():
  dev = _shipped()["devices"]["NVIDIA H200"]
  # 4 shapes x BT 512/2048/4096 (bf16 moments; the split_out sweep
  # re-measured every case), 4096^2 at BT 512 with fp32 moments, and a BT 16
  # case; then the decoder's 5 shapes x BT 512/2048 (tuned by the autotuner;
  # its BT-512 winners replaced by the wider tuning).
  assert len(dev["entries"]) == 24
  assert sorted(s["csv"] for s in dev["sources"].values() if "csv" in s) == (
      sorted([os.path.relpath(p, ROOT) for p in H200_CSVS]
             + [BACKENDS_CSV] * 20))
  # (the runs of ddd1e56, 9228555, c7c1567, ee3c82c, 0eff7ae, fee8919,
  # 1b02eba, 846ff5a, 868c0e8, 0764b56, de106a3, 57fa5c9, 51674fc,
  # b0561ee, 47b2950, 01d5aaf, 3cc5976, cad4866, be43b4d and 2d3c6f2)
  assert sorted(s["file"] for s in dev["sources"].values()
                if "file" in s) == sorted(H200_TUNED)
  assert sum(e["source"].startswith("autotune@")
             for e in dev["entries"].values()) == 10
  for source in dev["sources"].values():
    assert source["device"] == "gpu:NVIDIA H200"
    assert "jax 0.11.2" in source["versions"]
    assert "triton 3.6.0" in source["versions"]
    assert source["measured"][:10] in (
        ("2026-12-02", "2026-12-03", "2026-12-04", "2026-12-05")
        if source.get("csv") == BACKENDS_CSV
        else ("2026-11-29",))
  for entry in [*dev["entries"].values(), *dev["mosaic_gpu"].values()]:
    assert entry["source"] in dev["sources"]


def _default_at_ddd1e56(x_dtype, state_dtypes, bt=None, shape=None,
                        quantized=False):
  """``mosaic_kernel.default_config`` at commit ddd1e56 (the column-split
  schedule's tilings), for the cases its benchmarks.backends run measured
  (no int8 moments): the shipped Mosaic GPU entries are that run's default
  tilings."""
  del x_dtype, shape, quantized
  if bt is not None and bt <= 1024:
    narrow = all(jnp.dtype(d).itemsize <= 2 for d in state_dtypes)
    return pk.MosaicConfig.from_label("64x128x64/4,b2,pn" if narrow
                                      else "128x128x64/4,r1")
  return pk.MosaicConfig.from_label("128x128x64/4,e64x32,r2,s8")


def test_from_csv_reproduces_the_shipped_winners(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)  # the sources record the paths as given
  monkeypatch.setattr(autotune.mosaic_kernel, "default_config",
                      _default_at_ddd1e56)
  out = tmp_path / "tuned.json"
  assert autotune.main(["--from-csv", *H200_CSVS, "--out", str(out)]) == 0
  assert autotune.main(["--merge", *H200_TUNED, "--out", str(out)]) == 0
  assert autotune.main([*MOSAIC_FROM_CSV, "--out", str(out)]) == 0
  assert autotune.main([*MOSAIC_PINGPONG_FROM_CSV, "--out", str(out)]) == 0
  assert autotune.main([*MOSAIC_ROLLED_FROM_CSV, "--out", str(out)]) == 0
  for argv in MOSAIC_LATER_FROM_CSV:
    assert autotune.main([*argv, "--out", str(out)]) == 0
  got = json.loads(out.read_text())
  assert got == _shipped()


def test_merge_rejects_a_missing_file_and_config(tmp_path, capsys):
  out = str(tmp_path / "t.json")
  with pytest.raises(SystemExit):
    autotune.main(["--merge", str(tmp_path / "nope.json"), "--out", out])
  assert "no such cache file" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    autotune.main(["--merge", *H200_TUNED, "--config", "64x64x64,g1,w4,s3",
                   "--out", out])
  assert "--merge measures nothing" in capsys.readouterr().err
  assert not os.path.exists(out)


def test_package_data_declares_the_json():
  with open(os.path.join(ROOT, "pyproject.toml")) as f:
    text = f.read()
  assert "[tool.setuptools.package-data]" in text
  assert 'pallas_kernels = ["tuned_configs.json"]' in text


# --- lookup and select_config --------------------------------------------------


def test_lookup_hits_the_h200_winners():
  # 4096x1024 at BT 512: the register-lean 64x64 tile (the split_out sweep).
  cfg = tuning_cache.lookup(512, 4096, 1024, jnp.bfloat16, BF16, pk.ADAMW,
                            device_kind="NVIDIA H200")
  assert cfg == pk.BlockConfig(64, 64, 64, 1, 4, 3, stream_state=True)
  # 4096x14336 at BT 2048: grouped 128x256 in four column sub-tiles (the
  # split_out sweep).
  cfg = tuning_cache.lookup(2048, 4096, 14336, "bf16", BF16, "adamw",
                            device_kind="NVIDIA H200")
  assert cfg == pk.BlockConfig(128, 256, 32, 8, 8, 4, stream_state=True,
                               split_out=4)
  # BT is bucketed to the next power of two.
  assert tuning_cache.lookup(1500, 4096, 14336, jnp.bfloat16, BF16, pk.ADAMW,
                             device_kind="NVIDIA H200") == cfg
  # 4096x14336 at BT 512: 64x128 in two column halves (the split_out sweep).
  cfg = tuning_cache.lookup(512, 4096, 14336, "bf16", BF16, "adamw",
                            device_kind="NVIDIA H200")
  assert cfg == pk.BlockConfig(64, 128, 32, 1, 4, 4, stream_state=True,
                               split_out=2)


def _tuned_lookup(rule):
  slots = (jnp.bfloat16,) * len(rule.slots)
  return tuning_cache.lookup(512, 2048, 1024, jnp.bfloat16, slots, rule,
                             device_kind="NVIDIA H200")


def test_rules_tuned_as_adamw_take_its_winners():
  """Rules with AdamW's state and like work (optax's Adam variants) take the
  cached AdamW tilings where they have none of their own; Lion and SGD do
  not."""
  want = _tuned_lookup(pk.ADAMW)
  assert want is not None
  for rule in (pk.adam_rule(), pk.adam_rule(nesterov=True),
               pk.adamw_rule(nesterov=True), pk.ADAMW.with_static(round_mu=1.0)):
    assert _tuned_lookup(rule) == want, rule.name
  for rule in (pk.lion_rule(), pk.sgd_rule(momentum=True)):
    assert _tuned_lookup(rule) is None, rule.name


def test_torch_adam_rules_take_adamws_winners():
  """forge_torch's AdamW and Adam formulas (its own rule names) take them
  too; amsgrad (a third slot) does not."""
  from pallas_kernels import torch_rules
  want = _tuned_lookup(pk.ADAMW)
  for rule in (torch_rules.adam_rule(False),
               torch_rules.adam_rule(False, cuda_fused=True)):
    assert _tuned_lookup(rule) == want, rule.name
  assert _tuned_lookup(torch_rules.adam_rule(True)) is None


def test_a_rules_own_entry_wins_over_its_tuned_as(tmp_path):
  own = pk.BlockConfig(32, 64, 16, 1, 4, 2)
  key = tuning_cache.cache_key("adam", 512, 2048, 1024, jnp.bfloat16, BF16)
  path = tmp_path / "cache.json"
  path.write_text(json.dumps({"format": 1, "devices": {"NVIDIA H200": {
      "entries": {key: {"config": dataclasses.asdict(own)}}}}}))
  tuning_cache.clear_cache()
  try:
    found = tuning_cache.lookup(512, 2048, 1024, jnp.bfloat16, BF16,
                                pk.adam_rule(), device_kind="NVIDIA H200",
                                paths=[str(path)] + tuning_cache.cache_paths())
  finally:
    tuning_cache.clear_cache()
  assert found == own


def test_tuned_as_must_name_another_rule():
  for bad in ("adamw", 3, (), ("adam", "adam"), ("adam", "adamw"), ["adam"]):
    with pytest.raises(ValueError, match="tuned_as must name another rule"):
      dataclasses.replace(pk.ADAMW, tuned_as=bad)
  assert dataclasses.replace(pk.ADAMW, tuned_as=("adam", "lion")).tuned_as


@pytest.mark.parametrize("case", [
    dict(bt=512, n_in=4096, n_out=4097),          # unknown shape
    dict(bt=8192),                                 # BT bucket not tuned
    dict(w_dtype=jnp.float32),                     # other W dtype
    dict(slot_dtypes=("float32", "float32")),      # other moment dtypes
    dict(rule=pk.lion_rule()),                     # other rule
    dict(device_kind="NVIDIA A100"),               # other device
    dict(device_kind="cpu"),
])
def test_lookup_misses(case):
  args = dict(bt=512, n_in=4096, n_out=1024, w_dtype=jnp.bfloat16,
              slot_dtypes=BF16, rule=pk.ADAMW, device_kind="NVIDIA H200")
  args.update(case)
  kind = args.pop("device_kind")
  assert tuning_cache.lookup(**args, device_kind=kind) is None


def test_cpu_never_uses_gpu_entries():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU")
  assert tuning_cache.current_device_kind() is None
  # no device_kind given: the current device (CPU) matches nothing
  assert tuning_cache.lookup(512, 4096, 1024, jnp.bfloat16, BF16,
                             pk.ADAMW) is None
  for interpret in (None, True):
    assert pk.select_config(512, 4096, 1024, jnp.bfloat16, BF16, pk.ADAMW,
                            interpret=interpret) == pk.BlockConfig.default(
                                512, 4096, 1024)
  # compiled (as on a GPU with no cache entry): the compiled heuristic
  assert pk.select_config(512, 4096, 1024, jnp.bfloat16, BF16, pk.ADAMW,
                          interpret=False) == pk.BlockConfig.compiled_default(
                              512, 4096, 1024, jnp.bfloat16)


def test_select_config_is_the_heuristic_in_interpret_mode(monkeypatch):
  # Even when the device looks like an H200, interpret mode uses the heuristic.
  monkeypatch.setattr(tuning_cache, "current_device_kind",
                      lambda: "NVIDIA H200")
  args = (512, 4096, 1024, jnp.bfloat16, BF16, pk.ADAMW)
  assert pk.select_config(*args, interpret=True) == pk.BlockConfig.default(
      512, 4096, 1024)
  # Compiled on that "GPU": the cached winner; unknown shapes: the heuristic.
  entry = _shipped()["devices"]["NVIDIA H200"]["entries"][
      "adamw|bt512|4096x1024|w=bfloat16|slots=bfloat16,bfloat16"]
  assert pk.select_config(*args, interpret=False) == pk.BlockConfig(
      **entry["config"])
  assert pk.select_config(512, 4096, 4097, jnp.bfloat16, BF16, pk.ADAMW,
                          interpret=False) == pk.BlockConfig.compiled_default(
                              512, 4096, 4097, jnp.bfloat16)


@pytest.mark.parametrize("fn", ["select_config", "select_backend"])
@pytest.mark.parametrize("args,error,match", [
    ((-5, 64, 64, "bfloat16", BF16, None), ValueError, "bt=-5"),
    ((8, 4.5, 64, "bfloat16", BF16, None), ValueError, "n_in=4.5"),
    ((8, 64, 64, "floatx", BF16, None), TypeError, "w_dtype='floatx'"),
    ((8, 64, 64, "bfloat16", ("nope", "bfloat16"), None), TypeError,
     r"slot_dtypes\[0\]='nope'"),
    ((8, 64, 64, "bfloat16", BF16, 42), TypeError, "rule=42"),
])
def test_a_case_no_call_could_have_is_refused_in_interpret_mode(
    fn, args, error, match):
  """select_config / select_backend on a case with a negative or fractional
  size, a name that is no dtype or a rule that is none: refused naming the
  argument in interpret mode too (there an answer was formed from it; on a
  GPU the dtype failed inside jnp.dtype)."""
  extra = ("bfloat16",) if fn == "select_backend" else ()
  rule_args = args if args[5] is not None or fn == "select_config" else (
      args[:5] + (pk.ADAMW,))
  with pytest.raises(error, match=match):
    getattr(tuning_cache, fn)(*rule_args, *extra, interpret=True)


def test_select_config_takes_the_values_it_took_before_its_checks():
  """No slots given as None, a NumPy or JAX integer or an integral float
  size, slot dtypes from a generator (read once): answered as before."""
  want = tuning_cache.select_config(512, 64, 64, "bfloat16", BF16,
                                    interpret=True)
  for args in ((np.int64(512), 64, 64, "bfloat16", BF16),
               (np.float32(512), jnp.float32(64), 64, "bfloat16", BF16),
               (jnp.int32(512), 64.0, 64, "bfloat16", BF16),
               (512, 64, 64, "bfloat16", (d for d in BF16))):
    assert tuning_cache.select_config(*args, interpret=True) == want
  assert isinstance(tuning_cache.select_config(
      512, 64, 64, "bfloat16", None, interpret=True), pk.BlockConfig)
  # Not sizes: a string, a complex, a boolean array.
  for bad in ("512", np.complex64(512 + 3j), np.array(True)):
    with pytest.raises(ValueError, match="bt=.*non-negative integer"):
      tuning_cache.select_config(bad, 64, 64, "bfloat16", BF16,
                                 interpret=True)


def test_a_traced_size_or_static_setting_is_refused_saying_so():
  """Under jax.jit a size or a rule's static setting given as a traced
  value is refused with what to pass instead (the tiling and the kernel
  build are fixed when tracing), not only as "not a number"."""
  @jax.jit
  def choose(bt):
    tuning_cache.select_config(bt, 64, 64, "bfloat16", BF16, interpret=True)
    return bt

  with pytest.raises(ValueError, match=r"bt=.*traced value.*x\.shape\[0\]"):
    choose(512)

  @jax.jit
  def build(round_mu):
    pk.adam_rule().with_static(round_mu=round_mu)
    return round_mu

  with pytest.raises(TypeError, match="round_mu.*traced value.*Python number"):
    build(1.0)
  # (Concrete values as before: no such words.)
  with pytest.raises(TypeError) as e:
    pk.adam_rule().with_static(round_mu="1")
  assert "traced" not in str(e.value)


def test_fused_wgrad_update_without_config_uses_select_config(monkeypatch):
  seen = []
  real = tuning_cache.lookup

  def spy(*a, **k):
    seen.append(a)
    return real(*a, **k)

  monkeypatch.setattr(tuning_cache, "lookup", spy)
  x, dy, w, slots = make_case(0, (37,), 70, 130, (jnp.bfloat16,) * 4)
  check_against_reference(x, dy, w, slots, adamw_hparams(), pk.ADAMW)
  assert not seen  # interpret mode never consults the cache

  # Compiled (lowered for an H200 without one), config=None takes the
  # cache's winner for the case: the Triton kernel is launched with it.
  from pallas_kernels import fused_wgrad, triton_kernel  # noqa: PLC0415
  from tests.harness import lower_for_cuda  # noqa: PLC0415
  monkeypatch.setattr(tuning_cache, "current_device_kind",
                      lambda: "NVIDIA H200")
  launched = []
  real_launch = triton_kernel.launch

  def launch(*a, cfg, **k):
    launched.append(cfg)
    return real_launch(*a, cfg=cfg, **k)

  monkeypatch.setattr(fused_wgrad.triton_kernel, "launch", launch)
  bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  lower_for_cuda(
      lambda x, dy, w, h, m, v: pk.fused_wgrad_update(
          x, dy, w, (m, v), h, rule=pk.ADAMW, backend="triton",
          interpret=False),
      bf16(512, 4096), bf16(512, 1024), bf16(4096, 1024),
      jax.ShapeDtypeStruct((pk.HPARAM_VECTOR_LEN,), jnp.float32),
      bf16(4096, 1024), bf16(4096, 1024))
  entry = _shipped()["devices"]["NVIDIA H200"]["entries"][
      "adamw|bt512|4096x1024|w=bfloat16|slots=bfloat16,bfloat16"]
  assert seen, "the compiled call did not consult the cache"
  assert launched == [pk.BlockConfig(**entry["config"])]


def _write_cache(path, kind, key, cfg):
  data = autotune._empty_cache()
  autotune.merge(data, kind, "test", {"kind": "test"},
                 {key: {"config": dataclasses.asdict(cfg), "time_us": 1.0}})
  autotune.write(str(path), data)


def test_env_var_override(tmp_path, monkeypatch):
  mine = pk.BlockConfig(32, 64, 32, 2, 2, 2)
  key = tuning_cache.cache_key(pk.ADAMW, 512, 4096, 1024, jnp.bfloat16, BF16)
  path = tmp_path / "retuned.json"
  _write_cache(path, "NVIDIA H200", key, mine)
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(path))
  assert tuning_cache.cache_paths() == [str(path), tuning_cache.SHIPPED_CACHE]
  # the override wins over the shipped entry ...
  assert tuning_cache.lookup(512, 4096, 1024, jnp.bfloat16, BF16, pk.ADAMW,
                             device_kind="NVIDIA H200") == mine
  # ... and the shipped file still answers what the override lacks
  assert tuning_cache.lookup(2048, 4096, 14336, jnp.bfloat16, BF16, pk.ADAMW,
                             device_kind="NVIDIA H200") == pk.BlockConfig(
                             128, 256, 32, 8, 8, 4, stream_state=True,
                             split_out=4)
  monkeypatch.setattr(tuning_cache, "current_device_kind",
                      lambda: "NVIDIA H200")
  assert pk.select_config(512, 4096, 1024, jnp.bfloat16, BF16, pk.ADAMW,
                          interpret=False) == mine


def test_any_rule_entries_apply_to_every_rule(tmp_path):
  cfg = pk.BlockConfig(32, 32, 32, 1, 4, 3)
  key = tuning_cache.cache_key(None, 100, 64, 64, jnp.float32, ("float32",))
  assert key.startswith("any|bt128|")
  path = tmp_path / "any.json"
  _write_cache(path, "Some GPU", key, cfg)
  got = tuning_cache.lookup(128, 64, 64, jnp.float32, ("float32",),
                            pk.lion_rule(), device_kind="Some GPU",
                            paths=[str(path)])
  assert got == cfg


def test_missing_env_cache_fails_clearly(tmp_path, monkeypatch):
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(tmp_path / "nope.json"))
  with pytest.raises(FileNotFoundError, match=tuning_cache.ENV_VAR):
    tuning_cache.lookup(512, 4096, 1024, jnp.bfloat16, BF16, pk.ADAMW,
                        device_kind="NVIDIA H200")


_KEY = tuning_cache.cache_key("adamw", 512, 64, 64, jnp.bfloat16, BF16)


def test_bad_cache_entries_fail_clearly(tmp_path):
  path = tmp_path / "bad.json"
  data = autotune._empty_cache()
  data["devices"]["X"] = {"entries": {_KEY: {"config": {"block_in": 48}}}}
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="bad entry"):
    tuning_cache.load(str(path))


@pytest.mark.parametrize("table", ["entries", "mosaic_gpu"])
@pytest.mark.parametrize("key", [
    "k", "adamw|bt0|64x64|w=bfloat16|slots=bfloat16,bfloat16",
    "adamw|bt512|0x64|w=bfloat16|slots=bfloat16,bfloat16",
    "adamw|bt512|64x64",
    # Forms a lookup never finds: a dtype alias, BT not a bucket, no dtype.
    "adamw|bt512|64x64|w=bf16|slots=bfloat16,bfloat16",
    "adamw|bt500|64x64|w=bfloat16|slots=bfloat16,bfloat16",
    "adamw|bt512|64x64|w=nonsense|slots="])
def test_malformed_cache_keys_fail_clearly(tmp_path, table, key):
  """A key not of cache_key's form (a hand edit: a zero size, a missing
  part, a dtype alias, BT not a power of two) is refused when the file is
  read, naming the file and the key, not met later as a math error in the
  nearest-entry search or never found by a lookup."""
  path = tmp_path / "bad.json"
  data = autotune._empty_cache()
  data["devices"]["NVIDIA H200"] = {"entries": {}, table: {key: {
      "config": {} if table == "mosaic_gpu" else dataclasses.asdict(
          pk.BlockConfig(32, 64, 32))}}}
  path.write_text(json.dumps(data))
  tuning_cache.clear_cache()
  try:
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: bad key "
                       f".*{re.escape(repr(key))}"):
      tuning_cache.nearest_mosaic(64, 64, 64, jnp.bfloat16, BF16, pk.ADAMW,
                                  device_kind="NVIDIA H200",
                                  paths=[str(path)])
  finally:
    tuning_cache.clear_cache()


def test_a_clipped_rule_takes_its_base_rules_own_tilings(tmp_path):
  """grad_scaled(rule) takes the entries rule takes, in rule's order: its
  own (Adam's), then its tuned_as rule's (AdamW's), then "any"."""
  own, aw = pk.BlockConfig(32, 64, 32), pk.BlockConfig(64, 128, 64)
  key = lambda r: tuning_cache.cache_key(r, 512, 256, 256, jnp.bfloat16, BF16)
  path = tmp_path / "cache.json"
  path.write_text(json.dumps({"format": 1, "devices": {"NVIDIA H200": {
      "entries": {key("adam"): {"config": dataclasses.asdict(own)},
                  key("adamw"): {"config": dataclasses.asdict(aw)}}}}}))
  clipped = pk.grad_scaled(pk.adam_rule())
  assert clipped.tuned_as == ("adam", "adamw")
  assert pk.grad_scaled(pk.ADAMW).tuned_as == "adamw"
  tuning_cache.clear_cache()
  try:
    got = [tuning_cache.lookup(512, 256, 256, jnp.bfloat16, BF16, r,
                               device_kind="NVIDIA H200", paths=[str(path)])
           for r in (pk.adam_rule(), clipped, pk.grad_scaled(pk.ADAMW))]
  finally:
    tuning_cache.clear_cache()
  assert got == [own, own, aw]


# --- tune --------------------------------------------------------------------


def _fake_timer(times, calls, run=True):
  """Seconds from ``times`` by config; runs the step once (interpret mode)."""

  def timer(step, state, cfg):
    calls.append((cfg, state))
    if run:
      jax.block_until_ready(step(state))
    t = times[cfg]
    if isinstance(t, Exception):
      raise t
    return t

  return timer


def test_tune_picks_the_fastest_and_skips_failures():
  configs = [pk.BlockConfig(16, 16, 16), pk.BlockConfig(32, 16, 16, 2),
             pk.BlockConfig(16, 32, 16, 1, 2, 2), pk.BlockConfig(32, 32, 32)]
  times = {configs[0]: 3e-6, configs[1]: 1e-6,
           configs[2]: RuntimeError("does not compile"), configs[3]: 2e-6}
  calls = []
  res = autotune.tune(40, 48, 40, jnp.float32, ("float32", "float32"),
                      pk.ADAMW, configs=configs,
                      timer=_fake_timer(times, calls))
  assert res.best == configs[1] and res.best_s == 1e-6
  assert res.timings == {c: times[c] for c in (configs[0], configs[1],
                                               configs[3])}
  assert list(res.failures) == [configs[2]]
  assert "does not compile" in res.failures[configs[2]]
  assert [c for c, _ in calls] == configs


def test_tune_refuses_a_rule_name_with_the_cli_names():
  with pytest.raises(TypeError, match="needs an UpdateRule.*adamw"):
    autotune.tune(40, 48, 40, jnp.float32, ("float32", "float32"),
                  rule="adamw")


def test_cli_rules_are_the_registrys_kernel_rules():
  """--rule offers every registered regime-1/2 rule (and named variant) by
  the name its cache entries use."""
  from pallas_kernels import families
  rules = families.optax_rules(regimes=(1, 2)).values()
  assert sorted(autotune.RULES) == sorted(r.name for r in rules)
  assert all(r.name == name for name, r in autotune.RULES.items())
  assert {"adamw", "adamw_nesterov", "adam", "adamax", "radam", "lion", "sgd",
          "sgd_momentum", "adagrad", "rmsprop", "lamb_moments",
          "muon_momentum_nesterov"} <= set(autotune.RULES)


def test_tune_raises_when_nothing_runs():
  cfg = pk.BlockConfig(16, 16, 16)
  with pytest.raises(RuntimeError, match="no config ran"):
    autotune.tune(16, 16, 16, jnp.float32, ("float32", "float32"), pk.ADAMW,
                  configs=[cfg], timer=_fake_timer({cfg: ValueError("x")}, [],
                                                   run=False))


def test_tune_clamps_candidates_to_the_problem():
  cands = autotune.candidates(20, 24, 40)
  assert all(c.block_in <= 32 and c.block_out <= 64 and c.block_bt <= 32
             for c in cands)
  assert len(cands) == len(set(cands))


def test_tune_never_touches_the_callers_arrays():
  """Tuning runs (and donates) scratch copies only: the caller's W and state,
  passed to stand for their dtypes, keep their values and stay alive."""
  x, dy, w, slots = make_case(3, (24,), 40, 48,
                              (jnp.bfloat16, jnp.bfloat16, jnp.float32,
                               jnp.bfloat16))
  before = [np.asarray(a).copy() for a in (x, dy, w, *slots)]
  configs = [pk.BlockConfig(16, 16, 16), pk.BlockConfig(32, 64, 32)]
  calls = []

  def donating_timer(step, state, cfg):
    # a real timer donates the state to a jitted loop; do the same here
    calls.append(state)
    out = jax.jit(step, donate_argnums=0)(state)
    jax.block_until_ready(out)
    return {configs[0]: 2.0, configs[1]: 1.0}[cfg]

  res = autotune.tune(24, 40, 48, w, slots, pk.ADAMW, configs=configs,
                      timer=donating_timer)
  assert res.best == configs[1]
  for a, b in zip((x, dy, w, *slots), before):
    assert not a.is_deleted()
    np.testing.assert_array_equal(np.asarray(a), b)
  # the timer got fresh arrays of the caller's shapes and dtypes, not theirs
  for state in calls:
    assert [(a.shape, a.dtype) for a in state] == [
        (a.shape, a.dtype) for a in (x, dy, w, *slots)]
    assert not any(s is a for s in state for a in (x, dy, w, *slots))


def test_autotune_cli_refuses_on_cpu(tmp_path, capsys):
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU")
  out = tmp_path / "t.json"
  assert autotune.main(["--shapes", "64x64", "--tokens", "16", "--out",
                        str(out)]) == 2
  assert "needs a GPU" in capsys.readouterr().err
  assert not out.exists()


@pytest.mark.parametrize("bt,n_in,n_out", [(7, 5, 20), (3000, 33, 17),
                                           (512, 4096, 4096)])
def test_candidates_fit_every_problem(bt, n_in, n_out):
  # the whole space, clamped: valid configs (split_out shrinks with the tile)
  cands = autotune.candidates(bt, n_in, n_out)
  assert cands and len(cands) == len(set(cands))
  for c in cands:
    assert c.block_out // c.split_out >= 16
    assert c.block_in <= max(16, 2 * n_in) and c.block_out <= max(16, 2 * n_out)


def test_autotune_cli_tunes_only_the_given_candidates(tmp_path, monkeypatch):
  # A stand-in GPU and timer: the CLI's own path, no device needed.
  monkeypatch.setattr(autotune, "current_device_kind", lambda: "Fake GPU")
  monkeypatch.setattr(autotune, "loop_timer", lambda: (
      lambda step, state, cfg: 1e-6 * cfg.block_out * cfg.split_out))
  out = tmp_path / "t.json"
  labels = ["16x32x16,g1,w4,s2,e,o2", "16x16x16,g1,w4,s2"]
  assert autotune.main(["--shapes", "40x48", "--tokens", "24", "--config",
                        *labels, "--out", str(out)]) == 0
  (entry,) = json.loads(out.read_text())["devices"]["Fake GPU"][
      "entries"].values()
  assert sorted(entry["timings_us"]) == sorted(labels)
  assert entry["config"] == dataclasses.asdict(
      tuning_cache.parse_label(labels[1]))
  assert entry["time_us"] == pytest.approx(16.0)


@pytest.mark.parametrize("argv,match", [
    (["--config", "64x128x32,g1,w4,s4,o3"], "split_out=3 must be a power"),
    (["--config", "big"], "not a config label: 'big'"),
    (["--from-csv", "k.csv", "--config", "64x128x32,g1,w4,s4"],
     "--from-csv measures nothing"),
])
def test_autotune_cli_rejects_bad_candidates(argv, match, capsys):
  with pytest.raises(SystemExit) as e:
    autotune.main(argv)
  assert e.value.code == 2
  assert match in capsys.readouterr().err


# --- GPU ---------------------------------------------------------------------


@pytest.mark.gpu
def test_tune_on_gpu_returns_a_config_that_runs_and_matches():
  bt, n_in, n_out = 256, 512, 384
  res = autotune.tune(bt, n_in, n_out, jnp.bfloat16, BF16, pk.ADAMW,
                      configs=autotune.config_space()[:4],
                      timer=autotune.loop_timer(n_inner=3, n_outer=2))
  assert res.best in res.timings and res.best_s > 0
  assert all(t > 0 for t in res.timings.values())
  x, dy, w, slots = make_case(11, (bt,), n_in, n_out, (jnp.bfloat16,) * 4)
  check_against_reference(x, dy, w, slots, adamw_hparams(), pk.ADAMW,
                          config=res.best, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", [(jnp.bfloat16,) * 4, (jnp.float32,) * 4],
                         ids=["bf16", "f32"])
def test_every_shipped_tiling_matches_the_reference_on_gpu(dtypes):
  # Each distinct tiling of the shipped cache, compiled, on a ragged shape
  # (every edge partial): the cache never hands out an untested kernel.
  configs = sorted(
      set(tuning_cache.load(tuning_cache.SHIPPED_CACHE)["configs"].values()),
      key=tuning_cache.config_label)
  assert len(configs) >= 5
  x, dy, w, slots = make_case(12, (300,), 520, 390, dtypes)
  for cfg in configs:
    check_against_reference(x, dy, w, slots, adamw_hparams(), pk.ADAMW,
                            config=cfg, interpret=False)


def _tuned_as_adamw_rules():
  from pallas_kernels import torch_rules
  return [pk.adam_rule(), pk.adam_rule(nesterov=True),
          pk.adamw_rule(nesterov=True), torch_rules.adam_rule(False),
          torch_rules.adam_rule(False, cuda_fused=True)]


def test_every_shipped_tiling_lowers_for_the_rules_tuned_as_adamw():
  """The rules that take AdamW's cached tilings (tuned_as) go through
  Triton's lowering with each of them (deviceless, on the CPU)."""
  from tests.harness import lower_for_cuda, triton_calls
  configs = sorted(
      set(tuning_cache.load(tuning_cache.SHIPPED_CACHE)["configs"].values()),
      key=tuning_cache.config_label)
  S = jax.ShapeDtypeStruct
  b16 = jnp.bfloat16
  for rule in _tuned_as_adamw_rules():
    assert rule.tuned_as == "adamw", rule.name
    for cfg in configs:
      step = lambda x, dy, w, h, m, v, rule=rule, cfg=cfg: (
          pk.fused_wgrad_update(x, dy, w, (m, v), h, rule=rule, config=cfg,
                                interpret=False))
      text = lower_for_cuda(step, S((300, 520), b16), S((300, 390), b16),
                            S((520, 390), b16),
                            S((pk.HPARAM_VECTOR_LEN,), jnp.float32),
                            S((520, 390), b16), S((520, 390), b16))
      assert len(triton_calls(text)) == 1, (rule.name, cfg)


# --- malformed cache files and CLI values -------------------------------------


@pytest.mark.parametrize("text,match", [
    ('{"format": 1, "devices": {', "not a valid JSON file"),
    (json.dumps({"format": 1, "devices": []}), "must be an object"),
    (json.dumps({"format": 1, "devices": {"X": {"entries": [1]}}}),
     "must be an object"),
], ids=["truncated", "devices-list", "entries-list"])
def test_malformed_cache_raises_value_error_naming_the_file(tmp_path, text,
                                                           match):
  p = tmp_path / "bad.json"
  p.write_text(text)
  with pytest.raises(ValueError, match=match) as e:
    tuning_cache.load(str(p))
  assert str(p) in str(e.value)


def test_malformed_env_cache_names_the_variable(tmp_path, monkeypatch):
  p = tmp_path / "bad.json"
  p.write_text("{")
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(p))
  with pytest.raises(ValueError, match=tuning_cache.ENV_VAR):
    tuning_cache.lookup(512, 4096, 1024, jnp.bfloat16, BF16, pk.ADAMW,
                        device_kind="NVIDIA H200")


def _good_cache(path, key, cfg):
  data = autotune._empty_cache()
  autotune.merge(data, "G", "s", {"kind": "test"},
                 {key: {"config": dataclasses.asdict(cfg)}})
  autotune.write(str(path), data)


def test_malformed_out_file_is_a_usage_error(tmp_path, capsys):
  key = tuning_cache.cache_key(pk.ADAMW, 512, 64, 64, "bfloat16", BF16)
  _good_cache(tmp_path / "good.json", key, pk.BlockConfig(32, 32, 32))
  bad = tmp_path / "bad.json"
  bad.write_text('{"format": 1, "devices": {')
  with pytest.raises(SystemExit) as e:
    autotune.main(["--merge", str(tmp_path / "good.json"), "--out", str(bad)])
  assert e.value.code == 2
  assert "--out" in capsys.readouterr().err
  assert bad.read_text() == '{"format": 1, "devices": {'


def test_merge_keeps_entries_without_a_source_record(tmp_path):
  """lookup() uses an entry with no (or an unknown) source, so --merge must
  carry it over rather than drop it and report 0 entries."""
  key = tuning_cache.cache_key(pk.ADAMW, 512, 64, 64, "bfloat16", BF16)
  other = tuning_cache.cache_key(pk.ADAMW, 1024, 64, 64, "bfloat16", BF16)
  cfg = pk.BlockConfig(32, 32, 32)
  src = tmp_path / "hand.json"
  src.write_text(json.dumps({"format": 1, "devices": {"G": {"entries": {
      key: {"config": dataclasses.asdict(cfg)},
      other: {"config": dataclasses.asdict(cfg), "source": "nowhere"}}}}}))
  assert tuning_cache.lookup(512, 64, 64, "bfloat16", BF16, pk.ADAMW,
                             device_kind="G", paths=[str(src)]) == cfg
  out = tmp_path / "out.json"
  assert autotune.main(["--merge", str(src), "--out", str(out)]) == 0
  tuning_cache.clear_cache()
  assert tuning_cache.lookup(512, 64, 64, "bfloat16", BF16, pk.ADAMW,
                             device_kind="G", paths=[str(out)]) == cfg
  dev = json.loads(out.read_text())["devices"]["G"]
  assert len(dev["entries"]) == 2
  assert all(e["source"] in dev["sources"] for e in dev["entries"].values())


@pytest.mark.parametrize("bad", [
    ["--tokens", "0"], ["--tokens", "-3"], ["--shapes", "0x48"],
    ["--w-dtype", "bogus"], ["--slot-dtype", "int8"]],
    ids=["tokens0", "tokens-3", "shape0", "wdtype", "slotdtype"])
def test_autotune_cli_bad_values_are_usage_errors(bad, tmp_path, monkeypatch):
  monkeypatch.setattr(autotune, "current_device_kind", lambda: "Fake GPU")
  monkeypatch.setattr(autotune, "loop_timer",
                      lambda: (lambda step, state, cfg: 1e-6))
  out = tmp_path / "t.json"
  with pytest.raises(SystemExit) as e:
    autotune.main(["--shapes", "40x48", "--tokens", "24", "--config",
                   "16x16x16,g1,w4,s2", *bad, "--out", str(out)])
  assert e.value.code == 2
  assert not out.exists()


def test_cli_default_out_is_the_env_cache_then_a_checkouts_shipped_file(
    tmp_path, monkeypatch):
  monkeypatch.delenv(tuning_cache.ENV_VAR, raising=False)
  assert autotune.default_out() == tuning_cache.SHIPPED_CACHE  # this checkout
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(tmp_path / "mine.json"))
  assert autotune.default_out() == str(tmp_path / "mine.json")


def test_cli_refuses_to_write_into_an_installed_package(tmp_path, monkeypatch,
                                                       capsys):
  monkeypatch.delenv(tuning_cache.ENV_VAR, raising=False)
  shipped = tmp_path / "lib" / "site-packages" / "pallas_kernels" / "t.json"
  monkeypatch.setattr(autotune, "SHIPPED_CACHE", str(shipped))
  assert autotune.default_out() is None
  with pytest.raises(SystemExit) as e:
    autotune.main(["--merge", *H200_TUNED])
  assert e.value.code == 2
  assert "pass --out FILE, or set $FORGE_AUTOTUNE_CACHE" in capsys.readouterr().err
  assert not shipped.exists()


# --- the Mosaic GPU backend ---------------------------------------------------

H200 = "NVIDIA H200"
M = pk.MosaicConfig


def test_mosaic_config_space_is_valid_and_fits_a_typical_case():
  space = autotune.mosaic_config_space()
  assert 6 <= len(space) <= 49 and len(space) == len(set(space))
  assert [c.label for c in space] == list(autotune.MOSAIC_CONFIG_SPACE)
  bf, f32 = jnp.bfloat16, jnp.float32
  # The kernel's default tilings are candidates.
  for state, bt in (([bf] * 3, 512), ([bf] * 3, 2048), ([bf, f32, f32], 512)):
    assert pk.mosaic_kernel.default_config(bf, state, bt=bt) in space
  # BT 2048, 4096 x 4096, bf16 AdamW: every candidate fits shared memory and
  # is accepted by the kernel.
  w, slots = jax.ShapeDtypeStruct((4096, 4096), bf), [
      jax.ShapeDtypeStruct((4096, 4096), bf)] * 2
  for cfg in space:
    assert cfg.smem_bytes(bf, [bf] * 3) <= pk.mosaic_kernel._SMEM_BYTES
    assert pk.mosaic_kernel.unsupported(2048, 4096, 4096, bf, w, slots,
                                        pk.ADAMW, cfg, stacked=False,
                                        g_stored=False) is None, cfg.label
  assert autotune.mosaic_candidates(2048, 4096, 4096, "bf16", "bf16", BF16,
                                    pk.ADAMW) == space
  # fp32 moments: fewer fit. 192 inputs: the 128-row tiles reach past them
  # (candidates too), but no cluster's tile-row pairs divide them.
  wide = autotune.mosaic_candidates(2048, 4096, 4096, "bf16", "bf16",
                                    ("float32",) * 2, pk.ADAMW)
  assert 6 <= len(wide) < len(space)
  assert all(c.smem_bytes(bf, [bf, f32, f32]) <= pk.mosaic_kernel._SMEM_BYTES
             for c in wide)
  narrow = autotune.mosaic_candidates(512, 192, 4096, "bf16", "bf16", BF16,
                                      pk.ADAMW)
  assert any(c.tile_m == 128 for c in narrow)
  assert any(c.tile_m == 64 for c in narrow)
  assert not any(c.cluster > 1 for c in narrow)
  assert any(c.cluster > 1 for c in space)
  assert autotune.mosaic_candidates(512, 4096, 4096, "float32", "bf16",
                                    BF16, pk.ADAMW) == []


def _csv_rows(path):
  with open(os.path.join(ROOT, path), newline="") as f:
    return [r for r in csv.DictReader(f) if r["metric"] == "time"]


def test_shipped_mosaic_entries_are_the_measured_default_tilings():
  dev = _shipped()["devices"][H200]
  entries = dev["mosaic_gpu"]
  # AdamW: 4 shapes x BT 512/2048/4096 (bf16 moments and fp32 moments);
  # SGD and SGD with momentum at 4096^2, BT 512; the decoder's 4 shapes x
  # BT 512/2048 (bf16 moments); the 4 Llama shapes at BT 512 with int8
  # moments; the LM head of the decoder (2048 x 32000) at BT 512 and 2048;
  # the 4 Llama shapes at BT 256 and 1024 (bf16 moments); the 4 Llama
  # shapes at BT 512 and 2048 with an fp32 weight and fp32 moments, and
  # with an fp32 weight, bf16 m and fp32 v (optax's mu_dtype=bfloat16);
  # the decoder's 4 shapes x BT 512/2048 with the latter, and SGD at
  # 14336 x 4096, BT 512.
  assert len(entries) == 73
  rows = _csv_rows(BACKENDS_CSV)
  by_commit = {}
  for key, entry in entries.items():
    rule, bt, shape, w, slots = key.split("|")
    bt = int(bt[2:])
    # (SGD has no slot: its rows' dtypes name bf16.)
    short = {"bfloat16": "bf16", "float32": "fp32", "int8": "int8"}
    names = [short[d] for d in slots.split("=")[1].split(",") if d]
    suffix = (f"m {names[0]}; v {names[1]}" if len(set(names)) == 2
              else (names or ["bf16"])[0])
    operands = {"w=bfloat16": "x,dy,W bf16;",
                "w=float32": "x,dy bf16; W fp32;"}[w]
    label = M(**entry["config"]).label
    source = dev["sources"][entry["source"]]
    assert source["csv"] == BACKENDS_CSV
    commit = source["commit"]
    by_commit.setdefault(commit, set()).add(key)
    assert rule in ("adamw", "sgd", "sgd_momentum")
    assert entry["timings_us"][label] == entry["time_us"]
    # Its time and the Triton kernel's are the rows of one run of the CSV.
    case = [r for r in rows if r["commit"] == commit and r["case"] == rule
            and r["timestamp"] == entry["run"]
            and r["shape"] == f"BT={bt} {shape}"
            and r["dtypes"].startswith(operands)
            and r["dtypes"].endswith(suffix)]
    # (the --auto arm's rows, forge_auto_mosaic_<label>, time its tiling)
    mosaic = {M.from_label(r["provider"].split("mosaic_", 1)[1]).label:
              float(r["p50"]) for r in case
              if r["provider"].startswith(("forge_mosaic_",
                                           "forge_auto_mosaic_"))}
    (triton,) = [float(r["p50"]) for r in case
                 if r["provider"] == "forge_triton"]
    assert entry["time_us"] == mosaic[label]
    assert entry["triton_time_us"] == triton
    # (the first run, ddd1e56's default tilings, has no entry left: each
    # shipped one is the fastest tiling a later run measured)
    assert commit in ("c7c1567", "ee3c82c", "868c0e8", "de106a3",
                      "57fa5c9", "51674fc", "b0561ee", "47b2950", "01d5aaf",
                      "3cc5976", "cad4866", "be43b4d", "2d3c6f2")
    assert "fastest" in source["pick"]
    assert entry["time_us"] == min(
        t for lab, t in mosaic.items()
        if not M.from_label(lab).approx_math), key
  # Each later run replaced the cases it measured: c7c1567 every
  # bf16-moment case and the fp32-moment ones at BT 512, then 0eff7ae the
  # four bf16-moment cases at BT 512; ee3c82c brought the decoder's shapes;
  # fee8919 the int8-moment cases (replacing 0eff7ae's) and 4096^2 with
  # bf16 moments, 1b02eba the other three bf16-moment cases at BT 512,
  # 846ff5a all eight of those again, 868c0e8 those eight, the four
  # bf16-moment cases at BT 2048 and the LM head, 0764b56 the
  # bf16-moment cases at BT 512 and 2048 and two at BT 4096, de106a3 the
  # twelve bf16-moment cases at BT 512, 2048 and 4096, 57fa5c9 the
  # twelve fp32-moment ones and 51674fc the decoder's four at BT 512; then
  # b0561ee (five K steps) where it was faster: three bf16-moment and the
  # four fp32-moment cases at BT 512, three of the decoder's; then 47b2950
  # (the 64 x 64 epilogue sub-tile and the rolled epilogue at BT 2048)
  # where it was faster: three of de106a3's bf16-moment cases (not
  # 4096 x 1024, whose held entry's time from an earlier run is lower;
  # no fp32-moment case). So nothing
  # of ddd1e56's, 0eff7ae's, fee8919's, 1b02eba's, 846ff5a's or 0764b56's
  # stands, of c7c1567's only SGD's two and of ee3c82c's the decoder's
  # shapes at BT 2048.
  assert len(by_commit["c7c1567"]) == 2 and "9228555" not in by_commit
  assert len(by_commit["ee3c82c"]) == 4 and len(by_commit["868c0e8"]) == 6
  assert len(by_commit["de106a3"]) == 6 and len(by_commit["57fa5c9"]) == 8
  assert len(by_commit["51674fc"]) == 1 and len(by_commit["b0561ee"]) == 10
  assert len(by_commit["47b2950"]) == 3
  assert len(by_commit["cad4866"]) == 8 and all(
      "|w=float32|slots=float32,float32" in k for k in by_commit["cad4866"])
  assert len(by_commit["be43b4d"]) == 8 and all(
      "|w=float32|slots=bfloat16,float32" in k for k in by_commit["be43b4d"])
  # 2d3c6f2: the decoder's shapes with an fp32 weight, bf16 m and fp32 v
  # (no entry held them) and SGD at 14336 x 4096, BT 512.
  assert len(by_commit["2d3c6f2"]) == 9
  assert not {"ddd1e56", "0eff7ae", "fee8919", "1b02eba", "846ff5a",
              "0764b56"} & set(by_commit)
  for commit in by_commit:
    assert {M(**entries[k]["config"]).pingpong
            for k in by_commit[commit]} == {True}
  # fp32 moments: the ping-pong schedule's rolled 64 x 64 epilogue, in
  # bands of 8 beyond BT 1024, mostly without the automatic barriers.
  fp32_won = {M(**entries[k]["config"]).label for k in by_commit["57fa5c9"]}
  assert fp32_won == {"128x128x64/4,s8,pp,lp,nb",
                      "128x128x64/4,s8,pn,pp,lp,nb"}
  # At BT 512 the rolled 64x64 epilogue on the smaller ping-pong tiles won
  # on the Llama shapes, where 128 x 128 spilled, without Pallas's
  # automatic barriers (,nb); with int8 moments everywhere, with bf16 ones
  # in clusters of two (,c2) at 4096^2 and 4096 x 14336 and beside the
  # ring running across tiles (,pn) on 128 x 128 tiles at 4096 x 1024. At
  # BT 2048 and 4096 the bands of 8 with the ring across tiles and without
  # the barriers, not in clusters.
  won = {"|".join(k.split("|")[1:3] + k.split("|")[4:]):
         M(**entries[k]["config"]).label
         for k in by_commit["868c0e8"] | by_commit["de106a3"]}
  small, narrow = "64x128x64/4,pp,lp", "128x64x64/4,pp,lp"
  band = "128x128x64/4,e64x32,s8,pn,pp,nb"
  assert won == {
      "bt512|4096x1024|slots=bfloat16,bfloat16": (
          "128x128x64/4,e64x32,pn,pp,nb"),
      "bt512|4096x4096|slots=int8,int8": small + ",nb",
      "bt512|4096x1024|slots=int8,int8": narrow + ",nb",
      "bt512|4096x14336|slots=int8,int8": small + ",nb",
      "bt512|14336x4096|slots=int8,int8": small + ",nb",
      "bt2048|4096x1024|slots=bfloat16,bfloat16": band,
      "bt4096|4096x4096|slots=bfloat16,bfloat16": band,
      "bt4096|4096x1024|slots=bfloat16,bfloat16": band,
      "bt4096|4096x14336|slots=bfloat16,bfloat16": band,
      "bt4096|14336x4096|slots=bfloat16,bfloat16": band,
      "bt512|2048x32000|slots=bfloat16,bfloat16": small,
      "bt2048|2048x32000|slots=bfloat16,bfloat16": (
          "128x128x64/4,e64x32,pp,lp")}
  # Five K steps won at BT 512 on the Llama shapes other than 4096 x 1024
  # (fp32 moments there: 128 x 128 tiles again, re-measured faster), on
  # 64 x 128 tiles in clusters of two, or 128 x 64 with the ring across
  # tiles at 4096^2; on the decoder's MLP shapes without a cluster.
  five = "64x128x64/5,c2,pp,lp,nb"
  assert {"|".join(k.split("|")[1:3] + k.split("|")[4:]):
          M(**entries[k]["config"]).label for k in by_commit["b0561ee"]} == {
      "bt512|4096x4096|slots=bfloat16,bfloat16": "128x64x64/5,pn,pp,lp,nb",
      "bt512|4096x14336|slots=bfloat16,bfloat16": five,
      "bt512|14336x4096|slots=bfloat16,bfloat16": five,
      "bt512|4096x4096|slots=float32,float32": five,
      "bt512|4096x1024|slots=float32,float32": "128x128x64/4,pp,lp,nb",
      "bt512|4096x14336|slots=float32,float32": five,
      "bt512|14336x4096|slots=float32,float32": five,
      "bt512|2048x1024|slots=bfloat16,bfloat16": "64x128x64/4,e64x32,pp",
      "bt512|2048x5632|slots=bfloat16,bfloat16": "64x128x64/5,pp,lp,nb",
      "bt512|5632x2048|slots=bfloat16,bfloat16": "64x128x64/5,pp,lp,nb"}
  # At BT 2048 the 64 x 64 epilogue sub-tile (a ring of two) won on two
  # bf16-moment cases, the rolled 64 x 32 one at 4096^2 (0.2 us ahead).
  assert {"|".join(k.split("|")[1:3] + k.split("|")[4:]):
          M(**entries[k]["config"]).label for k in by_commit["47b2950"]} == {
      "bt2048|4096x4096|slots=bfloat16,bfloat16":
          "128x128x64/4,e64x32,s8,pn,pp,lp,nb",
      "bt2048|4096x14336|slots=bfloat16,bfloat16": "128x128x64/4,s8,pn,pp,nb",
      "bt2048|14336x4096|slots=bfloat16,bfloat16": "128x128x64/4,s8,pn,pp,nb"}
  # c7c1567's rolled winner that stands: SGD's.
  bf16 = "w=bfloat16|slots=bfloat16,bfloat16"
  assert {k for k in by_commit["c7c1567"]
          if M(**entries[k]["config"]).rolled} == {
              "sgd|bt512|4096x4096|w=bfloat16|slots="}
  slower = {k for k, e in entries.items()
            if e["time_us"] >= e["triton_time_us"]}
  assert slower == {f"adamw|bt2048|2048x1024|{bf16}",
                    "adamw|bt512|2048x1024|w=float32|slots=bfloat16,float32"}


def test_shipped_mosaic_entries_fit_their_cases():
  """Every shipped Mosaic GPU tiling is one the kernel takes for its case
  (``mosaic_kernel.unsupported``, whose shared-memory estimate bounds the
  lowering's: tests/test_mosaic_lowering.py): a cached winner never fails
  at launch."""
  from pallas_kernels import families, lowp, mosaic_kernel
  from pallas_kernels.quant import MomentFormat, Quantized
  S = jax.ShapeDtypeStruct
  rules = {"adamw": families.get("adamw").optax_rule(),
           "sgd": families.get("sgd").optax_rule(),
           "sgd_momentum": families.get("sgd").optax_rule(momentum=0.9)}
  for key, entry in _shipped()["devices"][H200]["mosaic_gpu"].items():
    name, bt, shape, w, slots = key.split("|")
    rule, bt = rules[name], int(bt[2:])
    n_in, n_out = map(int, shape.split("x"))
    kinds = [k for k in slots.split("=")[1].split(",") if k]
    assert len(kinds) == len(rule.slots), key
    w = S((n_in, n_out), jnp.dtype(w.split("=")[1]))
    plan, state = None, []
    if "int8" in kinds:
      fmt = MomentFormat("int8")
      plan = lowp.StatePlan(tuple(
          lowp.SlotPlan(fmt, n in rule.second_moments) for n in rule.slots))
    for k in kinds:
      if k == "int8":
        state.append(Quantized(S((n_in, n_out), jnp.int8),
                               S((n_in, n_out // 64), jnp.float32)))
      else:
        state.append(S((n_in, n_out), jnp.dtype(k)))
    why = mosaic_kernel.unsupported(
        bt, n_in, n_out, jnp.bfloat16, w, state, rule, M(**entry["config"]),
        stacked=False, g_stored=False, low_precision=plan is not None,
        plan=plan)
    assert why is None, (key, why)


_BACKENDS_HEADER = ["benchmark", "case", "provider", "shape", "dtypes",
                    "metric", "p20", "p50", "p80", "unit", "device",
                    "versions", "timestamp", "commit"]


def _backends_csv(path, rows):
  """A benchmarks.backends CSV of ``(run, commit, shape, moments, provider,
  p50 us)`` time rows (each with a max_rel_err row beside it)."""
  with open(path, "w", newline="") as f:
    out = csv.writer(f)
    out.writerow(_BACKENDS_HEADER)
    for run, commit, shape, moments, provider, t in rows:
      for metric, v in (("time", t), ("max_rel_err_vs_xla", 0.001)):
        out.writerow(["backends", "adamw", provider, shape,
                      f"x,dy,W bf16; m,v {moments}", metric, v, v, v,
                      "us" if metric == "time" else "", "gpu:Fake GPU",
                      "jax 0.12", f"2026-12-0{run}T00:00:00+00:00", commit])


def test_the_auto_arms_tiling_is_a_candidate_like_the_others(tmp_path):
  """benchmarks.backends --auto times the tiling backend=None took (the
  nearest entry's, beyond the cache) as forge_auto_mosaic_<label>: a
  measurement of that tiling, which an entry made from the run may pick."""
  a, b = "128x128x64/4,pp,lp", "64x128x64/2"
  path = tmp_path / "b.csv"
  _backends_csv(path, [
      (1, "c1", "BT=512 2048x2048", "bf16", "forge_triton", 100.0),
      (1, "c1", "BT=512 2048x2048", "bf16", "forge_mosaic_" + b, 90.0),
      (1, "c1", "BT=512 2048x2048", "bf16", "forge_auto_mosaic_" + a, 80.0),
  ])
  key = tuning_cache.cache_key("adamw", 512, 2048, 2048, "bf16", BF16)
  _, _, _, entries = autotune.mosaic_winners_from_csv(str(path))
  assert M(**entries[key]["config"]) == M.from_label(a)
  assert entries[key]["time_us"] == 80.0
  assert entries[key]["timings_us"] == {a: 80.0, b: 90.0}


def test_mosaic_entries_from_a_backends_csv(tmp_path):
  a = "forge_mosaic_128x128x64/4,e64x32,s8,pn,pp,nb"  # the BT 2048 default
  b = "forge_mosaic_64x128x64/2"
  path = tmp_path / "b.csv"
  _backends_csv(path, [
      # BT 2048: the first measurement has b fastest; the second the
      # default tiling a, slower than b but faster than Triton. The default
      # pick takes a.
      (1, "c1", "BT=2048 4096x4096", "bf16", "forge_triton", 200.0),
      (1, "c1", "BT=2048 4096x4096", "bf16", b, 150.0),
      (2, "c1", "BT=2048 4096x4096", "bf16", "forge_triton", 210.0),
      (2, "c1", "BT=2048 4096x4096", "bf16", a, 170.0),
      (2, "c1", "BT=2048 4096x4096", "bf16", "xla_unfused", 100.0),
      # BT 512, fp32 moments: Mosaic slower than Triton.
      (1, "c1", "BT=512 4096x1024", "fp32", "forge_triton", 30.0),
      (1, "c1", "BT=512 4096x1024", "fp32", b, 31.0),
      # No Triton row in its run: left out.
      (3, "c1", "BT=512 4096x4096", "bf16", b, 1.0),
      # Another commit.
      (4, "c0", "BT=2048 4096x4096", "bf16", "forge_triton", 500.0),
      (4, "c0", "BT=2048 4096x4096", "bf16", b, 1.0),
  ])
  key = tuning_cache.cache_key("adamw", 2048, 4096, 4096, "bf16", BF16)
  slow = tuning_cache.cache_key("adamw", 512, 4096, 1024, "bf16",
                                ("float32",) * 2)
  kind, sid, source, entries = autotune.mosaic_winners_from_csv(
      str(path), commit="c1")
  assert (kind, sid) == ("Fake GPU", "b.csv@2026-12-01T00:00:00+00:00")
  assert sorted(entries) == sorted([key, slow])
  fast = entries[key]
  assert M(**fast["config"]) == M.from_label(b[13:])
  assert (fast["time_us"], fast["triton_time_us"]) == (150.0, 200.0)
  assert fast["timings_us"] == {b[13:]: 150.0, a[13:]: 170.0}
  assert entries[slow]["time_us"] > entries[slow]["triton_time_us"]
  assert source["commit"] == "c1" and "fastest" in source["pick"]
  _, _, source, entries = autotune.mosaic_winners_from_csv(
      str(path), commit="c1", pick="default")
  assert M(**entries[key]["config"]) == M.from_label(a[13:])
  assert (entries[key]["time_us"], entries[key]["triton_time_us"]) == (
      170.0, 210.0)
  # Without the commit filter the other commit's faster row wins.
  _, _, _, entries = autotune.mosaic_winners_from_csv(str(path))
  assert entries[key]["time_us"] == 1.0
  # Through the CLI: Mosaic entries, looked up and chosen by that device.
  out = tmp_path / "t.json"
  assert autotune.main(["--from-csv", str(path), "--commit", "c1",
                        "--out", str(out)]) == 0
  found = tuning_cache.lookup_mosaic(2048, 4096, 4096, "bf16", BF16,
                                     pk.ADAMW, device_kind="Fake GPU",
                                     paths=[str(out)])
  assert found == tuning_cache.MosaicEntry(M.from_label(b[13:]), 150.0, 200.0)
  assert found.faster_than_triton
  assert not json.loads(out.read_text())["devices"]["Fake GPU"]["entries"]
  # --mosaic-pick faster: a later run's entry replaces the one held only
  # where it measured faster.
  later = tmp_path / "later.csv"
  _backends_csv(later, [
      (5, "c2", "BT=2048 4096x4096", "bf16", "forge_triton", 200.0),
      (5, "c2", "BT=2048 4096x4096", "bf16", a, 160.0),  # slower than 150
      (5, "c2", "BT=512 4096x1024", "fp32", "forge_triton", 30.0),
      (5, "c2", "BT=512 4096x1024", "fp32", a, 25.0),  # faster than 31
  ])
  kept = tmp_path / "kept.json"
  kept.write_text(out.read_text())
  assert autotune.main(["--from-csv", str(later), "--mosaic-pick", "faster",
                        "--out", str(kept)]) == 0
  held = json.loads(kept.read_text())["devices"]["Fake GPU"]["mosaic_gpu"]
  assert held[key]["time_us"] == 150.0 and M(**held[key]["config"]) == (
      M.from_label(b[13:]))
  assert held[slow]["time_us"] == 25.0 and M(**held[slow]["config"]) == (
      M.from_label(a[13:]))
  sources = json.loads(kept.read_text())["devices"]["Fake GPU"]["sources"]
  assert "only where it is faster" in sources[held[slow]["source"]]["pick"]
  with pytest.raises(ValueError, match="use one of"):
    autotune.mosaic_winners_from_csv(str(later), pick="faster")
  # --merge carries Mosaic GPU entries over.
  merged = tmp_path / "m.json"
  assert autotune.main(["--merge", str(out), "--out", str(merged)]) == 0
  assert (json.loads(merged.read_text())["devices"]["Fake GPU"]["mosaic_gpu"]
          .keys() == {key, slow})


def test_approximate_tilings_are_timed_but_never_cached(tmp_path):
  exact, approx = ("forge_mosaic_64x128x64/4,pp,lp,nb",
                   "forge_mosaic_64x128x64/4,pp,lp,nb,ax")
  path = tmp_path / "b.csv"
  _backends_csv(path, [
      (1, "c1", "BT=512 4096x4096", "bf16", "forge_triton", 120.0),
      (1, "c1", "BT=512 4096x4096", "bf16", exact, 101.0),
      (1, "c1", "BT=512 4096x4096", "bf16", approx, 99.0),
      # Only an approximate tiling measured: no entry for the case.
      (1, "c1", "BT=512 4096x1024", "bf16", "forge_triton", 40.0),
      (1, "c1", "BT=512 4096x1024", "bf16", approx, 30.0),
  ])
  _, _, _, entries = autotune.mosaic_winners_from_csv(str(path))
  key = tuning_cache.cache_key("adamw", 512, 4096, 4096, "bf16", BF16)
  assert list(entries) == [key]
  assert M(**entries[key]["config"]) == M.from_label(exact[13:])
  assert entries[key]["time_us"] == 101.0
  assert entries[key]["timings_us"] == {exact[13:]: 101.0, approx[13:]: 99.0}


@pytest.mark.parametrize("argv,match", [
    (["--commit", "abc"], "--commit chooses the rows of --from-csv CSVs"),
    (["--mosaic-pick", "default"], "needs --from-csv"),
    (["--mosaic-pick", "slowest"], "invalid choice: 'slowest'"),
    (["--from-csv", "x.csv", "--backend", "both"], "--backend choose(s)"),
    (["--backend", "triton", "--config", "128x128x64/4,r2"],
     "128x128x64/4,r2 is a mosaic_gpu tiling, but --backend triton"),
    (["--backend", "mosaic_gpu", "--config", "64x64x64,g1,w4,s3"],
     "is a triton tiling, but --backend mosaic_gpu"),
    (["--config", "128x128x64/4,q1"], "unknown knob 'q1'"),
    (["--tokens", "384", "512"], "--tokens 384 and 512 share one cache "
     "entry (BT 512"),
    (["--from-csv", "x.csv", "--act-dtype", "bfloat16"],
     "--act-dtype choose(s) what to measure"),
    (["--backend", "mosaic_gpu", "--config", "128x128x64/4,pp,ax"],
     "--config 128x128x64/4,pp,ax: approx_math (,ax) changes the rule's"),
])
def test_autotune_cli_mosaic_usage_errors(argv, match, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    autotune.main([*argv, "--out", str(tmp_path / "t.json")])
  assert e.value.code == 2
  assert match in capsys.readouterr().err
  assert not (tmp_path / "t.json").exists()


def test_one_bucket_keeps_the_case_measured_at_its_own_bt(tmp_path):
  """BT 384 and 512 share the cache's BT-512 entry: the case measured at
  BT 512 is kept, whichever the CSV lists first; a held entry without a
  time of its own is beaten by any measured one (--mosaic-pick faster)."""
  b = "forge_mosaic_64x128x64/2"
  for order in (1, -1):
    path = tmp_path / f"b{order}.csv"
    _backends_csv(path, [
        (1, "c1", "BT=384 4096x4096", "bf16", "forge_triton", 70.0),
        (1, "c1", "BT=384 4096x4096", "bf16", b, 90.0),
        (1, "c1", "BT=512 4096x4096", "bf16", "forge_triton", 100.0),
        (1, "c1", "BT=512 4096x4096", "bf16", b, 80.0),
    ][::order])
    _, _, _, entries = autotune.mosaic_winners_from_csv(str(path))
    (entry,) = entries.values()
    assert entry["bt_measured"] == 512
    assert (entry["time_us"], entry["triton_time_us"]) == (80.0, 100.0)
  out = tmp_path / "held.json"
  data = autotune._empty_cache()
  key = tuning_cache.cache_key("adamw", 512, 4096, 4096, "bf16", BF16)
  autotune.merge(data, "Fake GPU", "hand", {"kind": "hand"}, {key: {
      "config": dataclasses.asdict(M.from_label("64x64x64/3")),
      "triton_time_us": 100.0}}, "mosaic_gpu")
  autotune.write(str(out), data)
  assert autotune.main(["--from-csv", str(tmp_path / "b1.csv"),
                        "--mosaic-pick", "faster", "--out", str(out)]) == 0
  held = json.loads(out.read_text())["devices"]["Fake GPU"]["mosaic_gpu"]
  assert held[key]["time_us"] == 80.0


def test_bad_backends_csvs_fail_clearly(tmp_path):
  path = tmp_path / "b.csv"
  _backends_csv(path, [(1, "c1", "BT=512 64x64", "bf16", "forge_triton", 1.0),
                       (1, "c1", "BT=512 64x64", "bf16",
                        "forge_mosaic_96x64x64/2", 1.0)])
  with pytest.raises(ValueError, match="provider 'forge_mosaic_96x64x64/2'.*"
                     "tile_m=96"):
    autotune.mosaic_winners_from_csv(str(path))
  with pytest.raises(ValueError, match="no rows of commit 'nope'"):
    autotune.mosaic_winners_from_csv(str(path), commit="nope")
  with pytest.raises(ValueError, match="no column commit"):
    autotune.winners_from_csv(os.path.join(ROOT, AUTOTUNE, "kernel.csv"),
                              commit="abc")
  _backends_csv(path, [(1, "c1", "BT=512 64x64", "bf16", "forge_triton", 1.0)])
  with pytest.raises(ValueError, match="no forge_mosaic_<tiling> time rows"):
    autotune.mosaic_winners_from_csv(str(path))


def _assert_cli_refuses(tmp_path, flag: str, path) -> None:
  """The CLI given ``flag path`` exits with a usage error, writing no
  ``--out``."""
  out = tmp_path / "out.json"
  with pytest.raises(SystemExit) as e:
    autotune.main([flag, str(path), "--out", str(out)])
  assert e.value.code == 2 and not out.exists()


_KERNEL_HEADER = ("benchmark,provider,shape,dtypes,metric,p50,unit,device,"
                  "versions,timestamp")
_KERNEL_ROW = 'kernel,"forge[64x128x64,g1,w4,s3]",{shape},"{dtypes}",time'


@pytest.mark.parametrize("shape,dtypes,rest,match", [
    ("BT=512 64x64", "w=bf16,m/v=bf16", "10,min", r"p50='10' 'min' is not a "
     "positive, finite time in us, ms or s"),
    ("BT=512 64x64", "w=bf16,m/v=bf16", "nan,us", "p50='nan' 'us' is not"),
    ("BT=512 64x64", "w=bf16,m/v=bf16", "-5,us", "p50='-5' 'us' is not"),
    ("BT=512 64x64", "w=bf16,m/v=bf16", None, "no p50 or unit"),
    ("BT=512 64x64", "m/v=bf16", "10,us", "dtypes 'm/v=bf16' is not of the "
     "form 'w=bf16,m/v=bf16'"),
    ("BT=512 64x64", "w=bogus,m/v=bf16", "10,us", "dtypes 'w=bogus"),
    ("BT=0 64x64", "w=bf16,m/v=bf16", "10,us", "unexpected shape 'BT=0 "
     "64x64'.*each at least 1"),
])
def test_a_kernel_csv_row_it_cannot_read_is_refused_naming_it(
    tmp_path, shape, dtypes, rest, match):
  """A row whose time is not a positive, finite number in a known unit,
  whose dtypes or shape cannot be read, is refused naming the file and the
  row (it was a KeyError or TypeError traceback; a NaN time, which no
  comparison replaces, became the case's winner, a negative one won)."""
  path = tmp_path / "k.csv"
  row = _KERNEL_ROW.format(shape=shape, dtypes=dtypes)
  if rest is not None:
    row += f",{rest},gpu:Fake GPU,v,t1"
  path.write_text(f"{_KERNEL_HEADER}\n{row}\n")
  with pytest.raises(ValueError, match=f"{re.escape(str(path))}: .*{match}"):
    autotune.winners_from_csv(str(path))
  _assert_cli_refuses(tmp_path, "--from-csv", path)


def test_a_nan_time_in_a_backends_csv_is_refused(tmp_path):
  path = tmp_path / "b.csv"
  _backends_csv(path, [(1, "c1", "BT=512 64x64", "bf16", "forge_triton", 1.0),
                       (1, "c1", "BT=512 64x64", "bf16",
                        "forge_mosaic_64x128x64/2", float("nan"))])
  with pytest.raises(ValueError, match="'forge_mosaic_64x128x64/2'.*p50='nan'"):
    autotune.mosaic_winners_from_csv(str(path))


@pytest.mark.parametrize("device,match", [
    ({"entries": {_KEY: {"config": {}, "time_us": -5.0}}},
     "bad entry.*time_us must be a positive, finite number"),
    ({"entries": {_KEY: {"config": {}, "time_us": "fast"}}},
     "bad entry.*time_us must be a positive, finite number"),
    ({"entries": {_KEY: {"config": {}, "source": ["x"]}}},
     "bad entry.*\"source\" must name a record of \"sources\""),
    ({"entries": {_KEY: {"config": {}, "source": "s"}},
      "sources": {"s": "notadict"}},
     r"sources\['s'\] must be an object"),
])
def test_a_triton_entry_or_source_record_it_cannot_use_is_refused(
    tmp_path, device, match):
  """Triton entries' times are checked as Mosaic GPU entries' are, and an
  entry's source must name a record that is an object: a cache file given
  to --merge with either was written as it was, or a TypeError traceback."""
  path = tmp_path / "bad.json"
  data = autotune._empty_cache()
  data["devices"]["X"] = {"entries": {}, "sources": {}, **device}
  path.write_text(json.dumps(data))
  tuning_cache.clear_cache()
  with pytest.raises(ValueError, match=match):
    tuning_cache.load(str(path))
  _assert_cli_refuses(tmp_path, "--merge", path)


def test_bad_mosaic_cache_entries_fail_clearly(tmp_path):
  path = tmp_path / "bad.json"
  for entry, match in (({"config": {"tile_m": 96}}, "tile_m=96"),
                       ({"config": {}, "time_us": -1}, "positive, finite"),
                       ({"config": {}, "triton_time_us": "fast"},
                        "positive, finite"),
                       # (json writes and reads inf as Infinity: every
                       # lookup would take the Mosaic GPU tiling as faster)
                       ({"config": {}, "triton_time_us": float("inf")},
                        "positive, finite")):
    data = autotune._empty_cache()
    data["devices"]["X"] = {"entries": {}, "mosaic_gpu": {_KEY: entry}}
    path.write_text(json.dumps(data))
    tuning_cache.clear_cache()
    with pytest.raises(ValueError, match=f"bad mosaic_gpu entry.*{match}"):
      tuning_cache.load(str(path))


@pytest.mark.parametrize("text,match", [
    ("[" * 100_000 + "]" * 100_000, "RecursionError"),
    ('{"format": ' + "9" * 5000 + "}", "ValueError"),
    ('{"format": true, "devices": {}}', "not a format-1"),
])
def test_a_foreign_cache_file_is_refused_naming_it(tmp_path, text, match):
  """JSON the parser gives up on (nesting too deep, an integer too long) and
  a "format" of true (equal to 1 in Python) are refused as not a cache,
  naming the file, like any other foreign file."""
  path = tmp_path / "foreign.json"
  path.write_text(text)
  tuning_cache.clear_cache()
  with pytest.raises(ValueError, match=match) as e:
    tuning_cache.load(str(path))
  assert "foreign.json" in str(e.value)


def test_two_writers_of_one_cache_keep_a_whole_file_and_both_entries(
    tmp_path):
  """Two autotune runs sharing an --out: each write reads the file again
  under a lock and replaces it through its own temporary, so a reader
  never meets half a file and neither run's entries are lost."""
  import threading
  path = str(tmp_path / "shared.json")
  entry = json.loads(json.dumps(autotune._entry(
      pk.BlockConfig.compiled_default(64, 64, 64, "bfloat16"), 1.0, {}, 64)))
  errors, seen = [], []

  def writer(n):
    try:
      for i in range(40):
        autotune.update_file(path, lambda d: autotune.merge(
            d, "X", f"run{n}", {"kind": "test"},
            {tuning_cache.cache_key("adamw", 512, 1000 * n + i + 1, 64,
                                    jnp.bfloat16, BF16): entry}))
    except Exception as e:  # noqa: BLE001 -- collected, asserted below
      errors.append(e)

  def reader(stop):
    while not stop.is_set():
      if os.path.exists(path):
        try:
          with open(path) as f:
            json.load(f)
          seen.append(True)
        except ValueError as e:
          errors.append(e)

  stop = threading.Event()
  readers = [threading.Thread(target=reader, args=(stop,))]
  writers = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
  for t in readers + writers:
    t.start()
  for t in writers:
    t.join()
  stop.set()
  readers[0].join()
  assert not errors, errors[:3]
  tuning_cache.clear_cache()
  data = tuning_cache.load(path)["data"]
  assert len(data["devices"]["X"]["entries"]) == 80
  assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_cache_write_where_files_cannot_be_locked_still_writes(
    tmp_path, monkeypatch, capsys):
  """A filesystem without flock (some FUSE mounts: ENOSYS): the write goes
  on unserialised, saying so on stderr; a new file takes open()'s mode,
  0666 less the umask."""
  import errno
  if autotune.fcntl is None:
    pytest.skip("no fcntl on this platform")

  def no_flock(*a):
    raise OSError(errno.ENOSYS, "Function not implemented")

  monkeypatch.setattr(autotune.fcntl, "flock", no_flock)
  path = str(tmp_path / "nolock.json")
  old = os.umask(0o027)
  try:
    autotune.update_file(path, lambda d: None)
  finally:
    os.umask(old)
  assert tuning_cache.load(path)["data"]["format"] == 1
  assert os.stat(path).st_mode & 0o777 == 0o640
  assert "written without a lock" in capsys.readouterr().err


def test_a_private_cache_is_never_written_more_open(tmp_path, monkeypatch):
  """A cache file of mode 0600 is rewritten through a temporary that is
  0600 before its first byte (0644 under umask 022 left a readable copy
  where a write was cut short)."""
  path = str(tmp_path / "private.json")
  autotune.update_file(path, lambda d: None)
  os.chmod(path, 0o600)
  seen = []
  real = autotune.json.dump

  def dump(data, f, **kw):
    seen.append(os.fstat(f.fileno()).st_mode & 0o777)
    return real(data, f, **kw)

  monkeypatch.setattr(autotune.json, "dump", dump)
  old = os.umask(0o022)
  try:
    autotune.update_file(path, lambda d: None)
  finally:
    os.umask(old)
  assert seen == [0o600] and os.stat(path).st_mode & 0o777 == 0o600


def test_the_cache_lock_file_is_opened_for_writing(tmp_path, monkeypatch):
  """NFS and CIFS clients take an exclusive flock only on a file opened for
  writing (read-only: EBADF, and the lock was skipped); the lock file is
  opened so where this user may write it."""
  if autotune.fcntl is None:
    pytest.skip("no fcntl on this platform")
  fcntl = autotune.fcntl
  modes = []
  real = fcntl.flock

  def flock(fd, op):
    modes.append(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE)
    return real(fd, op)

  monkeypatch.setattr(autotune.fcntl, "flock", flock)
  autotune.update_file(str(tmp_path / "c.json"), lambda d: None)
  assert modes and all(m == os.O_RDWR for m in modes), modes


def test_tune_mosaic_runs_the_mosaic_kernel_and_picks_the_fastest():
  # BT 128 (two K steps: the column split releases each a step late) x 64 x
  # 128 in interpret mode: one candidate runs for real through
  # fused_wgrad_update(backend="mosaic_gpu"), the others are timed by
  # the stand-in timer only; a cluster's tile-row pair (128 rows) does not
  # divide 64 inputs.
  configs = [M.from_label(l) for l in ("64x128x64/2,r1", "64x64x64/2",
                                       "64x128x64/2,e64x32,c2,pp",
                                       "64x128x64/2")]
  times = {configs[0]: 3e-6, configs[1]: 2e-6,
           configs[3]: RuntimeError("does not compile")}
  calls = []
  res = autotune.tune(128, 64, 128, "bf16", BF16, pk.ADAMW, configs=configs,
                      backend="mosaic_gpu", timer=_fake_timer(times, calls,
                                                              run=False))
  assert res.backend == "mosaic_gpu"
  assert res.best == configs[1] and res.timings == {configs[0]: 3e-6,
                                                    configs[1]: 2e-6}
  assert list(res.failures) == [configs[3]]
  assert [c for c, _ in calls] == [configs[0], configs[1], configs[3]]
  # One real run of a candidate's step: the Mosaic GPU kernel on scratch.
  ran = []

  def timer(step, state, cfg):
    new = jax.block_until_ready(step(state))
    ran.append((cfg, new))
    return 1e-6

  autotune.tune(128, 64, 128, "bf16", BF16, pk.ADAMW, configs=configs[:1],
                backend="mosaic_gpu", timer=timer, interpret=True)
  ((cfg, (x, dy, w, mu, nu)),) = ran
  x0, dy0, w0, mu0, nu0 = autotune.scratch_state(128, 64, 128, "bf16", BF16)
  ref_w, (ref_mu, ref_nu) = pk.fused_wgrad_update_reference(
      x0, dy0, w0, (mu0, nu0), autotune._tuning_hparams(pk.ADAMW),
      rule=pk.ADAMW)
  from tests.tolerances import assert_close
  for got, ref, what in ((w, ref_w, "w"), (mu, ref_mu, "mu"),
                         (nu, ref_nu, "nu")):
    assert_close(got, ref, what=what)
  with pytest.raises(RuntimeError, match="no Mosaic GPU tiling covers BT=128 "
                     "64x128 with float32 x and dy"):
    autotune.tune(128, 64, 128, "float32", ("float32",) * 2, pk.ADAMW,
                  backend="mosaic_gpu", timer=timer)


def _fake_gpu_cli(monkeypatch, capability=(9, 0)):
  monkeypatch.setattr(autotune, "current_device_kind", lambda: "Fake GPU")
  monkeypatch.setattr(autotune, "compute_capability", lambda: capability)

  def time_of(step, state, cfg):
    if isinstance(cfg, M):
      return 1e-6 * cfg.tile_m / 16   # 64-row tiles: 4 us, 128: 8 us
    return 5e-6

  monkeypatch.setattr(autotune, "loop_timer", lambda: time_of)


def test_autotune_cli_tunes_the_mosaic_backend(tmp_path, monkeypatch):
  _fake_gpu_cli(monkeypatch)
  out = tmp_path / "t.json"
  labels = ["128x128x64/4,r1", "64x128x64/2,r1"]
  assert autotune.main(["--backend", "mosaic_gpu", "--shapes", "256x256",
                        "--tokens", "128", "--config", *labels,
                        "--out", str(out)]) == 0
  dev = json.loads(out.read_text())["devices"]["Fake GPU"]
  assert not dev["entries"]  # the Triton kernel timed, not tuned
  (entry,) = dev["mosaic_gpu"].values()
  assert sorted(entry["timings_us"]) == sorted(labels)
  assert M(**entry["config"]) == M.from_label(labels[1])
  assert entry["time_us"] == pytest.approx(4.0)
  assert entry["triton_time_us"] == pytest.approx(5.0)
  # On the CPU no cache entry applies: the compiled heuristic's tiling.
  assert entry["triton_config"] == tuning_cache.config_label(
      pk.BlockConfig.compiled_default(128, 256, 256, "bfloat16"))
  # both: a Triton entry beside it, each backend taking its own labels.
  out2 = tmp_path / "both.json"
  assert autotune.main(["--backend", "both", "--shapes", "256x256",
                        "--tokens", "128", "--config", labels[0],
                        "16x16x16,g1,w4,s2", "32x32x16,g1,w4,s2",
                        "--out", str(out2)]) == 0
  dev = json.loads(out2.read_text())["devices"]["Fake GPU"]
  (triton,), (mosaic,) = dev["entries"].values(), dev["mosaic_gpu"].values()
  assert sorted(triton["timings_us"]) == ["16x16x16,g1,w4,s2",
                                          "32x32x16,g1,w4,s2"]
  assert list(mosaic["timings_us"]) == [labels[0]]
  assert mosaic["triton_time_us"] == triton["time_us"] == pytest.approx(5.0)
  assert mosaic["triton_config"] == "16x16x16,g1,w4,s2"  # first of equals
  # $FORGE_AUTOTUNE_CACHE naming a file not written yet (the default
  # --out): the Triton baseline reads the shipped cache alone, and the
  # run writes that file.
  fresh = tmp_path / "fresh.json"
  monkeypatch.setenv(tuning_cache.ENV_VAR, str(fresh))
  # (the cache lookup asks for the device kind too)
  monkeypatch.setattr(tuning_cache, "current_device_kind", lambda: "Fake GPU")
  tuning_cache.clear_cache()
  assert autotune.main(["--backend", "mosaic_gpu", "--shapes", "256x256",
                        "--tokens", "128", "--config", labels[0]]) == 0
  (entry,) = json.loads(fresh.read_text())["devices"]["Fake GPU"][
      "mosaic_gpu"].values()
  assert list(entry["timings_us"]) == [labels[0]]
  # An fp32 weight: the Mosaic GPU kernel takes bf16 x and dy only, so its
  # entry needs --act-dtype bfloat16 (mixed precision); with fp32 ones
  # (the default: the weight's dtype) there is none.
  f32 = ["--backend", "mosaic_gpu", "--shapes", "256x256", "--tokens", "128",
         "--w-dtype", "float32", "--slot-dtype", "float32", "--config",
         labels[0]]
  key = tuning_cache.cache_key("adamw", 128, 256, 256, "float32",
                               ("float32", "float32"))
  assert autotune.main(f32 + ["--out", str(tmp_path / "f1.json")]) == 0
  assert key not in json.loads((tmp_path / "f1.json").read_text())[
      "devices"]["Fake GPU"].get("mosaic_gpu", {})
  assert autotune.main(f32 + ["--act-dtype", "bfloat16",
                              "--out", str(tmp_path / "f2.json")]) == 0
  assert key in json.loads((tmp_path / "f2.json").read_text())[
      "devices"]["Fake GPU"]["mosaic_gpu"]


def test_autotune_cli_refuses_mosaic_below_hopper(tmp_path, monkeypatch,
                                                  capsys):
  _fake_gpu_cli(monkeypatch, capability=(8, 0))
  out = tmp_path / "t.json"
  assert autotune.main(["--backend", "both", "--shapes", "256x256",
                        "--tokens", "128", "--out", str(out)]) == 2
  assert "compute capability 9.0 or newer" in capsys.readouterr().err
  assert not out.exists()
