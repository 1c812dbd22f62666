"""The machinery every lowering rule shares: graph sizes as int32 expressions (`dim_expr`), and
`Ctx`, which carries one operator's inputs, attributes and size bindings while it is lowered.

How graph sizes map to expressions.  A graph dimension is an int or a `Sym` of tessera's size
algebra (`tessera.ir.symbolic`), converted by `to_expr`.  Names that appear in the graph shapes
of the operator's inputs as whole dimensions are bound to what the matching input nodes
actually have there (`Ctx.env`): an int32 `Var` when the caller built symbolic placeholders, a
constant when it built them for concrete shapes.  Sizes in attributes that the inputs do not
bind become `Var`s of `symbols`, which the caller must bind at run time.  Opaque names (a
leading "_", sizes that depend on data) are never invented as `Var`s: nothing could bind them.

Why outputs are re-viewed ("conformed").  Graph and ops compare sizes in the same algebra, but
the graph *assumes* sizes equal where a broadcast or contraction meets two it cannot prove
equal (checked at run time), and ops refuses those.  Every lowered output therefore gets
exactly the shape the graph gives it by wrapping it in a free injective view where ops built a
different size; inputs that the graph says share a size are conformed the same way before they
reach an ops function that checks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tessera import ops
from tessera.errors import UnsupportedError
from tessera.graph.operator import Operator
from tessera.graph.symbolic import Dim, Sym
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import TensorNode, compute, fresh_name
from tessera.ir.dtypes import DataType, numpy_dtype
from tessera.ir.shapes import to_expr
from tessera.ops.common import same_dim, static

I32 = dtypes.int32


class LoweringError(UnsupportedError):
    """An operator that lower_operator cannot express with tessera.ops (it runs in its numpy reference)."""


def i32(v: int) -> E.Const:
    return E.Const(v, I32)


def is_opaque(name: str) -> bool:
    """Sizes the graph invented for results it cannot express (see graph.symbolic.fresh_dim)."""
    return name.startswith("_")


def dim_expr(d: Dim, symbols: dict[str, E.Expr]) -> E.Expr:
    """A graph dimension as an int32 expression (`tessera.ir.symbolic.to_expr`): ints become
    constants, names become the int32 `Var`s taken (or created) by name in `symbols`.

    `symbols` may also map a name to a constant (an int32 `Const`) when the caller lowers for
    known sizes; that size then folds into the expressions."""
    if isinstance(d, bool) or not isinstance(d, (int, Sym)):
        raise TypeError(f"a graph dimension is an int or a Sym, got {d!r}")
    return to_expr(d, symbols)


def _rank(e: E.Expr) -> int:
    """Preference among expressions for one size: constants, then variables, then the rest."""
    return 0 if isinstance(e, E.Const) else 1 if isinstance(e, E.Var) else 2


def view(x: TensorNode, shape: Sequence[E.Expr]) -> TensorNode:
    """x with its dimensions re-expressed as `shape` (the same sizes at run time), free once inlined."""
    if len(shape) != x.rank:
        raise LoweringError(f"cannot view '{x.name}' of rank {x.rank} with {len(shape)} dimensions")
    if all(same_dim(a, b) for a, b in zip(x.shape, shape)):
        return x
    for a, b in zip(x.shape, shape):
        if static(a) is not None and static(b) is not None and static(a) != static(b):
            raise LoweringError(f"'{x.name}' has size {static(a)} where the graph has {static(b)}")
    return compute(shape, lambda *i: x[i], fresh_name("view"), x.dtype, tag="reshape")


def copy(x: TensorNode) -> TensorNode:
    """A new node with x's values (so that an output is never the very node of an input)."""
    return compute(x.shape, lambda *i: x[i], fresh_name("copy"), x.dtype)


def cast(x: TensorNode, dt: DataType) -> TensorNode:
    return x if x.dtype == dt else ops.cast(x, dt)


def python_value(value: Any, dt: DataType) -> bool | int | float:
    """A Python number converted the way numpy's astype(dt) converts it (ints truncate)."""
    try:
        v = np.asarray(value).astype(numpy_dtype(dt)).item()
    except UnsupportedError:  # bfloat16 without ml_dtypes: round through float32
        v = float(np.float32(value))
    return bool(v) if dt.is_bool else int(v) if not dt.is_float else float(v)


class Ctx:
    """One operator being lowered: its normalized attributes, its input nodes (conformed to the
    graph's shapes) and the sizes those inputs bind."""

    def __init__(self, op: Operator, inputs: Sequence[TensorNode], symbols: dict[str, E.Expr],
                 inline_scalars: bool = False):  # fmt: skip
        if len(inputs) != len(op.inputs):
            raise LoweringError(f"{op.name} ({op.kind}) has {len(op.inputs)} inputs, got {len(inputs)} nodes")
        self.op, self.kind, self.symbols = op, op.kind, symbols
        self.attrs: dict[str, Any] = op.opdef.normalize_attrs(op.attrs)
        self.inline_scalars = inline_scalars
        self.env: dict[str, E.Expr] = {}
        for t, node in zip(op.inputs, inputs):
            if not isinstance(node, TensorNode):
                raise LoweringError(f"{op.name}: input {t.name} must be a tensor node, got {type(node).__name__}")
            if node.rank != t.ndim:
                raise LoweringError(f"{op.name}: input {t.name} is {t.type_str()} but its node has rank {node.rank}")
            for d, e in zip(t.shape, node.shape):
                name = d.name if isinstance(d, Sym) else None
                if name is not None:
                    if name not in self.env or _rank(e) < _rank(self.env[name]):
                        self.env[name] = e
        self.inputs: list[TensorNode] = [view(n, self.shape(t.shape, n.shape)) for t, n in zip(op.inputs, inputs)]

    # ---- sizes ---------------------------------------------------------------------------------------------------
    def size(self, d: Dim) -> E.Expr | None:
        """d in terms of what the inputs bind; None if some name in d is not bound by them."""
        if isinstance(d, Sym) and any(n not in self.env for n in d.names):
            return None
        return to_expr(d, dict(self.env))

    def shape(self, dims: Sequence[Dim], fallback: Sequence[E.Expr]) -> list[E.Expr]:
        """Graph dims as expressions; where a dim is not bound by the inputs, the fallback's entry."""
        out = []
        for d, f in zip(dims, fallback):
            e = self.size(d)
            out.append(f if e is None else e)
        return out

    def attr_dim(self, d: Any) -> E.Expr:
        """A size given in an attribute (int or Sym): names the inputs bind take their expressions,
        others become Vars of `symbols` (opaque names only if the caller already made them)."""
        if isinstance(d, (bool, float)) or not isinstance(d, (int, np.integer, Sym)):
            raise LoweringError(f"{self.op.name} ({self.kind}): expected a size, got {d!r}")
        if not isinstance(d, Sym):
            if d < 0:
                raise LoweringError(f"{self.op.name} ({self.kind}): negative size {d}")
            return i32(int(d))
        names: dict[str, E.Expr] = {}
        for name in d.names:
            e = self.env.get(name)
            if e is None:
                if is_opaque(name) and name not in self.symbols:
                    raise LoweringError(f"{self.op.name} ({self.kind}): size {d} depends on {name}, which no input binds")
                e = dim_expr(Sym.var(name), self.symbols)
            names[name] = e
        return to_expr(d, names)

    # ---- operands ------------------------------------------------------------------------------------------------
    def x(self, k: int = 0) -> TensorNode:
        return self.inputs[k]

    def arg(self, k: int) -> Any:
        """Input k, or its value as a Python number when it is a rank-0 constant and scalars are inlined."""
        t = self.op.inputs[k]
        if self.inline_scalars and t.is_constant and t.ndim == 0:
            return t.data.item()  # type: ignore[union-attr]
        return self.inputs[k]

    @property
    def out_dtype(self) -> DataType:
        return self.op.outputs[0].dtype

    def out_shape(self, k: int = 0, fallback: Sequence[E.Expr] | None = None) -> list[E.Expr]:
        """Output k's graph shape as expressions; unbound dims come from `fallback`, else from the
        inputs' right-aligned dims that are not 1 (the broadcast rule)."""
        dims = self.op.outputs[k].shape
        if fallback is None:
            fallback = []
            for j in range(len(dims)):
                pick: E.Expr = i32(1)
                for x in self.inputs:
                    jj = j - (len(dims) - x.rank)
                    if jj >= 0 and static(x.shape[jj]) != 1:
                        pick = x.shape[jj]
                        break
                fallback.append(pick)
        return self.shape(dims, fallback)

    def broadcast(self, args: Sequence[Any], shape: Sequence[E.Expr]) -> list[Any]:
        """Tensor args with every dim that is not a size-1 (broadcast) dim expressed as in `shape`."""
        out = []
        for a in args:
            if isinstance(a, TensorNode):
                off = len(shape) - a.rank
                a = view(a, [d if static(d) == 1 and static(shape[j + off]) != 1 else shape[j + off]
                             for j, d in enumerate(a.shape)])  # fmt: skip
            out.append(a)
        return out

    def finish(self, nodes: Sequence[TensorNode]) -> list[TensorNode]:
        """Outputs with the graph's dtypes and shapes (never an input node itself)."""
        if len(nodes) != len(self.op.outputs):
            raise LoweringError(f"internal: {self.kind} lowered to {len(nodes)} outputs, the graph has {len(self.op.outputs)}")
        out = []
        for t, node in zip(self.op.outputs, nodes):
            if node.rank != t.ndim:
                raise LoweringError(f"internal: {self.kind} lowered {t.name} to rank {node.rank}, the graph has {t.ndim}")
            node = cast(node, t.dtype)
            node = view(node, self.shape(t.shape, node.shape))
            if any(node is x for x in self.inputs):
                node = copy(node)
            out.append(node)
        return out
