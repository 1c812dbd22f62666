"""A small, generic tuner (Hidet's approach: a hardware-centric candidate list, not a search).

`tune(key, candidates, build, bench)` compiles every candidate with `build` in a thread pool
(nvcc runs as subprocesses, so threads overlap the compiles), times each built candidate with
`bench`, and records the winner under the tuning cache (next to the artifact cache) keyed
by `key`.  A later call with the same key returns the recorded winner without compiling or
timing anything.  Candidates that fail to build are skipped with a warning; if all fail the
first error is raised.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from tessera.backend.cache import cache_key, cache_root

C = TypeVar("C")


@dataclass
class TuningRecord(Generic[C]):
    """The outcome of one tuning run: the winner and every candidate's time (µs)."""

    best: C
    times_us: dict[str, float]
    from_cache: bool


def _record_path(key: str) -> Path:
    return cache_root() / "tuning" / f"{cache_key(key)}.json"


def _load(key: str, by_name: dict[str, C]) -> C | None:
    path = _record_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key and data.get("best") in by_name:
            return by_name[data["best"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        warnings.warn(f"tessera: ignoring an unreadable tuning record {path}; it will be re-tuned", stacklevel=3)
    return None


def _store(key: str, best: str, times: dict[str, float]) -> None:
    path = _record_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump({"key": key, "best": best, "times_us": times}, f, indent=1)
    os.replace(f.name, path)  # atomic: concurrent tuners never see half a record


def tune(
    key: str,
    candidates: Sequence[C],
    build: Callable[[C], Any],
    bench: Callable[[C, Any], float],
    workers: int | None = None,
) -> TuningRecord[C]:
    """Pick the fastest candidate for `key`.

    `build(c)` compiles candidate c (may run in a worker thread) and returns what `bench`
    needs; `bench(c, built)` returns its time in µs (called in this thread, one at a time).
    Candidates are identified by `str(c)`, which must be unique.
    """
    if not candidates:
        raise ValueError(f"tune({key!r}): no candidates")
    by_name = {str(c): c for c in candidates}
    if len(by_name) != len(candidates):
        raise ValueError(f"tune({key!r}): candidate names (str) must be unique")
    cached = _load(key, by_name)
    if cached is not None:
        return TuningRecord(cached, {}, True)
    built: dict[str, Any] = {}
    errors: list[tuple[str, BaseException]] = []

    def attempt(c: C) -> None:
        try:
            built[str(c)] = build(c)
        except Exception as exc:  # noqa: BLE001  (one bad candidate must not stop tuning)
            errors.append((str(c), exc))

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        list(pool.map(attempt, candidates))
    if not built:
        name, exc = errors[0]
        raise RuntimeError(f"tune({key!r}): all {len(candidates)} candidates failed; first ({name}): {exc}") from exc
    for name, exc in errors:
        warnings.warn(f"tessera: tuning {key!r}: candidate {name} failed to build: {exc}", stacklevel=2)
    times = {name: float(bench(by_name[name], b)) for name, b in built.items()}
    best = min(times, key=times.__getitem__)
    _store(key, best, times)
    return TuningRecord(by_name[best], times, False)
