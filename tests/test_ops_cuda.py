"""The ops on the GPU (torch CUDA tensors) against float64 references: every schedule kind
(elementwise, thread/warp/block per row, contractions), float16/bfloat16/float32, symbolic sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tessera import ops
from tessera.ir import Var, dtypes

pytestmark = pytest.mark.cuda
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def rand(torch, shape, dtype_name, scale=1.0, offset=0.0):
    return (torch.randn(*shape, dtype=torch.float64, device="cuda") * scale + offset).to(getattr(torch, dtype_name))


def check(out, ref, dtype_name, scale=1.0):
    tol = TOL[dtype_name] * scale
    assert tuple(out.shape) == tuple(ref.shape)
    np.testing.assert_allclose(out.double().cpu().numpy(), ref.double().cpu().numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_elementwise_chain(torch, dtype_name):
    x = ops.placeholder((37, 129), dtype_name, "x")
    b = ops.placeholder((129,), dtype_name, "b")
    outs = [ops.gelu(ops.add(x, b)), ops.gelu(x, "tanh"), ops.silu(x), ops.sigmoid(x), ops.exp(x), ops.tanh(x),
            ops.rsqrt(ops.add(ops.abs(x), 1.0)), ops.where(ops.gt(x, b), x, b), ops.div(x, b), ops.erf(x)]  # fmt: skip
    f = ops.build(outs, [x, b], "cuda")
    xv, bv = rand(torch, (37, 129), dtype_name), rand(torch, (129,), dtype_name, 1, 3)
    res = f(xv, bv)
    x64, b64 = xv.double(), bv.double()
    F = torch.nn.functional
    refs = [F.gelu(x64 + b64), F.gelu(x64, approximate="tanh"), F.silu(x64), torch.sigmoid(x64), torch.exp(x64),
            torch.tanh(x64), torch.rsqrt(x64.abs() + 1), torch.where(x64 > b64, x64, b64), x64 / b64, torch.erf(x64)]  # fmt: skip
    for out, ref in zip(res, refs):
        assert out.dtype == xv.dtype and out.is_cuda
        check(out, ref, dtype_name, scale=4)


def test_elementwise_fused_one_kernel_large(torch):
    n = Var("n", dtypes.int32)
    x = ops.placeholder((n, 1000), "float16", "x")
    y = ops.mul(ops.relu(ops.transpose(ops.reshape(x, (n, 10, 100)), 1, 2)), 2.0)
    f = ops.build([y], [x], "cuda")
    assert f.num_kernels == 1
    for rows in (3, 1111):
        xv = rand(torch, (rows, 1000), "float16")
        ref = torch.relu(xv.double().reshape(rows, 10, 100).transpose(1, 2)) * 2
        check(f(xv), ref, "float16")


@pytest.mark.parametrize("cols", [7, 300, 1024, 5000])  # thread, warp, warp, block per row
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_row_reductions_and_softmax(torch, cols, dtype_name):
    x = ops.placeholder((33, cols), dtype_name, "x")
    outs = [ops.sum(x, 1), ops.mean(x, 1, keepdims=True), ops.max(x, 1), ops.min(x, 1), ops.softmax(x), ops.log_softmax(x)]
    f = ops.build(outs, [x], "cuda")
    xv = rand(torch, (33, cols), dtype_name, 2, 10)
    x64 = xv.double()
    refs = [x64.sum(1), x64.mean(1, keepdim=True), x64.amax(1), x64.amin(1), torch.softmax(x64, 1), torch.log_softmax(x64, 1)]
    for k, (out, ref) in enumerate(zip(f(xv), refs)):
        scale = 30 if k == 0 else 20 if k == 5 else 2  # sums of ~10-valued rows; log_softmax adds log(cols)
        check(out, ref, dtype_name, scale)


def test_column_and_full_reductions(torch):
    x = ops.placeholder((3000, 5), "float32", "x")
    outs = [ops.sum(x, 0), ops.sum(x), ops.prod(ops.cast(x, "float64"), 0), ops.max(x), ops.softmax(x, 0)]
    f = ops.build(outs, [x], "cuda")
    xv = torch.rand(3000, 5, device="cuda") + 0.5
    x64 = xv.double()
    res = f(xv)
    check(res[0], x64.sum(0), "float32", 100)
    check(res[1], x64.sum(), "float32", 1000)
    np.testing.assert_allclose(res[2].cpu().numpy(), x64.log().sum(0).exp().cpu().numpy(), rtol=1e-9)
    check(res[3], x64.max(), "float32")
    check(res[4], torch.softmax(x64, 0), "float32")


def test_integer_and_bool_reductions(torch):
    x = ops.placeholder((40, 700), "int32", "x")
    b = ops.placeholder((40, 700), "bool", "b")
    f = ops.build([ops.sum(x, 1), ops.max(x, 1), ops.min(b, 1), ops.max(b, 1)], [x, b], "cuda")
    xv = torch.randint(-1000, 1000, (40, 700), device="cuda", dtype=torch.int32)
    bv = torch.rand(40, 700, device="cuda") > 0.001
    s, m, all_, any_ = f(xv, bv)
    assert torch.equal(s, xv.sum(1)) and torch.equal(m, xv.amax(1))
    assert torch.equal(all_, bv.all(1)) and torch.equal(any_, bv.any(1))


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cols", [64, 768, 4099])
def test_norms(torch, dtype_name, cols):
    n = Var("n", dtypes.int32)
    x = ops.placeholder((n, cols), dtype_name, "x")
    w = ops.placeholder((cols,), dtype_name, "w")
    b = ops.placeholder((cols,), dtype_name, "b")
    f = ops.build([ops.layer_norm(x, w, b), ops.rms_norm(x, w)], [x, w, b], "cuda")
    assert f.num_kernels == 2
    for rows in (1, 257):
        xv, wv, bv = rand(torch, (rows, cols), dtype_name, 2, 1), rand(torch, (cols,), dtype_name), rand(torch, (cols,), dtype_name)
        x64, w64, b64 = xv.double(), wv.double(), bv.double()
        ln, rms = f(xv, wv, bv)
        check(ln, torch.nn.functional.layer_norm(x64, (cols,), w64, b64, 1e-5), dtype_name, 4)
        check(rms, x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64, dtype_name, 4)


def test_matmul_linear_conv_pool(torch):
    F = torch.nn.functional
    a = ops.placeholder((2, 65, 96), "float16", "a")
    w = ops.placeholder((40, 96), "float16", "w")
    bias = ops.placeholder((40,), "float16", "bias")
    img = ops.placeholder((2, 6, 15, 14), "float32", "img")
    k = ops.placeholder((8, 3, 3, 3), "float32", "k")
    outs = [ops.linear(a, w, bias), ops.matmul(a, ops.transpose(w, 0, 1)), ops.conv2d(img, k, None, 2, 1, 1, 2),
            ops.max_pool2d(img, 3, 2, 1), ops.avg_pool2d(img, 2), ops.adaptive_avg_pool2d(img, 1)]  # fmt: skip
    f = ops.build(outs, [a, w, bias, img, k], "cuda")
    av, wv, bv = rand(torch, (2, 65, 96), "float16"), rand(torch, (40, 96), "float16"), rand(torch, (40,), "float16")
    iv, kv = rand(torch, (2, 6, 15, 14), "float32"), rand(torch, (8, 3, 3, 3), "float32")
    res = f(av, wv, bv, iv, kv)
    i64 = iv.double()
    check(res[0], F.linear(av.double(), wv.double(), bv.double()), "float16", 10)
    check(res[1], av.double() @ wv.double().T, "float16", 10)
    check(res[2], F.conv2d(i64, kv.double(), None, 2, 1, 1, 2), "float32", 4)
    check(res[3], F.max_pool2d(i64, 3, 2, 1), "float32")
    check(res[4], F.avg_pool2d(i64, 2), "float32")
    check(res[5], F.adaptive_avg_pool2d(i64, 1), "float32")


def test_transforms_and_gathers(torch):
    s = Var("s", dtypes.int32)
    x = ops.placeholder((2, s, 64), "bfloat16", "x")   # [batch, seq, hidden]
    cos = ops.placeholder((s, 16), "bfloat16", "cos")
    sin = ops.placeholder((s, 16), "bfloat16", "sin")
    emb = ops.placeholder((100, 64), "bfloat16", "emb")
    ids = ops.placeholder((2, s), "int64", "ids")
    heads = ops.permute(ops.reshape(x, (2, s, 4, 16)), (0, 2, 1, 3))
    outs = [ops.apply_rotary(heads, cos, sin), ops.embedding(emb, ids), ops.pad(x, [(0, 0), (1, 2), (0, 0)]),
            ops.concat([x, ops.slice(x, 2, None, None, 2)], 2)]  # fmt: skip
    f = ops.build(outs, [x, cos, sin, emb, ids], "cuda")
    for seq in (5, 77):
        xv = rand(torch, (2, seq, 64), "bfloat16")
        ang = torch.rand(seq, 8, device="cuda", dtype=torch.float64) * 6
        cv, sv = torch.cat([ang, ang], -1).cos().bfloat16(), torch.cat([ang, ang], -1).sin().bfloat16()
        ev = rand(torch, (100, 64), "bfloat16")
        iv = torch.randint(0, 100, (2, seq), device="cuda")
        r = f(xv, cv, sv, ev, iv)
        h = xv.double().reshape(2, seq, 4, 16).permute(0, 2, 1, 3)
        rot = torch.cat([-h[..., 8:], h[..., :8]], -1)
        check(r[0], h * cv.double() + rot * sv.double(), "bfloat16", 2)
        assert torch.equal(r[1], ev[iv])
        assert torch.equal(r[2], torch.nn.functional.pad(xv, (0, 0, 1, 2)))
        assert torch.equal(r[3], torch.cat([xv, xv[:, :, ::2]], 2))


def test_gelu_matches_math(torch):
    x = ops.placeholder((1000,), "float32", "x")
    f = ops.build([ops.gelu(x)], [x], "cuda")
    xv = torch.linspace(-8, 8, 1000, device="cuda")
    ref = torch.tensor([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in xv.double().tolist()], dtype=torch.float64)
    check(f(xv).cpu(), ref, "float32")


def test_attention_and_creation(torch):
    s = Var("s", dtypes.int32)
    q = ops.placeholder((1, 4, s, 32), "float16", "q")
    k = ops.placeholder((1, 4, s, 32), "float16", "k")
    v = ops.placeholder((1, 4, s, 32), "float16", "v")
    pos = ops.arange(s, "float32")
    f = ops.build([ops.attention(q, k, v, causal=True), ops.var(ops.cast(q, "float32"), -1), pos], [q, k, v], "cuda")
    for seq in (1, 45):
        qv, kv, vv = (rand(torch, (1, 4, seq, 32), "float16") for _ in range(3))
        att, var, p = f(qv, kv, vv)
        ref = torch.nn.functional.scaled_dot_product_attention(qv.double(), kv.double(), vv.double(), is_causal=True)
        check(att, ref, "float16", 4)
        check(var, qv.double().var(-1), "float32", 100)
        assert torch.equal(p, torch.arange(seq, device="cuda", dtype=torch.float32))
