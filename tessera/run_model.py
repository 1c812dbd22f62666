"""`tessera run`: compile a model file (ONNX, or a saved compiled graph) and run it once.

Inputs are random (fixed seed; integer inputs in [0, --int-high)) or `.npy` files; symbolic
sizes take values from `--dim name=value` (default 1).  Prints each output's shape, dtype
and statistics, and the median latency over `--repeat` timed calls after a warm-up.
"""

from __future__ import annotations

import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.graph.symbolic import evaluate
from tessera.graph.tensor import numpy_dtype


def load_model(path: str | Path, target: str) -> Any:
    """A CompiledGraph from an .onnx file or a file written by CompiledGraph.save."""
    from tessera.graph.compiler import compile_graph, load_compiled

    path = Path(path)
    if not path.exists():
        raise ArgumentError(f"{path}: no such file")
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            if "compiled.json" in z.namelist():
                return load_compiled(path)
        from tessera.graph import load

        return compile_graph(load(path), target)
    from tessera.frontend import onnx as tessera_onnx

    return compile_graph(tessera_onnx.load(str(path)), target)


def make_inputs(graph: Any, npy: Sequence[str], dims: dict[str, int], int_high: int, seed: int = 0) -> list[np.ndarray]:
    """The graph's inputs: from .npy files in order, else random of the declared type."""
    rng = np.random.default_rng(seed)
    sizes = {n: 1 for t in graph.inputs for d in t.shape if not isinstance(d, int) for n in d.names} | dict(dims)
    arrays = []
    for i, t in enumerate(graph.inputs):
        if i < len(npy):
            arrays.append(np.load(npy[i], allow_pickle=False))
            continue
        shape = tuple(evaluate(d, sizes) for d in t.shape)
        dt = numpy_dtype(t.dtype)
        if np.issubdtype(dt, np.floating):
            arrays.append(rng.standard_normal(shape).astype(dt))
        elif dt == np.bool_:
            arrays.append(rng.random(shape) < 0.5)
        else:
            arrays.append(rng.integers(0, int_high, shape).astype(dt))
    return arrays


def run_model(path: str, device: str = "auto", npy: Sequence[str] = (), dims: Sequence[str] = (),
              repeat: int = 20, int_high: int = 100, save: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Compile and run the model at `path`; prints a summary and returns it as a dict."""
    from tessera.runtime import cuda

    target = ("cuda" if cuda.is_available() else "cpu") if device == "auto" else device
    bindings = {}
    for d in dims:
        name, _, value = d.partition("=")
        if not value.isdigit():
            raise ArgumentError(f"--dim takes name=integer, got {d!r}")
        bindings[name] = int(value)
    start = time.perf_counter()
    compiled = load_model(path, target)
    arrays = make_inputs(compiled.graph, npy, bindings, int_high)
    outs = compiled(*arrays)
    first_s = time.perf_counter() - start
    times = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        outs = compiled(*arrays)
        if target == "cuda":
            import torch

            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    summary = compiled.summary()
    print(f"{Path(path).name}: {summary['operators']} operators -> {summary['kernels']} kernels on {target} "
          f"(steps {summary['steps']}), compile + first run {first_s:.2f} s")  # fmt: skip
    for ref in summary["reference_ops"]:
        print(f"  runs in numpy: {ref}")
    results = []
    for t, o in zip(compiled.graph.outputs, outs):
        a = o.float().cpu().numpy() if hasattr(o, "cpu") else np.asarray(o, dtype=np.float64)
        stats = {"name": t.name, "shape": list(a.shape), "dtype": t.dtype.name, "mean": float(a.mean()), "std": float(a.std()),
                 "min": float(a.min()), "max": float(a.max()), "finite": bool(np.isfinite(a).all())}  # fmt: skip
        results.append(stats)
        print(f"  output {t.name}: shape {tuple(a.shape)} {t.dtype.name}  mean {stats['mean']:.5g} std {stats['std']:.5g} "
              f"min {stats['min']:.5g} max {stats['max']:.5g}")  # fmt: skip
    median_ms = sorted(times)[len(times) // 2] * 1e3
    print(f"  latency: median {median_ms:.3f} ms over {len(times)} calls (host-timed, after a warm-up)")
    if save:
        compiled.save(save)
        print(f"  saved the compiled graph to {save}")
    if not all(r["finite"] for r in results):
        print("  warning: an output holds NaN or Inf")
    return {"target": target, "latency_ms": median_ms, "first_run_s": first_s, "outputs": results, "summary": summary}
