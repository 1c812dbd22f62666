"""Shared fixtures: the artifact cache (one per run, or a fresh one per test that asks), the rng
and the `cuda` marker's skip."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest


def pytest_addoption(parser):
    parser.addoption("--artifact-cache", default=None, metavar="DIR",
                     help="the artifact cache the tests share (default: a fresh one per run, shared by the "
                          "xdist workers); a test that asks for the cache_dir fixture still gets its own")  # fmt: skip


@pytest.fixture(scope="session")
def shared_cache_dir(request, tmp_path_factory):
    """One artifact cache for the whole run: most tests build the same small kernels (a tiny
    Llama's, the row templates'), and the cache is safe for concurrent processes (atomic renames),
    so sharing it across tests and xdist workers saves the repeated gcc runs."""
    chosen = request.config.getoption("--artifact-cache")
    if chosen:
        return Path(chosen)
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' base directories are siblings of one run's directory
    return base / "tessera-shared-cache"


@pytest.fixture(autouse=True)
def _artifact_cache(shared_cache_dir, monkeypatch):
    """Every test builds into the run's shared cache, never ~/.cache/tessera; and tunes nothing
    unless it asks (tune=True): the default (tuning on) would time every GEMM's schedule space."""
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(shared_cache_dir))
    monkeypatch.setenv("TESSERA_TUNE", "0")
    return shared_cache_dir


@pytest.fixture
def cache_dir(_artifact_cache, tmp_path, monkeypatch):
    """A fresh, empty artifact cache of this test's own: for tests of caching itself (hits,
    misses, corruption, what a build writes), which a cache warmed by other tests would fool."""
    d = tmp_path / "tessera-cache"
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(d))
    return d


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name: fresh data per test, reproducible runs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _cuda_unavailable_reason() -> str | None:
    """None when a CUDA GPU is usable, else why not."""
    try:
        from tessera.runtime import is_available

        return None if is_available() else "tessera.runtime.is_available() is False"
    except Exception as exc:  # noqa: BLE001  (cuda-python missing or broken)
        return f"{type(exc).__name__}: {exc}"


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    reason = _cuda_unavailable_reason()
    if reason is None:
        return
    if "cuda" in (config.getoption("markexpr") or "") and "not cuda" not in config.getoption("markexpr"):
        # The GPU tier was asked for by name: skipping it all would report success without a GPU.
        raise pytest.UsageError(f"-m cuda selects the GPU tier, but no CUDA GPU is usable ({reason})")
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU ({reason})")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
