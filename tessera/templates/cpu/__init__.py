"""The CPU family: float32 `linear`, `matmul`, group-1 NCHW `conv2d` and `max_pool2d` with
static shapes, on x86 (AVX2 or AVX-512) C kernels, epilogues fused into their stores.

Kernels: `gemm_kernel.py` (the register-tiled micro-kernel and the B packer), `pad_kernel.py`,
`pool_kernel.py`; plans: `gemm.py` (linear, matmul: a constant weight packed once), `conv.py`
(implicit GEMM over NCHW), `pool.py`.  A linear or matmul whose only symbolic sizes are its rows
runs on kernels generic in the row count (`gemm_rows.py`: one build per configuration serves
every length); other symbolic sizes stay on the ops scheduler's kernels, which serve every size
from one build (a template per size would cost a gcc run each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod
from typing import Any

from tessera.backend.isa import vector_lanes
from tessera.graph.operator import Operator
from tessera.ir import dtypes
from tessera.ops.geometry import pads, pair
from tessera.templates.cpu.conv import conv_space, plan_cpu_conv2d
from tessera.templates.cpu.gemm import gemm_space, plan_cpu_linear, plan_cpu_matmul
from tessera.templates.cpu.gemm_rows import RowGenericGemm, row_generic
from tessera.templates.cpu.pool import plan_cpu_max_pool2d
from tessera.templates.epilogue import Epilogue
from tessera.templates.gemm.generic import rows_refusal
from tessera.templates.registry import AnchorSite, Shape, Template, register, static


def cpu_refusal(op: Operator, symbolic: Callable[[Operator], str | None] | None = None) -> str | None:
    """Why the CPU templates cannot take op's machine, dtypes or sizes (None when they can);
    `symbolic` says why not for symbolic sizes (a template generic in some of them), else
    they are refused."""
    if vector_lanes() == 1:
        return "this CPU has no SIMD unit the CPU templates use"
    if any(t.dtype != dtypes.float32 for t in (*op.inputs, *op.outputs)):
        return "the CPU templates compute in float32"
    if not static(*op.inputs, *op.outputs):
        return symbolic(op) if symbolic is not None else "symbolic sizes: the CPU templates are specialised to their shapes"
    return None


def _constant_weight(op: Operator, ndim: int) -> Any:
    w = op.inputs[1]
    return w.data if w.is_constant and w.ndim == ndim else None


def _conv_geometry(attrs: dict[str, Any]) -> dict[str, Any]:
    return {"stride": pair(attrs["stride"], "stride", "conv2d"), "padding": pads(attrs["padding"], "conv2d"),
            "dilation": pair(attrs["dilation"], "dilation", "conv2d")}  # fmt: skip


class CpuGemm(Template):
    name, kinds, target = "cpu-gemm", ("linear", "matmul"), "cpu"

    def refuse(self, op: Operator) -> str | None:
        return cpu_refusal(op, rows_refusal)

    def generic(self, site: AnchorSite, tune: bool) -> RowGenericGemm | None:
        return row_generic(site, tune)

    def space(self, op: Operator, shapes: Sequence[Shape]) -> list[Any]:
        a, b = shapes[0], shapes[1]
        if op.kind == "linear":
            return gemm_space(prod(a[:-1]), b[0], b[1], 1)
        return gemm_space(a[-2] if len(a) > 1 else 1, b[-1], a[-1], prod(a[:-2]))

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        weight = _constant_weight(op, 2)
        if op.kind == "linear":
            return plan_cpu_linear(shapes[0], shapes[1], bias=len(op.inputs) == 3, epilogue=epilogue, weight=weight,
                                   tune=tune).load()  # fmt: skip
        return plan_cpu_matmul(shapes[0], shapes[1], epilogue=epilogue, weight=weight, tune=tune).load()


class CpuConv(Template):
    name, kinds, target = "cpu-conv2d", ("conv2d",), "cpu"

    def refuse(self, op: Operator) -> str | None:
        if op.attrs.get("groups", 1) != 1 or op.inputs[0].ndim != 4 or op.attrs.get("layout", "NCHW") != "NCHW":
            return "the x86 implicit GEMM takes group-1 NCHW convolutions"
        return cpu_refusal(op)

    def space(self, op: Operator, shapes: Sequence[Shape]) -> list[Any]:
        g = _conv_geometry(op.attrs)
        return conv_space(shapes[0], shapes[1], (g["stride"], g["padding"], g["dilation"]))

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        return plan_cpu_conv2d(shapes[0], shapes[1], bias=len(op.inputs) == 3, epilogue=epilogue,
                               weight=_constant_weight(op, 4), tune=tune, **_conv_geometry(op.attrs)).load()  # fmt: skip


class CpuMaxPool(Template):
    name, kinds, target = "cpu-max-pool2d", ("max_pool2d",), "cpu"

    def refuse(self, op: Operator) -> str | None:
        if len(op.inputs) != 1 or op.attrs.get("layout", "NCHW") != "NCHW" or op.inputs[0].ndim != 4:
            return "the row kernel takes one NCHW input"
        return cpu_refusal(op)

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        a = op.opdef.normalize_attrs(op.attrs)
        top, left, _, _ = pads(a["padding"], op.kind)
        kernel = pair(a["kernel"], "kernel", op.kind)
        return plan_cpu_max_pool2d(shapes[0], kernel, pair(a["stride"] or kernel, "stride", op.kind), (top, left),
                                   ceil_mode=bool(a["ceil_mode"]), epilogue=epilogue).load()  # fmt: skip


CPU_GEMM = register(CpuGemm())
CPU_CONV = register(CpuConv())
CPU_MAX_POOL = register(CpuMaxPool())
