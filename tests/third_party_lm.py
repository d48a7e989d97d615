"""A small decoder-only Transformer LM written in plain flax.linen, as a third
party writes one: it imports nothing from forge_jax. The tests train it with
``forge_jax.make_step(..., convert=True)`` unchanged.

Token embedding, ``nn.MultiHeadDotProductAttention`` (its query, key, value
and output projections are ``nn.DenseGeneral`` layers built inside Flax), an
MLP of ``nn.Dense``, pre-LayerNorms, dropout (embedding, attention weights,
residual branches) and a ``nn.Dense`` head; every parameter is declared with
``nn.with_logical_partitioning``.
"""

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def logical(*names, init=nn.initializers.lecun_normal()):
  return nn.with_logical_partitioning(init, names)


ONES, ZEROS = nn.initializers.ones, nn.initializers.zeros


class Block(nn.Module):
  """Pre-LN causal self-attention + GELU MLP, with residual dropout."""

  d_model: int
  num_heads: int
  d_ff: int
  dropout_rate: float
  deterministic: bool

  @nn.compact
  def __call__(self, x):
    norm = functools.partial(nn.LayerNorm,
                             scale_init=logical("embed", init=ONES),
                             bias_init=logical("embed", init=ZEROS))
    drop = functools.partial(nn.Dropout, self.dropout_rate,
                             deterministic=self.deterministic)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
    # No projection biases: a key bias gets an exactly-zero gradient under
    # softmax (it shifts every logit of a query alike), which Adam would
    # turn into an update of pure rounding noise.
    h = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, use_bias=False,
        kernel_init=logical("embed", "joined_kv"),
        out_kernel_init=logical("joined_kv", "embed"),
        dropout_rate=self.dropout_rate,
        deterministic=self.deterministic)(norm()(x), mask=mask)
    x = x + drop()(h)
    h = nn.Dense(self.d_ff, kernel_init=logical("embed", "mlp"),
                 bias_init=logical("mlp", init=ZEROS))(norm()(x))
    h = nn.Dense(self.d_model, kernel_init=logical("mlp", "embed"),
                 bias_init=logical("embed", init=ZEROS))(nn.gelu(h))
    return x + drop()(h)


class LM(nn.Module):
  """Tokens ``(batch, length)`` -> logits ``(batch, length, vocab)``.

  ``stack``: how the blocks are stacked. ``None``: a Python loop
  (``Block_0``, ``Block_1``, ...); else a module class called as
  ``stack(block, num_layers, name="blocks")`` with ``block`` a callable
  making one deterministic block (a scan over blocks: ``nn.scan`` or
  ``forge_jax.ScannedBlocks``).
  """

  vocab: int = 29
  d_model: int = 16
  num_heads: int = 2
  d_ff: int = 24
  num_layers: int = 2
  dropout_rate: float = 0.1
  stack: Callable[..., Any] | None = None

  @nn.compact
  def __call__(self, tokens, train: bool = True):
    x = nn.Embed(self.vocab, self.d_model, embedding_init=logical(
        "vocab", "embed", init=nn.initializers.normal(1.0)))(tokens)
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    if self.stack is None:
      for _ in range(self.num_layers):
        x = Block(self.d_model, self.num_heads, self.d_ff, self.dropout_rate,
                  deterministic=not train)(x)
    else:
      block = functools.partial(Block, self.d_model, self.num_heads,
                                self.d_ff, 0.0, True)
      x = self.stack(block, self.num_layers, name="blocks")(x)
    x = nn.LayerNorm(scale_init=logical("embed", init=ONES),
                     bias_init=logical("embed", init=ZEROS))(x)
    return nn.Dense(self.vocab, kernel_init=logical("embed", "vocab"),
                    bias_init=logical("vocab", init=ZEROS))(x)


def next_token_loss(model):
  """``loss_fn(variables, (tokens, targets, dropout_key))``: mean
  cross-entropy, dropout drawn from the batch's key."""
  def loss_fn(variables, batch):
    tokens, targets, key = batch
    logits = model.apply(variables, tokens, rngs={"dropout": key})
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets).mean()
  return loss_fn


def batches(n, batch=3, length=7, vocab=29, seed=5):
  """``n`` batches ``(tokens, next tokens, dropout key)``; the keys are
  ``rbg`` keys (cheaper to compile than threefry on the CPU)."""
  out = []
  for i in range(n):
    seq = jax.random.randint(jax.random.key(seed + i), (batch, length + 1), 0,
                             vocab)
    out.append((seq[:, :-1], seq[:, 1:],
                jax.random.key(1000 + seed + i, impl="rbg")))
  return out


# --- Test helpers (they too need nothing from forge_jax) ----------------------

# XLA:CPU takes seconds to compile a training step of even this small model
# at its default LLVM optimisation; the tests compile every arm (FORGE's and
# optax's alike) without it. (A JAX whose XLA lacks these options compiles
# as usual.)
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0,
                    "xla_llvm_disable_expensive_passes": True}


def compiled(fn, *args):
  """``jax.jit(fn)`` traced for ``args`` (so that a step's trace-time
  reports are set) and compiled (fast, on the CPU): ``(traced, compiled)``."""
  traced = jax.jit(fn).trace(*args)
  lowered = traced.lower()
  if jax.default_backend() == "cpu":
    try:
      return traced, lowered.compile(FAST_CPU_COMPILE)
    except jax.errors.JaxRuntimeError:
      pass
  return traced, lowered.compile()


def init(model, tokens):
  """``model.init`` (without dropout), compiled, from ``rbg`` keys (faster to
  compile on the CPU than threefry)."""
  keys = {"params": jax.random.key(0, impl="rbg"),
          "dropout": jax.random.key(1, impl="rbg")}
  _, run = compiled(lambda k, t: model.init(k, t, train=False), keys, tokens)
  return run(keys, tokens)
