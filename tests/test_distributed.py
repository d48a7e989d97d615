"""FORGE steps on a device mesh (``make_step(..., mesh_layout=...)``).

The multi-device checks need eight devices, which JAX fixes when it starts:
they run once, in a process of their own with eight simulated CPU devices
(``tests/multidevice_checks.py``), and the tests below assert on what it
reports. The argument checks and the deviceless lowering for eight H200s run
here.
"""

import fcntl
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import (AbstractDevice, AbstractMesh, AxisType, Mesh,
                          NamedSharding, PartitionSpec as P)

import forge_jax
from tests import multidevice_checks as checks
from tests.harness import triton_calls
from tests.tolerances import SHARDED_RTOL, tol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_checks(extra_args=(), env=None):
  p = subprocess.run(
      [sys.executable, "-m", "tests.multidevice_checks", *extra_args],
      cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
      text=True, timeout=900, check=False)
  assert p.returncode == 0, p.stderr[-4000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  """The multi-device checks on eight simulated CPU devices, run once per
  test session: pytest-xdist workers share the result through a file in
  the session's temporary root, written under an exclusive lock."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # shared by the workers of this session
  path = root / "multidevice_checks.json"
  with open(f"{path}.lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if path.is_file():
      return json.loads(path.read_text(encoding="utf-8"))
    got = _run_checks(["--cpu-devices", "8"],
                      env={"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
    path.write_text(json.dumps(got), encoding="utf-8")
    return got


def _assert_run_ok(name, r, rtol=tol(jnp.float32)):
  # fp32 parity with the one-device run, every parameter and state array.
  assert r["max_rel_err"] <= rtol, (name, r["worst"], r["max_rel_err"])
  # Every replica of every shard bit-identical.
  assert r["drift"] == 0.0, (name, r["drift"])
  # Every output sharded as its input.
  assert r["shardings_moved"] == [], (name, r["shardings_moved"])
  # Every kernel and slot shard updated in its own (donated) buffer from the
  # second step on; the first step's inputs were assembled from host arrays.
  assert all(r["in_place"][1:]), (name, r["in_place"])


def test_layouts_train_as_optax_in_place_keeping_shardings(report):
  """Data, tensor (along in and out), data x tensor and fully-sharded (x
  tensor) parallel, with Flax boxes or param_specs, in buckets, for a
  regime-2 family with G in memory and a deferred family: each trains
  5 steps as the same model does unsharded under optax."""
  assert report["devices"] == 8
  assert set(report["runs"]) == set(checks.RUNS)
  for name, r in report["runs"].items():
    _assert_run_ok(name, r)
  # The kernels really were sharded as declared.
  main = report["runs"]["dp_tp_fsdp"]
  assert main["mesh"] == {"data": 4, "model": 2}
  assert main["kernel_specs"] == {
      "a": [["data"], ["model"]], "b": [["model"], []],
      "c": [[], ["data"]], "d": [[], []], "e": [[], ["model"]]}


LAYOUT_MESHES = {"dp": {"data": 8}, "tp": {"model": 8},
                 "dp_tp": {"data": 4, "model": 2}, "fsdp": {"data": 8}}


def test_decoder_and_mlp_layouts_match_one_device(report):
  """A small decoder (attention and MLP) and the odd-width MLP, 10 fp32
  steps data parallel (8), tensor parallel (8), data x tensor parallel
  (4 x 2) and fully sharded (8): every parameter and AdamW moment equals
  the same FORGE step on one device to SHARDED_RTOL, every replica is
  bit-identical, every output keeps its input's sharding, and every weight
  and moment shard is written in place (its buffer kept; the compiled step
  aliases all of the donated state to its outputs)."""
  runs = report["layouts"]
  assert set(runs) == {f"{m}_{l}" for m in checks.MODELS
                       for l in checks.LAYOUTS}
  for name, r in runs.items():
    _assert_run_ok(name, r, SHARDED_RTOL)
    layout = name.split("_", 1)[1]
    assert r["mesh"] == LAYOUT_MESHES[layout], (name, r["mesh"])
    assert len(r["in_place"]) == checks.LAYOUT_STEPS
    # Not a vacuous match: every parameter moved.
    assert r["min_moved"] > 1e3 * SHARDED_RTOL, (name, r["min_moved"])
    mem = r["memory"]
    assert mem["alias"] == mem["state"], (name, mem)
    # The kernels really were sharded as the layout says.
    axes = {a for spec in r["kernel_specs"].values() for d in spec for a in d}
    assert axes == {"dp": set(), "tp": {"model"}, "dp_tp": {"model"},
                    "fsdp": {"data"}}[layout], (name, r["kernel_specs"])
    if layout == "fsdp":
      assert all(spec != [[], []] for spec in r["kernel_specs"].values())
  assert runs["decoder_tp"]["kernel_specs"]["['qkv']"] == [[], ["model"]]
  # down, head, o, qkv, up: one eighth of each along its fully sharded
  # dimension (56 / 8, 40 / 8, 120 / 8).
  assert runs["decoder_fsdp"]["local_kernels"] == [
      [7, 40], [5, 29], [5, 40], [40, 15], [40, 7]]


def test_no_weight_sized_copy_per_device(report):
  """The compiled step's memory analysis, per device, for an MLP whose
  kernels outweigh its activations: in every layout the temporaries hold
  less than one copy of the model's kernels -- no layer's gathered kernel
  (fully sharded) or gradient (data parallel) lives longer than its own
  step -- and the whole donated state is aliased to the outputs."""
  mem = report["memory"]
  assert mem["wgrad"] == "xla"
  for layout in checks.LAYOUTS:
    got = mem[layout]
    assert got["temp"] < mem["kernels"], (layout, got, mem["kernels"])
    assert got["alias"] == got["state"], (layout, got)
  # The measure sees a layer's transients: data parallel holds a whole
  # layer's gradient, fully sharded a whole layer's gathered kernel.
  for layout in ("dp", "fsdp"):
    assert mem[layout]["temp"] > mem["largest"], (layout, mem)


def test_tied_kernel_under_fsdp(report):
  """A kernel read twice (a layer applied twice), fully sharded: refused by
  default, naming the layer and both fixes; with shared="standard" the
  layer takes optax's update, which XLA partitions, and trains as on one
  device."""
  got = report["tied"]
  assert got["refused"] is not None, "a tied kernel was not refused"
  for words in ("'tied' is called more than once", "fused=False",
                'shared="standard"'):
    assert words in got["refused"], got["refused"]
  assert got["standard_layers"] == ["tied"]
  assert got["kernel_spec"] == [["data"], []]
  assert got["max_rel_err"] <= SHARDED_RTOL, got
  assert got["drift"] == 0.0


def test_a_rematerialised_layer_trains_on_a_data_parallel_mesh(report):
  """The last layer under nn.remat traces its backward in the
  checkpoint's trace; the reductions' chain restarts there instead of
  carrying that trace's value into the outer one (UnexpectedTracerError),
  and the step trains as on one device."""
  got = report["rematerialised"]
  assert got["max_rel_err"] <= SHARDED_RTOL, got
  assert got["drift"] == 0.0, got


def _matrices(collective):
  return [shape for shape in collective if len(shape) == 2]


def test_each_reduction_holds_one_layers_gradient(report):
  """In the compiled programs (after XLA's collective combiner), no
  all-reduce or reduce-scatter carries two kernels' gradients: each layer's
  gradient is reduced on its own, after the previous layer's update
  (otherwise XLA merges them into one collective, a gradient pool). Tensor
  parallel reduces no kernel gradient at all."""
  runs = {**report["runs"], **{name: r for name, r in
                               report["layouts"].items()
                               if name.startswith("mlp")}}
  for name, r in runs.items():
    for collective in r["reductions"]:
      assert len(_matrices(collective)) <= 1, (name, collective)
  # Tensor parallel: no collective carries a kernel's gradient.
  for model in checks.MODELS:
    r = report["layouts"][f"{model}_tp"]
    kernels = {tuple(s) for s in r["local_kernels"]}
    kernels |= {s[::-1] for s in kernels}
    assert not any(tuple(m) in kernels for c in r["reductions"]
                   for m in _matrices(c)), (model, r["reductions"])
  # Five layers, five reductions of a gradient (local shards on 4 x 2).
  main = sorted(m for c in runs["dp_tp_fsdp"]["reductions"]
                for m in _matrices(c))
  assert main == [[6, 20], [20, 56], [24, 20], [40, 24], [56, 10]], main
  # Layer a's 6 local rows in two buckets of 3.
  assert [m for c in runs["fsdp_tp_buckets"]["reductions"]
          for m in _matrices(c)] == [[3, 20], [3, 20]]


REFUSED = {
    "no_layout": "built without a mesh layout",
    "other_mesh": "MeshLayout's mesh has axes",
    "axes_in_another_order": "the same axes in another order",
    "spec_axes_in_another_order": "NamedSharding on another mesh than the "
                                  "layout's (the same axes in another order",
    "unknown_bias_axis": "names axes ['tp'] that the mesh does not have",
    "bias_spec_on_another_mesh": "NamedSharding on another mesh than the "
                                 "layout's (the same axes in another order",
    "bias_spec_not_a_spec": "is a str, not a PartitionSpec",
    "spec_prefix_not_a_spec": "at up (a prefix of forge_jax layer 'up') is "
                              "a str, not a dict, PartitionSpec",
    "kernel_spec_missing": "MeshLayout.param_specs has no entry for "
                           "forge_jax layer 'up'",
    "data_and_model_on_one_dim": "both data axes",
    "unknown_sharding": "sharding is unknown",
    "indivisible_kernel": "is not divisible by the 8 devices",
    "axis_on_both_dims": "names the mesh axes ['model'] more than once",
    "indivisible_batch": "batch) dimension 7 is not divisible",
    "stacked_kernel": "2-D (in, out) kernels only",
    "batch_on_another_mesh": "place the parameters, optimizer state and "
                             "batch on the layout's mesh",
    "state_on_another_mesh": "place the parameters, optimizer state and "
                             "batch on the layout's mesh",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_layouts_are_refused(report, case):
  msg = report["refusals"][case]
  assert msg is not None, f"{case} was not refused"
  assert REFUSED[case] in msg, msg
  assert not msg.startswith("_"), msg  # a private exception type


def test_an_eager_step_refuses_arrays_on_other_devices(report):
  """Concrete arrays on the layout's devices in another order, or committed
  to one device: refused in plain words (they were refused by JAX inside
  the step's shard_map); on the layout's mesh the eager step gives the
  jitted step's loss."""
  got = report["eager_placement"]
  assert "same devices in another arrangement" in (got["reversed"] or ""), got
  assert "placed on the devices ['" in (got["one_device"] or ""), got
  assert got["loss_rel_err"] <= 1e-6, got


def test_convert_on_a_mesh_skips_flax_layers_inside_scanned_blocks(report):
  """make_step(convert=True) on a mesh: flax nn.Dense layers inside
  forge_jax.ScannedBlocks (stacked kernels) stay on the standard path with
  the reason in step.skipped, the head is converted, the step traces."""
  got = report["converted_scanned"]
  assert got["error"] is None, got["error"]
  assert got["converted"] == ["head"], got
  assert len(got["skipped"]) == 2, got
  for why in got["skipped"].values():
    assert "inside forge_jax.ScannedBlocks" in why, why


def test_convert_on_a_mesh_skips_kernels_of_more_than_two_axes(report):
  """make_step(convert=True) on a mesh over flax's attention: its 3-axis
  DenseGeneral projections stay on the standard path, each with the reason
  in step.skipped (they were refused, with a fix that does not apply to
  them), and the 2-D nn.Dense layers are converted."""
  got = report["converted_attention"]
  assert got["error"] is None, got["error"]
  assert got["converted"] == ["a", "c"], got
  assert sorted(got["skipped"]) == [f"att/{p}" for p in
                                    ("key", "out", "query", "value")], got
  for why in got["skipped"].values():
    assert "3 axes" in why and "on a device mesh" in why, why


def test_check_vma_catches_a_missing_reduction(report):
  """Data parallel with the gradient's sum over the data axis removed: the
  per-shard update's outputs vary over that axis and shard_map's out_specs
  check refuses them, for the fused kernel (checked abstractly) and for
  XLA's update; with the sum, nothing is refused."""
  got = report["missing_reduction"]
  assert got["fused_reduced"] is None and got["xla_reduced"] is None, got
  for key in ("fused_unreduced", "xla_unreduced"):
    assert got[key] is not None and "replicat" in got[key], got[key]


# --- in this process ----------------------------------------------------------


def test_mesh_layout_arguments_are_checked():
  devices = np.array(jax.devices()[:1])
  auto = Mesh(devices, ("data",))
  explicit = Mesh(devices, ("data",), axis_types=(AxisType.Explicit,))
  with pytest.raises(ValueError, match="not AxisType.Auto"):
    forge_jax.MeshLayout(explicit, data_axes="data")
  with pytest.raises(ValueError, match="distinct axes of the mesh"):
    forge_jax.MeshLayout(auto, data_axes="batch")
  with pytest.raises(ValueError, match="distinct axes of the mesh"):
    forge_jax.MeshLayout(auto, data_axes=("data", "data"))
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="bucket_bytes"):
      forge_jax.MeshLayout(auto, bucket_bytes=bad)
  with pytest.raises(TypeError, match="jax.sharding.Mesh"):
    forge_jax.MeshLayout("data")
  with pytest.raises(TypeError, match="mesh_layout must be"):
    forge_jax.make_step(lambda v, b: 0.0, forge_jax.adamw(1e-3),
                        mesh_layout=auto)
  assert forge_jax.MeshLayout(auto, data_axes="data").data_axes == ("data",)
  # Not a name or a tuple of names (an int was a bare "'int' object is not
  # iterable"; a set, unordered, was taken in its iteration order).
  for bad in (0, {"data"}, ("data", 1)):
    with pytest.raises(TypeError, match="MeshLayout: data_axes"):
      forge_jax.MeshLayout(auto, data_axes=bad)
  for ok in (["data"], P("data"), P("data", None), np.array(["data"]),
             np.str_("data"), {"data": 1}.keys()):
    got = forge_jax.MeshLayout(auto, data_axes=ok).data_axes
    assert got == ("data",) and type(got[0]) is str, got
  assert forge_jax.MeshLayout(auto, data_axes=P()).data_axes == ()
  # A spec that shards more than the batch's leading dimension: refused
  # (P("data", "model") was read as the batch split over both axes).
  with pytest.raises(TypeError, match="more than the batch's leading"):
    forge_jax.MeshLayout(auto, data_axes=P("data", "data"))


def test_an_unconstrained_kernel_spec_is_refused_naming_the_layer():
  """P.UNCONSTRAINED in a FORGE kernel's spec: refused naming the layer and
  the spec (it was a bare TypeError from iterating it)."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  layout = forge_jax.MeshLayout(
      mesh, data_axes="data",
      param_specs={"w": {"kernel": P(P.UNCONSTRAINED, None)}})
  with pytest.raises(TypeError, match="forge_jax layer 'w'.*UNCONSTRAINED"):
    _plans(layout, None, {"w": (8, 8)})


def _plans(layout, boxed_params, shapes):
  from forge_jax import _context, _sharding  # noqa: PLC0415
  layers = {(name,): _context.LayerInfo((name,), shape, jnp.float32)
            for name, shape in shapes.items()}
  kpaths = {(name,): (jax.tree_util.DictKey(name),
                      jax.tree_util.DictKey("kernel")) for name in shapes}
  return {p[0]: plan for p, plan in _sharding.plan_layers(
      layout, boxed_params, layers, kpaths).items()}


def test_each_axis_takes_its_role():
  """A data axis that shards a kernel dimension makes it fully sharded
  (reduce-scatter), one that does not is summed over; any other axis in a
  kernel's spec is tensor parallel. (A 1 x 1 mesh: only the roles.)"""
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  specs = {"dp": P(), "tp": P("model", None), "fsdp_tp": P("data", "model"),
           "tp_fsdp": P("model", "data")}
  plans = _plans(forge_jax.MeshLayout(mesh, data_axes="data",
                                      param_specs={k: {"kernel": v}
                                                   for k, v in specs.items()}),
                 None, {k: (8, 8) for k in specs})
  got = {k: (p.tp_in, p.tp_out, p.scatter_in, p.scatter_out, p.psum)
         for k, p in plans.items()}
  assert got == {"dp": ((), (), (), (), ("data",)),
                 "tp": (("model",), (), (), (), ("data",)),
                 "fsdp_tp": ((), ("model",), ("data",), (), ()),
                 "tp_fsdp": (("model",), (), (), ("data",), ())}
  tp_only = _plans(forge_jax.MeshLayout(mesh, param_specs=P(None, "model")),
                   None, {"w": (8, 8)})["w"]
  assert not tp_only.reduces and tp_only.tp_out == ("model",)


def test_a_kernel_spec_naming_an_unknown_axis_is_refused():
  """A kernel's PartitionSpec naming an axis the mesh lacks is refused
  naming the layer, the axis and the mesh's axes."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  layout = forge_jax.MeshLayout(mesh, data_axes="data",
                                param_specs={"w": {"kernel": P("tp", None)}})
  with pytest.raises(ValueError, match=(
      r"layer 'w', its kernel: the PartitionSpec .* names axes \['tp'\] that "
      r"the mesh does not have \(its axes: \('data',\)\)")):
    _plans(layout, None, {"w": (8, 8)})


def test_kernel_specs_are_read_from_param_specs_or_flax_boxes():
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  layout = forge_jax.MeshLayout(mesh, data_axes="data")
  logical = forge_jax.Dense(8, kernel_init=nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), ("embed", "mlp")))
  boxed = logical.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
  with pytest.raises(ValueError, match="no logical axis rules"):
    _plans(layout, {"w": boxed}, {"w": (4, 8)})
  with nn.logical_axis_rules((("embed", "data"), ("mlp", None))):
    assert _plans(layout, {"w": boxed}, {"w": (4, 8)})["w"].w_in == ("data",)
  plain = {"w": {"kernel": jnp.ones((4, 8))}}
  with pytest.raises(ValueError, match="sharding is unknown"):
    _plans(layout, plain, {"w": (4, 8)})
  with_specs = lambda specs: forge_jax.MeshLayout(mesh, data_axes="data",
                                                  param_specs=specs)
  # A NamedSharding of the layout's mesh, or a prefix of the tree.
  named = {"w": {"kernel": NamedSharding(mesh, P(None, "data"))}}
  assert _plans(with_specs(named), plain, {"w": (4, 8)})["w"].w_out == (
      "data",)
  assert _plans(with_specs({"w": P("data")}), plain,
                {"w": (4, 8)})["w"].scatter_in == ("data",)
  for specs, match in (({"v": P()}, "no entry for"),
                       ({"w": P("batch")}, "axes .'batch'. that the mesh"),
                       ({"w": P(None, None, None)}, "more entries"),
                       ({"w": {"kernel": None}}, "gives None")):
    with pytest.raises(ValueError, match=match):
      _plans(with_specs(specs), plain, {"w": (4, 8)})


def test_sharded_step_lowers_for_eight_h200s(monkeypatch):
  """Deviceless AOT for 8 H200s (4 data x 2 model): the compiled path, with
  shard_map's check_vma on. Each FORGE kernel becomes one Triton call on its
  local shard (here: the epilogue on the reduced gradient); the data x
  tensor-parallel layers' gradients are all-reduced, the fully sharded
  ones' reduce-scattered."""
  import pallas_kernels.fused_wgrad as fw
  monkeypatch.setattr(fw, "default_interpret", lambda: False)
  mesh = AbstractMesh((4, 2), ("data", "model"),
                      axis_types=(AxisType.Auto,) * 2,
                      abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(forge_jax.Dense(512, name="up")(x))
      x = nn.relu(forge_jax.Dense(256, name="down")(x))
      return forge_jax.Dense(128, name="out")(x)

  model = MLP()
  x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("data")))
  variables = jax.eval_shape(model.init, jax.random.key(0),
                             jnp.ones((64, 256), jnp.bfloat16))
  specs = {"up": {"kernel": P(None, "model"), "bias": P("model")},
           "down": {"kernel": P("model", None), "bias": P()},
           "out": {"kernel": P("data", None), "bias": P()}}
  tx = forge_jax.adamw(1e-3)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda s: isinstance(s, P))
  params = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=s),
      variables["params"], shardings)
  state = jax.eval_shape(tx.init, params)
  by_shape = {a.shape: a.sharding for a in jax.tree.leaves(params)}
  state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=by_shape.get(
          a.shape, NamedSharding(mesh, P()))), state)
  step = forge_jax.make_step(
      lambda v, b: jnp.mean(model.apply(v, b).astype(jnp.float32) ** 2), tx,
      mesh_layout=forge_jax.MeshLayout(mesh, data_axes="data",
                                       param_specs=specs))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(step, donate_argnums=(0, 1)).trace(
        {"params": params}, state, x).lower(
            lowering_platforms=("cuda",)).as_text()
  triton = triton_calls(text)
  assert len(triton) == 3, len(triton)
  # Local shards: up (256, 512) -> (256, 256); down (512, 256) -> (256,
  # 256); out (256, 128) over 4 -> (64, 128): W and both moments, aliased.
  assert sum("-> (tensor<256x256xbf16>, tensor<256x256xbf16>, "
             "tensor<256x256xbf16>)" in t for t in triton) == 2
  assert sum("-> (tensor<64x128xbf16>, tensor<64x128xbf16>, "
             "tensor<64x128xbf16>)" in t for t in triton) == 1
  assert text.count("stablehlo.reduce_scatter") == 1
  assert text.count("stablehlo.all_reduce") >= 2


@pytest.mark.gpu
def test_layouts_on_the_gpus():
  """The same checks on the real GPUs (two or more), compiled kernels."""
  if jax.device_count() < 2:
    pytest.skip(f"needs 2+ GPUs, this machine has {jax.device_count()}")
  got = _run_checks()
  assert got["platform"] == "gpu" and got["devices"] == jax.device_count()
  for name, r in got["runs"].items():
    _assert_run_ok(name, r)
  for name, r in got["layouts"].items():
    _assert_run_ok(name, r, SHARDED_RTOL)
    assert r["memory"]["alias"] == r["memory"]["state"], (name, r["memory"])
  assert got["memory"]["wgrad"] == "fused"  # compiled: no interpreter copies
  for layout in checks.LAYOUTS:
    assert got["memory"][layout]["temp"] < got["memory"]["kernels"], layout
  assert got["tied"]["max_rel_err"] <= SHARDED_RTOL
  for case, text in REFUSED.items():
    text = text.replace("8 devices", f"{got['devices']} devices")
    if case == "indivisible_batch":
      text = f"dimension {got['devices'] - 1} is not divisible"
    assert got["refusals"][case] is not None and text in got["refusals"][case]
