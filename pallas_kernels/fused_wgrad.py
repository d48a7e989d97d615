"""Fused weight gradient + optimizer update: ``G = x^T dy`` never leaves registers.

For a linear layer ``y = x @ W`` (``W`` of shape ``(in, out)``) the weight
gradient of a step is ``G = x^T dy``, a sum over the ``BT`` token rows.
:func:`fused_wgrad_update` computes ``G`` one output tile at a time and
applies an elementwise optimizer rule (an
:class:`~pallas_kernels.rules.UpdateRule`) to that tile in the kernel's
epilogue, updating ``W`` and its state in place; ``G`` is never written to
memory. :func:`stored_g_update` is the epilogue alone, on a gradient
already in memory; :func:`unfused_wgrad_update` the same step with ``G``
formed by XLA.

The caller must have read the *pre-update* ``W`` (for ``dx = dy @ W^T``)
before the kernel runs; inside ``jax.jit`` data dependencies order that.

The kernels are :mod:`pallas_kernels.triton_kernel` and
:mod:`pallas_kernels.mosaic_kernel` (Hopper; which one a call takes:
:func:`~pallas_kernels.tuning_cache.select_backend`, shown by
:func:`describe_backend`); the Triton tiling :mod:`pallas_kernels.tiling`
(chosen by :func:`~pallas_kernels.tuning_cache.select_config`); the input
checks :mod:`pallas_kernels.checks`, the reference
:mod:`pallas_kernels.reference`.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import lowp, mosaic_kernel, triton_kernel
from pallas_kernels.checks import (
    check_float_dtype,
    check_values,
    check_inputs,
    checked_inputs,
    checked_state_inputs,
    common_dtype,
    flatten_tokens,
    planned_slots,
)
from pallas_kernels.interpret import (check_interpret, default_interpret,
                                      warn_interpret_once)
from pallas_kernels.reference import apply_rule, fused_wgrad_update_reference
from pallas_kernels.rules import HPARAM_VECTOR_LEN, UpdateRule
from pallas_kernels.tiling import BlockConfig, check_block_config
from pallas_kernels.tuning_cache import (
    BACKEND_ENV_VAR,
    BackendChoice,
    config_label,
    select_backend,
    select_config,
)

__all__ = ["BackendChoice", "BlockConfig", "check_block_config",
           "default_interpret", "describe_backend", "fused_wgrad_update",
           "fused_wgrad_update_reference", "select_backend", "select_config",
           "stored_g_update", "unfused_wgrad_update"]


def _interpret(interpret: bool | None, where: str) -> bool:
  """``interpret``, or when ``None`` whether there is no GPU; running in
  interpret mode for that reason gives the one-time
  :class:`~pallas_kernels.interpret.InterpretModeWarning`."""
  interpret = check_interpret(interpret, where)
  if interpret is not None:
    return interpret
  interpret = default_interpret()
  if interpret:
    warn_interpret_once()
  return interpret


def _dot_precision(x, dy, w):
  # fp32 parameters get IEEE fp32 products, not TF32, so fp32 parity holds.
  if jnp.float32 in (x.dtype, dy.dtype, w.dtype):
    return lax.Precision.HIGHEST
  return None


def fused_wgrad_update(
    x: jax.Array,
    dy: jax.Array,
    w: jax.Array,
    slots: Sequence[jax.Array],
    hparams: jax.Array,
    *,
    rule: UpdateRule,
    config: BlockConfig | mosaic_kernel.MosaicConfig | None = None,
    interpret: bool | None = None,
    layer: jax.Array | int | None = None,
    backend: str | None = None,
    formats=None,
    stochastic_rounding=None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """One optimizer step of ``w`` from ``G = x^T dy``, without storing ``G``.

  Args:
    x: layer input, ``(..., in)``; leading dimensions are the tokens.
    dy: gradient of the layer output, ``(..., out)``, same leading dims.
      ``x`` and ``dy`` of different float dtypes are promoted to their common
      dtype first, as ``jnp.dot`` does.
    w: the weight, ``(in, out)``, fp32 or bf16 (fp16 works too; float64
      and 8- or 4-bit floats are refused). Written in place.
    slots: the rule's state arrays (``rule.slots``), a sequence, each of
      ``w``'s shape, in float32, bfloat16 or float16 (e.g. ``mu`` in
      ``mu_dtype``; float64 and 8- or 4-bit floats are refused), or
      quantized: a :class:`pallas_kernels.quant.Quantized` pair ``(q,
      scale)`` (not a plain tuple) -- codes of ``w``'s shape in int8,
      float8_e4m3fn or float8_e5m2 and float32 scales ``(..., in,
      ceil(out / 64))``, one per 64 consecutive elements of a row
      (:mod:`pallas_kernels.lowp`; the Mosaic GPU backend takes int8 ones,
      not fp8). Written in place.
    hparams: ``rule.pack(...)``: this step's runtime hyperparameters.
    rule: the optimizer family's elementwise update.
    config: tiling: a :class:`BlockConfig` (a Triton tiling) or a
      :class:`~pallas_kernels.mosaic_kernel.MosaicConfig` (a Mosaic GPU
      one); with ``backend=None`` its type picks the backend. When
      ``None``, the chosen backend's tiling for the case: Triton's
      :func:`select_config` (the autotuned winner cached for this GPU, else
      a heuristic); Mosaic GPU's cached entry where it covers the case,
      else the nearest cached entry's tiling that does
      (:func:`~pallas_kernels.tuning_cache.nearest_covering`), else
      :func:`~pallas_kernels.mosaic_kernel.default_config` (with int8
      moments, its ``quantized`` tiling; always the default in interpret
      mode).
    interpret: run in Pallas interpret mode (CPU); default: unless on a GPU
      (without one, the first such call gives an ``InterpretModeWarning``).
    layer: for a stack of layers: ``w`` and the slots are ``(L, in, out)``
      and only layer ``layer`` (an integer scalar, may be traced) is updated,
      in place in the stacks -- no slice is copied out or back. A static
      index out of range raises; a traced one is clamped into ``[0, L)``, as
      ``lax.dynamic_update_slice`` clamps.
    backend: ``"triton"``, ``"mosaic_gpu"`` (Hopper,
      :mod:`pallas_kernels.mosaic_kernel`; a case it does not cover raises
      ``ValueError`` with the reason, never falling back silently) or
      ``None``: the backend of ``config``'s type; else the one
      ``$FORGE_BACKEND`` names (``triton`` or ``mosaic_gpu``); else Mosaic
      GPU where it is known to be faster -- compiled on a GPU of compute
      capability 9.0 or newer, for a case the autotune cache measured it
      faster than the Triton kernel on this device kind and that it
      covers (int8 moments: an entry measured with them), or, for a case
      without an entry, where its nearest entry of the same rule and
      dtypes did and its tiling covers the case -- and Triton
      everywhere else, and always with fp8 moments or stochastic rounding,
      which only the Triton kernel supports
      (:func:`~pallas_kernels.tuning_cache.select_backend`;
      :func:`describe_backend` tells which a call takes, and why).
    formats: for quantized slots whose format is not the default of their
      codes' dtype (block 64, second-moment floor ``v_floor=1``): one
      :class:`~pallas_kernels.quant.MomentFormat` or ``None`` per slot (a
      single ``MomentFormat`` is refused), or a mapping from slot name to
      format. Which slots are second moments
      (clamped at zero and floored) is the rule's
      :attr:`~pallas_kernels.rules.UpdateRule.second_moments`. A quantized
      slot's blocks must not straddle a column sub-tile of the tiling: a
      chosen tiling is fitted to them, a ``config`` that splits them is
      refused.
    stochastic_rounding: ``None`` (round to nearest), or ``(seed, step)``,
      integer scalars (Python or traced, taken modulo 2**32; a new step
      does not recompile): a bfloat16 ``w`` is stored by
      :func:`pallas_kernels.quant.stochastic_round_to_bf16` with each
      element's global flat index, independent of the tiling.

  Returns:
    ``(w_new, slots_new)``, aliasing the buffers of ``w`` and ``slots`` when
    the caller donates them. For a rule with ``outputs`` (Muon's ``mu_hat``),
    ``slots_new`` continues with those fresh arrays (``w``'s shape,
    ``rule.output_dtype``). For a rule with ``updates_weight=False`` the
    kernel does not touch ``w`` and ``w_new`` is ``w``. A quantized slot
    comes back as a ``Quantized`` pair.

  Example:
    >>> from pallas_kernels import ADAMW, fused_wgrad_update
    >>> h = ADAMW.pack(lr=1e-3, b1=0.9, b2=0.999, one_minus_b1=0.1,
    ...                one_minus_b2=0.001, eps=1e-8, eps_root=0.0,
    ...                weight_decay=1e-4, bc1=0.1, bc2=0.001, bc1_next=0.19)
    >>> w, (mu, nu) = fused_wgrad_update(x, dy, w, (mu, nu), h, rule=ADAMW)

    With int8 moments (``quant.quantize`` makes the pairs)::

    >>> from pallas_kernels import quant
    >>> fmt = quant.MomentFormat("int8")
    >>> mu_q = quant.quantize(mu, fmt)
    >>> nu_q = quant.quantize(nu, fmt, second_moment=True)
    >>> w, (mu_q, nu_q) = fused_wgrad_update(x, dy, w, (mu_q, nu_q), h,
    ...                                      rule=ADAMW)
  """
  where = "fused_wgrad_update"
  x, dy, w, slots, plan = checked_state_inputs(
      x, dy, w, slots, hparams, rule, layer, formats, stochastic_rounding,
      where=where)
  x2, dy2 = flatten_tokens(x, dy)
  bt = x2.shape[0]
  n_in, n_out = w.shape[-2:]
  stacked = layer is not None
  if stacked:
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, w.shape[0] - 1)
  interpret = _interpret(interpret, where)
  choice = _decide(bt, x2.dtype, w, slots, plan, rule, interpret=interpret,
                   stacked=stacked, config=config, backend=backend,
                   varying=_varying(x2, dy2, w, *jax.tree.leaves(slots)),
                   where=where)
  if bt == 0:
    # No tokens: G = 0, the optimizer still steps (moments decay, weight
    # decay), whichever backend was asked for (its arguments still checked:
    # _decide refused what that backend does not take).
    return apply_rule(rule, jnp.zeros((n_in, n_out), jnp.float32), w, slots,
                      hparams, layer, plan=plan, sr=stochastic_rounding)
  if choice.backend == "mosaic_gpu":
    return mosaic_kernel.launch((x2, dy2), w, slots, hparams, rule=rule,
                                cfg=choice.config, interpret=interpret,
                                layer=layer, plan=plan)
  return triton_kernel.launch(
      (x2, dy2), w, slots, hparams, rule=rule, cfg=choice.config,
      layer=layer, interpret=interpret, bt=bt,
      precision=_dot_precision(x, dy, w), plan=plan, sr=stochastic_rounding)


def _slot_dtypes(slots, plan) -> list:
  """The slots' dtypes as the backend choice and the autotune cache read
  them: a quantized slot counts as float32 (its values in the epilogue)."""
  if plan is None:
    return [a.dtype for a in slots]
  return plan.logical_dtypes(slots)


def _mosaic_slot_dtypes(slots, plan) -> list | None:
  """With low-precision state the Mosaic GPU kernel takes (int8 moments, no
  stochastic rounding), the slots' dtypes as it holds them (int8 codes),
  by which its autotune cache keys the case; else ``None``."""
  if plan is None or mosaic_kernel.low_precision_problem(plan) is not None:
    return None
  return [jnp.dtype(a.q.dtype if isinstance(a, lowp.Quantized) else a.dtype)
          for a in slots]


def _decide(bt: int, x_dtype, w, slots, plan, rule: UpdateRule, *,
            interpret: bool, stacked: bool, config, backend, varying: bool,
            where: str, g_stored: bool = False) -> BackendChoice:
  """The backend and tiling a kernel call with these checked arguments
  runs: :func:`select_backend`'s choice, a Triton tiling fitted to the
  quantized slots' blocks (:func:`_triton_tiling`); a case the chosen
  backend does not take is refused in plain words (Mosaic GPU:
  :func:`~pallas_kernels.mosaic_kernel.unsupported`, without tokens all
  but its K loop's needs). The kernel calls and :func:`describe_backend`
  share it, so that what the latter tells is what runs.

  ``x_dtype``: ``x``'s and ``dy``'s common dtype (with ``g_stored``, the
  stored gradient's); ``slots`` as :func:`checked_state_inputs` returns
  them (arrays or ``jax.ShapeDtypeStruct`` s), ``plan`` its plan."""
  n_in, n_out = w.shape[-2:]
  choice = select_backend(bt, n_in, n_out, w.dtype, _slot_dtypes(slots, plan),
                          rule, x_dtype, interpret=interpret, stacked=stacked,
                          g_stored=g_stored, config=config, backend=backend,
                          varying=varying, where=where,
                          low_precision=plan is not None,
                          mosaic_slot_dtypes=_mosaic_slot_dtypes(slots, plan))
  if choice.backend == "mosaic_gpu":
    _mosaic_refusal(choice, varying, where, lambda: (
        mosaic_kernel.unsupported(bt, n_in, n_out, x_dtype, w, slots, rule,
                                  choice.config, stacked=stacked,
                                  g_stored=g_stored,
                                  low_precision=plan is not None,
                                  plan=plan, k_loop=bt > 0)))
    return choice
  if g_stored:
    check_block_config(choice.config, f"{where}(config=...)")
  return choice._replace(
      config=_triton_tiling(choice, plan, n_out, config, where))


def _triton_tiling(choice, plan, n_out: int, config, where: str):
  """The Triton tiling a call runs: ``choice``'s; with quantized slots,
  fitted to their blocks (:func:`lowp.fit_tiling`) unless the caller gave
  it (then refused if it splits a block)."""
  if plan is None:
    return choice.config
  cfg = choice.config
  if not plan.quantized:
    return cfg
  if config is not None:
    why = lowp.tiling_problem(cfg, plan, n_out)
    if why is not None:
      raise ValueError(f"{where}(config={config_label(cfg)}): the tiling "
                       f"cannot hold quantized moments: {why}")
    return cfg
  return lowp.fit_tiling(cfg, plan, n_out)


def _varying(*arrays) -> bool:
  """Whether any of ``arrays`` varies over a ``shard_map`` mesh axis (never
  for shapes without values, ``jax.ShapeDtypeStruct`` s)."""
  if any(isinstance(a, jax.ShapeDtypeStruct) for a in arrays):
    return False
  return bool(triton_kernel.varying_axes(arrays).varying)


def describe_backend(x, dy, w, slots, *, rule: UpdateRule, config=None,
                     backend: str | None = None,
                     interpret: bool | None = None,
                     layer=None, formats=None,
                     stochastic_rounding=None) -> BackendChoice:
  """The backend and tiling :func:`fused_wgrad_update` runs with these
  arguments, and why: the kernel call's own decision
  (:func:`~pallas_kernels.tuning_cache.select_backend`, with a Triton
  tiling fitted to quantized slots' blocks), and its refusals -- a case the
  chosen backend does not take raises the ``ValueError`` the call raises.

  ``x``, ``dy``, ``w`` and ``slots`` may be arrays or
  ``jax.ShapeDtypeStruct`` s (only shapes and dtypes are read), a
  quantized slot a ``Quantized`` pair of them, checked as the call checks
  them; ``formats`` as :func:`fused_wgrad_update` takes it; ``layer`` only
  says whether the state is stacked (either backend takes a stack),
  ``stochastic_rounding`` only whether it is asked for (with
  ``backend=None`` such a call takes the Triton kernel).

  Returns:
    A :class:`~pallas_kernels.tuning_cache.BackendChoice`
    ``(backend, config, reason)``, e.g. ``("mosaic_gpu",
    MosaicConfig(...), "the autotune cache's Mosaic GPU tiling
    64x128x64/4,b2,pn measured 101.1 us against the Triton kernel's
    105.0 us on NVIDIA H200")``.
  """
  where = "describe_backend"
  # Only whether stochastic rounding is asked for is read: a stand-in
  # (seed, step) for the checks, once the value given passes the call's.
  if stochastic_rounding is not None:
    lowp._check_seed_step(stochastic_rounding, where)
  sr = None if stochastic_rounding is None else (0, 0)
  slots, plan, stand_ins = planned_slots(slots, rule, w, formats, sr,
                                         where=where)
  # (Stand-ins: no hyperparameters here; any layer of a stack.)
  check_inputs(x, dy, w, stand_ins,
               jax.ShapeDtypeStruct((HPARAM_VECTOR_LEN,), jnp.float32), rule,
               None if layer is None else 0)
  interpret = check_interpret(interpret, where)
  if interpret is None:
    interpret = default_interpret()
  return _decide(math.prod(x.shape[:-1]), common_dtype(x, dy), w, slots,
                 plan, rule, interpret=interpret, stacked=layer is not None,
                 config=config, backend=backend,
                 varying=_varying(x, dy, w, *jax.tree.leaves(slots)),
                 where=where)


def _mosaic_refusal(choice, varying: bool, where: str, why_not) -> None:
  """Raises, in plain words, when the Mosaic GPU backend that ``choice`` (a
  :class:`~pallas_kernels.tuning_cache.BackendChoice`) took cannot run:
  inside ``shard_map`` on varying operands, or a case ``why_not()`` (the
  kernel's :func:`~pallas_kernels.mosaic_kernel.unsupported`) refuses."""
  if varying:
    why = ("inside shard_map, on operands that vary over a mesh axis, the "
           "Mosaic GPU kernel cannot run (jax's mpmd_map, which it is built "
           "on, refuses state refs that vary over mesh axes)")
  else:
    why = why_not()
  if why is None:
    return
  if choice.reason.startswith("config is"):
    fix = "pass a BlockConfig, or no config, for this case"
  else:
    fix = "use backend='triton' for this case" + (
        f" (or unset ${BACKEND_ENV_VAR})"
        if choice.reason.startswith("$") else "")
  raise ValueError(f"{where}(backend='mosaic_gpu'): {why}. The Mosaic GPU "
                   f"backend was chosen because {choice.reason}; {fix}.")


def unfused_wgrad_update(x, dy, w, slots, hparams, *, rule: UpdateRule,
                         layer=None, precision=None, formats=None,
                         stochastic_rounding=None):
  """The same step as :func:`fused_wgrad_update`, unfused: XLA's GEMM forms
  ``G = x^T dy`` in memory and ``rule.apply`` (XLA's elementwise code)
  consumes it -- or, for layer ``layer`` of stacks on a GPU,
  :func:`stored_g_update` (the fused kernel's epilogue on that ``G``),
  which updates the layer in place where XLA would copy each new slice into
  its stack. In Pallas interpret mode (no GPU) the stacked case keeps
  XLA's rule and a dynamic-update-slice per array: the interpreter copies
  every operand, the whole stacks, once per grid program.

  ``G`` is formed as JAX's transpose of a ``Dense`` layer's dot forms the
  kernel's gradient (``dy^T x`` over every token axis, transposed), stored in
  ``x``'s and ``dy``'s common dtype: for bf16 operands it is the gradient
  ``jax.grad`` gives optax, bit for bit. ``precision`` is the GEMM's (the
  layer's ``precision``); ``None``: the default, except that fp32 operands
  get fp32 products (``HIGHEST``, as in the fused kernel). For shapes where
  the fused kernel is slower than XLA's GEMM plus an elementwise update
  (``forge_jax.make_step(..., wgrad="xla")``); called inside a layer's
  backward, ``G`` lives for that one call. Otherwise the same arguments and
  returns as :func:`fused_wgrad_update`, without ``config``, ``interpret``
  and ``backend`` (on a GPU a stack goes through :func:`stored_g_update`
  with its default tiling and backend, compiled).
  """
  x, dy, w, slots, plan = checked_state_inputs(
      x, dy, w, slots, hparams, rule, layer, formats, stochastic_rounding,
      where="unfused_wgrad_update")
  # G as JAX's transpose of the layer's dot forms it -- dy^T x over every
  # token axis at once, then transposed -- so that it rounds as optax's does.
  tokens = tuple(range(x.ndim - 1))
  if precision is None and x.dtype == jnp.float32:  # (x, dy: one dtype)
    precision = lax.Precision.HIGHEST
  g = lax.dot_general(dy, x, ((tokens, tokens), ((), ())),
                      precision=precision,
                      preferred_element_type=x.dtype).T
  if layer is not None and not default_interpret():
    # Layer `layer` of the stacks, in place: the fused kernel's epilogue on
    # the stored G. (XLA's elementwise rule plus a dynamic-update-slice per
    # array would copy every new slice into its stack once more.)
    return stored_g_update(g, w, slots, hparams, rule=rule, layer=layer,
                           interpret=False, formats=formats,
                           stochastic_rounding=stochastic_rounding)
  return apply_rule(rule, g, w, slots, hparams, layer, plan=plan,
                    sr=stochastic_rounding)


def stored_g_update(g, w, slots, hparams, *, rule: UpdateRule,
                    config=None, interpret: bool | None = None, layer=None,
                    backend: str | None = None, formats=None,
                    stochastic_rounding=None):
  """One optimizer step of ``w`` from a gradient ``g`` already in memory:
  the fused kernel's epilogue without its GEMM (the same kernel body), ``W``
  and the slots updated in place.

  For a weight gradient formed by another GEMM (``wgrad="xla"``) on a
  stacked ``(L, in, out)`` kernel: with ``layer=i`` it updates layer ``i``
  of ``w`` and of each slot where they lie, as :func:`fused_wgrad_update`
  does, where XLA's elementwise rule would write new slices and copy each
  into its stack. ``g`` is ``(in, out)`` (one layer), of any float dtype;
  it is read once, in fp32. ``config``: the tiling (``block_bt``,
  ``num_stages`` and ``group_in`` do not matter here); default
  :meth:`BlockConfig.stored_default`. ``backend``: ``None`` (the backend
  of ``config``'s type, else ``$FORGE_BACKEND``'s, else Triton: the cache
  holds no measurement of a stored ``G``), ``"triton"`` or
  ``"mosaic_gpu"`` (``G`` streamed through
  the state ring with the state; ``config`` a ``MosaicConfig`` with
  ``state_ring``, default :func:`mosaic_kernel.stored_config`; a case it
  does not cover raises ``ValueError`` with the reason, quantized slots
  and ``stochastic_rounding`` among them; with the default backend they
  take the Triton kernel). Otherwise the arguments and returns of
  :func:`fused_wgrad_update`.
  """
  where = "stored_g_update"
  check_values(where, g=g, w=w)
  for name, v in (("g", g), ("w", w)):  # (nested lists are arrays here)
    if v is None:
      raise TypeError(f"{name} must be an array, got NoneType")
  g, w = jnp.asarray(g), jnp.asarray(w)
  check_float_dtype("g", g)
  if w.ndim < 2:
    raise ValueError(f"w must be 2-D (in, out), got shape {w.shape}")
  n_in, n_out = w.shape[-2:]
  if g.shape != (n_in, n_out):
    raise ValueError(f"g must have the shape of one layer of w, "
                     f"{(n_in, n_out)}, got {g.shape}")
  # x, dy stand-ins of the right widths: the shared checks (w, slots,
  # hparams, layer) need them.
  _, _, w, slots, plan = checked_state_inputs(
      jax.ShapeDtypeStruct((1, n_in), g.dtype),
      jax.ShapeDtypeStruct((1, n_out), g.dtype), w, slots, hparams, rule,
      layer, formats, stochastic_rounding, where=where, stand_ins=True)
  if layer is not None:
    layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, w.shape[0] - 1)
  interpret = _interpret(interpret, where)
  choice = _decide(0, g.dtype, w, slots, plan, rule, interpret=interpret,
                   stacked=layer is not None, config=config, backend=backend,
                   varying=_varying(g, w, *jax.tree.leaves(slots)),
                   where=where, g_stored=True)
  if choice.backend == "mosaic_gpu":
    return mosaic_kernel.launch((g,), w, slots, hparams, rule=rule,
                                cfg=choice.config, interpret=interpret,
                                layer=layer)
  return triton_kernel.launch((g,), w, slots, hparams, rule=rule,
                              cfg=choice.config, layer=layer,
                              interpret=interpret, bt=0, precision=None,
                              plan=plan, sr=stochastic_rounding)
