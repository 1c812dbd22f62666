"""`tessera cache list|size|verify|clear` over the artifact cache the compiler uses."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import tessera as ts
from tessera import f32
from tessera.backend import cache
from tessera.cli import main


@ts.kernel
def cache_add(a: f32["n"], b: f32["n"], c: f32["n"]):
    for i in ts.parallel(a.shape[0]):
        c[i] = a[i] + b[i]


@ts.kernel
def cache_scale(a: f32["n"], c: f32["n"]):
    for i in ts.parallel(a.shape[0]):
        c[i] = a[i] * 3.0


def _run_both(rng):
    a, b = rng.standard_normal(37).astype(np.float32), rng.standard_normal(37).astype(np.float32)
    c = np.empty_like(a)
    cache_add(a, b, c)
    np.testing.assert_allclose(c, a + b, rtol=1e-6)
    cache_scale(a, c)
    np.testing.assert_allclose(c, a * 3, rtol=1e-6)


def _fresh_kernels():
    # Kernel objects keep what they loaded; clearing the cache must not break new loads.
    for k in (cache_add, cache_scale):
        k._compiled = None


def _entry_of(name: str) -> cache.Entry:
    (entry,) = [e for e in cache.entries() if name in e.kernels]
    return entry


@pytest.mark.slow
def test_list_and_size(rng, cache_dir, capsys):
    _fresh_kernels()
    _run_both(rng)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "cache_add" in out and "cache_scale" in out and "2 entries" in out and str(cache_dir) in out
    entry = _entry_of("cache_add")
    assert entry.kind == "c" and entry.size > (entry.path / entry.artifact).stat().st_size
    assert main(["cache", "list", "--kind", "cuda"]) == 0
    assert "0 entries" in capsys.readouterr().out
    assert main(["cache", "size"]) == 0
    assert "(2 entries, 0 tuning records)" in capsys.readouterr().out
    assert cache.total_size() >= sum(e.size for e in cache.entries())


@pytest.mark.slow
def test_verify_finds_corrupt_and_mislabelled_entries(rng, cache_dir, capsys):
    _fresh_kernels()
    _run_both(rng)
    assert main(["cache", "verify"]) == 0
    assert "2 of 2 entries intact, 0 bad" in capsys.readouterr().out
    corrupt, relabelled = _entry_of("cache_add"), _entry_of("cache_scale")
    artifact = corrupt.path / corrupt.artifact
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    # A new file, not a rewrite in place: this process has the library mapped.
    (corrupt.path / "tmp").write_bytes(bytes(data))
    os.replace(corrupt.path / "tmp", artifact)
    meta = json.loads((relabelled.path / cache.META).read_text())
    meta["compiler"] += " (edited)"  # the key no longer hashes what the entry says it holds
    (relabelled.path / cache.META).write_text(json.dumps(meta))
    assert main(["cache", "verify"]) == 1
    out = capsys.readouterr().out
    assert "SHA-256 does not match" in out and corrupt.key[:12] in out
    assert "key is not the hash" in out and relabelled.key[:12] in out and "0 of 2 entries intact, 2 bad" in out
    assert main(["cache", "verify", "--remove"]) == 0
    assert cache.entries() == []
    _fresh_kernels()
    _run_both(rng)  # rebuilt
    assert len(cache.entries()) == 2


@pytest.mark.slow
def test_clear_older_than_and_all(rng, cache_dir, capsys):
    _fresh_kernels()
    _run_both(rng)
    from tessera.tune.tuner import store

    store("old-record", "a")
    store("new-record", "b")
    old = _entry_of("cache_add")
    ten_days_ago = time.time() - 10 * 86400
    os.utime(old.path / cache.META, (ten_days_ago, ten_days_ago))
    records = cache.tuning_records()
    os.utime(records[0], (ten_days_ago, ten_days_ago))
    assert main(["cache", "clear", "--older-than", "5"]) == 0
    assert "older than 5 days" in capsys.readouterr().out
    assert [e.kernels for e in cache.entries()] == [_entry_of("cache_scale").kernels]
    assert cache.tuning_records() == records[1:]
    indexed = [json.loads(p.read_text())["key"] for p in (cache_dir / "by-source").glob("*/*")]
    assert old.key not in indexed and len(indexed) == 1  # no index entry points at a removed entry
    assert main(["cache", "clear"]) == 0
    assert not cache_dir.exists() and "cleared everything" in capsys.readouterr().out
    _fresh_kernels()
    _run_both(rng)
    assert main(["cache", "size"]) == 0


@pytest.mark.parametrize("bad", ["-1", "soon", "nan", "inf"])
def test_clear_refuses_bad_days(bad, capsys):
    with pytest.raises(SystemExit) as info:
        main(["cache", "clear", "--older-than", bad])
    assert info.value.code == 2 and "number of days" in capsys.readouterr().err
