"""Graph operators: a kind from the registry, attributes, input and output tensors."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tessera.graph.registry import OpDef, get_op
from tessera.graph.symbolic import ShapeError
from tessera.graph.tensor import Tensor

_names = itertools.count()


class Operator:
    """One node of a FlowGraph.  Build with `Operator.create`, which infers the outputs."""

    def __init__(self, kind: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                 attrs: dict[str, Any], name: str | None = None):  # fmt: skip
        self.kind = kind
        self.inputs: list[Tensor] = list(inputs)
        self.outputs: list[Tensor] = list(outputs)
        self.attrs: dict[str, Any] = attrs
        self.name = name or f"{kind}{next(_names)}"
        for t in self.outputs:
            t.producer = self

    @property
    def opdef(self) -> OpDef:
        return get_op(self.kind)

    @staticmethod
    def create(kind: str, inputs: Sequence[Tensor], attrs: dict[str, Any] | None = None,
               name: str | None = None, output_names: Sequence[str] | None = None) -> Operator:  # fmt: skip
        """Check the attributes, infer the outputs' shapes and dtypes, and build the operator."""
        opdef = get_op(kind)
        full = opdef.normalize_attrs(dict(attrs or {}))
        lo, hi = opdef.num_inputs
        if not lo <= len(inputs) <= hi:
            raise ShapeError(f"op {kind!r} takes {lo}..{hi} inputs, got {len(inputs)}")
        devices = {t.device for t in inputs}
        device = "cuda" if "cuda" in devices else "cpu"
        try:
            types = opdef.infer(list(inputs), full)
        except ShapeError as e:
            raise ShapeError(f"{kind}{' ' + name if name else ''}: {e}") from None
        names = list(output_names or [])
        outputs = [Tensor(s, dt, device, names[i] if i < len(names) else None) for i, (s, dt) in enumerate(types)]
        return Operator(kind, inputs, outputs, full, name)

    def __repr__(self) -> str:
        return f"Operator({self.kind}, {self.name})"
