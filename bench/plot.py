"""Plots of benchmark results: one PNG per suite file, next to its markdown table.

    python3 bench/plot.py bench/results/2026-11-22-h200-models.jsonl [more.jsonl ...]

For each case (one row of the JSONL, bench/PROTOCOL.md's results format) the plot shows tessera's
speed relative to each peer, peer time / tessera time, so bars right of the line at 1 are
cases tessera wins; where a row has `floor_us` (the memory-bound floor of the lowbit suite),
its bar is floor time / tessera time, the fraction of the floor reached.  The suites call
`plot_file` after writing their tables; without matplotlib (the `plots` extra) they skip the
plot and say so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

FLOOR = "floor (memory bound)"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def ratios(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, list[float]]]:
    """(cases, {peer: peer_us / tessera_us per case}); NaN where a case lacks that peer or a
    time.  A row's `floor_us` appears as the series FLOOR."""
    cases = [str(r.get("case", f"row {i}")) for i, r in enumerate(rows)]
    peers = sorted({p for r in rows for p in (r.get("peers_us") or {})})
    series: dict[str, list[float]] = {p: [] for p in peers}
    if any(_number(r.get("floor_us")) for r in rows):
        series[FLOOR] = []
    for r in rows:
        ours = _number(r.get("tessera_us"))
        for p in peers:
            theirs = _number((r.get("peers_us") or {}).get(p))
            series[p].append(theirs / ours if ours and theirs else math.nan)
        if FLOOR in series:
            floor = _number(r.get("floor_us"))
            series[FLOOR].append(floor / ours if ours and floor else math.nan)
    return cases, series


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) and x > 0 else None


def plot_file(jsonl: Path, png: Path | None = None) -> Path | None:
    """Write the plot of `jsonl` (default: the same name with .png); None, with a note on
    stderr, when matplotlib is missing or no row has a time to compare."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: no plot for {jsonl}: matplotlib is not installed (pip install 'tessera[plots]')", file=sys.stderr)
        return None
    rows = read_jsonl(jsonl)
    cases, series = ratios(rows)
    series = {name: values for name, values in series.items() if any(not math.isnan(v) for v in values)}
    if not series:
        print(f"note: no plot for {jsonl}: no case has both a tessera time and a peer time", file=sys.stderr)
        return None
    png = Path(png) if png is not None else Path(jsonl).with_suffix(".png")
    height = 0.28 * len(series) * len(cases) + 1.6
    fig, ax = plt.subplots(figsize=(9, min(max(height, 3.0), 60)))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        ys = [i + (k - (len(series) - 1) / 2) * width for i in range(len(cases))]
        shown = [0 if math.isnan(v) else v for v in values]
        bars = ax.barh(ys, shown, height=width, label=name, hatch="//" if name == FLOOR else None)
        for bar, v in zip(bars, values):
            if not math.isnan(v):
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.2f}", va="center", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(cases, fontsize=8)
    ax.invert_yaxis()
    label = "peer time / tessera time (> 1: tessera faster)"
    ax.set_xlabel(label + ("; floor: floor time / tessera time" if FLOOR in series else ""))
    first = rows[0] if rows else {}
    ax.set_title(f"{first.get('suite', Path(jsonl).stem)}: {first.get('gpu', '?')}, {first.get('date', '?')}, "
                 f"commit {str(first.get('commit', '?'))[:12]}", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="result files (.jsonl)")
    args = parser.parse_args(argv)
    status = 0
    for f in args.files:
        if not f.is_file():
            print(f"{f}: no such file", file=sys.stderr)
            status = 1
            continue
        out = plot_file(f)
        print(f"{f} -> {out}" if out else f"{f}: no plot")
    return status


if __name__ == "__main__":
    sys.exit(main())
