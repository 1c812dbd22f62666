"""User identifiers never clash with C, CUDA or OpenMP names in generated code (they are mangled)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import tessera as ts
from tessera import f32, i32
from tessera.backend.codegen_c_like import c_identifier, symbol_name

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@pytest.mark.slow
def test_cpu_kernel_named_like_a_math_macro_with_macro_named_locals(rng):
    @ts.kernel
    def isgreater(a: f32["n"], INT32_MAX: f32["n"], NAN: i32["n"]):
        for i in range(a.shape[0]):
            EOF: f32 = a[i]
            M_PI = NAN[i] * 2
            errno = EOF * 3.0
            INT32_MAX[i] = errno + M_PI

    a = rng.standard_normal(9).astype(np.float32)
    m = rng.integers(-50, 50, 9).astype(np.int32)
    out = np.zeros(9, np.float32)
    isgreater(a, out, m)
    np.testing.assert_allclose(out, a * 3 + m * 2, rtol=1e-6)


@pytest.mark.parametrize("name", ["omp_get_thread_num", "omp_get_num_threads", "memcpy", "main", "exp", "malloc"])
@pytest.mark.slow
def test_cpu_kernel_named_like_a_library_function_runs(name, rng):
    """An exported kernel symbol named like a libgomp/libc function used to replace it (segfault)."""

    def body(a: f32["n"]):
        for i in ts.parallel(a.shape[0]):
            a[i] = a[i] * 2.0 + 1.0

    k = ts.Kernel(body, "cpu", name=name)
    a = rng.standard_normal(1000).astype(np.float32)
    expected = a * 2 + 1
    k(a)
    np.testing.assert_allclose(a, expected, rtol=1e-6)


@pytest.mark.slow
def test_names_in_the_generated_codes_own_namespace(rng):
    """Names like the preludes' helpers, reserved C names and non-ASCII names."""

    @ts.kernel
    def ts_floordiv(ts_status: i32["n"], _Bool: i32["n"], __x: i32["n"]):
        for i in range(ts_status.shape[0]):
            ts_floormod = ts_status[i] // 3
            α = _Bool[i] % 5
            β = __x[i] * 2
            ts_status[i] = ts_floormod + α + β

    a, b, c = (rng.integers(-100, 100, 11).astype(np.int32) for _ in range(3))
    expected = a // 3 + b % 5 + c * 2
    ts_floordiv(a, b, c)
    np.testing.assert_array_equal(a, expected)


@pytest.mark.slow
def test_two_variables_of_one_name_get_distinct_c_names():
    @ts.kernel
    def twice(a: f32["n"]):
        for i in range(a.shape[0]):
            a[i] = a[i] + 1.0
        for i in range(a.shape[0]):
            a[i] = a[i] * 2.0

    a = np.arange(4, dtype=np.float32)
    twice(a)
    np.testing.assert_array_equal(a, (np.arange(4) + 1) * 2)
    assert "i_" in twice.source and "i_1_" in twice.source


def test_mangling_scheme():
    assert c_identifier("x") == "x_" and c_identifier("INT32_MAX") == "INT32_MAX_"
    assert c_identifier("ts_pool") == "vts_pool_" and c_identifier("__x") == "v__x_" and c_identifier("9a") == "v9a_"
    assert c_identifier("α") == "v__"
    k = ts.Kernel(lambda_free_body, "cpu", name="normcdf")
    assert symbol_name(k.ir) == "ts_kernel_normcdf"
    assert "void ts_kernel_normcdf(" in k.source


def lambda_free_body(a: f32["n"]):
    for i in range(a.shape[0]):
        a[i] = 0.0


def _cuda_clashes(a: f32["n"], half: f32["n"], warpSize: i32["n"]):
    ts.attrs.grid = ts.ceil_div(a.shape[0], 64)
    ts.attrs.block = 64
    i = ts.block_idx.x * 64 + ts.thread_idx.x
    if i < a.shape[0]:
        normcdf = a[i] * 2.0
        rsqrtf = warpSize[i] + 1
        INT32_MAX = normcdf + rsqrtf
        half[i] = INT32_MAX


@needs_nvcc
@pytest.mark.slow
def test_cuda_kernel_named_like_a_cuda_math_function_compiles(cache_dir):
    for name in ("normcdf", "rsqrtf", "__syncthreads", "threadIdx"):
        k = ts.Kernel(_cuda_clashes, "cuda", name=name, arch="sm_90")
        assert k.build().endswith(".cubin")
        assert f"void __launch_bounds__(64) {symbol_name(k.ir)}(" in k.source


@pytest.mark.cuda
def test_cuda_kernel_named_like_a_cuda_math_function_runs(rng):
    import torch

    k = ts.Kernel(_cuda_clashes, "cuda", name="normcdf")
    a = torch.randn(300, device="cuda")
    w = torch.randint(-5, 5, (300,), dtype=torch.int32, device="cuda")
    out = torch.zeros(300, device="cuda")
    k(a, out, w)
    torch.testing.assert_close(out, a * 2 + w + 1)
