"""Where tessera's compiled models spend their time, on the GPU (per kernel) or on the host.

    python3 bench/profile_models.py --models bert,gpt2 [--top 14] [--explain DIR]
    python3 bench/profile_models.py --models bert,gpt2 --host

Models come from bench/models_suite.py.  By default each is compiled with
torch.compile(backend="tessera", options={"cuda_graph": False}), run under torch.profiler, and
its GPU kernel time printed grouped by kernel name.  (Timing steps with events around each
launch would measure the host's launch cost instead: the GPU idles while Python launches.)

`--host`: the host cost of a call as users compile it (torch.compile(backend="tessera")):
wall time per call over 50 calls and a cProfile of 20 calls, sorted by own time -- the Python
side (guards, segment bookkeeping, graph replay).

A diagnostic, not a benchmark: the models suite measures.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _family(name: str) -> str:
    """Kernel names without their group/instance numbers (g12_0_layer_norm -> layer_norm)."""
    return re.sub(r"^(g|a)\d+_\d+_", "", name)[:90]


def host_profile(name: str, model, inputs: tuple, top: int) -> None:
    """Host wall time per call (50 calls) and a cProfile of 20 calls of the compiled model."""
    import torch

    torch._dynamo.reset()
    with torch.no_grad():
        fn = torch.compile(model, backend="tessera")
        for _ in range(5):
            fn(*inputs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn(*inputs)
        torch.cuda.synchronize()
        print(f"{name}: {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms per call (host wall, 50 calls)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            fn(*inputs)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    import models_suite as suite
    import torch
    from torch.profiler import ProfilerActivity, profile

    import tessera.frontend.torch  # noqa: F401

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--explain", default="", help="folder: write each model's tessera.explain report there")
    parser.add_argument("--host", action="store_true", help="host wall time and a cProfile per model instead")
    args = parser.parse_args()
    for name in args.models.split(","):
        model, inputs = suite.build(suite.MODELS[name])
        if args.host:
            host_profile(name, model, inputs, args.top)
            continue
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
