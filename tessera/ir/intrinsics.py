"""Intrinsic functions callable from kernels, with their typing rules.

Backends map each intrinsic name to a C or CUDA function; the front end and passes only
need the arity and the result type defined here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.ir import dtypes
from tessera.ir.dtypes import DataType


@dataclass(frozen=True)
class Intrinsic:
    name: str
    arity: int
    # "float": result is the (float) argument type, ints promote to float32.
    # "same": result is the promoted type of the arguments.
    # "first": result is the first argument's type (warp shuffles: value, lane operand).
    rule: str

    def result_type(self, arg_types: list[DataType]) -> DataType:
        if len(arg_types) != self.arity:
            raise TypeError(f"{self.name}() takes {self.arity} argument(s), got {len(arg_types)}")
        t = arg_types[0]
        if self.rule == "first":
            if not arg_types[1].is_integer:
                raise TypeError(f"{self.name}() takes an integer lane operand, got {arg_types[1]}")
            return t
        for other in arg_types[1:]:
            t = dtypes.promote(t, other)
        if self.rule == "float" and not t.is_float:
            return dtypes.float32
        return t


_FLOAT_UNARY = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh", "erf", "floor", "ceil", "round",
                "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh")
INTRINSICS: dict[str, Intrinsic] = {n: Intrinsic(n, 1, "float") for n in _FLOAT_UNARY}
INTRINSICS |= {
    "pow": Intrinsic("pow", 2, "float"),
    "abs": Intrinsic("abs", 1, "same"),
    "max": Intrinsic("max", 2, "same"),
    "min": Intrinsic("min", 2, "same"),
    "fma": Intrinsic("fma", 3, "float"),
    "fmod": Intrinsic("fmod", 2, "float"),  # C's fmod: the remainder has the sign of the dividend
    # checked_index(i, n): i (negative counts from the end) if -n <= i < n; otherwise the CPU
    # kernel reports an out-of-range index (the runtime raises) and CUDA clamps into [0, n).
    "checked_index": Intrinsic("checked_index", 2, "same"),
    # max of two floats that ignores a NaN operand (C's fmax: one instruction, where "max"
    # propagates NaN as numpy and torch do).
    "fmax": Intrinsic("fmax", 2, "float"),
    # 2**x by the GPU's special-function unit (ex2.approx.ftz: ~2 ulp, results below 2**-126
    # flushed to 0); CUDA only.  The softmax of flash attention feeds it.
    "fast_exp2": Intrinsic("fast_exp2", 1, "float"),
    # Warp shuffles (CUDA only): exchange a value among the 32 lanes of a warp.
    "shfl_xor": Intrinsic("shfl_xor", 2, "first"),
    "shfl_down": Intrinsic("shfl_down", 2, "first"),
    "shfl_idx": Intrinsic("shfl_idx", 2, "first"),
}
# Two more calls carry an explicit result type and are not in this table: ipow(a, n) (exact
# integer power, made only by tessera.ops; see backend SHARED_HELPERS) and bitcast(x) (x's bits
# as the call's type, of the same width: tessera.ops and the kernel builtin ts.bitcast).
GPU_ONLY = frozenset({"shfl_xor", "shfl_down", "shfl_idx", "fast_exp2"})


def lookup(name: str) -> Intrinsic:
    try:
        return INTRINSICS[name]
    except KeyError:
        raise KeyError(f"unknown intrinsic {name!r}; known: {sorted(INTRINSICS)}") from None
