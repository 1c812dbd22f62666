"""fuse_rms_norm: written-out RMS norms become one rms_norm operator, with the same results."""

from __future__ import annotations

import numpy as np
import pytest
from graph_form import form

from tessera.graph import GraphBuilder
from tessera.graph.passes import fuse_rms_norm

EPS = 0.3  # large enough that a wrong eps shows in the results


def _norm(b, x, *, up=None, square="pow", inv="rsqrt", axes=(-1,), weight=None, order="cast_first", down=None,
          t5=False):  # fmt: skip
    """RMS norm of x written out as the front ends write it (t5: the rsqrt multiplies x itself,
    the op promoting it); returns its result."""
    c = lambda v, dt="float32": b.constant(np.asarray(v, dtype=dt))  # noqa: E731
    xf = b.op("cast", x, dtype=up) if up else x
    dt = up or x.dtype.name
    sq = b.op("pow", xf, c(2.0, dt)) if square == "pow" else b.op("mul", xf, xf)
    ms = b.op("add", b.op("reduce_mean", sq, axes=list(axes), keepdim=True), c(EPS, dt))
    y = b.op("mul", x if t5 else xf, b.op("rsqrt", ms)) if inv == "rsqrt" else b.op("div", xf, b.op("sqrt", ms))
    if order == "cast_first":
        y = b.op("cast", y, dtype=down) if down else y
        return b.op("mul", weight, y) if weight is not None else y
    y = b.op("mul", y, weight) if weight is not None else y
    return b.op("cast", y, dtype=down) if down else y


def _graph(shape, dt="float32", k=1, weight_dt=None, **kw):
    b = GraphBuilder()
    x = b.input("x", shape, dt)
    h = b.op("add", x, x)  # x is an intermediate, as after a residual add
    w = b.input("w", shape[len(shape) - k :], weight_dt or dt)
    y = _norm(b, h, weight=w, axes=tuple(range(-k, 0)), **kw)
    b.output(b.op("add", y, h) if y.dtype == h.dtype else y)
    return b.build()


def _inputs(rng, shape, dt, k, weight_dt=None):
    x = (rng.standard_normal(shape) * 2).astype(dt)
    w = (rng.standard_normal(shape[len(shape) - k :]) + 0.5).astype(weight_dt or dt)
    return x, w


def _check(g, rng, shape, dt, k=1, weight_dt=None, tol=1e-5, calls=3):
    xs = [_inputs(rng, shape, dt, k, weight_dt) for _ in range(calls)]
    before = [g.run(*a)[0].astype(np.float64) for a in xs]
    assert fuse_rms_norm(g) == 1
    g.verify()
    for a, want in zip(xs, before):
        np.testing.assert_allclose(g.run(*a)[0].astype(np.float64), want, rtol=tol, atol=tol)
    return next(op for op in g.operators if op.kind == "rms_norm")


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1, 1), (2, 1, 64)])
def test_hf_llama_form_reads_the_half_input(rng, dt, shape):
    # HF LlamaRMSNorm: w * cast(x32 * rsqrt(mean(x32^2) + eps), x.dtype) with x32 = cast(x, float32)
    if dt == "bfloat16":
        pytest.importorskip("ml_dtypes")
    g = _graph(shape, dt, up="float32", down=dt)
    tol = 1e-2 if dt == "float16" else 6e-2  # one extra rounding to x's dtype in the written-out form
    op = _check(g, rng, shape, dt, tol=tol)
    assert g.summary() == {"add": 2, "rms_norm": 1}  # the up-cast went too
    assert op.inputs[0].dtype.name == dt and op.attrs == {"num_axes": 1, "eps": pytest.approx(EPS)}


def test_t5_form_multiplies_the_half_input(rng):
    # T5LayerNorm: x * rsqrt(mean(cast(x, f32)^2) + eps) (promoted to float32), cast back, times w
    g = _graph((2, 3, 16), "float16", up="float32", down="float16", t5=True)
    op = _check(g, rng, (2, 3, 16), "float16", tol=1e-2)
    assert g.summary() == {"add": 2, "rms_norm": 1} and op.inputs[0].dtype.name == "float16"


@pytest.mark.parametrize("square", ["pow", "mul"])
@pytest.mark.parametrize("inv", ["rsqrt", "sqrt"])
@pytest.mark.parametrize("k", [1, 2])
def test_float32_forms(rng, square, inv, k):
    g = _graph((4, 3, 9), square=square, inv=inv, k=k)
    op = _check(g, rng, (4, 3, 9), "float32", k=k)
    assert g.summary() == {"add": 2, "rms_norm": 1} and op.attrs["num_axes"] == k


def test_weight_before_the_cast_keeps_its_dtype(rng):
    # Gemma-like: the weight multiplies in float32 before the down-cast, so rms_norm reads the up-cast
    # float32 x and the cast to float16 stays after it
    g = _graph((3, 8), "float16", weight_dt="float32", up="float32", order="weight_first", down="float16")
    op = _check(g, rng, (3, 8), "float16", weight_dt="float32", tol=1e-2)
    assert op.inputs[0].dtype.name == "float32" and op.outputs[0].dtype.name == "float32"
    assert g.summary() == {"add": 2, "cast": 2, "rms_norm": 1}


def test_no_weight_and_no_cast(rng):
    b = GraphBuilder()
    x = b.input("x", (5, 6))
    b.output(_norm(b, x))
    g = b.build()
    xs = [rng.standard_normal((5, 6)).astype(np.float32) for _ in range(2)]
    before = [g.run(a)[0] for a in xs]
    assert fuse_rms_norm(g) == 1 and g.summary() == {"rms_norm": 1}
    for a, want in zip(xs, before):
        np.testing.assert_allclose(g.run(a)[0], want, rtol=1e-5, atol=1e-6)


def test_forms_that_are_not_rms_norm_stay():
    def count(build):
        b = GraphBuilder()
        x = b.input("x", (4, 6))
        b.output(*build(b, x))
        return fuse_rms_norm(b.build())

    two = lambda b: b.constant(np.float32(2.0))  # noqa: E731
    eps = lambda b: b.constant(np.float32(EPS))  # noqa: E731

    def mean_over(axes, keepdim=True, power=2.0):
        def build(b, x):
            ms = b.op("reduce_mean", b.op("pow", x, b.constant(np.float32(power))), axes=axes, keepdim=keepdim)
            return [b.op("mul", x, b.op("rsqrt", b.op("add", ms, eps(b))))]

        return build

    assert count(mean_over([0])) == 0  # not the last axis
    assert count(mean_over([-1], power=3.0)) == 0  # not a square

    def other_x(b, x):  # normalises a different tensor than the one squared
        ms = b.op("reduce_mean", b.op("pow", x, two(b)), axes=[-1], keepdim=True)
        return [b.op("mul", b.op("neg", x), b.op("rsqrt", b.op("add", ms, eps(b))))]

    assert count(other_x) == 0

    def shared(b, x):  # the mean square is an output too: it must survive
        ms = b.op("reduce_mean", b.op("pow", x, two(b)), axes=[-1], keepdim=True)
        return [b.op("mul", x, b.op("rsqrt", b.op("add", ms, eps(b)))), ms]

    assert count(shared) == 0


def test_rewrite_keeps_the_up_cast_read_elsewhere(rng):
    b = GraphBuilder()
    x = b.input("x", (3, 10), "float16")
    w = b.input("w", (10,), "float16")
    xf = b.op("cast", x, dtype="float32")
    y = _norm(b, xf, weight=w, down="float16")  # the norm reads xf, which the second output reads too
    b.output(y, b.op("exp", xf))
    g = b.build()
    args = _inputs(rng, (3, 10), "float16", 1)
    before = g.run(*args)
    assert fuse_rms_norm(g) == 1
    assert g.summary() == {"cast": 1, "exp": 1, "rms_norm": 1}
    norm = next(op for op in g.operators if op.kind == "rms_norm")
    assert norm.inputs[0] is x  # still reads the float16 input, not the kept cast
    after = g.run(*args)
    np.testing.assert_allclose(after[0].astype(np.float32), before[0].astype(np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(after[1], before[1])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_transformers_llama_rms_norm_compiles_to_one_rms_norm(dtype):
    """HF's LlamaRMSNorm through torch.compile (ATen decomposes it) becomes one rms_norm, and the
    compiled module matches torch over several inputs, odd sizes included."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers.models.llama.modeling_llama")
    from tessera.frontend.torch.backend import backend

    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    norm = tf.LlamaRMSNorm(37, eps=1e-5).eval()
    norm.weight.data = torch.randn(37) * 0.5 + 1
    norm = norm.to(dt)
    collected = []
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: norm(a + b), backend=lambda gm, ex: backend(gm, ex, collect=collected))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):
            a, b = (torch.randn(2, 3, 37, generator=g, dtype=torch.float32).to(dt) for _ in range(2))
            out, ref = compiled(a, b), norm(a + b)
            assert out.dtype == ref.dtype
            tol = 1e-2 if dtype == "float16" else 1e-5
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    kinds = [op.kind for cg in collected for graph in cg.graphs for op in graph.operators]
    assert kinds.count("rms_norm") == 1 and "reduce_mean" not in kinds and "rsqrt" not in kinds


def _expected(shape, dt, k=1, weight_dt=None, up=None, down=None):
    """h = x + x; y = rms_norm(h or cast(h, up), w) (then cast to down); y + h."""
    b = GraphBuilder()
    x = b.input("x", shape, dt)
    h = b.op("add", x, x)
    w = b.input("w", shape[len(shape) - k :], weight_dt or dt)
    y = b.op("rms_norm", b.op("cast", h, dtype=up) if up else h, w, num_axes=k, eps=float(np.float32(EPS)))
    b.output(b.op("add", b.op("cast", y, dtype=down) if down else y, h))
    return b.build()


@pytest.mark.parametrize(
    "case, written, expected",
    [
        ("llama", dict(up="float32", down="float16"), dict()),  # the up-cast goes: rms_norm reads x
        ("gemma", dict(up="float32", down="float16", order="weight_first", weight_dt="float32"),
         dict(up="float32", down="float16", weight_dt="float32")),  # the weight multiplies in float32
        ("t5", dict(up="float32", down="float16", t5=True, square="mul", inv="sqrt"), dict()),
        ("two_axes", dict(k=2, square="mul", inv="sqrt"), dict(k=2)),
    ],
)  # fmt: skip
def test_forms_before_and_after(rng, case, written, expected):
    shape = (3, 5, 7)
    dt = "float32" if case == "two_axes" else "float16"
    g = _graph(shape, dt, **written)
    _check(g, rng, shape, dt, k=written.get("k", 1), weight_dt=written.get("weight_dt"), tol=1e-2 if dt == "float16" else 1e-5)
    assert form(g) == form(_expected(shape, dt, **expected))
