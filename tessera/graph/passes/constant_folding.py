"""Constant folding: operators whose inputs are all constants are evaluated now, with their
numpy reference implementation, and replaced by constant tensors."""

from __future__ import annotations

from tessera.errors import DivisionByZeroError
from tessera.graph.flow_graph import FlowGraph
from tessera.graph.registry import get_op
from tessera.graph.symbolic import contains_sym
from tessera.graph.tensor import Tensor
from tessera.ir.dtypes import numpy_dtype

# Folding a broadcast (expand, full) can turn a few bytes into megabytes of file and memory;
# such results stay computed at run time.
MAX_GROWTH_BYTES = 1 << 20


def fold_constants(graph: FlowGraph) -> int:
    """Fold in place; returns the number of operators removed."""
    folded = 0
    keep = []
    for op in graph.operators:
        if not all(t.is_constant and t.producer is None for t in op.inputs) or _symbolic(op):
            keep.append(op)
            continue
        in_bytes = sum(t.data.nbytes for t in op.inputs)
        out_bytes = sum(t.numel * t.dtype.nbytes for t in op.outputs)  # shapes are static here
        if out_bytes > max(MAX_GROWTH_BYTES, 4 * in_bytes):
            keep.append(op)
            continue
        opdef = get_op(op.kind)
        try:
            results = opdef.reference([t.data for t in op.inputs], opdef.normalize_attrs(op.attrs))
        except DivisionByZeroError:  # the device decides at run time (the CPU raises, CUDA gives 0)
            keep.append(op)
            continue
        for out, value in zip(op.outputs, results):
            # the reference made value (or viewed read-only constants): no copy
            const = Tensor.constant(value.astype(numpy_dtype(out.dtype), copy=False), name=out.name, device=out.device,
                                    copy=False)
            graph.replace_uses(out, const)
        folded += 1
    graph.set_operators(keep)
    return folded


def _symbolic(op) -> bool:
    return contains_sym(list(op.attrs.values())) or any(not t.is_static for t in op.outputs)


