"""The row family: layer norm, RMS norm and softmax over the last axis (float16, bfloat16,
float32) on the tuned CUDA row kernels, the elementwise tail fused into their stores.

Kernels: `reduce.py` (row reductions and softmax), `norm.py` (layer norm, RMS norm),
`schedule.py` (thread / warp / block per row by the row length), `kinds.py` (the kernel of
each operator); `plan.py` adapts an operator's tensors to them (per shape, or generic in the
row count under dynamic shapes).
"""

from __future__ import annotations

from typing import Any

from tessera.graph.operator import Operator
from tessera.templates.epilogue import Epilogue
from tessera.templates.registry import AnchorSite, Shape, Template, register
from tessera.templates.row.plan import ROW_DTYPES, ROW_OPS, RowGenericRows, prepare_row, row_generic
from tessera.templates.row.reduce import make_layernorm, make_rmsnorm, make_row_reduce, make_softmax

__all__ = ["ROW", "RowTemplate", "make_layernorm", "make_rmsnorm", "make_row_reduce", "make_softmax"]


class RowTemplate(Template):
    name, kinds, target = "row", tuple(ROW_OPS), "cuda"

    def refuse(self, op: Operator) -> str | None:
        inputs = ROW_OPS[op.kind][1]
        if len(op.inputs) != inputs:
            return f"takes {inputs} inputs ({op.kind} with weight and bias as the kernel has them), not {len(op.inputs)}"
        x = op.inputs[0]
        if x.dtype not in ROW_DTYPES or any(t.dtype != x.dtype for t in op.inputs) or x.ndim < 1:
            return "takes float16, bfloat16 or float32 rows with parameters of x's dtype"
        if op.kind == "softmax":
            return None if op.attrs.get("axis") in (-1, x.ndim - 1) else "softmax over an axis other than the last"
        return None if op.attrs.get("num_axes", 1) == 1 else "normalises over more than the last axis"

    def generic(self, site: AnchorSite, tune: bool) -> RowGenericRows | None:
        return row_generic(site)

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        eps = float(op.attrs.get("eps", 1e-5))
        return prepare_row(op.kind, shapes[0], op.outputs[0].dtype, eps=eps, epilogue=epilogue)


ROW = register(RowTemplate())
