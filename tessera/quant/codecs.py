"""Reference codecs of the low-bit weight types, in numpy: the semantics every kernel is tested against.

* Integers int1..int8 / uint1..uint8: a code is the value's low `bits` bits (two's complement
  for the signed types).
* Small floats e2m1, e2m3, e3m2 (OCP MX: no inf/NaN), e4m3 (e4m3fn: S.1111.111 is NaN, no inf)
  and e5m2 (IEEE: inf and NaN): sign, exponent, mantissa from the top bit down; encoding rounds
  to the nearest representable value (ties to an even code) and saturates at the largest finite
  magnitude.
* Dense packing: element i of a b-bit tensor occupies bits [i*b, i*b + b) of the byte stream,
  least significant bit first, so a tensor of n elements takes ceil(n*b/8) bytes and fields
  cross byte boundaries whenever 8 % b != 0.  This is the layout packed kernel parameters have
  (tessera.backend.codegen_c_like.LOWBIT_HELPERS reads it).
"""

from __future__ import annotations

import functools

import numpy as np

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType

WEIGHT_TYPES: tuple[DataType, ...] = (
    dtypes.int1, dtypes.int2, dtypes.int3, dtypes.int4, dtypes.int5, dtypes.int6, dtypes.int7, dtypes.int8,
    dtypes.uint1, dtypes.uint2, dtypes.uint3, dtypes.uint4, dtypes.uint5, dtypes.uint6, dtypes.uint7, dtypes.uint8,
    dtypes.float4_e2m1, dtypes.float6_e2m3, dtypes.float6_e3m2, dtypes.float8_e4m3, dtypes.float8_e5m2,
)  # fmt: skip


def weight_type(name: str | DataType) -> DataType:
    """The low-bit weight type called `name` ("int4", "uint3", "e2m1", ...), checked."""
    try:
        t = dtypes.dtype(name)
    except ValueError:
        t = None
    if t not in WEIGHT_TYPES:
        raise ArgumentError(f"{name!r} is not a low-bit weight type; use one of {[t.name for t in WEIGHT_TYPES]}")
    return t


@functools.cache
def float_table(t: DataType) -> np.ndarray:
    """decode(code) for every code of the small float `t`, as float64 (NaN where the code is NaN)."""
    e, m = t.exponent_bits, t.mantissa_bits
    bias = (1 << (e - 1)) - 1
    out = np.empty(1 << t.nbits, np.float64)
    for c in range(1 << t.nbits):
        sign, E, M = (c >> (e + m)) & 1, (c >> m) & ((1 << e) - 1), c & ((1 << m) - 1)
        if t.name == "e5m2" and E == (1 << e) - 1:
            v = np.inf if M == 0 else np.nan
        elif t.name == "e4m3" and E == (1 << e) - 1 and M == (1 << m) - 1:
            v = np.nan
        elif E == 0:
            v = np.ldexp(float(M), 1 - bias - m)
        else:
            v = np.ldexp(float((1 << m) | M), E - bias - m)
        out[c] = -v if sign else v
    return out


def decode(codes: np.ndarray, t: DataType) -> np.ndarray:
    """Values of `codes` (unsigned integers < 2**bits): int64 for the integer types, float64 for floats."""
    codes = np.asarray(codes).astype(np.int64)
    if t.is_float:
        return float_table(t)[codes]
    if t.kind == "int":
        return np.where(codes >= 1 << (t.nbits - 1), codes - (1 << t.nbits), codes)
    return codes


def encode(values: np.ndarray, t: DataType) -> np.ndarray:
    """Codes (uint8) of `values`.  Integer types take integer values in range (checked); floats
    round to nearest, ties to an even code, saturating at the largest finite magnitude."""
    values = np.asarray(values)
    if t.is_integer:
        if values.dtype.kind == "f":
            if not np.all(np.isfinite(values)) or np.any(values != np.round(values)):
                raise ArgumentError(f"encoding {t} takes integer values; round them first")
        v = values.astype(np.int64)
        if v.size and (v.min() < t.min_value or v.max() > t.max_value):
            raise ArgumentError(f"values in [{v.min()}, {v.max()}] do not fit {t} ([{t.min_value}, {t.max_value}])")
        return (v & ((1 << t.nbits) - 1)).astype(np.uint8)
    x = values.astype(np.float64)
    table = float_table(t)
    half = 1 << (t.nbits - 1)
    mags = table[:half]  # non-negative codes, increasing
    finite = np.isfinite(mags)
    top = int(np.flatnonzero(finite)[-1])  # largest finite positive code
    mags = mags[: top + 1]
    a = np.minimum(np.abs(x), mags[-1])
    hi = np.clip(np.searchsorted(mags, a), 0, top)
    lo = np.clip(hi - 1, 0, top)
    d_lo, d_hi = a - mags[lo], mags[hi] - a
    pick = np.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)
    codes = pick.astype(np.int64) | np.where(np.signbit(x), half, 0)
    nan = np.isnan(x)
    if nan.any():
        nan_codes = np.flatnonzero(np.isnan(table))
        if not nan_codes.size:
            raise ArgumentError(f"{t} has no NaN; the values to encode contain NaN")
        codes = np.where(nan, nan_codes[-1], codes)
    return codes.astype(np.uint8)


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes of `count` densely packed `bits`-bit fields."""
    return (count * bits + 7) // 8


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack the flattened `codes` (each < 2**bits) densely, LSB first: a uint8 array of packed_nbytes bytes."""
    c = np.asarray(codes).reshape(-1)
    n = c.size
    if n and int(c.max()) >> bits:
        raise ArgumentError(f"a code does not fit in {bits} bits")
    # eight fields fill exactly `bits` bytes: build them as one little-endian uint64 each
    groups = np.zeros(-(-n // 8) * 8, np.uint64)
    groups[:n] = c
    groups = groups.reshape(-1, 8)
    word = np.zeros(groups.shape[0], np.uint64)
    for j in range(8):
        word |= groups[:, j] << np.uint64(bits * j)
    return word.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :bits].reshape(-1)[: packed_nbytes(n, bits)].copy()


def unpack_bits(data: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first `count` `bits`-bit fields of the densely packed bytes `data`, as uint8 codes."""
    data = np.asarray(data, dtype=np.uint8).reshape(-1)
    need = packed_nbytes(count, bits)
    if data.size < need:
        raise ArgumentError(f"{data.size} bytes hold fewer than {count} fields of {bits} bits")
    groups = -(-count // 8)
    raw = np.zeros((groups, 8), np.uint8)
    flat = np.zeros(groups * bits, np.uint8)
    flat[:need] = data[:need]
    raw[:, :bits] = flat.reshape(groups, bits)
    word = raw.reshape(-1).view("<u8")
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((groups, 8), np.uint8)
    for j in range(8):
        out[:, j] = (word >> np.uint64(bits * j)) & mask
    return out.reshape(-1)[:count]
