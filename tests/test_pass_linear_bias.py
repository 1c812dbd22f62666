"""fold_linear_bias: linear + constant bias add becomes one biased linear, with the same results."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder
from tessera.graph.passes import fold_linear_bias, matmul_to_linear, merge_parallel_projections


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("bias_shape,bias_first", [((7,), False), ((1, 1, 7), True), ((1, 7), False)])
def test_bias_add_folds_into_linear(rng, bias_shape, bias_first):
    b = GraphBuilder()
    x = b.input("x", ["n", 3, 5])
    y = b.op("matmul", x, b.constant(_f32(rng, 5, 7)))
    bias = b.constant(_f32(rng, *bias_shape))
    y = b.op("add", bias, y) if bias_first else b.op("add", y, bias)
    b.output(b.op("relu", y))
    g = b.build()
    xs = [_f32(rng, n, 3, 5) for n in (1, 4)]
    before = [g.run(x)[0] for x in xs]
    assert matmul_to_linear(g) == 1 and fold_linear_bias(g) == 1
    assert g.verify().summary() == {"linear": 1, "relu": 1}
    assert len(next(op for op in g.operators if op.kind == "linear").inputs) == 3
    for x, want in zip(xs, before):
        np.testing.assert_allclose(g.run(x)[0], want, rtol=1e-5, atol=1e-5)


def test_biased_qkv_projections_merge(rng):
    b = GraphBuilder()
    x = b.input("x", [3, 8])
    outs = [b.op("add", b.op("matmul", x, b.constant(_f32(rng, 8, 4))), b.constant(_f32(rng, 4))) for _ in range(3)]
    b.output(*outs)
    g = b.build()
    xv = _f32(rng, 3, 8)
    before = g.run(xv)
    assert matmul_to_linear(g) == 3 and fold_linear_bias(g) == 3 and merge_parallel_projections(g) == 1
    assert g.verify().summary() == {"linear": 1, "split": 1}
    for got, want in zip(g.run(xv), before):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_adds_that_are_not_a_bias_stay(rng):
    b = GraphBuilder()
    x = b.input("x", [3, 5])
    w = b.constant(_f32(rng, 7, 5))
    per_row = b.op("add", b.op("linear", x, w), b.constant(_f32(rng, 3, 1)))  # broadcasts along rows
    widened = b.op("add", b.op("linear", x, w), b.constant(_f32(rng, 2, 1, 7)))  # grows the shape
    runtime = b.op("add", b.op("linear", x, w), b.input("r", [7]))  # not a constant
    twice = b.op("linear", x, w)
    b.output(per_row, widened, runtime, b.op("add", twice, b.constant(_f32(rng, 7))), twice)  # read twice
    g = b.build()
    assert fold_linear_bias(g) == 0 and g.summary() == {"linear": 4, "add": 4}
