"""Graph passes change the graph and keep its results."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder
from tessera.graph.passes import (
    eliminate_dead_code,
    fold_batchnorm,
    fold_constants,
    matmul_to_linear,
    merge_parallel_projections,
    optimize,
)  # fmt: skip


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_constant_folding_evaluates_constant_subgraphs(rng):
    b = GraphBuilder()
    x = b.input("x", ["n", 4])
    w = b.constant(_f32(rng, 4, 4))
    w2 = b.op("mul", b.op("permute", w, perm=[1, 0]), b.constant(np.float32(2.0)))  # constant-only
    b.output(b.op("add", b.op("matmul", x, w2), b.op("arange", end=4, dtype="float32")))
    g = b.build()
    xv = _f32(rng, 3, 4)
    before = g.run(xv)[0]
    assert fold_constants(g) == 3
    assert sorted(g.summary()) == ["add", "matmul"]
    np.testing.assert_allclose(g.verify().run(xv)[0], before, rtol=1e-6)


def test_dead_code_elimination(rng):
    b = GraphBuilder()
    x = b.input("x", [3])
    b.op("exp", x)  # unused
    b.output(b.op("relu", x))
    g = b.build()
    assert len(g.operators) == 2 and eliminate_dead_code(g) == 1 and g.summary() == {"relu": 1}


def test_batchnorm_folds_into_conv(rng):
    b = GraphBuilder()
    x = b.input("x", ["n", 3, 9, 8])
    c = b.op("conv2d", x, b.constant(_f32(rng, 5, 3, 3, 3)), b.constant(_f32(rng, 5)), padding=[1, 1, 1, 1])
    stats = [b.constant(_f32(rng, 5)), b.constant(rng.random(5).astype(np.float32) + 0.5),
             b.constant(_f32(rng, 5)), b.constant(_f32(rng, 5))]  # fmt: skip
    b.output(b.op("relu", b.op("batch_norm", c, *stats, eps=1e-3)))
    g = b.build()
    xv = _f32(rng, 2, 3, 9, 8)
    before = g.run(xv)[0]
    assert fold_batchnorm(g) == 1
    assert g.summary() == {"conv2d": 1, "relu": 1}
    np.testing.assert_allclose(g.verify().run(xv)[0], before, rtol=1e-5, atol=1e-5)


def test_qkv_projections_merge_into_one_linear(rng):
    b = GraphBuilder()
    x = b.input("x", ["batch", "seq", 8])
    q, k, v = (b.op("linear", x, b.constant(_f32(rng, n, 8)), b.constant(_f32(rng, n))) for n in (8, 4, 4))
    scores = b.op("matmul", q, b.op("permute", b.op("concat", k, k, axis=-1), perm=[0, 2, 1]))
    b.output(b.op("matmul", b.op("softmax", scores, axis=-1), b.op("concat", v, v, axis=-1)))
    g = b.build()
    xv = _f32(rng, 2, 5, 8)
    before = g.run(xv)[0]
    assert merge_parallel_projections(g) == 1
    assert g.summary()["linear"] == 1 and g.summary()["split"] == 1
    np.testing.assert_allclose(g.verify().run(xv)[0], before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gated_projections_stay_apart_for_their_epilogues(rng, act):
    """act(x @ Wg) * (x @ Wu) (SwiGLU/GeGLU) is not merged: the activation and the product fold
    into the two GEMMs' stores; a third projection of x (a plain one) has nothing to merge with."""
    b = GraphBuilder()
    x = b.input("x", ["n", 8])
    gate, up, other = (b.op("linear", x, b.constant(_f32(rng, n, 8))) for n in (12, 12, 5))
    b.output(b.op("linear", b.op("mul", b.op(act, gate), up), b.constant(_f32(rng, 8, 12))), other)
    g = b.build()
    xv = _f32(rng, 3, 8)
    before = g.run(xv)
    assert merge_parallel_projections(g) == 0 and g.summary()["linear"] == 4
    for got, want in zip(g.verify().run(xv), before):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_projections_merge_when_the_product_is_not_gated(rng):
    b = GraphBuilder()
    x = b.input("x", ["n", 8])
    a, c = (b.op("linear", x, b.constant(_f32(rng, 12, 8))) for _ in range(2))
    b.output(b.op("mul", b.op("silu", a), c), a)  # the gate's output is used twice: no gated pair
    g = b.build()
    assert merge_parallel_projections(g) == 1


def test_projections_of_equal_reshapes_of_one_input_merge(rng):
    """The ATen graph flattens x once per projection (`view(x, [B*S, K])` before each mm): equal
    reshapes of one tensor are one input; a reshape to another shape is not."""
    b = GraphBuilder()
    x = b.input("x", [1, 3, 8])
    flat = [b.op("reshape", x, shape=[3, 8]) for _ in range(3)]
    q, k, v = (b.op("linear", f, b.constant(_f32(rng, n, 8))) for f, n in zip(flat, (8, 4, 4)))
    other = b.op("linear", b.op("reshape", x, shape=[1, 3, 8]), b.constant(_f32(rng, 4, 8)))
    b.output(b.op("add", b.op("mul", b.op("slice", q, starts=[0], ends=[4], axes=[1]), k), v), other)
    g = b.build()
    xv = _f32(rng, 1, 3, 8)
    before = g.run(xv)
    assert merge_parallel_projections(g) == 1
    assert g.summary()["linear"] == 2 and g.summary()["split"] == 1
    (wide,) = [op for op in g.operators if op.kind == "linear" and op.outputs[0].shape[-1] == 16]
    assert wide.inputs[0].producer.kind == "reshape"
    for got, ref in zip(g.verify().run(xv), before):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_default_pipeline_is_idempotent(rng):
    b = GraphBuilder()
    x = b.input("x", ["n", 6])
    b.output(b.op("gelu", b.op("linear", x, b.constant(_f32(rng, 6, 6)))))
    g = optimize(b.build())
    text = str(g)
    assert str(optimize(g)) == text


def test_matmul_by_constant_becomes_linear_with_one_transposed_weight(rng):
    b = GraphBuilder()
    x = b.input("x", ["n", 3, 5])
    y = b.input("y", [7, 5])
    w = b.constant(_f32(rng, 5, 6))
    other = b.constant(_f32(rng, 6, 2))
    h = b.op("relu", b.op("matmul", x, w))  # rank 3 by a constant [K, N]
    b.output(b.op("matmul", h, other), b.op("matmul", y, w), b.op("matmul", x, b.op("permute", y, perm=[1, 0])))
    g = b.build()
    xv, yv = _f32(rng, 2, 3, 5), _f32(rng, 7, 5)
    before = g.run(xv, yv)
    assert matmul_to_linear(g) == 3  # not the matmul by a computed operand
    assert g.summary()["linear"] == 3 and g.summary()["matmul"] == 1
    weights = {id(op.inputs[1]) for op in g.operators if op.kind == "linear"}
    assert len(weights) == 2  # w's users share one transposed copy
    for got, ref in zip(g.verify().run(xv, yv), before):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
