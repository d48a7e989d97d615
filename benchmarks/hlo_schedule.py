"""Where a compiled training step forms each weight gradient and where it
applies the optimizer to it: read from the scheduled HLO XLA compiled.

    ./dev.sh python -m benchmarks.hlo_schedule H.hlo.txt[.gz] [...]

The input is ``compiled.as_text()`` of a jitted step (``e2e_paired.py
--hlo-dir`` writes one per arm); its entry computation lists the kernels in
the order they run. An *update* is a kernel (fusion or custom call) that
reads a matrix slot of the optimizer state (an entry parameter named
``opt_state...`` of rank >= 2). Its *gradient GEMM* is an operand that is a
GEMM's output (a ``__cublas`` custom call, a ``gemm_fusion``, or a fusion
whose computation's root is a ``dot``, as XLA:CPU's library fusions are;
through ``get-tuple-element`` / ``bitcast``). Per file it prints: how many
updates there are and how many read a GEMM-formed gradient; for those, how
many kernels run between the GEMM and the update; where in the step the
updates sit (fraction of the kernel sequence); the most gradients alive at once
(formed and not yet consumed by their update) with their bytes, and the
most gradient bytes alive at once. A FORGE step with the fused kernel has
updates that are custom calls reading no GEMM output: the gradient is never
stored. Copies of a slot or of a gradient are followed back to their source
(a copy is not an update).

Only the entry computation is read for the above: a step whose layers run
in a loop (``nn.scan``, ``ScannedDenseStack``) keeps its GEMMs and per-layer
updates in the loop's body; an update in the entry that reads a loop's
output is counted as such, not followed into the loop. Inside while-loop
bodies it lists the copies of large arrays (``--min-copy-bytes``, default
1 MiB), which run on every iteration.

It answers one question without a GPU (given the dumps): does
XLA already schedule optax's jitted step the way FORGE would, each gradient
consumed right after it is formed? Exit status 1 if a file has no entry
computation.
"""

from __future__ import annotations

import argparse
import gzip
import re
import statistics
import sys
import zlib

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_SHAPE = re.compile(r"([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
          "u64": 8}
# Followed back to the producer (a copy of a slot or of G is still it).
_PASS_THROUGH = ("get-tuple-element", "bitcast", "copy")
_KERNELS = ("fusion", "custom-call", "copy", "dot")
# Ops whose outputs come from another computation (not analysed).
_CALLS = ("while", "call", "conditional")


def _balanced(s: str, i: int) -> int:
  """Index just past the parenthesis group opening at ``s[i]``."""
  depth = 0
  for j in range(i, len(s)):
    depth += {"(": 1, ")": -1}.get(s[j], 0)
    if depth == 0:
      return j + 1
  raise ValueError(f"unbalanced parentheses in {s[:80]!r}")


def parse_instruction(line: str):
  """``(name, type, op, operands, attributes)`` of one HLO instruction line,
  or ``None`` if the line is not one."""
  m = _INSTR.match(line)
  if not m:
    return None
  name, rest = m.groups()
  if rest.startswith("("):
    end = _balanced(rest, 0)
    typ, rest = rest[:end], rest[end:].lstrip()
  else:
    typ, _, rest = rest.partition(" ")
  op, paren, rest = rest.partition("(")
  if not paren:
    return None
  end = _balanced("(" + rest, 0) - 1
  args, attrs = rest[:end - 1], rest[end:]
  operands = re.findall(r"%([\w.\-]+)", args)
  return name, typ, op.strip(), operands, attrs


def entry_instructions(text: str) -> list[tuple]:
  """The entry computation's instructions, in schedule order."""
  lines = text.splitlines()
  start = next((i for i, l in enumerate(lines) if l.startswith("ENTRY ")),
               None)
  if start is None:
    raise ValueError("no ENTRY computation in this HLO text")
  out = []
  for line in lines[start + 1:]:
    if line.startswith("}"):
      break
    ins = parse_instruction(line)
    if ins is not None:
      out.append(ins)
  return out


def _computation_lines(text: str):
  """``(computation name, line)`` of each line inside a computation."""
  name = None
  for line in text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      head = line[6:] if line.startswith("ENTRY ") else line
      m = re.match(r"%?([\w.\-]+)", head)
      name = m.group(1) if m else None
    elif line.startswith("}"):
      name = None
    elif name is not None:
      yield name, line


def computations(text: str) -> dict[str, list[tuple]]:
  """Every computation's instructions by name (the entry's under its own
  name too), in order."""
  out = {}
  for name, line in _computation_lines(text):
    ins = parse_instruction(line)
    if ins is not None:
      out.setdefault(name, []).append(ins)
  return out


def loop_copies(text: str, min_bytes: int) -> list[tuple[str, list]]:
  """``(body, [(copy, type), ...])`` for every while loop's body that
  copies an array of at least ``min_bytes``: a copy there runs on every
  iteration (e.g. a carried stack copied before an in-place update)."""
  comps = computations(text)
  bodies = []
  for instrs in comps.values():
    for _, _, op, _, attrs in instrs:
      m = re.search(r"body=%([\w.\-]+)", attrs) if op == "while" else None
      if m and m.group(1) not in bodies:
        bodies.append(m.group(1))
  out = []
  for body in bodies:
    big = [(n, t) for n, t, op, _, _ in comps.get(body, [])
           if op == "copy" and nbytes(t) >= min_bytes]
    if big:
      out.append((body, big))
  return out


def nbytes(typ: str) -> int:
  """Bytes of an HLO type's first array (a tuple's first element)."""
  m = _SHAPE.search(typ)
  if not m:
    return 0
  dims = [int(d) for d in m.group(2).split(",") if d]
  elem = m.group(1)
  bits = (8 * _BYTES[elem] if elem in _BYTES
          else 8 if elem.startswith("f8")
          else int(elem[1:]) if elem[:1] in "suf" and elem[1:].isdigit()
          else 32)
  n = bits
  for d in dims:
    n *= d
  return (n + 7) // 8


def _rank(typ: str) -> int:
  m = _SHAPE.search(typ)
  return len([d for d in m.group(2).split(",") if d]) if m else 0


def root_ops(text: str) -> dict[str, str]:
  """The op of each computation's ``ROOT`` instruction, by computation."""
  out = {}
  for name, line in _computation_lines(text):
    ins = parse_instruction(line) if line.lstrip().startswith("ROOT ") else None
    if ins is not None:
      out[name] = ins[2]
  return out


def is_gemm(op: str, attrs: str, roots: dict[str, str] | None = None
            ) -> bool:
  """Whether an instruction forms a GEMM: a ``dot``, a cuBLAS call, XLA:GPU's
  ``gemm_fusion``, or (given ``roots``, :func:`root_ops`) a fusion whose
  computation's root is a ``dot`` (XLA:CPU's library fusions)."""
  if op == "fusion":
    m = re.search(r"calls=%([\w.\-]+)", attrs)
    return m is not None and (m.group(1).startswith("gemm_fusion") or (
        roots is not None and roots.get(m.group(1)) == "dot"))
  return (op == "dot"
          or (op == "custom-call" and 'custom_call_target="__cublas' in attrs))


def analyse(text: str) -> dict:
  """The schedule figures of one HLO module (see the module docstring)."""
  instrs = entry_instructions(text)
  roots = root_ops(text)
  by_name = {i[0]: i for i in instrs}
  slots = {n for n, typ, op, _, _ in instrs
           if op == "parameter" and n.startswith("opt_state")
           and _rank(typ) >= 2}
  kernels = [i for i in instrs if i[2] in _KERNELS]
  position = {k[0]: p for p, k in enumerate(kernels)}

  def source(name: str) -> str:
    seen = 0
    while name in by_name and by_name[name][2] in _PASS_THROUGH and seen < 50:
      name, seen = by_name[name][3][0], seen + 1
    return name

  updates = []
  for name, typ, op, operands, attrs in kernels:
    sources = set(map(source, operands))
    # A copy of a slot moves it; an update computes from it.
    if op == "copy" or not slots & sources:
      continue
    gemms = sorted({s for s in sources
                    if s in by_name and is_gemm(by_name[s][2],
                                                by_name[s][4], roots)},
                   key=lambda s: position.get(s, -1))
    loops = {s for s in sources if s in by_name and by_name[s][2] in _CALLS}
    updates.append(dict(name=name, position=position[name], gemms=gemms,
                        loops=bool(loops),
                        custom=op == "custom-call" and not is_gemm(op,
                                                                   attrs)))

  # The gradients: GEMM outputs some update reads; each lives from its GEMM
  # to the last update that reads it.
  last_use = {}
  for u in updates:
    for g in u["gemms"]:
      last_use[g] = max(last_use.get(g, -1), u["position"])
  live, peak, peak_bytes, max_bytes, events = 0, 0, 0, 0, []
  for g, end in last_use.items():
    b = nbytes(by_name[g][1])
    events += [(position[g], 0, b), (end, 1, -b)]  # a G dies after its use
  cur_b = 0
  for _, kind, b in sorted(events):
    live += 1 if kind == 0 else -1
    cur_b += b
    if live > peak or (live == peak and cur_b > peak_bytes):
      peak, peak_bytes = live, cur_b  # the bytes alive at the most G's
    max_bytes = max(max_bytes, cur_b)
  with_g = [u for u in updates if u["gemms"]]
  gaps = [u["position"] - position[u["gemms"][-1]] - 1 for u in with_g]
  n = max(len(kernels), 1)
  where = [u["position"] / n for u in updates]
  from_loop = sum(u["loops"] and not u["gemms"] for u in updates)
  custom = sum(u["custom"] and not u["gemms"] for u in updates)
  return dict(kernels=len(kernels), slots=len(slots), updates=len(updates),
              updates_from_gemm=len(with_g), gemms=len(last_use),
              updates_from_loop=from_loop, updates_custom_call=custom,
              max_live_bytes=max_bytes,
              gap_min=min(gaps, default=None),
              gap_median=statistics.median(gaps) if gaps else None,
              gap_max=max(gaps, default=None),
              first_update=min(where, default=None),
              last_update=max(where, default=None),
              peak_live=peak, peak_live_bytes=peak_bytes)


def _read(path: str) -> str:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    return f.read()


def _size(n: int) -> str:
  return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def report(path: str, r: dict) -> str:
  lines = [f"{path}: {r['kernels']} kernel instructions in the entry "
           f"computation; {r['updates']} updates of matrix slots, "
           f"{r['updates_from_gemm']} of them reading a gradient a GEMM "
           f"formed ({r['gemms']} such GEMMs)"]
  if not r["slots"]:
    lines.append("  no optimizer-state parameter (an entry parameter named "
                 "opt_state... of rank >= 2): nothing to analyse")
  if r["slots"] and not r["updates"]:
    lines.append("  no kernel of the entry computation updates the "
                 "optimizer state: it is updated inside a loop or call "
                 "(not analysed)")
  if r["updates"]:
    lines.append(f"  updates sit at {r['first_update']:.0%} to "
                 f"{r['last_update']:.0%} of the kernel sequence")
  if r["updates_from_gemm"]:
    lines.append(f"  kernels between a gradient's GEMM and its update: min "
                 f"{r['gap_min']}, median {r['gap_median']:g}, max "
                 f"{r['gap_max']}")
    lines.append(f"  most gradients alive at once: {r['peak_live']} "
                 f"({_size(r['peak_live_bytes'])} together); most gradient "
                 f"bytes alive at once: {_size(r['max_live_bytes'])}")
  if r["updates_from_loop"]:
    lines.append(f"  {r['updates_from_loop']} read the output of a loop or "
                 "call (a gradient formed inside it: not analysed)")
  if r["updates_custom_call"]:
    lines.append(f"  {r['updates_custom_call']} are custom calls that read "
                 "no GEMM output (e.g. FORGE's fused kernel, which forms "
                 "the gradient in registers: it is never stored)")
  rest = (r["updates"] - r["updates_from_gemm"] - r["updates_from_loop"]
          - r["updates_custom_call"])
  if rest > 0:
    lines.append(f"  {rest} read neither a GEMM's nor a loop's output (a "
                 "gradient formed otherwise, e.g. an embedding's scatter)")
  return "\n".join(lines)


def _bytes_arg(s: str) -> int:
  try:
    v = int(s)
  except ValueError:
    v = -1
  if v < 1:
    raise argparse.ArgumentTypeError(f"{s!r} is not a byte count >= 1")
  return v


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("hlo", nargs="+", help="compiled.as_text() dumps (.gz ok)")
  p.add_argument("--min-copy-bytes", type=_bytes_arg, default=2**20,
                 help="list the copies of arrays this large or larger "
                 "inside while-loop bodies (they run every iteration)")
  args = p.parse_args(argv)
  rc = 0
  for path in args.hlo:
    try:
      text = _read(path)
      r = analyse(text)
    except (ValueError, OSError, EOFError, zlib.error) as e:
      # not an HLO dump; unreadable; a truncated or corrupt .gz
      print(f"{path}: {e}", file=sys.stderr)
      rc = 1
      continue
    print(report(path, r))
    for body, big in loop_copies(text, args.min_copy_bytes):
      shapes = ", ".join(t.split("{")[0] for _, t in big)
      print(f"  loop body %{body}: {len(big)} copies of arrays >= "
            f"{_size(args.min_copy_bytes)} every iteration ({shapes})")
  return rc


if __name__ == "__main__":
  sys.exit(main())
