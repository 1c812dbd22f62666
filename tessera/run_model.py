"""`tessera run`: compile a model file (ONNX, or a saved compiled graph) and run it once.

ONNX models go through `tessera.onnx.compile`, which specialises the compiled graph on the
values of shape-like inputs (a Reshape's shape, a ReduceSum's axes fed as graph inputs): give
those as `.npy` files -- random values would be meaningless shapes, so `tessera run` refuses
to invent them and names them.  Inputs are `.npy` files (in input order, at most one per
input) or random (fixed seed; integer inputs in [0, --int-high)); symbolic sizes take values
from the files' shapes and `--dim name=value` (default 1), which must name a size of the model
and agree with the files.  Prints each output's shape, dtype and statistics, and the median
latency over `--repeat` timed calls after a warm-up; with `--explain`, the compile report
(tessera.graph.compiler.report) too.  `--save` writes the compiled graph the last call ran
(for a specialised ONNX model: the one for the given shape-like values, which are then
constants of the saved graph).
"""

from __future__ import annotations

import time
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError, FileFormatError
from tessera.frontend import onnx as tessera_onnx
from tessera.graph import load
from tessera.graph.compiler import compile_graph, load_compiled
from tessera.graph.symbolic import Sym, bind_shape, evaluate, format_shape
from tessera.ir.dtypes import numpy_dtype
from tessera.runtime import cuda


def load_model(path: str | Path, target: str) -> Any:
    """An OnnxModel (tessera.onnx.compile: specialised on shape-like inputs) from an .onnx
    file, or a CompiledGraph from a file written by CompiledGraph.save (or tessera.graph.save).
    A file that is neither raises FileFormatError naming the problem."""
    path = Path(path)
    if not path.exists():
        raise ArgumentError(f"{path}: no such file")
    if not path.is_file():
        raise ArgumentError(f"{path}: not a file")
    if zipfile.is_zipfile(path) or path.suffix == ".tsr":
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            raise FileFormatError(f"{path}: not a readable compiled-graph (.tsr) or graph file ({exc})") from None
        if "compiled.json" in names or path.suffix == ".tsr":
            return load_compiled(path)

        return compile_graph(load(path), target)

    return tessera_onnx.compile(str(path), target)


class _Declared:
    """What make_inputs needs of a model: its input tensors and their symbolic sizes."""

    def __init__(self, inputs: list[Any]):
        self.inputs = inputs
        self._symbols = list(dict.fromkeys(n for t in inputs for d in t.shape if isinstance(d, Sym) for n in d.names))

    def symbols(self) -> list[str]:
        return self._symbols


def declared_inputs(model: Any) -> Any:
    """The input declarations of a CompiledGraph (its graph) or an OnnxModel (its ONNX inputs)."""
    return _Declared(model.input_tensors()) if hasattr(model, "input_tensors") else model.graph


def _check_shape_inputs(model: Any, npy: Sequence[str], inputs: list[Any]) -> None:
    """Shape-like inputs of an ONNX model must come from files: random ones are no shapes."""
    given = {t.name for t in inputs[: len(npy)]}
    missing = [n for n in getattr(model, "shape_inputs", []) if n not in given]
    if missing:
        order = ", ".join(t.name for t in inputs)
        raise ArgumentError(f"the model's input(s) {', '.join(missing)} give shapes, axes or sizes (its graph needs "
                            f"their values): pass them as --input .npy files (inputs in order: {order})")  # fmt: skip


def parse_dims(dims: Sequence[str]) -> dict[str, int]:
    """--dim name=value arguments as a dict; malformed or repeated ones raise ArgumentError."""
    out: dict[str, int] = {}
    for d in dims:
        name, _, value = d.partition("=")
        name = name.strip()
        if not name or not value.strip().isdigit() or int(value) < 1:
            raise ArgumentError(f"--dim takes name=positive integer, got {d!r}")
        if name in out:
            raise ArgumentError(f"--dim {name} is given twice")
        out[name] = int(value)
    return out


def _load_npy(file: str, t: Any) -> np.ndarray:
    try:
        a = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        why = "it is not an .npy array, or one of Python objects (not loaded: unsafe)" if "pickle" in str(exc) else exc
        raise ArgumentError(f"--input {file}: not a readable .npy file ({why})") from None
    if not isinstance(a, np.ndarray):
        raise ArgumentError(f"--input {file}: holds several arrays (an .npz); give one .npy per input")
    if a.dtype != numpy_dtype(t.dtype):
        raise ArgumentError(f"--input {file}: {a.dtype} data, but input {t.name!r} is {t.dtype.name}; "
                            f"convert it (e.g. with .astype(np.{numpy_dtype(t.dtype)}))")  # fmt: skip
    return a


def make_inputs(graph: Any, npy: Sequence[str], dims: Mapping[str, int], int_high: int, seed: int = 0) -> list[np.ndarray]:
    """The graph's inputs: from .npy files in order, the rest random of the declared type.

    Every --dim must name a symbolic size of the graph and agree with the sizes the .npy files
    carry; there may be no more files than inputs.  Unset sizes default to 1."""
    symbols = graph.symbols()
    names = ", ".join(t.name for t in graph.inputs)
    for name in dims:
        if name not in symbols:
            known = ", ".join(symbols) if symbols else "none: all its input shapes are static"
            raise ArgumentError(f"--dim {name}: the model has no symbolic size {name!r} (its sizes: {known})")
    if len(npy) > len(graph.inputs):
        raise ArgumentError(f"{len(npy)} --input files given, but the model takes {len(graph.inputs)} input(s): {names}")
    loaded = [_load_npy(f, t) for f, t in zip(npy, graph.inputs)]
    sizes = dict(dims)
    source: dict[str, str] = {name: f"--dim {name}={v}" for name, v in dims.items()}
    for f, t, a in zip(npy, graph.inputs, loaded):
        found: dict[str, int] = {}
        bind_shape(found, t.shape, a.shape, f"--input {f} (input {t.name!r} of shape {format_shape(t.shape)})")
        for name, v in found.items():
            if sizes.setdefault(name, v) != v:
                raise ArgumentError(f"{source[name]} contradicts --input {f}: its shape {a.shape} gives {name}={v}")
            source.setdefault(name, f"--input {f} (shape {a.shape})")
    sizes = {n: 1 for n in symbols} | sizes
    for f, t, a in zip(npy, graph.inputs, loaded):  # compound sizes (2*batch) too
        expected = tuple(evaluate(d, sizes) for d in t.shape)
        if expected != a.shape:
            raise ArgumentError(f"--input {f}: shape {a.shape}, but input {t.name!r} must be {format_shape(t.shape)} "
                                f"= {expected} for {sizes}")  # fmt: skip
    rng = np.random.default_rng(seed)
    arrays = list(loaded)
    for t in graph.inputs[len(loaded):]:
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
              repeat: int = 20, int_high: int = 100, save: str | None = None, explain: bool = False) -> dict[str, Any]:  # fmt: skip
    """Compile and run the model at `path`; prints a summary (and with `explain` the compile
    report) and returns it as a dict."""
    target = ("cuda" if cuda.is_available() else "cpu") if device == "auto" else device
    bindings = parse_dims(dims)
    if repeat < 1:
        raise ArgumentError(f"--repeat must be at least 1, got {repeat}")
    if int_high < 1:
        raise ArgumentError(f"--int-high must be at least 1, got {int_high}")
    if save and not Path(save).resolve().parent.is_dir():
        raise ArgumentError(f"--save {save}: the folder {Path(save).resolve().parent} does not exist")
    start = time.perf_counter()
    compiled = load_model(path, target)
    if compiled.target != target:  # a saved compiled graph keeps the target it was compiled for
        if device != "auto":
            raise ArgumentError(f"{path} was compiled for {compiled.target}; --device {device} cannot apply to it "
                                f"(compile the original model for {device})")  # fmt: skip
        target = compiled.target
    declared = declared_inputs(compiled)
    _check_shape_inputs(compiled, npy, declared.inputs)
    arrays = make_inputs(declared, npy, bindings, int_high)
    outs = compiled(*arrays)
    first_s = time.perf_counter() - start
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        outs = compiled(*arrays)
        if target == "cuda":
            import torch

            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    summary = compiled.summary()
    ran = getattr(compiled, "latest", compiled)  # the CompiledGraph the calls ran
    if getattr(compiled, "shape_inputs", None):
        print(f"  specialised on the values of {', '.join(compiled.shape_inputs)}")
    print(f"{Path(path).name}: {summary['operators']} operators -> {summary['kernels']} kernels on {target} "
          f"(steps {summary['steps']}), compile + first run {first_s:.2f} s")  # fmt: skip
    if len(npy) < len(arrays):
        print(f"  random inputs: {', '.join(t.name for t in declared.inputs[len(npy):])}")
    for ref in summary["reference_ops"]:
        print(f"  runs in numpy: {ref}")
    results = []
    for t, o in zip(ran.graph.outputs, outs):
        a = o.float().cpu().numpy() if hasattr(o, "cpu") else np.asarray(o.numpy() if hasattr(o, "numpy") else o,
                                                                            dtype=np.float64)  # fmt: skip
        stats = {"name": t.name, "shape": list(a.shape), "dtype": t.dtype.name, "mean": float(a.mean()), "std": float(a.std()),
                 "min": float(a.min()), "max": float(a.max()), "finite": bool(np.isfinite(a).all())}  # fmt: skip
        results.append(stats)
        print(f"  output {t.name}: shape {tuple(a.shape)} {t.dtype.name}  mean {stats['mean']:.5g} std {stats['std']:.5g} "
              f"min {stats['min']:.5g} max {stats['max']:.5g}")  # fmt: skip
    median_ms = sorted(times)[len(times) // 2] * 1e3
    print(f"  latency: median {median_ms:.3f} ms over {len(times)} calls (host-timed, after a warm-up)")
    if save:
        try:
            ran.save(save)
        except OSError as exc:
            raise ArgumentError(f"--save {save}: cannot write the file ({exc})") from None
        print(f"  saved the compiled graph to {save}")
    if not all(r["finite"] for r in results):
        print("  warning: an output holds NaN or Inf")
    out = {"target": target, "latency_ms": median_ms, "first_run_s": first_s, "outputs": results, "summary": summary}
    if explain:
        report = compiled.report()
        print(report)
        out["report"] = report.to_dict()
    return out
