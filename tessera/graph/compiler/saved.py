"""Saving a CompiledGraph to one file (`.tsr`) and loading it in a fresh process.

A `.tsr` file holds native code: load only files you trust, as with a pickle.  The format, and
what loading verifies, are in tessera.graph.compiler.archive; `CompiledGraph.save` writes it.
Loading installs the file's artifacts into the local artifact cache, then partitions and lowers
the graph again (milliseconds), and every kernel is found in the cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from tessera.errors import ArgumentError
from tessera.graph.compiler import archive
from tessera.graph.compiler.archive import FORMAT, VERSION
from tessera.graph.compiler.build import compile_graph
from tessera.graph.compiler.compiled_graph import CompiledGraph

__all__ = ["FORMAT", "VERSION", "load_compiled", "save_compiled"]


def save_compiled(compiled: CompiledGraph, path: str | Path, sizes: Sequence[Mapping[str, int]] = ()) -> None:
    """Write `compiled` (graph, constants, options, every kernel artifact and tuning record it
    uses) to `path`.  `sizes`: values of the graph's symbolic sizes whose anchors (GPU
    templates, specialised per shape) should be prepared and saved besides those already run."""
    compiled.save(path, sizes)


def load_compiled(path: str | Path) -> CompiledGraph:
    """Load a file written by `save_compiled`; the original model is not needed.

    The file is verified before anything from it is installed (see tessera.graph.compiler.archive
    for what is and is not verified); a file that fails raises FileFormatError.  It holds native
    code: load only files you trust."""
    path = Path(path)
    if not path.is_file():
        raise ArgumentError(f"{path}: {'not a file' if path.exists() else 'no such file'}")
    graph, doc = archive.read(path)
    options = doc["options"]
    return compile_graph(graph, doc["target"], optimize=False, cuda_graph=options["cuda_graph"], tune=options["tune"])
