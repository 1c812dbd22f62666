"""How the suites build each system they time: the torch.compile arguments of a system name, the
tessera backend made resolvable, a fresh inductor cache per torch.compile mode, and eager torch
captured in a CUDA graph (the `torch.eager+cudagraph` peer)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from models_report import COMPILE_PEERS, TESSERA_SYSTEMS


def compile_kwargs(system: str) -> dict[str, Any]:
    if system in TESSERA_SYSTEMS:
        return {"backend": "tessera"}
    mode = system.split(":", 1)[1]
    return {} if mode == "default" else {"mode": mode}


def ensure_tessera_backend() -> str:
    """Make `backend="tessera"` resolvable; says whether the entry point or the import provided it."""
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend("tessera")
        return "entry point"
    except Exception:  # noqa: BLE001  (not pip-installed: importing the front end registers the name)
        import tessera.frontend.torch  # noqa: F401

        lookup_backend("tessera")
        return "registered on import of tessera.frontend.torch (no entry point: tessera is not pip-installed)"


def fresh_inductor_cache(system: str) -> contextlib.AbstractContextManager:
    """An empty inductor/Triton cache for each torch.compile mode, so that its cold compile is
    not served by the previous mode's FX-graph cache; warm then means warm in this folder."""
    if system not in COMPILE_PEERS:
        return contextlib.nullcontext()
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or getattr(utils, "fresh_inductor_cache", None)
    return fresh() if fresh else contextlib.nullcontext()


def cuda_graphed(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    """Eager `model` captured once in a CUDA graph: each call copies its inputs into the static
    ones and replays (what tessera's compiled graphs do too), returning the static output."""
    static = [x.clone() for x in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture (cuBLAS workspaces, lazy inits)
            model(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(*static)

    def replay(*args: torch.Tensor) -> torch.Tensor:
        for dst, src in zip(static, args):
            dst.copy_(src)
        graph.replay()
        return out

    return replay
