"""The compiled-graph file (`.tsr`): writing one and reading it back, verified.

`CompiledGraph.save` (tessera.graph.compiler.compiled_graph) writes it and
`tessera.graph.compiler.load_compiled` (saved.py) compiles what it reads.

A `.tsr` file holds native code: load only files you trust, as with a pickle.

Format (version 2): a zip archive (tessera.graph.serialize's graph.json + constants.npz,
the graph as optimized) with these further members and nothing else:

* `compiled.json`::

      {"format": "tessera.compiled", "version": 2, "target": "cpu" | "cuda",
       "options": {"cuda_graph": bool, "tune": bool, "optimize": bool},
       "artifacts": [{"key": 40 hex digits, "kind": "c" | "cuda", "compiler": str,
                      "flags": str, "machine": str, "sha256": 64 hex digits}],
       "tuning": [{"key": str, "best": str}]}

* `artifacts/<key>/kernel.c` + `kernel.so` (CPU) or `kernel.cu` + `kernel.cubin` (CUDA) for
  each artifact: the generated source and the built library or cubin.

The artifacts are everything the model runs: the fused kernels and, on the GPU, the anchors'
template kernels prepared so far (for every shape the model has run, the static shape of a
graph without symbolic sizes, and any `sizes` given to `save`), with the tuning records
that chose them.  Loading installs them into the local artifact cache; the graph is then
partitioned and lowered again (milliseconds), and every kernel is found in the cache --
by its exact key when the local compiler is the saving one, and through the cache's source
index when there is no compiler at all (tessera.backend.cache), so a machine of the same
type runs the model without gcc or nvcc.  Shapes whose anchors were not saved need nvcc.

What loading verifies, before it writes anything:
  * the zip is readable and every member's CRC is right; its member names are exactly the
    fixed names above (no other name, no duplicate: nothing can land outside the cache);
  * compiled.json has the schema above; every key has the cache's key format;
  * each artifact's SHA-256 matches its recorded sha256, and its key is the hash of its
    stored source, compiler identity, flags and machine (recomputed, not trusted), so an
    artifact can only be installed under the key of the source it comes with;
  * the artifacts' kind matches the target; the graph verifies (serialize.load).
What it cannot verify: that an artifact is what that compiler makes of that source (only
rebuilding could tell, and builds are not byte-reproducible), nor who made the file.  A
crafted file can carry any native code consistent with itself; tessera loads that code
into the process when the model runs.  Hence: load only `.tsr` files you trust.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tessera.backend import cache
from tessera.backend.build import artifact_files
from tessera.errors import FileFormatError
from tessera.graph import serialize
from tessera.graph.flow_graph import FlowGraph
from tessera.tune import tuner

FORMAT, VERSION = "tessera.compiled", 2
_FIXED = ("graph.json", "constants.npz", "compiled.json")
_KINDS = {"cpu": "c", "cuda": "cuda"}
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_OPTIONS = ("cuda_graph", "tune", "optimize")
_MAX_TEXT = 100_000  # longest compiler / flags / machine / tuning text a valid file holds


def write(path: Path, graph: FlowGraph, target: str, options: Mapping[str, Any], artifacts: Iterable[Path],
          tuning: Iterable[tuple[str, str]]) -> None:  # fmt: skip
    """Write the file: the graph, the options, each artifact (a cache path) with its source, and
    the tuning records (key, winner); the file appears whole at `path` or not at all."""
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION, "target": target,
                           "options": {k: bool(options[k]) for k in _OPTIONS},
                           "artifacts": [], "tuning": [{"key": k, "best": b} for k, b in tuning]}  # fmt: skip
    members: dict[str, bytes] = {}
    for a in artifacts:
        meta = _entry_meta(Path(a))
        src_name, art_name = artifact_files(meta["kind"])
        doc["artifacts"].append({f: meta[f] for f in ("key", "kind", "compiler", "flags", "machine", "sha256")})
        members[f"artifacts/{meta['key']}/{src_name}"] = (Path(a).parent / src_name).read_bytes()
        members[f"artifacts/{meta['key']}/{art_name}"] = Path(a).read_bytes()
    tmp = path.with_name(path.name + ".partial")
    try:
        serialize.save(graph, tmp)
        with zipfile.ZipFile(tmp, "a") as z:
            for name, data in members.items():
                z.writestr(name, data)
            z.writestr("compiled.json", json.dumps(doc, indent=1))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _entry_meta(artifact: Path) -> dict:
    """The cache entry's meta.json, checked against the files (a damaged entry is not saved)."""
    try:
        meta = cache.describe(artifact)
        identity = cache.identity_of(meta)
        source = (artifact.parent / artifact_files(identity.kind)[0]).read_text()
        intact = cache.sha256_bytes(artifact.read_bytes()) == meta["sha256"] and identity.key(source) == meta["key"]
    except (OSError, ValueError, KeyError, TypeError):
        intact = False
    if not intact:
        raise FileFormatError(f"the cache entry {artifact.parent} is damaged; clear it (tessera.backend.cache.clear) "
                              "and compile the model again before saving")  # fmt: skip
    return meta


def read(path: Path) -> tuple[FlowGraph, dict]:
    """Verify the file, install its artifacts into the local cache and its tuning records (where
    this machine has none), and return the graph and compiled.json (target, options)."""
    try:
        with zipfile.ZipFile(path) as z:
            doc, artifacts, tuning = _read_verified(z, path)
    except zipfile.BadZipFile as exc:  # also a member whose CRC is wrong
        raise FileFormatError(f"{path}: not a readable compiled-graph file ({exc}); save it again") from None
    except OSError as exc:
        raise FileFormatError(f"{path}: cannot be read ({exc})") from None
    graph = serialize.load(path)
    for identity, source, data in artifacts:
        src_name, art_name = artifact_files(identity.kind)
        cache.install(identity, src_name, source, art_name, data)
    for key, best in tuning:
        if tuner.lookup(key) is None:  # a record tuned on this machine wins
            tuner.store(key, best)
    return graph, doc


def _read_verified(z: zipfile.ZipFile, path: Path) -> tuple[dict, list, list]:
    """compiled.json, the artifacts as (identity, source, bytes) and the tuning records, all
    checked; FileFormatError names the first problem."""

    def bad(problem: str) -> FileFormatError:
        return FileFormatError(f"{path}: {problem}; not a valid {FORMAT} v{VERSION} file (save it again)")

    names = z.namelist()
    if len(set(names)) != len(names):
        raise bad("duplicate member names")
    if "compiled.json" not in names:
        raise bad("missing member compiled.json")
    try:
        doc = json.loads(z.read("compiled.json"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise bad(f"compiled.json is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        found = (doc.get("format"), doc.get("version")) if isinstance(doc, dict) else type(doc).__name__
        raise bad(f"compiled.json declares {found}")
    target = doc.get("target")
    if target not in _KINDS:
        raise bad(f"target {target!r} is not 'cpu' or 'cuda'")
    options = doc.get("options")
    if not isinstance(options, dict) or set(options) != set(_OPTIONS) or not all(isinstance(v, bool) for v in options.values()):
        raise bad(f"options must be booleans {list(_OPTIONS)}, got {options!r}")
    entries, records = doc.get("artifacts"), doc.get("tuning")
    if not isinstance(entries, list) or not isinstance(records, list):
        raise bad("artifacts and tuning must be lists")
    expected = set(_FIXED)
    artifacts = []
    for i, e in enumerate(entries):
        fields = ("key", "kind", "compiler", "flags", "machine", "sha256")
        if not isinstance(e, dict) or set(e) != set(fields) or not all(isinstance(e[f], str) for f in fields):
            raise bad(f"artifact {i} must have exactly the string fields {list(fields)}")
        if not cache.is_key(e["key"]) or not _SHA256.match(e["sha256"]):
            raise bad(f"artifact {i}: malformed key or sha256")
        if e["kind"] != _KINDS[target]:
            raise bad(f"artifact {e['key']} is of kind {e['kind']!r}; a {target} model has {_KINDS[target]!r} artifacts")
        if max(len(e[f]) for f in ("compiler", "flags", "machine")) > _MAX_TEXT:
            raise bad(f"artifact {e['key']}: overlong identity")
        src_name, art_name = artifact_files(e["kind"])
        src_member, art_member = f"artifacts/{e['key']}/{src_name}", f"artifacts/{e['key']}/{art_name}"
        if src_member in expected:
            raise bad(f"artifact {e['key']} is listed twice")
        expected |= {src_member, art_member}
        for m in (src_member, art_member):
            if m not in names:
                raise bad(f"missing member {m}")
        try:
            source = z.read(src_member).decode("utf-8")
        except UnicodeDecodeError:
            raise bad(f"{src_member} is not UTF-8 text") from None
        data = z.read(art_member)
        if cache.sha256_bytes(data) != e["sha256"]:
            raise bad(f"{art_member} does not match its recorded sha256")
        identity = cache.Identity(e["kind"], e["compiler"], e["flags"], e["machine"])
        if identity.key(source) != e["key"]:
            raise bad(f"artifact key {e['key']} is not the hash of its source, compiler, flags and machine")
        artifacts.append((identity, source, data))
    unexpected = sorted(set(names) - expected)
    if unexpected:
        raise bad(f"unexpected member {unexpected[0]!r}")
    for m in _FIXED:
        if m not in names:
            raise bad(f"missing member {m}")
    tuning = []
    for i, r in enumerate(records):
        if not isinstance(r, dict) or set(r) != {"key", "best"} or not all(isinstance(r[f], str) for f in r):
            raise bad(f"tuning record {i} must have exactly the string fields ['key', 'best']")
        if max(len(r["key"]), len(r["best"])) > _MAX_TEXT:
            raise bad(f"tuning record {i} is overlong")
        tuning.append((r["key"], r["best"]))
    return doc, artifacts, tuning
