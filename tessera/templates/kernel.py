"""AnchorKernel: the kernels of one anchor operator, compiled in one nvcc run, launched without allocating;
CpuAnchorKernel: the C kernels of one anchor operator, called on numpy arrays without allocating.

A plan (`AnchorPlan`) is a list of launches.  Each launch is an IR function and, per
parameter, where its argument comes from at call time: one of the anchor's inputs, the
output, one of the epilogue's extras, or a workspace allocated once when the plan is
loaded.  Plans are made without a GPU (their CUDA source can be inspected and compiled
anywhere); `AnchorPlan.load()` compiles, loads and allocates the workspaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.ir import expr as E
from tessera.ir.dtypes import DataType
from tessera.ir.evaluate import evaluate
from tessera.ir.func import Function
from tessera.jit import build_source, generate_source, load_function
from tessera.ops import generate
from tessera.runtime.cuda import DeviceArray, current_stream
from tessera.runtime.tensor_map import Im2colWindow, TensorMap
from tessera.templates.rewrite import rename
from tessera.transforms.pipeline import lower

# Where a kernel argument comes from: (source, index) with source one of these; a TENSOR_MAP
# slot is the plan's tensor_maps[index], encoded at call time over its operand's address; a
# CONSTANT slot is the plan's constants[index] (CPU: weights packed at plan time); a TEMPORARY
# slot is a buffer of the plan's `temporaries` that the caller passes with each call (the graph
# compiler places it in its arena, alive during the step only, unlike a workspace, which the
# kernel owns for its whole life).
INPUT, OUTPUT, EXTRA, WORKSPACE, LITERAL, TENSOR_MAP, CONSTANT, TEMPORARY = range(8)
Slot = tuple[int, int]


@dataclass(frozen=True)
class MapSpec:
    """A TMA tensor map over one operand: where the operand comes from, the row-major shape the
    kernel reads it as, its dtype and the box of one copy; with a `window`, an im2col map whose
    box is (pixels, channels) (an implicit-GEMM convolution's input); `swizzle` the shared-memory
    swizzle in bytes of a tiled map (0: boxes land as they are)."""

    operand: Slot
    dtype: DataType
    shape: tuple[int, ...]  # one size may be -1: the operand's element count gives it per call (free rows)
    box: tuple[int, ...]
    window: Im2colWindow | None = None
    swizzle: int = 128

    def call_shape(self, operand: Any) -> tuple[int, ...]:
        """The shape the map describes over this call's operand (the free size filled in)."""
        if -1 not in self.shape:
            return self.shape
        known = prod(d for d in self.shape if d != -1)
        return tuple(prod(operand.shape) // known if d == -1 else d for d in self.shape)

    def encode(self, ptr: int, shape: tuple[int, ...] | None = None) -> TensorMap:
        """The map over the operand at device address `ptr` (of `shape`, default the spec's)."""
        shape = shape or self.shape
        if self.window is None:
            return TensorMap.from_pointer(ptr, self.dtype, shape, self.box, self.swizzle)
        return TensorMap.im2col_from_pointer(ptr, self.dtype, shape, self.window, *self.box)


@dataclass
class Launch:
    """One kernel launch: the (unlowered) function and the source of each parameter."""

    func: Function
    slots: list[Slot]
    lowered: Function | None = None  # when the caller lowered it already (tessera.ops kernels)
    generic: bool = False  # shape symbols left free, bound from each call's arrays (a CPU kernel generic in its rows)

    def __post_init__(self) -> None:
        if len(self.slots) != len(self.func.params):
            raise ValueError(f"{self.func.name}: {len(self.func.params)} parameters but {len(self.slots)} argument slots")
        if self.func.shape_params and not self.generic:
            raise ValueError(f"{self.func.name}: shape symbols {[s.name for s in self.func.shape_params]} are not bound")


@dataclass
class AnchorPlan:
    """Launches, workspaces and the call signature of an anchor, not compiled yet.  Plans build
    independently (`build_all` compiles several at once)."""

    name: str
    launches: list[Launch]
    out_shape: tuple[int, ...]
    out_dtype: DataType
    num_inputs: int
    num_extras: int
    workspaces: list[tuple[tuple[int, ...], DataType]] = field(default_factory=list)
    zeroed: set[int] = field(default_factory=set)  # workspaces zeroed at load (a kernel leaves them at zero)
    aligned_inputs: list[int] = field(default_factory=list)  # read with 16-byte vector copies
    aligned_output: bool = False  # written with 16-byte vector copies
    tensor_maps: list[MapSpec] = field(default_factory=list)
    config: Any = None
    target: str = "cuda"  # or "cpu": C kernels called on numpy arrays (tessera.templates.cpu.gemm)
    constants: list[Any] = field(default_factory=list)  # CONSTANT slots: arrays made at plan time (packed weights)
    temporaries: list[tuple[tuple[int, ...], DataType]] = field(default_factory=list)  # TEMPORARY slots (per call)
    helpers: list[str] = field(default_factory=list)  # artifacts of kernels run at plan time (the weight packer)
    _source: str | None = None

    def tensor_map(self, spec: MapSpec) -> Slot:
        self.tensor_maps.append(spec)
        return (TENSOR_MAP, len(self.tensor_maps) - 1)

    def workspace(self, shape: Sequence[int], dtype: DataType, zeroed: bool = False) -> Slot:
        """A buffer the kernel owns for its life; `zeroed`: zero at load, for kernels that keep it
        zero at rest (sums and tickets between blocks, as the register-A GEMM's stream-K)."""
        self.workspaces.append((tuple(int(s) for s in shape), dtype))
        if zeroed:
            self.zeroed.add(len(self.workspaces) - 1)
        return (WORKSPACE, len(self.workspaces) - 1)

    def temporary(self, shape: Sequence[int], dtype: DataType) -> Slot:
        """A buffer the caller passes with each call (`kernel(inputs, out, extras, temps)`)."""
        self.temporaries.append((tuple(int(s) for s in shape), dtype))
        return (TEMPORARY, len(self.temporaries) - 1)

    @property
    def lowered(self) -> list[Function]:
        for launch in self.launches:
            if launch.lowered is None:
                launch.lowered = lower(launch.func)
        return [launch.lowered for launch in self.launches]  # type: ignore[misc]

    @property
    def source(self) -> str:
        """The CUDA (or C) source of every kernel of the anchor (one compilation unit)."""
        if self._source is None:
            self._source = generate_source(self.lowered, self.target)
        return self._source

    def build(self, arch: str | None = None) -> str:
        """Compile (or fetch from the artifact cache) and return the artifact's path (a cubin, or a
        CPU plan's shared library)."""
        if self.target == "cpu":
            return str(build_source(self.source, "cpu"))
        return str(build_source(self.source, "cuda", arch))

    def load(self, arch: str | None = None) -> Any:
        """Compile, load the kernels and allocate the workspaces on the current CUDA device
        (a CPU plan: gcc, and 64-byte aligned numpy workspaces; see CpuAnchorKernel)."""

        path = Path(self.build(arch))
        if self.target == "cpu":
            return CpuAnchorKernel(self, path)
        kernels = [load_function(launch.func, path, "cuda", low.launch) for launch, low in zip(self.launches, self.lowered)]
        # Workspaces are tessera device arrays, whatever arrays the kernel is called on: torch
        # is not needed, and their memory lives as long as the kernel.
        ws = [DeviceArray.from_numpy(np.zeros(shape, dt.name)) if i in self.zeroed else DeviceArray(shape, dt)
              for i, (shape, dt) in enumerate(self.workspaces)]  # fmt: skip
        return AnchorKernel(self, kernels, ws, path)


def ops_launches(plan: AnchorPlan, outputs: Sequence[Any], inputs: Sequence[Any], slots: dict[Any, Slot], name: str,
                 target: str = "cuda") -> None:  # fmt: skip
    """Append the kernels tessera.ops schedules for `outputs` (compute definitions over the
    placeholders `inputs`) to `plan`.  `slots` says where each input and output lives; any
    tensor the scheduler materialises in between gets a workspace."""

    gen = generate(list(outputs), list(inputs), target, name=name)
    for spec, low in zip(gen.kernels, gen.lowered):
        for t in spec.tensors:
            if t not in slots:
                slots[t] = plan.workspace(tuple(int(evaluate(d, {})) for d in t.shape) or (1,), t.dtype)
        args = [slots[t] for t in spec.tensors] + [(LITERAL, int(evaluate(e, {}))) for _, e in spec.scalars]
        plan.launches.append(Launch(rename(spec.func, spec.name), args, low))


class PreparedAnchor:
    """What a loaded plan has on every target: the plan, its artifact and workspaces, and the
    check of a call's operand counts (AnchorKernel on CUDA, CpuAnchorKernel on the CPU)."""

    def __init__(self, plan: AnchorPlan, workspaces: list[Any], artifact: Any = None):
        self.plan = plan
        self.artifact = artifact  # the cubin or shared library in the artifact cache (a saved graph ships it)
        self.out_shape: tuple[int, ...] = plan.out_shape
        self.out_dtype: DataType = plan.out_dtype
        self.config = plan.config
        self.workspaces = workspaces

    @property
    def kernels(self) -> list[str]:
        """The launched kernels' names, in order (the GEMM's name carries its configuration)."""
        return [launch.func.name for launch in self.plan.launches]

    @property
    def source(self) -> str:
        return self.plan.source

    @property
    def temporaries(self) -> list[tuple[tuple[int, ...], DataType]]:
        """(shape, dtype) of the buffers each call passes (`temps`), in order."""
        return list(self.plan.temporaries)

    def _checked_temps(self, temps: Sequence[Any]) -> Sequence[Any]:
        if len(temps) != len(self.plan.temporaries):
            raise ArgumentError(f"{self.plan.name}: takes {len(self.plan.temporaries)} temporary buffers "
                                f"({self.plan.temporaries}), got {len(temps)}")  # fmt: skip
        return temps

    def _checked_extras(self, inputs: Sequence[Any], extras: Sequence[Any]) -> list[Any]:
        """Raise ArgumentError unless the call passes the plan's numbers of inputs and extras;
        return the extras with a rank-0 one (a scalar operand of the epilogue) as one element."""
        plan = self.plan
        if len(inputs) != plan.num_inputs:
            raise ArgumentError(f"{plan.name}: takes {plan.num_inputs} inputs, got {len(inputs)}")
        if len(extras) != plan.num_extras:
            raise ArgumentError(f"{plan.name}: its epilogue takes {plan.num_extras} extra tensors, got {len(extras)}")
        return [e.reshape(1) if getattr(e, "ndim", 1) == 0 else e for e in extras]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.plan.name} -> {self.out_dtype}{list(self.out_shape)}: {', '.join(self.kernels)}>"


class AnchorKernel(PreparedAnchor):
    """A prepared anchor operator: call `kernel(inputs, out, extras)` on torch CUDA tensors or
    tessera DeviceArrays.

    Launches on the current stream (tessera.runtime.cuda.current_stream: tessera's
    `use_stream` block, else torch's current stream) and allocates nothing per call (workspaces belong to
    the kernel, so one AnchorKernel must not run on two streams at once), which makes it safe
    to capture in a CUDA graph.  `out` must be a contiguous tensor of `out_shape` and
    `out_dtype`; inputs and extras must be contiguous, with the shapes given at prepare time.
    """

    def __init__(self, plan: AnchorPlan, kernels: list[Any], workspaces: list[Any], artifact: Any = None):
        super().__init__(plan, workspaces, artifact)
        self._steps = [(k, list(launch.slots)) for k, launch in zip(kernels, plan.launches)]
        self._aligned = list(plan.aligned_inputs)
        self._aligned_output = plan.aligned_output
        self._maps = list(plan.tensor_maps)
        self._encoded: list[dict[tuple, Any]] = [{} for _ in self._maps]  # per map: (address, shape) -> TensorMap
        # A launch generic in its rows reads an operand as a view with the rows flattened ([..., K] as [1, M, K]).
        self._views = [[_free_view(q) for q in launch.func.params] if launch.generic else None
                       for launch in plan.launches]  # fmt: skip

    def sibling(self, *, workspaces: bool = True) -> AnchorKernel:
        """The same plan and loaded kernels with workspaces and tensor-map caches of its own: another
        step running this plan (tessera.graph.compiler.build shares a plan between equal groups).
        `workspaces=False` makes a template that only makes siblings (it holds no device memory)."""

        ws = [DeviceArray(shape, dt) for shape, dt in self.plan.workspaces] if workspaces else []
        return AnchorKernel(self.plan, [k for k, _ in self._steps], ws, self.artifact)

    def __call__(self, inputs: Sequence[Any], out: Any, extras: Sequence[Any] = (), temps: Sequence[Any] = ()) -> None:
        extras = self._checked_extras(inputs, extras)
        temps = self._checked_temps(temps)
        for i in self._aligned:
            ptr = inputs[i].data_ptr() if hasattr(inputs[i], "data_ptr") else 0
            if ptr % 16:
                raise ArgumentError(f"{self.plan.name}: input {i} must start on a 16-byte boundary (its data is read "
                                    "with 16-byte copies); pass a fresh contiguous tensor")  # fmt: skip
        if self._aligned_output and out.data_ptr() % 16:
            raise ArgumentError(f"{self.plan.name}: the output must start on a 16-byte boundary (it is written with "
                                "16-byte copies); pass a fresh contiguous tensor")  # fmt: skip
        maps = self._tensor_maps((inputs, (out,), extras, self.workspaces, (), (), (), temps))
        sources = (inputs, (out,), extras, self.workspaces, (), maps, (), temps)
        stream = current_stream((out,))  # once, not once per launch
        for (kernel, slots), views in zip(self._steps, self._views):
            args = [sources[s][i] if s != LITERAL else i for s, i in slots]
            if views is not None:
                args = [a if view is None else a.reshape(view) for a, view in zip(args, views)]
            kernel.launch(args, stream)

    def _tensor_maps(self, sources: Sequence[Sequence[Any]]) -> list[Any]:
        """The plan's tensor maps over this call's operands, `sources` by slot kind (encoded
        once per address and shape and kept: a CUDA-graph replay passes the same buffers every time)."""
        if not self._maps:
            return []
        maps = []
        for spec, cache in zip(self._maps, self._encoded):
            operand = sources[spec.operand[0]][spec.operand[1]]
            key = (operand.data_ptr(), spec.call_shape(operand))
            tmap = cache.get(key)
            if tmap is None:
                if len(cache) >= 16:
                    cache.pop(next(iter(cache)))
                tmap = cache[key] = spec.encode(*key)
            maps.append(tmap)
        return maps


def aligned_empty(shape: Sequence[int], dtype: Any, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    raw = np.empty(n + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start: start + n].view(dt).reshape(tuple(shape))


def _call_shape(param: Any) -> tuple[int, ...] | None:
    """The shape a tensor parameter reads its argument as (-1 for its one free shape symbol, whose
    size the argument's element count gives), or None when the argument is passed as it is."""
    dims = getattr(param.type, "shape", None)
    if dims is None or sum(not isinstance(d, E.Const) for d in dims) > 1:
        return None
    return tuple(int(d.value) if isinstance(d, E.Const) else -1 for d in dims)


def _free_view(param: Any) -> tuple[int, ...] | None:
    """The view a generic launch passes for a parameter with one free size (-1), else None."""
    shape = _call_shape(param)
    return shape if shape is not None and -1 in shape else None


class CpuAnchorKernel(PreparedAnchor):
    """A prepared CPU anchor: call `kernel(inputs, out, extras)` on numpy arrays (or CPU torch
    tensors).  Workspaces (per-worker packing buffers) belong to the kernel and are allocated
    once, 64-byte aligned: one CpuAnchorKernel must not run in two threads at once."""

    def __init__(self, plan: AnchorPlan, library: Path):
        workspaces = [aligned_empty(shape, dt.name) for shape, dt in plan.workspaces]
        for i in plan.zeroed:
            workspaces[i].fill(0)
        super().__init__(plan, workspaces, library)
        # What a saved graph ships: the library, and the kernels the plan ran (packing a constant
        # weight), which a graph loaded without a compiler runs again.
        self.artifacts = [str(library), *plan.helpers]
        kernels = [load_function(launch.func, library, "cpu") for launch in plan.launches]
        self._steps = [(k, list(launch.slots), [_call_shape(q) for q in launch.func.params],
                        [getattr(q.type, "rank", 0) for q in launch.func.params])  # 0: a scalar (a LITERAL slot's int)
                       for k, launch in zip(kernels, plan.launches)]  # fmt: skip

    def __call__(self, inputs: Sequence[Any], out: Any, extras: Sequence[Any] = ()) -> None:
        extras = self._checked_extras(inputs, extras)
        sources = (inputs, (out,), extras, self.workspaces, None, None, self.plan.constants)
        for kernel, slots, shapes, ranks in self._steps:
            args = [i if s == LITERAL else sources[s][i] for s, i in slots]
            # Operands the kernel reads as another view of the same memory ([..., K] as [M, K], OIHW as [O, K]);
            # one of lower rank whose sizes are free gets leading ones (a [B, S] mask read as [B, 1, 1, S]).
            kernel([a.reshape(shape) if shape is not None and tuple(a.shape) != shape
                    else a.reshape((1,) * (rank - a.ndim) + tuple(a.shape)) if rank and a.ndim < rank else a
                    for a, shape, rank in zip(args, shapes, ranks)])  # fmt: skip


def build_all(plans: Sequence[AnchorPlan]) -> list[Any]:
    """Compile several plans at once (the compilers run in parallel threads; the artifact cache
    keeps each result), then load them in order."""
    if len(plans) > 1:
        with ThreadPoolExecutor(max_workers=min(len(plans), 8)) as pool:
            list(pool.map(AnchorPlan.build, plans))
    return [plan.load() for plan in plans]
