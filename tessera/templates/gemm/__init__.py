"""The GPU GEMM family: fp16/bf16 `linear` and `matmul` on tensor cores, epilogue fused.

Kernels: `mma.py` (mma.sync, any GPU from SM80), `wgmma.py` (warpgroup MMA, SM90), `tma.py`
(warp-specialised TMA + wgmma, SM90).  `space.py` holds their schedule spaces and cost model,
`config.py` picks or tunes a schedule per shape, `plan.py` adapts a problem (operand index
maps, batch folding, the epilogue) to the template and builds it, and `generic.py` builds a
linear layer's kernels once for every row count (dynamic shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

from tessera.graph.operator import Operator
from tessera.templates.epilogue import Epilogue
from tessera.templates.gemm.config import families
from tessera.templates.gemm.generic import RowGenericGpuGemm, row_generic
from tessera.templates.gemm.plan import (
    ANCHOR_DTYPES,
    GemmProblem,
    Operand,
    matmul_problem,
    prepare_linear,
    prepare_matmul,
)
from tessera.templates.gemm.space import schedule_space
from tessera.templates.kernel import INPUT
from tessera.templates.registry import AnchorSite, Shape, Template, register


def gpu_dtype_refusal(op: Operator) -> str | None:
    """Why a tensor-core template cannot take op's dtypes (None when it can)."""
    out = op.outputs[0].dtype
    if out not in ANCHOR_DTYPES:
        return f"computes in {out.name}; the tensor-core templates take float16 and bfloat16"
    if any(t.dtype != out for t in op.inputs):
        return "its inputs' dtypes differ from its output's"
    return None


class GemmTemplate(Template):
    name, kinds, target = "gemm", ("linear", "matmul"), "cuda"

    def refuse(self, op: Operator) -> str | None:
        if op.kind == "matmul" and (op.inputs[0].ndim < 2 or op.inputs[1].ndim < 2):
            return "a matrix-vector product (1-D operand) runs on the generic kernels"
        return gpu_dtype_refusal(op)

    def problem(self, op: Operator, shapes: Sequence[Shape]) -> GemmProblem:
        dtype = op.outputs[0].dtype
        if op.kind == "matmul":
            return matmul_problem(tuple(shapes[0]), tuple(shapes[1]), dtype, "kn")[0]
        (n, k), lead = shapes[1], shapes[0][:-1]
        a, b = Operand((INPUT, 0), tuple(shapes[0]), None, plain=True), Operand((INPUT, 1), (n, k), None, plain=True)
        return GemmProblem(dtype, "nk", 1, prod(lead), n, k, a, b, None, k % 8 == 0, row_major_out=True)

    def space(self, op: Operator, shapes: Sequence[Shape]) -> list[Any]:
        p = self.problem(op, shapes)
        fams = families(p.layout, p.vector, tma=p.tma)
        return schedule_space(p.m, p.n, p.k, p.batch, p.layout, wgmma="wgmma" in fams, tma="tma" in fams)

    def generic(self, site: AnchorSite, tune: bool) -> RowGenericGpuGemm | None:
        return row_generic(site, tune, lambda shapes: self.prepare(site, shapes, tune))

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        dtype = op.outputs[0].dtype
        if op.kind == "linear":
            return prepare_linear(shapes[0], shapes[1], dtype, bias=len(op.inputs) == 3, epilogue=epilogue, tune=tune)
        return prepare_matmul(shapes[0], shapes[1], dtype, b_layout="kn", epilogue=epilogue, tune=tune)


GEMM = register(GemmTemplate())
