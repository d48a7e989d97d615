"""Input checks shared by the kernels and their references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.rules import HPARAM_VECTOR_LEN, UpdateRule

__all__ = ["check_float_dtype", "check_inputs", "checked_inputs",
           "checked_state_inputs", "flatten_tokens", "state_arrays"]


def check_float_dtype(name: str, a) -> None:
  """Refuses a non-float or float64 array ``a`` (named ``name``)."""
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {a.dtype}")
  if jax.dtypes.canonicalize_dtype(a.dtype) == jnp.float64:
    raise TypeError(
        f"{name} is float64: the fused kernel computes in fp32 and stores "
        "fp32, bf16 or fp16; cast it (e.g. to float32) first")


def check_inputs(x, dy, w, slots, hparams, rule: UpdateRule, layer=None):
  """Checks the arguments of a kernel call (``fused_wgrad_update``'s)
  before anything is traced.

  Raises:
    TypeError: a non-float or float64 array, a non-integer ``layer``.
    ValueError: shapes that do not fit together, slots that do not match
      ``rule.slots``, ``hparams`` that is not ``rule.pack(...)``'s vector.
    IndexError: a concrete ``layer`` out of range.
  """
  for name, a in (("x", x), ("dy", dy), ("w", w)):
    check_float_dtype(name, a)
  if layer is None and w.ndim != 2:
    raise ValueError(f"w must be 2-D (in, out), got shape {w.shape}")
  if layer is not None:
    if w.ndim != 3:
      raise ValueError(
          f"with layer=..., w must be a stack (L, in, out), got shape {w.shape}")
    # A concrete index goes through NumPy: under an explicit-sharding
    # (abstract) mesh, jnp.asarray(1) inside jit is a tracer and int() of it
    # fails.
    concrete = not isinstance(layer, jax.core.Tracer)
    layer_a = np.asarray(layer) if concrete else layer
    if layer_a.shape != () or not jnp.issubdtype(layer_a.dtype, jnp.integer):
      raise TypeError(f"layer must be an integer scalar, got {layer_a.dtype}"
                      f"{list(layer_a.shape)}")
    if concrete:
      index = int(layer_a)  # concrete: a Python, NumPy or JAX integer
      if not 0 <= index < w.shape[0]:
        raise IndexError(
            f"layer={index} is out of range for {w.shape[0]} layers")
  if x.ndim < 1 or dy.ndim < 1:
    raise ValueError(
        f"x and dy need at least one dimension, got {x.shape} and {dy.shape}")
  n_in, n_out = w.shape[-2:]
  if n_in == 0 or n_out == 0:
    raise ValueError(f"w has a zero-size dimension, shape {w.shape}: there is "
                     "no weight to update")
  if x.shape[-1] != n_in:
    raise ValueError(f"x's last dimension {x.shape[-1]} != w.shape[0]={n_in}")
  if dy.shape[-1] != n_out:
    raise ValueError(
        f"dy's last dimension {dy.shape[-1]} != w.shape[1]={n_out}")
  if x.shape[:-1] != dy.shape[:-1]:
    raise ValueError(
        f"x and dy must share leading (token) dimensions, got {x.shape} and "
        f"{dy.shape}")
  if len(slots) != len(rule.slots):
    raise ValueError(
        f"rule {rule.name!r} needs slots {rule.slots}, got {len(slots)} arrays")
  for name, s in zip(rule.slots, slots):
    check_float_dtype(f"slot {name!r}", s)
    if s.shape != w.shape:
      raise ValueError(
          f"slot {name!r} has shape {s.shape}, expected w's shape {w.shape}")
  shape, dtype = getattr(hparams, "shape", None), getattr(hparams, "dtype", None)
  if shape != (HPARAM_VECTOR_LEN,) or dtype != jnp.float32:
    got = (f"{dtype}{list(shape)}" if shape is not None and dtype is not None
           else type(hparams).__name__)
    raise ValueError(
        f"hparams must be a float32 vector of length {HPARAM_VECTOR_LEN} (use"
        f" rule.pack(...)), got {got}")


def checked_inputs(x, dy, w, slots, hparams, rule: UpdateRule, layer=None):
  """:func:`check_inputs`, then the arrays both the kernel and its reference
  take: NumPy inputs as JAX arrays (float64 under x64-off canonicalises to
  float32), ``x`` and ``dy`` promoted to their common dtype, as ``jnp.dot``
  does (the kernel's dot needs one operand dtype)."""
  slots = tuple(slots)
  check_inputs(x, dy, w, slots, hparams, rule, layer)
  x, dy, w = jnp.asarray(x), jnp.asarray(dy), jnp.asarray(w)
  slots = tuple(jnp.asarray(a) for a in slots)
  common = jnp.result_type(x, dy)
  return x.astype(common), dy.astype(common), w, slots


def checked_state_inputs(x, dy, w, slots, hparams, rule: UpdateRule,
                         layer=None, formats=None, stochastic_rounding=None,
                         *, where: str):
  """:func:`checked_inputs` for a call whose slots may be quantized and
  whose weight may be stored by stochastic rounding
  (:func:`pallas_kernels.lowp.plan_state` checks those).

  ``x`` and ``dy`` may be ``jax.ShapeDtypeStruct`` stand-ins of the right
  widths (a stored gradient's call): they are checked and returned as
  they are.

  Returns:
    ``(x, dy, w, slots, plan)``: ``plan`` ``None`` for plain state (the
    arrays as :func:`checked_inputs` returns them), else the
    :class:`~pallas_kernels.lowp.StatePlan`, with each quantized slot a
    ``Quantized`` pair of JAX arrays.
  """
  from pallas_kernels import lowp  # noqa: PLC0415 -- lowp imports rules

  slots = tuple(slots)
  plan, stand_ins = lowp.plan_state(slots, rule, w, formats,
                                    stochastic_rounding, where=where)
  if plan is None and not isinstance(x, jax.ShapeDtypeStruct):
    x, dy, w, slots = checked_inputs(x, dy, w, slots, hparams, rule, layer)
    return x, dy, w, slots, None
  check_inputs(x, dy, w, stand_ins, hparams, rule, layer)
  if isinstance(x, jax.ShapeDtypeStruct):  # stand-ins (stored_g_update)
    return x, dy, jnp.asarray(w), state_arrays(slots), plan
  x, dy, w = jnp.asarray(x), jnp.asarray(dy), jnp.asarray(w)
  common = jnp.result_type(x, dy)
  return (x.astype(common), dy.astype(common), w, state_arrays(slots),
          plan)


def state_arrays(slots) -> tuple:
  """The slots as JAX arrays, a quantized one as a ``Quantized`` pair."""
  from pallas_kernels.quant import Quantized  # noqa: PLC0415

  return tuple(Quantized(jnp.asarray(a.q), jnp.asarray(a.scale))
               if isinstance(a, Quantized) else jnp.asarray(a)
               for a in slots)


def flatten_tokens(x, dy):
  """``x`` and ``dy`` with their token dimensions flattened into one."""
  return x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
