"""DLPack without a compiled extension: tessera's device arrays go out to torch, cupy or
numpy (`torch.from_dlpack(device_array)`), and any DLPack producer's GPU arrays come in as
kernel arguments (CPU ones come in through numpy's own `np.from_dlpack`).

The structures are DLPack's stable (unversioned) ABI, `DLManagedTensor` in a PyCapsule named
"dltensor", which every consumer accepts.  A consumer renames the capsule "used_dltensor" and
calls the tensor's deleter when it is done.  Exported capsules have no destructor: one would be
Python code run while its consumer's exception may be pending, which CPython turns into a
SystemError.  So a capsule that no consumer takes (its consumer failed) keeps its array alive
until the process ends; consumers take capsules at once, so this is the error path only.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType

CPU, CUDA, CUDA_HOST, CUDA_MANAGED = 1, 2, 3, 13  # DLDeviceType values tessera reads
_INT, _UINT, _FLOAT, _BFLOAT, _BOOL = 0, 1, 2, 4, 6
_NAME = b"dltensor"
_USED = b"used_dltensor"


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]  # fmt: skip


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
_CODES = {dtypes.boolean: (_BOOL, 8), dtypes.bfloat16: (_BFLOAT, 16)}
for _dt in (dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64):
    _CODES[_dt] = (_INT, _dt.nbytes * 8)
for _dt in (dtypes.uint8, dtypes.uint16, dtypes.uint32, dtypes.uint64):
    _CODES[_dt] = (_UINT, _dt.nbytes * 8)
for _dt in (dtypes.float16, dtypes.float32, dtypes.float64):
    _CODES[_dt] = (_FLOAT, _dt.nbytes * 8)
_FROM_CODE = {v: k for k, v in _CODES.items()}

# Exported tensors stay alive (with what owns their memory) until their deleter runs.
_LIVE: dict[int, tuple[Any, ...]] = {}
_LOCK = threading.Lock()


@_DELETER
def _delete(managed: Any) -> None:
    with _LOCK:
        _LIVE.pop(ctypes.addressof(managed.contents), None)


def export(ptr: int, shape: tuple[int, ...], dt: DataType, device_type: int, device_id: int, owner: Any) -> Any:
    """A "dltensor" capsule for a contiguous array at `ptr`; `owner` is kept alive until the
    consumer is done with it."""
    if dt not in _CODES:
        raise ArgumentError(f"DLPack has no {dt.name} (sub-byte types travel packed, as uint8)")
    code, bits = _CODES[dt]
    managed = DLManagedTensor()
    ndim = len(shape)
    sizes = (ctypes.c_int64 * max(ndim, 1))(*shape)
    managed.dl_tensor = DLTensor(ctypes.c_void_p(ptr), DLDevice(device_type, device_id), ndim,
                                 DLDataType(code, bits, 1), sizes, None, 0)  # fmt: skip
    managed.deleter = _delete
    with _LOCK:
        _LIVE[ctypes.addressof(managed)] = (managed, sizes, owner)
    return _api.PyCapsule_New(ctypes.addressof(managed), _NAME, None)


class _Imported:
    """Owns a consumed DLPack tensor: calls its producer's deleter when collected."""

    def __init__(self, capsule: Any, managed: Any):
        self.capsule, self.managed = capsule, managed

    def __del__(self) -> None:
        deleter = self.managed.contents.deleter
        if deleter:
            deleter(self.managed)


def consume(obj: Any, stream: int | None = None) -> tuple[int, tuple[int, ...], DataType, int, int, bool, Any]:
    """(data pointer, shape, dtype, device type, device id, contiguous, owner) of a DLPack
    producer's array; keep `owner` alive while the memory is used."""
    try:
        capsule = obj.__dlpack__(stream=stream)
    except TypeError:  # producers predating the stream argument
        capsule = obj.__dlpack__()
    if not _api.PyCapsule_IsValid(capsule, _NAME):
        raise ArgumentError(f"{type(obj).__name__}.__dlpack__() did not return an unconsumed 'dltensor' capsule")
    managed = ctypes.cast(_api.PyCapsule_GetPointer(capsule, _NAME), ctypes.POINTER(DLManagedTensor))
    _api.PyCapsule_SetName(capsule, _USED)
    owner = _Imported(capsule, managed)
    t = managed.contents.dl_tensor
    key = (int(t.dtype.code), int(t.dtype.bits))
    if key not in _FROM_CODE or t.dtype.lanes != 1:
        raise ArgumentError(f"DLPack dtype (code {t.dtype.code}, {t.dtype.bits} bits, {t.dtype.lanes} lanes) is not "
                            "one tessera kernels take")  # fmt: skip
    dt = _FROM_CODE[key]
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    contiguous = True
    if t.strides:
        expected, acc = [], 1
        for d in reversed(shape):
            expected.append(acc)
            acc *= d
        contiguous = all(shape[i] == 1 or int(t.strides[i]) == s for i, s in enumerate(reversed(expected)))
    ptr = (t.data or 0) + int(t.byte_offset)
    return ptr, shape, dt, int(t.device.device_type), int(t.device.device_id), contiguous, owner
