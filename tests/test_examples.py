"""The example kernels on the CPU against numpy at odd sizes, and their CUDA versions through nvcc."""

from __future__ import annotations

import functools
import shutil

import numpy as np
import pytest

from tessera.examples import make_matmul, make_softmax, make_vector_add
from tessera.examples.run import _softmax_ref


@pytest.mark.parametrize("n", [1, 7, 1023, 100003])
def test_vector_add_cpu(rng, n):
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    c = np.full(n, np.nan, np.float32)
    make_vector_add("cpu")(a, b, c)
    np.testing.assert_array_equal(c, a + b)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 300, 77), (33, 17, 65), (129, 63, 200)])
@pytest.mark.slow
def test_matmul_cpu(rng, m, k, n):
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    c = np.full((m, n), np.nan, np.float32)
    make_matmul("cpu")(a, b, c)
    ref = a.astype(np.float64) @ b
    assert np.linalg.norm(c - ref) / np.linalg.norm(ref) < 1e-6


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 1000), (17, 257), (5, 4099)])
def test_softmax_cpu(rng, rows, cols):
    x = (rng.standard_normal((rows, cols)) * 5).astype(np.float32)
    y = np.full_like(x, np.nan)
    make_softmax("cpu")(x, y)
    np.testing.assert_allclose(y, _softmax_ref(x), rtol=2e-5, atol=1e-7)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("factory", [make_vector_add, make_matmul, make_softmax])
def test_examples_cuda_compile(factory):
    kernel = factory("cuda")
    path = kernel.build()
    assert path.endswith(".cubin")
    assert "__global__" in kernel.source


@pytest.mark.slow
def test_main_job_cpu(capsys, monkeypatch):
    from tessera.cli import main
    from tessera.examples import run

    # One timed call per case instead of ten: what is checked is each result against numpy (the
    # 1024^3 matmul example takes ~5 s a call on a loaded 2-core machine).
    monkeypatch.setattr(run, "_time", functools.partial(run._time, repeats=1))
    assert main(["examples", "--device", "cpu"]) == 0
    assert "all examples match numpy" in capsys.readouterr().out
