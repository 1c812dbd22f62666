"""CompiledGraph: a FlowGraph built into kernels, run with planned memory (and on the GPU,
replayed as one CUDA graph).

Per distinct set of symbol values (batch, sequence...) the compiled graph makes a *plan*:
concrete shapes (the graph's symbolic sizes evaluated), buffer offsets for every intermediate
tensor and kernel temporary (placed by liveness, tessera.graph.memory_plan), and the anchors
prepared for those shapes.  On the GPU the first call of a plan runs the steps eagerly; the
second captures them into a CUDA graph (its warm-up run gives that call's results), so a shape
seen once -- each step of a growing KV cache -- costs no capture; later calls copy the inputs
into the plan's static input buffers, replay the graph and hand back copies of the static
outputs (callers own what they get).

Plans run one at a time, so they share memory (as Grape shares it between the CUDA graphs of a
dynamic model): every plan places its buffers -- on the GPU its static inputs and outputs too --
in one arena per compiled graph, sized by the largest plan.  When a new plan needs more, the
arena grows (by at least half, so a sweep of growing lengths reallocates rarely) and the plans
made on the old arena are dropped; a later call with their sizes plans (and captures) again,
with no compiling.  So the memory a dynamic-shape model holds is that of its largest shape,
not the sum over the shapes it has seen.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.graph.executor import collect_inputs
from tessera.graph.flow_graph import FlowGraph
from tessera.graph.memory_plan import place_buffers
from tessera.graph.shape_check import propagate_shapes
from tessera.graph.symbolic import bind_shapes, evaluate
from tessera.graph.tensor import Tensor, numpy_dtype
from tessera.ir.dtypes import DataType
from tessera.ops.compiled import numpy_to_torch, torch_dtype, torch_to_numpy

log = logging.getLogger("tessera")

ALIGN = 256
MAX_PLANS = 16
ARENA_GROWTH = 1.5  # a GPU arena that must grow takes at least this factor


def _nbytes(shape: Sequence[int], dt: DataType) -> int:
    return -(-max(1, int(np.prod(shape, dtype=np.int64)) * dt.nbytes) // ALIGN) * ALIGN


class _Plan:
    """Everything one set of symbol values needs: shapes, buffers, CUDA graph."""

    def __init__(self) -> None:
        self.shapes: dict[Tensor, tuple[int, ...]] = {}
        self.bindings: dict[str, int] = {}
        self.buffers: dict[Tensor, Any] = {}
        self.temps: list[list[Any]] = []
        self.arena: Any = None
        self.arena_bytes = 0
        self.generation = -1  # the arena generation the buffers are views of
        self.static_inputs: list[Any] | None = None
        self.static_outputs: dict[Tensor, Any] | None = None  # the buffers the captured steps write
        self.cuda_graph: Any = None
        self.io: dict[Tensor, Any] = {}  # static input and output buffers of a CUDA-graph plan


class CompiledGraph:
    """A graph compiled for "cpu" (numpy in, numpy out) or "cuda" (torch CUDA tensors in and out).

    Call it with the graph's inputs (positionally, by name or as one dict); it returns the list
    of outputs.  `summary()` tells how the graph was compiled."""

    def __init__(self, graph: FlowGraph, target: str, steps: list[Any], options: Mapping[str, Any]):
        self.graph, self.target, self.steps, self.options = graph, target, steps, dict(options)
        self.use_cuda_graph = target == "cuda" and bool(options.get("cuda_graph", True))
        if self.use_cuda_graph and any(s.kind == "reference" for s in steps):
            names = sorted({s.op.kind for s in steps if s.kind == "reference"})
            log.warning("tessera: %s runs %s on the host, so it is not captured into a CUDA graph", graph.name, names)
            self.use_cuda_graph = False
        self._constants: dict[Tensor, Any] = {}
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._arena: Any = None  # shared by every plan (see the module docstring)
        self._arena_size = 0
        self._generation = 0
        # The index of the last step reading each tensor, for liveness.
        self._last_use: dict[Tensor, int] = {}
        for i, s in enumerate(steps):
            for t in s.inputs:
                self._last_use[t] = i
        for t in graph.outputs:
            self._last_use[t] = len(steps)

    # ---- calling ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return self.execute(collect_inputs(self.graph, args, kwargs))

    def execute(self, arrays: Sequence[Any], symbols: Mapping[str, int] | None = None) -> list[Any]:
        """Run on the inputs in graph order; `symbols` adds sizes no input shape carries."""
        if len(arrays) != len(self.graph.inputs):
            raise ArgumentError(f"graph {self.graph.name} takes {len(self.graph.inputs)} inputs, got {len(arrays)}")
        arrays = [self._check_input(t, a) for t, a in zip(self.graph.inputs, arrays)]
        bindings = dict(symbols or {})
        bind_shapes(bindings, [(t.shape, tuple(a.shape), f"input {t.name!r}") for t, a in zip(self.graph.inputs, arrays)])
        key = tuple(sorted(bindings.items()))
        plan = self._plans.get(key)
        if plan is None:
            # The graph's shape assumptions hold for these sizes (or a ShapeError says which fails).
            shapes = propagate_shapes(self.graph, [tuple(a.shape) for a in arrays], bindings)
            with _plan_owned(self.target):
                plan = self._make_plan(shapes, bindings)
            self._plans[key] = plan
            if len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
            return self._run_eager(plan, arrays)
        self._plans.move_to_end(key)
        if plan.cuda_graph is not None:
            return self._replay(plan, arrays)
        if self.use_cuda_graph:  # the plan's second call: capture (its warm-up run computes this call)
            with _plan_owned(self.target):
                self._capture(plan, arrays)
            return [self._result(t, arrays, plan.static_outputs, copy=True) for t in self.graph.outputs]
        return self._run_eager(plan, arrays)

    def _check_input(self, t: Tensor, a: Any) -> Any:
        if self.target == "cpu":
            if type(a).__module__.startswith("torch"):
                a = torch_to_numpy(a)
            a = _contiguous(np.asarray(a))
            if a.dtype != numpy_dtype(t.dtype):
                raise ArgumentError(f"input {t.name!r} must be {t.dtype.name}, got {a.dtype}")
            return a
        import torch

        if not isinstance(a, torch.Tensor):
            a = numpy_to_torch(_contiguous(np.asarray(a)))
        if a.device.type != "cuda":
            a = a.cuda()
        if a.dtype != torch_dtype(t.dtype):
            raise ArgumentError(f"input {t.name!r} must be {t.dtype.name}, got {a.dtype}")
        return a.contiguous()

    # ---- plans -----------------------------------------------------------------------------
    def _constant(self, t: Tensor) -> Any:
        if t not in self._constants:
            data = np.array(t.data, order="C")  # a writable copy: torch refuses read-only arrays
            if self.target == "cuda":
                with _plan_owned(self.target):
                    self._constants[t] = numpy_to_torch(data).cuda()
            else:
                self._constants[t] = data
        return self._constants[t]

    def _make_plan(self, shapes: Mapping[Tensor, tuple[int, ...]], bindings: Mapping[str, int]) -> _Plan:
        """A plan for the run-time shapes of every tensor (`propagate_shapes`) and the symbol
        values (input sizes and the graph's opaque sizes)."""
        plan = _Plan()
        plan.bindings = dict(bindings)
        outputs = set(self.graph.outputs)
        sizes: dict[Any, int] = {}
        lifetimes: dict[Any, tuple[int, int]] = {}
        dtypes: dict[Any, DataType] = {}
        for i, step in enumerate(self.steps):
            for t in step.outputs:
                plan.shapes[t] = shapes[t]
                if t not in outputs:
                    sizes[t] = _nbytes(plan.shapes[t], t.dtype)
                    lifetimes[t] = (i, self._last_use.get(t, i))
                    dtypes[t] = t.dtype
        for t in [*self.graph.inputs, *self.graph.constants]:
            plan.shapes[t] = shapes[t]
        # Kernel temporaries live during their own step only.
        temp_specs = []
        for i, step in enumerate(self.steps):
            specs = step.temporaries([_Shaped(plan.shapes[t], t.dtype) for t in step.inputs], bindings)
            temp_specs.append(specs)
            for j, (shape, dt) in enumerate(specs):
                sizes[(i, j)] = _nbytes(shape, dt)
                lifetimes[(i, j)] = (i, i)
        offsets, plan.arena_bytes = place_buffers(sizes, lifetimes)
        io_offsets: dict[Tensor, int] = {}
        if self.use_cuda_graph:  # the capture's static inputs and outputs live after the intermediates
            end = plan.arena_bytes
            for t in [*self.graph.inputs, *(t for t in self.graph.outputs if t.producer is not None)]:
                if t not in io_offsets:
                    io_offsets[t] = end
                    end += _nbytes(plan.shapes[t], t.dtype)
            plan.arena_bytes = end
        plan.arena = self._shared_arena(plan.arena_bytes)
        plan.generation = self._generation
        plan.io = {t: self._view(plan.arena, off, plan.shapes[t], t.dtype) for t, off in io_offsets.items()}
        for t in dtypes:
            plan.buffers[t] = self._view(plan.arena, offsets[t], plan.shapes[t], t.dtype)
        for i, specs in enumerate(temp_specs):
            plan.temps.append([self._view(plan.arena, offsets[(i, j)], shape, dt) for j, (shape, dt) in enumerate(specs)])
        for step in self.steps:
            if step.kind == "anchor":
                step.bind(plan.shapes)
        return plan

    def _shared_arena(self, nbytes: int) -> Any:
        """The arena every plan places its buffers in, grown (dropping the plans on the old one)
        when this plan needs more than it holds."""
        if self._arena is None or nbytes > self._arena_size:
            size = max(nbytes, 1)
            if self._arena is not None and self.target == "cuda":
                size = max(size, int(self._arena_size * ARENA_GROWTH))
            self._plans.clear()  # their buffers and captured graphs point into the old arena
            self._arena = None  # free it before allocating the new one
            self._arena = self._alloc_arena(size)
            self._arena_size = size
            self._generation += 1
        return self._arena

    def _alloc_arena(self, nbytes: int) -> Any:
        if self.target == "cpu":
            return np.empty(max(nbytes, 1), np.uint8)
        import torch

        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")

    def _view(self, arena: Any, offset: int, shape: tuple[int, ...], dt: DataType) -> Any:
        count = int(np.prod(shape, dtype=np.int64))
        if self.target == "cpu":
            return np.frombuffer(arena, numpy_dtype(dt), count, offset).reshape(shape)
        return arena[offset: offset + count * dt.nbytes].view(torch_dtype(dt)).view(shape)

    def _empty(self, shape: tuple[int, ...], dt: DataType) -> Any:
        if self.target == "cpu":
            return np.empty(shape, numpy_dtype(dt))
        import torch

        return torch.empty(shape, dtype=torch_dtype(dt), device="cuda")

    # ---- running ---------------------------------------------------------------------------
    def _run_eager(self, plan: _Plan, arrays: Sequence[Any]) -> list[Any]:
        outs = {t: self._empty(plan.shapes[t], t.dtype) for t in self.graph.outputs if t.producer is not None}
        self._run_steps(plan, arrays, outs)
        return [self._result(t, arrays, outs) for t in self.graph.outputs]

    def _run_steps(self, plan: _Plan, arrays: Sequence[Any], outs: Mapping[Tensor, Any]) -> None:
        env: dict[Tensor, Any] = dict(zip(self.graph.inputs, arrays))
        env.update(plan.buffers)
        env.update(outs)
        for step, temps in zip(self.steps, plan.temps):
            ins = [env[t] if t in env else self._constant(t) for t in step.inputs]
            step.run(ins, [env[t] for t in step.outputs], temps, plan.bindings)

    def _result(self, t: Tensor, arrays: Sequence[Any], outs: Mapping[Tensor, Any], copy: bool = False) -> Any:
        """Output t: the buffer a step wrote (copied if asked), else a copy of the input or
        constant it passes through -- taken from `arrays`, the inputs of THIS call."""
        if t in outs:
            return outs[t].clone() if copy else outs[t]
        source = arrays[self.graph.inputs.index(t)] if t in self.graph.inputs else self._constant(t)
        return source.copy() if self.target == "cpu" else source.clone()

    def _capture(self, plan: _Plan, arrays: Sequence[Any]) -> None:
        import torch

        plan.static_inputs = [plan.io[t] for t in self.graph.inputs]
        for static, a in zip(plan.static_inputs, arrays):
            static.copy_(a)
        outs = {t: plan.io[t] for t in self.graph.outputs if t.producer is not None}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm every launch plan off the capture
            self._run_steps(plan, plan.static_inputs, outs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._run_steps(plan, plan.static_inputs, outs)
        plan.static_outputs = outs
        plan.cuda_graph = graph

    def _replay(self, plan: _Plan, arrays: Sequence[Any]) -> list[Any]:
        """Copy this call's inputs in, replay, and hand back copies of what the replay wrote.
        Outputs no step writes (an input or constant passed through) come from this call's
        inputs, never from the capture: the replay does not produce them."""
        for static, a in zip(plan.static_inputs, arrays):
            static.copy_(a)
        plan.cuda_graph.replay()
        return [self._result(t, arrays, plan.static_outputs, copy=True) for t in self.graph.outputs]

    def prepare(self, symbols: Mapping[str, int]) -> None:
        """Prepare (compile and load) the anchors for these values of the symbolic sizes
        without running anything; the first call with such inputs would do it otherwise."""
        inputs = [tuple(int(evaluate(d, symbols)) for d in t.shape) for t in self.graph.inputs]
        shapes = propagate_shapes(self.graph, inputs, dict(symbols))
        for step in self.steps:
            if step.kind == "anchor":
                step.bind(shapes)

    def artifacts(self) -> tuple[list[Path], list[tuple[str, str]]]:
        """The built artifacts (cache paths) of every kernel compiled or prepared so far, and
        the tuning records (key, winner) that chose the prepared anchors' schedules."""
        paths: dict[Path, None] = {}
        tuning: dict[tuple[str, str], None] = {}
        for step in self.steps:
            if step.kind == "fused" and step.compiled.artifact is not None:
                paths[Path(step.compiled.artifact)] = None
            elif step.kind == "anchor":
                for kernel in step.prepared():
                    paths.update(dict.fromkeys(Path(a) for a in kernel.artifacts))
                    tuning.update(dict.fromkeys(kernel.tuning))
        return list(paths), list(tuning)

    def save(self, path: Any, sizes: Sequence[Mapping[str, int]] = ()) -> None:
        """Write the compiled graph with every kernel it has built to one file;
        `tessera.graph.compiler.load_compiled` reads it.  `sizes`: values of the symbolic
        sizes whose GPU anchors to prepare and save besides those already run."""
        from tessera.graph.compiler.saved import save_compiled

        save_compiled(self, path, sizes)

    # ---- reporting -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Counts of steps by kind, kernels, and the operators left to the numpy reference."""
        counts: dict[str, int] = {}
        for s in self.steps:
            counts[s.kind] = counts.get(s.kind, 0) + 1
        return {
            "target": self.target,
            "operators": len(self.graph.operators),
            "steps": counts,
            "kernels": sum(s.num_kernels for s in self.steps),
            "reference_ops": sorted({f"{s.op.kind}: {s.group.reason}" for s in self.steps if s.kind == "reference"}),
            "fused_ops": sum(len(s.group.ops) - 1 for s in self.steps if s.kind == "anchor"),
            "cuda_graph": self.use_cuda_graph,
            "arena_bytes": {str(dict(k)): p.arena_bytes for k, p in self._plans.items()},
            "shared_arena_bytes": self._arena_size,
        }

    def __repr__(self) -> str:
        s = self.summary()
        return f"<CompiledGraph {self.graph.name} {self.target}: {s['operators']} ops -> {s['steps']}, {s['kernels']} kernels>"


@contextlib.contextmanager
def _plan_owned(target: str) -> Iterator[None]:
    """Allocate a plan's long-lived GPU buffers as normal tensors even under
    torch.inference_mode(): later calls outside it copy into them, which torch refuses for
    inference tensors."""
    if target != "cuda":
        yield
        return
    import torch

    with torch.inference_mode(False):
        yield


def _contiguous(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array of the same shape (np.ascontiguousarray turns 0-d into 1-d)."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


class _Shaped:
    """A stand-in array (shape and dtype only) for computing temporary sizes."""

    def __init__(self, shape: tuple[int, ...], dt: DataType):
        self.shape, self.dtype_ = shape, dt

    def __tessera_view__(self) -> Any:
        from tessera.runtime.tensor import ArrayView

        return ArrayView(0, tuple(self.shape), self.dtype_, "cpu", True, None)

