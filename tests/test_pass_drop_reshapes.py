"""drop_reshapes: identity reshapes and the flatten/unflatten pair around a linear go, results stay."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder
from tessera.graph.passes import drop_reshapes


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("lead,flat", [((2, 3), [-1, 5]), ((1, 1), [1, 5]), ((4,), [4, 5]), ((2, 3, 2), [6, 2, 5])])
def test_flatten_pair_around_linear_goes(rng, lead, flat):
    """GPT-2's Conv1D: view(-1, K) -> addmm -> view(..., N); also a partial flatten."""
    b = GraphBuilder()
    x = b.input("x", [*lead, 5])
    h = b.op("relu", x)
    y = b.op("linear", b.op("reshape", h, shape=flat), b.constant(_f32(rng, 7, 5)), b.constant(_f32(rng, 7)))
    y = b.op("reshape", y, shape=[*lead, 7])
    b.output(b.op("add", y, b.op("reduce_sum", h, axes=[-1], keepdim=True)))
    g = b.build()
    xs = [_f32(rng, *lead, 5) for _ in range(2)]
    before = [g.run(v)[0] for v in xs]
    assert drop_reshapes(g) >= 1  # (with one leading axis both reshapes are identities)
    assert "reshape" not in g.verify().summary()
    lin = next(op for op in g.operators if op.kind == "linear")
    assert lin.inputs[0].shape == (*lead, 5) and lin.outputs[0].shape == (*lead, 7)
    for v, want in zip(xs, before):
        np.testing.assert_allclose(g.run(v)[0], want, rtol=1e-5, atol=1e-5)


def test_symbolic_batch_and_identity_reshape(rng):
    b = GraphBuilder()
    x = b.input("x", ["n", 3, 4])
    same = b.op("reshape", b.op("exp", x), shape=[-1, 3, 4])  # changes nothing
    y = b.op("linear", b.op("reshape", same, shape=[-1, 4]), b.constant(_f32(rng, 6, 4)))
    b.output(b.op("reshape", y, shape=[-1, 3, 6]))
    g = b.build()
    xs = [_f32(rng, n, 3, 4) for n in (1, 5)]
    before = [g.run(v)[0] for v in xs]
    assert drop_reshapes(g) == 2
    assert g.verify().summary() == {"exp": 1, "linear": 1}
    for v, want in zip(xs, before):
        np.testing.assert_allclose(g.run(v)[0], want, rtol=1e-5, atol=1e-5)


def test_merged_heads_reshape_once_for_the_linear(rng):
    """The torch path's attention output: [B, S, H, D] flattened to [B*S, H*D] for the projection."""
    b = GraphBuilder()
    x = b.input("x", [2, 3, 4, 5])
    y = b.op("linear", b.op("reshape", b.op("permute", x, perm=[0, 2, 1, 3]), shape=[12, 10]),
             b.constant(_f32(rng, 7, 10)))  # fmt: skip
    b.output(b.op("relu", b.op("reshape", y, shape=[3, 4, 7])))
    g = b.build()
    xv = _f32(rng, 2, 3, 4, 5)
    before = g.run(xv)[0]
    assert drop_reshapes(g) == 1
    assert g.verify().summary() == {"permute": 1, "reshape": 1, "linear": 1, "relu": 1}
    assert next(op for op in g.operators if op.kind == "linear").inputs[0].shape == (3, 4, 10)
    np.testing.assert_allclose(g.run(xv)[0], before, rtol=1e-5, atol=1e-5)


def test_reshapes_that_move_rows_stay(rng):
    b = GraphBuilder()
    x = b.input("x", [2, 3, 4])
    w = b.constant(_f32(rng, 6, 4))
    y2 = b.op("linear", b.op("reshape", x, shape=[6, 4]), w)
    wide = b.op("reshape", y2, shape=[2, 18])  # mixes features into rows
    kept = b.op("linear", b.op("reshape", x, shape=[6, 4]), w)
    b.output(wide, b.op("reshape", kept, shape=[2, 3, 6]), kept)  # the flat result is an output too
    g = b.build()
    assert drop_reshapes(g) == 0
