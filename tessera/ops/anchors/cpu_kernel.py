"""CpuAnchorKernel: the C kernels of one anchor operator, called on numpy arrays without allocating."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.ir import expr as E
from tessera.ops.anchors.kernel import CONSTANT, LITERAL, AnchorPlan, PreparedAnchor


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


class CpuAnchorKernel(PreparedAnchor):
    """A prepared CPU anchor: call `kernel(inputs, out, extras)` on numpy arrays (or CPU torch
    tensors).  Workspaces (per-worker packing buffers) belong to the kernel and are allocated
    once, 64-byte aligned: one CpuAnchorKernel must not run in two threads at once."""

    def __init__(self, plan: AnchorPlan, library: Path):
        from tessera.backend.codegen_c_like import symbol_name
        from tessera.runtime.cpu import CpuKernel

        workspaces = [aligned_empty(shape, dt.name) for shape, dt in plan.workspaces]
        for i in plan.zeroed:
            workspaces[i].fill(0)
        super().__init__(plan, workspaces, library)
        # What a saved graph ships: the library, and the kernels the plan ran (packing a constant
        # weight), which a graph loaded without a compiler runs again.
        self.artifacts = [str(library), *plan.helpers]
        kernels = [CpuKernel(launch.func, library, symbol_name(launch.func)) for launch in plan.launches]
        self._steps = [(k, list(launch.slots), [_static_shape(q) for q in launch.func.params])
                       for k, launch in zip(kernels, plan.launches)]  # fmt: skip

    def __call__(self, inputs: Sequence[Any], out: Any, extras: Sequence[Any] = ()) -> None:
        extras = self._checked_extras(inputs, extras)
        sources = (inputs, (out,), extras, self.workspaces, None, None, self.plan.constants)
        for kernel, slots, shapes in self._steps:
            args = [i if s == LITERAL else sources[s][i] for s, i in slots]
            # Operands the kernel reads as another view of the same memory ([..., K] as [M, K], OIHW as [O, K]).
            kernel([a.reshape(shape) if shape is not None and tuple(a.shape) != shape else a for a, shape in zip(args, shapes)])


__all__ = ["CONSTANT", "CpuAnchorKernel", "aligned_empty"]
