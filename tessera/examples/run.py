"""Build and run the example kernels, checking each against numpy (the README's main job)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tessera.examples.matmul import make_matmul
from tessera.examples.softmax import make_softmax
from tessera.examples.vector_add import make_vector_add
from tessera.runtime import cuda


def _softmax_ref(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def cases(rng: np.random.Generator) -> list[tuple[str, Callable, list[np.ndarray], Callable]]:
    """(name, kernel factory, inputs, float64 reference) for each example and size."""
    out: list[tuple[str, Callable, list[np.ndarray], Callable]] = []

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    for n in (1000003, 4097):
        out.append((f"vector_add n={n}", make_vector_add, [r(n), r(n)], lambda a, b: a.astype(np.float64) + b))
    for m, k, n in ((511, 257, 383), (1024, 1024, 1024)):
        out.append((f"matmul {m}x{k}x{n}", make_matmul, [r(m, k), r(k, n)], lambda a, b: a.astype(np.float64) @ b))
    for rows, cols in ((4099, 1000), (64, 32768)):
        out.append((f"softmax {rows}x{cols}", make_softmax, [r(rows, cols) * 4], _softmax_ref))
    return out


def _time(fn: Callable[..., Any], args: list[Any], sync: Callable[[], None], repeats: int = 10) -> float:
    fn(*args)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run_examples(device: str = "auto", seed: int = 0) -> list[dict[str, Any]]:
    """Run every example on `device` ("cpu", "cuda" or "auto"); print and return the results."""
    if device == "auto":
        device = "cuda" if cuda.is_available() else "cpu"
    rng = np.random.default_rng(seed)
    results = []
    print(f"tessera examples on {device}")
    print(f"{'case':<28} {'max rel err':>12} {'time (ms)':>10} {'build (s)':>10}")
    for name, factory, inputs, ref in cases(rng):
        t0 = time.perf_counter()
        kernel = factory(device)
        kernel.compile()
        build_s = time.perf_counter() - t0
        expected = ref(*inputs)
        out = np.full(expected.shape, np.nan, dtype=np.float32)  # poison: unwritten outputs show up
        if device == "cuda":
            args = [cuda.DeviceArray.from_numpy(x) for x in inputs] + [cuda.DeviceArray.from_numpy(out)]
            seconds = _time(kernel, args, cuda.synchronize)
            result = args[-1].numpy()
        else:
            seconds = _time(kernel, [*inputs, out], lambda: None)
            result = out
        err = float(np.max(np.abs(result - expected)) / max(np.max(np.abs(expected)), 1e-30))
        row = {"case": name, "device": device, "max_rel_err": err, "ms": seconds * 1e3, "build_s": build_s}
        results.append(row)
        print(f"{name:<28} {err:>12.2e} {seconds * 1e3:>10.3f} {build_s:>10.2f}")
    return results
