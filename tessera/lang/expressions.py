"""Expression half of the kernel parser: Python expressions into IR values.

A value is either an IR expression (computed at run time) or a plain Python object known at
compile time (ints from the enclosing scope, task mappings, dtypes, builtins).  Arithmetic on
compile-time values is evaluated in Python, so kernel templates can use closure constants.
"""

from __future__ import annotations

import ast
import builtins as py_builtins
import inspect
import operator
from math import prod
from typing import Any

from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir import vector as V
from tessera.ir.dtypes import DataType
from tessera.ir.func import LaunchConfig
from tessera.ir.intrinsics import GPU_ONLY, INTRINSICS
from tessera.ir.types import REGISTER, SHARED, Swizzle, TensorType, VectorType
from tessera.lang import builtins as B
from tessera.lang import collectives
from tessera.lang.inline import Inline
from tessera.lang.instructions import InstructionError, build_instruction

BINARY_OPERATORS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>",
}  # fmt: skip
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_PY_EQUIVALENTS = B.python_equivalents()


_PY_BINARY = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "//": operator.floordiv,
    "%": operator.mod, "&": operator.and_, "|": operator.or_, "^": operator.xor, "<<": operator.lshift,
    ">>": operator.rshift, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
    "==": operator.eq, "!=": operator.ne,
}  # fmt: skip


class ParseError(Exception):
    """Internal: an error message to be attached to the current AST node."""


def _vload_signature(src: Any, lanes: int, count: Any = None) -> None: ...


def _vbroadcast_signature(value: Any, lanes: int, dtype: Any = dtypes.float32) -> None: ...


def is_py_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, bool))


class ExpressionParser:
    """Translate expressions; KernelParser adds statements, scopes and parameters."""

    target: str
    current: ast.AST | None
    loop_depth: int
    launch: LaunchConfig

    def lookup(self, name: str) -> Any:
        raise NotImplementedError

    def expand_inline(self, func: Any, args: list[Any], kwargs: dict[str, Any]) -> S.Stmt:
        """The statements of an inline function's body for this call (tessera.lang.inline)."""
        raise ParseError(f"inline function '{func.name}' can only be called as a statement of a kernel")

    def emit_before(self, stmts: list[S.Stmt]) -> None:
        """Statements that must run before the statement being parsed (expanded builtins)."""
        raise NotImplementedError

    def fresh_var(self, hint: str, dtype: DataType) -> E.Var:
        raise NotImplementedError

    def collective(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> E.Expr:
        if self.target != "cuda":
            raise ParseError(f"{name}() is only available in CUDA kernels")
        if len(args) != 2 or kwargs or args[1] not in collectives.OPS:
            raise ParseError(f"{name}(value, op) takes a value and one of {collectives.OPS}")
        value = self.to_ir(args[0])
        acc = self.fresh_var("red", value.dtype)
        stmts: list[S.Stmt] = [S.DeclareVar(acc, value)]
        if name == "warp_reduce":
            stmts += collectives.warp_reduce(acc, args[1])
        else:
            block = self.launch.block
            if len(block) != 1 or block[0].value % collectives.WARP:
                raise ParseError("block_reduce() needs `attrs.block = N` set earlier, 1-D, with N a multiple of 32")
            stmts += collectives.block_reduce(acc, args[1], int(block[0].value), self.fresh_var("partials", value.dtype).name)
        self.emit_before(stmts)
        return acc

    # ---- expressions --------------------------------------------------------------------------
    def expr(self, node: ast.expr) -> Any:
        prev, self.current = self.current, node
        method = getattr(self, "expr_" + type(node).__name__, None)
        if method is None:
            raise ParseError(f"`{type(node).__name__}` expressions are not supported in kernels")
        try:
            out = method(node)
        except E.IRTypeError as exc:
            raise ParseError(str(exc)) from None
        self.current = prev
        return out

    def to_ir(self, value: Any) -> E.Expr:
        if isinstance(value, E.Expr):
            if isinstance(value, E.Var) and not isinstance(value.type, (DataType, VectorType)):
                raise ParseError(f"'{value.name}' is a {value.type}, not a scalar value; index it")
            return value
        if is_py_scalar(value):
            return E.as_expr(value)
        if isinstance(value, str):
            raise ParseError(f"string constant {value!r} is not supported in kernels")
        raise ParseError(f"{value!r} is not a value a kernel can compute with")

    def convert(self, value: E.Expr, dtype: DataType, what: str = "the target") -> E.Expr:
        """Implicit conversion on assignment to `what`: widening and int->float; float->int must
        be explicit; a constant must fit.  Vectors convert to nothing but their own type."""
        if isinstance(value.type, VectorType) or isinstance(dtype, VectorType):
            if value.type != dtype:
                raise ParseError(f"{what} has type {dtype} but the value is {value.type}; vectors do not convert")
            return value
        src = value.dtype
        if src == dtype:
            return value
        _check_not_storage(dtype, what)
        if src.is_float and (dtype.is_integer or dtype.is_bool):
            raise ParseError(f"{what} has type {dtype} but the value is {src}; convert explicitly with cast(x, {dtype})")
        if isinstance(value, E.Const):
            if not dtype.holds(value.value):
                raise ParseError(f"the constant {value.value!r} does not fit in {dtype} ({what}); give the target a "
                                 "wider type, or compute the intended value in Python")  # fmt: skip
            return E.Const(value.value, dtype)
        return E.Cast(value, dtype)

    def cast(self, value: Any, dtype: DataType) -> E.Expr:
        """An explicit conversion; a compile-time constant must fit the type (C would truncate it)."""
        x = self.to_ir(value)
        _check_not_storage(dtype, "cast()")
        if isinstance(x, E.Const) and not dtype.holds(x.value):
            raise ParseError(f"the constant {x.value!r} does not fit in {dtype}; compute the intended value in Python")
        return E.Cast(x, dtype)

    def bitcast(self, value: Any, dtype: DataType) -> E.Expr:
        """x's bits read as `dtype` (no conversion: float32 <-> uint32, say); the widths must match."""
        x = self.to_ir(value)
        _check_not_storage(dtype, "bitcast()")
        if x.dtype.nbits != dtype.nbits or x.dtype.is_bool or dtype.is_bool:
            raise ParseError(f"bitcast reads the bits of {x.dtype} ({x.dtype.nbits} bits) as {dtype} "
                             f"({dtype.nbits} bits): the widths must match (cast() converts values)")  # fmt: skip
        return E.Call("bitcast", (x,), dtype)

    def as_condition(self, value: E.Expr) -> E.Expr:
        if value.dtype.is_bool:
            return value
        if value.dtype.is_float:
            raise ParseError(f"a condition must be a bool or an integer, got {value.dtype}")
        return E.Binary("!=", value, E.Const(0, value.dtype))

    def expr_Constant(self, node: ast.Constant) -> Any:
        if is_py_scalar(node.value) or isinstance(node.value, str):
            return node.value  # strings only matter at compile time: float("inf")
        raise ParseError(f"constant {node.value!r} of type {type(node.value).__name__} is not supported in kernels")

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
                raise ParseError(f"{owner.name} has fields x, y and z, not '{node.attr}'")
            if self.target != "cuda":
                raise ParseError(f"{owner.name}.{node.attr} is only available in CUDA kernels")
            return E.HardwareIndex(f"{owner.name}.{node.attr}")
        if isinstance(owner, E.Var) and isinstance(owner.type, TensorType) and node.attr == "shape":
            return tuple(owner.type.shape)
        if isinstance(owner, E.Expr):
            raise ParseError(f"IR values have no attribute '{node.attr}'")
        try:
            return getattr(owner, node.attr)
        except AttributeError:
            raise ParseError(f"{owner!r} has no attribute '{node.attr}'") from None

    def expr_Subscript(self, node: ast.Subscript) -> Any:
        base = self.expr(node.value)
        if isinstance(base, tuple):  # e.g. a.shape[0] or a compile-time tuple
            idx = self.expr(node.slice)
            if not isinstance(idx, int):
                raise ParseError("tuples can only be indexed with compile-time integers")
            return base[idx]
        if isinstance(base, E.Var):
            buf, indices = self.subscript_target(node)
            return E.Load(buf, indices)
        if isinstance(base, (list, dict)):
            return base[self.expr(node.slice)]
        raise ParseError(f"`{ast.unparse(node.value)}` cannot be indexed")

    def expr_BinOp(self, node: ast.BinOp) -> Any:
        a, b = self.expr(node.left), self.expr(node.right)
        if isinstance(node.op, ast.Pow):
            if is_py_scalar(a) and is_py_scalar(b):
                return a**b
            if b == 2:
                x = self.to_ir(a)
                return E.Binary("*", x, x)
            return self.intrinsic("pow", [a, b])
        op = BINARY_OPERATORS.get(type(node.op))
        if op is None:
            raise ParseError(f"operator {type(node.op).__name__} is not supported")
        if not isinstance(a, E.Expr) and not isinstance(b, E.Expr):  # compile time: ints, mappings, ...
            try:
                return _PY_BINARY[op](a, b)
            except Exception as exc:  # noqa: BLE001
                raise ParseError(f"compile-time `{ast.unparse(node)}` failed: {exc}") from None
        x, y = self.to_ir(a), self.to_ir(b)
        x, y = self.coerce_constant(x, y), self.coerce_constant(y, x)
        return E.Binary(op, x, y)

    def coerce_constant(self, c: E.Expr, other: E.Expr) -> E.Expr:
        """Python literals take the type of the other operand (1.0 * half stays half)."""
        if isinstance(c, E.Const) and not isinstance(other, E.Const):
            t = other.dtype
            if (c.type.is_float and t.is_float) or (c.type.is_integer and (t.is_integer or t.is_float)):
                if t.holds(c.value):
                    return E.Const(c.value, t)
                # A literal the other operand's type cannot hold keeps a type that holds it, and
                # the operation is done in that wider type: a_i32 + 2**40 is int64, h_f16 * 1e6 float32.
                if c.type.is_integer and t.is_float:
                    return E.as_expr(float(c.value))
        return c

    def expr_UnaryOp(self, node: ast.UnaryOp) -> Any:
        v = self.expr(node.operand)
        if is_py_scalar(v):
            return {ast.USub: lambda: -v, ast.UAdd: lambda: +v, ast.Not: lambda: not v, ast.Invert: lambda: ~v}[type(node.op)]()
        x = self.to_ir(v)
        if isinstance(node.op, ast.UAdd):
            return x
        if isinstance(node.op, ast.Not):
            return E.Unary("!", self.as_condition(x))
        return E.Unary("-" if isinstance(node.op, ast.USub) else "~", x)

    def expr_BoolOp(self, node: ast.BoolOp) -> Any:
        values = [self.expr(v) for v in node.values]
        if all(is_py_scalar(v) for v in values):
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
                raise ParseError(f"comparison {type(op_node).__name__} is not supported")
            if not isinstance(a, E.Expr) and not isinstance(b, E.Expr):  # compile time, strings too
                part: Any = _PY_BINARY[op](a, b)
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
        if isinstance(func, Inline):
            return self.expand_inline(func, args, kwargs)
        if isinstance(func, DataType):  # f16(x): conversion
            if len(args) != 1 or kwargs:
                raise ParseError(f"{func}(x) takes one argument")
            return self.cast(args[0], func)
        if func in (py_builtins.int, py_builtins.float, py_builtins.bool) and any(isinstance(a, E.Expr) for a in args):
            target = {py_builtins.int: dtypes.int32, py_builtins.float: dtypes.float32, py_builtins.bool: dtypes.boolean}[func]
            return E.Cast(self.to_ir(args[0]), target)
        if any(isinstance(a, E.Expr) for a in list(args) + list(kwargs.values())):
            raise ParseError(f"`{ast.unparse(node.func)}` is not a kernel function and cannot take run-time values")
        try:
            return func(*args, **kwargs)  # compile-time call: spatial(4, 8), min(BM, 32), ...
        except Exception as exc:  # noqa: BLE001
            raise ParseError(f"compile-time call `{ast.unparse(node)}` failed: {exc}") from None

    def intrinsic(self, name: str, args: list[Any]) -> E.Expr:
        irs = [self.to_ir(a) for a in args]
        if len(irs) > 1:
            irs = [self.coerce_constant(x, next((y for y in irs if y is not x), x)) for x in irs]
        try:
            rtype = INTRINSICS[name].result_type([a.dtype for a in irs])
        except TypeError as exc:
            raise ParseError(str(exc)) from None
        return E.Call(name, tuple(irs), rtype)

    def call_builtin(self, func: B.Builtin, args: list[Any], kwargs: dict[str, Any]) -> Any:
        kind = func.kind
        if kind == "intrinsic":
            if kwargs:
                raise ParseError(f"{func.name}() takes no keyword arguments")
            if func.name in ("max", "min") and all(is_py_scalar(a) for a in args):
                return (max if func.name == "max" else min)(*args)
            if func.name in GPU_ONLY and self.target != "cuda":
                raise ParseError(f"{func.name}() is only available in CUDA kernels")
            return self.intrinsic(func.name, args)
        if kind == "collective":
            return self.collective(func.name, args, kwargs)
        if kind == "vector":
            return self.vector(func.name, args, kwargs)
        if kind == "instruction":
            try:
                return build_instruction(func.name, self.target, args, kwargs)
            except InstructionError as exc:
                raise ParseError(str(exc)) from None
        if kind == "barrier":
            if self.target != "cuda":
                raise ParseError("syncthreads() is only available in CUDA kernels")
            if args or kwargs:
                raise ParseError("syncthreads() takes no arguments")
            return S.Barrier()
        if kind == "alloc":
            return self.alloc(func.name, args, kwargs)
        if kind == "cast":
            if len(args) != 2 or not isinstance(args[1], DataType):
                raise ParseError("cast(x, dtype) takes a value and a dtype")
            return self.cast(args[0], args[1])
        if kind == "bitcast":
            if len(args) != 2 or not isinstance(args[1], DataType):
                raise ParseError("bitcast(x, dtype) takes a value and a dtype")
            return self.bitcast(args[0], args[1])
        if kind == "ceil_div":
            if len(args) != 2:
                raise ParseError("ceil_div(a, b) takes two arguments")
            a, b = args
            if isinstance(a, int) and isinstance(b, int):
                return -(-a // b)
            x, y = self.to_ir(a), self.to_ir(b)
            return E.Binary("//", E.Binary("-", E.Binary("+", x, y), E.Const(1, y.dtype)), y)
        if kind == "select":
            if len(args) != 3:
                raise ParseError("select(cond, a, b) takes three arguments")
            a, b = self.to_ir(args[1]), self.to_ir(args[2])
            return E.Select(self.as_condition(self.to_ir(args[0])), self.coerce_constant(a, b), self.coerce_constant(b, a))
        if kind == "loop":
            raise ParseError(f"{func.name}() can only be used as the iterable of a `for` loop")
        raise ParseError(f"{func.name} cannot be called")

    def vector(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> E.Expr:
        """A vector intrinsic (tessera.ir.vector); CPU kernels only."""
        if self.target != "cpu":
            raise ParseError(f"{name}() is only available in CPU kernels")
        try:
            if name == "vload":
                bound = inspect.signature(_vload_signature).bind(*args, **kwargs).arguments
                src = bound["src"]
                if not isinstance(src, E.Load):
                    raise ParseError("vload() reads from a tensor element such as A[i, j]")
                count = bound.get("count")
                return V.vload(E.Address(src.buffer, src.indices), bound["lanes"],
                               None if count is None else self.to_ir(count))  # fmt: skip
            if name == "vbroadcast":
                bound = inspect.signature(_vbroadcast_signature).bind(*args, **kwargs).arguments
                dtype = bound.get("dtype", dtypes.float32)
                if not isinstance(dtype, DataType):
                    raise ParseError(f"vbroadcast()'s dtype must be a dtype such as ts.uint32, got {dtype!r}")
                return V.vbroadcast(self.to_ir(bound["value"]), bound["lanes"], dtype)
            if kwargs:
                raise ParseError(f"{name}() takes no keyword arguments")
            if name in ("vshl", "vshr"):
                if len(args) != 2:
                    raise ParseError(f"{name}(vector, amount) takes 2 arguments, got {len(args)}")
                return V.shift(name, self.to_ir(args[0]), self.to_ir(args[1]))
            if name == "vbitcast":
                if len(args) != 2 or not isinstance(args[1], DataType):
                    raise ParseError("vbitcast(vector, dtype) takes a vector and a dtype such as ts.float32")
                return V.bitcast(self.to_ir(args[0]), args[1])
            if name == "vlookup":
                if len(args) != 2:
                    raise ParseError(f"vlookup(table, index) takes 2 arguments, got {len(args)}")
                return V.lookup(self.to_ir(args[0]), self.to_ir(args[1]))
            return V.vector_call(name, [self.to_ir(a) for a in args])
        except TypeError as exc:  # a wrong signature, or an IR type error
            raise ParseError(f"{name}(): {exc}") from None

    def alloc(self, which: str, args: list[Any], kwargs: dict[str, Any]) -> S.DeclareBuffer:
        swizzle = kwargs.pop("swizzle", None)
        if len(args) != 2 or kwargs or not isinstance(args[0], (DataType, VectorType)):
            raise ParseError(f"{which}(dtype, [d0, d1, ...]) takes a dtype (or a vector type) and a shape")
        scope = REGISTER if which == "register_tensor" else SHARED
        if isinstance(args[0], VectorType) and (scope != REGISTER or self.target != "cpu"):
            raise ParseError("tensors of vectors are register tensors of CPU kernels")
        if swizzle is not None and (scope != SHARED or not isinstance(swizzle, Swizzle)):
            raise ParseError("swizzle= takes a tessera.Swizzle and applies to shared tensors only")
        if scope == SHARED and self.target != "cuda":
            raise ParseError("shared_tensor() is only available in CUDA kernels; use register_tensor() on the CPU")
        if self.loop_depth and scope == SHARED:
            raise ParseError("declare shared tensors outside of loops")
        shape = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise ParseError(f"{which}() needs a shape of positive compile-time integers, got {shape}")
        dtype = args[0]
        if isinstance(dtype, DataType) and dtype.is_storage_only:
            raise ParseError(f"{which}() of the storage type {dtype}: {dtype} values live in packed global tensors; "
                             "keep the packed words in a uint32 tensor and unpack them with ts.dequant()")
        period = 1 << (swizzle.base + swizzle.bits) if swizzle is not None else 1
        if prod(shape[-2:]) % period:
            raise ParseError(f"a {swizzle} layout needs 2-D tiles (last two dims) whose size is a multiple of {period}")
        var = E.Var("_buf", TensorType(dtype, tuple(E.Const(d, dtypes.int32) for d in shape), scope, swizzle))
        return S.DeclareBuffer(var)


    def subscript_target(self, node: ast.Subscript) -> tuple[E.Var, tuple[E.Expr, ...]]:
        buf = self.expr(node.value)
        if not isinstance(buf, E.Var) or isinstance(buf.type, DataType):
            raise ParseError(f"`{ast.unparse(node.value)}` is not a tensor or pointer")
        idx_node = node.slice
        elts = idx_node.elts if isinstance(idx_node, ast.Tuple) else [idx_node]
        if any(isinstance(e, ast.Slice) for e in elts):
            raise ParseError("slices are not supported; index one element at a time")
        return buf, tuple(self.to_ir(self.expr(e)) for e in elts)


def _check_not_storage(dtype: Any, what: str) -> None:
    if isinstance(dtype, DataType) and dtype.is_storage_only:  # (vector types are never storage-only)
        raise ParseError(f"{what} would produce a {dtype} value, but {dtype} is a storage type: its values are read "
                         f"from packed tensors and computed in {dtypes.compute_type(dtype)}; convert to that instead")
