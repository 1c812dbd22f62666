"""The `cpu` suite's cases with every system alone in its own process.

    OMP_NUM_THREADS=2 TESSERA_COMMIT=<sha> python3 bench/cpu_isolated.py [--cases resnet18,mlp,bert,gpt2,gemm]

Why: `bench/cpu_suite.py` times the systems round-robin in one process.  There tessera's
kernels (gcc's libgomp) and torch's (the libgomp torch ships) keep two OpenMP thread pools
whose workers spin after each parallel region, so on 2 cores each system's call runs beside
the other pool's spinning workers: at 87b0380 torch eager's ResNet-18 took 44.6 ms in the
suite and 25.9 ms alone, torch.matmul 1024^3 31.8 ms against 13.6 ms.  Here each (case,
system) pair runs in a fresh process: warm-up calls, then the median wall time of 30 calls
(tessera compiled with tuning; torch.compile's default mode; GEMMs as the suite calls them).
Writes `<date>-cpu-cpu-isolated.md` under bench/results (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = ("resnet18", "mlp", "bert", "gpt2")
GEMMS = ((1024, 1024, 1024), (4096, 4096, 1024), (16, 4096, 4096))
MODEL_SYSTEMS = ("tessera", "torch.eager", "torch.compile:default")
GEMM_SYSTEMS = ("tessera", "torch.matmul")


def _measure(case: str, system: str, calls: int) -> float:
    """Median ms of `calls` calls of one system on one case, in this process."""
    import numpy as np
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if case.startswith("gemm:"):
        m, n, k = (int(v) for v in case[5:].split("x"))
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        if system == "tessera":
            from tessera.templates.cpu.gemm import plan_cpu_matmul

            kernel, out = plan_cpu_matmul((m, k), (k, n), tune=True).load(), np.empty((m, n), np.float32)
            fn = functools.partial(kernel, [a, b], out)
        else:
            fn = functools.partial(torch.matmul, torch.from_numpy(a), torch.from_numpy(b))
    else:
        from cpu_suite import build_model

        model, inputs = build_model(case)
        if system == "tessera":
            from tessera.frontend.torch.backend import backend

            compiled = torch.compile(model, backend=functools.partial(backend, tune=True))
        elif system == "torch.compile:default":
            compiled = torch.compile(model)
        else:
            compiled = model
        fn = functools.partial(compiled, *inputs)
    times = []
    with torch.no_grad():
        for _ in range(5):
            fn()
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="resnet18,mlp,bert,gpt2,gemm")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(f"{_measure(args.child[0], args.child[1], args.calls):.4f}")
        return
    from harness import current_commit

    wanted = args.cases.split(",")
    cases = [(m, MODEL_SYSTEMS) for m in MODELS if m in wanted]
    cases += [(f"gemm:{m}x{n}x{k}", GEMM_SYSTEMS) for m, n, k in GEMMS if "gemm" in wanted]
    rows = []
    for case, systems in cases:
        ms = {}
        for system in systems:
            out = subprocess.run([sys.executable, __file__, "--child", case, system, "--calls", str(args.calls)],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            ms[system] = float(out.stdout.strip().splitlines()[-1])
        best = min(v for s, v in ms.items() if s != "tessera")
        rows.append((case, ms, best / ms["tessera"]))
        print(case, ms, f"x{best / ms['tessera']:.2f}", flush=True)
    load = os.getloadavg()
    lines = [f"# cpu, each system alone in its process — {os.cpu_count()} CPUs, {datetime.date.today()}, "
             f"{os.environ.get('OMP_NUM_THREADS', '2')} threads, commit {current_commit()}", "",
             f"Median wall time of {args.calls} calls after 5 warm-up calls, one fresh process per (case, system) "
             f"(`bench/cpu_isolated.py`); x = best torch / tessera.  Load average when written: "
             f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.", "",
             "| case | tessera (ms) | peers (ms) | x best torch |", "|---|---|---|---|"]  # fmt: skip
    for case, ms, x in rows:
        peers = ", ".join(f"{s} {v:.2f}" for s, v in ms.items() if s != "tessera")
        lines.append(f"| {case} | {ms['tessera']:.2f} | {peers} | {x:.2f} |")
    out_dir = Path(args.out or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{datetime.date.today()}-cpu-cpu-isolated-{current_commit()[:7]}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    with stem.with_suffix(".jsonl").open("w") as f:
        for case, ms, x in rows:
            f.write(json.dumps({"suite": "cpu-isolated", "case": case, "tessera_ms": ms["tessera"],
                                "peers_ms": {s: v for s, v in ms.items() if s != "tessera"}, "vs_best_torch": x,
                                "calls": args.calls, "threads": int(os.environ.get("OMP_NUM_THREADS", "2")),
                                "commit": current_commit(), "load": load}) + "\n")  # fmt: skip
    print(stem.with_suffix(".md"))


if __name__ == "__main__":
    main()
