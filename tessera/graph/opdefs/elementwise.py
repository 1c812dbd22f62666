"""Elementwise operators: unary math, activations, binary arithmetic with broadcasting,
comparisons, where, cast and clamp."""

from __future__ import annotations

import math

import numpy as np

from tessera.errors import DivisionByZeroError
from tessera.graph.opdefs._common import float_result, upcast
from tessera.graph.registry import register
from tessera.graph.symbolic import ShapeError, broadcast_shapes
from tessera.ir import dtypes
from tessera.ir.dtypes import from_numpy_dtype, numpy_dtype, promote_graph


def _erf(x: np.ndarray) -> np.ndarray:
    # numpy has no erf; math.erf is exact to double precision, which an oracle must be.
    try:
        from scipy.special import erf  # type: ignore[import-not-found]

        return erf(x)
    except ImportError:
        return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(x.dtype)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Split by sign so that exp never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


def _gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


_UNARY_FLOAT = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "tanh": np.tanh, "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x), "erf": _erf, "reciprocal": lambda x: 1 / x,
    "softplus": lambda x: np.logaddexp(0, x), "log1p": np.log1p, "expm1": np.expm1,
    "mish": lambda x: x * np.tanh(np.logaddexp(0, x)),
    "hardsigmoid": lambda x: np.clip(x / 6 + 0.5, 0, 1), "hardswish": lambda x: x * np.clip(x / 6 + 0.5, 0, 1),
    "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh,
    "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh,
}  # fmt: skip
_UNARY_SAME = {
    "neg": np.negative, "abs": np.abs, "relu": lambda x: np.maximum(x, 0).astype(x.dtype), "sign": lambda x: x if x.dtype == np.bool_ else np.sign(x),
    "floor": np.floor, "ceil": np.ceil, "round": np.round,
}  # fmt: skip


def _infer_float(inputs, attrs):
    return [(inputs[0].shape, float_result(inputs[0].dtype))]


def _infer_same(inputs, attrs):
    return [(inputs[0].shape, inputs[0].dtype)]


def _infer_neg(inputs, attrs):
    if inputs[0].dtype.is_bool:  # numpy and torch refuse it too
        raise ShapeError("neg of a bool tensor is not defined; use logical_not, or cast to a number first")
    return _infer_same(inputs, attrs)


def _unary_ref(fn):
    return lambda xs, attrs: [fn(upcast(xs[0]))]


def _float_ref(fn):
    # Integer and bool inputs compute in float32, the result dtype: numpy would pick float16
    # for bool and int8 (np.exp(True) is float16) and lose precision the graph promises.
    def ref(xs, attrs):
        x = upcast(xs[0])
        return [fn(x if x.dtype.kind == "f" else x.astype(np.float32))]

    return ref


for _k, _f in _UNARY_FLOAT.items():
    register(_k, infer=_infer_float, reference=_float_ref(_f), category="elementwise")
for _k, _f in _UNARY_SAME.items():
    register(_k, infer=_infer_neg if _k == "neg" else _infer_same, reference=_unary_ref(_f), category="elementwise")

register("gelu", infer=_infer_float, category="elementwise", attrs={"approximate": "none"},
         reference=lambda xs, a: [_gelu(upcast(xs[0]), a["approximate"])],
         doc='approximate="none" is the erf form, "tanh" the tanh approximation')  # fmt: skip
register("leaky_relu", infer=_infer_same, category="elementwise", attrs={"negative_slope": 0.01},
         reference=lambda xs, a: [np.where(xs[0] >= 0, xs[0], xs[0] * a["negative_slope"])])  # fmt: skip
register("elu", infer=_infer_same, category="elementwise", attrs={"alpha": 1.0},
         reference=lambda xs, a: [np.where(xs[0] > 0, xs[0], a["alpha"] * np.expm1(np.minimum(upcast(xs[0]), 0)))])  # fmt: skip
register("logical_not", infer=lambda xs, a: [(xs[0].shape, dtypes.boolean)], category="elementwise",
         reference=lambda xs, a: [np.logical_not(xs[0])])  # fmt: skip
register("isnan", infer=lambda xs, a: [(xs[0].shape, dtypes.boolean)], category="elementwise",
         reference=lambda xs, a: [np.isnan(xs[0])])  # fmt: skip
register("identity", infer=_infer_same, category="elementwise", reference=lambda xs, a: [xs[0]])


def _clamp_ref(xs, a):
    x = xs[0]
    if a["min"] is not None:
        x = np.maximum(x, np.asarray(a["min"]).astype(x.dtype))
    if a["max"] is not None:
        x = np.minimum(x, np.asarray(a["max"]).astype(x.dtype))
    return [x]


register("clamp", infer=_infer_same, category="elementwise", attrs={"min": None, "max": None},
         reference=_clamp_ref, doc="min/max are optional numbers; NaN passes through")  # fmt: skip


def _cast_ref(xs, a):
    return [xs[0].astype(numpy_dtype(dtypes.dtype(a["dtype"])))]


register("cast", infer=lambda xs, a: [(xs[0].shape, dtypes.dtype(a["dtype"]))], category="elementwise",
         attrs={"dtype": None}, reference=_cast_ref)  # fmt: skip


# ---- binary ------------------------------------------------------------------------------
def _infer_arith(inputs, attrs):
    return [(broadcast_shapes(inputs[0].shape, inputs[1].shape), promote_graph(inputs[0].dtype, inputs[1].dtype))]


def _infer_sub(inputs, attrs):
    if inputs[0].dtype.is_bool and inputs[1].dtype.is_bool:  # numpy and torch refuse it too
        raise ShapeError("sub of two bool tensors is not defined; use logical_xor, or cast to a number first")
    return _infer_arith(inputs, attrs)


def _infer_bitwise(inputs, attrs):
    if inputs[0].dtype.is_float or inputs[1].dtype.is_float:
        raise ShapeError(f"bitwise operators take integer or bool tensors, got {inputs[0].dtype} and {inputs[1].dtype}")
    return _infer_arith(inputs, attrs)


def _infer_compare(inputs, attrs):
    return [(broadcast_shapes(inputs[0].shape, inputs[1].shape), dtypes.boolean)]


def _binary_ref(fn):
    return lambda xs, attrs: [fn(upcast(xs[0]), upcast(xs[1]))]


def _promoted_ref(fn):
    # Operands converted to the promoted dtype first, as the graph's result dtype says (and as
    # torch does): numpy would compute int64 % float16 in float64, where 2**40 is finite.
    def ref(xs, attrs):
        dt = numpy_dtype(promote_graph(from_numpy_dtype(xs[0].dtype), from_numpy_dtype(xs[1].dtype)))
        return [fn(upcast(xs[0].astype(dt, copy=False)), upcast(xs[1].astype(dt, copy=False)))]

    return ref


_ARITH = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum, "minimum": np.minimum,
    "pow": np.power, "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
}  # fmt: skip
_COMPARE = {
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal,
}  # fmt: skip
_LOGICAL = {"logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor}
_ARITH_INFER = {"sub": _infer_sub, "bitwise_and": _infer_bitwise, "bitwise_or": _infer_bitwise,
                "bitwise_xor": _infer_bitwise}
for _k, _f in _ARITH.items():
    register(_k, infer=_ARITH_INFER.get(_k, _infer_arith), reference=_promoted_ref(_f), category="elementwise", num_inputs=2,
             doc="operands are converted to the promoted dtype (the result's), then combined")  # fmt: skip
for _k, _f in _COMPARE.items():
    register(_k, infer=_infer_compare, reference=_promoted_ref(_f), category="elementwise", num_inputs=2,
             doc="compares in the promoted dtype of the operands")  # fmt: skip
for _k, _f in _LOGICAL.items():  # each operand's truth value (nonzero), no promotion
    register(_k, infer=_infer_compare, reference=_binary_ref(_f), category="elementwise", num_inputs=2)


def _integer_divisor(x: np.ndarray, y: np.ndarray, what: str) -> None:
    """Integer division semantics on the host, as the CPU kernels (and torch on the CPU) have
    them: a zero divisor raises instead of numpy's silent 0."""
    if np.issubdtype(np.result_type(x, y), np.integer) and not np.all(y):
        raise DivisionByZeroError(f"{what}: integer division or modulo by zero")


def _checked(fn, what: str):
    def checked(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        _integer_divisor(x, y, what)
        return fn(x, y)

    return checked


for _k, _f in {"remainder": np.mod, "fmod": np.fmod}.items():  # remainder floors (Python), fmod truncates (C)
    register(_k, infer=_infer_arith, reference=_promoted_ref(_checked(_f, _k)), category="elementwise", num_inputs=2,
             doc="operands are converted to the promoted dtype; an integer zero divisor raises DivisionByZeroError")  # fmt: skip


def _infer_div(inputs, attrs):
    (shape, dt), = _infer_arith(inputs, attrs)
    if attrs["rounding"] is None and not dt.is_float:
        dt = dtypes.float32
    return [(shape, dt)]


def _div_ref(xs, a):
    dt = promote_graph(from_numpy_dtype(xs[0].dtype), from_numpy_dtype(xs[1].dtype))
    if a["rounding"] is None and not dt.is_float:
        dt = dtypes.float32  # true division of integers is float32 division, as torch does it
    x, y = (upcast(v.astype(numpy_dtype(dt), copy=False)) for v in xs)
    if a["rounding"] is None:
        return [np.true_divide(x, y)]
    _integer_divisor(x, y, "div")
    if a["rounding"] == "floor":
        return [np.floor_divide(x, y)]
    if np.issubdtype(np.result_type(x, y), np.integer):
        q = np.floor_divide(x, y)
        return [np.where((q < 0) & (q * y != x), q + 1, q)]  # truncate toward zero
    return [np.trunc(x / y)]


register("div", infer=_infer_div, reference=_div_ref, category="elementwise", num_inputs=2,
         attrs={"rounding": None}, doc='rounding: None (true division), "trunc" or "floor" (like torch.div)')  # fmt: skip


def _infer_where(inputs, attrs):
    shape = broadcast_shapes(inputs[0].shape, inputs[1].shape, inputs[2].shape)
    return [(shape, promote_graph(inputs[1].dtype, inputs[2].dtype))]


register("where", infer=_infer_where, category="elementwise", num_inputs=3,
         reference=lambda xs, a: [np.where(xs[0].astype(bool), xs[1], xs[2])])  # fmt: skip


def _bitshift_ref(xs, a):
    x, n = xs[0], xs[1].astype(xs[0].dtype)
    return [np.left_shift(x, n) if a["left"] else np.right_shift(x, n)]


register("bitshift", infer=lambda xs, a: [(broadcast_shapes(xs[0].shape, xs[1].shape), xs[0].dtype)],
         reference=_bitshift_ref, category="elementwise", num_inputs=2, attrs={"left": True},
         doc="x << n (left) or x >> n on unsigned integers (ONNX BitShift)")  # fmt: skip


def _bitcast_ref(xs, a):
    return [xs[0].view(numpy_dtype(dtypes.dtype(a["dtype"])))]


def _bitcast_infer(xs, a):
    dt = dtypes.dtype(a["dtype"])
    if dt.nbits != xs[0].dtype.nbits:
        raise ShapeError(f"bitcast between {xs[0].dtype} and {dt} of different widths")
    return [(xs[0].shape, dt)]


register("bitcast", infer=_bitcast_infer, reference=_bitcast_ref, category="elementwise", attrs={"dtype": "int32"},
         doc="the same bits read as another dtype of the same width (ONNX BitCast)")  # fmt: skip
