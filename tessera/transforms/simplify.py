"""Constant folding and algebraic identities.

Integer `//` and `%` follow Python (floor) semantics, the same as the IR defines them.
A rewrite is applied only when it keeps the expression's type unchanged.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.func import Function
from tessera.ir.functor import IRMutator, IRVisitor, substitute

_FOLD: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod, "&": operator.and_, "|": operator.or_,
    "^": operator.xor, "<<": operator.lshift, ">>": operator.rshift,
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "==": operator.eq, "!=": operator.ne, "&&": lambda a, b: bool(a) and bool(b),
    "||": lambda a, b: bool(a) or bool(b),
}  # fmt: skip


def _is(e: E.Expr, value: Any) -> bool:
    return isinstance(e, E.Const) and e.value == value


def fold_binary(op: str, a: E.Const, b: E.Const, dtype: Any) -> E.Const | None:
    """The constant value of `a op b`, or None when it cannot be folded exactly."""
    if op in ("/", "//", "%") and b.value == 0:
        return None
    if op in ("<<", ">>") and b.value < 0:
        return None
    if dtype.is_float and op == "%":
        value = math.fmod(a.value, b.value)
    elif dtype.is_float or op in ("/",):
        value = _FOLD[op](float(a.value), float(b.value)) if op not in E.COMPARE_OPS else _FOLD[op](a.value, b.value)
    else:
        value = _FOLD[op](a.value, b.value)
    if dtype.is_integer and not (dtype.min_value <= value <= dtype.max_value):
        return None  # would overflow: leave it to the target's arithmetic
    return E.Const(value, dtype)


class Simplify(IRMutator):
    def visit_Binary(self, e: E.Binary) -> E.Expr:
        a, b = self.visit(e.a), self.visit(e.b)
        node = e if (a is e.a and b is e.b) else E.Binary(e.op, a, b)
        if isinstance(a, E.Const) and isinstance(b, E.Const):
            folded = fold_binary(e.op, a, b, node.type)
            if folded is not None:
                return folded
        return self.identities(node)

    def identities(self, e: E.Binary) -> E.Expr:
        a, b, op, t = e.a, e.b, e.op, e.type
        integer = t.is_integer

        def keep(x: E.Expr) -> E.Expr | None:
            return x if x.type == t else None

        result: E.Expr | None = None
        if op == "+":
            result = keep(a) if _is(b, 0) else keep(b) if _is(a, 0) else None
            # (x + c1) + c2 -> x + (c1 + c2)
            if result is None and isinstance(b, E.Const) and isinstance(a, E.Binary) and a.op == "+" and isinstance(a.b, E.Const) and integer:
                c = fold_binary("+", a.b, b, t)
                if c is not None and a.type == t:
                    result = E.Binary("+", a.a, c)
        elif op == "-":
            result = keep(a) if _is(b, 0) else None
        elif op == "*":
            result = keep(a) if _is(b, 1) else keep(b) if _is(a, 1) else None
            if result is None and integer and (_is(a, 0) or _is(b, 0)):
                result = E.Const(0, t)
        elif op in ("//", "/") and integer:
            result = keep(a) if _is(b, 1) else None
        elif op == "%" and integer and _is(b, 1):
            result = E.Const(0, t)
        elif op == "&&":
            result = keep(b) if _is(a, True) else keep(a) if _is(b, True) else None
        elif op == "||":
            result = keep(b) if _is(a, False) else keep(a) if _is(b, False) else None
        return result if result is not None else e

    def visit_Unary(self, e: E.Unary) -> E.Expr:
        a = self.visit(e.a)
        if isinstance(a, E.Const):
            if e.op == "-":
                return E.Const(-a.value, e.type)
            if e.op == "!":
                return E.Const(not a.value, e.type)
            return E.Const(~int(a.value), e.type)
        return e if a is e.a else E.Unary(e.op, a)

    def visit_Cast(self, e: E.Cast) -> E.Expr:
        v = self.visit(e.value)
        if v.type == e.type:
            return v
        if isinstance(v, E.Const) and (e.type.is_float or (e.type.is_integer and not v.type.is_float)):
            if not e.type.is_integer or e.type.min_value <= v.value <= e.type.max_value:
                return E.Const(v.value, e.type)
        return e if v is e.value else E.Cast(v, e.type)

    def visit_Select(self, e: E.Select) -> E.Expr:
        c = self.visit(e.cond)
        if isinstance(c, E.Const):
            chosen = self.visit(e.a if c.value else e.b)
            return chosen if chosen.type == e.type else E.Cast(chosen, e.type)
        return super().visit_Select(e)

    def visit_If(self, s: S.If) -> S.Stmt:
        c = self.visit(s.cond)
        if isinstance(c, E.Const):
            taken = s.then_body if c.value else s.else_body
            return self.visit(taken) if taken is not None else S.Seq([])
        return super().visit_If(s)

    def visit_For(self, s: S.For) -> S.Stmt:
        start, stop, step = self.visit(s.start), self.visit(s.stop), self.visit(s.step)
        if isinstance(start, E.Const) and isinstance(stop, E.Const):
            if stop.value <= start.value:
                return S.Seq([])
            if isinstance(step, E.Const) and stop.value - start.value <= step.value and not _has_loop_exit(s.body):
                return self.visit(substitute(s.body, {s.var: start}))  # exactly one iteration
        return super().visit_For(s)


def _has_loop_exit(body: S.Stmt) -> bool:
    """True if `body` has a break/continue that belongs to the loop around it."""

    class Finder(IRVisitor):
        found = False

        def visit_Break(self, x: S.Break) -> None:
            self.found = True

        visit_Continue = visit_Break

        def visit_For(self, x: S.For) -> None:  # exits inside nested loops are theirs
            pass

        visit_While = visit_For

    f = Finder()
    f.visit(body)
    return f.found


def simplify(func: Function) -> Function:
    return Simplify().mutate_function(func)
