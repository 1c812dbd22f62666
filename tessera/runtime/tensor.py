"""A uniform view of array arguments: numpy arrays, torch tensors, DLPack and CUDA-array-interface objects."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessera.errors import ArgumentError, DataTypeError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.runtime import dlpack


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


def as_view(obj: Any) -> ArrayView | None:
    """An ArrayView of `obj`, or None when it is not an array."""
    if isinstance(obj, np.ndarray):
        dt = _dtype_of(obj.dtype)
        return ArrayView(obj.ctypes.data, tuple(obj.shape), dt, "cpu", bool(obj.flags.c_contiguous), obj,
                         bool(obj.flags.writeable))  # fmt: skip
    mod = type(obj).__module__
    if mod.startswith("torch") and hasattr(obj, "data_ptr"):
        dt = dtypes.from_torch(obj.dtype)
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
    try:
        return dtypes.from_numpy_dtype(dt)
    except DataTypeError:
        raise ArgumentError(f"array dtype {dt} is not supported") from None


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out, acc = [], itemsize
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))
