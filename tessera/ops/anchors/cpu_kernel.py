"""CpuAnchorKernel: the C kernels of one anchor operator, called on numpy arrays without allocating."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.ir import expr as E
from tessera.ir.dtypes import DataType
from tessera.ops.anchors.kernel import CONSTANT, LITERAL, AnchorPlan


def aligned_empty(shape: Sequence[int], dtype: Any, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    raw = np.empty(n + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start: start + n].view(dt).reshape(tuple(shape))


def _static_shape(param: Any) -> tuple[int, ...] | None:
    dims = getattr(param.type, "shape", None)
    if dims is None or not all(isinstance(d, E.Const) for d in dims):
        return None
    return tuple(int(d.value) for d in dims)


class CpuAnchorKernel:
    """A prepared CPU anchor: call `kernel(inputs, out, extras)` on numpy arrays (or CPU torch
    tensors).  Workspaces (per-worker packing buffers) belong to the kernel and are allocated
    once, 64-byte aligned: one CpuAnchorKernel must not run in two threads at once."""

    def __init__(self, plan: AnchorPlan, library: Path):
        from tessera.backend.codegen_c_like import symbol_name
        from tessera.runtime.cpu import CpuKernel

        self.plan = plan
        self.artifact = library
        self.out_shape: tuple[int, ...] = plan.out_shape
        self.out_dtype: DataType = plan.out_dtype
        self.config = plan.config
        self.workspaces = [aligned_empty(shape, dt.name) for shape, dt in plan.workspaces]
        kernels = [CpuKernel(launch.func, library, symbol_name(launch.func)) for launch in plan.launches]
        self._steps = [(k, list(launch.slots), [_static_shape(q) for q in launch.func.params])
                       for k, launch in zip(kernels, plan.launches)]  # fmt: skip
        self._num_inputs, self._num_extras = plan.num_inputs, plan.num_extras

    @property
    def kernels(self) -> list[str]:
        return [launch.func.name for launch in self.plan.launches]

    @property
    def source(self) -> str:
        return self.plan.source

    def __call__(self, inputs: Sequence[Any], out: Any, extras: Sequence[Any] = ()) -> None:
        if len(inputs) != self._num_inputs:
            raise ArgumentError(f"{self.plan.name}: takes {self._num_inputs} inputs, got {len(inputs)}")
        if len(extras) != self._num_extras:
            raise ArgumentError(f"{self.plan.name}: its epilogue takes {self._num_extras} extra tensors, got {len(extras)}")
        extras = [e.reshape(1) if getattr(e, "ndim", 1) == 0 else e for e in extras]
        sources = (inputs, (out,), extras, self.workspaces, None, None, self.plan.constants)
        for kernel, slots, shapes in self._steps:
            args = [i if s == LITERAL else sources[s][i] for s, i in slots]
            # Operands the kernel reads as another view of the same memory ([..., K] as [M, K], OIHW as [O, K]).
            kernel([a.reshape(shape) if shape is not None and tuple(a.shape) != shape else a for a, shape in zip(args, shapes)])

    def __repr__(self) -> str:
        return f"<CpuAnchorKernel {self.plan.name} -> {self.out_dtype}{list(self.out_shape)}: {', '.join(self.kernels)}>"


__all__ = ["CONSTANT", "CpuAnchorKernel", "aligned_empty"]
