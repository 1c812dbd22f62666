"""The `@tessera.kernel` decorator: parse, lower, generate, build and load on first call.

This module sits on top of the layers (lang -> transforms -> backend -> runtime) and is the
only place that strings them together for one kernel.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from tessera.backend import build_c, build_cuda, detect_cuda_arch, generate_c, generate_cuda
from tessera.backend.codegen_c_like import symbol_name
from tessera.backend.source_view import readable
from tessera.ir.func import Function
from tessera.lang.parser import parse_kernel
from tessera.runtime.cpu import CpuKernel
from tessera.runtime.cuda import CudaKernel
from tessera.transforms.pipeline import lower


class Kernel:
    """A tessera kernel.  Inspect `.ir`, `.lowered` and `.source` (the kernel and the helpers it
    uses; `.source_full` is everything that is compiled); call it to run it."""

    def __init__(self, pyfunc: Callable, target: str = "cpu", name: str | None = None, arch: str | None = None,
                 scope: dict[str, Any] | None = None):  # fmt: skip
        self.pyfunc, self.target = pyfunc, target
        self.ir: Function = parse_kernel(pyfunc, target, name, scope)
        self.__name__ = self.ir.name
        self.__doc__ = pyfunc.__doc__
        self._arch = arch
        self._lowered: Function | None = None
        self._source: str | None = None
        self._compiled: Any = None
        self._lock = threading.Lock()  # tuners build candidates from several threads

    @property
    def lowered(self) -> Function:
        if self._lowered is None:
            self._lowered = lower(self.ir)
        return self._lowered

    @property
    def arch(self) -> str:
        if self._arch is None:
            self._arch = detect_cuda_arch()
        return self._arch

    @property
    def source_full(self) -> str:
        """The generated C or CUDA source as it is compiled: the whole prelude of helpers, then the kernel."""
        if self._source is None:
            gen = generate_c if self.target == "cpu" else generate_cuda
            self._source = gen([self.lowered])
        return self._source

    @property
    def source(self) -> str:
        """The generated source to read: the kernel and only the prelude helpers it uses
        (`source_full` is what is compiled)."""
        return readable(self.source_full)

    def build(self) -> str:
        """Compile (or fetch from the cache) and return the artifact path."""
        if self.target == "cpu":
            return str(build_c(self.source_full))
        return str(build_cuda(self.source_full, self.arch))

    def compile(self) -> Any:
        """Build and load; returns the loaded runtime kernel."""
        with self._lock:
            return self._compile_locked()

    def _compile_locked(self) -> Any:
        if self._compiled is None:
            from pathlib import Path

            path = Path(self.build())
            if self.target == "cpu":
                self._compiled = CpuKernel(self.ir, path, symbol_name(self.ir))
            else:
                self._compiled = CudaKernel(self.ir, path, symbol_name(self.ir), self.lowered.launch)
        return self._compiled

    def __call__(self, *args: Any, stream: int | None = None) -> None:
        compiled = self._compiled or self.compile()
        if self.target == "cpu":
            compiled(args)
        else:
            compiled.launch(args, stream)

    def __repr__(self) -> str:
        return f"<tessera.Kernel {self.ir.name} target={self.target}>"


def kernel(fn: Callable | None = None, *, target: str = "cpu", name: str | None = None,
           arch: str | None = None) -> Any:  # fmt: skip
    """Compile a Python function into a tessera kernel.

    Use as ``@kernel`` (CPU) or ``@kernel(target="cuda")``.  The function body is parsed at
    decoration time, so unsupported constructs are reported immediately with the line.
    """
    # The names visible where the kernel is defined: this call's caller in both forms
    # (`@kernel` calls kernel(f) there, `@kernel(...)` calls kernel(...) there), never wrap's.
    scope = dict(sys._getframe(1).f_locals)

    def wrap(f: Callable) -> Kernel:
        return Kernel(f, target, name, arch, scope)

    return wrap(fn) if fn is not None else wrap
