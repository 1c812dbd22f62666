"""Post-scheduling epilogue fusion (Hidet): fold an elementwise tail into an anchor kernel's stores.

An anchor kernel (a GEMM template, say) is scheduled on its own and writes its result with
plain element stores ``OUT[idx] = v``.  `fuse_epilogue` rewrites every such store into a
store of the epilogue's value into the final output:

    FINAL[j] = epilogue(acc[j] := v, extras read at j)     with j = index_map(idx)

`index_map` sends the kernel's store indices to the anchor's *logical* output index (a
GEMM's [batch, M, N] tile coordinates to the NCHW index of a convolution, say).  The
epilogue is a compute definition (tessera.ops) over a placeholder `acc` that stands for the
anchor's result; its chain of injective ops is inlined into one expression, its reads of the
other placeholders (`extras`: bias, residual, ...) become loads from new kernel parameters
appended to the function in the order given.

The value the epilogue sees is the anchor's accumulator rounded to `acc.dtype`, exactly what
the unfused graph would have read back from memory; declare `acc` as float32 to work on the
unrounded accumulator instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.compute import (
    Compute,
    Placeholder,
    TensorElement,
    TensorElementMutator,
    TensorNode,
    compute,
    reads_of,
    topological_order,
)
from tessera.ir.func import Function
from tessera.ir.functor import IRMutator, IRVisitor
from tessera.ir.types import GLOBAL, REGISTER, TensorType
from tessera.ops.common import same_dim, shape_vars
from tessera.ops.schedule.inline import Inliner

__all__ = ["Epilogue", "EpilogueError", "compose", "fuse_epilogue", "identity_epilogue"]


class EpilogueError(UnsupportedError):
    """The epilogue cannot be folded into the anchor's stores (not injective, reads the anchor's
    result at another index, reads an unlisted tensor, ...): run it as a separate kernel."""


@dataclass
class Epilogue:
    """An elementwise tail of an anchor operator.

    `acc` stands for the anchor's result (shape = the anchor's logical output shape);
    `output` is an injective compute over `acc` and `extras` with the same shape (its dtype
    may differ); `extras` are the other inputs (bias, residual, ...), passed at call time
    in this order.
    """

    acc: Placeholder
    output: TensorNode
    extras: list[Placeholder] = field(default_factory=list)


def identity_epilogue(shape: Sequence[int | E.Expr], dtype: dtypes.DataType, out_dtype: dtypes.DataType | None = None) -> Epilogue:
    """The plain store of the anchor's result (converted to `out_dtype` when given)."""
    acc = Placeholder("acc", tuple(shape), dtype)
    if out_dtype is None or out_dtype == dtype:
        return Epilogue(acc, acc, [])
    return Epilogue(acc, compute(acc.shape, lambda *i: acc[i], "cast", out_dtype), [])


class _Replace(TensorElementMutator):
    """Rebuild compute nodes so that reads of one tensor read another one instead."""

    def __init__(self, old: TensorNode, new: TensorNode):
        self.tensors: dict[TensorNode, TensorNode] = {old: new}

    def visit_TensorElement(self, e: TensorElement) -> E.Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        return TensorElement(self.tensors.get(e.tensor, e.tensor), idx)

    def node(self, t: TensorNode) -> TensorNode:
        if t in self.tensors:
            return self.tensors[t]
        if not isinstance(t, Compute):
            return t
        value = self.visit(t.value)
        out = t if value is t.value else Compute(t.name, t.shape, t.dtype, t.axes, value, t.tag)
        self.tensors[t] = out
        return out


def compose(inner: Epilogue, outer: Epilogue) -> Epilogue:
    """`outer` applied to the result of `inner`: acc is inner's, extras are inner's then outer's.

    Used to fold an anchor's own bias (linear, conv2d) in front of a caller's epilogue."""
    if inner.output.dtype != outer.acc.dtype:
        inner = Epilogue(inner.acc, compute(inner.output.shape, lambda *i: inner.output[i], "round", outer.acc.dtype),
                         inner.extras)  # fmt: skip
    rep = _Replace(outer.acc, inner.output)
    out = outer.output
    for t in topological_order([outer.output]):
        out = rep.node(t)
    return Epilogue(inner.acc, out, [*inner.extras, *outer.extras])


@dataclass
class _Inlined:
    axes: tuple[E.Var, ...]
    value: E.Expr  # reads only acc (at exactly `axes`) and extras


def _inline(ep: Epilogue) -> _Inlined:
    """The epilogue as one expression over its output axes, after validation."""
    acc, out = ep.acc, ep.output
    if not isinstance(acc, Placeholder):
        raise EpilogueError(f"Epilogue.acc must be a Placeholder, got {type(acc).__name__}")
    if acc.rank == 0:
        raise EpilogueError("Epilogue.acc must have at least one dimension")
    if out.rank != acc.rank or not all(same_dim(a, b) for a, b in zip(out.shape, acc.shape)):
        raise EpilogueError(f"the epilogue's output {out!r} must have the shape of acc {acc!r}")
    extras = list(ep.extras)
    if acc in extras or len(set(extras)) != len(extras):
        raise EpilogueError("Epilogue.extras must list distinct placeholders other than acc")
    for t in topological_order([out]):
        if isinstance(t, Placeholder):
            if t is not acc and t not in extras:
                raise EpilogueError(f"the epilogue reads placeholder '{t.name}', which is not among its extras")
        elif not isinstance(t, Compute):
            raise EpilogueError(f"the epilogue is not injective: '{t.name}' is a {type(t).__name__} "
                                "(reductions cannot be folded into an anchor's stores)")  # fmt: skip
    if out is acc:
        axes = tuple(E.Var(f"ax{k}", dtypes.int32) for k in range(acc.rank))
        return _Inlined(axes, acc[axes])
    assert isinstance(out, Compute)
    value = Inliner(set()).visit(out.value)
    _check_acc_reads(value, acc, out.axes)
    if value.dtype != out.dtype:
        value = E.Cast(value, out.dtype)
    return _Inlined(out.axes, value)


def _check_acc_reads(value: E.Expr, acc: Placeholder, axes: tuple[E.Var, ...]) -> None:
    for r in reads_of(value):
        if r.tensor is acc and not all(i is a for i, a in zip(r.indices, axes)):
            got = ", ".join(str(i) for i in r.indices)
            raise EpilogueError(f"the epilogue reads the anchor's result at [{got}], not at its own output index "
                                f"[{', '.join(a.name for a in axes)}]; only elementwise tails can be fused")  # fmt: skip


class _Lower(TensorElementMutator):
    """Epilogue expression -> kernel IR: axes -> store indices, acc -> the stored value, extras -> loads."""

    def __init__(self, mapping: dict[E.Var, E.Expr], acc: Placeholder, value: E.Expr, extras: dict[TensorNode, E.Var]):
        self.mapping, self.acc, self.value, self.extras = mapping, acc, value, extras

    def visit_Var(self, e: E.Var) -> E.Expr:
        return self.mapping.get(e, e)

    def visit_TensorElement(self, e: TensorElement) -> E.Expr:
        if e.tensor is self.acc:
            return self.value
        p = self.extras[e.tensor]
        idx = tuple(self.visit(i) for i in e.indices) if e.tensor.rank else (E.Const(0, dtypes.int32),)
        return E.Load(p, idx)


def _strip_store_cast(v: E.Expr, dtype: dtypes.DataType) -> E.Expr:
    """The value before the conversion a store into `dtype` added (the front end casts explicitly)."""
    return v.value if isinstance(v, E.Cast) and v.type == dtype else v


class _Names(IRVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Var(self, e: E.Var) -> None:
        self.names.add(e.name)

    def visit_DeclareVar(self, s: S.DeclareVar) -> None:
        self.names.add(s.var.name)
        super().visit_DeclareVar(s)

    def visit_DeclareBuffer(self, s: S.DeclareBuffer) -> None:
        self.names.add(s.var.name)

    def visit_For(self, s: S.For) -> None:
        self.names.add(s.var.name)
        super().visit_For(s)

    def visit_ForMapping(self, s: S.ForMapping) -> None:
        self.names.update(v.name for v in s.vars)
        if s.task_var is not None:
            self.names.add(s.task_var.name)
        super().visit_ForMapping(s)


def _c_name(name: str) -> str:
    out = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return out if out and not out[0].isdigit() else f"t_{out}"


class _Rewrite(IRMutator):
    def __init__(self, old: E.Var, new: E.Var, index_map: Callable[..., Sequence[E.Expr]], ep: Epilogue,
                 inlined: _Inlined, extras: dict[TensorNode, E.Var], row_major: bool, taken: set[str]):  # fmt: skip
        self.old, self.new, self.index_map, self.ep, self.inlined, self.extras = old, new, index_map, ep, inlined, extras
        self.row_major, self.taken = row_major, taken
        self.count = 0

    def _fresh(self, base: str) -> str:
        name, n = base, 0
        while name in self.taken:
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        return name

    def _value(self, v: E.Expr, idx: tuple[E.Expr, ...]) -> tuple[tuple[E.Expr, ...], E.Expr]:
        """(logical index, the epilogue's value) for the kernel's value `v` stored at `idx`."""
        logical = tuple(E.as_expr(i) for i in self.index_map(*idx))
        if len(logical) != self.ep.acc.rank:
            raise EpilogueError(f"the index map gives {len(logical)} indices; the anchor's output has rank {self.ep.acc.rank}")
        if v.dtype != self.ep.acc.dtype:
            v = E.Cast(v, self.ep.acc.dtype)
        value = _Lower(dict(zip(self.inlined.axes, logical)), self.ep.acc, v, self.extras).visit(self.inlined.value)
        if value.dtype != self.new.type.dtype:
            value = E.Cast(value, self.new.type.dtype)
        return logical, value

    def visit_Instruction(self, s: S.Instruction) -> S.Stmt:
        """A vector copy into the output (a staged epilogue's 16-byte row segment): the elements
        are loaded into registers, the epilogue is applied to each, and the results are stored with
        vector copies when the output is the kernel's row-major layout, else one by one."""
        dst = s.operands[0] if s.operands else None
        if s.name != "copy_vector" or not (isinstance(dst, E.Address) and dst.buffer is self.old):
            return super().visit_Instruction(s)
        self.count += 1
        src = self.visit(s.operands[1])
        in_dt, out_dt = self.old.type.dtype, self.new.type.dtype
        width = s.attrs["bytes"] // in_dt.nbytes
        idx = tuple(self.visit(i) for i in dst.indices)
        staged = E.Var(self._fresh("ep_in"), TensorType(in_dt, (E.Const(width, dtypes.int32),), REGISTER))
        result = E.Var(self._fresh("ep_out"), TensorType(out_dt, (E.Const(width, dtypes.int32),), REGISTER))
        zero = (E.Const(0, dtypes.int32),)
        stmts: list[S.Stmt] = [S.DeclareBuffer(staged), S.Instruction("copy_vector", (E.Address(staged, zero), src), dict(s.attrs)),
                               S.DeclareBuffer(result)]  # fmt: skip
        first: tuple[E.Expr, ...] = ()
        for e in range(width):
            at = (*idx[:-1], idx[-1] + E.Const(e, dtypes.int32) if e else idx[-1])
            logical, value = self._value(E.Load(staged, (E.Const(e, dtypes.int32),)), at)
            first = first or logical
            stmts.append(S.Store(result, (E.Const(e, dtypes.int32),), value))
            if not self.row_major:
                stmts.append(S.Store(self.new, logical, E.Load(result, (E.Const(e, dtypes.int32),))))
        if self.row_major:  # the row segment stays contiguous (and aligned) in the output
            chunk = min(16, width * out_dt.nbytes)
            per = chunk // out_dt.nbytes
            for c in range(0, width, per):
                at = (*first[:-1], first[-1] + E.Const(c, dtypes.int32) if c else first[-1])
                stmts.append(S.Instruction("copy_vector", (E.Address(self.new, at), E.Address(result, (E.Const(c, dtypes.int32),))),
                                           {"bytes": chunk}))  # fmt: skip
        out = S.seq(*stmts)
        out.line = s.line
        return out

    def _refuse(self, what: str) -> None:
        raise EpilogueError(f"the kernel {what} its output '{self.old.name}'; epilogues need plain element stores")

    def visit_Load(self, e: E.Load) -> E.Expr:
        if e.buffer is self.old:
            self._refuse("reads")
        return super().visit_Load(e)

    def visit_Address(self, e: E.Address) -> E.Expr:
        if e.buffer is self.old:
            self._refuse("takes the address of (asynchronous stores into, or reads by instructions)")
        return super().visit_Address(e)

    def visit_Store(self, s: S.Store) -> S.Stmt:
        if s.buffer is not self.old:
            return super().visit_Store(s)
        self.count += 1
        idx = tuple(self.visit(i) for i in s.indices)
        logical, value = self._value(_strip_store_cast(self.visit(s.value), self.old.type.dtype), idx)
        out = S.Store(self.new, logical, value)
        out.line = s.line
        return out


def fuse_epilogue(func: Function, out: str, index_map: Callable[..., Sequence[E.Expr]], epilogue: Epilogue,
                  row_major: bool = False) -> Function:  # fmt: skip
    """`func` with every store into parameter `out` replaced by a store of the epilogue.

    Vector copies into `out` (`copy_vector`, a staged epilogue's row segments) are fused too:
    each element goes through the epilogue in registers; with `row_major` (the caller's output is
    laid out as the kernel's `out`, so a segment stays contiguous and aligned) the results are
    written back with vector copies, else element by element.

    `index_map(*store_indices)` returns the anchor's logical output index (one expression per
    dimension of `epilogue.acc`).  The parameter `out` is replaced in place by the final output
    (shape and dtype of `epilogue.output`, same name); the extras' parameters are appended.
    The epilogue's shapes may be symbolic (int32 expressions over shape symbols: a kernel generic
    in its rows), each symbol a whole dimension of some parameter after fusing; the kernel's own
    shape symbols must not depend on `out` alone (specialise them first).
    Raises EpilogueError when the epilogue cannot be fused.
    """
    old = next((p for p in func.params if p.name == out), None)
    if old is None or not isinstance(old.type, TensorType) or old.type.scope != GLOBAL:
        raise EpilogueError(f"kernel '{func.name}' has no global tensor parameter '{out}'")
    inlined = _inline(epilogue)
    # Symbolic sizes of the epilogue's tensors (a kernel generic in its rows) become shape symbols
    # of the kernel, bound from the arrays at call time like its own.
    symbols = list(func.shape_params)
    for t in (epilogue.output, *epilogue.extras):
        for name, v in shape_vars(t.shape).items():
            if v.type != dtypes.int32:
                raise EpilogueError(f"epilogue tensor '{t.name}' has a size over {name}, which is not an int32 symbol")
            if all(s.name != name for s in symbols):
                symbols.append(v)
    names = _Names()
    names.visit(func.body)
    taken = names.names | {p.name for p in func.all_params}
    extras: dict[TensorNode, E.Var] = {}
    for k, t in enumerate(epilogue.extras):
        name = base = f"ep{k}_{_c_name(t.name)}"
        n = 0
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        extras[t] = E.Var(name, TensorType(t.dtype, t.shape or (E.Const(1, dtypes.int32),), GLOBAL))
    new = E.Var(out, TensorType(epilogue.output.dtype, epilogue.output.shape, GLOBAL))
    rewriter = _Rewrite(old, new, index_map, epilogue, inlined, extras, row_major, taken)
    body = rewriter.visit(func.body)
    if rewriter.count == 0:
        raise EpilogueError(f"kernel '{func.name}' never stores into '{out}'")
    params = [new if p is old else p for p in func.params] + list(extras.values())
    bound = {d.name for p in params if isinstance(p.type, TensorType) for d in p.type.shape if isinstance(d, E.Var)}
    orphans = [s.name for s in symbols if s.name not in bound]
    if orphans:
        raise EpilogueError(f"kernel '{func.name}': shape symbol(s) {orphans} are not a whole dimension of any "
                            f"parameter after fusing (bound only by '{out}', or only inside expressions); "
                            "specialise the kernel's shapes before fusing")  # fmt: skip
    return Function(func.name, params, body, func.kind, func.launch, symbols, func.source_file, func.source_line)

