"""Load CPU kernels from shared libraries and call them."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tessera.errors import raise_for_status
from tessera.ir.func import Function
from tessera.ir.functor import written_buffers
from tessera.runtime.args import bind, ctype_of


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


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

    def __call__(self, args: Sequence[Any]) -> None:
        values, _, views = bind(self.func, args, "cpu", self.written)
        status = ctypes.c_int32(0)
        self.fn(*values, ctypes.byref(status))
        del views
        if status.value:
            raise_for_status(status.value, self.func.name)
