"""matmul/linear, conv2d, pooling and rotary embeddings on the CPU against float64 numpy (torch where it is the spec)."""

from __future__ import annotations

import numpy as np
import pytest

from tessera import ops
from tessera.ir import dtypes


def rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


@pytest.mark.parametrize("sa,sb", [((5, 7), (7, 3)), ((1, 33), (33, 65)), ((2, 4, 9), (9, 5)), ((3, 1, 4, 6), (2, 6, 5)),
                                   ((7,), (7, 4)), ((3, 7), (7,)), ((7,), (7,))])  # fmt: skip
def test_matmul_float32(rng, sa, sb):
    a = ops.placeholder(sa, "float32", "a")
    b = ops.placeholder(sb, "float32", "b")
    av, bv = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    out = ops.build([ops.matmul(a, b)], [a, b])(av, bv)
    ref = np.matmul(av.astype(np.float64), bv.astype(np.float64))
    assert np.shape(out) == ref.shape
    assert rel(out, ref) < 1e-6


def test_matmul_half_and_int(rng):
    a = ops.placeholder((9, 40), "float16", "a")
    b = ops.placeholder((40, 6), "float16", "b")
    ia = ops.placeholder((3, 4), "int32", "ia")
    ib = ops.placeholder((4, 2), "int32", "ib")
    mm, imm = ops.matmul(a, b), ops.matmul(ia, ib)
    assert mm.dtype == dtypes.float16 and imm.dtype == dtypes.int32
    av, bv = rng.standard_normal((9, 40)).astype(np.float16), rng.standard_normal((40, 6)).astype(np.float16)
    iav, ibv = rng.integers(-9, 9, (3, 4)).astype(np.int32), rng.integers(-9, 9, (4, 2)).astype(np.int32)
    out, iout = ops.build([mm, imm], [a, b, ia, ib])(av, bv, iav, ibv)
    assert rel(out, av.astype(np.float64) @ bv.astype(np.float64)) < 1e-3
    np.testing.assert_array_equal(iout, iav @ ibv)


def test_linear_with_bias_fuses(rng):
    x = ops.placeholder((2, 3, 16), "float32", "x")
    w = ops.placeholder((10, 16), "float32", "w")
    b = ops.placeholder((10,), "float32", "b")
    y = ops.gelu(ops.linear(x, w, b))
    f = ops.build([y], [x, w, b])
    assert f.num_kernels == 1  # bias and activation are the contraction's epilogue
    xv, wv, bv = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 16), (10, 16), (10,)))
    lin = xv.astype(np.float64) @ wv.T.astype(np.float64) + bv
    from math import erf

    ref = 0.5 * lin * (1 + np.vectorize(erf)(lin / np.sqrt(2)))
    assert rel(f(xv, wv, bv), ref) < 1e-6


def conv_ref(x, w, stride, pad, dil, groups):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, [(0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])])
    oh = (h + 2 * pad[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * pad[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    og = o // groups
    for g in range(groups):
        for u in range(kh):
            for v in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, u * dil[0]:u * dil[0] + stride[0] * (oh - 1) + 1:stride[0],
                           v * dil[1]:v * dil[1] + stride[1] * (ow - 1) + 1:stride[1]]  # fmt: skip
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, w[g * og:(g + 1) * og, :, u, v])
    return out


@pytest.mark.parametrize("stride,pad,dil,groups", [((1, 1), (0, 0), (1, 1), 1), ((2, 2), (1, 1), (1, 1), 1),
                                                   ((1, 2), (2, 1), (2, 1), 1), ((1, 1), (1, 1), (1, 1), 3)])  # fmt: skip
def test_conv2d(rng, stride, pad, dil, groups):
    x = ops.placeholder((2, 6, 9, 8), "float32", "x")
    w = ops.placeholder((9, 6 // groups, 3, 3), "float32", "w")
    b = ops.placeholder((9,), "float32", "b")
    y = ops.conv2d(x, w, b, stride, pad, dil, groups)
    xv = rng.standard_normal((2, 6, 9, 8)).astype(np.float32)
    wv = rng.standard_normal((9, 6 // groups, 3, 3)).astype(np.float32)
    bv = rng.standard_normal(9).astype(np.float32)
    out = ops.build([y], [x, w, b])(xv, wv, bv)
    ref = conv_ref(xv.astype(np.float64), wv.astype(np.float64), stride, pad, dil, groups) + bv[None, :, None, None]
    assert out.shape == ref.shape
    assert rel(out, ref) < 1e-6


def test_pooling_against_torch(rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = ops.placeholder((2, 3, 11, 10), "float32", "x")
    cases = [
        (ops.max_pool2d(x, 3, 2, 1), lambda t: F.max_pool2d(t, 3, 2, 1)),
        (ops.max_pool2d(x, 2), lambda t: F.max_pool2d(t, 2)),
        (ops.max_pool2d(x, 3, 2, 0, ceil_mode=True), lambda t: F.max_pool2d(t, 3, 2, 0, ceil_mode=True)),
        (ops.avg_pool2d(x, 3, 2, 1), lambda t: F.avg_pool2d(t, 3, 2, 1)),
        (ops.avg_pool2d(x, 3, 2, 1, count_include_pad=False), lambda t: F.avg_pool2d(t, 3, 2, 1, count_include_pad=False)),
        (ops.avg_pool2d(x, 2, 3, 1, ceil_mode=True), lambda t: F.avg_pool2d(t, 2, 3, 1, ceil_mode=True)),
        (ops.adaptive_avg_pool2d(x, 1), lambda t: F.adaptive_avg_pool2d(t, 1)),
        (ops.adaptive_avg_pool2d(x, (3, 4)), lambda t: F.adaptive_avg_pool2d(t, (3, 4))),
    ]
    xv = rng.standard_normal((2, 3, 11, 10)).astype(np.float32)
    res = ops.build([c[0] for c in cases], [x])(xv)
    t = torch.from_numpy(xv.astype(np.float64))
    for k, (out, (_, ref_fn)) in enumerate(zip(res, cases)):
        ref = ref_fn(t).numpy()
        assert out.shape == ref.shape, k
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6, err_msg=f"case {k}")


@pytest.mark.parametrize("kernel,stride,padding,ceil_mode", [(3, 2, 1, False), (3, 2, 1, True), (2, 3, 1, True),
                                                           (4, 1, 2, False), (5, 3, 2, True)])
def test_max_pool_padding_never_wins_and_special_values_propagate(rng, kernel, stride, padding, ceil_mode):
    """Max pooling reads the nearest input element for a tap in the padding (ops.nn._pool): on
    all-negative inputs with +inf, -inf and NaN on the borders it still equals torch's."""
    torch = pytest.importorskip("torch")
    x = ops.placeholder((2, 3, 13, 11), "float32", "x")
    f = ops.build([ops.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode)], [x])
    for _ in range(2):
        xv = -np.abs(rng.standard_normal((2, 3, 13, 11))).astype(np.float32) - 1
        xv[0, 0, 0, :] = np.inf
        xv[0, 1, :, -1] = -np.inf
        xv[1, 2, -1, 0] = np.nan
        xv[1, 0, 0, 0] = np.nan
        ref = torch.nn.functional.max_pool2d(torch.from_numpy(xv), kernel, stride, padding, ceil_mode=ceil_mode).numpy()
        np.testing.assert_array_equal(f(xv), ref)


def test_ceil_mode_pooling_over_symbolic_sizes(rng):
    """ceil_mode output sizes as expressions of symbolic H, W (torch's last-window rule included)."""
    torch = pytest.importorskip("torch")
    from tessera.ir import Var, dtypes

    F = torch.nn.functional
    h, w = Var("h", dtypes.int32), Var("w", dtypes.int32)
    x = ops.placeholder((2, 3, h, w), "float32", "x")
    f = ops.build([ops.max_pool2d(x, 3, 2, 1, ceil_mode=True), ops.avg_pool2d(x, 2, 3, 1, ceil_mode=True),
                   ops.avg_pool2d(x, 3, 2, 0, ceil_mode=True, count_include_pad=False)], [x])  # fmt: skip
    for hw in ((11, 10), (9, 9), (4, 7)):
        xv = rng.standard_normal((2, 3, *hw)).astype(np.float32)
        t = torch.from_numpy(xv.astype(np.float64))
        refs = [F.max_pool2d(t, 3, 2, 1, ceil_mode=True), F.avg_pool2d(t, 2, 3, 1, ceil_mode=True),
                F.avg_pool2d(t, 3, 2, 0, ceil_mode=True, count_include_pad=False)]  # fmt: skip
        for out, ref in zip(f(xv), refs):
            assert out.shape == tuple(ref.shape), hw
            np.testing.assert_allclose(out, ref.numpy(), rtol=1e-5, atol=1e-6)


def test_rotary(rng):
    x = ops.placeholder((2, 4, 5, 8), "float32", "x")  # [batch, heads, seq, head_dim]
    cos = ops.placeholder((5, 8), "float32", "cos")
    sin = ops.placeholder((5, 8), "float32", "sin")
    y = ops.apply_rotary(x, cos, sin)
    f = ops.build([y, ops.rotate_half(x)], [x, cos, sin])
    xv = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)
    ang = rng.uniform(0, 6, (5, 4))
    cv = np.cos(np.concatenate([ang, ang], -1)).astype(np.float32)
    sv = np.sin(np.concatenate([ang, ang], -1)).astype(np.float32)
    yv, rh = f(xv, cv, sv)
    rot = np.concatenate([-xv[..., 4:], xv[..., :4]], -1)
    np.testing.assert_array_equal(rh, rot)
    assert rel(yv, xv.astype(np.float64) * cv + rot * sv.astype(np.float64)) < 1e-6
    assert len(ops.generate([y], [x, cos, sin]).kernels) == 1


def _attention_ref(q, k, v, mask=None, causal=False):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        lq, lk = s.shape[-2:]
        s = np.where(np.arange(lk)[None, :] - np.arange(lq)[:, None] <= lk - lq, s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def test_attention(rng):
    q = ops.placeholder((2, 3, 5, 8), "float32", "q")
    k = ops.placeholder((2, 3, 7, 8), "float32", "k")
    v = ops.placeholder((2, 3, 7, 4), "float32", "v")
    m = ops.placeholder((2, 1, 1, 7), "bool", "m")
    outs = [ops.attention(q, k, v), ops.attention(q, k, v, causal=True), ops.attention(q, k, v, mask=m)]
    qv, kv, vv = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4)))
    mv = rng.random((2, 1, 1, 7)) > 0.3
    mv[..., 0] = True
    res = ops.build(outs, [q, k, v, m])(qv, kv, vv, mv)
    q64, k64, v64 = (a.astype(np.float64) for a in (qv, kv, vv))
    for out, ref in zip(res, [_attention_ref(q64, k64, v64), _attention_ref(q64, k64, v64, causal=True),
                              _attention_ref(q64, k64, v64, mask=mv)]):  # fmt: skip
        assert rel(out, ref) < 1e-6


def test_creation_ops(rng):
    n = ops.placeholder((4, 6), "float32", "n")
    outs = [ops.full((2, 3), 2.5), ops.arange(5), ops.arange(4, "float32", 1.0, 0.5), ops.tril(n), ops.triu(n, 1),
            ops.causal_mask(3, 5), ops.add(n, ops.arange(6, "float32"))]  # fmt: skip
    nv = rng.standard_normal((4, 6)).astype(np.float32)
    res = ops.build(outs, [n])(nv)
    np.testing.assert_array_equal(res[0], np.full((2, 3), 2.5, np.float32))
    np.testing.assert_array_equal(res[1], np.arange(5))
    assert res[1].dtype == np.int64
    np.testing.assert_array_equal(res[2], np.arange(1.0, 3.0, 0.5, dtype=np.float32))
    np.testing.assert_array_equal(res[3], np.tril(nv))
    np.testing.assert_array_equal(res[4], np.triu(nv, 1))
    np.testing.assert_array_equal(res[5], np.where(np.arange(5)[None] - np.arange(3)[:, None] <= 2, 0, -np.inf))
    np.testing.assert_array_equal(res[6], nv + np.arange(6, dtype=np.float32))
