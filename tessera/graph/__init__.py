"""The graph layer: FlowGraph (tensors, operators, registry), graph passes, the interim
executor, memory planning and save/load.

    >>> from tessera.graph import GraphBuilder, load
"""

from tessera.graph import opdefs  # noqa: F401  (registers the operator vocabulary)
from tessera.graph.builder import GraphBuilder
from tessera.graph.executor import Backend, Executor, NumpyBackend, OpKernel
from tessera.graph.flow_graph import FlowGraph, GraphError
from tessera.graph.memory_plan import MemoryPlan, plan_memory
from tessera.graph.operator import Operator
from tessera.graph.registry import OpDef, all_ops, get_op, has_op, register
from tessera.graph.serialize import load, save
from tessera.graph.symbolic import ShapeError, Sym
from tessera.graph.tensor import Tensor
from tessera.ir.dtypes import from_numpy_dtype, numpy_dtype

__all__ = [
    "GraphBuilder", "Backend", "Executor", "NumpyBackend", "OpKernel", "FlowGraph", "GraphError",
    "MemoryPlan", "plan_memory", "Operator", "OpDef", "all_ops", "get_op", "has_op", "register",
    "load", "save", "ShapeError", "Sym", "Tensor", "from_numpy_dtype", "numpy_dtype",
]  # fmt: skip
