"""Parse a Python function's AST into a tessera IR Function.

Values during parsing are either IR expressions (run-time values) or plain Python objects
(compile-time values: ints from the enclosing scope, task mappings, dtypes, builtins).
Arithmetic on compile-time values is evaluated in Python, so kernel templates can use
closure constants freely; `if` on a compile-time condition keeps only the taken branch.
"""

from __future__ import annotations

import ast
import builtins as py_builtins
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

from tessera.errors import KernelSyntaxError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.dtypes import DataType
from tessera.ir.func import TARGETS, Function, LaunchConfig
from tessera.ir.intrinsics import INTRINSICS
from tessera.ir.mapping import TaskMapping, repeat
from tessera.ir.types import GLOBAL, REGISTER, SHARED, PointerType, TensorType
from tessera.lang import builtins as B

_BINOPS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>",
}  # fmt: skip
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_PY_EQUIVALENTS = B.python_equivalents()


class _Error(Exception):
    """Internal: an error message to be attached to the current AST node."""


def _is_py_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, bool))


class KernelParser:
    """Translate one Python function into a Function for `target` ("cpu" or "cuda")."""

    def __init__(self, pyfunc: Callable, target: str, name: str | None = None):
        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r}; choose one of {sorted(TARGETS)}")
        self.pyfunc, self.target = pyfunc, target
        self.name = name or pyfunc.__name__
        try:
            lines, self.first_line = inspect.getsourcelines(pyfunc)
            self.filename = inspect.getsourcefile(pyfunc) or "<unknown>"
        except (OSError, TypeError) as exc:
            raise KernelSyntaxError(f"cannot read the source of {pyfunc!r}: {exc}", self.name) from None
        self.source_lines = lines
        self.tree = ast.parse(textwrap.dedent("".join(lines)))
        self.indent = len(lines[0]) - len(lines[0].lstrip())
        self.env = dict(pyfunc.__globals__)
        if pyfunc.__closure__:
            for var, cell in zip(pyfunc.__code__.co_freevars, pyfunc.__closure__):
                try:
                    self.env[var] = cell.cell_contents
                except ValueError:  # empty cell: defined later in the enclosing function
                    pass
        self.scopes: list[dict[str, Any]] = []
        self.shape_params: dict[str, E.Var] = {}
        self.launch = LaunchConfig()
        self.current: ast.AST | None = None
        self.loop_depth = 0
        self.counter = 0
        # Variables the kernel may read but not assign: loop indices and shape symbols.
        self.readonly: dict[E.Var, str] = {}

    # ---- entry -----------------------------------------------------------------------
    def parse(self) -> Function:
        fdef = self.tree.body[0]
        if not isinstance(fdef, ast.FunctionDef):
            raise KernelSyntaxError("a kernel must be a plain `def` function", self.name, self.filename)
        self.current = fdef
        try:
            params = self.parse_params(fdef)
            body = self.block(fdef.body)
            self.check_launch(fdef)
        except _Error as err:
            raise self.error(str(err)) from None
        func = Function(self.name, params, body, TARGETS[self.target], self.launch, list(self.shape_params.values()))
        func.source_file, func.source_line = self.filename, self.first_line
        return func

    def error(self, message: str, node: ast.AST | None = None) -> KernelSyntaxError:
        node = node or self.current
        rel = getattr(node, "lineno", 1)
        col = getattr(node, "col_offset", 0) + self.indent
        src = self.source_lines[rel - 1] if 0 < rel <= len(self.source_lines) else ""
        return KernelSyntaxError(message, self.name, self.filename, self.first_line + rel - 1, col, src)

    # ---- parameters --------------------------------------------------------------------
    def parse_params(self, fdef: ast.FunctionDef) -> list[E.Var]:
        a = fdef.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults:
            raise _Error("kernel parameters must be plain positional parameters without defaults")
        self.scopes.append({})
        params: list[E.Var] = []
        annotations = []
        for arg in a.args:
            self.current = arg
            if arg.annotation is None:
                raise _Error(f"parameter '{arg.arg}' needs a type annotation, e.g. `{arg.arg}: f32['n']` or `: int32`")
            ann = self.eval_python(arg.annotation)
            if isinstance(ann, str):  # `from __future__ import annotations`
                ann = self.eval_python(ast.parse(ann, mode="eval").body)
            if not isinstance(ann, (DataType, TensorType, PointerType)):
                raise _Error(f"parameter '{arg.arg}' has annotation {ann!r}; expected a dtype, a tensor type or ptr()")
            if isinstance(ann, DataType) and (ann.is_subbyte or ann.name in ("e4m3", "e5m2")):
                raise _Error(f"scalar parameter '{arg.arg}' cannot have the storage-only type {ann}")
            annotations.append((arg, ann))
            if not isinstance(ann, TensorType):
                var = E.Var(arg.arg, ann)
                params.append(var)
                self.define(arg.arg, var)
            else:
                params.append(None)  # filled below, once all scalar params are known
        for k, (arg, ann) in enumerate(annotations):
            if isinstance(ann, TensorType):
                self.current = arg
                shape = tuple(self.shape_dim(d, arg.arg) for d in ann.shape)
                var = E.Var(arg.arg, TensorType(ann.dtype, shape, GLOBAL))
                params[k] = var
                self.define(arg.arg, var)
        return params

    def shape_dim(self, d: Any, pname: str) -> E.Expr:
        if isinstance(d, int):
            return E.Const(d, dtypes.int32)
        existing = self.lookup_local(d)
        if isinstance(existing, E.Var):
            if not (isinstance(existing.type, DataType) and existing.type.is_integer):
                raise _Error(f"shape symbol '{d}' of '{pname}' names parameter '{d}', which is not an integer")
            self.readonly[existing] = "shape symbol"
            return existing
        if d not in self.shape_params:
            if not d.isidentifier():
                raise _Error(f"shape symbol {d!r} of '{pname}' is not a valid identifier")
            var = E.Var(d, dtypes.int32)
            self.readonly[var] = "shape symbol"
            self.shape_params[d] = var
            self.define(d, var)
        return self.shape_params[d]

    # ---- scopes ---------------------------------------------------------------------------
    def define(self, name: str, value: Any) -> None:
        self.scopes[-1][name] = value

    def lookup_local(self, name: str) -> Any:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def lookup(self, name: str) -> Any:
        local = self.lookup_local(name)
        if local is not None:
            return local
        if name in self.env:
            return self.env[name]
        if hasattr(py_builtins, name):
            return getattr(py_builtins, name)
        raise _Error(f"name '{name}' is not defined (kernels see their parameters, locals and enclosing Python scope)")

    def eval_python(self, node: ast.expr) -> Any:
        """Evaluate an expression as ordinary Python in the kernel's enclosing scope."""
        env = dict(self.env)
        for scope in self.scopes:
            env.update({k: v for k, v in scope.items() if not isinstance(v, E.Expr)})
        try:
            return eval(compile(ast.Expression(node), self.filename, "eval"), env)
        except Exception as exc:  # noqa: BLE001  (user code: report whatever went wrong)
            raise _Error(f"cannot evaluate `{ast.unparse(node)}` at compile time: {exc}") from None

    # ---- statements -------------------------------------------------------------------------
    def block(self, body: list[ast.stmt], scope: dict[str, Any] | None = None) -> S.Stmt:
        self.scopes.append(scope if scope is not None else {})
        try:
            out = [self.stmt(s) for s in body]
        finally:
            self.scopes.pop()
        return S.seq(*[s for s in out if s is not None]) if out else S.Seq([])

    def stmt(self, node: ast.stmt) -> S.Stmt | None:
        self.current = node
        method = getattr(self, "stmt_" + type(node).__name__, None)
        if method is None:
            raise _Error(f"`{type(node).__name__}` statements are not supported in kernels")
        try:
            result = method(node)
        except E.IRTypeError as exc:
            self.current = node
            raise _Error(str(exc)) from None
        if isinstance(result, S.Stmt):
            result.line = self.first_line + node.lineno - 1
        return result

    def stmt_Pass(self, node: ast.Pass) -> None:
        return None

    def stmt_Expr(self, node: ast.Expr) -> S.Stmt | None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None  # docstring
        value = self.expr(node.value)
        if isinstance(value, S.Stmt):
            return value
        if isinstance(value, E.Call):
            return S.Evaluate(value)
        raise _Error("this expression has no effect; did you mean to assign it?")

    def stmt_Return(self, node: ast.Return) -> S.Stmt:
        if node.value is not None:
            raise _Error("kernels cannot return values; write results into an output tensor")
        return S.Return()

    def stmt_Break(self, node: ast.Break) -> S.Stmt:
        return S.Break()

    def stmt_Continue(self, node: ast.Continue) -> S.Stmt:
        return S.Continue()

    def stmt_AnnAssign(self, node: ast.AnnAssign) -> S.Stmt:
        if not isinstance(node.target, ast.Name):
            raise _Error("annotated assignment needs a plain name on the left")
        t = self.eval_python(node.annotation)
        if not isinstance(t, DataType):
            raise _Error(f"local variables must have a scalar dtype, got {t!r}")
        if node.target.id in self.scopes[-1]:
            raise _Error(f"variable '{node.target.id}' is already defined")
        var = E.Var(node.target.id, t)
        init = None if node.value is None else self.convert(self.to_ir(self.expr(node.value)), t)
        self.define(var.name, var)
        return S.DeclareVar(var, init)

    def stmt_Assign(self, node: ast.Assign) -> S.Stmt | None:
        if len(node.targets) != 1:
            raise _Error("chained assignment (a = b = c) is not supported")
        target = node.targets[0]
        if isinstance(target, ast.Tuple):
            if not isinstance(node.value, ast.Tuple) or len(node.value.elts) != len(target.elts):
                raise _Error("tuple assignment needs a tuple of the same length on the right")
            values = [self.expr(v) for v in node.value.elts]  # every right-hand side first
            stmts: list[S.Stmt] = []
            targets = {n.id for t in target.elts for n in ast.walk(t) if isinstance(n, ast.Name)}
            sources = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            for k, v in enumerate(values):
                # a, b = b, a needs temporaries; independent targets do not.
                if targets & sources and isinstance(v, E.Expr) and not isinstance(v, E.Const):
                    tmp = self.fresh_var("tmp", v.dtype)
                    stmts.append(S.DeclareVar(tmp, v))
                    values[k] = tmp
            for t, v in zip(target.elts, values):
                if (s := self.assign_to(t, v)) is not None:
                    stmts.append(s)
            return S.seq(*stmts)
        return self.assign_to(target, self.expr(node.value))

    def assign_to(self, target: ast.expr, value: Any) -> S.Stmt | None:
        self.current = target
        if isinstance(target, ast.Attribute):
            return self.assign_attr(target, value)
        if isinstance(target, ast.Subscript):
            buf, indices = self.subscript_target(target)
            return S.Store(buf, indices, self.convert(self.to_ir(value), buf.type.dtype))
        if not isinstance(target, ast.Name):
            raise _Error(f"cannot assign to `{ast.unparse(target)}`")
        name = target.id
        existing = self.lookup_local(name)
        if isinstance(value, S.DeclareBuffer):
            if existing is not None:
                raise _Error(f"'{name}' is already defined; give the new tensor another name")
            value.var.name = name
            self.define(name, value.var)
            return value
        if isinstance(existing, E.Var):
            if value is existing:
                return None  # M = M (e.g. M = a.shape[0] where M is the shape symbol)
            if not isinstance(existing.type, DataType):
                raise _Error(f"cannot rebind tensor or pointer '{name}'; assign to its elements instead")
            self.check_assignable(existing)
            return S.Assign(existing, self.convert(self.to_ir(value), existing.type, name))
        if not isinstance(value, E.Expr) and not _is_py_scalar(value):
            self.define(name, value)  # compile-time value (mapping, dtype, ...)
            return None
        # A scalar literal assigned in the body starts a run-time variable (acc = 0.0).
        value = self.to_ir(value)
        var = E.Var(name, value.dtype)
        self.define(name, var)
        return S.DeclareVar(var, value)

    def check_assignable(self, var: E.Var) -> None:
        what = self.readonly.get(var)
        if what == "loop variable":
            raise _Error(f"cannot assign to loop variable '{var.name}'; copy it into a new variable first")
        if what is not None:
            raise _Error(f"cannot assign to '{var.name}': it is a tensor dimension ({what}); copy it first")

    def fresh_var(self, hint: str, dtype: DataType) -> E.Var:
        self.counter += 1
        return E.Var(f"_{hint}{self.counter}", dtype)

    def assign_attr(self, target: ast.Attribute, value: Any) -> None:
        owner = self.expr(target.value)
        if owner is not B.attrs:
            raise _Error(f"cannot assign to attribute `{ast.unparse(target)}`")
        if self.target != "cuda":
            raise _Error("attrs.grid/attrs.block configure CUDA launches; CPU kernels do not use them")
        values = value if isinstance(value, tuple) else (value,)
        if target.attr in ("grid", "block"):
            if not 1 <= len(values) <= 3:
                raise _Error(f"attrs.{target.attr} takes 1 to 3 dimensions, got {len(values)}")
            dims = tuple(self.to_ir(v) for v in values)
            if target.attr == "block" and not all(isinstance(v, int) and v > 0 for v in values):
                raise _Error("attrs.block must be compile-time positive integers")
            setattr(self.launch, target.attr, dims)
        elif target.attr == "dynamic_smem":
            self.launch.dynamic_smem = self.to_ir(value)
        elif target.attr == "min_blocks":
            if not isinstance(value, int):
                raise _Error("attrs.min_blocks must be a compile-time integer")
            self.launch.min_blocks = value
        else:
            raise _Error(f"unknown launch attribute '{target.attr}'; use grid, block, dynamic_smem or min_blocks")
        return None

    def subscript_target(self, node: ast.Subscript) -> tuple[E.Var, tuple[E.Expr, ...]]:
        buf = self.expr(node.value)
        if not isinstance(buf, E.Var) or isinstance(buf.type, DataType):
            raise _Error(f"`{ast.unparse(node.value)}` is not a tensor or pointer")
        idx_node = node.slice
        elts = idx_node.elts if isinstance(idx_node, ast.Tuple) else [idx_node]
        if any(isinstance(e, ast.Slice) for e in elts):
            raise _Error("slices are not supported; index one element at a time")
        return buf, tuple(self.to_ir(self.expr(e)) for e in elts)

    def stmt_AugAssign(self, node: ast.AugAssign) -> S.Stmt:
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise _Error(f"augmented operator {type(node.op).__name__} is not supported")
        rhs = self.to_ir(self.expr(node.value))
        if isinstance(node.target, ast.Subscript):
            buf, indices = self.subscript_target(node.target)
            value = E.Binary(op, E.Load(buf, indices), rhs)
            return S.Store(buf, indices, self.convert(value, buf.type.dtype))
        if isinstance(node.target, ast.Name):
            var = self.lookup_local(node.target.id)
            if not isinstance(var, E.Var) or not isinstance(var.type, DataType):
                raise _Error(f"'{node.target.id}' is not a scalar variable defined in this kernel")
            self.check_assignable(var)
            return S.Assign(var, self.convert(E.Binary(op, var, rhs), var.type, var.name))
        raise _Error(f"cannot assign to `{ast.unparse(node.target)}`")

    def stmt_If(self, node: ast.If) -> S.Stmt | None:
        cond = self.expr(node.test)
        if not isinstance(cond, E.Expr):  # compile-time condition: keep only the taken branch
            return self.block(node.body if cond else node.orelse)
        cond = self.as_condition(cond)
        then_body = self.block(node.body)
        else_body = self.block(node.orelse) if node.orelse else None
        return S.If(cond, then_body, else_body)

    def stmt_While(self, node: ast.While) -> S.Stmt:
        if node.orelse:
            raise _Error("while/else is not supported")
        cond = self.as_condition(self.to_ir(self.expr(node.test)))
        self.loop_depth += 1
        body = self.block(node.body)
        self.loop_depth -= 1
        return S.While(cond, body)

    def stmt_For(self, node: ast.For) -> S.Stmt:
        if node.orelse:
            raise _Error("for/else is not supported")
        it = node.iter
        task_name = None
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate":
            # for t, (i, j) in enumerate(m.on(w)): t numbers the worker's own tasks
            target = node.target
            if not (isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[0], ast.Name)):
                raise _Error("use `for t, (i, j) in enumerate(mapping.on(worker))`")
            if len(it.args) != 1 or not self.is_mapping_on(it.args[0]):
                raise _Error("enumerate() in kernels only wraps mapping.on(worker)")
            task_name, it = target.elts[0].id, it.args[0]
            names = self.target_names(target.elts[1])
        else:
            names = self.target_names(node.target)
        self.loop_depth += 1
        try:
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "on":
                mapping = self.expr(it.func.value)
                if isinstance(mapping, TaskMapping):
                    if len(it.args) != 1 or it.keywords:
                        raise _Error("mapping.on() takes exactly one argument: the worker index")
                    worker = self.to_ir(self.expr(it.args[0]))
                    return self.mapping_loop(names, mapping, worker, node, task_name)
            func = self.expr(it.func) if isinstance(it, ast.Call) else self.expr(it)
            if isinstance(it, ast.Call) and not isinstance(func, B.Builtin) and func is not py_builtins.range:
                func = self.expr(it)  # e.g. `for i, j in spatial(4, 8):`
            if isinstance(func, (list, tuple)) and not isinstance(it, ast.Call):
                return self.static_loop(names, func, node)
            if isinstance(func, TaskMapping):  # every task of every worker, worker-major
                w = self.fresh_var("worker", dtypes.int32)
                inner = self.mapping_loop(names, func, w, node)
                return S.For(w, E.Const(0, dtypes.int32), E.Const(func.num_workers, dtypes.int32), E.Const(1, dtypes.int32), inner)
            if func is py_builtins.range or (isinstance(func, B.Builtin) and func.name in ("unroll", "parallel")):
                kind = S.SERIAL if func is py_builtins.range else (S.UNROLL if func.name == "unroll" else S.PARALLEL)
                if kind == S.PARALLEL and self.target != "cpu":
                    raise _Error("parallel() loops are for CPU kernels; on CUDA use thread/block indices")
                if len(names) != 1:
                    raise _Error(f"{getattr(func, 'name', 'range')}() yields one index, not {len(names)}")
                return self.range_loop(names[0], [self.expr(a) for a in it.args], kind, node, it)
            if isinstance(func, B.Builtin) and func.name == "grid":
                extents = [self.expr(a) for a in it.args]
                if len(extents) != len(names):
                    raise _Error(f"grid() has {len(extents)} dimensions but the loop unpacks {len(names)} names")
                if all(isinstance(x, int) for x in extents):
                    return self.mapping_loop(names, repeat(*extents), E.Const(0, dtypes.int32), node)
                return self.nested_grid(names, extents, node)
            raise _Error("kernels can loop over range(), unroll(), parallel(), grid() or mapping.on(worker)")
        finally:
            self.loop_depth -= 1

    def target_names(self, target: ast.expr) -> list[str]:
        elts = target.elts if isinstance(target, ast.Tuple) else [target]
        if not all(isinstance(e, ast.Name) for e in elts):
            raise _Error("loop targets must be plain names")
        return [e.id for e in elts]

    def new_loop_var(self, name: str, dtype: DataType = dtypes.int32) -> E.Var:
        if name in self.scopes[0]:
            raise _Error(f"loop variable '{name}' shadows a kernel parameter")
        var = E.Var(name, dtype)
        self.readonly[var] = "loop variable"
        return var

    def range_loop(self, name: str, args: list[Any], kind: str, node: ast.For, call: ast.expr) -> S.Stmt:
        if not 1 <= len(args) <= 3:
            raise _Error("range() takes 1 to 3 arguments")
        irs = [self.to_ir(a) for a in args]
        for a in irs:
            if not a.dtype.is_integer:
                raise _Error(f"range() bounds must be integers, got {a.dtype}")
        zero, one = E.Const(0, dtypes.int32), E.Const(1, dtypes.int32)
        start, stop, step = (zero, irs[0], one) if len(irs) == 1 else (irs[0], irs[1], irs[2] if len(irs) == 3 else one)
        if isinstance(step, E.Const) and step.value <= 0:
            raise _Error("range() steps must be positive constants or expressions")
        dtype = dtypes.promote(dtypes.promote(start.dtype, stop.dtype), step.dtype)
        var = self.new_loop_var(name, dtype)
        body = self.block(node.body, {name: var})
        return S.For(var, start, stop, step, body, kind)

    def nested_grid(self, names: list[str], extents: list[Any], node: ast.For) -> S.Stmt:
        vars_ = [self.new_loop_var(n) for n in names]
        body = self.block(node.body, dict(zip(names, vars_)))
        zero, one = E.Const(0, dtypes.int32), E.Const(1, dtypes.int32)
        for v, ext in reversed(list(zip(vars_, extents))):
            body = S.For(v, zero, self.to_ir(ext), one, body)
        return body

    def is_mapping_on(self, node: ast.expr) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "on"
                and isinstance(self.expr(node.func.value), TaskMapping))  # fmt: skip

    def mapping_loop(self, names: list[str], mapping: TaskMapping, worker: E.Expr, node: ast.For,
                     task_name: str | None = None) -> S.Stmt:  # fmt: skip
        if len(names) != mapping.rank:
            raise _Error(f"the mapping {mapping} has rank {mapping.rank} but the loop unpacks {len(names)} names")
        if not worker.dtype.is_integer:
            raise _Error(f"the worker index must be an integer, got {worker.dtype}")
        vars_ = tuple(self.new_loop_var(n) for n in names)
        scope = dict(zip(names, vars_))
        task_var = None
        if task_name is not None:
            task_var = self.new_loop_var(task_name)
            scope[task_name] = task_var
        body = self.block(node.body, scope)
        return S.ForMapping(vars_, mapping, worker, body, task_var)

    def static_loop(self, names: list[str], values: list[Any] | tuple[Any, ...], node: ast.For) -> S.Stmt:
        """`for s in (128, 64, 32):` over a compile-time sequence: the body is repeated per value."""
        if any(isinstance(n, (ast.Break, ast.Continue)) for stmt in node.body for n in ast.walk(stmt)):
            raise _Error("break/continue are not supported in loops over compile-time sequences")
        out = []
        for value in values:
            items = value if len(names) > 1 else (value,)
            if not isinstance(items, (list, tuple)) or len(items) != len(names):
                raise _Error(f"cannot unpack {value!r} into {len(names)} names")
            self.loop_depth -= 1  # the copies are not run-time loops
            out.append(self.block(node.body, dict(zip(names, items))))
            self.loop_depth += 1
        return S.seq(*out) if out else S.Seq([])

    # ---- expressions --------------------------------------------------------------------------
    def expr(self, node: ast.expr) -> Any:
        prev, self.current = self.current, node
        method = getattr(self, "expr_" + type(node).__name__, None)
        if method is None:
            raise _Error(f"`{type(node).__name__}` expressions are not supported in kernels")
        try:
            out = method(node)
        except E.IRTypeError as exc:
            raise _Error(str(exc)) from None
        self.current = prev
        return out

    def to_ir(self, value: Any) -> E.Expr:
        if isinstance(value, E.Expr):
            if isinstance(value, E.Var) and not isinstance(value.type, DataType):
                raise _Error(f"'{value.name}' is a {value.type}, not a scalar value; index it")
            return value
        if _is_py_scalar(value):
            return E.as_expr(value)
        if isinstance(value, str):
            raise _Error(f"string constant {value!r} is not supported in kernels")
        raise _Error(f"{value!r} is not a value a kernel can compute with")

    def convert(self, value: E.Expr, dtype: DataType, name: str = "") -> E.Expr:
        """Implicit conversion on assignment: widening and int->float; float->int must be explicit."""
        src = value.dtype
        if src == dtype:
            return value
        if src.is_float and (dtype.is_integer or dtype.is_bool):
            what = f"variable '{name}'" if name else "the target"
            raise _Error(f"{what} has type {dtype} but the value is {src}; convert explicitly with cast(x, {dtype})")
        if isinstance(value, E.Const):
            return E.Const(value.value, dtype)
        return E.Cast(value, dtype)

    def as_condition(self, value: E.Expr) -> E.Expr:
        if value.dtype.is_bool:
            return value
        if value.dtype.is_float:
            raise _Error(f"a condition must be a bool or an integer, got {value.dtype}")
        return E.Binary("!=", value, E.Const(0, value.dtype))

    def expr_Constant(self, node: ast.Constant) -> Any:
        if _is_py_scalar(node.value) or isinstance(node.value, str):
            return node.value  # strings only matter at compile time: float("inf")
        raise _Error(f"constant {node.value!r} of type {type(node.value).__name__} is not supported in kernels")

    def expr_Name(self, node: ast.Name) -> Any:
        return self.lookup(node.id)

    def expr_Tuple(self, node: ast.Tuple) -> tuple:
        return tuple(self.expr(e) for e in node.elts)

    def expr_List(self, node: ast.List) -> list:
        return [self.expr(e) for e in node.elts]

    def expr_Attribute(self, node: ast.Attribute) -> Any:
        owner = self.expr(node.value)
        if isinstance(owner, B.Builtin) and owner.kind == "hwindex":
            if node.attr not in ("x", "y", "z"):
                raise _Error(f"{owner.name} has fields x, y and z, not '{node.attr}'")
            if self.target != "cuda":
                raise _Error(f"{owner.name}.{node.attr} is only available in CUDA kernels")
            return E.HardwareIndex(f"{owner.name}.{node.attr}")
        if isinstance(owner, E.Var) and isinstance(owner.type, TensorType) and node.attr == "shape":
            return tuple(owner.type.shape)
        if isinstance(owner, E.Expr):
            raise _Error(f"IR values have no attribute '{node.attr}'")
        try:
            return getattr(owner, node.attr)
        except AttributeError:
            raise _Error(f"{owner!r} has no attribute '{node.attr}'") from None

    def expr_Subscript(self, node: ast.Subscript) -> Any:
        base = self.expr(node.value)
        if isinstance(base, tuple):  # e.g. a.shape[0] or a compile-time tuple
            idx = self.expr(node.slice)
            if not isinstance(idx, int):
                raise _Error("tuples can only be indexed with compile-time integers")
            return base[idx]
        if isinstance(base, E.Var):
            buf, indices = self.subscript_target(node)
            return E.Load(buf, indices)
        if isinstance(base, (list, dict)):
            return base[self.expr(node.slice)]
        raise _Error(f"`{ast.unparse(node.value)}` cannot be indexed")

    def expr_BinOp(self, node: ast.BinOp) -> Any:
        a, b = self.expr(node.left), self.expr(node.right)
        if isinstance(node.op, ast.Pow):
            if _is_py_scalar(a) and _is_py_scalar(b):
                return a**b
            if b == 2:
                x = self.to_ir(a)
                return E.Binary("*", x, x)
            return self.intrinsic("pow", [a, b])
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise _Error(f"operator {type(node.op).__name__} is not supported")
        if _is_py_scalar(a) and _is_py_scalar(b):
            return eval(f"a {op} b", {"a": a, "b": b}) if op != "//" else a // b
        if isinstance(a, TaskMapping) and isinstance(b, TaskMapping) and op == "*":
            return a * b
        x, y = self.to_ir(a), self.to_ir(b)
        x, y = self.coerce_constant(x, y), self.coerce_constant(y, x)
        return E.Binary(op, x, y)

    def coerce_constant(self, c: E.Expr, other: E.Expr) -> E.Expr:
        """Python literals take the type of the other operand (1.0 * half stays half)."""
        if isinstance(c, E.Const) and not isinstance(other, E.Const):
            t = other.dtype
            if (c.type.is_float and t.is_float) or (c.type.is_integer and (t.is_integer or t.is_float)):
                if t.is_integer and not t.min_value <= c.value <= t.max_value:
                    return c  # a literal that does not fit keeps its own (wider) type: a_i32 + 2**40 is int64
                return E.Const(c.value, t)
        return c

    def expr_UnaryOp(self, node: ast.UnaryOp) -> Any:
        v = self.expr(node.operand)
        if _is_py_scalar(v):
            return {ast.USub: lambda: -v, ast.UAdd: lambda: +v, ast.Not: lambda: not v, ast.Invert: lambda: ~v}[type(node.op)]()
        x = self.to_ir(v)
        if isinstance(node.op, ast.UAdd):
            return x
        if isinstance(node.op, ast.Not):
            return E.Unary("!", self.as_condition(x))
        return E.Unary("-" if isinstance(node.op, ast.USub) else "~", x)

    def expr_BoolOp(self, node: ast.BoolOp) -> Any:
        values = [self.expr(v) for v in node.values]
        if all(_is_py_scalar(v) for v in values):
            return all(values) if isinstance(node.op, ast.And) else any(values)
        op = "&&" if isinstance(node.op, ast.And) else "||"
        out = self.as_condition(self.to_ir(values[0]))
        for v in values[1:]:
            out = E.Binary(op, out, self.as_condition(self.to_ir(v)))
        return out

    def expr_Compare(self, node: ast.Compare) -> Any:
        operands = [self.expr(node.left)] + [self.expr(c) for c in node.comparators]
        result: Any = None
        for op_node, a, b in zip(node.ops, operands, operands[1:]):
            op = _CMPOPS.get(type(op_node))
            if op is None:
                raise _Error(f"comparison {type(op_node).__name__} is not supported")
            if _is_py_scalar(a) and _is_py_scalar(b):
                part: Any = eval(f"a {op} b", {"a": a, "b": b})
            else:
                x, y = self.to_ir(a), self.to_ir(b)
                part = E.Binary(op, self.coerce_constant(x, y), self.coerce_constant(y, x))
            if result is None:
                result = part
            elif isinstance(result, bool) and isinstance(part, bool):
                result = result and part
            else:
                result = E.Binary("&&", self.as_condition(self.to_ir(result)), self.as_condition(self.to_ir(part)))
        return result

    def expr_IfExp(self, node: ast.IfExp) -> Any:
        cond = self.expr(node.test)
        if not isinstance(cond, E.Expr):
            return self.expr(node.body if cond else node.orelse)
        a, b = self.to_ir(self.expr(node.body)), self.to_ir(self.expr(node.orelse))
        return E.Select(self.as_condition(cond), self.coerce_constant(a, b), self.coerce_constant(b, a))

    def expr_Call(self, node: ast.Call) -> Any:
        func = self.expr(node.func)
        func = _PY_EQUIVALENTS.get(func, func) if not isinstance(func, E.Expr) else func
        args = [self.expr(a) for a in node.args]
        kwargs = {k.arg: self.expr(k.value) for k in node.keywords}
        if isinstance(func, B.Builtin):
            self.current = node
            return self.call_builtin(func, args, kwargs)
        if isinstance(func, DataType):  # f16(x): conversion
            if len(args) != 1 or kwargs:
                raise _Error(f"{func}(x) takes one argument")
            return E.Cast(self.to_ir(args[0]), func)
        if func in (py_builtins.int, py_builtins.float, py_builtins.bool) and any(isinstance(a, E.Expr) for a in args):
            target = {py_builtins.int: dtypes.int32, py_builtins.float: dtypes.float32, py_builtins.bool: dtypes.boolean}[func]
            return E.Cast(self.to_ir(args[0]), target)
        if any(isinstance(a, E.Expr) for a in list(args) + list(kwargs.values())):
            raise _Error(f"`{ast.unparse(node.func)}` is not a kernel function and cannot take run-time values")
        try:
            return func(*args, **kwargs)  # compile-time call: spatial(4, 8), min(BM, 32), ...
        except Exception as exc:  # noqa: BLE001
            raise _Error(f"compile-time call `{ast.unparse(node)}` failed: {exc}") from None

    def intrinsic(self, name: str, args: list[Any]) -> E.Expr:
        irs = [self.to_ir(a) for a in args]
        if len(irs) > 1:
            irs = [self.coerce_constant(x, next((y for y in irs if y is not x), x)) for x in irs]
        try:
            rtype = INTRINSICS[name].result_type([a.dtype for a in irs])
        except TypeError as exc:
            raise _Error(str(exc)) from None
        return E.Call(name, tuple(irs), rtype)

    def call_builtin(self, func: B.Builtin, args: list[Any], kwargs: dict[str, Any]) -> Any:
        kind = func.kind
        if kind == "intrinsic":
            if kwargs:
                raise _Error(f"{func.name}() takes no keyword arguments")
            if func.name in ("max", "min") and all(_is_py_scalar(a) for a in args):
                return (max if func.name == "max" else min)(*args)
            return self.intrinsic(func.name, args)
        if kind == "barrier":
            if self.target != "cuda":
                raise _Error("syncthreads() is only available in CUDA kernels")
            if args or kwargs:
                raise _Error("syncthreads() takes no arguments")
            return S.Barrier()
        if kind == "alloc":
            return self.alloc(func.name, args, kwargs)
        if kind == "cast":
            if len(args) != 2 or not isinstance(args[1], DataType):
                raise _Error("cast(x, dtype) takes a value and a dtype")
            return E.Cast(self.to_ir(args[0]), args[1])
        if kind == "ceil_div":
            if len(args) != 2:
                raise _Error("ceil_div(a, b) takes two arguments")
            a, b = args
            if isinstance(a, int) and isinstance(b, int):
                return -(-a // b)
            x, y = self.to_ir(a), self.to_ir(b)
            return E.Binary("//", E.Binary("-", E.Binary("+", x, y), E.Const(1, y.dtype)), y)
        if kind == "select":
            if len(args) != 3:
                raise _Error("select(cond, a, b) takes three arguments")
            a, b = self.to_ir(args[1]), self.to_ir(args[2])
            return E.Select(self.as_condition(self.to_ir(args[0])), self.coerce_constant(a, b), self.coerce_constant(b, a))
        if kind == "loop":
            raise _Error(f"{func.name}() can only be used as the iterable of a `for` loop")
        raise _Error(f"{func.name} cannot be called")

    def alloc(self, which: str, args: list[Any], kwargs: dict[str, Any]) -> S.DeclareBuffer:
        if len(args) != 2 or kwargs or not isinstance(args[0], DataType):
            raise _Error(f"{which}(dtype, [d0, d1, ...]) takes a dtype and a shape")
        scope = REGISTER if which == "register_tensor" else SHARED
        if scope == SHARED and self.target != "cuda":
            raise _Error("shared_tensor() is only available in CUDA kernels; use register_tensor() on the CPU")
        if self.loop_depth and scope == SHARED:
            raise _Error("declare shared tensors outside of loops")
        shape = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise _Error(f"{which}() needs a shape of positive compile-time integers, got {shape}")
        dtype = args[0]
        if dtype.is_subbyte:
            raise _Error(f"{which}() of sub-byte type {dtype} is not supported yet")
        var = E.Var("_buf", TensorType(dtype, tuple(E.Const(d, dtypes.int32) for d in shape), scope))
        return S.DeclareBuffer(var)

    def check_launch(self, fdef: ast.FunctionDef) -> None:
        if self.target == "cuda" and (not self.launch.grid or not self.launch.block):
            self.current = fdef
            raise _Error("CUDA kernels must set `attrs.grid = (...)` and `attrs.block = (...)` in their body")


def parse_kernel(pyfunc: Callable, target: str = "cpu", name: str | None = None) -> Function:
    """Parse a Python function into an IR Function for `target`."""
    return KernelParser(pyfunc, target, name).parse()
