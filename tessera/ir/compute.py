"""Compute definitions: tensors described by what each element is, not by loops.

A `Placeholder` is an input tensor.  A `Compute` defines every element of a tensor by an
ordinary IR expression over its axis variables; it reads other tensors through
`TensorElement` (``x[i, j]``).  A `ReduceCompute` folds an expression over extra reduction
axes (sum, prod, max, min, mean) in an accumulator type, then casts to its own dtype.  A
`Program` is written by statements, one serial program per task, for what no expression per
element says: writes at data-dependent positions (scatters), selection (topk), factorizations.

These nodes form a DAG that the auto-scheduler (tessera.ops.schedule) turns into kernels:
injective `Compute` nodes are inlined into their readers, reductions become loops.  Shapes
are int32 expressions: constants, symbolic `Var`s (a dynamic batch or sequence length) or
arithmetic on them (the `a + b` of a concatenation).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.dtypes import DataType
from tessera.ir.functor import IRMutator, IRVisitor
from tessera.ir.types import GLOBAL, TensorType

DimLike = Union[int, E.Expr]
REDUCE_OPS = ("sum", "prod", "max", "min", "mean")

_ids = itertools.count()


def as_dim(d: Any) -> E.Expr:
    """A shape entry as an int32 expression (ints become constants)."""
    if isinstance(d, bool):
        raise TypeError(f"a dimension must be an int or an int32 expression, got {d!r}")
    if isinstance(d, int):
        if d < 0:
            raise TypeError(f"a dimension must be non-negative, got {d}")
        return E.Const(d, dtypes.int32)
    if isinstance(d, E.Expr) and isinstance(d.type, DataType) and d.type == dtypes.int32:
        return d
    raise TypeError(f"a dimension must be an int or an int32 expression (e.g. Var('batch', int32)), got {d!r}")


def as_shape(shape: Sequence[Any]) -> tuple[E.Expr, ...]:
    return tuple(as_dim(d) for d in shape)


class TensorNode:
    """Base of the tensor nodes: a name, a shape (int32 expressions) and an element type."""

    name: str
    shape: tuple[E.Expr, ...]
    dtype: DataType

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __getitem__(self, indices: Any) -> TensorElement:
        if not isinstance(indices, tuple):
            indices = (indices,)
        return TensorElement(self, tuple(E.as_expr(i) for i in indices))

    def __repr__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{type(self).__name__}({self.name}: {self.dtype}[{dims}])"

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Placeholder(TensorNode):
    """An input tensor of the computation."""

    name: str
    shape: tuple[E.Expr, ...]
    dtype: DataType

    def __post_init__(self) -> None:
        self.shape = as_shape(self.shape)

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Compute(TensorNode):
    """out[axes] = value, for every index in `shape`.  `value` has type `dtype`.

    `tag` names the kind of computation ("injective", "broadcast", ...) for schedulers and
    readers; it never changes the meaning.
    """

    name: str
    shape: tuple[E.Expr, ...]
    dtype: DataType
    axes: tuple[E.Var, ...]
    value: E.Expr
    tag: str = "injective"

    def __post_init__(self) -> None:
        self.shape = as_shape(self.shape)
        if len(self.axes) != len(self.shape):
            raise E.IRTypeError(f"compute '{self.name}' has {len(self.shape)} dimensions but {len(self.axes)} axes")
        if self.value.dtype != self.dtype:
            self.value = E.Cast(self.value, self.dtype)

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class ReduceCompute(TensorNode):
    """out[axes] = op over reduce_axes of value, accumulated in `acc_dtype`, cast to `dtype`.

    `mean` is a sum divided by the number of reduced elements.  `tag` "contraction" marks a
    reduction whose operands are reused across outputs (matmul, convolution): schedulers give
    each output element its own thread rather than a cooperating group.
    """

    name: str
    shape: tuple[E.Expr, ...]
    dtype: DataType
    axes: tuple[E.Var, ...]
    reduce_axes: tuple[E.Var, ...]
    reduce_extents: tuple[E.Expr, ...]
    op: str
    value: E.Expr
    acc_dtype: DataType
    tag: str = "reduce"

    def __post_init__(self) -> None:
        self.shape = as_shape(self.shape)
        self.reduce_extents = as_shape(self.reduce_extents)
        if self.op not in REDUCE_OPS:
            raise E.IRTypeError(f"unknown reduction {self.op!r}; choose one of {REDUCE_OPS}")
        if len(self.axes) != len(self.shape) or len(self.reduce_axes) != len(self.reduce_extents):
            raise E.IRTypeError(f"reduction '{self.name}': axes and extents do not match")
        if self.value.dtype != self.acc_dtype:
            self.value = E.Cast(self.value, self.acc_dtype)

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Program(TensorNode):
    """A tensor written by statements: first every element is `init` (an expression over
    `axes`, like a Compute's value; None leaves the elements to the body), then, for every
    index of the `tasks` extents, `body` (statements over `task_axes`) runs serially.

    The body reads other tensors through TensorElement (their producers are inlined into it,
    as into a Compute's value), reads and writes this tensor through `out` (a global tensor
    variable: ``Load(out, idx)``, ``Store(out, idx, v)``) and may declare locals, register
    buffers and loops.  Tasks must touch disjoint elements of `out`: schedulers run them in
    parallel, in any order (one CPU thread or one CUDA thread per task).
    """

    name: str
    shape: tuple[E.Expr, ...]
    dtype: DataType
    axes: tuple[E.Var, ...]
    init: E.Expr | None
    tasks: tuple[E.Expr, ...]
    task_axes: tuple[E.Var, ...]
    body: S.Stmt
    out: E.Var
    tag: str = "program"

    def __post_init__(self) -> None:
        self.shape = as_shape(self.shape)
        self.tasks = as_shape(self.tasks)
        if len(self.axes) != len(self.shape) or len(self.task_axes) != len(self.tasks):
            raise E.IRTypeError(f"program '{self.name}': axes and extents do not match")
        if self.init is not None and self.init.dtype != self.dtype:
            self.init = E.Cast(self.init, self.dtype)

    @property
    def value(self) -> S.Stmt:
        """init and body as one statement (`program_parts` splits it): what the scheduler
        inlines producers into and reads the inputs from."""
        return S.seq(S.Evaluate(self.init) if self.init is not None else S.Seq([]), S.Seq([self.body]))

    __hash__ = object.__hash__


def program_parts(value: S.Stmt) -> tuple[E.Expr | None, S.Stmt]:
    """(init, body) of a Program's `value`, after rewriting (inlining) it."""
    stmts = value.stmts if isinstance(value, S.Seq) else [value]
    if stmts and isinstance(stmts[0], S.Evaluate):
        return stmts[0].expr, S.seq(*stmts[1:])
    return None, S.seq(*stmts)


@dataclass(eq=False, repr=False)
class TensorElement(E.Expr):
    """One element of a tensor node, `tensor[indices]`: the expression that links compute nodes."""

    tensor: TensorNode
    indices: tuple[E.Expr, ...]
    type: DataType = field(init=False)

    def __post_init__(self) -> None:
        if len(self.indices) != self.tensor.rank:
            raise E.IRTypeError(f"'{self.tensor.name}' has rank {self.tensor.rank} but got {len(self.indices)} indices")
        for i in self.indices:
            if not i.dtype.is_integer:
                raise E.IRTypeError(f"index into '{self.tensor.name}' must be an integer, got {i.dtype}")
        self.type = self.tensor.dtype

    def __str__(self) -> str:
        return f"{self.tensor.name}[{', '.join(str(i) for i in self.indices)}]"

    __hash__ = object.__hash__


# ---- construction helpers ---------------------------------------------------------------------------------------
def fresh_name(prefix: str) -> str:
    """A unique node name: prefix, '.', a process-wide counter (kernels drop the '.n' part)."""
    return f"{prefix}.{next(_ids)}"


def axis_vars(prefix: str, n: int) -> tuple[E.Var, ...]:
    """n fresh int32 axis variables."""
    return tuple(E.Var(f"{prefix}{k}", dtypes.int32) for k in range(n))


def placeholder(shape: Sequence[DimLike], dtype: DataType | str, name: str | None = None) -> Placeholder:
    """An input tensor; dims are ints or int32 `Var`s (symbolic sizes bound at call time)."""
    return Placeholder(name or fresh_name("in"), as_shape(shape), dtypes.dtype(dtype))


def compute(shape: Sequence[DimLike], fcompute: Callable[..., Any], name: str | None = None,
            dtype: DataType | None = None, tag: str = "injective") -> Compute:  # fmt: skip
    """A tensor with elements `fcompute(*axes)`; `dtype` defaults to the value's type."""
    shape = as_shape(shape)
    name = name or fresh_name("t")
    axes = axis_vars("i", len(shape))
    value = E.as_expr(fcompute(*axes))
    return Compute(name, shape, dtype or value.dtype, axes, value, tag)


def reduce(shape: Sequence[DimLike], reduce_extents: Sequence[DimLike], fcompute: Callable[..., Any], op: str,
           name: str | None = None, dtype: DataType | None = None, acc_dtype: DataType | None = None,
           tag: str = "reduce") -> ReduceCompute:  # fmt: skip
    """A reduction: ``fcompute(axes, reduce_axes)`` folded with `op` over `reduce_extents`."""
    shape, extents = as_shape(shape), as_shape(reduce_extents)
    axes, raxes = axis_vars("i", len(shape)), axis_vars("r", len(extents))
    value = E.as_expr(fcompute(axes, raxes))
    acc = acc_dtype or value.dtype
    return ReduceCompute(name or fresh_name("red"), shape, dtype or acc, axes, raxes, extents, op, value, acc, tag)


def program(shape: Sequence[DimLike], dtype: DataType | str, tasks: Sequence[DimLike],
            fbody: Callable[..., S.Stmt], init: Callable[..., Any] | None = None, name: str | None = None,
            tag: str = "program") -> Program:  # fmt: skip
    """A Program: `fbody(out, *task_axes)` builds the statements of one task (`out` is the
    tensor's variable, for loads and stores); `init(*axes)` the value every element starts with."""

    shape, extents = as_shape(shape), as_shape(tasks)
    dt = dtypes.dtype(dtype)
    name = name or fresh_name("program")
    axes, task_axes = axis_vars("i", len(shape)), axis_vars("t", len(extents))
    out = E.Var(name.split(".")[0], TensorType(dt, shape or (E.Const(1, dtypes.int32),), GLOBAL))
    value = None if init is None else E.as_expr(init(*axes))
    return Program(name, shape, dt, axes, value, extents, task_axes, fbody(out, *task_axes), out, tag)


# ---- traversal ------------------------------------------------------------------------------------------------------
class TensorReads(IRVisitor):
    """Collect the TensorElement reads of an expression (in visiting order, repeats kept)."""

    def __init__(self) -> None:
        self.reads: list[TensorElement] = []

    def visit_TensorElement(self, e: TensorElement) -> None:
        self.reads.append(e)
        for i in e.indices:
            self.visit(i)


def reads_of(value: E.Expr) -> list[TensorElement]:
    finder = TensorReads()
    finder.visit(value)
    return finder.reads


def inputs_of(node: TensorNode) -> list[TensorNode]:
    """The tensors `node` reads directly, each once, in first-read order."""
    if isinstance(node, Placeholder):
        return []
    out: dict[TensorNode, None] = {}
    for r in reads_of(node.value):
        out.setdefault(r.tensor, None)
    return list(out)


def topological_order(outputs: Sequence[TensorNode]) -> list[TensorNode]:
    """Every node the outputs depend on, producers before consumers."""
    order: list[TensorNode] = []
    state: dict[TensorNode, int] = {}
    for root in outputs:
        stack: list[tuple[TensorNode, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                if state.get(node) != 2:
                    state[node] = 2
                    order.append(node)
                continue
            if state.get(node):
                continue
            state[node] = 1
            stack.append((node, True))
            stack.extend((t, False) for t in reversed(inputs_of(node)) if not state.get(t))
    return order


class TensorElementMutator(IRMutator):
    """An IRMutator that also rebuilds TensorElement nodes (their indices)."""

    def visit_TensorElement(self, e: TensorElement) -> E.Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        return e if all(a is b for a, b in zip(idx, e.indices)) else TensorElement(e.tensor, idx)


class _SubstituteVars(TensorElementMutator):
    def __init__(self, mapping: dict[E.Var, E.Expr]):
        self.mapping = mapping

    def visit_Var(self, e: E.Var) -> E.Expr:
        return self.mapping.get(e, e)


def substitute_vars(value: E.Expr, mapping: dict[E.Var, E.Expr]) -> E.Expr:
    """`value` with variables replaced, looking inside tensor reads too."""
    return _SubstituteVars(mapping).visit(value) if mapping else value


class ExprKeys:
    """Structural keys as small integers (hash-consing): for one ExprKeys, `keys(a) == keys(b)`
    exactly when a and b are equal expressions (variables and tensors by identity).  Each node is
    keyed once, however often the expressions that share it are keyed: index expressions made by
    chains of views over symbolic sizes are DAGs exponentially larger as trees, so a key built as
    nested tuples would be too.  The keyed expressions are kept alive, so an `id` in a key always
    names the same object."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}
        self._seen: dict[int, tuple[Any, int]] = {}  # id(expr) -> (expr, key)

    def __call__(self, e: Any) -> int:
        seen = self._seen.get(id(e))
        if seen is not None:
            return seen[1]
        if isinstance(e, E.Const):
            s: tuple = ("c", e.value, e.type.name)
        elif isinstance(e, E.Var):
            s = ("v", id(e))
        elif isinstance(e, E.Binary):
            s = ("b", e.op, self(e.a), self(e.b))
        elif isinstance(e, E.Unary):
            s = ("u", e.op, self(e.a))
        elif isinstance(e, E.Cast):
            s = ("cast", e.type.name, self(e.value))
        elif isinstance(e, E.Call):
            s = ("call", e.func, e.type.name, tuple(self(a) for a in e.args))
        elif isinstance(e, E.Select):
            s = ("sel", self(e.cond), self(e.a), self(e.b))
        elif isinstance(e, TensorElement):
            s = ("t", id(e.tensor), tuple(self(i) for i in e.indices))
        else:
            s = ("id", id(e))
        k = self._ids.setdefault(s, len(self._ids))
        self._seen[id(e)] = (e, k)
        return k
