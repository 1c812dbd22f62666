"""Rank-0 constants of fused groups are folded into the generated code (steps.lower_group):
GPT-2's GELU writes pow(x, 3.0) with the 3.0 a constant tensor, which must become x * x * x,
not a powf call per element; groups that differ only in such a value stay apart."""

from __future__ import annotations

import math

import numpy as np

from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph


def _gelu_new(b, x, cube=3.0):
    """transformers' NewGELUActivation, op by op, with its numbers as constant tensors."""
    c = lambda v: b.constant(np.float32(v))  # noqa: E731
    inner = b.op("mul", b.op("add", x, b.op("mul", c(0.044715), b.op("pow", x, c(cube)))), c(math.sqrt(2 / math.pi)))
    return b.op("mul", b.op("mul", c(0.5), x), b.op("add", c(1.0), b.op("tanh", inner)))


def _reference(x, cube=3.0):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**cube)))


def test_gelu_constants_fold_into_the_kernel(rng):
    b = GraphBuilder("gelu")
    x = b.input("x", [7, 131])
    b.output(_gelu_new(b, x))
    compiled = compile_graph(b.build(), "cpu")
    source = "".join(s.compiled.source for s in compiled.steps if s.kind == "fused")
    kernels = source[source.index("void ts_kernel"):]
    assert "powf(" not in kernels and "ts_tanhf(" in kernels
    for _ in range(2):
        xv = (rng.standard_normal((7, 131)) * 3).astype(np.float32)
        np.testing.assert_allclose(compiled(xv)[0], _reference(xv), rtol=2e-6, atol=1e-7)


def test_groups_with_other_scalar_values_do_not_share_kernels(rng):
    """Two GELU groups of one shape around a GEMM anchor: the same structure, other exponents."""
    b = GraphBuilder("two")
    x = b.input("x", [5, 9])
    h = b.op("linear", _gelu_new(b, x, 3.0), b.constant(rng.standard_normal((9, 9)).astype(np.float32) * 0.3))
    b.output(_gelu_new(b, h, 2.0))
    graph = b.build()
    compiled = compile_graph(graph, "cpu")
    fused = [s for s in compiled.steps if s.kind == "fused"]
    assert len(fused) == 2 and fused[0].compiled is not fused[1].compiled
    for _ in range(2):
        xv = rng.standard_normal((5, 9)).astype(np.float32)
        np.testing.assert_allclose(compiled(xv)[0], graph.run(xv)[0], rtol=2e-5, atol=1e-6)
