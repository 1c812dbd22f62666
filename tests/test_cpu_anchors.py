"""GEMM anchors on the CPU (tessera.templates.cpu.gemm) and their use by the graph compiler,
against numpy/torch in float64: odd sizes, tails, fused epilogues, constant (pre-packed) weights."""

from __future__ import annotations

import numpy as np
import pytest

from tessera import ops
from tessera.backend.isa import vector_lanes
from tessera.errors import ArgumentError, UnsupportedError
from tessera.templates import Epilogue
from tessera.templates.cpu.conv import plan_cpu_conv2d
from tessera.templates.cpu.gemm import plan_cpu_linear, plan_cpu_matmul

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(vector_lanes() == 1, reason="the CPU GEMM needs AVX2 or AVX-512")


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("lead,n,k", [((1,), 1, 1), ((2, 5), 19, 37), ((33,), 70, 16)])
@pytest.mark.slow
def test_linear_bias_residual_relu(rng, packed, lead, n, k):
    out_shape = (*lead, n)
    acc, res_p = ops.placeholder(out_shape, "float32", "acc"), ops.placeholder(out_shape, "float32", "res")
    ep = Epilogue(acc, ops.relu(ops.add(acc, res_p)), [res_p])
    w = _f32(rng, n, k)
    kernel = plan_cpu_linear((*lead, k), w.shape, bias=True, epilogue=ep, weight=w if packed else None).load()
    for _ in range(2):  # fresh inputs per call; a packed weight is the plan-time one
        x, b, res = _f32(rng, *lead, k), _f32(rng, n), _f32(rng, *out_shape)
        out = np.full(out_shape, np.nan, np.float32)
        kernel([x, w, b], out, [res])
        ref = np.maximum(x.astype(np.float64) @ w.T + b + res, 0)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_matmul_broadcast_batch_and_vectors(rng):
    for a_shape, b_shape in [((3, 4, 9, 17), (4, 17, 23)), ((9, 17), (17,)), ((17,), (3, 17, 5)), ((1, 1), (1, 1))]:
        a, b = _f32(rng, *a_shape), _f32(rng, *b_shape)
        kernel = plan_cpu_matmul(a_shape, b_shape).load()
        out = np.full(kernel.out_shape, np.nan, np.float32)
        kernel([a, b], out)
        np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride,padding,dilation", [((1, 1), (1, 1, 1, 1), (1, 1)), ((2, 2), (0, 0, 0, 0), (1, 1)),
                                                     ((2, 1), (1, 0, 2, 1), (1, 2)), ((1, 1), (0, 0, 0, 0), (1, 1))])
@pytest.mark.slow
def test_conv2d_with_fused_epilogue(rng, stride, padding, dilation):
    x, w, bias = _f32(rng, 2, 5, 11, 13), _f32(rng, 7, 5, 3, 3), _f32(rng, 7)
    t = torch.nn.functional.pad(torch.from_numpy(x).double(), (padding[1], padding[3], padding[0], padding[2]))
    ref = torch.nn.functional.conv2d(t, torch.from_numpy(w).double(), torch.from_numpy(bias).double(), stride=stride,
                                     dilation=dilation).numpy()  # fmt: skip
    acc = ops.placeholder(ref.shape, "float32", "acc")
    for weight in (None, w):  # read per call, or packed once
        kernel = plan_cpu_conv2d(x.shape, w.shape, stride=stride, padding=padding, dilation=dilation, bias=True,
                                 epilogue=Epilogue(acc, ops.relu(acc), []), weight=weight).load()  # fmt: skip
        out = np.full(ref.shape, np.nan, np.float32)
        kernel([x, w, bias], out)
        np.testing.assert_allclose(out, np.maximum(ref, 0), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_call_errors_are_clear_and_a_scalar_extra_is_one_element(rng):
    acc, s = ops.placeholder((5, 3), "float32", "acc"), ops.placeholder((), "float32", "s")
    kernel = plan_cpu_linear((5, 7), (3, 7), epilogue=Epilogue(acc, ops.mul(acc, s), [s])).load()
    x, w = _f32(rng, 5, 7), _f32(rng, 3, 7)
    out = np.full((5, 3), np.nan, np.float32)
    with pytest.raises(ArgumentError, match="takes 2 inputs, got 1"):
        kernel([x], out, [np.float32(2)])
    with pytest.raises(ArgumentError, match="takes 1 extra tensors, got 0"):
        kernel([x, w], out)
    scale = np.array(-1.5, np.float32)  # rank 0
    kernel([x, w], out, [scale])
    np.testing.assert_allclose(out, (x.astype(np.float64) @ w.T) * -1.5, rtol=1e-5, atol=1e-5)
    assert repr(kernel).startswith("<CpuAnchorKernel ")


@pytest.mark.parametrize("kernel_hw,stride,padding,dilation", [((2, 3), (1, 2), (1, 2, 0, 1), (2, 1)),
                                                               ((7, 7), (2, 2), (3, 3, 3, 3), (1, 1)),
                                                               ((1, 1), (2, 2), (0, 0, 0, 0), (1, 1))])
@pytest.mark.slow
def test_conv2d_im2col_offsets_for_other_kernel_shapes(rng, kernel_hw, stride, padding, dilation):
    """The per-column offset table (channel, kernel row, kernel column) for non-square kernels,
    the 7x7 stride-2 stem and 1x1s, over three images."""
    x, w = _f32(rng, 3, 4, 17, 15), _f32(rng, 9, 4, *kernel_hw)
    t = torch.nn.functional.pad(torch.from_numpy(x).double(), (padding[1], padding[3], padding[0], padding[2]))
    ref = torch.nn.functional.conv2d(t, torch.from_numpy(w).double(), stride=stride, dilation=dilation).numpy()
    for weight in (None, w):
        kernel = plan_cpu_conv2d(x.shape, w.shape, stride=stride, padding=padding, dilation=dilation,
                                 weight=weight).load()  # fmt: skip
        out = np.full(ref.shape, np.nan, np.float32)
        kernel([x, w], out)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tile", [(4, 2), (6, 2), (14, 2)], ids=str)
@pytest.mark.slow
def test_conv2d_row_and_pixel_layouts(rng, tile):
    """Both row layouts of the implicit GEMM (one GEMM batch per output row when a row is at
    least MR pixels, else all pixels as M): rows shorter than, equal to and longer than MR
    (the last tile of a row shifted back), two images, stride 2, a channel tail past the
    register tile's columns, workers splitting rows or (a weight larger than the input)
    columns, a residual epilogue; three calls with fresh inputs."""
    from tessera.templates.cpu.conv import row_layout
    from tessera.templates.cpu.gemm_kernel import CpuGemmConfig

    mr, nv = tile
    lanes = vector_lanes()
    cfg = CpuGemmConfig(mr, nv if lanes == 16 else 1, lanes, 2)
    layouts, orders = set(), set()
    for x_shape, w_shape, stride, padding in [((2, 3, 9, 15), (37, 3, 3, 3), (1, 1), (1, 1, 1, 1)),
                                              ((2, 5, 13, 29), (7, 5, 3, 3), (2, 2), (1, 1, 1, 1)),
                                              ((1, 4, 6, 6), (17, 4, 1, 1), (1, 1), (0, 0, 0, 0)),
                                              ((1, 8, 5, 16), (40, 8, 3, 3), (1, 1), (1, 1, 1, 1))]:  # fmt: skip
        w, bias = _f32(rng, *w_shape), _f32(rng, w_shape[0])
        t_ref = torch.nn.functional.conv2d(torch.zeros(x_shape, dtype=torch.float64), torch.from_numpy(w).double(),
                                           stride=stride, padding=padding[:2])  # fmt: skip
        out_shape = tuple(t_ref.shape)
        acc, res_p = ops.placeholder(out_shape, "float32", "acc"), ops.placeholder(out_shape, "float32", "res")
        ep = Epilogue(acc, ops.relu(ops.add(acc, res_p)), [res_p])
        kernel = plan_cpu_conv2d(x_shape, w_shape, stride=stride, padding=padding, bias=True, epilogue=ep, weight=w,
                                 config=cfg).load()  # fmt: skip
        assert kernel.config == cfg
        layouts.add(row_layout(cfg, out_shape[3]))
        orders.add("_pm" in kernel.plan.launches[-1].func.name)  # the weight outweighs the input in the last case
        for _ in range(3):
            x, res = _f32(rng, *x_shape), _f32(rng, *out_shape)
            ref = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(),
                                             torch.from_numpy(bias).double(), stride=stride, padding=padding[:2])  # fmt: skip
            out = np.full(out_shape, np.nan, np.float32)
            kernel([x, w, bias], out, [res])
            np.testing.assert_allclose(out, np.maximum(ref.numpy() + res, 0), rtol=1e-4, atol=1e-4)
    assert layouts == ({True, False} if mr == 14 else {True}) and orders == {True, False}  # ow = 15, 15, 6, 16


@pytest.mark.slow
def test_tuned_conv2d_is_correct_and_cached(rng, monkeypatch, cache_dir):
    from tessera.templates.cpu import conv as cpu_conv

    x_shape, w_shape, geo = (1, 3, 10, 19), (5, 3, 3, 3), ((1, 1), (1, 1, 1, 1), (1, 1))
    w, bias = _f32(rng, *w_shape), _f32(rng, 5)
    kernel = plan_cpu_conv2d(x_shape, w_shape, padding=geo[1], bias=True, weight=w, tune=True).load()
    for _ in range(2):
        x = _f32(rng, *x_shape)
        out = np.full((1, 5, 10, 19), np.nan, np.float32)
        kernel([x, w, bias], out)
        np.testing.assert_allclose(out, cpu_conv.reference_conv2d(x, w, bias, geo), rtol=1e-4, atol=1e-4)

    def no_builds(*args, **kwargs):
        raise AssertionError("a cached tuning record must not build candidates again")

    monkeypatch.setattr(cpu_conv, "plan_cpu_conv2d", no_builds)
    with monkeypatch.context() as m:  # nor make the probes' data (a warm compile's time)
        m.setattr(cpu_conv, "reference_conv2d", no_builds)
        m.setattr(np.random, "default_rng", no_builds)
        assert cpu_conv.tuned_conv_config(x_shape, w_shape, geo, extras=True) == kernel.config


def test_other_dtypes_are_refused():
    with pytest.raises(UnsupportedError, match="float32"):
        plan_cpu_linear((4, 8), (3, 8), "float16")


@pytest.mark.slow
def test_graph_anchors_run_on_the_cpu_gemm(rng):
    from tessera.graph import GraphBuilder
    from tessera.graph.compiler import compile_graph

    b = GraphBuilder("mlp")
    x = b.input("x", [5, 17])
    w1, b1, w2 = _f32(rng, 24, 17), _f32(rng, 24), _f32(rng, 24, 13)
    h = b.op("relu", b.op("linear", x, b.constant(w1), b.constant(b1)))
    b.output(b.op("add", b.op("matmul", h, b.constant(w2)), b.constant(np.float32(0.5))))
    compiled = compile_graph(b.build(), "cpu")
    for _ in range(2):
        xv = _f32(rng, 5, 17)
        ref = np.maximum(xv.astype(np.float64) @ w1.T + b1, 0) @ w2 + 0.5
        np.testing.assert_allclose(compiled(xv)[0], ref, rtol=1e-4, atol=1e-4)
    summary = compiled.summary()
    assert summary["steps"] == {"anchor": 2} and summary["fused_ops"] == 2, summary


@pytest.mark.slow
def test_compiled_model_matches_torch(rng):
    """conv + batchnorm + relu + residual and a linear head through torch.compile."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.conv2 = torch.nn.Conv2d(8, 8, 1)
            self.fc = torch.nn.Linear(8 * 9 * 7, 10)

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x)))
            h = torch.relu(self.conv2(h) + h)
            return self.fc(h.flatten(1))

    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
        compiled = torch.compile(model, backend="tessera")
        for _ in range(2):
            x = torch.randn(2, 3, 9, 7)
            np.testing.assert_allclose(compiled(x).numpy(), model(x).double().numpy(), rtol=1e-4, atol=1e-4)


def test_tuned_linear_is_correct_and_the_choice_is_cached(rng, monkeypatch, cache_dir):
    from tessera.templates.cpu import gemm as cpu_gemm

    x, w, b = _f32(rng, 7, 33), _f32(rng, 21, 33), _f32(rng, 21)
    kernel = plan_cpu_linear(x.shape, w.shape, bias=True, weight=w, tune=True).load()
    out = np.full((7, 21), np.nan, np.float32)
    kernel([x, w, b], out)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T + b, rtol=1e-4, atol=1e-4)
    assert str(kernel.config) in {str(cpu_gemm.CpuGemmConfig(mr, nv, kernel.config.lanes, kernel.config.threads))
                                  for mr, nv in cpu_gemm.TILES[kernel.config.lanes]}  # fmt: skip

    def no_builds(*args, **kwargs):
        raise AssertionError("a cached tuning record must not build candidates again")

    monkeypatch.setattr(cpu_gemm, "plan_cpu_gemm", no_builds)
    with monkeypatch.context() as m:  # nor make the probes' data (a warm compile's time)
        m.setattr(np.random, "default_rng", no_builds)
        assert cpu_gemm.tuned_config(7, 21, 33, 1, "packed", extras=True) == kernel.config
    if cpu_gemm.TILES[kernel.config.lanes] and any(cpu_gemm.spill_free(cpu_gemm.CpuGemmConfig(mr, nv, kernel.config.lanes, 1))
                                                   for mr, nv in cpu_gemm.TILES[kernel.config.lanes]):  # fmt: skip
        assert cpu_gemm.spill_free(kernel.config)  # the bias epilogue keeps the tile's B vectors in registers


@pytest.mark.toolchain
def test_bias_epilogue_tiles_keep_the_k_loop_in_registers(tmp_path):
    """The tile chosen for a GEMM whose epilogue reads a bias compiles to a K loop whose FMAs
    take every operand from registers.  Only the rule's own tile is checked: what gcc does with
    tiles the rule never picks depends on its version and the CPU, not on tessera."""
    import re
    import subprocess

    from tessera.backend.build import C_FLAGS
    from tessera.backend.isa import vector_lanes
    from tessera.templates.cpu import gemm as cpu_gemm

    if vector_lanes() != 16:
        pytest.skip("the register budget was measured on AVX-512")
    w = np.zeros((96, 80), np.float32)
    cfg = cpu_gemm.heuristic_config(64, 96, 80, extras=True)
    assert cpu_gemm.spill_free(cfg)
    src = tmp_path / "k.c"
    src.write_text(plan_cpu_linear((64, 80), (96, 80), bias=True, weight=w, config=cfg).source)
    flags = [f for f in C_FLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run(["gcc", *flags, "-S", str(src), "-o", str(tmp_path / "k.s")], check=True)
    asm = (tmp_path / "k.s").read_text()
    assert not re.search(r"vfmadd\w+\s+-?\d*\(%rsp\)", asm)


@pytest.mark.parametrize("shape,causal,mask", [((1, 4, 4, 9, 9, 16), True, None), ((2, 4, 2, 7, 11, 8), False, (2, 1, 1, 11)),
                                               ((1, 2, 1, 5, 5, 3), True, (5, 5))])
@pytest.mark.slow
def test_attention_on_the_cpu_gemm(rng, shape, causal, mask):
    from tessera.templates.attention.plan import plan_attention

    b, h, hk, sq, sk, d = shape
    q, k, v = _f32(rng, b, h, sq, d), _f32(rng, b, hk, sk, d), _f32(rng, b, hk, sk, d)
    m = None if mask is None else _f32(rng, *mask)
    kernel = plan_attention(q.shape, k.shape, v.shape, "float32", causal=causal, mask_shape=mask,
                            mask_dtype=None if mask is None else "float32", target="cpu").load()  # fmt: skip
    out = np.full(kernel.out_shape, np.nan, np.float32)
    kernel([q, k, v] + ([] if m is None else [m]), out)
    rep = h // hk
    ref = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q).double(), torch.from_numpy(k).double().repeat_interleave(rep, 1),
        torch.from_numpy(v).double().repeat_interleave(rep, 1), is_causal=causal,
        attn_mask=None if m is None else torch.from_numpy(m).double())  # fmt: skip
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_zero_dim_tensor_from_a_torch_segment():
    """A 0-d tensor made by an op that runs in torch (new_ones) feeds a compiled segment
    (GPT-2's attention mask does this): it must arrive 0-d, not as shape (1,)."""

    class M(torch.nn.Module):
        def forward(self, x):
            s = x.new_ones(())
            return torch.relu(x * (s + 1.0) - 0.5)

    model = M()
    compiled = torch.compile(model, backend="tessera")
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 5)
            np.testing.assert_allclose(compiled(x).numpy(), model(x).numpy(), rtol=1e-6)


@pytest.mark.slow
def test_avx2_code_path(rng, monkeypatch):
    """With the ISA capped at AVX2 the anchors use 8-lane tiles, and stay correct."""
    monkeypatch.setenv("TESSERA_CPU_ISA", "avx2")
    if vector_lanes() != 8:
        pytest.skip("this CPU has no AVX2")
    x, w, b = _f32(rng, 11, 29), _f32(rng, 13, 29), _f32(rng, 13)
    kernel = plan_cpu_linear(x.shape, w.shape, bias=True).load()
    assert kernel.config.lanes == 8 and "__m256" in kernel.source and "__m512" not in kernel.source.split("ts_kernel_")[1]
    out = np.full((11, 13), np.nan, np.float32)
    kernel([x, w, b], out)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T + b, rtol=1e-4, atol=1e-4)
