"""Elementwise operators: unary math and activations, binary arithmetic with numpy broadcasting and
type promotion, comparisons, logic, `where`, `clamp` and `cast`.

Every op is an injective `Compute`; the scheduler inlines chains of them into one kernel.
float16 and bfloat16 values are computed in float32 and rounded once per op (as torch does);
integer inputs of transcendental functions give float32.  Python numbers are "weak": they
never widen a tensor's dtype, only its category (``int_tensor * 0.5`` is float32).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import Compute, TensorNode, compute, fresh_name
from tessera.ir.dtypes import DataType
from tessera.ops.common import (
    SUPPORTED,
    TensorOrScalar,
    broadcast_shapes,
    check_tensor,
    compute_type,
    float_type,
    operand,
    result_type,
    scalar_kind,
)


def const(value: float | int | bool, t: DataType) -> E.Const:
    return E.Const(value, t)


def fdiv(a: E.Expr, b: E.Expr) -> E.Expr:
    """a / b (true division)."""
    return E.Binary("/", a, b)


def _relu6(v: E.Expr) -> E.Expr:
    return _call("min", _call("max", v, const(0, v.dtype)), const(6, v.dtype))


def _call(fn: str, *args: E.Expr) -> E.Expr:
    return E.Call(fn, tuple(args), args[0].dtype)


def elementwise(op: str, args: list[TensorOrScalar], out: DataType, ct: DataType, fn: Callable[..., E.Expr],
                tag: str = "injective") -> Compute:  # fmt: skip
    """out[idx] = fn(*args read at idx with broadcasting, as `ct` values), stored as `out`."""
    tensors = [check_tensor(a, op, f"argument {k}") for k, a in enumerate(args) if isinstance(a, TensorNode)]
    for a in args:
        if not isinstance(a, TensorNode):
            scalar_kind(a)  # validates Python numbers
    shape = broadcast_shapes([t.shape for t in tensors], op)
    return compute(shape, lambda *ax: fn(*(operand(a, shape, ax, ct) for a in args)), fresh_name(op), out, tag)


# ---- unary --------------------------------------------------------------------------------------------------------------
def _unary_float(op: str, x: TensorNode, fn: Callable[[E.Expr], E.Expr]) -> Compute:
    """A floating-point function of x (integer inputs give float32)."""
    check_tensor(x, op)
    out = float_type(x.dtype)
    return elementwise(op, [x], out, compute_type(out), fn)


def _unary_same(op: str, x: TensorNode, fn: Callable[[E.Expr], E.Expr], allow_bool: bool = False) -> Compute:
    """A function of x with x's dtype."""
    check_tensor(x, op)
    if x.dtype.is_bool and not allow_bool:
        raise UnsupportedError(f"{op}: not defined for bool tensors ('{x.name}'); cast it to an integer or float type first")
    return elementwise(op, [x], x.dtype, compute_type(x.dtype), fn)


def neg(x: TensorNode) -> Compute:
    return _unary_same("neg", x, lambda v: -v)


def abs(x: TensorNode) -> Compute:  # noqa: A001  (mirrors numpy/torch names)
    return _unary_same("abs", x, lambda v: _call("abs", v))


def square(x: TensorNode) -> Compute:
    return _unary_same("square", x, lambda v: v * v)


def sign(x: TensorNode) -> Compute:
    def fn(v: E.Expr) -> E.Expr:
        t = v.dtype
        return E.Select(v > const(0, t), const(1, t), E.Select(v < const(0, t), const(-1, t), v))

    return _unary_same("sign", x, fn)


def exp(x: TensorNode) -> Compute:
    return _unary_float("exp", x, lambda v: _call("exp", v))


def exp2(x: TensorNode) -> Compute:
    return _unary_float("exp2", x, lambda v: _call("exp2", v))


def log(x: TensorNode) -> Compute:
    return _unary_float("log", x, lambda v: _call("log", v))


def log2(x: TensorNode) -> Compute:
    return _unary_float("log2", x, lambda v: _call("log2", v))


def sqrt(x: TensorNode) -> Compute:
    return _unary_float("sqrt", x, lambda v: _call("sqrt", v))


def rsqrt(x: TensorNode) -> Compute:
    return _unary_float("rsqrt", x, lambda v: _call("rsqrt", v))


def sin(x: TensorNode) -> Compute:
    return _unary_float("sin", x, lambda v: _call("sin", v))


def cos(x: TensorNode) -> Compute:
    return _unary_float("cos", x, lambda v: _call("cos", v))


def tanh(x: TensorNode) -> Compute:
    return _unary_float("tanh", x, lambda v: _call("tanh", v))


def erf(x: TensorNode) -> Compute:
    return _unary_float("erf", x, lambda v: _call("erf", v))


def reciprocal(x: TensorNode) -> Compute:
    return _unary_float("reciprocal", x, lambda v: fdiv(const(1, v.dtype), v))


def _rounding(op: str, x: TensorNode) -> Compute:
    if not x.dtype.is_float:  # integers are already whole: a copy
        return _unary_same(op, x, lambda v: v, allow_bool=True)
    return _unary_float(op, x, lambda v: _call(op, v))


def floor(x: TensorNode) -> Compute:
    return _rounding("floor", x)


def ceil(x: TensorNode) -> Compute:
    return _rounding("ceil", x)


def round(x: TensorNode) -> Compute:  # noqa: A001
    """Round half to even, like torch.round and numpy.round."""
    return _rounding("round", x)


def _sigmoid(v: E.Expr) -> E.Expr:
    return fdiv(const(1, v.dtype), const(1, v.dtype) + _call("exp", -v))


def sigmoid(x: TensorNode) -> Compute:
    return _unary_float("sigmoid", x, _sigmoid)


def relu(x: TensorNode) -> Compute:
    return _unary_same("relu", x, lambda v: _call("max", v, const(0, v.dtype)))


def silu(x: TensorNode) -> Compute:
    return _unary_float("silu", x, lambda v: v * _sigmoid(v))


def gelu(x: TensorNode, approximate: str = "none") -> Compute:
    """GELU: x * Phi(x) ("none", with erf) or its tanh approximation ("tanh", GPT-2's)."""
    if approximate == "none":
        return _unary_float("gelu", x, lambda v: const(0.5, v.dtype) * v * (const(1, v.dtype) + _call("erf", v * const(math.sqrt(0.5), v.dtype))))
    if approximate == "tanh":
        def fn(v: E.Expr) -> E.Expr:
            t = v.dtype
            inner = const(math.sqrt(2 / math.pi), t) * (v + const(0.044715, t) * v * v * v)
            return const(0.5, t) * v * (const(1, t) + _call("tanh", inner))

        return _unary_float("gelu_tanh", x, fn)
    raise ArgumentError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def softplus(x: TensorNode, beta: float = 1.0, threshold: float = 20.0) -> Compute:
    """log(1 + exp(beta x)) / beta, linear above `threshold` (torch's definition)."""
    def fn(v: E.Expr) -> E.Expr:
        t = v.dtype
        bx = v * const(beta, t)
        return E.Select(bx > const(threshold, t), v, fdiv(_call("log", const(1, t) + _call("exp", bx)), const(beta, t)))

    return _unary_float("softplus", x, fn)


def leaky_relu(x: TensorNode, negative_slope: float = 0.01) -> Compute:
    check_tensor(x, "leaky_relu")
    out = float_type(x.dtype)
    return elementwise("leaky_relu", [x], out, compute_type(out),
                       lambda v: E.Select(v > const(0, v.dtype), v, v * const(negative_slope, v.dtype)))  # fmt: skip


def hardsigmoid(x: TensorNode) -> Compute:
    """relu6(x + 3) / 6."""
    return _unary_float("hardsigmoid", x, lambda v: fdiv(_relu6(v + const(3, v.dtype)), const(6, v.dtype)))


def hardswish(x: TensorNode) -> Compute:
    """x * relu6(x + 3) / 6."""
    return _unary_float("hardswish", x, lambda v: fdiv(v * _relu6(v + const(3, v.dtype)), const(6, v.dtype)))


def tan(x: TensorNode) -> Compute:
    """sin(x) / cos(x) (no tan intrinsic on every target)."""
    return _unary_float("tan", x, lambda v: fdiv(_call("sin", v), _call("cos", v)))


def _log1p(v: E.Expr) -> E.Expr:
    # Goldberg's trick: log(u) * x / (u - 1) with u = 1 + x cancels the rounding of 1 + x,
    # so small x keep full relative precision (log(1 + x) alone loses it).
    t = v.dtype
    u = const(1, t) + v
    d = u - const(1, t)
    exact = E.Binary("||", E.Binary("==", d, const(0, t)), E.Binary("==", u, const(float("inf"), t)))
    return E.Select(exact, E.Select(E.Binary("==", d, const(0, t)), v, u), _call("log", u) * fdiv(v, d))


def _expm1(v: E.Expr) -> E.Expr:
    # Kahan's trick: (u - 1) * x / log(u) with u = exp(x) is accurate for small x; where
    # exp(x) rounds to 1 the answer is x, and for large |x| u - 1 itself is exact enough.
    t = v.dtype
    u = _call("exp", v)
    um1 = u - const(1, t)
    small = E.Binary("&&", v > const(-0.5, t), v < const(0.5, t))
    return E.Select(E.Binary("==", u, const(1, t)), v, E.Select(small, um1 * fdiv(v, _call("log", u)), um1))


def log1p(x: TensorNode) -> Compute:
    """log(1 + x), accurate for small x."""
    return _unary_float("log1p", x, _log1p)


def expm1(x: TensorNode) -> Compute:
    """exp(x) - 1, accurate for small x."""
    return _unary_float("expm1", x, _expm1)


def elu(x: TensorNode, alpha: float = 1.0) -> Compute:
    """x for x > 0, alpha * (exp(x) - 1) otherwise."""
    return _unary_float("elu", x, lambda v: E.Select(v > const(0, v.dtype), v, const(alpha, v.dtype) * _expm1(v)))


def mish(x: TensorNode) -> Compute:
    """x * tanh(softplus(x)), softplus linear above 20 (torch's threshold)."""
    def fn(v: E.Expr) -> E.Expr:
        t = v.dtype
        sp = E.Select(v > const(20, t), v, _log1p(_call("exp", v)))
        return v * _call("tanh", sp)

    return _unary_float("mish", x, fn)


def trunc(x: TensorNode) -> Compute:
    """Round towards zero (integers are copied)."""
    if not x.dtype.is_float:
        return _unary_same("trunc", x, lambda v: v, allow_bool=True)
    return _unary_float("trunc", x, lambda v: E.Select(v < const(0, v.dtype), _call("ceil", v), _call("floor", v)))


def isnan(x: TensorNode) -> Compute:
    """True where x is NaN (never for integers)."""
    check_tensor(x, "isnan")
    return elementwise("isnan", [x], dtypes.boolean, compute_type(x.dtype),
                       lambda v: E.Binary("!=", v, v) if v.dtype.is_float else const(False, dtypes.boolean))  # fmt: skip


def logical_not(x: TensorNode) -> Compute:
    check_tensor(x, "logical_not")
    return elementwise("logical_not", [x], dtypes.boolean, x.dtype, lambda v: E.Binary("==", v, const(0, v.dtype)))


def cast(x: TensorNode, dtype: DataType | str) -> Compute:
    """x converted to `dtype` (floats to integers truncate towards zero; nonzero to bool is True)."""
    check_tensor(x, "cast")
    dt = dtypes.dtype(dtype)
    if dt not in SUPPORTED:
        raise UnsupportedError(f"cast: cannot convert to {dt}; ops compute with {', '.join(d.name for d in SUPPORTED)}")
    return elementwise("cast", [x], dt, x.dtype, lambda v: E.Binary("!=", v, const(0, v.dtype)) if dt.is_bool else v)


def bitcast(x: TensorNode, dtype: DataType | str) -> Compute:
    """The bits of x read as `dtype`, of the same width (ONNX BitCast; numpy's `view`)."""
    check_tensor(x, "bitcast")
    dt = dtypes.dtype(dtype)
    if dt not in SUPPORTED:
        raise UnsupportedError(f"bitcast: cannot reinterpret as {dt}; ops compute with {', '.join(d.name for d in SUPPORTED)}")
    if dt.nbits != x.dtype.nbits:
        raise ArgumentError(f"bitcast: {x.dtype} ({x.dtype.nbits} bits) and {dt} ({dt.nbits} bits) differ in width; "
                            "BitCast keeps the shape, so the widths must match")
    return compute(x.shape, lambda *i: E.Call("bitcast", (x[i],), dt), fresh_name("bitcast"), dt)


# ---- binary ------------------------------------------------------------------------------------------------------------
def _binary(op: str, a: TensorOrScalar, b: TensorOrScalar, fn: Callable[[E.Expr, E.Expr], E.Expr],
            out: DataType | None = None) -> Compute:  # fmt: skip
    t = result_type([a, b], op)
    return elementwise(op, [a, b], out or t, compute_type(t), fn)


def _no_bool(op: str, *args: TensorOrScalar) -> None:
    if all(isinstance(a, bool) or (isinstance(a, TensorNode) and a.dtype.is_bool) for a in args):
        raise UnsupportedError(f"{op}: not defined for bool operands; use logical_xor/logical_and or cast to an integer type")


def add(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    """a + b (bool + bool is logical or, as in torch)."""
    return _binary("add", a, b, lambda x, y: x + y)


def sub(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    _no_bool("sub", a, b)
    return _binary("sub", a, b, lambda x, y: x - y)


def mul(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _binary("mul", a, b, lambda x, y: x * y)


def div(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    """True division; integer operands give float32."""
    t = result_type([a, b], "div")
    out = float_type(t)
    return elementwise("div", [a, b], out, compute_type(out), fdiv)


def floor_divide(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    """Division rounded towards minus infinity.  An integer division by zero raises
    DivisionByZeroError on the CPU and gives 0 on CUDA, like the kernels' `//` (and torch)."""
    _no_bool("floor_divide", a, b)
    t = result_type([a, b], "floor_divide")
    fn = (lambda x, y: _call("floor", fdiv(x, y))) if t.is_float else (lambda x, y: E.Binary("//", x, y))
    return _binary("floor_divide", a, b, fn)


def remainder(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    """Python's modulo (the sign of the divisor).  An integer modulo by zero raises
    DivisionByZeroError on the CPU and gives 0 on CUDA, like the kernels' `%` (and torch)."""
    _no_bool("remainder", a, b)
    return _binary("remainder", a, b, lambda x, y: E.Binary("%", x, y))


def pow(a: TensorOrScalar, b: TensorOrScalar) -> Compute:  # noqa: A001
    """a ** b.  Integer powers are exact (wrapping like numpy): a small constant exponent by
    multiplication, others by squaring (`ipow`); a negative integer exponent raises
    NegativePowerError on the CPU (numpy and ONNX refuse it) and gives 1/a**-b truncated
    (1, -1 or 0) on CUDA, as torch does."""
    t = result_type([a, b], "pow")
    if not t.is_float:
        _no_bool("pow", a, b)
        if isinstance(b, bool) or not (isinstance(b, int) and 0 <= b <= 16):
            return _binary("pow", a, b, lambda x, y: E.Call("ipow", (x, y), x.dtype))

        def ipow(x: E.Expr, _: E.Expr) -> E.Expr:
            out: E.Expr = const(1, x.dtype)
            for _k in range(b):
                out = out * x
            return out

        return _binary("pow", a, b, ipow)
    if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, TensorNode):
        special = {1: lambda x, y: x, 2: lambda x, y: x * x, 3: lambda x, y: x * x * x, 0.5: lambda x, y: _call("sqrt", x),
                   -1: lambda x, y: const(1, x.dtype) / x}  # fmt: skip
        if b in special:
            return _binary("pow", a, b, special[b])
    return _binary("pow", a, b, lambda x, y: _call("pow", x, y))


def maximum(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    """Elementwise maximum; NaN propagates."""
    return _binary("maximum", a, b, lambda x, y: _call("max", x, y))


def minimum(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    """Elementwise minimum; NaN propagates."""
    return _binary("minimum", a, b, lambda x, y: _call("min", x, y))


def _compare(op: str, sym: str, a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _binary(op, a, b, lambda x, y: E.Binary(sym, x, y), out=dtypes.boolean)


def eq(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _compare("eq", "==", a, b)


def ne(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _compare("ne", "!=", a, b)


def lt(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _compare("lt", "<", a, b)


def le(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _compare("le", "<=", a, b)


def gt(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _compare("gt", ">", a, b)


def ge(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _compare("ge", ">=", a, b)


def _logical(op: str, sym: str, a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    def truth(x: E.Expr) -> E.Expr:
        return E.Binary("!=", x, const(0, x.dtype))

    return _binary(op, a, b, lambda x, y: E.Binary(sym, truth(x), truth(y)), out=dtypes.boolean)


def logical_and(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _logical("logical_and", "&&", a, b)


def logical_or(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _logical("logical_or", "||", a, b)


def logical_xor(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    return _logical("logical_xor", "!=", a, b)


def _bitwise(op: str, sym: str, a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    t = result_type([a, b], op)
    if t.is_float:
        raise UnsupportedError(f"{op}: needs integer or bool operands, got {t}")
    return _binary(op, a, b, lambda x, y: E.Binary(sym, x, y))


def bitwise_and(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    """a & b on integers (logical and on bools)."""
    return _bitwise("bitwise_and", "&", a, b)


def bitwise_or(a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    """a | b on integers (logical or on bools)."""
    return _bitwise("bitwise_or", "|", a, b)


def where(cond: TensorNode, a: TensorOrScalar, b: TensorOrScalar) -> Compute:
    """a where cond else b, with all three broadcast together; only the chosen side is read."""
    check_tensor(cond, "where", "condition")
    if not cond.dtype.is_bool:
        raise ArgumentError(f"where: the condition '{cond.name}' must be a bool tensor, got {cond.dtype}; compare it first (e.g. ne(x, 0))")
    if isinstance(a, TensorNode) or isinstance(b, TensorNode):
        t = result_type([a, b], "where")
    else:
        kinds = {scalar_kind(a), scalar_kind(b)}
        t = dtypes.float32 if "float" in kinds else dtypes.int64 if "int" in kinds else dtypes.boolean
    ct = compute_type(t)
    tensors = [cond] + [x for x in (a, b) if isinstance(x, TensorNode)]
    for x in tensors:
        check_tensor(x, "where")
    shape = broadcast_shapes([x.shape for x in tensors], "where")
    return compute(shape, lambda *ax: E.Select(operand(cond, shape, ax, dtypes.boolean), operand(a, shape, ax, ct),
                                               operand(b, shape, ax, ct)), fresh_name("where"), t)  # fmt: skip


def clamp(x: TensorNode, min: TensorOrScalar | None = None, max: TensorOrScalar | None = None) -> Compute:  # noqa: A002
    """min(max(x, lo), hi) with either bound optional; NaN in x propagates."""
    check_tensor(x, "clamp")
    if min is None and max is None:
        raise ArgumentError("clamp: give at least one of min and max")
    args: list[TensorOrScalar] = [x] + [v for v in (min, max) if v is not None]
    t = result_type(args, "clamp")

    def fn(v: E.Expr, *bounds: E.Expr) -> E.Expr:
        k = 0
        if min is not None:
            v = _call("max", v, bounds[k])
            k += 1
        if max is not None:
            v = _call("min", v, bounds[k])
        return v

    return elementwise("clamp", args, t, compute_type(t), fn)
