"""The `cpu` suite: tessera's CPU backend against torch on the CPU, float32, side by side in one process.

    python3 bench/run.py --suite cpu [--cases gemm,resnet18,mlp,bert,gpt2] [--rounds 30] [--threads 2] [--out DIR]
                                 [--clock cpu]   (CPU time instead of wall time: a diagnostic for a loaded machine)
    python3 bench/cpu_suite.py ...               (the same without run.py)

Models (random weights, eval, torch.no_grad): a hand-written ResNet-18 at batch 1, 224x224
(tessera.examples.models.ResNet18; torchvision has no CPU build here); the MLP
1024-4096-4096-1024 at batch 16; a BERT-base encoder layer at seq 128 (hand-written, so it is
compiled by tessera rather than handed to torch's fused fast path); GPT-2 small at seq 128
(transformers GPT2LMHeadModel(GPT2Config()), logits).  Each runs under torch eager,
torch.compile (inductor, `torch.compile:default`) and `torch.compile(model, backend="tessera")`.
GEMM alone (1024^3, 4096x4096x1024, 16x4096x4096): tessera's CPU GEMM (B an ordinary input,
packed per call) against torch.matmul (oneDNN/MKL) and numpy's BLAS.

Timing protocol for a shared, noisy CPU: every system gets the same inputs and warm-up; the
systems are *interleaved*, one call each per round, for `--rounds` rounds, so a burst of load
from other processes hits all of them alike; each reports the median, and `noise` is the
spread (p75 - p25) / median of the system's own rounds.  torch runs with `--threads` threads
(torch.set_num_threads) and tessera's OpenMP kernels with as many (OMP_NUM_THREADS).
Correctness in the same run: rel_err against a float64 eager copy on the same inputs.

Results: <out>/<date>-cpu-cpu.jsonl (bench/PROTOCOL.md's format; "gpu" names the CPU) and a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))  # harness

CASES = ("gemm", "resnet18", "mlp", "bert", "gpt2")


def cpu_name() -> str:
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from tessera.backend.isa import cpu_isa

    return f"{model} ({os.cpu_count()} CPUs, {cpu_isa()})"


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter  # set by main's --clock


def interleaved(systems: dict[str, Callable[[], Any]], rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Per system, the times (ms) of `rounds` calls made round-robin with the others."""
    for fn in systems.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(rounds):
        for name, fn in systems.items():
            t0 = _clock()
            fn()
            times[name].append((_clock() - t0) * 1e3)
    return times


def _stats(ts: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(ts, n=4) if len(ts) >= 4 else [min(ts), statistics.median(ts), max(ts)]
    med = statistics.median(ts)
    return med, (q[2] - q[0]) / med


def rel_err(out: Any, ref: Any) -> float:
    import torch

    out, ref = torch.as_tensor(out).double(), torch.as_tensor(ref).double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# ---- GEMM --------------------------------------------------------------------------------------------------------
def gemm_cases(rounds: int, tune: bool) -> list[dict]:
    import numpy as np
    import torch

    from tessera.templates.cpu.gemm import plan_cpu_matmul

    rows = []
    for m, n, k in [(1024, 1024, 1024), (4096, 4096, 1024), (16, 4096, 4096)]:
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        t0 = time.perf_counter()
        kernel = plan_cpu_matmul((m, k), (k, n), tune=tune).load()
        compile_s = time.perf_counter() - t0
        out = np.empty((m, n), np.float32)
        systems = {"tessera": lambda k=kernel, a=a, b=b, o=out: k([a, b], o),
                   "torch.matmul": lambda ta=ta, tb=tb: torch.matmul(ta, tb), "numpy-blas": lambda a=a, b=b: a @ b}  # fmt: skip
        times = interleaved(systems, rounds)
        kernel([a, b], out)
        err = rel_err(out, ta.double() @ tb.double())
        rows.append(_row(f"M={m},N={n},K={k},fp32", times, err, compile_s,
                         {"gflops": 2 * m * n * k / (statistics.median(times["tessera"]) * 1e6),
                          "config": str(kernel.config)}))  # fmt: skip
    return rows


# ---- models ------------------------------------------------------------------------------------------------------
def build_model(name: str) -> tuple[Any, tuple]:
    import torch

    from tessera.examples import models as M

    torch.manual_seed(0)
    if name == "resnet18":
        # torchvision's widths (64..512) and 1000 classes: the ResNet-18 of the table, 1.8 GFLOP
        return M.randomize_batchnorm(M.ResNet18(width=64, classes=1000)).eval(), (torch.randn(1, 3, 224, 224),)
    if name == "mlp":
        mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                  torch.nn.ReLU(), torch.nn.Linear(4096, 1024))  # fmt: skip
        return mlp.eval(), (torch.randn(16, 1024),)
    if name == "bert":
        layer = M.BertLayer(vocab=30522, hidden=768, heads=12, ffn=3072, max_len=512).eval()
        return layer, (torch.randint(0, 30522, (1, 128)), torch.ones(1, 128))
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config()
        cfg.use_cache = False
        model = GPT2LMHeadModel(cfg).eval()

        class Logits(torch.nn.Module):  # one tensor out
            def __init__(self, inner: Any):
                super().__init__()
                self.inner = inner

            def forward(self, ids: Any) -> Any:
                return self.inner(input_ids=ids, use_cache=False).logits

        return Logits(model).eval(), (torch.randint(0, cfg.vocab_size, (1, 128)),)
    raise ValueError(f"unknown model {name!r}; known: {CASES[1:]}")


def model_case(name: str, rounds: int, tune: bool) -> dict:
    import torch

    model, inputs = build_model(name)
    reference = copy.deepcopy(model).double()
    ref_inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    with torch.no_grad():
        expected = reference(*ref_inputs)
        torch._dynamo.reset()
        inductor = torch.compile(model)
        inductor(*inputs)
        torch._dynamo.reset()
        # The backend function with tune bound (torch.compile hands options={...} over as ONE keyword
        # argument named `options`, which the tessera backend does not unpack).
        from tessera.frontend.torch.backend import backend as tessera_backend

        tessera = torch.compile(model, backend=functools.partial(tessera_backend, tune=tune))
        t0 = time.perf_counter()
        got = tessera(*inputs)
        compile_s = time.perf_counter() - t0
        err = rel_err(got, expected)
        systems = {"tessera": lambda: tessera(*inputs), "torch.eager": lambda: model(*inputs),
                   "torch.compile:default": lambda: inductor(*inputs)}  # fmt: skip
        times = interleaved(systems, rounds)
    case = {"resnet18": "model=resnet18,bs=1,224,fp32", "mlp": "model=mlp-1024-4096-4096-1024,bs=16,fp32",
            "bert": "model=bert-base-layer,seq=128,fp32", "gpt2": "model=gpt2,seq=128,fp32"}[name]  # fmt: skip
    return _row(case, times, err, compile_s, {})


def _row(case: str, times: dict[str, list[float]], err: float, compile_s: float, extra: dict) -> dict:
    med = {k: _stats(v) for k, v in times.items()}
    peers = {k: m * 1e3 for k, (m, _) in med.items() if k != "tessera"}
    best = min(v for k, v in peers.items() if k.startswith("torch"))  # numpy is a reference, not the bar
    row = {"case": case, "tessera_us": med["tessera"][0] * 1e3, "peers_us": peers, "rel_err": err,
           "vs_best_torch": best / (med["tessera"][0] * 1e3), "compile_s": compile_s,
           "noise": {k: round(n, 3) for k, (_, n) in med.items()}, "rounds": len(times["tessera"]), **extra}  # fmt: skip
    print(f"{case:<42} tessera {row['tessera_us'] / 1e3:9.2f} ms  "
          + "  ".join(f"{k} {v / 1e3:9.2f}" for k, v in peers.items())
          + f"  x{row['vs_best_torch']:.2f}  err {err:.1e}  noise {row['noise']}", flush=True)  # fmt: skip
    return row


# ---- results -----------------------------------------------------------------------------------------------------
def write(rows: list[dict], outdirs: list[Path], threads: int, errors: dict[str, str], clock: str = "wall") -> None:
    import torch
    from harness import current_commit

    commit = current_commit()
    env = {"gpu": cpu_name(), "date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
           "threads": threads, "load_avg_1m": os.getloadavg()[0], "clock": clock}  # fmt: skip
    stem = f"{env['date']}-cpu-cpu" + ("" if clock == "wall" else f"-{clock}time")
    lines = [json.dumps({"suite": "cpu", **r, **env}) for r in rows]
    peers = sorted({p for r in rows for p in r["peers_us"]})
    head = (f"# cpu — {env['gpu']}, {env['date']}, torch {env['torch']}, {threads} threads, commit {commit[:12]}\n\n"
            f"Medians of interleaved rounds (ms, {'wall' if clock == 'wall' else 'process CPU'} time); noise = (p75 - p25) / median per system; x = best torch / tessera.\n"
            f"Load average when written: {env['load_avg_1m']:.1f} on {os.cpu_count()} CPUs (other processes share them).\n\n")  # fmt: skip
    cols = ["case", "tessera", *peers, "x best torch", "compile s", "noise (tessera)", "rel_err"]
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["case"], f"{r['tessera_us'] / 1e3:.2f}", *[f"{r['peers_us'].get(p, float('nan')) / 1e3:.2f}" for p in peers],
                 f"{r['vs_best_torch']:.2f}", f"{r['compile_s']:.1f}", f"{r['noise']['tessera']:.2f}", f"{r['rel_err']:.1e}"]  # fmt: skip
        table.append("| " + " | ".join(cells) + " |")
    if errors:
        table += ["", "Cases that failed in this run:", *[f"- {c}: `{e}`" for c, e in errors.items()]]
    for d in outdirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{stem}.jsonl").write_text("\n".join(lines) + "\n")
        (d / f"{stem}.md").write_text(head + "\n".join(table) + "\n")
    print(head + "\n".join(table))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-tune", action="store_true",
                    help="use the GEMM cost model instead of timing the register tiles once per shape (cached)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                    help="wall time (the benchmark), or the process's CPU time: with --threads 1 the work itself, "
                         "which other processes on a loaded machine inflate far less (a diagnostic)")  # fmt: skip
    args = ap.parse_args(argv)
    global _clock
    _clock = CLOCK[args.clock]
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before tessera's first kernel loads libgomp
    import torch

    torch.set_num_threads(args.threads)
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} threads, load average {os.getloadavg()}")
    rows: list[dict] = []
    errors: dict[str, str] = {}
    tune = not args.no_tune
    for c in cases:
        try:
            rows += gemm_cases(args.rounds, tune) if c == "gemm" else [model_case(c, args.rounds, tune)]
        except Exception as exc:  # noqa: BLE001  (one failing case must not lose the others)
            print(f"{c}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            errors[c] = f"{type(exc).__name__}: {str(exc)[:300]}"
    outdirs = [BENCH / "results"] + ([Path(args.out)] if args.out else [])
    write(rows, outdirs, args.threads, errors, args.clock)


if __name__ == "__main__":
    main()
