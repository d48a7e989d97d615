"""`forge_jax.DenseGeneral`: `flax.linen.DenseGeneral` whose backward updates
its own kernel, for the configurations that are one GEMM."""

from __future__ import annotations

import math

import jax.numpy as jnp
import flax.linen as nn
from flax.core import meta
from flax.linen import dtypes as flax_dtypes

import pallas_kernels
from forge_jax import _context
from forge_jax.dense import (_Static, _fused_linear, in_block, kernel_read,
                             linen_kernel_dtype, refuse_custom_dot,
                             refuse_dtype)

# nn.DenseGeneral.__call__ without Flax's method wrapper (as Dense._standard).
_BODY = getattr(nn.DenseGeneral.__call__, "__wrapped__", None)

_KIND = "forge_jax.DenseGeneral"


def _as_tuple(v) -> tuple:
  return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _reshaped(init, flat_shape):
  """``init`` called with ``flat_shape``, its value reshaped to the
  parameter's shape, as ``nn.DenseGeneral`` does: a boxed value (e.g. from
  ``nn.with_logical_partitioning``) keeps its box and names."""
  def wrapped(rng, shape, dtype):
    value = init(rng, flat_shape, dtype)
    if isinstance(value, meta.AxisMetadata):
      return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
    return jnp.reshape(value, shape)
  return wrapped


class DenseGeneral(nn.DenseGeneral):
  """A drop-in for :class:`flax.linen.DenseGeneral` whose backward applies the
  optimizer.

  Same attributes, defaults and parameter tree as ``nn.DenseGeneral``
  (``kernel`` ``(*in_dims, *features)``, ``bias`` ``features``). Called
  outside a FORGE step it *is* ``nn.DenseGeneral``. Inside a step built by
  :func:`forge_jax.make_step` it is fused as :class:`forge_jax.Dense` is,
  when the layer is one GEMM with no weight copy: ``batch_dims=()`` and
  ``axis`` the input's trailing axes in order (``-1``, ``(-2, -1)``, ...).
  The fused op then sees the input as ``(tokens, prod(in_dims))`` and the
  kernel parameter, viewed inside it, as ``(prod(in_dims), prod(features))``;
  the updated kernel and slots come back in the parameter's own shape. The
  bias takes the ordinary path. Inside a :class:`forge_jax.ScannedBlocks`
  block it is fused as ``forge_jax.Dense`` is there: its stacked kernel
  ``(L, *in_dims, *features)`` and stacked slots are stepped at layer ``i``
  as ``(L, prod(in_dims), prod(features))`` views (reshapes, no copy) and
  come back in their own shape.

  Extra attributes (after ``nn.DenseGeneral``'s, all optional): ``fused``
  and ``block_config``, as for :class:`forge_jax.Dense`.

  Raises (at call time, inside a FORGE step, for a fused layer):
    ValueError: ``batch_dims`` set, ``axis`` not the trailing axes in order,
      or a custom ``dot_general`` or ``promote_dtype``. (A kernel with more
      than two axes under Muon is refused by ``make_step``, also with
      ``ValueError``: optax keeps it in Muon's Adam partition.)
    TypeError: a float64 or non-float kernel or computation dtype (the
      fused kernel computes in fp32 and stores fp32, bf16 or fp16).

  Example:
    >>> import forge_jax, jax, jax.numpy as jnp
    >>> layer = forge_jax.DenseGeneral(features=(2, 3), axis=(-2, -1))
    >>> variables = layer.init(jax.random.key(0), jnp.ones((1, 4, 5)))
  """

  fused: bool = True
  block_config: pallas_kernels.BlockConfig | None = None

  def _standard(self, inputs):
    if _BODY is None:  # another Flax: the wrapped method
      return super().__call__(inputs)
    return _BODY(self, inputs)

  def _gemm_dims(self, inputs, name: str):
    """``(in_dims, features)`` of the one-GEMM form, or a ValueError."""
    fix = (f"{_KIND} at {name!r}: {{}} cannot be fused into one GEMM without "
           "copying the weight; use flax.linen.DenseGeneral, or fused=False "
           "for this layer")
    if _as_tuple(self.batch_dims):
      raise ValueError(fix.format(f"batch_dims={self.batch_dims!r}"))
    ndim = jnp.ndim(inputs)
    axis = tuple(a % ndim if -ndim <= a < ndim else a
                 for a in _as_tuple(self.axis))
    if axis != tuple(range(ndim - len(axis), ndim)):
      raise ValueError(fix.format(
          f"axis={self.axis!r} (the contracted axes must be the input's "
          f"trailing axes, in order, e.g. axis=-1 or (-2, -1); input has "
          f"{ndim} axes)"))
    return (tuple(jnp.shape(inputs)[ndim - len(axis):]),
            _as_tuple(self.features))

  def _refuse(self, name: str, kernel_ndim: int, spec, inputs) -> None:
    """Refuses what cannot be fused: a custom dot, a float64 or non-float
    kernel or computation dtype for ``inputs``, or Muon (``spec``) on a
    kernel of ``kernel_ndim`` > 2 axes."""
    refuse_custom_dot(self, _KIND, name)
    refuse_dtype(_KIND, name, linen_kernel_dtype(self), self.dtype, inputs,
                 spec)
    if spec is not None and spec.family == "muon" and kernel_ndim > 2:
      raise ValueError(
          f"{_KIND} at {name!r}: Muon orthogonalizes a matrix, and this "
          f"kernel has {kernel_ndim} axes; FORGE would orthogonalize its "
          "(in, out) view, which optax does not. Set fused=False for this "
          "layer, or use forge_jax.Dense")

  def _fused(self, inputs, in_dims, features, static_of, layer_inputs):
    """``nn.DenseGeneral``'s computation with the contraction as the fused
    op: the raw kernel parameter is viewed as a matrix and cast inside it."""
    n_in, n_out = math.prod(in_dims), math.prod(features)
    kernel = self.param("kernel", _reshaped(self.kernel_init, (n_in, n_out)),
                        in_dims + features, self.param_dtype)
    bias = (self.param("bias", _reshaped(self.bias_init, (n_out,)),
                       features, self.param_dtype)
            if self.use_bias else None)
    dtype = flax_dtypes.canonicalize_dtype(inputs, kernel, bias,
                                           dtype=self.dtype)
    inputs_c, bias_c = flax_dtypes.promote_dtype(inputs, bias, dtype=dtype)
    lead = jnp.shape(inputs)[:jnp.ndim(inputs) - len(in_dims)]
    x = jnp.reshape(inputs_c, lead + (n_in,))
    y = _fused_linear(static_of(dtype, (n_in, n_out)), x, kernel, layer_inputs)
    y = jnp.reshape(y, lead + features)
    if bias_c is not None:
      y += bias_c
    return y

  @nn.compact
  def __call__(self, inputs):
    """Applies the layer; see the class docstring.

    Args:
      inputs: the input array; its trailing ``len(axis)`` axes are contracted.

    Returns:
      The output, of shape ``inputs.shape[:-len(axis)] + features``.

    Raises:
      ValueError: a fused layer inside a FORGE step whose configuration is
        not one GEMM (see the class docstring).
    """
    tap = _context.current_tap()
    if tap is not None:  # inside a forge_jax.ScannedBlocks block
      return in_block(self, _KIND, tap, inputs)
    name = _context.layer_name(self.path)
    pallas_kernels.fused_wgrad.check_block_config(
        self.block_config, f"{_KIND} at {name!r}")
    ctx = _context.current()
    if ctx is not None and not self.fused and ctx.mode == "discover":
      ctx.unfused.add(tuple(self.path))
    if ctx is None or not self.fused or ctx.is_standard(self.path):
      return self._standard(inputs)
    in_dims, features = self._gemm_dims(inputs, name)
    self._refuse(name, len(in_dims) + len(features), ctx.spec, inputs)
    path = tuple(self.path)
    if ctx.mode == "discover":
      _context.register_layer(
          ctx, path, in_dims + features, self.param_dtype, _KIND,
          hint=" (Inside nn.scan a layer is traced more than once: for "
          "scanned blocks use forge_jax.ScannedBlocks.)",
          kernel=kernel_read(self))
      return self._standard(inputs)
    if path not in ctx.inputs:
      raise RuntimeError(
          f"{_KIND} at {name!r} was not seen when the step discovered its "
          "FORGE layers: the loss function must call the same layers on "
          "every trace")
    return self._fused(
        inputs, in_dims, features,
        lambda dtype, gemm: _Static(
            path=path, rule=ctx.rule, dtype=dtype, precision=self.precision,
            config=self.block_config, spec=ctx.spec,
            layout=ctx.layouts.get(path), wgrad=ctx.wgrad, gemm=gemm,
            kind=_KIND),
        ctx.inputs[path])
