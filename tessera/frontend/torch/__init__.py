"""The torch front end: `torch.compile(model, backend="tessera")`.

The backend is registered through the `torch_dynamo_backends` entry point (pyproject.toml);
`backend` can also be passed directly: `torch.compile(model, backend=tessera.frontend.torch.backend)`.
See `tessera.frontend.torch.backend` for how graphs are translated and partitioned.
"""

from tessera.frontend.torch.backend import CompiledGraph, backend, stats

__all__ = ["CompiledGraph", "backend", "stats"]
