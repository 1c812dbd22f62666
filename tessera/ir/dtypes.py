"""Scalar data types, including the sub-byte integer and small-float types.

Every scalar value in the IR carries one of the `DataType` objects defined here.
Types narrower than a byte (int1..int7, uint1..uint7, e2m1, e2m3, e3m2) and the 8-bit floats
(e4m3, e5m2) are *storage* types: they live in packed global tensors (dense, N*K*bits/8 bytes,
see tessera.quant) and are computed with in their compute type (`compute_type`): int32 for the
integers, as C promotes char, float32 for the small floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def promote(a: DataType, b: DataType) -> DataType:
    """The type of a binary arithmetic result, following C-like rules.

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
        if not b.is_float:
            return a
        if not a.is_float:
            return b
        if {a, b} == {float16, bfloat16}:
            return float32
        return a if a.nbits >= b.nbits else b
    bits = max(a.nbits, b.nbits, 32)
    if (a.kind == "uint" and a.nbits >= bits) or (b.kind == "uint" and b.nbits >= bits):
        return _uint(bits)
    return _int(bits)
