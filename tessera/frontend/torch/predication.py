"""Predication of data-dependent branches (Grape's third idea): one graph where dynamo would break.

`if torch.isinf(h).any(): h = torch.clamp(h, ...)` reads a tensor's value on the host, so dynamo
splits the model there: two graphs, a device sync, and no CUDA graph across the split.  Where
the branch is pure, it is the same as computing its body unconditionally and selecting:

    if h.dtype == torch.float16:                  # a condition on Python values stays a branch
        p = torch.isinf(h).any()                  # the tensor condition, as a 0-d bool tensor
        c = torch.finfo(h.dtype).max - 1000       # the body, computed every time
        h_new = torch.clamp(h, min=-c, max=c)
        h = select(p, h_new, h)                   # torch.where: every element as the branch had it

`predicate(model)` rewrites the `forward` of each submodule whose source has such a branch
(once per function; each module instance gets the rewritten method) and reports what it
rewrote and what it declined, and why.  A branch is rewritten only when it is safe:

- its condition is `and` of Python conditions (kept as the branch) and tensor conditions (a
  `.any()` / `.all()` reduction, possibly under `not`), and it has no `else`;
- its body only assigns names, from expressions that cannot raise or mutate: names, constants,
  attributes, arithmetic, comparisons and calls of the pure elementwise torch functions and
  tensor methods in PURE_CALLS (no in-place method, no `out=`);
- each name it assigns that is read after the branch held a value before it (a parameter, or
  assigned earlier in the function); names read only inside it need no merge.

At run time the merge selects with `torch.where` when both values are tensors; otherwise
(unexpected types) it evaluates the condition on the host, as the original branch did.
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("tessera")

# Calls a predicated body may make: elementwise or reducing, no side effects, no data-dependent errors.
PURE_CALLS = frozenset({
    "clamp", "clip", "clamp_min", "clamp_max", "where", "finfo", "iinfo", "nan_to_num", "abs", "minimum",
    "maximum", "masked_fill", "to", "float", "half", "bfloat16", "type_as", "isinf", "isnan", "isfinite",
    "any", "all", "logical_not", "logical_and", "logical_or", "sign", "neg", "reciprocal", "sqrt", "rsqrt",
    "exp", "log", "tanh", "sigmoid", "relu", "amax", "amin", "max", "min", "sum", "mean", "full_like",
    "zeros_like", "ones_like", "mul", "add", "sub", "div",
})  # fmt: skip
_REDUCTIONS = ("any", "all")
_PREFIX = "_tessera_p"


@dataclass
class PredicationReport:
    """What `predicate` did: each rewritten branch and each declined one, as (function, line, note)."""

    rewritten: list[tuple[str, int, str]] = field(default_factory=list)
    declined: list[tuple[str, int, str]] = field(default_factory=list)
    modules: int = 0  # module instances given a rewritten forward

    def __str__(self) -> str:
        lines = [f"predication: {len(self.rewritten)} branch(es) rewritten, {self.modules} module(s) use them"]
        lines += [f"  {fn}:{line}: {note}" for fn, line, note in self.rewritten]
        if self.declined:
            lines.append(f"  declined ({len(self.declined)}):")
            lines += [f"    {fn}:{line}: {note}" for fn, line, note in self.declined]
        return "\n".join(lines)


def select(condition: Any, new: Any, old: Any) -> Any:
    """The merge of a predicated branch: `new` where the 0-d `condition` holds, else `old`."""
    if isinstance(condition, torch.Tensor) and isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor):
        return torch.where(condition, new, old)
    return new if bool(condition) else old  # the original branch's semantics (a host read)


def predicate(model: torch.nn.Module) -> PredicationReport:
    """Rewrite the safe data-dependent branches of `model`'s submodules' `forward` methods into
    predication (in place: each module instance gets the rewritten method) and report them.
    Call it before `torch.compile(model, backend="tessera")`; results are unchanged."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"predicate() takes a torch.nn.Module, got {type(model).__name__}")
    report = PredicationReport()
    seen: dict[Any, Any] = {}
    for module in model.modules():
        fn = getattr(type(module), "forward", None)
        if not isinstance(fn, types.FunctionType) or "forward" in vars(module):
            continue
        if fn not in seen:
            seen[fn] = _rewritten(fn, report)
        if seen[fn] is not None:
            module.forward = types.MethodType(seen[fn], module)
            report.modules += 1
    for name, line, note in report.declined:
        log.info("tessera: predication declined %s:%d: %s", name, line, note)
    return report


def _rewritten(fn: types.FunctionType, report: PredicationReport) -> types.FunctionType | None:
    """fn with its safe tensor branches predicated, or None when it has none (or cannot be rewritten).

    A decorated fn (functools.wraps: `__wrapped__`) is rebuilt around the rewritten inner
    function: a copy of each wrapper whose closure cell holding the inner one holds the new one."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None:
        if not isinstance(inner, types.FunctionType):
            return None
        new_inner = _rewritten(inner, report)
        if new_inner is None:
            return None
        cells = list(fn.__closure__ or ())
        if not any(_holds(c, inner) for c in cells):
            report.declined.append((fn.__qualname__, fn.__code__.co_firstlineno,
                                    "its decorator does not keep the function in a closure: cannot be rebuilt"))  # fmt: skip
            return None
        closure = tuple(types.CellType(new_inner) if _holds(c, inner) else c for c in cells)
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
        new.__dict__.update(fn.__dict__)
        new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
        new.__wrapped__ = new_inner  # type: ignore[attr-defined]
        return new
    name = fn.__qualname__
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    if ".any()" not in source and ".all()" not in source:
        return None
    func = ast.parse(source).body[0]
    if not isinstance(func, ast.FunctionDef) or func.name != fn.__code__.co_name:
        return None
    # fn runs this def's own code, so its decorators returned it as it is (a wrapper would be
    # another function, reached above through __wrapped__): the rewrite leaves them out.
    func.decorator_list = []
    first_line = fn.__code__.co_firstlineno  # of the first decorator, where the source starts too
    rewriter = _Rewriter(name, first_line - 1, func)
    func.body = rewriter.block(func.body)
    report.declined += rewriter.declined
    if not rewriter.rewritten:
        return None
    report.rewritten += rewriter.rewritten
    return _compile(fn, func)


def _holds(cell: Any, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _params(func: ast.FunctionDef) -> set[str]:
    a = func.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []), *([a.kwarg] if a.kwarg else [])]
    return {p.arg for p in names}


def _compile(fn: types.FunctionType, func: ast.FunctionDef) -> types.FunctionType:
    """Define the rewritten function in fn's globals, with fn's closure cells (`__class__` for
    `super()`), defaults and line numbers; `select` reaches it through the factory's closure."""
    for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs, func.args.vararg, func.args.kwarg):
        if a is not None:
            a.annotation = None  # evaluated at definition: not needed, and may name typing-only imports
    func.returns = None
    free = list(fn.__code__.co_freevars)
    factory = ast.FunctionDef(name="_tessera_factory", args=ast.arguments(
        posonlyargs=[], args=[ast.arg(arg=n) for n in [f"{_PREFIX}_select", *free]], kwonlyargs=[], kw_defaults=[],
        defaults=[]), body=[func, ast.Return(ast.Name(func.name, ast.Load()))], decorator_list=[], returns=None)  # fmt: skip
    if "type_params" in ast.FunctionDef._fields:  # Python 3.12+
        factory.type_params = []
    module = ast.Module(body=[factory], type_ignores=[])
    for node in (factory, factory.args, *factory.args.args, factory.body[1]):
        ast.copy_location(node, func)
    ast.fix_missing_locations(module)
    ast.increment_lineno(module, fn.__code__.co_firstlineno - 1)  # tracebacks show the original file's lines
    namespace: dict[str, Any] = {}
    exec(compile(module, inspect.getsourcefile(fn) or "<predicated>", "exec"), fn.__globals__, namespace)
    cells = [c.cell_contents for c in (fn.__closure__ or ())]
    new = namespace["_tessera_factory"](select, *cells)
    new.__defaults__, new.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__tessera_original__ = fn  # type: ignore[attr-defined]
    return new


class _Rewriter:
    """Predicates the safe `if` statements of one function body (see the module docstring)."""

    def __init__(self, name: str, line_offset: int, func: ast.FunctionDef):
        self.name, self.offset, self.func = name, line_offset, func
        self.rewritten: list[tuple[str, int, str]] = []
        self.declined: list[tuple[str, int, str]] = []
        self.bound = _params(func)  # names holding a value at the current statement
        self.count = 0

    def block(self, stmts: list[ast.stmt], bound: set[str] | None = None) -> list[ast.stmt]:
        """The statements with their safe branches predicated; `bound`: the names that surely hold
        a value before the first (a nested block starts from a copy of its parent's)."""
        bound = set(self.bound if bound is None else bound)
        out: list[ast.stmt] = []
        for s in stmts:
            if isinstance(s, ast.If):
                new = self._if(s, bound)
                if new is not None:
                    out.extend(new)
                    continue
                s.body, s.orelse = self.block(s.body, bound), self.block(s.orelse, bound)
            elif isinstance(s, (ast.For, ast.While, ast.With)):
                s.body = self.block(s.body, bound)
            out.append(s)
            if not isinstance(s, (ast.If, ast.For, ast.While, ast.Try)):  # those may not run their stores
                bound |= {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        return out

    def _if(self, s: ast.If, bound: set[str]) -> list[ast.stmt] | None:
        conjuncts = s.test.values if isinstance(s.test, ast.BoolOp) and isinstance(s.test.op, ast.And) else [s.test]
        tensor = [c for c in conjuncts if _tensor_condition(c)]
        if not tensor:
            return None
        line = s.lineno + self.offset
        why = self._unsafe(s, conjuncts, tensor, bound)
        if why is not None:
            self.declined.append((self.name, line, why))
            return None
        self.count += 1
        p = f"{_PREFIX}{self.count}"
        assigned = [t.id for st in s.body for t in st.targets]  # type: ignore[attr-defined]
        live = [n for n in dict.fromkeys(assigned) if _read_outside(self.func, s, n)]
        renames = {n: f"{_PREFIX}{self.count}_{n}" for n in live}
        rename = _Rename(renames)
        body: list[ast.stmt] = [ast.Assign([ast.Name(p, ast.Store())], _tensor_expr(tensor))]
        body += [rename.visit(st) for st in s.body]
        for n, tmp in renames.items():
            merge = ast.Call(ast.Name(f"{_PREFIX}_select", ast.Load()),
                             [ast.Name(p, ast.Load()), ast.Name(tmp, ast.Load()), ast.Name(n, ast.Load())], [])  # fmt: skip
            body.append(ast.Assign([ast.Name(n, ast.Store())], merge))
        static = [c for c in conjuncts if c not in tensor]
        self.rewritten.append((self.name, line, f"predicated ({', '.join(live) or 'no live names'} selected)"))
        for st in body:
            ast.copy_location(st, s)
        if not static:
            return body
        test = static[0] if len(static) == 1 else ast.BoolOp(ast.And(), static)
        return [ast.copy_location(ast.If(test, body, []), s)]

    def _unsafe(self, s: ast.If, conjuncts: list[ast.expr], tensor: list[ast.expr], bound: set[str]) -> str | None:
        """Why the branch cannot be predicated, or None."""
        if s.orelse:
            return "has an else branch"
        if any(c not in tensor for c in conjuncts[conjuncts.index(tensor[0]):]):
            # the branch keeps the Python conditions, which would then run whatever the tensor one says
            return "a Python condition follows the tensor one"
        for c in tensor:
            if not _pure(c):
                return "its tensor condition calls something not known to be pure"
        for st in s.body:
            if not (isinstance(st, ast.Assign) and all(isinstance(t, ast.Name) for t in st.targets)):
                return f"its body does more than assign names (line {st.lineno + self.offset})"
            if not _pure(st.value):
                return f"its body calls something not known to be pure (line {st.lineno + self.offset})"
        assigned = {t.id for st in s.body for t in st.targets}  # type: ignore[attr-defined]
        unbound = sorted(n for n in assigned if _read_outside(self.func, s, n) and n not in bound)
        if unbound:
            return f"{unbound} is read after it but may have no value before it"
        return None


def _tensor_condition(c: ast.expr) -> bool:
    """A condition reading a tensor reduction's value: `x.any()`, `x.all()`, under `not`."""
    if isinstance(c, ast.UnaryOp) and isinstance(c.op, ast.Not):
        return _tensor_condition(c.operand)
    return isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in _REDUCTIONS and not c.args


def _tensor_expr(conds: list[ast.expr]) -> ast.expr:
    """The tensor conditions as one 0-d bool tensor expression."""

    def one(c: ast.expr) -> ast.expr:
        if isinstance(c, ast.UnaryOp) and isinstance(c.op, ast.Not):
            return _torch_call("logical_not", [one(c.operand)])
        return c

    out = one(conds[0])
    for c in conds[1:]:
        out = _torch_call("logical_and", [out, one(c)])
    return out


def _torch_call(name: str, args: list[ast.expr]) -> ast.expr:
    return ast.Call(ast.Attribute(ast.Name("torch", ast.Load()), name, ast.Load()), args, [])


_PURE_NODES = (ast.Name, ast.Constant, ast.Attribute, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call, ast.keyword,
               ast.Tuple, ast.List, ast.Load, ast.operator, ast.unaryop, ast.cmpop, ast.Subscript, ast.Slice)  # fmt: skip


def _pure(e: ast.expr) -> bool:
    for node in ast.walk(e):
        if not isinstance(node, _PURE_NODES):
            return False
        if isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if called not in PURE_CALLS or any(k.arg == "out" for k in node.keywords):
                return False
    return True


def _read_outside(func: ast.FunctionDef, branch: ast.If, name: str) -> bool:
    """Whether `name` is read anywhere in the function outside the branch's body (after it, in
    a later loop iteration, in its condition): its value after the branch then matters."""
    inside = {id(n) for st in branch.body for n in ast.walk(st)}
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) and id(n) not in inside
               for n in ast.walk(func))  # fmt: skip


class _Rename(ast.NodeTransformer):
    """Assignments to (and later reads of) the live names go to temporaries."""

    def __init__(self, renames: dict[str, str]):
        self.renames = renames
        self.assigned: set[str] = set()

    def visit_Assign(self, node: ast.Assign) -> ast.Assign:
        node.value = self.visit(node.value)  # reads first: `h = clamp(h)` reads the old h
        for t in node.targets:
            if isinstance(t, ast.Name) and t.id in self.renames:
                self.assigned.add(t.id)
                t.id = self.renames[t.id]
        return node

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if isinstance(node.ctx, ast.Load) and node.id in self.assigned:
            node.id = self.renames[node.id]
        return node
