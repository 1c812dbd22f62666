"""Where compiled models spend their time: per-step GPU times of tessera's compiled graphs.

    python bench/profile_models.py --models bert,gpt2

Compiles each model with torch.compile(backend="tessera"), then times every step of every
compiled segment with CUDA events (eager, not in a CUDA graph) and prints the totals by step
kind and the slowest steps.  A diagnostic, not a benchmark: the models suite measures.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import models_suite as suite
    import torch

    import tessera.frontend.torch  # noqa: F401

    tb = sys.modules["tessera.frontend.torch.backend"]  # the module (the package exports a function of that name)

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    compiled_graphs: list = []
    original = tb.compile_graph

    def spy(*a, **k):
        cg = original(*a, **k)
        compiled_graphs.append(cg)
        return cg

    tb.compile_graph = spy
    for name in args.models.split(","):
        compiled_graphs.clear()
        model, inputs = suite.build(suite.MODELS[name])
        torch._dynamo.reset()
        with torch.no_grad():
            fn = torch.compile(model, backend="tessera")
            fn(*inputs)
            total = defaultdict(float)
            rows = []
            seen = 0
            for cg in compiled_graphs:
                last = next(reversed(cg._plans.values()), None)
                if last is None or last.static_inputs is None:
                    continue
                for step, us in cg.profile(*last.static_inputs):
                    total[step.split(":")[0]] += us
                    rows.append((us, step))
                seen += 1
        print(f"== {name}: {seen} compiled segment(s), {sum(total.values()) / 1e3:.3f} ms in steps")
        for kind, us in sorted(total.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:10s} {us / 1e3:8.3f} ms")
        by_name = defaultdict(lambda: [0.0, 0])
        for us, step in rows:
            by_name[step][0] += us
            by_name[step][1] += 1
        for step, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {us / 1e3:8.3f} ms  x{n:3d}  {step[:110]}")


if __name__ == "__main__":
    main()
