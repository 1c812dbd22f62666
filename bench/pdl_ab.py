"""Programmatic dependent launch on and off: tessera's model time with each setting.

    TESSERA_PDL=1 python3 bench/pdl_ab.py resnet50,bert,gpt2
    TESSERA_PDL=0 python3 bench/pdl_ab.py resnet50,bert,gpt2

One process per setting (the runtime reads $TESSERA_PDL once), the same tuning cache, the
models suite's models and inputs, and its timer (CUDA events, median of 50 after 10 warm-up
calls, no L2 flush).  Prints one JSON line: model -> [microseconds, relative error against
the fp16 eager model].  A diagnostic of one launch option, not a suite.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import models_suite as suite
    import torch
    from harness import Timer

    import tessera.frontend.torch  # noqa: F401  (registers the backend)

    results = {}
    for name in sys.argv[1].split(","):
        model, inputs = suite.build(suite.MODELS[name])
        torch._dynamo.reset()
        with torch.no_grad():
            fn = torch.compile(model, backend="tessera")
            ref, got = model(*inputs).float(), fn(*inputs).float()
            timer = Timer(repeats=50, warmup=10, flush_l2=False)
            results[name] = [timer(fn, *inputs), float((got - ref).norm() / ref.norm())]
    print(os.environ.get("TESSERA_PDL", "1"), json.dumps(results))


if __name__ == "__main__":
    main()
