"""Plots a kernel-benchmark CSV: step time per shape, XLA unfused vs FORGE
(and torch's cuBLAS + fused AdamW vs FORGE through forge_torch, where the CSV
has those arms).

    ./dev.sh python -m benchmarks.plot out/bench/kernel.csv out/bench/kernel.png
"""

import argparse
import os
import re
import sys


import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks import common, paths

PROVIDERS = ["xla_unfused", "xla_gemm", "xla_adamw", "forge_mainloop", "forge",
             "torch", "forge_torch"]
TORCH_ARMS = ("torch", "forge_torch")  # hatched: the torch-side arms


def _bt(shape: str) -> int:
  m = re.match(r"BT=(\d+)", shape)
  return int(m.group(1)) if m else 0


def plot(src: str, dst: str) -> int:
  """Writes the plot of kernel CSV ``src`` to ``dst``; 1 if it has no
  kernel time rows (nothing written)."""
  rows = [r for r in common.read_rows(src)
          if r.get("metric") == "time" and r.get("provider") in PROVIDERS]
  if not rows:
    print(f"plot.py: {src} has no kernel time rows ({', '.join(PROVIDERS)});"
          " nothing plotted", file=sys.stderr)
    return 1
  # Only the arms the CSV has (older CSVs: no torch arms; the torch arms have
  # no rows for fp32 moments, whose bars are then left empty).
  providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
  cases = sorted({(r["dtypes"], r["shape"]) for r in rows},
                 key=lambda c: (c[0], _bt(c[1]), c[1]))
  fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(cases)), 5))
  width = 0.8 / max(1, len(providers))
  for i, prov in enumerate(providers):
    vals = []
    for dt, shape in cases:
      v = [float(r["p50"]) for r in rows if (r["dtypes"], r["shape"],
                                            r["provider"]) == (dt, shape, prov)]
      vals.append(v[-1] if v else 0.0)
    ax.bar([j + i * width for j in range(len(cases))], vals, width, label=prov,
           hatch="//" if prov in TORCH_ARMS else None)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
  short = lambda d: d.replace("bfloat16", "bf16").replace("float32", "f32")
  ax.set_xticklabels([f"{s.replace(' ', chr(10))}\n{short(d)}"
                      for d, s in cases], fontsize=7)
  ax.set_ylabel("median step time (µs)")
  device = rows[0]["device"] if rows else "?"
  ax.set_title(f"One layer's weight-gradient + AdamW step ({device})")
  ax.legend(fontsize=8)
  common.save_figure(fig, dst)
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("csv", help="a benchmarks/kernel.py CSV")
  p.add_argument("png", type=paths.out_file, help="where to write the plot")
  args = p.parse_args(argv)
  if not os.path.exists(args.csv):
    p.error(f"no CSV at {args.csv}")
  return plot(args.csv, args.png)


if __name__ == "__main__":
  sys.exit(main())
