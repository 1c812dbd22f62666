"""TMA tensor maps on the host: `TensorMap.tiled(array, box)` encodes a CUtensorMap with
cuda-python's `cuTensorMapEncodeTiled`; kernels take it as a `ts.tensor_map(dtype, box)`
parameter, passed by value (`const __grid_constant__ CUtensorMap`).

The map holds the array's address, so it is only valid while the array lives; the caller
keeps the array alive (kernels usually take the array as an argument as well).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir.types import TensorMapType, tensor_map, tensor_map_im2col
from tessera.runtime.driver import _driver, check, ensure_current
from tessera.runtime.tensor import view_of

MAP_BYTES = 128  # sizeof(CUtensorMap)

_DATA_TYPES = {
    "uint8": "UINT8", "int8": "UINT8", "uint16": "UINT16", "int16": "UINT16", "uint32": "UINT32",
    "int32": "INT32", "uint64": "UINT64", "int64": "INT64", "float16": "FLOAT16", "bfloat16": "BFLOAT16",
    "float32": "FLOAT32", "float64": "FLOAT64",
}  # fmt: skip


class TensorMapSlot(ctypes.Structure):
    """The 128 bytes of one tensor map in a launch's argument array (64-byte aligned)."""

    _fields_ = [("words", ctypes.c_uint64 * (MAP_BYTES // 8))]

    def __init__(self, raw: bytes = bytes(MAP_BYTES)) -> None:
        super().__init__()
        self.load(raw)

    def load(self, raw: bytes) -> None:
        ctypes.memmove(ctypes.addressof(self), raw, MAP_BYTES)


class TensorMap:
    """An encoded tensor map: its kernel-side type (dtype, box, swizzle) and its 128 bytes."""

    __slots__ = ("type", "raw", "shape")

    def __init__(self, type: TensorMapType, raw: bytes, shape: tuple[int, ...] = ()):
        if not isinstance(type, TensorMapType):
            raise ArgumentError(f"TensorMap needs a TensorMapType, got {type!r}")
        if len(raw) != MAP_BYTES:
            raise ArgumentError(f"a tensor map is {MAP_BYTES} bytes, got {len(raw)}")
        self.type, self.raw, self.shape = type, bytes(raw), tuple(shape)

    @staticmethod
    def tiled(array: Any, box: tuple[int, ...] | list[int], swizzle: int = 128) -> TensorMap:
        """Encode a map over a contiguous CUDA array (torch tensor, device array, ...) read in
        boxes of `box` elements, outermost dimension first; out-of-bounds elements read as zero."""
        view = view_of(array, "TensorMap.tiled: the array")
        if view.device != "cuda":
            raise ArgumentError("TensorMap.tiled needs an array in GPU memory")
        if not view.contiguous:
            raise ArgumentError("TensorMap.tiled needs a contiguous array")
        return TensorMap.from_pointer(view.ptr, view.dtype, view.shape, box, swizzle)

    @staticmethod
    def from_pointer(ptr: int, dtype: dtypes.DataType, shape: tuple[int, ...], box: tuple[int, ...],
                     swizzle: int = 128, strides: tuple[int, ...] | None = None) -> TensorMap:  # fmt: skip
        """Encode a map over the row-major tensor of `dtype` and `shape` at device address `ptr`
        (what `tiled` does after reading an array's view): contiguous, or with `strides` (in
        elements, outermost first, the innermost 1) a strided view, e.g. the heads of one
        projection inside a fused QKV output.  Every stride but the innermost must be a
        multiple of 16 bytes."""
        try:
            t = tensor_map(dtype, tuple(box), swizzle)
        except TypeError as exc:
            raise ArgumentError(str(exc)) from None
        shape = tuple(int(d) for d in shape)
        if len(shape) != t.rank:
            raise ArgumentError(f"a rank-{t.rank} box {list(t.box)} needs a rank-{t.rank} tensor, got shape {list(shape)}")
        if strides is None:
            strides = tuple(prod(shape[k + 1 :]) for k in range(len(shape)))
        strides = tuple(int(v) for v in strides)
        if len(strides) != len(shape) or strides[-1] != 1 or any(v <= 0 for v in strides):
            raise ArgumentError(f"strides {list(strides)} for shape {list(shape)}: one positive stride per "
                                "dimension, the innermost 1")  # fmt: skip
        if ptr % 16 or any((v * dtype.nbytes) % 16 for v in strides[:-1]):
            raise ArgumentError(f"TMA needs a 16-byte aligned base and every stride a multiple of 16 bytes; "
                                f"got address {ptr:#x} and strides of {[v * dtype.nbytes for v in strides]} bytes")  # fmt: skip
        return TensorMap(t, _encode(ptr, dtype, shape, t, strides), shape)

    @staticmethod
    def im2col_from_pointer(ptr: int, dtype: dtypes.DataType, shape: tuple[int, ...], window: Im2colWindow,
                            pixels: int, channels: int, swizzle: int = 128) -> TensorMap:  # fmt: skip
        """Encode an im2col map over the contiguous N[D][H]WC tensor of `dtype` and `shape` at `ptr`:
        each load reads `pixels` positions of the sliding `window`, `channels` channels each
        (`cuTensorMapEncodeIm2col`; kernels read it with `tma_load_im2col`)."""
        shape = tuple(int(d) for d in shape)
        try:
            t = tensor_map_im2col(dtype, pixels, channels, len(shape), swizzle)
        except TypeError as exc:
            raise ArgumentError(str(exc)) from None
        problems = window.problems(len(shape) - 2)
        if problems:
            raise ArgumentError(f"im2col window {window} over a rank-{len(shape)} tensor: {'; '.join(problems)}")
        strides = tuple(prod(shape[k + 1 :]) for k in range(len(shape)))
        if ptr % 16 or (shape[-1] * dtype.nbytes) % 16:
            raise ArgumentError(f"TMA needs a 16-byte aligned base and rows of a multiple of 16 bytes; got address "
                                f"{ptr:#x} and {shape[-1]} channels of {dtype}")  # fmt: skip
        return TensorMap(t, _encode(ptr, dtype, shape, t, strides, window), shape)

    def __repr__(self) -> str:
        return f"TensorMap({self.type}, shape={list(self.shape)})"


@dataclass(frozen=True)
class Im2colWindow:
    """Where an im2col map's sliding window goes over the spatial dimensions (outermost first):
    the window's first position at `lower` (e.g. -padding) and its last at the dimension's
    size - 1 + `upper` (both for window offset 0, inclusive), stepping by `strides`."""

    lower: tuple[int, ...]
    upper: tuple[int, ...]
    strides: tuple[int, ...]

    def problems(self, spatial: int) -> list[str]:
        """Why TMA cannot encode this window over `spatial` spatial dimensions (empty when it can)."""
        if not (len(self.lower) == len(self.upper) == len(self.strides) == spatial):
            return [f"needs {spatial} lower corners, upper corners and strides"]
        bits = {1: 15, 2: 7, 3: 4}[spatial]  # the signed corner range TMA encodes per spatial rank
        out = []
        if not all(-(2**bits) <= v < 2**bits for v in (*self.lower, *self.upper)):
            out.append(f"corners out of the range TMA encodes ({-(2**bits)}..{2**bits - 1})")
        if not all(1 <= s <= 8 for s in self.strides):
            out.append(f"strides must be 1..8 (TMA element strides), got {list(self.strides)}")
        return out

    @staticmethod
    def convolution(size: Sequence[int], stride: Sequence[int], pad_lo: Sequence[int], out: Sequence[int]) -> Im2colWindow:
        """The window of a convolution's output positions (where the filter's first tap reads;
        each other tap is a load offset of u * dilation): from -pad_lo to (out - 1) * stride - pad_lo
        in steps of `stride`."""
        upper = tuple((o - 1) * s - p - (n - 1) for n, s, p, o in zip(size, stride, pad_lo, out))
        return Im2colWindow(tuple(-p for p in pad_lo), upper, tuple(stride))


def _encode(ptr: int, dtype: dtypes.DataType, shape: tuple[int, ...], t: TensorMapType,
            element_strides: tuple[int, ...], window: Im2colWindow | None = None) -> bytes:  # fmt: skip
    driver = _driver()
    ensure_current()
    if dtype.name not in _DATA_TYPES:
        raise ArgumentError(f"TMA cannot describe {dtype} tensors")
    rank = len(shape)
    dims = [driver.cuuint64_t(d) for d in reversed(shape)]  # innermost first
    # byte strides of every dimension but the innermost, innermost first
    strides = [driver.cuuint64_t(v * dtype.nbytes) for v in reversed(element_strides[:-1])]
    data_type = getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_DATA_TYPES[dtype.name]}")
    swizzle = getattr(driver.CUtensorMapSwizzle, "CU_TENSOR_MAP_SWIZZLE_" + ("NONE" if not t.swizzle else f"{t.swizzle}B"))
    tail = (driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)  # fmt: skip
    if window is None:
        tmap = check(
            driver.cuTensorMapEncodeTiled(data_type, rank, ptr, dims, strides, [driver.cuuint32_t(b) for b in reversed(t.box)],
                                          [driver.cuuint32_t(1)] * rank, *tail),
            f"cuTensorMapEncodeTiled(shape={list(shape)}, box={list(t.box)})",
        )  # fmt: skip
    else:
        steps = [driver.cuuint32_t(s) for s in (1, *reversed(window.strides), 1)]
        tmap = check(
            driver.cuTensorMapEncodeIm2col(data_type, rank, ptr, dims, strides, list(reversed(window.lower)),
                                           list(reversed(window.upper)), t.box[1], t.box[0], steps, *tail),
            f"cuTensorMapEncodeIm2col(shape={list(shape)}, {window}, pixels={t.box[0]}, channels={t.box[1]})",
        )  # fmt: skip
    return ctypes.string_at(int(tmap.getPtr()), MAP_BYTES)


def check_tensor_map(func_name: str, pname: str, expected: TensorMapType, value: Any) -> TensorMap:
    """The argument for a tensor-map parameter, checked against the kernel's declared type."""
    if not isinstance(value, TensorMap):
        raise ArgumentError(f"{func_name}: argument '{pname}' must be a TensorMap (TensorMap.tiled(array, box)), "
                            f"got {type(value).__name__}")  # fmt: skip
    if value.type != expected:
        raise ArgumentError(f"{func_name}: argument '{pname}' is a {value.type}, but the kernel expects {expected}")
    return value
