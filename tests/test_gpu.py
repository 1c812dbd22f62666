"""GPU tier: the kernels run on the device and match numpy/torch (marker `cuda`)."""

from __future__ import annotations

import numpy as np
import pytest

import tessera as ts
from tessera import f16, f32
from tessera.examples import make_matmul, make_softmax, make_vector_add
from tessera.examples.run import _softmax_ref

pytestmark = pytest.mark.cuda


def _dev(x):
    from tessera.runtime import DeviceArray

    return DeviceArray.from_numpy(x)


@pytest.mark.parametrize("n", [1, 255, 257, 1000003])
def test_vector_add(rng, n):
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    da, db, dc = _dev(a), _dev(b), _dev(np.full(n, np.nan, np.float32))
    make_vector_add("cuda")(da, db, dc)
    np.testing.assert_array_equal(dc.numpy(), a + b)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 300, 77), (65, 17, 129), (257, 513, 191), (1024, 1024, 1024)])
def test_matmul(rng, m, k, n):
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    dc = _dev(np.full((m, n), np.nan, np.float32))
    make_matmul("cuda")(_dev(a), _dev(b), dc)
    ref = a.astype(np.float64) @ b
    assert np.linalg.norm(dc.numpy() - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 1000), (17, 257), (129, 32769)])
def test_softmax(rng, rows, cols):
    x = (rng.standard_normal((rows, cols)) * 5).astype(np.float32)
    dy = _dev(np.full_like(x, np.nan))
    make_softmax("cuda")(_dev(x), dy)
    np.testing.assert_allclose(dy.numpy(), _softmax_ref(x), rtol=2e-5, atol=1e-7)


def test_torch_tensors_and_half(rng):
    torch = pytest.importorskip("torch")

    @ts.kernel(target="cuda")
    def scale_half(x: f16["n"], y: f32["n"], s: f32):
        ts.attrs.grid = ts.ceil_div(x.shape[0], 128)
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < x.shape[0]:
            y[i] = ts.cast(x[i], f32) * s + ts.exp(x[i])

    n = 5001
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    y = torch.full((n,), float("nan"), device="cuda")
    scale_half(x, y, 1.5)
    torch.cuda.synchronize()
    ref = x.double() * 1.5 + torch.exp(x.float()).half().double()
    assert torch.allclose(y.double(), ref, rtol=2e-3, atol=1e-3)


def test_wrong_device_is_a_clear_error(rng):
    a = rng.standard_normal(10).astype(np.float32)
    with pytest.raises(ts.ArgumentError, match="is on cpu"):
        make_vector_add("cuda")(a, a, a)
