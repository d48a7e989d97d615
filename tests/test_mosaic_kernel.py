"""The Mosaic GPU backend (``fused_wgrad_update(..., backend="mosaic_gpu")``)
against the reference: in Pallas GPU interpret mode on the CPU, compiled on
a Hopper GPU (``gpu``-marked)."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels as pk
from pallas_kernels import autotune, lowp, quant
from tests.test_kernel import (_check_stored, _stored_case, _stored_hparams,
                               check_against_reference)
from tests.tolerances import assert_close, assert_update_close, tol

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
SMALL = pk.MosaicConfig(tile_m=64, tile_n=64, tile_k=64, steps=2)
RULES = [pk.ADAMW, pk.sgd_rule(momentum=True, nesterov=True), pk.lion_rule(),
         pk.adagrad_rule(), pk.rmsprop_rule()]


def _hparams(rule):
  values = {**autotune._TUNING_HPARAMS, "lr": 3e-2}
  return rule.pack(**{n: values.get(n, 0.5) for n in rule.hparams})


def _case(seed, bt, n_in, n_out, rule, x_dtype=BF16, w_dtype=BF16,
          slot_dtype=BF16):
  k = jax.random.split(jax.random.key(seed), 3 + len(rule.slots))
  x = jax.random.normal(k[0], (bt, n_in)).astype(x_dtype)
  dy = jax.random.normal(k[1], (bt, n_out)).astype(x_dtype)
  w = jax.random.normal(k[2], (n_in, n_out)).astype(w_dtype)
  slot_dtypes = (slot_dtype if isinstance(slot_dtype, tuple)
                 else (slot_dtype,) * len(rule.slots))
  slots = []
  for i, (name, dtype) in enumerate(zip(rule.slots, slot_dtypes)):
    a = 0.1 * jax.random.normal(k[3 + i], (n_in, n_out))
    positive = name in ("nu", "sum_of_squares") or name.endswith("nu")
    slots.append((jnp.abs(a) if positive else a).astype(dtype))
  return x, dy, w, tuple(slots)


def _check(rule, case, config, interpret):
  x, dy, w, slots = case
  check_against_reference(x, dy, w, slots, _hparams(rule), rule, config,
                          interpret, backend="mosaic_gpu")


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_mosaic_kernel_matches_reference(rule):
  # 3 x 3 tiles over 4 persistent programs: some programs take two tiles.
  _check(rule, _case(1, 128, 192, 192, rule), SMALL, interpret=True)


@pytest.mark.parametrize("w_dtype,slot_dtype", [(F32, F32), (BF16, F32),
                                                (F32, (BF16, F32))],
                         ids=["fp32-state", "bf16-w-fp32-slots",
                              "fp32-w-bf16-mu"])
def test_mosaic_kernel_fp32_state(w_dtype, slot_dtype):
  _check(pk.ADAMW, _case(2, 192, 128, 192, pk.ADAMW, w_dtype=w_dtype,
                         slot_dtype=slot_dtype), SMALL, interpret=True)


def test_mosaic_kernel_default_tiling_with_sub_tiled_epilogue():
  # 128 x 128 tiles, each updated in four 64 x 64 epilogue sub-tiles.
  _check(pk.ADAMW, _case(3, 192, 256, 128, pk.ADAMW), None, interpret=True)


def _stack3(w, slots):
  """``w`` and ``slots`` as 3-layer stacks (the layers x, x/2, 2x)."""
  stack = lambda a: jnp.stack([a, 0.5 * a, 2 * a]).astype(a.dtype)
  return stack(w), tuple(map(stack, slots))


def _check_stacked(case, layer, config, interpret):
  """Layer ``layer`` of a 3-layer stack matches the reference on that
  layer; the other layers come back bit for bit."""
  x, dy, w, slots = case
  ws, ss = _stack3(w, slots)
  h = _hparams(pk.ADAMW)
  got_w, got_s = pk.fused_wgrad_update(
      x, dy, ws, ss, h, rule=pk.ADAMW, layer=layer, config=config,
      interpret=interpret, backend="mosaic_gpu")
  ref_w, ref_s = pk.fused_wgrad_update_reference(
      x, dy, ws[layer], tuple(a[layer] for a in ss), h, rule=pk.ADAMW)
  for got, ref, old, what in zip((got_w, *got_s), (ref_w, *ref_s),
                                 (ws, *ss), ("w", *pk.ADAMW.slots)):
    assert got.shape == old.shape and got.dtype == old.dtype, what
    assert_close(got[layer], ref, what=what)
    assert not np.allclose(np.asarray(got[layer], np.float32),
                           np.asarray(old[layer], np.float32)), what
    for other in {0, 1, 2} - {layer}:
      np.testing.assert_array_equal(np.asarray(got[other], np.float32),
                                    np.asarray(old[other], np.float32))


def _check_state_only(rule, case, config, interpret):
  """A rule that leaves the weight to a later per-layer pass: its slots and
  write-only outputs match the reference; the weight comes back as is."""
  x, dy, w, slots = case
  h = _hparams(rule)
  got_w, got = pk.fused_wgrad_update(x, dy, w, slots, h, rule=rule,
                                     config=config, interpret=interpret,
                                     backend="mosaic_gpu")
  _, ref = pk.fused_wgrad_update_reference(x, dy, w, slots, h, rule=rule)
  np.testing.assert_array_equal(np.asarray(got_w, np.float32),
                                np.asarray(w, np.float32))
  assert len(got) == len(ref) == len(rule.slots) + len(rule.outputs)
  for what, g, r in zip((*rule.slots, *rule.outputs), got, ref):
    assert g.shape == r.shape and g.dtype == r.dtype, what
    assert_close(g, r, what=what)
  for g, s in zip(got, slots):
    assert not np.allclose(np.asarray(g, np.float32), np.asarray(s, np.float32))


@pytest.mark.parametrize("rule", [pk.muon_rule(), pk.scion_rule()],
                         ids=["muon-with-mu_hat-output", "scion-state-only"])
def test_mosaic_kernel_state_only_rules(rule):
  _check_state_only(rule, _case(12, 128, 128, 192, rule), SMALL,
                    interpret=True)


def test_mosaic_kernel_updates_one_layer_of_a_stack():
  _check_stacked(_case(10, 128, 128, 192, pk.ADAMW), 2, SMALL, interpret=True)


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton"])
def test_no_tokens_steps_the_state_on_either_backend(backend):
  # G = 0: the moments decay and weight decay applies, as the reference does.
  _, _, w, slots = _case(21, 64, 128, 128, pk.ADAMW, w_dtype=F32,
                         slot_dtype=F32)
  x, dy = jnp.zeros((0, 128), BF16), jnp.zeros((0, 128), BF16)
  h = _hparams(pk.ADAMW)
  got_w, got = pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW,
                                     backend=backend, interpret=True)
  ref_w, ref = pk.fused_wgrad_update_reference(x, dy, w, slots, h,
                                               rule=pk.ADAMW)
  for a, b, old in zip((got_w, *got), (ref_w, *ref), (w, *slots)):
    assert_close(a, b)
    assert not np.array_equal(np.asarray(a, np.float32),
                              np.asarray(old, np.float32))


RING = pk.MosaicConfig(tile_m=128, tile_n=256, tile_k=64, steps=2,
                      state_ring=2)


@pytest.mark.parametrize("cfg", [
    RING,  # each warpgroup streams four 64 x 64 sub-tiles through 2 slots
    pk.MosaicConfig(tile_m=64, tile_n=128, tile_k=64, steps=2, epi_n=32,
                    state_ring=3, band=3, rolled=True),  # 2 sub-tiles per
    # slot, 3 slots, looped over (rolled); bands of 3 tile columns over 4:
    # the last band is narrower.
], ids=["128x256-ring2", "64x128-e64x32-ring3-band3-rolled"])
def test_mosaic_kernel_streams_state_through_a_ring(cfg):
  # 2 x 2 (and 4 x 4) tiles over 4 programs; ring slots reused within a
  # tile and across tiles.
  _check(pk.ADAMW, _case(13, 128, 256, 512, pk.ADAMW), cfg, interpret=True)


def test_mosaic_kernel_ring_with_stacks_and_state_only_rules():
  one = pk.MosaicConfig(tile_m=64, tile_n=128, steps=2, state_ring=1)
  _check_stacked(_case(14, 128, 128, 256, pk.ADAMW), 1, one, interpret=True)
  _check_state_only(pk.muon_rule(), _case(15, 128, 128, 256, pk.muon_rule()),
                    one, interpret=True)


@pytest.mark.parametrize("rule,layers,layer,dtypes", [
    (pk.ADAMW, None, None, (BF16,) * 4),
    (pk.ADAMW, 3, 1, (F32, BF16, BF16, F32)),  # fp32 G; stacked state
    (pk.muon_rule(), None, None, (BF16,) * 4),  # state only, mu_hat output
], ids=["adamw-bf16", "adamw-fp32-g-stacked", "muon"])
def test_mosaic_stored_g_update_is_the_rule_on_that_g(rule, layers, layer,
                                                      dtypes):
  # 128 x 256 in 128 x 128 tiles (stored_config), the ring of 64 x 64
  # sub-tiles carrying G with the state.
  g, w, slots = _stored_case(18, layers, 128, 256, dtypes, rule)
  _check_stored(rule, g, w, slots, _stored_hparams(rule), layer,
                backend="mosaic_gpu")


def test_mosaic_stored_g_update_tilings_and_refusals(monkeypatch):
  g, w, slots = _stored_case(19, None, 128, 384, (BF16,) * 4, pk.ADAMW)
  h = _stored_hparams(pk.ADAMW)
  cfg = pk.MosaicConfig(tile_m=64, tile_n=128, epi_n=32, state_ring=2)
  _check_stored(pk.ADAMW, g, w, slots, h, None, cfg, backend="mosaic_gpu")
  # A MosaicConfig, or $FORGE_BACKEND, picks the backend as for
  # fused_wgrad_update.
  launched = []
  real = pk.mosaic_kernel.launch
  monkeypatch.setattr(pk.mosaic_kernel, "launch", lambda *a, **k: (
      launched.append(k["cfg"]), real(*a, **k))[1])
  _check_stored(pk.ADAMW, g, w, slots, h, None, cfg)
  monkeypatch.setenv("FORGE_BACKEND", "mosaic_gpu")
  _check_stored(pk.ADAMW, g, w, slots, h, None)
  monkeypatch.delenv("FORGE_BACKEND")
  assert launched == [cfg, pk.mosaic_kernel.stored_config(128, 384,
                                                          [BF16] * 4)]
  with pytest.raises(ValueError, match="pass a BlockConfig, or no config"):
    pk.stored_g_update(g, w, slots, h, rule=pk.ADAMW, interpret=True,
                       config=SMALL)
  assert pk.mosaic_kernel.stored_config(128, 384, [BF16] * 4).tile_n == 128
  with pytest.raises(ValueError, match="needs state_ring >= 1"):
    pk.stored_g_update(g, w, slots, h, rule=pk.ADAMW, interpret=True,
                       backend="mosaic_gpu", config=SMALL)
  with pytest.raises(ValueError, match="G is 128 x 100 bfloat16"):
    pk.stored_g_update(g[:, :100], w[:, :100], tuple(a[:, :100] for a in slots),
                       h, rule=pk.ADAMW, interpret=True, backend="mosaic_gpu")
  with pytest.raises(TypeError, match="must be a MosaicConfig"):
    pk.stored_g_update(g, w, slots, h, rule=pk.ADAMW, interpret=True,
                       backend="mosaic_gpu", config=pk.BlockConfig(16, 16, 16))
  with pytest.raises(ValueError, match="backend='cuda'"):
    pk.stored_g_update(g, w, slots, h, rule=pk.ADAMW, backend="cuda",
                       interpret=True)


@pytest.mark.parametrize("kwargs,match", [
    # Dimensions TMA cannot move in whole pieces of the blocks' tiling.
    (dict(n_in=100), r"x is 128 x 100 bfloat16: .* pieces of 8 x 64 .* "
     "multiple of 8 rows and of 64 columns"),
    (dict(n_out=100), r"dy is 128 x 100 bfloat16"),
    (dict(bt=100), r"x is 100 x 128 bfloat16"),
    (dict(x_dtype=F32), "bfloat16 or float16 operands"),
])
def test_mosaic_kernel_refuses_what_it_does_not_cover(kwargs, match):
  shape = dict(bt=128, n_in=128, n_out=128)
  x_dtype = kwargs.pop("x_dtype", BF16)
  shape.update(kwargs)
  x, dy, w, slots = _case(4, shape["bt"], shape["n_in"], shape["n_out"],
                          pk.ADAMW, x_dtype=x_dtype)
  with pytest.raises(ValueError, match=match):
    pk.fused_wgrad_update(x, dy, w, slots, _hparams(pk.ADAMW), rule=pk.ADAMW,
                          config=SMALL, interpret=True, backend="mosaic_gpu")


def test_mosaic_kernel_refuses_regime2_and_bad_arguments():
  x, dy, w, slots = _case(5, 64, 64, 64, pk.ADAMW)
  h = _hparams(pk.ADAMW)
  with pytest.raises(TypeError, match="MosaicConfig"):
    pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW,
                          config=pk.BlockConfig(), interpret=True,
                          backend="mosaic_gpu")
  with pytest.raises(ValueError, match="backend="):
    pk.fused_wgrad_update(x, dy, w, slots, h, rule=pk.ADAMW, interpret=True,
                          backend="cuda")
  with pytest.raises(ValueError, match="multiple of 64"):
    pk.MosaicConfig(tile_m=96)
  x, dy, w, slots = _case(5, 256, 256, 256, pk.ADAMW)
  with pytest.raises(ValueError, match="shared memory"):
    pk.fused_wgrad_update(
        x, dy, w, slots, h, rule=pk.ADAMW, interpret=True,
        backend="mosaic_gpu", config=pk.MosaicConfig(
            tile_m=256, tile_n=256, tile_k=64, steps=4))


@pytest.mark.gpu
@pytest.mark.parametrize("rule", RULES[:3], ids=lambda r: r.name)
@pytest.mark.parametrize("slot_dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_gpu_mosaic_kernel_compiled_matches_reference(rule, slot_dtype):
  case = _case(6, 512, 1024, 768, rule, w_dtype=slot_dtype,
               slot_dtype=slot_dtype)
  _check(rule, case, None, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [
    pk.MosaicConfig(tile_m=64, tile_n=128, steps=4, state_buffers=2),
    pk.MosaicConfig(tile_m=64, tile_n=128, steps=4, state_buffers=2,
                    prefetch_next=True),
    pk.MosaicConfig(tile_m=64, tile_n=192, steps=2, compute_wgs=3,
                    delay_release=0),
    RING,
    pk.MosaicConfig(tile_m=64, tile_n=128, steps=4, epi_n=32, state_ring=4),
    # The default beyond 1024 tokens (the shipped cache's tiling there).
    pk.MosaicConfig(tile_m=128, tile_n=128, steps=4, epi_n=32, state_ring=2,
                    band=8),
    pk.MosaicConfig.from_label("128x128x64/4,e64x32,r2,s8,lp"),
    pk.MosaicConfig.from_label("128x128x64/4,e64x32,pp,lp"),
], ids=["two-buffers", "prefetch-next", "three-warpgroups", "ring",
        "ring-e64x32", "ring-banded", "ring-rolled", "pingpong-rolled"])
def test_gpu_mosaic_kernel_compiled_knobs(cfg):
  _check(pk.ADAMW, _case(9, 512, 1024, 768, pk.ADAMW), cfg, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("label,knob,slot_dtype", [
    ("128x64x64/4,pp,lp", ",nb", BF16), ("64x128x64/4,pp,lp", ",nb", F32),
    ("128x128x64/4,e64x32,s8,pp", ",nb", BF16),
    ("128x128x64/4,e64x32,r2,s8", ",nb", BF16),
    ("64x128x64/4,b2,pn", ",nb", BF16), ("64x128x64/4,pp,lp", ",nb", "int8"),
    ("64x128x64/4,pp,lp,nb", ",pn", BF16),
    ("128x128x64/4,e64x32,s8,pp", ",pn", BF16),
    ("64x128x64/4,pp,lp,nb", ",pn", "int8"),
    ("64x128x64/3,r3,pp,lp,nb", ",pn", BF16),
    ("64x128x64/4,pp,lp,nb", ",c2", BF16),
    ("128x128x64/4,e64x32,s8,pn,pp,nb", ",c2", BF16),
    ("64x128x64/4,pp,lp,nb", ",c2", "int8")],
    ids=["pingpong-128x64", "pingpong-fp32", "pingpong-banded",
         "ring-banded", "two-buffers", "pingpong-int8", "next-tile-ring",
         "next-tile-ring-banded", "next-tile-ring-int8",
         "next-tile-ring-beyond-tile", "cluster",
         "cluster-next-tile-banded", "cluster-int8"])
def test_gpu_mosaic_kernel_knob_is_bitwise_the_same(label, knob, slot_dtype):
  # no_barriers (,nb) drops Pallas's barriers around the epilogue's
  # shared-memory stores; prefetch_next (,pn, ping-pong) loads the next
  # tile's first state sub-tiles during this tile's epilogue; a cluster
  # (,c2) multicasts the dy blocks between two programs: a race would
  # show as differing bits somewhere in W, m or v over several inputs.
  cfg = pk.MosaicConfig.from_label(label)
  bare = pk.MosaicConfig.from_label(label + knob)
  h = _hparams(pk.ADAMW)
  run = lambda c: jax.jit(lambda x, dy, w, s: pk.fused_wgrad_update(
      x, dy, w, s, h, rule=pk.ADAMW, backend="mosaic_gpu", config=c))
  int8 = slot_dtype == "int8"

  def case(seed):
    x, dy, w, slots = _case(seed, 512, 1024, 768, pk.ADAMW,
                            w_dtype=BF16 if int8 else slot_dtype,
                            slot_dtype=F32 if int8 else slot_dtype)
    if int8:  # codes and per-block scales (forge_jax's int8 moments)
      fmt = quant.MomentFormat("int8")
      slots = tuple(quant.quantize(a, fmt, second_moment=k == 1)
                    for k, a in enumerate(slots))
    return x, dy, w, slots

  for seed in range(3):
    x, dy, w, slots = case(40 + seed)
    want = jax.tree.leaves(run(cfg)(x, dy, w, slots))
    got = jax.tree.leaves(run(bare)(x, dy, w, slots))
    assert len(want) == len(got) == (5 if int8 else 3)
    for a, b in zip(want, got):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if not int8:  # (int8 against its reference: tests/test_low_precision.py)
    _check(pk.ADAMW, case(43), bare, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rule,layers,layer,dtypes", [
    (pk.ADAMW, 3, 2, (BF16,) * 4),
    (pk.ADAMW, None, None, (F32, F32, F32, F32)),
    (pk.muon_rule(), None, None, (BF16,) * 4),
], ids=["adamw-bf16-stacked", "adamw-fp32", "muon"])
def test_gpu_mosaic_stored_g_update(rule, layers, layer, dtypes):
  g, w, slots = _stored_case(20, layers, 512, 768, dtypes, rule)
  _check_stored(rule, g, w, slots, _stored_hparams(rule), layer,
                interpret=False, backend="mosaic_gpu")


@pytest.mark.gpu
def test_gpu_mosaic_kernel_ring_stacked_and_state_only():
  one = pk.MosaicConfig(tile_m=64, tile_n=128, steps=2, state_ring=1)
  _check_stacked(_case(16, 512, 256, 512, pk.ADAMW), 1, one, interpret=False)
  _check_state_only(pk.muon_rule(), _case(17, 512, 256, 512, pk.muon_rule()),
                    one, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", [pk.muon_rule(), pk.scion_rule()],
                         ids=["muon", "scion"])
def test_gpu_mosaic_kernel_state_only_rules(rule):
  _check_state_only(rule, _case(13, 512, 1024, 768, rule), None,
                    interpret=False)


@pytest.mark.gpu
def test_gpu_mosaic_kernel_updates_one_layer_of_a_stack():
  _check_stacked(_case(11, 512, 1024, 768, pk.ADAMW), 1, None,
                 interpret=False)


@pytest.mark.gpu
def test_gpu_mosaic_kernel_updates_in_place():
  x, dy, w, slots = _case(7, 512, 1024, 1024, pk.ADAMW)
  h = _hparams(pk.ADAMW)
  step = jax.jit(lambda x, dy, w, s: pk.fused_wgrad_update(
      x, dy, w, s, h, rule=pk.ADAMW, backend="mosaic_gpu"),
                 donate_argnums=(2, 3))
  ptrs = [a.unsafe_buffer_pointer() for a in (w, *slots)]
  new_w, new_slots = step(x, dy, w, slots)
  assert [a.unsafe_buffer_pointer() for a in (new_w, *new_slots)] == ptrs


def test_backends_benchmark_arguments(capsys):
  from benchmarks import backends
  assert backends.parse_mosaic("64x128x64/2") == pk.MosaicConfig(
      tile_m=64, tile_n=128, tile_k=64, steps=2)
  assert backends.parse_mosaic("64x128x64/4,wg1,d0,e64x64,b2,pn") == (
      pk.MosaicConfig(tile_m=64, tile_n=128, tile_k=64, steps=4,
                      compute_wgs=1, delay_release=0, epi_m=64, epi_n=64,
                      state_buffers=2, prefetch_next=True))
  assert backends.parse_mosaic("128x256x64/2,e64x32,r4,s8") == (
      pk.MosaicConfig(tile_m=128, tile_n=256, tile_k=64, steps=2, epi_n=32,
                      state_ring=4, band=8))
  with pytest.raises(ValueError, match="state_ring streams"):
    pk.MosaicConfig(state_ring=2, state_buffers=2)
  with pytest.raises(ValueError, match="prefetch_next needs"):
    pk.MosaicConfig(prefetch_next=True)
  with pytest.raises(SystemExit):
    backends.main(["--mosaic", "64x128/2"])
  assert "expected MxNxK/STEPS" in capsys.readouterr().err
  if jax.default_backend() != "gpu":
    assert backends.main(["--tokens", "512"]) == 1
    assert "needs a GPU" in capsys.readouterr().err
    assert backends.main(["--once", "--tokens", "512"]) == 1
    assert "needs a GPU" in capsys.readouterr().err


def test_backends_benchmark_mu_bf16_moments(capsys):
  """``--moments mu-bf16``: optax's ``mu_dtype=bfloat16`` over an fp32 W
  (m bf16, v fp32), written so that the autotune cache keys it by those
  slot dtypes; refused where it means nothing else."""
  from benchmarks import backends
  x, dy, w, (m, v) = jax.eval_shape(
      lambda: backends._state(64, 128, 192, "mu-bf16", weights="fp32"))
  assert (x.dtype, dy.dtype, w.dtype, m.dtype, v.dtype) == (
      BF16, BF16, F32, BF16, F32)
  field = backends._dtypes_field("mu-bf16", "fp32", 2)
  assert field == "x,dy bf16; W fp32; m bf16; v fp32"
  assert autotune._backends_dtypes(field) == (  # noqa: SLF001
      "bfloat16", "float32", ("bfloat16", "float32"))
  assert backends._moments_label(field) == "m bf16 v fp32, W fp32"
  assert backends._tick("m bf16 v fp32, W fp32") == "m bf16\nv fp32\nW fp32"
  assert backends._moments_label(
      backends._dtypes_field("fp32", "bf16", 2)) == "fp32"
  assert backends._moments_label(
      backends._dtypes_field("int8", "bf16", 2)) is None
  assert backends._moments_label(
      backends._dtypes_field("bf16", "bf16", 1)) is None
  for argv, match in [
      (["--moments", "mu-bf16"], "with a bf16 W is --moments bf16"),
      (["--moments", "mu-bf16", "--weights", "fp32", "--rules", "adamw",
        "sgd"], "rule\\(s\\) sgd have no slot mu")]:
    with pytest.raises(SystemExit):
      backends.main(argv)
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.gpu
def test_gpu_backends_benchmark_once_runs_each_arm_once(tmp_path, capsys):
  from benchmarks import backends
  out = tmp_path / "b.csv"
  assert backends.main(["--once", "--tokens", "128", "--moments", "bf16",
                        "--shapes", "t 192x384", "--out", str(out),
                        "--mosaic", "64x128x64/2,pp", "128x128x64/2,c2,pp"]
                       ) == 0
  lines = capsys.readouterr().out.splitlines()
  # 192 x 384: clusters of two take 128-row tiles in pairs, and 192 is not
  # a multiple of 256 (skipped, with the reason).
  assert [ln.split(": ", 1)[1][:4] for ln in lines] == [
      "ran ", "ran ", "ran ", "skip"], lines
  assert "forge_mosaic_64x128x64/2,pp" in lines[2]
  assert not out.exists()


def test_backends_plot_takes_each_cases_latest_run(tmp_path, capsys):
  from benchmarks import backends, common
  csv_path = str(tmp_path / "b.csv")
  res = common.Results(csv_path, "backends")

  def add(provider, shape, moments, us, when, operands="x,dy,W bf16"):
    res.stamp = when  # the run's timestamp
    res.commit = "c" + when[8:10]  # and its commit
    slots = (moments if moments.startswith("m ") else f"m,v {moments}")
    res.add("adamw", provider, shape, f"{operands}; {slots}", "time",
            (us, us, us), "us")

  # 4096^2 at BT 512: an older run, then the latest (its fastest tiling
  # without approx_math counts); int8 moments and other shapes left out.
  for arm, us in [("xla_unfused", 100.0), ("forge_triton", 125.0),
                  ("forge_mosaic_64x128x64/4,pp,lp", 50.0)]:
    add(arm, "BT=512 4096x4096", "bf16", us, "2026-01-01T00:00:00")
  for arm, us in [("xla_unfused", 110.0), ("forge_triton", 100.0),
                  ("forge_mosaic_64x128x64/4,pp,lp", 88.0),
                  ("forge_mosaic_64x128x64/4,c2,pp,lp", 80.0),
                  ("forge_mosaic_64x128x64/4,pp,lp,ax", 70.0)]:
    add(arm, "BT=512 4096x4096", "bf16", us, "2026-01-02T00:00:00")
  add("xla_unfused", "BT=2048 4096x1024", "fp32", 60.0, "2026-01-01T00:00:00")
  add("forge_mosaic_128x128x64/4,s8,pp,lp", "BT=2048 4096x1024", "fp32",
      50.0, "2026-01-01T00:00:00")
  add("xla_unfused", "BT=512 4096x4096", "int8", 300.0, "2026-01-01T00:00:00")
  # An fp32 W (--weights fp32) is a case of its own.
  for arm, us in [("xla_unfused", 90.0), ("forge_triton", 100.0),
                  ("forge_mosaic_128x128x64/4,pp,lp", 75.0)]:
    add(arm, "BT=512 4096x4096", "fp32", us, "2026-01-03T00:00:00",
        "x,dy bf16; W fp32")
  # So is --moments mu-bf16 (m bf16, v fp32) over it.
  for arm, us in [("xla_unfused", 80.0), ("forge_triton", 100.0),
                  ("forge_mosaic_64x128x64/4,pp,lp", 64.0)]:
    add(arm, "BT=512 4096x4096", "m bf16; v fp32", us,
        "2026-01-03T00:00:00", "x,dy bf16; W fp32")
  # --auto's arm counts as its tiling, at the Llama shapes and (beyond=True)
  # at the others.
  for arm, us in [("xla_unfused", 30.0), ("forge_triton", 30.0),
                  ("forge_auto_mosaic_64x128x64/5,c2,pp,lp,nb", 24.0)]:
    add(arm, "BT=64 4096x1024", "bf16", us, "2026-01-03T00:00:00")
  for arm, us in [("xla_unfused", 2.0), ("forge_triton", 4.0),
                  ("forge_auto_mosaic_64x64x64/4,pp", 1.6)]:
    add(arm, "BT=512 64x192", "bf16", us, "2026-01-03T00:00:00")
  add("xla_unfused", "BT=512 40x24", "bf16", 1.0, "2026-01-01T00:00:00")
  add("forge_auto_triton", "BT=512 40x24", "bf16", 2.0,
      "2026-01-01T00:00:00")
  # (Beyond the Llama shapes, only runs with --auto's arm.)
  add("xla_unfused", "BT=512 64x64", "bf16", 1.0, "2026-01-01T00:00:00")
  add("forge_mosaic_64x64x64/4,pp", "BT=512 64x64", "bf16", 1.0,
      "2026-01-01T00:00:00")
  # The decoder's shapes (--shapes decoder) have a table of their own.
  add("xla_unfused", "BT=512 2048x1024", "bf16", 20.0, "2026-01-01T00:00:00")
  add("forge_mosaic_64x64x64/4,pp", "BT=512 2048x1024", "bf16", 16.0,
      "2026-01-01T00:00:00")
  rows = common.read_rows(csv_path)
  got = backends.latest_ratios(rows)
  assert got == {("bf16", 512, "4096x4096"): (1.1, 1.375,
                                               "64x128x64/4,c2,pp,lp"),
                 ("fp32", 2048, "4096x1024"): (None, 1.2,
                                               "128x128x64/4,s8,pp,lp"),
                 ("bf16", 64, "4096x1024"): (1.0, 1.25,
                                             "64x128x64/5,c2,pp,lp,nb"),
                 ("fp32, W fp32", 512, "4096x4096"): (0.9, 1.2,
                                                      "128x128x64/4,pp,lp"),
                 ("m bf16 v fp32, W fp32", 512, "4096x4096"): (
                     0.8, 1.25, "64x128x64/4,pp,lp")}
  assert backends.latest_ratios(rows, beyond=True) == {
      ("bf16", 512, "64x192"): (0.5, 1.25, "64x64x64/4,pp"),
      ("bf16", 512, "40x24"): (None, None, None)}
  # The same as Markdown (--table): a line per moments and BT at the Llama
  # shapes and at the decoder's, one per case beyond them (--auto runs),
  # each naming its runs' commits.
  assert backends.table(rows).splitlines() == [
      "| moments | BT | 4096 × 4096 (q/o) | 4096 × 1024 (k/v) | "
      "4096 × 14336 (up/gate) | 14336 × 4096 (down) | commit |",
      "|---|---|---|---|---|---|---|",
      "| bf16 | 64 |  | **1.25×** (1.00×) |  |  | `c03` |",
      "| bf16 | 512 | **1.38×** (1.10×) |  |  |  | `c02` |",
      "| fp32 | 2048 |  | **1.20×** (—) |  |  | `c01` |",
      "| fp32, W fp32 | 512 | **1.20×** (0.90×) |  |  |  | `c03` |",
      "| m bf16 v fp32, W fp32 | 512 | **1.25×** (0.80×) |  |  |  | `c03` |",
      "",
      "| moments | BT | 2048 × 2048 (q/o) | 2048 × 1024 (k/v) | "
      "2048 × 5632 (up/gate) | 5632 × 2048 (down) | commit |",
      "|---|---|---|---|---|---|---|",
      "| bf16 | 512 |  | **1.25×** (—) |  |  | `c01` |",
      "",
      "| in × out | BT | moments | Mosaic GPU, speed vs XLA | its tiling | "
      "Triton, speed vs XLA | commit |",
      "|---|---|---|---|---|---|---|",
      "| 40 × 24 | 512 | bf16 | — | — | — | `c01` |",
      "| 64 × 192 | 512 | bf16 | **1.25×** | `64x64x64/4,pp` | 0.50× | `c03` |"]
  assert backends.main(["--table", "--out", csv_path]) == 0
  assert capsys.readouterr().out == backends.table(rows) + "\n"
  png = tmp_path / "b.png"
  assert backends.main(["--replot", "--out", csv_path, "--plot",
                        str(png)]) == 0
  assert png.stat().st_size > 10_000
  empty = tmp_path / "e.csv"
  empty.write_text(open(csv_path).readline())
  assert backends.main(["--replot", "--out", str(empty), "--plot",
                        str(tmp_path / "e.png")]) == 1
  assert "nothing plotted" in capsys.readouterr().err
  assert not (tmp_path / "e.png").exists()
  assert backends.main(["--table", "--out", str(empty)]) == 1
  assert "no AdamW rows" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    backends.main(["--table", "--out", str(tmp_path / "none.csv")])
  assert "--table: no CSV at" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    backends.main(["--replot", "--out", csv_path])
  assert "--replot needs --plot PNG" in capsys.readouterr().err


def test_benchmarks_doc_shows_the_committed_csvs_latest_ratios():
  """docs/benchmarks.md's kernel tables are `benchmarks.backends --table`
  of the committed CSV, verbatim: a run appended to the CSV must be
  carried into the doc."""
  from benchmarks import backends, common
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rows = common.read_rows(os.path.join(
      root, "benchmarks", "results", "h200", "backends.csv"))
  tables = backends.table(rows).split("\n\n")
  assert len(tables) == 3  # Llama shapes, the decoder's, the others
  with open(os.path.join(root, "docs", "benchmarks.md"),
            encoding="utf-8") as f:
    doc = f.read()
  for t in tables:
    assert t in doc, t.splitlines()[0]


@pytest.mark.parametrize("state", [[BF16] * 3, [BF16, F32, F32], [F32] * 3,
                                   [F32] * 4], ids=["bf16", "fp32-moments",
                                                    "fp32", "fp32-4-arrays"])
@pytest.mark.parametrize("bt", [None, 512, 4096])
def test_default_mosaic_tiling_fits_shared_memory(state, bt):
  cfg = pk.mosaic_kernel.default_config(BF16, state, bt=bt)
  assert cfg.smem_bytes(BF16, state) <= pk.mosaic_kernel._SMEM_BYTES


def test_default_mosaic_tiling_is_the_ping_pong_schedule():
  default = pk.mosaic_kernel.default_config
  bf16, fp32_moments = [BF16] * 3, [BF16, F32, F32]
  # 16-bit state: 64 x 32 sub-tiles, unrolled; 4-byte state: 64 x 64,
  # looped over (rolled).
  for state, ring, epi in ((bf16, 4, ",e64x32"), (fp32_moments, 1, "")):
    rolled = "" if epi else ",lp"
    short = default(BF16, state, bt=512)
    assert short.label == f"128x128x64/4{epi},pp{rolled}"
    # The ring: as many sub-tiles as fit beside 4 K steps.
    assert short.ring_for(BF16, state) == ring
    long = default(BF16, state, bt=2048)
    # (16-bit state: the ring across tiles and no automatic barriers.)
    assert long.label == (f"128x128x64/4{epi},s8,pn,pp,nb" if epi else
                          f"128x128x64/4,s8,pp{rolled}")
    assert default(BF16, state) == long  # tokens unknown: the long case
  # Shapes 128 does not divide: the first of 64 x 128, 128 x 64, 64 x 64
  # that does, else 128 x 128 (refused).
  for shape, tile in (((4096, 1024), (128, 128)), ((192, 1024), (64, 128)),
                      ((128, 192), (128, 64)), ((64, 64), (64, 64)),
                      ((96, 128), (128, 128))):
    cfg = default(BF16, bf16, bt=512, shape=shape)
    assert (cfg.tile_m, cfg.tile_n) == tile and cfg.pingpong, shape
  # Too much state for 4 K steps beside a ring of one sub-tile: 3.
  # 64 x 64 sub-tiles of it fit with no K steps: 64 x 32.
  many = default(BF16, [F32] * 8, bt=512)
  assert many.steps == 3 and many.ring_for(BF16, [F32] * 8) == 1
  assert (many.epi_n, many.rolled) == (32, True)
  assert many.smem_bytes(BF16, [F32] * 8) <= pk.mosaic_kernel._SMEM_BYTES


@pytest.mark.parametrize("prefetch_next", [False, True],
                         ids=["prefetch-at-tile-start", "prefetch-next"])
def test_mosaic_kernel_three_warpgroups_two_state_buffers_no_delay(
    prefetch_next):
  # Three compute warpgroups each own 64 of the tile's 192 columns; 3 x 2
  # tiles over 4 programs, so two programs reuse their first state buffer
  # (and, prefetching the next tile, chain a prefetch across tiles).
  cfg = pk.MosaicConfig(tile_m=64, tile_n=192, tile_k=64, steps=2,
                        compute_wgs=3, delay_release=0, state_buffers=2,
                        prefetch_next=prefetch_next,
                        band=2 if prefetch_next else 1)
  _check(pk.ADAMW, _case(8, 128, 192, 384, pk.ADAMW), cfg, interpret=True)


# --- the ping-pong schedule ---------------------------------------------------

# The interpreter with its race detector on: a buffer overwritten while
# another thread may still read it (a missing barrier or store wait) raises.
RACES = plgpu.InterpretGPUParams(detect_races=True)


def _check_pingpong(rule, case, label, num_sms, layer=None, interpret=RACES):
  """The ping-pong tiling ``label`` over ``num_sms`` programs, interpreted
  with race detection (``interpret=False``: compiled, on the GPU's SMs
  with ``num_sms=None``), against the reference: the weight (or, for a rule
  that does not update it, ``w`` as is), each slot and output, their
  updates too (so an element left unstepped fails), and over 90 % of the
  elements of each state array changed; with ``layer``, the stack's other
  layers bit for bit as they were."""
  x, dy, w, slots = case
  cfg = pk.MosaicConfig.from_label(label)
  assert cfg.pingpong and cfg.label == label
  h = _hparams(rule)
  assert pk.mosaic_kernel.unsupported(
      x.shape[0], *w.shape[-2:], x.dtype, w, slots, rule, cfg,
      stacked=layer is not None, g_stored=False) is None
  got_w, got = pk.mosaic_kernel.launch(
      (x, dy), w, slots, h, rule=rule, cfg=cfg, interpret=interpret,
      num_sms=num_sms, layer=None if layer is None else jnp.int32(layer))
  one = (lambda a: a) if layer is None else (lambda a: a[layer])
  ref_w, ref = pk.fused_wgrad_update_reference(
      x, dy, one(w), tuple(map(one, slots)), h, rule=rule)
  if not rule.updates_weight:
    np.testing.assert_array_equal(np.asarray(got_w, np.float32),
                                  np.asarray(w, np.float32))
  state = [("w", got_w, ref_w, w)] if rule.updates_weight else []
  state += list(zip(rule.slots, got, ref, slots))
  for what, g, r, old in state:
    assert g.shape == old.shape and g.dtype == old.dtype, what
    if layer is not None:
      for other in set(range(old.shape[0])) - {layer}:
        np.testing.assert_array_equal(np.asarray(g[other], np.float32),
                                      np.asarray(old[other], np.float32))
      g, old = g[layer], old[layer]
    assert_close(g, r, what=what)
    assert_update_close(g, r, old, what=what)
    changed = np.asarray(g, np.float32) != np.asarray(old, np.float32)
    assert changed.mean() > 0.9, f"{what}: {changed.mean():.1%} stepped"
  assert len(got) == len(rule.slots) + len(rule.outputs)
  for what, g, r in zip(rule.outputs, got[len(rule.slots):],
                        ref[len(rule.slots):]):
    assert g.shape == r.shape and g.dtype == r.dtype, what
    assert_close(g, r, what=what)


@pytest.mark.parametrize("rule,shape,dtypes,label,num_sms,layer", [
    # 1 x 5 tiles over 2 programs: 3 and 2, so on the first warpgroup 0
    # takes two tiles and 1 one; 2 K steps through a ring of 4 slots that
    # change owner between tiles; 8 sub-tiles through a ring of 4 (as many
    # as fit).
    (pk.ADAMW, (128, 128, 640), (BF16,) * 3, "128x128x64/4,e64x32,pp", 2,
     None),
    # fp32 state, 9 tiles over 2 programs (5 and 4): 4 K steps through 3
    # slots, which change owner within a tile.
    (pk.ADAMW, (256, 192, 192), (BF16, F32, F32), "64x64x64/3,e64x32,pp", 2,
     None),
    # fp16 operands, bf16 weight and fp32 slots; one wgmma in flight at most
    # (d0), a ring of one sub-tile (each reloaded at once), bands of 2 tile
    # columns; 2 x 3 tiles over 5 programs.
    (pk.lion_rule(), (192, 128, 384), (F16, BF16, F32),
     "64x128x64/2,d0,e64x32,r1,s2,pp", 5, None),
    # Layer 1 of a stack of 3, a ring of 2 over 4 sub-tiles (looped over:
    # rolled), 2 x 2 tiles over 3 programs.
    (pk.ADAMW, (128, 128, 256), (BF16,) * 3, "64x128x64/2,e64x32,r2,pp,lp",
     3, 1),
    # A state-only rule (the weight unread) with a write-only output
    # (mu_hat, stored, never loaded); 4 tiles over 6 programs: two get none.
    (pk.muon_rule(), (128, 128, 256), (BF16,) * 3, "64x128x64/2,pp",
     6, None),
    # Three compute warpgroups: 5 x 2 tiles over 2 programs, 5 each, so
    # warpgroups 0 and 1 take two tiles and 2 one.
    (pk.ADAMW, (128, 320, 256), (BF16,) * 3, "64x128x64/4,wg3,e64x32,pp", 2,
     None),
    # Three, rolled, on a stack: 2 x 3 tiles in one program (each
    # warpgroup takes two); 3 K steps through 2 slots, which change owner
    # within a tile.
    (pk.ADAMW, (192, 256, 192), (BF16,) * 3, "128x64x64/2,wg3,pp,lp", 1, 1),
    # The ring running across a warpgroup's tiles (prefetch_next): the
    # first case's tiles, a ring of 4 over 8 sub-tiles ...
    (pk.ADAMW, (128, 128, 640), (BF16,) * 3, "128x128x64/4,e64x32,pn,pp", 2,
     None),
    # ... a shipped tiling beyond 1024 tokens: 64 x 64 sub-tiles through a
    # ring of two, bands of 2, no automatic barriers, 2 x 3 tiles on 2
    # programs ...
    (pk.ADAMW, (128, 256, 384), (BF16,) * 3, "128x128x64/2,s2,pn,pp,nb", 2,
     None),
    # ... a ring of one (each slot reloaded at once, with the next tile's
    # first sub-tile at the end of a tile), 3 tiles per program ...
    (pk.lion_rule(), (192, 128, 384), (F16, BF16, F32),
     "64x128x64/2,d0,e64x32,r1,s2,pn,pp", 2, None),
    # ... a ring of 3 over 4 sub-tiles (a slot holds sub-tiles of
    # different rows and columns from one tile to the next), rolled, on a
    # stack, 5 tiles per warpgroup ...
    (pk.ADAMW, (128, 320, 256), (BF16,) * 3, "64x128x64/2,e64x32,r3,pn,pp,lp",
     1, 1),
    # ... a ring of 3 over tiles of 2 sub-tiles (the loads run into the
    # tile after next), unrolled, 3 tiles per warpgroup ...
    (pk.ADAMW, (128, 192, 256), (BF16,) * 3, "64x128x64/2,r3,pn,pp", 1,
     None),
    # ... and three warpgroups.
    (pk.ADAMW, (128, 320, 256), (BF16,) * 3, "64x128x64/4,wg3,e64x32,pn,pp",
     2, None),
    # Five K steps (the shipped tiling at 4096^2, BT 512) over 3 K steps a
    # tile: the ring wraps within and across tiles, 3 tiles per program.
    (pk.ADAMW, (192, 256, 192), (BF16,) * 3, "128x64x64/5,pn,pp,lp,nb", 2,
     None),
    # Clusters of two programs taking tile-row pairs: 2 x 3 pairs over 3
    # clusters (6 programs), the dy blocks shared ...
    (pk.ADAMW, (128, 256, 384), (BF16,) * 3, "64x128x64/2,e64x32,c2,pp", 6,
     None),
    # ... 1 x 3 pairs of 128 x 128 tiles over 2 clusters (2 and 1 each),
    # 3 K steps through 2 slots, bands of 2, on a stack ...
    (pk.ADAMW, (192, 256, 384), (BF16,) * 3,
     "128x128x64/2,e64x32,s2,c2,pp", 4, 1),
    # ... and with the ring across tiles (a shipped tiling): one cluster,
    # 2 x 3 pairs, 6 tiles per program, 3 per warpgroup; 3 K steps a tile
    # through 5 slots; on a stack.
    pytest.param(
        pk.ADAMW, (192, 256, 384), (BF16,) * 3, "64x128x64/5,c2,pn,pp,lp,nb",
        2, 1, marks=pytest.mark.skipif(
            not pk.mosaic_kernel.INTERPRETS_CLUSTERED_PREFETCH,
            reason="Pallas's GPU interpreter before jax 0.12 deadlocks on a "
            "cluster with prefetch_next (test_pingpong_refusals checks the "
            "refusal)")),
], ids=["128x128-5-tiles", "fp32-state", "fp16-d0-ring1-band",
        "stacked-layer-rolled", "muon-no-tile-programs", "three-warpgroups",
        "three-warpgroups-stacked", "next-tile-ring",
        "next-tile-ring-64x64-banded", "next-tile-ring1",
        "next-tile-ring3-stacked", "next-tile-ring-beyond-tile",
        "next-tile-three-warpgroups", "five-steps",
        "cluster", "cluster-banded-stacked", "cluster-next-tile-ring"])
def test_pingpong_matches_reference(rule, shape, dtypes, label, num_sms,
                                    layer):
  x_dtype, w_dtype, slot_dtype = dtypes
  x, dy, w, slots = _case(sum(shape), *shape, rule, x_dtype=x_dtype,
                          w_dtype=w_dtype, slot_dtype=slot_dtype)
  if layer is not None:
    w, slots = _stack3(w, slots)
  _check_pingpong(rule, (x, dy, w, slots), label, num_sms, layer)


@pytest.mark.parametrize("label,slot_dtype", [
    ("64x128x64/2,pp,lp", "int8"), ("128x128x64/4,e64x32,pp", BF16)],
    ids=["int8", "bf16"])
def test_pingpong_next_tile_ring_is_bitwise_the_same(label, slot_dtype):
  # prefetch_next changes when the state's loads are issued, not what the
  # epilogue computes: the same bits as without it (one program: two or
  # four tiles per warpgroup; the races: test_pingpong_matches_reference).
  int8 = slot_dtype == "int8"
  x, dy, w, slots = _case(46, 64, 256, 256, pk.ADAMW,
                          slot_dtype=F32 if int8 else slot_dtype)
  if int8:
    fmt = quant.MomentFormat("int8")
    slots = tuple(quant.quantize(a, fmt, second_moment=k == 1)
                  for k, a in enumerate(slots))
  h = _hparams(pk.ADAMW)
  plan = (lowp.plan_state(slots, pk.ADAMW, w, where="test")[0] if int8
          else None)
  out = []
  for cfg in (pk.MosaicConfig.from_label(label),
              pk.MosaicConfig.from_label(label + ",pn")):
    if int8:
      assert pk.mosaic_kernel.int8_tiling_problem(cfg) is None
    out.append(jax.tree.leaves(pk.mosaic_kernel.launch(
        (x, dy), w, slots, h, rule=pk.ADAMW, cfg=cfg, interpret=True,
        num_sms=1, plan=plan)))
  want, got = out
  assert len(want) == len(got) == (5 if int8 else 3)
  for a, b, old in zip(want, got, jax.tree.leaves((w, slots))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (np.asarray(a) != np.asarray(old)).mean() > 0.3


def test_pingpong_through_fused_wgrad_update():
  # The default tiling, picked by fused_wgrad_update for backend=
  # "mosaic_gpu": ping-pong, 64 x 128 tiles for a weight 128 does not
  # divide (192 x 256: 3 x 2 tiles over 4 programs).
  x, dy, w, slots = _case(23, 128, 192, 256, pk.ADAMW)
  choice = pk.describe_backend(x, dy, w, slots, rule=pk.ADAMW,
                               backend="mosaic_gpu", interpret=True)
  assert choice.config.label == "64x128x64/4,e64x32,pp"
  _check(pk.ADAMW, (x, dy, w, slots), None, interpret=True)


# Shapes the tiles do not divide: the last tiles and K step reach past the
# arrays, TMA zero-fills those loads and drops those stores. Every element
# must be stepped (the edges too) and, on a stack, the other layers left
# alone bit for bit (a row past the layer's edge is not the next layer's).
@pytest.mark.parametrize("rule,shape,dtypes,label,num_sms,layer", [
    # BT, in and out all ragged: 2 x 3 tiles, the last row and column of
    # tiles half past the edge, the fourth K step 24 rows short.
    (pk.ADAMW, (232, 192, 320), (BF16,) * 3, "128x128x64/4,e64x32,pp", 2,
     None),
    # out smaller than one tile, BT than one K step; fp32 slots beside a
    # bf16 weight, rolled 64 x 32 sub-tiles (the second column of them
    # wholly past the edge).
    (pk.lion_rule(), (8, 64, 64), (BF16, BF16, F32), "64x128x64/2,e64x32,pp,lp",
     2, None),
    # The ring across tiles, on a stack: layer 1's last tile row is half
    # past its edge.
    (pk.ADAMW, (136, 192, 192), (BF16,) * 3,
     "128x64x64/2,e64x32,r3,pn,pp,lp", 2, 1),
    # A state-only rule (the weight unread) with a write-only output.
    (pk.muon_rule(), (104, 64, 320), (BF16,) * 3, "64x128x64/2,pp", 3,
     None),
    # Clusters (tile-row pairs, so in a multiple of 2 x 64): BT and out
    # ragged, the dy blocks' multicast past the edges.
    (pk.ADAMW, (232, 256, 320), (BF16,) * 3, "64x128x64/2,e64x32,c2,pp", 4,
     None),
], ids=["all-ragged", "smaller-than-a-tile", "ring-across-stacked",
        "muon-write-only", "cluster"])
def test_pingpong_ragged_shapes_match_reference(rule, shape, dtypes, label,
                                                num_sms, layer):
  x_dtype, w_dtype, slot_dtype = dtypes
  x, dy, w, slots = _case(sum(shape) + 1, *shape, rule, x_dtype=x_dtype,
                          w_dtype=w_dtype, slot_dtype=slot_dtype)
  if layer is not None:
    w, slots = _stack3(w, slots)
  _check_pingpong(rule, (x, dy, w, slots), label, num_sms, layer)


@pytest.mark.parametrize("rule,shape,dtypes,label", [
    (pk.ADAMW, (104, 192, 320), (BF16,) * 3, "64x128x64/2"),
    (pk.sgd_rule(momentum=True, nesterov=True), (72, 192, 64),
     (BF16, F32, F32), "64x128x64/3,r2"),
    # 128-row tiles over 192 inputs: the K loop's x blocks reach past in.
    (pk.ADAMW, (104, 192, 320), (BF16,) * 3, "128x128x64/2,e64x32,r2"),
], ids=["held", "ring-fp32", "x-past-in"])
def test_column_split_ragged_shapes_match_reference(rule, shape, dtypes,
                                                    label):
  x_dtype, w_dtype, slot_dtype = dtypes
  _check(rule, _case(sum(shape), *shape, rule, x_dtype=x_dtype,
                     w_dtype=w_dtype, slot_dtype=slot_dtype),
         pk.MosaicConfig.from_label(label), interpret=True)


def test_column_split_ragged_stack_leaves_the_other_layers():
  # Layer 1 of 3: its last tile row half past its 192 rows, whose stores
  # must not reach layer 2.
  _check_stacked(_case(51, 104, 192, 320, pk.ADAMW), 1,
                 pk.MosaicConfig.from_label("128x128x64/2,e64x32,r2"),
                 interpret=True)


@pytest.mark.parametrize("layers,layer", [(None, None), (3, 1)])
def test_mosaic_stored_g_ragged_shapes(layers, layer):
  # 136 x 320: the default stored tiling (128 x 256, none divides) over
  # 2 x 2 tiles, the second row of them 8 rows of 128, the second column
  # 64 columns of 256; on a stack, a middle layer (the next one must not
  # be written).
  g, w, slots = _stored_case(47, layers, 136, 320, (BF16,) * 4, pk.ADAMW)
  assert pk.mosaic_kernel.stored_config(136, 320, [BF16] * 4).label == (
      pk.MosaicConfig(tile_m=128, tile_n=256, state_ring=3).label)
  _check_stored(pk.ADAMW, g, w, slots, _stored_hparams(pk.ADAMW),
                None if layer is None else jnp.int32(layer),
                backend="mosaic_gpu")


def test_stored_tiling_for_a_weight_one_piece_wide():
  # 136 x 64: no tile divides it, and every tile wider than 64 columns
  # would move a sub-tile wholly past its one-piece edge (refused): the
  # stored tiling is the largest that TMA can move there, 64 x 64.
  cfg = pk.mosaic_kernel.stored_config(136, 64, [BF16] * 4)
  assert (cfg.tile_m, cfg.tile_n) == (64, 64)
  g, w, slots = _stored_case(52, None, 136, 64, (BF16,) * 4, pk.ADAMW)
  assert pk.mosaic_kernel.unsupported(
      0, 136, 64, BF16, w, slots, pk.ADAMW, cfg, stacked=False,
      g_stored=True) is None
  assert "one TMA piece" in pk.mosaic_kernel.unsupported(
      0, 136, 64, BF16, w, slots, pk.ADAMW,
      pk.MosaicConfig(tile_m=128, tile_n=256, state_ring=3), stacked=False,
      g_stored=True)
  _check_stored(pk.ADAMW, g, w, slots, _stored_hparams(pk.ADAMW), None,
                backend="mosaic_gpu")
  # Sub-tiles of fewer than 64 rows are refused when the tiling is made:
  # such a slice of the accumulator does not lower (jax 0.12).
  with pytest.raises(ValueError, match="rows a multiple of 64"):
    pk.MosaicConfig(tile_m=64, tile_n=256, epi_m=8, state_ring=1)


def test_a_block_past_a_one_piece_edge_is_refused():
  # out = 64 is one 64-column TMA piece of a bf16 array, as is a 64 x 64
  # sub-tile: Mosaic GPU drops that dimension from the copy, so the
  # sub-tile past the edge of a 128-wide tile would land on the first
  # (compiled only: the interpreter bounds the copy as written). Sub-tiles
  # of 32 columns, or a 64-wide tile, are fine; so are x and dy, whose
  # blocks are whole tiles.
  x, dy, w, slots = _case(49, 8, 64, 64, pk.lion_rule())
  why = lambda label: pk.mosaic_kernel.unsupported(
      8, 64, 64, BF16, w, slots, pk.lion_rule(),
      pk.MosaicConfig.from_label(label), stacked=False, g_stored=False)
  assert re.search(r"the state is 64 x 64: its 64 columns are one TMA piece"
                   r", as are the 64 columns of the blocks .* the tile "
                   r"\(64 x 128\) reaches past them", why("64x128x64/2,pp,lp"))
  assert why("64x128x64/2,e64x32,pp,lp") is None
  assert why("64x64x64/2,pp,lp") is None
  # The column split's held state moves in each warpgroup's share.
  assert "one TMA piece" in why("64x128x64/2,wg2,e64x64")
  with pytest.raises(ValueError, match="one TMA piece"):
    pk.fused_wgrad_update(x, dy, w, slots, _hparams(pk.lion_rule()),
                          rule=pk.lion_rule(), interpret=True,
                          config=pk.MosaicConfig.from_label("64x128x64/2,pp"))


def test_default_tiling_reaches_past_the_edges_by_a_little():
  # 4544 x 4672 (Falcon-7B's fused QKV): 128 x 128 tiles reach 2.8 % past
  # its edges (measured 1.2-1.6x faster on the H200 than the 64 x 64 tiles
  # that divide it); at 192 x 256 they would reach 33 % past, and 64 x 128
  # divides it; at 192 x 320 only 64 x 64 is within 1/16. int8 moments
  # take a dividing tile.
  state = [BF16] * 3
  tile = lambda shape, **kw: pk.mosaic_kernel.default_config(
      BF16, state, 512, shape=shape, **kw).label.split("x64/")[0]
  assert tile((4544, 4672)) == "128x128"
  assert tile((4096, 4160)) == "128x128"
  assert tile((192, 256)) == "64x128"
  assert tile((192, 320)) == "64x64"
  assert tile((4544, 4672), quantized=True) == "64x64"
  assert tile((4096, 4096)) == "128x128"
  w = jax.ShapeDtypeStruct((4544, 4672), BF16)
  assert pk.mosaic_kernel.unsupported(
      512, 4544, 4672, BF16, w, (w, w), pk.ADAMW,
      pk.mosaic_kernel.default_config(BF16, state, 512, shape=(4544, 4672)),
      stacked=False, g_stored=False) is None


def test_column_split_needs_more_k_steps_than_its_release_delay():
  # The column split's K loop releases each operand block delay_release
  # steps late: with a single K step (BT up to tile_k) and tiles to follow,
  # Pallas's GPU interpreter caught a missed barrier phase or a block
  # overwritten before its wgmma read it (a wrong update), so it is
  # refused; ping-pong (its own release) and ',d0' run such a case.
  x, dy, w, slots = _case(54, 64, 256, 256, pk.ADAMW)
  why = lambda label, bt=64: pk.mosaic_kernel.unsupported(
      bt, 256, 256, BF16, w, slots, pk.ADAMW,
      pk.MosaicConfig.from_label(label), stacked=False, g_stored=False)
  for label in ("128x128x64/4", "128x128x64/4,e64x32,r2", "64x128x64/2"):
    assert re.search(r"delay_release=1 step\(s\) late, so it needs more "
                     r"than 1 K step\(s\); BT = 64 makes 1 of 64 rows",
                     why(label)), label
    assert why(label, bt=72) is None  # two K steps, the second 8 rows
    assert "needs more than 0 K step(s); BT = 0" in why(label + ",d0", bt=0)
  assert why("128x128x64/4,pp") is None
  for label in ("128x128x64/4,d0", "64x128x64/2,d0,e64x32,r2"):
    assert why(label) is None
    got_w, got = pk.mosaic_kernel.launch(
        (x, dy), w, slots, _hparams(pk.ADAMW), rule=pk.ADAMW, interpret=True,
        cfg=pk.MosaicConfig.from_label(label), num_sms=1)
    ref_w, ref = pk.fused_wgrad_update_reference(
        x, dy, w, slots, _hparams(pk.ADAMW), rule=pk.ADAMW)
    assert_close(got_w, ref_w, what="w")
    assert_update_close(got_w, ref_w, w, what="w")


_RANDOM_LABELS = (
    "128x128x64/4,e64x32,pp", "128x128x64/4,e64x32,s8,pn,pp,nb",
    "64x128x64/5,c2,pp,lp,nb", "128x64x64/5,pn,pp,lp,nb",
    "64x128x64/2,e64x32,r3,pn,pp,lp", "128x64x64/2,wg3,pp,lp",
    "64x128x64/2", "128x128x64/2,e64x32,r2", "64x64x64/2,pp")


@pytest.mark.parametrize("seed", [0, 1])
def test_random_ragged_cases_match_reference(seed):
  # Random BT (multiples of 8), in and out (of 64), rules, dtypes, stacks
  # and tilings of both schedules: each case the kernel accepts matches the
  # reference (the stack's other layers bit for bit); refused ones are
  # counted, and most cases must run.
  rng = np.random.default_rng(seed)
  rules = RULES + [pk.muon_rule()]
  ran = 0
  for i in range(8):
    cfg = pk.MosaicConfig.from_label(_RANDOM_LABELS[rng.integers(
        len(_RANDOM_LABELS))])
    if (cfg.cluster > 1 and cfg.prefetch_next
        and not pk.mosaic_kernel.INTERPRETS_CLUSTERED_PREFETCH):
      continue
    rule = rules[rng.integers(len(rules))]
    shape = (8 * int(rng.integers(1, 30)), 64 * int(rng.integers(1, 5)),
             64 * int(rng.integers(1, 5)))
    w_dtype, slot_dtype = (BF16, F32)[rng.integers(2)], (BF16, F32)[
        rng.integers(2)]
    layer = (None, 1)[rng.integers(2)]
    x, dy, w, slots = _case(100 * seed + i, *shape, rule, w_dtype=w_dtype,
                            slot_dtype=slot_dtype)
    if layer is not None:
      w, slots = _stack3(w, slots)
    if pk.mosaic_kernel.unsupported(
        shape[0], *shape[1:], BF16, w, slots, rule, cfg,
        stacked=layer is not None, g_stored=False) is not None:
      continue
    h = _hparams(rule)
    got_w, got = pk.mosaic_kernel.launch(
        (x, dy), w, slots, h, rule=rule, cfg=cfg, interpret=True,
        num_sms=int(rng.integers(1, 5)),
        layer=None if layer is None else jnp.int32(layer))
    one = (lambda a: a) if layer is None else (lambda a: a[layer])
    ref_w, ref = pk.fused_wgrad_update_reference(
        x, dy, one(w), tuple(map(one, slots)), h, rule=rule)
    what = f"case {i}: {cfg.label} {rule.name} {shape} layer {layer}"
    pairs = [("w", got_w, ref_w, w)] if rule.updates_weight else []
    for name, g, r, old in pairs + list(zip(rule.slots, got, ref, slots)):
      if layer is not None:
        for other in {0, 1, 2} - {layer}:
          np.testing.assert_array_equal(np.asarray(g[other], np.float32),
                                        np.asarray(old[other], np.float32))
      g, old = one(g), one(old)
      if rule.name == "lion" and name == "w" and g.dtype == BF16:
        # (Lion's sign(c) where c rounds to ~0: a step of 2 lr either way.)
        off = np.asarray(g, np.float32) != np.asarray(r, np.float32)
        assert off.mean() <= 2e-3, f"{what}: {name}"
        continue
      assert_close(g, r, what=f"{what}: {name}")
      assert_update_close(g, r, old, what=f"{what}: {name}")
    ran += 1
  assert ran >= 5, ran


def test_ragged_int8_moments_are_refused():
  # An int8 slot's new scales are stored by plain stores, which TMA's
  # bounds do not guard: ragged shapes take the Triton kernel.
  x, dy, w, slots = _case(48, 64, 136, 256, pk.ADAMW, slot_dtype=F32)
  fmt = quant.MomentFormat("int8")
  slots = tuple(quant.quantize(a, fmt, second_moment=k == 1)
                for k, a in enumerate(slots))
  plan = lowp.plan_state(slots, pk.ADAMW, w, where="test")[0]
  cfg = pk.MosaicConfig.from_label("64x128x64/2,pp,lp")
  why = pk.mosaic_kernel.unsupported(
      64, 136, 256, BF16, w, slots, pk.ADAMW, cfg, stacked=False,
      g_stored=False, low_precision=True, plan=plan)
  assert "int8 moments need in x out = 136 x 256 to be a multiple of the " \
      "tile 64 x 128" in why
  assert pk.mosaic_kernel.unsupported(
      64, 128, 256, BF16, w[:128], tuple(
          quant.quantize(a[:128].astype(F32), fmt, second_moment=k == 1)
          for k, a in enumerate(_case(48, 64, 128, 256, pk.ADAMW)[3])),
      pk.ADAMW, cfg, stacked=False, g_stored=False, low_precision=True,
      plan=plan) is None


def test_pingpong_labels_and_limits():
  cfg = pk.MosaicConfig.from_label("128x128x64/4,e64x32,s8,pp")
  assert cfg == pk.MosaicConfig(tile_m=128, tile_n=128, tile_k=64, steps=4,
                                epi_n=32, band=8, pingpong=True)
  assert (cfg.compute_wgs, cfg.wg_n, cfg.sub_tiles) == (2, 128, 8)
  assert pk.MosaicConfig.from_label(" 128x128x64/4,pp,wg2,e64x32 ") == (
      pk.MosaicConfig(tile_m=128, tile_n=128, steps=4, epi_n=32,
                      pingpong=True))
  assert pk.MosaicConfig(tile_m=64, tile_n=64, pingpong=True).label == (
      "64x64x64/3,pp")  # two compute warpgroups is its default
  three = pk.MosaicConfig.from_label("64x128x64/4,wg3,pp")
  assert (three.compute_wgs, three.wg_n, three.label) == (
      3, 128, "64x128x64/4,wg3,pp")
  assert [pk.mosaic_kernel.pingpong_registers(c) for c in (2, 3)] == [
      232, 152]
  # A ring longer than a tile's sub-tiles is cut to them, except running
  # across tiles (prefetch_next); the automatic ring holds a tile at most.
  ring = lambda label: pk.MosaicConfig.from_label(label).ring_for(
      BF16, [BF16] * 3)
  assert pk.MosaicConfig.from_label("64x128x64/2,r3,pp").sub_tiles == 2
  assert [ring("64x128x64/2,r3,pp"), ring("64x128x64/2,r3,pn,pp"),
          ring("64x128x64/2,e64x32,r3,pn,pp"), ring("64x128x64/2,pn,pp")] == [
              2, 3, 3, 2]
  # Clusters of two programs (the dy blocks multicast).
  pair = pk.MosaicConfig.from_label("64x128x64/4,pp,c2,lp")
  assert (pair.cluster, pair.label) == (2, "64x128x64/4,c2,pp,lp")
  assert pair.smem_bytes(BF16, [BF16] * 3) == pk.MosaicConfig.from_label(
      "64x128x64/4,pp,lp").smem_bytes(BF16, [BF16] * 3)
  bare = pk.MosaicConfig.from_label("64x128x64/4,pp,lp,ax,nb")
  assert (bare.no_barriers, bare.approx_math, bare.label) == (
      True, True, "64x128x64/4,pp,lp,nb,ax")
  assert pk.MosaicConfig.from_label(bare.label) == bare
  with pytest.raises(ValueError, match="no_barriers=1 must be True or False"):
    pk.MosaicConfig(no_barriers=1)
  from benchmarks import backends
  assert backends.parse_mosaic(cfg.label) == cfg
  assert [backends.parse_mosaic(m) for m in backends.MOSAIC_DEFAULT] == [
      pk.mosaic_kernel.default_config(BF16, [BF16] * 3, bt)
      for bt in (512, 2048)]
  for label, match in [
      ("128x256x64/2,pp", "256 registers per thread"),
      ("128x128x64/4,wg1,pp", "2 or 3 compute warpgroups"),
      ("64x128x64/4,wg4,pp", "with 4, compiling the kernel did not finish"),
      ("128x128x64/4,wg3,pp", "128 registers per thread; with 3 compute "
       "warpgroups each has 152, of which at most 104 fit.*"
       r"<= 13312 \(e.g. 64x128 or 128x64\)"),
      ("64x128x64/4,b2,pn,pp", "so leave state_buffers=1"),
      ("64x128x64/4,pn", "prefetch_next needs state_buffers=2 .or pingpong"),
      ("128x128x64/4,e32x64,pp", "multiple of 64 that divides tile_m"),
      ("128x128x64/4,pp,pp", "knob 'pp' is given twice"),
      ("128x128x64/4,p", "unknown knob 'p'.*,pn ,pp ,lp ,nb and ,ax"),
      ("128x128x64/4,lp", "rolled .* needs pingpong or state_ring"),
      ("128x128x64/4,c2", "cluster=2 must be 1, or 2 with pingpong"),
      ("128x128x64/4,c4,pp", "cluster=4 must be 1, or 2 with pingpong")]:
    with pytest.raises(ValueError, match=match):
      pk.MosaicConfig.from_label(label)
  # The state ring: as many sub-tiles as fit, or the one asked for, at most
  # a tile's.
  assert cfg.ring_for(BF16, [BF16] * 3) == 4
  assert cfg.ring_for(BF16, [BF16, F32, F32]) == 2
  assert cfg.ring_for(BF16, [BF16] * 2) == 6
  small = pk.MosaicConfig(tile_m=64, tile_n=64, epi_n=32, pingpong=True)
  assert small.ring_for(BF16, [BF16]) == small.sub_tiles == 2
  fixed = pk.MosaicConfig(steps=4, epi_n=32, state_ring=3, pingpong=True)
  assert fixed.ring_for(BF16, [F32] * 3) == 3
  assert fixed.smem_bytes(BF16, [F32] * 3) == (
      4 * 64 * 256 * 2 + 2 * 3 * 64 * 32 * 12 + 1024)


def test_pingpong_refusals():
  x, dy, w, slots = _case(24, 128, 128, 128, pk.ADAMW, w_dtype=F32,
                          slot_dtype=F32)
  h = _hparams(pk.ADAMW)
  pp = pk.MosaicConfig(steps=4, epi_n=32, pingpong=True)

  def unsupported(cfg, g_stored=False, low_precision=False):
    return pk.mosaic_kernel.unsupported(
        128, 128, 128, BF16, w, slots, pk.ADAMW, cfg, stacked=False,
        g_stored=g_stored, low_precision=low_precision)

  assert unsupported(pp) is None
  # A cluster with the ring across tiles is interpreted from jax 0.12 on
  # (test_pingpong_matches_reference[cluster-next-tile-ring]); before,
  # it runs compiled only.
  if not pk.mosaic_kernel.INTERPRETS_CLUSTERED_PREFETCH:
    with pytest.raises(ValueError, match=r"\(a cluster with prefetch_next\) "
                       "runs compiled only with jax"):
      pk.mosaic_kernel.launch(
          (x, dy), w, slots, h, rule=pk.ADAMW, interpret=True,
          cfg=pk.MosaicConfig(tile_m=64, steps=4, epi_n=32, pingpong=True,
                              cluster=2, prefetch_next=True))
  # A cluster takes tile rows in pairs: 128 rows are one 128-row tile.
  assert "in = 128 must be a multiple of 2 x tile_m = 256" in unsupported(
      pk.MosaicConfig(steps=4, epi_n=32, pingpong=True, cluster=2))
  pair = pk.MosaicConfig(tile_m=64, steps=4, epi_n=32, pingpong=True,
                         cluster=2)
  assert unsupported(pair) is None
  # One program asked for: still one cluster (of two), not an empty grid.
  got_w, got = pk.mosaic_kernel.launch((x, dy), w, slots, h, rule=pk.ADAMW,
                                       cfg=pair, interpret=True, num_sms=1)
  ref_w, _ = pk.fused_wgrad_update_reference(x, dy, w, slots, h,
                                             rule=pk.ADAMW)
  assert_close(got_w, ref_w, what="w")
  # A stored gradient stays on the column-split schedule.
  assert "stored gradient has no K loop" in unsupported(pp, g_stored=True)
  with pytest.raises(ValueError, match="use a tiling without ',pp'"):
    pk.stored_g_update(jnp.ones((128, 128), BF16), w, slots, h,
                       rule=pk.ADAMW, interpret=True, backend="mosaic_gpu",
                       config=pp)
  # Quantized moments or stochastic rounding: refused, as for any tiling.
  assert unsupported(pp, low_precision=True) == lowp.MOSAIC_REFUSAL
  # A fixed ring too long for shared memory: the need, with the ring.
  deep = pk.MosaicConfig(steps=6, state_ring=4, pingpong=True)
  assert "with a state ring of 4 sub-tiles" in unsupported(deep)
  assert "shared memory" in unsupported(deep)
  with pytest.raises(ValueError, match="x is 128 x 60 bfloat16"):
    pk.fused_wgrad_update(x[:, :60], dy, w[:60], tuple(a[:60] for a in slots),
                          h, rule=pk.ADAMW, config=pp, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("label,slot_dtype", [
    ("128x128x64/4,e64x32,pp", BF16),   # the default up to 1024 tokens
    ("128x128x64/4,e64x32,s8,pp", BF16),  # ... and beyond
    ("128x128x64/4,e64x32,pp", F32),
    ("64x128x64/2,d0,e64x32,r1,s2,pp", BF16),
    ("64x256x64/3,e64x32,r2,pp", BF16),
    ("128x128x64/3,e64x64,pp", F32),
    ("64x128x64/4,wg3,e64x32,pp,nb", BF16),
    ("128x128x64/4,e64x32,pn,pp", BF16),
    ("64x128x64/4,pn,pp,lp,nb", F32),
])
def test_gpu_mosaic_pingpong_compiled_matches_reference(label, slot_dtype):
  case = _case(25, 512, 1024, 768, pk.ADAMW, w_dtype=slot_dtype,
               slot_dtype=slot_dtype)
  _check(pk.ADAMW, case, pk.MosaicConfig.from_label(label), interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rule,shape,label,layer", [
    # BT 1000 (the last K step 40 rows), in and out 64 past a tile edge.
    (pk.ADAMW, (1000, 4032, 4160), "128x128x64/4,e64x32,pp", None),
    # The ring across tiles on a stack: layer 1 of 3, its last tile row
    # half past its edge (the next layer untouched).
    (pk.ADAMW, (520, 1088, 1216), "128x128x64/4,e64x32,s8,pn,pp,nb", 1),
    # Clusters, the dy blocks multicast past the edges.
    (pk.ADAMW, (1000, 1024, 1088), "64x128x64/5,c2,pp,lp,nb", None),
    # A write-only output; a weight smaller than one tile, 8 tokens.
    (pk.muon_rule(), (200, 320, 704), "64x128x64/2,pp", None),
    (pk.lion_rule(), (8, 64, 64), "64x128x64/2,e64x32,pp,lp", None),
], ids=["bt-1000", "stacked-next-tile", "cluster", "muon", "tiny"])
def test_gpu_mosaic_ragged_shapes_compiled(rule, shape, label, layer):
  x, dy, w, slots = _case(sum(shape), *shape, rule)
  if layer is not None:
    w, slots = _stack3(w, slots)
  _check_pingpong(rule, (x, dy, w, slots), label, None, layer,
                  interpret=False)


@pytest.mark.gpu
def test_gpu_mosaic_ragged_column_split_and_stored_g():
  _check(pk.ADAMW, _case(29, 1000, 1088, 1216, pk.ADAMW),
         pk.MosaicConfig.from_label("128x128x64/4,e64x32,r2,s8"),
         interpret=False)
  # A stored G whose tiles (the default 128 x 256) reach past both edges,
  # on the middle layer of a stack (the next layer must stay as it was);
  # then a weight one TMA piece wide, on the 64 x 64 tiles it takes.
  g, w, slots = _stored_case(30, 3, 1096, 2112, (BF16,) * 4, pk.ADAMW)
  _check_stored(pk.ADAMW, g, w, slots, _stored_hparams(pk.ADAMW),
                jnp.int32(1), interpret=False, backend="mosaic_gpu")
  g, w, slots = _stored_case(31, None, 136, 64, (BF16,) * 4, pk.ADAMW)
  _check_stored(pk.ADAMW, g, w, slots, _stored_hparams(pk.ADAMW), None,
                interpret=False, backend="mosaic_gpu")


@pytest.mark.gpu
def test_gpu_mosaic_pingpong_stacked_state_only_and_in_place():
  pp = pk.MosaicConfig.from_label("128x128x64/4,e64x32,s8,pp")
  _check_stacked(_case(26, 512, 1024, 768, pk.ADAMW), 2, pp,
                 interpret=False)
  _check_state_only(pk.muon_rule(), _case(27, 512, 1024, 768,
                                          pk.muon_rule()), pp,
                    interpret=False)
  x, dy, w, slots = _case(28, 512, 1024, 768, pk.ADAMW)
  h = _hparams(pk.ADAMW)
  step = jax.jit(lambda x, dy, w, s: pk.fused_wgrad_update(
      x, dy, w, s, h, rule=pk.ADAMW, config=pp), donate_argnums=(2, 3))
  ptrs = [a.unsafe_buffer_pointer() for a in (w, *slots)]
  new_w, new_slots = step(x, dy, w, slots)
  assert [a.unsafe_buffer_pointer() for a in (new_w, *new_slots)] == ptrs


def test_per_step_kernels_sums_by_name():
  from benchmarks import common
  events = [("gemm", 0.0, 30.0), ("adamw", 31.0, 60.0), ("add", 92.0, 1.0),
            ("gemm", 100.0, 32.0), ("adamw", 133.0, 62.0),
            ("add", 196.0, 1.0)]
  got = common.per_step_kernels(events, 2)
  assert got == [("adamw", 1.0, 61.0), ("gemm", 1.0, 31.0),
                 ("add", 1.0, 1.0)]
  assert common.per_step_kernels([], 5) == []


@pytest.mark.gpu
def test_gpu_backends_benchmark_traces_each_arms_kernels(tmp_path, capsys):
  # --kernels: each arm's kernels per step from a trace of its loop; the
  # fused step is one Mosaic GPU kernel (and the loop's counter), XLA's at
  # least a GEMM and the AdamW fusion, each under its loop time.
  from benchmarks import backends, common
  out = tmp_path / "b.csv"
  assert backends.main(["--kernels", "--tokens", "128", "--moments", "bf16",
                        "--shapes", "t 256x384", "--out", str(out),
                        "--mosaic", "64x128x64/2,pp"]) == 0
  rows = common.read_rows(str(out))
  got = {(r["provider"], r["metric"]): float(r["p50"]) for r in rows}
  for arm in ("xla_unfused", "forge_triton", "forge_mosaic_64x128x64/2,pp"):
    assert 0 < got[(arm, "kernel_time")] <= got[(arm, "time")]
  assert got[("xla_unfused", "kernels")] >= 2
  assert "anonymous_mosaic_gpu_kernel 1x" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_backends_benchmark_auto_arm_is_the_backend_choice(tmp_path):
  # --auto: the arm backend=None runs, named by describe_backend's choice:
  # on the H200 an fp32 weight at a shape and BT the cache has no entry
  # for takes the nearest fp32-weight entry's tiling.
  from benchmarks import backends, common
  from pallas_kernels import tuning_cache
  if tuning_cache.current_device_kind() != "NVIDIA H200":
    pytest.skip("the shipped Mosaic GPU entries are the H200's")
  out = tmp_path / "b.csv"
  assert backends.main(["--auto", "--mosaic", "--tokens", "128",
                        "--moments", "fp32", "--weights", "fp32",
                        "--shapes", "t 256x384", "--out", str(out)]) == 0
  rows = common.read_rows(str(out))
  arms = {r["provider"] for r in rows if r["metric"] == "time"}
  state = backends._state(128, 256, 384, "fp32", weights="fp32")
  choice = pk.describe_backend(*state[:3], state[3], rule=pk.ADAMW)
  assert choice.backend == "mosaic_gpu", choice.reason
  assert "nearest entry" in choice.reason and "w=float32" in choice.reason
  assert arms == {"xla_unfused", "forge_triton",
                  f"forge_auto_mosaic_{choice.config.label}"}
  assert all(r["dtypes"] == "x,dy bf16; W fp32; m,v fp32" for r in rows)
  errs = [float(r["p50"]) for r in rows
          if r["metric"] == "max_rel_err_vs_xla"]
  assert len(errs) == 3 and max(errs) < tol(jnp.float32)
