"""On-disk artifact cache: built libraries keyed by source, compiler version and flags.

Layout: <root>/<key[:2]>/<key>/{source file, artifact, meta.json}.  An entry is built in a
private temporary directory and published with one atomic rename, so concurrent processes
never see half-written entries; the loser of a race discards its copy.  meta.json records
the artifact's SHA-256, which is checked on every lookup: a corrupt entry is removed and
rebuilt rather than loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

ENV_VAR = "TESSERA_CACHE_DIR"


def cache_root() -> Path:
    """The cache directory: $TESSERA_CACHE_DIR, else ~/.cache/tessera."""
    root = os.environ.get(ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "tessera")
    return Path(root)


def cache_key(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _remove_entry(path: Path) -> None:
    trash = path.with_name(path.name + f".trash-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def lookup(key: str, artifact_name: str) -> Path | None:
    """The artifact for `key` if present and intact; a corrupt entry is removed."""
    entry = cache_root() / key[:2] / key
    artifact, meta = entry / artifact_name, entry / "meta.json"
    if not entry.is_dir():
        return None
    try:
        recorded = json.loads(meta.read_text())["sha256"]
        if _sha256_file(artifact) == recorded:
            return artifact
        reason = "checksum mismatch"
    except (OSError, ValueError, KeyError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    warnings.warn(f"tessera: removing corrupt cache entry {entry} ({reason}); it will be rebuilt", stacklevel=3)
    _remove_entry(entry)
    return None


def get_or_build(key: str, source_name: str, source: str, artifact_name: str,
                 build: Callable[[Path, Path], None]) -> Path:  # fmt: skip
    """Return the cached artifact for `key`, building it with build(source_path, artifact_path)."""
    found = lookup(key, artifact_name)
    if found is not None:
        return found
    parent = cache_root() / key[:2]
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=parent))
    try:
        src = tmp / source_name
        src.write_text(source)
        build(src, tmp / artifact_name)
        meta = {"sha256": _sha256_file(tmp / artifact_name), "key": key}
        (tmp / "meta.json").write_text(json.dumps(meta))
        return _publish(tmp, key, artifact_name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, key: str, artifact_name: str) -> Path:
    """Rename a complete entry folder into place (atomic; a concurrent twin wins harmlessly)."""
    final = cache_root() / key[:2] / key
    try:
        os.rename(tmp, final)
    except OSError:  # another process published the same entry first
        if lookup(key, artifact_name) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final / artifact_name


def install(key: str, artifact_name: str, files: dict[str, bytes]) -> Path:
    """Put a saved entry (artifact and meta.json, e.g. from a compiled-graph file) into the
    cache unless an intact copy is there; a corrupt one fails `lookup` later as usual."""
    found = lookup(key, artifact_name)
    if found is not None:
        return found
    parent = cache_root() / key[:2]
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        return _publish(tmp, key, artifact_name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def keep_failed_source(key: str, source_name: str, source: str) -> Path:
    """Save the source of a failed build where the user can inspect it."""
    d = cache_root() / "failed" / key
    d.mkdir(parents=True, exist_ok=True)
    path = d / source_name
    path.write_text(source)
    return path


def clear() -> None:
    """Delete the whole cache."""
    shutil.rmtree(cache_root(), ignore_errors=True)
