"""Every kernel rule lowers through the Mosaic GPU kernel for a CUDA target
(its default tiling, the ping-pong schedule), and both schedules' knobs do.

Lowering needs no GPU (``jax.jit(...).trace(...).lower(lowering_platforms=
("cuda",))`` runs the Mosaic GPU lowering on the CPU), so this catches, on
any machine, a rule using an operation the kernel's warpgroup lowering does
not take (e.g. a select whose predicate would need an implicit broadcast),
which interpret mode, running the same rule as plain JAX, cannot.
"""

import inspect

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import families, mosaic_kernel
from pallas_kernels.rules import accumulating

S = jax.ShapeDtypeStruct


def _torch_rules():
  """Every torch-order rule with its static options all off and all on
  (every optional branch of its update taken once), each distinct rule
  once."""
  out, seen = {}, set()
  for f in families._ENTRIES:
    if f.torch_factory is None:
      continue
    params = [p for p in inspect.signature(f.torch_factory).parameters.values()
              if p.annotation in (bool, "bool")]
    for value in (False, True):
      options = {p.name: value for p in params}
      try:
        rule = f.torch_rule(**options)
      except ValueError:  # a combination torch refuses
        continue
      if rule.name in seen:  # (e.g. Adam's and AdamW's, SGD's variants)
        continue
      seen.add(rule.name)
      flags = ",".join(k for k, v in options.items() if v)
      out[f"torch:{f.name}[{flags}]"] = rule
  return out


RULES = {**{f"optax:{k}": r for k, r in families.optax_rules().items()},
         **_torch_rules()}
RULES["optax:adamw accumulating"] = accumulating(families.get("adamw")
                                                 .optax_rule())


def _lower(rule, state_dtype, cfg=None, n=64, layers=None,
           x_dtype=jnp.bfloat16, bt=128, n_out=None):
  """Lowers the kernel for ``rule`` on ``n x n_out`` state (default
  ``n x n``; ``layers`` of it, stacked, with a layer index), ``bt``
  tokens; ``cfg`` default: the default tiling for the case (ping-pong,
  64 x 64 tiles at ``n=64``)."""
  m = n if n_out is None else n_out
  slot_dtypes = [state_dtype] * len(rule.slots)
  held = mosaic_kernel.smem_dtypes(rule, state_dtype, slot_dtypes)
  if cfg is None:
    cfg = mosaic_kernel.default_config(x_dtype, held, bt, shape=(n, m))
  lead = () if layers is None else (layers,)
  w = S((*lead, n, m), state_dtype)
  slots = [S((*lead, n, m), d) for d in slot_dtypes]
  assert mosaic_kernel.unsupported(bt, n, m, x_dtype, w, slots, rule, cfg,
                                   stacked=layers is not None,
                                   g_stored=False) is None

  def f(x, dy, h, w, *slots):
    layer = None if layers is None else jnp.int32(layers - 1)
    return mosaic_kernel.launch((x, dy), w, tuple(slots), h, rule=rule,
                                cfg=cfg, interpret=False, num_sms=8,
                                layer=layer)

  args = [S((bt, n), x_dtype), S((bt, m), x_dtype),
          S((len(rule.hparams),), jnp.float32), w, *slots]
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_lowers_for_cuda(name):
  lowered = _lower(RULES[name], jnp.bfloat16)
  assert "mosaic_gpu" in lowered.as_text()


def test_torch_accumulation_rules_lower_for_cuda():
  """forge_torch's gradient accumulation: the state-only sum into the fp32
  buffer (its select's predicate broadcast explicitly) and a family's rule
  stepping from the buffer."""
  pytest.importorskip("torch")
  from forge_torch import _accumulate  # noqa: PLC0415
  for rule in (_accumulate.sum_rule(),
               _accumulate.from_accumulator(RULES["torch:adam[]"])):
    assert "mosaic_gpu" in _lower(rule, jnp.float32).as_text(), rule.name


@pytest.mark.parametrize("name", ["optax:adamw", "torch:adam[]"])
def test_fp32_state_lowers_for_cuda(name):
  assert "mosaic_gpu" in _lower(RULES[name], jnp.float32).as_text()


@pytest.mark.parametrize("name,label,layers,x_dtype", [
    # The column-split schedule's tilings: two state buffers with the next
    # tile's state prefetched; the state streamed in bands.
    ("optax:adamw", "64x128x64/4,b2,pn", None, jnp.bfloat16),
    ("optax:muon", "128x128x64/4,e64x32,r2,s8", None, jnp.bfloat16),
    # The ping-pong default at 128 x 128 on a stack, fp16 operands; one
    # wgmma in flight at most and a ring of one sub-tile.
    ("optax:adamw", "128x128x64/4,e64x32,s8,pp", 3, jnp.float16),
    ("optax:muon", "64x128x64/2,d0,e64x32,r1,pp", None, jnp.bfloat16),
    # The epilogue looped over its sub-tiles (rolled).
    ("optax:adamw", "128x128x64/4,e64x32,pp,lp", None, jnp.bfloat16),
    # Three ping-pong compute warpgroups; the ring running across tiles.
    ("optax:adamw", "64x128x64/4,wg3,e64x32,pp,lp", None, jnp.bfloat16),
    ("optax:muon", "128x64x64/4,wg3,pn,pp", 3, jnp.bfloat16),
    ("optax:adamw", "128x128x64/4,e64x32,pn,pp,lp", None, jnp.bfloat16),
    # Clusters of two programs, the dy blocks multicast between them.
    ("optax:adamw", "64x128x64/4,c2,pp,lp,nb", None, jnp.bfloat16),
    ("optax:muon", "64x128x64/2,e64x32,s2,c2,pp", 3, jnp.bfloat16),
], ids=["column-split-buffers", "column-split-ring", "pingpong-stacked-fp16",
        "pingpong-d0-ring1-state-only", "pingpong-rolled",
        "pingpong-three-warpgroups", "pingpong-three-next-tile-stacked",
        "pingpong-next-tile-rolled", "pingpong-cluster",
        "pingpong-cluster-banded-stacked"])
def test_schedules_lower_for_cuda(name, label, layers, x_dtype):
  cfg = mosaic_kernel.MosaicConfig.from_label(label)
  text = _lower(RULES[name], jnp.bfloat16, cfg, n=128, layers=layers,
                x_dtype=x_dtype).as_text()
  assert "mosaic_gpu" in text
  # A cluster's programs read their place in it (to take their tile row
  # of a pair and multicast their half of the dy blocks).
  assert ("cluster_block_id" in text) == (cfg.cluster > 1)


@pytest.mark.parametrize("label,n_in,layers", [
    ("128x128x64/4,e64x32,pp", 192, None),
    ("64x128x64/5,c2,pn,pp,lp,nb", 256, 3),
    ("128x128x64/4,e64x32,r2,s8", 192, None)],
    ids=["pingpong", "cluster-next-tile-stacked", "column-split-ring"])
def test_ragged_shapes_lower_for_cuda(label, n_in, layers):
  # BT (104), out (320) and, but for the cluster's tile-row pairs, in (192)
  # that the tiles do not divide, in whole pieces of TMA's 8 x 64 (x, dy)
  # and 8 x 32 (the state's 64 x 32 sub-tiles) tiling: the last tiles and
  # K step reach past the arrays.
  cfg = mosaic_kernel.MosaicConfig.from_label(label)
  text = _lower(RULES["optax:adamw"], jnp.bfloat16, cfg, n=n_in, bt=104,
                n_out=320, layers=layers).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("layers", [None, 3], ids=["2d", "stacked"])
def test_int8_moments_lower_for_cuda(layers):
  """int8 moments in the ping-pong epilogue (64-column sub-tiles, the
  scales by plain loads and stores of contiguous rows): lowered for CUDA
  through Mosaic GPU's layout inference."""
  from pallas_kernels import lowp
  from pallas_kernels.quant import MomentFormat, Quantized
  rule, n, bt = RULES["optax:adamw"], 128, 128
  fmt = MomentFormat("int8")
  plan = lowp.StatePlan((lowp.SlotPlan(fmt, False), lowp.SlotPlan(fmt, True)))
  cfg = mosaic_kernel.MosaicConfig.from_label("64x128x64/2,pp,lp")
  lead = () if layers is None else (layers,)

  def f(x, dy, h, w, mq, ms, vq, vs):
    layer = None if layers is None else jnp.int32(1)
    return mosaic_kernel.launch(
        (x, dy), w, (Quantized(mq, ms), Quantized(vq, vs)), h, rule=rule,
        cfg=cfg, interpret=False, num_sms=8, layer=layer, plan=plan)

  q, s = S((*lead, n, n), jnp.int8), S((*lead, n, n // 64), jnp.float32)
  text = jax.jit(f).trace(
      S((bt, n), jnp.bfloat16), S((bt, n), jnp.bfloat16),
      S((len(rule.hparams),), jnp.float32), S((*lead, n, n), jnp.bfloat16),
      q, s, q, s).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "llvm." in text


def test_compiled_launch_returns_an_untouched_weight_as_given():
  """A compiled launch runs inside one jit per case (one lowered kernel for
  every call site of it); a rule that does not update the weight (Muon's
  momentum) still gets back the very ``w`` it passed, not a jit output."""
  rule = RULES["optax:muon"]
  assert not rule.updates_weight
  cfg = mosaic_kernel.default_config(jnp.bfloat16, mosaic_kernel.smem_dtypes(
      rule, jnp.bfloat16, [jnp.bfloat16]), 128, shape=(64, 64))
  seen = []

  def f(x, dy, h, w, mu):
    w_new, rest = mosaic_kernel.launch((x, dy), w, (mu,), h, rule=rule,
                                       cfg=cfg, interpret=False, num_sms=8)
    seen.append(w_new is w)
    return w_new, rest

  bf = jnp.bfloat16
  jax.jit(f).trace(S((128, 64), bf), S((128, 64), bf),
                   S((len(rule.hparams),), jnp.float32), S((64, 64), bf),
                   S((64, 64), bf))
  assert seen == [True]


@pytest.mark.parametrize("label,int8,layers", [
    ("64x256x64/4,r2,lp", True, None),    # the pipeline schedule's ring
    ("64x256x64/4,r2,lp", False, 3),
    ("128x64x64/6,pp,lp", True, 3),       # ping-pong, its ring fitted
    ("128x128x64/4,pp,lp", False, None),
    ("64x128x64/4,wg3,pn,pp,lp", True, None),  # three compute warpgroups
    ("128x64x64/4,wg3,e64x32,pp", False, 3),
    ("64x128x64/4,b2,pn", False, None),   # whole tiles, 2 buffers
])
def test_shared_memory_estimate_bounds_the_lowering(monkeypatch, label, int8,
                                                     layers):
  """``MosaicConfig.smem_bytes`` (what ``unsupported`` refuses a tiling by)
  is at least what the Mosaic GPU lowering allocates, int8 moments' scales
  and reductions included: a tiling it admits cannot fail to launch for
  want of shared memory. (The lowering's own figure, read by bounding it
  to 0 bytes, is in its error.)"""
  import re
  from jax.experimental.mosaic.gpu import core as mgpu_core
  from pallas_kernels import lowp
  from pallas_kernels.quant import MomentFormat, Quantized
  monkeypatch.setattr(mgpu_core, "_SMEM_SIZE_BOUND", 0)
  rule, bf = RULES["optax:adamw"], jnp.bfloat16
  cfg = mosaic_kernel.MosaicConfig.from_label(label)
  n_in, n_out, bt = cfg.tile_m, 2 * cfg.tile_n, cfg.steps * cfg.tile_k
  lead = () if layers is None else (layers,)
  w = S((*lead, n_in, n_out), bf)
  if int8:
    fmt = MomentFormat("int8")
    plan = lowp.StatePlan((lowp.SlotPlan(fmt, False),
                           lowp.SlotPlan(fmt, True)))
    q = S((*lead, n_in, n_out), jnp.int8)
    s = S((*lead, n_in, n_out // 64), jnp.float32)
    state, held = [q, s, q, s], [bf, jnp.int8, jnp.int8]

    def slots_of(a):
      return (Quantized(a[0], a[1]), Quantized(a[2], a[3]))
  else:
    plan, state, held = None, [w, w], [bf] * 3

    def slots_of(a):
      return tuple(a)

  def f(x, dy, h, w, *a):
    layer = None if layers is None else jnp.int32(1)
    return mosaic_kernel.launch((x, dy), w, slots_of(a), h, rule=rule,
                                cfg=cfg, interpret=False, num_sms=8,
                                layer=layer, plan=plan)

  with pytest.raises(ValueError, match="exceeds available shared memory") as e:
    jax.jit(f).trace(S((bt, n_in), bf), S((bt, n_out), bf),
                     S((len(rule.hparams),), jnp.float32), w, *state).lower(
                         lowering_platforms=("cuda",))
  allocated = int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))
  estimate = cfg.smem_bytes(bf, held)
  assert allocated <= estimate, (allocated, estimate)
  assert estimate - allocated < 2048  # and not far above it
