"""Reduction, softmax and normalisation kernels: nvcc compile in the CPU tier, torch checks on the GPU."""

from __future__ import annotations

import shutil

import pytest

import tessera as ts
from tessera import f16, f32
from tessera.kernels import make_layernorm, make_rmsnorm, make_row_reduce, make_softmax

EPS = 1e-5


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_reduce_kernels_compile():
    for k in (make_row_reduce("max", f16), make_softmax(f16), make_layernorm(f16), make_rmsnorm(f16)):
        assert k.build().endswith(".cubin")
        assert "__shfl_xor_sync" in k.source


def test_collectives_need_cuda_and_block():
    with pytest.raises(ts.KernelSyntaxError, match="only available in CUDA"):

        @ts.kernel
        def cpu_reduce(x: f32["n"], y: f32[1]):
            y[0] = ts.block_reduce(x[0], "sum")

    with pytest.raises(ts.KernelSyntaxError, match="attrs.block"):

        @ts.kernel(target="cuda")
        def no_block(x: f32["n"], y: f32[1]):
            ts.attrs.grid = 1
            y[0] = ts.block_reduce(x[0], "sum")
            ts.attrs.block = 64

    with pytest.raises(ts.KernelSyntaxError, match="one of"):

        @ts.kernel(target="cuda")
        def bad_op(x: f32["n"], y: f32[1]):
            ts.attrs.grid = 1
            ts.attrs.block = 64
            y[0] = ts.block_reduce(x[0], "prod")


SHAPES = [(1, 1), (3, 1000), (17, 4099), (130, 8193)]
DTYPES = ["float16", "bfloat16", "float32"]
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}


def _setup(dtype_name, shape):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype_name)
    x = torch.randn(*shape, device="cuda", dtype=tdt) * 3
    return torch, tdt, ts.dtype(dtype_name), x


def _rel(torch, out, ref):
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_row_reduce(dtype_name, shape, op):
    torch, tdt, sdt, x = _setup(dtype_name, shape)
    y = torch.full((shape[0],), float("nan"), device="cuda", dtype=tdt)
    make_row_reduce(op, sdt)(x, y)
    fn = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[op]
    ref = fn(x.double(), dim=-1)
    assert _rel(torch, y, ref) < TOL[dtype_name] * (10 if op == "sum" else 1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_layernorm_rmsnorm(dtype_name, shape):
    torch, tdt, sdt, x = _setup(dtype_name, shape)
    w = torch.randn(shape[1], device="cuda", dtype=tdt)
    b = torch.randn(shape[1], device="cuda", dtype=tdt)
    F = torch.nn.functional
    y = torch.full_like(x, float("nan"))
    make_softmax(sdt)(x, y)
    assert _rel(torch, y, torch.softmax(x.double(), -1)) < TOL[dtype_name]
    y.fill_(float("nan"))
    make_layernorm(sdt)(x, w, b, y, EPS)
    ref = F.layer_norm(x.double(), (shape[1],), w.double(), b.double(), EPS)
    assert _rel(torch, y, ref) < TOL[dtype_name] * 2
    y.fill_(float("nan"))
    make_rmsnorm(sdt)(x, w, y, EPS)
    ref = F.rms_norm(x.double(), (shape[1],), w.double(), EPS)
    assert _rel(torch, y, ref) < TOL[dtype_name] * 2
