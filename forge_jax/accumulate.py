"""Gradient accumulation over K micro-batches: :func:`MultiSteps`.

``forge_jax.MultiSteps(tx, every_k_schedule, mode=...)`` is the FORGE
counterpart of ``optax.MultiSteps(tx, every_k_schedule)``: the step built by
``forge_jax.make_step`` is called once per micro-batch, and the weights (and
the optimizer's own state: moments, step counts, schedules) change only on
every K-th call, where they become what one step of ``tx`` on the mean of the
K micro-batch gradients gives. Two modes:

* ``"exact"`` (any family forge_jax implements): each FORGE kernel keeps an
  fp32 accumulator of its shape in the state -- ``optax.MultiStepsState``'s
  own ``acc_grads``, which holds one for every parameter -- and the fused
  kernel's epilogue adds the micro-batch's ``G`` to it in registers
  (``pallas_kernels.rules.accumulating``); on the last micro-step the family's
  rule steps from the accumulated mean and the accumulator is reset. Regime 2
  (LAMB, Muon) runs its per-layer pass on the last micro-step only; regime 3
  (Adafactor, SM3) runs ``optax.MultiSteps``' own update on the layer's
  explicit ``G``. Everything else is ``optax.MultiSteps`` itself, with the
  same state tree.
* ``"momentum"`` (SGD with momentum, without Nesterov): the update reads
  ``G`` only through a momentum affine in it, so each micro-step adds
  ``G / K`` straight into the momentum (the first one also decays it) and the
  last one also updates the weight (``pallas_kernels.rules.
  momentum_accumulating``, the same rule for FORGE kernels -- in the kernel's
  epilogue -- and for every other parameter). No accumulator at all.

Memory: exact mode holds, for the whole run, 4 bytes per FORGE kernel element
(fp32 accumulators; plus, as ``optax.MultiSteps`` does, one for every other
parameter -- biases, norms); momentum mode holds nothing beyond the
optimizer's own state.
"""

from __future__ import annotations

import numbers
from typing import Callable, Union

import jax
import jax.numpy as jnp
from jax import lax
import optax
from optax._src import numerics

from forge_jax import _inject
from forge_jax import _state
from forge_jax import clip as _clip
from forge_jax.transforms import ForgeSpec, ForgeTransformation, check_spec
from pallas_kernels import rules as _rules

MODES = ("exact", "momentum")

# Why a family cannot accumulate into its momentum (mode="momentum").
_NO_MOMENTUM_MODE = {
    "sgd": "plain SGD (momentum=None) has no momentum to accumulate into",
    "sgd_momentum": (
        "with nesterov=True its update reads G beside the momentum "
        "(w -= lr * (G + momentum * trace)), not through the momentum alone"),
    "muon": (
        "Muon's default Nesterov look-ahead reads G beside the momentum, and "
        "its non-matrix parameters go through AdamW, which is not affine in G"),
    "rmsprop": "its second moment squares G (not affine in G)",
    "adagrad": "its sum of squares squares G (not affine in G)",
    "lion": "its update is the sign of an interpolation with G (not affine)",
}


def _marked(fn):
  fn._forge_multi_steps = True
  return fn


def _check_k(every_k_schedule):
  """``(every_k, every_k_schedule)``: K as a function of the gradient step,
  and the argument for ``optax.MultiSteps`` (a plain int, or the callable)."""
  if callable(every_k_schedule):
    return every_k_schedule, every_k_schedule
  if (isinstance(every_k_schedule, bool)
      or not isinstance(every_k_schedule, numbers.Integral)):
    raise TypeError(
        "forge_jax.MultiSteps: every_k_schedule must be an int >= 1 (or a "
        "schedule: a callable from the gradient step to an int), got "
        f"{every_k_schedule!r} of type {type(every_k_schedule).__name__}")
  k = int(every_k_schedule)
  if k < 1:
    raise ValueError(
        f"forge_jax.MultiSteps: every_k_schedule={k} must be >= 1 (the "
        "number of micro-batches per optimizer step)")
  return (lambda step: k), k


def _momentum_mode_reason(spec: ForgeSpec) -> str:
  reason = _NO_MOMENTUM_MODE.get(
      spec.family, f"{spec.family}'s update is not affine in G through a "
      "single momentum (e.g. Adam's second moment squares G)")
  return (
      f"forge_jax.MultiSteps(mode='momentum') cannot accumulate "
      f"{spec.family!r} into its momentum: {reason}. Momentum mode supports "
      "forge_jax.sgd(lr, momentum=...) with nesterov=False; use "
      "mode='exact' (an fp32 accumulator per FORGE kernel) for every other "
      "family.")


def MultiSteps(  # noqa: N802 -- named after optax.MultiSteps
    tx: ForgeTransformation,
    every_k_schedule: Union[int, Callable[[jax.Array], jax.Array]],
    mode: str = "exact",
) -> ForgeTransformation:
  r"""Gradient accumulation over K micro-batches, for FORGE layers too.

  The FORGE counterpart of ``optax.MultiSteps(tx, every_k_schedule)`` (with
  its defaults: gradients averaged, no skipping): build the step with
  ``forge_jax.make_step(loss_fn, forge_jax.MultiSteps(tx, K))`` and call it
  once per micro-batch. The weights and ``tx``'s own state (moments, step
  counts, hence schedules) change only on every K-th call, to what one step
  of ``tx`` on the mean of the K micro-batch gradients gives; the other calls
  only accumulate. One compiled step serves every micro-step (the
  micro-step's role is a runtime value in the kernel's hyperparameters).
  ``opt_state = tx_k.init(params)`` is an ``optax.MultiStepsState``
  (``mini_step``, ``gradient_step``, ``inner_opt_state`` -- ``tx``'s own state
  -- and ``acc_grads``); ``state.mini_step == 0 and state.gradient_step > 0``
  after an update, as ``optax.MultiSteps.has_updated`` reads it.

  Modes:

  * ``"exact"`` -- every family (regimes 1-3), without low-precision
    state. The state is
    ``optax.MultiSteps``' own: ``acc_grads`` holds an fp32 running mean of
    the cycle's gradients for every parameter. A FORGE kernel's entry is
    updated in the fused kernel's epilogue (``G`` stays in registers); on
    the last micro-step the family's rule steps from the mean, in the same
    epilogue, and the entry is reset to 0. Regime 2 (LAMB, Muon): the
    per-layer pass runs on the last micro-step only. Regime 3 (Adafactor,
    SM3): the layer applies ``optax.MultiSteps``' own update to its explicit
    ``G``. Other parameters: ``optax.MultiSteps`` itself.
    **Memory: 4 bytes per FORGE kernel element for the whole run** (the fp32
    accumulators; ``optax.MultiSteps`` holds the same, plus the gradients of
    the step itself, which FORGE never materialises).
  * ``"momentum"`` -- ``forge_jax.sgd(lr, momentum=mu)`` without Nesterov,
    whose update reads ``G`` only through its trace ``m' = G + mu * m``:
    micro-step 0 does ``m <- mu * m + G / K``, micro-steps 1..K-1 do
    ``m <- m + G / K``, and the last one also applies ``w <- w - lr * m`` --
    equal to one step on the mean gradient. Every parameter (FORGE kernels in
    the epilogue, the others with the same rule on whole arrays) accumulates
    into its own momentum. **Memory: nothing beyond ``tx``'s state**
    (``acc_grads`` is empty). The momentum accumulates in its storage dtype
    (``accumulator_dtype``): with a bf16 momentum, prefer exact mode.

  Args:
    tx: a forge_jax transform (``forge_jax.adamw(...)``, ...).
    every_k_schedule: K, the number of micro-batches per optimizer step: an
      int >= 1, or (as in optax) a schedule mapping the gradient step (the
      number of optimizer steps so far) to K.
    mode: ``"exact"`` or ``"momentum"``.

  Returns:
    A :class:`forge_jax.ForgeTransformation` (an optax transform:
    ``update`` on plain gradients is the same accumulation) with
    ``optax.MultiSteps``' attributes: ``inner_opt`` (``tx``),
    ``has_updated(state)`` and ``gradient_transformation()`` (the
    transform itself).

  Raises:
    TypeError: ``tx`` is not a forge_jax transform (or is an
      ``optax.inject_hyperparams`` one, or a chain with global-norm
      clipping: clipping with accumulation is not supported), or K is not
      an int.
    ValueError: K < 1, an unknown ``mode``, ``tx`` already accumulates,
      ``tx`` has low-precision state (``moments=``,
      ``stochastic_rounding=``), or
      ``mode="momentum"`` with a family that is not affine in ``G`` through
      its momentum (Adam & co., Nesterov, Muon, plain SGD).

  Example:
    >>> tx = forge_jax.MultiSteps(forge_jax.adamw(1e-3), every_k_schedule=4)
    >>> opt_state = tx.init(variables["params"])
    >>> step = jax.jit(forge_jax.make_step(loss_fn, tx), donate_argnums=(0, 1))
    >>> for micro_batch in micro_batches:   # weights move every 4th call
    ...   loss, variables, opt_state = step(variables, opt_state, micro_batch)
  """
  if not isinstance(tx, ForgeTransformation) and _clip.holds_clipping(tx):
    raise _clip.accumulation_refused("forge_jax.MultiSteps")
  if not isinstance(tx, ForgeTransformation) and _inject.recognise(tx):
    raise TypeError(
        "forge_jax.MultiSteps cannot wrap an optax.inject_hyperparams "
        "transform: its state hides the family's state inside the injected "
        "one. Pass a schedule instead, forge_jax.MultiSteps("
        "forge_jax.adamw(learning_rate=schedule), k), or drop the "
        "accumulation and give make_step the injected transform itself.")
  if not isinstance(tx, ForgeTransformation):
    raise TypeError(
        "forge_jax.MultiSteps wraps a forge_jax transform (e.g. "
        f"forge_jax.adamw(...)); got {type(tx).__name__}. For a plain optax "
        "transform use optax.MultiSteps.")
  check_spec(tx, "forge_jax.MultiSteps")
  if getattr(tx.update, "_forge_multi_steps", False):
    raise ValueError(
        "forge_jax.MultiSteps: tx already accumulates gradients (it is a "
        "forge_jax.MultiSteps); wrap the optimizer once, with K the product "
        "of the micro-step counts")
  if mode not in MODES:
    raise ValueError(
        f"forge_jax.MultiSteps: unknown mode {mode!r}; expected one of "
        f"{MODES}")
  every_k, every_k_schedule = _check_k(every_k_schedule)
  spec = tx.spec
  if spec.low_precision is not None:
    raise ValueError(
        f"forge_jax.MultiSteps: forge_jax.{spec.family} with low-precision "
        "state (moments= or stochastic_rounding=) cannot accumulate "
        "gradients yet; accumulate with moments=None and "
        "stochastic_rounding=False")
  if mode == "exact":
    out = _exact(tx, spec, every_k_schedule, every_k)
  elif spec.momentum_decay is None or spec.regime != 1:
    raise ValueError(_momentum_mode_reason(spec))
  else:
    out = _momentum(tx, spec, every_k)
  # optax.MultiSteps' attributes: the wrapped transform, the has_updated
  # reader and the transform itself as a GradientTransformation.
  out.inner_opt = tx
  out.has_updated = has_updated
  out.gradient_transformation = lambda: out
  return out


def has_updated(state: optax.MultiStepsState) -> jax.Array:
  """Whether the call that returned ``state`` updated the weights: as
  ``optax.MultiSteps.has_updated`` (also ``tx.has_updated`` of a
  :func:`MultiSteps` transform); ``state`` may be an NNX optimizer's
  ``opt_state``, whose counts are ``nnx`` variables."""
  return jnp.logical_and(jnp.asarray(state.mini_step) == 0,
                         jnp.asarray(state.gradient_step) > 0)


def _cycle_flags(state, every_k):
  """``(k, emit)``: this cycle's K and whether this is its last micro-step,
  as ``optax.MultiSteps.update`` computes them."""
  k = every_k(state.gradient_step)
  return k, state.mini_step == k - 1


# --- exact mode: an fp32 accumulator per kernel -------------------------------


def _exact(tx, spec: ForgeSpec, every_k_schedule, every_k):
  ms = optax.MultiSteps(tx, every_k_schedule)
  update = _marked(lambda grads, state, params=None, **extra:
                   ms.update(grads, state, params, **extra))
  if spec.regime == 3:
    # Deferred: the layer runs optax.MultiSteps' own update on its explicit
    # G and its slice of the state (accumulator included).
    new = ForgeSpec(rule=None, slot_fields=None, hparams=lambda state: {},
                    family=spec.family, update=update)
    return ForgeTransformation(ms.init, update, new)

  def hparams(state):
    h = dict(spec.hparams(state.inner_opt_state))
    _, emit = _cycle_flags(state, every_k)
    # optax.MultiSteps' running mean divides by n_acc + 1.
    h["acc_n"] = state.mini_step + 1
    h["acc_final"] = emit
    return h

  def layer_pass(w, slots, outputs, h, shared):
    # Regime 2: the per-layer pass (Newton-Schulz, trust ratio) runs on
    # the cycle's last micro-step only; before it, W and the state stay.
    acc, rest = slots[0], tuple(slots[1:])

    def run(w, rest, outputs):
      w2, rest2 = spec.layer_pass(w, rest, outputs, h, shared)
      return w2.astype(w.dtype), tuple(
          a.astype(b.dtype) for a, b in zip(rest2, rest))

    w_new, rest_new = lax.cond(h["acc_final"] > 0, run,
                               lambda w, rest, outputs: (w, rest),
                               w, rest, outputs)
    return w_new, (acc, *rest_new)

  new = ForgeSpec(
      rule=_rules.accumulating(spec.rule),
      slot_fields=((optax.MultiStepsState, "acc_grads"), *spec.slot_fields),
      hparams=hparams, weight_decay_mask=spec.weight_decay_mask,
      family=spec.family,
      layer_pass=layer_pass if spec.layer_pass is not None else None,
      shared=lambda state: spec.shared(state.inner_opt_state))
  return ForgeTransformation(ms.init, update, new)


# --- momentum mode: accumulate into the momentum ------------------------------


def _momentum(tx, spec: ForgeSpec, every_k):
  rule = _rules.momentum_accumulating(spec.rule, spec.momentum_decay)
  if "weight_decay" in rule.hparams:
    raise ValueError(
        f"forge_jax.MultiSteps(mode='momentum') does not support the weight "
        f"decay of {spec.family!r}; use mode='exact'")

  def hparams(state):
    h = dict(spec.hparams(state.inner_opt_state))
    k, emit = _cycle_flags(state, every_k)
    h["acc_scale"] = 1.0 / k
    h["acc_first"] = state.mini_step == 0
    h["acc_final"] = emit
    return h

  def init(params):
    return optax.MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        inner_opt_state=tx.init(params), acc_grads=(), skip_state=())

  @_marked
  def update(grads, state, params=None, **extra_args):
    """Every parameter given here accumulates into its momentum with the
    same rule as a FORGE kernel's epilogue (``None`` subtrees -- FORGE
    kernels cut out by make_step -- are skipped). ``extra_args`` (optax's
    ``value=``, ...) are accepted, as ``optax.MultiSteps`` does; SGD's
    momentum rule reads none of them."""
    del extra_args
    k, emit = _cycle_flags(state, every_k)
    inner = state.inner_opt_state
    packed = rule.pack(**hparams(state))
    g_leaves, treedef = jax.tree.flatten(grads)
    # Without params (optax's update(grads, state)): the rule from W = 0.
    # Its update does not depend on W -- weight decay, the one term that
    # reads W, is refused in this mode -- so W1 - 0 is the update.
    p_leaves = ([jnp.zeros_like(g) for g in g_leaves] if params is None
                else treedef.flatten_up_to(params))
    fields = _state.per_param_fields(inner, treedef)
    # The momentum field, as make_step selects it.
    slot_ids = _state.select_slots(fields, spec, inner, treedef)
    for f in fields:
      if f.index not in slot_ids and jax.tree.leaves(f.tree):
        raise ValueError(
            f"mode='momentum': the {spec.family} state field {f.name!r} is "
            "not its momentum; use mode='exact'")
    slot_leaves = [treedef.flatten_up_to(fields[i].tree) for i in slot_ids]
    new_w, new_slots = [], [[] for _ in slot_ids]
    for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
      w1, s1 = rule.apply(g, p, tuple(s[i] for s in slot_leaves), packed)
      new_w.append(w1)
      for j, s in enumerate(s1[:len(slot_ids)]):
        new_slots[j].append(s)
    # On the other micro-steps the rule selects the old weight back: a zero
    # update.
    updates = treedef.unflatten([w1 - p for w1, p in zip(new_w, p_leaves)])
    # The inner transform's shared state (step counts: schedules, bias
    # corrections) advances on the cycle's last micro-step only, as in
    # optax.MultiSteps; its per-parameter results are replaced by the
    # rule's (and, under jit, never computed).
    _, stepped = tx.update(grads, inner, params)
    stepped = jax.tree.map(
        lambda n, o: jnp.where(emit, n, o).astype(o.dtype), stepped, inner)
    by_index = {i: treedef.unflatten(s) for i, s in zip(slot_ids, new_slots)}
    stepped = _state.map_per_param(
        stepped, treedef, lambda i, t: by_index.get(i, t))
    return updates, optax.MultiStepsState(
        mini_step=numerics.safe_increment(state.mini_step) % k,
        gradient_step=jnp.where(emit,
                                numerics.safe_increment(state.gradient_step),
                                state.gradient_step),
        inner_opt_state=stepped, acc_grads=(), skip_state=())

  new = ForgeSpec(
      rule=rule, slot_fields=spec.slot_fields, hparams=hparams,
      weight_decay_mask=spec.weight_decay_mask, family=spec.family,
      shared=lambda state: spec.shared(state.inner_opt_state),
      momentum_decay=None)
  return ForgeTransformation(init, update, new)
