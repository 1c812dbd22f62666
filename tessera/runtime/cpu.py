"""Load CPU kernels from shared libraries and call them."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tessera.errors import raise_for_status
from tessera.ir.func import Function
from tessera.ir.functor import written_buffers
from tessera.runtime.args import bind, ctype_of


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


class RecordedCall:
    """One recorded call of a CPU kernel: the kernel and its checked C argument values (the
    status word excluded); `views` keep the arrays the pointers point into alive."""

    __slots__ = ("kernel", "values", "views")

    def __init__(self, kernel: CpuKernel, values: list[Any], views: list[Any]):
        self.kernel, self.values, self.views = kernel, values, views


_RECORDER = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[list[RecordedCall]]:
    """Record every CpuKernel call this thread makes inside the block (they run as usual), in
    call order: what `tessera.graph.compiler.cpu_replay` replays without re-checking."""
    launches: list[RecordedCall] = []
    outer = getattr(_RECORDER, "launches", None)
    _RECORDER.launches = launches
    try:
        yield launches
    finally:
        _RECORDER.launches = outer


class CpuKernel:
    """A compiled CPU kernel; call it with numpy arrays or CPU torch tensors.

    Calls may come from several threads at once: every call converts its own arguments and
    passes its own status word (the generated function's last parameter, see
    backend.codegen_c), so nothing is shared between calls."""

    def __init__(self, func: Function, library: Path, name: str | None = None):
        self.func = func
        self.fn = getattr(_load(str(library)), name or func.name)
        self.fn.restype = None
        self.fn.argtypes = [ctype_of(p.type) for p in func.all_params] + [ctypes.POINTER(ctypes.c_int32)]
        self.written = written_buffers(func)
        # Which C arguments are addresses (tensors and pointers), in `all_params` order.
        self.pointer_args = [t is ctypes.c_void_p for t in self.fn.argtypes[:-1]]

    def __call__(self, args: Sequence[Any]) -> None:
        values, _, views = bind(self.func, args, "cpu", self.written)
        status = ctypes.c_int32(0)
        self.fn(*values, ctypes.byref(status))
        if status.value:
            raise_for_status(status.value, self.func.name)
        launches = getattr(_RECORDER, "launches", None)
        if launches is not None:
            launches.append(RecordedCall(self, values, views))
