"""The graph compiler: FlowGraph -> partition into fused groups -> kernels -> CompiledGraph.

    >>> from tessera.graph.compiler import compile_graph
    >>> compiled = compile_graph(graph, "cuda")   # anchors on templates, the rest fused
    >>> outputs = compiled(x)                       # one call runs the whole graph
"""

from tessera.graph.compiler.build import compile_graph
from tessera.graph.compiler.compiled_graph import CompiledGraph
from tessera.graph.compiler.partition import Group, partition
from tessera.graph.compiler.saved import load_compiled, save_compiled

__all__ = ["compile_graph", "CompiledGraph", "Group", "partition", "load_compiled", "save_compiled"]
