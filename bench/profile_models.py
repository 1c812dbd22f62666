"""Where compiled models spend GPU time: per-kernel totals of tessera's compiled models.

    python bench/profile_models.py --models bert,gpt2

Compiles each model with torch.compile(backend="tessera", options={"cuda_graph": False}),
runs it under torch.profiler and prints GPU kernel time grouped by kernel name, plus the
model time with CUDA-graph replay for comparison.  A diagnostic, not a benchmark: the
models suite measures.  (Timing steps with events around each launch would measure the
host's launch cost instead: the GPU idles while Python launches.)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _family(name: str) -> str:
    """Kernel names without their group/instance numbers (g12_0_layer_norm -> layer_norm)."""
    return re.sub(r"^(g|a)\d+_\d+_", "", name)[:90]


def main() -> None:
    import models_suite as suite
    import torch
    from torch.profiler import ProfilerActivity, profile

    import tessera.frontend.torch  # noqa: F401

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--explain", default="", help="folder: write each model's tessera.explain report there")
    args = parser.parse_args()
    for name in args.models.split(","):
        model, inputs = suite.build(suite.MODELS[name])
        torch._dynamo.reset()
        with torch.no_grad():
            fn = torch.compile(model, backend="tessera", options={"cuda_graph": False})
            for _ in range(3):
                fn(*inputs)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn(*inputs)
                torch.cuda.synchronize()
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type.name == "CUDA":
                t = totals[_family(e.name)]
                t[0] += e.device_time / 5
                t[1] += 1 / 5
        total = sum(v[0] for v in totals.values())
        print(f"== {name}: {total / 1e3:.3f} ms of GPU kernel time per call (no CUDA graph)")
        for k, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {us / 1e3:8.3f} ms {100 * us / total:5.1f}%  x{n:4.0f}  {k}")
        if args.explain:
            import tessera

            Path(args.explain, f"{name}.txt").write_text(str(tessera.explain(fn)))


if __name__ == "__main__":
    main()
