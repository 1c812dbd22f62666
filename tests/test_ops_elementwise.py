"""Elementwise ops on the CPU against float64 numpy: unary math and activations, broadcasting binary ops,
type promotion, comparisons, where, clamp and cast."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tessera as ts
from tessera import ops
from tessera.errors import UnsupportedError
from tessera.ir import dtypes

ERF = np.vectorize(math.erf)
TOL = {"float32": 2e-6, "float64": 1e-13, "float16": 2e-3, "bfloat16": 1.6e-2}


def np_dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def check(out, ref, dtype_name, scale=1.0):
    out64 = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out64.shape == ref.shape
    tol = TOL[dtype_name] * scale
    np.testing.assert_allclose(out64, ref, rtol=tol, atol=tol)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


UNARY = {
    "neg": (ops.neg, lambda x: -x, "any"),
    "abs": (ops.abs, np.abs, "any"),
    "square": (ops.square, np.square, "any"),
    "sign": (ops.sign, np.sign, "any"),
    "exp": (ops.exp, np.exp, "any"),
    "exp2": (ops.exp2, np.exp2, "any"),
    "log": (ops.log, np.log, "pos"),
    "log2": (ops.log2, np.log2, "pos"),
    "sqrt": (ops.sqrt, np.sqrt, "pos"),
    "rsqrt": (ops.rsqrt, lambda x: 1 / np.sqrt(x), "pos"),
    "sin": (ops.sin, np.sin, "any"),
    "cos": (ops.cos, np.cos, "any"),
    "tanh": (ops.tanh, np.tanh, "any"),
    "erf": (ops.erf, ERF, "any"),
    "reciprocal": (ops.reciprocal, lambda x: 1 / x, "pos"),
    "floor": (ops.floor, np.floor, "any"),
    "ceil": (ops.ceil, np.ceil, "any"),
    "round": (ops.round, np.round, "any"),
    "sigmoid": (ops.sigmoid, sigmoid, "any"),
    "relu": (ops.relu, lambda x: np.maximum(x, 0), "any"),
    "silu": (ops.silu, lambda x: x * sigmoid(x), "any"),
    "gelu": (ops.gelu, lambda x: 0.5 * x * (1 + ERF(x / math.sqrt(2))), "any"),
    "gelu_tanh": (lambda x: ops.gelu(x, "tanh"),
                  lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))), "any"),
    "softplus": (ops.softplus, lambda x: np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))), "any"),
    "leaky_relu": (lambda x: ops.leaky_relu(x, 0.2), lambda x: np.where(x > 0, x, 0.2 * x), "any"),
    "hardsigmoid": (ops.hardsigmoid, lambda x: np.clip(x + 3, 0, 6) / 6, "any"),
    "hardswish": (ops.hardswish, lambda x: x * np.clip(x + 3, 0, 6) / 6, "any"),
}  # fmt: skip


def _input(rng, shape, domain, dt):
    x = rng.standard_normal(shape) * 3
    if domain == "pos":
        x = np.abs(x) + 0.1
    return x.astype(dt)


@pytest.mark.parametrize("dtype_name", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("domain", ["any", "pos"])
def test_unary_ops(rng, dtype_name, domain):
    """Every unary op of one domain in one build (one compiler run), on an odd 2-D shape."""
    dt = np_dtype(dtype_name)
    names = [n for n, (_, _, d) in UNARY.items() if d == domain]
    x = ops.placeholder((37, 19), dtype_name, "x")
    outs = [UNARY[n][0](x) for n in names]
    f = ops.build(outs, [x])
    xv = _input(rng, (37, 19), domain, dt)
    results = f(xv)
    for n, out in zip(names, results):
        assert out.dtype == dt, n
        ref = UNARY[n][1](xv.astype(np.float64))
        if n in ("round", "floor", "ceil", "sign"):
            np.testing.assert_array_equal(out.astype(np.float64), ref, err_msg=n)
        else:
            check(out, ref, dtype_name, scale=4 if n in ("gelu", "gelu_tanh", "silu", "softplus") else 1)


def test_unary_int_inputs(rng):
    """Transcendentals of integers give float32; neg/abs keep the integer type."""
    x = ops.placeholder((5, 7), "int32", "x")
    e, a, n = ops.exp(x), ops.abs(x), ops.neg(x)
    assert e.dtype == dtypes.float32 and a.dtype == dtypes.int32
    xv = rng.integers(-5, 5, (5, 7)).astype(np.int32)
    ev, av, nv = ops.build([e, a, n], [x])(xv)
    check(ev, np.exp(xv.astype(np.float64)), "float32")
    np.testing.assert_array_equal(av, np.abs(xv))
    np.testing.assert_array_equal(nv, -xv)


BINARY = {
    "add": (ops.add, np.add), "sub": (ops.sub, np.subtract), "mul": (ops.mul, np.multiply),
    "div": (ops.div, np.divide), "maximum": (ops.maximum, np.maximum), "minimum": (ops.minimum, np.minimum),
    "pow": (ops.pow, np.power), "floor_divide": (ops.floor_divide, np.floor_divide),
    "remainder": (ops.remainder, np.remainder),
}  # fmt: skip

BROADCASTS = [((6, 5), (6, 5)), ((3, 1, 7), (4, 1)), ((1,), (9, 3)), ((2, 3, 1), (1, 3, 5)), ((11,), ())]


@pytest.mark.parametrize("sa,sb", BROADCASTS)
def test_binary_broadcasting_float32(rng, sa, sb):
    a = ops.placeholder(sa, "float32", "a")
    b = ops.placeholder(sb, "float32", "b")
    names = list(BINARY)
    f = ops.build([BINARY[n][0](a, b) for n in names], [a, b])
    av = (rng.standard_normal(sa) * 2).astype(np.float32)
    bv = (rng.standard_normal(sb) * 2).astype(np.float32)
    bv = np.where(np.abs(bv) < 0.1, 0.5, bv).astype(np.float32)  # no near-zero divisors
    pa = np.abs(av) + 0.5  # positive bases for pow
    outs = f(av, bv)
    for n, out in zip(names, outs):
        a64, b64 = av.astype(np.float64), bv.astype(np.float64)
        if n == "pow":
            continue
        ref = BINARY[n][1](a64, b64)
        if n in ("floor_divide", "remainder"):  # the float32 quotient may round across an integer
            ok = np.isclose(out, ref, rtol=1e-5, atol=1e-5) | np.isclose(out, BINARY[n][1](av, bv), rtol=1e-5, atol=1e-5)
            assert ok.all(), n
            continue
        check(out, ref, "float32")
    fp = ops.build([ops.pow(a, b)], [a, b])
    check(fp(pa.astype(np.float32), bv), np.power(pa.astype(np.float32).astype(np.float64), bv.astype(np.float64)), "float32", 8)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_binary_half(rng, dtype_name):
    dt = np_dtype(dtype_name)
    a = ops.placeholder((4, 33), dtype_name, "a")
    b = ops.placeholder((33,), dtype_name, "b")
    outs = [ops.add(a, b), ops.mul(a, b), ops.div(a, b), ops.maximum(a, b), ops.mul(a, 2.5)]
    assert all(o.dtype == dtypes.dtype(dtype_name) for o in outs)  # weak Python scalars keep the dtype
    av = rng.standard_normal((4, 33)).astype(dt)
    bv = (rng.uniform(0.5, 2, 33) * rng.choice([-1, 1], 33)).astype(dt)
    res = ops.build(outs, [a, b])(av, bv)
    a64, b64 = av.astype(np.float64), bv.astype(np.float64)
    for out, ref in zip(res, [a64 + b64, a64 * b64, a64 / b64, np.maximum(a64, b64), a64 * 2.5]):
        check(out, ref, dtype_name)


def test_integer_arithmetic_and_promotion(rng):
    a = ops.placeholder((5, 6), "int32", "a")
    b = ops.placeholder((6,), "int64", "b")
    c = ops.placeholder((5, 6), "uint8", "c")
    d = ops.placeholder((5, 6), "int8", "d")
    add, fdiv, mod, tdiv, mix, ipow = (ops.add(a, b), ops.floor_divide(a, b), ops.remainder(a, b), ops.div(a, b),
                                       ops.add(c, d), ops.pow(a, 3))  # fmt: skip
    assert add.dtype == dtypes.int64 and tdiv.dtype == dtypes.float32 and mix.dtype == dtypes.int16
    assert ops.mul(a, 0.5).dtype == dtypes.float32 and ops.add(ops.gt(a, 0), 1).dtype == dtypes.int64
    av = rng.integers(-50, 50, (5, 6)).astype(np.int32)
    bv = rng.integers(-7, 8, 6).astype(np.int64)
    bv[bv == 0] = 3
    cv = rng.integers(0, 255, (5, 6)).astype(np.uint8)
    dv = rng.integers(-128, 127, (5, 6)).astype(np.int8)
    f = ops.build([add, fdiv, mod, tdiv, mix, ipow], [a, b, c, d])
    r = f(av, bv, cv, dv)
    np.testing.assert_array_equal(r[0], av + bv)
    np.testing.assert_array_equal(r[1], np.floor_divide(av.astype(np.int64), bv))
    np.testing.assert_array_equal(r[2], np.remainder(av.astype(np.int64), bv))
    check(r[3], av / bv, "float32")
    np.testing.assert_array_equal(r[4], cv.astype(np.int16) + dv)
    np.testing.assert_array_equal(r[5], av.astype(np.int32) ** 3)


@pytest.mark.parametrize("op", [ops.floor_divide, ops.remainder])
def test_integer_division_by_zero_raises_on_the_cpu(op):
    """Like torch on the CPU (numpy would give 0); the kernel must not trap (SIGFPE)."""
    a = ops.placeholder((4,), "int32", "a")
    b = ops.placeholder((4,), "int32", "b")
    f = ops.build(op(a, b), [a, b])
    av = np.array([7, -7, 0, -(2**31)], np.int32)
    with pytest.raises(ts.DivisionByZeroError, match="division or modulo by zero"):
        f(av, np.array([2, 0, 1, -1], np.int32))
    with pytest.raises(ZeroDivisionError):
        f(av, np.zeros(4, np.int32))
    # INT_MIN // -1 wraps to INT_MIN (two's complement, like numpy and torch); % -1 is 0
    bv = np.array([2, -2, 1, -1], np.int32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(f(av, bv), (np.floor_divide if op is ops.floor_divide else np.remainder)(av, bv))


def test_comparisons_logic_where(rng):
    a = ops.placeholder((7, 5), "float32", "a")
    b = ops.placeholder((5,), "float32", "b")
    av = rng.standard_normal((7, 5)).astype(np.float32)
    bv = rng.standard_normal(5).astype(np.float32)
    av[0, :] = bv  # some equal elements
    cmp = [ops.eq(a, b), ops.ne(a, b), ops.lt(a, b), ops.le(a, b), ops.gt(a, b), ops.ge(a, 0.0)]
    refs = [av == bv, av != bv, av < bv, av <= bv, av > bv, av >= 0]
    gt = ops.gt(a, b)
    logic = [ops.logical_and(gt, ops.gt(a, 0.0)), ops.logical_or(gt, ops.lt(a, -1.0)), ops.logical_xor(gt, ops.gt(a, 0.0)),
             ops.logical_not(gt)]  # fmt: skip
    lrefs = [(av > bv) & (av > 0), (av > bv) | (av < -1), (av > bv) ^ (av > 0), ~(av > bv)]
    w1 = ops.where(gt, a, b)
    w2 = ops.where(gt, 1.0, a)
    w3 = ops.where(gt, 2, -3)
    res = ops.build(cmp + logic + [w1, w2, w3], [a, b])(av, bv)
    for out, ref in zip(res, refs + lrefs):
        assert out.dtype == np.bool_
        np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(res[-3], np.where(av > bv, av, bv))
    np.testing.assert_array_equal(res[-2], np.where(av > bv, 1.0, av).astype(np.float32))
    assert res[-1].dtype == np.int64
    np.testing.assert_array_equal(res[-1], np.where(av > bv, 2, -3))


def test_clamp_and_nan(rng):
    x = ops.placeholder((3, 8), "float32", "x")
    lo = ops.placeholder((8,), "float32", "lo")
    outs = [ops.clamp(x, -0.5, 0.5), ops.clamp(x, min=lo), ops.clamp(x, max=0.0), ops.relu(x), ops.maximum(x, lo)]
    xv = rng.standard_normal((3, 8)).astype(np.float32)
    xv[1, 2] = np.nan
    lov = rng.standard_normal(8).astype(np.float32) * 0.1
    r = ops.build(outs, [x, lo])(xv, lov)
    refs = [np.clip(xv, -0.5, 0.5), np.maximum(xv, lov), np.minimum(xv, 0.0), np.maximum(xv, 0), np.maximum(xv, lov)]
    for out, ref in zip(r, refs):
        np.testing.assert_array_equal(out, ref)  # NaN propagates, as in numpy and torch
        assert np.isnan(out[1, 2])


@pytest.mark.parametrize("src,dst", [("float32", "float16"), ("float32", "int32"), ("float32", "bool"), ("int64", "float32"),
                                     ("float64", "bfloat16"), ("bool", "float32"), ("float16", "float64"), ("int32", "uint8")])  # fmt: skip
def test_cast(rng, src, dst):
    x = ops.placeholder((4, 9), src, "x")
    y = ops.cast(x, dst)
    assert y.dtype == dtypes.dtype(dst)
    if src == "bool":
        xv = rng.random((4, 9)) > 0.5
    elif src.startswith(("int", "uint")):
        xv = rng.integers(-300, 300, (4, 9)).astype(src)
    else:
        xv = (rng.standard_normal((4, 9)) * 100).astype(np_dtype(src))
        xv[0, 0] = 0
    out = ops.build([y], [x])(xv)
    if dst == "uint8":
        ref = xv.astype(np.int64).astype(np.uint8)  # wraps modulo 256, as C and torch
    else:
        ref = xv.astype(np_dtype(dst))
    assert out.dtype == np_dtype(dst)
    np.testing.assert_array_equal(out.astype(np.float64), ref.astype(np.float64))


def test_scalar_and_rank0_inputs(rng):
    s = ops.placeholder((), "float32", "s")
    x = ops.placeholder((6,), "float32", "x")
    y = ops.add(ops.mul(x, s), 1.0)
    z = ops.exp(s)
    sv = np.array(1.5, np.float32)
    xv = rng.standard_normal(6).astype(np.float32)
    yv, zv = ops.build([y, z], [s, x])(sv, xv)
    assert zv.shape == ()
    check(yv, xv.astype(np.float64) * 1.5 + 1, "float32")
    check(zv, np.exp(1.5), "float32")


def test_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    a = ops.placeholder((5, 3), "bfloat16", "a")
    f = ops.build([ops.silu(a)], [a])
    t = torch.randn(5, 3, dtype=torch.bfloat16)
    out = f(t)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.nn.functional.silu(t), rtol=1.6e-2, atol=1e-2)


EXTRA_UNARY = {
    "tan": (ops.tan, np.tan),
    "log1p": (ops.log1p, np.log1p),
    "expm1": (ops.expm1, np.expm1),
    "elu": (lambda x: ops.elu(x, 0.7), lambda x: np.where(x > 0, x, 0.7 * np.expm1(np.minimum(x, 0)))),
    "mish": (ops.mish, lambda x: x * np.tanh(np.logaddexp(0, x))),
    "trunc": (ops.trunc, np.trunc),
}  # fmt: skip


@pytest.mark.parametrize("dtype_name", ["float32", "float64", "float16"])
def test_extra_unary_ops(rng, dtype_name):
    """tan, log1p, expm1 (accurate near 0), elu, mish, trunc and isnan in one build."""
    dt = np_dtype(dtype_name)
    x = ops.placeholder((23, 9), dtype_name, "x")
    names = list(EXTRA_UNARY)
    f = ops.build([EXTRA_UNARY[n][0](x) for n in names] + [ops.isnan(x)], [x])
    xv = (rng.standard_normal((23, 9)) * 2).clip(-0.95, None).astype(dt)  # log1p needs x > -1
    xv[0, :4] = np.array([1e-7, -3e-6, 2e-4, -1e-3]).astype(dt)  # where log(1 + x) and exp(x) - 1 cancel
    xv[1, 0] = np.nan
    results = f(xv)
    x64 = xv.astype(np.float64)
    ok = ~np.isnan(x64)
    for n, out in zip(names, results):
        assert out.dtype == dt, n
        with np.errstate(invalid="ignore"):
            ref = EXTRA_UNARY[n][1](x64)
        assert np.isnan(out[~ok]).all(), n
        if n == "trunc":
            np.testing.assert_array_equal(out[ok].astype(np.float64), ref[ok], err_msg=n)
        else:  # relative accuracy also at the tiny inputs (float16 results there are subnormal)
            atol = 1e-7 if dtype_name == "float16" else 1e-30
            np.testing.assert_allclose(out[ok].astype(np.float64), ref[ok], rtol=TOL[dtype_name] * 4, atol=atol, err_msg=n)
    np.testing.assert_array_equal(results[-1], np.isnan(xv))


def test_trunc_isnan_of_integers_and_bitwise(rng):
    a = ops.placeholder((7, 5), "int32", "a")
    b = ops.placeholder((5,), "int64", "b")
    m = ops.placeholder((7, 5), "bool", "m")
    outs = [ops.trunc(a), ops.isnan(a), ops.bitwise_and(a, b), ops.bitwise_or(a, 6), ops.bitwise_and(m, ops.lt(a, 0)),
            ops.bitwise_or(m, False)]  # fmt: skip
    av = rng.integers(-100, 100, (7, 5)).astype(np.int32)
    bv = rng.integers(0, 1 << 40, 5).astype(np.int64)
    mv = rng.random((7, 5)) > 0.5
    res = ops.build(outs, [a, b, m])(av, bv, mv)
    assert res[2].dtype == np.int64 and res[4].dtype == np.bool_
    for out, ref in zip(res, [av, np.zeros((7, 5), bool), av & bv, av | 6, mv & (av < 0), mv]):
        np.testing.assert_array_equal(out, ref)
    with pytest.raises(UnsupportedError, match="bitwise_and"):
        ops.bitwise_and(ops.placeholder((3,), "float32"), a)
