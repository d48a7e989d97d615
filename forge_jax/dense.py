"""`forge_jax.Dense`: `flax.linen.Dense` whose backward updates its own kernel."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import flax.linen as nn
from flax.linen import dtypes as flax_dtypes

import pallas_kernels
from forge_jax import _context
from forge_jax import _paths
from forge_jax import clip as _clip
from forge_jax import _sharding
from forge_jax import _usage


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
  """Static (non-array) arguments of the fused linear op."""

  path: _context.Path
  rule: pallas_kernels.UpdateRule | None
  dtype: Any
  precision: Any
  config: pallas_kernels.BlockConfig | None
  # The step's ForgeSpec (picks the path: epilogue / epilogue + layer pass /
  # deferred) and where this kernel's state lives; None: `rule`, regime 1.
  spec: Any = None
  layout: Any = None
  wgrad: str = "fused"  # make_step's wgrad: "fused" | "xla"
  # forge_jax.DenseGeneral: the (in, out) matrix its kernel parameter is
  # viewed as (a reshape, inside the fused op); None: the kernel is (in, out).
  gemm: tuple[int, int] | None = None
  kind: str = "forge_jax.Dense"  # the layer, as errors name it


def _gemm_view(static: _Static, kernel):
  """The kernel as the GEMM's ``(in, out)`` matrix (a reshape, no copy)."""
  return kernel if static.gemm is None else kernel.reshape(static.gemm)


def _matmul(x, kernel, precision):
  return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                         precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_linear(static: _Static, x, kernel, inputs: _context.LayerInputs):
  return _matmul(x, _gemm_view(static, kernel).astype(static.dtype),
                 static.precision)


def _fused_linear_fwd(static, x, kernel, inputs):
  # On a mesh, a fully sharded kernel is gathered for this matmul alone.
  k = _sharding.gathered_after(static.path, kernel, x)
  y = _matmul(x, _gemm_view(static, k).astype(static.dtype),
              static.precision)
  return y, (x, kernel, inputs)


def _fused_linear_bwd(static, res, dy):
  """Returns dx and, in place of the kernel's and slots' cotangents, their
  updated values (make_step reads them as such).

  The optimizer step itself takes the spec's path (``forge_jax._paths``):
  the fused kernel's epilogue (regime 1), the epilogue then a per-layer pass
  over the new state (regime 2), or deferred: ``G`` formed, consumed and
  freed here (regime 3).
  """
  x, kernel, inputs = res
  # dx must read the pre-update kernel: it is computed from `kernel` before
  # the fused kernel (which aliases that buffer) writes it.
  k = _gemm_view(static, _sharding.gathered_after(static.path, kernel, dy))
  k = k.astype(static.dtype)
  dx = lax.dot_general(dy, k, (((dy.ndim - 1,), (1,)), ((), ())),
                       precision=static.precision)
  if _clip.is_norm_pass(static.wgrad):
    # The norm pass of a clipped step (forge_jax/clip.py): this layer's
    # squared gradient norm, returned as its "touched" cotangent; nothing is
    # updated, and the kernel's cotangent is not read.
    return dx.astype(x.dtype), jnp.zeros_like(kernel), _clip.norm_pass_inputs(
        inputs, _clip.layer_sqnorm(x, dy, static.wgrad, static.precision))
  # The barrier makes the in-place write data-dependent on dx, so XLA orders
  # the dx GEMM's read of the kernel before the fused kernel overwrites it
  # instead of protecting the read with a kernel-sized copy.
  dx, kernel = lax.optimization_barrier((dx, kernel))
  with _paths.refusing_derivatives(
      f"{static.kind} at {_context.layer_name(static.path)!r}"):
    new_kernel, new_slots = _update(static, x, dy, kernel, inputs)
  ctx = _context.current()
  if ctx is not None:
    ctx.bwd_traced.add(static.path)
  return dx.astype(x.dtype), new_kernel, _context.LayerInputs(
      slots=new_slots,
      hparams=jax.tree.map(jnp.zeros_like, inputs.hparams),
      touched=jnp.ones_like(inputs.touched),
      shared=jax.tree.map(_paths.zero_cotangent, inputs.shared))


def _update_matrix(static, x, dy, kernel, inputs):
  """The optimizer step of an ``(in, out)`` kernel: ``(new_kernel, new_slots)``."""
  plan = _sharding.plan_of(static.path)
  if plan is not None:  # make_step(..., mesh_layout=...): per shard
    return plan.step_in_backward(static, x, dy, kernel, inputs)
  if static.spec is None:
    return _paths.wgrad_update(
        x, dy, kernel, inputs.slots, inputs.hparams, rule=static.rule,
        config=static.config, wgrad=static.wgrad, precision=static.precision)
  return _paths.step_in_backward(
      static.spec, static.layout, x, dy, kernel, inputs, static.config,
      static.wgrad, static.precision)


def _update(static, x, dy, kernel, inputs):
  """The optimizer step of the kernel parameter, in its own shape.

  A ``forge_jax.DenseGeneral`` kernel (``static.gemm`` set) is stepped as its
  ``(in, out)`` matrix, with its kernel-shaped slots viewed the same way, and
  the new values are reshaped back (reshapes of contiguous arrays: no copy).
  A deferred family (regime 3) runs optax on the parameter's own shape.
  """
  if static.gemm is None or (static.spec is not None
                             and static.spec.regime == 3):
    return _update_matrix(static, x, dy, kernel, inputs)
  shape = kernel.shape
  views = {shape: static.gemm}
  if static.spec is not None and static.spec.low_precision is not None:
    # A quantized moment's scales (one per 64 elements of the kernel's last
    # axis) viewed as the GEMM's (one per 64 of its rows' elements).
    views.update(_scale_views(static, shape, quantized_formats(
        static.spec.low_precision, static.layout, shape)))
  slots = tuple(s.reshape(views[s.shape]) if s.shape in views else s
                for s in inputs.slots)
  new_kernel, new_slots = _update_matrix(
      static, x, dy, kernel.reshape(static.gemm), inputs._replace(slots=slots))
  return new_kernel.reshape(shape), tuple(
      n.reshape(s.shape) if s.shape in views else n
      for n, s in zip(new_slots, inputs.slots))


def quantized_formats(lp, layout, shape) -> set:
  """The formats of low-precision state ``lp`` whose slots of a kernel of
  ``shape`` are quantized (a ``Quantized`` pair of codes and scales, two
  leaves), as the state stores them (``layout``, the kernel's
  ``_state.KernelLayout``; None: the formats' own rule, as the
  transform's init): a kernel of fewer elements than a format's
  ``min_size`` keeps float moments. Also ``forge_jax.ScannedBlocks``'
  rule, for its stacked kernels."""
  if layout is None:  # the formats' own rule, as the transform's init
    return {f for i, f in enumerate(lp.formats) if lp.quantizes(i, shape)}
  return {f for f, d in zip(lp.formats, layout.slot_defs)
          if f is not None and d.num_leaves == 2}


def misfit_block(shape, n_out: int, formats):
  """The first of the quantized ``formats`` whose blocks along the last
  axis of a kernel of ``shape`` are not blocks of its GEMM matrix's rows
  (``n_out`` wide): several feature axes, the last not a multiple of the
  block. ``None`` if every format fits."""
  for fmt in formats:
    if shape[-1] != n_out and shape[-1] % fmt.block:
      return fmt
  return None


def _scale_views(static, shape, formats) -> dict:
  """``{scale shape of the kernel: scale shape of its GEMM matrix}`` for
  the quantized moments (of ``formats``) of a ``forge_jax.DenseGeneral``
  kernel; refuses a kernel whose blocks along its last axis are not blocks
  of the matrix's rows (:func:`misfit_block`). Float moments have no
  blocks: nothing to view or refuse."""
  views = {}
  n_out = static.gemm[1]
  fmt = misfit_block(shape, n_out, formats)
  if fmt is not None:
    raise ValueError(
        f"{static.kind} at {_context.layer_name(static.path)!r}: its "
        f"kernel {tuple(shape)} has several feature axes, the last of "
        f"{shape[-1]} elements, not a multiple of {fmt.block}: the "
        f"quantized moments' blocks ({fmt.block} consecutive elements of "
        "the kernel's last axis) are not blocks of the fused kernel's "
        f"({static.gemm[0]}, {n_out}) matrix. Give this layer "
        "fused=False (the standard path steps it with the same "
        "quantized state), or features whose last axis is a multiple of "
        f"{fmt.block}.")
  for fmt in formats:
    param = fmt.scale_shape(shape)
    if param != tuple(shape):  # (else a one-column kernel: viewed as one)
      views[param] = fmt.scale_shape(static.gemm)
  return views


_fused_linear.defvjp(_fused_linear_fwd, _fused_linear_bwd)
_usage.register_fused_backward(_fused_linear_bwd)


def refuse_custom_dot(layer, kind: str, name: str) -> None:
  """Refuses a fused ``layer`` (``kind`` at ``name``) with a custom
  ``dot_general``, ``dot_general_cls`` or ``promote_dtype``: the fused
  kernel computes the plain product."""
  if (layer.dot_general is not None or layer.dot_general_cls is not None
      or layer.promote_dtype is not flax_dtypes.promote_dtype):
    raise ValueError(
        f"{kind} at {name!r}: a custom dot_general or promote_dtype cannot "
        "be fused; set fused=False for this layer")


def linen_kernel_dtype(layer):
  """The dtype of a Flax linen layer's kernel (``nn.Dense``,
  ``nn.DenseGeneral``, their FORGE layers, a ``ScannedDenseStack``): its
  parameter's, else its ``param_dtype``'s."""
  if layer.has_variable("params", "kernel"):
    return jnp.dtype(layer.get_variable("params", "kernel").dtype)
  return jnp.dtype(jax.dtypes.canonicalize_dtype(layer.param_dtype))


def dtype_reason(kernel_dtype, dtype, inputs, fix: str) -> str | None:
  """Why a layer's dtypes keep it off the fused kernel (a non-float,
  float64 or 8- or 4-bit float kernel or computation dtype), or None;
  ``fix``, in parentheses at its end, says how to fuse it. The computation
  dtype is the one the layer computes in: its ``dtype``, else (``dtype``
  None) the promotion of its input and kernel (as
  ``flax.linen.dtypes.canonicalize_dtype``)."""
  kernel_dtype = jnp.dtype(kernel_dtype)
  promoted = dtype is None
  if promoted:
    dtype = jnp.result_type(jnp.asarray(inputs).dtype, kernel_dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
      dtype = jnp.promote_types(jnp.float32, dtype)
  for what, d in (("kernel", kernel_dtype), ("computation", jnp.dtype(dtype))):
    source = ""
    if what == "computation" and promoted:
      # The layer sets no dtype: its input's dtype decides it.
      source = (f" (from its {jnp.asarray(inputs).dtype} input and "
                f"{kernel_dtype} kernel: the layer sets no dtype)")
      fix = ("cast the input to float32 or bfloat16, or give the layer "
             f"dtype=jnp.float32; {fix}")
    if not jnp.issubdtype(d, jnp.floating):
      return (f"its {what} dtype is {d}{source}: the fused kernel updates "
              "floating-point weights from floating-point activations only "
              f"({fix})")
    if jax.dtypes.canonicalize_dtype(d) == jnp.float64:
      return (f"its {what} dtype is float64{source}: the fused kernel "
              f"computes in fp32 and stores fp32, bf16 or fp16 ({fix})")
    if d.itemsize < 2:  # 8- and 4-bit floats
      return (f"its {what} dtype is {d}{source}: the fused kernel reads "
              "and stores fp32, bf16 or fp16 weights and activations "
              f"({fix})")
  return None


# How to fuse a FORGE layer whose dtypes the fused kernel does not take.
_DTYPE_FIX = (
    "give this layer param_dtype float32 or bfloat16, and a dtype of "
    "float32 or bfloat16 if it sets one, to fuse it; or fused=False to keep "
    "it on the standard path, an ordinary gradient and optax update in its "
    "own dtype")


def refuse_dtype(kind: str, name: str, kernel_dtype, dtype, inputs,
                 spec) -> None:
  """Refuses a fused layer (``kind`` at ``name``) whose kernel or
  computation dtype (its ``kernel_dtype``, and its ``dtype`` or the
  promotion with ``inputs``) the fused kernel does not take (float64,
  8- and 4-bit floats, non-float), naming the layer, the dtype and the
  fix. ``spec``: the step's ``ForgeSpec`` (``None``: a rule, regime 1); a
  deferred family (regime 3) forms ``G`` itself, in the kernel's own dtype
  (float64, complex), and runs no fused kernel: nothing is refused.
  Nothing is refused while the step discovers its layers either (its
  family is not known there): the step's fused trace refuses."""
  ctx = _context.current()
  if (ctx is not None and ctx.mode == "discover") or (
      spec is not None and spec.regime == 3):
    return
  why = dtype_reason(kernel_dtype, dtype, inputs, _DTYPE_FIX)
  if why is not None:
    raise TypeError(f"{kind} at {name!r}: {why}")


def kernel_read(layer):
  """The kernel array ``layer`` reads in this call (None where it has none
  yet): told apart from another call's by identity, at discovery."""
  if layer.has_variable("params", "kernel"):
    return layer.get_variable("params", "kernel")
  return None


def _lead(inputs, in_dims) -> tuple[int, ...]:
  """The input's leading (token) axes: all but the contracted ones."""
  return tuple(jnp.shape(inputs)[:jnp.ndim(inputs) - len(in_dims)])


def in_block(layer, kind: str, tap: _context.BlockTap, inputs):
  """A FORGE layer (``forge_jax.Dense`` or ``forge_jax.DenseGeneral``, named
  ``kind`` in errors) inside one block of a ``forge_jax.ScannedBlocks`` (the
  block's ``tap`` says how): the layer's own computation, recorded, or with
  the tap whose cotangent is this layer's ``dy``.

  The block's backward sees every FORGE layer as one GEMM: its input
  flattened to ``(*lead, n_in)`` (left in ``tap.inputs``), its tap (and so
  its ``dy``) of shape ``(*lead, n_out)``, reshaped to the layer's output
  where it is added, and its kernel ``(*in_dims, *features)`` viewed as the
  ``(n_in, n_out)`` matrix its record names (``DenseRecord.gemm``).

  The layer provides ``_standard(inputs)`` (the flax layer's own body),
  ``_gemm_dims(inputs, name) -> (in_dims, features)`` (raising for a
  configuration that is not one GEMM), ``_refuse(name, kernel_ndim, spec,
  inputs)`` and ``_fused(inputs, in_dims, features, static_of,
  layer_inputs)`` (its computation through the fused op;
  ``static_of(dtype, gemm)`` gives the op's ``_Static``).
  """
  path = tuple(layer.path)
  name = _context.layer_name((*tap.prefix, *path))
  pallas_kernels.fused_wgrad.check_block_config(layer.block_config,
                                                f"{kind} at {name!r}")
  if tap.mode == "record":
    return _record_in_block(layer, kind, tap, path, name, inputs)
  y = layer._standard(inputs)
  if tap.mode == "tap" and path in tap.forge:
    in_dims, _ = layer._gemm_dims(inputs, name)
    kernel = layer.get_variable("params", "kernel")
    bias = layer.get_variable("params", "bias") if layer.use_bias else None
    dtype = flax_dtypes.canonicalize_dtype(inputs, kernel, bias,
                                           dtype=layer.dtype)
    tap.inputs[path] = jnp.reshape(
        jnp.asarray(inputs, dtype),
        _lead(inputs, in_dims) + (math.prod(in_dims),))
    y = y + jnp.reshape(tap.taps[path], jnp.shape(y))
  return y


def _record_in_block(layer, kind, tap, path, name, inputs):
  """``record`` mode: reports the layer; a fused one (refused here if it
  cannot be fused) reads its kernel through the fused op (never
  differentiated here, only traced), so that ``ScannedBlocks`` can tell its
  own read from any other in the block's jaxpr."""
  gemm = None
  if not layer.fused:
    y = layer._standard(inputs)
    out = jax.ShapeDtypeStruct(jnp.shape(y), y.dtype)
  else:
    in_dims, features = layer._gemm_dims(inputs, name)
    ctx = _context.current()
    layer._refuse(name, len(in_dims) + len(features),
                  None if ctx is None else ctx.spec, inputs)
    y = layer._fused(
        inputs, in_dims, features,
        lambda dtype, g: _Static(path=(*tap.prefix, *path), rule=None,
                                 dtype=dtype, precision=layer.precision,
                                 config=layer.block_config, gemm=g,
                                 kind=kind),
        _context.LayerInputs(slots=(), hparams=(),
                             touched=jnp.zeros((), jnp.float32)))
    gemm = (math.prod(in_dims), math.prod(features))
    out = jax.ShapeDtypeStruct(_lead(inputs, in_dims) + gemm[1:], y.dtype)
  rec = tap.records.get(path)
  if rec is None:
    kernel = layer.get_variable("params", "kernel")
    rec = tap.records[path] = _context.DenseRecord(
        kernel_shape=tuple(kernel.shape), param_dtype=kernel.dtype,
        fused=layer.fused, config=layer.block_config,
        precision=layer.precision, out=out, gemm=gemm, kind=kind)
  rec.calls += 1
  return y


# nn.Dense.__call__ without Flax's method wrapper (Dense._standard).
_DENSE_BODY = getattr(nn.Dense.__call__, "__wrapped__", None)

_KIND = "forge_jax.Dense"


class Dense(nn.Dense):
  """A drop-in for :class:`flax.linen.Dense` whose backward applies the optimizer.

  Same attributes, defaults and parameter tree as ``nn.Dense`` (``kernel``
  ``(in, out)``, ``bias`` ``(out,)``). Called outside a FORGE step it *is*
  ``nn.Dense``. Inside a step built by :func:`forge_jax.make_step`, its
  backward computes ``dx`` from the pre-update kernel, then updates the kernel
  and its optimizer slots in place with the fused weight-gradient kernel, so
  the kernel's gradient never exists in memory (with ``make_step(...,
  wgrad="xla")``: from XLA's GEMM, this layer's gradient alone in memory for
  the update). The bias takes the ordinary path and is updated exactly as
  optax would. The fused kernel computes in fp32 and stores fp32, bf16 or
  fp16: inside a step a fused layer with a float64 (or non-float) kernel or
  computation dtype raises a ``TypeError`` naming the layer and the fix
  (a deferred family, regime 3, forms ``G`` in the kernel's own dtype and
  takes float64 and complex kernels).

  Extra attributes (after ``nn.Dense``'s, all optional):
    fused: ``False`` keeps this layer on the standard path (its kernel gets an
      ordinary gradient and an ordinary optax update), e.g. for a module that
      is called more than once per step or whose kernel is tied to another
      op. ``forge_jax.make_step(..., shared="standard")`` does this
      automatically for every such layer.
    block_config: a Triton tiling of the fused kernel (a ``BlockConfig``,
      which runs the Triton kernel); when ``None``, the backend and tiling
      the kernel chooses for the case (``pallas_kernels.select_backend``).

  Example:
    >>> import forge_jax, jax, jax.numpy as jnp
    >>> layer = forge_jax.Dense(features=4)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((1, 3)))
  """

  fused: bool = True
  block_config: pallas_kernels.BlockConfig | None = None

  def _standard(self, inputs):
    # nn.Dense's own body, not its Flax-wrapped method: super().__call__
    # would run Flax's method wrapper a second time for this one call (two
    # capture_intermediates entries, interceptors applied twice).
    if _DENSE_BODY is None:  # another Flax: the wrapped method, as before
      return super().__call__(inputs)
    return _DENSE_BODY(self, inputs)

  def _gemm_dims(self, inputs, name: str):
    """``(in_dims, features)``: the kernel is ``(in, out)`` already."""
    del name
    return (jnp.shape(inputs)[-1],), (self.features,)

  def _refuse(self, name: str, kernel_ndim: int, spec, inputs) -> None:
    """Refuses what cannot be fused (a custom dot, a kernel or computation
    dtype the fused kernel does not take for ``inputs``, e.g. float64, an
    8-bit float or non-float, where the step's ``spec`` runs the fused
    kernel); ``kernel_ndim`` matters to
    ``forge_jax.DenseGeneral`` only."""
    del kernel_ndim
    refuse_custom_dot(self, _KIND, name)
    refuse_dtype(_KIND, name, linen_kernel_dtype(self), self.dtype, inputs,
                 spec)

  def _fused(self, inputs, in_dims, features, static_of, layer_inputs):
    """``nn.Dense``'s computation with the matmul as the fused op: the raw
    kernel parameter is cast inside that op, so it is the kernel's only
    consumer (see ``_usage``). ``static_of(dtype, gemm)`` gives its
    ``_Static`` (or raises); the kernel is its own ``(in, out)`` matrix
    (``gemm=None``)."""
    kernel = self.param('kernel', self.kernel_init,
                        (*in_dims, *features), self.param_dtype)
    bias = (self.param('bias', self.bias_init, (self.features,),
                       self.param_dtype) if self.use_bias else None)
    dtype = flax_dtypes.canonicalize_dtype(inputs, kernel, bias,
                                           dtype=self.dtype)
    inputs_c, bias_c = flax_dtypes.promote_dtype(inputs, bias, dtype=dtype)
    y = _fused_linear(static_of(dtype, None), inputs_c, kernel, layer_inputs)
    if bias_c is not None:
      y += jnp.reshape(bias_c, (1,) * (y.ndim - 1) + (-1,))
    return y

  @nn.compact
  def __call__(self, inputs):
    tap = _context.current_tap()
    if tap is not None:  # inside a forge_jax.ScannedBlocks block
      return in_block(self, _KIND, tap, inputs)
    pallas_kernels.fused_wgrad.check_block_config(
        self.block_config,
        f"forge_jax.Dense at {_context.layer_name(self.path)!r}")
    ctx = _context.current()
    if ctx is not None and not self.fused and ctx.mode == "discover":
      ctx.unfused.add(tuple(self.path))
    if ctx is None or not self.fused or ctx.is_standard(self.path):
      # Standard path: outside a step, fused=False, or a shared layer that
      # make_step(..., shared="standard") moved here for this step.
      return self._standard(inputs)
    path = tuple(self.path)
    self._refuse(_context.layer_name(path), 2, ctx.spec, inputs)
    if ctx.mode == "discover":
      _context.register_layer(
          ctx, path, (jnp.shape(inputs)[-1], self.features), self.param_dtype,
          "forge_jax.Dense", hint=" (Inside nn.scan a layer is traced more "
          "than once: for scanned blocks use forge_jax.ScannedBlocks (any "
          "block) or forge_jax.ScannedDenseStack (Dense layers only).)",
          kernel=kernel_read(self))
      return self._standard(inputs)

    if path not in ctx.inputs:
      raise RuntimeError(
          f"forge_jax.Dense at {_context.layer_name(path)!r} was not seen when "
          "the step discovered its FORGE layers: the loss function must call "
          "the same layers on every trace")
    return self._fused(
        inputs, *self._gemm_dims(inputs, _context.layer_name(path)),
        lambda dtype, gemm: _Static(
            path=path, rule=ctx.rule, dtype=dtype, precision=self.precision,
            config=self.block_config, spec=ctx.spec,
            layout=ctx.layouts.get(path), wgrad=ctx.wgrad, gemm=gemm),
        ctx.inputs[path])
