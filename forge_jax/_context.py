"""The per-step context through which `make_step` talks to FORGE layers.

A training step traces the user's loss function twice, under two contexts:

* ``discover``: every FORGE layer reports its kernel path and that it was
  called (a second call of the same layer is an error -- paper Remark 2 --
  unless the step was built with ``shared="standard"``, which only counts);
* ``fused``: every FORGE layer finds its optimizer slots and this step's
  hyperparameters here and runs its fused backward; the backward records that
  it was traced, which tells the step which kernels received a gradient
  (Remark 1). A layer whose path is in ``standard`` (a shared layer that
  ``shared="standard"`` moved to the standard path) runs as if it had
  ``fused=False``.

Outside `make_step` no context is active and `forge_jax.Dense` is exactly
`flax.linen.Dense`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

Path = tuple[str, ...]


class LayerInputs(NamedTuple):
  """What one FORGE layer's backward reads (and returns the new values of).

  ``slots`` are this kernel's optimizer-state arrays, written back (their
  "cotangents" are their new values): the epilogue's slots (regimes 1-2,
  each of the kernel's shape) or, for a deferred family (regime 3), every
  array the optax state holds for this kernel, of any shape (Adafactor's
  ``v_row``/``v_col``, SM3's per-axis maxima). ``shared`` is read only (its
  cotangents are zeros): state shared by all parameters that the layer's
  update reads -- step counts, Muon's Newton-Schulz coefficients; the global
  optax update advances it.
  """

  slots: tuple[jax.Array, ...]
  hparams: Any  # the kernel's packed fp32 vector (regimes 1-2), or ()
  touched: jax.Array  # fp32 scalar; its "cotangent" is 1 when the bwd ran.
  shared: Any = ()


@dataclasses.dataclass
class LayerInfo:
  path: Path
  kernel_shape: tuple[int, ...]
  kernel_dtype: Any
  calls: int = 0
  # How messages name the layer's kind (e.g. "forge_jax.ScannedDenseStack").
  kind: str = "forge_jax.Dense"
  # Why this layer cannot be fused although it is called once (a kernel
  # read again inside a ScannedBlocks block, or a layer under a transform
  # there); None: nothing known against it.
  unfusable: str | None = None
  # Whether its first call read the step's own kernel at its path (None: not
  # known), to tell a second model's call of the path from this model's.
  own: bool | None = None
  # The stored kernel's shape where it is not kernel_shape (a lifted
  # transform that stacks it: a user's nn.scan); None: the same, or not
  # known.
  stacked: tuple[int, ...] | None = None


@dataclasses.dataclass
class StepContext:
  mode: str  # "discover" | "fused"
  rule: Any = None  # the pallas_kernels.UpdateRule of the step's optimizer
  spec: Any = None  # the step's forge_jax.ForgeSpec (None: `rule`, regime 1)
  # make_step's wgrad: "fused" (the Pallas kernel) or "xla" (XLA's GEMM, then
  # the rule's elementwise update, in the layer's backward).
  wgrad: str = "fused"
  layouts: dict[Path, Any] = dataclasses.field(default_factory=dict)
  inputs: dict[Path, LayerInputs] = dataclasses.field(default_factory=dict)
  layers: dict[Path, LayerInfo] = dataclasses.field(default_factory=dict)
  bwd_traced: set[Path] = dataclasses.field(default_factory=set)
  # make_step's `shared` policy: "error" (a second call raises at discovery)
  # or "standard" (calls are only counted).
  shared: str = "error"
  # Layers that run their standard path in this (fused) trace.
  standard: frozenset[Path] = frozenset()
  # FORGE layers with fused=False that discovery saw (they need no FORGE
  # path, but a step with only such layers is still a FORGE model's step).
  unfused: set[Path] = dataclasses.field(default_factory=set)
  # Discover mode, while loss_fn is traced: the step's own
  # variables["params"] as loss_fn received them (traced values).
  params: Any = None
  # make_step(..., mesh_layout=...): path -> how that fused layer's kernel is
  # stepped on the mesh (a forge_jax._sharding.Plans of KernelPlan, which
  # also orders the layers' gradient reductions); {}: no mesh.
  sharding: dict[Path, Any] = dataclasses.field(default_factory=dict)

  def is_standard(self, path: Path) -> bool:
    return tuple(path) in self.standard


_STATE = threading.local()


def current() -> StepContext | None:
  return getattr(_STATE, "ctx", None)


@contextlib.contextmanager
def _only(attr: str, value, nested: Exception):
  """Sets this thread's ``attr`` to ``value`` for the block; raises
  ``nested`` if it is already set (these contexts do not nest)."""
  if getattr(_STATE, attr, None) is not None:
    raise nested
  setattr(_STATE, attr, value)
  try:
    yield value
  finally:
    setattr(_STATE, attr, None)


def step_context(ctx: StepContext):
  return _only("ctx", ctx, RuntimeError(
      "forge_jax: a FORGE step is already being traced on this thread; "
      "make_step steps cannot be nested"))


@contextlib.contextmanager
def _swapped(attr: str, value):
  """Sets this thread's ``attr`` to ``value`` for the block, then back to
  what it was (these contexts nest)."""
  prev = getattr(_STATE, attr, None)
  setattr(_STATE, attr, value)
  try:
    yield
  finally:
    setattr(_STATE, attr, prev)


def full_params(params):
  """Inside a step: the step's whole parameter tree, for callable masks that
  optax evaluates on trees with the FORGE kernels cut out
  (``transforms._holes_aware``)."""
  return _swapped("full_params", params)


def current_full_params():
  return getattr(_STATE, "full_params", None)


def user_keys(keys):
  """Inside an NNX step: ``keys`` turns the step's string-keyed trees and
  key paths back into the model state's own keys (list indices as ints),
  so that the transform's user callables -- a weight-decay mask,
  Adam-mini's ``block_axes`` -- see what ``nnx.Optimizer.update`` shows
  them (``forge_jax.nnx``'s ``_OriginalKeys``); ``None``: as they are."""
  return _swapped("user_keys", keys)


def call_mask(mask, tree):
  """``mask(tree)``, a user's callable weight-decay mask, given ``tree``
  with the keys its model's state has and answering with the step's."""
  keys = getattr(_STATE, "user_keys", None)
  return mask(tree) if keys is None else keys.call_mask(mask, tree)


def user_path(path):
  """A key path of the step's trees as its model's state spells it."""
  keys = getattr(_STATE, "user_keys", None)
  return path if keys is None else keys.path(path)


def layer_name(path: Path) -> str:
  return "/".join(path) or "<root>"


# The two fixes for a shared FORGE layer (paper Remark 2), named by every
# error that refuses one.
SHARED_FIX = (
    "Give this layer fused=False to keep it on the standard path (an ordinary "
    "gradient and optax update), or build the step with "
    "forge_jax.make_step(..., shared=\"standard\"), which does that "
    "automatically for every shared FORGE layer (and warns which).")


# What a second call of a layer that reads another kernel array than the
# first most likely is, and the fixes that keep the step's own layers fused.
SECOND_MODEL_NOTE = (
    " Its calls read different kernel arrays, though: a second model "
    "applied in loss_fn to its own variables (a teacher: an EMA, mean or "
    "frozen copy of the model, even under stop_gradient) calls its layers "
    "at the same paths, and each call counts. To keep this model's layers "
    "fused (the fixes above move them to the standard path too), apply the "
    "teacher without FORGE layers: the same model built with "
    "flax.linen.Dense layers (or forge_jax.Dense(..., fused=False)), whose "
    "parameter tree is the same; or compute its output outside loss_fn "
    "(outside a step forge_jax.Dense is flax.linen.Dense) and pass it in "
    "the batch; or write the model with flax.linen.Dense and build the step "
    "with make_step(..., convert=True), which leaves a teacher's layers "
    "unfused by itself (docs/shared_weights.md).")


def kernel_at(params, path: Path):
  """The ``kernel`` leaf of ``params`` at the layer's ``path``, or None."""
  node = params
  for key in (*path, "kernel"):
    if not isinstance(node, Mapping) or key not in node:
      return None
    node = node[key]
  return node


def _stacked_kernel_shape(stored, kernel_shape: tuple[int, ...]
                          ) -> tuple[int, ...] | None:
  """The shape of ``stored``, the kernel at a layer's path, where it is
  not ``kernel_shape``, the one a call reads: the layer runs beneath a
  lifted transform that stacks its kernel (a user's ``nn.scan``, whose body
  flax traces more than once, so that the calls counted are traces, not
  uses); None otherwise or where not known."""
  shape = tuple(getattr(stored, "shape", ()))
  return shape if shape and shape != tuple(kernel_shape) else None


def shared_reason(info: "LayerInfo") -> str:
  """Why a layer counted more than once takes the standard path."""
  if info.stacked is not None:
    return (f"inside a lifted transform that stacks its kernel, such as "
            f"nn.scan: stored {info.stacked}, each call reads "
            f"{tuple(info.kernel_shape)}")
  return f"called {info.calls} times"


def register_layer(ctx: StepContext, path: Path,
                   kernel_shape: tuple[int, ...], param_dtype, kind: str,
                   hint: str = "", kernel=None) -> LayerInfo:
  """Discover mode: records one call of the FORGE layer at ``path`` (``kind``
  names it in errors) and refuses a second call in one step unless the step
  allows shared kernels; ``hint`` is appended to that error. ``kernel``, the
  array the call reads (if given): where one of two calls reads the step's
  own kernel at the path and the other another array, the other is most
  likely a second model's (a teacher), and the error says so. (Beneath a
  lifted transform, nn.remat or nn.scan, a call reads the transform's copy,
  neither: no note.)"""
  # The step's own kernel at the path (the very traced value loss_fn
  # received); None where the params are not known or hold none there.
  stored = None if ctx.params is None else kernel_at(ctx.params, path)
  # Whether this call reads it (None: not known).
  own = None if kernel is None or stored is None else stored is kernel
  info = ctx.layers.get(path)
  if info is None:
    info = ctx.layers[path] = LayerInfo(
        path, kernel_shape, param_dtype, kind=kind, own=own,
        stacked=_stacked_kernel_shape(stored, kernel_shape))
  info.calls += 1
  # (A path with no kernel in the step's params is not counted as shared:
  # two calls there are most likely two applies of a model to parts of the
  # variables, whose layer paths are relative to each apply; the step
  # refuses such a path once discovery ends, saying so.)
  if (info.calls > 1 and ctx.shared == "error"
      and (ctx.params is None or stored is not None)):
    other = own is not None and info.own is not None and own != info.own
    what = ("runs " + shared_reason(info) + ", whose body is traced more "
            "than once and reads the stacked kernel at every step of the "
            "loop" if info.stacked is not None
            else "is called more than once in one step")
    raise ValueError(
        f"{kind} at {layer_name(path)!r} {what}. FORGE updates a kernel in "
        "place during its backward, so each kernel may have one consumer "
        "per step (paper Remark 2). "
        + SHARED_FIX + (SECOND_MODEL_NOTE if other else "") + hint)
  return info


# --------------------------------------------------------------------------
# Block taps: how forge_jax.ScannedBlocks runs one block of its stack.


@dataclasses.dataclass
class DenseRecord:
  """What a FORGE layer (``forge_jax.Dense`` or ``forge_jax.DenseGeneral``)
  inside a scanned block reported (``record`` mode): its kernel's per-layer
  shape and dtype, whether it is fused, its tiling and precision, the shape
  and dtype of its tap (its output as the GEMM's ``(*lead, n_out)``), the
  ``(n_in, n_out)`` matrix its kernel is stepped as, and how often it was
  called in one block."""

  kernel_shape: tuple[int, ...]
  param_dtype: Any
  fused: bool
  config: Any
  precision: Any
  out: Any  # jax.ShapeDtypeStruct of the tap: the output, (*lead, n_out)
  # (n_in, n_out): the kernel (*in_dims, *features) as the GEMM's matrix
  # (a fused layer; None for one with fused=False).
  gemm: tuple[int, int] | None = None
  kind: str = "forge_jax.Dense"  # the layer, as errors name it
  calls: int = 0
  unfusable: str | None = None  # why its kernel cannot be fused, if so


@dataclasses.dataclass
class BlockTap:
  """Active while ``forge_jax.ScannedBlocks`` traces one block; every
  FORGE layer inside (``forge_jax.Dense``, ``forge_jax.DenseGeneral``)
  defers to it (``forge_jax.dense.in_block``).

  ``mode``:
    ``"record"``: each layer fills ``records`` (a fused one computes its
      output through the fused op, to be found in the block's jaxpr);
    ``"plain"``: each layer runs as its flax layer (the standard
      ``nn.scan``);
    ``"tap"``: as its flax layer, and each layer in ``forge`` adds its tap
      ``taps[path]`` (zeros of the GEMM's output shape ``(*lead, n_out)``,
      reshaped to the layer's output; its cotangent is the layer's ``dy``)
      to its output and leaves its (promoted) input, flattened to
      ``(*lead, n_in)``, in ``inputs[path]``.
  Paths are relative to the block.
  """

  mode: str
  prefix: Path = ()  # the block's own path in the model (for messages)
  forge: frozenset[Path] = frozenset()
  taps: dict[Path, Any] = dataclasses.field(default_factory=dict)
  inputs: dict[Path, Any] = dataclasses.field(default_factory=dict)
  records: dict[Path, DenseRecord] = dataclasses.field(default_factory=dict)


def current_tap() -> BlockTap | None:
  return getattr(_STATE, "tap", None)


def block_tap(tap: BlockTap):
  return _only("tap", tap, ValueError(
      "forge_jax.ScannedBlocks cannot be nested inside another "
      "ScannedBlocks' block"))
