"""The `@tessera.kernel` decorator, and the one build-and-load pipeline every kernel takes:
lower (transforms), generate one source (backend), build it into the artifact cache (gcc or
nvcc), load each function (runtime).

This module sits on top of the layers (lang -> transforms -> backend -> runtime) and is the
only place that strings them together: `Kernel` for one decorated kernel, the ops layer for
scheduled compute definitions and the templates for their plans all call `generate_source`,
`build_source` and `load_function`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tessera.backend import build_c, build_cuda, detect_cuda_arch, generate_c, generate_cuda
from tessera.backend.codegen_c_like import symbol_name
from tessera.backend.source_view import readable
from tessera.ir.func import Function, LaunchConfig
from tessera.lang.parser import parse_kernel
from tessera.runtime.cpu import CpuKernel
from tessera.runtime.cuda import CudaKernel
from tessera.transforms.pipeline import lower


def generate_source(lowered: Sequence[Function], target: str) -> str:
    """One compilation unit: the C ("cpu") or CUDA ("cuda") source of lowered functions."""
    return (generate_c if target == "cpu" else generate_cuda)(list(lowered))


def build_source(source: str, target: str, arch: str | None = None) -> Path:
    """Compile `source` with gcc ("cpu") or nvcc ("cuda", for `arch` or this machine's GPU), or
    fetch the artifact the cache holds for it."""
    if target == "cpu":
        return Path(build_c(source))
    return Path(build_cuda(source, arch or detect_cuda_arch()))


def load_function(func: Function, path: Path, target: str, launch: LaunchConfig | None = None) -> Any:
    """`func` from a built artifact: a CpuKernel, or a CudaKernel launched with `launch` (the
    lowered function's configuration; passes may add a shared-memory pool) or func's own."""
    if target == "cpu":
        return CpuKernel(func, path, symbol_name(func))
    return CudaKernel(func, path, symbol_name(func), launch)


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
            self._source = generate_source([self.lowered], self.target)
        return self._source

    @property
    def source(self) -> str:
        """The generated source to read: the kernel and only the prelude helpers it uses
        (`source_full` is what is compiled)."""
        return readable(self.source_full)

    def build(self) -> str:
        """Compile (or fetch from the cache) and return the artifact path."""
        return str(build_source(self.source_full, self.target, None if self.target == "cpu" else self.arch))

    def compile(self) -> Any:
        """Build and load; returns the loaded runtime kernel."""
        with self._lock:
            return self._compile_locked()

    def _compile_locked(self) -> Any:
        if self._compiled is None:
            launch = None if self.target == "cpu" else self.lowered.launch
            self._compiled = load_function(self.ir, Path(self.build()), self.target, launch)
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
