"""FORGE for Flax NNX: ``nnx.Linear`` whose backward applies the optimizer.

* :class:`Linear` -- a drop-in for ``flax.nnx.Linear`` (same constructor
  arguments, parameters and call), fused inside a FORGE step;
* :func:`convert` -- turns every ``nnx.Linear`` of an existing model into a
  :class:`Linear` in place;
* :class:`Optimizer` -- ``nnx.Optimizer`` that checks, when it is made, that
  its transform can drive FORGE layers (``forge_jax.adamw(...)``, ...);
* :func:`make_step` -- the training step: ``step(model, optimizer, *args)``
  runs the forward and backward, in which each :class:`Linear` updates its
  kernel and optimizer state with the fused kernel, updates every other
  parameter with the optax transform, and writes the new values back into
  ``model`` and ``optimizer``, as ``optimizer.update(model, grads)`` does.

The step is ``forge_jax.make_step`` itself: the model is split into its
trained parameters (``optimizer.wrt``) and the rest, the parameters go in as
a nested dict, and ``loss_fn`` sees the model merged back from the traced
values. Each :class:`Linear` finds its path in that model and runs the same
fused op as ``forge_jax.Dense`` (``forge_jax.dense._fused_linear``).
"""

from __future__ import annotations

from collections.abc import Mapping
import contextlib
import re
import threading
import warnings
from typing import Any, Callable

import jax
from jax import lax
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

import pallas_kernels
from forge_jax import _context
from forge_jax import _inject
from forge_jax import clip as _clip
from forge_jax import step as _step
from forge_jax import transforms
from forge_jax.dense import _Static, _fused_linear, refuse_dtype

__all__ = ["Linear", "Optimizer", "convert", "make_step"]

_KIND = "forge_jax.nnx.Linear"
Path = tuple[str, ...]


# --------------------------------------------------------------------------
# Where each Linear sits in the model a step traces.


class _Found:
  """The model merged inside one trace of the step: its :class:`Linear`
  layers by ``id`` (``(path, trainable)``; the modules are kept alive so
  that ids are not reused)."""

  def __init__(self, model, params: Mapping):
    self.paths: dict[int, tuple[Path, bool]] = {}
    self.modules: list[Any] = []
    for path, node in nnx.iter_graph(model):
      if isinstance(node, Linear):
        p = tuple(str(k) for k in path)
        self.paths[id(node)] = (p, _has_leaf(params, (*p, "kernel")))
        self.modules.append(node)


_FOUND = threading.local()


@contextlib.contextmanager
def _tracing(model, params):
  """While ``loss_fn`` runs on ``model`` (merged from ``params``, the step's
  str-keyed parameter dict): each :class:`Linear` of it can find its path."""
  prev = getattr(_FOUND, "found", None)
  _FOUND.found = _Found(model, params)
  try:
    yield
  finally:
    _FOUND.found = prev


def _aliased_kernels(model, params: Mapping) -> list[tuple[Path, Path]]:
  """``(layer path, kernel path)`` of each fused :class:`Linear` whose
  trained kernel the model's graph reaches first at another path (an
  attribute holding the same Variable, visited before the layer): the
  layer does not find its kernel under its own path and runs unfused."""
  first: dict[int, Path] = {}
  layers = []
  for path, node in nnx.iter_graph(model):
    p = tuple(str(k) for k in path)
    if isinstance(node, nnx.Variable):
      first.setdefault(id(node), p)
    elif isinstance(node, Linear) and node.fused:
      layers.append((p, node))
  # A kernel reached first as another layer's (tied layers) is left to
  # the single-use check, which judges that layer.
  owners = {(*p, "kernel") for p, layer in layers
            if first.get(id(layer.kernel)) == (*p, "kernel")}
  out = []
  for p, layer in layers:
    at = first.get(id(layer.kernel))
    if (at is not None and at != (*p, "kernel") and at not in owners
        and _has_leaf(params, at)):
      out.append((p, at))
  return out


def _has_leaf(tree: Mapping, path: Path) -> bool:
  node = tree
  for k in path:
    if not isinstance(node, Mapping) or k not in node:
      return False
    node = node[k]
  return not isinstance(node, Mapping)


def _layer_name(layer: "Linear") -> str:
  return f"{_KIND}({layer.in_features}, {layer.out_features})"


_NOT_IN_MODEL = (
    "{layer} was called inside a FORGE step but is not a layer of the model "
    "passed to the step. Causes: loss_fn calls a model it closes over instead "
    "of the model it receives as its first argument; the layer is called "
    "under an NNX transform inside loss_fn (nnx.jit, nnx.remat, nnx.vmap, "
    "nnx.scan, nnx.cond), which calls a copy of it; or it belongs to another "
    "model (a frozen teacher). FORGE updates the kernel inside the layer's own "
    "backward, so it must find the layer in the model: call the layers "
    "directly in loss_fn and put nnx.jit around the whole training step, or "
    "give this layer fused=False (it then runs as nnx.Linear).")


class Linear(nnx.Linear):
  """A drop-in for :class:`flax.nnx.Linear` whose backward applies the optimizer.

  Same constructor arguments, defaults, parameters (``kernel``
  ``(in_features, out_features)`` and ``bias`` ``(out_features,)``, both
  ``nnx.Param``, initialised from ``rngs`` exactly as ``nnx.Linear`` does)
  and call. Called outside a step of :func:`make_step` it *is*
  ``nnx.Linear`` (evaluation, ``nnx.grad``). Inside a step its backward
  computes ``dx`` from the pre-update kernel, then updates the kernel and its
  optimizer state with the fused weight-gradient kernel (the same op as
  ``forge_jax.Dense``), so the kernel's gradient never exists in memory. The
  bias takes the ordinary path and is updated exactly as optax would.

  Extra keyword arguments (after ``nnx.Linear``'s, both optional):
    fused: ``False`` keeps this layer on the standard path (an ordinary
      gradient and optax update), e.g. a layer called twice per step, whose
      kernel is read elsewhere, or with a custom ``dot_general``;
      ``make_step(..., shared="standard")`` does this automatically for
      shared layers.
    block_config: tiling of the fused kernel
      (``pallas_kernels.BlockConfig``); ``None``: the backend and tiling the
      kernel chooses for the case (``pallas_kernels.select_backend``).

  Raises (inside a step, for a fused layer):
    ValueError: a custom ``dot_general``, ``promote_dtype``,
      ``preferred_element_type`` or ``out_sharding`` (the fused kernel
      computes the product itself); the layer is not part of the model passed
      to the step (see :func:`make_step`).

  Example:
    >>> import forge_jax.nnx, jax.numpy as jnp
    >>> from flax import nnx
    >>> layer = forge_jax.nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 3))).shape
    (2, 4)
  """

  def __init__(self, *args, fused: bool = True,
               block_config: pallas_kernels.BlockConfig | None = None,
               **kwargs):
    super().__init__(*args, **kwargs)
    if not isinstance(fused, bool):
      raise TypeError(f"{_KIND}: fused must be a bool, got {fused!r}")
    pallas_kernels.fused_wgrad.check_block_config(block_config, _KIND)
    self.fused = fused
    self.block_config = block_config

  def _refuse_custom(self, name: str, out_sharding) -> None:
    custom = [what for what, bad in (
        ("dot_general", self.dot_general is not lax.dot_general),
        ("promote_dtype", self.promote_dtype is not nnx_dtypes.promote_dtype),
        ("preferred_element_type", self.preferred_element_type is not None),
        ("out_sharding", out_sharding is not None)) if bad]
    if custom:
      raise ValueError(
          f"{_KIND} at {name!r}: a custom {' and '.join(custom)} cannot be "
          "fused (the fused kernel computes the product itself); give this "
          "layer fused=False (or set layer.fused = False) to keep it on the "
          "standard path")

  def __call__(self, inputs, out_sharding=None):
    """Applies the layer: ``inputs @ kernel + bias`` over the last axis.

    Args:
      inputs: the input array.
      out_sharding: as for ``nnx.Linear`` (refused inside a step for a
        fused layer).

    Returns:
      The output, ``inputs.shape[:-1] + (out_features,)``.
    """
    ctx = _context.current()
    if ctx is None:  # outside a FORGE step: nnx.Linear
      return super().__call__(inputs, out_sharding)
    found = getattr(_FOUND, "found", None)
    entry = None if found is None else found.paths.get(id(self))
    if entry is None:
      if not self.fused:
        return super().__call__(inputs, out_sharding)
      raise ValueError(_NOT_IN_MODEL.format(layer=_layer_name(self)))
    path, trainable = entry
    if not self.fused or not trainable or ctx.is_standard(path):
      # fused=False; a kernel the optimizer does not train (outside
      # `wrt`, or a Variable shared with an earlier layer: the single-use
      # check then judges its owner); or moved by shared="standard".
      if ctx.mode == "discover":
        ctx.unfused.add(path)
      return super().__call__(inputs, out_sharding)
    name = _context.layer_name(path)
    self._refuse_custom(name, out_sharding)
    refuse_dtype(_KIND, name, self.kernel[...].dtype, self.dtype, inputs,
                 ctx.spec)
    if ctx.mode == "discover":
      _context.register_layer(
          ctx, path, (self.in_features, self.out_features),
          self.kernel[...].dtype, _KIND, hint=(
              " (In NNX this is one Linear instance called twice, or "
              "referenced from two places of the model and called from "
              "both.)"))
      return super().__call__(inputs, out_sharding)
    if path not in ctx.inputs:
      raise RuntimeError(
          f"{_KIND} at {name!r} was not seen when the step discovered its "
          "FORGE layers: loss_fn must call the same layers on every trace")
    kernel = self.kernel[...]  # the step's traced parameter, uncast
    bias = self.bias[...] if self.bias is not None else None
    dtype = nnx_dtypes.canonicalize_dtype(inputs, kernel, bias,
                                          dtype=self.dtype)
    # The kernel is cast inside the fused op, so that op is its only reader.
    inputs, bias = nnx_dtypes.promote_dtype((inputs, bias), dtype=dtype)
    static = _Static(path=path, rule=ctx.rule, dtype=dtype,
                     precision=self.precision, config=self.block_config,
                     spec=ctx.spec, layout=ctx.layouts.get(path),
                     wgrad=ctx.wgrad, kind=_KIND)
    y = _fused_linear(static, inputs, kernel, ctx.inputs[path])
    if bias is not None:
      y += bias.reshape((1,) * (y.ndim - 1) + (-1,))
    return y


def convert(model, *, block_config: pallas_kernels.BlockConfig | None = None):
  """Turns every ``nnx.Linear`` of ``model`` into a :class:`Linear`, in place.

  The layers keep their parameters (the same ``nnx.Param`` objects, so an
  optimizer made before or after sees the same state) and attributes; only
  their class changes, to :class:`Linear` with ``fused=True`` and
  ``block_config``. Subclasses of ``nnx.Linear`` other than :class:`Linear`,
  ``nnx.LinearGeneral`` and ``nnx.Einsum`` are left as they are (they run
  on the standard path).

  Args:
    model: an NNX module (or any graph of them).
    block_config: the tiling every converted layer gets (``None``: chosen
      per GPU and shape).

  Returns:
    ``model`` itself.
  """
  pallas_kernels.fused_wgrad.check_block_config(block_config, _KIND)
  for _, node in list(nnx.iter_graph(model)):
    if type(node) is nnx.Linear:  # noqa: E721 -- exactly nnx.Linear
      node.__class__ = Linear
      node.fused = True
      node.block_config = block_config
  return model


# --------------------------------------------------------------------------
# The optimizer and the step.


def _check_transform(tx, who: str) -> None:
  """Refuses a transform FORGE cannot drive, or a tree-shaped weight-decay
  mask (the step's parameters are nested dicts with string keys, which a
  mask tree written for ``nnx.State`` does not match), also in the
  optimizer of a clipping chain."""
  try:
    _step._check_step_arguments(tx, "error", False, "fused")
  except TypeError as e:  # worded for linen's make_step: named as ``who``
    message = str(e)
    if message.startswith("make_step needs"):
      message = who + message.removeprefix("make_step")
    else:
      message = f"{who}: {message.removeprefix('make_step: ')}"
    raise TypeError(message) from None
  clipping = _clip.recognise(tx)  # optax.chain(clip_by_global_norm, tx)
  if clipping is not None:
    tx = clipping.member
  spec = getattr(tx, "spec", None)
  injected = _inject.recognise(tx)
  masks = ([getattr(spec, "weight_decay_mask", None)] if injected is None
           else [injected.other_hps.get(k)
                 for k in ("mask", "weight_decay_mask")])
  if any(m is not None and not callable(m) and not isinstance(m, bool)
         for m in masks):
    raise TypeError(
        f"{who}: the optimizer's weight-decay mask is a tree; forge_jax.nnx "
        "needs a callable mask (evaluated on the parameters, e.g. "
        "mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)) or a bool, "
        "because the FORGE step passes the parameters to optax as nested "
        "dicts with string keys, which a tree written for nnx.State does not "
        "match")


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` for a FORGE transform, checked when it is made.

  The same arguments, attributes (``step``, ``tx``, ``opt_state``, ``wrt``)
  and state as ``nnx.Optimizer(model, tx, wrt=...)``, so a checkpoint of
  either restores into the other. ``tx`` must be a forge_jax transform
  (``forge_jax.adamw(...)``, ``forge_jax.sgd(...)``, ...; the registry of
  families is ``forge_jax.classify``) or ``optax.inject_hyperparams`` of a
  forge_jax factory. Train with :func:`make_step`; ``update(model, grads)``
  is ``nnx.Optimizer``'s (the standard path: ordinary gradients, nothing
  fused).

  Raises:
    TypeError: ``tx`` is not a transform forge_jax can drive (e.g. an optax
      transform or chain: the message says why), or its weight-decay mask is
      a tree rather than a callable.
  """

  def __init__(self, model, tx, *, wrt, **kwargs):
    _check_transform(tx, "forge_jax.nnx.Optimizer")
    super().__init__(model, tx, wrt=wrt, **kwargs)


# Phrases in the messages of forge_jax.make_step (shared with the Flax linen
# layers) and what they are for an NNX model (tests/test_nnx.py checks that
# the messages still hold each phrase).
_NO_MESH_LAYOUT = (
    "forge_jax.nnx.make_step takes no mesh layout: keep the model and the "
    "batch on one device, or train a Flax linen model with "
    "forge_jax.make_step(..., mesh_layout=forge_jax.MeshLayout(...)) "
    "(docs/distributed.md).")
_NO_LAYER_CALLED = (
    "no forge_jax.Dense layer (or ScannedDenseStack) was called by loss_fn")
_RENAMES = (
    ("apply remat per module with flax.linen.remat, supported, and jit the "
     "whole step instead",
     "a jax.checkpoint made inside loss_fn or the model's __call__ is "
     "supported, nnx.remat is not (it calls copies of the layers); put "
     "nnx.jit around the whole step instead"),
    # Parallelism: NNX steps take no mesh layout.
    ("Build the step with forge_jax.make_step(..., mesh_layout=forge_jax."
     "MeshLayout(mesh, data_axes=...)) (docs/distributed.md).",
     _NO_MESH_LAYOUT),
    ("For data, tensor or fully-sharded parallelism, place the arrays on a "
     "mesh (jax.device_put with a NamedSharding), build the step with "
     "make_step(..., mesh_layout=forge_jax.MeshLayout(mesh, data_axes=...)) "
     "and jit it: each kernel's update then reads its complete gradient "
     "(docs/distributed.md).", _NO_MESH_LAYOUT),
    # Scanned stacks are linen modules.
    ("(For scanned blocks use forge_jax.ScannedBlocks, or "
     "forge_jax.ScannedDenseStack for a stack of Dense layers.)",
     "(Scanned stacks of layers are supported in Flax linen only: "
     "forge_jax.ScannedBlocks, docs/scanned.md.)"),
    ("jax.vmap / nn.vmap over the model", "jax.vmap / nnx.vmap over the model"),
    ("or the parameters transformed before model.apply (e.g. cast to "
     "another dtype: give the model param_dtype/dtype instead)",
     "or the kernel transformed before the layer reads it (e.g. cast to "
     "another dtype: give the layer param_dtype/dtype instead)"),
    ("forge_jax.make_step", "forge_jax.nnx.make_step"),
    ("forge_jax.Dense", _KIND),
)


_RENAMED = re.compile("|".join(re.escape(old) for old, _ in _RENAMES))


def _in_nnx_terms(e: Exception) -> Exception:
  """``e``, raised by ``forge_jax.make_step`` for this step, with its message
  in NNX terms (the same exception if nothing changes)."""
  msg = str(e)
  if msg.startswith(_NO_LAYER_CALLED):
    msg = (
        "forge_jax.nnx.make_step: loss_fn called none of the model's "
        f"{_KIND} layers. It must call the model it receives as its first "
        "argument. A function inside loss_fn that was jitted (jax.jit) and "
        "already traced at these shapes is replayed from JAX's cache, and the "
        "layers in it are never called: call them un-jitted and put nnx.jit "
        "around the whole step.")
  # One pass: a phrase put in is not renamed again.
  msg = _RENAMED.sub(lambda m: dict(_RENAMES)[m.group(0)], msg)
  if msg == str(e):
    return e
  return type(e)(msg).with_traceback(e.__traceback__)


def _refuse_shared_variables(model, args_with_paths) -> None:
  """Refuses NNX objects among the step's other arguments (``(key path,
  leaf)`` of ``(args, kwargs)``) that hold a Variable of the model or of
  another such argument: each is passed apart (as its own state), so its
  copy of the Variable would be written back over the model's update
  (nnx.value_and_grad refuses such aliasing too)."""
  found = [(kp, leaf) for kp, leaf in args_with_paths
           if nnx.graph.is_graph_node(leaf)]
  if not found:
    return

  def variables(node) -> dict[int, str]:
    return {id(v): "/".join(map(str, path)) or "(itself)"
            for path, v in nnx.iter_graph(node)
            if isinstance(v, nnx.Variable)}

  def argument(kp) -> str:
    head, index, rest = kp[0].idx, kp[1], kp[2:]
    name = (f"loss_fn's argument {index.idx + 2} (the model is its first)"
            if head == 0 else f"keyword argument {index.key!r}")
    return name + (f" at {jax.tree_util.keystr(rest)}" if rest else "")

  owners = {k: ("the model", path) for k, path in variables(model).items()}
  for kp, node in found:
    mine = variables(node)
    for k, path in mine.items():
      if k in owners:
        other, other_path = owners[k]
        raise ValueError(
            f"forge_jax.nnx.make_step: {argument(kp)}, a "
            f"{type(node).__name__}, holds the Variable at {path!r} that "
            f"{other} holds at {other_path!r}. The step passes each NNX "
            "object among loss_fn's other arguments apart from the model "
            "(as its own state) and writes its new state back after the "
            "model's, so its copy would overwrite the shared Variable's "
            "update (nnx.value_and_grad refuses such aliasing too). Reach "
            "the shared part through the model only, or give the argument "
            "its own copy (nnx.clone).")
    owners.update({k: (argument(kp), path) for k, path in mine.items()})


def _str_keys(tree):
  """``tree`` with each mapping (an ``nnx.State`` level, a dict) a plain
  dict whose keys are strings (list indices become ``"0"``, ``"1"``, ...)."""

  def convert_mapping(node):
    if not isinstance(node, Mapping):
      return node
    out = {}
    for k, v in node.items():
      if str(k) in out:
        raise ValueError(
            f"forge_jax.nnx: keys {k!r} and {str(k)!r} at one level of the "
            "model's state cannot both be kept as strings")
      out[str(k)] = _str_keys(v)  # a state inside a value (optax's states)
    return out

  return jax.tree.map(convert_mapping, tree,
                      is_leaf=lambda x: isinstance(x, Mapping))


class _OriginalKeys:
  """The model state's own keys for the step's string-keyed trees
  (:func:`_str_keys`): what the transform's user callables see inside
  the step -- a weight-decay mask, Adam-mini's ``block_axes`` -- as
  ``nnx.Optimizer.update`` shows them (list indices as ints), their
  answers keyed as the step's trees again."""

  def __init__(self, state):
    self.levels: dict[tuple[str, ...], dict[str, Any]] = {}

    def walk(node, at):
      if isinstance(node, Mapping):
        level = self.levels.setdefault(at, {})
        for k, v in node.items():
          level[str(k)] = k
          walk(v, (*at, str(k)))

    walk(state, ())

  def tree(self, tree, at=()):
    """``tree`` (a step's tree, or a part of one from its root) with each
    mapping an ``nnx.State`` keyed as the model's state is."""
    if not isinstance(tree, Mapping):
      return tree
    level = self.levels.get(at, {})
    return nnx.State({level.get(k, k): self.tree(v, (*at, k))
                      for k, v in tree.items()})

  def call_mask(self, mask, tree):
    return _str_keys(mask(self.tree(tree)))

  def path(self, path):
    """A key path of the step's trees, its dict keys the state's own."""
    out, at = [], ()
    for entry in path:
      key = getattr(entry, "key", None)
      if isinstance(entry, jax.tree_util.DictKey) and isinstance(key, str):
        entry = jax.tree_util.DictKey(self.levels.get(at, {}).get(key, key))
        at = (*at, key)
      out.append(entry)
    return tuple(out)


def _state_mismatch(keys, want) -> str:
  """Why an optimizer's state cannot be this model's: the keys of one of
  its levels (``keys``) are not the transform's ``init`` ones (``want``)."""
  missing = [k for k in want if k not in keys]
  extra = [k for k in keys if k not in want]
  said = []
  if missing:
    said.append(f"it has no entry for {missing[:4]}")
  if extra:
    said.append(f"it has entries the model's trained parameters lack, "
                f"{extra[:4]}")
  return (
      "forge_jax.nnx.make_step: the optimizer's state is not laid out as "
      f"the model's trained parameters: {'; '.join(said)}. Was the "
      "nnx.Optimizer made for this model (nnx.Optimizer(model, tx, "
      "wrt=...)) -- not for one of its submodules, nor for a model that "
      "holds it?")


def _conform(state, like):
  """``state`` (an optimizer state as ``nnx.Optimizer`` keeps it, whose
  lists may have come back from an update as int-keyed ``nnx.State``
  levels) laid out as ``like`` (the transform's ``init`` on the
  string-keyed parameters): its mappings string-keyed dicts, its lists and
  tuples (SM3's accumulators per axis, optax's named tuples, a quantized
  moment's pair, which NNX may hold as a state keyed by field) again lists
  and tuples, so that the transform indexes them as it built them."""
  if isinstance(like, Mapping):
    by_str = {str(k): v for k, v in state.items()}
    if by_str.keys() != like.keys():
      raise ValueError(_state_mismatch(by_str, like))
    return {k: _conform(by_str[k], v) for k, v in like.items()}
  if isinstance(like, (list, tuple)):
    if isinstance(state, Mapping):  # by index, or a named tuple's fields
      by_str = {str(k): v for k, v in state.items()}
      fields = getattr(like, "_fields", ())
      keys = (fields if fields and all(f in by_str for f in fields)
              else [str(i) for i in range(len(like))])
      items = [by_str[k] for k in keys]
    else:
      items = list(state)
    items = [_conform(a, b) for a, b in zip(items, like, strict=True)]
    if hasattr(like, "_fields"):
      return type(like)(*items)
    return type(like)(items)
  children, treedef = jax.tree_util.tree_flatten(
      like, is_leaf=lambda node: node is not like)
  if treedef.num_nodes == 1 and children and children[0] is like:
    return state  # a leaf
  own = jax.tree_util.tree_flatten(state, is_leaf=lambda node: node
                                   is not state)[0]
  return treedef.unflatten([_conform(a, b)
                            for a, b in zip(own, children, strict=True)])


def _key(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _like(template, new):
  """``template`` (a tree of arrays holding ``nnx.State`` levels) with the
  leaves of ``new`` (the same tree with string-keyed dicts, from
  :func:`_str_keys`) at the same places."""
  by_path = {tuple(_key(k) for k in kp): leaf
             for kp, leaf in jax.tree_util.tree_flatten_with_path(new)[0]}
  return jax.tree_util.tree_map_with_path(
      lambda kp, _: by_path[tuple(_key(k) for k in kp)], template)


def _forge_layers(model) -> tuple[list[str], list[str]]:
  """Names of the model's :class:`Linear` layers and of its other
  ``nnx.Linear`` layers."""
  forge, plain = [], []
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Linear):
      name = "/".join(str(k) for k in path) or "<root>"
      (forge if isinstance(node, Linear) else plain).append(name)
  return forge, plain


def _check_step_call(model, optimizer) -> None:
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError(
        "forge_jax.nnx.make_step: the step is step(model, optimizer, *args);"
        f" its second argument must be an nnx.Optimizer (forge_jax.nnx."
        f"Optimizer) made for this model, got {type(optimizer).__name__}")
  if not isinstance(model, nnx.Module):
    raise TypeError(
        "forge_jax.nnx.make_step: the step is step(model, optimizer, *args);"
        f" its first argument must be an NNX module, got "
        f"{type(model).__name__}")
  forge, plain = _forge_layers(model)
  if not forge:
    if plain:
      raise ValueError(
          "forge_jax.nnx.make_step: the model has no forge_jax.nnx.Linear "
          f"layer; its nnx.Linear layers ({', '.join(map(repr, plain))}) are "
          "ordinary layers. Build them as forge_jax.nnx.Linear (same "
          "arguments), or call forge_jax.nnx.convert(model) once before "
          "training.")
    raise ValueError(
        "forge_jax.nnx.make_step: the model has no forge_jax.nnx.Linear "
        "layer, so FORGE has nothing to fuse; train it with nnx.Optimizer and "
        "an optax transform instead.")
  _check_transform(optimizer.tx, "forge_jax.nnx.make_step")


def make_step(
    loss_fn: Callable[..., Any],
    *,
    shared: str = "error",
    has_aux: bool = False,
    wgrad: str = "fused",
) -> Callable[..., Any]:
  """Builds ``step(model, optimizer, *args, **kwargs) -> loss``.

  The step replaces ``nnx.value_and_grad(loss_fn)(model, *args)`` followed
  by ``optimizer.update(model, grads)``: it computes the loss, runs the
  backward, in which each :class:`Linear` updates its kernel and its
  optimizer state with the fused kernel (``G = x^T dy`` never stored), and
  updates every other trained parameter with ``optimizer.tx`` exactly as
  ``optimizer.update`` would. It then writes the new parameters, the
  model's other state that ``loss_fn`` changed (batch statistics, RNG
  counts) and the new optimizer state back into ``model`` and ``optimizer``
  and advances ``optimizer.step``, as ``nnx.Optimizer.update`` does. Put
  ``nnx.jit`` around it (around a training step that calls it)::

    step = forge_jax.nnx.make_step(loss_fn)

    @nnx.jit
    def train_step(model, optimizer, x, y):
      return step(model, optimizer, x, y)

  Args:
    loss_fn: ``loss_fn(model, *args, **kwargs)`` returns a scalar loss (or
      ``(loss, aux)`` with ``has_aux``) and calls the model it receives
      (not one it closes over). The :class:`Linear` layers must be called
      directly, not under an NNX transform inside ``loss_fn`` (``nnx.remat``,
      ``nnx.vmap``, ``nnx.scan``, ``nnx.cond``): those call copies of the
      layers.
    shared: a :class:`Linear` called more than once per step, or whose kernel
      is also read by another op (a tied head): ``"error"`` (default) refuses
      it naming the layer; ``"standard"`` moves it to the standard path for
      the step (an ordinary gradient and optax update) and warns which
      (``forge_jax.SharedWeightsWarning``).
    has_aux: ``loss_fn`` returns ``(loss, aux)`` and the step returns it.
    wgrad: ``"fused"`` (default): the fused Pallas kernel forms each
      layer's ``G`` in registers; ``"xla"``: XLA's GEMM forms it inside the
      layer's backward, for that layer's update only
      (``forge_jax.make_step``'s ``wgrad``).

  Returns:
    ``step(model, optimizer, *args, **kwargs)``, returning the loss (or
    ``(loss, aux)``) and updating ``model`` and ``optimizer`` in place.
    ``step.standard_layers`` lists the fused :class:`Linear` layers (by path,
    e.g. ``"layers/0/attn/q"``) that the last trace moved to the standard
    path: shared ones under ``shared="standard"``, and those whose kernel
    the model's graph reaches first under another attribute (with a
    ``forge_jax.SharedWeightsWarning``). Layers built with ``fused=False``
    are not listed.

  Raises:
    ValueError: ``shared`` or ``wgrad`` is not one of the choices above.
    TypeError: ``has_aux`` is not a bool.

    When the step runs (traced): ``TypeError`` if ``optimizer`` is not an
    ``nnx.Optimizer`` or its transform is not a forge_jax one; ``ValueError``
    if the model has no :class:`Linear` (its ``nnx.Linear`` layers not
    converted), a :class:`Linear` is shared (with ``shared="error"``), is not
    part of the model passed to the step, or has a custom ``dot_general``,
    or an NNX object among ``args`` / ``kwargs`` holds a Variable of the
    model or of another such argument.
  """
  # The step's options are checked now, against a valid transform (the
  # optimizer, and with it the transform, comes with each call).
  _step._check_step_arguments(transforms.sgd(0.0), shared, has_aux, wgrad)
  standard_layers: list[str] = []

  def step(model, optimizer, *args, **kwargs):
    _check_step_call(model, optimizer)
    graph = getattr(optimizer, "graph", None)
    graphdef, trained, rest = nnx.split(model, optimizer.wrt, ..., graph=graph)
    trained, rest = nnx.as_pure(trained), nnx.as_pure(rest)
    opt_state = nnx.as_pure(optimizer.opt_state)
    # NNX objects among the other arguments (an nnx.Rngs, a frozen teacher
    # module): passed as their state, merged inside the loss, their new
    # state (RNG counts, statistics) written back, as nnx.value_and_grad
    # does for arguments it does not differentiate.
    with_paths, args_def = jax.tree_util.tree_flatten_with_path(
        (args, kwargs), is_leaf=nnx.graph.is_graph_node)
    _refuse_shared_variables(model, with_paths)
    leaves = [leaf for _, leaf in with_paths]
    nodes = {i: nnx.split(leaf) for i, leaf in enumerate(leaves)
             if nnx.graph.is_graph_node(leaf)}
    plain = [None if i in nodes else leaf for i, leaf in enumerate(leaves)]
    node_states = {i: nnx.as_pure(st) for i, (_, st) in nodes.items()}
    nodes = {i: graphdef_i for i, (graphdef_i, _) in nodes.items()}

    def forge_loss(variables, batch):
      params = variables["params"]
      merged = nnx.merge(graphdef, _like(trained, params), rest)
      plain_leaves, states = batch
      arg_nodes = {i: nnx.merge(nodes[i], st) for i, st in states.items()}
      call_args, call_kwargs = jax.tree.unflatten(
          args_def, [arg_nodes[i] if i in arg_nodes else leaf
                     for i, leaf in enumerate(plain_leaves)])
      # (The state's own keys are for the step's transform; a transform
      # loss_fn runs on trees of its own sees them as they are.)
      with _tracing(merged, params), _context.user_keys(None):
        out = loss_fn(merged, *call_args, **call_kwargs)
      loss, aux = out if has_aux else (out, None)
      # The model's other state as loss_fn left it (batch statistics, RNG
      # counts), and the argument objects'; the trained parameters come
      # back from the step.
      return loss, (aux, nnx.split(merged, optimizer.wrt, ..., graph=graph)[2],
                    {i: nnx.as_pure(nnx.split(n)[1])
                     for i, n in arg_nodes.items()})

    str_trained = _str_keys(trained)
    inner = _step.make_step(forge_loss, optimizer.tx, shared=shared,
                            has_aux=True, wgrad=wgrad)
    try:
      with _context.user_keys(_OriginalKeys(trained)):
        (loss, (aux, new_rest, new_nodes)), new_vars, new_state = inner(
            {"params": str_trained}, _conform(
                opt_state, jax.eval_shape(optimizer.tx.init, str_trained)),
            (plain, node_states))
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
      raise _in_nnx_terms(e) from None
    aliased = _aliased_kernels(model, str_trained)
    if aliased:
      warnings.warn(_step.SharedWeightsWarning(
          "forge_jax.nnx.make_step: the kernel of " + "; of ".join(
              f"{_KIND} at {'/'.join(p)!r} is reached first at "
              f"{'/'.join(at)!r}" for p, at in aliased)
          + " in the model's graph (another attribute holds the same "
          "Variable), where the step finds it, so the layer takes the "
          "standard path (ordinary gradient and optax update). Remove the "
          "other reference to fuse it, or give the layer fused=False."),
          stacklevel=2)
    standard_layers[:] = list(inner.standard_layers) + [
        "/".join(p) for p, _ in aliased]
    nnx.update(model, _like(trained, new_vars["params"]), new_rest)
    for i, new in new_nodes.items():
      nnx.update(leaves[i], new)
    nnx.update(optimizer.opt_state,
               nnx.state(_like(opt_state, new_state), graph=graph))
    optimizer.step[...] += 1
    return (loss, aux) if has_aux else loss

  step.standard_layers = standard_layers
  return step
