"""The main job: compile a real model with torch.compile(backend="tessera"), run it, and check
it against torch.

On a GPU the model runs in float16 with CUDA-graph replay and is checked against torch in
float32; on the CPU it runs in float32 through the generated C.  Prints the error, both
latencies and how the graph was compiled.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any


def _build(name: str, device: str) -> tuple[Any, Any]:
    import torch

    from tessera.examples import models as M  # optional: torch

    torch.manual_seed(0)
    big = device == "cuda"
    if name == "gpt2":
        model = M.TinyGPT(vocab=8192 if big else 1000, hidden=768 if big else 128, heads=12 if big else 4,
                          layers=6 if big else 2)  # fmt: skip
        x = torch.randint(0, 1000, (1, 128 if big else 32))
    elif name == "llama":
        model = M.TinyLlama(vocab=8192 if big else 1000, hidden=1024 if big else 128, heads=16 if big else 4,
                            kv_heads=4 if big else 2, ffn=2816 if big else 344, layers=4 if big else 2)  # fmt: skip
        x = torch.randint(0, 1000, (1, 128 if big else 32))
    elif name == "bert":
        model = M.BertLayer(vocab=1000, hidden=768 if big else 96, heads=12 if big else 4, ffn=3072 if big else 384,
                            max_len=128)  # fmt: skip
        x = torch.randint(0, 1000, (1, 128 if big else 24))
    else:
        model = M.randomize_batchnorm(M.ResNet18())
        x = torch.randn(1, 3, 64, 64)
    return model.eval(), x


REPEAT = 30


def _interleaved_median_ms(fns: dict[str, Any], sync: Any, repeat: int = REPEAT) -> dict[str, float]:
    """Median ms per call of each function, timed in alternation (one call of each per round),
    so that load from other processes falls on all of them alike; each is warmed up first."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
        sync()
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}


def _load_note() -> str:
    """What else the CPU is doing: CPU timings are only as good as the machine is quiet."""
    import os

    try:
        load = os.getloadavg()[0]
    except OSError:
        return f"{os.cpu_count()} CPUs"
    return f"{os.cpu_count()} CPUs, load average {load:.1f}{'; busy machine, timings noisy' if load > 0.5 * (os.cpu_count() or 1) else ''}"


def run_demo(name: str = "gpt2", device: str = "auto") -> bool:
    """Compile and run the demo model; True when tessera matches torch within tolerance."""
    import torch

    from tessera.frontend.torch import stats  # optional: torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    model, x = _build(name, device)
    reference = copy.deepcopy(model).float().to(device)
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = model.to(device=device, dtype=dtype)
    x = x.to(device) if not x.is_floating_point() else x.to(device=device, dtype=dtype)
    extra = {"mask": torch.ones(x.shape[0], x.shape[1], device=device)} if name == "bert" else {}
    with torch.no_grad():
        expected = reference(x.float() if x.is_floating_point() else x, **extra).float()
        compiled = torch.compile(model, backend="tessera")
        t0 = time.perf_counter()
        got = compiled(x, **extra)
        compile_s = time.perf_counter() - t0
        err = float((got.float() - expected).abs().max() / expected.abs().max())
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        ms = _interleaved_median_ms({"eager": lambda: model(x, **extra), "tessera": lambda: compiled(x, **extra)}, sync)
        eager_ms, tessera_ms = ms["eager"], ms["tessera"]
    tolerance = 2e-2 if dtype == torch.float16 else 1e-4
    ok = err <= tolerance
    print(f"model {name} on {device} ({str(dtype).removeprefix('torch.')}), input {tuple(x.shape)}")
    print(f"  compile + first call: {compile_s:.1f} s; graphs {stats['graphs']}, "
          f"segments {stats['segments']}, nodes left to torch {stats['eager_nodes']}")  # fmt: skip
    print(f"  max relative error vs torch float32: {err:.2e} ({'ok' if ok else 'ABOVE'} tolerance {tolerance:g})")
    print(f"  latency: tessera {tessera_ms:.3f} ms, torch eager {eager_ms:.3f} ms "
          f"(host-timed medians of {REPEAT} interleaved calls)")  # fmt: skip
    speedup = eager_ms / tessera_ms
    verdict = "faster than" if speedup >= 1.0 else "SLOWER than"
    print(f"  speed-up: {speedup:.2f}x -- tessera is {verdict} torch eager on this model and machine"
          + ("" if device == "cuda" else f" ({_load_note()})"))
    return ok
