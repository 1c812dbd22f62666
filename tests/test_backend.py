"""Building generated code: the artifact cache, compiler errors and nvcc.

Every test gets its own cache directory (the autouse `cache_dir` fixture in conftest.py).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import tessera as ts
from tessera import f16, f32, f64
from tessera.backend import build, cache
from tessera.backend.build import build_c, build_cuda, find_compiler


def scale_add(a: f32["n"], b: f32["n"], out: f32["n"]):
    for i in ts.parallel(a.shape[0]):
        out[i] = a[i] * 3.0 + b[i]


def check_scale_add(kernel: ts.Kernel, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(101).astype(np.float32)
    b = rng.standard_normal(101).astype(np.float32)
    out = np.full(101, np.nan, np.float32)
    kernel(a, b, out)
    np.testing.assert_allclose(out, a * np.float32(3) + b, rtol=1e-6)


def entries(cache_dir: Path) -> list[Path]:
    """Everything in the cache's two-level layout (published entries and any leftovers)."""
    return sorted(p for d in cache_dir.iterdir() if d.is_dir() and d.name not in ("failed", "by-source") for p in d.iterdir())


class CountingRun:
    """Wraps subprocess.run and records the commands it is given."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, cmd, *args, **kwargs):
        self.calls.append(list(cmd))
        return self.real(cmd, *args, **kwargs)

    def compiles(self) -> int:
        return sum(1 for c in self.calls if "--version" not in c)


@pytest.fixture
def counting_run(monkeypatch):
    counter = CountingRun(subprocess.run)
    monkeypatch.setattr(build.subprocess, "run", counter)
    return counter


# ---- the cache -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_builds_go_to_the_configured_cache(cache_dir):
    path = Path(ts.Kernel(scale_add).build())
    assert cache_dir in path.parents
    assert path.name == "kernel.so" and path.is_file()
    entry = path.parent
    assert (entry / "kernel.c").read_text() == ts.Kernel(scale_add).source_full
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["key"] == entry.name and len(meta["sha256"]) == 64


@pytest.mark.slow
def test_second_build_is_a_cache_hit(cache_dir, counting_run):
    k1 = ts.Kernel(scale_add)
    path1 = Path(k1.build())
    assert counting_run.compiles() == 1
    stat1 = path1.stat()

    counting_run.calls.clear()
    k2 = ts.Kernel(scale_add)  # a fresh kernel object: nothing cached in memory
    path2 = Path(k2.build())
    assert path2 == path1
    assert counting_run.compiles() == 0, counting_run.calls
    assert path2.stat().st_mtime_ns == stat1.st_mtime_ns and path2.stat().st_ino == stat1.st_ino
    check_scale_add(k2)
    assert counting_run.compiles() == 0
    assert len(entries(cache_dir)) == 1


@pytest.mark.slow
def test_cache_key_covers_source_and_flags(cache_dir, counting_run, monkeypatch):
    path1 = Path(ts.Kernel(scale_add).build())

    def other(a: f32["n"], b: f32["n"], out: f32["n"]):
        for i in ts.parallel(a.shape[0]):
            out[i] = a[i] * 4.0 + b[i]

    path2 = Path(ts.Kernel(other).build())
    monkeypatch.setattr(build, "C_FLAGS", [*build.C_FLAGS, "-DTESSERA_TEST_FLAG=1"])
    path3 = Path(ts.Kernel(scale_add).build())
    assert len({path1, path2, path3}) == 3
    assert counting_run.compiles() == 3


@pytest.mark.parametrize("damage", ["overwrite", "truncate", "delete", "bad_meta", "no_meta"])
@pytest.mark.slow
def test_corrupt_entry_is_detected_and_rebuilt(cache_dir, counting_run, damage):
    path = Path(ts.Kernel(scale_add).build())  # built, not loaded: no stale handle in this process
    good = path.read_bytes()
    meta = path.parent / "meta.json"
    if damage == "overwrite":
        path.write_bytes(b"\x7fELF" + bytes(len(good) - 4))  # same size, different content
    elif damage == "truncate":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "delete":
        path.unlink()
    elif damage == "bad_meta":
        meta.write_text("{not json")
    else:
        meta.unlink()

    counting_run.calls.clear()
    k = ts.Kernel(scale_add)
    with pytest.warns(UserWarning, match="corrupt cache entry"):
        rebuilt = Path(k.build())
    assert rebuilt == path
    assert counting_run.compiles() == 1
    assert json.loads(meta.read_text())["sha256"] == cache._sha256_file(rebuilt)
    check_scale_add(k)
    assert not [p for p in entries(cache_dir) if ".trash-" in p.name or ".tmp-" in p.name]


def test_losing_a_publish_race_uses_the_winners_entry(cache_dir):
    """Simulate another process publishing the same entry while this one is building."""
    identity = cache.Identity("c", "race-test", "", "")
    key = identity.key("source")
    built = []

    def winner(src: Path, out: Path) -> None:
        out.write_bytes(b"winner")

    def loser(src: Path, out: Path) -> None:
        built.append(cache.get_or_build(identity, "s.txt", "source", "artifact.bin", winner))
        out.write_bytes(b"loser")

    result = cache.get_or_build(identity, "s.txt", "source", "artifact.bin", loser)
    assert result == built[0]
    assert result.read_bytes() == b"winner"
    assert [p.name for p in entries(cache_dir)] == [key]


def _concurrent_worker(cache_dir: str, barrier, results) -> None:
    os.environ["TESSERA_CACHE_DIR"] = cache_dir
    try:
        k = ts.Kernel(scale_add)
        k.source  # noqa: B018  (parse and generate code before the race starts)
        barrier.wait(timeout=30)
        path = k.build()
        check_scale_add(k, seed=os.getpid())
        results.put(("ok", path))
    except BaseException as exc:  # noqa: BLE001  (report every failure to the parent)
        results.put(("error", repr(exc)))


@pytest.mark.parametrize("round_", range(2))
@pytest.mark.slow
def test_concurrent_builds_from_two_processes(cache_dir, round_):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_worker, args=(str(cache_dir), barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert [o[0] for o in outcomes] == ["ok", "ok"], outcomes
    assert outcomes[0][1] == outcomes[1][1]
    # exactly one intact, published entry; no temporary or trash directories left behind
    (entry,) = entries(cache_dir)
    assert cache.lookup(entry.name, "kernel.so") == Path(outcomes[0][1])
    check_scale_add(ts.Kernel(scale_add))


# ---- compiler failures ---------------------------------------------------------------------------------------


def test_gcc_failure_reports_log_and_source(cache_dir, monkeypatch):
    monkeypatch.setattr(build, "C_FLAGS", [*build.C_FLAGS, "-fthis-flag-does-not-exist"])
    k = ts.Kernel(scale_add)
    with pytest.raises(ts.CompilationError) as info:
        k(np.ones(3, np.float32), np.ones(3, np.float32), np.ones(3, np.float32))
    err = info.value
    text = str(err)
    assert err.compiler == "gcc"
    assert "-fthis-flag-does-not-exist" in err.log  # gcc's own complaint
    assert err.log.strip() in text
    assert err.source_path in text
    src = Path(err.source_path)
    assert src.is_file() and src.read_text() == k.source_full
    assert cache_dir in src.parents
    assert "-fthis-flag-does-not-exist" in " ".join(err.command)
    # nothing half-built was published or left behind
    assert entries(cache_dir) == []


def test_invalid_c_source_reports_the_error_line(cache_dir):
    source = "int f(void) {\n  return undeclared_variable;\n}\n"
    with pytest.raises(ts.CompilationError) as info:
        build_c(source)
    err = info.value
    assert "undeclared_variable" in err.log and "error" in err.log
    assert "undeclared_variable" in str(err)
    assert Path(err.source_path).read_text() == source
    assert entries(cache_dir) == []


@pytest.mark.slow
def test_compiler_from_environment(monkeypatch, tmp_path):
    gcc = shutil.which("gcc")
    monkeypatch.setenv("TESSERA_CC", gcc)
    assert find_compiler("gcc", "TESSERA_CC") == gcc
    monkeypatch.setenv("TESSERA_CC", "gcc")  # a command name is looked up on PATH
    assert find_compiler("gcc", "TESSERA_CC") == gcc
    check_scale_add(ts.Kernel(scale_add))


@pytest.mark.parametrize("value", ["/nonexistent/bin/gcc", "no-such-compiler-xyz", "not-executable"])
def test_missing_compiler_from_environment(monkeypatch, tmp_path, value, cache_dir):
    if value == "not-executable":
        f = tmp_path / "gcc"
        f.write_text("#!/bin/sh\nexit 0\n")
        f.chmod(0o644)
        value = str(f)
    monkeypatch.setenv("TESSERA_CC", value)
    with pytest.raises(ts.CompilerNotFoundError, match="TESSERA_CC"):
        find_compiler("gcc", "TESSERA_CC")
    with pytest.raises(ts.CompilerNotFoundError, match=value.replace(".", r"\.")):
        ts.Kernel(scale_add).build()
    monkeypatch.setenv("TESSERA_NVCC", value)
    with pytest.raises(ts.CompilerNotFoundError, match="TESSERA_NVCC"):
        build_cuda("__global__ void k() {}")


def test_compiler_not_on_path(monkeypatch, tmp_path, cache_dir):
    monkeypatch.delenv("TESSERA_CC", raising=False)
    monkeypatch.delenv("TESSERA_NVCC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory
    with pytest.raises(ts.CompilerNotFoundError, match="gcc was not found"):
        ts.Kernel(scale_add).build()
    with pytest.raises(ts.CompilerNotFoundError, match="nvcc was not found"):
        build_cuda("__global__ void k() {}")


# ---- nvcc -----------------------------------------------------------------------------------------------------

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def cuda_narrow(a: f64["n"], h: f16["n"], half: f32["n"]):
    ts.attrs.grid = ts.ceil_div(a.shape[0], 128)
    ts.attrs.block = 128
    i = ts.block_idx.x * 128 + ts.thread_idx.x
    if i < a.shape[0]:
        h[i] = ts.cast(a[i], f16)
        double = h[i] * 2.0 + ts.exp(h[i])
        half[i] = double % 1.5 + (i - 3) // 2


@needs_nvcc
@pytest.mark.slow
def test_cuda_source_compiles_to_cubin(cache_dir, counting_run):
    k = ts.Kernel(cuda_narrow, target="cuda", name="exp")  # a name that clashes with CUDA's math library
    path = Path(k.build())
    data = path.read_bytes()
    assert path.suffix == ".cubin" and data[:4] == b"\x7fELF"
    assert b"ts_kernel_exp" in data  # the kernel's symbol, renamed away from exp()
    assert (path.parent / "kernel.cu").read_text() == k.source_full
    assert "__double2half" in k.source and "ts_floordiv" in k.source and "ts_fmod_floor" in k.source
    counting_run.calls.clear()
    assert Path(ts.Kernel(cuda_narrow, target="cuda", name="exp").build()) == path  # cache hit
    assert counting_run.compiles() == 0


@needs_nvcc
@pytest.mark.slow
def test_nvcc_failure_is_a_compilation_error(cache_dir):
    with pytest.raises(ts.CompilationError) as info:
        build_cuda('extern "C" __global__ void k(float* x) { x[0] = undeclared_thing; }\n')
    err = info.value
    assert err.compiler == "nvcc" and "undeclared_thing" in err.log
    assert Path(err.source_path).is_file()


@pytest.mark.cuda
@needs_nvcc
def test_cuda_kernel_with_renamed_symbol_runs(rng):
    from tessera.runtime import DeviceArray, synchronize

    k = ts.Kernel(cuda_narrow, target="cuda", name="exp")
    n = 1001
    a = rng.uniform(-4, 4, n)
    a[:3] = [1 + 2**-11 + 2**-40, -(1 + 2**-11 + 2**-40), 2**-25 + 2**-60]  # double rounding traps
    da = DeviceArray.from_numpy(a)
    dh, dout = DeviceArray((n,), f16), DeviceArray((n,), f32)
    k(da, dh, dout)
    synchronize()
    h = dh.numpy()
    np.testing.assert_array_equal(h.view(np.uint16), a.astype(np.float16).view(np.uint16))
    h32 = h.astype(np.float32)
    d = (h32 * 2 + np.exp(h32)).astype(np.float16).astype(np.float32)
    expected = np.mod(d, np.float32(1.5)) + (np.arange(n) - 3) // 2
    np.testing.assert_allclose(dout.numpy(), expected, rtol=1e-2, atol=2e-2)
