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

Outputs computed in place (`in_place`, compiler/in_place.py: a KV-cache update) live in the
caller's input array: no buffer of their own, no static copy of that input in a CUDA graph (the
capture records the input's address, and a later call with the input elsewhere runs the plan
without its graph), and the call returns the input array itself for them.  Outputs copied back
(`copy_back`: updates of inputs the caller keeps in place, such as a position counter) are
written into their input by the run's last steps -- inside the CUDA graph -- and returned as
that input too.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.graph.compiler import archive
from tessera.graph.compiler.cpu_replay import Replay
from tessera.graph.compiler.cpu_runner import artifact
from tessera.graph.compiler.memory import choose_memory
from tessera.graph.compiler.report import graph_report
from tessera.graph.executor import collect_inputs
from tessera.graph.flow_graph import FlowGraph
from tessera.graph.memory_plan import place_buffers
from tessera.graph.shape_check import propagate_shapes
from tessera.graph.symbolic import bind_shapes, evaluate
from tessera.graph.tensor import Tensor
from tessera.ir.dtypes import DataType
from tessera.progress import bar
from tessera.progress import progress as show_progress
from tessera.runtime.tensor import ArrayView

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
        self.unshared_bytes = 0  # what the buffers would take without reuse
        self.generation = -1  # the arena generation the buffers are views of
        self.static_inputs: list[Any] | None = None
        self.static_outputs: dict[Tensor, Any] | None = None  # the buffers the captured steps write
        self.cuda_graph: Any = None
        self.io: dict[Tensor, Any] = {}  # static input and output buffers of a CUDA-graph plan
        self.pinned: dict[int, int] = {}  # in-place input index -> the address its capture recorded
        self.replayable = False  # a CPU plan whose steps only launch C kernels (see cpu_replay)
        self.replay: Any = None  # its recorded C calls (cpu_replay.Replay)


class CompiledGraph:
    """A graph compiled for "cpu" (numpy in, numpy out) or "cuda" (torch CUDA tensors in and
    out, or tessera DeviceArrays without torch: see tessera.graph.compiler.memory).

    Call it with the graph's inputs (positionally, by name or as one dict); it returns the list
    of outputs.  `summary()` counts what the graph was compiled into; `report()` (printed by
    `tessera.explain`) tells it kernel by kernel."""

    def __init__(self, graph: FlowGraph, target: str, steps: list[Any], options: Mapping[str, Any],
                 in_place: Mapping[int, int] | None = None, copy_back: Mapping[int, int] | None = None):  # fmt: skip
        self.graph, self.target, self.steps, self.options = graph, target, steps, dict(options)
        # output index -> input index: outputs computed in the caller's input array, and outputs
        # copied into it at the end of the run (see the module docstring)
        self.in_place, self.copy_back = dict(in_place or {}), dict(copy_back or {})
        self._in_place_outputs = {graph.outputs[j]: i for j, i in self.in_place.items()}
        self._copied_outputs = {graph.outputs[j]: i for j, i in self.copy_back.items()}
        self._pinned = sorted({*self.in_place.values(), *self.copy_back.values()})  # inputs used where they are
        shapes = [tuple(t.shape) for t in graph.inputs]
        self._static_shapes = shapes if all(isinstance(d, int) for s in shapes for d in s) else None
        self.memory = choose_memory(target, self.options.get("arrays", "auto"))
        self.timings: dict[str, float] = {}  # seconds per compile phase (optimize, lower, build, anchors, plan)
        self.use_cuda_graph = target == "cuda" and bool(options.get("cuda_graph", True))
        self.step_times: list[float] | None = None  # see profile_steps
        self._clock: Any = time.perf_counter
        if self.use_cuda_graph and any(s.kind == "reference" for s in steps):
            names = sorted({s.op.kind for s in steps if s.kind == "reference"})
            log.warning("tessera: %s runs %s on the host, so it is not captured into a CUDA graph", graph.name, names)
            self.use_cuda_graph = False
        if target == "cpu":  # build (or find) the replay trampoline now: calls never compile

            artifact()
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

    def execute(self, arrays: Sequence[Any], symbols: Mapping[str, int] | None = None,
                borrow: frozenset[int] = frozenset()) -> list[Any]:  # fmt: skip
        """Run on the inputs in graph order; `symbols` adds sizes no input shape carries.

        `borrow`: indices of outputs the caller consumes before the next call (an input
        mutation's new value, copied into the input at once); a CUDA-graph replay returns its
        own buffers for them instead of copies."""
        if len(arrays) != len(self.graph.inputs):
            raise ArgumentError(f"graph {self.graph.name} takes {len(self.graph.inputs)} inputs, got {len(arrays)}")
        arrays = [self._check_input(t, a) for t, a in zip(self.graph.inputs, arrays)]
        bindings = dict(symbols or {})
        # Static input shapes need no binding, only a comparison (the per-call host cost of a decode step).
        if self._static_shapes is None or any(tuple(a.shape) != s for a, s in zip(arrays, self._static_shapes)):
            bind_shapes(bindings, [(t.shape, tuple(a.shape), f"input {t.name!r}") for t, a in zip(self.graph.inputs, arrays)])
        key = tuple(sorted(bindings.items()))
        plan = self._plans.get(key)
        if plan is None:
            # The graph's shape assumptions hold for these sizes (or a ShapeError says which fails).
            shapes = propagate_shapes(self.graph, [tuple(a.shape) for a in arrays], bindings)
            with self.memory.owned(), show_progress(self.options.get("progress")):
                plan = self._make_plan(shapes, bindings)
            self._plans[key] = plan
            if len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
            return self._run_eager(plan, arrays)
        self._plans.move_to_end(key)
        if plan.cuda_graph is not None:
            return self._replay(plan, arrays, borrow)
        if self.use_cuda_graph:  # the plan's second call: capture (its warm-up run computes this call)
            with self.memory.owned():
                self._capture(plan, arrays)
            return [self._result(t, arrays, plan.static_outputs, copy=True) for t in self.graph.outputs]
        return self._run_eager(plan, arrays)

    def _check_input(self, t: Tensor, a: Any) -> Any:
        return self.memory.input(a, t.dtype, t.name)

    # ---- plans -----------------------------------------------------------------------------
    def _constant(self, t: Tensor) -> Any:
        if t not in self._constants:
            with self.memory.owned():
                self._constants[t] = self.memory.constant(t.data)
        return self._constants[t]

    def _make_plan(self, shapes: Mapping[Tensor, tuple[int, ...]], bindings: Mapping[str, int]) -> _Plan:
        """A plan for the run-time shapes of every tensor (`propagate_shapes`) and the symbol
        values (input sizes and the graph's opaque sizes)."""
        start = time.perf_counter()
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
        plan.unshared_bytes = sum(sizes.values())
        io_offsets: dict[Tensor, int] = {}
        if self.use_cuda_graph:  # the capture's static inputs and outputs live after the intermediates
            end = plan.arena_bytes
            in_place_inputs = {self.graph.inputs[i] for i in self._pinned}
            for t in [*self.graph.inputs, *(t for t in self.graph.outputs if t.producer is not None)]:
                if t not in io_offsets and t not in in_place_inputs and t not in self._in_place_outputs:
                    io_offsets[t] = end
                    end += _nbytes(plan.shapes[t], t.dtype)
            plan.arena_bytes = end
        plan.arena = self._shared_arena(plan.arena_bytes)
        plan.generation = self._generation
        plan.io = {t: self.memory.view(plan.arena, off, plan.shapes[t], t.dtype) for t, off in io_offsets.items()}
        for t in dtypes:
            plan.buffers[t] = self.memory.view(plan.arena, offsets[t], plan.shapes[t], t.dtype)
        for i, specs in enumerate(temp_specs):
            plan.temps.append([self.memory.view(plan.arena, offsets[(i, j)], shape, dt) for j, (shape, dt) in enumerate(specs)])
        self._add_time("plan", time.perf_counter() - start)
        self._bind_anchors(plan.shapes)
        plan.replayable = self.target == "cpu" and all(s.replayable for s in self.steps)
        return plan

    def _bind_anchors(self, shapes: Mapping[Tensor, tuple[int, ...]]) -> None:
        """Prepare every anchor for these shapes (compiling those not prepared yet)."""
        anchors = [s for s in self.steps if s.kind == "anchor"]
        start = time.perf_counter()
        with bar(anchors, desc=f"{self.graph.name}: preparing {len(anchors)} anchor kernels", unit="kernel") as steps:
            for step in steps:
                step.bind(shapes)
        self._add_time("anchors", time.perf_counter() - start)

    def _shared_arena(self, nbytes: int) -> Any:
        """The arena every plan places its buffers in, grown (dropping the plans on the old one)
        when this plan needs more than it holds."""
        if self._arena is None or nbytes > self._arena_size:
            size = max(nbytes, 1)
            if self._arena is not None and self.target == "cuda":
                size = max(size, int(self._arena_size * ARENA_GROWTH))
            self._plans.clear()  # their buffers and captured graphs point into the old arena
            self._arena = None  # free it before allocating the new one
            self._arena = self.memory.arena(size)
            self._arena_size = size
            self._generation += 1
        return self._arena

    def _add_time(self, phase: str, seconds: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + seconds

    # ---- running ---------------------------------------------------------------------------
    def _run_eager(self, plan: _Plan, arrays: Sequence[Any]) -> list[Any]:
        outs = {t: self.memory.empty(plan.shapes[t], t.dtype) for t in self.graph.outputs
                if t.producer is not None and t not in self._in_place_outputs}  # fmt: skip
        own = list(outs.values())  # the replay substitutes the in-place outputs' addresses as their inputs'
        outs.update(self._outputs_in_inputs(arrays))
        if self.step_times is not None or not plan.replayable:
            self._run_steps(plan, arrays, outs)
        elif plan.replay is not None:
            plan.replay(arrays, own)
        else:  # the plan's first call records its C calls (see cpu_replay)
            plan.replay = Replay.record(lambda: self._run_steps(plan, arrays, outs), arrays, own)
        return [self._result(t, arrays, outs) for t in self.graph.outputs]

    def _outputs_in_inputs(self, arrays: Sequence[Any]) -> dict[Tensor, Any]:
        """The in-place outputs, each bound to this call's input array."""
        return {t: arrays[i] for t, i in self._in_place_outputs.items()}

    def _run_steps(self, plan: _Plan, arrays: Sequence[Any], outs: Mapping[Tensor, Any]) -> None:
        env: dict[Tensor, Any] = dict(zip(self.graph.inputs, arrays))
        env.update(plan.buffers)
        env.update(outs)
        times, clock = self.step_times, self._clock
        with self.memory.running():
            for i, (step, temps) in enumerate(zip(self.steps, plan.temps)):
                ins = [env[t] if t in env else self._constant(t) for t in step.inputs]
                start = clock() if times is not None else 0.0
                step.run(ins, [env[t] for t in step.outputs], temps, plan.bindings)
                if times is not None:
                    times[i] += clock() - start
            for t, k in self._copied_outputs.items():  # after every reader of the inputs' old values
                self.memory.copy_into(arrays[k], env[t])

    def _result(self, t: Tensor, arrays: Sequence[Any], outs: Mapping[Tensor, Any], copy: bool = False) -> Any:
        """Output t: the buffer a step wrote (copied if asked), else a copy of the input or
        constant it passes through -- taken from `arrays`, the inputs of THIS call.  An in-place
        output is this call's input array itself."""
        if t in self._in_place_outputs or t in self._copied_outputs:
            return arrays[self._in_place_outputs.get(t, self._copied_outputs.get(t))]
        if t in outs:
            return self.memory.clone(outs[t]) if copy else outs[t]
        source = arrays[self.graph.inputs.index(t)] if t in self.graph.inputs else self._constant(t)
        return self.memory.clone(source)

    def _capture(self, plan: _Plan, arrays: Sequence[Any]) -> None:
        # In-place inputs are captured where the caller keeps them, the others in static copies.
        plan.static_inputs = [a if t not in plan.io else plan.io[t] for t, a in zip(self.graph.inputs, arrays)]
        for static, a in zip(plan.static_inputs, arrays):
            if static is not a:
                self.memory.copy_into(static, a)
        plan.pinned = {i: self.memory.address(arrays[i]) for i in self._pinned}
        outs = {t: plan.io[t] for t in self.graph.outputs if t.producer is not None and t not in self._in_place_outputs}
        outs.update(self._outputs_in_inputs(arrays))
        # The capture's warm-up run computes this call's results (see the module docstring).
        plan.cuda_graph = self.memory.capture(lambda: self._run_steps(plan, plan.static_inputs, outs))
        plan.static_outputs = outs

    def _replay(self, plan: _Plan, arrays: Sequence[Any], borrow: frozenset[int] = frozenset()) -> list[Any]:
        """Copy this call's inputs in, replay, and hand back copies of what the replay wrote.
        Outputs no step writes (an input or constant passed through) come from this call's
        inputs, never from the capture: the replay does not produce them.  An in-place input
        that is not where the capture saw it runs the plan without its graph."""
        for i, address in plan.pinned.items():
            if self.memory.address(arrays[i]) != address:
                log.info("tessera: %s: in-place input %r moved since the capture; running without the CUDA graph",
                         self.graph.name, self.graph.inputs[i].name)  # fmt: skip
                return self._run_eager(plan, arrays)
        for k, (static, a) in enumerate(zip(plan.static_inputs, arrays)):
            if k not in plan.pinned:
                self.memory.copy_into(static, a)
        self.memory.replay(plan.cuda_graph)
        return [self._result(t, arrays, plan.static_outputs, copy=j not in borrow) for j, t in enumerate(self.graph.outputs)]

    def prepare(self, symbols: Mapping[str, int]) -> None:
        """Prepare (compile and load) the anchors for these values of the symbolic sizes
        without running anything; the first call with such inputs would do it otherwise."""
        inputs = [tuple(int(evaluate(d, symbols)) for d in t.shape) for t in self.graph.inputs]
        shapes = propagate_shapes(self.graph, inputs, dict(symbols))
        with show_progress(self.options.get("progress")):
            self._bind_anchors(shapes)

    def artifacts(self) -> tuple[list[Path], list[tuple[str, str]]]:
        """The built artifacts (cache paths) of every kernel compiled or prepared so far, and
        the tuning records (key, winner) that chose the prepared anchors' schedules."""
        paths: dict[Path, None] = {}
        tuning: dict[tuple[str, str], None] = {}
        if self.target == "cpu":  # the replay trampoline (cpu_runner), so a loaded graph needs no compiler for it

            trampoline = artifact()
            if trampoline is not None:
                paths[trampoline] = None
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
        path = Path(path)
        if not path.parent.is_dir():
            raise ArgumentError(f"cannot save to {path}: the folder {path.parent} does not exist")
        runs = [dict(s) for s in sizes] + ([{}] if not self.graph.symbols() else [])
        for symbols in runs:
            self.prepare(symbols)
        artifacts, tuning = self.artifacts()
        archive.write(path, self.graph, self.target, self.options, artifacts, tuning)

    def profile_steps(self, on: bool = True, clock: Any = time.perf_counter) -> None:
        """Time each step of the calls from now on (`on`), summed into `step_times` (seconds
        per step, in `steps` order; bench/cpu_profile.py prints them), or stop timing.  `clock`
        reads the time: host wall time by default (the kernels' time on the CPU, launch time
        only on the GPU), or e.g. time.process_time for CPU time, which a loaded machine's
        other processes do not inflate."""
        self.step_times = [0.0] * len(self.steps) if on else None
        self._clock = clock

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
            "fused_ops": sum(len(s.group.members) - 1 for s in self.steps if s.kind == "anchor"),
            "cuda_graph": self.use_cuda_graph,
            "arena_bytes": {str(dict(k)): p.arena_bytes for k, p in self._plans.items()},
            "shared_arena_bytes": self._arena_size,
        }

    def report(self) -> Any:
        """A `GraphReport`: each kernel with the operators fused into it, the template and
        configuration of each anchor (tuned or chosen by the cost model), the operators left to
        the numpy references and why, the memory plan per shape and the compile time by phase.
        `print(compiled.report())` (or `tessera.explain(compiled)`) shows it."""
        return graph_report(self)

    def __repr__(self) -> str:
        s = self.summary()
        return f"<CompiledGraph {self.graph.name} {self.target}: {s['operators']} ops -> {s['steps']}, {s['kernels']} kernels>"


class _Shaped:
    """A stand-in array (shape and dtype only) for computing temporary sizes."""

    def __init__(self, shape: tuple[int, ...], dt: DataType):
        self.shape, self.dtype_ = shape, dt

    def __tessera_view__(self) -> Any:
        return ArrayView(0, tuple(self.shape), self.dtype_, "cpu", True, None)

