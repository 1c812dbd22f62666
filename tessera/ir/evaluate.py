"""Evaluate scalar IR expressions in Python (launch dimensions, shape checks, tests)."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

from tessera.ir import expr as E

_OPS = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv,
    "%": operator.mod, "&": operator.and_, "|": operator.or_, "^": operator.xor, "<<": operator.lshift,
    ">>": operator.rshift, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "==": operator.eq, "!=": operator.ne, "&&": lambda a, b: a and b, "||": lambda a, b: a or b,
}  # fmt: skip
_FUNCS = {"max": max, "min": min, "abs": abs, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
          "floor": math.floor, "ceil": math.ceil, "pow": math.pow}  # fmt: skip


class EvaluationError(ValueError):
    pass


def evaluate(e: E.Expr, env: Mapping[E.Var, Any]) -> Any:
    """The value of `e` with variables bound by `env` (by identity or by name)."""
    if isinstance(e, E.Const):
        return e.value
    if isinstance(e, E.Var):
        if e in env:
            return env[e]
        for k, v in env.items():
            if getattr(k, "name", k) == e.name:
                return v
        raise EvaluationError(f"no value for variable '{e.name}'")
    if isinstance(e, E.Binary):
        a, b = evaluate(e.a, env), evaluate(e.b, env)
        if e.op in ("//", "%", "/") and b == 0:
            raise EvaluationError(f"division by zero in {e}")
        return _OPS[e.op](a, b)
    if isinstance(e, E.Unary):
        a = evaluate(e.a, env)
        return {"-": operator.neg, "!": operator.not_, "~": operator.invert}[e.op](a)
    if isinstance(e, E.Cast):
        v = evaluate(e.value, env)
        return float(v) if e.type.is_float else bool(v) if e.type.is_bool else int(v)
    if isinstance(e, E.Select):
        return evaluate(e.a, env) if evaluate(e.cond, env) else evaluate(e.b, env)
    if isinstance(e, E.Call) and e.func in _FUNCS:
        return _FUNCS[e.func](*(evaluate(a, env) for a in e.args))
    raise EvaluationError(f"cannot evaluate {e} on the host")
