"""The steps of a compiled graph: what each partition group turns into, and how it runs.

A step reads and writes arrays that the compiled graph hands it (numpy arrays on the CPU,
torch tensors on the GPU); it never allocates at run time, so that a whole GPU run can be
captured into one CUDA graph.  Fused groups share their CompiledOp when they are the same
computation on the same shapes (the 22 identical layers of a Llama build once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tessera import ops
from tessera.graph.compiler.partition import Group
from tessera.graph.executor import NumpyBackend
from tessera.graph.lowering import dim_expr, lower_operator
from tessera.graph.operator import Operator
from tessera.graph.symbolic import ShapeError, evaluate
from tessera.graph.tensor import Tensor
from tessera.ir.compute import Placeholder, TensorNode, inputs_of
from tessera.ir.dtypes import numpy_dtype
from tessera.ops.compiled import numpy_to_torch, torch_to_numpy
from tessera.templates.kernel import CpuAnchorKernel


def group_signature(group: Group) -> str:
    """Structure of a group without its tensors' identities: equal signatures compute the same
    function of their inputs (constants are inputs, so layers with different weights match;
    the values of rank-0 constants are part of it: `lower_group` folds them into the code)."""
    local: dict[Tensor, str] = {t: f"in{i}:{t.dtype.name}{list(t.shape)}{_scalar_value(t)}" for i, t in enumerate(group.inputs)}
    parts = []
    for k, op in enumerate(group.members):
        attrs = sorted((name, repr(value)) for name, value in op.attrs.items())
        parts.append(f"{op.kind}{attrs}({','.join(local[t] for t in op.inputs)})")
        for j, t in enumerate(op.outputs):
            local[t] = f"op{k}.{j}"
    parts.append("->" + ",".join(local[t] for t in group.outputs))
    return ";".join(parts)


def _scalar_value(t: Tensor) -> str:
    """`=value` for a rank-0 constant (folded into the kernel), else nothing."""
    if t.is_constant and t.ndim == 0:
        value = t.data.item()  # type: ignore[union-attr]
        return f"={value!r}" if value == value else "=nan"  # nan != nan would split equal groups
    return ""


def lower_group(group: Group, symbols: dict[str, Any], concrete: Mapping[Tensor, tuple[int, ...]] | None = None,
                nodes: list[list[TensorNode]] | None = None) -> tuple[list[TensorNode], list[Placeholder]]:  # fmt: skip
    """Compute definitions of a group's outputs over placeholders for its inputs.

    With `concrete`, input shapes are those ints (anchor epilogues are built per shape);
    otherwise symbolic graph dimensions become int32 expressions over `symbols`.  `nodes`,
    when given, receives each operator's output nodes, in the group's operator order (which
    kernel computes which operator: `FusedStep.kernel_ops`)."""
    env: dict[Tensor, TensorNode] = {}
    placeholders = []
    for i, t in enumerate(group.inputs):
        shape = concrete[t] if concrete is not None else tuple(dim_expr(d, symbols) for d in t.shape)
        env[t] = ops.placeholder(shape, t.dtype, f"in{i}")
        placeholders.append(env[t])
    known: set[TensorNode] = set(placeholders)
    for op in group.members:
        # Rank-0 constants become numbers in the code (pow(x, 3.0) is x * x * x; group_signature
        # keeps groups with other values apart).
        outs = lower_operator(op, [env[t] for t in op.inputs], symbols, inline_scalars=True)
        env.update(zip(op.outputs, outs))
        if nodes is not None:
            nodes.append(_new_nodes(outs, known))
    return [env[t] for t in group.outputs], placeholders


def _new_nodes(outs: Sequence[TensorNode], known: set[TensorNode]) -> list[TensorNode]:
    """The nodes `outs` depend on that are not in `known` (what one operator's lowering
    created), added to `known`."""
    found: list[TensorNode] = []
    stack = list(outs)
    while stack:
        t = stack.pop()
        if t in known:
            continue
        known.add(t)
        found.append(t)
        stack.extend(inputs_of(t))
    return found


class FusedStep:
    """A fused group run by its CompiledOp; temporaries come from the memory plan."""

    kind = "fused"

    def __init__(self, group: Group, compiled: Any, op_nodes: Sequence[Sequence[TensorNode]] = ()):
        self.group, self.compiled = group, compiled
        self.inputs, self.outputs = group.inputs, group.outputs
        # Per operator of the group (by position: merged groups share one lowering), the
        # compute nodes its lowering created in `compiled`; empty when unknown.
        self.op_nodes = [list(n) for n in op_nodes]

    def kernel_ops(self) -> list[tuple[Any, list[Operator]]]:
        """(kernel spec, the group's operators it computes) per kernel, in launch order.  An
        operator inlined into its consumers counts in every kernel that recomputes it; one
        lowered to a view of its input (a reshape) computes nothing and is in none."""
        return kernel_operators(self.compiled.kernels, self.group.ops, self.op_nodes)

    def temporaries(self, arrays: Sequence[Any], symbols: Mapping[str, int]) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, dtype) of every temporary buffer for these inputs."""
        temps = self.compiled.temporaries
        return list(zip(self.compiled.shapes_for(temps, arrays, symbols), [t.dtype for t in temps]))

    def run(self, arrays: Sequence[Any], outs: Sequence[Any], temps: Sequence[Any], symbols: Mapping[str, int]) -> None:
        self.compiled.run(arrays, outs, symbols=symbols, temporaries=temps)

    @property
    def replayable(self) -> bool:
        """A CPU CompiledOp given its temporaries only launches its kernels (cpu_replay)."""
        return self.compiled.target == "cpu"

    @property
    def num_kernels(self) -> int:
        return self.compiled.num_kernels


def kernel_operators(kernels: Sequence[Any], ops: Sequence[Operator], op_nodes: Sequence[Sequence[TensorNode]]
                     ) -> list[tuple[Any, list[Operator]]]:  # fmt: skip
    """Which operators each kernel computes: a kernel covers the nodes it stores or reduces
    and every node they read that no other kernel materialises (those were inlined)."""
    owner: dict[TensorNode, int] = {}
    for k, spec in enumerate(kernels):
        for t in [*spec.plan.stores, *spec.plan.reductions]:
            owner[t] = k  # the last writer: a program's tasks, not the kernel writing its initial values
    covered: list[set[TensorNode]] = []
    for k, spec in enumerate(kernels):
        seen: set[TensorNode] = set()
        stack = [*spec.plan.stores, *spec.plan.reductions]
        while stack:
            t = stack.pop()
            if t in seen or isinstance(t, Placeholder) or owner.get(t, k) != k:
                continue
            seen.add(t)
            stack.extend(inputs_of(t))
        covered.append(seen)
    result = []
    for spec, nodes in zip(kernels, covered):
        members = [op for op, outs in zip(ops, op_nodes) if any(t in nodes for t in outs)]
        result.append((spec, members))
    return result


class AnchorStep:
    """An anchor group: a kernel template with its epilogue, prepared per concrete shape."""

    kind = "anchor"

    def __init__(self, group: Group, prepare: Any):
        self.group = group
        self.anchor = group.anchor
        self.inputs, self.outputs = group.inputs, group.outputs
        self._prepare = prepare  # (group, shapes) -> kernel(arrays, outs) with .artifacts and .tuning
        self._kernels: dict[tuple, Any] = {}

    def bind(self, shapes: Mapping[Tensor, tuple[int, ...]]) -> Any:
        key = tuple(shapes[t] for t in self.inputs)
        if key not in self._kernels:
            self._kernels[key] = self._prepare(self.group, shapes)
        return self._kernels[key]

    def prepared(self) -> list[Any]:
        """The kernels prepared so far, one per distinct input shape."""
        return list(self._kernels.values())

    @property
    def replayable(self) -> bool:
        """Every prepared kernel only launches C kernels (cpu_replay): a CPU template, or the
        generic kernels of a CPU CompiledOp (whose temporaries the replay keeps alive)."""
        def launches_only(k: Any) -> bool:
            compiled = getattr(k, "compiled", None)
            return isinstance(getattr(k, "kernel", None), CpuAnchorKernel) or getattr(compiled, "target", None) == "cpu"

        return all(launches_only(k) for k in self._kernels.values())

    def prepared_by_shape(self) -> list[tuple[tuple, Any]]:
        """(input shapes, kernel) of every kernel prepared so far."""
        return list(self._kernels.items())

    def temporaries(self, arrays: Sequence[Any], symbols: Mapping[str, int]) -> list:
        """The buffers the kernel for these input shapes takes per call: a low-bit prefill's
        dequantised weights (tessera.templates.lowbit.plan), the only template that takes any, so only it
        is prepared here (the others in `_bind_anchors`, whose time the report shows)."""
        if self.anchor.kind != "lowbit_linear":
            return []
        shapes = {t: tuple(a.shape) for t, a in zip(self.inputs, arrays)}
        shapes.update({t: tuple(int(evaluate(d, symbols)) for d in t.shape) for t in self.outputs})
        return list(getattr(self.bind(shapes), "temporaries", ()))

    def run(self, arrays: Sequence[Any], outs: Sequence[Any], temps: Sequence[Any], symbols: Mapping[str, int]) -> None:
        shapes = {t: tuple(a.shape) for t, a in zip(self.inputs, arrays)}
        if temps:
            self.bind(shapes)(arrays, outs, temps)
        else:
            self.bind(shapes)(arrays, outs)

    @property
    def num_kernels(self) -> int:
        return 1


class ReferenceStep:
    """One operator tessera does not compile, run by its numpy reference (GPU data makes a
    round trip through the host, so such a graph cannot be captured)."""

    kind = "reference"
    replayable = False  # it computes in numpy

    def __init__(self, group: Group):
        self.group = group
        self.op: Operator = group.ops[0]
        self.inputs, self.outputs = group.inputs, group.outputs
        self.kernel = NumpyBackend().prepare(self.op)

    def temporaries(self, arrays: Sequence[Any], symbols: Mapping[str, int]) -> list:
        return []

    def run(self, arrays: Sequence[Any], outs: Sequence[Any], temps: Sequence[Any], symbols: Mapping[str, int]) -> None:
        by_tensor = dict(zip(self.inputs, arrays))  # the group's inputs are distinct; the op may repeat one
        results = self.kernel([_to_numpy(by_tensor[t]) for t in self.op.inputs], symbols)
        for t, r, out in zip(self.outputs, results, outs):
            _copy_into(out, r, f"{self.op.name} ({self.op.kind}) output {t.name}")

    @property
    def num_kernels(self) -> int:
        return 0


def _to_numpy(a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "numpy") and not type(a).__module__.startswith("torch"):  # a tessera DeviceArray
        return a.numpy()

    return torch_to_numpy(a)


def _copy_into(out: Any, value: np.ndarray, what: str) -> None:
    """Copy a reference result into its planned buffer, which must have exactly its shape
    (the same number of elements in another shape would be a different tensor)."""
    if tuple(value.shape) != tuple(out.shape):
        raise ShapeError(f"{what}: the reference computed shape {list(value.shape)}, but the compiled graph "
                         f"planned {list(out.shape)} for it; the graph's shape inference and the operator's "
                         f"reference disagree, which is a bug in that operator's definition")  # fmt: skip
    if isinstance(out, np.ndarray):
        out[...] = value
    elif not type(out).__module__.startswith("torch"):  # a tessera DeviceArray

        out.copy_(np.asarray(value).astype(numpy_dtype(out.dtype), copy=False))
    else:
        out.copy_(numpy_to_torch(value))
