"""Saving a CompiledGraph to one file and loading it in a fresh process.

The file is a FlowGraph file (tessera.graph.serialize: graph.json + constants.npz, the graph
as optimized) with two more members: `compiled.json` (target and options) and the built
artifacts of the fused kernels (`artifacts/<cache key>/...`).  Loading puts the artifacts
back into the local artifact cache when it lacks them, so a machine with the same compiler
rebuilds nothing: the graph is partitioned and lowered again (milliseconds) and every
kernel is found in the cache.  Anchor kernels are specialised per shape at the first call
and come from the cache as well.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from tessera.backend import cache
from tessera.errors import TesseraError
from tessera.graph import serialize
from tessera.graph.compiler.build import compile_graph
from tessera.graph.compiler.compiled_graph import CompiledGraph

FORMAT, VERSION = "tessera.compiled", 1


def save_compiled(compiled: CompiledGraph, path: str | Path) -> None:
    """Write `compiled` (graph, constants, options and kernel artifacts) to `path`."""
    path = Path(path)
    serialize.save(compiled.graph, path)
    artifacts = sorted({str(s.compiled.artifact) for s in compiled.steps
                        if s.kind == "fused" and getattr(s.compiled, "artifact", None)})  # fmt: skip
    doc = {"format": FORMAT, "version": VERSION, "target": compiled.target, "options": compiled.options, "artifacts": []}
    with zipfile.ZipFile(path, "a") as z:
        for a in artifacts:
            entry = Path(a).parent
            key = entry.name
            doc["artifacts"].append({"key": key, "name": Path(a).name})
            for f in sorted(entry.iterdir()):
                z.write(f, f"artifacts/{key}/{f.name}")
        z.writestr("compiled.json", json.dumps(doc, indent=1))


def load_compiled(path: str | Path) -> CompiledGraph:
    """Load a file written by `save_compiled`; the original model is not needed."""
    try:
        with zipfile.ZipFile(path) as z:
            doc = json.loads(z.read("compiled.json"))
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise TesseraError(f"{path}: not a {FORMAT} v{VERSION} file")
            for art in doc["artifacts"]:
                _install(z, art["key"], art["name"])
    except (KeyError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise TesseraError(f"{path}: not a readable compiled-graph file ({exc}); save it again with save_compiled") from exc
    graph = serialize.load(path)
    options = doc.get("options", {})
    return compile_graph(graph, doc["target"], optimize=False, cuda_graph=options.get("cuda_graph", True),
                         tune=options.get("tune", False))  # fmt: skip


def _install(z: zipfile.ZipFile, key: str, name: str) -> None:
    """Publish one saved artifact into the cache unless an intact copy is there."""
    prefix = f"artifacts/{key}/"
    files = {m[len(prefix):]: z.read(m) for m in z.namelist() if m.startswith(prefix)}
    cache.install(key, name, files)
