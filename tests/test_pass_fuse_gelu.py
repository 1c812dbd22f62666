"""fuse_gelu: written-out GELU chains become one gelu operator, with the same results."""

from __future__ import annotations

import math

import numpy as np
import pytest
from graph_form import form

from tessera.graph import GraphBuilder
from tessera.graph.passes import fuse_gelu


def _erf_chain(b, x, variant, dt="float32"):
    c = lambda v: b.constant(np.asarray(v, dtype=dt))  # noqa: E731
    if variant == "div":  # torch.onnx's export of nn.GELU: ((x * (erf(x / sqrt2) + 1)) * 0.5)
        t = b.op("add", b.op("erf", b.op("div", x, c(math.sqrt(2)))), c(1.0))
        return b.op("mul", b.op("mul", x, t), c(0.5))
    if variant == "half_first":  # (x * 0.5) * (1 + erf(x * (1/sqrt2)))
        t = b.op("add", c(1.0), b.op("erf", b.op("mul", x, c(math.sqrt(0.5)))))
        return b.op("mul", b.op("mul", x, c(0.5)), t)
    t = b.op("add", b.op("erf", b.op("div", x, c(math.sqrt(2)))), c(1.0))  # (t * 0.5) * x
    return b.op("mul", b.op("mul", t, c(0.5)), x)


def _tanh_chain(b, x, dt="float32"):  # GPT-2's NewGELUActivation as exported
    c = lambda v: b.constant(np.asarray(v, dtype=dt))  # noqa: E731
    half = b.op("mul", x, c(0.5))
    inner = b.op("add", x, b.op("mul", b.op("pow", x, c(3.0)), c(0.044715)))
    t = b.op("add", b.op("tanh", b.op("mul", inner, c(math.sqrt(2 / math.pi)))), c(1.0))
    return b.op("mul", half, t)


def _graph(chain, shape, dt="float32", **kw):
    b = GraphBuilder()
    x = b.input("x", shape, dt)
    y = chain(b, b.op("add", x, x), dt=dt, **kw)  # x is an intermediate, as after a linear
    b.output(b.op("add", y, x))
    return b.build()


@pytest.mark.parametrize("variant", ["div", "half_first", "half_last"])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1), (2, 1, 9)])
def test_erf_chain_becomes_gelu(rng, variant, shape):
    g = _graph(_erf_chain, shape, variant=variant)
    xs = [rng.standard_normal(shape).astype(np.float32) * 3 for _ in range(2)]
    before = [g.run(x)[0] for x in xs]
    assert fuse_gelu(g) == 1
    assert g.verify().summary() == {"add": 2, "gelu": 1}
    assert next(op for op in g.operators if op.kind == "gelu").attrs["approximate"] == "none"
    for x, want in zip(xs, before):
        np.testing.assert_allclose(g.run(x)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_tanh_chain_becomes_tanh_gelu(rng, dt):
    g = _graph(_tanh_chain, (5, 1, 11), dt)
    x = rng.standard_normal((5, 1, 11)).astype(dt)
    before = g.run(x)[0].astype(np.float32)
    assert fuse_gelu(g) == 1
    assert g.verify().summary() == {"add": 2, "gelu": 1}
    assert next(op for op in g.operators if op.kind == "gelu").attrs["approximate"] == "tanh"
    tol = 1e-5 if dt == "float32" else 4e-3
    np.testing.assert_allclose(g.run(x)[0].astype(np.float32), before, rtol=tol, atol=tol)


def test_chains_that_are_not_gelu_stay():
    # a wrong constant
    b = GraphBuilder()
    x = b.input("x", [4])
    t = b.op("add", b.op("erf", b.op("div", x, b.constant(np.float32(1.5)))), b.constant(np.float32(1.0)))
    b.output(b.op("mul", b.op("mul", x, t), b.constant(np.float32(0.5))))
    g = b.build()
    assert fuse_gelu(g) == 0 and "gelu" not in g.summary()
    # an intermediate read elsewhere too (it must survive, so the chain cannot go)
    b = GraphBuilder()
    x = b.input("x", [4])
    e = b.op("erf", b.op("div", x, b.constant(np.float32(math.sqrt(2)))))
    t = b.op("add", e, b.constant(np.float32(1.0)))
    b.output(b.op("mul", b.op("mul", x, t), b.constant(np.float32(0.5))), e)
    g = b.build()
    assert fuse_gelu(g) == 0 and "gelu" not in g.summary()
    # 0.5 * y * (1 + erf(x / sqrt2)) with y != x
    b = GraphBuilder()
    x, y = b.input("x", [4]), b.input("y", [4])
    t = b.op("add", b.op("erf", b.op("div", x, b.constant(np.float32(math.sqrt(2))))), b.constant(np.float32(1.0)))
    b.output(b.op("mul", b.op("mul", y, t), b.constant(np.float32(0.5))))
    g = b.build()
    assert fuse_gelu(g) == 0 and "gelu" not in g.summary()


_TAILS = {  # 0.5 * x * t as exporters associate it
    "(0.5*x)*t": lambda b, x, t, c: b.op("mul", b.op("mul", c(0.5), x), t),
    "0.5*(x*t)": lambda b, x, t, c: b.op("mul", c(0.5), b.op("mul", x, t)),
    "(x*t)*0.5": lambda b, x, t, c: b.op("mul", b.op("mul", x, t), c(0.5)),
    "(x*t)/2": lambda b, x, t, c: b.op("div", b.op("mul", t, x), c(2.0)),
    "(x*0.5)*t": lambda b, x, t, c: b.op("mul", t, b.op("mul", x, c(0.5))),
    "(t*0.5)*x": lambda b, x, t, c: b.op("mul", b.op("mul", t, c(0.5)), x),
}
_SCALED = {  # x / sqrt(2) or x * sqrt(0.5)
    "/sqrt2": lambda b, x, c: b.op("div", x, c(math.sqrt(2))),
    "*sqrt.5": lambda b, x, c: b.op("mul", c(math.sqrt(0.5)), x),
}


def _expected(shape, dt, approximate):
    b = GraphBuilder()
    x = b.input("x", shape, dt)
    b.output(b.op("add", b.op("gelu", b.op("add", x, x), approximate=approximate), x))
    return b.build()


@pytest.mark.parametrize("tail", list(_TAILS))
@pytest.mark.parametrize("scaled", list(_SCALED))
def test_erf_forms_before_and_after(rng, tail, scaled):
    shape = (3, 5, 7)

    def chain(b, x, dt):
        c = lambda v: b.constant(np.asarray(v, dtype=dt))  # noqa: E731
        t = b.op("add", c(1.0), b.op("erf", _SCALED[scaled](b, x, c)))
        return _TAILS[tail](b, x, t, c)

    g = _graph(chain, shape)
    xs = [rng.standard_normal(shape).astype(np.float32) * 3 + 0.1 for _ in range(2)]
    before = [g.run(x)[0] for x in xs]
    assert fuse_gelu(g) == 1
    assert form(g.verify()) == form(_expected(shape, "float32", "none"))
    for x, want in zip(xs, before):
        np.testing.assert_allclose(g.run(x)[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cube_first", [False, True])
def test_tanh_form_before_and_after(rng, cube_first):
    shape, dt = (2, 9, 3), "float16"

    def chain(b, x, dt):
        c = lambda v: b.constant(np.asarray(v, dtype=dt))  # noqa: E731
        cube = b.op("mul", c(0.044715), b.op("pow", x, c(3.0)))
        inner = b.op("add", cube, x) if cube_first else b.op("add", x, cube)
        t = b.op("add", b.op("tanh", b.op("mul", c(math.sqrt(2 / math.pi)), inner)), c(1.0))
        return b.op("mul", c(0.5), b.op("mul", t, x))

    g = _graph(chain, shape, dt)
    x = (rng.standard_normal(shape) * 2 + 0.1).astype(dt)
    before = g.run(x)[0].astype(np.float32)
    assert fuse_gelu(g) == 1
    assert form(g.verify()) == form(_expected(shape, dt, "tanh"))
    np.testing.assert_allclose(g.run(x)[0].astype(np.float32), before, rtol=4e-3, atol=4e-3)


def test_rounding_division_is_not_gelu():
    def chain(b, x, dt, rounding="floor"):
        c = lambda v: b.constant(np.asarray(v, dtype=dt))  # noqa: E731
        t = b.op("add", b.op("erf", b.op("div", x, c(math.sqrt(2)), rounding=rounding)), c(1.0))
        return b.op("mul", b.op("mul", x, t), c(0.5))

    assert fuse_gelu(_graph(chain, (4,))) == 0
    assert fuse_gelu(_graph(chain, (4,), rounding=None)) == 1
