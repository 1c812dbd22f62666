"""The interim executor: runs a FlowGraph operator by operator, with a pluggable backend per operator.

Each `Backend` is asked, in order, to `prepare` an operator; the first that returns a
kernel runs it.  `NumpyBackend` (the reference implementations) accepts every operator and
is always last.  The compiled executor will put a backend first whose kernels come from
`tessera.ops` and that fuses operators; the interface (`Backend`, `OpKernel`) is in
tessera.graph.backend_protocol and importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tessera.errors import ArgumentError, DivisionByZeroError
from tessera.graph.backend_protocol import Backend, OpKernel
from tessera.graph.flow_graph import FlowGraph, provide
from tessera.graph.operator import Operator
from tessera.graph.registry import get_op
from tessera.graph.shape_check import propagate_shapes
from tessera.graph.symbolic import bind_shapes, contains_sym, evaluate
from tessera.graph.tensor import Tensor
from tessera.ir.dtypes import numpy_dtype


class NumpyBackend:
    """Runs every operator with its numpy reference implementation (slow, exact semantics)."""

    name = "numpy"

    def prepare(self, op: Operator) -> OpKernel:
        opdef = get_op(op.kind)
        attrs = opdef.normalize_attrs(op.attrs)
        symbolic = contains_sym(list(attrs.values()))
        out_types = [(numpy_dtype(t.dtype), t.ndim) for t in op.outputs]

        def kernel(inputs: Sequence[Any], bindings: Mapping[str, int]) -> list[np.ndarray]:
            a = {k: evaluate(v, bindings) for k, v in attrs.items()} if symbolic else attrs
            try:
                results = opdef.reference([np.asarray(x) for x in inputs], a)
            except DivisionByZeroError:
                raise  # the documented semantics of integer division by zero, as on the CPU
            except (ValueError, TypeError, IndexError, ZeroDivisionError, FloatingPointError) as exc:
                # Data the operator cannot take (an index out of range, an integer to a negative power).
                raise ArgumentError(f"{op.name} ({op.kind}) cannot compute these inputs: {exc}") from exc
            outs = []
            for r, (dt, ndim) in zip(results, out_types):
                r = np.asarray(r)
                if r.ndim != ndim:
                    raise AssertionError(f"{op.name} ({op.kind}) reference gave rank {r.ndim}, expected {ndim}")
                outs.append(r.astype(dt, copy=False))
            return outs

        return kernel


class Executor:
    """Prepared operators of one graph; `run` binds symbolic sizes and executes in order,
    dropping each intermediate value after its last use."""

    def __init__(self, graph: FlowGraph, backends: Sequence[Backend] | None = None):
        self.graph = graph
        chain = list(backends or []) + [NumpyBackend()]
        self.steps: list[tuple[Operator, OpKernel, str]] = []
        for op in graph.operators:
            for backend in chain:
                kernel = backend.prepare(op)
                if kernel is not None:
                    self.steps.append((op, kernel, backend.name))
                    break
        # Index of the last step that reads each tensor, to free values early.
        last_use: dict[Tensor, int] = {}
        for i, (op, _, _) in enumerate(self.steps):
            for t in op.inputs:
                last_use[t] = i
        keep = set(graph.outputs)
        self.release: list[list[Tensor]] = [[] for _ in self.steps]
        for t, i in last_use.items():
            if t not in keep and not t.is_constant:
                self.release[i].append(t)

    def bind(self, arrays: Sequence[Any], symbols: Mapping[str, int] | None = None) -> dict[str, int]:
        """Symbol values from `symbols` and the actual input shapes (an error on any mismatch)."""
        bindings = dict(symbols or {})
        bind_shapes(bindings, [(t.shape, tuple(a.shape), f"input {t.name!r}") for t, a in zip(self.graph.inputs, arrays)])
        return bindings

    def run(self, *args: Any, **kwargs: Any) -> list[np.ndarray]:
        """Run on inputs given positionally, by name, or as one dict; returns the outputs."""
        return self.execute(_collect(self.graph, args, kwargs))

    def execute(self, arrays: Sequence[Any], symbols: Mapping[str, int] | None = None,
                borrow: frozenset[int] = frozenset()) -> list[np.ndarray]:  # fmt: skip
        """Run on the inputs in graph order; symbols adds size values no input shape carries.
        (`borrow` is CompiledGraph.execute's; these outputs are always fresh arrays.)"""
        if len(arrays) != len(self.graph.inputs):
            raise ArgumentError(f"graph {self.graph.name} takes {len(self.graph.inputs)} inputs, got {len(arrays)}")
        for t, a in zip(self.graph.inputs, arrays):
            if np.asarray(a).dtype != numpy_dtype(t.dtype):
                raise ArgumentError(f"input {t.name!r} must be {t.dtype}, got {np.asarray(a).dtype}")
        bindings = self.bind(arrays, symbols)
        propagate_shapes(self.graph, [np.shape(a) for a in arrays], bindings)  # the graph's assumptions hold
        env: dict[Tensor, Any] = dict(zip(self.graph.inputs, arrays))
        for t in self.graph.constants:
            env[t] = t.data
        for (op, kernel, _), release in zip(self.steps, self.release):
            outs = kernel([env[t] for t in op.inputs], bindings)
            env.update(zip(op.outputs, outs))
            for t in release:
                env.pop(t, None)
        # Hand out arrays the caller owns: never a constant, an input or a view of either.
        outs = []
        for t in self.graph.outputs:
            a = np.asarray(env[t])
            fresh = a.flags.c_contiguous and a.flags.owndata and t.producer is not None
            outs.append(a if fresh else np.array(a, order="C", copy=True))
        return outs

    def backend_counts(self) -> dict[str, int]:
        """How many operators each backend runs."""
        counts: dict[str, int] = {}
        for _, _, name in self.steps:
            counts[name] = counts.get(name, 0) + 1
        return counts


def _collect(graph: FlowGraph, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[np.ndarray]:
    return [np.asarray(a) for a in collect_inputs(graph, args, kwargs)]


def collect_inputs(graph: FlowGraph, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    """The graph's inputs in order, given positionally, by name, or as one dict."""
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        kwargs, args = args[0], ()
    if args and kwargs:
        raise ArgumentError("pass the inputs either positionally or by name, not both")
    if kwargs:
        missing = [t.name for t in graph.inputs if t.name not in kwargs]
        extra = set(kwargs) - {t.name for t in graph.inputs}
        if missing or extra:
            raise ArgumentError(f"missing inputs {missing}, unknown inputs {sorted(extra)}")
        args = [kwargs[t.name] for t in graph.inputs]
    if len(args) != len(graph.inputs):
        raise ArgumentError(f"graph {graph.name} takes {len(graph.inputs)} inputs, got {len(args)}")
    return list(args)


def _run(graph: FlowGraph, backends: Sequence[Backend] | None, *args: Any, **kwargs: Any) -> list[np.ndarray]:
    return Executor(graph, backends).run(*args, **kwargs)


provide("run", _run)  # FlowGraph.run
