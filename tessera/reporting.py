"""`tessera.explain`: the compile report of anything tessera compiled.

This sits on top of the layers (like jit and cli): it dispatches to the graph compiler's
report (tessera.graph.compiler.report) and, for models compiled with
`torch.compile(..., backend="tessera")`, to the torch front end's record of its graphs.
"""

from __future__ import annotations

from typing import Any

from tessera.errors import ArgumentError


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
    if "torch" in type(compiled).__module__ or hasattr(compiled, "_torchdynamo_orig_callable"):
        from tessera.frontend.torch import report as torch_report  # optional: torch

        if torch_report.is_torch_compiled(compiled):
            return torch_report.explain(compiled)
    raise ArgumentError(f"tessera.explain takes a compiled graph, an ONNX model from tessera.onnx.compile or a "
                        f"module/function from torch.compile(..., backend='tessera'); got {type(compiled).__name__}")
