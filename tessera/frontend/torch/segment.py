"""A segment of the ATen graph compiled into one FlowGraph, and the values crossing its boundary.

The torch backend (backend.py) cuts the graph where nodes run in torch; each run of lowered nodes
is a `Segment`.  The helpers here move values across a segment's edge: module state into graph
constants, results back into the layouts the traced graph gave them, and graph outputs that are
in-place updates of the inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tessera.frontend.torch.convert import Converter
from tessera.graph import Executor, FlowGraph, Tensor
from tessera.graph.compiler import CompiledGraph
from tessera.ops.compiled import torch_to_numpy


def to_numpy(t: torch.Tensor) -> np.ndarray:
    a = torch_to_numpy(t)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)  # (ascontiguousarray makes 0-d arrays 1-d)


def state_constant(t: torch.Tensor, name: str) -> Tensor:
    """Module state as a graph constant.  A CPU tensor's array views the module's memory, so the
    constant copies it; a device tensor's is a fresh host copy already (no second copy of the
    weights: a 1.1B Llama's are 2.2 GB)."""
    return Tensor.constant(to_numpy(t), name=name, copy=t.device.type == "cpu")


def leaves(value: Any) -> list:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in leaves(v)]
    return [value]


# Ops whose values depend on their input's memory layout, not only its elements: when tessera
# computed that input, it is contiguous, so it is re-laid out as traced before torch runs them.
STORAGE_READERS = ("aten.as_strided.", "aten.as_strided_copy.", "aten.as_strided_scatter.")


def with_traced_layout(value: Any, meta: Any) -> Any:
    """`value` with the strides and storage offset the traced graph gave it (`meta`)."""
    if not isinstance(value, torch.Tensor) or not isinstance(meta, torch.Tensor):
        return value
    # Under dynamic shapes the traced strides are expressions: keep their order (from the example
    # sizes) and lay the actual sizes out densely in it.
    hint = [concrete(st) for st in meta.stride()]
    size, offset = tuple(value.shape), concrete(meta.storage_offset())
    stride = [0] * len(size)
    step = 1
    for i in sorted(range(len(size)), key=lambda i: (hint[i], i)):
        stride[i] = step
        step *= max(size[i], 1)
    stride = tuple(stride) if any(isinstance(st, torch.SymInt) for st in meta.stride()) else tuple(hint)
    if value.stride() == stride and value.storage_offset() == offset:
        return value
    extent = offset + 1 + sum((d - 1) * st for d, st in zip(size, stride) if d > 0)
    laid = torch.empty(extent, dtype=value.dtype, device=value.device).as_strided(size, stride, offset)
    return laid.copy_(value)


def concrete(v: Any) -> int:
    """An int, or a SymInt's value in the example the graph was traced with."""
    return int(v.node.hint) if isinstance(v, torch.SymInt) else int(v)


def is_input_mutation(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"


def tensor_slots(structure: Any) -> list[int]:
    """The graph-output indices an output structure (see Segment.output_structure) refers to."""
    if isinstance(structure, tuple) and len(structure) == 2 and structure[0] in ("tensor", "const", "size"):
        return [structure[1]] if structure[0] == "tensor" else []
    if isinstance(structure, (tuple, list)):
        return [j for s in structure for j in tensor_slots(s)]
    return []


def same_memory(a: Any, b: torch.Tensor) -> bool:
    """Whether tensor `a` is `b`'s memory seen again (an update the compiled graph made in place
    and returned as a view of the input)."""
    return (isinstance(a, torch.Tensor) and a.device == b.device and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)  # fmt: skip


def in_place_slots(structure: list[Any], updates: dict[int, torch.fx.Node], cv: Converter,
                    graph: FlowGraph) -> dict[int, int]:  # fmt: skip
    """{graph output index: graph input index} of the updates (structure index -> placeholder)
    whose new value is one graph output that nothing else returns."""
    others = [j for k, s in enumerate(structure) if k not in updates for j in tensor_slots(s)]
    out = {}
    for k, ph in updates.items():
        slots = tensor_slots(structure[k])
        t = cv.env.get(ph)
        if len(slots) == 1 and slots[0] not in others and isinstance(t, Tensor) and t in graph.inputs:
            out[slots[0]] = graph.inputs.index(t)
    return out


class Segment:
    """A run of lowered nodes compiled into one FlowGraph."""

    def __init__(self, nodes: list[torch.fx.Node]):
        self.nodes = nodes
        self.inputs: list[torch.fx.Node] = []
        self.outputs: list[torch.fx.Node] = []
        self.output_structure: list[Any] = []  # per output node: its value with tensors as leaf indices
        self.graph: FlowGraph | None = None
        self.executor: Executor | CompiledGraph | None = None
        self.on_device = False  # a CUDA graph: torch tensors in and out
        self.devices: list[torch.device] = []
        self.size_outputs = False  # outputs include symbolic sizes (evaluated per call)
        self.sym_inputs: dict[str, int] = {}  # symbol name -> index of a SymInt placeholder
        # Graph outputs read only by input-mutation write-backs: the CUDA-graph replay may hand
        # back its own buffers for them (copied into the inputs at once), not copies.
        self.borrow: frozenset[int] = frozenset()
