"""Host cost of a compiled model call: wall time per call and a cProfile of 20 calls.

    python bench/host_profile.py bert,gpt2

Models come from bench/models_suite.py, compiled with torch.compile(backend="tessera").  A
diagnostic for the Python side (guards, segment bookkeeping, graph replay), not a benchmark.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(names: str) -> None:
    import models_suite as suite
    import torch

    import tessera.frontend.torch  # noqa: F401  (registers backend="tessera")

    for name in names.split(","):
        model, inputs = suite.build(suite.MODELS[name])
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
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bert")
