"""SIMD vector values on the CPU: types and the typing rules of the vector intrinsics.

A vector is a `VectorType(dtype, lanes)` value (one AVX-512 register is `f32x16`, one AVX2
register `f32x8`).  Vector expressions are `Call` nodes whose type is a VectorType; the two
that only have an effect, `vstore` and `prefetch`, are instructions (tessera.ir.instructions).

    vload(A[i, j], 16)            16 consecutive elements from the address of A[i, j]
    vload(A[i, j], 16, n)         the first n of them (0 <= n <= 16), the others 0; reads only n
    vbroadcast(x, 16)             x in every lane
    vfma(a, b, c)                 a * b + c per lane, one rounding (fused multiply-add)
    vadd/vsub/vmul/vmax/vmin(a, b)
    vsum(v), vreduce_max(v)       the scalar sum / maximum of the lanes

Backends map each one to the target's instructions (tessera.backend.codegen_c); which
widths a machine has is tessera.backend.isa's business, not the IR's.
"""

from __future__ import annotations

from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.types import VectorType

VECTOR_DTYPES = (dtypes.float32,)
VECTOR_LANES = (8, 16)
_ELEMENTWISE = ("vadd", "vsub", "vmul", "vmax", "vmin")
_REDUCE = ("vsum", "vreduce_max")
VECTOR_CALLS = ("vload", "vbroadcast", "vfma", *_ELEMENTWISE, *_REDUCE)


class VectorTypeError(E.IRTypeError):
    """A vector intrinsic used with operands of the wrong type."""


def vector_type(dtype: dtypes.DataType, lanes: int) -> VectorType:
    """The vector type of `lanes` x `dtype`, refused unless a backend can hold it."""
    if dtype not in VECTOR_DTYPES:
        raise VectorTypeError(f"vectors of {dtype} are not supported; vector types hold {[str(d) for d in VECTOR_DTYPES]}")
    if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes not in VECTOR_LANES:
        raise VectorTypeError(f"a vector has {' or '.join(map(str, VECTOR_LANES))} lanes (a compile-time int), got {lanes!r}")
    return VectorType(dtype, lanes)


f32x8 = VectorType(dtypes.float32, 8)
f32x16 = VectorType(dtypes.float32, 16)


def is_vector(e: E.Expr) -> bool:
    return isinstance(e.type, VectorType)


def _vector_operand(name: str, e: E.Expr, what: str) -> VectorType:
    if not isinstance(e, E.Expr) or not is_vector(e):
        raise VectorTypeError(f"{name}() takes vectors as {what}, got {getattr(e, 'type', e)}")
    return e.type


def _count(name: str, count: E.Expr, lanes: int) -> E.Expr:
    if not isinstance(count.type, dtypes.DataType) or not count.dtype.is_integer:
        raise VectorTypeError(f"{name}()'s count (how many lanes to touch) must be an integer, got {count.type}")
    if isinstance(count, E.Const) and not 0 <= count.value <= lanes:
        raise VectorTypeError(f"{name}()'s count must be in 0..{lanes}, got {count.value}")
    return count


def vload(address: E.Address, lanes: int, count: E.Expr | None = None) -> E.Call:
    """`lanes` consecutive elements from `address` (with `count`: the first `count`, others 0)."""
    if not isinstance(address, E.Address):
        raise VectorTypeError("vload() reads from a tensor element such as A[i, j]")
    t = vector_type(address.type.dtype, lanes)
    args: tuple[E.Expr, ...] = (address,) if count is None else (address, _count("vload", count, lanes))
    return E.Call("vload", args, t)


def vbroadcast(value: E.Expr, lanes: int, dtype: dtypes.DataType = dtypes.float32) -> E.Call:
    """`value` (a scalar, converted to `dtype`) in each of `lanes` lanes."""
    t = vector_type(dtype, lanes)
    if not isinstance(value.type, dtypes.DataType):
        raise VectorTypeError(f"vbroadcast() takes a scalar, got {value.type}")
    if value.dtype != dtype:
        value = E.Const(value.value, dtype) if isinstance(value, E.Const) else E.Cast(value, dtype)
    return E.Call("vbroadcast", (value,), t)


def vector_call(name: str, args: list[E.Expr]) -> E.Call:
    """One of vfma, vadd, vsub, vmul, vmax, vmin, vsum, vreduce_max on vector operands."""
    arity = 3 if name == "vfma" else 2 if name in _ELEMENTWISE else 1 if name in _REDUCE else None
    if arity is None:
        raise VectorTypeError(f"unknown vector intrinsic {name!r}; known: {list(VECTOR_CALLS)}")
    if len(args) != arity:
        raise VectorTypeError(f"{name}() takes {arity} vector(s), got {len(args)}")
    types = [_vector_operand(name, a, "operands") for a in args]
    if any(t != types[0] for t in types):
        raise VectorTypeError(f"{name}() needs operands of one vector type, got {', '.join(map(str, types))}")
    rtype = types[0].dtype if name in _REDUCE else types[0]
    return E.Call(name, tuple(args), rtype)
