"""One row per profiled kernel from an Nsight Compute ``--csv`` log.

    python -m benchmarks.ncu_summary ncu.csv --kernels fused_wgrad_adamw \\
        --labels 64x128x32,g1,w4,s4,e 64x64x32,g1,w4,s4,e --out summary.csv

``ncu --csv --log-file ncu.csv --metrics A,B,... CMD`` writes one line per
(kernel launch, metric), after its own log lines. This keeps the launches
whose kernel name contains one of ``--kernels`` (all launches if none is
given), in launch order, as rows of ``kernel, label, block, grid, device,
cc`` and one column per metric; ``--labels`` names the kept launches in
order (their number must match). ``device`` is ``cuda:<index>`` (ncu's CSV
holds only the device's index), after the name given by ``--device`` when
there is one (``"NVIDIA H200 (cuda:0)"``); ``cc`` its compute capability,
from the log. ``python -m benchmarks.epilogue_probe --once`` runs each
kernel once for such a profile (its docstring gives the command).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys

from benchmarks import paths


def read_launches(path: str, kernels=()) -> list[dict]:
  """``[{"id", "kernel", "block", "grid", "device", "cc",
  "metrics": {name: value}}]`` (``device``: ncu's device index; it and
  ``cc`` are empty in a log without those columns)."""
  text = open(path).read()
  start = text.find('"ID",')
  if start < 0:
    raise ValueError(f"{path}: no ncu CSV header (\"ID\",...) found")
  launches: dict[str, dict] = {}
  for r in csv.DictReader(io.StringIO(text[start:])):
    if kernels and not any(k in r["Kernel Name"] for k in kernels):
      continue
    row = launches.setdefault(r["ID"], {
        "id": int(r["ID"]), "kernel": r["Kernel Name"],
        "block": r["Block Size"], "grid": r["Grid Size"],
        "device": r.get("Device") or "", "cc": r.get("CC") or "",
        "metrics": {}})
    row["metrics"][r["Metric Name"]] = r["Metric Value"].replace(",", "")
  return sorted(launches.values(), key=lambda r: r["id"])


def write_summary(launches, out, labels=None, device=None) -> None:
  """``device``: the profiled GPU's name, written before each row's
  ``cuda:<ncu's device index>``."""
  if labels is not None and len(labels) != len(launches):
    raise ValueError(f"{len(labels)} labels for {len(launches)} kept launches")
  metrics = sorted({m for r in launches for m in r["metrics"]})
  w = csv.writer(out)
  w.writerow(["kernel", "label", "block", "grid", "device", "cc"] + metrics)
  for i, r in enumerate(launches):
    index = f"cuda:{r['device']}" if r.get("device") else ""
    dev = f"{device} ({index})" if device and index else device or index
    w.writerow([r["kernel"], labels[i] if labels else "", r["block"],
                r["grid"], dev, r.get("cc", "")]
               + [r["metrics"].get(m, "") for m in metrics])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("log", help="the file ncu --csv --log-file wrote")
  p.add_argument("--kernels", nargs="*", default=[],
                 help="keep launches whose kernel name contains one of these")
  p.add_argument("--labels", nargs="*", default=None,
                 help="a name for each kept launch, in launch order")
  p.add_argument("--device", default=None,
                 help="the profiled GPU's name, written before the device "
                 "column's cuda:<index> (ncu's CSV has only the index)")
  p.add_argument("--out", type=paths.out_file_or_stdout,
                 default="-", help="CSV path (default: stdout)")
  args = p.parse_args(argv)
  try:
    launches = read_launches(args.log, args.kernels)
  except (OSError, ValueError, KeyError) as e:
    print(f"ncu_summary: cannot read {args.log}: {e}", file=sys.stderr)
    return 1
  if not launches:
    print(f"{args.log}: no launch matched {args.kernels}", file=sys.stderr)
    return 1
  if args.labels is not None and len(args.labels) != len(launches):
    # Before --out is opened: an existing summary is left as it was.
    print(f"ncu_summary: {len(args.labels)} labels for {len(launches)} kept "
          "launches", file=sys.stderr)
    return 1
  if args.out == "-":
    write_summary(launches, sys.stdout, args.labels, args.device)
  else:
    with open(args.out, "w", newline="") as f:
      write_summary(launches, f, args.labels, args.device)
    print(f"wrote {args.out}: {len(launches)} launches")
  return 0


if __name__ == "__main__":
  sys.exit(main())
