"""The fused kernel's tiling: :class:`BlockConfig`, its heuristics and checks.

:func:`pallas_kernels.tuning_cache.select_config` picks a tiling for a
problem (a tuned one from the cache, else a heuristic from here).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

__all__ = ["BlockConfig", "MIN_BLOCK", "check_block_config", "next_pow2"]

MIN_BLOCK = 16  # Triton's dot needs every dimension >= 16.


def _is_int(v) -> bool:
  # A Python int (the tiling reaches Triton's compile parameters as is): not
  # a bool, a float or a NumPy scalar.
  return isinstance(v, int) and not isinstance(v, bool)


def _is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
  """The smallest power of two >= ``n`` (1 for ``n`` <= 1)."""
  return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Tiling of the fused kernel.

  Attributes:
    block_in: rows of a ``G`` tile (the layer's input dimension).
    block_out: columns of a ``G`` tile (the layer's output dimension).
    block_bt: token rows reduced per main-loop iteration.
    group_in: tiles along ``in`` visited together before moving along
      ``out`` (grouped order, so neighbouring programs share ``dy`` chunks in
      L2); 1 is plain row-major order.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages of the main loop.
    prefetch: load the tile of ``W`` and of each slot *before* the main loop
      instead of after it, so that this traffic overlaps the GEMM (it then
      occupies registers during the loop).
    stream_state: load and store ``W`` and the slots with the
      ``evict_first`` L2 policy and ``x``, ``dy`` with ``evict_last``: each
      state byte is touched once, while every ``x``/``dy`` chunk is re-read
      by a whole row/column of tiles, so the operands should stay in L2.
    split_out: compute the ``(block_in, block_out)`` tile as this many
      column sub-tiles of ``block_out // split_out``, each its own fp32
      accumulator (they share each loaded ``x`` chunk), and run the epilogue
      one sub-tile at a time, so only one sub-tile of ``W`` and its state is
      live in registers at once (with ``prefetch``, every sub-tile's state
      is loaded before the main loop and all are live through it).
  """

  block_in: int = 64
  block_out: int = 128
  block_bt: int = 64
  group_in: int = 1
  num_warps: int = 4
  num_stages: int = 3
  prefetch: bool = False
  stream_state: bool = False
  split_out: int = 1

  def __post_init__(self):
    for name in ("block_in", "block_out", "block_bt"):
      v = getattr(self, name)
      if not _is_int(v):
        raise ValueError(f"{name}={v!r} must be a Python int (a power of two"
                         f" >= {MIN_BLOCK}), got {type(v).__name__}")
      if not _is_pow2(v) or v < MIN_BLOCK:
        raise ValueError(
            f"{name}={v!r} must be a power of two >= {MIN_BLOCK}")
    if not _is_int(self.group_in) or self.group_in < 1:
      raise ValueError(f"group_in={self.group_in!r} must be an int >= 1")
    if not _is_int(self.num_warps) or self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps!r} must be 1, 2, 4, 8 or 16")
    if not _is_int(self.num_stages) or self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages!r} must be an int >= 1")
    for name in ("prefetch", "stream_state"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
    if (not _is_int(self.split_out) or not _is_pow2(self.split_out)
        or self.block_out // self.split_out < MIN_BLOCK):
      raise ValueError(
          f"split_out={self.split_out!r} must be a power of two leaving "
          f"sub-tiles of >= {MIN_BLOCK} columns (block_out={self.block_out})")

  def fit(self, bt: int, n_in: int, n_out: int) -> "BlockConfig":
    """This tiling shrunk to the problem: each block at most the next power
    of two of its dimension (and at least 16), ``split_out`` reduced so that
    sub-tiles keep >= 16 columns. The one clamp every heuristic and the
    autotuner's candidates go through."""
    clamp = lambda b, n: max(MIN_BLOCK, min(b, next_pow2(n)))
    bo = clamp(self.block_out, n_out)
    return dataclasses.replace(
        self, block_in=clamp(self.block_in, n_in), block_out=bo,
        block_bt=clamp(self.block_bt, bt),
        split_out=max(1, min(self.split_out, bo // MIN_BLOCK)))

  @classmethod
  def default(cls, bt: int, n_in: int, n_out: int) -> "BlockConfig":
    """A heuristic tiling: the measured-best 64x128x64 tile, shrunk to fit."""
    return cls(block_in=64, block_out=128, block_bt=64).fit(bt, n_in, n_out)

  @classmethod
  def stored_default(cls, n_in: int, n_out: int) -> "BlockConfig":
    """The tiling of :func:`pallas_kernels.stored_g_update` (no GEMM):
    32x128 blocks on 4 warps, 32 elements per thread (the fastest block
    shape for a stored-gradient AdamW on the H200: docs/perf_notes.md,
    ``benchmarks/epilogue_probe.py``). Shrunk to fit."""
    return cls(block_in=32, block_out=128, block_bt=16, num_stages=1).fit(
        MIN_BLOCK, n_in, n_out)

  @classmethod
  def compiled_default(cls, bt: int, n_in: int, n_out: int,
                       w_dtype) -> "BlockConfig":
    """The heuristic for a compiled (GPU) kernel on a problem the autotune
    cache does not hold, from the H200 sweep over the Llama-8B shapes
    (docs/perf_notes.md). With 16-bit weights: the 64x128 tile computed as
    two column halves for ``BT`` up to 1024, and the grouped 128x256 tile
    in four column quarters above (``BT`` buckets as the cache rounds them:
    1025..2048 is the 2048 bucket), both streaming the state. fp32 weights
    keep :meth:`default`. Shrunk to fit."""
    if jnp.dtype(w_dtype).itemsize != 2:
      return cls.default(bt, n_in, n_out)
    if bt > 1024:
      cfg = cls(128, 256, 32, group_in=8, num_warps=8, num_stages=4,
                stream_state=True, split_out=4)
    else:
      cfg = cls(64, 128, 32, num_stages=4, stream_state=True, split_out=2)
    return cfg.fit(bt, n_in, n_out)


def check_block_config(config, where: str, name: str = "block_config"
                       ) -> None:
  """Refuses a tiling that is neither ``None`` nor a :class:`BlockConfig`
  (a dict, a tuple, a label string) where it is given, rather than as an
  AttributeError deep inside a backward; ``name``: the argument's."""
  if config is not None and not isinstance(config, BlockConfig):
    raise TypeError(
        f"{where}: {name} must be a pallas_kernels.BlockConfig or None, "
        f"got {type(config).__name__} {config!r:.80}")
