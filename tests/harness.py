"""The reference training step every parity test compares FORGE against."""

import jax
import optax


def reference_step(loss_fn, tx):
  """``step(variables, opt_state, batch) -> (loss, variables, opt_state)``:
  plain ``jax.value_and_grad`` + the optax transform (not jitted)."""

  def step(variables, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(variables, batch)
    updates, opt_state = tx.update(grads["params"], opt_state,
                                   variables["params"])
    return loss, {**variables, "params": optax.apply_updates(
        variables["params"], updates)}, opt_state

  return step
