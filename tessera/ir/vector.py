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

Integer vectors (int32 / uint32 lanes: a low-bit weight's words, decoded in registers):

    vload(W[i], 8)                8 consecutive words; vbroadcast(x, 8, ts.uint32)
    vadd/vsub(a, b)               per lane, wrapping
    vand/vor/vxor(a, b)           bitwise
    vshl(a, n), vshr(a, n)        shifts by a scalar n in 0..31 (vshr: logical on uint32,
                                  arithmetic on int32)
    vfloat(a)                     int32 lanes to float32 (rounded to nearest)
    vfloat16(a)                   the float16 bit pattern in each lane's low 16 bits to float32
                                  (exact, subnormals included; F16C's vcvtph2ps)
    vbitcast(a, dtype)            the same bits read as float32, int32 or uint32
    vlookup(table, idx)           table[idx & (lanes - 1)] per lane: a float32 vector of `lanes`
                                  entries indexed by the low bits of an integer vector

Backends map each one to the target's instructions (tessera.backend.codegen_c); which
widths a machine has is tessera.backend.isa's business, not the IR's.
"""

from __future__ import annotations

from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.types import VectorType

VECTOR_DTYPES = (dtypes.float32, dtypes.int32, dtypes.uint32)
VECTOR_LANES = (8, 16)
_ELEMENTWISE = ("vadd", "vsub", "vmul", "vmax", "vmin")
_FLOAT_ONLY = ("vmul", "vmax", "vmin", "vfma", "vsum", "vreduce_max")
_BITWISE = ("vand", "vor", "vxor")
_SHIFTS = ("vshl", "vshr")
_REDUCE = ("vsum", "vreduce_max")
VECTOR_CALLS = ("vload", "vbroadcast", "vfma", *_ELEMENTWISE, *_REDUCE, *_BITWISE, *_SHIFTS, "vfloat", "vfloat16",
                "vbitcast", "vlookup")


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
    if isinstance(value, E.Const) and dtype.is_integer and not (
            float(value.value).is_integer() and dtype.min_value <= value.value <= dtype.max_value):  # fmt: skip
        raise VectorTypeError(f"vbroadcast() of {value.value!r} into {dtype} lanes: the value is not a {dtype}")
    if value.dtype != dtype:
        value = E.Const(value.value, dtype) if isinstance(value, E.Const) else E.Cast(value, dtype)
    return E.Call("vbroadcast", (value,), t)


def vector_call(name: str, args: list[E.Expr]) -> E.Call:
    """One of vfma, vadd, vsub, vmul, vmax, vmin, vsum, vreduce_max, vand, vor, vxor, vfloat,
    vfloat16 on vector operands (the shifts, vbitcast and vlookup have functions of their own)."""
    arity = (3 if name == "vfma" else 2 if name in _ELEMENTWISE or name in _BITWISE
             else 1 if name in _REDUCE or name in ("vfloat", "vfloat16") else None)  # fmt: skip
    if arity is None:
        raise VectorTypeError(f"unknown vector intrinsic {name!r}; known: {list(VECTOR_CALLS)}")
    if len(args) != arity:
        raise VectorTypeError(f"{name}() takes {arity} vector(s), got {len(args)}")
    types = [_vector_operand(name, a, "operands") for a in args]
    if any(t != types[0] for t in types):
        raise VectorTypeError(f"{name}() needs operands of one vector type, got {', '.join(map(str, types))}")
    dtype = types[0].dtype
    if name in _FLOAT_ONLY and dtype != dtypes.float32:
        raise VectorTypeError(f"{name}() takes float32 vectors, got {types[0]} (vfloat() converts int32 lanes)")
    if name in _BITWISE and dtype == dtypes.float32:
        raise VectorTypeError(f"{name}() takes int32 or uint32 vectors, got {types[0]} (vbitcast() reads a float32 "
                              "vector's bits)")  # fmt: skip
    if name == "vfloat":
        if dtype != dtypes.int32:
            raise VectorTypeError(f"vfloat() converts int32 lanes, got {types[0]} (vbitcast a uint32 vector to int32 "
                                  "when its values are below 2**31)")  # fmt: skip
        return E.Call(name, tuple(args), VectorType(dtypes.float32, types[0].lanes))
    if name == "vfloat16":
        if dtype == dtypes.float32:
            raise VectorTypeError(f"vfloat16() reads float16 bits from int32 or uint32 lanes, got {types[0]}")
        return E.Call(name, tuple(args), VectorType(dtypes.float32, types[0].lanes))
    rtype = dtype if name in _REDUCE else types[0]
    return E.Call(name, tuple(args), rtype)


def shift(name: str, value: E.Expr, amount: E.Expr) -> E.Call:
    """vshl / vshr of an integer vector by a scalar integer amount (0..31)."""
    t = _vector_operand(name, value, "its first operand")
    if t.dtype == dtypes.float32:
        raise VectorTypeError(f"{name}() shifts int32 or uint32 vectors, got {t} (vbitcast() reads a float32 vector's bits)")
    if not isinstance(amount.type, dtypes.DataType) or not amount.dtype.is_integer:
        raise VectorTypeError(f"{name}()'s amount is a scalar integer, got {amount.type}")
    if isinstance(amount, E.Const) and not 0 <= amount.value <= 31:
        raise VectorTypeError(f"{name}()'s amount must be in 0..31, got {amount.value}")
    return E.Call(name, (value, amount), t)


def bitcast(value: E.Expr, dtype: dtypes.DataType) -> E.Call:
    """`value`'s bits read as a vector of `dtype` lanes (float32, int32 or uint32)."""
    t = _vector_operand("vbitcast", value, "its operand")
    return E.Call("vbitcast", (value,), vector_type(dtype, t.lanes))


def lookup(table: E.Expr, index: E.Expr) -> E.Call:
    """table[index & (lanes - 1)] per lane (a permute of the table's lanes)."""
    tt = _vector_operand("vlookup", table, "its table")
    it = _vector_operand("vlookup", index, "its index")
    if tt.dtype != dtypes.float32 or it.dtype == dtypes.float32 or tt.lanes != it.lanes:
        raise VectorTypeError(f"vlookup(table, index) takes a float32 table and an integer index vector of as many "
                              f"lanes, got {tt} and {it}")  # fmt: skip
    return E.Call("vlookup", (table, index), tt)
