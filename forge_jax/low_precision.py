"""Low-precision optimizer state for the forge_jax transforms: int8 and fp8
moments, stochastic-rounded bf16 weights.

``forge_jax.adamw(..., moments="int8")`` (and the other families that keep
moments, :data:`FAMILIES`) returns a transform whose state is this module's
:class:`LowPrecisionState`-style NamedTuple: the step count and, per slot
(``mu``, ``nu``, ...), a params-shaped tree whose leaves are
``pallas_kernels.quant.Quantized(q, scale)`` pairs -- int8 or fp8 codes of
the parameter's shape and one float32 scale per 64 consecutive elements of
its last axis -- for parameters of at least
``pallas_kernels.quant.MIN_QUANTIZED_SIZE`` (4096) elements, and float
arrays for smaller ones (biases, norm scales), as bitsandbytes keeps them.
FORGE kernels step it in the fused kernel's epilogue; every other parameter
is stepped by this transform with the same rule and the same quantizer
(``pallas_kernels.lowp.apply``), so the whole model's state is one format.

A stacked parameter (the ``(L, in, out)`` kernel of a
``forge_jax.ScannedDenseStack`` or of a layer in ``forge_jax.ScannedBlocks``)
is one leaf: its moments are stacked ``Quantized(q (L, in, out), scale (L,
in, ceil(out / 64)))`` pairs, whose blocks lie within one row of one layer,
so the scanned stack's backward requantizes layer ``i`` of them in place
and gets the bits this transform gives the whole leaf.

``stochastic_rounding=True`` stores bfloat16 parameters by stochastic
rounding (``pallas_kernels.quant.stochastic_round_to_bf16``): the random
bits hash ``(seed of the parameter, step, element index)``, where the
parameter's seed is ``(seed + crc32(its key path)) mod 2**32``
(:func:`param_seed`) and the step is the 1-based step number, so a run is
reproducible and independent of the kernel's tiling; the element index is
the flat index in the whole parameter, a stacked one's earlier layers
counted in (``pallas_kernels.quant.global_index``), so a scanned stack that
steps layer ``i`` on its own draws the bits of the whole leaf's update.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import zlib
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax
from optax._src import numerics

import pallas_kernels
from pallas_kernels import lowp, quant
from pallas_kernels.quant import MomentFormat, Quantized

__all__ = ["FAMILIES", "LowPrecision", "MOMENT_KINDS", "param_seed",
           "state_class"]

# The forge_jax families that take `moments=` and `stochastic_rounding=`:
# the regime-1 families, whose whole step runs in the kernel's epilogue.
FAMILIES = ("adam", "adamw", "nadam", "nadamw", "radam", "adamax", "lion",
            "sgd", "rmsprop", "adagrad")

# moments= names: int8, or fp8 (float8_e4m3fn: with 64-element blocks and
# the second-moment floor it measured closer to fp32 state than e5m2 for
# second moments, docs/optimizers.md), or one fp8 kind for every slot.
MOMENT_KINDS = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")

# int8 codes cross a custom_vjp as their bit pattern in this float dtype: a
# cotangent must be floating point, and the bits are never computed on.
_TRANSPORT = jnp.dtype(jnp.float8_e4m3fn)


def param_seed(seed, keypath):
  """The stochastic-rounding seed of the parameter at ``keypath`` (a key
  path of the params tree): ``(seed + crc32(keystr(keypath))) mod 2**32``,
  so that parameters draw independent bits. A dict key that is not a
  string (an ``nnx.List`` index in an NNX state) is hashed as its string,
  so that a state and its string-keyed form (``forge_jax.nnx``'s step)
  seed a parameter alike. A Python int for an int ``seed``, else a uint32
  array."""
  keypath = tuple(
      jax.tree_util.DictKey(str(k.key))
      if isinstance(k, jax.tree_util.DictKey) and not isinstance(k.key, str)
      else k for k in keypath)
  crc = zlib.crc32(jax.tree_util.keystr(keypath).encode())
  if isinstance(seed, int):
    return (seed + crc) % 2 ** 32
  return jnp.asarray(seed).astype(jnp.uint32) + jnp.uint32(crc)


_STATE_CLASSES: dict[tuple[str, ...], type] = {}


def state_class(slots: tuple[str, ...]) -> type:
  """The NamedTuple state of a low-precision transform with these slots:
  ``(count, *slots)``, e.g. ``LowPrecisionState(count, mu, nu)``. One class
  per slot tuple, also reachable as ``forge_jax.low_precision.
  LowPrecisionState_mu_nu`` (so that it pickles). The classes of the
  :data:`FAMILIES`' rules are made when this module is imported, so a
  process that imports ``forge_jax`` unpickles their states before it has
  built a transform; another slot tuple's class is made on first use."""
  slots = tuple(slots)
  cls = _STATE_CLASSES.get(slots)
  if cls is None:
    name = "_".join(("LowPrecisionState",) + slots)
    cls = NamedTuple("LowPrecisionState",
                     [("count", jax.Array)] + [(s, Any) for s in slots])
    cls.__qualname__ = name
    cls.__module__ = __name__
    cls.__doc__ = (
        f"State of a low-precision forge_jax transform: the step count and "
        f"the slots {slots}, each a params-shaped tree of "
        "pallas_kernels.quant.Quantized(q, scale) pairs (parameters of at "
        "least 4096 elements) or float arrays.")
    globals()[name] = cls
    _STATE_CLASSES[slots] = cls
  return cls


def _family_slot_tuples() -> list[tuple[str, ...]]:
  """The slot tuples of the :data:`FAMILIES`' rules, in every variant their
  factories make (each of their bool options on and off: SGD with and
  without momentum, RMSprop centered or with momentum, ...)."""
  found = []
  for name in FAMILIES:
    factory = pallas_kernels.families.get(name).optax_factory
    options = [p.name for p in inspect.signature(factory).parameters.values()
               if isinstance(p.default, bool)]
    for values in itertools.product((False, True), repeat=len(options)):
      try:
        slots = tuple(factory(**dict(zip(options, values))).slots)
      except (TypeError, ValueError):  # an option set the factory refuses
        continue
      if slots not in found:
        found.append(slots)
  return found


# The families' state classes, made now: their states unpickle in a process
# that has built no transform yet.
for _slots in _family_slot_tuples():
  state_class(_slots)


# What has a dtype without being one: jnp.dtype would take its dtype.
_VALUES = (np.ndarray, np.generic, jax.Array)


def _check_flag(where: str, stochastic_rounding) -> None:
  if not isinstance(stochastic_rounding, (bool, np.bool_)):
    raise TypeError(f"{where}: stochastic_rounding must be True or False, "
                    f"got {stochastic_rounding!r:.80}")


def _float_dtype(moments):
  """``moments`` as a float dtype of two bytes or more -- given as a dtype,
  a scalar type (``jnp.bfloat16``) or a dtype's name (``'bfloat16'``) --
  else ``None``. A value (an array, a NumPy or JAX scalar) is not one,
  though ``jnp.dtype`` would take it for its dtype; nor is a mapping, which
  NumPy would read as a structured dtype's fields."""
  if isinstance(moments, (*_VALUES, Mapping)):
    return None
  try:
    dtype = jnp.dtype(moments)
  except (TypeError, ValueError):
    return None
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 2:
    return dtype
  return None


@dataclasses.dataclass(frozen=True, eq=False)
class LowPrecision:
  """A transform's low-precision settings (static; part of its spec).

  Attributes:
    family: the forge_jax family (for errors).
    slots: the rule's slot names.
    formats: per slot, the :class:`MomentFormat` of a quantized moment, or
      ``None`` where the slot stays a float array.
    float_dtypes: per slot, the dtype of the float arrays (``None``: the
      dtype the family's optax transform gives it, ``default_dtypes``);
      for a quantized slot, the dtype of the small parameters' moments.
    default_dtypes: per slot, ``fn(param) -> dtype`` as optax gives it.
    stochastic_rounding: store bfloat16 parameters by stochastic rounding.
    seed: the stochastic-rounding seed (a Python int, or an integer scalar
      array where ``optax.inject_hyperparams`` passed one).
    second: per slot, whether it is a second moment.
  """

  family: str
  slots: tuple[str, ...]
  formats: tuple[Optional[MomentFormat], ...]
  float_dtypes: tuple[Any, ...]
  default_dtypes: tuple[Callable[[Any], Any], ...]
  stochastic_rounding: bool
  seed: int
  second: tuple[bool, ...]

  @property
  def quantized(self) -> bool:
    """Whether any moment is quantized (for large enough parameters)."""
    return any(f is not None for f in self.formats)

  def slot_dtype(self, i: int, param):
    d = self.float_dtypes[i]
    return jnp.dtype(d) if d is not None else jnp.dtype(
        self.default_dtypes[i](param))

  def sr_for(self, param) -> bool:
    """Stochastic rounding applies to ``param`` (a bfloat16 parameter with
    at least one element: an empty one has nothing to round)."""
    return (self.stochastic_rounding
            and jnp.dtype(jnp.result_type(param)) == jnp.bfloat16
            and math.prod(jnp.shape(param)) > 0)

  def quantizes(self, i: int, shape) -> bool:
    """Whether slot ``i`` of a parameter of ``shape`` is quantized (a
    ``Quantized`` pair) rather than a float array."""
    fmt = self.formats[i]
    return fmt is not None and bool(shape) and fmt.quantizes(shape)

  def describe(self) -> str:
    """What this transform's state holds, in words: each slot's format."""
    kept = []
    for s, f, d in zip(self.slots, self.formats, self.float_dtypes):
      if f is not None:
        kept.append(f"{s} as {f.kind} codes")
      elif d is not None:
        kept.append(f"{s} as {jnp.dtype(d).name} arrays")
      else:
        kept.append(f"{s} as float arrays")
    return ", ".join(kept) if kept else "no moments"

  def init_slot(self, i: int, param, value: float = 0.0):
    """Slot ``i``'s initial state for ``param``: quantized (``value``
    everywhere) or a float array.

    Every block of a constant holds the same values (a partial last block
    too: its missing columns count as zeros, which leave its absmax
    ``|value|``), so one block is quantized and its code and scale are
    broadcast: ``quant.quantize`` of the whole constant, bit for bit,
    without a parameter-sized float32 array (which XLA would also try to
    constant-fold under ``jax.jit``, for minutes at billions of elements).
    A parameter with no elements (``min_size=0``) gets empty codes and
    scales, as ``quant.quantize`` gives it.
    """
    fmt = self.formats[i]
    shape = tuple(jnp.shape(param))
    if self.quantizes(i, shape):
      one = quant.quantize(
          jnp.full((1, max(1, min(shape[-1], fmt.block))), value,
                   jnp.float32), fmt, second_moment=self.second[i])
      return Quantized(jnp.broadcast_to(one.q[0, 0], shape),
                       jnp.broadcast_to(one.scale[0, 0],
                                        fmt.scale_shape(shape)))
    return jnp.full(shape, value, self.slot_dtype(i, param))

  def plan(self, slots, param) -> lowp.StatePlan:
    """The kernel's plan for ``param``'s slots (as stored)."""
    return lowp.StatePlan(
        tuple(lowp.SlotPlan(f if isinstance(s, Quantized) else None, sec)
              for f, s, sec in zip(self.formats, slots, self.second)),
        self.sr_for(param))

  def kernel_formats(self, slots):
    """``formats=`` for the kernel call: each quantized slot's format."""
    return tuple(f if isinstance(s, Quantized) else None
                 for f, s in zip(self.formats, slots))


def make(family: str, rule: pallas_kernels.UpdateRule, moments,
         stochastic_rounding: bool, seed,
         default_dtypes: tuple[Callable[[Any], Any], ...],
         dtype_options: tuple[tuple[int, str, Any], ...] = ()
         ) -> Optional[LowPrecision]:
  """The :class:`LowPrecision` of a transform's arguments, or ``None`` when
  they ask for neither (``moments=None``, ``stochastic_rounding=False``):
  the transform is then optax's own. ``dtype_options``: the transform's
  own options that set a slot's stored dtype, ``(slot index, name,
  value)`` (``mu_dtype``: the first moment's), which ``moments`` must not
  also set.

  Raises:
    TypeError: ``stochastic_rounding`` is not a bool, or ``seed`` not an
      integer.
    ValueError: ``moments`` is not a known kind, a float dtype or a
      ``MomentFormat``, or does not fit the optimizer's moments; ``moments``
      sets the stored dtype of a slot that a ``dtype_options`` entry sets
      too; ``seed`` without ``stochastic_rounding`` (it would do nothing).
  """
  where = f"forge_jax.{family}"
  _check_flag(where, stochastic_rounding)
  stochastic_rounding = bool(stochastic_rounding)
  if seed is not None:
    # A Python int, or an integer scalar array (optax.inject_hyperparams
    # passes numeric arguments as arrays).
    if isinstance(seed, bool) or not (isinstance(seed, int) or (
        hasattr(seed, "dtype") and jnp.issubdtype(seed.dtype, jnp.integer)
        and jnp.ndim(seed) == 0)):
      raise TypeError(f"{where}: seed must be an integer (the stochastic-"
                      f"rounding seed), got {seed!r:.80}")
    if not stochastic_rounding:
      raise ValueError(
          f"{where}: seed= is the stochastic-rounding seed and would do "
          "nothing with stochastic_rounding=False; pass "
          "stochastic_rounding=True, or leave seed out")
  if moments is None and not stochastic_rounding:
    return None
  seed = 0 if seed is None else seed
  slots = rule.slots
  second = tuple(s in rule.second_moments for s in slots)
  n = len(slots)
  if not slots and moments is not None:
    raise ValueError(
        f"{where}: moments={moments!r}, but this optimizer keeps no moments "
        "(plain SGD has no state); pass momentum=... or leave moments=None")
  formats, float_dtypes = (None,) * n, (None,) * n
  if moments is None:
    pass
  elif isinstance(moments, (tuple, list)):
    if len(moments) != n:
      raise ValueError(
          f"{where}: moments={moments!r} gives {len(moments)} formats; this "
          f"optimizer keeps {n} moments {slots} (one entry per moment, in "
          "that order, or one for all)")
    formats = tuple(_format_of(m, where, moments) for m in moments)
  elif (dtype := _float_dtype(moments)) is not None:
    float_dtypes = (dtype,) * n
  else:
    formats = (_format_of(moments, where, moments),) * n
  for i, option, value in dtype_options:
    if value is not None and (formats[i] is not None
                              or float_dtypes[i] is not None):
      raise ValueError(
          f"{where}: {option}={value!r} and moments={moments!r} both set "
          f"how the moment {slots[i]!r} is stored; pass one of them "
          f"({option} alone for that moment, moments= for all of them)")
  return LowPrecision(family=family, slots=slots, formats=formats,
                      float_dtypes=float_dtypes,
                      default_dtypes=tuple(default_dtypes),
                      stochastic_rounding=stochastic_rounding, seed=seed,
                      second=second)


def _format_of(kind, where: str, moments) -> MomentFormat:
  """One ``moments=`` entry as a :class:`MomentFormat`."""
  if isinstance(kind, MomentFormat):
    return kind
  if isinstance(kind, str) and kind in MOMENT_KINDS:
    return MomentFormat("fp8_e4m3" if kind == "fp8" else kind)
  shown = repr(moments)
  if isinstance(kind, _VALUES):
    shown = (
        f"<a {jnp.result_type(kind)}{list(np.shape(kind))} value> is a "
        "value, not a format or dtype (under optax.inject_hyperparams a "
        "dtype such as jnp.bfloat16 is callable: the wrapper takes it for a "
        "schedule and passes its value; give the dtype's name there, "
        "moments='bfloat16')")
  raise ValueError(
      f"{where}: moments={shown:.400}; use 'int8' (8-bit integer codes), "
      "'fp8' or 'fp8_e4m3' (float8_e4m3fn codes), 'fp8_e5m2' "
      "(float8_e5m2 codes) -- each with one float32 scale per 64 elements "
      "-- a pallas_kernels.quant.MomentFormat, a tuple of those with one "
      "per moment (e.g. ('fp8_e4m3', 'fp8_e5m2') for Adam's mu and nu), a "
      "float dtype such as jnp.bfloat16 or its name 'bfloat16' (every "
      "moment stored in it), or None (the dtypes optax gives them)")


def refuse(family: str, moments, stochastic_rounding) -> None:
  """Refuses ``moments=`` or ``stochastic_rounding=`` for a family that
  does not take them (regimes 2 and 3), in plain words."""
  _check_flag(f"forge_jax.{family}", stochastic_rounding)
  if moments is None and not stochastic_rounding:
    return
  raise ValueError(
      f"forge_jax.{family}: moments={moments!r}, stochastic_rounding="
      f"{stochastic_rounding!r}: low-precision optimizer state and "
      "stochastic rounding are supported for the families whose whole step "
      "runs in the fused kernel's epilogue -- " + ", ".join(FAMILIES)
      + f". {family}'s weight update reads a whole layer (a per-layer pass "
      "or a deferred update), which does not read quantized moments yet; "
      "leave moments=None and stochastic_rounding=False.")


# --- the transform: every parameter that is not a FORGE kernel --------------


class _Counts(NamedTuple):
  """The step count under the optax state names a family's hyperparameters
  read it from (all of them count steps alike)."""
  adam: Any
  rms: Any
  rstd: Any
  schedule: Any
  decay: Any


def count_view(count):
  """A tuple of optax states that all hold ``count``: what a family's
  ``hparams(state)`` reads its step counts from (``ScaleByAdamState``,
  ``ScaleByScheduleState``, ...), built from a low-precision state's one
  count."""
  from optax._src.transform import (  # noqa: PLC0415
      ScaleByRmsWithCountState, ScaleByRStdDevWithCountState)
  from optax.transforms._adding import WeightDecaySchedule  # noqa: PLC0415
  return _Counts(
      optax.ScaleByAdamState(count=count, mu=None, nu=None),
      ScaleByRmsWithCountState(count=count, nu=None),
      ScaleByRStdDevWithCountState(count=count, mu=None, nu=None),
      optax.ScaleByScheduleState(count=count),
      WeightDecaySchedule(count=count))


def state_type(state) -> Optional[type]:
  """The :func:`state_class` class of ``state`` (a low-precision
  transform's state), or of the first one an ``optax.chain``'s state
  holds; ``None`` where there is none."""
  if type(state) in _STATE_CLASSES.values():
    return type(state)
  if type(state) is tuple:
    return next((t for t in map(state_type, state) if t is not None), None)
  return None


def _fields(cls) -> str:
  return "(" + ", ".join(cls._fields) + ")"


# How to mend a state that the transform does not take.
REMEDY = ("Re-initialise it with this transform's init(params), or build the "
          "transform with the moments= and stochastic_rounding= the state "
          "was made with")


def check_state(lp: LowPrecision, state) -> None:
  """Refuses, in plain words, a ``state`` that is not the
  :func:`state_class` state this transform's ``init`` makes (optax's state
  of a transform without low-precision settings, or another optimizer's
  low-precision state), before anything reads its step count.

  Raises:
    ValueError: ``state`` is not of this transform's state class.
  """
  cls = state_class(lp.slots)
  if isinstance(state, cls):
    return
  kind = type(state)
  if kind in _STATE_CLASSES.values():
    what = (f"a {kind.__qualname__}{_fields(kind)}, another optimizer's "
            "low-precision state")
  elif isinstance(state, tuple):
    what = (f"a {kind.__name__} of optax states, as a transform with "
            "moments=None and stochastic_rounding=False keeps them")
  else:
    what = f"a {kind.__name__}"
  raise ValueError(
      f"forge_jax.{lp.family}: opt_state is {what}; this transform keeps "
      f"low-precision state, a {cls.__qualname__}{_fields(cls)} with "
      f"{lp.describe()}: was it made by this transform's init()? {REMEDY}.")


def _as_quantized(slot):
  """A slot leaf as this module steps it: a quantized moment held as a
  mapping ``{"q", "scale"}`` (``flax.nnx``'s state holds a ``Quantized``
  pair so) as its ``Quantized`` pair."""
  if isinstance(slot, Mapping) and set(slot) == {"q", "scale"}:
    return Quantized(slot["q"], slot["scale"])
  return slot


def _check_slot(lp: LowPrecision, i: int, slot, param, keypath) -> None:
  """Refuses a slot stored in another format than this transform's
  ``init`` gives ``param`` (quantized or float, the codes' dtype)."""
  fmt = lp.formats[i]
  want = lp.quantizes(i, tuple(jnp.shape(param)))
  got = isinstance(slot, Quantized)
  if want == got and (not got or jnp.dtype(slot.q.dtype) == fmt.dtype):
    return
  if got:
    has = f"{jnp.dtype(slot.q.dtype).name} codes"
  elif hasattr(slot, "dtype"):
    has = f"a {jnp.dtype(slot.dtype).name} array"
  else:
    has = f"a {type(slot).__name__}"
  keeps = (f"{fmt.kind} codes" if want else
           "a float array" + (" (below the format's min_size)"
                              if fmt is not None else ""))
  raise ValueError(
      f"forge_jax.{lp.family}: opt_state's {lp.slots[i]} of the parameter "
      f"at {jax.tree_util.keystr(tuple(keypath))} holds {has}, where this "
      f"transform keeps {keeps} ({lp.describe()}): was it made by this "
      f"transform's init()? {REMEDY}.")


def _mask_leaves(mask, params):
  """``mask`` (``None``, a tree, a prefix of ``params`` or a callable) as one
  bool per leaf of ``params`` (``None`` leaves stay ``None``)."""
  none = lambda x: x is None
  if mask is None:
    return jax.tree.map(lambda p: True, params, is_leaf=none)
  tree = mask(params) if callable(mask) else mask
  return jax.tree.map(
      lambda m, sub: jax.tree.map(lambda p: None if p is None else m, sub,
                                  is_leaf=none),
      tree, params, is_leaf=none)


def transform(lp: LowPrecision, rule: pallas_kernels.UpdateRule,
              hparams: Callable[[Any], dict], mask=None,
              init_values: Optional[dict[str, float]] = None
              ) -> optax.GradientTransformation:
  """The optax-style transform of a low-precision family.

  Args:
    lp: the settings.
    rule: the family's kernel rule (its update, in optax's operation order).
    hparams: ``hparams(state) -> dict``, the family's hyperparameters by
      ``rule.hparams`` name (``lr`` and ``weight_decay`` included), read
      from ``count_view(state.count)``.
    mask: the weight-decay mask (a tree, a prefix or a callable).
    init_values: initial slot values by name (Adagrad's accumulator, ...);
      0 otherwise.

  Returns:
    ``(init, update)``: ``init(params)`` builds ``state_class(rule.slots)``;
    ``update(grads, state, params)`` steps every parameter whose gradient
    is not ``None`` with ``rule`` and the quantizer, and returns the
    updates that ``optax.apply_updates`` turns into the new parameters.
  """
  cls = state_class(rule.slots)
  init_values = dict(init_values or {})
  none = lambda x: x is None

  def init_fn(params):
    slots = {
        name: jax.tree.map(
            lambda p, i=i, name=name: lp.init_slot(
                i, p, init_values.get(name, 0.0)), params)
        for i, name in enumerate(rule.slots)}
    return cls(count=jnp.zeros([], jnp.int32), **slots)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # (optax.chain passes its members' extra arguments)
    if params is None:
      raise ValueError(
          f"forge_jax.{lp.family} with low-precision state needs the "
          "parameters in update(grads, state, params): it returns the "
          "difference between the new and the old parameters")
    check_state(lp, state)
    count_inc = numerics.safe_increment(state.count)
    h = dict(hparams(count_view(state.count)))
    packed = {
        on: rule.pack(**(h if on or "weight_decay" not in h
                         else {**h, "weight_decay": 0.0}))
        for on in (True, False)}
    wd = _mask_leaves(mask, params)
    flat_p, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=none)
    def_ = jax.tree.structure(params, is_leaf=none)
    flat_g = def_.flatten_up_to(updates)
    flat_wd = def_.flatten_up_to(wd)
    flat_s = [def_.flatten_up_to(getattr(state, n)) for n in rule.slots]
    out_u, out_s = [], [[] for _ in rule.slots]
    for k, ((kp, p), g, on) in enumerate(zip(flat_p, flat_g, flat_wd)):
      slots = tuple(s[k] for s in flat_s)
      if p is None or g is None:
        out_u.append(None)
        for j, s in enumerate(slots):
          out_s[j].append(s)
        continue
      stored = tuple(_as_quantized(s) for s in slots)
      for j, s in enumerate(stored):
        _check_slot(lp, j, s, p, kp)
      sr = ((param_seed(lp.seed, kp), count_inc) if lp.sr_for(p) else None)
      w_new, new = step_leaf(lp, rule, g, p, stored, packed[bool(on)], sr)
      out_u.append(w_new.astype(jnp.float32) - jnp.asarray(p, jnp.float32))
      for j, s in enumerate(new):
        out_s[j].append(s)
    new_state = cls(count=count_inc, **{
        n: def_.unflatten(v) for n, v in zip(rule.slots, out_s)})
    return def_.unflatten(out_u), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def step_leaf(lp: LowPrecision, rule, g, p, slots, hparams, sr):
  """One parameter's step by the reference: ``(w_new, new_slots)``; a
  scalar parameter is stepped as a one-element vector."""
  p = jnp.asarray(p)
  shape = p.shape
  if p.ndim == 0:
    g, p = jnp.reshape(g, (1,)), jnp.reshape(p, (1,))
    slots = tuple(jnp.reshape(s, (1,)) for s in slots)
  plan = lp.plan(slots, p)
  w_new, new = pallas_kernels.reference.apply_rule(
      rule, jnp.asarray(g), p, slots, hparams, plan=plan, sr=sr)
  new = new[:len(rule.slots)]
  if len(shape) == 0:
    w_new = w_new.reshape(shape)
    new = tuple(s.reshape(shape) for s in new)
  return w_new, tuple(new)


# --- int8 codes across the layers' custom_vjp ---------------------------------


def to_transport(leaves) -> tuple:
  """Slot leaves as a FORGE layer carries them: int8 codes viewed as a
  float dtype of the same width (their cotangent, the new codes, must be
  floating point); the bits are not changed."""
  return tuple(lax.bitcast_convert_type(a, _TRANSPORT)
               if jnp.dtype(a.dtype) == jnp.int8 else a for a in leaves)


def from_transport(leaves, dtypes) -> tuple:
  """The inverse of :func:`to_transport`, given the leaves' own dtypes."""
  return tuple(lax.bitcast_convert_type(a, jnp.int8)
               if jnp.dtype(d) == jnp.int8 and a.dtype != jnp.int8 else a
               for a, d in zip(leaves, dtypes))
