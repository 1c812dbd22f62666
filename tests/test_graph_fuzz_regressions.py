"""Regression tests for the bugs the graph fuzzer (tests/fuzz) found: each a small explicit graph,
compiled on the CPU and checked against the reference (and the reference against numpy where
the reference itself was wrong).  Each test failed before its fix."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tessera.graph import GraphBuilder, ShapeError, Sym
from tessera.graph.compiler import compile_graph


def _compiled_and_reference(g, *inputs):
    compiled = compile_graph(g, "cpu")
    return compiled(*inputs), g.run(*inputs), compiled


def _no_fallback(caplog):
    """compile_graph logged no operator running in its reference and no failed group."""
    bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not bad, bad


@pytest.mark.parametrize("kind, fn", [("exp", np.exp), ("sin", np.sin), ("cos", np.cos), ("tanh", np.tanh)])
def test_math_of_bool_computes_in_float32(rng, kind, fn):
    """np.exp(bool) computes in float16; the graph's result is float32, and so is its reference."""
    b = GraphBuilder("g")
    x = b.input("x", [4, 3], "bool")
    b.output(b.op(kind, x))
    g = b.build()
    xv = rng.random((4, 3)) < 0.5
    (got,), (want,), _ = _compiled_and_reference(g, xv)
    expected = fn(xv.astype(np.float32))
    np.testing.assert_allclose(want, expected, rtol=2e-7)
    np.testing.assert_allclose(got, expected, rtol=2e-7)


def test_arange_over_a_size_no_fused_input_carries(rng, caplog):
    """arange(n) in a fused group without inputs (x only binds n): the size comes from the
    graph's bindings at run time (the group failed to build and fell back to the reference)."""
    b = GraphBuilder("g")
    b.input("x", [4, "n"])
    b.output(b.op("mul", b.op("arange", end=Sym.var("n"), dtype="int32"), b.constant(np.int32(3))))
    g = b.build()
    with caplog.at_level(logging.WARNING, logger="tessera"):
        compiled = compile_graph(g, "cpu")
    _no_fallback(caplog)
    for n in (3, 1):
        (got,) = compiled(rng.standard_normal((4, n)).astype(np.float32))
        np.testing.assert_array_equal(got, 3 * np.arange(n, dtype=np.int32))


def test_ops_build_takes_sizes_no_input_carries():
    from tessera import ops
    from tessera.errors import ArgumentError
    from tessera.ir import dtypes
    from tessera.ir import expr as E
    from tessera.ir.compute import compute

    n = E.Var("n", dtypes.int32)
    x = ops.placeholder([3], dtypes.float32, "x")
    r = compute([n], lambda i: E.Cast(i, dtypes.float32), "r", dtypes.float32)
    op = ops.build([ops.exp(x), r], [x], "cpu")
    _, out = op(np.ones(3, np.float32), symbols={"n": 5})
    np.testing.assert_array_equal(out, np.arange(5, dtype=np.float32))
    with pytest.raises(ArgumentError, match=r"\['n'\].*symbols"):
        op(np.ones(3, np.float32))


def test_bool_unary_semantics(rng, caplog):
    """neg of a bool is refused when the graph is built (numpy's reference raised TypeError);
    abs, relu and sign of bools are the identity and compile (sign's reference raised)."""
    b = GraphBuilder("g")
    x = b.input("x", [5], "bool")
    with pytest.raises(ShapeError, match="neg of a bool"):
        b.op("neg", x)
    b.output(*(b.op(k, x) for k in ("abs", "relu", "sign")))
    g = b.build()
    xv = rng.random(5) < 0.5
    with caplog.at_level(logging.WARNING, logger="tessera"):
        got, want, _ = _compiled_and_reference(g, xv)
    _no_fallback(caplog)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype == np.bool_
        np.testing.assert_array_equal(a, xv)
        np.testing.assert_array_equal(e, xv)


def _guarded(shape, pad=64):
    """A float32 array of `shape` inside a larger one filled with a canary, and the check."""
    n = int(np.prod(shape))
    raw = np.full(n + 2 * pad, -7.0, np.float32)
    return raw[pad: pad + n].reshape(shape), lambda: bool((raw[:pad] == -7).all() and (raw[pad + n:] == -7).all())


def test_reduction_is_not_fused_into_a_larger_consumer(rng):
    """cumsum [2,4,2] (also an output) read by a concat [2,7,2] along axis 1: the scheduler fused the
    reduction into the concat's kernel, which computed it (reading x out of bounds) and stored it
    for all 7 rows, writing past the cumsum output."""
    from tessera import ops
    from tessera.ir import dtypes

    x = ops.placeholder([2, 4, 2], dtypes.float32, "x")
    y = ops.placeholder([2, 3, 2], dtypes.float32, "y")
    c = ops.cumsum(x, 2, True, True)
    s = ops.reduce_axes("sum", x, [2], True)
    op = ops.build([c, ops.concat([c, y], 1), ops.concat([s, ops.reduce_axes("sum", y, [2], True)], 1)], [x, y], "cpu")
    xv, yv = rng.standard_normal((2, 4, 2)).astype(np.float32), rng.standard_normal((2, 3, 2)).astype(np.float32)
    outs = [_guarded(shape) for shape in [(2, 4, 2), (2, 7, 2), (2, 7, 1)]]
    op.run([xv, yv], [o for o, _ in outs])
    assert all(ok() for _, ok in outs), "a kernel wrote out of bounds"
    cum = np.flip(np.cumsum(np.flip(xv, 2), 2), 2) - xv
    np.testing.assert_allclose(outs[0][0], cum, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs[1][0], np.concatenate([cum, yv], 1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs[2][0], np.concatenate([xv.sum(2, keepdims=True), yv.sum(2, keepdims=True)], 1),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


def test_reduction_output_read_by_a_smaller_consumer(rng):
    """A reduction that is an output and is read by a slice r[0:4] of it: fused into the slice's
    kernel, it was computed and stored only where the slice reads it (r[4:] left garbage)."""
    b = GraphBuilder("g")
    x = b.input("x", [6, 5])
    r = b.op("reduce_sum", x, axes=[1])
    b.output(r, b.op("slice", r, axes=[0], starts=[0], ends=[4]))
    g = b.build()
    xv = rng.standard_normal((6, 5)).astype(np.float32)
    got, want, _ = _compiled_and_reference(g, xv)
    for a, e in zip(got, want):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def test_reductions_of_bool_compile(rng, caplog):
    """reduce_prod of a bool tensor ran in its reference ("not lowered"); it is the int64 product."""
    b = GraphBuilder("g")
    x = b.input("x", [3, 4], "bool")
    b.output(*(b.op(k, x, axes=[1]) for k in ("reduce_prod", "reduce_sum", "reduce_max", "reduce_mean")))
    g = b.build()
    xv = rng.random((3, 4)) < 0.7
    with caplog.at_level(logging.WARNING, logger="tessera"):
        got, want, _ = _compiled_and_reference(g, xv)
    _no_fallback(caplog)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype
        np.testing.assert_allclose(a, e)


@pytest.mark.parametrize("reverse", [False, True])
def test_exclusive_cumsum_of_nan_and_inf(reverse):
    """The reference computed an exclusive cumsum as cumsum(x) - x: NaN (or inf) where the sum of
    no elements is 0, and cancellation elsewhere; the compiled kernel was right."""
    b = GraphBuilder("g")
    x = b.input("x", [2, 4])
    b.output(b.op("cumsum", x, axis=1, exclusive=True, reverse=reverse))
    g = b.build()
    xv = np.array([[np.nan, 1, 2, 3], [np.inf, 1, 2, 3]], np.float32)
    if reverse:
        xv = xv[:, ::-1].copy()
    expected = np.array([[0, np.nan, np.nan, np.nan], [0, np.inf, np.inf, np.inf]], np.float32)
    if reverse:
        expected = expected[:, ::-1]
    (got,), (want,), _ = _compiled_and_reference(g, xv)
    np.testing.assert_array_equal(want, expected)
    np.testing.assert_array_equal(got, expected)


def test_mixed_dtype_arithmetic_computes_in_the_promoted_dtype():
    """int64 % float16 and int32 + float16 are float16 operations (the graph's result dtype, and
    torch's), and comparisons compare in it: the reference computed in float64 (numpy's
    promotion), where 2**40 is finite, 2049 + 0.5 rounds to 2050 and 2049 != 2048."""
    b = GraphBuilder("g")
    i64, i32, h = b.input("i64", [2], "int64"), b.input("i32", [2], "int32"), b.input("h", [2], "float16")
    b.output(b.op("remainder", i64, h), b.op("add", i32, h), b.op("eq", i32, h), b.op("lt", h, i64))
    g = b.build()
    args = (np.array([2**40, 7], np.int64), np.array([2049, 2049], np.int32), np.array([0.5, 2048.0], np.float16))
    with np.errstate(all="ignore"):
        got, want, _ = _compiled_and_reference(g, *args)
    expected = [
        np.array([np.nan, 7.0], np.float16),  # 2**40 is inf in float16, and inf % 0.5 is NaN
        np.array([2048.0, 4096.0], np.float16),  # 2049 is 2048 in float16; 2048.5 rounds to 2048
        np.array([False, True]),  # 2049 == 2048 in float16
        np.array([True, False]),  # 0.5 < inf
    ]
    for a, e, x in zip(got, want, expected):
        np.testing.assert_array_equal(e, x)
        np.testing.assert_array_equal(a, x)


def test_undefined_dtype_combinations_are_refused_when_built():
    """sub of two bools and bitwise ops on floats built a graph whose reference then raised numpy's
    TypeError at run time; they are refused with a ShapeError when the graph is built."""
    b = GraphBuilder("g")
    p, q, f = b.input("p", [3], "bool"), b.input("q", [3], "bool"), b.input("f", [3], "float32")
    with pytest.raises(ShapeError, match="sub of two bool"):
        b.op("sub", p, q)
    for kind in ("bitwise_and", "bitwise_or"):
        with pytest.raises(ShapeError, match="bitwise operators take integer or bool"):
            b.op(kind, f, p)
    assert b.op("bitwise_and", p, q).dtype.is_bool


def test_reference_errors_on_bad_data_are_clear(rng):
    """Operators the compiler leaves to the reference can still meet data they cannot take (an
    integer to a negative power, an index out of range): an ArgumentError naming the operator,
    not numpy's ValueError or IndexError."""
    from tessera.errors import ArgumentError

    b = GraphBuilder("g")
    x, e = b.input("x", [3], "int32"), b.input("e", [3], "int32")
    b.output(b.op("pow", x, e))
    g = b.build()
    compiled = compile_graph(g, "cpu")
    args = np.array([2, 3, 4], np.int32), np.array([1, -1, 2], np.int32)
    for run in (g.run, compiled):
        with pytest.raises(ArgumentError, match=r"pow.*negative"):
            run(*args)
    np.testing.assert_array_equal(compiled(args[0], np.abs(args[1]))[0], [2, 3, 16])
    b = GraphBuilder("take")
    x, i = b.input("x", [4]), b.input("i", [2], "int64")
    b.output(b.op("take", x, i))
    with pytest.raises(ArgumentError, match=r"take.*out of range"):
        b.build().run(np.ones(4, np.float32), np.array([1, 9]))
