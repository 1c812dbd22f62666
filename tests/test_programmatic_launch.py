"""Programmatic dependent launch: every generated CUDA kernel waits for the grids it depends on
before touching memory, so launching it with programmatic stream serialization is safe; the
runtime uses it on SM90+ GPUs unless $TESSERA_PDL=0, for every kernel but the warp-specialised
ones."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

import tessera as ts
from tessera import f32, settings
from tessera.backend import build_cuda
from tessera.runtime import cuda

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _axpy():
    @ts.kernel(target="cuda")
    def axpy(x: f32["n"], y: f32["n"], out: f32["n"]):
        ts.attrs.grid = ts.ceil_div(n, 128)
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < n:
            out[i] = 2.0 * x[i] + y[i]

    return axpy


def test_every_kernel_waits_for_its_predecessors_first():
    src = _axpy().source
    body = src[src.index('extern "C" __global__') :]
    first = body.split("{", 1)[1].strip().splitlines()[0]
    assert first == "ts_grid_dependency_sync();", first  # before any load or store
    assert re.search(r"griddepcontrol\.wait;.*\n.*griddepcontrol\.launch_dependents;", src)


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_wait_builds_for_every_architecture(arch):
    """Below SM90 the instructions are compiled out (no programmatic launch there)."""
    assert build_cuda(_axpy().source, arch).exists()


def test_programmatic_launch_is_off_without_a_gpu_or_when_disabled(monkeypatch):
    cuda.programmatic_launch.cache_clear()
    try:
        monkeypatch.setenv(settings.PDL.name, "0")
        assert cuda.programmatic_launch() is False
        cuda.programmatic_launch.cache_clear()
        monkeypatch.delenv(settings.PDL.name)
        props = cuda.device_properties()
        assert cuda.programmatic_launch() == (props.from_driver and props.capability >= (9, 0))
    finally:
        cuda.programmatic_launch.cache_clear()


def test_warp_specialised_kernels_launch_plainly(monkeypatch):
    """With programmatic launch on, every kernel takes the attribute but the warp-specialised
    ones (setmaxnreg): back-to-back launches of those with it ran 100-400x slower."""
    from tessera.templates.gemm import tma as gemm_tma
    from tessera.templates.gemm.tma import TmaConfig
    from tessera.templates.lowbit.gemm_rs import CONFIGS, make_lowbit_gemm_rs

    monkeypatch.setattr(cuda, "programmatic_launch", lambda: True)
    assert cuda.launches_programmatically(_axpy().ir)
    assert not cuda.launches_programmatically(gemm_tma.make_gemm_tma(ts.f16, TmaConfig(128, 128, 4)).ir)
    assert not cuda.launches_programmatically(make_lowbit_gemm_rs(ts.int4, 128, False, CONFIGS[0]).ir)
    monkeypatch.setattr(cuda, "programmatic_launch", lambda: False)
    assert not cuda.launches_programmatically(_axpy().ir)


@pytest.mark.cuda
def test_back_to_back_warp_specialised_gemms_chain_their_results(rng):
    """Persistent TMA GEMMs launched back to back, each reading the previous one's output
    (C_i+1 = C_i @ B), with an axpy (programmatic) between two of them: every result holds."""
    torch = pytest.importorskip("torch")
    from tessera.eager.matmul import matmul
    from tessera.templates.gemm.tma import TmaConfig

    n = 1000  # (not a multiple of the tile: boundary tiles too)
    b = torch.from_numpy(rng.standard_normal((n, n)).astype(np.float32) / np.sqrt(n)).cuda().half()
    c = torch.from_numpy(rng.standard_normal((600, n)).astype(np.float32)).cuda().half()
    want = c.double()
    config = TmaConfig(128, 128, 4)
    for i in range(4):
        c = matmul(c, b, b_layout="nk", config=config)
        want = want @ b.double().T
        if i == 1:
            out = torch.empty(c.numel(), dtype=torch.float32, device="cuda")
            _axpy()(c.float().reshape(-1), c.float().reshape(-1), out)  # 3c, then back to c / 1
            c = (out / 3).reshape(c.shape).half()
    torch.cuda.synchronize()
    err = float((c.double() - want).norm() / want.norm())
    assert err < 1e-2, err


@pytest.mark.cuda
def test_dependent_kernels_see_their_predecessors_writes(rng):
    """A chain of dependent launches (each reads what the previous wrote) on one stream, eager
    and inside a CUDA graph, with programmatic launch as the runtime decides (on for SM90)."""
    torch = pytest.importorskip("torch")
    axpy = _axpy()
    n = 1 << 20
    x = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).cuda()
    bufs = [torch.zeros(n, device="cuda") for _ in range(4)]

    def chain():
        axpy(x, x, bufs[0])
        for a, b in zip(bufs, bufs[1:]):
            axpy(a, x, b)

    for _ in range(3):
        for b in bufs:
            b.zero_()
        chain()
        want = 3 * x.double()
        for _ in range(3):
            want = 2 * want + x.double()
        torch.testing.assert_close(bufs[-1].double(), want, rtol=1e-5, atol=1e-4)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain()
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            chain()
    x.copy_(torch.from_numpy(rng.standard_normal(n).astype(np.float32)))
    graph.replay()
    torch.cuda.synchronize()
    want = 3 * x.double()
    for _ in range(3):
        want = 2 * want + x.double()
    torch.testing.assert_close(bufs[-1].double(), want, rtol=1e-5, atol=1e-4)
