"""The interface between the interim executor (tessera.graph.executor) and its backends: a
`Backend` turns an operator into an `OpKernel`.  It sits below FlowGraph, whose `run` takes
backends, and below the executor, which runs them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tessera.graph.operator import Operator


class OpKernel(Protocol):
    """Runs one operator: input arrays and the symbol bindings in, output arrays out."""

    def __call__(self, inputs: Sequence[Any], bindings: Mapping[str, int]) -> Sequence[Any]: ...


class Backend(Protocol):
    """Turns operators into kernels; returns None for an operator it cannot run."""

    name: str

    def prepare(self, op: Operator) -> OpKernel | None: ...
