"""Build compute definitions into a callable: schedule, lower, generate, compile, load, run.

`build(outputs, inputs, target)` reuses the kernel compiler's pipeline (transforms.pipeline.lower,
backend.generate_c/generate_cuda and build_c/build_cuda with the artifact cache, runtime
CpuKernel/CudaKernel) for every kernel of the op; all kernels go into one source file, so one
op costs one compiler run.  The returned `CompiledOp` binds shape symbols from its inputs'
shapes at every call, so one build serves every batch size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import Compute, Placeholder, TensorNode, topological_order
from tessera.ir.dtypes import DataType, numpy_dtype
from tessera.ir.evaluate import evaluate
from tessera.jit import build_source, generate_source, load_function
from tessera.ops.common import shape_vars
from tessera.ops.schedule import KernelSpec, schedule
from tessera.runtime.cuda import DeviceArray
from tessera.runtime.tensor import as_view, view_of
from tessera.transforms.pipeline import lower


class Generated:
    """Scheduled and lowered kernels of an op with their source (not compiled)."""

    def __init__(self, inputs: list[Placeholder], outputs: list[TensorNode], kernels: list[KernelSpec], target: str,
                 free_symbols: Sequence[E.Var] = ()):  # fmt: skip
        self.inputs, self.outputs, self.kernels, self.target = inputs, outputs, kernels, target
        self.free_symbols = list(free_symbols)  # size symbols that no input's shape carries
        self.lowered = [lower(k.func) for k in kernels]
        self._source: str | None = None

    @property
    def source(self) -> str:
        if self._source is None:
            self._source = generate_source(self.lowered, self.target)
        return self._source


def _load(gen: Generated, path: Path) -> list[Any]:
    return [load_function(k.func, path, gen.target) for k in gen.kernels]


def _check_graph(outputs: list[TensorNode], inputs: list[Placeholder]) -> list[TensorNode]:
    if not outputs:
        raise ArgumentError("build: needs at least one output")
    for t in outputs:
        if not isinstance(t, TensorNode):
            raise ArgumentError(f"build: outputs must be tensor nodes, got {type(t).__name__}")
    for p in inputs:
        if not isinstance(p, Placeholder):
            raise ArgumentError(f"build: inputs must be placeholders, got {p!r}")
    if len(set(inputs)) != len(inputs) or len(set(outputs)) != len(outputs):
        raise ArgumentError("build: a tensor is listed twice among the inputs or the outputs")
    # An output that is an input needs a copy kernel.
    outputs = [Compute(f"copy_{t.name}", t.shape, t.dtype, (ax := tuple(E.Var(f"i{k}", dtypes.int32) for k in range(t.rank))), t[ax], "injective")
               if isinstance(t, Placeholder) else t for t in outputs]  # fmt: skip
    reached = [n for n in topological_order(outputs) if isinstance(n, Placeholder)]
    missing = [p.name for p in reached if p not in inputs]
    if missing:
        raise ArgumentError(f"build: the outputs read placeholder(s) {missing} that are not among the inputs; pass them in `inputs`")
    names: dict[str, E.Var] = {}
    for p in inputs:
        for d in p.shape:
            if not isinstance(d, E.Expr) or d.dtype != dtypes.int32:
                raise ArgumentError(f"build: input '{p.name}' has dimension {d}; input dimensions must be ints or int32 expressions")
            for v in shape_vars([d]).values():
                if names.setdefault(v.name, v) is not v:
                    raise ArgumentError(f"build: two different shape symbols are both named '{v.name}'; reuse one Var per dynamic size")
    return outputs


def generate(outputs: TensorNode | Sequence[TensorNode], inputs: Sequence[Placeholder], target: str = "cpu",
             name: str = "op") -> Generated:  # fmt: skip
    """Schedule `outputs` and generate their source without compiling (e.g. to inspect it)."""
    outs = [outputs] if isinstance(outputs, TensorNode) else list(outputs)
    inputs = list(inputs)
    outs = _check_graph(outs, inputs)
    kernels = schedule(outs, target, name)
    symbols = {v for p in inputs for d in p.shape for v in shape_vars([d]).values()}
    names = {v.name: v for v in symbols}
    free: list[E.Var] = []  # sizes no input carries (an arange to `seq`): given in `symbols` at run time
    for k in kernels:
        for v, expr in k.scalars:
            if v is expr and v not in symbols and v not in free:
                if names.setdefault(v.name, v) is not v:
                    raise ArgumentError(f"build: two different shape symbols are both named '{v.name}'; reuse one Var per dynamic size")
                free.append(v)
    return Generated(inputs, outs, kernels, target, free)


def build(outputs: TensorNode | Sequence[TensorNode], inputs: Sequence[Placeholder], target: str = "cpu",
          name: str = "op", arch: str | None = None) -> CompiledOp:  # fmt: skip
    """Compile the computation of `outputs` from `inputs` for `target` ("cpu" or "cuda")."""
    gen = generate(outputs, inputs, target, name)
    path = build_source(gen.source, target, arch)
    return CompiledOp(gen, _load(gen, path), path)


def build_many(graphs: Sequence[tuple[TensorNode | Sequence[TensorNode], Sequence[Placeholder]]], target: str = "cpu",
               name: str = "op", arch: str | None = None) -> list[CompiledOp]:  # fmt: skip
    """Build several (outputs, inputs) computations with ONE compiler run (one source, one artifact).

    A graph compiler should use this for all the fused groups of a model: nvcc's start-up cost
    is then paid once, not per group.
    """
    gens = [generate(outs, ins, target, f"{name}{k}") for k, (outs, ins) in enumerate(graphs)]
    if not gens:
        return []
    path = build_source(generate_source([f for g in gens for f in g.lowered], target), target, arch)
    return [CompiledOp(g, _load(g, path), path) for g in gens]


def torch_dtype(dt: DataType) -> Any:
    """The torch dtype of a tessera DataType (`dtypes.torch_name`: float16, bfloat16, int64, bool...)."""
    import torch

    return getattr(torch, dtypes.torch_name(dt))


def torch_to_numpy(t: Any) -> np.ndarray:
    """A host numpy array with t's values (a view where torch allows one).  bfloat16, which numpy
    lacks, travels as its bit pattern into ml_dtypes.bfloat16."""
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(numpy_dtype(dtypes.bfloat16))
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> Any:
    """A CPU torch tensor sharing a's memory; bfloat16 (ml_dtypes) through its bit pattern."""
    import torch

    a = np.ascontiguousarray(a) if a.ndim else a
    if a.dtype.kind == "V" and a.dtype.name == "bfloat16":  # ml_dtypes' kind; .name alone costs ~10 us per call
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _empty(shape: tuple[int, ...], dt: DataType, like: Any, target: str) -> Any:
    """An uninitialised array of the same family (numpy, torch, device array) as `like`."""
    if like is not None and type(like).__module__.startswith("torch"):
        import torch

        return torch.empty(shape, dtype=torch_dtype(dt), device=like.device)
    if target == "cuda":
        if like is None or type(like).__module__.startswith("torch"):
            import torch

            return torch.empty(shape, dtype=torch_dtype(dt), device="cuda")

        return DeviceArray(shape, dt)
    return np.empty(shape, dtype=numpy_dtype(dt))


def _vector(a: Any) -> Any:
    """A rank-0 array as a one-element vector (kernels take rank-0 tensors that way)."""
    if hasattr(a, "reshape"):
        return a.reshape(1)
    raise ArgumentError(f"rank-0 arguments must support reshape(); got {type(a).__name__}")


class CompiledOp:
    """A built op: call it on arrays (numpy or CPU torch for "cpu"; torch CUDA tensors or
    device arrays for "cuda") to get its outputs, or use `run` with preallocated outputs."""

    def __init__(self, gen: Generated, loaded: list[Any], artifact: Path | None = None):
        self.artifact = artifact  # the built library or cubin in the artifact cache
        self.inputs, self.outputs, self.kernels, self.target = gen.inputs, gen.outputs, gen.kernels, gen.target
        self.free_symbols = gen.free_symbols
        self.source = gen.source
        self.lowered = gen.lowered
        self._loaded = loaded
        written = list(dict.fromkeys(t for k in self.kernels for t in k.writes))  # kernel order, deterministic
        self.temporaries = [t for t in written if t not in self.outputs]

    @property
    def num_kernels(self) -> int:
        return len(self.kernels)

    def bind_symbols(self, arrays: Sequence[Any], symbols: Mapping[str, int] | None = None) -> dict[E.Var, int]:
        """Check the inputs' ranks and sizes; return the shape symbols' values.

        A symbol that is an input's whole dimension is bound from that input's shape; one that
        only appears inside a dimension expression (such as 4*batch), or in no input's shape at
        all (`free_symbols`, e.g. the length of an arange), must come in `symbols`."""
        if len(arrays) != len(self.inputs):
            names = ", ".join(p.name for p in self.inputs)
            raise ArgumentError(f"op takes {len(self.inputs)} inputs ({names}), got {len(arrays)}")
        env: dict[E.Var, int] = {}
        if symbols:
            env.update((v, int(symbols[v.name])) for p in self.inputs for d in p.shape for v in shape_vars([d]).values() if v.name in symbols)
        shapes = []
        for p, a in zip(self.inputs, arrays):
            view = view_of(a, f"input '{p.name}'")
            if view.dtype != p.dtype:
                raise ArgumentError(f"input '{p.name}' has dtype {view.dtype}, expected {p.dtype}")
            if len(view.shape) != p.rank:
                raise ArgumentError(f"input '{p.name}' has shape {view.shape}, expected rank {p.rank} ({p!r})")
            for d, actual in zip(p.shape, view.shape):
                if isinstance(d, E.Var):
                    env.setdefault(d, actual)
            shapes.append((p, tuple(view.shape)))
        for p, actual_shape in shapes:
            for axis, (d, actual) in enumerate(zip(p.shape, actual_shape)):
                unbound = [v.name for v in shape_vars([d]).values() if v not in env]
                if unbound:
                    raise ArgumentError(f"input '{p.name}': the size symbol(s) {unbound} of dimension {axis} are bound by no "
                                        "input's shape; pass their values in `symbols`")  # fmt: skip
                expected = int(evaluate(d, env))
                if actual != expected:
                    what = f"symbol '{d.name}' = {expected} (bound by an earlier input)" if isinstance(d, E.Var) else (
                        f"{d} = {expected}" if shape_vars([d]) else str(expected))
                    raise ArgumentError(f"input '{p.name}' has shape {actual_shape}; dimension {axis} should be {what}")
        missing = [v.name for v in self.free_symbols if not symbols or v.name not in symbols]
        if missing:
            raise ArgumentError(f"the size symbol(s) {missing} appear in no input's shape; pass their values in `symbols`")
        env.update((v, int(symbols[v.name])) for v in self.free_symbols)  # type: ignore[index]
        return env

    def shape_of(self, t: TensorNode, env: dict[E.Var, int]) -> tuple[int, ...]:
        shape = tuple(int(evaluate(d, env)) for d in t.shape)
        if any(s <= 0 for s in shape):
            raise ArgumentError(f"'{t.name}' would have shape {shape} for these inputs; empty results are not supported")
        return shape

    def __call__(self, *arrays: Any, stream: int | None = None, symbols: Mapping[str, int] | None = None) -> Any:
        env = self.bind_symbols(arrays, symbols)
        like = arrays[0] if arrays else None
        outs = [_empty(self.shape_of(t, env), t.dtype, like, self.target) for t in self.outputs]
        self._run(arrays, outs, env, stream)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def run(self, inputs: Sequence[Any], outputs: Sequence[Any], stream: int | None = None,
            symbols: Mapping[str, int] | None = None, temporaries: Sequence[Any] | None = None) -> None:  # fmt: skip
        """Compute into preallocated `outputs` (their shapes are checked by the kernels).

        `temporaries` (in the order of `self.temporaries`, shapes from `shapes_for`) lets a caller
        that plans memory, or captures a CUDA graph, supply every buffer: nothing is allocated."""
        if len(outputs) != len(self.outputs):
            raise ArgumentError(f"op has {len(self.outputs)} outputs, got {len(outputs)} arrays")
        env = self.bind_symbols(inputs, symbols)
        for t, a in zip(self.outputs, outputs):
            view = as_view(a)
            if view is None or tuple(view.shape) != self.shape_of(t, env):
                raise ArgumentError(f"output '{t.name}' must have shape {self.shape_of(t, env)}")
        if temporaries is not None and len(temporaries) != len(self.temporaries):
            raise ArgumentError(f"op has {len(self.temporaries)} temporaries, got {len(temporaries)} arrays")
        self._run(inputs, outputs, env, stream, temporaries)

    def shapes_for(self, tensors: Sequence[TensorNode], inputs: Sequence[Any], symbols: Mapping[str, int] | None = None) -> list[tuple[int, ...]]:
        """Concrete shapes of some of this op's tensors (e.g. its temporaries) for these inputs."""
        env = self.bind_symbols(inputs, symbols)
        return [self.shape_of(t, env) for t in tensors]

    def _run(self, inputs: Sequence[Any], outputs: Sequence[Any], env: dict[E.Var, int], stream: int | None,
             temporaries: Sequence[Any] | None = None) -> None:  # fmt: skip
        arrays: dict[TensorNode, Any] = dict(zip(self.inputs, inputs))
        arrays.update(zip(self.outputs, outputs))
        like = inputs[0] if inputs else outputs[0]
        if temporaries is not None:
            arrays.update(zip(self.temporaries, temporaries))
        else:
            for t in self.temporaries:
                arrays[t] = _empty(self.shape_of(t, env), t.dtype, like, self.target)
        for spec, kernel in zip(self.kernels, self._loaded):
            args = [arrays[t] if t.rank else _vector(arrays[t]) for t in spec.tensors]
            args += [int(evaluate(expr, env)) for _, expr in spec.scalars]
            if self.target == "cpu":
                kernel(args)
            else:
                kernel.launch(args, stream)

    def __repr__(self) -> str:
        return f"<CompiledOp {len(self.inputs)} inputs -> {len(self.outputs)} outputs, {len(self.kernels)} kernel(s), {self.target}>"
