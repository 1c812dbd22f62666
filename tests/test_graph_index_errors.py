"""Gather indices outside [-n, n): the numpy references and the compiled CPU kernels refuse them
(IndexOutOfRangeError, an IndexError, as numpy and torch do) instead of clamping silently;
CUDA kernels, which cannot report, clamp so that no read leaves the tensor."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tessera.errors import ArgumentError, IndexOutOfRangeError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph


def _take_graph():
    b = GraphBuilder("take")
    x, i = b.input("x", [5, 3], "float32"), b.input("i", [4], "int64")
    b.output(b.op("take", x, i, axis=0))
    return b.build()


def test_take_out_of_range_raises_on_the_cpu():
    g = _take_graph()
    compiled = compile_graph(_take_graph(), "cpu")
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    good = np.array([0, 4, -1, -5], np.int64)
    np.testing.assert_array_equal(compiled(x, good)[0], g.run(x, good)[0])
    for bad in ([0, 5, 1, 1], [-6, 0, 0, 0], [2**40, 0, 0, 0]):
        bad = np.array(bad, np.int64)
        with pytest.raises(IndexOutOfRangeError) as err:
            compiled(x, bad)
        assert isinstance(err.value, IndexError)
        with pytest.raises(ArgumentError):
            g.run(x, bad)
    np.testing.assert_array_equal(compiled(x, good)[0], g.run(x, good)[0])  # usable afterwards


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_gather_clamps_and_builds():
    from tessera import ops
    from tessera.backend import build_cuda

    x = ops.placeholder((5, 3), "float32", "x")
    i = ops.placeholder((4,), "int64", "i")
    gen = ops.generate([ops.take(x, i, axis=0)], [x, i], target="cuda")
    assert "ts_index_chk" in gen.source and "ts_status" not in gen.source
    assert str(build_cuda(gen.source, arch="sm_90a")).endswith(".cubin")
