"""The GPU benchmark protocol of bench/PROTOCOL.md: side by side in one process, CUDA events, L2 flushed,
median of at least 50 repeats, correctness in the same run; results as JSONL + markdown."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from plot import plot_file

# The flush reads 1 GB: far above the H200's 60 MB L2, and ~250 us of GPU work, a head start
# that keeps each system's host-side dispatch (torch.compile's guards and wrapper, tessera's
# argument checks: tens of us) out of the timed region.  With a 256 MB flush (~65 us) the
# GPU sometimes idled between the start event and the launch, and that idle time was timed.
L2_FLUSH_BYTES = 1 << 30


class Timer:
    """Times callables with CUDA events; flushes L2 before each repeat by reading a large buffer.

    The flush reads (sums) a large buffer rather than writing one: a write flush leaves L2
    full of dirty lines, which the timed kernel then pays to write back to DRAM as its own
    reads evict them — a cost that falls hardest on read-mostly kernels (reductions) and is
    no part of their work (measured on the H200: fp16 row sum 8192 x 8192, 41.4 us after a
    write flush, 34.0 us after a read flush).  After a read flush L2 holds only clean,
    unrelated lines, the same for every system timed.  See L2_FLUSH_BYTES for its size.
    """

    def __init__(self, repeats: int = 50, warmup: int = 5, flush_l2: bool = True):
        self.repeats, self.warmup, self.flush_l2 = repeats, warmup, flush_l2
        self.scratch = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
        self._sink = torch.empty((), dtype=torch.float32, device="cuda")

    def flush(self) -> None:
        """Evict L2 by reading L2_FLUSH_BYTES (it writes one scalar)."""
        torch.sum(self.scratch, dim=0, out=self._sink)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> float:
        """Median time of fn(*args) in microseconds."""
        for _ in range(self.warmup):
            fn(*args)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        for s, e in zip(starts, ends):
            if self.flush_l2:
                self.flush()
            s.record()
            fn(*args)
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3

    def side_by_side(self, calls: dict[str, Callable[[], Any]]) -> dict[str, float]:
        """Median microseconds of each call, timed in interleaved rounds: every round times
        each call once (after its own flush), in forward order on even rounds and reverse on
        odd ones.  Drift in the card's clocks (power-limited GEMMs at ~500 us swing +-10%
        between back-to-back runs of the same kernel) then lands on every peer alike, which
        timing one peer's repeats after another's does not give."""
        names = list(calls)
        for name in names:
            for _ in range(self.warmup):
                calls[name]()
        torch.cuda.synchronize()
        events = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(self.repeats)] for n in names}  # fmt: skip
        for r in range(self.repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                start, end = events[name][r]
                if self.flush_l2:
                    self.flush()
                start.record()
                calls[name]()
                end.record()
            if r % 8 == 7:  # keep the queue short: the host never runs far ahead of the GPU
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return {n: statistics.median(s.elapsed_time(e) for s, e in events[n]) * 1e3 for n in names}


def copy_bandwidth_gbs(timer: Any, nbytes: int = 1 << 30, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth (bytes read + written) measured in this run."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timer(dst.copy_, src)
    return nbytes / (us * 1e-6) / 1e9


def current_commit() -> str:
    """The commit a benchmark measures: $TESSERA_COMMIT (a checkout without git history, or a
    named build), else this checkout's `git rev-parse HEAD`, else "unknown"."""
    commit = os.environ.get("TESSERA_COMMIT")
    if commit:
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict[str, Any]:
    commit = current_commit()
    return {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def write_results(suite: str, rows: list[dict[str, Any]], outdirs: list[Path], columns: list[str]) -> None:
    """Write <date>-h200-<suite>.jsonl and a markdown table into each of `outdirs`."""
    env = environment()
    gpu_tag = "h200" if "H200" in env["gpu"] else env["gpu"].lower().replace(" ", "-")
    stem = f"{env['date']}-{gpu_tag}-{suite}"
    lines = [json.dumps({"suite": suite, **r, **env}) for r in rows]
    header = f"# {suite} — {env['gpu']}, {env['date']}, torch {env['torch']}, CUDA {env['cuda']}, commit {env['commit'][:12]}\n\n"
    peer_names = sorted({p for r in rows for p in r["peers_us"]})
    cols = ["case", "tessera_us", *[f"{p} (us)" for p in peer_names], *columns, "rel_err"]
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["case"], f"{r['tessera_us']:.1f}"]
        cells += [f"{r['peers_us'].get(p, float('nan')):.1f}" for p in peer_names]
        cells += [f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in columns]
        cells.append(f"{r['rel_err']:.1e}")
        table.append("| " + " | ".join(cells) + " |")
    for d in outdirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{stem}.jsonl").write_text("\n".join(lines) + "\n")
        (d / f"{stem}.md").write_text(header + "\n".join(table) + "\n")
        plot_file(d / f"{stem}.jsonl")  # the PNG next to the table
    print(header + "\n".join(table))
