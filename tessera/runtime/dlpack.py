"""DLPack in both directions, without torch or cupy: export a pointer as a `dltensor` capsule,
import any object with `__dlpack__` (torch, cupy, jax, numpy) as an ArrayView.

The structs follow dlpack.h (v0.8, the layout every producer and consumer accepts):
DLManagedTensor = {DLTensor, manager_ctx, deleter}; DLTensor = {data, device, ndim, dtype,
shape, strides, byte_offset}.  The consumer of a capsule renames it "used_dltensor" and calls
the deleter when done; an unconsumed capsule's destructor calls it instead.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType

CPU, CUDA, CUDA_HOST = 1, 2, 3  # DLDeviceType values
_INT, _UINT, _FLOAT, _BFLOAT, _BOOL = 0, 1, 2, 4, 6  # DLDataTypeCode values


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

# The destructor gets the dying capsule as a raw pointer: wrapping it in a py_object would
# touch the reference count of an object being deallocated.
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

# Exported tensors alive in some consumer, by the address of their DLManagedTensor: the
# struct, its shape array and the owner of the memory stay referenced until the deleter runs.
_live: dict[int, tuple[Any, ...]] = {}
_live_lock = threading.Lock()


@_DELETER
def _delete(managed: Any) -> None:
    address = ctypes.cast(managed, ctypes.c_void_p).value
    with _live_lock:
        _live.pop(address, None)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule: Any) -> None:
    # Only a capsule nobody consumed still has its original name; the consumer owns the rest.
    if _api.PyCapsule_IsValid(capsule, b"dltensor"):
        address = _api.PyCapsule_GetPointer(capsule, b"dltensor")
        with _live_lock:
            _live.pop(address, None)


def _dl_dtype(dt: DataType) -> _DType:
    if dt == dtypes.boolean:
        return _DType(_BOOL, 8, 1)
    if dt == dtypes.bfloat16:
        return _DType(_BFLOAT, 16, 1)
    if dt.is_float:
        return _DType(_FLOAT, dt.nbytes * 8, 1)
    if dt.is_integer:
        return _DType(_INT if dt.is_signed else _UINT, dt.nbytes * 8, 1)
    raise ArgumentError(f"{dt} has no DLPack equivalent")


def _tessera_dtype(d: _DType) -> DataType:
    if d.lanes != 1:
        raise ArgumentError(f"DLPack vector dtypes (lanes={d.lanes}) are not supported")
    table = {
        (_BOOL, 8): dtypes.boolean, (_BFLOAT, 16): dtypes.bfloat16,
        (_FLOAT, 16): dtypes.float16, (_FLOAT, 32): dtypes.float32, (_FLOAT, 64): dtypes.float64,
        (_INT, 8): dtypes.int8, (_INT, 16): dtypes.int16, (_INT, 32): dtypes.int32, (_INT, 64): dtypes.int64,
        (_UINT, 8): dtypes.uint8, (_UINT, 16): dtypes.uint16, (_UINT, 32): dtypes.uint32, (_UINT, 64): dtypes.uint64,
    }  # fmt: skip
    dt = table.get((d.code, d.bits))
    if dt is None:
        raise ArgumentError(f"DLPack dtype (code {d.code}, {d.bits} bits) is not supported")
    return dt


def export(ptr: int, shape: tuple[int, ...], dt: DataType, device_type: int, device_id: int, owner: Any) -> Any:
    """A "dltensor" capsule describing the C-contiguous array at `ptr`; `owner` stays alive
    until the consumer (or the capsule's destructor) releases it."""
    managed = _Managed()
    shape_array = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed.dl_tensor.data = ptr or None
    managed.dl_tensor.device = _Device(device_type, device_id)
    managed.dl_tensor.ndim = len(shape)
    managed.dl_tensor.dtype = _dl_dtype(dt)
    managed.dl_tensor.shape = ctypes.cast(shape_array, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = None  # NULL: compact row-major
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _delete
    address = ctypes.addressof(managed)
    with _live_lock:
        _live[address] = (managed, shape_array, owner)
    return _api.PyCapsule_New(address, b"dltensor", _capsule_destructor)


class _Imported:
    """Owns an imported DLManagedTensor: calls its producer's deleter when dropped."""

    def __init__(self, capsule: Any, managed: Any):
        self.capsule, self.managed = capsule, managed

    def __del__(self) -> None:
        deleter = self.managed.contents.deleter
        if deleter:
            deleter(self.managed)


def import_view(obj: Any, stream: int | None = None) -> tuple[int, tuple[int, ...], DataType, str, bool, Any]:
    """(pointer, shape, dtype, device "cpu"/"cuda", contiguous, owner) of a DLPack producer.
    `stream` is the CUDA stream the data will be used on (the producer orders its work before
    it); None lets the producer use its default (the legacy stream)."""
    try:
        device_type, _ = obj.__dlpack_device__()
        capsule = obj.__dlpack__(stream=stream) if device_type == CUDA and stream is not None else obj.__dlpack__()
    except (BufferError, TypeError, RuntimeError) as exc:
        raise ArgumentError(f"{type(obj).__name__} cannot be exported through DLPack: {exc}") from None
    raw = id(capsule)  # CPython: the object's address
    if type(capsule).__name__ != "PyCapsule" or not _api.PyCapsule_IsValid(raw, b"dltensor"):
        raise ArgumentError(f"{type(obj).__name__}.__dlpack__() did not return a dltensor capsule")
    managed = ctypes.cast(_api.PyCapsule_GetPointer(raw, b"dltensor"), ctypes.POINTER(_Managed))
    _api.PyCapsule_SetName(raw, b"used_dltensor")  # we own it now
    owner = _Imported(capsule, managed)
    t = managed.contents.dl_tensor
    kind = {CPU: "cpu", CUDA_HOST: "cpu", CUDA: "cuda"}.get(t.device.device_type)
    if kind is None:
        raise ArgumentError(f"DLPack device type {t.device.device_type} is not supported (only CPU and CUDA)")
    dt = _tessera_dtype(t.dtype)
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    contiguous = True
    if t.strides:
        expected = 1
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and int(t.strides[i]) != expected:
                contiguous = False
            expected *= shape[i]
    return (t.data or 0) + t.byte_offset, shape, dt, kind, contiguous, owner
