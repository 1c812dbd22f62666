"""FlowGraph: a model as tensors and operators in topological order, with a printer and a verifier."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import TesseraError
from tessera.graph.backend_protocol import Backend
from tessera.graph.operator import Operator
from tessera.graph.registry import get_op
from tessera.graph.symbolic import Dim, Sym, format_shape
from tessera.graph.tensor import Tensor

# FlowGraph.run and FlowGraph.save are done by modules above this one, which register their
# functions here when imported (tessera.graph's __init__ imports both): "run" by
# tessera.graph.executor, "save" by tessera.graph.serialize.
_SERVICES: dict[str, Callable[..., Any]] = {}


def provide(service: str, fn: Callable[..., Any]) -> None:
    """Register the function that does `service` ("run" or "save") for FlowGraph."""
    _SERVICES[service] = fn


class GraphError(TesseraError):
    """A FlowGraph is malformed (found by `FlowGraph.verify`)."""


class FlowGraph:
    """A dataflow graph: input tensors, output tensors and the operators between them.

    `operators` is kept in topological order.  Constants are tensors with `data` and no
    producer.  Passes rewrite the graph in place through `replace_uses` and `set_operators`.
    """

    def __init__(self, inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                 operators: Iterable[Operator] | None = None, name: str = "graph"):  # fmt: skip
        self.name = name
        self.inputs: list[Tensor] = list(inputs)
        self.outputs: list[Tensor] = list(outputs)
        self.operators: list[Operator] = []
        self.set_operators(operators if operators is not None else _reachable(self.outputs))

    # ---- structure ----------------------------------------------------------------------
    def set_operators(self, operators: Iterable[Operator]) -> None:
        """Replace the operator list, sorted topologically (a stable sort: input order wins ties)."""
        ops = list(dict.fromkeys(operators))
        member = set(ops)
        order: list[Operator] = []
        state: dict[Operator, int] = {}
        for root in ops:
            stack = [(root, False)]
            while stack:
                op, done = stack.pop()
                if done:
                    state[op] = 2
                    order.append(op)
                    continue
                if state.get(op) == 2:
                    continue
                if state.get(op) == 1:
                    raise GraphError(f"the graph has a cycle through {op.name}")
                state[op] = 1
                stack.append((op, True))
                for t in reversed(op.inputs):
                    p = t.producer
                    if p is not None and p in member and state.get(p) != 2:
                        if state.get(p) == 1:
                            raise GraphError(f"the graph has a cycle through {p.name}")
                        stack.append((p, False))
        self.operators = order

    @property
    def constants(self) -> list[Tensor]:
        """Constant tensors used by operators or returned as outputs, in first-use order."""
        seen: dict[Tensor, None] = {}
        for op in self.operators:
            for t in op.inputs:
                if t.is_constant and t.producer is None:
                    seen.setdefault(t)
        for t in self.outputs:
            if t.is_constant and t.producer is None:
                seen.setdefault(t)
        return list(seen)

    def consumers(self) -> dict[Tensor, list[Operator]]:
        users: dict[Tensor, list[Operator]] = {}
        for op in self.operators:
            for t in op.inputs:
                users.setdefault(t, []).append(op)
        return users

    def replace_uses(self, old: Tensor, new: Tensor) -> None:
        """Make every operator and graph output that reads old read new instead."""
        for op in self.operators:
            op.inputs = [new if t is old else t for t in op.inputs]
        self.outputs = [new if t is old else t for t in self.outputs]

    def symbols(self) -> list[str]:
        """Names of the symbolic sizes in the inputs' shapes, in order of appearance."""
        names: dict[str, None] = {}
        for t in self.inputs:
            for d in t.shape:
                if isinstance(d, Sym):
                    names.update(dict.fromkeys(d.names))
        return list(names)

    # ---- checking -----------------------------------------------------------------------
    def verify(self) -> FlowGraph:
        """Check definitions before use, single producers, attributes and re-inferred types."""
        defined: set[Tensor] = set()
        for t in self.inputs:
            if t.producer is not None or t.is_constant:
                raise GraphError(f"graph input {t!r} is produced by an operator or is a constant")
            if t in defined:
                raise GraphError(f"graph input {t!r} is listed twice")
            defined.add(t)
        for op in self.operators:
            for i, t in enumerate(op.inputs):
                if t not in defined and not (t.is_constant and t.producer is None):
                    raise GraphError(f"{op.name} ({op.kind}) reads {t!r} (input {i}) before it is defined")
            opdef = get_op(op.kind)
            lo, hi = opdef.num_inputs
            if not lo <= len(op.inputs) <= hi:
                raise GraphError(f"{op.name} ({op.kind}) has {len(op.inputs)} inputs, expects {lo}..{hi}")
            try:
                attrs = opdef.normalize_attrs(op.attrs)
                types = opdef.infer(op.inputs, attrs)
            except (ValueError, TesseraError) as e:
                raise GraphError(f"{op.name} ({op.kind}): {e}") from e
            if len(types) != len(op.outputs):
                raise GraphError(f"{op.name} ({op.kind}) has {len(op.outputs)} outputs, inference gives {len(types)}")
            for t, (shape, dt) in zip(op.outputs, types):
                if t.producer is not op or t in defined:
                    raise GraphError(f"{t!r} has more than one producer ({op.name})")
                if t.dtype != dt or not _shapes_agree(t.shape, shape):
                    raise GraphError(f"{op.name} ({op.kind}) output {t!r} but inference gives "
                                     f"{dt.short}{format_shape(shape)}")  # fmt: skip
                defined.add(t)
        for t in self.outputs:
            if t not in defined and not t.is_constant:
                raise GraphError(f"graph output {t!r} is never computed")
        return self

    # ---- running, saving ----------------------------------------------------------------
    def run(self, *args: Any, backends: Sequence[Backend] | None = None, **kwargs: Any) -> list[np.ndarray]:
        """Execute the graph on numpy inputs (positional, or by input name); returns the outputs.

        The default backend is the numpy reference implementation of every operator.
        """
        return _SERVICES["run"](self, backends, *args, **kwargs)

    def save(self, path: str | Path) -> None:
        """Write the graph to one file (see `tessera.graph.serialize` for the format)."""
        _SERVICES["save"](self, path)

    # ---- printing -----------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"graph {self.name}(" + ", ".join(repr(t) for t in self.inputs) + ") {"]
        for c in self.constants:
            lines.append(f"  const {c!r}")
        for op in self.operators:
            outs = ", ".join(repr(t) for t in op.outputs)
            args = ", ".join(f"%{t.name}" for t in op.inputs)
            attrs = ", ".join(f"{k}={_fmt_attr(v)}" for k, v in op.attrs.items())
            lines.append(f"  {outs} = {op.kind}({args})" + (f" {{{attrs}}}" if attrs else ""))
        lines.append("  return " + ", ".join(f"%{t.name}" for t in self.outputs))
        lines.append("}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<FlowGraph {self.name}: {len(self.inputs)} inputs, {len(self.operators)} operators>"

    def summary(self) -> Mapping[str, int]:
        """How many operators of each kind the graph holds."""
        counts: dict[str, int] = {}
        for op in self.operators:
            counts[op.kind] = counts.get(op.kind, 0) + 1
        return counts


def _fmt_attr(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt_attr(x) for x in v) + "]"
    return str(v)


def _shapes_agree(recorded: Sequence[Dim], inferred: Sequence[Dim]) -> bool:
    """Equal, except that an opaque inferred size (a fresh `_` name) matches anything."""
    if len(recorded) != len(inferred):
        return False
    for r, i in zip(recorded, inferred):
        if r == i:
            continue
        if isinstance(i, Sym) and any(n.startswith("_") for n in i.names):
            continue
        if isinstance(r, Sym) and any(n.startswith("_") for n in r.names):
            continue
        if isinstance(r, Sym) != isinstance(i, Sym):
            # A frontend may know a size is fixed where rules alone keep a symbol, or
            # the reverse (broadcasting a symbol against a fixed size).
            continue
        return False
    return True


def _reachable(outputs: Sequence[Tensor]) -> list[Operator]:
    ops: dict[Operator, None] = {}
    stack = [t.producer for t in outputs if t.producer is not None]
    while stack:
        op = stack.pop()
        if op in ops:
            continue
        ops[op] = None
        stack.extend(t.producer for t in op.inputs if t.producer is not None)
    return list(ops)
