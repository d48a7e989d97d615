"""The three ways a FORGE layer's backward applies its optimizer step.

``pallas_kernels.classify(family).number`` picks the path (``ForgeSpec.regime``):

1. **epilogue** -- the fused kernel's epilogue applies the whole rule; ``G``
   lives in registers only.
2. **epilogue, then a layer pass** -- the epilogue advances the state (the
   rule leaves ``W``, e.g. LAMB's moments, Muon's momentum); then
   ``spec.layer_pass`` (plain ``jnp``, still inside the layer's backward)
   forms the weight update from the *new state* and ``W`` (LAMB's trust
   ratio, Muon's Newton-Schulz). It never reads ``G``.
3. **deferred** -- ``G = x^T dy`` is formed in fp32, the optax update itself
   is applied to this one parameter (its state sliced down to it), and ``G``
   dies in this backward: at most one layer's ``G`` is live.

The same functions give Remark 1's zero-gradient step (:func:`step_from_grad`)
so that a layer whose backward never ran gets exactly what optax gives it.
"""

from __future__ import annotations

import contextlib
import jax
import numpy as np
import jax.numpy as jnp
from jax import lax
import optax

import pallas_kernels
from forge_jax import _state
from forge_jax import low_precision


@contextlib.contextmanager
def refusing_derivatives(layer: str):
  """Around a FORGE layer's in-place update in its backward: differentiating
  the step itself (``jax.grad`` / ``jax.jvp`` of it, a meta-gradient) reaches
  the aliased Pallas call, which has no derivative; say so in FORGE's terms
  instead of Pallas' "JVP with aliasing not supported"."""
  try:
    yield
  except NotImplementedError as e:
    if "aliasing" not in str(e):
      raise
    raise NotImplementedError(
        f"{layer}: the FORGE step is being differentiated (jax.grad / jax.jvp "
        "of the step, e.g. a meta-gradient through an update). Its fused "
        "update writes the kernel in place and has no derivative. "
        "Differentiate an optax step of the same model instead "
        "(flax.linen.Dense, or fused=False).") from e


def form_gradient(x, dy):
  """``G = x^T dy`` over all token rows (regime 3), in fp32 -- or wider, as
  the operands are: float64 and complex kernels keep their own dtype, as
  ``jax.grad`` gives them to optax."""
  x2 = x.reshape(-1, x.shape[-1])
  dy2 = dy.reshape(-1, dy.shape[-1])
  dtype = jnp.promote_types(jnp.result_type(x2, dy2), jnp.float32)
  return lax.dot_general(x2, dy2, (((0,), (0,)), ((), ())),
                         precision=lax.Precision.HIGHEST,
                         preferred_element_type=dtype)


def _after_epilogue(spec, w, new, inputs):
  """Regime 1: done. Regime 2: the per-layer pass over the new state."""
  if spec.regime == 1:
    return w, new
  n = len(spec.rule.slots)
  w_new, slots = spec.layer_pass(w, new[:n], new[n:],
                                 spec.rule.unpack(inputs.hparams),
                                 inputs.shared)
  return w_new.astype(w.dtype), tuple(
      s.astype(old.dtype) for s, old in zip(slots, inputs.slots))


def _deferred(spec, layout: _state.KernelLayout, g, w, inputs):
  """Regime 3: optax's own update on the one-parameter slice of its state."""
  subtrees = layout.split(list(inputs.slots))
  shared = jax.tree.unflatten(layout.shared_def, list(inputs.shared))
  state_one = _state.walk(
      shared, lambda v, owner, name: isinstance(v, _state.Hole),
      lambda i, owner, name, hole: layout.one_leaf(subtrees[i]))
  params_one = layout.one_leaf(w)
  updates, new_state = spec.update(layout.one_leaf(g), state_one, params_one)
  w_new = _state.get_subtree(optax.apply_updates(params_one, updates),
                             layout.keypath)
  params_def = jax.tree.structure(layout.params_skeleton,
                                  is_leaf=lambda x: x is None)
  new_subtrees = [
      _state.get_subtree(f.tree, layout.keypath)
      for f in _state.per_param_fields(new_state, params_def)]
  new_leaves = []
  for sub, d in zip(new_subtrees, layout.slot_defs):
    leaves, got = jax.tree.flatten(sub)
    if got != d:
      raise ValueError(
          f"the optimizer changed the structure of its state for "
          f"{jax.tree_util.keystr(layout.keypath)}: {d} -> {got}")
    new_leaves.extend(leaves)
  return w_new.astype(w.dtype), tuple(
      n.astype(o.dtype) for n, o in zip(new_leaves, inputs.slots))


WGRAD_MODES = ("fused", "xla")


def wgrad_update(x, dy, w, slots, hparams, *, rule, config=None,
                 wgrad="fused", layer=None, precision=None, formats=None,
                 stochastic_rounding=None):
  """The rule's step from ``G = x^T dy``: the fused kernel (``wgrad="fused"``,
  ``G`` never in memory) or XLA's GEMM, at the layer's ``precision``, then
  the rule's elementwise update (``"xla"``, ``G`` in memory for this call:
  make_step's ``wgrad``). ``formats`` and ``stochastic_rounding``: for
  quantized slots and stochastic rounding, as the kernel takes them."""
  if wgrad == "xla":
    return pallas_kernels.unfused_wgrad_update(
        x, dy, w, slots, hparams, rule=rule, layer=layer, precision=precision,
        formats=formats, stochastic_rounding=stochastic_rounding)
  if wgrad != "fused":
    raise ValueError(f"wgrad={wgrad!r} must be one of {WGRAD_MODES}")
  return pallas_kernels.fused_wgrad_update(
      x, dy, w, slots, hparams, rule=rule, config=config, layer=layer,
      formats=formats, stochastic_rounding=stochastic_rounding)


def _low_precision_step(spec, layout: _state.KernelLayout, w, inputs, step):
  """A regime-1 step on low-precision state: the layer's slot leaves
  regrouped into the kernel's slots (a quantized one as its
  ``Quantized`` pair, int8 codes back from their transport), ``step(slots,
  formats, sr)`` run, and its new slots flattened back for the layer."""
  lp = spec.low_precision
  leaves = low_precision.from_transport(inputs.slots, layout.leaf_dtypes)
  # A slot's subtree holds one float array or a quantized moment's codes and
  # scales (a Quantized pair; flax.nnx's state may hold it as a mapping
  # {"q", "scale"}, whose leaves come in the same order).
  slots = []
  for sub in layout.split(list(leaves)):
    parts = jax.tree.leaves(sub)
    slots.append(pallas_kernels.quant.Quantized(*parts) if len(parts) == 2
                 else parts[0])
  slots = tuple(slots)
  sr = None
  if lp.sr_for(w):
    seed_step = inputs.shared[0]
    sr = (seed_step[0], seed_step[1])
  w_new, new = step(slots, lp.kernel_formats(slots), sr)
  flat = jax.tree.leaves(tuple(new[:len(slots)]))
  return w_new, low_precision.to_transport(flat)


def step_in_backward(spec, layout, x, dy, w, inputs, config=None,
                     wgrad="fused", precision=None):
  """The optimizer step of one FORGE kernel inside its layer's backward.

  ``w`` is the pre-update kernel (the caller has already read it for
  ``dx``), in the parameter's own shape for a deferred family (regime 3: its
  ``G``, formed as a matrix, is reshaped to it, as for a
  ``forge_jax.DenseGeneral`` kernel). Returns ``(w_new, slots_new)``.
  """
  if spec.regime == 3:
    return _deferred(spec, layout, form_gradient(x, dy).reshape(w.shape), w,
                     inputs)
  if spec.low_precision is not None:
    return _low_precision_step(
        spec, layout, w, inputs, lambda slots, formats, sr: wgrad_update(
            x, dy, w, slots, inputs.hparams, rule=spec.rule, config=config,
            wgrad=wgrad, precision=precision, formats=formats,
            stochastic_rounding=sr))
  w1, new = wgrad_update(x, dy, w, inputs.slots, inputs.hparams,
                         rule=spec.rule, config=config, wgrad=wgrad,
                         precision=precision)
  return _after_epilogue(spec, w1, new, inputs)


def step_from_grad(spec, layout, g, w, inputs):
  """The same step from an explicit gradient (Remark 1: ``g = 0``)."""
  if spec.regime == 3:
    return _deferred(spec, layout, g, w, inputs)
  if spec.low_precision is not None:
    lp = spec.low_precision

    def reference(slots, formats, sr):
      del formats  # the plan reads them from the settings
      return pallas_kernels.reference.apply_rule(
          spec.rule, g, w, slots, inputs.hparams, plan=lp.plan(slots, w),
          sr=sr)

    return _low_precision_step(spec, layout, w, inputs, reference)
  w1, new = spec.rule.apply(g, w, inputs.slots, inputs.hparams)
  return _after_epilogue(spec, w1, new, inputs)


def zero_cotangent(a):
  """A zero cotangent for a primal input that the backward only reads."""
  a = jnp.asarray(a)
  if jnp.issubdtype(a.dtype, jnp.inexact):
    return jnp.zeros_like(a)
  return np.zeros(a.shape, jax.dtypes.float0)
