"""A uniform view of array arguments: numpy arrays, torch tensors, DLPack and CUDA-array-interface objects."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.runtime import dlpack

_NUMPY_TO_DTYPE = {
    "bool": dtypes.boolean, "int8": dtypes.int8, "int16": dtypes.int16, "int32": dtypes.int32, "int64": dtypes.int64,
    "uint8": dtypes.uint8, "uint16": dtypes.uint16, "uint32": dtypes.uint32, "uint64": dtypes.uint64,
    "float16": dtypes.float16, "float32": dtypes.float32, "float64": dtypes.float64, "bfloat16": dtypes.bfloat16,
}  # fmt: skip


@dataclass
class ArrayView:
    """What the runtime needs to pass an array to a kernel."""

    ptr: int
    shape: tuple[int, ...]
    dtype: DataType
    device: str  # "cpu" or "cuda"
    contiguous: bool
    owner: Any  # keeps the memory alive during the call
    writable: bool = True  # False for read-only numpy arrays and CUDA-array-interface views


@functools.cache  # per call on the CPU path: a scan with dataclass equality cost ~20 us per array
def numpy_dtype(dt: DataType) -> np.dtype:
    """The numpy dtype that stores `dt` (bfloat16 needs the ml_dtypes package)."""
    if dt == dtypes.bfloat16:
        try:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            raise TypeError("bfloat16 numpy arrays need the ml_dtypes package; or pass torch tensors") from None
    for name, d in _NUMPY_TO_DTYPE.items():
        if d == dt:
            return np.dtype(name)
    raise TypeError(f"{dt} has no numpy equivalent")


def _torch_dtype(t: Any) -> DataType | None:
    name = str(t).removeprefix("torch.")
    return _NUMPY_TO_DTYPE.get(name)


def as_view(obj: Any) -> ArrayView | None:
    """An ArrayView of `obj`, or None when it is not an array."""
    if isinstance(obj, np.ndarray):
        dt = _dtype_of(obj.dtype)
        return ArrayView(obj.ctypes.data, tuple(obj.shape), dt, "cpu", bool(obj.flags.c_contiguous), obj,
                         bool(obj.flags.writeable))  # fmt: skip
    mod = type(obj).__module__
    if mod.startswith("torch") and hasattr(obj, "data_ptr"):
        dt = _torch_dtype(obj.dtype)
        if dt is None:
            raise ArgumentError(f"torch dtype {obj.dtype} is not supported")
        device = "cuda" if obj.is_cuda else "cpu" if obj.device.type == "cpu" else obj.device.type
        return ArrayView(obj.data_ptr(), tuple(obj.shape), dt, device, obj.is_contiguous(), obj)
    if hasattr(obj, "__tessera_view__"):
        return obj.__tessera_view__()
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        dt = _dtype_of(np.dtype(cai["typestr"]))
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        contiguous = strides is None or tuple(strides) == _c_strides(shape, np.dtype(cai["typestr"]).itemsize)
        ptr, readonly = cai["data"]
        return ArrayView(int(ptr), shape, dt, "cuda", contiguous, obj, not readonly)
    if hasattr(obj, "__dlpack__"):
        return _dlpack_view(obj)
    return None


def _dlpack_view(obj: Any) -> ArrayView:
    """A DLPack producer's array: CPU memory through numpy, GPU memory through tessera.runtime.dlpack."""

    device = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else dlpack.CPU
    if device == dlpack.CPU:
        return as_view(np.from_dlpack(obj))
    if device not in (dlpack.CUDA, dlpack.CUDA_HOST, dlpack.CUDA_MANAGED):
        raise ArgumentError(f"{type(obj).__name__} lives on DLPack device type {int(device)}; tessera kernels take "
                            "CPU and CUDA memory (copy it to one of them first)")  # fmt: skip
    ptr, shape, dt, kind, _, contiguous, owner = dlpack.consume(obj)
    return ArrayView(ptr, shape, dt, "cpu" if kind == dlpack.CUDA_HOST else "cuda", contiguous, owner)


def view_of(obj: Any, what: str) -> ArrayView:
    """as_view for an argument that must be an array: any refusal names `what` (e.g.
    "kernel f: argument 'x'")."""
    try:
        view = as_view(obj)
    except (ArgumentError, TypeError) as exc:
        raise ArgumentError(f"{what}: {exc}") from None
    if view is None:
        raise ArgumentError(f"{what} must be an array (numpy, torch, device array), got {type(obj).__name__}")
    return view


@functools.cache
def _dtype_of(dt: np.dtype) -> DataType:
    """The DataType of a numpy dtype in native byte order (the only order kernels read).
    Cached: numpy computes `dtype.name` in Python, which would dominate a small call."""
    if not dt.isnative:
        raise ArgumentError(f"dtype {dt.str} is not in the machine's byte order, which kernels would misread; "
                            "convert it first: x.astype(x.dtype.newbyteorder('='))")  # fmt: skip
    out = _NUMPY_TO_DTYPE.get(dt.name)
    if out is None:
        raise ArgumentError(f"array dtype {dt} is not supported")
    return out


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out, acc = [], itemsize
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))
