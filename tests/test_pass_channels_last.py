"""to_channels_last: GPU convolutions move to NHWC, layout changes cancel between them, and
results stay those of the NCHW graph (numpy references, and the CPU compiler's lowering of
NHWC convolutions)."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.graph.passes.channels_last import tensor_core_conv, to_channels_last


def _residual_net(rng, dtype: str, batch: object = "n"):
    """conv-relu-conv(stride 2) + a strided 1x1 shortcut, relu, max-pool, a conv with a constant
    per-channel scale after it, and a spatial mean: the shapes of a ResNet stage."""
    f = np.float16 if dtype == "float16" else np.float32

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(f)

    b = GraphBuilder()
    x = b.input("x", [batch, 8, 9, 11], dtype)
    y = b.op("conv2d", x, b.constant(w(16, 8, 3, 3)), b.constant(w(16)), padding=[1, 1, 1, 1])
    y = b.op("relu", y)
    y = b.op("conv2d", y, b.constant(w(16, 16, 1, 1)), stride=[2, 2])
    short = b.op("conv2d", x, b.constant(w(16, 8, 1, 1)), b.constant(w(16)), stride=[2, 2])
    z = b.op("relu", b.op("add", y, short))
    p = b.op("max_pool2d", z, kernel=[2, 2], stride=[2, 2], ceil_mode=True)
    q = b.op("conv2d", p, b.constant(w(24, 16, 3, 3)), padding=[1, 0, 1, 2])
    q = b.op("mul", q, b.constant(rng.uniform(0.5, 1.5, (24, 1, 1)).astype(f)))
    b.output(b.op("reduce_mean", q, axes=[2, 3]), z)
    return b.build()


def test_layout_changes_cancel_between_convolutions(rng):
    g = _residual_net(rng, "float16")
    xs = [rng.standard_normal((n, 8, 9, 11)).astype(np.float16) for n in (1, 3)]
    before = [g.run(x) for x in xs]
    assert to_channels_last(g) == 4
    g.verify()
    kinds = g.summary()
    assert kinds["conv2d"] == 4 and all(op.attrs["layout"] == "NHWC" for op in g.operators if op.kind in ("conv2d", "max_pool2d"))
    # x in; z out (an output); the scaled conv out to the mean (the pool runs on NHWC)
    assert kinds["permute"] == 3, kinds
    for x, want in zip(xs, before):
        for got, ref in zip(g.run(x), want):
            np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-2)


def test_only_tensor_core_convolutions_move(rng):
    g = _residual_net(rng, "float32")
    assert not any(tensor_core_conv(op) for op in g.operators)
    assert to_channels_last(g) == 0 and "permute" not in g.summary()


def test_cpu_compiler_lowers_nhwc_convolutions(rng):
    """The generic lowering of an NHWC conv2d (permuted views around the NCHW computation)."""
    g = _residual_net(rng, "float32", batch=2)
    x1, x2 = (rng.standard_normal((2, 8, 9, 11)).astype(np.float32) for _ in range(2))
    want = [g.run(x1), g.run(x2)]
    assert to_channels_last(g, lambda op: op.kind == "conv2d") == 4
    compiled = compile_graph(g, "cpu", tune=False)
    for x, ref in zip((x1, x2), want):
        for got, r in zip(compiled(x), ref):
            np.testing.assert_allclose(got, r, rtol=1e-4, atol=1e-4)


def _pooling_net(rng, dtype: str):
    """A stem conv, a padded 3x3/2 max pool, a conv, a 2x2 average pool (ceil mode, padding not
    counted) and a global average pool: every pooling between convolutions runs on NHWC."""
    f = np.float16 if dtype == "float16" else np.float32
    b = GraphBuilder()
    x = b.input("x", ["n", 8, 13, 10], dtype)
    y = b.op("relu", b.op("conv2d", x, b.constant((rng.standard_normal((16, 8, 3, 3)) / 9).astype(f)), stride=[2, 2],
                          padding=[1, 1, 1, 1]))  # fmt: skip
    y = b.op("max_pool2d", y, kernel=[3, 3], stride=[2, 2], padding=[1, 1, 1, 1])
    y = b.op("conv2d", y, b.constant((rng.standard_normal((24, 16, 1, 1)) / 4).astype(f)))
    y = b.op("avg_pool2d", y, kernel=[2, 2], stride=[2, 2], padding=[1, 1, 1, 1], ceil_mode=True, count_include_pad=False)
    b.output(b.op("adaptive_avg_pool2d", y, output_size=[1, 1]), b.op("adaptive_avg_pool2d", y, output_size=[2, 3]))
    return b.build()


def test_pooling_runs_on_nhwc(rng):
    g = _pooling_net(rng, "float16")
    xs = [rng.standard_normal((n, 8, 13, 10)).astype(np.float16) for n in (1, 2)]
    want = [g.run(x) for x in xs]
    assert to_channels_last(g) == 2
    g.verify()
    assert all(op.attrs.get("layout") == "NHWC" for op in g.operators if "pool" in op.kind or op.kind == "conv2d")
    assert g.summary()["permute"] == 3, g.summary()  # x in, the two outputs back to NCHW
    for x, ref in zip(xs, want):
        for got, r in zip(g.run(x), ref):
            np.testing.assert_allclose(got.astype(np.float32), r.astype(np.float32), rtol=2e-2, atol=2e-2)


def test_cpu_compiler_lowers_nhwc_pooling(rng):
    g = _pooling_net(rng, "float32")
    xs = [rng.standard_normal((n, 8, 13, 10)).astype(np.float32) for n in (3, 1)]
    want = [g.run(x) for x in xs]
    assert to_channels_last(g, lambda op: op.kind == "conv2d") == 2
    compiled = compile_graph(g, "cpu", tune=False)
    for x, ref in zip(xs, want):
        for got, r in zip(compiled(x), ref):
            np.testing.assert_allclose(got, r, rtol=1e-4, atol=1e-4)


def test_non_constant_weights_are_permuted_in_the_graph(rng):
    b = GraphBuilder()
    x = b.input("x", [2, 8, 5, 5], "float16")
    wt = b.input("w", [4, 8, 3, 3], "float16")
    b.output(b.op("conv2d", x, wt, padding=[1, 1, 1, 1]))
    g = b.build()
    xv = rng.standard_normal((2, 8, 5, 5)).astype(np.float16)
    wv = rng.standard_normal((4, 8, 3, 3)).astype(np.float16)
    want = g.run(xv, wv)[0]
    assert to_channels_last(g) == 1 and g.summary()["permute"] == 3
    np.testing.assert_allclose(g.run(xv, wv)[0].astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_batch_norm_keeps_its_channel_axis(rng):
    """batch_norm is elementwise but its parameters follow axis 1: it must not run on NHWC."""
    f = np.float16
    b = GraphBuilder()
    x = b.input("x", [2, 8, 5, 6], "float16")
    y = b.op("relu", b.op("conv2d", x, b.constant((rng.standard_normal((8, 8, 3, 3)) / 9).astype(f)), padding=[1, 1, 1, 1]))
    params = [rng.standard_normal(8).astype(f) * 0.1, rng.uniform(0.5, 2, 8).astype(f),
              rng.uniform(0.5, 2, 8).astype(f), rng.standard_normal(8).astype(f)]  # fmt: skip
    b.output(b.op("batch_norm", y, *(b.constant(p) for p in params)))
    g = b.build()
    xs = [rng.standard_normal((2, 8, 5, 6)).astype(f) for _ in range(2)]
    want = [g.run(x)[0] for x in xs]
    assert to_channels_last(g) == 1
    assert next(op for op in g.operators if op.kind == "batch_norm").inputs[0].shape == (2, 8, 5, 6)
    for x, ref in zip(xs, want):
        np.testing.assert_allclose(g.run(x)[0].astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bad", ["NCWH", "nhwc"])
def test_unknown_conv_layout_is_refused(bad):
    b = GraphBuilder()
    x = b.input("x", [1, 8, 5, 5], "float16")
    with pytest.raises(Exception, match="layout"):
        b.op("conv2d", x, b.constant(np.ones((4, 8, 3, 3), np.float16)), layout=bad)


@pytest.mark.cuda
def test_gpu_compiles_convolutions_channels_last_on_the_tma_gemm(rng):
    """(bfloat16 NHWC convolutions: tests/test_ops_anchors.py::test_conv2d_anchor)"""
    torch = pytest.importorskip("torch")
    g = _residual_net(rng, "float16", batch=3)
    xs = [rng.standard_normal((3, 8, 9, 11)).astype(np.float16) for _ in range(3)]
    want = [g.run(x) for x in xs]
    compiled = compile_graph(g, "cuda")
    assert sum(op.kind == "conv2d" and op.attrs["layout"] == "NHWC" for op in g.operators) == 4
    for x, ref in zip(xs, want):
        for got, r in zip(compiled(torch.from_numpy(x).cuda()), ref):
            np.testing.assert_allclose(got.float().cpu().numpy(), r.astype(np.float32), rtol=2e-2, atol=2e-2)
    report = str(compiled.report())  # anchors are planned on the first call
    assert "tma_" in report, report


@pytest.mark.cuda
def test_gpu_pools_channels_last(rng):
    torch = pytest.importorskip("torch")
    g = _pooling_net(rng, "float16")
    xs = [rng.standard_normal((n, 8, 13, 10)).astype(np.float16) for n in (2, 1, 2)]
    want = [g.run(x) for x in xs]
    compiled = compile_graph(g, "cuda")
    assert all(op.attrs.get("layout") == "NHWC" for op in g.operators if "pool" in op.kind)
    for x, ref in zip(xs, want):
        for got, r in zip(compiled(torch.from_numpy(x).cuda()), ref):
            np.testing.assert_allclose(got.float().cpu().numpy(), r.astype(np.float32), rtol=2e-2, atol=2e-2)
