"""Visitors and rewriters over the IR (in the spirit of TVM's TIR functors).

`IRVisitor` walks every node; `IRMutator` rebuilds a node only when one of its children
changed, so unchanged subtrees are shared.  Subclasses override `visit_<NodeClass>`.
"""

from __future__ import annotations

from typing import Any

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.func import Function


class IRVisitor:
    """Visit every expression and statement; override visit_X to act on node class X."""

    def visit(self, node: Any) -> Any:
        method = getattr(self, "visit_" + type(node).__name__, None)
        if method is None:
            raise NotImplementedError(f"{type(self).__name__} cannot visit {type(node).__name__}")
        return method(node)

    def visit_function(self, func: Function) -> None:
        self.visit(func.body)

    # expressions
    def visit_Var(self, e: E.Var) -> Any:
        pass

    def visit_Const(self, e: E.Const) -> Any:
        pass

    def visit_HardwareIndex(self, e: E.HardwareIndex) -> Any:
        pass

    def visit_Binary(self, e: E.Binary) -> Any:
        self.visit(e.a)
        self.visit(e.b)

    def visit_Unary(self, e: E.Unary) -> Any:
        self.visit(e.a)

    def visit_Cast(self, e: E.Cast) -> Any:
        self.visit(e.value)

    def visit_Select(self, e: E.Select) -> Any:
        self.visit(e.cond)
        self.visit(e.a)
        self.visit(e.b)

    def visit_Call(self, e: E.Call) -> Any:
        for a in e.args:
            self.visit(a)

    def visit_Load(self, e: E.Load) -> Any:
        self.visit(e.buffer)
        for i in e.indices:
            self.visit(i)

    def visit_Address(self, e: E.Address) -> Any:
        self.visit(e.buffer)
        for i in e.indices:
            self.visit(i)

    # statements
    def visit_Evaluate(self, s: S.Evaluate) -> Any:
        self.visit(s.expr)

    def visit_DeclareVar(self, s: S.DeclareVar) -> Any:
        if s.init is not None:
            self.visit(s.init)

    def visit_Assign(self, s: S.Assign) -> Any:
        self.visit(s.value)

    def visit_Store(self, s: S.Store) -> Any:
        self.visit(s.buffer)
        for i in s.indices:
            self.visit(i)
        self.visit(s.value)

    def visit_DeclareBuffer(self, s: S.DeclareBuffer) -> Any:
        pass

    def visit_For(self, s: S.For) -> Any:
        self.visit(s.start)
        self.visit(s.stop)
        self.visit(s.step)
        self.visit(s.body)

    def visit_ForMapping(self, s: S.ForMapping) -> Any:
        self.visit(s.worker)
        self.visit(s.body)

    def visit_If(self, s: S.If) -> Any:
        self.visit(s.cond)
        self.visit(s.then_body)
        if s.else_body is not None:
            self.visit(s.else_body)

    def visit_While(self, s: S.While) -> Any:
        self.visit(s.cond)
        self.visit(s.body)

    def visit_Break(self, s: S.Break) -> Any:
        pass

    def visit_Continue(self, s: S.Continue) -> Any:
        pass

    def visit_Return(self, s: S.Return) -> Any:
        pass

    def visit_Instruction(self, s: S.Instruction) -> Any:
        for x in s.operands:
            self.visit(x)

    def visit_Barrier(self, s: S.Barrier) -> Any:
        pass

    def visit_Seq(self, s: S.Seq) -> Any:
        for x in s.stmts:
            self.visit(x)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


def keep_line(new: S.Stmt, old: S.Stmt) -> S.Stmt:
    """`new` with the source line of the statement it replaces."""
    new.line = old.line
    return new


class IRMutator(IRVisitor):
    """Rewrite the IR bottom-up; each visit_X returns the (possibly new) node."""

    def mutate_function(self, func: Function) -> Function:
        body = self.visit(func.body)
        return func if body is func.body else func.with_body(body)

    def visit_Var(self, e: E.Var) -> E.Expr:
        return e

    def visit_Const(self, e: E.Const) -> E.Expr:
        return e

    def visit_HardwareIndex(self, e: E.HardwareIndex) -> E.Expr:
        return e

    def visit_Binary(self, e: E.Binary) -> E.Expr:
        a, b = self.visit(e.a), self.visit(e.b)
        return e if a is e.a and b is e.b else E.Binary(e.op, a, b)

    def visit_Unary(self, e: E.Unary) -> E.Expr:
        a = self.visit(e.a)
        return e if a is e.a else E.Unary(e.op, a)

    def visit_Cast(self, e: E.Cast) -> E.Expr:
        v = self.visit(e.value)
        return e if v is e.value else E.Cast(v, e.type)

    def visit_Select(self, e: E.Select) -> E.Expr:
        c, a, b = self.visit(e.cond), self.visit(e.a), self.visit(e.b)
        return e if (c is e.cond and a is e.a and b is e.b) else E.Select(c, a, b)

    def visit_Call(self, e: E.Call) -> E.Expr:
        args = tuple(self.visit(a) for a in e.args)
        return e if _same(args, e.args) else E.Call(e.func, args, e.type)

    def visit_Load(self, e: E.Load) -> E.Expr:
        buf = self.visit(e.buffer)
        idx = tuple(self.visit(i) for i in e.indices)
        return e if buf is e.buffer and _same(idx, e.indices) else E.Load(buf, idx)

    def visit_Address(self, e: E.Address) -> E.Expr:
        buf = self.visit(e.buffer)
        idx = tuple(self.visit(i) for i in e.indices)
        return e if buf is e.buffer and _same(idx, e.indices) else E.Address(buf, idx)

    def visit_Evaluate(self, s: S.Evaluate) -> S.Stmt:
        x = self.visit(s.expr)
        return s if x is s.expr else keep_line(S.Evaluate(x), s)

    def visit_DeclareVar(self, s: S.DeclareVar) -> S.Stmt:
        init = None if s.init is None else self.visit(s.init)
        return s if init is s.init else keep_line(S.DeclareVar(s.var, init), s)

    def visit_Assign(self, s: S.Assign) -> S.Stmt:
        v = self.visit(s.value)
        return s if v is s.value else keep_line(S.Assign(s.var, v), s)

    def visit_Store(self, s: S.Store) -> S.Stmt:
        buf = self.visit(s.buffer)
        idx = tuple(self.visit(i) for i in s.indices)
        v = self.visit(s.value)
        if buf is s.buffer and _same(idx, s.indices) and v is s.value:
            return s
        return keep_line(S.Store(buf, idx, v), s)

    def visit_DeclareBuffer(self, s: S.DeclareBuffer) -> S.Stmt:
        return s

    def visit_For(self, s: S.For) -> S.Stmt:
        start, stop, step = self.visit(s.start), self.visit(s.stop), self.visit(s.step)
        body = self.visit(s.body)
        if start is s.start and stop is s.stop and step is s.step and body is s.body:
            return s
        return keep_line(S.For(s.var, start, stop, step, body, s.kind), s)

    def visit_ForMapping(self, s: S.ForMapping) -> S.Stmt:
        w, body = self.visit(s.worker), self.visit(s.body)
        return s if w is s.worker and body is s.body else keep_line(S.ForMapping(s.vars, s.mapping, w, body, s.task_var), s)

    def visit_If(self, s: S.If) -> S.Stmt:
        c, t = self.visit(s.cond), self.visit(s.then_body)
        e = None if s.else_body is None else self.visit(s.else_body)
        if c is s.cond and t is s.then_body and e is s.else_body:
            return s
        return keep_line(S.If(c, t, e), s)

    def visit_While(self, s: S.While) -> S.Stmt:
        c, body = self.visit(s.cond), self.visit(s.body)
        return s if c is s.cond and body is s.body else keep_line(S.While(c, body), s)

    def visit_Break(self, s: S.Break) -> S.Stmt:
        return s

    def visit_Continue(self, s: S.Continue) -> S.Stmt:
        return s

    def visit_Return(self, s: S.Return) -> S.Stmt:
        return s

    def visit_Instruction(self, s: S.Instruction) -> S.Stmt:
        ops = tuple(self.visit(x) for x in s.operands)
        return s if _same(ops, s.operands) else keep_line(S.Instruction(s.name, ops, dict(s.attrs)), s)

    def visit_Barrier(self, s: S.Barrier) -> S.Stmt:
        return s

    def visit_Seq(self, s: S.Seq) -> S.Stmt:
        stmts = [self.visit(x) for x in s.stmts]
        if all(a is b for a, b in zip(stmts, s.stmts)):
            return s
        return keep_line(S.Seq(stmts), s)


class Substitute(IRMutator):
    """Replace variables by expressions."""

    def __init__(self, mapping: dict[E.Var, E.Expr]):
        self.mapping = mapping

    def visit_Var(self, e: E.Var) -> E.Expr:
        return self.mapping.get(e, e)


def substitute(node: Any, mapping: dict[E.Var, E.Expr]) -> Any:
    return Substitute(mapping).visit(node)


class _Written(IRVisitor):
    def __init__(self) -> None:
        self.buffers: set[E.Var] = set()

    def visit_Store(self, s: S.Store) -> None:
        self.buffers.add(s.buffer)
        super().visit_Store(s)

    def visit_Instruction(self, s: S.Instruction) -> None:
        # An instruction's first memory operand is the one it writes (tessera.ir.instructions).
        dst = next((x for x in s.operands if isinstance(x, E.Address)), None)
        if dst is not None:
            self.buffers.add(dst.buffer)
        super().visit_Instruction(s)


def written_buffers(func: Function) -> frozenset[E.Var]:
    """The tensors and pointers `func` may write: stores and instruction destinations."""
    finder = _Written()
    finder.visit_function(func)
    return frozenset(finder.buffers)


class _InstructionNames(IRVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Instruction(self, s: S.Instruction) -> None:
        self.names.add(s.name)
        super().visit_Instruction(s)


def instruction_names(func: Function) -> frozenset[str]:
    """The names of the instructions (tessera.ir.instructions) `func`'s body executes."""
    finder = _InstructionNames()
    finder.visit_function(func)
    return frozenset(finder.names)
