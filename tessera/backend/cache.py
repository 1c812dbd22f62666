"""On-disk artifact cache: built libraries keyed by source, compiler identity, flags and machine.

Layout: <root>/<key[:2]>/<key>/{source file, artifact, meta.json}.  An entry is built in a
private temporary directory and published with one atomic rename, so concurrent processes
never see half-written entries; the loser of a race discards its copy.  meta.json records
the artifact's SHA-256 and the entry's `Identity` (what the key is a hash of, besides the
source), so an entry describes itself; the SHA-256 is checked on every lookup: a corrupt
entry is removed and rebuilt rather than loaded.

Besides the key (which includes the compiler's version), every entry is indexed by its
*source identity* -- kind, source, flags and machine, no compiler --
under <root>/by-source/.  That index is used only when no compiler is available: a machine
without gcc or nvcc can still run kernels whose artifacts it holds (e.g. installed from a
compiled-graph file), while a machine with a compiler never reuses an artifact built by
another compiler version.

Keys and file names are validated before they become paths (`check_key`, `check_name`):
keys may come from files (tessera.graph.compiler.saved) and must never leave the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera import settings

_KEY = re.compile(r"[0-9a-f]{40}\Z")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}\Z")
META = "meta.json"
ENTRY_FORMAT = "entry-v2"  # meta.json records the Identity


def cache_root() -> Path:
    """The cache directory: $TESSERA_CACHE_DIR, else ~/.cache/tessera."""
    return settings.cache_dir()


def cache_key(*parts: str) -> str:
    """The hash of `parts` in the cache's key format (40 lowercase hex digits)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def is_key(key: object) -> bool:
    return isinstance(key, str) and _KEY.match(key) is not None


def check_key(key: object) -> str:
    """`key` if it has the cache's key format, else ValueError (it would become a path)."""
    if not is_key(key):
        raise ValueError(f"not an artifact cache key (40 lowercase hex digits): {key!r}")
    return key  # type: ignore[return-value]


def check_name(name: object) -> str:
    """`name` if it is a plain file name an entry may hold (no separators, no leading dot)."""
    if not isinstance(name, str) or _NAME.match(name) is None or name == META:
        raise ValueError(f"not a valid artifact file name: {name!r}")
    return name


@dataclass(frozen=True)
class Identity:
    """Everything an artifact is built from besides its source: the kind ("c" or "cuda"), the
    compiler's identity (its `--version` text), the flags and the machine ("" where the flags
    name the target, as CUDA's -gencode does; the CPU model for gcc's -march=native)."""

    kind: str
    compiler: str
    flags: str
    machine: str

    def key(self, source: str) -> str:
        """The cache key: a hash of source, compiler identity, flags and machine (and the
        entry format, so entries of older tessera versions, without an identity, never match)."""
        return cache_key(ENTRY_FORMAT, self.kind, source, self.compiler, self.flags, self.machine)

    def source_key(self, source: str) -> str:
        """The index key: the same without the compiler (see the module docstring)."""
        return source_key(self.kind, source, self.flags, self.machine)


def source_key(kind: str, source: str, flags: str, machine: str) -> str:
    return cache_key("by-source", kind, source, flags, machine)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    return sha256_bytes(path.read_bytes())


def _entry(key: str) -> Path:
    return cache_root() / check_key(key)[:2] / key


def _remove_entry(path: Path) -> None:
    trash = path.with_name(path.name + f".trash-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def lookup(key: str, artifact_name: str) -> Path | None:
    """The artifact for `key` if present and intact; a corrupt entry is removed."""
    entry = _entry(key)
    artifact, meta = entry / check_name(artifact_name), entry / META
    if not entry.is_dir():
        return None
    try:
        recorded = json.loads(meta.read_text())["sha256"]
        if _sha256_file(artifact) == recorded:
            return artifact
        reason = "checksum mismatch"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    warnings.warn(f"tessera: removing corrupt cache entry {entry} ({reason}); it will be rebuilt", stacklevel=3)
    _remove_entry(entry)
    return None


def describe(artifact: Path) -> dict:
    """The meta.json of the entry holding `artifact` (sha256, key, identity, file names)."""
    return json.loads((Path(artifact).parent / META).read_text())


def get_or_build(identity: Identity, source_name: str, source: str, artifact_name: str,
                 build: Callable[[Path, Path], None]) -> Path:  # fmt: skip
    """Return the cached artifact of `source` built for `identity`, building it with
    build(source_path, artifact_path) when the cache lacks it."""
    key = identity.key(source)
    found = lookup(key, artifact_name)
    if found is not None:
        return found
    tmp = _private_dir(key)
    try:
        src = tmp / check_name(source_name)
        src.write_text(source)
        build(src, tmp / check_name(artifact_name))
        _write_meta(tmp, key, identity, source_name, artifact_name)
        return _publish(tmp, key, artifact_name, identity.source_key(source))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def install(identity: Identity, source_name: str, source: str, artifact_name: str, artifact: bytes) -> Path:
    """Put a prebuilt artifact of `source` (e.g. from a compiled-graph file) into the cache
    under the key `identity` gives it, unless an intact copy is there.  The caller vouches for
    the bytes: nothing here can tell whether they are what the compiler makes of `source`."""
    key = identity.key(source)
    found = lookup(key, artifact_name)
    if found is not None:
        _index(identity.source_key(source), key, artifact_name)
        return found
    tmp = _private_dir(key)
    try:
        (tmp / check_name(source_name)).write_text(source)
        (tmp / check_name(artifact_name)).write_bytes(artifact)
        _write_meta(tmp, key, identity, source_name, artifact_name)
        return _publish(tmp, key, artifact_name, identity.source_key(source))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def lookup_source(kind: str, source: str, flags: str, machine: str, artifact_name: str) -> Path | None:
    """An intact artifact of `source` built with these flags for this machine by any compiler
    (the fallback when no compiler is available), or None."""
    path = _index_path(source_key(kind, source, flags, machine))
    try:
        doc = json.loads(path.read_text())
        key, name = doc["key"], doc["artifact"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not is_key(key) or name != artifact_name:
        return None
    return lookup(key, artifact_name)


def _private_dir(key: str) -> Path:
    parent = _entry(key).parent
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=parent))


def _write_meta(entry: Path, key: str, identity: Identity, source_name: str, artifact_name: str) -> None:
    meta = {"key": key, "sha256": _sha256_file(entry / artifact_name), "source": source_name,
            "artifact": artifact_name, **asdict(identity)}  # fmt: skip
    (entry / META).write_text(json.dumps(meta, indent=1))


def _publish(tmp: Path, key: str, artifact_name: str, by_source: str) -> Path:
    """Rename a complete entry folder into place (atomic; a concurrent twin wins harmlessly)."""
    final = _entry(key)
    try:
        os.rename(tmp, final)
    except OSError:  # another process published the same entry first
        if lookup(key, artifact_name) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    _index(by_source, key, artifact_name)
    return final / artifact_name


def _index_path(by_source: str) -> Path:
    return cache_root() / "by-source" / check_key(by_source)[:2] / by_source


def _index(by_source: str, key: str, artifact_name: str) -> None:
    """Point the source index at `key` (atomically: readers see the old or the new entry)."""
    path = _index_path(by_source)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump({"key": check_key(key), "artifact": check_name(artifact_name)}, f)
    os.replace(f.name, path)


def keep_failed_source(key: str, source_name: str, source: str) -> Path:
    """Save the source of a failed build where the user can inspect it."""
    d = cache_root() / "failed" / check_key(key)
    d.mkdir(parents=True, exist_ok=True)
    path = d / check_name(source_name)
    path.write_text(source)
    return path


def identity_of(meta: Mapping) -> Identity:
    """The Identity recorded in an entry's meta.json (KeyError/TypeError when it has none)."""
    fields = {f: meta[f] for f in ("kind", "compiler", "flags", "machine")}
    if not all(isinstance(v, str) for v in fields.values()):
        raise TypeError(f"identity fields must be strings: {fields}")
    return Identity(**fields)


def clear(older_than_days: float | None = None) -> int:
    """Delete the whole cache, or with `older_than_days` only the artifact entries, tuning
    records and kept failed sources written more than that many days ago.  Returns how many
    bytes were freed.  Safe while other processes use the cache: entries leave by an atomic
    rename, so a reader finds an entry whole or not at all (and then rebuilds it)."""
    root = cache_root()
    if older_than_days is None:
        freed = _tree_size(root)
        shutil.rmtree(root, ignore_errors=True)
        return freed
    if older_than_days < 0:
        raise ValueError(f"older_than_days must be >= 0, got {older_than_days}")
    limit = time.time() - older_than_days * 86400
    freed = 0
    for entry in entries():
        if entry.created < limit:
            freed += entry.size
            _remove_entry(entry.path)
    for folder in (root / "tuning", root / "failed"):
        for path in sorted(folder.glob("*")) if folder.is_dir() else []:
            try:
                if path.stat().st_mtime < limit:
                    size = _tree_size(path)
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                    freed += size
            except OSError:  # removed meanwhile by another process
                continue
    _drop_dangling_index()
    return freed


@dataclass(frozen=True)
class Entry:
    """One artifact in the cache, as `entries()` finds it."""

    key: str
    path: Path
    kind: str  # "c" or "cuda" (from meta.json; "?" when it is unreadable)
    artifact: str
    size: int  # bytes of the whole entry (source, artifact, meta.json)
    created: float  # when it was published (meta.json's mtime, seconds since the epoch)
    kernels: tuple[str, ...]  # the exported kernels, without the ts_kernel_ prefix


_KERNEL = re.compile(r"\bts_kernel_(\w+)\s*\(")


def entries() -> list[Entry]:
    """Every published artifact entry, oldest first (temporary and trash folders are skipped)."""
    root = cache_root()
    found = []
    for shard in sorted(root.glob("[0-9a-f][0-9a-f]")) if root.is_dir() else []:
        for path in sorted(shard.iterdir()):
            if not is_key(path.name) or not path.is_dir():
                continue
            try:
                meta = json.loads((path / META).read_text())
                kind, artifact, source = str(meta.get("kind", "?")), str(meta["artifact"]), str(meta["source"])
                created = (path / META).stat().st_mtime
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                kind, artifact, source, created = "?", "?", "", _mtime(path)
            kernels: tuple[str, ...] = ()
            if source:
                try:
                    kernels = tuple(dict.fromkeys(_KERNEL.findall((path / check_name(source)).read_text(errors="replace"))))
                except (OSError, ValueError):
                    pass
            found.append(Entry(path.name, path, kind, artifact, _tree_size(path), created, kernels))
    return sorted(found, key=lambda e: e.created)


def verify() -> list[tuple[Entry, str]]:
    """Check every entry: its artifact's SHA-256 against meta.json, and that its key is the hash
    of its stored source and recorded identity.  Returns (entry, problem) for each bad one; the
    compiler would remove and rebuild such an entry at its next lookup."""
    bad = []
    for entry in entries():
        try:
            meta = json.loads((entry.path / META).read_text())
            artifact = entry.path / check_name(meta["artifact"])
            source = (entry.path / check_name(meta["source"])).read_text()
            if _sha256_file(artifact) != meta["sha256"]:
                bad.append((entry, f"{artifact.name}: SHA-256 does not match meta.json (corrupt or modified)"))
            elif meta.get("key") != entry.key or identity_of(meta).key(source) != entry.key:
                bad.append((entry, "the key is not the hash of the stored source and compiler identity"))
        except FileNotFoundError as exc:
            bad.append((entry, f"missing file {Path(exc.filename or '?').name}"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            bad.append((entry, f"unreadable meta.json or files ({type(exc).__name__}: {exc})"))
    return bad


def remove(entry: Entry) -> None:
    """Remove one entry (atomically, as a corrupt entry is removed at lookup)."""
    _remove_entry(entry.path)


def tuning_records() -> list[Path]:
    """The tuning records (tessera.tune) stored next to the artifacts."""
    folder = cache_root() / "tuning"
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def total_size() -> int:
    """Bytes under the cache directory, everything included."""
    return _tree_size(cache_root())


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _drop_dangling_index() -> None:
    """Remove source-index files whose entry is gone."""
    folder = cache_root() / "by-source"
    for path in folder.glob("*/*") if folder.is_dir() else []:
        try:
            key = json.loads(path.read_text())["key"]
            if not _entry(key).is_dir():
                path.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            continue
