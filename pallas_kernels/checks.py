"""Input checks shared by the kernels and their references."""

from __future__ import annotations

from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.rules import HPARAM_VECTOR_LEN, UpdateRule

__all__ = ["STORAGE_DTYPES", "check_float_dtype", "check_inputs",
           "check_rule", "check_storage_dtype", "checked_inputs",
           "checked_state_inputs", "common_dtype", "flatten_tokens",
           "slot_tuple", "state_arrays"]

# The dtypes a weight and a plain (not quantized) slot are stored in: the
# rules compute in fp32 and promote the weight's and slots' dtypes together
# (UpdateRule.output_dtype), which JAX does not do for 8- and 4-bit floats.
STORAGE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16,
                                              jnp.float16))


def check_rule(rule, where: str) -> None:
  """Refuses a ``rule`` that is not an
  :class:`~pallas_kernels.rules.UpdateRule` (a family's name, ``None``)."""
  if not isinstance(rule, UpdateRule):
    raise TypeError(f"{where}: rule must be an UpdateRule (e.g. "
                    f"pallas_kernels.ADAMW), got {type(rule).__name__}")


def slot_tuple(slots, rule: UpdateRule, where: str) -> tuple:
  """``slots`` as a tuple, refused in plain words when it is not a sequence
  of the rule's slots (``None``, one array, one quantized pair, a mapping,
  ...)."""
  from pallas_kernels.quant import Quantized  # noqa: PLC0415

  if isinstance(slots, Quantized):
    got = "one pallas_kernels.quant.Quantized pair"
  elif hasattr(slots, "shape"):  # (an array iterates over its rows)
    got = (f"one array of shape {tuple(slots.shape)}; wrap it as (slot,) "
           "for a one-slot rule")
  elif slots is None or isinstance(slots, (str, bytes, Mapping)) or (
      not isinstance(slots, Iterable)):
    got = repr(None) if slots is None else type(slots).__name__
  else:
    return tuple(slots)
  want = (f"a sequence with one entry per slot of rule {rule.name!r}, "
          f"{rule.slots} (each an array, or a quantized slot's "
          "pallas_kernels.quant.Quantized pair), e.g. a tuple"
          if rule.slots else
          f"an empty sequence, (), for rule {rule.name!r}, which keeps no "
          "state")
  raise TypeError(f"{where}: slots must be {want}; got {got}")


def check_values(where: str, **arrays) -> None:
  """Refuses, by name, an operand that is a shape-only stand-in
  (``jax.ShapeDtypeStruct``: what :func:`describe_backend` takes) or a
  torch tensor where the call needs JAX arrays' values. A sequence (the
  slots) is checked entry by entry, a quantized slot's pair
  (``quant.Quantized``) field by field."""
  for name, a in arrays.items():
    items = ([(f"{name}[{i}]", v) for i, v in enumerate(a)]
             if isinstance(a, (list, tuple)) and not hasattr(a, "_fields")
             else [(name, a)])
    flat = []
    for label, v in items:
      if hasattr(v, "_fields"):  # a quantized slot's (q, scale)
        flat += [(f"{label}.{f}", getattr(v, f)) for f in v._fields]
      else:
        flat.append((label, v))
    for label, v in flat:
      if isinstance(v, jax.ShapeDtypeStruct):
        raise TypeError(
            f"{where}: {label} is a jax.ShapeDtypeStruct, a shape-only "
            "stand-in (what describe_backend takes); the update needs the "
            "array itself")
      if type(v).__module__.split(".")[0] == "torch":
        raise TypeError(
            f"{where}: {label} is a {type(v).__name__} from torch; "
            "pallas_kernels takes JAX arrays (forge_torch runs these kernels "
            "on torch tensors, or convert with jax.dlpack.from_dlpack)")


def check_float_dtype(name: str, a) -> None:
  """Refuses a non-array, non-float or float64 ``a`` (named ``name``)."""
  if not hasattr(a, "dtype") or not hasattr(a, "shape"):
    raise TypeError(f"{name} must be an array, got {type(a).__name__}")
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {a.dtype}")
  if jax.dtypes.canonicalize_dtype(a.dtype) == jnp.float64:
    raise TypeError(
        f"{name} is float64: the fused kernel computes in fp32 and stores "
        "fp32, bf16 or fp16; cast it (e.g. to float32) first")


def check_storage_dtype(name: str, a, *, slot: bool = False) -> None:
  """:func:`check_float_dtype`, and refuses a weight or plain slot ``a``
  (named ``name``; ``slot``: a slot) that is not float32, bfloat16 or
  float16: 8- and 4-bit floats have no arithmetic with float32 in JAX."""
  check_float_dtype(name, a)
  dtype = jnp.dtype(jax.dtypes.canonicalize_dtype(a.dtype))
  if dtype in STORAGE_DTYPES:
    return
  hint = (". For 8-bit moments pass a pallas_kernels.quant.Quantized pair "
          "instead: int8, float8_e4m3fn or float8_e5m2 codes with their "
          "per-block scales (quant.quantize(values, fmt) makes it)"
          if slot else "")
  raise TypeError(
      f"{name} is {dtype.name}; a weight and a plain slot must be float32, "
      f"bfloat16 or float16 (the update computes in float32 and stores in "
      f"their dtypes, and JAX has no promotion between {dtype.name} and "
      f"float32){hint}")


def common_dtype(x, dy):
  """The dtype ``x`` and ``dy`` are promoted to (as ``jnp.dot`` does),
  refused in plain words where JAX has none (an 8-bit float beside
  another dtype)."""
  try:
    return jnp.result_type(x, dy)
  except jax.dtypes.TypePromotionError:
    raise TypeError(
        f"x is {jnp.dtype(x.dtype).name} and dy {jnp.dtype(dy.dtype).name}, "
        "which JAX does not promote to a common dtype: cast one to the "
        "other's dtype (or both to bfloat16)") from None


def check_inputs(x, dy, w, slots, hparams, rule: UpdateRule, layer=None):
  """Checks the arguments of a kernel call (``fused_wgrad_update``'s)
  before anything is traced.

  Raises:
    TypeError: a non-float or float64 array, a weight or plain slot that
      is not float32, bfloat16 or float16 (:func:`check_storage_dtype`), a
      non-integer ``layer``.
    ValueError: shapes that do not fit together, slots that do not match
      ``rule.slots``, ``hparams`` that is not ``rule.pack(...)``'s vector.
    IndexError: a concrete ``layer`` out of range.
  """
  for name, a in (("x", x), ("dy", dy)):
    check_float_dtype(name, a)
  check_storage_dtype("w", w)
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
    check_storage_dtype(f"slot {name!r}", s, slot=True)
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
  common = common_dtype(x, dy)
  return x.astype(common), dy.astype(common), w, slots


def planned_slots(slots, rule: UpdateRule, w, formats, stochastic_rounding,
                  *, where: str):
  """The rule and ``slots`` checked, and the state's plan
  (:func:`pallas_kernels.lowp.plan_state`): ``(slots, plan, stand_ins)``,
  ``slots`` as a tuple and ``stand_ins`` the arrays :func:`check_inputs`
  checks in their place. What every call that takes possibly quantized
  slots checks first, and what ``describe_backend`` checks as it does."""
  from pallas_kernels import lowp  # noqa: PLC0415 -- lowp imports rules

  check_rule(rule, where)
  slots = slot_tuple(slots, rule, where)
  check_float_dtype("w", w)  # (the plan reads its shape)
  plan, stand_ins = lowp.plan_state(slots, rule, w, formats,
                                    stochastic_rounding, where=where)
  return slots, plan, stand_ins


def checked_state_inputs(x, dy, w, slots, hparams, rule: UpdateRule,
                         layer=None, formats=None, stochastic_rounding=None,
                         *, where: str, stand_ins: bool = False):
  """:func:`checked_inputs` for a call whose slots may be quantized and
  whose weight may be stored by stochastic rounding
  (:func:`pallas_kernels.lowp.plan_state` checks those).

  With ``stand_ins``, ``x`` and ``dy`` are ``jax.ShapeDtypeStruct``
  stand-ins of the right widths (a stored gradient's call): they are
  checked and returned as they are. Otherwise such a stand-in, or a torch
  tensor, is refused (:func:`check_values`).

  Returns:
    ``(x, dy, w, slots, plan)``: ``plan`` ``None`` for plain state (the
    arrays as :func:`checked_inputs` returns them), else the
    :class:`~pallas_kernels.lowp.StatePlan`, with each quantized slot a
    ``Quantized`` pair of JAX arrays.
  """
  if stand_ins:
    check_values(where, w=w, slots=slots)
  else:
    check_values(where, x=x, dy=dy, w=w, slots=slots)
  slots, plan, slot_stand_ins = planned_slots(
      slots, rule, w, formats, stochastic_rounding, where=where)
  if plan is None and not stand_ins:
    x, dy, w, slots = checked_inputs(x, dy, w, slots, hparams, rule, layer)
    return x, dy, w, slots, None
  check_inputs(x, dy, w, slot_stand_ins, hparams, rule, layer)
  if stand_ins:  # (stored_g_update)
    return x, dy, jnp.asarray(w), state_arrays(slots), plan
  x, dy, w = jnp.asarray(x), jnp.asarray(dy), jnp.asarray(w)
  common = common_dtype(x, dy)
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
