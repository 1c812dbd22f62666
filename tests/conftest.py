"""Shared fixtures: an isolated artifact cache per test and the `cuda` marker's skip."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test builds into its own cache under tmp_path, never ~/.cache/tessera; and tunes
    nothing unless it asks (tune=True): with a fresh cache per test, the default (tuning on)
    would time every GEMM's schedule space again in every test."""
    d = tmp_path / "tessera-cache"
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(d))
    monkeypatch.setenv("TESSERA_TUNE", "0")
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
