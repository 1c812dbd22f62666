"""Round-to-nearest quantisation of weight matrices, and `QuantizedWeight`, the format every
low-bit path of tessera takes (kernels, the graph op, checkpoint loaders).

W [N, K] is cut into groups of `group_size` consecutive k per row (the last one may be shorter;
`group_size=None` means one group per row, per channel).  Per group:
* integer types: W ~ (q - z) * s with q in the type's range.  With a zero point (asymmetric)
  s = (max - min) / (qmax - qmin) and z = qmin - round(min / s), clipped to the range; without
  one z is 0 for int types and the midpoint 2**(bits-1) for uint types, and
  s = absmax / d with d the positive levels on the narrower side of z (the wider side for 1 bit);
* small floats: W ~ decode(q) * s with s = absmax / the type's largest finite value (no zeros).
Scales are float16 (the kernels read them so, and checkpoints store them so); `dequantize`
is the reference every kernel is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.errors import ArgumentError
from tessera.ir.dtypes import DataType
from tessera.quant import codecs
from tessera.quant.packed import PackedTensor


@dataclass
class QuantizedWeight:
    """codes [N, K] of `dtype`, scales [N, G] float16, zeros [N, G] int32 (or None)."""

    codes: PackedTensor
    scales: np.ndarray
    zeros: np.ndarray | None
    group_size: int  # == K for per-channel

    @property
    def dtype(self) -> DataType:
        return self.codes.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        g = -(-k // self.group_size)
        if self.scales.shape != (n, g) or self.scales.dtype != np.float16:
            raise ArgumentError(f"scales must be float16 [{n}, {g}] for {k} columns in groups of {self.group_size}, "
                                f"got {self.scales.dtype} {list(self.scales.shape)}")  # fmt: skip
        if self.zeros is not None:
            if self.dtype.is_float:
                raise ArgumentError(f"{self.dtype} weights take no zero points")
            if self.zeros.shape != (n, g):
                raise ArgumentError(f"zeros must be [{n}, {g}], got {list(self.zeros.shape)}")
            lo, hi = self.dtype.min_value, self.dtype.max_value
            if self.zeros.size and (self.zeros.min() < lo or self.zeros.max() > hi):
                raise ArgumentError(f"zero points must lie in {self.dtype}'s range [{lo}, {hi}]")

    def group_of_columns(self) -> np.ndarray:
        return np.arange(self.shape[1]) // self.group_size

    def dequantize(self) -> np.ndarray:
        """The float32 weights [N, K] the codes stand for (float64 arithmetic, rounded once)."""
        q = self.codes.numpy().astype(np.float64)
        cols = self.group_of_columns()
        s = self.scales.astype(np.float64)[:, cols]
        if self.zeros is not None:
            q = q - self.zeros.astype(np.float64)[:, cols]
        return (q * s).astype(np.float32)


def _int_zero_free(t: DataType) -> int:
    return 0 if t.kind == "int" else 1 << (t.nbits - 1)


def check_arguments(shape: tuple[int, ...], t: DataType, group_size: int | None,
                    zero_point: bool | None) -> tuple[int, int, int, bool]:  # fmt: skip
    """(N, K, the group size, whether there are zero points) of a quantize_weight call, or an
    ArgumentError saying which argument is wrong."""
    if len(shape) != 2 or 0 in shape:
        raise ArgumentError(f"quantize_weight takes a non-empty [N, K] matrix, got shape {list(shape)}")
    n, k = shape
    gs = k if group_size in (None, -1) else int(group_size)
    if gs <= 0:
        raise ArgumentError(f"group_size must be positive (or None for per channel), got {group_size}")
    return n, k, gs, t.kind == "uint" if zero_point is None else bool(zero_point)


def quantize_weight(w: np.ndarray, dtype: DataType | str, group_size: int | None = 128,
                    zero_point: bool | None = None) -> QuantizedWeight:  # fmt: skip
    """Round-to-nearest quantisation of `w` [N, K] (see the module docstring).  zero_point
    defaults to True for uint types and False otherwise."""
    t = codecs.weight_type(dtype)
    w = np.asarray(w, dtype=np.float64)
    n, k, gs, zero_point = check_arguments(w.shape, t, group_size, zero_point)
    if not np.all(np.isfinite(w)):
        raise ArgumentError("the weights contain inf or NaN; they cannot be quantized")
    if zero_point and t.is_float:
        raise ArgumentError(f"{t} weights take no zero points (zero_point=True is for integer types)")
    g = -(-k // gs)
    # a short last group is padded with copies of its last value: its min and max stay the same
    pad = w if g * gs == k else np.pad(w, ((0, 0), (0, g * gs - k)), mode="edge")
    groups = pad.reshape(n, g, gs)
    lo, hi = groups.min(axis=2), groups.max(axis=2)
    absmax = np.maximum(np.abs(lo), np.abs(hi))
    zeros = None
    if t.is_float:
        s = absmax / t.max_value
    elif zero_point:
        qmin, qmax = t.min_value, t.max_value
        lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)  # zero stays representable
        s = (hi - lo) / (qmax - qmin)
        safe = np.where(s > 0, s, 1.0)
        zeros = np.clip(qmin - np.round(lo / safe), qmin, qmax).astype(np.int32)
    else:
        z = _int_zero_free(t)
        up, down = t.max_value - z, z - t.min_value
        d = min(up, down) or max(up, down)
        s = absmax / d
    s16 = s.astype(np.float16)
    s16 = np.where((s16 == 0) & (s > 0), np.float16(2.0**-24), s16)  # never round a needed scale to 0
    if not np.all(np.isfinite(s16)):
        raise ArgumentError("a group's scale overflows float16 (|w| too large for this type); rescale the weights")
    scale = s16.astype(np.float64)
    safe = np.where(scale > 0, scale, 1.0)
    x = groups / safe[:, :, None]
    if t.is_float:
        codes = codecs.encode(x, t)
    else:
        zz = zeros if zeros is not None else np.full((n, g), _int_zero_free(t))
        q = np.clip(np.round(x) + zz[:, :, None], t.min_value, t.max_value)
        codes = codecs.encode(q, t)
    codes = codes.reshape(n, g * gs)[:, :k]
    zeros_out = zeros if zeros is not None else (None if t.kind == "int" or t.is_float else np.full((n, g), _int_zero_free(t), np.int32))
    return QuantizedWeight(PackedTensor.from_codes(codes, t), s16, zeros_out, gs)
