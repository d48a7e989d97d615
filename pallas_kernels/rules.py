"""Per-family update rules for the fused weight-gradient kernel's epilogue.

A regime-1 optimizer step is elementwise: a coordinate's new weight and state
depend only on its own gradient, weight and state. An :class:`UpdateRule`
captures exactly that, as a function of fp32 values, so one kernel body
(:mod:`pallas_kernels.fused_wgrad`) serves every family and the same function
is the pure-``jnp`` reference.

Hyperparameters (learning rate from a schedule, bias corrections, ...) are
*runtime* scalars packed in one small fp32 vector, so a new learning rate never
recompiles the kernel. Anything that changes the kernel's code (``nesterov``)
is a static field of the rule instead.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

# Triton blocks need a power-of-two number of elements: the hyperparameter
# vector is padded to this length.
HPARAM_VECTOR_LEN = 16

UpdateFn = Callable[
    [jax.Array, jax.Array, tuple[jax.Array, ...], Mapping[str, jax.Array]],
    tuple[jax.Array, tuple[jax.Array, ...]],
]


@dataclasses.dataclass(frozen=True)
class UpdateRule:
  """An elementwise optimizer step ``(g, w, slots, h) -> (w', slots')``.

  Attributes:
    name: family name, e.g. ``"adamw"``; also the kernel's name suffix.
    slots: names of the state arrays kept beside the weight, in order (they
      have the weight's shape; e.g. ``("mu", "nu")``).
    hparams: names of the runtime scalars the update reads, in order.
    update: ``update(g, w, slots, h)`` on fp32 arrays, ``h`` a mapping from
      hyperparameter name to an fp32 scalar; returns the new weight and the new
      slots (fp32; the caller casts to storage dtypes).
  """

  name: str
  slots: tuple[str, ...]
  hparams: tuple[str, ...]
  update: UpdateFn

  def __post_init__(self):
    if len(self.hparams) > HPARAM_VECTOR_LEN:
      raise ValueError(
          f"rule {self.name!r} has {len(self.hparams)} hyperparameters; at most"
          f" {HPARAM_VECTOR_LEN} fit the kernel's hyperparameter vector")

  def pack(self, **values) -> jax.Array:
    """Packs named hyperparameters into the kernel's fp32 vector."""
    missing = [n for n in self.hparams if n not in values]
    extra = [n for n in values if n not in self.hparams]
    if missing or extra:
      raise ValueError(
          f"rule {self.name!r} takes hyperparameters {self.hparams}; "
          f"missing {missing}, unexpected {extra}")
    vec = jnp.stack(
        [jnp.asarray(values[n], jnp.float32).reshape(()) for n in self.hparams])
    return jnp.pad(vec, (0, HPARAM_VECTOR_LEN - len(self.hparams)))

  def unpack(self, vec) -> dict[str, jax.Array]:
    """Reads the named scalars back out of a packed vector (or vector ref)."""
    return {n: vec[i] for i, n in enumerate(self.hparams)}

  def apply(self, g, w, slots: Sequence[jax.Array], hparams: jax.Array):
    """The rule on whole arrays in fp32, cast back to the storage dtypes."""
    f32 = jnp.float32
    w_new, slots_new = self.update(
        g.astype(f32), w.astype(f32), tuple(s.astype(f32) for s in slots),
        self.unpack(hparams))
    return (w_new.astype(w.dtype),
            tuple(n.astype(s.dtype) for n, s in zip(slots_new, slots)))


def _adamw_update(nesterov: bool) -> UpdateFn:
  # optax.adamw = scale_by_adam -> add_decayed_weights -> scale_by_lr, with the
  # same operation order as optax so fp32 results agree to rounding.
  def update(g, w, slots, h):
    mu, nu = slots
    mu = h["one_minus_b1"] * g + h["b1"] * mu
    nu = h["one_minus_b2"] * (g * g) + h["b2"] * nu
    if nesterov:
      mu_hat = h["b1"] * (mu / h["bc1_next"]) + h["one_minus_b1"] * (
          g / h["bc1"])
    else:
      mu_hat = mu / h["bc1"]
    nu_hat = nu / h["bc2"]
    u = mu_hat / (jnp.sqrt(nu_hat + h["eps_root"]) + h["eps"])
    u = u + h["weight_decay"] * w
    return w + (-h["lr"]) * u, (mu, nu)

  return update


def adamw_rule(nesterov: bool = False) -> UpdateRule:
  """AdamW as ``optax.adamw`` computes it (``nesterov`` as in optax).

  Hyperparameters: ``lr`` (this step's learning rate), ``b1``, ``b2``,
  ``one_minus_b1``, ``one_minus_b2`` (passed separately so that they are
  rounded from double precision, as optax's Python floats are), ``eps``,
  ``eps_root``, ``weight_decay`` (0 where the mask excludes the weight), and
  the bias corrections ``bc1 = 1 - b1**t``, ``bc2 = 1 - b2**t`` and
  ``bc1_next = 1 - b1**(t + 1)`` for step ``t`` (1-based).
  """
  return UpdateRule(
      name="adamw_nesterov" if nesterov else "adamw",
      slots=("mu", "nu"),
      hparams=("lr", "b1", "b2", "one_minus_b1", "one_minus_b2", "eps",
               "eps_root", "weight_decay", "bc1", "bc2", "bc1_next"),
      update=_adamw_update(nesterov),
  )


ADAMW = adamw_rule()
