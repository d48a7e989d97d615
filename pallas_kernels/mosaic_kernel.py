"""The Pallas Mosaic GPU kernel (Hopper, sm_90+): the weight-gradient GEMM
by ``wgmma`` with the rule in its epilogue.

Persistent and warp-specialised: one program per SM walks the output tiles
(in snaking bands of ``band`` tile columns, ``plgpu.planar_snake``). A
memory warpgroup streams the ``x`` and ``dy`` blocks of each tile's K loop
by TMA; compute warpgroups accumulate ``x_blk^T dy_blk`` in fp32 by
``wgmma`` (``x`` transposed in shared memory, free for 16-bit operands),
then apply the rule in ``(epi_m, epi_n)`` sub-tiles: the accumulator slice
and the state read from shared memory, the new state written back there
and TMA-stored in place, asynchronously (drained while the next tile
runs). ``G`` never leaves registers. Two schedules
(:attr:`MosaicConfig.pingpong`):

* **Column split** (``pingpong=False``): ``compute_wgs`` compute warpgroups
  each own a column slice of every ``(tile_m, tile_n)`` tile; all run its
  K loop (``plgpu.emit_pipeline_warp_specialized``, the memory warpgroup
  running ahead into the next tile's blocks), then all run its epilogue.
  Each first issues the TMA loads of its slice of ``W`` and of each slot
  into its own shared-memory buffers, so they are in flight while the
  tensor cores run (``state_buffers``, ``prefetch_next``); or, with
  ``state_ring``, streams the state through a ring of sub-tile slots
  instead of holding the whole slice.
* **Ping-pong** (``pingpong=True``): ``compute_wgs`` (2 or 3) compute
  warpgroups each own whole tiles, taking the tiles of their program in
  turn, so while one runs a tile's K loop on the tensor cores the others
  run the epilogues of their previous tiles (with more than two, an
  epilogue may take as long as several K loops, and more warps share its
  latency). The memory warpgroup streams the blocks of the program's
  tiles, in tile order, through one ring of ``steps`` slots that every
  compute warpgroup reads; each slot has a "full" barrier per compute
  warpgroup (a thread must wait on every phase of a barrier it waits on,
  so each waits only on its own) and one "consumed" barrier, waited on by
  the memory warpgroup alone. The state always streams through a ring of
  sub-tiles per warpgroup, the first loads in flight during the K loop.
  With ``cluster=2`` the programs run in clusters of two that take
  tile-row pairs in step and multicast the ``dy`` blocks they share (the
  "consumed" barriers then span the cluster).

Both share the epilogue: the rule on a sub-tile, the sub-tile loads and
stores, the streamed ring. Stacked ``(L, in, out)`` state (``layer=i``)
updates layer ``i`` in place, the index read from memory at run time. A
rule that does not update the weight (the state-only update of a regime-2
family) leaves ``W`` unread; write-only outputs (Muon's ``mu_hat``) are
stored, never loaded. Shapes the tiles do not divide run with the last
tiles and K step reaching past the arrays: TMA zero-fills those loads
(rows of ``x`` and ``dy`` past BT add zero to ``G``) and drops those
stores; TMA moves a block in the pieces of its shared-memory tiling, so
each dimension must be a multiple of them (BT of 8, ``in`` and ``out`` of
64 with 16-bit operands; a stored ``G``'s ``in`` of 8), and a weight one
piece wide needs tiles no wider than it or narrower sub-tiles
(:func:`_tiling_problem`). Not covered (each refused with the reason by
:func:`unsupported`): other shapes, fp32 operands (wgmma takes 16-bit ones
here), fp8 moments, stochastic rounding, and int8 moments on a shape the
tiles do not divide. int8 moments
(:class:`~pallas_kernels.quant.Quantized` slots, 64-element blocks) are
dequantized and requantized in the streamed epilogue, in sub-tiles one
block wide (:func:`low_precision_problem`): their codes stream through the
state ring, their scales (transposed around the launch, so that a
sub-tile's are one contiguous row) by plain loads and stores. A gradient
already in memory (``stored_g_update``) takes the column-split body
without the K loop: ``G``'s sub-tiles stream through the ring with the
state's.
:func:`launch` is its entry point; :mod:`pallas_kernels.fused_wgrad`
holds the public wrappers (``backend="mosaic_gpu"``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import lowp, quant
from pallas_kernels.rules import UpdateRule

__all__ = ["INTERPRETS_CLUSTERED_PREFETCH", "MosaicConfig", "default_config",
           "launch", "pingpong_registers", "stored_config", "unsupported"]

# Shared memory per block on Hopper (227 KiB).
_SMEM_BYTES = 232448
# Shared memory the ping-pong schedule keeps for its barriers (and the
# alignment of its buffers) beside the operand and state rings; the other
# schedule's pipeline barriers.
_PINGPONG_RESERVE = 1024
_PIPELINE_RESERVE = 256
# Per int8 slot and compute warpgroup: the scratch of its per-row absmax
# reduction (with alignment; at least 1 KiB a slot). These reserves keep
# MosaicConfig.smem_bytes at or above what the Mosaic GPU lowering
# allocates (tests/test_mosaic_lowering.py compares them).
_INT8_REDUCTION_BYTES = 512
# Registers per thread of the memory warpgroup; the compute warpgroups
# share the rest (pingpong_registers: 232 each with two, 152 with three).
_MEMORY_REGISTERS = 40
# Registers per thread a ping-pong compute warpgroup keeps for its
# epilogue beside the accumulator (MosaicConfig's check).
_EPILOGUE_REGISTERS = 48
# Whether Pallas's GPU interpreter runs a cluster with prefetch_next
# (MosaicConfig.cluster): jax 0.12's does; jax 0.11's deadlocks on it.
INTERPRETS_CLUSTERED_PREFETCH = jax.__version_info__ >= (0, 12)


def pingpong_registers(compute_wgs: int) -> int:
  """Registers per thread of each of ``compute_wgs`` ping-pong compute
  warpgroups: an SM's 65536 shared with the memory warpgroup's
  ``_MEMORY_REGISTERS`` (128 threads a warpgroup), a multiple of 8, at most
  232."""
  return min(232, (65536 // 128 - _MEMORY_REGISTERS) // compute_wgs // 8 * 8)


# MosaicConfig's True/False knobs (every other field is an int).
_MOSAIC_FLAGS = frozenset(("prefetch_next", "pingpong", "rolled",
                           "no_barriers", "approx_math"))


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiling of the Mosaic GPU kernel.

  Attributes:
    tile_m: rows of ``W`` per output tile (a multiple of 64).
    tile_n: columns of ``W`` per output tile (a multiple of 64).
    tile_k: token rows per K step (a multiple of 64).
    steps: K blocks in flight in the pipeline (>= 1); with ``pingpong``,
      the slots of the operand ring the compute warpgroups share.
    epi_m, epi_n: the epilogue's sub-tile (divide each compute warpgroup's
      ``tile_m x tile_n / compute_wgs`` share; rows a multiple of 64,
      columns of 32; with ``pingpong`` they divide the whole tile).
    compute_wgs: compute warpgroups (1 to 4) splitting the tile's columns
      (each takes a multiple of 64); default 2 where ``tile_n`` is a
      multiple of 128, else 1. More warpgroups hide more of the epilogue's
      latency; each gets fewer registers. With ``pingpong`` 2 (the
      default) or 3, each owning whole tiles.
    delay_release: K steps a block stays in shared memory after its
      ``wgmma`` is issued (0 or 1): 1 keeps one ``wgmma`` in flight.
    state_buffers: shared-memory buffers for the state tiles (1 or 2). With
      2, tiles alternate buffers, so a tile's state prefetch does not wait
      for the previous tile's stores to drain.
    prefetch_next: with 2 state buffers, issue the next tile's state loads
      when this tile's K loop ends (before its epilogue) instead of at the
      next tile's start, so they also fly during this tile's epilogue.
      With ``pingpong`` (one state buffer: the ring), the ring runs on
      across a warpgroup's tiles: its sub-tiles form one stream, and as
      the last sub-tiles of a tile's epilogue free their slots, they load
      the first sub-tiles of the warpgroup's next tile, whose loads then
      fly during the rest of this epilogue and the next K loop instead of
      starting with it. A ring longer than a tile's sub-tiles
      (``state_ring``) then holds sub-tiles of the tiles after.
    state_ring: 0 holds each warpgroup's whole share of the state tile in
      shared memory (``state_buffers`` copies). ``R >= 1`` streams it
      instead through a ring of ``R`` epilogue sub-tiles per warpgroup: the
      first ``R`` sub-tiles' loads fly during the K loop, and each sub-tile's
      slot is reloaded with the sub-tile ``R`` places later once its stores
      have read it. Shared memory no longer grows with the tile, so larger
      tiles (fewer re-reads of ``x`` and ``dy``) fit. With ``pingpong`` the
      state always streams: 0 there means a ring of as many sub-tiles as
      fit beside the operand ring (at most a tile's; :meth:`ring_for`),
      and without ``prefetch_next`` a ring longer than a tile's sub-tiles
      is cut to them.
    band: the order the persistent programs take the tiles in: down bands
      of ``band`` tile columns, snaking (``plgpu.planar_snake``). 1 sweeps
      one tile column at a time, so every column re-reads all of ``x``:
      from HBM once ``x`` no longer fits in L2. Wider bands keep the
      concurrent tiles' ``x`` and ``dy`` blocks in L2 together.
    pingpong: the ping-pong schedule (module docstring): the compute
      warpgroups each own whole tiles, one running its K loop while the
      others run their epilogues. Each holds a whole tile's fp32
      accumulator, ``tile_m * tile_n / 128`` registers per thread, out of
      :func:`pingpong_registers` less 48 for the epilogue, at most 128: so
      ``tile_m * tile_n <= 16384`` (128 x 128, 64 x 256 or smaller) with
      two compute warpgroups, ``<= 8192`` (64 x 128, 128 x 64) with
      three. Not for a stored gradient (:func:`stored_g_update`), which
      has no K loop to overlap.
    rolled: the streamed epilogue (``pingpong`` or ``state_ring``) as a
      loop over its sub-tiles instead of unrolled: each iteration takes its
      slice of the accumulator through a ``lax.switch`` (register moves),
      so the epilogue's code is one sub-tile's, not a tile's. Unrolled, a
      128 x 128 tile's AdamW epilogue is about 5,000 instructions per
      thread, executed once per tile, which the instruction cache does not
      hold.
    no_barriers: leave out the warpgroup barriers that Pallas inserts
      around every shared-memory store and before every TMA copy a compute
      warpgroup issues (``CompilerParams(unsafe_no_auto_barriers=True)``).
      The kernel orders its own shared-memory traffic: each thread stores a
      state sub-tile's new values to the addresses it read them from (one
      register layout for the load and the store), ``commit_smem`` (a fence
      and a barrier) precedes every TMA store, and a ring slot is reloaded
      only after that barrier and the wait for its stores.
    approx_math: approximate square roots and transcendentals in the
      epilogue (``CompilerParams(approx_math=True)``: ``sqrt.approx``
      instead of the IEEE sequence); the results may differ from the
      reference in the last bits.
    cluster: programs per thread-block cluster (1 or 2; 2 needs
      ``pingpong``). With 2, the two programs of a cluster take the two
      tiles of a tile-row pair in step (rows ``2p`` and ``2p + 1`` of the
      same tile column), which share their ``dy`` blocks: each memory
      warpgroup loads half of each ``dy`` block and multicasts it to both
      (TMA multicast), so the operand traffic from L2 falls by a
      ``tile_n / (2 (tile_m + tile_n))`` share (a third on 64 x 128 tiles,
      a quarter on 128 x 128). A ring slot is then refilled only once both
      programs' warpgroups have read it (a cluster barrier). The weight's
      rows must split into an even number of tiles. With
      ``prefetch_next`` as well, interpreted only from jax 0.12 on: in
      Pallas's GPU interpreter before it the two together deadlock in some
      runs (one cluster of 64 x 128 tiles, with or without race detection:
      the memory warpgroups waiting on the cluster's "consumed" barriers,
      the compute warpgroups on their own barriers), which neither alone
      does, nor the two in jax 0.12's interpreter (with race detection) or
      compiled on the H200 (the same bits as without ``prefetch_next``);
      :func:`launch` refuses the pair in interpret mode there.
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  steps: int = 3
  epi_m: int = 64
  epi_n: int = 64
  compute_wgs: int | None = None
  delay_release: int = 1
  state_buffers: int = 1
  prefetch_next: bool = False
  state_ring: int = 0
  band: int = 1
  pingpong: bool = False
  rolled: bool = False
  no_barriers: bool = False
  approx_math: bool = False
  cluster: int = 1

  def __post_init__(self):
    # Types first: a float, a bool or a NumPy scalar where a count goes
    # would pass the range checks below and fail inside the kernel.
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name in _MOSAIC_FLAGS:
        if not isinstance(v, bool):
          raise ValueError(f"MosaicConfig: {f.name}={v!r} must be True or "
                           "False")
      elif not (v is None and f.name == "compute_wgs") and (
          not isinstance(v, int) or isinstance(v, bool)):
        raise ValueError(f"MosaicConfig: {f.name}={v!r} must be a Python "
                         "int")
    for name in ("tile_m", "tile_n", "tile_k"):
      v = getattr(self, name)
      if v <= 0 or v % 64:
        raise ValueError(f"MosaicConfig: {name}={v!r} must be a positive "
                         "multiple of 64")
    if self.steps < 1:
      raise ValueError(f"MosaicConfig: steps={self.steps!r} must be >= 1")
    for name in ("epi_m", "epi_n"):
      if getattr(self, name) <= 0:
        raise ValueError(f"MosaicConfig: {name}={getattr(self, name)!r} "
                         "must be positive")
    if self.compute_wgs is None:
      object.__setattr__(self, "compute_wgs", self._default_compute_wgs())
    if self.cluster not in (1, 2) or (self.cluster > 1
                                      and not self.pingpong):
      raise ValueError(
          f"MosaicConfig: cluster={self.cluster!r} must be 1, or 2 with "
          "pingpong (the ping-pong schedule's memory warpgroups multicast "
          "the shared dy blocks)")
    if self.pingpong:
      self._check_pingpong()
    elif (self.compute_wgs not in (1, 2, 3, 4)
          or self.tile_n % (64 * self.compute_wgs)):
      raise ValueError(
          f"MosaicConfig: compute_wgs={self.compute_wgs!r} must be 1 to 4 "
          f"and split tile_n={self.tile_n} into multiples of 64")
    if self.delay_release not in (0, 1) or self.delay_release >= self.steps:
      raise ValueError(f"MosaicConfig: delay_release={self.delay_release!r} "
                       "must be 0 or 1, and less than steps")
    if self.state_buffers not in (1, 2):
      raise ValueError(f"MosaicConfig: state_buffers={self.state_buffers!r} "
                       "must be 1 or 2")
    if self.prefetch_next and self.state_buffers != 2 and not self.pingpong:
      raise ValueError("MosaicConfig: prefetch_next needs state_buffers=2 "
                       "(or pingpong, whose ring then runs across tiles)")
    if not 0 <= self.state_ring <= 8:
      raise ValueError(f"MosaicConfig: state_ring={self.state_ring!r} must "
                       "be 0 (the whole state tile held; with pingpong, a "
                       "ring of as many sub-tiles as fit) to 8")
    if self.band < 1:
      raise ValueError(f"MosaicConfig: band={self.band!r} must be a "
                       "positive number of tile columns")
    if self.rolled and not (self.pingpong or self.state_ring):
      raise ValueError("MosaicConfig: rolled loops over the streamed "
                       "epilogue's sub-tiles: it needs pingpong or "
                       "state_ring >= 1")
    if self.state_ring and self.state_buffers != 1:
      raise ValueError("MosaicConfig: state_ring streams the state through "
                       "its own ring; leave state_buffers=1 and "
                       "prefetch_next=False with it")
    if (self.tile_m % self.epi_m or self.wg_n % self.epi_n
        or self.epi_m % 64 or self.epi_n % 32):
      raise ValueError(
          f"MosaicConfig: the epilogue sub-tile {self.epi_m}x{self.epi_n} "
          f"must divide each compute warpgroup's {self.tile_m}x{self.wg_n} "
          "share of the tile (rows a multiple of 64: a slice of fewer rows "
          "of the warpgroup's accumulator does not lower -- Mosaic GPU's "
          "layout inference finds no layout for it, jax 0.12 -- and "
          "columns a multiple of 32)")

  def _default_compute_wgs(self) -> int:
    return 2 if self.pingpong or self.tile_n % 128 == 0 else 1

  def _check_pingpong(self):
    """The ping-pong schedule's own limits (``pingpong=True``)."""
    if self.compute_wgs not in (2, 3):
      raise ValueError(
          f"MosaicConfig: compute_wgs={self.compute_wgs!r} with pingpong: "
          "the ping-pong schedule runs 2 or 3 compute warpgroups, each "
          "owning whole tiles in turn; leave compute_wgs unset (2) or give "
          "3 (with 4, compiling the kernel did not finish within minutes "
          "on the H200, jax 0.11.2)")
    regs = pingpong_registers(self.compute_wgs)
    most = min(128, regs - _EPILOGUE_REGISTERS)
    if self.tile_m * self.tile_n > most * 128:
      raise ValueError(
          f"MosaicConfig: with pingpong each compute warpgroup holds a whole "
          f"{self.tile_m}x{self.tile_n} tile's fp32 accumulator, "
          f"{self.tile_m * self.tile_n // 128} registers per thread; with "
          f"{self.compute_wgs} compute warpgroups each has {regs}, of which "
          f"at most {most} fit beside the epilogue: keep tile_m * tile_n "
          f"<= {most * 128} (e.g. "
          + ("128x128 or 64x256)" if most >= 128 else
             "64x128 or 128x64)" if most >= 64 else "64x64)"))
    if self.state_buffers != 1:
      raise ValueError(
          "MosaicConfig: with pingpong the state streams through a ring of "
          "epilogue sub-tiles (state_ring; 0 = as many as fit), so leave "
          "state_buffers=1")
    if self.epi_m % 64 or self.tile_m % self.epi_m:
      raise ValueError(
          f"MosaicConfig: with pingpong the epilogue sub-tile's rows "
          f"(epi_m={self.epi_m}) must be a multiple of 64 that divides "
          f"tile_m={self.tile_m}")

  @property
  def wg_n(self) -> int:
    """Columns of the tile each compute warpgroup owns (with ``pingpong``
    each owns whole tiles: all ``tile_n``)."""
    return self.tile_n if self.pingpong else self.tile_n // self.compute_wgs

  @property
  def sub_tiles(self) -> int:
    """Epilogue sub-tiles of a compute warpgroup's share of a tile."""
    return (self.tile_m // self.epi_m) * (self.wg_n // self.epi_n)

  # The label's knobs, in label order: prefix -> the fields it sets; then
  # the flags (a knob without a value that sets its field to True).
  _KNOBS = (("wg", ("compute_wgs",)), ("d", ("delay_release",)),
            ("e", ("epi_m", "epi_n")), ("b", ("state_buffers",)),
            ("r", ("state_ring",)), ("s", ("band",)), ("c", ("cluster",)))
  _FLAGS = (("pn", "prefetch_next"), ("pp", "pingpong"), ("lp", "rolled"),
            ("nb", "no_barriers"), ("ax", "approx_math"))
  LABEL_FORM = ("MxNxK/STEPS[,wgW][,dD][,eMxN][,bB][,rR][,sS][,cC][,pn]"
                "[,pp][,lp][,nb][,ax]")

  @property
  def label(self) -> str:
    """``128x128x64/4,e64x32,s8,pp``: ``tile_m x tile_n x tile_k / steps``,
    then each knob that is off its default: ``,wgW`` (compute_wgs),
    ``,dD`` (delay_release), ``,eMxN`` (the epilogue sub-tile), ``,bB``
    (state_buffers), ``,rR`` (state_ring), ``,sS`` (band), ``,cC``
    (cluster), ``,pn`` (prefetch_next), ``,pp`` (pingpong), ``,lp``
    (rolled), ``,nb`` (no_barriers), ``,ax`` (approx_math).
    ``MosaicConfig.from_label(cfg.label) == cfg``."""
    fields = {f.name: f.default for f in dataclasses.fields(self)}
    # compute_wgs's default follows tile_n and pingpong (__post_init__).
    fields["compute_wgs"] = self._default_compute_wgs()
    out = f"{self.tile_m}x{self.tile_n}x{self.tile_k}/{self.steps}"
    for prefix, names in self._KNOBS:
      values = [getattr(self, n) for n in names]
      if values != [fields[n] for n in names]:
        out += f",{prefix}" + "x".join(str(v) for v in values)
    return out + "".join(f",{flag}" for flag, name in self._FLAGS
                         if getattr(self, name))

  @classmethod
  def from_label(cls, label: str) -> "MosaicConfig":
    """The tiling a :attr:`label` names (knobs in any order, each once;
    a knob left out takes its default).

    Raises:
      ValueError: ``label`` is not of the form :attr:`LABEL_FORM`, or
        names an invalid tiling; the message says which part and why.
    """
    if not isinstance(label, str):
      raise ValueError(f"a Mosaic GPU tiling label is a string of the form "
                       f"{cls.LABEL_FORM}, got {type(label).__name__}")

    def numbers(text: str, count: int, what: str) -> list[int]:
      parts = text.split("x")
      if len(parts) != count or not all(p.isascii() and p.isdecimal()
                                        for p in parts):
        form = "x".join(["N"] * count)
        raise ValueError(f"Mosaic GPU tiling label {label!r}: {what} is not "
                         f"{form} (whole numbers); the form is "
                         f"{cls.LABEL_FORM}, e.g. 128x128x64/4,e64x32,s8,pp")
      return [int(p) for p in parts]

    head, *knobs = label.strip().split(",")
    tiles, slash, steps = head.partition("/")
    if not slash:
      raise ValueError(f"Mosaic GPU tiling label {label!r}: no '/STEPS' after "
                       f"the tile; the form is {cls.LABEL_FORM}, e.g. "
                       "128x128x64/4,e64x32,s8,pp")
    tm, tn, tk = numbers(tiles, 3, f"the tile {tiles!r}")
    (n_steps,) = numbers(steps, 1, f"the step count {steps!r}")
    prefixes = dict(cls._KNOBS)
    flags = dict(cls._FLAGS)
    extra = {}
    for knob in knobs:
      if knob in flags:
        names, values = (flags[knob],), [True]
      else:
        prefix = "wg" if knob.startswith("wg") else knob[:1]
        if prefix not in prefixes:
          raise ValueError(
              f"Mosaic GPU tiling label {label!r}: unknown knob {knob!r}; "
              "the knobs are ,wgW ,dD ,eMxN ,bB ,rR ,sS ,cC ,pn ,pp ,lp "
              f",nb and ,ax (the form is {cls.LABEL_FORM})")
        names = prefixes[prefix]
        values = numbers(knob[len(prefix):], len(names),
                         f"the value after {prefix!r} in knob {knob!r}")
      if names[0] in extra:
        raise ValueError(f"Mosaic GPU tiling label {label!r}: knob {knob!r} "
                         "is given twice")
      extra.update(zip(names, values))
    try:
      return cls(tile_m=tm, tile_n=tn, tile_k=tk, steps=n_steps, **extra)
    except ValueError as e:
      raise ValueError(f"Mosaic GPU tiling label {label!r}: {e}") from None

  def _operand_bytes(self, x_dtype) -> int:
    return 0 if x_dtype is None else (
        self.steps * self.tile_k * (self.tile_m + self.tile_n)
        * jnp.dtype(x_dtype).itemsize)

  def ring_for(self, x_dtype, state_dtypes) -> int:
    """The state ring the kernel runs with these dtypes: ``state_ring``;
    with ``pingpong`` and ``state_ring=0``, the most epilogue sub-tiles
    (at least 1, at most a tile's) whose buffers fit beside the operand
    ring, for every compute warpgroup; with ``pingpong`` and without
    ``prefetch_next``, at most a tile's sub-tiles."""
    if not self.pingpong:
      return self.state_ring
    if self.state_ring:
      # Running across tiles (prefetch_next), a ring may hold sub-tiles of
      # the warpgroup's next tiles as well; within a tile, no more than
      # its sub-tiles are of use.
      return (self.state_ring if self.prefetch_next
              else min(self.state_ring, self.sub_tiles))
    sub = self._sub_tile_bytes(state_dtypes)
    free = (_SMEM_BYTES - self._reserve(state_dtypes)
            - self._operand_bytes(x_dtype))
    return max(1, min(self.sub_tiles, free // (self.compute_wgs * sub)))

  def _sub_tile_bytes(self, state_dtypes) -> int:
    """Shared memory of one ring slot: the state's sub-tiles, plus the
    scales of each int8 slot (int8 codes are int8 moments' only), one fp32
    per row."""
    dts = [jnp.dtype(d) for d in state_dtypes]
    return (self.epi_m * self.epi_n * sum(d.itemsize for d in dts)
            + 4 * self.epi_m * dts.count(jnp.dtype(jnp.int8)))

  def _reserve(self, state_dtypes) -> int:
    """Shared memory beside the operand and state buffers: barriers and
    alignment, and the int8 slots' reduction scratch."""
    n_int8 = [jnp.dtype(d) for d in state_dtypes].count(jnp.dtype(jnp.int8))
    return ((_PINGPONG_RESERVE if self.pingpong else _PIPELINE_RESERVE)
            + max(1024, _INT8_REDUCTION_BYTES * self.compute_wgs) * n_int8)

  def smem_bytes(self, x_dtype, state_dtypes) -> int:
    """Shared memory the kernel asks for, at most this (pipeline buffers +
    state tiles or ring + :meth:`_reserve`); ``x_dtype=None``: no K loop
    (a stored ``G``, counted in the state)."""
    ring = self.ring_for(x_dtype, state_dtypes)
    if ring:
      held = self.compute_wgs * ring * self._sub_tile_bytes(state_dtypes)
    else:
      held = self.state_buffers * self.tile_m * self.tile_n * sum(
          jnp.dtype(d).itemsize for d in state_dtypes)
    return self._operand_bytes(x_dtype) + held + self._reserve(state_dtypes)


# How far past a weight's edges a tiling chosen for another case may reach
# (the default tiling's, and backend=None's nearest cache entry's), as a
# fraction of the weight: 1/16. At 4544 x 4672 on the H200, 128 x 128 tiles
# 2.8 % past the edges measured 1.2-1.6x faster than 64 x 64 tiles that
# divide it (docs/benchmarks.md, Shapes the tiles do not divide).
MAX_OVERREACH = 1 / 16


def overreach(n_in: int, n_out: int, tile_m: int, tile_n: int) -> float:
  """The fraction of a weight ``n_in x n_out`` by which ``tile_m x
  tile_n`` tiles reach past its edges (0 where they divide it)."""
  padded = pl.cdiv(n_in, tile_m) * tile_m * pl.cdiv(n_out, tile_n) * tile_n
  return padded / (n_in * n_out) - 1


def default_config(x_dtype, state_dtypes, bt: int | None = None, *,
                   shape: tuple[int, int] | None = None,
                   quantized: bool = False) -> MosaicConfig:
  """The default tiling for a case: the ping-pong schedule
  (``pingpong=True``) on 128 x 128 tiles, 64 token rows per K step with 4
  in flight, the state streamed in 64 x 32 epilogue sub-tiles through a
  ring of as many as fit (``state_ring=0``: 4 with bf16 ``W, m, v``),
  taken in snaking bands of 8 tile columns beyond 1024 tokens (``bt``
  unknown counts as beyond) and one column at a time up to 1024; beyond
  1024 tokens with 16-bit state, also the ring running on across a
  warpgroup's tiles (``prefetch_next``) and no automatic barriers
  (``no_barriers``), which measured 1-9 % faster on the H200 at BT 2048 on
  the four Llama-3.1-8B shapes and equal or faster at BT 4096. With a
  4-byte state array (fp32 moments or weight) the sub-tiles are 64 x 64
  where they fit (a ring of 1 with fp32 moments) and the epilogue loops
  over them (``rolled``).

  With 16-bit state it measured faster on the H200 than the column-split
  schedule's default tilings at BT 512, 2048 and 4096 on the four
  Llama-3.1-8B projection shapes; with fp32 moments the rolled 64 x 64
  epilogue measured 1.09-1.14x XLA's GEMM + AdamW at BT 512 on the two
  largest of three shapes timed (0.97x unrolled in 64 x 32 sub-tiles),
  0.93x at 4096 x 1024 (0.99x).
  It covers every case the column-split schedule does except a stored
  gradient (which takes :func:`stored_config`), so it does not depend on
  the rule.

  ``state_dtypes``: the arrays whose tiles the kernel holds in shared
  memory (:func:`smem_dtypes`). ``shape``: the weight's ``(in, out)``;
  the first of 128 x 128, 64 x 128, 128 x 64 and 64 x 64 tiles that
  divides it or reaches past its edges by at most 1/16 of it (else the
  first; with int8 moments only tiles that divide it count). At 4544 x
  4672 on the H200 the 128 x 128 tiles over the edges (2.8 % more)
  measured 1.2-1.6x faster than the 64 x 64 tiles that divide it
  (:data:`MAX_OVERREACH`). Where 4 K steps do not fit shared memory (many
  or wide state arrays), 3, then 2; where none does with 64 x 64
  sub-tiles, 64 x 32.

  ``quantized``: int8 moments, requantized in the epilogue in sub-tiles one
  64-element block wide: 64 x 64 sub-tiles, rolled, on 64 x 128 tiles first
  (then 128 x 64, 64 x 64, 128 x 128). A warpgroup's 128 x 128 accumulator
  takes 128 registers per thread and leaves the requantizing epilogue too
  few: it spilled (ptxas: 280 bytes of spill stores per thread; Nsight
  Compute: 8x the local-memory requests of bf16 moments), and 64 x 128
  tiles measured 1.12-1.37x faster on the H200 at BT 512 on the four
  Llama-3.1-8B shapes.
  """
  long = bt is None or bt > 1024
  band = 8 if long else 1
  # Wide (4-byte) state: 64 x 64 sub-tiles, looped over (rolled).
  wide = quantized or any(jnp.dtype(d).itemsize > 2 for d in state_dtypes)
  # 16-bit state beyond 1024 tokens: the ring running across tiles, no
  # automatic barriers.
  across = long and not wide
  tiles = [(128, 128), (64, 128), (128, 64), (64, 64)]
  if quantized:
    tiles = [(64, 128), (128, 64), (64, 64), (128, 128)]
  if shape is not None:
    n_in, n_out = shape

    def fits(tm, tn):
      # Divides the weight, or (16-bit or fp32 state) reaches past its
      # edges by at most 1/16 of it.
      if n_in % tm == 0 and n_out % tn == 0:
        return True
      return not quantized and overreach(n_in, n_out, tm, tn) <= MAX_OVERREACH
    tiles = [t for t in tiles if fits(*t)] or tiles
  tm, tn = tiles[0]
  # (epilogue sub-tile columns, rolled), the first whose tiling fits.
  epilogues = ([(64, True)] if wide and tn % 64 == 0 else []) + (
      [] if quantized else [(32, wide)])
  for epi_n, rolled in epilogues:
    for steps in (4, 3, 2):
      cfg = MosaicConfig(tile_m=tm, tile_n=tn, steps=steps, epi_n=epi_n,
                         band=band, pingpong=True, rolled=rolled,
                         prefetch_next=across, no_barriers=across)
      if cfg.smem_bytes(x_dtype, state_dtypes) <= _SMEM_BYTES:
        return cfg
  return cfg


def stored_config(n_in: int, n_out: int, state_dtypes) -> MosaicConfig:
  """The tiling for a stored ``G`` (``state_dtypes`` counting ``G``'s):
  the largest of 128 x 256, 128 x 128, 64 x 128 and 64 x 64 tiles that
  divides the weight, its state streamed in 64 x 64 sub-tiles through the
  deepest ring (3 to 1) that fits; if none divides, the largest whose
  blocks TMA can move past the weight's edges (:func:`_tiling_problem`),
  else 128 x 256."""
  tiles = ((128, 256), (128, 128), (64, 128), (64, 64))
  sub = (64, 64)
  movable = [(tm, tn) for tm, tn in tiles if _tiling_problem(
      [("G", (n_in, n_out), d, 64, sub, (tm, tn))
       for d in state_dtypes]) is None]
  tm, tn = ([t for t in tiles if n_in % t[0] == 0 and n_out % t[1] == 0]
            or movable or tiles)[0]
  for ring in (3, 2, 1):
    cfg = MosaicConfig(tile_m=tm, tile_n=tn, state_ring=ring)
    if cfg.smem_bytes(None, state_dtypes) <= _SMEM_BYTES:
      break
  return cfg


def smem_dtypes(rule: UpdateRule, w_dtype, slot_dtypes) -> list:
  """The dtypes of the arrays whose tiles the kernel holds in shared memory:
  the weight (if the rule updates it), the slots, the write-only outputs."""
  slot_dtypes = [jnp.dtype(d) for d in slot_dtypes]
  out = rule.output_dtype(w_dtype, slot_dtypes)
  return ([jnp.dtype(w_dtype)] if rule.updates_weight else []) + slot_dtypes + [
      out] * len(rule.outputs)


def low_precision_problem(plan, cfg: MosaicConfig | None = None, *,
                          g_stored: bool = False) -> str | None:
  """Why the Mosaic GPU kernel cannot take this low-precision state
  (:class:`pallas_kernels.lowp.StatePlan`), or ``None``: it takes int8
  moments (any slots, 64-element blocks) in its streamed epilogue, in
  sub-tiles one block wide; not fp8 codes, stochastic rounding or a stored
  gradient. ``cfg=None``: the tiling is not known yet."""
  if plan is None:
    return None
  if plan.stochastic_rounding:
    return ("stochastic rounding runs on the Triton backend; the Mosaic GPU "
            "kernel does not support it yet")
  fmts = [sp.fmt for sp in plan.slots if sp.fmt is not None]
  if any(f.kind != "int8" for f in fmts):
    return ("fp8 moments run on the Triton backend; the Mosaic GPU kernel "
            "takes int8 ones only")
  if any(f.block != _QUANT_BLOCK for f in fmts):
    return (f"the Mosaic GPU kernel takes int8 moments in blocks of "
            f"{_QUANT_BLOCK}; these have blocks of "
            f"{sorted({f.block for f in fmts})}")
  if g_stored:
    return ("a stored gradient with int8 moments runs on the Triton "
            "backend")
  if cfg is not None and fmts:
    return int8_tiling_problem(cfg)
  return None


def int8_tiling_problem(cfg: MosaicConfig) -> str | None:
  """Why the tiling cannot hold int8 moments, or ``None``."""
  if not (cfg.pingpong or cfg.state_ring):
    return ("int8 moments are requantized in the streamed epilogue: the "
            "tiling needs pingpong or state_ring >= 1")
  if cfg.epi_n != _QUANT_BLOCK or cfg.epi_m % 8:
    return (f"int8 moments need epilogue sub-tiles one block wide: "
            f"epi_n={_QUANT_BLOCK} (this tiling has "
            f"{cfg.epi_m}x{cfg.epi_n})")
  return None


def unsupported(bt: int, n_in: int, n_out: int, x_dtype, w, slots,
                rule: UpdateRule, cfg: MosaicConfig, *, stacked: bool,
                g_stored: bool, low_precision: bool = False,
                plan=None, k_loop: bool = True) -> str | None:
  """Why the Mosaic GPU kernel cannot run this case, or ``None``.

  With ``g_stored``, ``x_dtype`` is the stored gradient's dtype and ``bt``
  is not used. ``low_precision``: a slot is quantized or the weight is
  stored by stochastic rounding (:mod:`pallas_kernels.lowp`); ``plan``: its
  :class:`~pallas_kernels.lowp.StatePlan` (without it, refused).
  ``k_loop=False``: the number of K steps is not checked (a call without
  tokens, which returns without launching the kernel; everything else
  about its arguments is)."""
  if low_precision and plan is None:
    return lowp.MOSAIC_REFUSAL
  why = low_precision_problem(plan, cfg, g_stored=g_stored)
  if why is not None:
    return why
  held = smem_dtypes(rule, w.dtype, [_code_dtype(s) for s in slots])
  if any(jnp.dtype(_code_dtype(s)) == jnp.dtype(jnp.int8)
         for s in slots) and (n_in % cfg.tile_m or n_out % cfg.tile_n):
    return (f"int8 moments need in x out = {n_in} x {n_out} to be a "
            f"multiple of the tile {cfg.tile_m} x {cfg.tile_n} (the "
            "scales of a ragged edge tile are stored by plain stores, "
            "which TMA's bounds do not guard)")
  if g_stored:
    if cfg.pingpong:
      return ("a stored gradient has no K loop for the ping-pong schedule "
              "to overlap with the epilogue: use a tiling without ',pp' "
              "(pingpong=False), e.g. mosaic_kernel.stored_config's")
    if not cfg.state_ring:
      return ("a stored gradient is streamed with the state: the tiling "
              "needs state_ring >= 1")
    sub, tile = (cfg.epi_m, cfg.epi_n), (cfg.tile_m, cfg.tile_n)
    why = _tiling_problem(
        [("G", (n_in, n_out), x_dtype, cfg.epi_n, sub, tile)]
        + [("the state", (n_in, n_out), d, cfg.epi_n, sub, tile)
           for d in held])
    if why is not None:
      return why
    need = cfg.smem_bytes(None, held + [jnp.dtype(x_dtype)])
  else:
    if jnp.dtype(x_dtype) not in (jnp.dtype(jnp.bfloat16),
                                  jnp.dtype(jnp.float16)):
      return (f"x and dy are {jnp.dtype(x_dtype).name}; the Mosaic GPU "
              "kernel takes bfloat16 or float16 operands")
    # The state moves in epilogue sub-tiles, or (column split without a
    # ring) in each warpgroup's share of the tile.
    streamed = cfg.pingpong or cfg.state_ring
    sub = (cfg.epi_m, cfg.epi_n) if streamed else (cfg.tile_m, cfg.wg_n)
    tile = (cfg.tile_m, cfg.tile_n)
    xb, dyb = (cfg.tile_k, cfg.tile_m), (cfg.tile_k, cfg.tile_n)
    why = _tiling_problem(
        [("x", (bt, n_in), x_dtype, cfg.tile_m, xb, xb),
         ("dy", (bt, n_out), x_dtype, cfg.tile_n, dyb, dyb)]
        + [("the state", (n_in, n_out), d, cfg.epi_n, sub, tile)
           for d in held])
    if why is not None:
      return why
    k_steps = pl.cdiv(bt, cfg.tile_k)
    if k_loop and not cfg.pingpong and k_steps <= cfg.delay_release:
      # (Pallas's GPU interpreter: a barrier phase missed, or a block
      # overwritten before its wgmma read it, with tiles to follow.)
      return (f"the column-split schedule releases each K step's operand "
              f"blocks delay_release={cfg.delay_release} step(s) late, so "
              f"it needs more than {cfg.delay_release} K step(s); BT = {bt} "
              f"makes {k_steps} of {cfg.tile_k} rows: use the ping-pong "
              "schedule (',pp': pingpong=True, as mosaic_kernel."
              "default_config's tilings have; MosaicConfig() defaults to "
              "the column split) or delay_release=0 (',d0')")
    if cfg.cluster > 1 and n_in % (cfg.tile_m * cfg.cluster):
      return (f"with cluster={cfg.cluster} the programs of a cluster take "
              f"tile rows in pairs: in = {n_in} must be a multiple of "
              f"{cfg.cluster} x tile_m = {cfg.cluster * cfg.tile_m}")
    need = cfg.smem_bytes(x_dtype, held)
  if need > _SMEM_BYTES:
    ring = (f" with a state ring of {cfg.ring_for(x_dtype, held)} sub-tiles"
            if cfg.pingpong else "")
    return (f"the tiling needs {need} bytes of shared memory{ring}, more "
            f"than the {_SMEM_BYTES} a block has: use smaller tiles, fewer "
            "steps or a smaller epilogue sub-tile")
  return None


def _tiling_problem(arrays) -> str | None:
  """Why TMA cannot move the blocks of these arrays, or ``None``.

  ``arrays`` holds ``(name, (rows, columns), dtype, minor, block, tile)``:
  an array, the columns its shared-memory tiling is formed for
  (:func:`_transforms`), the ``(rows, columns)`` of the blocks moved (a K
  step's operand block, an epilogue sub-tile) and of the output tile they
  are taken from.
  Shapes the tiles do not divide are covered (TMA zero-fills the loads past
  an array's edge and drops the stores there), but TMA moves a block in the
  pieces of its shared-memory tiling (:func:`_transforms`: 8 rows by the
  swizzle's width), and Mosaic GPU views the whole array in those pieces:
  each dimension must be a multiple of them. And a copy drops every
  dimension in which both the array and the block are one piece, its index
  with it: a block of a tile wider than such an array, wholly past its
  edge, would be moved at the edge's piece instead (measured on the H200:
  a wrong update), so that case is refused too."""
  for name, (rows, cols), dtype, minor, block, tile in arrays:
    tr, tc = _transforms(minor, dtype)[0].tiling
    if rows % tr or cols % tc:
      return (f"{name} is {rows} x {cols} {jnp.dtype(dtype).name}: the "
              "Mosaic GPU kernel moves its blocks by TMA in pieces of "
              f"{tr} x {tc} (its shared-memory tiling), so it needs a "
              f"multiple of {tr} rows and of {tc} columns")
    for what, n, b, t, piece in (("rows", rows, block[0], tile[0], tr),
                                 ("columns", cols, block[1], tile[1], tc)):
      if n == piece and b == piece and t > n:
        return (f"{name} is {rows} x {cols}: its {n} {what} are one TMA "
                f"piece, as are the {b} {what} of the blocks it is moved "
                f"in, and the tile ({tile[0]} x {tile[1]}) reaches past "
                "them; Mosaic GPU drops such a dimension from the copy, so "
                "a block past the edge would land on the edge: use tiles "
                f"of at most {n} {what} or smaller epilogue sub-tiles "
                "(e.g. the default tiling for the shape)")
  return None


# Elements per int8 scale: one block per row of an epilogue sub-tile.
_QUANT_BLOCK = 64


def _code_dtype(slot):
  """A slot's dtype in the kernel: a quantized slot's codes'."""
  return slot.q.dtype if isinstance(slot, lowp.Quantized) else slot.dtype


def _quantize_rows(x, fmt, second: bool):
  """:func:`pallas_kernels.quant.quantize_blocks` on an fp32 ``(rows,
  block)`` sub-tile, one block per row: the same results bit for bit, in
  fewer operations. One reduction per row instead of two: a non-finite
  value counts as ``+inf`` in the absmax, so ``m = inf`` marks a bad block
  and a finite ``m`` is the block's absmax; the masks are float 0/1 per
  row (Mosaic GPU lowers no boolean vectors here), a second moment's floor
  shares the one select, and no clip is needed (int8 codes, below).
  Returns int8 codes ``(rows, block)`` and scales ``(rows,)``."""
  f0, f1, inf = jnp.float32(0), jnp.float32(1), jnp.float32(jnp.inf)
  ax = jnp.abs(x)
  finite = ax < inf  # False for NaN and +-Inf
  if second:  # negatives (and NaN) to 0; `finite` still sees the original
    x = jnp.where(x > f0, x, f0)
    ax = x
  m = jnp.max(jnp.where(finite, ax, inf), axis=1)
  ok = m < inf  # no non-finite value in the block
  live = jnp.where(ok, jnp.where(m >= jnp.float32(quant.TINY_ABSMAX), f1, f0),
                   f0)
  scale = jnp.where(ok, jnp.where(live > f0, m * jnp.float32(fmt.inv_qmax),
                                  f0), jnp.float32(jnp.nan))
  r = jnp.float32(fmt.qmax) / jnp.where(live > f0, m, f1)
  # No clip to [-qmax, qmax] (the reference's): in a live block |x| <= m,
  # so |x * r| <= qmax (1 + 2**-24)**2 < qmax + 0.5, which rounds to at
  # most qmax: the same codes.
  y = x * r[:, None]
  if second and fmt.v_floor:
    y = jnp.maximum(y, jnp.float32(fmt.floor_value))
  live2 = jnp.broadcast_to(live[:, None], x.shape) > f0
  return _round_to_codes(jnp.where(live2, y, f0)), scale


# int8 <-> fp32 without the GPU's conversion instructions: those run at a
# quarter of the integer and an eighth of the fp32 rate (16 per clock and
# SM on Hopper), and the int8 epilogue would take three per element and
# slot (int8 -> fp32, round, fp32 -> int8). Adding 1.5 * 2**23 to a float
# of magnitude below 2**22 rounds it to an integer, half to even (the
# addition's own rounding), and leaves that integer in the low bits of the
# sum's mantissa: an integer subtraction reads it out (on the GPU a byte
# of the sum, the subtraction's constant having a zero low byte). Back:
# the code added to those bits is the float 1.5 * 2**23 + code, exactly.
_MAGIC = 12582912.0  # 1.5 * 2**23
_MAGIC_BITS = 0x4B400000  # its bits


def _round_to_codes(y):
  """``round(y)`` (half to even) as int8 codes, for ``|round(y)| <= 127``.

  Where ``y`` is a product the compiler may contract ``y + 1.5 * 2**23``
  into one fused multiply-add, which rounds the exact product: a code can
  then differ by one from the reference's where the product lies within
  half an fp32 ulp of a half-integer (docs/optimizers.md, Tests)."""
  t = lax.bitcast_convert_type(y + jnp.float32(_MAGIC), jnp.int32)
  return (t - jnp.int32(_MAGIC_BITS)).astype(jnp.int8)


def _codes_to_f32(q):
  """int8 codes as fp32, exactly."""
  t = q.astype(jnp.int32) + jnp.int32(_MAGIC_BITS)
  return lax.bitcast_convert_type(t, jnp.float32) - jnp.float32(_MAGIC)


def _transforms(minor: int, dtype):
  """Tiling and swizzle of a shared-memory block whose minor dimension has
  ``minor`` elements."""
  swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _kernel_body(*refs, rule: UpdateRule, cfg: MosaicConfig, ring: int,
                 bt: int, n_in: int, n_out: int, interpret: bool,
                 stacked: bool, g_stored: bool, quantized: tuple = ()):
  # The operands: x and dy (BT, in) and (BT, out); or, with a stored
  # gradient, G (in, out) alone. Then the hyperparameters. Stacked: the
  # layer index next. Then the state the rule reads and rewrites ((L,) in,
  # out when stacked): the weight if the rule updates it, the slots; last
  # the write-only outputs (in, out). `ring`: the state ring
  # (cfg.ring_for(...); 0: each warpgroup's share of the tile held whole).
  # `quantized`: per int8 slot (slot index, format, second moment); its
  # codes are the slot's state array, its scales, transposed ((L,) out/64,
  # in), follow the state arrays (rewritten in place by plain stores).
  if g_stored:
    g_gmem, h_gmem, *refs = refs
  else:
    x_gmem, dy_gmem, h_gmem, *refs = refs
  if stacked:
    layer_gmem, *refs = refs
    layer = layer_gmem[0]
  n_out_arrays = len(rule.outputs)
  n_state = len(refs) - n_out_arrays - len(quantized)
  state_gmem = refs[:n_state]
  scale_gmem = refs[n_state:n_state + len(quantized)]
  stored = [(ref, True) for ref in state_gmem] + [
      (ref, False) for ref in refs[len(refs) - n_out_arrays:]]
  first_slot = 1 if rule.updates_weight else 0

  def at(ref, r, c, is_state=True):
    return ref.at[layer, r, c] if stacked and is_state else ref.at[r, c]
  tm, tn, tk, wn = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.wg_n
  cw, nbuf = cfg.compute_wgs, cfg.state_buffers
  # Ragged edges: the last tiles (and K step) reach past the arrays; TMA
  # zero-fills their loads and drops their stores (in whole pieces of the
  # blocks' tiling: _tiling_problem), so the rows past BT add zero to G and
  # nothing past in x out is written.
  m_iters, n_iters = pl.cdiv(n_in, tm), pl.cdiv(n_out, tn)
  k_iters = pl.cdiv(bt, tk)
  delay = cfg.delay_release
  slot_dtypes = [r.dtype for r in state_gmem[first_slot:]]
  for k, _, _ in quantized:  # the rule sees an int8 slot as fp32
    slot_dtypes[k] = jnp.dtype(jnp.float32)

  def hparams():
    return rule.unpack(h_gmem, slot_dtypes, round_by_convert=not interpret)

  em, en = cfg.epi_m, cfg.epi_n
  # The epilogue's sub-tiles of a warpgroup's (tm, wn) share, in order.
  subs = [(i, j) for i in range(tm // em) for j in range(wn // en)]
  # Whole tile: (buffer, warpgroup, tm, wn); ring: (warpgroup, slot, em, en).
  held = (cw, ring, em, en) if ring else (nbuf, cw, tm, wn)
  n_bars = cw * ring if ring else nbuf * cw
  # Sub-tiles between a ring slot's stores and its reload: with ping-pong
  # and a ring of 2 or more, 1 (the stores drain while the next sub-tile is
  # updated); otherwise 0 (reloaded as soon as its stores have read it).
  lag = 1 if cfg.pingpong and ring >= 2 else 0

  def scale_row(q, rows, block):
    """The scales of int8 slot ``q`` for ``rows`` of block column
    ``block`` (a contiguous row of the transposed scales)."""
    ref = scale_gmem[q]
    return ref.at[layer, block, rows] if stacked else ref.at[block, rows]

  def update(g, sub, h, bufs, pos=None, scales=()):
    """The rule on one sub-tile: the accumulator slice ``g`` and the state
    at ``buf[sub]`` (rewritten there). ``pos``: the sub-tile's rows of
    ``W`` and its block column (int8 slots: where their new scales go);
    ``scales``: per int8 slot, its old scales in shared memory."""
    old = [buf[sub] for buf in bufs[:len(state_gmem)]]
    for q, (k, _, _) in enumerate(quantized):  # dequantize: codes * scale
      old[first_slot + k] = (_codes_to_f32(old[first_slot + k])
                             * scales[q][...][:, None])
    old = [a.astype(jnp.float32) for a in old]
    if rule.updates_weight:
      w_new, new = rule.call(g, old[0], tuple(old[1:]), h)
      new = [w_new, *new]
    else:
      _, new = rule.call(g, None, tuple(old), h)
      new = list(new)
    for q, (k, fmt, second) in enumerate(quantized):  # requantize
      new[first_slot + k], scale = _quantize_rows(new[first_slot + k], fmt,
                                                  second)
      scale_row(q, *pos)[...] = scale
    for buf, val in zip(bufs, new):
      buf[sub] = val.astype(buf.dtype)

  def pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=_MEMORY_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((tk, tm), lambda k: (k, 0),
                            transforms=_transforms(tm, x_gmem.dtype),
                            delay_release=delay),
            plgpu.BlockSpec((tk, tn), lambda k: (k, 0),
                            transforms=_transforms(tn, dy_gmem.dtype),
                            delay_release=delay),
        ],
        wg_axis="wg", num_compute_wgs=cw,
        max_concurrent_steps=cfg.steps, compute_context=context)

  ignore = lambda *_, **__: None
  # The arrays loaded per tile or sub-tile, with whether they are stacked:
  # the state, and a stored G (one layer, (in, out)) last.
  loaded_refs = [(ref, True) for ref in state_gmem]
  allocs = {}
  if g_stored:
    loaded_refs.append((g_gmem, False))
    allocs["g_buf"] = plgpu.SMEM(held, g_gmem.dtype,
                                 transforms=_transforms(en, g_gmem.dtype))
  elif cfg.pingpong:
    allocs.update(
        x_ring=plgpu.SMEM((cfg.steps, tk, tm), x_gmem.dtype,
                          transforms=_transforms(tm, x_gmem.dtype)),
        dy_ring=plgpu.SMEM((cfg.steps, tk, tn), dy_gmem.dtype,
                           transforms=_transforms(tn, dy_gmem.dtype)),
        # full[c * steps + slot]: the slot's x and dy blocks for compute
        # warpgroup c have landed.
        full=plgpu.Barrier(num_arrivals=2, num_barriers=cw * cfg.steps),
        # consumed[slot]: the warpgroup that read the slot is done with it
        # (with a cluster: the warpgroup of every program of the cluster,
        # whose slots the multicast loads also fill).
        consumed=(plgpu.Barrier(num_arrivals=1, num_barriers=cfg.steps)
                  if cfg.cluster == 1 else
                  plgpu.ClusterBarrier(collective_axes=("cluster",),
                                       num_arrivals=1,
                                       num_barriers=cfg.steps)))
  else:
    allocs["pipeline_allocs"] = pipeline(ignore, ignore).get_allocations(
        x_gmem, dy_gmem)

  if quantized:
    # The int8 slots' scales of each ring slot's sub-tile (one per row),
    # loaded with its state so that the epilogue never waits on memory.
    assert ring, "int8 moments need a state ring (int8_tiling_problem)"
    allocs["scale_bufs"] = [plgpu.SMEM((cw, ring, em), jnp.float32)
                            for _ in quantized]

  @functools.partial(
      pl.run_scoped,
      bufs=[plgpu.SMEM(held, r.dtype, transforms=_transforms(en, r.dtype))
            for r, _ in stored],
      bar=plgpu.Barrier(num_barriers=n_bars,
                        num_arrivals=len(loaded_refs) + len(quantized)),
      collective_axes="wg", **allocs)
  def _scope(bufs, bar, pipeline_allocs=None, g_buf=None, x_ring=None,
             dy_ring=None, full=None, consumed=None, scale_bufs=()):
    # The buffers loaded per sub-tile, in loaded_refs' order.
    in_bufs = [*bufs[:len(state_gmem)], *([g_buf] if g_stored else [])]

    # The epilogue pieces both schedules share. `t = (mi, ni, col0, wg)`:
    # warpgroup `wg` on the tile (mi, ni), its share from column `col0` of
    # the tile on (0 with ping-pong: the whole tile).
    n_cols = wn // en  # sub-tile columns of a share

    def dyn(s):
      """``s`` (a sub-tile's number: a Python int, or traced in a rolled
      epilogue) as ``(slot, row, column)``."""
      if isinstance(s, int):
        return (s % ring, *subs[s])
      return lax.rem(s, ring), lax.div(s, n_cols), lax.rem(s, n_cols)

    def sub_at(t, s):
      """Rows and columns of ``W`` of sub-tile ``s`` of ``t``'s share."""
      mi, ni, col0, _ = t
      _, i, j = dyn(s)
      return (pl.ds(mi * tm + i * em, em),
              pl.ds(ni * tn + col0 + j * en, en))

    def load_sub(t, s, r=None):
      # Into ring slot r (default s % ring); the stores that last read the
      # slot have drained from shared memory (waited for by the caller).
      wg = t[3]
      if r is None:
        r = dyn(s)[0]
      for (ref, is_state), buf in zip(loaded_refs, in_bufs):
        plgpu.copy_gmem_to_smem(at(ref, *sub_at(t, s), is_state),
                                buf.at[wg, r], bar.at[wg * ring + r])
      if quantized:
        rows, cols = sub_at(t, s)
        block = cols.start // _QUANT_BLOCK
        for q, buf in enumerate(scale_bufs):
          plgpu.copy_gmem_to_smem(scale_row(q, rows, block), buf.at[wg, r],
                                  bar.at[wg * ring + r])

    def load_ring(t):
      # The share's first sub-tiles, once the warpgroup's previous stores
      # have left shared memory.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      for s in range(min(ring, len(subs))):
        load_sub(t, s)

    # The ring running on across a warpgroup's tiles (prefetch_next): its
    # sub-tiles form one stream, `stream = (u, n, tile_of)`: this is the
    # warpgroup's tile u of n, `tile_of(v)` its tile v as `t`; sub-tile s
    # of tile v is number v * len(subs) + s of the stream, in slot
    # number % ring.
    def load_stream(n, tile_of):
      # The stream's first `ring` sub-tiles (its start).
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      for q in range(ring):
        v, s = divmod(q, len(subs))
        pl.when(v < n)(functools.partial(load_sub, tile_of(v), s, q))

    def load_number(q, stream):
      # Sub-tile number q of the stream (if there is one) into its slot.
      _, n, tile_of = stream
      v, s = lax.div(q, len(subs)), lax.rem(q, len(subs))
      pl.when(v < n)(lambda: load_sub(tile_of(v), s, lax.rem(q, ring)))

    def streamed_epilogue(t, acc, h, stream=None):
      # acc: the share's accumulator, or None to read G from its buffer.
      # stream: the warpgroup's tiles as one stream (prefetch_next, above);
      # None: the ring starts afresh with each tile (load_ring).
      wg = t[3]
      base = None if stream is None else stream[0] * len(subs)

      def sub_tile(s, g):
        r = dyn(s)[0] if stream is None else lax.rem(base + s, ring)
        plgpu.barrier_wait(bar.at[wg * ring + r])
        sub = (wg, r, pl.ds(0, em), pl.ds(0, en))
        if g is None:
          g = g_buf[sub].astype(jnp.float32)
        pos = None
        if quantized:  # the sub-tile's rows and block column
          rows, cols = sub_at(t, s)
          pos = (rows, cols.start // _QUANT_BLOCK)
        update(g, sub, h, bufs, pos, [b.at[wg, r] for b in scale_bufs])
        plgpu.commit_smem()
        for (ref, is_state), buf in zip(stored, bufs):
          plgpu.copy_smem_to_gmem(buf.at[wg, r], at(ref, *sub_at(t, s),
                                                    is_state))
        # The slot of the sub-tile `lag` places back is reloaded now: one
        # store group per stored array and sub-tile, so those of the `lag`
        # sub-tiles since may still be reading. (A tile's first `lag`
        # sub-tiles reload none: the slots of the previous tile's last
        # ones were reloaded as it ended.)
        def reload():
          plgpu.wait_smem_to_gmem(lag * len(stored), wait_read_only=True)
          if stream is None:
            load_sub(t, s - lag + ring)
          else:
            load_number(base + s - lag + ring, stream)
        if stream is not None:
          if not isinstance(s, int):
            pl.when(s >= lag)(reload)
          elif s >= lag:
            reload()
        elif isinstance(s, int):
          if lag <= s < len(subs) + lag - ring:
            reload()
        else:
          pl.when((s >= lag) & (s - lag + ring < len(subs)))(reload)

      def acc_slice(i, j):
        return acc[i * em:(i + 1) * em, j * en:(j + 1) * en]

      if not cfg.rolled:
        for s, (i, j) in enumerate(subs):
          sub_tile(s, None if acc is None else acc_slice(i, j))
      else:
        @pl.loop(0, len(subs))
        def _sub(s):
          g = None if acc is None else lax.switch(
              s, [functools.partial(acc_slice, i, j) for i, j in subs])
          sub_tile(s, g)

      if stream is not None and lag:
        # The slots of this tile's last `lag` sub-tiles, once their stores
        # have read them, take the stream's sub-tiles `ring` places on.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for d in range(lag):
          load_number(base + len(subs) - lag + d + ring, stream)

    if cfg.pingpong:
      _pingpong_tiles(load_ring, load_stream, streamed_epilogue, hparams,
                      x_gmem, dy_gmem,
                      x_ring, dy_ring, full, consumed, cfg=cfg,
                      m_iters=m_iters, n_iters=n_iters, k_iters=k_iters)
      return

    wg = lax.axis_index("wg")

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile(info):
      (lin,) = info.index
      mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, cfg.band)
      t = (mi, ni, wg * wn, wg)
      rows = pl.ds(mi * tm, tm)
      own_cols = pl.ds(ni * tn + wg * wn, wn)  # this warpgroup's columns
      slot = info.local_index % nbuf if nbuf > 1 else 0
      loaded = bar.at[slot * cw + wg]

      def prefetch(tile_rows, tile_own_cols, to_slot, pending):
        # The stores of the tile that last used this buffer (this
        # warpgroup's, one group per state array) must have read it before
        # the loads overwrite it: at most `pending` groups may remain.
        plgpu.wait_smem_to_gmem(pending, wait_read_only=True)
        for ref, buf in zip(state_gmem, bufs):  # outputs are not loaded
          plgpu.copy_gmem_to_smem(at(ref, tile_rows, tile_own_cols),
                                  buf.at[to_slot, wg],
                                  bar.at[to_slot * cw + wg])

      def held_epilogue(acc, h):
        plgpu.barrier_wait(loaded)
        for i, j in subs:
          update(acc[i * em:(i + 1) * em, j * en:(j + 1) * en],
                 (slot, wg, pl.ds(i * em, em), pl.ds(j * en, en)), h, bufs)
        plgpu.commit_smem()
        for (ref, is_state), buf in zip(stored, bufs):
          plgpu.copy_smem_to_gmem(buf.at[slot, wg],
                                  at(ref, rows, own_cols, is_state))

      if g_stored:
        load_ring(t)
        streamed_epilogue(t, None, hparams())
        return

      def context(run_pipeline):
        # This tile's state loads fly during its K loop.
        if ring:
          load_ring(t)
        elif cfg.prefetch_next:
          pl.when(info.local_index == 0)(
              lambda: prefetch(rows, own_cols, slot, 0))
        else:
          prefetch(rows, own_cols, slot, (nbuf - 1) * len(stored))

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, wn)))
        def _acc(acc_ref):
          run_pipeline(acc_ref)
          if cfg.prefetch_next:
            nxt = lin + lax.axis_size("sm")

            @pl.when(nxt < m_iters * n_iters)
            def _next():
              nmi, nni = plgpu.planar_snake(nxt, (m_iters, n_iters), 1,
                                            cfg.band)
              # Only the previous tile's stores, from the other buffer,
              # can still be pending.
              prefetch(pl.ds(nmi * tm, tm), pl.ds(nni * tn + wg * wn, wn),
                       1 - slot, 0)
          acc = acc_ref[...]
          h = hparams()
          if ring:
            streamed_epilogue(t, acc, h)
          else:
            held_epilogue(acc, h)

      def k_step(_, x_smem, dy_smem, acc_ref):
        plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)),
                    dy_smem.at[:, pl.ds(wg * wn, wn)])
        plgpu.wgmma_wait(delay)
        return acc_ref

      pipeline(k_step, context)(x_gmem.at[:, rows],
                                dy_gmem.at[:, pl.ds(ni * tn, tn)],
                                allocations=pipeline_allocs)
  plgpu.wait_smem_to_gmem(0)


def _pingpong_tiles(load_ring, load_stream, streamed_epilogue, hparams,
                    x_gmem, dy_gmem, x_ring, dy_ring, full, consumed, *,
                    cfg: MosaicConfig, m_iters: int, n_iters: int,
                    k_iters: int):
  """The ping-pong schedule's tile loops (module docstring), warpgroups 0
  to ``compute_wgs - 1`` computing, the last streaming the operands; the
  epilogue pieces are :func:`_kernel_body`'s."""
  tm, tn, tk, n_steps = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.steps
  cw, delay, cl = cfg.compute_wgs, cfg.delay_release, cfg.cluster
  wg = lax.axis_index("wg")
  sm, n_sm = lax.axis_index("sm"), lax.axis_size("sm")
  # With a cluster, "sm" numbers the clusters and the grid of tiles is one
  # of tile-row groups of `cl`; program `cta` of a cluster takes row
  # `cta` of each group.
  cta = lax.axis_index("cluster") if cl > 1 else 0
  m_groups = m_iters // cl
  # This program's tiles: sm + j * n_sm for j < my_tiles; tile j is compute
  # warpgroup j % compute_wgs's, and its K steps are j * k_iters + k of the
  # stream through the operand ring.
  my_tiles = lax.div(m_groups * n_iters - sm + n_sm - 1, n_sm)

  def coords(j):
    mg, ni = plgpu.planar_snake(sm + j * n_sm, (m_groups, n_iters), 1,
                                cfg.band)
    return mg * cl + cta, ni

  @pl.when(wg == cw)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

    @pl.loop(0, my_tiles)
    def _tile(j):
      mi, ni = coords(j)
      owner = lax.rem(j, cw)

      @pl.loop(0, k_iters)
      def _k(k):
        step = j * k_iters + k
        slot = lax.rem(step, n_steps)

        @pl.when(step >= n_steps)
        def _():
          plgpu.barrier_wait(consumed.at[slot])
        rows = pl.ds(k * tk, tk)
        landed = full.at[owner * n_steps + slot]
        plgpu.copy_gmem_to_smem(x_gmem.at[rows, pl.ds(mi * tm, tm)],
                                x_ring.at[slot], landed)
        # With a cluster, each program loads half of the dy block and
        # multicasts it to both (the same block: one tile column).
        plgpu.copy_gmem_to_smem(dy_gmem.at[rows, pl.ds(ni * tn, tn)],
                                dy_ring.at[slot], landed,
                                **({"collective_axes": "cluster"}
                                   if cl > 1 else {}))

    # Observe the last steps' releases too, so that no barrier is left with
    # a phase this warpgroup did not see.
    total = my_tiles * k_iters

    @pl.loop(jnp.maximum(total - n_steps, 0), total)
    def _drain(step):
      plgpu.barrier_wait(consumed.at[lax.rem(step, n_steps)])

  @pl.when(wg < cw)
  def _compute():
    plgpu.set_max_registers(pingpong_registers(cw), action="increase")
    h = hparams()

    def release(step):
      plgpu.barrier_arrive(consumed.at[lax.rem(step, n_steps)])

    n_own = lax.div(my_tiles - wg + cw - 1, cw)  # this warpgroup's tiles

    @pl.loop(0, n_own)
    def _tile(u):
      j = wg + u * cw
      mi, ni = coords(j)
      t = (mi, ni, 0, wg)
      # This tile's first state sub-tiles fly during its K loop: issued
      # now; or (prefetch_next) the ring runs on across the warpgroup's
      # tiles, started with its first tile, and the previous tiles'
      # epilogues have issued them.
      stream = None
      if cfg.prefetch_next:
        stream = (u, n_own, lambda v: (*coords(wg + v * cw), 0, wg))
        pl.when(u == 0)(lambda: load_stream(n_own, stream[2]))
      else:
        load_ring(t)

      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn)))
      def _acc(acc_ref):
        first = j * k_iters

        @pl.loop(0, k_iters)
        def _k(k):
          step = first + k
          slot = lax.rem(step, n_steps)
          plgpu.barrier_wait(full.at[wg * n_steps + slot])
          plgpu.wgmma(acc_ref, x_ring.at[slot].transpose((1, 0)),
                      dy_ring.at[slot])
          plgpu.wgmma_wait(delay)
          if delay:  # the previous step's wgmma has read its slot
            pl.when(k > 0)(lambda: release(step - 1))
          else:
            release(step)

        if delay:
          plgpu.wgmma_wait(0)
          release(first + k_iters - 1)
        streamed_epilogue(t, acc_ref[...], h, stream)


def launch(operands, w, slots, hparams, *, rule: UpdateRule,
           cfg: MosaicConfig, interpret: bool | plgpu.InterpretGPUParams,
           layer=None, num_sms: int | None = None, plan=None):
  """The kernel on checked inputs that :func:`unsupported` accepts.

  Args:
    operands: ``(x, dy)``, ``(BT, in)`` and ``(BT, out)`` in one 16-bit
      dtype, whose ``G = x^T dy`` the kernel forms; or ``(g,)``, a gradient
      ``(in, out)`` already in memory (one layer), streamed with the state
      (needs ``cfg.state_ring``, and not ``cfg.pingpong``).
    w, slots: the weight and the rule's slots, ``(in, out)``, or stacked
      ``(L, in, out)`` with ``layer``; updated in place (the kernel writes
      them through refs).
    hparams: ``rule.pack(...)``.
    rule, cfg: the update rule and the tiling.
    layer: with stacked state, the int32 index (in range) of the layer to
      update; ``None`` for 2-D state.
    interpret: run in Pallas GPU interpret mode (on the CPU): ``True``, or
      the interpreter's ``plgpu.InterpretGPUParams`` (e.g. with
      ``detect_races=True``); ``False`` to compile.
    num_sms: programs in the persistent grid (``num_sms // cfg.cluster``
      clusters of them, at least one); default the GPU's SM count (4 in
      interpret mode).
    plan: the :class:`~pallas_kernels.lowp.StatePlan` of int8 slots
      (``Quantized`` pairs in ``slots``; :func:`low_precision_problem`), or
      ``None``.

  Returns:
    ``(w_new, slots_new + outputs)``; ``w_new`` is ``w`` itself when the
    rule does not update the weight.

  Compiled, the kernel runs inside one ``jax.jit`` per (shapes, dtypes,
  rule, tiling): every call of the same case in a program (the layers of an
  unrolled model) then lowers to one function holding one Mosaic GPU
  module, lowered and compiled once, instead of one module per call site
  (about half a second of lowering each, and as much compiling).
  """
  if (interpret and cfg.cluster > 1 and cfg.prefetch_next
      and not INTERPRETS_CLUSTERED_PREFETCH):
    raise ValueError(
        f"the Mosaic GPU tiling {cfg.label} (a cluster with prefetch_next) "
        f"runs compiled only with jax {jax.__version__}: Pallas's GPU "
        "interpreter before jax 0.12 deadlocks on the two together; use "
        "jax >= 0.12, or drop ,c2 or ,pn to run it in interpret mode")
  if num_sms is None:
    num_sms = 4 if interpret else jax.devices()[0].core_count
  # (The interpreter's params need not be hashable: no jit there.)
  run = _launch if interpret else _launch_compiled
  w_new, rest = run(operands, w, slots, hparams, layer, rule=rule, cfg=cfg,
                    interpret=interpret or False,
                    num_sms=num_sms, plan=plan)
  # A rule that leaves the weight alone returns it as given (not passed
  # through the jit, which would hand back another array, or a copy).
  return (w_new if rule.updates_weight else w), rest


def _launch(operands, w, slots, hparams, layer, *, rule: UpdateRule,
            cfg: MosaicConfig, interpret, num_sms: int, plan):
  """:func:`launch` on its arguments, ``num_sms`` resolved; ``w_new`` is
  ``None`` for a rule that does not update the weight."""
  g_stored = len(operands) == 1
  quantized, scales, arrays = [], [], []
  for k, a in enumerate(slots):
    if isinstance(a, lowp.Quantized):
      sp = plan.slots[k]
      quantized.append((k, sp.fmt, sp.second))
      scales.append(jnp.swapaxes(a.scale, -1, -2))  # contiguous per block
      a = a.q
    arrays.append(a)
  slots = tuple(arrays)
  n_in, n_out = w.shape[-2:]
  bt = 0 if g_stored else operands[0].shape[0]
  stacked = layer is not None
  ring = cfg.ring_for(None if g_stored else operands[0].dtype,
                      smem_dtypes(rule, w.dtype, [a.dtype for a in slots]))
  body = functools.partial(_kernel_body, rule=rule, cfg=cfg, ring=ring,
                           bt=bt, n_in=n_in, n_out=n_out,
                           interpret=bool(interpret), stacked=stacked,
                           g_stored=g_stored, quantized=tuple(quantized))
  out_dtype = rule.output_dtype(w.dtype, [a.dtype for a in slots])
  if isinstance(interpret, plgpu.InterpretGPUParams):
    params = interpret
  else:
    params = plgpu.InterpretGPUParams() if interpret else None
  clusters = ({} if cfg.cluster == 1 else
              {"cluster": (cfg.cluster,), "cluster_names": ("cluster",)})
  kernel = plgpu.kernel(
      body, grid=(max(1, num_sms // cfg.cluster),), grid_names=("sm",),
      **clusters,
      out_type=tuple(jax.ShapeDtypeStruct((n_in, n_out), out_dtype)
                     for _ in rule.outputs),
      # A stored G needs no memory warpgroup: no K loop to stream.
      num_threads=cfg.compute_wgs + (0 if g_stored else 1), thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          approx_math=cfg.approx_math,
          unsafe_no_auto_barriers=cfg.no_barriers),
      interpret=params)
  state = (w, *slots) if rule.updates_weight else slots
  refs = [jax.new_ref(a) for a in (*state, *scales)]
  extra = (jnp.reshape(layer, (1,)).astype(jnp.int32),) if stacked else ()
  outputs = kernel(*operands, hparams, *extra, *refs)
  new = [r[...] for r in refs]
  new_scales = [jnp.swapaxes(a, -1, -2) for a in new[len(state):]]
  new = new[:len(state)]
  w_new = new.pop(0) if rule.updates_weight else None
  for (k, _, _), scale in zip(quantized, new_scales):
    new[k] = lowp.Quantized(new[k], scale)
  return w_new, (*new, *outputs)


# One traced and lowered kernel per case (launch's docstring); the static
# arguments are frozen dataclasses (hashed by value).
_launch_compiled = jax.jit(
    _launch, static_argnames=("rule", "cfg", "interpret", "num_sms", "plan"))
