"""`forge_jax.ScannedDenseStack`: a scanned stack of Dense layers whose
backward updates the *stacked* kernel and optimizer slots in place.

Large JAX models stack identical layers with ``nn.scan``/``lax.scan``: the
kernels live in one ``(L, in, out)`` array. A FORGE ``custom_vjp`` inside the
scan body would return each layer's new kernel as a cotangent, and scan's
transpose stacks those into a *fresh* params-sized buffer (one more per
slot): the gradient pool is back.

Here the whole stack is one ``jax.custom_vjp``:

* forward: a ``lax.scan`` over the layers, saving each layer's input and
  pre-activation (what ``nn.scan``'s own backward saves);
* backward: a reverse ``lax.scan`` whose **carry** holds ``dy`` and the
  stacked kernel and slots. Iteration ``i`` computes ``dz`` through the
  activation, ``db``, and ``dx`` from the *pre-update* kernel slice, then
  runs the layer's optimizer step in the fused kernel's epilogue in its
  ``layer=i`` mode, which reads and writes layer ``i`` of the carried stacks
  directly (no slice of ``W`` or a slot is copied out or back). XLA updates
  while-loop carries in place, so there is no gradient pool and no per-layer
  copy of the kernel or its slots.
  The carried stacks are returned as the "cotangents" of the kernel stack
  and its slots (``make_step`` reads them as new values, as for
  ``forge_jax.Dense``); the bias stack gets its ordinary gradient.

Outside a FORGE step (and with ``fused=False``) the module *is*
``nn.scan`` of a Dense layer followed by ``activation``.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import functools
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
import flax.linen as nn
from flax.linen import dtypes as flax_dtypes
from flax.core import FrozenDict
from flax.linen import initializers

import pallas_kernels
from pallas_kernels import fused_wgrad
from forge_jax import _context
from forge_jax import _paths
from forge_jax import clip as _clip
from forge_jax import _usage
from forge_jax.dense import linen_kernel_dtype, refuse_dtype


@dataclasses.dataclass(frozen=True, eq=False)
class _Static:
  """Static (non-array) arguments of the fused stack."""

  path: _context.Path
  activation: Callable[[jax.Array], jax.Array]
  dtype: Any
  precision: Any
  config: pallas_kernels.BlockConfig | None
  spec: Any
  layout: Any
  in_place_layer: bool  # stack_update: "layer" (True) or "slice" (False)
  wgrad: str = "fused"  # make_step's wgrad: "fused" | "xla"


def _matmul(x, kernel, precision):
  return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                         precision=precision)


def _layer(static, h, w, b):
  """One layer, exactly as nn.Dense then the activation: ``(y, z)``. ``h``:
  the layer's input in the computation dtype (nn.Dense casts it so)."""
  z = _matmul(h, w.astype(static.dtype), static.precision)
  if b is not None:
    z += jnp.reshape(b.astype(static.dtype), (1,) * (z.ndim - 1) + (-1,))
  return static.activation(z), z


def scan_saving(body, carry, per_layer, after):
  """``lax.scan(body, carry, per_layer)`` whose stacked outputs are written
  into carried stacks that are made no earlier than ``after`` is ready.

  ``lax.scan`` starts its stacked outputs from a constant (zeros), which XLA
  may compute, or fuse with another scan's, at the very start of the step. In
  a clipped step (``forge_jax/clip.py``) that keeps the update pass's saved
  activations -- ``(L, tokens, features)`` stacks -- live through the whole
  norm pass. Here their zero start comes out of an ``optimization_barrier``
  with ``after`` (the kernel stack the forward reads, which the update pass
  gets from the norm pass's barrier), so they are made when the forward runs.

  Args:
    body: ``body(carry, per_layer_i) -> (carry, saved_i)``, as for
      ``lax.scan``.
    carry: the initial carry.
    per_layer: the per-layer inputs, stacked on axis 0 (``L`` layers).
    after: an array the stacks' start waits for.

  Returns:
    ``(carry, saved)``, as ``lax.scan`` returns them.
  """
  num = jax.tree.leaves(per_layer)[0].shape[0]
  saved = jax.eval_shape(lambda c, p: body(c, p)[1], carry,
                         jax.tree.map(lambda a: a[0], per_layer))
  zero, _ = lax.optimization_barrier((jnp.zeros((), jnp.float32), after))
  stacks = jax.tree.map(lambda a: jnp.broadcast_to(
      zero.astype(a.dtype), (num, *a.shape)), saved)

  def write(state, i_per_layer):
    c, st = state
    i, p = i_per_layer
    c, out = body(c, p)
    return (c, jax.tree.map(
        lambda s_, o: lax.dynamic_update_index_in_dim(s_, o, i, 0), st,
        out)), None

  (carry, stacks), _ = lax.scan(write, (carry, stacks),
                                (jnp.arange(num), per_layer))
  return carry, stacks


def _forward(static, x, kernels, biases, save):
  """``(y, None)``, or with ``save`` ``(y, (xs, zs))``: each layer's input and
  pre-activation, stacked over the layers."""
  def body(h, wb):
    # The carry keeps the input's dtype, as nn.scan's (each layer's output,
    # after the activation, has it); the layer computes in static.dtype.
    w, b = wb
    h = h.astype(static.dtype)
    y, z = _layer(static, h, w, b)
    return y, ((h, z) if save else None)
  if save:
    return scan_saving(body, x, (kernels, biases), kernels)
  return lax.scan(body, x, (kernels, biases))


def check_stack_settings(where: str, num_layers, stack_update) -> None:
  """The settings a scanned stack (``ScannedDenseStack``, ``ScannedBlocks``)
  checks on every call."""
  # (An int or a NumPy integer, as nn.scan's length.)
  if (isinstance(num_layers, bool)
      or not isinstance(num_layers, numbers.Integral) or num_layers < 1):
    raise ValueError(f"{where}: num_layers={num_layers!r} must be an int >= 1")
  if stack_update not in ("auto", "layer", "slice"):
    raise ValueError(f"{where}: stack_update={stack_update!r} must be "
                     "'auto', 'layer' or 'slice'")


def require_regime_1(where: str, spec, what: str) -> None:
  """A scanned stack steps each layer of a stacked leaf on its own: refuses
  a family whose update reads the whole leaf (regime 2 or 3).

  Low-precision state (``moments=``, ``stochastic_rounding=``) is a
  regime-1 family's and is stepped per layer like any other state: a
  quantized moment's scales belong to blocks of one row, and the
  stochastic-rounding index of layer ``l``'s elements counts the layers
  before it (``pallas_kernels.quant.global_index``), as the standard path
  counts them in the stacked leaf.
  """
  if spec is None or spec.regime != 1:
    family = getattr(spec, "family", None)
    raise ValueError(
        f"{where}: the in-place stacked path supports regime-1 families "
        f"only (got {family!r}, regime {getattr(spec, 'regime', None)}). "
        "optax applies LAMB's trust ratio, Muon's orthogonalisation and "
        "regime-3 statistics to the whole stacked (L, in, out) leaf, which "
        f"a per-layer update cannot reproduce. Give this {what} fused=False "
        "(standard optax path).")


def updates_in_place(stack_update: str) -> bool:
  """``stack_update`` resolved: ``"auto"`` is ``"layer"`` on a GPU and
  ``"slice"`` in Pallas interpret mode."""
  return stack_update == "layer" or (
      stack_update == "auto" and not fused_wgrad.default_interpret())


def update_layer(spec, layout, in_place_layer: bool, i, x_i, dy_i, w_stack,
                 slot_stacks, inputs: _context.LayerInputs, config, wgrad,
                 precision):
  """One optimizer step of layer ``i`` of a stacked ``(L, in, out)`` kernel
  from its input ``x_i`` and output gradient ``dy_i``, inside a backward
  loop that carries the stacks; returns the new ``(w_stack, slot_stacks)``.

  The caller has already read the pre-update slice (for ``dx``) and ordered
  that read before this write (an ``optimization_barrier`` on ``dx`` and
  ``w_stack``).

  ``in_place_layer``: the fused kernel updates layer ``i`` of the carried
  stacks in place (``layer=i``: no slice of ``W`` or of a slot is copied out
  or back; with ``wgrad="xla"``, XLA's GEMM forms ``G`` and
  ``pallas_kernels.stored_g_update``, the fused kernel's epilogue, updates
  layer ``i`` in place). Otherwise layer
  ``i``'s ``W`` and slots are copied out of the stacks, stepped, and written
  back (one layer's ``W`` and slots of temporaries).

  Low-precision state (``spec.low_precision``): the slot stacks are the
  state's leaves as the layer carries them (a quantized moment's codes --
  int8 ones as their float transport, ``forge_jax.low_precision`` -- and
  its scales ``(L, in, ceil(out / 64))``), regrouped into ``Quantized``
  stacks for the kernel. With stochastic rounding the layer is always
  stepped inside the stacks (``layer=i``), whatever ``in_place_layer``
  says: each element's random bits hash its index in the whole stacked
  leaf (layer ``i`` starts at row ``i * in``), which a copied-out slice
  would count from 0.
  """
  lp = spec.low_precision
  if lp is not None and (in_place_layer or lp.sr_for(w_stack)):
    def step(slots, formats, sr):
      return _paths.wgrad_update(
          x_i, dy_i, w_stack, slots, inputs.hparams, rule=spec.rule,
          config=config, wgrad=wgrad, layer=i, precision=precision,
          formats=formats, stochastic_rounding=sr)
    w_stack, slot_stacks = _paths._low_precision_step(  # noqa: SLF001
        spec, layout, w_stack, inputs._replace(slots=tuple(slot_stacks)),
        step)
    return w_stack, tuple(slot_stacks)
  if in_place_layer:
    w_stack, slot_stacks = _paths.wgrad_update(
        x_i, dy_i, w_stack, slot_stacks, inputs.hparams, rule=spec.rule,
        config=config, wgrad=wgrad, layer=i, precision=precision)
    return w_stack, tuple(slot_stacks)
  w_i = lax.dynamic_index_in_dim(w_stack, i, keepdims=False)
  slots_i = tuple(lax.dynamic_index_in_dim(s, i, keepdims=False)
                  for s in slot_stacks)
  w_new, slots_new = _paths.step_in_backward(
      spec, layout, x_i, dy_i, w_i, inputs._replace(slots=slots_i), config,
      wgrad, precision)
  # Materialised before the write-back (see pallas_kernels.reference.apply_rule:
  # otherwise XLA fuses the update into the dynamic-update-slice and copies
  # the whole stack to protect that fusion's read of it).
  w_new, slots_new = lax.optimization_barrier((w_new, tuple(slots_new)))
  w_stack = lax.dynamic_update_index_in_dim(
      w_stack, w_new.astype(w_stack.dtype), i, 0)
  slot_stacks = tuple(
      lax.dynamic_update_index_in_dim(s, n.astype(s.dtype), i, 0)
      for s, n in zip(slot_stacks, slots_new))
  return w_stack, slot_stacks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_stack(static: _Static, x, kernels, biases,
                 inputs: _context.LayerInputs):
  return _forward(static, x, kernels, biases, save=False)[0]


def _fused_stack_fwd(static, x, kernels, biases, inputs):
  y, (xs, zs) = _forward(static, x, kernels, biases, save=True)
  return y, (xs, zs, kernels, biases, inputs)


def _fused_stack_bwd(static, res, dy):
  """Reverse loop over the layers; the stacked kernel and slots are carried
  and updated slice by slice (in place), and returned in place of their
  cotangents."""
  xs, zs, kernels, biases, inputs = res
  num_layers = kernels.shape[0]
  carried = dy.dtype  # the stack's input's and output's (xs: computed in)
  # The norm pass of a clipped step (forge_jax/clip.py): the layers' squared
  # gradient norms are summed into the carry; nothing is updated, and the
  # stacks are read, not carried (a carried stack that pass 2 reads again
  # would be copied into the loop).
  norm_pass = _clip.is_norm_pass(static.wgrad)

  def body(carry, per_layer):
    dy, w_stack, slot_stacks, sqnorm = carry
    i, x_i, z_i = per_layer
    w_i = lax.dynamic_index_in_dim(kernels if norm_pass else w_stack, i,
                                   keepdims=False)
    y_i, act_vjp = jax.vjp(static.activation, z_i)
    (dz,) = act_vjp(dy.astype(y_i.dtype))
    db = (jnp.sum(dz, axis=tuple(range(dz.ndim - 1))) if biases is not None
          else None)
    # dx reads the pre-update slice; the barrier orders that read before the
    # fused kernel overwrites the slice (as in forge_jax.Dense).
    dx = lax.dot_general(dz, w_i.astype(static.dtype),
                         (((dz.ndim - 1,), (1,)), ((), ())),
                         precision=static.precision)
    if norm_pass:
      sqnorm = sqnorm + _clip.layer_sqnorm(x_i, dz, static.wgrad,
                                           static.precision)
      return (dx.astype(dy.dtype), w_stack, slot_stacks, sqnorm), db
    dx, w_stack = lax.optimization_barrier((dx, w_stack))
    w_stack, slot_stacks = update_layer(
        static.spec, static.layout, static.in_place_layer, i, x_i, dz,
        w_stack, slot_stacks, inputs, static.config, static.wgrad,
        static.precision)
    return (dx.astype(dy.dtype), w_stack, slot_stacks, sqnorm), db

  with _paths.refusing_derivatives(
      f"forge_jax.ScannedDenseStack at {_context.layer_name(static.path)!r}"):
    (dx, new_kernels, new_slots, sqnorm), dbs = lax.scan(
        body, (dy, () if norm_pass else kernels,
               () if norm_pass else tuple(inputs.slots),
               jnp.zeros((), jnp.float32)),
        (jnp.arange(num_layers), xs, zs), reverse=True)
  dbias = None if biases is None else dbs.astype(biases.dtype)
  if norm_pass:
    return (dx.astype(carried), jnp.zeros_like(kernels), dbias,
            _clip.norm_pass_inputs(inputs, sqnorm))
  ctx = _context.current()
  if ctx is not None:
    ctx.bwd_traced.add(static.path)
  return dx.astype(carried), new_kernels, dbias, _context.LayerInputs(
      slots=new_slots,
      hparams=jax.tree.map(jnp.zeros_like, inputs.hparams),
      touched=jnp.ones_like(inputs.touched),
      shared=jax.tree.map(_paths.zero_cotangent, inputs.shared))


_fused_stack.defvjp(_fused_stack_fwd, _fused_stack_bwd)
_usage.register_fused_backward(_fused_stack_bwd)


def _identity(y):
  return y


def _scan_body(module, carry, _):
  return module._dense_layer(carry), None


class ScannedDenseStack(nn.Module):
  """``num_layers`` Dense layers ``features -> features``, stacked and scanned.

  Each layer is ``activation(nn.Dense(features)(h))`` -- the activation
  follows *every* layer, the last included (``activation=None``: identity).
  The parameters are ``{'kernel': (L, features, features), 'bias':
  (L, features)}`` in this module's scope, exactly the tree (and the initial
  values) of ``nn.scan(Layer, variable_axes={'params': 0},
  split_rngs={'params': True}, length=L)`` of a ``nn.Dense`` subclass whose
  ``__call__(h, _)`` returns ``(activation(dense(h)), None)``.

  Outside a FORGE step (or with ``fused=False``, or when
  ``make_step(..., shared="standard")`` moves a shared stack to the standard
  path) it *is* that ``nn.scan``.
  Inside a step built by :func:`forge_jax.make_step`, its backward is one
  reverse loop over the layers that updates the stacked kernel and its
  stacked optimizer slots in place, one layer at a time (regime-1 families
  only: SGD ... Lion; others are refused -- optax computes LAMB's trust
  ratio, Muon's orthogonalisation and Adafactor's statistics over the whole
  stacked leaf, which a per-layer step cannot reproduce; use ``fused=False``).
  The kernel stack's hyperparameters and weight-decay mask entry are those of
  its one parameter leaf, shared by the ``L`` layers, as in optax.
  Low-precision state (``forge_jax.adamw(..., moments="int8" | "fp8" | ...,
  stochastic_rounding=True)``) is stepped the same way: the state holds
  stacked ``Quantized(q (L, in, out), scale (L, in, ceil(out / 64)))``
  slots (or stacked float arrays), and layer ``i`` of them is requantized
  in place; stochastic rounding hashes each element's index in the whole
  stacked leaf, as the standard path does.

  The input's last dimension must be ``features``, and each layer's output
  (computed in ``dtype``, or the input's dtype promoted with the
  parameters', then the activation) must have the input's dtype, as for
  ``nn.scan``, whose carry keeps one type.

  ``stack_update`` says how the backward loop reaches layer ``i``'s kernel
  and slots: ``"layer"`` -- the fused kernel reads and writes them inside the
  carried stacks (``fused_wgrad_update(..., layer=i)``), nothing copied
  (under ``make_step(..., wgrad="xla")`` XLA's GEMM forms layer ``i``'s
  ``G`` and the fused kernel's epilogue, ``stored_g_update``, updates the
  layer in place);
  ``"slice"`` -- they are copied out of the stacks, stepped, and written back
  (one layer's W and slots of temporaries); ``"auto"`` (default) -- ``"layer"``
  on a GPU, ``"slice"`` in Pallas interpret mode (CPU), whose interpreter
  copies every operand it is given and so would copy the whole stacks.

  ``metadata_params``: as ``nn.scan``'s, passed to it: with a boxed
  ``kernel_init`` (``nn.with_logical_partitioning(init, ('embed',
  'mlp'))``), ``{nn.PARTITION_NAME: 'layers'}`` names the stacked axis 0 of
  the boxes (without it flax cannot stack boxed parameters).
  ``make_step`` trains the boxed tree and returns it boxed, names kept.
  """

  features: int
  num_layers: int
  activation: Callable[[jax.Array], jax.Array] | None = nn.relu
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Callable = nn.linear.default_kernel_init
  bias_init: Callable = initializers.zeros_init()
  fused: bool = True
  block_config: pallas_kernels.BlockConfig | None = None
  stack_update: str = "auto"
  metadata_params: Mapping[Any, Any] = FrozenDict()

  def _act(self, y):
    return y if self.activation is None else self.activation(y)

  def _dense_layer(self, inputs):
    """One layer inside the nn.scan: nn.Dense's computation, then activation."""
    kernel = self.param('kernel', self.kernel_init,
                        (jnp.shape(inputs)[-1], self.features),
                        self.param_dtype)
    bias = (self.param('bias', self.bias_init, (self.features,),
                       self.param_dtype) if self.use_bias else None)
    inputs, kernel, bias = flax_dtypes.promote_dtype(inputs, kernel, bias,
                                                     dtype=self.dtype)
    y = lax.dot_general(inputs, kernel,
                        (((inputs.ndim - 1,), (0,)), ((), ())),
                        precision=self.precision)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return self._act(y)

  def _scanned(self, x):
    try:
      y, _ = nn.scan(_scan_body, variable_axes={'params': 0},
                     split_rngs={'params': True},
                     length=self.num_layers,
                     metadata_params=dict(self.metadata_params))(self, x,
                                                                 None)
    except TypeError as e:  # the scan's own words, without the module's name
      said = " ".join(str(e).split())
      if "carry input and carry output must have equal types" not in said:
        raise
      raise ValueError(
          f"{self._where()}: a layer's output is not of its input's type "
          f"({jax.typeof(x).str_short()}), which the next layer takes. The "
          f"layers compute in {self._compute_dtype(x)} ("
          + ("dtype" if self.dtype is not None else
             "the input promoted with the parameters' dtype")
          + "), then apply the activation: give the input the dtype the "
          "activation returns, or make the activation return the input's. "
          f"(jax: {said})") from e
    return y

  def _compute_dtype(self, x) -> str:
    """The dtype the layers compute in for input ``x``: ``dtype``, or the
    input's promoted with the parameters' own dtypes where they exist
    (cast after init, say), else ``param_dtype``'s."""
    params = [jnp.result_type(nn.meta.unbox(self.get_variable("params", n)))
              if self.has_variable("params", n) else self.param_dtype
              for n in ("kernel", "bias")[:1 + self.use_bias]]
    return str(jnp.dtype(flax_dtypes.canonicalize_dtype(
        x, *(jnp.zeros((), d) for d in params), dtype=self.dtype)))

  def _where(self) -> str:
    return (f"forge_jax.ScannedDenseStack at "
            f"{_context.layer_name(tuple(self.path))!r}")

  def _check_width(self, x) -> None:
    """The input of a stack of ``features -> features`` layers: its last
    dimension ``features`` (each layer's output is the next one's input,
    the scan's carry)."""
    if jnp.ndim(x) == 0 or jnp.shape(x)[-1] != self.features:
      raise ValueError(
          f"{self._where()}: the input's last dimension must equal features "
          f"({self.features}), each layer's output being the next one's "
          f"input; got an input of shape {jnp.shape(x)}")

  @nn.compact
  def __call__(self, x):
    # Checked on every call (init, eval, either path), not only where a
    # fused step reads them.
    where = self._where()
    check_stack_settings(where, self.num_layers, self.stack_update)
    self._check_width(x)
    fused_wgrad.check_block_config(self.block_config, where)
    if _context.current_tap() is not None:
      raise ValueError(
          f"{where}: a ScannedDenseStack cannot sit inside a "
          "forge_jax.ScannedBlocks block (one scan over the blocks; make the "
          "stack's layers forge_jax.Dense layers of the block instead)")
    ctx = _context.current()
    if ctx is not None and not self.fused and ctx.mode == "discover":
      ctx.unfused.add(tuple(self.path))
    if (ctx is None or not self.fused or self.is_initializing()
        or ctx.is_standard(self.path)):
      return self._scanned(x)
    path = tuple(self.path)
    name = _context.layer_name(path)
    refuse_dtype("forge_jax.ScannedDenseStack", name,
                 linen_kernel_dtype(self), self.dtype, x, ctx.spec)
    if ctx.mode == "discover":
      _context.register_layer(
          ctx, path, (self.num_layers, jnp.shape(x)[-1], self.features),
          self.param_dtype, "forge_jax.ScannedDenseStack")
      return self._scanned(x)

    spec = ctx.spec
    require_regime_1(f"forge_jax.ScannedDenseStack at {name!r}", spec,
                     "stack")
    if path not in ctx.inputs:
      raise RuntimeError(
          f"forge_jax.ScannedDenseStack at {name!r} was not seen when the "
          "step discovered its FORGE layers: the loss function must call the "
          "same layers on every trace")
    kernels = self.get_variable('params', 'kernel')
    biases = self.get_variable('params', 'bias') if self.use_bias else None
    want = (self.num_layers, jnp.shape(x)[-1], self.features)
    if kernels is None or tuple(kernels.shape) != want:
      raise ValueError(
          f"forge_jax.ScannedDenseStack at {name!r}: expected a 'kernel' "
          f"param of shape {want}, got "
          f"{None if kernels is None else kernels.shape}")
    in_place_layer = updates_in_place(self.stack_update)
    dtype = flax_dtypes.canonicalize_dtype(x, kernels, biases,
                                           dtype=self.dtype)
    static = _Static(path=path, activation=self.activation or _identity,
                     dtype=dtype,
                     precision=self.precision, config=self.block_config,
                     spec=spec, layout=ctx.layouts.get(path),
                     in_place_layer=in_place_layer, wgrad=ctx.wgrad)
    return _fused_stack(static, x, kernels, biases, ctx.inputs[path])
