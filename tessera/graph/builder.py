"""GraphBuilder: the convenient way for front ends and tests to write a FlowGraph."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor
from tessera.ir.dtypes import DataType


class GraphBuilder:
    """Collects inputs, operators and outputs, then builds (and verifies) a FlowGraph.

    >>> b = GraphBuilder("mlp")
    >>> x = b.input("x", ["batch", 4], "float32")
    >>> w = b.constant(np.ones((8, 4), np.float32), "w")
    >>> b.output(b.op("relu", b.op("linear", x, w)))
    >>> g = b.build()
    """

    def __init__(self, name: str = "graph", device: str = "cpu"):
        self.name, self.device = name, device
        self.inputs: list[Tensor] = []
        self.outputs: list[Tensor] = []
        self.operators: list[Operator] = []

    def input(self, name: str, shape: Sequence[object], dtype: DataType | str = "float32") -> Tensor:
        t = Tensor(shape, dtype, self.device, name)
        self.inputs.append(t)
        return t

    def constant(self, value: Any, name: str | None = None, dtype: DataType | str | None = None) -> Tensor:
        return Tensor.constant(np.asarray(value), dtype, name, self.device)

    def op(self, kind: str, *inputs: Tensor, name: str | None = None, **attrs: Any) -> Tensor:
        """Add an operator with one output and return that output."""
        outs = self.op_multi(kind, *inputs, name=name, **attrs)
        if len(outs) != 1:
            raise ValueError(f"{kind} has {len(outs)} outputs; use op_multi")
        return outs[0]

    def op_multi(self, kind: str, *inputs: Tensor, name: str | None = None, **attrs: Any) -> list[Tensor]:
        op = Operator.create(kind, list(inputs), attrs, name)
        self.operators.append(op)
        return op.outputs

    def output(self, *tensors: Tensor) -> None:
        self.outputs.extend(tensors)

    def build(self, verify: bool = True) -> FlowGraph:
        g = FlowGraph(self.inputs, self.outputs, self.operators, self.name)
        return g.verify() if verify else g
