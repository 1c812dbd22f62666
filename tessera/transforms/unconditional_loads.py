"""Take every memory read of a CPU kernel out of conditional positions.

gcc 12 at -O3 if-converts a read that only one arm of a conditional needs (`c ? a[i] * b[i] : a[i]`,
`c ? 1.5f : a[i]`, `c && b[i] > 0`, `if (c) t = a[i];`) into a masked vector load, and on x86-64
(AVX2 and AVX-512) it gets the mask wrong for short inner loops: silent wrong results
(docs/cpu_codegen.md).  A read that is evaluated unconditionally needs no mask, so this pass
rewrites each conditional read into a variable declared before the statement and read there
without a condition; the conditional then selects between values already computed.

A read may be in bounds only where its condition holds (padding, concatenation, a tail).  Each
index the pass cannot prove in bounds from the loop ranges and the buffer's shape is clamped,
`min(max(index, 0), extent - 1)`, which is always in bounds (the runtime refuses empty arrays) and
holds no condition.  Reads whose indices are proven in bounds (every input of a fused
elementwise kernel) keep their plain index, so gcc still vectorizes them as contiguous loads.

Runs before flatten_buffers, on CPU kernels only: nvcc predicates conditional loads correctly.
"""

from __future__ import annotations

from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.compute import ExprKeys
from tessera.ir.func import CPU_KERNEL, Function
from tessera.ir.functor import IRMutator, IRVisitor, keep_line
from tessera.ir.types import DataType, TensorType

_TRUE = E.Const(True, dtypes.boolean)


def same_expr(a: E.Expr, b: E.Expr) -> bool:
    """Structural equality of two expressions (variables by identity)."""
    keys = ExprKeys()
    return keys(a) == keys(b)


class IndexBounds:
    """What the pass knows of integer variables: ranges of loops and of declared constants."""

    def __init__(self) -> None:
        self.loops: dict[E.Var, S.For] = {}
        self.definitions: dict[E.Var, E.Expr] = {}
        self.positive_vars: set[E.Var] = set()  # shape parameters: dimensions of non-empty arrays

    def nonneg(self, e: E.Expr) -> bool:
        if isinstance(e, E.Const):
            return e.value >= 0
        if isinstance(e, E.Var):
            if e in self.positive_vars:
                return True
            if e in self.loops:
                return self.nonneg(self.loops[e].start)
            if e in self.definitions:
                return self.nonneg(self.definitions[e])
            return False
        if isinstance(e, E.Binary) and e.op in ("+", "*", "//", "%"):
            return self.nonneg(e.a) and self.nonneg(e.b)
        if isinstance(e, E.Cast) and e.type.is_integer:
            return e.value.dtype.is_integer and self.nonneg(e.value)
        return False

    def upper(self, e: E.Expr) -> E.Expr | None:
        """An expression U with e < U (for e >= 0), or None when none is known."""
        if isinstance(e, E.Const):
            return E.Const(e.value + 1, e.dtype)
        if isinstance(e, E.Var):
            if e in self.loops:
                loop = self.loops[e]
                positive_step = isinstance(loop.step, E.Const) and loop.step.value > 0
                return loop.stop if positive_step else None
            if e in self.definitions:
                return self.upper(self.definitions[e])
            return None
        if isinstance(e, E.Binary) and e.op == "-" and self.nonneg(e.b):
            return self.upper(e.a)  # e < e.a < U
        if isinstance(e, E.Binary) and e.op == "%" and self.nonneg(e.a) and self.positive(e.b):
            return e.b
        if isinstance(e, E.Binary) and e.op == "//" and self.positive(e.b):
            bound = self.upper(e.a)
            if isinstance(bound, E.Binary) and bound.op == "*":
                if same_expr(bound.a, e.b):
                    return bound.b
                if same_expr(bound.b, e.b):
                    return bound.a
            if isinstance(bound, E.Const) and isinstance(e.b, E.Const):
                return E.Const(-(-bound.value // e.b.value), bound.dtype)
        return None

    def positive(self, e: E.Expr) -> bool:
        return (isinstance(e, E.Const) and e.value > 0) or e in self.positive_vars

    def in_bounds(self, index: E.Expr, extent: E.Expr) -> bool:
        """Whether 0 <= index < extent holds wherever the read is reached."""
        return self.nonneg(index) and self.below(index, extent)

    def below(self, index: E.Expr, extent: E.Expr) -> bool:
        """Whether index < extent holds wherever the read is reached (for index >= 0)."""
        bound = self.upper(index)
        if bound is None:
            return False
        if isinstance(bound, E.Const) and isinstance(extent, E.Const):
            return bound.value <= extent.value
        return same_expr(bound, extent)


def _as(e: E.Expr, t: DataType) -> E.Expr:
    return e if e.dtype == t else E.Cast(e, t)


def _conjoin(guard: E.Expr, cond: E.Expr) -> E.Expr:
    return cond if guard is _TRUE else E.Binary("&&", guard, cond)


def _negate(cond: E.Expr) -> E.Expr:
    return E.Unary("!", cond)


class _HoistReads(IRMutator):
    """Rewrites one expression: conditional reads become fresh variables declared in `hoisted`.

    Reads the walk pins (in an If branch that changes their index or buffer) stay in place."""

    def __init__(self, walk: UnconditionalLoads, guard: E.Expr, hoisted: list[S.Stmt]):
        self.walk = walk
        self.guard = guard
        self.hoisted = hoisted

    def under(self, cond: E.Expr, e: E.Expr) -> E.Expr:
        outer = self.guard
        self.guard = _conjoin(outer, cond)
        try:
            return self.visit(e)
        finally:
            self.guard = outer

    def visit_Select(self, e: E.Select) -> E.Expr:
        c = self.visit(e.cond)
        a, b = self.under(c, e.a), self.under(_negate(c), e.b)
        return e if (c is e.cond and a is e.a and b is e.b) else E.Select(c, a, b)

    def visit_Binary(self, e: E.Binary) -> E.Expr:
        if e.op not in ("&&", "||"):
            return super().visit_Binary(e)
        a = self.visit(e.a)
        b = self.under(a if e.op == "&&" else _negate(a), e.b)
        return e if a is e.a and b is e.b else E.Binary(e.op, a, b)

    def visit_Load(self, e: E.Load) -> E.Expr:
        indices = tuple(self.visit(i) for i in e.indices)
        if self.guard is _TRUE or self.walk.pinned(e.buffer, indices):
            return e if all(x is y for x, y in zip(indices, e.indices)) else E.Load(e.buffer, indices)
        bounds = self.walk.bounds
        shape = e.buffer.type.shape if isinstance(e.buffer.type, TensorType) else (None,) * len(indices)
        proven = [extent is not None and bounds.in_bounds(i, extent) for i, extent in zip(indices, shape)]
        needs_guard = any(not ok and extent is None for ok, extent in zip(proven, shape))
        if needs_guard and _uses(self.guard) & self.walk.branch_vars:
            # The guard needs values the If branch computes: it cannot be evaluated before the If.
            return e if all(x is y for x, y in zip(indices, e.indices)) else E.Load(e.buffer, indices)
        safe = tuple(i if ok else self.walk.clamped(i, extent, self.guard) for i, ok, extent in zip(indices, proven, shape))
        var = E.Var(self.walk.fresh_name(e.buffer.name), dtypes.compute_type(e.type))
        self.hoisted.append(S.DeclareVar(var, E.Load(e.buffer, safe)))
        return var


class _Names(IRVisitor):
    """Variables a statement declares or assigns, buffers it stores to, and whether it loops."""

    def __init__(self) -> None:
        self.vars: set[E.Var] = set()
        self.assigned: set[E.Var] = set()
        self.stored: set[E.Var] = set()
        self.has_loop = False

    def visit_DeclareVar(self, s: S.DeclareVar) -> None:
        self.vars.add(s.var)
        super().visit_DeclareVar(s)

    def visit_Assign(self, s: S.Assign) -> None:
        self.vars.add(s.var)
        self.assigned.add(s.var)
        super().visit_Assign(s)

    def visit_Store(self, s: S.Store) -> None:
        self.stored.add(s.buffer)
        super().visit_Store(s)

    def visit_For(self, s: S.For) -> None:
        self.has_loop = True
        super().visit_For(s)

    def visit_ForMapping(self, s: S.ForMapping) -> None:
        self.has_loop = True
        super().visit_ForMapping(s)

    def visit_While(self, s: S.While) -> None:
        self.has_loop = True
        super().visit_While(s)


class _Uses(IRVisitor):
    def __init__(self) -> None:
        self.vars: set[E.Var] = set()

    def visit_Var(self, e: E.Var) -> None:
        self.vars.add(e)


def _uses(e: E.Expr) -> set[E.Var]:
    finder = _Uses()
    finder.visit(e)
    return finder.vars


class UnconditionalLoads:
    """The statement walk: tracks index bounds and hoists conditional reads before statements."""

    def __init__(self) -> None:
        self.bounds = IndexBounds()
        self.count = 0
        self.assigned: set[E.Var] = set()
        # Inside a straight-line If branch: what the branch changes (its reads of these stay put).
        self.branch_vars: set[E.Var] = set()
        self.branch_stores: set[E.Var] = set()

    def run(self, func: Function) -> Function:
        names = _Names()
        names.visit(func.body)
        self.assigned = names.assigned
        self.bounds.positive_vars = set(func.shape_params)
        body = self.stmt(func.body)
        return func if body is func.body else func.with_body(body)

    def fresh_name(self, buffer: str) -> str:
        self.count += 1
        return f"{buffer}_read{self.count}"

    def pinned(self, buffer: E.Var, indices: tuple[E.Expr, ...]) -> bool:
        return buffer in self.branch_stores or any(_uses(i) & self.branch_vars for i in indices)

    def clamped(self, index: E.Expr, extent: E.Expr | None, guard: E.Expr) -> E.Expr:
        """`index` made in bounds without a condition: min(max(index, 0), extent - 1) (either
        side dropped where it is proven), so the address never depends on the guard (gcc has
        been seen to mis-vectorize `b[c ? k : 0]` next to other conditional code).  Without a
        known extent, `guard ? index : 0`."""
        if extent is None:
            return E.Select(guard, index, E.Const(0, index.dtype))
        t = index.dtype
        below = self.bounds.below(index, extent)
        if not self.bounds.nonneg(index):
            index = E.Call("max", (index, E.Const(0, t)), t)
        if not below:
            last = E.Const(extent.value - 1, t) if isinstance(extent, E.Const) else E.Binary("-", _as(extent, t), E.Const(1, t))
            index = E.Call("min", (index, last), t)
        return index

    def expr(self, e: E.Expr, guard: E.Expr, hoisted: list[S.Stmt]) -> E.Expr:
        return _HoistReads(self, guard, hoisted).visit(e)

    def stmt(self, s: S.Stmt) -> S.Stmt:
        """`s` rewritten, with the reads hoisted out of its conditionals declared before it."""
        hoisted: list[S.Stmt] = []
        out = self.rewrite(s, _TRUE, hoisted)
        return S.seq(*hoisted, out) if hoisted else out

    def rewrite(self, s: S.Stmt, guard: E.Expr, hoisted: list[S.Stmt]) -> S.Stmt:
        """`s` rewritten where it runs only under `guard`; hoisted reads go to `hoisted`."""
        if isinstance(s, S.Seq):
            if guard is _TRUE:
                stmts = [self.stmt(x) for x in s.stmts]
            else:
                stmts = [self.rewrite(x, guard, hoisted) for x in s.stmts]
            return s if all(a is b for a, b in zip(stmts, s.stmts)) else S.Seq(stmts)
        if isinstance(s, S.Store):
            idx = tuple(self.expr(i, guard, hoisted) for i in s.indices)
            return keep_line(S.Store(s.buffer, idx, self.expr(s.value, guard, hoisted)), s)
        if isinstance(s, S.Assign):
            return keep_line(S.Assign(s.var, self.expr(s.value, guard, hoisted)), s)
        if isinstance(s, S.Evaluate):
            return keep_line(S.Evaluate(self.expr(s.expr, guard, hoisted)), s)
        if isinstance(s, S.DeclareVar):
            init = None if s.init is None else self.expr(s.init, guard, hoisted)
            if init is not None and isinstance(s.var.type, DataType) and s.var.type.is_integer and s.var not in self.assigned:
                self.bounds.definitions[s.var] = init
            return s if init is s.init else keep_line(S.DeclareVar(s.var, init), s)
        if isinstance(s, S.If):
            cond = self.expr(s.cond, guard, hoisted)
            then_body = self.branch(s.then_body, _conjoin(guard, cond), hoisted)
            else_body = None if s.else_body is None else self.branch(s.else_body, _conjoin(guard, _negate(cond)), hoisted)
            return keep_line(S.If(cond, then_body, else_body), s)
        if isinstance(s, S.For):
            if s.var not in self.assigned:
                self.bounds.loops[s.var] = s
            body = self.stmt(s.body)
            return s if body is s.body else S.For(s.var, s.start, s.stop, s.step, body, s.kind)
        if isinstance(s, S.While):
            body = self.stmt(s.body)
            return s if body is s.body else S.While(s.cond, body)
        if isinstance(s, S.ForMapping):
            body = self.stmt(s.body)
            return s if body is s.body else S.ForMapping(s.vars, s.mapping, s.worker, body, s.task_var)
        return s

    def branch(self, body: S.Stmt, guard: E.Expr, hoisted: list[S.Stmt]) -> S.Stmt:
        """A branch of an If.  A straight-line branch (what gcc if-converts) has its reads hoisted
        before the If, except those whose index or buffer the branch itself changes; a branch
        with loops is not if-converted and is rewritten as code of its own."""
        names = _Names()
        names.visit(body)
        if names.has_loop:
            return self.stmt(body)
        outer = self.branch_vars, self.branch_stores
        self.branch_vars, self.branch_stores = outer[0] | names.vars, outer[1] | names.stored
        try:
            return self.rewrite(body, guard, hoisted)
        finally:
            self.branch_vars, self.branch_stores = outer


def unconditional_loads(func: Function) -> Function:
    """The pass: CPU kernels get every conditional read hoisted and guarded; others are unchanged."""
    if func.kind != CPU_KERNEL:
        return func
    return UnconditionalLoads().run(func)
