"""Which graphs the torch backend compiled, for `tessera.explain(torch.compile(model, backend="tessera"))`.

The backend records every graph it compiles (`record`), together with the torch.compile call
that asked for it: dynamo calls a backend named by string through a `torch._TorchCompileWrapper`,
one per `torch.compile(...)` call, which the compiled module or function also leads to (through
its dynamo context's `_torchdynamo_orig_backend` chain).  Matching the two gives the graphs of
one compiled model.  Both are torch internals: when they change, `explain` of a compiled model
says so, and `compiled_graphs()` still lists every graph compiled in the process.

Graphs are held weakly: dynamo owns them, and `torch._dynamo.reset()` lets them go.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

from tessera.errors import ArgumentError
from tessera.graph.compiler.report import CompileReport
from tessera.reporting import register_explainer

_LOCK = threading.Lock()
_GRAPHS: list[tuple[int | None, weakref.ref]] = []  # (id of the torch.compile wrapper, graph)
_OWNERS: dict[int, weakref.ref] = {}  # id -> the wrapper, to tell a reused id from its owner


def _wrapper_type() -> type | None:
    import torch

    return getattr(torch, "_TorchCompileWrapper", None)


def _calling_wrapper() -> Any:
    """The torch.compile wrapper that called the backend (nearest on the stack), or None."""
    kind = _wrapper_type()
    frame = sys._getframe(2)
    depth = 0
    while frame is not None and depth < 32 and kind is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, kind):
            return owner
        frame, depth = frame.f_back, depth + 1
    return None


def record(graph: Any) -> None:
    """Remember `graph` (a backend CompiledAtenGraph) under the torch.compile call compiling it."""
    owner = _calling_wrapper()
    with _LOCK:
        _GRAPHS[:] = [(o, g) for o, g in _GRAPHS if g() is not None]
        if owner is not None:
            _OWNERS[id(owner)] = weakref.ref(owner)
        _GRAPHS.append((id(owner) if owner is not None else None, weakref.ref(graph)))


def compiled_graphs() -> list[Any]:
    """Every graph the torch backend compiled in this process that dynamo still holds, oldest first."""
    with _LOCK:
        return [g for _, g in ((o, ref()) for o, ref in _GRAPHS) if g is not None]


def _wrapper_of(compiled: Any) -> Any:
    """The torch.compile wrapper behind a compiled module or function, or None."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is None:  # a compiled function keeps its context in its closure
        for cell in getattr(compiled, "__closure__", None) or ():
            try:
                contents = cell.cell_contents
            except ValueError:
                continue
            if hasattr(contents, "callback") and type(contents).__name__.endswith("Context"):
                ctx = contents
                break
    backend = getattr(ctx, "callback", None)
    kind = _wrapper_type()
    for _ in range(16):
        if backend is None or (kind is not None and isinstance(backend, kind)):
            return backend
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
    return None


def is_torch_compiled(obj: Any) -> bool:
    """Whether obj is what torch.compile returns (an OptimizedModule or a compiled function)."""
    return hasattr(obj, "_torchdynamo_orig_callable") or type(obj).__name__ == "OptimizedModule"


def graphs_of(compiled: Any) -> list[Any]:
    """The graphs the tessera backend compiled for this torch.compile'd module or function."""
    owner = _wrapper_of(compiled)
    if owner is None:
        raise ArgumentError(f"cannot find the torch.compile call behind this {type(compiled).__name__} (torch "
                            "internals may have changed); tessera.frontend.torch.compiled_graphs() lists every graph "
                            "the backend compiled in this process")  # fmt: skip
    with _LOCK:
        alive = _OWNERS.get(id(owner))
        if alive is None or alive() is not owner:
            return []
        return [g for o, ref in _GRAPHS if o == id(owner) and (g := ref()) is not None]


def explain(compiled: Any) -> Any:
    """A CompileReport of the graphs tessera compiled for a torch.compile'd module or function
    (none until it has been called: torch.compile compiles on the first call)."""
    graphs = graphs_of(compiled)
    report = CompileReport(f"torch.compile(backend=\"tessera\") of {_name(compiled)}")
    if not graphs:
        report.notes.append("no graph compiled yet: torch.compile compiles on the first call (or it was compiled "
                            "with another backend)")  # fmt: skip
    for g in graphs:
        part = g.report()
        report.graphs += part.graphs
        report.outside += part.outside
        report.notes += part.notes
    return report


def _name(obj: Any) -> str:
    inner = getattr(obj, "_orig_mod", None) or getattr(obj, "_torchdynamo_orig_callable", None) or obj
    return getattr(inner, "__qualname__", None) or type(inner).__name__


register_explainer(is_torch_compiled, explain)
