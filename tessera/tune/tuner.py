"""A small, generic tuner (Hidet's approach: a hardware-centric candidate list, not a search).

`tune(key, candidates, build, bench, check=..., template=...)` compiles every candidate with
`build` in a thread pool (nvcc runs as subprocesses, so threads overlap the compiles), runs
each built candidate once through `check` against a reference, times the ones that compute
the right result with `bench`, and records the winner under the tuning cache (next to the
artifact cache).  A candidate that fails to build, raises (faults) or computes a wrong result
is skipped with a warning, never chosen; when none is left, `TuningError` says why each failed.
A fault that corrupts the process (a CUDA illegal address poisons the context) cannot be
caught here: candidates are expected to be memory-safe, only possibly wrong.

The record is keyed by `key` AND a hash of `template` (the source text the candidates are
generated from), so editing a template never reuses a winner timed on its older version.
A later call with the same key and template returns the recorded winner without compiling,
checking or timing anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from tessera.backend.cache import cache_key, cache_root, sha256_bytes
from tessera.errors import TuningError
from tessera.progress import bar

C = TypeVar("C")
log = logging.getLogger("tessera")

# (record key, winner's name) of every tune() call made inside `recording()`.
_RECORDING: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar("tessera_tuning", default=None)


@dataclass
class TuningRecord(Generic[C]):
    """The outcome of one tuning run: the winner and every checked candidate's time (µs)."""

    best: C
    times_us: dict[str, float]
    from_cache: bool
    rejected: dict[str, str] | None = None  # candidate name -> why it was skipped


def record_key(key: str, template: str) -> str:
    """The key a tuning record is stored under: the caller's key and the template's hash."""
    return f"{key}|template={sha256_bytes(template.encode())[:16]}"


def _record_path(full_key: str) -> Path:
    return cache_root() / "tuning" / f"{cache_key(full_key)}.json"


def lookup(full_key: str) -> str | None:
    """The winner's name recorded for `full_key` (a `record_key`), or None."""
    path = _record_path(full_key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") == full_key and isinstance(data.get("best"), str):
            return data["best"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        log.warning("tessera: ignoring an unreadable tuning record %s; it will be re-tuned", path)
    return None


def _load(full_key: str, by_name: dict[str, C]) -> C | None:
    best = lookup(full_key)
    return by_name.get(best) if best is not None else None


def recorded(key: str, candidates: Sequence[C], template: str) -> C | None:
    """The candidate a tuning record chose for `key` (as `tune` would return it, and noted for
    `recording` likewise), or None when there is no record: a caller that must not block on
    tuning uses its own default then."""
    full_key = record_key(key, template)
    found = _load(full_key, {str(c): c for c in candidates})
    if found is not None:
        _note(full_key, str(found))
    return found


def store(full_key: str, best: str, times: dict[str, float] | None = None) -> None:
    """Write the record choosing `best` for `full_key` (a `record_key`), atomically."""
    if not isinstance(full_key, str) or not isinstance(best, str):
        raise TypeError("a tuning record's key and winner are strings")
    path = _record_path(full_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump({"key": full_key, "best": best, "times_us": times or {}}, f, indent=1)
    os.replace(f.name, path)  # atomic: concurrent tuners never see half a record


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, str]]]:
    """Collect (record key, winner) of every tune() call in this context (this thread or task),
    e.g. to ship the records with a saved model so that loading it re-tunes nothing."""
    found: list[tuple[str, str]] = []
    token = _RECORDING.set(found)
    try:
        yield found
    finally:
        _RECORDING.reset(token)


def _note(full_key: str, best: str) -> None:
    found = _RECORDING.get()
    if found is not None:
        found.append((full_key, best))


CONFIRM_CANDIDATES = 4  # the fastest few, when within CONFIRM_MARGIN of the best, are timed again
CONFIRM_MARGIN = 1.15
CONFIRM_ROUNDS = 4


def _confirm(times: dict[str, float], bench: Callable[[str], float]) -> None:
    """Time the candidates close to the fastest again, round-robin, and keep each one's median.

    One timing of a kernel of a few µs varies by 10-20% between runs (H200, 2026-11-23: the
    same model measured 0.33 and 0.44 ms with different tuned picks); the winner of one pass
    over the space is then partly the luckiest candidate.  Interleaving the rounds spreads
    clock drift over all of them."""
    fastest = min(times.values())
    close = [n for n in sorted(times, key=times.__getitem__)[:CONFIRM_CANDIDATES] if times[n] <= fastest * CONFIRM_MARGIN]
    if len(close) < 2:
        return
    samples = {n: [times[n]] for n in close}
    for _ in range(CONFIRM_ROUNDS):
        for n in close:
            samples[n].append(bench(n))
    for n in close:
        times[n] = statistics.median(samples[n])


def tune(
    key: str,
    candidates: Sequence[C],
    build: Callable[[C], Any],
    bench: Callable[[C, Any], float],
    *,
    check: Callable[[C, Any], str | None],
    template: str,
    workers: int | None = None,
) -> TuningRecord[C]:
    """Pick the fastest correct candidate for `key`.

    `build(c)` compiles candidate c (may run in a worker thread) and returns what the others
    need; `check(c, built)` runs it once and returns None when its result matches the
    reference, else what is wrong (raising counts as a fault); `bench(c, built)` returns its
    time in µs.  check and bench are called in this thread, one candidate at a time.
    `template` is the source the candidates come from (its hash is part of the record key).
    Candidates are identified by `str(c)`, which must be unique.
    """
    if not candidates:
        raise ValueError(f"tune({key!r}): no candidates")
    by_name = {str(c): c for c in candidates}
    if len(by_name) != len(candidates):
        raise ValueError(f"tune({key!r}): candidate names (str) must be unique")
    full_key = record_key(key, template)
    cached = _load(full_key, by_name)
    if cached is not None:
        _note(full_key, str(cached))
        return TuningRecord(cached, {}, True)
    built: dict[str, Any] = {}
    rejected: dict[str, str] = {}

    def attempt(c: C) -> None:
        try:
            built[str(c)] = build(c)
        except Exception as exc:  # noqa: BLE001  (one bad candidate must not stop tuning)
            rejected[str(c)] = f"failed to build: {type(exc).__name__}: {exc}"

    shown = bar(total=2 * len(candidates), desc=f"tuning {key}: building {len(candidates)} candidates", unit="step")
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        for _ in pool.map(attempt, candidates):
            shown.update()
    shown.set_description_str(f"tessera: tuning {key}: checking and timing")
    times: dict[str, float] = {}
    for c in candidates:  # candidate order: deterministic logs and ties
        name = str(c)
        shown.update()
        if name not in built:
            continue
        try:
            wrong = check(c, built[name])
            if wrong is None:
                times[name] = float(bench(c, built[name]))
            else:
                rejected[name] = f"wrong result: {wrong}"
        except Exception as exc:  # noqa: BLE001  (a faulting candidate is skipped, not fatal)
            rejected[name] = f"raised {type(exc).__name__}: {exc}"
    shown.close()
    for name in by_name:
        if name in rejected:
            log.warning("tessera: tuning %r: skipping candidate %s, which %s", key, name, rejected[name])
    if not times:
        reasons = "; ".join(f"{n}: {r}" for n, r in list(rejected.items())[:5])
        raise TuningError(f"tune({key!r}): all {len(candidates)} candidates failed ({reasons}"
                          f"{'; ...' if len(rejected) > 5 else ''})")  # fmt: skip
    _confirm(times, lambda name: float(bench(by_name[name], built[name])))
    best = min(times, key=times.__getitem__)
    store(full_key, best, times)
    _note(full_key, best)
    return TuningRecord(by_name[best], times, False, rejected)
