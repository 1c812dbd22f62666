"""The torch front end: `torch.compile(model, backend="tessera")`.

The backend is registered through the `torch_dynamo_backends` entry point (pyproject.toml),
and again by name when this module is imported (for checkouts used without `pip install`);
`backend` can also be passed directly: `torch.compile(model, backend=tessera.frontend.torch.backend)`.
See `tessera.frontend.torch.backend` for how graphs are translated and partitioned.
`predicate(model)` turns a model's pure data-dependent branches (fp16 overflow guards) into
selects, so that dynamo traces one graph where it would break (tessera.frontend.torch.predication).
"""

from tessera.frontend.torch.backend import CompiledAtenGraph, backend, stats
from tessera.frontend.torch.predication import PredicationReport, predicate
from tessera.frontend.torch.report import compiled_graphs


def _register() -> None:
    from torch._dynamo.backends import registry

    if "tessera" not in registry._BACKENDS:
        registry.register_backend(compiler_fn=backend, name="tessera")


_register()

__all__ = ["CompiledAtenGraph", "PredicationReport", "backend", "compiled_graphs", "predicate", "stats"]
