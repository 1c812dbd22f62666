"""The mixture-of-experts family: `fused_moe` (router top-k, SiLU-gated experts, weighted combine,
shared expert; tessera.graph.opdefs.moe) as one anchor.

CPU: `cpu.py` (route, group by expert, grouped up and down GEMMs over the chosen experts only,
combine; written in tessera, token counts at run time), called in order by `plan.py`.  A CUDA
template slots in beside `CpuMoe` as another registration of the same kind ("cuda" target,
same inputs and attributes); until one does, the torch front end keeps MoE blocks as traced on
the GPU (frontend/torch/backend.py calls keep_moe_whole for CPU graphs only, and
aten_nn._fused_moe refuses CUDA tensors): lift both guards with the template.
"""

from __future__ import annotations

from typing import Any

from tessera.graph.operator import Operator
from tessera.ir import dtypes
from tessera.templates.epilogue import Epilogue
from tessera.templates.moe.plan import CpuMoeKernel, MoeProblem, moe_cpu, prepare_moe_cpu
from tessera.templates.registry import Shape, Template, register


class CpuMoe(Template):
    name, kinds, target = "moe", ("fused_moe",), "cpu"
    epilogue = False  # the combine writes the output; a residual add stays a fused kernel of its own

    def refuse(self, op: Operator) -> str | None:
        if any(t.dtype != dtypes.float32 for t in op.inputs):
            return "takes float32 tensors on the CPU"
        if not all(t.is_constant for t in op.inputs[1:]):
            return "takes constant expert and router weights"
        if not all(isinstance(d, int) for t in op.inputs[1:] for d in t.shape):
            return "takes weights of static shapes"
        return None

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        return prepare_moe_cpu(op.attrs, shapes)


CPU_MOE = register(CpuMoe())

__all__ = ["CPU_MOE", "CpuMoe", "CpuMoeKernel", "MoeProblem", "moe_cpu", "prepare_moe_cpu"]
