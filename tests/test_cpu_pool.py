"""Max pooling on the CPU (tessera.templates.cpu.pool_kernel, tessera.templates.cpu.pool) against torch in
float64: window geometries with and without padding, ceil_mode, size-1 dims, rows shorter
than a window, a fused epilogue, and the graph compiler's use of it."""

from __future__ import annotations

import numpy as np
import pytest

from tessera import ops
from tessera.backend.isa import vector_lanes
from tessera.errors import ArgumentError
from tessera.templates import Epilogue
from tessera.templates.cpu.pool import plan_cpu_max_pool2d

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(vector_lanes() == 1, reason="the CPU anchors need AVX2 or AVX-512")

GEOMETRIES = [((3, 3), (2, 2), (1, 1), False), ((2, 2), (2, 2), (0, 0), False), ((3, 2), (1, 2), (1, 0), True),
              ((5, 3), (3, 1), (2, 1), True), ((1, 1), (1, 1), (0, 0), False), ((3, 3), (2, 2), (0, 1), True)]  # fmt: skip


@pytest.mark.parametrize("kernel,stride,padding,ceil_mode", GEOMETRIES)
@pytest.mark.slow
def test_max_pool2d_matches_torch(rng, kernel, stride, padding, ceil_mode):
    for x_shape in [(2, 3, 11, 13), (1, 1, 1, 1), (1, 4, 5, 2), (3, 1, 4, 40)]:
        if x_shape[2] + 2 * padding[0] < kernel[0] or x_shape[3] + 2 * padding[1] < kernel[1]:
            continue
        ref_fn = lambda x: torch.nn.functional.max_pool2d(torch.from_numpy(x).double(), kernel, stride, padding,  # noqa: E731
                                                          ceil_mode=ceil_mode).numpy()  # fmt: skip
        out_shape = ref_fn(np.zeros(x_shape, np.float32)).shape
        kernel_ = plan_cpu_max_pool2d(x_shape, kernel, stride, padding, ceil_mode=ceil_mode).load()
        assert kernel_.out_shape == out_shape
        for _ in range(2):  # fresh inputs per call
            x = rng.standard_normal(x_shape).astype(np.float32)
            out = np.full(out_shape, np.nan, np.float32)
            kernel_([x], out)
            np.testing.assert_array_equal(out, ref_fn(x).astype(np.float32))


@pytest.mark.slow
def test_max_pool2d_with_a_fused_epilogue_and_many_rows(rng):
    """Enough rows for several workers; out = relu(pool(x)) * s + 1 with s per channel."""
    x_shape, out_shape = (2, 40, 30, 31), (2, 40, 15, 16)
    acc, s = ops.placeholder(out_shape, "float32", "acc"), ops.placeholder((40, 1, 1), "float32", "s")
    ep = Epilogue(acc, ops.add(ops.mul(ops.relu(acc), s), 1.0), [s])
    kernel = plan_cpu_max_pool2d(x_shape, (3, 3), (2, 2), (1, 1), epilogue=ep).load()
    for _ in range(2):
        x, sv = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal((40, 1, 1)).astype(np.float32)
        out = np.full(out_shape, np.nan, np.float32)
        kernel([x], out, [sv])
        pooled = torch.nn.functional.max_pool2d(torch.from_numpy(x).double(), 3, 2, 1).numpy()
        np.testing.assert_allclose(out, np.maximum(pooled, 0) * sv + 1, rtol=1e-6, atol=1e-6)


def test_bad_geometry_is_refused():
    with pytest.raises(ArgumentError, match="half the kernel"):
        plan_cpu_max_pool2d((1, 1, 8, 8), (2, 2), (1, 1), (2, 0))
    with pytest.raises(ArgumentError, match="NCHW"):
        plan_cpu_max_pool2d((8, 8), (2, 2), (1, 1), (0, 0))
    with pytest.raises(ArgumentError, match="empty"):
        plan_cpu_max_pool2d((1, 1, 1, 1), (3, 3), (1, 1), (0, 0))


@pytest.mark.slow
def test_compiled_graph_runs_max_pool_as_an_anchor(rng):
    class Net(torch.nn.Module):
        def forward(self, x):
            return torch.relu(torch.nn.functional.max_pool2d(x, 3, 2, 1)) + 0.5

    with torch.no_grad():
        compiled = torch.compile(Net(), backend="tessera")
        for _ in range(2):
            x = torch.randn(1, 8, 21, 18)
            np.testing.assert_array_equal(compiled(x).numpy(), Net()(x).numpy())
    import tessera

    report = str(tessera.explain(compiled))
    assert "max_pool2d" in report and "anchor" in report, report
