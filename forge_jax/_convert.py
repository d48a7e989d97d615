"""``make_step(..., convert=True)``: an unmodified Flax model's ``nn.Dense``
and ``nn.DenseGeneral`` layers run as ``forge_jax.Dense`` and
``forge_jax.DenseGeneral``.

While the step is traced, a Flax method interceptor
(``flax.linen.intercept_methods``) catches each call of ``nn.Dense``'s or
``nn.DenseGeneral``'s own ``__call__`` (an instance of the class, of a
subclass that does not override ``__call__``, or a subclass's
``super().__call__``), and runs the FORGE layer's body in that module's own
scope, in its own call: the same parameters, by the same names, shapes and
boxes, so the parameter tree is the unconverted model's. A layer FORGE cannot
fuse runs its own ``__call__`` unchanged (the standard path) and is reported
with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Mapping
import warnings

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax.linen import dtypes as flax_dtypes

from forge_jax import _context
from forge_jax import dense as _dense
from forge_jax._usage import KernelNotReadError
from forge_jax.dense import Dense, dtype_reason, linen_kernel_dtype
from forge_jax.dense_general import DenseGeneral


class ConvertSkipWarning(UserWarning):
  """``make_step(..., convert=True)`` left some ``nn.Dense`` /
  ``nn.DenseGeneral`` layers on the standard path; the message (and the
  step's ``skipped`` dict) says which and why. Emitted once per trace of the
  step; filter it, or escalate it to an error, like any warning."""


def _body(method):
  """A Flax module method without Flax's wrapper (its ``__wrapped__``)."""
  body = getattr(method, "__wrapped__", None)
  if body is None:
    raise NotImplementedError(
        "forge_jax.make_step(..., convert=True) needs Flax module methods "
        "that expose __wrapped__ (flax.linen's method wrapper); this Flax "
        "version does not: replace nn.Dense / nn.DenseGeneral with "
        "forge_jax.Dense / forge_jax.DenseGeneral in the model instead")
  return body


@functools.cache
def _targets() -> dict:
  """What a call runs (the method's own body, by identity) -> (the FORGE
  class that replaces it, that class's body, the layer's name in reports)."""
  return {
      _body(nn.Dense.__call__): (Dense, _body(Dense.__call__), "nn.Dense"),
      _body(nn.DenseGeneral.__call__): (DenseGeneral,
                                        _body(DenseGeneral.__call__),
                                        "nn.DenseGeneral"),
  }


@dataclasses.dataclass
class Report:
  """What the conversion did while the step was traced.

  ``converted``: layer name -> ``"nn.Dense"`` / ``"nn.DenseGeneral"``, for
  the layers that ran as FORGE layers; ``skipped``: layer name -> why the
  layer stayed on the standard path, in plain words.
  """

  converted: dict[str, str] = dataclasses.field(default_factory=dict)
  skipped: dict[str, str] = dataclasses.field(default_factory=dict)

  def publish(self, converted: list[str], skipped: dict[str, str],
              standard: list[str] = ()) -> None:
    """Sets the step's ``converted`` list and ``skipped`` dict (in place, so
    that ``jax.jit(step)``'s copies of the attributes see them) and warns a
    :class:`ConvertSkipWarning` naming the skipped layers, at the caller of
    the step.

    ``standard`` names the converted layers the step then moved to the
    standard path (``step.standard_layers``: shared or frozen ones): they did
    not run fused, so they are not listed as converted. A layer of a second
    model skipped at the name of one of the step's layers that was converted
    (an EMA teacher of the same architecture) is not reported: that name's
    kernel, the step's, was converted.
    """
    ran = sorted(set(self.converted) - set(standard))
    left = {name: why for name, why in sorted(self.skipped.items())
            if name not in self.converted}
    converted[:] = ran
    skipped.clear()
    skipped.update(left)
    if left:
      warnings.warn(ConvertSkipWarning(
          f"forge_jax.make_step(..., convert=True) left "
          f"{len(left)} layer(s) on the standard path (an ordinary "
          "gradient and optax update, exactly as without FORGE); the "
          f"{len(ran)} other(s) run as FORGE layers:\n" + "\n".join(
              f"  {name}: {why}" for name, why in left.items())
          + "\n(The step's .skipped dict holds these reasons.)"), stacklevel=3)


_ACTIVE = threading.local()


def active_report() -> Report | None:
  """The report of the conversion active on this thread, if any."""
  return getattr(_ACTIVE, "report", None)


def no_layers_note() -> str:
  """A sentence for the step's "no FORGE layer" error: what the conversion
  found, when one is active (empty otherwise)."""
  report = active_report()
  if report is None:
    return ""
  if not report.skipped:
    return (". make_step(..., convert=True) found no nn.Dense or "
            "nn.DenseGeneral layer in loss_fn either.")
  return (". make_step(..., convert=True) found only layers it cannot fuse: "
          + "; ".join(f"{n!r} ({why})" for n, why in
                      sorted(report.skipped.items())) + ".")


def check_flag(convert) -> None:
  """Refuses a ``convert`` argument that is not a bool."""
  if not isinstance(convert, bool):
    raise TypeError(f"make_step: convert must be a bool, got {convert!r}")


def _as_tuple(v) -> tuple:
  return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _dtype_reason(module, inputs) -> str | None:
  """Why the layer's dtypes keep it off the fused kernel, or None (as for a
  FORGE layer: ``forge_jax.dense.dtype_reason``), with the fix for a model
  that is not edited."""
  return dtype_reason(linen_kernel_dtype(module), module.dtype, inputs,
                      "give the model param_dtype/dtype float32 to fuse it")


def _custom_dot(module) -> bool:
  return (module.dot_general is not None
          or module.dot_general_cls is not None
          or module.promote_dtype is not flax_dtypes.promote_dtype)


def _kernel_shape(module, kind: str, inputs) -> tuple[tuple, str | None]:
  """The kernel's shape as the FORGE layer sees it, or why the layer is not
  one GEMM (``nn.DenseGeneral`` only)."""
  shape = jnp.shape(inputs)
  if kind == "nn.Dense":
    return (shape[-1:] + (module.features,)), None
  batch_dims = _as_tuple(module.batch_dims)
  if batch_dims:
    return (), (f"batch_dims={module.batch_dims!r}: a weight per batch "
                "index is a batched matrix product, not one GEMM")
  ndim = len(shape)
  axis = tuple(a % ndim if -ndim <= a < ndim else a
               for a in _as_tuple(module.axis))
  if axis != tuple(range(ndim - len(axis), ndim)):
    return (), (f"axis={module.axis!r} on a {ndim}-axis input: the "
                "contracted axes are not the input's trailing axes in order, "
                "so the layer is not one GEMM without copying the weight")
  return shape[ndim - len(axis):] + _as_tuple(module.features), None


def _has_kernel(params, path) -> bool:
  return _context.kernel_at(params, path) is not None


def _params_of(variables):
  """``variables["params"]``, or None where ``variables`` has none."""
  if isinstance(variables, Mapping) and "params" in variables:
    return variables["params"]
  return None


_NOT_IN_PARAMS = (
    "its kernel is not in the step's variables['params'] at this path: a "
    "second model applied inside loss_fn (e.g. a frozen teacher), or the "
    "model applied to part of the variables")

_ANOTHER_ARRAY = (
    "its kernel is another array than the one the step's "
    "variables['params'] holds at this path: a second model of the same "
    "architecture applied inside loss_fn to its own variables (e.g. an EMA "
    "or mean teacher), or the model applied to parameters changed inside "
    "loss_fn (e.g. cast, or frozen with stop_gradient)")


_LIFTED_OTHER = (
    "it reads another kernel than the step's variables['params'] holds at "
    "this path, and FORGE updates the kernel it reads: a lifted "
    "transform's slice or function of it (nn.vmap or nn.scan over the "
    "parameters, nn.map_variables; for blocks stacked with nn.scan, "
    "forge_jax.ScannedBlocks fuses them), or another model applied inside "
    "a module to its own variables")

_UNDER_VMAP = (
    "it runs under a vmap opened inside loss_fn (jax.vmap or nn.vmap): the "
    "fused update would run once per mapped element; apply the model to "
    "the whole batch (the mapped axis folded into the batch) to fuse it")


def _traces_beneath(x, steps):
  """``x``'s trace and its parents up to, not including, the one the
  step's parameter ``steps`` belongs to: the traces opened beneath the
  step's inside ``loss_fn``, innermost first. Empty where ``x`` is not a
  tracer of such a trace (an array, a tracer of the step's own or an
  enclosing trace); ``None`` where JAX's tracer internals it reads (the
  tracers' ``_trace``, the traces' ``parent_trace``) are missing."""
  if not isinstance(x, jax.core.Tracer):
    return []
  outer = getattr(steps, "_trace", None)
  trace = getattr(x, "_trace", None)
  if outer is None or trace is None or not hasattr(trace, "parent_trace"):
    return None
  found = []
  while trace is not None and trace is not outer:
    found.append(trace)
    trace = getattr(trace, "parent_trace", None)
  return found if trace is outer else []


def _under_vmap(inputs, steps) -> bool:
  """Whether the layer's ``inputs`` are batched by a vmap opened beneath
  the step's trace (JAX's ``BatchTrace``, found by name; where the tracer
  internals are missing, it cannot tell: no)."""
  return any(type(t).__name__ == "BatchTrace"
             for t in _traces_beneath(inputs, steps) or ())


def _traced_beneath(kernel, steps) -> bool:
  """Whether ``kernel`` is a tracer of a trace opened beneath the one the
  step's parameter ``steps`` belongs to (:func:`_traces_beneath`): the
  parameters handed on as operands inside ``loss_fn``
  (``jax.checkpoint(model.apply)``, a ``custom_vjp``, a control-flow
  primitive), the same values under another name, where the layer's path
  decides. A teacher's kernel (an array, or a tracer of the step's own or
  an enclosing trace: passed in the batch, frozen with ``stop_gradient``,
  cast) is not. Where JAX's tracer internals are missing it cannot tell,
  and the path decides."""
  traces = _traces_beneath(kernel, steps)
  return traces is None or bool(traces)


@dataclasses.dataclass(frozen=True)
class _Apply:
  """The outermost module call in progress (a ``model.apply`` in
  ``loss_fn``): the root scope of its variables, and the step's parameters
  as this trace of ``loss_fn`` received them (None: not inside a call of
  ``loss_fn``, e.g. a ``ScannedBlocks`` backward)."""

  root: object
  params: object


class _Converter:
  """The method interceptor: runs each ``nn.Dense`` / ``nn.DenseGeneral``
  call it can fuse as the FORGE layer, records the others with the reason.

  Args:
    params: the step's (unboxed) parameter tree: a layer whose kernel is not
      in it at the layer's path belongs to another model. (Within a call of
      ``loss_fn``, the parameters that call received decide, by identity:
      :meth:`reading`.)
    spec: the step's ``ForgeSpec`` (Muon cannot fuse a kernel of more than
      two axes).
    report: where the decisions are recorded.
    on_mesh: the step runs on a device mesh (``MeshLayout``), where FORGE
      steps 2-D kernels only.
  """

  def __init__(self, params, spec, report: Report, on_mesh: bool = False):
    self.params = params
    self.spec = spec
    self.report = report
    self.on_mesh = on_mesh
    # The step's parameters as the call of loss_fn being traced received
    # them (reading_params), and the outermost module call in progress.
    self.trace_params = None
    self.apply: _Apply | None = None
    # id of a subclass instance whose own __call__ runs -> whether it has
    # reached nn.Dense's / nn.DenseGeneral's (super().__call__) yet.
    self.overriding: dict[int, bool] = {}

  @contextlib.contextmanager
  def reading(self, variables):
    """While ``loss_fn`` runs on ``variables``: their ``params`` are the
    step's, in this trace."""
    prev = self.trace_params
    self.trace_params = _params_of(variables)
    try:
      yield
    finally:
      self.trace_params = prev

  def _not_the_steps(self, module, path, tap) -> str | None:
    """Why the layer is not one of the step's model's (None: it is).

    A layer is the step's when its kernel is the very array (the same traced
    value) that the step's ``variables["params"]`` holds at its path, as
    ``loss_fn`` received them: a second model of the same architecture
    applied to its own variables (an EMA teacher) has kernels at the same
    paths, but other arrays. Beneath a lifted transform (``nn.remat``,
    ``nn.scan``) a layer reads the transform's copy of its kernel, so the
    array the outermost ``apply`` was given at the layer's path is compared
    instead. Inside a ``ScannedBlocks`` block, or outside a call of
    ``loss_fn``, only the path is checked.
    """
    apply = self.apply
    if tap is not None or apply is None or apply.params is None:
      return None if _has_kernel(self.params, path) else _NOT_IN_PARAMS
    steps = _context.kernel_at(apply.params, path)
    if steps is None:
      return _NOT_IN_PARAMS
    scope = module.scope
    if scope.root is apply.root:  # the apply's own variables
      if not module.has_variable("params", "kernel"):
        return _NOT_IN_PARAMS
      kernel = module.get_variable("params", "kernel")
    else:  # a lifted transform's copies: the apply's variables at the path
      kernel = _context.kernel_at(_params_of(apply.root.variables()), path)
    if not (kernel is steps or _traced_beneath(kernel, steps)):
      return _ANOTHER_ARRAY
    if scope.root is not apply.root:
      # ... and the copy the layer reads: the same array, or the same values
      # handed on by the transform (nn.remat, nn.jit: a tracer beneath the
      # step's, of the kernel's shape). Another root's kernel of another
      # shape or value (nn.vmap's or nn.scan's slice, nn.map_variables'
      # function of it, a model applied inside a module to its own
      # variables) is not the step's.
      own = (nn.meta.unbox(module.get_variable("params", "kernel"))
             if module.has_variable("params", "kernel") else None)
      if own is None:
        return _NOT_IN_PARAMS
      if not (jnp.shape(own) == jnp.shape(steps)
              and (own is steps or _traced_beneath(own, steps))):
        return _LIFTED_OTHER
    return None

  def _reason(self, module, kind: str, inputs, path, tap, next_fun,
              orig) -> str | None:
    """Why this call stays on the standard path, or None to convert it."""
    if next_fun is not orig:
      return ("another method interceptor (flax.linen.intercept_methods, "
              "entered inside the step) wraps this call, and the FORGE layer "
              "cannot run beneath it")
    why = self._not_the_steps(module, path, tap)
    if why is not None:
      return why
    if tap is not None and self.on_mesh:
      return ("it runs inside forge_jax.ScannedBlocks, whose stacked "
              "kernels FORGE does not step on a device mesh (mesh_layout) "
              "yet")
    steps = (_context.kernel_at(self.apply.params, path) if tap is None
             and self.apply is not None and self.apply.params is not None
             else None)
    if steps is not None and _under_vmap(inputs, steps):
      return _UNDER_VMAP
    if _custom_dot(module):
      return ("a custom dot_general, dot_general_cls or promote_dtype (e.g. "
              "quantisation) cannot be fused")
    shape, why = _kernel_shape(module, kind, inputs)
    if why is not None:
      return why
    if math.prod(shape) == 0:
      return f"its kernel {shape} is empty: there is nothing to update"
    why = _dtype_reason(module, inputs)
    if why is not None:
      return why
    if (kind == "nn.DenseGeneral" and len(shape) > 2
        and getattr(self.spec, "family", None) == "muon"):
      return (f"Muon orthogonalizes a matrix and this kernel has {len(shape)} "
              "axes: FORGE would orthogonalize its (in, out) view, which "
              "optax does not")
    if kind == "nn.DenseGeneral" and len(shape) > 2 and self.on_mesh:
      return (f"its kernel has {len(shape)} axes, and on a device mesh "
              "(mesh_layout) FORGE steps 2-D (in, out) kernels only")
    return self._blocks_reason(module, kind, shape)

  def _blocks_reason(self, module, kind: str, shape) -> str | None:
    """Why a ``nn.DenseGeneral`` kernel's quantized moments cannot be
    stepped as its GEMM matrix's (``forge_jax.dense``'s refusal, a skip
    here): several feature axes, the last not a multiple of a format's
    block."""
    lp = getattr(self.spec, "low_precision", None)
    if lp is None or kind != "nn.DenseGeneral":
      return None
    fmt = _dense.misfit_block(
        shape, math.prod(_as_tuple(module.features)),
        _dense.quantized_formats(lp, None, tuple(shape)))
    if fmt is None:
      return None
    return (f"its kernel {tuple(shape)} has several feature axes, the "
            f"last of {shape[-1]} elements, not a multiple of {fmt.block}: "
            "the quantized moments' blocks along it are not blocks of the "
            "fused kernel's matrix rows")

  def _overridden(self, module, next_fun, args, kwargs):
    """A subclass's own ``__call__``: converted where it calls nn.Dense's
    (``super().__call__``); reported where it does not (a LoRA layer that
    computes its own product)."""
    key = id(module)
    outer = self.overriding.get(key)
    self.overriding[key] = False
    try:
      return next_fun(*args, **kwargs)
    finally:
      reached = self.overriding.pop(key)
      if outer is not None:
        self.overriding[key] = outer or reached
      elif not reached:
        base = ("nn.DenseGeneral" if isinstance(module, nn.DenseGeneral)
                else "nn.Dense")
        tap = _context.current_tap()
        path = ((*tap.prefix, *module.path) if tap is not None
                else tuple(module.path))
        self.report.skipped[_context.layer_name(path)] = (
            f"{type(module).__name__} (a subclass of {base}): its class "
            f"overrides __call__ and does not call {base}.__call__ (e.g. a "
            "LoRA layer computing its own product); only that __call__ "
            "runs as a FORGE layer")

  def __call__(self, next_fun, args, kwargs, context):
    if self.apply is not None:
      return self._call(next_fun, args, kwargs, context)
    # The outermost module call: the layers beneath it read the variables
    # of its root scope.
    scope = getattr(context.module, "scope", None)
    self.apply = _Apply(root=None if scope is None else scope.root,
                        params=None if scope is None else self.trace_params)
    try:
      return self._call(next_fun, args, kwargs, context)
    finally:
      self.apply = None

  def _call(self, next_fun, args, kwargs, context):
    target = _targets().get(getattr(context.orig_method, "func", None))
    module = context.module
    if (context.method_name != "__call__"
        or isinstance(module, (Dense, DenseGeneral))):
      return next_fun(*args, **kwargs)
    if target is None:
      if isinstance(module, (nn.Dense, nn.DenseGeneral)):
        return self._overridden(module, next_fun, args, kwargs)
      return next_fun(*args, **kwargs)
    if id(module) in self.overriding:
      self.overriding[id(module)] = True
    cls, body, kind = target
    inputs = args[0] if args else kwargs.get("inputs")
    tap = _context.current_tap()
    path = (*tap.prefix, *module.path) if tap is not None else tuple(
        module.path)
    name = _context.layer_name(path)
    why = self._reason(module, kind, inputs, path, tap, next_fun,
                       context.orig_method)
    if why is not None:
      self.report.skipped[name] = f"{kind}: {why}"
      return next_fun(*args, **kwargs)
    self.report.converted[name] = kind
    # The FORGE layer's body run on this module itself: a FORGE-class view
    # sharing the module's fields, scope and call state, inside the module's
    # own (already entered) call -- so Flax records one call of one module.
    view = object.__new__(cls)
    view.__dict__.update(module.__dict__)
    for f in dataclasses.fields(cls):  # FORGE's own attributes: defaults
      if f.name not in view.__dict__:
        if f.default is not dataclasses.MISSING:
          object.__setattr__(view, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
          object.__setattr__(view, f.name, f.default_factory())
    object.__setattr__(view, "fused", True)
    return body(view, *args, **kwargs)


@contextlib.contextmanager
def converting(enabled: bool, params, spec, on_mesh: bool = False):
  """While the step is traced: the conversion, if ``enabled``
  (``on_mesh``: the step has a ``MeshLayout``).

  Yields:
    The :class:`Report` the conversion fills, or None when not enabled.
  """
  if not enabled:
    yield None
    return
  _targets()  # refuses a Flax it cannot convert for, before any trace
  report = Report()
  converter = _Converter(params, spec, report, on_mesh)
  prev = active_report(), getattr(_ACTIVE, "converter", None)
  _ACTIVE.report, _ACTIVE.converter = report, converter
  try:
    with nn.intercept_methods(converter):
      yield report
  except ValueError as e:
    _note_converted(e, report)
    raise
  finally:
    _ACTIVE.report, _ACTIVE.converter = prev


def _note_converted(error: ValueError, report: Report) -> None:
  """Adds to a FORGE layer's refusal that names a converted layer and
  ``fused=False`` (an attribute of FORGE's layers) the fixes that apply to
  a flax layer the step converted."""
  if not (error.args and isinstance(error.args[0], str)):
    return
  message = error.args[0]
  names = [n for n in report.converted if repr(n) in message]
  if not names or "fused=False" not in message:
    return
  if isinstance(error, KernelNotReadError):  # (shared="standard" or not)
    error.args = (message + (
        f"\n(make_step(..., convert=True) ran {', '.join(map(repr, names))} "
        "-- flax nn.Dense / nn.DenseGeneral layers of the model -- as FORGE "
        "layers; such a layer has no fused attribute, and this refusal holds "
        "under shared='standard' too. Write that layer as "
        "forge_jax.Dense(..., fused=False), which trains it on the standard "
        "path. A layer beneath nn.remat or nn.jit that reads a function of "
        "its kernel -- nn.map_variables, say -- or beneath nn.vjp / nn.jvp "
        "is converted and then refused so.)"), *error.args[1:])
    return
  error.args = (message + (
      f"\n(make_step(..., convert=True) ran {', '.join(map(repr, names))} "
      "-- flax nn.Dense / nn.DenseGeneral layers of the model -- as FORGE "
      "layers; such a layer has no fused attribute. Where this message says "
      "fused=False, build the step with shared='standard' (it moves such "
      "layers to the standard path and lists them in step.standard_layers)"
      ", or write that layer as forge_jax.Dense(..., fused=False).)"),
                *error.args[1:])


def reading_params(loss_fn):
  """``loss_fn``, telling the conversion active when it is called (if any)
  which parameters that call received: the step's, as this trace holds them
  (a layer is the step's when its kernel is one of them)."""
  def wrapped(variables, batch):
    converter = getattr(_ACTIVE, "converter", None)
    if converter is None:
      return loss_fn(variables, batch)
    with converter.reading(variables):
      return loss_fn(variables, batch)
  return wrapped
