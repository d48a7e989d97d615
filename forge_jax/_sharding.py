"""FORGE layers on a device mesh: data-, tensor- and fully-sharded parallel.

A step built with ``make_step(..., mesh_layout=MeshLayout(mesh, ...))`` runs
each FORGE kernel's optimizer step per shard, inside ``jax.shard_map`` (a
Pallas kernel cannot be partitioned by XLA: under a mesh it must run on
local blocks). Everything else in the step -- the forward, ``dx``, the
biases' optax update, a regime-2 layer pass, a deferred (regime-3) family --
is ordinary XLA code, which XLA partitions itself.

What a shard of the weight gradient ``G = x^T dy`` needs depends on how the
kernel ``W`` (``(in, out)``) and the batch are sharded (paper Section 4 and
Proposition 2). Each mesh axis that shards ``W`` or the batch plays one of
three roles:

* **tensor parallel** -- an axis that shards ``W`` but not the batch: ``W``'s
  ``in`` dimension with ``x`` sharded on its features the same way, or its
  ``out`` dimension with ``dy`` sharded so. A shard's ``x_local^T dy_local``
  is its complete gradient tile: no communication.
* **data parallel** -- an axis that shards the batch (``data_axes``) but
  not ``W``: each device holds a partial ``G``; it is summed over the axis
  (``psum``) before the update, which is nonlinear in ``G``.
* **fully sharded** -- a data axis that also shards ``W`` (FSDP): the partial
  ``G`` is reduce-scattered (``psum_scatter``) so each device receives the
  complete gradient of its own shard of ``W``, which it updates in place.

Where no reduction is needed the fused kernel runs per shard and ``G`` never
exists; otherwise the shard's ``G`` is formed by XLA's GEMM, reduced, and the
kernel's epilogue alone (``pallas_kernels.stored_g_update``) updates ``W`` and
its slots in place: ``G`` is a transient of one reduction bucket (the layer,
or ``MeshLayout.bucket_bytes`` of it). A fully sharded kernel is gathered by
XLA for its layer's matmuls, tied to the layer (:func:`gathered_after`), so
that one layer's gathered kernel exists at a time.

See docs/distributed.md.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from flax.core import meta as flax_meta

import pallas_kernels
from pallas_kernels import fused_wgrad
from pallas_kernels.reference import apply_rule
from forge_jax import _context
from forge_jax import _paths
from forge_jax import _state

Axes = tuple[str, ...]


def _axes(entry, what: str = "a PartitionSpec entry") -> Axes:
  """A PartitionSpec entry as a tuple of mesh axis names; ``TypeError``
  naming ``what`` for anything else (``P.UNCONSTRAINED``, a number, an
  unordered set)."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (str(entry),)  # (NumPy's str_ as str)
  if not isinstance(entry, (set, frozenset, Mapping)):  # (unordered)
    try:
      axes = tuple(entry)
    except TypeError:  # not iterable: P.UNCONSTRAINED, a number
      axes = None
    if axes is not None and all(isinstance(a, str) for a in axes):
      return tuple(map(str, axes))  # (NumPy's str_ as str)
  raise TypeError(
      f"{what}: {entry!r} is not a mesh axis name, a tuple of names or None"
      + (" (PartitionSpec.UNCONSTRAINED leaves the sharding to XLA; a FORGE "
         "kernel's update runs per shard of a sharding stated in full)"
         if entry is P.UNCONSTRAINED else ""))


def _check_known_axes(spec: P, mesh, what: str) -> None:
  """Refuses a PartitionSpec (``what``'s) naming an axis ``mesh`` lacks."""
  unknown = list(dict.fromkeys(
      a for e in spec if isinstance(e, (str, tuple))
      for a in _axes(e) if a not in mesh.axis_names))
  if unknown:
    raise ValueError(f"{what}: the PartitionSpec {spec} names axes "
                     f"{unknown} that the mesh does not have (its axes: "
                     f"{tuple(mesh.axis_names)})")


def _entry(axes: Axes):
  """The PartitionSpec entry for ``axes``."""
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  """Where a FORGE step's arrays live on a device mesh.

  Pass it to :func:`forge_jax.make_step` as ``mesh_layout=``: each FORGE
  kernel's optimizer step then runs per shard, with the communication its
  layout needs (none for tensor parallel; a sum over the data axes for data
  parallel; a reduce-scatter for fully-sharded kernels). The step keeps every
  array where it came: jit it with the state donated, and each device updates
  its own shard of every kernel and slot in place.

  Attributes:
    mesh: the ``jax.sharding.Mesh`` the step's arrays are placed on (or an
      ``AbstractMesh``, to lower the step ahead of time without the
      devices). Its axes must be ``AxisType.Auto``
      (``jax.sharding.Mesh(devices, names)``, or ``jax.make_mesh(...,
      axis_types=(AxisType.Auto,) * n)``: ``jax.make_mesh``'s default is
      Explicit axes, which are refused).
    data_axes: the mesh axes the batch's leading dimension is sharded over
      (a name or a tuple of names, ``()``: the batch is replicated). A data
      axis that also shards a kernel makes that kernel fully sharded (FSDP).
    param_specs: the kernels' shardings: a ``PartitionSpec`` or
      ``NamedSharding`` for each leaf of ``variables["params"]``, as a tree
      or a prefix of it (``PartitionSpec()`` alone: every parameter
      replicated); e.g. ``jax.tree.map(lambda a: a.sharding, params)`` of
      unboxed parameters (boxed ones need none: ``None`` reads the boxes).
      ``None``: read from Flax's partitioning boxes (``nn.with_partitioning``,
      ``nn.with_logical_partitioning`` with its rules), and a FORGE kernel
      without a box is refused. The optimizer slots of a kernel must be
      sharded like it (``tx.init`` of placed parameters, run eagerly, keeps
      that; a jitted ``tx.init`` needs its ``out_shardings``).
    bucket_bytes: where a layer's gradient must be reduced (data parallel,
      fully sharded), at most this many bytes of its local gradient are
      formed, reduced and consumed at once: the layer's rows are split into
      the fewest equal chunks of at most this size (never less than one
      row), each updated in place before the next is formed; a rule with
      write-only outputs (Muon) keeps the whole layer as one bucket.
      ``None`` (default): the whole layer is one bucket.
  """

  mesh: Mesh | AbstractMesh
  data_axes: str | tuple[str, ...] = ()
  param_specs: Any = None
  bucket_bytes: int | None = None

  def __post_init__(self):
    if not isinstance(self.mesh, (Mesh, AbstractMesh)):
      raise TypeError(
          f"MeshLayout: mesh must be a jax.sharding.Mesh, got "
          f"{type(self.mesh).__name__}")
    explicit = [n for n, t in zip(self.mesh.axis_names, self.mesh.axis_types)
                if t != AxisType.Auto]
    if explicit:
      raise ValueError(
          f"MeshLayout: mesh axes {explicit} are not AxisType.Auto. FORGE "
          "places its per-shard updates with shard_map on meshes whose axes "
          "XLA partitions (Auto); build the mesh with "
          "jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * n) or "
          "jax.sharding.Mesh(devices, names)")
    given = self.data_axes
    if isinstance(given, P):  # P("data"): its first entry, the batch's
      if any(e is not None for e in tuple(given)[1:]):
        raise TypeError(
            f"MeshLayout: data_axes={given} shards more than the batch's "
            "leading dimension; give the axes that dimension is split "
            "over: a name or a tuple of names (the PartitionSpec's first "
            "entry)")
      given = given[0] if len(given) else None
    data = _axes(given, "MeshLayout: data_axes")
    object.__setattr__(self, "data_axes", data)
    unknown = [a for a in data if a not in self.mesh.axis_names]
    if unknown or len(set(data)) != len(data):
      raise ValueError(
          f"MeshLayout: data_axes={data} must be distinct axes of the mesh "
          f"{tuple(self.mesh.axis_names)}")
    b = self.bucket_bytes
    if b is not None and (isinstance(b, bool) or not isinstance(b, int)
                          or b <= 0):
      raise ValueError(
          f"MeshLayout: bucket_bytes={b!r} must be a positive int (bytes), "
          "or None for one bucket per layer")

  def _size(self, axes: Axes) -> int:
    return math.prod(self.mesh.shape[a] for a in axes)


# --------------------------------------------------------------------------
# Refusing a step whose arrays sit on a mesh it was not told about.


def _mesh_of(leaf):
  """The (abstract) mesh of a traced or concrete array's sharding, or None."""
  try:
    sharding = jax.typeof(leaf).sharding
  except (TypeError, AttributeError):
    return None
  return getattr(sharding, "mesh", None)


def _mesh_size(mesh) -> int:
  if mesh is None or not mesh.axis_names:
    return 1
  return math.prod(mesh.axis_sizes)


def check_placement(mesh_layout: MeshLayout | None, params, batch,
                    opt_state=()) -> None:
  """At trace time: refuses parameters, optimizer state or a batch on a
  multi-device mesh without a ``MeshLayout``, and a ``MeshLayout`` whose
  mesh differs from that of any of them.

  Without a layout the fused kernels would be left to XLA, which cannot
  partition a Pallas call: it would gather every operand and run the whole
  kernel on each device (or refuse it, under Explicit axes).
  """
  for leaf in jax.tree.leaves((params, opt_state, batch)):
    if mesh_layout is not None:
      _check_devices(leaf, mesh_layout.mesh)
    mesh = _mesh_of(leaf)
    if _mesh_size(mesh) <= 1:
      continue
    axes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if mesh_layout is None:
      raise ValueError(
          f"forge_jax.make_step: the step's arrays are placed on a mesh of "
          f"{_mesh_size(mesh)} devices (axes {axes}), but the step was built "
          "without a mesh layout. A FORGE kernel updates its weight inside "
          "a Pallas call, which XLA cannot partition: it would gather every "
          "operand and run the whole update on each device. Build the step "
          "with forge_jax.make_step(..., mesh_layout=forge_jax.MeshLayout("
          "mesh, data_axes=...)) (docs/distributed.md).")
    layout_mesh = mesh_layout.mesh
    want = dict(zip(layout_mesh.axis_names, layout_mesh.axis_sizes))
    if not _same_axes(mesh, layout_mesh):
      raise ValueError(
          f"forge_jax.make_step: an array of the step is on a mesh with axes "
          f"{axes}, but its MeshLayout's mesh has axes {want}"
          f"{_order_note(mesh, layout_mesh)}: place "
          "the parameters, optimizer state and batch on the layout's mesh")


def _check_devices(leaf, layout_mesh) -> None:
  """Refuses a concrete array (an eager step's; a jitted step's arguments
  are traced, and their devices unknown) placed on other devices than the
  layout's mesh, or on its devices in another order: committed to one
  device (``jax.device_put(a, device)``), or sharded over a mesh of the
  same axes whose devices are arranged otherwise. (An uncommitted array,
  e.g. a fresh ``jnp.zeros``, goes where the step puts it.) JAX would
  refuse the step's first ``shard_map`` without naming the array."""
  if (not isinstance(layout_mesh, Mesh) or not isinstance(leaf, jax.Array)
      or isinstance(leaf, jax.core.Tracer)
      or not getattr(leaf, "committed", False)):
    return
  sharding = leaf.sharding
  want = layout_mesh.devices
  if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
    have = sharding.mesh.devices
    if have.shape == want.shape and (have == want).all():
      return
    where = (f"a mesh of the same devices in another arrangement "
             f"({[str(d) for d in have.flat]} where the layout has "
             f"{[str(d) for d in want.flat]})"
             if set(have.flat) == set(want.flat)
             else f"other devices ({sorted(str(d) for d in have.flat)})")
  else:
    devices = sharding.device_set
    if devices == set(want.flat):
      return
    where = f"the devices {sorted(str(d) for d in devices)}"
  raise ValueError(
      f"forge_jax.make_step: an array of shape {leaf.shape} of the step is "
      f"placed on {where}, not on its MeshLayout's mesh: place the "
      "parameters, optimizer state and batch on the layout's mesh "
      "(jax.device_put(x, NamedSharding(mesh_layout.mesh, spec))), or "
      "leave an array uncommitted (not put on one device)")


def _same_axes(a, b) -> bool:
  """Whether meshes ``a`` and ``b`` have the same axes, sizes and order (the
  same names and sizes in another order arrange the devices otherwise)."""
  return ((tuple(a.axis_names), tuple(a.axis_sizes))
          == (tuple(b.axis_names), tuple(b.axis_sizes)))


def _order_note(a, b) -> str:
  """For meshes ``a`` and ``b`` that differ: a note where only their axes'
  order does (the same names and sizes)."""
  if (dict(zip(a.axis_names, a.axis_sizes))
      == dict(zip(b.axis_names, b.axis_sizes))):
    return (" (the same axes in another order: another arrangement of the "
            "devices)")
  return ""


# --------------------------------------------------------------------------
# Each FORGE kernel's sharding: from param_specs or Flax's boxes.


def _is_spec_leaf(x) -> bool:
  return isinstance(x, (P, NamedSharding)) or x is None


class _Undeclared(ValueError):
  """``param_specs`` declares nothing for a path (no entry, or ``None``)."""


def _spec_at(tree, keypath, where: str):
  """The spec of ``param_specs`` at ``keypath`` (a prefix leaf covers its
  subtree); raises if the path is missing."""
  node, path = tree, []
  for k in keypath:
    if _is_spec_leaf(node):
      break
    if not isinstance(node, Mapping):  # (a str, list, tuple...: malformed)
      raise ValueError(
          f"MeshLayout.param_specs at {'/'.join(path) or 'its root'} (a "
          f"prefix of {where}) is a {type(node).__name__}, not a dict, "
          "PartitionSpec or NamedSharding: give a PartitionSpec there "
          "(e.g. PartitionSpec('model') rather than 'model'), or a dict of "
          "them")
    if k.key not in node:
      raise _Undeclared(
          f"MeshLayout.param_specs has no entry for {where}: give a "
          "PartitionSpec for it (or for a prefix of its path)")
    node = node[k.key]
    path.append(str(k.key))
  if node is None:
    raise _Undeclared(
        f"MeshLayout.param_specs gives None for {where}: give its "
        "PartitionSpec (PartitionSpec() for a replicated kernel)")
  if not _is_spec_leaf(node):
    raise ValueError(
        f"MeshLayout.param_specs at {where} is a {type(node).__name__}, not "
        "a PartitionSpec or NamedSharding")
  return node


def _box_at(boxed_params, keypath):
  node = boxed_params
  for k in keypath:
    node = node[k.key]
  return node


def _box_spec(box, where: str) -> P:
  """The mesh PartitionSpec of a Flax partitioning box."""
  if hasattr(box, "rules"):  # nn.LogicallyPartitioned: logical -> mesh axes
    import flax.linen as nn  # pylint: disable=g-import-not-at-top
    rules = box.rules or tuple(nn.get_logical_axis_rules())
    if not rules and any(name is not None for name in box.names):
      raise ValueError(
          f"{where}: its kernel is logically partitioned as {box.names}, but "
          "no logical axis rules are in effect where the step is traced "
          "(Flax would read it as replicated). Trace the step inside "
          "flax.linen.logical_axis_rules(rules), or give MeshLayout("
          "param_specs=...).")
    return P(*nn.logical_to_mesh_axes(box.names, rules))
  if hasattr(box, "get_partition_spec"):
    return box.get_partition_spec()
  raise ValueError(f"{where}: its kernel's box {type(box).__name__} carries "
                   "no partition spec; give MeshLayout.param_specs")


def _known_spec(mesh_layout: MeshLayout, boxed_params, keypath,
                where: str) -> P | None:
  """A parameter's declared spec (``param_specs``, else its Flax box), or
  ``None`` when neither gives one (no box; no entry in ``param_specs``)."""
  if mesh_layout.param_specs is None:
    box = _box_at(boxed_params, keypath)
    if not isinstance(box, flax_meta.AxisMetadata):
      return None
    try:
      return _box_spec(box, where)
    except ValueError:  # a box that gives no mesh spec: XLA places it
      return None
  try:
    return _kernel_spec(mesh_layout, boxed_params, keypath, where)
  except _Undeclared:  # no entry, or None: XLA places it
    return None


def _kernel_spec(mesh_layout: MeshLayout, boxed_params, keypath,
                 where: str) -> P:
  if mesh_layout.param_specs is not None:
    spec = _spec_at(mesh_layout.param_specs, keypath, where)
    if isinstance(spec, NamedSharding):
      if not _same_axes(spec.mesh, mesh_layout.mesh):
        raise ValueError(
            f"MeshLayout.param_specs at {where} is a NamedSharding on "
            "another mesh than the layout's"
            f"{_order_note(spec.mesh, mesh_layout.mesh)}")
      spec = spec.spec
    return spec
  box = _box_at(boxed_params, keypath)
  if not isinstance(box, flax_meta.AxisMetadata):
    raise ValueError(
        f"{where}: its kernel's sharding is unknown (it has no Flax "
        "partitioning box and MeshLayout.param_specs is None). Annotate it "
        "(kernel_init=nn.with_partitioning(init, names)) or give "
        "MeshLayout(..., param_specs=...), e.g. jax.tree.map(lambda a: "
        "a.sharding, variables['params']) of the placed parameters.")
  return _box_spec(box, where)


# --------------------------------------------------------------------------
# The per-kernel plan.


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """How one FORGE kernel ``(in, out)`` is stepped on the mesh.

  ``w_in``/``w_out``: the mesh axes sharding ``W``'s dimensions; of these,
  ``scatter_in``/``scatter_out`` are data axes (fully sharded: the gradient
  is reduce-scattered along that dimension) and the rest are tensor-parallel
  (``x``'s features, ``dy``'s features sharded the same way). ``psum``: the
  data axes that do not shard ``W`` (the gradient is summed over them).
  """

  name: str
  mesh: Mesh | AbstractMesh
  data: Axes
  w_in: Axes
  w_out: Axes
  scatter_in: Axes
  scatter_out: Axes
  psum: Axes
  bucket_bytes: int | None

  @property
  def tp_in(self) -> Axes:
    return tuple(a for a in self.w_in if a not in self.scatter_in)

  @property
  def tp_out(self) -> Axes:
    return tuple(a for a in self.w_out if a not in self.scatter_out)

  @property
  def reduces(self) -> bool:
    """Whether a shard's local gradient is partial (a data axis)."""
    return bool(self.data)

  @property
  def gathered(self) -> bool:
    """Whether XLA gathers the kernel for the layer's matmuls (fully
    sharded along a dimension)."""
    return bool(self.scatter_in or self.scatter_out)

  @property
  def w_spec(self) -> P:
    return P(_entry(self.w_in), _entry(self.w_out))

  def _size(self, axes: Axes) -> int:
    return math.prod(self.mesh.shape[a] for a in axes)

  # ---- the step in the layer's backward ----

  def wgrad_update(self, x, dy, w, slots, hparams, *, rule, config, wgrad,
                   precision):
    """``_paths.wgrad_update`` on the mesh: ``(w_new, slots_new)``, sharded
    as ``W`` (every slot and rule output too)."""
    self._check_tokens(x)
    tokens = (_entry(self.data),) + (None,) * (x.ndim - 2)
    x_spec = P(*tokens, _entry(self.tp_in))
    dy_spec = P(*tokens, _entry(self.tp_out))
    n_new = len(slots) + len(rule.outputs)
    in_specs = (x_spec, dy_spec, self.w_spec, (self.w_spec,) * len(slots), P())
    out_specs = (self.w_spec, (self.w_spec,) * n_new)

    def local(x, dy, w, slots, hparams):
      if not self.reduces:  # tensor parallel: the local tile is complete
        return _paths.wgrad_update(x, dy, w, slots, hparams, rule=rule,
                                   config=config, wgrad=wgrad,
                                   precision=precision)
      return self._reduce_and_update(x, dy, w, slots, hparams, rule=rule,
                                     wgrad=wgrad, precision=precision)

    # check_vma: every output must vary over exactly W's axes; a gradient
    # left partial over a data axis comes back varying over it and the
    # out_specs check refuses it. Pallas' interpreter (no GPU) cannot lower
    # a kernel on device-varying operands under check_vma (its loops and
    # pads lose the varying axes), so there the same per-shard function is
    # checked abstractly (jax.eval_shape: traced, not lowered) and then
    # executed unchecked.
    args = (x, dy, w, tuple(slots), hparams)
    interpreted = wgrad == "fused" and fused_wgrad.default_interpret()
    if interpreted:
      jax.eval_shape(
          jax.shard_map(local, mesh=self.mesh, in_specs=in_specs,
                        out_specs=out_specs, check_vma=True),
          *jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        args))
    w_new, new = jax.shard_map(
        local, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
        check_vma=not interpreted)(*args)
    return w_new, tuple(new)

  def _check_tokens(self, x) -> None:
    if x.ndim < 2:
      raise ValueError(
          f"forge_jax.Dense at {self.name!r}: its input has shape {x.shape}, "
          "no batch dimension; on a mesh a FORGE layer's input must be "
          "(batch, ..., features)")
    n = self._size(self.data)
    if n > 1 and x.shape[0] % n:
      raise ValueError(
          f"forge_jax.Dense at {self.name!r}: its input's leading (batch) "
          f"dimension {x.shape[0]} is not divisible by the {n} devices of "
          f"the data axes {self.data}. On a mesh a FORGE layer's input is "
          "split over the data axes by its leading dimension: make the "
          f"batch a multiple of {n}, or, where this layer reads something "
          "other than the batch (a parameter table, a pooled or reshaped "
          f"tensor), give its input a leading dimension divisible by {n} "
          "or the layer fused=False")

  def _local_gradient(self, x, dy, precision):
    """This shard's partial ``G = x^T dy``, formed as ``jax.grad`` forms it
    (``dy^T x`` over the token axes, transposed; stored in the operands'
    dtype; fp32 operands with fp32 products)."""
    tokens = tuple(range(x.ndim - 1))
    if precision is None and x.dtype == jnp.float32:
      precision = lax.Precision.HIGHEST
    return lax.dot_general(dy, x, ((tokens, tokens), ((), ())),
                           precision=precision,
                           preferred_element_type=x.dtype).T

  def _reduce(self, g):
    """The complete gradient of this device's block of ``W`` from its
    partial ``g``: summed over ``psum``, reduce-scattered over the fully
    sharded axes."""
    if self.psum:
      g = lax.psum(g, self.psum)
    if self.scatter_in:
      g = lax.psum_scatter(g, self.scatter_in, scatter_dimension=0,
                           tiled=True)
    if self.scatter_out:
      g = lax.psum_scatter(g, self.scatter_out, scatter_dimension=1,
                           tiled=True)
    return g

  def _update(self, g, w, slots, hparams, rule, wgrad, layer=None):
    if wgrad == "fused":  # the kernel's epilogue on the reduced G, in place
      return pallas_kernels.stored_g_update(g, w, slots, hparams, rule=rule,
                                            layer=layer)
    return apply_rule(rule, g, w, slots, hparams, layer)

  def _bucket_rows(self, rows: int, row_bytes: int, rule) -> int:
    """Rows of this shard's ``W`` per bucket: the largest divisor of
    ``rows`` whose gradient fits ``bucket_bytes`` (at least one row)."""
    if self.bucket_bytes is None or rule.outputs:
      return rows
    fit = max(1, self.bucket_bytes // max(1, row_bytes))
    return max(d for d in range(1, rows + 1) if rows % d == 0 and d <= fit)

  def _reduce_and_update(self, x, dy, w, slots, hparams, *, rule, wgrad,
                         precision):
    """Data parallel / fully sharded: the partial gradient, reduced bucket
    by bucket, each bucket consumed by the update before the next is
    formed."""
    rows, cols = w.shape
    scatter = self._size(self.scatter_in)
    # Bytes of one row of W's local block in the gradient formed before the
    # reduction: every device of the scatter axes' rows of it, full width.
    row_bytes = (scatter * cols * self._size(self.scatter_out)
                 * jnp.dtype(x.dtype).itemsize)
    per = self._bucket_rows(rows, row_bytes, rule)
    if per == rows:
      g = self._reduce(self._local_gradient(x, dy, precision))
      return self._update(g, w, slots, hparams, rule, wgrad)
    # Several buckets: W's local rows as a stack of n blocks of `per` rows,
    # block i updated in place; x's features viewed the same way (for a
    # fully sharded `in`, block i of every device's rows, so that the
    # reduce-scatter hands this device its own block i).
    n = rows // per
    lead = x.shape[:-1]
    xs = x.reshape(*lead, scatter, n, per)
    w3 = w.reshape(n, per, cols)
    s3 = tuple(s.reshape(n, per, cols) for s in slots)
    for i in range(n):
      xi = xs[..., i, :].reshape(*lead, scatter * per)
      g = self._reduce(self._local_gradient(xi, dy, precision))
      w3, s3 = self._update(g, w3, s3, hparams, rule, wgrad, layer=i)
      # The next bucket's gradient is formed after this bucket's update.
      xs, w3, s3 = lax.optimization_barrier((xs, w3, s3))
    return w3.reshape(rows, cols), tuple(s.reshape(rows, cols) for s in s3)

  # ---- the whole step of a layer ----

  def step_in_backward(self, static, x, dy, w, inputs):
    """``_paths.step_in_backward`` (or, without a spec, the rule's step) on
    the mesh, for a ``forge_jax.Dense`` (``static``: its ``_Static``).

    A layer whose gradient is reduced forms it only after the previous
    such layer of the backward has consumed its own (see :class:`Plans`).
    """
    plans = _context.current().sharding
    if self.reduces:
      x = plans.after_previous_update(x)
    w_new, slots_new = self._step(static, x, dy, w, inputs)
    if self.reduces:
      plans.updated(w_new)
    return w_new, slots_new

  def _step(self, static, x, dy, w, inputs):
    spec = static.spec
    if spec is not None and spec.regime == 3:
      # Deferred: G formed and consumed by XLA code, which XLA partitions
      # (the reduction included) -- no Pallas call.
      return _paths.step_in_backward(spec, static.layout, x, dy, w, inputs,
                                     static.config, static.wgrad,
                                     static.precision)
    rule = static.rule if spec is None else spec.rule
    w1, new = self.wgrad_update(x, dy, w, inputs.slots, inputs.hparams,
                                rule=rule, config=static.config,
                                wgrad=static.wgrad,
                                precision=static.precision)
    if spec is None:
      return w1, new
    # Regime 2's layer pass (LAMB's trust ratio, Muon's Newton-Schulz) is
    # XLA code over the whole kernel: XLA gathers what it reads.
    return _paths._after_epilogue(spec, w1, new, inputs)  # pylint: disable=protected-access


class Plans(dict):
  """A step's plans (layer path -> :class:`KernelPlan`), and the order of
  its gradient reductions.

  The layers whose gradient is reduced (data parallel, fully sharded) are
  chained in the order the backward reaches them: a layer's gradient is
  formed only after the previous one's update has consumed its reduced
  gradient (an ``optimization_barrier`` on the layer input ``x`` with that
  update's output). Without the chain the reductions of different layers
  are independent, and XLA's collective combiner merges them into one
  all-reduce, which holds every layer's gradient at once: the gradient
  pool FORGE removes. The chain does not hold back ``dx``: the next layer's
  input-gradient GEMM may still run while this layer's gradient is reduced.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    # The last reducing layer's new kernel in each trace the backward
    # traced layers in: id(trace) -> (trace, value). (A layer under
    # ``nn.remat`` / ``jax.checkpoint`` traces its backward in the
    # checkpoint's own trace, whose values must not reach another: each
    # trace keeps its own chain. JAX's tracer internals; without them, one
    # chain, as before.)
    self._last = {}

  def after_previous_update(self, x):
    """``x`` made to depend on the previous reducing layer's update traced
    in ``x``'s trace (none: ``x`` as it is)."""
    trace = getattr(x, "_trace", None)
    last = self._last.get(id(trace))
    if last is None or last[0] is not trace:
      return x
    x, _ = lax.optimization_barrier((x, last[1]))
    return x

  def updated(self, w_new) -> None:
    trace = getattr(w_new, "_trace", None)
    self._last[id(trace)] = (trace, w_new)


def plan_layers(mesh_layout: MeshLayout | None, boxed_params, layers,
                kpaths) -> Plans:
  """The plan of each fused FORGE layer.

  Args:
    mesh_layout: the step's layout (``None``: no plans, ``{}``).
    boxed_params: ``variables["params"]`` as the step received it (with
      Flax's partitioning boxes, if any).
    layers: path -> ``_context.LayerInfo`` of the fused layers.
    kpaths: path -> the key path of its kernel in the params.

  Raises:
    ValueError: a layout this module does not support, in plain words.
  """
  plans = Plans()
  if mesh_layout is None:
    return plans
  mesh = mesh_layout.mesh
  data = mesh_layout.data_axes
  for path, info in layers.items():
    name = _context.layer_name(path)
    where = f"forge_jax layer {name!r}"
    if len(info.kernel_shape) != 2:
      raise ValueError(
          f"{where}: its kernel has shape {info.kernel_shape}; on a mesh, "
          "FORGE steps 2-D (in, out) kernels only -- not yet the stacked "
          "kernels of forge_jax.ScannedDenseStack / ScannedBlocks, nor a "
          "forge_jax.DenseGeneral over several axes. Give that layer "
          "fused=False (its kernel then takes optax's update, which XLA "
          "partitions).")
    try:
      spec = _kernel_spec(mesh_layout, boxed_params, kpaths[path], where)
    except _Undeclared as e:  # a FORGE kernel's spec is required
      raise ValueError(str(e)) from None
    entries = tuple(spec) + (None,) * (2 - len(spec))
    if len(entries) != 2:
      raise ValueError(f"{where}: the kernel's PartitionSpec {spec} has more "
                       "entries than the kernel's 2 dimensions")
    w_in, w_out = (_axes(e, f"{where}: its kernel's PartitionSpec {spec}")
                   for e in entries)
    twice = sorted({a for a in w_in + w_out if (w_in + w_out).count(a) > 1})
    if twice:
      raise ValueError(
          f"{where}: its kernel's PartitionSpec {spec} names the mesh axes "
          f"{twice} more than once. A mesh axis shards one dimension of a "
          "kernel (its in or its out dimension), once; give each axis to "
          "one dimension.")
    _check_known_axes(spec, mesh, f"{where}, its kernel")
    for dim, axes, size in (("in", w_in, info.kernel_shape[0]),
                            ("out", w_out, info.kernel_shape[1])):
      n = mesh_layout._size(axes)
      if size % n:
        raise ValueError(
            f"{where}: its kernel's {dim} dimension ({size}) is not "
            f"divisible by the {n} devices of the axes {axes} sharding it")
      if any(a in data for a in axes) and any(a not in data for a in axes):
        raise ValueError(
            f"{where}: its kernel's {dim} dimension is sharded over {axes}, "
            f"both data axes ({[a for a in axes if a in data]}: fully "
            f"sharded) and other axes ({[a for a in axes if a not in data]}: "
            "tensor parallel). One dimension may be sharded over data axes "
            "or over model axes, not both; shard the other dimension over "
            "the second kind.")
    scatter_in = tuple(a for a in w_in if a in data)
    scatter_out = tuple(a for a in w_out if a in data)
    plans[path] = KernelPlan(
        name=name, mesh=mesh, data=data, w_in=w_in, w_out=w_out,
        scatter_in=scatter_in, scatter_out=scatter_out,
        psum=tuple(a for a in data if a not in (*scatter_in, *scatter_out)),
        bucket_bytes=mesh_layout.bucket_bytes)
  return plans


def plan_of(path) -> KernelPlan | None:
  """Inside a step's trace (forward or backward): the plan of the FORGE
  layer at ``path``, or ``None`` when the step has no mesh layout."""
  ctx = _context.current()
  if ctx is None:
    return None
  return ctx.sharding.get(tuple(path))


def gathered_after(path, kernel, anchor):
  """``kernel``, as the FORGE layer at ``path`` reads it for a matmul: where
  the kernel is fully sharded, made to depend on ``anchor`` (the layer's
  input in the forward, its output gradient in the backward) by an
  ``optimization_barrier``; else ``kernel`` itself.

  XLA gathers a fully sharded kernel for the layer's matmuls. Left alone,
  it gathers each kernel once, early (the gather depends on the parameters
  only), and keeps the gathered copy from the forward to the backward (the
  two gathers are the same expression): every device would hold every
  kernel whole, a copy of the model's weights. Tied to the anchor, the
  forward's and the backward's gathers are distinct and each waits for its
  matmul's other operand, so one layer's gathered kernel exists at a time
  (the gather does not overlap the previous layer's compute).
  """
  plan = plan_of(path)
  if plan is None or not plan.gathered:
    return kernel
  kernel, _ = lax.optimization_barrier((kernel, anchor))
  return kernel


def check_layout_argument(mesh_layout) -> None:
  """``make_step``'s ``mesh_layout``: ``None`` or a :class:`MeshLayout`."""
  if mesh_layout is not None and not isinstance(mesh_layout, MeshLayout):
    raise TypeError(
        "make_step: mesh_layout must be a forge_jax.MeshLayout(mesh, "
        f"data_axes=...) or None, got {type(mesh_layout).__name__}")


def keep_shardings(mesh_layout: MeshLayout | None, boxed_params, params,
                   new_params, new_state):
  """The step's new parameters, and each optimizer-state array of a
  parameter's shape, constrained to that parameter's declared sharding
  (``param_specs`` or its Flax box; parameters with neither are left to
  XLA). The FORGE kernels and their slots already come out of their
  ``shard_map`` so; this pins the rest (biases, optax's update), which XLA
  would otherwise be free to re-shard."""
  if mesh_layout is None:
    return new_params, new_state
  mesh = mesh_layout.mesh
  specs = {}
  for kp, _ in jax.tree_util.tree_leaves_with_path(params):
    where = f"parameter {jax.tree_util.keystr(kp)}"
    spec = _known_spec(mesh_layout, boxed_params, kp, where)
    if spec is not None:
      _check_known_axes(spec, mesh, f"forge_jax.make_step: {where}")
      specs[tuple(kp)] = NamedSharding(mesh, spec)
  shapes = {tuple(kp): jnp.shape(a)
            for kp, a in jax.tree_util.tree_leaves_with_path(params)}

  def pin(kp, a):
    sharding = specs.get(tuple(kp))
    if sharding is None or not hasattr(a, "shape") or (
        a.shape != shapes[tuple(kp)]) or len(sharding.spec) > a.ndim:
      return a  # undeclared, another shape, or a prefix spec it cannot take
    return lax.with_sharding_constraint(a, sharding)

  def pin_tree(tree):
    return jax.tree_util.tree_map_with_path(pin, tree)

  params_def = jax.tree.structure(params)
  new_state = _state.map_per_param(new_state, params_def,
                                   lambda i, tree: pin_tree(tree))
  return pin_tree(new_params), new_state
