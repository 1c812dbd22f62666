"""Run-time shape checks of graphs (issue 9, item 12): a symbolic size broadcasts only against an
equal size or a literal 1, also when it is 1 at run time; the compiled graph and the reference
executor both refuse inputs that break the graph's shape assumptions, with a ShapeError; a
reference step's result must have exactly its planned shape."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder, ShapeError
from tessera.graph.compiler import compile_graph


def _f32(rng, *shape):
    return (rng.standard_normal(shape) + 2).astype(np.float32)


def _binary(kind, x_shape, y_shape):
    b = GraphBuilder("g")
    x, y = b.input("x", x_shape), b.input("y", y_shape)
    b.output(b.op(kind, x, y))
    return b.build()


def _both(graph):
    """The compiled graph and the reference executor, which must agree on what they accept."""
    compiled = compile_graph(graph, "cpu")
    return [("compiled", compiled), ("reference", graph.run)]


@pytest.mark.parametrize("x_shape, y_shape, xv, yv", [
    (["n"], ["m"], (1,), (5,)),        # n is 1 at run time: the graph's result [n] would be [1]
    (["n"], ["m"], (5,), (1,)),        # m is 1: the kernels index y as if it had n elements
    (["n"], [5], (1,), (5,)),          # n assumed to be 5
    (["n", 3], [4, 3], (1, 3), (4, 3)),
    (["b", "k"], ["m"], (2, 1), (4,)),  # k is 1 against m
])  # fmt: skip
def test_symbolic_size_of_one_does_not_broadcast(rng, x_shape, y_shape, xv, yv):
    g = _binary("add", x_shape, y_shape)
    for what, run in _both(g):
        with pytest.raises(ShapeError, match="add") as info:
            run(_f32(rng, *xv), _f32(rng, *yv))
        assert "1" in str(info.value), what


@pytest.mark.parametrize("x_shape, y_shape, xv, yv", [
    (["n"], ["m"], (1,), (1,)),
    (["n"], ["m"], (6,), (6,)),
    (["n", 3], [1, 3], (1, 3), (1, 3)),  # a literal 1 broadcasts, the symbolic size may be 1
    (["n", 3], [1, 3], (4, 3), (1, 3)),
    (["n", "k"], ["k"], (1, 1), (1,)),
    (["n"], [5], (5,), (5,)),
])  # fmt: skip
def test_sizes_that_keep_the_graphs_assumptions_run(rng, x_shape, y_shape, xv, yv):
    g = _binary("mul", x_shape, y_shape)
    compiled = compile_graph(g, "cpu")
    for _ in range(2):
        x, y = _f32(rng, *xv), _f32(rng, *yv)
        expected = x * y
        for got in (compiled(x, y)[0], g.run(x, y)[0]):
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_broken_contraction_and_squeeze_are_refused(rng):
    g = _binary("matmul", [3, "n"], ["k", 4])
    for _, run in _both(g):
        with pytest.raises(ShapeError, match="matmul contraction"):
            run(_f32(rng, 3, 2), _f32(rng, 5, 4))
    b = GraphBuilder("squeeze")
    x = b.input("x", [3, "n"])
    b.output(b.op("exp", b.op("squeeze", x, axes=[1])))  # the graph keeps the axis (n is not 1 in general)
    g = b.build()
    for _, run in _both(g):
        with pytest.raises(ShapeError, match=r"squeeze.*\[3\].*\[3, n\]"):
            run(_f32(rng, 3, 1))
        np.testing.assert_allclose(run(_f32(rng, 3, 2) * 0)[0], np.ones((3, 2)))


def test_opaque_sizes_are_bound_at_run_time(rng):
    """A concat of two symbolic sizes has an opaque size (`_s0`) that no input carries; the run
    binds it from the inputs' shapes, so results of that size can leave a step."""
    b = GraphBuilder("concat")
    x, y = b.input("x", ["n", 3]), b.input("y", ["m", 3])
    c = b.op("concat", x, y, axis=0)
    b.output(b.op("exp", c), b.op("reduce_sum", c, axes=[0]))
    g = b.build()
    compiled = compile_graph(g, "cpu")
    for n, m in ((2, 4), (1, 1), (3, 1)):
        xv, yv = _f32(rng, n, 3), _f32(rng, m, 3)
        full = np.concatenate([xv, yv])
        for got in (compiled(xv, yv), g.run(xv, yv)):
            np.testing.assert_allclose(got[0], np.exp(full), rtol=1e-6)
            np.testing.assert_allclose(got[1], full.sum(0), rtol=1e-5)


def test_reference_step_result_must_have_its_planned_shape(rng, monkeypatch):
    """A reference result with the planned number of elements in another shape is refused, not
    reshaped into the buffer."""
    import tessera.graph.lowering as lowering

    original = lowering.lowering_error
    monkeypatch.setattr(lowering, "lowering_error", lambda op: "host" if op.kind == "exp" else original(op))
    b = GraphBuilder("host")
    x = b.input("x", [2, 3])
    b.output(b.op("neg", b.op("exp", x)))
    g = b.build()
    compiled = compile_graph(g, "cpu")
    (step,) = [s for s in compiled.steps if s.kind == "reference"]
    xv = _f32(rng, 2, 3)
    np.testing.assert_allclose(compiled(xv)[0], -np.exp(xv), rtol=1e-6)
    good = step.kernel
    monkeypatch.setattr(step, "kernel", lambda arrays, symbols: [r.T for r in good(arrays, symbols)])
    with pytest.raises(ShapeError, match=r"exp.*\[3, 2\].*\[2, 3\]"):
        compiled(_f32(rng, 2, 3))
