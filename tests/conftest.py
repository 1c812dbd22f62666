"""Shared fixtures: an isolated artifact cache per test and the `cuda` marker's skip."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test builds into its own cache under tmp_path, never ~/.cache/tessera."""
    d = tmp_path / "tessera-cache"
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(d))
    return d


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name: fresh data per test, reproducible runs."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _cuda_available() -> bool:
    try:
        from tessera.runtime import is_available
    except Exception:  # noqa: BLE001  (cuda-python missing or broken)
        return False
    try:
        return bool(is_available())
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tessera.runtime.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
