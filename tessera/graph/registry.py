"""The operator registry: what each op kind accepts, how it infers shapes, and its numpy reference.

Every op kind names its attributes (with defaults), a shape/dtype inference function and a
numpy reference implementation.  The reference is the semantics of the op: constant folding
runs it, the interim executor runs it, and compiled kernels are tested against it.

The registry is filled at import by the modules that define op kinds: `tessera.graph.opdefs`
(the built-in vocabulary, which `tessera.graph`'s __init__ imports first, so any import of a
graph module has registered it) and any module that calls `register` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera.errors import UnsupportedError
from tessera.graph.symbolic import Shape
from tessera.graph.tensor import Tensor
from tessera.ir.dtypes import DataType


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

InferFn = Callable[["Sequence[Tensor]", dict], "list[tuple[Shape, DataType]]"]
ReferenceFn = Callable[[list[np.ndarray], dict], "list[np.ndarray]"]

# Categories tell later layers how an op may be scheduled and fused.
#   elementwise: output[i] depends on input[i] (after broadcasting)
#   injective:   each output element reads one input element (reshape, transpose, slice, ...)
#   reduce:      reductions and ops built around one (softmax, norms)
#   anchor:      matmul, conv, attention: tuned templates
#   source:      no tensor inputs (arange, full)
#   opaque:      anything else
CATEGORIES = ("elementwise", "injective", "reduce", "anchor", "source", "opaque")


@dataclass(frozen=True)
class OpDef:
    """One operator kind: attributes, inference, reference implementation and category."""

    kind: str
    infer: InferFn
    reference: ReferenceFn
    attrs: dict[str, Any] = field(default_factory=dict)
    category: str = "opaque"
    num_inputs: tuple[int, int] = (1, 1)  # inclusive range
    doc: str = ""

    def normalize_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise ValueError(f"op {self.kind!r} has no attribute(s) {sorted(unknown)}; known: {sorted(self.attrs)}")
        out = {}
        for name, default in self.attrs.items():
            if name in attrs:
                out[name] = attrs[name]
            elif default is REQUIRED:
                raise ValueError(f"op {self.kind!r} needs attribute {name!r}")
            else:
                out[name] = default
        return out


_REGISTRY: dict[str, OpDef] = {}


def register(kind: str, *, infer: InferFn, reference: ReferenceFn, attrs: dict[str, Any] | None = None,
             category: str = "opaque", num_inputs: int | tuple[int, int] = 1, doc: str = "") -> OpDef:  # fmt: skip
    """Add an op kind to the registry (an error if the kind is already there)."""
    if kind in _REGISTRY:
        raise ValueError(f"op {kind!r} is already registered")
    if category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}")
    n = (num_inputs, num_inputs) if isinstance(num_inputs, int) else num_inputs
    op = OpDef(kind, infer, reference, dict(attrs or {}), category, n, doc)
    _REGISTRY[kind] = op
    return op


def get_op(kind: str) -> OpDef:
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise UnsupportedError(f"unknown graph operator {kind!r}") from None


def has_op(kind: str) -> bool:
    return kind in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)
