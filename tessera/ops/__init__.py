"""tessera.ops: compute definitions of tensor operators and their auto-scheduled kernels."""

from tessera.ir.compute import (
           Compute,
           Placeholder,
           ReduceCompute,
           TensorElement,
           TensorNode,
           compute,
           placeholder,
           reduce,
)
from tessera.ops.build import CompiledOp, build, generate

__all__ = ["Compute", "Placeholder", "ReduceCompute", "TensorElement", "TensorNode", "compute", "placeholder",
           "reduce", "CompiledOp", "build", "generate"]  # fmt: skip
