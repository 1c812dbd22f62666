"""Scalar data types, including the sub-byte integer and small-float types.

Every scalar value in the IR carries one of the `DataType` objects defined here.
Types narrower than a byte (int1..int7, uint1..uint7, e2m1, e2m3, e3m2) and the 8-bit floats
(e4m3, e5m2) are *storage* types: they live in packed global tensors (dense, N*K*bits/8 bytes,
see tessera.quant) and are computed with in their compute type (`compute_type`): int32 for the
integers, as C promotes char, float32 for the small floats.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessera.errors import DataTypeError, UnsupportedError

# What `float32["M", "N"]` builds (a TensorType): tessera.ir.types, which imports this module,
# registers its builder when it loads (`register_tensor_annotation`); tessera.ir imports types,
# so the builder is in place before any annotation is written.
_tensor_annotation: list[Callable[[DataType, tuple[Any, ...]], Any]] = []


def register_tensor_annotation(build: Callable[[DataType, tuple[Any, ...]], Any]) -> None:
    """Make `dtype[shape]` return `build(dtype, shape)` (shape a tuple)."""
    _tensor_annotation[:] = [build]


@dataclass(frozen=True)
class DataType:
    """A scalar type: its name, width in bits and kind.

    kind is one of "bool", "int" (signed), "uint" or "float".  Floats also record their
    exponent and mantissa widths so that small formats (e4m3, e2m1, ...) are described
    exactly.
    """

    name: str
    short: str
    nbits: int
    kind: str
    exponent_bits: int = 0
    mantissa_bits: int = 0

    # ---- classification -------------------------------------------------------------
    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_integer(self) -> bool:
        return self.kind in ("int", "uint")

    @property
    def is_signed(self) -> bool:
        return self.kind in ("int", "float")

    @property
    def is_bool(self) -> bool:
        return self.kind == "bool"

    @property
    def is_subbyte(self) -> bool:
        return self.nbits < 8 and not self.is_bool

    @property
    def is_storage_only(self) -> bool:
        """Sub-byte types and the 8-bit floats: packed-tensor elements, computed in `compute_type`."""
        return self.is_subbyte or (self.is_float and self.nbits == 8)

    @property
    def nbytes(self) -> int:
        """Storage size in whole bytes; sub-byte types have no whole-byte size."""
        if self.is_subbyte:
            raise TypeError(f"{self.name} is {self.nbits} bits wide and has no whole-byte size")
        return max(1, self.nbits // 8)

    @property
    def min_value(self) -> float:
        """The smallest finite value representable by the type."""
        if self.kind == "bool":
            return 0
        if self.kind == "uint":
            return 0
        if self.kind == "int":
            return -(1 << (self.nbits - 1))
        return -self.max_value

    @property
    def max_value(self) -> float:
        """The largest finite value representable by the type."""
        if self.kind == "bool":
            return 1
        if self.kind == "uint":
            return (1 << self.nbits) - 1
        if self.kind == "int":
            return (1 << (self.nbits - 1)) - 1
        return _FLOAT_MAX.get(self.name) or _ieee_max(self.exponent_bits, self.mantissa_bits)

    def holds(self, value: int | float | bool) -> bool:
        """Whether the Python number `value` converts to this type without overflowing.

        Integers must be in range (a float is truncated towards zero first, as C converts,
        and must be finite); floats must not exceed the largest finite value (inf and nan
        convert to themselves).  Rounding to the nearest representable value is fine."""
        if self.is_bool:
            return True
        if isinstance(value, float) and not self.is_float:
            return math.isfinite(value) and self.min_value <= math.trunc(value) <= self.max_value
        if self.is_float:
            return not math.isfinite(value) or abs(value) <= self.max_value
        return self.min_value <= value <= self.max_value

    # ---- annotation sugar: float32["M", "N"] is a tensor type --------------------------
    def __getitem__(self, shape: Any) -> Any:
        if not isinstance(shape, tuple):
            shape = (shape,)
        return _tensor_annotation[0](self, shape)

    def __repr__(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name


def _ieee_max(e: int, m: int) -> float:
    bias = (1 << (e - 1)) - 1
    return (2 - 2.0**-m) * 2.0 ** ((1 << e) - 2 - bias)


# Formats without infinities use the top exponent for finite values (OCP MX / FP8 specs).
_FLOAT_MAX = {"e4m3": 448.0, "e2m1": 6.0, "e2m3": 7.5, "e3m2": 28.0}


def _int(bits: int) -> DataType:
    return DataType(f"int{bits}", f"i{bits}", bits, "int")


def _uint(bits: int) -> DataType:
    return DataType(f"uint{bits}", f"u{bits}", bits, "uint")


boolean = DataType("bool", "b1", 8, "bool")
int8, int16, int32, int64 = (_int(b) for b in (8, 16, 32, 64))
uint8, uint16, uint32, uint64 = (_uint(b) for b in (8, 16, 32, 64))
float16 = DataType("float16", "f16", 16, "float", 5, 10)
bfloat16 = DataType("bfloat16", "bf16", 16, "float", 8, 7)
float32 = DataType("float32", "f32", 32, "float", 8, 23)
float64 = DataType("float64", "f64", 64, "float", 11, 52)

int1, int2, int3, int4, int5, int6, int7 = (_int(b) for b in range(1, 8))
uint1, uint2, uint3, uint4, uint5, uint6, uint7 = (_uint(b) for b in range(1, 8))
float4_e2m1 = DataType("e2m1", "e2m1", 4, "float", 2, 1)
float6_e2m3 = DataType("e2m3", "e2m3", 6, "float", 2, 3)
float6_e3m2 = DataType("e3m2", "e3m2", 6, "float", 3, 2)
float8_e4m3 = DataType("e4m3", "e4m3", 8, "float", 4, 3)
float8_e5m2 = DataType("e5m2", "e5m2", 8, "float", 5, 2)

# Short aliases used in kernel annotations.
i8, i16, i32, i64 = int8, int16, int32, int64
u8, u16, u32, u64 = uint8, uint16, uint32, uint64
f16, bf16, f32, f64 = float16, bfloat16, float32, float64
e2m1, e2m3, e3m2, e4m3, e5m2 = float4_e2m1, float6_e2m3, float6_e3m2, float8_e4m3, float8_e5m2

ALL_DTYPES: tuple[DataType, ...] = (
    boolean, int8, int16, int32, int64, uint8, uint16, uint32, uint64,
    float16, bfloat16, float32, float64,
    int1, int2, int3, int4, int5, int6, int7,
    uint1, uint2, uint3, uint4, uint5, uint6, uint7,
    float4_e2m1, float6_e2m3, float6_e3m2, float8_e4m3, float8_e5m2,
)  # fmt: skip

_BY_NAME = {d.name: d for d in ALL_DTYPES} | {d.short: d for d in ALL_DTYPES}
_BY_NAME |= {"float8_e4m3": float8_e4m3, "float8_e5m2": float8_e5m2, "float4_e2m1": float4_e2m1}


def dtype(name: str | DataType) -> DataType:
    """Look up a data type by name ("float16", "f16", "int4", "e4m3", ...)."""
    if isinstance(name, DataType):
        return name
    try:
        return _BY_NAME[str(name)]
    except KeyError:
        raise ValueError(f"unknown data type {name!r}; known: {sorted(d.name for d in ALL_DTYPES)}") from None


def compute_type(t: DataType) -> DataType:
    """The type values of `t` are computed in: int32 for sub-byte integers, float32 for the
    small floats (e2m1 .. e5m2), `t` itself otherwise."""
    if not t.is_storage_only:
        return t
    return float32 if t.is_float else int32


# ---- promotion policies: one definition each ---------------------------------------------------
def _promote_floats(a: DataType, b: DataType) -> DataType:
    """Floats win over non-floats; between floats the wider wins, and float16 with bfloat16 gives
    float32 (neither holds the other).  The part every promotion policy below shares."""
    if not b.is_float:
        return a
    if not a.is_float:
        return b
    if {a, b} == {float16, bfloat16}:
        return float32
    return a if a.nbits >= b.nbits else b


def promote(a: DataType, b: DataType) -> DataType:
    """C's arithmetic promotion: the type of a binary arithmetic result in kernel IR.

    Floats win over integers; between floats the wider wins (float16 with bfloat16 gives
    float32, since neither holds the other); between integers the wider wins and, at equal
    width, unsigned wins.  bool behaves as int32 in arithmetic; storage types (sub-byte
    integers, small floats) as their `compute_type`.
    """
    a, b = compute_type(a), compute_type(b)
    if a == b:
        return int32 if a.is_bool else a
    if a.is_bool:
        a = int32
    if b.is_bool:
        b = int32
    if a.is_float or b.is_float:
        return _promote_floats(a, b)
    bits = max(a.nbits, b.nbits, 32)
    if (a.kind == "uint" and a.nbits >= bits) or (b.kind == "uint" and b.nbits >= bits):
        return _uint(bits)
    return _int(bits)


def promote_graph(a: DataType, b: DataType) -> DataType:
    """The graph's promotion: the dtype both operands of a FlowGraph arithmetic operator or
    comparison are converted to, and its result's.  C's (`promote`), except that two bools stay
    bool.  Shape inference and lowering both use it: one rule for both sides."""
    return promote(a, b) if not (a.is_bool and b.is_bool) else boolean


def promote_torch(a: DataType, b: DataType, op: str = "promote") -> DataType:
    """torch's promotion between two tensor dtypes (`torch.promote_types`), as `tessera.ops`
    applies it: bool < integers < floats, whatever the widths (int64 with float16 gives
    float16); the wider float wins (float16 with bfloat16 gives float32); integers of one
    signedness give the wider; a signed and an unsigned integer give the signed one if it is
    wider, else the signed type twice the unsigned's width (uint8 with int8 gives int16; numpy's
    rule for the uint16..uint64 pairs torch leaves undefined).  uint64 with a signed integer,
    which no integer type holds, raises UnsupportedError (`op` names the operation)."""
    if a == b:
        return a
    if a.is_float or b.is_float:
        return _promote_floats(a, b)
    if a.is_bool:
        return b
    if b.is_bool:
        return a
    if a.kind == b.kind:
        return a if a.nbits >= b.nbits else b
    signed, unsigned = (a, b) if a.kind == "int" else (b, a)
    if signed.nbits > unsigned.nbits:
        return signed
    if unsigned.nbits >= 64:
        raise UnsupportedError(f"{op}: no integer type holds both {a} and {b}; cast one of them first")
    return _int(unsigned.nbits * 2)


def result_type_torch(tensors: Sequence[DataType], scalars: Iterable[str] = (), op: str = "promote") -> DataType:
    """torch's result type of an elementwise operation: the tensors' dtypes promote
    (`promote_torch`); Python numbers, given by kind ("bool", "int", "float"), only lift the
    category: a float makes a non-float result float32, an int makes a bool result int64.  So
    ``x_f16 * 2.0`` stays float16 and ``x_int32 * 2.5`` becomes float32."""
    t = tensors[0]
    for x in tensors[1:]:
        t = promote_torch(t, x, op)
    kinds = set(scalars)
    if "float" in kinds and not t.is_float:
        return float32
    if "int" in kinds and t.is_bool:
        return int64
    return t


# ---- counterparts in numpy, torch and ONNX: one table each ---------------------------------------
# numpy and torch name these types as tessera does (numpy's bfloat16 is the ml_dtypes package's);
# the storage types have none (torch's float8 and int1..int7 dtypes hold one value per byte, not
# tessera's packed fields).
NUMPY_DTYPES: tuple[DataType, ...] = (
    boolean, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, bfloat16, float32, float64,
)  # fmt: skip
TORCH_DTYPES: tuple[DataType, ...] = NUMPY_DTYPES  # the same set today, by coincidence of the two libraries
_FROM_NUMPY = {d.name: d for d in NUMPY_DTYPES}
_FROM_TORCH = {d.name: d for d in TORCH_DTYPES}
_TORCH_NAME = {d: d.name for d in TORCH_DTYPES}


@functools.cache  # called per array on the CPU path: a scan with dataclass equality cost ~20 us
def numpy_dtype(dt: DataType) -> np.dtype:
    """The numpy dtype that holds `dt`; bfloat16 needs the optional ml_dtypes package.  A type
    numpy lacks raises DataTypeError (an UnsupportedError and a TypeError)."""
    if _FROM_NUMPY.get(dt.name) != dt:
        raise DataTypeError(f"no numpy dtype holds {dt.name}")
    if dt == bfloat16:
        try:
            import ml_dtypes
        except ImportError:
            raise DataTypeError("bfloat16 numpy arrays need the ml_dtypes package (or use torch tensors)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dt.name)


def from_numpy_dtype(dt: np.dtype | type) -> DataType:
    """The DataType of a numpy dtype (or scalar type) in the machine's byte order; others raise
    DataTypeError (an UnsupportedError and a TypeError)."""
    dt = np.dtype(dt)
    out = _FROM_NUMPY.get(dt.name) if dt.isnative else None
    if out is None:
        raise DataTypeError(f"numpy dtype {dt} has no tessera equivalent")
    return out


def torch_name(dt: DataType) -> str:
    """The name of `dt`'s torch dtype (`getattr(torch, torch_name(dt))` is it): "float16" for
    float16.  A type torch lacks raises DataTypeError."""
    try:
        return _TORCH_NAME[dt]
    except KeyError:
        raise DataTypeError(f"no torch dtype holds {dt.name}") from None


def from_torch(torch_dtype: Any) -> DataType | None:
    """The DataType of a torch dtype (or its str, "torch.float16"), None for one tessera lacks
    (complex, quantized, float8...).  Reads the name: this layer imports no torch."""
    return _FROM_TORCH.get(str(torch_dtype).removeprefix("torch."))


# ONNX's TensorProto element types (onnx.proto's DataType enum) that tessera has; the others
# (string, complex, float8...) are refused on import.
ONNX_ELEMENT_TYPES: dict[int, DataType] = {
    1: float32, 2: uint8, 3: int8, 4: uint16, 5: int16, 6: int32, 7: int64, 9: boolean,
    10: float16, 11: float64, 12: uint32, 13: uint64, 16: bfloat16,
}  # fmt: skip
_ONNX_OF = {d: code for code, d in ONNX_ELEMENT_TYPES.items()}


def onnx_element_type(dt: DataType) -> int:
    """The ONNX element type of `dt`; a type ONNX's table here lacks raises DataTypeError."""
    try:
        return _ONNX_OF[dt]
    except KeyError:
        raise DataTypeError(f"no ONNX element type holds {dt.name}") from None
