"""Global-norm gradient clipping in a FORGE step: two passes, exact.

``optax.clip_by_global_norm(max_norm)`` replaces every gradient ``g`` by
``(g / norm) * max_norm`` when ``norm``, the norm of *all* the parameters'
gradients together, is ``max_norm`` or more. A FORGE layer updates its kernel
inside its own backward, before the gradients of the layers below it exist,
so no single backward can apply that factor (the paper's regime 4: the state
update reads a statistic across layers). ``make_step`` therefore runs a
clipped step as two passes:

1. **Norm pass.** The forward and backward run once with every FORGE layer
   in a measuring mode: its backward computes ``dx`` as usual and, in place
   of the update, the squared norm of its weight gradient ``G = x^T dy`` --
   in the registers of ``pallas_kernels.wgrad_sqnorm`` (one fp32 partial sum
   per tile), or from XLA's GEMM under ``make_step(..., wgrad="xla")`` --
   returned through the layer's ``touched`` input. Every other parameter gets
   its ordinary gradient. The global norm is the square root of the sum of
   all of them (in fp32).
2. **Update pass.** The forward and backward run again, as in an unclipped
   step, with the clip factors ``(gscale_div, gscale_mul)`` in each FORGE
   kernel's hyperparameter vector (``pallas_kernels.grad_scaled``): ``G`` is
   scaled in the epilogue before the optimizer reads it. The other
   parameters' gradients are clipped with optax's own expression and handed
   to the optimizer's ``update``.

No gradient-sized buffer is added: the norm pass stores no ``G``. The cost
is a second forward and backward (one more weight-gradient GEMM per FORGE
layer, in the norm kernel). See ``docs/clipping.md``.

The transform is :func:`clip_by_global_norm`, composed as optax users
compose clipping: ``optax.chain(forge_jax.clip_by_global_norm(1.0),
forge_jax.adamw(...))``; ``optax.clip_by_global_norm`` in that place is
recognised too. :func:`recognise` reads such a chain for ``make_step``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import optax

import pallas_kernels
from forge_jax import _context
from forge_jax import _inject
from forge_jax import _paths
from forge_jax import transforms as _transforms

__all__ = ["ClipByGlobalNorm", "clip_by_global_norm"]

# make_step's wgrad -> the norm pass's: how the layers form G to measure it.
NORM_PASS_WGRAD = {"fused": "norm_fused", "xla": "norm_xla"}
_MEASURED_AS = {v: k for k, v in NORM_PASS_WGRAD.items()}

_FORM = ("optax.chain(forge_jax.clip_by_global_norm(max_norm), "
         "forge_jax.adamw(...))")


# --- the transform ---------------------------------------------------------


class ClipByGlobalNorm(optax.GradientTransformation):
  """``optax.clip_by_global_norm(max_norm)`` that ``make_step`` recognises.

  It *is* optax's ``(init, update)`` pair (same state, ``EmptyState``, and
  same updates: outside a FORGE step it clips exactly as optax does), with
  ``max_norm`` kept as an attribute. Chained before a forge_jax transform,
  ``make_step`` runs the two-pass clipped step (module docstring).
  """

  def __new__(cls, max_norm):
    inner = optax.clip_by_global_norm(max_norm)
    self = super().__new__(cls, inner.init, inner.update)
    self.max_norm = max_norm
    return self

  def _replace(self, **changes):
    # New functions make another transform: a plain optax one.
    return optax.GradientTransformation(*self)._replace(**changes)

  def __repr__(self) -> str:
    return f"ClipByGlobalNorm(max_norm={self.max_norm!r})"


def _check_max_norm(max_norm) -> None:
  if isinstance(max_norm, jax.core.Tracer):
    return
  if isinstance(max_norm, bool) or not isinstance(
      max_norm, (numbers.Real, np.ndarray, np.generic, jax.Array)):
    raise TypeError(
        "forge_jax.clip_by_global_norm: max_norm must be a positive number, "
        f"got {type(max_norm).__name__}")
  value = np.asarray(max_norm)
  if value.shape != () or not (np.issubdtype(value.dtype, np.floating)
                               or np.issubdtype(value.dtype, np.integer)):
    raise TypeError(
        "forge_jax.clip_by_global_norm: max_norm must be a real scalar, got "
        f"{value.dtype}{list(value.shape)}")
  if not np.isfinite(value) or value <= 0:
    raise ValueError(
        f"forge_jax.clip_by_global_norm: max_norm={max_norm!r} must be a "
        "finite number > 0 (optax would divide every gradient by its norm "
        "and multiply by it)")


def clip_by_global_norm(max_norm) -> ClipByGlobalNorm:
  """Clips gradients by their global norm: ``optax.clip_by_global_norm``.

  Every gradient ``g`` becomes ``(g / norm) * max_norm`` when ``norm``, the
  norm of all the gradients together, is ``max_norm`` or more; otherwise the
  gradients pass unchanged (optax's formula, ``min(1, max_norm / norm)`` as
  a factor). Chain it before a forge_jax transform, as with optax::

      tx = optax.chain(forge_jax.clip_by_global_norm(1.0),
                       forge_jax.adamw(1e-3, weight_decay=1e-2))
      step = forge_jax.make_step(loss_fn, tx)

  ``make_step`` then runs each step in two passes (a norm pass that stores
  no gradient, then the fused update with the clip factor folded into each
  kernel's hyperparameters): the trajectory is optax's, at the cost of a
  second forward and backward (``docs/clipping.md``). The state is optax's
  (``(EmptyState(), <the optimizer's state>)``).

  Args:
    max_norm: gradients whose global norm is below it pass unchanged: a
      number > 0 (or a JAX scalar).

  Returns:
    A :class:`ClipByGlobalNorm` (an ``optax.GradientTransformation``).

  Raises:
    TypeError, ValueError: ``max_norm`` is not a finite real scalar > 0.
  """
  _check_max_norm(max_norm)
  return ClipByGlobalNorm(max_norm)


# --- recognising a clipped chain ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ClipChain:
  """An ``optax.chain`` of global-norm clipping and one forge_jax optimizer.

  Attributes:
    max_norm: the clipping's ``max_norm``.
    member: the optimizer, as a transform ``make_step`` drives (a
      :class:`ForgeTransformation`, or the ``optax.inject_hyperparams`` one).
    index: the optimizer's position in the chain (its state's too).
  """

  max_norm: Any
  member: Any
  index: int

  def member_state(self, chain_state):
    """The optimizer's own state inside the chain's state tuple."""
    return chain_state[self.index]

  def with_member_state(self, chain_state, new):
    """The chain's state with the optimizer's replaced by ``new`` (the
    clipping's ``EmptyState`` stays as it is)."""
    return type(chain_state)(new if i == self.index else s
                             for i, s in enumerate(chain_state))


def _unwrapped(update):
  """``(transform, update)`` behind a chain member's update function:
  ``optax.chain`` wraps a plain ``GradientTransformation`` in a closure over
  it (``with_extra_args_support``); ``(None, update)`` otherwise."""
  if getattr(update, "__qualname__", "") == (
      "with_extra_args_support.<locals>.update"):
    inner = _transforms.closure_vars(update).get("tx")
    if isinstance(inner, optax.GradientTransformation):
      return inner, inner.update
  return None, update


def _is_optax_clip(fn) -> bool:
  """Whether ``fn`` is the update function of ``optax.clip_by_global_norm``."""
  return (getattr(fn, "__qualname__", "")
          == "clip_by_global_norm.<locals>.update_fn"
          and getattr(fn, "__module__", "").startswith("optax"))


def _global_clip(update) -> tuple[bool, Any]:
  """``(True, max_norm)`` if a chain member is global-norm clipping
  (:func:`clip_by_global_norm`, or optax's), else ``(False, None)``.

  Raises:
    TypeError: the member is ``optax.inject_hyperparams`` of either
      clipping (an injected or scheduled ``max_norm``)."""
  inner, fn = _unwrapped(update)
  if isinstance(inner, ClipByGlobalNorm):
    return True, inner.max_norm
  injected = _inject.recognise(optax.GradientTransformationExtraArgs(
      lambda params: None, fn))
  if injected is not None and getattr(
      injected.inner_factory, "__name__", "") == "clip_by_global_norm":
    raise TypeError(
        "make_step: global-norm clipping inside optax.inject_hyperparams "
        "(an injected or scheduled max_norm) is not supported: the step's "
        "norm pass takes max_norm as a constant. Give it as a number and "
        "inject the optimizer's hyperparameters alone: optax.chain("
        "forge_jax.clip_by_global_norm(max_norm), optax.inject_hyperparams("
        "forge_jax.adamw)(learning_rate=...)).")
  if _is_optax_clip(fn):
    found = _transforms.closure_vars(fn)
    if "max_norm" not in found:
      raise TypeError(
          "make_step: this optax's clip_by_global_norm keeps its max_norm "
          f"where forge_jax cannot read it; write {_FORM} instead")
    _check_max_norm(found["max_norm"])
    return True, found["max_norm"]
  return False, None


def _optimizer(init, update):
  """The chain member as a transform make_step can drive, or ``None``."""
  found = _transforms.chain_member(update)
  if found is not None:
    family, spec = found
    if spec is None:
      raise _deferred(family)
    return _transforms.ForgeTransformation(init, update, spec)
  member = optax.GradientTransformationExtraArgs(init, update)
  if _inject.recognise(member) is not None:
    return member
  return None


def holds_clipping(tx) -> bool:
  """Whether ``tx`` is global-norm clipping (:func:`clip_by_global_norm`, or
  optax's) or an ``optax.chain`` holding it anywhere, nested chains
  included, in any order (:func:`recognise` judges the form); also behind
  ``with_extra_args_support``'s wrapper (``optax.MultiSteps.inner_opt``)."""
  inner, fn = _unwrapped(getattr(tx, "update", None))
  if isinstance(tx, ClipByGlobalNorm) or isinstance(
      inner, ClipByGlobalNorm) or _is_optax_clip(fn):
    return True
  if inner is not None:
    tx = inner
  for init, update in _transforms.chain_members(tx) or ():
    inner, fn = _unwrapped(update)
    if isinstance(inner, ClipByGlobalNorm) or _is_optax_clip(fn):
      return True
    if holds_clipping(inner if inner is not None else
                      optax.GradientTransformationExtraArgs(init, fn)):
      return True
  return False


def accumulation_refused(who: str,
                         given: str = "forge_jax.MultiSteps") -> TypeError:
  """The refusal of global-norm clipping combined with gradient
  accumulation, in either nesting, for ``who`` (the refusing function);
  ``given``: the accumulation wrapper the caller passed."""
  return TypeError(
      f"{who}: global-norm clipping together with gradient accumulation "
      f"({given}) is not supported, in either nesting. optax's "
      "optax.MultiSteps(optax.chain(optax.clip_by_global_norm(max_norm), "
      "optax.adamw(...)), k) clips the mean of the k micro-batch gradients "
      "once per k steps; a FORGE step cannot: its norm pass measures one "
      "batch's gradient, not the running mean the fused kernels accumulate "
      "(and clipping each micro-batch, optax.chain(clip, MultiSteps(...)), "
      "is not built either). What runs: clipping without accumulation, "
      f"{_FORM}, on the whole batch; accumulation without clipping, "
      "forge_jax.MultiSteps(forge_jax.adamw(...), k); or both with optax "
      "and no FORGE step: the same model (a forge_jax layer outside "
      "make_step is the standard layer) with jax.value_and_grad and that "
      "optax.MultiSteps chain (docs/clipping.md).")


def recognise(tx) -> Optional[ClipChain]:
  """The parts of ``tx`` if it is a chain with global-norm clipping.

  Args:
    tx: the transform given to ``make_step``.

  Returns:
    A :class:`ClipChain`, or ``None`` if ``tx`` is not an ``optax.chain``
    holding ``forge_jax.clip_by_global_norm`` or
    ``optax.clip_by_global_norm`` (another chain is refused by
    ``make_step`` as before: it is not a forge_jax transform).

  Raises:
    TypeError: a chain with global-norm clipping in a form this does not
      run: anything but exactly the clipping followed by one forge_jax
      transform (or ``optax.inject_hyperparams`` of one), the clipping after
      the optimizer (that clips the updates, not the gradients), a
      ``forge_jax.MultiSteps`` optimizer, or a deferred family (Adafactor,
      SM3, ...).
  """
  members = _transforms.chain_members(tx)
  if members is None:
    return None
  clips = [(i, _global_clip(u)) for i, (_, u) in enumerate(members)]
  clips = [(i, max_norm) for i, (is_clip, max_norm) in clips if is_clip]
  if not clips:
    return None
  optimizers = [(i, _optimizer(init, u)) for i, (init, u) in enumerate(members)
                if i not in dict(clips)]
  bad = sum(m is None for _, m in optimizers)
  if len(clips) != 1 or bad or len(optimizers) != 1:
    if bad:
      what = (f"{bad} transform(s) forge_jax cannot drive (an optax "
              "optimizer such as optax.adamw: use its forge_jax counterpart, "
              "forge_jax.adamw; any other transform: not in such a chain)")
    elif len(clips) != 1:
      what = f"{len(clips)} global-norm clippings"
    else:
      what = f"{len(optimizers)} forge_jax optimizers"
    raise TypeError(
        "make_step: global-norm clipping runs in a FORGE step as exactly "
        f"{_FORM}: the clipping, then one forge_jax transform (or "
        "optax.inject_hyperparams of a forge_jax factory). This chain holds "
        f"{what}. Train other chains with optax on the standard path "
        "(flax.linen.Dense, or forge_jax.Dense(fused=False)).")
  (clip_index, max_norm), = clips
  (index, member), = optimizers
  if clip_index > index:
    raise TypeError(
        "make_step: the global-norm clipping comes after the optimizer in "
        "this chain, so it would clip the optimizer's updates, not the "
        f"gradients. Put it first: {_FORM}.")
  if _accumulates(*members[index]):
    raise accumulation_refused("make_step")
  spec = getattr(member, "spec", None)
  if spec is not None:
    check_family(spec)
  return ClipChain(max_norm=max_norm, member=member, index=index)


def _accumulates(init, update) -> bool:
  """Whether the chain member ``(init, update)`` is a
  ``forge_jax.MultiSteps``, itself or made by the factory of an
  ``optax.inject_hyperparams``."""
  if getattr(update, "_forge_multi_steps", False):
    return True
  injected = _inject.recognise(optax.GradientTransformation(init, update))
  made = None if injected is None else _inject.initial_product(injected)
  return getattr(getattr(made, "update", None), "_forge_multi_steps", False)


def check_family(spec) -> None:
  """Refuses a family whose layers cannot take the clip factor.

  Raises:
    TypeError: a deferred family (regime 3: Adafactor, SM3, ...), whose
      layer runs optax's own update on ``G`` formed in its backward; its
      clipping is not built.
  """
  if spec.regime == 3:
    raise _deferred(spec.family)


def _deferred(family: str) -> TypeError:
  return TypeError(
      f"make_step: global-norm clipping with {family!r} (a family whose "
      "layer forms its gradient and runs optax's update on it in the "
      "backward) is not supported; clipping is built for the families the "
      f"fused kernel updates (SGD ... Lion, LAMB, Muon, Scion), as {_FORM}. "
      "Train this chain with optax on the standard path.")


def check_mesh_layout(mesh_layout) -> None:
  """Refuses clipping in a step laid out on a device mesh.

  Raises:
    ValueError: ``mesh_layout`` is given: the norm pass would need each
      sharded kernel's norm reduced across its shards, which is not built.
  """
  if mesh_layout is not None:
    raise ValueError(
        "make_step: global-norm clipping (forge_jax.clip_by_global_norm) is "
        "not supported with mesh_layout=... yet: the norm pass measures each "
        "kernel's gradient on one device. Clip in a single-device step, or "
        "train the clipped model with optax.")


def clipped_spec(spec):
  """``spec`` stepping from the clipped gradient: its rule wrapped by
  ``pallas_kernels.grad_scaled``, its hyperparameters with factors 1 (the
  norm pass sets them, :func:`with_factors`)."""
  check_family(spec)
  hparams = spec.hparams
  return dataclasses.replace(
      spec, rule=pallas_kernels.grad_scaled(spec.rule),
      hparams=lambda state: {**hparams(state), "gscale_div": 1.0,
                             "gscale_mul": 1.0})


# --- inside the layers' backward (the norm pass) -----------------------------


def is_norm_pass(wgrad: str) -> bool:
  """Whether a layer's ``wgrad`` (from the step context) says that this is
  the norm pass of a clipped step."""
  return wgrad in _MEASURED_AS


def layer_sqnorm(x, dy, wgrad: str, precision=None) -> jax.Array:
  """``sum(G ** 2)`` (fp32) of ``G = x^T dy``, formed as the update pass
  will form it: in the registers of ``pallas_kernels.wgrad_sqnorm``
  (``wgrad="fused"``), or as XLA's GEMM at the layer's ``precision``, as
  ``pallas_kernels.unfused_wgrad_update`` forms it (``"xla"``)."""
  if _MEASURED_AS[wgrad] == "fused":
    return pallas_kernels.wgrad_sqnorm(x, dy)
  common = pallas_kernels.checks.common_dtype(x, dy)
  x, dy = x.astype(common), dy.astype(common)
  tokens = tuple(range(x.ndim - 1))
  if precision is None and common == jnp.float32:
    precision = lax.Precision.HIGHEST
  g = lax.dot_general(dy, x, ((tokens, tokens), ((), ())),
                      precision=precision, preferred_element_type=common)
  g = g.astype(jnp.float32)
  return jnp.sum(g * g)


def norm_pass_inputs(inputs: _context.LayerInputs,
                     sqnorm) -> _context.LayerInputs:
  """A layer's ``LayerInputs`` cotangent in the norm pass: zeros, but for
  ``touched``, which carries the layer's squared gradient norm."""
  zero = lambda t: jax.tree.map(_paths.zero_cotangent, t)
  return _context.LayerInputs(
      slots=zero(inputs.slots), hparams=zero(inputs.hparams),
      touched=jnp.asarray(sqnorm, inputs.touched.dtype).reshape(
          inputs.touched.shape),
      shared=zero(inputs.shared))


# --- in make_step ---------------------------------------------------------------


def _sqnorm(g) -> jax.Array:
  """``sum(|g| ** 2)`` in fp32 at least (0 for a float0 gradient)."""
  if not jnp.issubdtype(g.dtype, jnp.inexact):
    return jnp.zeros((), jnp.float32)
  if jnp.issubdtype(g.dtype, jnp.complexfloating):
    g = jnp.abs(g)
  g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
  return jnp.sum(g * g)


def norm_pass(ctx: _context.StepContext, loss_of, params, inputs: dict,
              kpaths: dict, has_aux: bool):
  """Pass 1 of a clipped step: the global gradient norm, nothing updated.

  Args:
    ctx: the update pass's context (copied, its ``wgrad`` set to the norm
      pass's).
    loss_of: ``loss_of(params, inputs, ctx)``, the step's loss under ``ctx``.
    params: the parameter tree.
    inputs: the FORGE layers' ``LayerInputs`` by path.
    kpaths: the FORGE kernels' key paths by layer path.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    ``(g_norm, params)``: the fp32 global norm and ``params`` passed through
    an optimization barrier with it, so that the update pass, which reads
    them, starts after this pass ends (the two passes' activations are not
    live at once).
  """
  norm_ctx = dataclasses.replace(ctx, wgrad=NORM_PASS_WGRAD[ctx.wgrad],
                                 inputs={}, bwd_traced=set())
  with _context.step_context(norm_ctx), _context.full_params(params):
    _, (grads, new_inputs) = jax.value_and_grad(
        lambda p, i: loss_of(p, i, norm_ctx), argnums=(0, 1),
        allow_int=True, has_aux=has_aux)(params, inputs)
  cut = {kp: None for kp in kpaths.values()}
  rest = jax.tree_util.tree_map_with_path(
      lambda kp, g: None if tuple(kp) in cut else g, grads)
  total = jnp.zeros((), jnp.float32)
  for p in kpaths:  # each FORGE layer's squared norm, from its backward
    total = total + new_inputs[p].touched.astype(jnp.float32)
  for g in jax.tree.leaves(rest):
    total = total + _sqnorm(g).astype(jnp.float32)
  g_norm = jnp.sqrt(total)
  return lax.optimization_barrier((g_norm, params))


def with_factors(inputs: dict, rule: pallas_kernels.UpdateRule, g_norm,
                 max_norm) -> dict:
  """Each layer's ``LayerInputs`` with the clip factors in its packed
  hyperparameters: ``G -> (G / g_norm) * max_norm`` when ``g_norm >=
  max_norm``, else factors 1 (``G`` unchanged, bit for bit)."""
  trigger = g_norm < max_norm
  div = jnp.where(trigger, 1.0, g_norm).astype(jnp.float32)
  mul = jnp.where(trigger, 1.0, jnp.asarray(max_norm, jnp.float32))
  i, j = (rule.hparams.index(n) for n in pallas_kernels.rules.GRAD_SCALE_HPARAMS)
  return {p: li._replace(hparams=li.hparams.at[i].set(div).at[j].set(mul))
          for p, li in inputs.items()}


def clip_gradients(grads, kpaths: dict, g_norm, max_norm):
  """The gradients of every parameter but the FORGE kernels (whose leaves
  hold their new values), clipped as ``optax.clip_by_global_norm`` clips
  them, with the global ``g_norm``."""
  forge = set(kpaths.values())
  trigger = jnp.squeeze(g_norm < max_norm)

  def clip(kp, t):
    if tuple(kp) in forge or not jnp.issubdtype(t.dtype, jnp.inexact):
      return t
    return lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

  return jax.tree_util.tree_map_with_path(clip, grads)
