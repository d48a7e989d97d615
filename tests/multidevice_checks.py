"""The multi-device checks of tests/test_distributed.py, run in a process of
their own: ``python -m tests.multidevice_checks [--cpu-devices N]``.

JAX fixes its device count when it starts, so simulated CPU devices
(``--xla_force_host_platform_device_count``) need a fresh process; on GPUs the
real ones are used. Prints one JSON object:

* ``runs``: one model carrying many layouts at once, a layer per layout (so
  that each run compiles one step: the Pallas interpreter makes compiling
  slow on a CPU), against the same model trained unsharded by optax;
* ``layouts``: a small decoder and an odd-width MLP, each in four layouts
  (data parallel, tensor parallel, data x tensor parallel, fully sharded),
  against the same FORGE step on one device;
* ``memory``: per layout, the compiled step's memory analysis for an MLP
  whose kernels outweigh its activations;
* ``tied``: a kernel read twice under a fully sharded layout;
* ``refusals``: per refused layout, the error message (``null`` if nothing
  was refused).

Per run: the relative error of every parameter and optimizer state, the
largest difference between replicas of one shard (``drift``), the arrays
whose sharding changed, and whether every kernel and slot shard kept its
buffer (donated, updated in place).
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
import math
import re
from typing import Any
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
LAYOUT_STEPS = 10  # the four layouts of the decoder and the MLP
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


def host_init(module, x, seed=0):
  """``module``'s variables for the input ``x``, drawn on the host with
  numpy (XLA takes about a second to compile an initialiser; the draws are
  instant): LeCun-normal kernels, unit-normal embeddings, norm scales of
  one and N(0, 0.1^2) biases. Flax partitioning boxes are kept."""
  rng = np.random.default_rng(seed)

  def draw(path, a):
    name = path[-1].key
    if name == "scale":
      return np.ones(a.shape, a.dtype)
    normal = rng.standard_normal(a.shape).astype(a.dtype)
    if name == "kernel":
      return normal / np.sqrt(a.shape[0])
    return normal if name == "embedding" else 0.1 * normal

  def leaf(path, a):
    if isinstance(a, meta.AxisMetadata):
      return a.replace_boxed(draw(path, a.unbox()))
    return draw(path, a)

  return jax.tree_util.tree_map_with_path(
      leaf, jax.eval_shape(module.init, jax.random.key(0), x),
      is_leaf=lambda a: isinstance(a, meta.AxisMetadata))


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


def _drift(tree) -> float:
  """The largest difference between two devices' copies of one shard of
  any array of ``tree`` (replicated arrays, and arrays replicated along
  some mesh axes): 0 when every replica is bit-identical."""
  worst = 0.0
  for a in jax.tree.leaves(tree):
    first = {}
    for shard in a.addressable_shards:
      key = tuple((i.start, i.stop, i.step) for i in shard.index)
      data = np.asarray(shard.data)
      if key not in first:
        first[key] = data
      elif data.size:
        diff = np.abs(data.astype(np.float64) - first[key].astype(np.float64))
        worst = max(worst, float(np.max(diff)))
  return worst


def _local_bytes(tree) -> int:
  """Bytes of one device's shards of every array of ``tree``."""
  return int(sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                 for a in jax.tree.leaves(tree)))


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


def _train(compiled, variables, opt_state, data, unbox=lambda v: v):
  """``compiled`` stepped over ``data``: the final variables and state,
  per step whether every shard kept its buffer (in place), and each array
  whose sharding changed (``"path: before -> after"``)."""
  before = jax.tree.map(lambda a: a.sharding, (variables, opt_state))
  in_place = []
  for b in data:
    buffers = _shard_buffers((unbox(variables), opt_state))
    _, variables, opt_state = compiled(variables, opt_state, b)
    in_place.append(_shard_buffers((unbox(variables), opt_state)) == buffers)
  after = jax.tree.map(lambda a: a.sharding, (variables, opt_state))
  moved = [
      f"{jax.tree_util.keystr(kp)}: {a} -> {b}"
      for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(before),
                            jax.tree.leaves(after))
      if not (a == b or a.is_equivalent_to(b, 2))]
  return variables, opt_state, in_place, moved


def run(run: Run, n: int) -> dict:
  mesh = make_mesh(run.specs, n)
  data = batches(STEPS, LAYERS[run.depth - 1][1])
  specs = param_specs(run.specs, run.depth)
  boxes = tuple((l, (s["kernel"], s["bias"])) for l, s in specs.items())
  model = Net(forge_jax.Dense, run.depth, boxes if run.boxed else None)
  variables = host_init(model, data[0][0])
  v_ref, s_ref = reference(meta.unbox(variables), run.family, run.depth, data)

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
  variables, opt_state, in_place, moved = _train(
      compiled, variables, opt_state, data, meta.unbox)
  got = (meta.unbox(variables)["params"], opt_state)
  errs = jax.tree_util.tree_leaves_with_path(
      jax.tree.map(rel_err, got, (v_ref["params"], s_ref)))
  worst_path, worst = max(errs, key=lambda e: e[1])
  return {"max_rel_err": worst, "worst": jax.tree_util.keystr(worst_path),
          "n_arrays": len(errs), "drift": _drift(got),
          "shardings_moved": moved,
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
# Four layouts of a small decoder and of an odd-width MLP, 10 steps each,
# against the same FORGE step on one device.

# Each layout: the mesh (a kind of make_mesh) and the data axes.
LAYOUTS = {"dp": ("dp", (D,)), "tp": ("tp", ()), "dp_tp": ("2d", (D,)),
           "fsdp": ("dp", (D,))}
# in -> hidden -> hidden -> out: no width a power of two; on eight devices the
# hidden widths shard into 7 and 5 columns, so kernel tiles are partial on
# every device. The outer widths (37, 5) are never sharded.
MLP_WIDTHS = (37, 56, 40, 5)
# The decoder: vocabulary, model width, heads, MLP width (shards of 5 and 7).
VOCAB, WIDTH, HEADS, HIDDEN = 29, 40, 8, 56


class OddMLP(nn.Module):
  """``MLP_WIDTHS`` of ``forge_jax.Dense``, ReLUs between."""

  @nn.compact
  def __call__(self, x):
    for i, features in enumerate(MLP_WIDTHS[1:]):
      x = forge_jax.Dense(features, name=f"l{i}",
                          bias_init=nn.initializers.normal(0.1))(x)
      if i < len(MLP_WIDTHS) - 2:
        x = nn.relu(x)
    return x


class Decoder(nn.Module):
  """One pre-LN decoder block and a head: causal multi-head attention (its
  joint query-key-value projection and its output projection
  ``forge_jax.Dense``), a GELU MLP of two ``forge_jax.Dense``, a
  ``forge_jax.Dense`` head over the vocabulary; the embedding and the norms
  take optax's update."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH, name="embed",
                 embedding_init=nn.initializers.normal(1.0))(tokens)
    b, t, _ = x.shape
    h = nn.LayerNorm(name="ln1")(x)
    # No bias: the key's would get an exactly-zero gradient under the
    # softmax, which Adam turns into an update of rounding noise.
    qkv = forge_jax.Dense(3 * WIDTH, use_bias=False, name="qkv")(h)
    q, k, v = (a.reshape(b, t, HEADS, WIDTH // HEADS)
               for a in jnp.split(qkv, 3, axis=-1))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(WIDTH // HEADS)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)
    x = x + forge_jax.Dense(WIDTH, name="o")(a.reshape(b, t, WIDTH))
    h = nn.gelu(forge_jax.Dense(HIDDEN, name="up")(nn.LayerNorm(name="ln2")(x)))
    x = x + forge_jax.Dense(WIDTH, name="down")(h)
    return forge_jax.Dense(VOCAB, name="head")(nn.LayerNorm(name="ln3")(x))


def mlp_specs(layout: str):
  """The odd-width MLP's parameter specs (a prefix tree) per layout."""
  if layout == "dp":
    return P()
  if layout == "fsdp":  # every kernel sharded, along out or in
    return {"l0": {"kernel": P(None, D), "bias": P(D)},
            "l1": {"kernel": P(D, None), "bias": P(D)},
            "l2": {"kernel": P(D, None), "bias": P()}}
  # tp, dp_tp: column parallel, then row parallel (twice).
  return {"l0": {"kernel": P(None, M), "bias": P(M)},
          "l1": {"kernel": P(M, None), "bias": P()},
          "l2": {"kernel": P(M, None), "bias": P()}}


def decoder_specs(layout: str):
  """The decoder's parameter specs (a prefix tree) per layout."""
  if layout == "dp":
    return P()
  if layout == "fsdp":  # every parameter sharded that the devices divide
    norm = {"scale": P(D), "bias": P(D)}
    return {"embed": P(None, D), "ln1": norm, "ln2": norm, "ln3": norm,
            "qkv": P(None, D), "o": {"kernel": P(D, None), "bias": P(D)},
            "up": {"kernel": P(None, D), "bias": P(D)},
            "down": {"kernel": P(D, None), "bias": P(D)},
            "head": {"kernel": P(D, None), "bias": P()}}
  # tp, dp_tp: Megatron's layout -- heads and the MLP's hidden units split
  # over the model axis; the head row parallel.
  column = {"kernel": P(None, M), "bias": P(M)}
  row = {"kernel": P(M, None), "bias": P()}
  return {"embed": P(), "ln1": P(), "ln2": P(), "ln3": P(),
          "qkv": P(None, M), "o": row,
          "up": column, "down": row, "head": row}


def mlp_batches():
  rng = np.random.default_rng(3)
  normal = lambda *shape: rng.standard_normal(shape, np.float32)
  return [(normal(BATCH, SEQ, MLP_WIDTHS[0]),
           normal(BATCH, SEQ, MLP_WIDTHS[-1])) for _ in range(LAYOUT_STEPS)]


def decoder_batches():
  rng = np.random.default_rng(4)
  seqs = [rng.integers(0, VOCAB, (BATCH, 6), np.int32)
          for _ in range(LAYOUT_STEPS)]
  return [(seq[:, :-1], seq[:, 1:]) for seq in seqs]


def next_token_loss(model):
  def f(variables, batch):
    tokens, targets = batch
    return optax.softmax_cross_entropy_with_integer_labels(
        model.apply(variables, tokens), targets).mean()
  return f


@dataclasses.dataclass(frozen=True)
class Model:
  """A model of the layout checks."""

  module: type
  specs: Any  # layout -> the parameters' specs
  batches: Any
  loss: Any  # module -> loss_fn
  # AdamW's learning rate. The decoder's is smaller: its softmax and norms
  # amplify the rounding of a changed summation order (XLA's partitioned
  # sums), and over 10 steps of 1e-2 that alone moves its moments by ~6e-6
  # relative -- for optax's step partitioned the same way too.
  lr: float


MODELS = {
    "mlp": Model(OddMLP, mlp_specs, mlp_batches, loss_fn, 1e-2),
    "decoder": Model(Decoder, decoder_specs, decoder_batches, next_token_loss,
                     1e-3),
}


def _full_shardings(specs, params, mesh):
  """A NamedSharding for every leaf of ``params`` from a prefix tree of
  specs."""
  return jax.tree.map(
      lambda spec, sub: jax.tree.map(lambda _: NamedSharding(mesh, spec), sub),
      specs, params, is_leaf=lambda x: isinstance(x, P))


_INPUTS = {}
_SINGLE = {}


def inputs(name: str):
  """The model's initial variables and its batches, on the host (made
  once)."""
  if name not in _INPUTS:
    m = MODELS[name]
    data = m.batches()
    _INPUTS[name] = host_init(m.module(), data[0][0]), data
  return _INPUTS[name]


def single_device(name: str):
  """The model trained by the same FORGE step on one device (once)."""
  if name not in _SINGLE:
    m = MODELS[name]
    model = m.module()
    variables, data = jax.tree.map(jnp.asarray, inputs(name))
    tx = forge_jax.adamw(m.lr, weight_decay=0.1)
    state = tx.init(variables["params"])
    step = jax.jit(forge_jax.make_step(m.loss(model), tx),
                   donate_argnums=(0, 1))
    for b in data:
      _, variables, state = step(variables, state, b)
    _SINGLE[name] = variables["params"], state
  return _SINGLE[name]


def layout_run(name: str, layout: str, n: int) -> dict:
  """``name`` trained ``LAYOUT_STEPS`` steps in ``layout`` on ``n``
  devices, against :func:`single_device`."""
  m = MODELS[name]
  kind, data_axes = LAYOUTS[layout]
  mesh = make_mesh(kind, n)
  model, (start, data) = m.module(), inputs(name)
  tx = forge_jax.adamw(m.lr, weight_decay=0.1)
  specs = m.specs(layout)
  variables = start
  params = variables["params"]
  shardings = _full_shardings(specs, params, mesh)
  state = tx.init(params)
  opt_state = place(state, state_shardings(tx, state, params, shardings,
                                           mesh))
  variables = place(variables, {"params": shardings})
  step = jax.jit(forge_jax.make_step(
      m.loss(model), tx, mesh_layout=forge_jax.MeshLayout(
          mesh, data_axes=data_axes, param_specs=specs)),
                 donate_argnums=(0, 1))
  batch_sharding = NamedSharding(mesh, P(data_axes or None))
  data = [place(b, (batch_sharding,) * 2) for b in data]
  compiled = step.lower(variables, opt_state, data[0]).compile()
  memory = compiled.memory_analysis()
  state_bytes = _local_bytes((variables, opt_state))
  variables, opt_state, in_place, moved = _train(compiled, variables,
                                                 opt_state, data)
  got = (variables["params"], opt_state)
  errs = jax.tree_util.tree_leaves_with_path(
      jax.tree.map(rel_err, got, single_device(name)))
  worst_path, worst = max(errs, key=lambda e: e[1])
  return {
      "max_rel_err": worst, "worst": jax.tree_util.keystr(worst_path),
      "n_arrays": len(errs),
      # Not a vacuous match: the smallest relative change of a parameter.
      "min_moved": min(jax.tree.leaves(jax.tree.map(
          rel_err, got[0], start["params"]))),
      "drift": _drift(got), "shardings_moved": moved, "in_place": in_place,
      "mesh": dict(zip(mesh.axis_names, mesh.axis_sizes)),
      "kernel_specs": {
          path: _entries(a.sharding.spec) for path, a in (
              (jax.tree_util.keystr(kp[:-1]), a) for kp, a in
              jax.tree_util.tree_leaves_with_path(got[0])
              if kp[-1].key == "kernel")},
      "local_kernels": [list(a.sharding.shard_shape(a.shape)) for kp, a in
                        jax.tree_util.tree_leaves_with_path(got[0])
                        if kp[-1].key == "kernel"],
      # Per device: the donated state (params and optimizer state) aliased
      # to the outputs, and the step's other buffers.
      "memory": {"state": state_bytes,
                 "alias": memory.alias_size_in_bytes,
                 "output": memory.output_size_in_bytes,
                 "temp": memory.temp_size_in_bytes},
      "reductions": reductions(compiled.as_text())}


# The memory check: an MLP whose kernels outweigh its activations (8 tokens;
# widths shard into 31 and 5 columns). Four square layers make one copy of
# every kernel -- the weights gathered whole on every device, or a gradient
# of every layer at once -- over four layers' worth, about twice what a step
# needs at any time (a layer's gathered kernel or gradient, and the result
# of its reduction).
MEMORY_WIDTHS = (40, 248, 248, 248, 248, 248, 40)


class WideMLP(nn.Module):
  """``MEMORY_WIDTHS`` of ``forge_jax.Dense``, ReLUs between."""

  @nn.compact
  def __call__(self, x):
    for i, features in enumerate(MEMORY_WIDTHS[1:]):
      x = forge_jax.Dense(features, name=f"l{i}")(x)
      if i < len(MEMORY_WIDTHS) - 2:
        x = nn.relu(x)
    return x


def memory_specs(layout: str):
  """The wide MLP's parameter specs per layout: its kernels alternately
  sharded along out and in (tensor parallel or fully sharded)."""
  if layout == "dp":
    return P()
  axis = D if layout == "fsdp" else M
  return {f"l{i}": {"kernel": P(None, axis) if i % 2 == 0 else P(axis, None),
                    "bias": P(axis) if i % 2 == 0 else P()}
          for i in range(len(MEMORY_WIDTHS) - 1)}


def memory(n: int) -> dict:
  """Per layout, the compiled step's temporaries per device against the
  bytes of the model's kernels. On a CPU the step updates with XLA's code
  (``wgrad="xla"``): the Pallas interpreter copies its operands (padded to
  the kernel's tiles), which the compiled kernel does not; on GPUs, the
  fused kernel."""
  wgrad = "fused" if jax.default_backend() == "gpu" else "xla"
  model, tx = WideMLP(), forge_jax.adamw(1e-3)
  x = jax.ShapeDtypeStruct((BATCH, MEMORY_WIDTHS[0]), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  kernels = [a for kp, a in jax.tree_util.tree_leaves_with_path(params)
             if kp[-1].key == "kernel"]
  out = {"wgrad": wgrad,
         "kernels": int(sum(a.size * a.dtype.itemsize for a in kernels)),
         "largest": int(max(a.size * a.dtype.itemsize for a in kernels))}
  for layout, (kind, data_axes) in LAYOUTS.items():
    mesh = make_mesh(kind, n)
    specs = memory_specs(layout)
    shardings = _full_shardings(specs, params, mesh)
    state = jax.eval_shape(tx.init, params)
    args = (_placed({"params": params}, {"params": shardings}),
            _placed(state, state_shardings(tx, state, params, shardings,
                                           mesh)),
            _abstract((x, x), NamedSharding(mesh, P(data_axes or None))))
    step = forge_jax.make_step(
        loss_fn(model), tx, wgrad=wgrad, mesh_layout=forge_jax.MeshLayout(
            mesh, data_axes=data_axes, param_specs=specs))
    analysis = jax.jit(step, donate_argnums=(0, 1)).lower(
        *args).compile().memory_analysis()
    out[layout] = {"temp": analysis.temp_size_in_bytes,
                   "alias": analysis.alias_size_in_bytes,
                   "state": _local_bytes(args[:2])}
  return out


def _placed(tree, shardings):
  """Shapes, dtypes and shardings of ``tree`` (a tree of shardings alike)."""
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
      shardings)


class Tied(nn.Module):
  """A square layer applied twice (its kernel read by two backward paths),
  then a head."""

  @nn.compact
  def __call__(self, x):
    tied = forge_jax.Dense(IN, name="tied")
    return forge_jax.Dense(OUT, name="head")(nn.relu(tied(nn.relu(tied(x)))))


def tied(n: int) -> dict:
  """A kernel read twice, fully sharded: refused by default
  (``shared="error"``); with ``shared="standard"`` its layer takes optax's
  update (which XLA partitions), trained against the same step on one
  device."""
  mesh = make_mesh("dp", n)
  model, tx = Tied(), forge_jax.adamw(1e-2, weight_decay=0.1)
  data = batches(LAYOUT_STEPS)
  specs = {"tied": {"kernel": P(D, None), "bias": P(D)},
           "head": {"kernel": P(D, None), "bias": P()}}
  layout = forge_jax.MeshLayout(mesh, data_axes=D, param_specs=specs)
  variables = host_init(model, data[0][0])
  params = variables["params"]
  shardings = _full_shardings(specs, params, mesh)
  state = tx.init(params)
  state_sh = state_shardings(tx, state, params, shardings, mesh)
  batch_sh = (NamedSharding(mesh, P(D)),) * 2
  refused = _message(lambda: jax.jit(forge_jax.make_step(
      loss_fn(model), tx, mesh_layout=layout)).trace(
          _placed(variables, {"params": shardings}),
          _placed(state, state_sh), _placed(data[0], batch_sh)))
  # One device, then the mesh.
  step = jax.jit(forge_jax.make_step(loss_fn(model), tx, shared="standard"))
  v, s = variables, state
  for b in data:
    _, v, s = step(v, s, b)
  sharded = forge_jax.make_step(loss_fn(model), tx, mesh_layout=layout,
                                shared="standard")
  step = jax.jit(sharded, donate_argnums=(0, 1))
  got_v = place(variables, {"params": shardings})
  got_s = place(state, state_sh)
  for b in data:
    _, got_v, got_s = step(got_v, got_s, place(b, batch_sh))
  got = (got_v["params"], got_s)
  return {"refused": refused, "standard_layers": sharded.standard_layers,
          "max_rel_err": max(jax.tree.leaves(jax.tree.map(
              rel_err, got, (v["params"], s)))),
          "drift": _drift(got),
          "kernel_spec": _entries(got[0]["tied"]["kernel"].sharding.spec)}


class Rematerialised(nn.Module):
  """Two layers, the last under ``nn.remat`` (its backward traced in the
  checkpoint's own trace), the first not."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(forge_jax.Dense(40, name="a")(x))
    return nn.remat(forge_jax.Dense)(OUT, name="b")(h)


def rematerialised(n: int) -> dict:
  """A layer under ``nn.remat`` on a data-parallel mesh (the reductions'
  chain must not carry a value of the checkpoint's trace into the outer
  one), trained against the same step on one device."""
  mesh = make_mesh("dp", n)
  model, tx = Rematerialised(), forge_jax.adamw(1e-2, weight_decay=0.1)
  data = batches(STEPS)
  variables = host_init(model, data[0][0])
  state = tx.init(variables["params"])
  step = jax.jit(forge_jax.make_step(loss_fn(model), tx))
  v, s = variables, state
  for b in data:
    _, v, s = step(v, s, b)
  layout = forge_jax.MeshLayout(mesh, data_axes=D, param_specs=P())
  replicated, batch_sh = NamedSharding(mesh, P()), NamedSharding(mesh, P(D))
  step = jax.jit(forge_jax.make_step(loss_fn(model), tx, mesh_layout=layout))
  got_v = jax.device_put(variables, replicated)
  got_s = jax.device_put(state, replicated)
  for b in data:
    _, got_v, got_s = step(got_v, got_s, jax.device_put(b, batch_sh))
  got = (got_v["params"], got_s)
  return {"max_rel_err": max(jax.tree.leaves(jax.tree.map(
      rel_err, got, (v["params"], s)))), "drift": _drift(got)}


# --------------------------------------------------------------------------
# Refused layouts: each gives the error message, or None if not refused.


def _message(fn):
  """The message of the ValueError or TypeError ``fn`` raises (prefixed
  with its type's name where that is a private subclass), else None."""
  try:
    fn()
  except (ValueError, TypeError) as e:
    name = type(e).__name__
    return f"{name}: {e}" if name.startswith("_") else str(e)
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


def _abstract_step(model, tx, mesh):
  """``(x, y, variables, opt_state, args)``: the step's inputs as shapes,
  ``args`` placed on ``mesh`` (parameters and state replicated, the batch
  split over the data axis)."""
  x = jax.ShapeDtypeStruct((BATCH, SEQ, IN), jnp.float32)
  y = jax.ShapeDtypeStruct((BATCH, SEQ, OUT), jnp.float32)
  v = jax.eval_shape(model.init, jax.random.key(0), x)
  s = jax.eval_shape(tx.init, v["params"])
  rep = NamedSharding(mesh, P())
  return x, y, v, s, (_abstract(v, rep), _abstract(s, rep),
                      _abstract((x, y), NamedSharding(mesh, P(D))))


def refusals(n: int) -> dict:
  out = {}
  mesh, mesh2 = make_mesh("dp", n), make_mesh("2d", n)
  model, tx = Two(), forge_jax.adamw(1e-3)
  x, y, v, s, args = _abstract_step(model, tx, mesh)
  rep = NamedSharding(mesh, P())
  loss = loss_fn(model)

  def attempt(layout, args=args, fn=loss):
    return _message(lambda: jax.jit(forge_jax.make_step(
        fn, tx, mesh_layout=layout)).trace(*args))

  # Arrays on a mesh, a step without a MeshLayout.
  out["no_layout"] = attempt(None)
  # A MeshLayout on another mesh than the arrays'.
  out["other_mesh"] = attempt(forge_jax.MeshLayout(
      mesh2, data_axes=D, param_specs=P()))
  # The arrays' mesh with its axes in another order (same names and sizes).
  swapped = Mesh(mesh2.devices.T, (M, D), axis_types=mesh2.axis_types)
  out["axes_in_another_order"] = attempt(
      forge_jax.MeshLayout(swapped, data_axes=D, param_specs=P()),
      args=_abstract((v, s, (x, y)), NamedSharding(mesh2, P())))
  # param_specs as NamedShardings on that swapped mesh, the layout's the
  # arrays' own.
  out["spec_axes_in_another_order"] = attempt(
      forge_jax.MeshLayout(mesh2, data_axes=D, param_specs=NamedSharding(
          swapped, P())),
      args=_abstract((v, s, (x, y)), NamedSharding(mesh2, P())))
  # A kernel dimension sharded over a data axis and a model axis at once.
  out["data_and_model_on_one_dim"] = attempt(
      forge_jax.MeshLayout(mesh2, data_axes=D, param_specs={
          "up": {"kernel": P((D, M), None), "bias": P()}, "down": P()}),
      args=_abstract((v, s, (x, y)), NamedSharding(mesh2, P())))
  # No box and no param_specs: the kernels' sharding is unknown.
  out["unknown_sharding"] = attempt(forge_jax.MeshLayout(mesh, data_axes=D))
  # A kernel dimension its axes do not divide (up's 45 outputs over n):
  # the shards would be uneven (the kernel's tiles are not the constraint:
  # a shard's partial tiles are masked, as every run above has them).
  out["indivisible_kernel"] = attempt(forge_jax.MeshLayout(
      mesh, data_axes=D, param_specs={"up": P(None, D), "down": P()}))
  # One mesh axis on both dimensions of a kernel (up's 24 inputs and 45
  # outputs over the model axis; down replicated).
  out["axis_on_both_dims"] = attempt(
      forge_jax.MeshLayout(mesh2, data_axes=D, param_specs={
          "up": {"kernel": P(M, M), "bias": P()}, "down": P()}),
      args=_abstract((v, s, (x, y)), NamedSharding(mesh2, P())))
  # A batch whose leading dimension the data axes do not divide.
  short = (jax.ShapeDtypeStruct((n - 1, SEQ, IN), jnp.float32),
           jax.ShapeDtypeStruct((n - 1, SEQ, OUT), jnp.float32))
  # A bias's spec naming an axis the mesh lacks.
  out["unknown_bias_axis"] = attempt(forge_jax.MeshLayout(
      mesh, data_axes=D, param_specs={"up": {"kernel": P(), "bias": P("tp")},
                                      "down": P()}))
  # A bias's spec a NamedSharding on the swapped mesh; one not a spec.
  out["bias_spec_on_another_mesh"] = attempt(
      forge_jax.MeshLayout(mesh2, data_axes=D, param_specs={
          "up": {"kernel": P(), "bias": NamedSharding(swapped, P())},
          "down": P()}),
      args=_abstract((v, s, (x, y)), NamedSharding(mesh2, P())))
  out["bias_spec_not_a_spec"] = attempt(forge_jax.MeshLayout(
      mesh, data_axes=D, param_specs={"up": {"kernel": P(), "bias": "tp"},
                                      "down": P()}))
  # A prefix of a layer's parameters neither a dict nor a spec (an axis
  # name where PartitionSpec(name) was meant).
  out["spec_prefix_not_a_spec"] = attempt(forge_jax.MeshLayout(
      mesh, data_axes=D, param_specs={"up": "tp", "down": P()}))
  # No entry for a FORGE kernel (refused as a plain ValueError).
  out["kernel_spec_missing"] = attempt(forge_jax.MeshLayout(
      mesh, data_axes=D, param_specs={"down": P()}))
  out["indivisible_batch"] = attempt(
      forge_jax.MeshLayout(mesh, data_axes=D, param_specs=P()),
      args=(*args[:2], _abstract(short, rep)))
  # The parameters on the layout's mesh and the batch, or the optimizer
  # state, on another (every array is checked, not the first one met).
  rep2 = NamedSharding(mesh2, P())
  out["batch_on_another_mesh"] = attempt(
      forge_jax.MeshLayout(mesh2, data_axes=D, param_specs=P()),
      args=(_abstract(v, rep2), _abstract(s, rep2), args[2]))
  out["state_on_another_mesh"] = attempt(
      forge_jax.MeshLayout(mesh, data_axes=D, param_specs=P()),
      args=(args[0], _abstract(s, rep2), args[2]))

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


class _Attention(nn.Module):
  """flax layers for make_step(convert=True): two nn.Dense and the
  attention's nn.DenseGeneral projections, whose kernels have 3 axes."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(32, name="a")(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="att")(x)
    return nn.Dense(OUT, name="c")(x)


def converted(model: nn.Module, n: int) -> dict:
  """make_step(convert=True) on a data-parallel mesh, traced over
  ``model``: the trace's error (None where it traces), the layers
  converted, and those skipped with their reasons."""
  mesh = make_mesh("dp", n)
  tx = forge_jax.adamw(1e-3)
  *_, args = _abstract_step(model, tx, mesh)
  step = forge_jax.make_step(
      loss_fn(model), tx, convert=True, mesh_layout=forge_jax.MeshLayout(
          mesh, data_axes=D, param_specs=P()))
  error = _message(lambda: jax.jit(step).trace(*args))
  return {"error": error, "converted": sorted(step.converted),
          "skipped": {k: str(r) for k, r in sorted(step.skipped.items())}}


def eager_placement(n: int) -> dict:
  """An eager (un-jitted) step, whose arguments are concrete arrays: ones
  on the layout's devices in another order, or committed to one device,
  are refused by forge_jax's placement check (JAX refused them inside the
  step's shard_map, naming no array); on the layout's mesh the step runs
  and gives the jitted step's loss."""
  mesh = make_mesh("dp", n)
  model, tx = Two(), forge_jax.adamw(1e-3)
  x = jnp.ones((BATCH, SEQ, IN), jnp.float32)
  y = jnp.zeros((BATCH, SEQ, OUT), jnp.float32)
  v = model.init(jax.random.key(0), x)
  step = forge_jax.make_step(loss_fn(model), tx, mesh_layout=(
      forge_jax.MeshLayout(mesh, data_axes=D, param_specs=P())))

  def placed(m):
    vs = jax.device_put(v, NamedSharding(m, P()))
    return (vs, tx.init(vs["params"]),
            jax.device_put((x, y), NamedSharding(m, P(D))))

  reversed_mesh = Mesh(mesh.devices[::-1], (D,))
  one = jax.device_put((v, (x, y)), jax.devices()[0])
  out = {"reversed": _message(lambda: step(*placed(reversed_mesh))),
         "one_device": _message(lambda: step(
             one[0], tx.init(one[0]["params"]), one[1]))}
  args = placed(mesh)
  eager = step(*args)[0]
  jitted = jax.jit(step)(*placed(mesh))[0]
  out["loss_rel_err"] = rel_err(eager, jitted)
  return out


class _ScannedFlax(nn.Module):
  """flax nn.Dense layers inside forge_jax.ScannedBlocks, and a head."""

  @nn.compact
  def __call__(self, x):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, h):
        return h + nn.Dense(IN, use_bias=False)(
            nn.gelu(nn.Dense(16, use_bias=False)(h)))

    x = forge_jax.ScannedBlocks(Block, 2)(x)
    return nn.Dense(OUT, name="head")(x)


def missing_reduction(n: int) -> dict:
  """The check_vma safety net: a data-parallel plan with its reduction
  removed is refused by shard_map (fused: checked abstractly first; xla:
  checked where it runs); the same plan with its reduction is not."""
  mesh = make_mesh("dp", n)
  info = _context.LayerInfo(("w",), (IN, OUT), jnp.float32)
  plan = _sharding.plan_layers(
      forge_jax.MeshLayout(mesh, data_axes=D, param_specs=P()),
      None, {("w",): info}, {("w",): ()})[("w",)]
  rng = np.random.default_rng(2)
  x = rng.standard_normal((BATCH, IN), np.float32)
  dy = rng.standard_normal((BATCH, OUT), np.float32)
  w = rng.standard_normal((IN, OUT), np.float32)
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
    result["layouts"] = {f"{name}_{layout}": layout_run(name, layout, n)
                         for name in MODELS for layout in LAYOUTS}
    result["memory"] = memory(n)
    result["tied"] = tied(n)
    result["rematerialised"] = rematerialised(n)
    result["refusals"] = refusals(n)
    # flax's attention: its 3-axis DenseGeneral kernels skipped, the 2-D
    # nn.Dense layers converted; flax layers inside ScannedBlocks (stacked
    # kernels) skipped, the head converted.
    result["converted_attention"] = converted(_Attention(), n)
    result["converted_scanned"] = converted(_ScannedFlax(), n)
    result["eager_placement"] = eager_placement(n)
    result["missing_reduction"] = missing_reduction(n)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
