"""Reference implementations of the graph operators against torch (the semantics the front ends assume)."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder

torch = pytest.importorskip("torch")
F = torch.nn.functional


def run_op(kind, *arrays, **attrs):
    b = GraphBuilder()
    ins = [b.input(f"i{k}", a.shape, str(a.dtype)) for k, a in enumerate(arrays)]
    b.output(*b.op_multi(kind, *ins, **attrs))
    return b.build().run(*arrays)


def close(a, t, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(a, t.numpy(), rtol=rtol, atol=atol)


def test_conv2d_groups_stride_dilation_padding(rng):
    x = rng.standard_normal((2, 6, 11, 9)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)
    (y,) = run_op("conv2d", x, w, bias, stride=[2, 1], padding=[1, 0, 1, 0], dilation=[1, 2], groups=2)
    close(y, F.conv2d(*map(torch.from_numpy, (x, w, bias)), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2), 1e-4, 1e-5)


@pytest.mark.parametrize("ceil", [False, True])
def test_pools(rng, ceil):
    x = rng.standard_normal((2, 3, 10, 7)).astype(np.float32)
    t = torch.from_numpy(x)
    (y,) = run_op("max_pool2d", x, kernel=[3, 3], stride=[2, 2], padding=[1, 1, 1, 1], ceil_mode=ceil)
    close(y, F.max_pool2d(t, 3, 2, 1, ceil_mode=ceil))
    for cip in (True, False):
        (y,) = run_op("avg_pool2d", x, kernel=[3, 2], stride=[2, 2], padding=[1, 1, 1, 1], ceil_mode=ceil,
                      count_include_pad=cip)  # fmt: skip
        close(y, F.avg_pool2d(t, (3, 2), 2, 1, ceil_mode=ceil, count_include_pad=cip))
    (y,) = run_op("adaptive_avg_pool2d", x, output_size=[3, 4])
    close(y, F.adaptive_avg_pool2d(t, (3, 4)))


@pytest.mark.parametrize("causal,mask,gqa", [(True, None, False), (False, "bool", False), (False, "float", True),
                                             (True, None, True)])  # fmt: skip
def test_attention(rng, causal, mask, gqa):
    hk = 2 if gqa else 6
    q = rng.standard_normal((2, 6, 5, 8)).astype(np.float32)
    k = rng.standard_normal((2, hk, 7 if not causal else 5, 8)).astype(np.float32)
    v = rng.standard_normal((2, hk, k.shape[2], 3)).astype(np.float32)
    ins = [q, k, v]
    if mask == "bool":
        ins.append(rng.random((2, 1, 5, 7)) > 0.3)
        ins[-1][..., 0] = True
    elif mask == "float":
        ins.append(rng.standard_normal((5, 7)).astype(np.float32))
    (y,) = run_op("scaled_dot_product_attention", *ins, causal=causal)
    ref = F.scaled_dot_product_attention(*map(torch.from_numpy, ins), is_causal=causal, enable_gqa=gqa)
    close(y, ref, 1e-5, 1e-5)


def test_norms_and_activations(rng):
    x = rng.standard_normal((3, 4, 10)).astype(np.float32)
    w, b = rng.standard_normal(10).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    t = torch.from_numpy(x)
    close(run_op("layer_norm", x, w, b, eps=1e-5)[0], F.layer_norm(t, (10,), torch.from_numpy(w), torch.from_numpy(b)))
    close(run_op("rms_norm", x, w, eps=1e-6)[0], F.rms_norm(t, (10,), torch.from_numpy(w), 1e-6))
    for approx in ("none", "tanh"):
        close(run_op("gelu", x, approximate=approx)[0], F.gelu(t, approximate=approx))
    close(run_op("silu", x)[0], F.silu(t))
    close(run_op("log_softmax", x, axis=1)[0], F.log_softmax(t, 1))
    close(run_op("cumsum", x, axis=2)[0], torch.cumsum(t, 2), 1e-5, 1e-5)


def test_shape_ops(rng):
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    t = torch.from_numpy(x)
    close(run_op("slice", x, axes=[0, 2], starts=[-3, 1], ends=[2**62, -1], steps=[2, 3])[0], t[-3::2, :, 1:-1:3])
    parts = run_op("split", x, axis=1, sizes=[2, 3])
    close(parts[1], t[:, 2:])
    idx = rng.integers(0, 5, (2, 3))
    close(run_op("take", x, idx, axis=1)[0], t[:, torch.from_numpy(idx)])
    close(run_op("expand", x[:, :1], shape=[2, 4, 5, -1])[0], t[:, :1].expand(2, 4, 5, -1))
    close(run_op("reduce_max", x, axes=[0, 2], keepdim=True)[0], t.amax((0, 2), keepdim=True))
    (d,) = run_op("div", np.array([-7, 7]), np.array([2, -2]), rounding="trunc")
    assert d.tolist() == [-3, -3]
