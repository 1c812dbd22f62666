"""Reductions, softmax/log_softmax and normalisations on the CPU against float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest

from tessera import ops
from tessera.ir import dtypes

TOL = {"float32": 1e-5, "float64": 1e-12, "float16": 2e-3, "bfloat16": 1.6e-2}


def np_dtype(name):
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


def check(out, ref, name, scale=1.0):
    out64 = np.asarray(out).astype(np.float64)
    assert out64.shape == np.shape(ref)
    np.testing.assert_allclose(out64, ref, rtol=TOL[name] * scale, atol=TOL[name] * scale)


REDUCTIONS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}
CASES = [((13, 7), 1, False), ((13, 7), 0, True), ((4, 5, 6), (0, 2), False), ((4, 5, 6), None, False),
         ((4, 5, 6), None, True), ((3, 1, 1030), -1, True), ((9,), 0, False)]  # fmt: skip


@pytest.mark.parametrize("shape,axes,keepdims", CASES)
def test_reductions_float32(rng, shape, axes, keepdims):
    x = ops.placeholder(shape, "float32", "x")
    names = list(REDUCTIONS)
    outs = [getattr(ops, n)(x, axes, keepdims) for n in names]
    xv = rng.uniform(0.5, 1.5, shape).astype(np.float32) * rng.choice([-1, 1], shape).astype(np.float32)
    res = ops.build(outs, [x])(xv)
    ax = tuple(axes) if isinstance(axes, tuple) else axes
    for n, out in zip(names, res):
        ref = REDUCTIONS[n](xv.astype(np.float64), axis=ax, keepdims=keepdims)
        check(out, ref, "float32", scale=10 if n == "prod" else 1)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float64"])
def test_reductions_other_floats(rng, dtype_name):
    x = ops.placeholder((6, 300), dtype_name, "x")
    outs = [ops.sum(x, 1), ops.mean(x, 0, True), ops.max(x, 1), ops.min(x)]
    xv = rng.standard_normal((6, 300)).astype(np_dtype(dtype_name))
    res = ops.build(outs, [x])(xv)
    x64 = xv.astype(np.float64)
    for out, ref in zip(res, [x64.sum(1), x64.mean(0, keepdims=True), x64.max(1), x64.min()]):
        assert out.dtype == np_dtype(dtype_name)
        check(out, ref, dtype_name, scale=2)


def test_integer_and_bool_reductions(rng):
    x = ops.placeholder((5, 8), "int32", "x")
    b = ops.placeholder((5, 8), "bool", "b")
    outs = [ops.sum(x, 1), ops.max(x, 0), ops.min(x, 1, True), ops.prod(x, 1), ops.sum(b, 1), ops.max(b, 1), ops.min(b, 1)]
    assert outs[0].dtype == dtypes.int64 and outs[1].dtype == dtypes.int32 and outs[5].dtype == dtypes.boolean
    xv = rng.integers(-9, 9, (5, 8)).astype(np.int32)
    bv = rng.random((5, 8)) > 0.3
    bv[0] = True
    res = ops.build(outs, [x, b])(xv, bv)
    refs = [xv.sum(1), xv.max(0), xv.min(1, keepdims=True), xv.astype(np.int64).prod(1), bv.sum(1), bv.any(1), bv.all(1)]
    for out, ref in zip(res, refs):
        np.testing.assert_array_equal(out, ref)


def test_sum_dtype_override(rng):
    x = ops.placeholder((4, 100), "float16", "x")
    y = ops.sum(x, 1, dtype="float32")
    xv = rng.standard_normal((4, 100)).astype(np.float16)
    out = ops.build([y], [x])(xv)
    assert out.dtype == np.float32
    check(out, xv.astype(np.float64).sum(1), "float32", 10)


def softmax_ref(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


@pytest.mark.parametrize("shape,axis", [((7, 33), -1), ((3, 4, 5), 1), ((2, 1000), 1), ((5, 3), 0), ((1, 1), -1)])
@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_softmax_log_softmax(rng, shape, axis, dtype_name):
    x = ops.placeholder(shape, dtype_name, "x")
    sm, lsm = ops.softmax(x, axis), ops.log_softmax(x, axis)
    f = ops.build([sm, lsm], [x])
    xv = (rng.standard_normal(shape) * 4 + 50).astype(np_dtype(dtype_name))  # a large offset: max subtraction matters
    s, ls = f(xv)
    x64 = xv.astype(np.float64)
    ref = softmax_ref(x64, axis)
    check(s, ref, dtype_name)
    check(ls, np.log(ref), dtype_name, scale=20)


def test_softmax_is_one_kernel():
    x = ops.placeholder((8, 64), "float32", "x")
    f = ops.generate([ops.softmax(x)], [x])
    assert len(f.kernels) == 1
    assert len(f.kernels[0].plan.reductions) == 2


def ln_ref(x, w, b, eps, ndim):
    axes = tuple(range(x.ndim - ndim, x.ndim))
    mu = x.mean(axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axes, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 77), (1, 769)])
def test_layer_norm(rng, shape, dtype_name):
    dt = np_dtype(dtype_name)
    x = ops.placeholder(shape, dtype_name, "x")
    w = ops.placeholder(shape[-1:], dtype_name, "w")
    b = ops.placeholder(shape[-1:], dtype_name, "b")
    y = ops.layer_norm(x, w, b, eps=1e-5)
    f = ops.build([y], [x, w, b])
    assert f.num_kernels == 1
    xv = (rng.standard_normal(shape) * 2 + 3).astype(dt)
    wv, bv = rng.standard_normal(shape[-1:]).astype(dt), rng.standard_normal(shape[-1:]).astype(dt)
    out = f(xv, wv, bv)
    ref = ln_ref(xv.astype(np.float64), wv.astype(np.float64), bv.astype(np.float64), 1e-5, 1)
    check(out, ref, dtype_name, scale=4)


def test_layer_norm_two_dims_no_affine(rng):
    x = ops.placeholder((3, 4, 10), "float32", "x")
    y = ops.layer_norm(x, normalized_shape=(4, 10))
    xv = (rng.standard_normal((3, 4, 10)) + 1e3).astype(np.float32)  # a large mean: two-pass variance matters
    out = ops.build([y], [x])(xv)
    check(out, ln_ref(xv.astype(np.float64), None, None, 1e-5, 2), "float32", scale=400)


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_rms_norm(rng, dtype_name):
    dt = np_dtype(dtype_name)
    x = ops.placeholder((6, 130), dtype_name, "x")
    w = ops.placeholder((130,), dtype_name, "w")
    f = ops.build([ops.rms_norm(x, w, eps=1e-6)], [x, w])
    assert f.num_kernels == 1
    xv, wv = rng.standard_normal((6, 130)).astype(dt), rng.standard_normal(130).astype(dt)
    x64 = xv.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(1, keepdims=True) + 1e-6) * wv.astype(np.float64)
    check(f(xv, wv), ref, dtype_name, scale=4)


def test_batch_norm(rng):
    x = ops.placeholder((2, 5, 3, 4), "float32", "x")
    m, v, w, b = (ops.placeholder((5,), "float32", n) for n in ("m", "v", "w", "b"))
    f = ops.build([ops.batch_norm(x, m, v, w, b, eps=1e-5)], [x, m, v, w, b])
    xv = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    mv, wv, bv = (rng.standard_normal(5).astype(np.float32) for _ in range(3))
    vv = rng.uniform(0.5, 2, 5).astype(np.float32)
    c = (slice(None), None, None)
    ref = (xv - mv[c]) / np.sqrt(vv[c] + 1e-5) * wv[c] + bv[c]
    check(f(xv, mv, vv, wv, bv), ref.astype(np.float64), "float32", 2)


def test_reduce_prologue_and_epilogue_fuse(rng):
    """sum(exp(x) * 2) / n + 1: the exp prologue and the scale epilogue live in the reduction kernel."""
    x = ops.placeholder((9, 40), "float32", "x")
    s = ops.sum(ops.mul(ops.exp(x), 2.0), 1, keepdims=True)
    y = ops.add(ops.div(s, 40.0), 1.0)
    f = ops.build([y], [x])
    assert f.num_kernels == 1
    xv = rng.standard_normal((9, 40)).astype(np.float32)
    check(f(xv), (np.exp(xv.astype(np.float64)) * 2).sum(1, keepdims=True) / 40 + 1, "float32")


def test_unaligned_reduction_gets_its_own_kernel(rng):
    """x - max(x over rows)[reversed]: the reversed read cannot fuse, so the max is materialised."""
    x = ops.placeholder((6, 5), "float32", "x")
    m = ops.max(x, 1)
    rev = ops.slice(m, 0, None, None, -1)
    y = ops.sub(x, ops.reshape(rev, (6, 1)))
    f = ops.build([y], [x])
    assert f.num_kernels == 2
    xv = rng.standard_normal((6, 5)).astype(np.float32)
    np.testing.assert_allclose(f(xv), xv - xv.max(1)[::-1, None], rtol=1e-6)


def test_multiple_outputs_share_statistics(rng):
    """The mean and the centred values requested together (the mean kernel, then the subtraction)."""
    x = ops.placeholder((4, 50), "float32", "x")
    mu = ops.mean(x, 1, keepdims=True)
    y = ops.sub(x, mu)
    f = ops.build([y, mu], [x])
    xv = rng.standard_normal((4, 50)).astype(np.float32)
    assert f.num_kernels == 2
    yv, mv = f(xv)
    check(mv, xv.astype(np.float64).mean(1, keepdims=True), "float32")
    check(yv, xv - xv.astype(np.float64).mean(1, keepdims=True), "float32")


def test_var_std_logsumexp(rng):
    x = ops.placeholder((5, 12, 3), "float32", "x")
    outs = [ops.var(x, 1), ops.std(x, (0, 2), 0, keepdims=True), ops.logsumexp(x, 1), ops.logsumexp(x, -1, keepdims=True)]
    xv = (rng.standard_normal((5, 12, 3)) * 2 + 5).astype(np.float32)
    x64 = xv.astype(np.float64)
    res = ops.build(outs, [x])(xv)
    lse = np.log(np.exp(x64).sum(1))
    for out, ref in zip(res, [x64.var(1, ddof=1), x64.std((0, 2), ddof=0, keepdims=True), lse,
                              np.log(np.exp(x64).sum(-1, keepdims=True))]):  # fmt: skip
        check(out, ref, "float32", 2)


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "int32"])
def test_argmax_argmin(rng, dtype_name):
    x = ops.placeholder((6, 9, 5), dtype_name, "x")
    outs = [ops.argmax(x, 1), ops.argmin(x, -1, keepdims=True), ops.argmax(x, 0, keepdims=True), ops.argmin(x, 1)]
    f = ops.build(outs, [x])
    if dtype_name == "int32":
        xv = rng.integers(-3, 4, (6, 9, 5)).astype(np.int32)  # many ties: the first index must win
    else:
        xv = rng.standard_normal((6, 9, 5)).astype(dtype_name)
        xv[2, 4, 1] = np.nan  # numpy: the first NaN is both the maximum and the minimum
    res = f(xv)
    refs = [np.argmax(xv, 1), np.argmin(xv, -1)[..., None], np.argmax(xv, 0)[None], np.argmin(xv, 1)]
    for out, ref in zip(res, refs):
        assert out.dtype == np.int64
        np.testing.assert_array_equal(out, ref)


def test_cumsum_variants(rng):
    x = ops.placeholder((7, 11), "float32", "x")
    b = ops.placeholder((4, 9), "bool", "b")
    h = ops.placeholder((13,), "float16", "h")
    outs = [ops.cumsum(x, 1), ops.cumsum(x, 0, exclusive=True), ops.cumsum(x, -1, reverse=True),
            ops.cumsum(x, 1, exclusive=True, reverse=True), ops.cumsum(b, 1), ops.cumsum(h, 0)]  # fmt: skip
    xv = rng.standard_normal((7, 11)).astype(np.float32)
    bv = rng.random((4, 9)) > 0.4
    hv = rng.standard_normal(13).astype(np.float16)
    res = ops.build(outs, [x, b, h])(xv, bv, hv)
    x64 = xv.astype(np.float64)
    rev = np.flip(np.cumsum(np.flip(x64, 1), 1), 1)
    for out, ref in zip(res[:4], [np.cumsum(x64, 1), np.cumsum(x64, 0) - x64, rev, rev - x64]):
        check(out, ref, "float32", 2)
    assert res[4].dtype == np.int64 and res[5].dtype == np.float16
    np.testing.assert_array_equal(res[4], np.cumsum(bv, 1))
    check(res[5], np.cumsum(hv.astype(np.float64)), "float16", 4)
