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
from tessera.ir.mapping import TaskMapping, repeat
from tessera.ir.types import GLOBAL, PointerType, TensorMapType, TensorType, VectorType
from tessera.lang import builtins as B
from tessera.lang import pysource
from tessera.lang.expressions import BINARY_OPERATORS, ExpressionParser, ParseError, is_py_scalar


class KernelParser(ExpressionParser):
    """Translate one Python function into a Function for `target` ("cpu" or "cuda")."""

    def __init__(self, pyfunc: Callable, target: str, name: str | None = None,
                 scope: dict[str, Any] | None = None):  # fmt: skip
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
        self.tree = pysource.parse(textwrap.dedent("".join(lines)))
        self.indent = len(lines[0]) - len(lines[0].lstrip())
        # Globals, then the defining frame's locals (names used only in annotations are not
        # closure cells under `from __future__ import annotations`), then the closure.
        self.env = dict(pyfunc.__globals__) | dict(scope or {})
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
        self.pending: list[S.Stmt] = []  # statements expanded from the expression being parsed
        # Variables the kernel may read but not assign: loop indices and shape symbols.
        self.readonly: dict[E.Var, str] = {}
        self.inlining: list[str] = []  # the inline functions being expanded (innermost last)
        self.inline_constants: list[set[str]] = []  # their parameters bound to compile-time values

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
        except ParseError as err:
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
            raise ParseError("kernel parameters must be plain positional parameters without defaults")
        self.scopes.append({})
        params: list[E.Var] = []
        annotations = []
        for arg in a.args:
            self.current = arg
            if arg.annotation is None:
                raise ParseError(f"parameter '{arg.arg}' needs a type annotation, e.g. `{arg.arg}: f32['n']` or `: int32`")
            ann = self.eval_python(arg.annotation)
            if isinstance(ann, str):  # `from __future__ import annotations`
                ann = self.eval_python(pysource.parse(ann, mode="eval").body)
            if not isinstance(ann, (DataType, TensorType, PointerType, TensorMapType)):
                raise ParseError(f"parameter '{arg.arg}' has annotation {ann!r}; expected a dtype, a tensor type or ptr()")
            if isinstance(ann, TensorMapType) and self.target != "cuda":
                raise ParseError(f"parameter '{arg.arg}': tensor maps (TMA) are for CUDA kernels")
            if isinstance(ann, DataType) and (ann.is_subbyte or ann.name in ("e4m3", "e5m2")):
                raise ParseError(f"scalar parameter '{arg.arg}' cannot have the storage-only type {ann}")
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
                raise ParseError(f"shape symbol '{d}' of '{pname}' names parameter '{d}', which is not an integer")
            self.readonly[existing] = "shape symbol"
            return existing
        if d not in self.shape_params:
            if not d.isidentifier():
                raise ParseError(f"shape symbol {d!r} of '{pname}' is not a valid identifier")
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
        raise ParseError(f"name '{name}' is not defined (kernels see their parameters, locals and enclosing Python scope)")

    def eval_python(self, node: ast.expr) -> Any:
        """Evaluate an expression as ordinary Python in the kernel's enclosing scope."""
        env = dict(self.env)
        for scope in self.scopes:
            env.update({k: v for k, v in scope.items() if not isinstance(v, E.Expr)})
        try:
            return eval(pysource.compile_expression(node, self.filename), env)
        except Exception as exc:  # noqa: BLE001  (user code: report whatever went wrong)
            raise ParseError(f"cannot evaluate `{ast.unparse(node)}` at compile time: {exc}") from None

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
            raise ParseError(f"`{type(node).__name__}` statements are not supported in kernels")
        outer_pending, self.pending = self.pending, []
        try:
            result = method(node)
        except E.IRTypeError as exc:
            self.current = node
            raise ParseError(str(exc)) from None
        finally:
            pending, self.pending = self.pending, outer_pending
        if pending:
            if isinstance(node, ast.While):
                raise ParseError("collectives cannot be used in a while condition")
            result = S.seq(*pending, *([result] if result is not None else []))
        if isinstance(result, S.Stmt):
            result.line = self.first_line + node.lineno - 1
        return result

    def emit_before(self, stmts: list[S.Stmt]) -> None:
        self.pending.extend(stmts)

    def expand_inline(self, func: Any, args: list[Any], kwargs: dict[str, Any]) -> S.Stmt:
        """The inline function's body parsed with its parameters bound to this call's arguments
        (the caller's variables themselves: assigning a parameter assigns them), in its own
        Python scope and source location; the caller's state comes back afterwards."""
        try:
            bound = func.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ParseError(f"{func.name}{func.signature}: {exc}") from None
        bound.apply_defaults()
        if func.name in self.inlining:
            raise ParseError(f"inline function '{func.name}' calls itself")
        saved = (self.env, self.scopes, self.source_lines, self.first_line, self.filename, self.indent, self.current)
        self.env, self.scopes = func.env, []
        self.source_lines, self.first_line, self.filename, self.indent = (func.source_lines, func.first_line,
                                                                          func.filename, func.indent)  # fmt: skip
        self.inlining.append(func.name)
        self.inline_constants.append({k for k, v in bound.arguments.items() if not isinstance(v, E.Expr)})
        try:
            return self.block(func.body, dict(bound.arguments))
        except ParseError as err:  # reported where it is, in the inline function's source
            raise self.error(f"{err} (in inline function '{func.name}')") from None
        finally:
            self.inlining.pop()
            self.inline_constants.pop()
            (self.env, self.scopes, self.source_lines, self.first_line, self.filename, self.indent,
             self.current) = saved  # fmt: skip

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
        raise ParseError("this expression has no effect; did you mean to assign it?")

    def stmt_Return(self, node: ast.Return) -> S.Stmt:
        if self.inlining:
            raise ParseError(f"inline function '{self.inlining[-1]}' cannot return; write results into its arguments")
        if node.value is not None:
            raise ParseError("kernels cannot return values; write results into an output tensor")
        return S.Return()

    def stmt_Break(self, node: ast.Break) -> S.Stmt:
        return S.Break()

    def stmt_Continue(self, node: ast.Continue) -> S.Stmt:
        return S.Continue()

    def stmt_AnnAssign(self, node: ast.AnnAssign) -> S.Stmt:
        if not isinstance(node.target, ast.Name):
            raise ParseError("annotated assignment needs a plain name on the left")
        t = self.eval_python(node.annotation)
        if not isinstance(t, (DataType, VectorType)):
            raise ParseError(f"local variables must have a scalar dtype or a vector type, got {t!r}")
        if node.target.id in self.scopes[-1]:
            raise ParseError(f"variable '{node.target.id}' is already defined")
        var = E.Var(node.target.id, t)
        what = f"variable '{node.target.id}'"
        init = None if node.value is None else self.convert(self.to_ir(self.expr(node.value)), t, what)
        self.define(var.name, var)
        return S.DeclareVar(var, init)

    def stmt_Assign(self, node: ast.Assign) -> S.Stmt | None:
        if len(node.targets) != 1:
            raise ParseError("chained assignment (a = b = c) is not supported")
        target = node.targets[0]
        if isinstance(target, ast.Tuple):
            if not isinstance(node.value, ast.Tuple) or len(node.value.elts) != len(target.elts):
                raise ParseError("tuple assignment needs a tuple of the same length on the right")
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
            _check_store(buf)
            return S.Store(buf, indices, self.convert(self.to_ir(value), buf.type.dtype, f"an element of '{buf.name}'"))
        if not isinstance(target, ast.Name):
            raise ParseError(f"cannot assign to `{ast.unparse(target)}`")
        name = target.id
        existing = self.lookup_local(name)
        if self.inline_constants and name in self.inline_constants[-1]:
            raise ParseError(f"parameter '{name}' of inline function '{self.inlining[-1]}' was passed a compile-time "
                             "value: assigning it would not change the caller's; pass a run-time variable")  # fmt: skip
        if isinstance(value, S.DeclareBuffer):
            if existing is not None:
                raise ParseError(f"'{name}' is already defined; give the new tensor another name")
            value.var.name = name
            self.define(name, value.var)
            return value
        if isinstance(existing, E.Var):
            if value is existing:
                return None  # M = M (e.g. M = a.shape[0] where M is the shape symbol)
            if not isinstance(existing.type, (DataType, VectorType)):
                raise ParseError(f"cannot rebind tensor or pointer '{name}'; assign to its elements instead")
            self.check_assignable(existing)
            return S.Assign(existing, self.convert(self.to_ir(value), existing.type, f"variable '{name}'"))
        if not isinstance(value, E.Expr) and not is_py_scalar(value):
            self.define(name, value)  # compile-time value (mapping, dtype, ...)
            return None
        # A scalar literal assigned in the body starts a run-time variable (acc = 0.0).
        value = self.to_ir(value)
        if isinstance(value.type, VectorType):
            var = E.Var(name, value.type)
        else:
            if value.dtype.is_storage_only:  # a packed element read into a local computes in its compute type
                value = E.Cast(value, dtypes.compute_type(value.dtype))
            var = E.Var(name, value.dtype)
        self.define(name, var)
        return S.DeclareVar(var, value)

    def check_assignable(self, var: E.Var) -> None:
        what = self.readonly.get(var)
        if what == "loop variable":
            raise ParseError(f"cannot assign to loop variable '{var.name}'; copy it into a new variable first")
        if what is not None:
            raise ParseError(f"cannot assign to '{var.name}': it is a tensor dimension ({what}); copy it first")

    def fresh_var(self, hint: str, dtype: DataType) -> E.Var:
        self.counter += 1
        return E.Var(f"_{hint}{self.counter}", dtype)

    def assign_attr(self, target: ast.Attribute, value: Any) -> None:
        owner = self.expr(target.value)
        if owner is not B.attrs:
            raise ParseError(f"cannot assign to attribute `{ast.unparse(target)}`")
        if self.target != "cuda":
            raise ParseError("attrs.grid/attrs.block configure CUDA launches; CPU kernels do not use them")
        values = value if isinstance(value, tuple) else (value,)
        if target.attr in ("grid", "block"):
            if not 1 <= len(values) <= 3:
                raise ParseError(f"attrs.{target.attr} takes 1 to 3 dimensions, got {len(values)}")
            dims = tuple(self.to_ir(v) for v in values)
            if target.attr == "block" and not all(isinstance(v, int) and v > 0 for v in values):
                raise ParseError("attrs.block must be compile-time positive integers")
            setattr(self.launch, target.attr, dims)
        elif target.attr == "dynamic_smem":
            self.launch.dynamic_smem = self.to_ir(value)
        elif target.attr == "cluster":
            if not 1 <= len(values) <= 3 or not all(isinstance(v, int) and v > 0 for v in values):
                raise ParseError("attrs.cluster takes 1 to 3 compile-time positive integers (the cluster shape)")
            self.launch.cluster = tuple(values)
        elif target.attr == "min_blocks":
            if not isinstance(value, int):
                raise ParseError("attrs.min_blocks must be a compile-time integer")
            self.launch.min_blocks = value
        else:
            raise ParseError(f"unknown launch attribute '{target.attr}'; use grid, block, dynamic_smem, min_blocks or cluster")
        return None

    def stmt_AugAssign(self, node: ast.AugAssign) -> S.Stmt:
        op = BINARY_OPERATORS.get(type(node.op))
        if op is None:
            raise ParseError(f"augmented operator {type(node.op).__name__} is not supported")
        rhs = self.to_ir(self.expr(node.value))
        if isinstance(node.target, ast.Subscript):
            buf, indices = self.subscript_target(node.target)
            _check_store(buf)
            value = E.Binary(op, E.Load(buf, indices), rhs)
            return S.Store(buf, indices, self.convert(value, buf.type.dtype, f"an element of '{buf.name}'"))
        if isinstance(node.target, ast.Name):
            var = self.lookup_local(node.target.id)
            if not isinstance(var, E.Var) or not isinstance(var.type, DataType):
                raise ParseError(f"'{node.target.id}' is not a scalar variable defined in this kernel")
            self.check_assignable(var)
            return S.Assign(var, self.convert(E.Binary(op, var, rhs), var.type, f"variable '{var.name}'"))
        raise ParseError(f"cannot assign to `{ast.unparse(node.target)}`")

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
            raise ParseError("while/else is not supported")
        cond = self.as_condition(self.to_ir(self.expr(node.test)))
        self.loop_depth += 1
        body = self.block(node.body)
        self.loop_depth -= 1
        return S.While(cond, body)

    def stmt_For(self, node: ast.For) -> S.Stmt:
        if node.orelse:
            raise ParseError("for/else is not supported")
        it = node.iter
        task_name = None
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate":
            # for t, (i, j) in enumerate(m.on(w)): t numbers the worker's own tasks
            target = node.target
            if not (isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[0], ast.Name)):
                raise ParseError("use `for t, (i, j) in enumerate(mapping.on(worker))`")
            if len(it.args) != 1 or not self.is_mapping_on(it.args[0]):
                raise ParseError("enumerate() in kernels only wraps mapping.on(worker)")
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
                        raise ParseError("mapping.on() takes exactly one argument: the worker index")
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
                    raise ParseError("parallel() loops are for CPU kernels; on CUDA use thread/block indices")
                if len(names) != 1:
                    raise ParseError(f"{getattr(func, 'name', 'range')}() yields one index, not {len(names)}")
                return self.range_loop(names[0], [self.expr(a) for a in it.args], kind, node, it)
            if isinstance(func, B.Builtin) and func.name == "grid":
                extents = [self.expr(a) for a in it.args]
                if len(extents) != len(names):
                    raise ParseError(f"grid() has {len(extents)} dimensions but the loop unpacks {len(names)} names")
                if all(isinstance(x, int) for x in extents):
                    return self.mapping_loop(names, repeat(*extents), E.Const(0, dtypes.int32), node)
                return self.nested_grid(names, extents, node)
            raise ParseError("kernels can loop over range(), unroll(), parallel(), grid() or mapping.on(worker)")
        finally:
            self.loop_depth -= 1

    def target_names(self, target: ast.expr) -> list[str]:
        elts = target.elts if isinstance(target, ast.Tuple) else [target]
        if not all(isinstance(e, ast.Name) for e in elts):
            raise ParseError("loop targets must be plain names")
        return [e.id for e in elts]

    def new_loop_var(self, name: str, dtype: DataType = dtypes.int32) -> E.Var:
        if name in self.scopes[0]:
            raise ParseError(f"loop variable '{name}' shadows a kernel parameter")
        var = E.Var(name, dtype)
        self.readonly[var] = "loop variable"
        return var

    def range_loop(self, name: str, args: list[Any], kind: str, node: ast.For, call: ast.expr) -> S.Stmt:
        if not 1 <= len(args) <= 3:
            raise ParseError("range() takes 1 to 3 arguments")
        irs = [self.to_ir(a) for a in args]
        for a in irs:
            if not a.dtype.is_integer:
                raise ParseError(f"range() bounds must be integers, got {a.dtype}")
        zero, one = E.Const(0, dtypes.int32), E.Const(1, dtypes.int32)
        start, stop, step = (zero, irs[0], one) if len(irs) == 1 else (irs[0], irs[1], irs[2] if len(irs) == 3 else one)
        if isinstance(step, E.Const) and step.value <= 0:
            raise ParseError("range() steps must be positive constants or expressions")
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
            raise ParseError(f"the mapping {mapping} has rank {mapping.rank} but the loop unpacks {len(names)} names")
        if not worker.dtype.is_integer:
            raise ParseError(f"the worker index must be an integer, got {worker.dtype}")
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
            raise ParseError("break/continue are not supported in loops over compile-time sequences")
        out = []
        for value in values:
            items = value if len(names) > 1 else (value,)
            if not isinstance(items, (list, tuple)) or len(items) != len(names):
                raise ParseError(f"cannot unpack {value!r} into {len(names)} names")
            self.loop_depth -= 1  # the copies are not run-time loops
            out.append(self.block(node.body, dict(zip(names, items))))
            self.loop_depth += 1
        return S.seq(*out) if out else S.Seq([])

    def check_launch(self, fdef: ast.FunctionDef) -> None:
        if self.target == "cuda" and (not self.launch.grid or not self.launch.block):
            self.current = fdef
            raise ParseError("CUDA kernels must set `attrs.grid = (...)` and `attrs.block = (...)` in their body")


def parse_kernel(pyfunc: Callable, target: str = "cpu", name: str | None = None,
                 scope: dict[str, Any] | None = None) -> Function:  # fmt: skip
    """Parse a Python function into an IR Function for `target`; `scope` adds names visible
    where the function was defined (the decorator passes its caller's locals)."""
    return KernelParser(pyfunc, target, name, scope).parse()


def _check_store(buf: E.Var) -> None:
    dtype = buf.type.dtype
    if isinstance(dtype, DataType) and dtype.is_storage_only:
        raise ParseError(f"'{buf.name}' holds packed {dtype} values, which kernels only read; pack weights on the "
                         "host with tessera.quant.pack (or write the packed uint32 words of a uint32 tensor)")
