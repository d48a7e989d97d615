"""The weight gradient's squared norm without storing it: ``||x^T dy||_F^2``.

Clipping by the global gradient norm (``forge_jax.clip_by_global_norm``,
``forge_torch``'s ``max_grad_norm=``) needs every layer's gradient norm
before any layer is updated, so a clipped FORGE step runs the backward twice:
a first pass that only measures the norms, then the fused update scaled by
the clip factor. This module is the first pass's kernel. One program
computes one ``(block_in, block_out)`` tile of ``G = x^T dy``, accumulating
over chunks of ``block_bt`` token rows in fp32 as the fused kernel's main
loop does, and its epilogue reduces the tile to the sum of its squared
entries. The output is one fp32 partial sum per tile, a
``(tiles_in, tiles_out)`` array that :func:`wgrad_sqnorm` sums; ``G`` never
leaves registers.

:func:`wgrad_sqnorm_reference` is the pure-``jnp`` reference (``G`` formed
in fp32, then squared and summed, per tile or in all).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.checks import (check_float_dtype, check_values,
                                   common_dtype, flatten_tokens)
from pallas_kernels.interpret import (check_interpret, default_interpret,
                                      warn_interpret_once)
from pallas_kernels.tiling import BlockConfig, check_block_config

__all__ = ["default_config", "wgrad_sqnorm", "wgrad_sqnorm_reference"]

# BlockConfig options of the fused kernel's epilogue, which this kernel (no
# weight, no state) does not have: they must keep their defaults.
_EPILOGUE_OPTIONS = ("prefetch", "stream_state", "split_out")


def default_config(bt: int, n_in: int, n_out: int, *,
                   interpret: bool) -> BlockConfig:
  """The tiling :func:`wgrad_sqnorm` takes without a ``config``.

  Compiled: 128x128 tiles, 32 token rows per step, in groups of 8 tiles
  along ``in``, 8 warps, 3 stages -- a plain GEMM tiling (the epilogue loads
  no state, so the accumulator may take the registers); not tuned. In
  interpret mode :meth:`BlockConfig.default`. Shrunk to fit the problem.
  """
  if interpret:
    return BlockConfig.default(bt, n_in, n_out)
  return BlockConfig(block_in=128, block_out=128, block_bt=32, group_in=8,
                     num_warps=8, num_stages=3).fit(bt, n_in, n_out)


def _and(a, b):
  if a is None:
    return b
  return a if b is None else a & b


def _sqnorm_kernel(x_ref, dy_ref, out_ref, *, cfg: BlockConfig, bt: int,
                   n_in: int, n_out: int, precision):
  """One tile: ``sum(G_tile ** 2)`` stored at ``out[ti * tiles_out + to]``."""
  bi, bo, bk = cfg.block_in, cfg.block_out, cfg.block_bt
  # Grouped tile order, as the fused kernel walks its tiles: `group_in`
  # tiles down `in` before the next `out` column, so programs in flight
  # share chunks of dy.
  pid = pl.program_id(0)
  tiles_in = pl.cdiv(n_in, bi)
  tiles_out = pl.cdiv(n_out, bo)
  per_group = cfg.group_in * tiles_out
  first_in = (pid // per_group) * cfg.group_in
  group_size = jnp.minimum(tiles_in - first_in, cfg.group_in)
  ti = first_in + (pid % per_group) % group_size
  to = (pid % per_group) // group_size

  # Masks only where the tiles do not divide a dimension. A masked load
  # reads zeros, so the rows and columns past the edges of G add nothing.
  row_ok = (ti * bi + jnp.arange(bi) < n_in)[None, :] if n_in % bi else None
  col_ok = (to * bo + jnp.arange(bo) < n_out)[None, :] if n_out % bo else None

  def body(k, acc):
    k_ok = (k * bk + jnp.arange(bk) < bt)[:, None] if bt % bk else None
    x_mask, dy_mask = _and(k_ok, row_ok), _and(k_ok, col_ok)
    xk = plgpu.load(x_ref.at[pl.ds(k * bk, bk), pl.ds(ti * bi, bi)],
                    mask=x_mask, other=None if x_mask is None else 0.0)
    dyk = plgpu.load(dy_ref.at[pl.ds(k * bk, bk), pl.ds(to * bo, bo)],
                     mask=dy_mask, other=None if dy_mask is None else 0.0)
    return acc + plgpu.dot(xk, dyk, trans_a=True, precision=precision)

  acc = lax.fori_loop(0, pl.cdiv(bt, bk), body,
                      jnp.zeros((bi, bo), jnp.float32))
  plgpu.store(out_ref.at[pl.ds(ti * tiles_out + to, 1)],
              jnp.sum(acc * acc).reshape(1))


@functools.partial(jax.jit, inline=jax.Inline.JAX_EARLY,
                   static_argnames=("cfg", "interpret", "precision"))
def _launch(x2, dy2, cfg: BlockConfig, interpret: bool, precision):
  # (Jitted: one compile per case for eager calls, not one per call;
  # inlined where traced inside another function.)
  bt, n_in = x2.shape
  n_out = dy2.shape[1]
  tiles_in, tiles_out = pl.cdiv(n_in, cfg.block_in), pl.cdiv(n_out,
                                                             cfg.block_out)
  kernel = functools.partial(_sqnorm_kernel, cfg=cfg, bt=bt, n_in=n_in,
                             n_out=n_out, precision=precision)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((tiles_in * tiles_out,), jnp.float32),
      grid=(tiles_in * tiles_out,),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret,
      name="wgrad_sqnorm",
  )(x2, dy2)
  return out.reshape(tiles_in, tiles_out)


def _checked(x, dy, where: str):
  """``x`` and ``dy`` as ``(BT, in)``, ``(BT, out)`` arrays of one dtype
  (arrays, as the updates take them: not torch tensors or lists)."""
  check_values(where, x=x, dy=dy)
  for name, a in (("x", x), ("dy", dy)):
    check_float_dtype(name, a)
  x, dy = jnp.asarray(x), jnp.asarray(dy)
  for name, a in (("x", x), ("dy", dy)):
    if a.ndim < 1:
      raise ValueError(f"{name} needs at least one dimension, got a scalar")
  if x.shape[:-1] != dy.shape[:-1]:
    raise ValueError(
        f"x and dy must share leading (token) dimensions, got {x.shape} and "
        f"{dy.shape}")
  if x.shape[-1] == 0 or dy.shape[-1] == 0:
    raise ValueError(f"x {x.shape} and dy {dy.shape} give a weight gradient "
                     "with a zero-size dimension")
  common = common_dtype(x, dy)
  return flatten_tokens(x.astype(common), dy.astype(common))


def wgrad_sqnorm(x: jax.Array, dy: jax.Array, *,
                 config: BlockConfig | None = None,
                 interpret: bool | None = None,
                 partials: bool = False) -> jax.Array:
  """``sum((x^T dy) ** 2)`` in fp32, without storing ``x^T dy``.

  The squared Frobenius norm of a linear layer's weight gradient
  ``G = x^T dy``, computed tile by tile in registers.

  Args:
    x: layer input, ``(..., in)``; leading dimensions are the tokens.
    dy: gradient of the layer output, ``(..., out)``, same leading dims. Of
      different float dtypes, both are promoted to their common dtype first,
      as ``jnp.dot`` does; float64 is refused. fp32 operands get IEEE fp32
      products (not TF32), 16-bit ones fp32 accumulation.
    config: tiling (``block_in``, ``block_out``, ``block_bt``, ``group_in``,
      ``num_warps``, ``num_stages``; the epilogue options ``prefetch``,
      ``stream_state`` and ``split_out`` must keep their defaults); default
      :func:`default_config`.
    interpret: run in Pallas interpret mode (CPU); default: unless on a GPU
      (without one, the first such call gives an ``InterpretModeWarning``).
    partials: return the per-tile sums, a ``(tiles_in, tiles_out)`` fp32
      array (``tiles_in = ceil(in / block_in)``, ...; entry ``(i, j)`` is the
      sum over tile ``(i, j)`` of ``G``), instead of their total.

  Returns:
    An fp32 scalar (or, with ``partials``, the per-tile array). With no
    token rows, zeros.

  Raises:
    TypeError: an operand that is not an array (a torch tensor, a list, a
      ``jax.ShapeDtypeStruct``), a non-float or float64 one, a ``config``
      that is not a ``BlockConfig``.
    ValueError: shapes that do not fit, an epilogue option set in
      ``config``.
  """
  x2, dy2 = _checked(x, dy, "wgrad_sqnorm")
  bt, n_in = x2.shape
  n_out = dy2.shape[1]
  check_block_config(config, "wgrad_sqnorm", "config")
  if config is not None:
    set_ = [n for n in _EPILOGUE_OPTIONS if getattr(config, n)
            != getattr(BlockConfig, n)]
    if set_:
      raise ValueError(
          f"wgrad_sqnorm(config=...): {set_} are options of the fused "
          "kernel's epilogue, which this kernel does not have; leave them "
          "at their defaults")
  interpret = check_interpret(interpret, "wgrad_sqnorm")
  if interpret is None:
    interpret = default_interpret()
    if interpret:
      warn_interpret_once()
  cfg = config or default_config(bt, n_in, n_out, interpret=interpret)
  if bt == 0:
    parts = jnp.zeros((pl.cdiv(n_in, cfg.block_in),
                       pl.cdiv(n_out, cfg.block_out)), jnp.float32)
  else:
    precision = (lax.Precision.HIGHEST if x2.dtype == jnp.float32 else None)
    parts = _launch(x2, dy2, cfg, bool(interpret), precision)
  return parts if partials else jnp.sum(parts)


def wgrad_sqnorm_reference(x, dy, *, partials: bool = False,
                           block_in: int = 64, block_out: int = 128):
  """Pure-``jnp`` reference of :func:`wgrad_sqnorm`: ``G = x^T dy`` formed
  in fp32 (IEEE products), squared and summed -- in all, or, with
  ``partials``, over each ``(block_in, block_out)`` tile (the kernel's
  ``config.block_in`` / ``block_out``), as a ``(tiles_in, tiles_out)``
  array."""
  x2, dy2 = _checked(x, dy, "wgrad_sqnorm_reference")
  if partials:
    for name, v in (("block_in", block_in), ("block_out", block_out)):
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"wgrad_sqnorm_reference: {name} must be a "
                         f"positive int (a tile's width), got {v!r}")
  g = jnp.dot(x2.T, dy2, precision=lax.Precision.HIGHEST,
              preferred_element_type=jnp.float32)
  sq = g * g
  if not partials:
    return jnp.sum(sq)
  n_in, n_out = g.shape
  ti, to = -(-n_in // block_in), -(-n_out // block_out)
  sq = jnp.pad(sq, ((0, ti * block_in - n_in), (0, to * block_out - n_out)))
  return sq.reshape(ti, block_in, to, block_out).sum(axis=(1, 3))
