"""`tessera.explain`: the compile report of anything tessera compiled.

It sits low in the layers and knows no compiler: anything with a `report()` method (compiled
graphs, ONNX models) reports itself, and front ends register an explainer for the objects they
make (the torch front end, for `torch.compile(..., backend="tessera")` results, when it loads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tessera.errors import ArgumentError

# (recognises an object, explains it), registered by front ends at import.
_EXPLAINERS: list[tuple[Callable[[Any], bool], Callable[[Any], Any]]] = []


def register_explainer(recognises: Callable[[Any], bool], explain_one: Callable[[Any], Any]) -> None:
    """Let `explain` report the objects `recognises` accepts, through `explain_one`."""
    _EXPLAINERS.append((recognises, explain_one))


def explain(compiled: Any) -> Any:
    """What tessera made of a compiled model, as a printable report (`.to_dict()` for tools).

    Takes a `CompiledGraph` (compile_graph, tessera.graph.compiler.load_compiled), an ONNX
    model from `tessera.onnx.compile`, or a module or function returned by
    `torch.compile(..., backend="tessera")` (after its first call: torch compiles lazily).
    Per graph it lists each kernel with the operators fused into it, the template and
    configuration of each anchor (tuned or chosen by the cost model), the operators left to
    torch or to the numpy reference and why, the memory plan per shape and the compile time
    by phase."""
    report = getattr(compiled, "report", None)
    if callable(report):
        return report()
    for recognises, explain_one in _EXPLAINERS:
        if recognises(compiled):
            return explain_one(compiled)
    raise ArgumentError(f"tessera.explain takes a compiled graph, an ONNX model from tessera.onnx.compile or a "
                        f"module/function from torch.compile(..., backend='tessera'); got {type(compiled).__name__}")
