"""The multi-device checks of tests/test_distributed.py, run in a process of
their own: ``python -m tests.multidevice_checks [--cpu-devices N]``.

JAX fixes its device count when it starts, so simulated CPU devices
(``--xla_force_host_platform_device_count``) need a fresh process; on GPUs the
real ones are used. Prints one JSON object: per run, the relative error of
every parameter and optimizer state against the same model trained unsharded
by optax, the arrays whose sharding changed, and whether every kernel and slot
shard kept its buffer (donated, updated in place); per refused layout, the
error message (``null`` if nothing was refused).

One model carries every layout at once, a layer per layout, so that each run
compiles one step (the Pallas interpreter makes compiling slow on a CPU).
"""

import argparse
import json
import os
import sys

if __name__ == "__main__":
  _p = argparse.ArgumentParser()
  _p.add_argument("--cpu-devices", type=int, default=0,
                  help="simulate this many CPU devices (0: the real devices)")
  _n = _p.parse_args(sys.argv[1:]).cpu_devices
  if _n:
    # Simulated devices; LLVM's optimizations off: compiling the Pallas
    # interpreter's programs is most of the time spent here.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") +
        f" --xla_force_host_platform_device_count={_n}"
        " --xla_backend_optimization_level=0"
        " --xla_llvm_disable_expensive_passes=true")
    os.environ["JAX_PLATFORMS"] = "cpu"

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import re
import warnings

import flax.linen as nn
from flax.core import meta
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import forge_jax
import pallas_kernels
from forge_jax import _context
from forge_jax import _sharding

BATCH, SEQ = 8, 3  # x is (batch, seq, width): 24 tokens
STEPS = 5
# (name, features): in 24 -> ... -> 16. Every width is a multiple of 8 and
# splits into odd shards on some layout (40 / 8 = 5, 56 / 8 = 7, 24 / 8 = 3),
# so kernel tiles are partial on every device.
IN = 24
LAYERS = (("a", 40), ("b", 56), ("c", 40), ("d", 24), ("e", 40), ("f", 24),
          ("g", 16))
OUT = LAYERS[-1][1]

D, M = "data", "model"
# Kernel specs per mesh, one layer per layout (the bias: sharded as the
# kernel's out dimension when that is tensor parallel, else replicated).
SPECS = {
    # A 2-D mesh (data x model), the batch over data: fully sharded x tensor
    # parallel (a, g), data x tensor parallel along in (b) and out (e),
    # fully sharded along out (c) and in (f), data parallel (d).
    "2d": {"a": P(D, M), "b": P(M, None), "c": P(None, D), "d": P(),
           "e": P(None, M), "f": P(D, None), "g": P(M, D)},
    # Tensor parallel alone: a 1-D model mesh, the batch replicated.
    "tp": {"a": P(None, M), "b": P(M, None), "c": P(), "d": P(M, None),
           "e": P(), "f": P(None, M), "g": P(M, None)},
    # A 1-D data mesh: fully sharded and data parallel, n-way.
    "dp": {"a": P(D, None), "b": P(), "c": P(None, D), "d": P(),
           "e": P(D, None), "f": P(None, D), "g": P()},
}


class Net(nn.Module):
  """The first ``depth`` of ``LAYERS``, ReLUs between. ``specs``: kernel
  specs by layer, given to the parameters as Flax partitioning boxes
  (``nn.with_partitioning``); ``None``: no boxes."""

  dense: type
  depth: int
  specs: tuple | None = None

  @nn.compact
  def __call__(self, x):
    specs = dict(self.specs or ())
    layers = LAYERS[:self.depth]
    for i, (name, features) in enumerate(layers):
      kernel_init = nn.initializers.lecun_normal()
      bias_init = nn.initializers.normal(0.1)
      if self.specs is not None:
        k, b = specs[name]
        kernel_init = nn.with_partitioning(kernel_init, tuple(k))
        bias_init = nn.with_partitioning(bias_init, tuple(b))
      x = self.dense(features, name=name, kernel_init=kernel_init,
                     bias_init=bias_init)(x)
      if i < len(layers) - 1:
        x = nn.relu(x)
    return x


def bias_spec(kernel_spec: P) -> P:
  out = tuple(kernel_spec) + (None,) * (2 - len(kernel_spec))
  return P(out[1]) if out[1] == M else P()


def param_specs(kind: str, depth: int) -> dict:
  return {l: {"kernel": SPECS[kind][l], "bias": bias_spec(SPECS[kind][l])}
          for l, _ in LAYERS[:depth]}


def loss_fn(model):
  def f(variables, batch):
    x, y = batch
    return jnp.mean((model.apply(variables, x) - y) ** 2)
  return f


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_mesh(kind: str, n: int) -> Mesh:
  devices = np.array(jax.devices()[:n])
  if kind == "2d":
    return Mesh(devices.reshape(n // 2, 2), (D, M))
  return Mesh(devices, (M if kind == "tp" else D,))


@dataclasses.dataclass(frozen=True)
class Run:
  specs: str  # a key of SPECS (and the mesh: "2d", or 1-D)
  depth: int = 3  # the first layers of LAYERS
  data_axes: tuple = (D,)
  boxed: bool = False  # the specs as Flax boxes instead of param_specs
  wgrad: str = "fused"
  bucket_bytes: int | None = None
  family: str = "adamw"


RUNS = {
    # The layouts of SPECS["2d"] but the last two (covered by the mirror
    # images a and c and by the runs below), one layer each.
    "dp_tp_fsdp": Run("2d", depth=5),
    "tp": Run("tp", depth=2, data_axes=()),
    # n-way fully sharded and data parallel, specs read from Flax's boxes.
    "fsdp_dp_boxed": Run("dp", depth=2, boxed=True),
    # a's reduce-scattered gradient in two buckets of 3 of its 6 local rows
    # (fully sharded x tensor parallel: 4 x 20 fp32 values per local row).
    "fsdp_tp_buckets": Run("2d", depth=1, bucket_bytes=3 * 4 * 20 * 4),
    # A regime-2 family (LAMB: a layer pass over the new state), each
    # kernel's G in memory (XLA's GEMM and update).
    "fsdp_tp_lamb_xla": Run("2d", depth=2, wgrad="xla", family="lamb"),
    # A deferred family (Adafactor: G formed and consumed by XLA code).
    "fsdp_dp_adafactor": Run("dp", depth=2, family="adafactor"),
}

FAMILIES = {
    "adamw": lambda m: m.adamw(1e-2, weight_decay=0.1),
    "lamb": lambda m: m.lamb(3e-2, weight_decay=0.1),
    "adafactor": lambda m: m.adafactor(3e-2),
}


def batches(n_steps, out=OUT, seed=1):
  got, k = [], jax.random.key(seed)
  for _ in range(n_steps):
    k1, k2, k = jax.random.split(k, 3)
    got.append((jax.random.normal(k1, (BATCH, SEQ, IN)),
                jax.random.normal(k2, (BATCH, SEQ, out))))
  return got


_REFERENCES = {}


def reference(variables, family, depth, data):
  """The same model, unsharded, trained by optax (once per family and
  depth)."""
  if (family, depth) in _REFERENCES:
    return _REFERENCES[family, depth]
  model, tx = Net(nn.Dense, depth), FAMILIES[family](optax)

  @jax.jit
  def step(v, s, b):
    loss, g = jax.value_and_grad(loss_fn(model))(v, b)
    u, s = tx.update(g["params"], s, v["params"])
    return loss, {"params": optax.apply_updates(v["params"], u)}, s

  v, s = variables, tx.init(variables["params"])
  for b in data:
    _, v, s = step(v, s, b)
  _REFERENCES[family, depth] = v, s
  return v, s


def place(tree, shardings):
  """``tree``'s arrays on the devices, each sharded as ``shardings`` says
  (a tree of the same structure), assembled from host copies (no program
  compiled, unlike ``jax.device_put`` of a device array)."""
  def one(a, sharding):
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda idx: host[idx])
  def boxed(a, sharding):  # a Flax box: its value placed, the box kept
    if isinstance(a, meta.AxisMetadata):
      return a.replace_boxed(one(a.unbox(), sharding))
    return one(a, sharding)
  return jax.tree.map(boxed, tree, shardings,
                      is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


def state_shardings(tx, state, params, param_shardings, mesh):
  """A kernel's (and bias's) slots sharded as it is; anything else (step
  counts, Adafactor's factored moments) replicated."""
  rep = NamedSharding(mesh, P())
  return optax.tree_utils.tree_map_params(
      tx, lambda leaf, sh, p: sh if leaf.shape == p.shape else rep, state,
      param_shardings, params, transform_non_params=lambda _: rep,
      is_leaf=lambda x: isinstance(x, NamedSharding))


def _shard_buffers(tree):
  """The device buffer of every shard of every kernel-shaped array."""
  return [[s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
          for a in jax.tree.leaves(tree) if a.ndim == 2]


def _entries(spec) -> list:
  """A kernel's PartitionSpec as two entries (JSON: lists of axis names)."""
  out = []
  for e in tuple(spec) + (None,) * (2 - len(spec)):
    out.append([] if e is None else [e] if isinstance(e, str) else list(e))
  return out


def run(run: Run, n: int) -> dict:
  mesh = make_mesh(run.specs, n)
  data = batches(STEPS, LAYERS[run.depth - 1][1])
  specs = param_specs(run.specs, run.depth)
  boxes = tuple((l, (s["kernel"], s["bias"])) for l, s in specs.items())
  model = Net(forge_jax.Dense, run.depth, boxes if run.boxed else None)
  v_ref, s_ref = reference(
      Net(nn.Dense, run.depth).init(jax.random.key(0), data[0][0]),
      run.family, run.depth, data)

  variables = model.init(jax.random.key(0), data[0][0])
  if run.boxed:
    shardings = nn.get_sharding(variables, mesh)
  else:
    shardings = {"params": jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs,
        is_leaf=lambda s: isinstance(s, P))}
  tx = FAMILIES[run.family](forge_jax)
  params = meta.unbox(variables)["params"]
  state = tx.init(params)
  opt_state = place(state, state_shardings(
      tx, state, params, meta.unbox(shardings)["params"], mesh))
  variables = place(variables, shardings)
  layout = forge_jax.MeshLayout(
      mesh, data_axes=run.data_axes, bucket_bytes=run.bucket_bytes,
      param_specs=None if run.boxed else specs)
  step = jax.jit(forge_jax.make_step(loss_fn(model), tx, mesh_layout=layout,
                                     wgrad=run.wgrad),
                 donate_argnums=(0, 1))
  batch_sharding = NamedSharding(mesh, P(run.data_axes or None))
  data = [place(b, (batch_sharding,) * 2) for b in data]
  compiled = step.lower(variables, opt_state, data[0]).compile()
  before = jax.tree.map(lambda a: a.sharding, (variables, opt_state))
  in_place = []  # per step: every kernel and slot shard kept its buffer
  for b in data:
    buffers = _shard_buffers((meta.unbox(variables), opt_state))
    _, variables, opt_state = compiled(variables, opt_state, b)
    in_place.append(
        _shard_buffers((meta.unbox(variables), opt_state)) == buffers)
  after = jax.tree.map(lambda a: a.sharding, (variables, opt_state))
  moved = [
      f"{jax.tree_util.keystr(kp)}: {a} -> {b}"
      for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(before),
                            jax.tree.leaves(after))
      if not (a == b or a.is_equivalent_to(b, 2))]
  got = (meta.unbox(variables)["params"], opt_state)
  errs = jax.tree_util.tree_leaves_with_path(
      jax.tree.map(rel_err, got, (v_ref["params"], s_ref)))
  worst_path, worst = max(errs, key=lambda e: e[1])
  return {"max_rel_err": worst, "worst": jax.tree_util.keystr(worst_path),
          "n_arrays": len(errs), "shardings_moved": moved,
          "in_place": in_place, "n_shards": len(jax.tree.leaves(
              _shard_buffers(meta.unbox(variables)["params"]))),
          "kernel_specs": {l: _entries(got[0][l]["kernel"].sharding.spec)
                           for l, _ in LAYERS[:run.depth]},
          "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes)),
          "reductions": reductions(compiled.as_text())}


def reductions(hlo: str) -> list:
  """The result shapes of every all-reduce and reduce-scatter of a
  compiled program (one list per collective, after XLA's combiner; a
  reduce-scatter's are the scattered shards)."""
  got = []
  for line in hlo.splitlines():
    m = re.search(r"= (.*?) (all-reduce|reduce-scatter)(-start)?\(", line)
    if m:
      got.append([[int(d) for d in dims.split(",") if d]
                  for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1))])
  return got


# --------------------------------------------------------------------------
# Refused layouts: each gives the error message, or None if not refused.


def _message(fn):
  try:
    fn()
  except (ValueError, TypeError) as e:
    return str(e)
  return None


class Two(nn.Module):
  """A small two-layer model for the refusals."""

  @nn.compact
  def __call__(self, x):
    return forge_jax.Dense(OUT, name="down")(
        nn.relu(forge_jax.Dense(45, name="up")(x)))


def _abstract(tree, sharding):
  """Shapes and dtypes of ``tree``, placed (abstractly) with ``sharding``:
  the refusals happen while the step is traced, before anything runs."""
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
      tree)


def refusals(n: int) -> dict:
  out = {}
  mesh, mesh2 = make_mesh("dp", n), make_mesh("2d", n)
  model, tx = Two(), forge_jax.adamw(1e-3)
  x = jax.ShapeDtypeStruct((BATCH, SEQ, IN), jnp.float32)
  y = jax.ShapeDtypeStruct((BATCH, SEQ, OUT), jnp.float32)
  v = jax.eval_shape(model.init, jax.random.key(0), x)
  s = jax.eval_shape(tx.init, v["params"])
  rep = NamedSharding(mesh, P())
  args = (_abstract(v, rep), _abstract(s, rep),
          _abstract((x, y), NamedSharding(mesh, P(D))))
  loss = loss_fn(model)

  def attempt(layout, args=args, fn=loss):
    return _message(lambda: jax.jit(forge_jax.make_step(
        fn, tx, mesh_layout=layout)).trace(*args))

  # Arrays on a mesh, a step without a MeshLayout.
  out["no_layout"] = attempt(None)
  # A MeshLayout on another mesh than the arrays'.
  out["other_mesh"] = attempt(forge_jax.MeshLayout(
      mesh2, data_axes=D, param_specs=P()))
  # A kernel dimension sharded over a data axis and a model axis at once.
  out["data_and_model_on_one_dim"] = attempt(
      forge_jax.MeshLayout(mesh2, data_axes=D, param_specs={
          "up": {"kernel": P((D, M), None), "bias": P()}, "down": P()}),
      args=_abstract((v, s, (x, y)), NamedSharding(mesh2, P())))
  # No box and no param_specs: the kernels' sharding is unknown.
  out["unknown_sharding"] = attempt(forge_jax.MeshLayout(mesh, data_axes=D))
  # A kernel dimension its axes do not divide (up's 45 outputs over n).
  out["indivisible_kernel"] = attempt(forge_jax.MeshLayout(
      mesh, data_axes=D, param_specs={"up": P(None, D), "down": P()}))
  # A batch whose leading dimension the data axes do not divide.
  short = (jax.ShapeDtypeStruct((n - 1, SEQ, IN), jnp.float32),
           jax.ShapeDtypeStruct((n - 1, SEQ, OUT), jnp.float32))
  out["indivisible_batch"] = attempt(
      forge_jax.MeshLayout(mesh, data_axes=D, param_specs=P()),
      args=(*args[:2], _abstract(short, rep)))

  # A stacked kernel (ScannedDenseStack) on a mesh.
  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      return forge_jax.ScannedDenseStack(num_layers=2, features=IN)(x)

  stack = Stack()
  vs = jax.eval_shape(stack.init, jax.random.key(0), x)
  out["stacked_kernel"] = attempt(
      forge_jax.MeshLayout(mesh, data_axes=D, param_specs=P()),
      args=(_abstract(vs, rep),
            _abstract(jax.eval_shape(tx.init, vs["params"]), rep), args[2]),
      fn=lambda v, b: jnp.mean(stack.apply(v, b[0]) ** 2))
  return out


def missing_reduction(n: int) -> dict:
  """The check_vma safety net: a data-parallel plan with its reduction
  removed is refused by shard_map (fused: checked abstractly first; xla:
  checked where it runs); the same plan with its reduction is not."""
  mesh = make_mesh("dp", n)
  info = _context.LayerInfo(("w",), (IN, OUT), jnp.float32)
  plan = _sharding.plan_layers(
      forge_jax.MeshLayout(mesh, data_axes=D, param_specs=P()),
      None, {("w",): info}, {("w",): ()})[("w",)]
  k = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(k[0], (BATCH, IN))
  dy = jax.random.normal(k[1], (BATCH, OUT))
  w = jax.random.normal(k[2], (IN, OUT))
  rule = pallas_kernels.rules.sgd_rule()
  h = rule.pack(lr=0.1)

  def trace(p, wgrad):
    return _message(lambda: jax.jit(lambda x, dy, w: p.wgrad_update(
        x, dy, w, (), h, rule=rule, config=None, wgrad=wgrad,
        precision=None)).trace(x, dy, w))

  broken = dataclasses.replace(plan, psum=())
  return {"fused_reduced": trace(plan, "fused"),
          "fused_unreduced": trace(broken, "fused"),
          "xla_reduced": trace(plan, "xla"),
          "xla_unreduced": trace(broken, "xla")}


def main() -> None:
  warnings.simplefilter("ignore")
  n = jax.device_count()
  result = {"devices": n, "platform": jax.default_backend()}
  with jax.default_matmul_precision("highest"):
    result["runs"] = {name: run(r, n) for name, r in RUNS.items()}
    result["refusals"] = refusals(n)
    result["missing_reduction"] = missing_reduction(n)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
