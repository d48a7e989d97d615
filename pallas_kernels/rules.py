"""Per-family update rules for the fused weight-gradient kernel's epilogue.

A regime-1 optimizer step is elementwise: a coordinate's new weight and state
depend only on its own gradient, weight and state. An :class:`UpdateRule`
captures exactly that, as a function of fp32 values, so one kernel body
(:mod:`pallas_kernels.triton_kernel`) serves every family and the same
function is the pure-``jnp`` reference. These rules follow optax's operation
order; :mod:`pallas_kernels.torch_rules` holds the ones in ``torch.optim``'s,
built from the same pieces (:class:`UpdateRule`, :func:`pack_host`,
:func:`rule_name`, :func:`lerp`).

Hyperparameters (learning rate from a schedule, bias corrections, ...) are
*runtime* scalars packed in one small fp32 vector, so a new learning rate never
recompiles the kernel. Anything that changes the kernel's code (``nesterov``,
whether a product is rounded to a moment's storage dtype) is a static field of
the rule instead (:attr:`UpdateRule.static`, :meth:`UpdateRule.with_static`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Triton blocks need a power-of-two number of elements: the hyperparameter
# vector is padded to this length.
HPARAM_VECTOR_LEN = 16
# The key of UpdateRule.unpack's mapping under which the slots' storage dtypes
# travel (not a hyperparameter; never packed).
STORED = "__stored__"
# ... and under which it says whether a product is rounded by a convert pair
# (the compiled Triton kernel, which keeps it and has no reduce_precision)
# rather than by lax.reduce_precision (XLA, whose excess-precision pass may
# drop an f32 -> bf16 -> f32 convert pair on the GPU).
ROUND_BY_CONVERT = "__round_by_convert__"

UpdateFn = Callable[
    [jax.Array, jax.Array, tuple[jax.Array, ...], Mapping[str, jax.Array]],
    tuple[jax.Array, tuple[jax.Array, ...]],
]


def tuned_names(rule) -> tuple[str, ...]:
  """The names of the rules whose tilings ``rule`` takes where the cache
  holds none of its own (:attr:`UpdateRule.tuned_as`), in order; ``()``
  for none (or an object that is not a rule)."""
  names = getattr(rule, "tuned_as", None)
  if names is None:
    return ()
  return names if type(names) is tuple else (names,)


def _is_complex(v) -> bool:
  """Whether ``v`` is a complex number or array (Python's, NumPy's of any
  width, JAX's, a list of them), whose imaginary part a conversion to
  float would drop."""
  if isinstance(v, complex):
    return True
  try:  # (an array's dtype, else NumPy's reading of the value)
    return bool(np.iscomplexobj(v))
  except Exception:  # noqa: BLE001 -- what NumPy cannot read is not one
    return False


@dataclasses.dataclass(frozen=True)
class UpdateRule:
  """An elementwise optimizer step ``(g, w, slots, h) -> (w', slots')``.

  Attributes:
    name: family name, e.g. ``"adamw"``; also the kernel's name suffix
      (followed by the names of nonzero :attr:`static` settings).
    slots: names of the state arrays kept beside the weight, in order (they
      have the weight's shape; e.g. ``("mu", "nu")``).
    hparams: names of the runtime scalars the update reads, in order.
    update: ``update(g, w, slots, h)`` on fp32 arrays, ``h`` a mapping from
      hyperparameter name to an fp32 scalar (and from each :attr:`static`
      setting's name to its Python number); returns the new weight and the new
      slots followed by the ``outputs`` (fp32; the caller casts to storage
      dtypes).
    updates_weight: ``False`` for a rule that only advances the state (the
      epilogue of a regime-2 family: LAMB, Muon): the kernel neither loads nor
      stores ``W``, ``update`` receives ``w=None`` and its returned weight is
      ignored.
    outputs: names of write-only arrays of the weight's shape that the
      epilogue produces beside the slots (e.g. Muon's Nesterov look-ahead
      ``"mu_hat"``, computed from ``G`` in registers for the layer pass that
      follows). Stored in ``output_dtype``; never read by the kernel.
    defaults: ``(name, source)`` pairs: :meth:`pack` gives hyperparameter
      ``name`` the value of hyperparameter ``source`` when it is not passed.
      Used for a momentum's
      decay as applied to the *stored* moment (``"b1_m"``, ``"decay_m"``):
      optax multiplies the stored moment by a Python-float decay in the
      moment's dtype, so with a bf16 moment the decay is rounded to bf16
      (0.9 -> 0.8984375). forge_jax passes the rounded decay; every other
      caller gets the decay itself.
    static: ``(name, value)`` pairs read by ``update`` from ``h`` like
      hyperparameters but fixed when the kernel is built (Python numbers,
      never packed), because they decide which code it emits: the flags
      that round optax's ``decay * stored moment`` product to the moment's
      storage dtype (``"round_mu"``, ``"round_trace"``, ``"round_b1"``,
      ``"round_b2"``; each op rounds to its dtype, and XLA's GPU backend
      rounds that bf16 product where its CPU backend under ``jit`` may
      not). Every rule here has them 0 (no rounding code at all);
      forge_jax sets 1 with :meth:`with_static` where optax rounds. The
      storage dtypes reach the update through :meth:`unpack`.
    tuned_as: the name of a rule whose autotuned tilings this one takes
      where the cache holds none of its own
      (:func:`pallas_kernels.tuning_cache.lookup`), for a rule whose kernel
      moves the same state as that rule's and does about the same
      arithmetic: the Adam variants and torch's Adam/AdamW formulas take
      ``"adamw"``'s (the only family tuned); or a tuple of such names, tried
      in order (a clipped rule, :func:`grad_scaled`, takes its base rule's
      and then the ones that rule takes). ``None``: its own entries and
      ``"any"`` ones only.
    second_moments: the slots that hold a second moment -- an average or
      sum of squares, or Adamax's infinity norm: non-negative values that
      the update divides by (``"nu"``, ``"sum_of_squares"``, torch's
      ``"exp_avg_sq"``). Stored quantized
      (:mod:`pallas_kernels.lowp`), such a slot is clamped at zero and
      floored (:class:`~pallas_kernels.quant.MomentFormat`'s ``v_floor``);
      every other slot is quantized as a signed value.
    no_quantized_state: ``None``, or why this rule's slots must not be
      stored quantized (int8/fp8 codes, :mod:`pallas_kernels.lowp`): a
      quantized slot passed to it is then refused with this reason (centered
      RMSprop: its variance, a difference of two moments, is lost to the
      codes' rounding).
  """

  name: str
  slots: tuple[str, ...]
  hparams: tuple[str, ...]
  update: UpdateFn
  updates_weight: bool = True
  outputs: tuple[str, ...] = ()
  defaults: tuple[tuple[str, str], ...] = ()
  static: tuple[tuple[str, float], ...] = ()
  tuned_as: str | tuple[str, ...] | None = None
  second_moments: tuple[str, ...] = ()
  no_quantized_state: str | None = None

  def __post_init__(self):
    for field in ("slots", "hparams", "outputs", "second_moments"):
      names = getattr(self, field)
      if not (isinstance(names, tuple)
              and all(isinstance(n, str) for n in names)):
        raise TypeError(
            f"rule {self.name!r}: {field} must be a tuple of names (str), "
            f"got {names!r:.80}")
    names = self.slots + self.hparams + self.outputs
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
      raise ValueError(
          f"rule {self.name!r}: the names {repeated} are used more than once "
          f"among its slots {self.slots}, hyperparameters {self.hparams} and "
          f"outputs {self.outputs}; each must be distinct")
    reserved = sorted({STORED, ROUND_BY_CONVERT}.intersection(
        self.hparams + tuple(n for n, _ in self.static)))
    if reserved:
      raise ValueError(
          f"rule {self.name!r}: {reserved} are reserved: unpack() puts the "
          "slots' storage dtypes and the rounding mode under those names in "
          "the mapping the update reads; name the hyperparameter otherwise")
    unknown = [n for n in self.second_moments if n not in self.slots]
    if unknown:
      raise ValueError(f"rule {self.name!r}: second_moments {unknown} are "
                       f"not among its slots {self.slots}")
    names = tuned_names(self)
    if self.tuned_as is not None and (
        not names or not all(isinstance(n, str) for n in names)
        or self.name in names or len(set(names)) != len(names)):
      raise ValueError(f"rule {self.name!r}: tuned_as must name another "
                       "rule, or be a tuple of distinct other rules' names; "
                       f"got {self.tuned_as!r}")
    if len(self.hparams) > HPARAM_VECTOR_LEN:
      raise ValueError(
          f"rule {self.name!r} has {len(self.hparams)} hyperparameters; at most"
          f" {HPARAM_VECTOR_LEN} fit the kernel's hyperparameter vector")
    if not self.updates_weight and not (self.slots or self.outputs):
      raise ValueError(
          f"rule {self.name!r} writes neither the weight nor any slot or "
          "output: its epilogue would do nothing")
    for name, source in self.defaults:
      if name not in self.hparams or source not in self.hparams:
        raise ValueError(
            f"rule {self.name!r}: default {name!r} <- {source!r} names a "
            f"hyperparameter it does not have ({self.hparams})")
    for name, value in self.static:
      if name in self.hparams or name in self.slots:
        raise ValueError(f"rule {self.name!r}: static setting {name!r} is "
                         "also a hyperparameter or slot name")
      if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"rule {self.name!r}: static setting {name!r} must "
                        f"be a Python number, got {value!r}")

  def with_static(self, **values) -> "UpdateRule":
    """This rule with some of its :attr:`static` settings changed (a new
    kernel build), e.g. ``adamw_rule().with_static(round_mu=1.0)``."""
    known = dict(self.static)
    unknown = [n for n in values if n not in known]
    if unknown:
      raise ValueError(f"rule {self.name!r} has no static settings {unknown}"
                       f" (it has {tuple(known)})")
    numbers = {}
    for n, v in values.items():
      try:  # (a NumPy or concrete JAX scalar too, True for 1.0; a
        # string, a complex or an array of several values not)
        if isinstance(v, (str, bytes)) or v is None or _is_complex(v):
          raise TypeError
        numbers[n] = float(v)
      except (TypeError, ValueError):
        traced = (" (a traced value: a static setting is part of the kernel "
                  "build, fixed when tracing; pass a Python number)"
                  if isinstance(v, jax.core.Tracer) else "")
        raise TypeError(f"rule {self.name!r}: static setting {n!r} must be "
                        f"a real number, got {v!r:.80}{traced}") from None
    known.update(numbers)
    return dataclasses.replace(self, static=tuple(known.items()))

  @staticmethod
  def output_dtype(w_dtype, slot_dtypes=()):
    """Storage dtype of ``outputs``: the weight's and slots' promoted dtype
    (what optax's arithmetic on ``G`` and the state produces)."""
    return jnp.result_type(w_dtype, *slot_dtypes)

  def pack(self, **values) -> jax.Array:
    """Packs named hyperparameters into the kernel's fp32 vector (a name in
    ``defaults`` may be left out: it takes its source's value; a
    :attr:`static` setting may be passed only with the rule's own value).
    Each value is a scalar (Python number or array of one element, may be
    traced); an array of several values is refused."""
    # A static setting is not packed; passed here (e.g. from unpack()'s
    # mapping) it must agree with the rule's.
    fixed = {n: v for n, v in self.static if n in values}
    differ = [n for n, v in fixed.items() if not _equals(values.pop(n), v)]
    if differ:
      raise ValueError(
          f"rule {self.name!r}: {differ} are static settings, fixed when the "
          f"kernel is built ({fixed}), not packed hyperparameters: use "
          "rule.with_static(...)")
    # A default may take its value from another default (a <- b <- lr):
    # applied until none is left to fill.
    pending = [d for d in self.defaults if d[0] not in values]
    while pending:
      ready = [(n, src) for n, src in pending if src in values]
      if not ready:
        break
      for name, source in ready:
        values[name] = values[source]
      pending = [d for d in pending if d[0] not in values]
    missing = [n for n in self.hparams if n not in values]
    extra = [n for n in values if n not in self.hparams]
    if missing or extra:
      raise ValueError(
          f"rule {self.name!r} takes hyperparameters {self.hparams}; "
          f"missing {missing}, unexpected {extra}")
    scalars = []
    for n in self.hparams:
      v = values[n]
      try:  # (a string would be parsed; a complex array's imaginary part
        # dropped with a warning)
        if isinstance(v, (str, bytes)) or v is None or _is_complex(v):
          raise TypeError("not a real number")
        a = jnp.asarray(v, jnp.float32)
      except (TypeError, ValueError) as e:
        raise TypeError(
            f"rule {self.name!r}: hyperparameter {n!r} must be a real number "
            f"or a one-element array, got {v!r:.80} ({e})") from None
      if a.size != 1:
        raise ValueError(
            f"rule {self.name!r}: hyperparameter {n!r} must be a scalar "
            f"(shape (); one value for the whole weight), got shape "
            f"{tuple(a.shape)}")
      scalars.append(a.reshape(()))
    vec = jnp.stack(scalars)
    return jnp.pad(vec, (0, HPARAM_VECTOR_LEN - len(self.hparams)))

  def unpack(self, vec, slot_dtypes: Sequence | None = None, *,
             round_by_convert: bool = False) -> dict:
    """Reads the named scalars back out of a packed vector (or vector ref).
    With ``slot_dtypes`` (the slots' storage dtypes, in order) the mapping
    also holds ``{slot name: dtype}`` under :data:`STORED`, for the updates
    that round a product to a moment's storage dtype as optax does;
    ``round_by_convert``: round with a convert pair (in a compiled Triton
    kernel) instead of ``lax.reduce_precision`` (for XLA). The
    :attr:`static` settings are in the mapping too, as Python numbers."""
    h = {n: vec[i] for i, n in enumerate(self.hparams)}
    h.update(self.static)
    if slot_dtypes is not None:
      h[STORED] = dict(zip(self.slots, (jnp.dtype(d) for d in slot_dtypes)))
      h[ROUND_BY_CONVERT] = round_by_convert
    return h

  def call(self, g, w, slots: Sequence[jax.Array], h) -> tuple:
    """``update(g, w, slots, h)``, its result checked: a new weight (when
    the rule updates it) and one array per slot and output, each of
    ``g``'s shape (the tile's). A kernel's epilogue and :meth:`apply` call
    the rule through this.

    Raises:
      ValueError: ``update`` returned another number of arrays, or an
        array of another shape, naming the rule and the slot.
    """
    w_new, new = self.update(g, w, slots, h)
    new = tuple(new)
    want = self.slots + self.outputs
    if len(new) != len(want):
      raise ValueError(
          f"rule {self.name!r}: update returned {len(new)} arrays after the "
          f"weight; it must return one per slot and output, {want}")
    shape = jnp.shape(g)
    named = list(zip(want, new))
    if self.updates_weight:
      named.insert(0, ("the weight", w_new))
    for name, a in named:
      if jnp.shape(a) != shape:
        raise ValueError(
            f"rule {self.name!r}: update returned {name!r} of shape "
            f"{tuple(jnp.shape(a))} for a tile of shape {tuple(shape)}; "
            "return arrays of the tile's shape (broadcast a scalar)")
    return w_new, new

  def apply(self, g, w, slots: Sequence[jax.Array], hparams: jax.Array):
    """The rule on whole arrays in fp32, cast back to the storage dtypes.

    Returns ``(w_new, new_slots + outputs)``; ``w_new`` is ``w`` itself when
    the rule does not update the weight.
    """
    f32 = jnp.float32
    slots = tuple(slots)
    w_new, new = self.call(
        g.astype(f32), w.astype(f32) if self.updates_weight else None,
        tuple(s.astype(f32) for s in slots),
        self.unpack(hparams, [s.dtype for s in slots]))
    out_dtype = self.output_dtype(w.dtype, [s.dtype for s in slots])
    dtypes = [s.dtype for s in slots] + [out_dtype] * len(self.outputs)
    return (w_new.astype(w.dtype) if self.updates_weight else w,
            tuple(n.astype(d) for n, d in zip(new, dtypes)))


def pack_host(rule: UpdateRule, values: Mapping[str, float]) -> np.ndarray:
  """``rule``'s fp32 hyperparameter vector on the host, from Python numbers.

  Unlike :meth:`UpdateRule.pack` (JAX, possibly traced values), this builds
  a NumPy vector, each value rounded once to fp32, and ``values`` may hold
  more names than ``rule`` reads (a family computes all of its scalars; each
  of its rules takes the ones it needs).

  Raises:
    ValueError: ``values`` lacks a hyperparameter of ``rule``.
  """
  missing = [n for n in rule.hparams if n not in values]
  if missing:
    raise ValueError(f"rule {rule.name!r} needs hyperparameters {missing}")
  vec = np.zeros(HPARAM_VECTOR_LEN, np.float32)
  for i, name in enumerate(rule.hparams):
    vec[i] = float(values[name])
  return vec


def _equals(value, static: float) -> bool:
  """A value passed to ``pack`` for a static setting equals the rule's (a
  traced or otherwise non-concrete value does not)."""
  try:
    return float(value) == static
  except Exception:  # noqa: BLE001 -- a tracer, an array of several values
    return False


# Each family's update mirrors the operation order of its optax counterpart
# (optax 0.2.8), so fp32 results agree to rounding. Constants such as
# ``1 - b1`` arrive as their own hyperparameters: optax computes them from
# Python floats in double precision, and rounding them once to fp32 (rather
# than subtracting in fp32 here) reproduces its values exactly.
#
# optax applies the learning rate as ``u * -lr`` (``scale_by_learning_rate``)
# and the result as ``w + u`` (``apply_updates``); `_descend` is that.


def _descend(w, u, h):
  return w + (-h["lr"]) * u


def _ema(g, m, one_minus_decay, decay):
  """``optax.tree.update_moment``: ``(1 - decay) * g + decay * m``."""
  return one_minus_decay * g + decay * m


def lerp(start, end, weight):
  """torch's ``start.lerp_(end, weight)`` for a scalar ``weight`` (the moment
  update of torch's rules, :mod:`pallas_kernels.torch_rules`).

  ``start + weight * (end - start)`` if ``|weight| < 0.5``, else
  ``end - (end - start) * (1 - weight)`` (ATen's ``lerp`` formula).
  """
  return select(jnp.abs(weight) < 0.5, start + weight * (end - start),
                end - (end - start) * (1.0 - weight))


def select(pred, on_true, on_false):
  """``jnp.where(pred, on_true, on_false)`` with all three broadcast to their
  common shape first: the Mosaic GPU kernel's lowering selects only between
  operands of one shape (a scalar predicate, e.g. a hyperparameter test, is
  not broadcast implicitly)."""
  shape = jnp.broadcast_shapes(jnp.shape(pred), jnp.shape(on_true),
                               jnp.shape(on_false))
  return jnp.where(*(jnp.broadcast_to(v, shape)
                     for v in (pred, on_true, on_false)))


def _stored_product(h, decay: str, t, slot: str, flag: str | None):
  """``h[decay] * t`` for the stored moment ``t`` (given in fp32) of slot
  ``slot``, as optax forms it: where the static setting ``h[flag]`` is 1 (a
  decay that JAX multiplies in the moment's dtype, e.g. a Python float) the
  product is rounded to the slot's storage dtype (``h[STORED]``, when the
  caller passed the dtypes and it is narrower than fp32). ``flag=None`` or
  0: never rounded, and no rounding code is emitted."""
  p = h[decay] * t
  dtype = h.get(STORED, {}).get(slot)
  if flag is None or dtype is None or dtype.itemsize >= 4:
    return p
  on = h[flag]
  if not isinstance(on, (int, float)):
    raise TypeError(f"{flag!r} must be a static setting of the rule (a "
                    f"Python number), got {type(on).__name__}")
  if not on:
    return p
  if h.get(ROUND_BY_CONVERT) or dtype != jnp.bfloat16:
    # reduce_precision flushes fp16 subnormals, which fp16 keeps: fp16 moments
    # are rounded by the convert pair everywhere (XLA may drop it on the GPU).
    return p.astype(dtype).astype(p.dtype)
  # For bf16 the convert pair's values (NaN payloads aside); XLA keeps it.
  return lax.reduce_precision(p, exponent_bits=8, mantissa_bits=7)


def _stored_ema(g, t, h, one_minus_decay: str, decay: str, slot: str,
                flag: str):
  """``optax.tree.update_moment`` of the stored moment ``t``:
  ``(1 - decay) * g + decay * t``, the product as :func:`_stored_product`."""
  return h[one_minus_decay] * g + _stored_product(h, decay, t, slot, flag)


def _trace(u, t, h, nesterov: bool, decay: str = "decay",
           decay_m: str = "decay_m", flag: str | None = "round_trace"):
  """``optax.trace``: returns ``(update, new_trace)``; ``h[decay_m]``
  multiplies the stored trace (the decay as rounded to its dtype, see
  :func:`_stored_product`), ``h[decay]`` the new one."""
  t = u + _stored_product(h, decay_m, t, "trace", flag)
  return (u + h[decay] * t if nesterov else t), t


def _inv(x):
  """``1 / x`` of a scalar hyperparameter, formed once: an elementwise
  ``a / x`` is then ``a * _inv(x)``, one multiplication per element instead
  of a division (IEEE division is about ten instructions on a GPU, one of
  them on the quarter-rate special-function unit), within an ulp and a half
  of ``a / x``."""
  return 1.0 / x


def _adam_moments(g, mu, nu, h, nesterov: bool):
  """``scale_by_adam``'s moments and bias-corrected ``(mu_hat, nu_hat)``;
  ``b1_m`` is ``b1`` as it multiplies the stored ``mu``. The bias
  corrections multiply by their reciprocals (:func:`_inv`)."""
  mu = _stored_ema(g, mu, h, "one_minus_b1", "b1_m", "mu", "round_mu")
  nu = _ema(g * g, nu, h["one_minus_b2"], h["b2"])
  if nesterov:
    mu_hat = h["b1"] * (mu * _inv(h["bc1_next"])) + h["one_minus_b1"] * (
        g * _inv(h["bc1"]))
  else:
    mu_hat = mu * _inv(h["bc1"])
  return mu, nu, mu_hat, nu * _inv(h["bc2"])


def _adam_scale(mu_hat, nu_hat, h):
  return mu_hat / (jnp.sqrt(nu_hat + h["eps_root"]) + h["eps"])


_ADAM_HPARAMS = ("lr", "b1", "b2", "one_minus_b1", "one_minus_b2", "eps",
                 "eps_root", "bc1", "bc2", "bc1_next", "b1_m")
_ADAM_DEFAULTS = (("b1_m", "b1"),)
_ADAM_STATIC = (("round_mu", 0.0),)


def _one_per_variant(factory):
  """``factory`` returning one rule object per variant however it is called
  (positional or keyword arguments, ``True`` or ``1``): a rule's update is a
  closure, so two calls would make unequal rules, and each new rule a new
  kernel build."""
  signature = inspect.signature(factory)
  made = {}

  @functools.wraps(factory)
  def cached(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    key = tuple(bound.arguments.items())
    rule = made.get(key)
    if rule is None:
      rule = made[key] = factory(*args, **kwargs)
    return rule

  return cached


def rule_name(base: str, **flags: bool) -> str:
  """A rule's name: ``base`` followed by the names of the flags that are on,
  e.g. ``rule_name("adam", nesterov=True) == "adam_nesterov"``."""
  return "_".join([base, *(f for f, on in flags.items() if on)])


@_one_per_variant
def sgd_rule(momentum: bool = False, nesterov: bool = False) -> UpdateRule:
  """SGD as ``optax.sgd`` computes it: ``trace`` (if ``momentum``), then lr.

  Slots: ``("trace",)`` with momentum, none without. Hyperparameters: ``lr``,
  and ``decay`` (the momentum) with momentum. ``nesterov`` only matters with
  momentum (as in optax): without it, the plain rule's object.
  """
  if nesterov and not momentum:
    return sgd_rule()  # (the cached plain rule: one kernel build)

  def update(g, w, slots, h):
    if not momentum:
      return _descend(w, g, h), ()
    u, t = _trace(g, slots[0], h, nesterov)
    return _descend(w, u, h), (t,)

  return UpdateRule(
      name=rule_name("sgd", momentum=momentum, nesterov=nesterov),
      slots=("trace",) if momentum else (),
      hparams=("lr", "decay", "decay_m") if momentum else ("lr",),
      update=update,
      defaults=(("decay_m", "decay"),) if momentum else (),
      static=(("round_trace", 0.0),) if momentum else ())


@_one_per_variant
def adagrad_rule() -> UpdateRule:
  """Adagrad as ``optax.adagrad`` computes it (``scale_by_rss``, then lr).

  Slots: ``("sum_of_squares",)``. Hyperparameters: ``lr``, ``eps``.
  """

  def update(g, w, slots, h):
    (sum_of_squares,) = slots
    sum_of_squares = g * g + sum_of_squares
    scale = jnp.where(sum_of_squares > 0,
                      lax.rsqrt(sum_of_squares + h["eps"]), 0.0)
    return _descend(w, scale * g, h), (sum_of_squares,)

  return UpdateRule(name="adagrad", slots=("sum_of_squares",),
                    hparams=("lr", "eps"), update=update,
                    second_moments=("sum_of_squares",))


CENTERED_VARIANCE = (
    "centered RMSprop divides by the square root of its variance, the "
    "second moment less the squared mean: a difference of two moments that "
    "int8/fp8 codes cannot resolve (it rounds to zero or below: huge steps "
    "or NaN weights)")


@_one_per_variant
def rmsprop_rule(centered: bool = False, eps_in_sqrt: bool = True,
                 bias_correction: bool = False, momentum: bool = False,
                 nesterov: bool = False) -> UpdateRule:
  """RMSprop as ``optax.rmsprop`` computes it.

  ``scale_by_rms`` (or ``scale_by_stddev`` when ``centered``), then the
  learning rate, then ``trace`` when ``momentum`` -- so the trace holds
  lr-scaled updates, as in optax.

  Slots: ``("nu",)`` or, centered, ``("mu", "nu")``; then ``"trace"`` with
  momentum. Hyperparameters: ``lr``, ``decay``, ``one_minus_decay``, ``eps``;
  ``bc = 1 - decay**t`` with ``bias_correction``; ``momentum`` with momentum.
  ``nesterov`` only matters with momentum: without it, the plain rule's
  object. Centered, its slots cannot be stored quantized
  (:attr:`UpdateRule.no_quantized_state`).
  """
  if nesterov and not momentum:
    return rmsprop_rule(centered, eps_in_sqrt, bias_correction)

  def update(g, w, slots, h):
    mu, nu, *trace = slots if centered else (None, *slots)
    nu = _ema(g * g, nu, h["one_minus_decay"], h["decay"])
    nu_hat = nu / h["bc"] if bias_correction else nu
    if centered:
      mu = _ema(g, mu, h["one_minus_decay"], h["decay"])
      mu_hat = mu / h["bc"] if bias_correction else mu
      var = nu_hat - mu_hat * mu_hat
    else:
      var = nu_hat
    if eps_in_sqrt:
      scale = lax.rsqrt(var + h["eps"])
    else:
      scale = 1.0 / (jnp.sqrt(var) + h["eps"])
    u = (-h["lr"]) * (scale * g)
    new = (mu, nu) if centered else (nu,)
    if momentum:
      # optax.rmsprop's trace follows the parameters' dtype: no flag.
      u, t = _trace(u, trace[0], h, nesterov, decay="momentum",
                    decay_m="momentum", flag=None)
      new = (*new, t)
    return w + u, new

  return UpdateRule(
      name=rule_name("rmsprop", centered=centered,
                   eps_outside_sqrt=not eps_in_sqrt,
                   bias_correction=bias_correction, momentum=momentum,
                   nesterov=nesterov),
      slots=(("mu", "nu") if centered else ("nu",))
      + (("trace",) if momentum else ()),
      hparams=("lr", "decay", "one_minus_decay", "eps")
      + (("bc",) if bias_correction else ())
      + (("momentum",) if momentum else ()),
      update=update, second_moments=("nu",),
      no_quantized_state=CENTERED_VARIANCE if centered else None)


@_one_per_variant
def adam_rule(nesterov: bool = False) -> UpdateRule:
  """Adam as ``optax.adam`` computes it (``nesterov=True``: ``optax.nadam``).

  Slots ``("mu", "nu")``; hyperparameters as :func:`adamw_rule` without
  ``weight_decay``.
  """

  def update(g, w, slots, h):
    mu, nu, mu_hat, nu_hat = _adam_moments(g, *slots, h, nesterov)
    return _descend(w, _adam_scale(mu_hat, nu_hat, h), h), (mu, nu)

  return UpdateRule(name=rule_name("adam", nesterov=nesterov),
                    slots=("mu", "nu"), hparams=_ADAM_HPARAMS, update=update,
                    defaults=_ADAM_DEFAULTS,
                    static=_ADAM_STATIC, tuned_as="adamw",
                    second_moments=("nu",))


@_one_per_variant
def adamw_rule(nesterov: bool = False) -> UpdateRule:
  """AdamW as ``optax.adamw`` computes it (``nesterov`` as in optax).

  Hyperparameters: ``lr`` (this step's learning rate), ``b1``, ``b2``,
  ``one_minus_b1``, ``one_minus_b2`` (passed separately so that they are
  rounded from double precision, as optax's Python floats are), ``eps``,
  ``eps_root``, ``weight_decay`` (0 where the mask excludes the weight), and
  the bias corrections ``bc1 = 1 - b1**t``, ``bc2 = 1 - b2**t`` and
  ``bc1_next = 1 - b1**(t + 1)`` for step ``t`` (1-based).
  """

  # optax.adamw = scale_by_adam -> add_decayed_weights -> scale_by_lr.
  def update(g, w, slots, h):
    mu, nu, mu_hat, nu_hat = _adam_moments(g, *slots, h, nesterov)
    u = _adam_scale(mu_hat, nu_hat, h) + h["weight_decay"] * w
    return _descend(w, u, h), (mu, nu)

  return UpdateRule(
      name=rule_name("adamw", nesterov=nesterov),
      slots=("mu", "nu"),
      hparams=_ADAM_HPARAMS + ("weight_decay",),
      defaults=_ADAM_DEFAULTS,
      static=_ADAM_STATIC,
      update=update,
      tuned_as="adamw" if nesterov else None,
      second_moments=("nu",),
  )


@_one_per_variant
def adamax_rule() -> UpdateRule:
  """Adamax as ``optax.adamax`` computes it.

  Slots ``("mu", "nu")`` (``nu`` the infinity moment). Hyperparameters:
  ``lr``, ``b1``, ``one_minus_b1``, ``b2``, ``eps``, ``bc1 = 1 - b1**t``.
  """

  def update(g, w, slots, h):
    mu, nu = slots
    mu = _ema(g, mu, h["one_minus_b1"], h["b1"])
    nu = jnp.maximum(jnp.abs(g) + h["eps"], h["b2"] * nu)
    return _descend(w, (mu / h["bc1"]) / nu, h), (mu, nu)

  return UpdateRule(name="adamax", slots=("mu", "nu"),
                    hparams=("lr", "b1", "one_minus_b1", "b2", "eps", "bc1"),
                    update=update, second_moments=("nu",))


@_one_per_variant
def radam_rule(nesterov: bool = False) -> UpdateRule:
  """RAdam as ``optax.radam`` computes it.

  Slots ``("mu", "nu")``. Hyperparameters: Adam's (:func:`adam_rule`) plus
  the step's rectification, computed by the caller from the step count as
  ``scale_by_radam`` does: ``rectify`` (1 if ``rho_t >= threshold`` else 0)
  and ``r`` (the rectification factor; unused when ``rectify`` is 0).
  """

  def update(g, w, slots, h):
    mu, nu, mu_hat, nu_hat = _adam_moments(g, *slots, h, nesterov)
    u = select(h["rectify"] > 0,
               h["r"] * mu_hat / (jnp.sqrt(nu_hat + h["eps_root"])
                                  + h["eps"]),
               mu_hat)
    return _descend(w, u, h), (mu, nu)

  return UpdateRule(name=rule_name("radam", nesterov=nesterov),
                    slots=("mu", "nu"), hparams=_ADAM_HPARAMS + ("r", "rectify"),
                    update=update, defaults=_ADAM_DEFAULTS,
                    static=_ADAM_STATIC, second_moments=("nu",))


@_one_per_variant
def lion_rule() -> UpdateRule:
  """Lion as ``optax.lion`` computes it (``scale_by_lion`` in its default
  ``'hard'`` mode, then decoupled weight decay, then lr).

  Slots ``("mu",)``. Hyperparameters: ``lr``, ``b1``, ``one_minus_b1``,
  ``b2``, ``one_minus_b2``, ``weight_decay`` (0 where the mask excludes the
  weight).
  """

  def update(g, w, slots, h):
    (mu,) = slots
    u = jnp.sign(_stored_ema(g, mu, h, "one_minus_b1", "b1", "mu", "round_b1"))
    mu = _stored_ema(g, mu, h, "one_minus_b2", "b2", "mu", "round_b2")
    return _descend(w, u + h["weight_decay"] * w, h), (mu,)

  return UpdateRule(name="lion", slots=("mu",),
                    hparams=("lr", "b1", "one_minus_b1", "b2", "one_minus_b2",
                             "weight_decay"),
                    update=update,
                    static=(("round_b1", 0.0), ("round_b2", 0.0)))


# --- Regime 2: the epilogue advances the state only ---------------------------
# The weight update reads a layer statistic of the new state (LAMB's norms,
# Muon's Newton-Schulz), so it runs in a per-layer pass after the kernel
# (``forge_jax``); these rules leave ``W`` untouched and never store ``G``.


@_one_per_variant
def lamb_rule() -> UpdateRule:
  """LAMB's state update (``optax.lamb``'s ``scale_by_adam`` moments) alone.

  Slots ``("mu", "nu")``; ``W`` is neither read nor written. The per-layer
  pass that follows forms the Adam update from the new moments, adds weight
  decay, scales by the trust ratio and applies the learning rate; it reads
  the same hyperparameters: Adam's (:func:`adam_rule`) and ``weight_decay``.
  """

  def update(g, w, slots, h):
    mu, nu, _, _ = _adam_moments(g, *slots, h, nesterov=False)
    return None, (mu, nu)

  return UpdateRule(name="lamb_moments", slots=("mu", "nu"),
                    hparams=_ADAM_HPARAMS + ("weight_decay",), update=update,
                    defaults=_ADAM_DEFAULTS, static=_ADAM_STATIC,
                    updates_weight=False, second_moments=("nu",))


@_one_per_variant
def muon_rule(nesterov: bool = True) -> UpdateRule:
  """Muon's state update (``optax.contrib.scale_by_muon``) alone.

  The momentum is affine in ``G``: ``mu = (1 - beta) * G + beta * mu``, so the
  weight-gradient GEMM accumulates straight into it. The epilogue also writes
  the bias-corrected momentum that Newton-Schulz will read, ``mu_hat``
  (output), exactly as optax forms it: ``mu / (1 - beta**t)``, or with
  ``nesterov`` ``beta * mu / (1 - beta**(t+1)) + (1 - beta) * G / (1 - beta**t)``
  -- the one place where ``G`` enters the weight update, consumed here in
  registers. ``mu_hat`` is formed from the fp32 momentum before it is rounded
  to its storage dtype, as optax does. ``W`` is neither read nor written.

  Slots ``("mu",)``; outputs ``("mu_hat",)``. Hyperparameters: ``lr``,
  ``b1`` (beta), ``one_minus_b1``, ``bc1 = 1 - beta**t``,
  ``bc1_next = 1 - beta**(t+1)``, ``weight_decay`` (the last two and ``lr``
  are read by the layer pass).
  """

  def update(g, w, slots, h):
    (mu,) = slots
    mu = _stored_ema(g, mu, h, "one_minus_b1", "b1_m", "mu", "round_mu")
    if nesterov:
      mu_hat = h["b1"] * (mu / h["bc1_next"]) + h["one_minus_b1"] * (
          g / h["bc1"])
    else:
      mu_hat = mu / h["bc1"]
    return None, (mu, mu_hat)

  return UpdateRule(
      name=rule_name("muon_momentum", nesterov=nesterov), slots=("mu",),
      hparams=("lr", "b1", "one_minus_b1", "bc1", "bc1_next", "weight_decay",
               "b1_m"),
      update=update, updates_weight=False, outputs=("mu_hat",),
      defaults=(("b1_m", "b1"),), static=(("round_mu", 0.0),))


@_one_per_variant
def scion_rule() -> UpdateRule:
  """Scion's state update (``forge_jax.scion``) alone.

  The gradient average of Pethick et al. (2025), ``d = momentum * G + decay *
  d`` with ``decay = 1 - momentum`` (``momentum`` is the weight of the new
  gradient, not the usual decay), is affine in ``G``: the weight-gradient GEMM
  accumulates straight into it. The linear minimisation oracle over the whole
  matrix of the new ``d`` (Newton-Schulz) and the weight update are the layer
  pass that follows; ``W`` is neither read nor written here.

  Slots ``("mu",)``. Hyperparameters: ``lr``, ``momentum``, ``decay``,
  ``weight_decay`` (``lr`` and ``weight_decay``, the constrained variant's
  shrink, are read by the layer pass).
  """

  def update(g, w, slots, h):
    (mu,) = slots
    return None, (h["momentum"] * g + h["decay"] * mu,)

  return UpdateRule(name="scion_momentum", slots=("mu",),
                    hparams=("lr", "momentum", "decay", "weight_decay"),
                    update=update, updates_weight=False)


ADAMW = adamw_rule()


# --- Gradient accumulation over K micro-batches (forge_jax.MultiSteps) --------
# Both wrappers keep ONE kernel body: they are ordinary rules whose update
# calls the wrapped family's update, with runtime flags in the hyperparameter
# vector selecting what each micro-step keeps, so one compiled step serves
# every micro-step of a cycle.

ACCUMULATE_HPARAMS = ("acc_n", "acc_final")
MOMENTUM_ACCUMULATE_HPARAMS = ("acc_scale", "acc_first", "acc_final")


def _check_extra_hparams(rule: UpdateRule, extra: tuple[str, ...],
                         slots: tuple[str, ...] = (),
                         purpose: str = "gradient accumulation") -> None:
  """``extra`` hyperparameters and ``slots`` (names only) added to ``rule``
  for ``purpose``."""
  clash = [n for n in extra + slots
           if n in rule.hparams or n in rule.slots or n in dict(rule.static)]
  if clash:
    raise ValueError(f"rule {rule.name!r} already uses the names {clash}")
  if len(rule.hparams) + len(extra) > HPARAM_VECTOR_LEN:
    raise ValueError(
        f"rule {rule.name!r} has {len(rule.hparams)} hyperparameters; with "
        f"{len(extra)} more for {purpose} they exceed the kernel's"
        f" {HPARAM_VECTOR_LEN}-entry hyperparameter vector")


def accumulating(rule: UpdateRule) -> UpdateRule:
  """``rule`` behind an fp32 gradient accumulator (``optax.MultiSteps``).

  Slots ``("acc", *rule.slots)``: ``acc`` holds the running mean of this
  accumulation cycle's micro-batch gradients, updated as ``optax.MultiSteps``
  updates its ``acc_grads`` (Welford): ``mean = acc + (g - acc) / n``.
  Hyperparameters ``(*rule.hparams, "acc_n", "acc_final")``: ``acc_n`` is the
  micro-step's 1-based index in the cycle, ``acc_final`` is 1 on its last
  micro-step and 0 before.

  * ``acc_final == 0``: ``acc' = mean``; the weight, the family's slots and
    its outputs are left as they were (selected back with ``jnp.where``);
  * ``acc_final == 1``: the family's rule steps from ``g_eff = mean`` (the
    cycle's averaged gradient); ``acc' = 0``.

  ``rule.update`` runs on every micro-step and its result is discarded on
  all but the last (elementwise work, no extra memory traffic beyond the
  ``acc`` tile); the write-only ``outputs`` (Muon's ``mu_hat``) are
  meaningful on the last micro-step only.
  """
  _check_extra_hparams(rule, ACCUMULATE_HPARAMS, slots=("acc",))
  n_slots = len(rule.slots)

  def update(g, w, slots, h):
    acc, inner = slots[0], tuple(slots[1:])
    mean = acc + (g - acc) / h["acc_n"]
    final = h["acc_final"] > 0
    w_new, new = rule.update(mean, w, inner, h)
    kept = tuple(select(final, s_new, s)
                 for s_new, s in zip(new[:n_slots], inner))
    if rule.updates_weight:
      w_new = select(final, w_new, w)
    return w_new, (select(final, 0.0, mean), *kept, *new[n_slots:])

  # (Every other field is the rule's; its tilings are its own.)
  return dataclasses.replace(
      rule, name=f"{rule.name}_accumulate", slots=("acc", *rule.slots),
      hparams=rule.hparams + ACCUMULATE_HPARAMS, update=update,
      tuned_as=None)


def momentum_accumulating(rule: UpdateRule, decay: str) -> UpdateRule:
  """``rule`` accumulating K micro-batches straight into its momentum.

  For a family whose update reads ``G`` only through a momentum affine in
  it, ``m' = decay * m + c * G`` (SGD's trace, ``c = 1``; Muon's momentum
  without Nesterov, ``c = 1 - beta``), one step on the mean of K gradients
  equals K micro-steps that each add ``c * G_i / K`` to the momentum, the
  first of them also applying the decay. ``decay`` names that
  hyperparameter of ``rule``. Same slots as ``rule`` (no accumulator);
  hyperparameters ``(*rule.hparams, "acc_scale", "acc_first", "acc_final")``:

  * the gradient is scaled by ``acc_scale`` (``1/K``);
  * ``decay`` is used as given when ``acc_first`` is 1 (the cycle's first
    micro-step) and replaced by 1 otherwise: ``m' = m + c * G / K``;
  * the new weight is kept when ``acc_final`` is 1 (the cycle's last
    micro-step) and the old one selected back otherwise.

  The caller guarantees the affine property (``forge_jax.MultiSteps`` reads
  it from the family's ``ForgeSpec.momentum_decay``); the momentum is
  accumulated in its own storage dtype.
  """
  if decay not in rule.hparams:
    raise ValueError(
        f"rule {rule.name!r} has no hyperparameter {decay!r} "
        f"(it has {rule.hparams})")
  if not rule.slots:
    raise ValueError(f"rule {rule.name!r} has no momentum slot")
  _check_extra_hparams(rule, MOMENTUM_ACCUMULATE_HPARAMS)

  # The decay as it multiplies the stored momentum (a `defaults` entry whose
  # source is `decay`, e.g. "b1_m") is replaced alike.
  replaced = (decay, *(n for n, src in rule.defaults if src == decay))

  def update(g, w, slots, h):
    h = dict(h)
    for name in replaced:
      h[name] = jnp.where(h["acc_first"] > 0, h[name], 1.0)
    w_new, new = rule.update(g * h["acc_scale"], w, slots, h)
    if rule.updates_weight:
      w_new = select(h["acc_final"] > 0, w_new, w)
    return w_new, new

  return dataclasses.replace(
      rule, name=f"{rule.name}_momentum_accumulate",
      hparams=rule.hparams + MOMENTUM_ACCUMULATE_HPARAMS, update=update,
      tuned_as=None)


# --- Global-norm clipping (forge_jax.clip_by_global_norm, max_grad_norm=) -----
# A clipped step scales every gradient by one factor known only after a first
# pass over the whole backward (pallas_kernels.sqnorm_kernel measures the
# kernels' norms). The factor travels in the hyperparameter vector, so the
# kernel body stays the family's own.

GRAD_SCALE_HPARAMS = ("gscale_div", "gscale_mul")


@functools.lru_cache(maxsize=None)
def grad_scaled(rule: UpdateRule) -> UpdateRule:
  """``rule`` stepping from ``G' = (G / gscale_div) * gscale_mul``.

  Hyperparameters ``(*rule.hparams, "gscale_div", "gscale_mul")``; same
  slots, outputs and static settings. The two factors reproduce each
  framework's clipping exactly: ``optax.clip_by_global_norm`` replaces a
  gradient ``t`` by ``(t / g_norm) * max_norm`` when ``g_norm >= max_norm``
  (``gscale_div = g_norm``, ``gscale_mul = max_norm``; else both 1, and
  ``(G / 1) * 1`` is ``G`` bit for bit), and
  ``torch.nn.utils.clip_grad_norm_`` multiplies by its clamped coefficient
  (``gscale_div = 1``, ``gscale_mul = min(1, max_norm / (norm + 1e-6))``).
  The scaling is applied to ``G`` before the family's update reads it, so
  every use of ``G`` (moments, Nesterov terms, Muon's ``mu_hat``) sees the
  clipped gradient. One wrapped rule per rule (cached), so a compiled
  kernel is reused from step to step.

  Raises:
    ValueError: the names are taken, or the vector would overflow.
  """
  _check_extra_hparams(rule, GRAD_SCALE_HPARAMS,
                       purpose="the gradient-clipping factors")

  def update(g, w, slots, h):
    return rule.update((g / h["gscale_div"]) * h["gscale_mul"], w, slots, h)

  return dataclasses.replace(
      rule, name=f"{rule.name}_clipped",
      hparams=rule.hparams + GRAD_SCALE_HPARAMS, update=update,
      # (The base rule's tilings, then those it takes.)
      tuned_as=(rule.name if rule.tuned_as is None
                else (rule.name, *tuned_names(rule))))
