"""Where a CPU-compiled model spends its time: per step of tessera's compiled graphs.

    OMP_NUM_THREADS=2 python3 bench/cpu_profile.py gpt2 [--rounds 10] [--top 25]
    python3 bench/cpu_profile.py demo            (the tiny GPT-2 of `python3 -m tessera demo`)

Models come from bench/cpu_suite.py (gpt2, bert, resnet18, mlp) or the demo; each is compiled
with torch.compile(backend="tessera"), timed per call against torch eager, then run with
`CompiledGraph.profile_steps` on: every step's wall time, grouped by what it computes (kernel
kind, operators, shapes), with the work it does (GFLOP/s of GEMM anchors, GB/s of fused
steps' inputs and outputs).  The gap between the whole call and the sum of the steps is host
overhead (guards, argument checks, output allocation).  A diagnostic, not a benchmark.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _median_ms(fn: Any, rounds: int, clock: Any = time.perf_counter) -> float:
    times = []
    for _ in range(rounds):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return statistics.median(times)


def _label(step: Any, shapes: dict) -> tuple[str, float, float]:
    """(what the step computes, its flops, the bytes of its inputs and outputs)."""
    import numpy as np

    nbytes = sum(int(np.prod(shapes.get(t, ()) or (1,))) * t.dtype.nbytes for t in [*step.inputs, *step.outputs])
    if step.kind == "anchor":
        op = step.anchor
        ins = [shapes.get(t) for t in op.inputs]
        out = shapes.get(op.outputs[0], shapes.get(step.outputs[0]) if step.outputs else None)  # fused: the step's
        flops = 0.0
        if op.kind == "linear":
            flops = 2.0 * float(np.prod(ins[0])) * ins[1][0]
        elif op.kind in ("matmul", "conv2d") and out is not None:
            k = ins[0][-1] if op.kind == "matmul" else int(np.prod(ins[1][1:]))
            flops = 2.0 * float(np.prod(out)) * k
        epi = "+".join(o.kind for o in step.group.epilogue)
        return f"anchor {op.kind}{'+' + epi if epi else ''} {ins}", flops, nbytes
    kinds = ",".join(o.kind for o in step.group.ops)
    return f"{step.kind} [{kinds[:70]}] out {[shapes.get(t) for t in step.outputs][:2]}", 0.0, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="gpt2, bert, resnet18, mlp (bench/cpu_suite.py) or demo")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true",
                    help="CPU time (time.process_time) instead of wall time: with --threads 1, the work itself, "
                         "which other processes on a loaded machine do not inflate")  # fmt: skip
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    import tessera.frontend.torch  # noqa: F401  (registers backend="tessera")
    from tessera.frontend.torch.report import compiled_graphs

    torch.set_num_threads(args.threads)
    if args.model == "demo":
        from tessera.examples.demo import _build

        model, x = _build("gpt2", "cpu")
        inputs: tuple = (x,)
    else:
        import cpu_suite

        model, inputs = cpu_suite.build_model(args.model)
    with torch.no_grad():
        compiled = torch.compile(model, backend="tessera")
        compiled(*inputs)
        compiled(*inputs)
        clock = time.process_time if args.cpu_time else time.perf_counter
        eager = _median_ms(lambda: model(*inputs), args.rounds, clock)
        whole = _median_ms(lambda: compiled(*inputs), args.rounds, clock)
        graphs = [s.executor for g in compiled_graphs() for s in g.steps if hasattr(s, "executor")]
        graphs = [g for g in graphs if hasattr(g, "profile_steps")]
        for g in graphs:
            g.profile_steps(clock=clock)
        for _ in range(args.rounds):
            compiled(*inputs)
    print(f"{args.model}: tessera {whole:.3f} ms per call, torch eager {eager:.3f} ms ({'CPU' if args.cpu_time else 'wall'} "
          f"time, medians of {args.rounds}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")  # fmt: skip
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0, 0.0])
    total = 0.0
    for g in graphs:
        plan = next(iter(g._plans.values()))
        for step, seconds in zip(g.steps, g.step_times):
            label, flops, nbytes = _label(step, plan.shapes)
            r = rows[label]
            r[0] += seconds * 1e3 / args.rounds
            r[1] += 1
            r[2] += flops
            r[3] += nbytes
            total += seconds * 1e3 / args.rounds
    steps = sum(len(g.steps) for g in graphs)
    print(f"steps: {steps} in {len(graphs)} graph(s), {total:.3f} ms per call in steps; "
          f"{whole - total:.3f} ms outside them (host overhead)")  # fmt: skip
    print(f"{'ms/call':>9} {'share':>6} {'n':>4} {'GFLOP/s':>8} {'GB/s':>7}  step")
    for label, (ms, n, flops, nbytes) in sorted(rows.items(), key=lambda kv: -kv[1][0])[: args.top]:
        per = ms / n * 1e-3
        gf = f"{flops / n / per * 1e-9:8.1f}" if flops else f"{'':8}"
        print(f"{ms:9.3f} {ms / total:6.1%} {n:4d} {gf} {nbytes / n / per * 1e-9:7.2f}  {label[:150]}")


if __name__ == "__main__":
    main()
