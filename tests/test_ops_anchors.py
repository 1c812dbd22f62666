"""Anchor kernels with post-scheduling epilogue fusion (tessera.templates).

CPU tier: the IR rewrites (specialise, operand remap, epilogue fusion) on small CPU kernels run
through the C backend against numpy; rejection of epilogues that cannot be fused; plans for
matmul/linear/conv2d compiled by nvcc; the configuration heuristic.
GPU tier: matmul/linear/conv2d anchors with epilogues against float64 torch references at odd
shapes, batch dimensions, both layouts, split-k and the warpgroup template; no allocation per
call and CUDA-graph capture.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

import tessera as ts
from tessera import f32, ops
from tessera.backend import build_c, generate_c
from tessera.backend.codegen_c_like import symbol_name
from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.runtime.cpu import CpuKernel
from tessera.runtime.tensor_map import Im2colWindow
from tessera.templates import (
    Epilogue,
    EpilogueError,
    compose,
    fuse_epilogue,
    plan_attention,
    plan_conv2d,
    plan_linear,
    plan_matmul,
    prepare_attention,
    prepare_conv2d,
    prepare_linear,
    prepare_matmul,
)
from tessera.templates.gemm.mma import GemmConfig
from tessera.templates.gemm.space import (
    PLANNING_DEVICE,
    estimate_us,
    heuristic_config,
    mma_space,
    schedule_space,
    wgmma_space,
)
from tessera.templates.gemm.tma import TmaConfig
from tessera.templates.gemm.wgmma import WgmmaConfig
from tessera.templates.kernel import INPUT
from tessera.templates.rewrite import accesses, remap_operand, specialize
from tessera.transforms.pipeline import lower

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


# ---- CPU kernels to rewrite ------------------------------------------------------------------------------------------
@ts.kernel
def bmm_nt(A: f32["batch", "M", "K"], B: f32["batch", "N", "K"], C: f32["batch", "M", "N"]):
    for b in ts.parallel(C.shape[0]):
        for i in range(C.shape[1]):
            for j in range(C.shape[2]):
                s = 0.0
                for k in range(A.shape[2]):
                    s += A[b, i, k] * B[b, j, k]
                C[b, i, j] = s


@ts.kernel
def reads_its_output(A: f32["n"], C: f32["n"]):
    for i in range(A.shape[0]):
        C[i] = A[i]
        C[i] = C[i] * 2.0


def run_cpu(func, *arrays):
    low = lower(func)
    CpuKernel(func, build_c(generate_c([low])), symbol_name(func))(list(arrays))


def specialised_bmm(batch=2, m=5, n=6, k=7):
    return specialize(bmm_nt.ir, {"A": (batch, m, k), "B": (batch, n, k), "C": (batch, m, n)})


# ---- the rewrites on IR ------------------------------------------------------------------------------------------------
def test_specialize_binds_every_shape_symbol():
    f = specialised_bmm()
    assert f.shape_params == []
    assert [str(p.type) for p in f.params] == ["float32[2, 5, 7]", "float32[2, 6, 7]", "float32[2, 5, 6]"]
    assert "batch" not in str(f) and "K)" not in str(f)
    with pytest.raises(UnsupportedError, match="bound to both"):
        specialize(bmm_nt.ir, {"A": (2, 5, 7), "B": (3, 6, 7)})
    with pytest.raises(UnsupportedError, match="not bound"):
        specialize(bmm_nt.ir, {"A": (2, 5, 7)})
    with pytest.raises(UnsupportedError, match="no parameter 'D'"):
        specialize(bmm_nt.ir, {"D": (1,)})


def test_epilogue_fused_into_stores_runs_on_the_cpu(rng):
    """Broadcast operand (remap) + transposed logical output + bias/relu/residual/cast epilogue."""
    f = remap_operand(specialised_bmm(), "A", (5, 7), lambda b, i, k: (i, k))  # A shared by both batches
    acc = ops.placeholder((2, 6, 5), "float32", "acc")  # logical output: [batch, N, M]
    bias = ops.placeholder((5,), "float32", "bias")
    res = ops.placeholder((2, 6, 5), "float32", "res")
    out = ops.cast(ops.add(ops.relu(ops.add(acc, bias)), res), "float64")
    fused = fuse_epilogue(f, "C", lambda b, i, j: (b, j, i), Epilogue(acc, out, [bias, res]))
    assert [p.name for p in fused.params] == ["A", "B", "C", "ep0_bias", "ep1_res"]
    assert str(fused.params[2].type) == "float64[2, 6, 5]"
    assert accesses(fused, fused.params[2]) == (0, 1)
    a, b = rng.standard_normal((5, 7), np.float32), rng.standard_normal((2, 6, 7), np.float32)
    bv, rv = rng.standard_normal(5, np.float32), rng.standard_normal((2, 6, 5), np.float32)
    c = np.empty((2, 6, 5), np.float64)
    run_cpu(fused, a, b, c, bv, rv)
    prod = np.einsum("mk,bnk->bnm", a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(c, np.maximum(prod + bv, 0) + rv, rtol=1e-5, atol=1e-5)


def test_nchw_index_map_and_composed_bias(rng):
    """A [pixels, K] x [O, K] product stored straight into NCHW; bias composed before a gelu."""
    n, h, w, o, k = 2, 3, 4, 5, 6
    f = specialize(bmm_nt.ir, {"A": (1, n * h * w, k), "B": (1, o, k), "C": (1, n * h * w, o)})
    pre = ops.placeholder((n, o, h, w), "float32", "pre")
    bias = ops.placeholder((o,), "float32", "bias")
    inner = Epilogue(pre, ops.add(pre, ops.reshape(bias, (o, 1, 1))), [bias])
    acc = ops.placeholder((n, o, h, w), "float32", "acc")
    ep = compose(inner, Epilogue(acc, ops.gelu(acc), []))
    assert ep.extras == [bias] and ep.acc is pre
    fused = fuse_epilogue(f, "C", lambda z, p, c: (p // (h * w), c, (p // w) % h, p % w), ep)
    a, b = rng.standard_normal((1, n * h * w, k), np.float32), rng.standard_normal((1, o, k), np.float32)
    bv = rng.standard_normal(o, np.float32)
    out = np.empty((n, o, h, w), np.float32)
    run_cpu(fused, a, b, out, bv)
    y = (a[0] @ b[0].T).reshape(n, h, w, o).transpose(0, 3, 1, 2) + bv[:, None, None]
    gelu = 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))
    np.testing.assert_allclose(out, gelu, rtol=1e-5, atol=1e-5)


def test_acc_is_rounded_to_its_declared_dtype():
    acc = ops.placeholder((2, 5, 6), "float16", "acc")
    fused = fuse_epilogue(specialised_bmm(), "C", lambda *i: i, Epilogue(acc, ops.cast(acc, "float32"), []))
    assert "cast(cast(s, float16), float32)" in str(fused)


@pytest.mark.parametrize("case", ["reduction", "transposed", "shifted", "unlisted", "shape", "acc_in_extras"])
def test_epilogues_that_cannot_be_fused_are_rejected(case):
    f = specialised_bmm()
    acc = ops.placeholder((2, 5, 6), "float32", "acc")
    other = ops.placeholder((2, 5, 6), "float32", "other")
    if case == "reduction":
        ep, match = Epilogue(acc, ops.sub(acc, ops.max(acc, -1, keepdims=True)), []), "not injective"
    elif case == "transposed":
        sq = ops.placeholder((2, 6, 6), "float32", "acc")
        ep, match = Epilogue(sq, ops.transpose(sq, 1, 2), []), "not at its own output index"
        f = specialize(bmm_nt.ir, {"A": (2, 6, 7), "B": (2, 6, 7), "C": (2, 6, 6)})
    elif case == "shifted":
        rolled = ops.concat([ops.slice(acc, 2, 1, 6), ops.slice(acc, 2, 0, 1)], 2)  # a neighbour's value
        ep, match = Epilogue(acc, ops.add(acc, rolled), []), "not at its own output index"
    elif case == "unlisted":
        ep, match = Epilogue(acc, ops.add(acc, other), []), "not among its extras"
    elif case == "shape":
        ep, match = Epilogue(acc, ops.sum(acc, 0), []), "shape of acc"
    else:
        ep, match = Epilogue(acc, acc, [acc]), "distinct placeholders"
    with pytest.raises(EpilogueError, match=match):
        fuse_epilogue(f, "C", lambda *i: i, ep)


def test_fusion_needs_plain_stores_into_a_named_output():
    acc = ops.placeholder((5,), "float32", "acc")
    f = specialize(reads_its_output.ir, {"A": (5,)})
    with pytest.raises(EpilogueError, match="reads its output"):
        fuse_epilogue(f, "C", lambda i: (i,), Epilogue(acc, ops.relu(acc), []))
    with pytest.raises(EpilogueError, match="no global tensor parameter 'Z'"):
        fuse_epilogue(f, "Z", lambda i: (i,), Epilogue(acc, acc, []))
    with pytest.raises(EpilogueError, match="index map gives 2"):
        acc3 = ops.placeholder((2, 5, 6), "float32")
        fuse_epilogue(specialised_bmm(), "C", lambda b, i, j: (i, j), Epilogue(acc3, acc3, []))


def test_remap_refuses_written_operands():
    with pytest.raises(UnsupportedError, match="writes 'C'"):
        remap_operand(specialised_bmm(), "C", (5, 6), lambda b, i, j: (i, j))


# ---- plans, errors and the heuristic (no GPU) ---------------------------------------------------------------------
def gelu_ep(shape, dtype="float16"):
    acc = ops.placeholder(shape, dtype, "acc")
    return Epilogue(acc, ops.gelu(acc), [])


def test_prepare_rejects_what_it_cannot_run():
    with pytest.raises(UnsupportedError, match="float16 or bfloat16"):
        plan_matmul((4, 8), (8, 4), "float32")
    with pytest.raises(UnsupportedError, match="groups=1"):
        plan_conv2d((1, 8, 8, 8), (8, 4, 3, 3), "float16", groups=2)
    with pytest.raises(ArgumentError, match="inner dimensions"):
        plan_matmul((4, 8), (9, 4), "float16")
    with pytest.raises(ArgumentError, match="cannot be broadcast"):
        plan_matmul((2, 4, 8), (3, 8, 4), "float16")
    with pytest.raises(ArgumentError, match="features"):
        plan_linear((4, 8), (16, 9), "float16")
    with pytest.raises(ArgumentError, match="channels"):
        plan_conv2d((1, 8, 8, 8), (8, 4, 3, 3), "float16")
    with pytest.raises(EpilogueError, match="acc has shape"):
        plan_linear((4, 8), (16, 8), "float16", epilogue=gelu_ep((4, 17)))


@needs_nvcc
def test_attention_plan_compiles_with_grouped_heads():
    plan = plan_attention((2, 8, 13, 64), (2, 2, 13, 64), (2, 2, 13, 32), "float16", causal=True, wgmma=False)
    assert plan.out_shape == (2, 8, 13, 32) and len(plan.launches) == 3
    assert plan.workspaces == [((2, 8, 13, 13), dtypes.float32), ((2, 8, 13, 16), dtypes.float16)]
    assert "select(gn <= gm" in str(plan.launches[0].func)  # the causal mask is the QK^T epilogue
    assert plan.build("sm_90a").endswith(".cubin")
    with pytest.raises(ArgumentError, match="not a multiple"):
        plan_attention((1, 6, 8, 64), (1, 4, 8, 64), (1, 4, 8, 64), "float16")
    with pytest.raises(UnsupportedError, match=r"\[B, H, S, D\]"):
        plan_attention((6, 8, 64), (6, 8, 64), (6, 8, 64), "float16")


@needs_nvcc
@pytest.mark.slow
def test_attention_mask_is_an_epilogue_operand():
    for mask_shape, mask_dtype, causal in (((2, 1, 1, 37), "float16", False), ((37, 37), "bool", True),
                                           ((1, 8, 37, 37), "float32", True)):  # fmt: skip
        plan = plan_attention((2, 8, 37, 64), (2, 2, 37, 64), (2, 2, 37, 64), "float16", causal=causal,
                              mask_shape=mask_shape, mask_dtype=mask_dtype, wgmma=False)  # fmt: skip
        qk = plan.launches[0]
        assert plan.num_inputs == 4 and len(plan.launches) == 3 and qk.slots[-1] == (INPUT, 3)
        mask = qk.func.params[-1]
        assert mask.name == "ep0_mask" and mask.type.dtype == dtypes.dtype(mask_dtype)
        assert [int(d.value) for d in mask.type.shape] == list(mask_shape)  # read in place, never expanded
        assert "ep0_mask_[" in plan.source and plan.build("sm_90a").endswith(".cubin")
    args = ((1, 4, 16, 64), (1, 2, 16, 64), (1, 2, 16, 64), "float16")
    assert plan_attention(*args).num_inputs == 3
    with pytest.raises(ArgumentError, match="does not broadcast"):
        plan_attention(*args, mask_shape=(1, 3, 16, 16), mask_dtype="bool")
    with pytest.raises(ArgumentError, match="does not broadcast"):
        plan_attention(*args, mask_shape=(1, 1, 1, 16, 16), mask_dtype="bool")
    with pytest.raises(ArgumentError, match="bool"):
        plan_attention(*args, mask_shape=(16, 16), mask_dtype="int32")
    with pytest.raises(ArgumentError, match="both mask_shape and mask_dtype"):
        plan_attention(*args, mask_shape=(16, 16))
    with pytest.raises(UnsupportedError, match="0-d"):
        plan_attention(*args, mask_shape=(), mask_dtype="float16")


@needs_nvcc
@pytest.mark.parametrize("which", ["matmul_batched_bcast", "matmul_vec", "linear_splitk_bias", "linear_wgmma",
                                   "linear_tma", "matmul_tma_kn", "conv_stem", "conv_1x1_direct", "conv_3x3_bf16",
                                   "conv_nhwc_3x3", "conv_nhwc_3x3_col", "conv_nhwc_stem", "conv_nhwc_1x1"])  # fmt: skip
def test_plans_compile_with_nvcc(which, monkeypatch):
    if which == "linear_tma":  # the planning device is an H200: aligned linear layers go to the TMA GEMM
        plan = plan_linear((3, 50, 1024), (4096, 1024), "float16", bias=True, epilogue=gelu_ep((3, 50, 4096)))
        assert isinstance(plan.config, TmaConfig) and plan.aligned_output
        assert [(m.operand, m.shape) for m in plan.tensor_maps] == [((0, 0), (1, 150, 1024)), ((0, 1), (1, 4096, 1024))]
        assert "ts_copy_vector<16>((&C_[" in plan.source  # the fused epilogue keeps 16-byte stores
    elif which == "matmul_tma_kn":
        plan = plan_matmul((2, 130, 64), (2, 64, 72), "bfloat16", epilogue=gelu_ep((2, 130, 72), "bfloat16"))
        assert isinstance(plan.config, TmaConfig) and len(plan.tensor_maps) == 2
        assert plan.tensor_maps[1].shape == (2, 64, 72) and plan.tensor_maps[1].box == (1, 64, 64)
    elif which == "matmul_batched_bcast":
        plan = plan_matmul((2, 1, 17, 24), (1, 3, 24, 40), "float16", epilogue=gelu_ep((2, 3, 17, 40)), wgmma=False)
        assert plan.out_shape == (2, 3, 17, 40) and len(plan.launches) == 1
    elif which == "matmul_vec":
        plan = plan_matmul((3, 5, 64), (64,), "float16", wgmma=False)
        assert plan.out_shape == (3, 5)
    elif which == "linear_splitk_bias":
        plan = plan_linear((3, 5, 64), (100, 64), "float16", bias=True, epilogue=gelu_ep((3, 5, 100)),
                           config=GemmConfig(16, 64, 64, 16, 16, 3, 4))  # fmt: skip
        assert [k.func.name for k in plan.launches] == ["linear_gemm_16x64x64_w16x16_s3_k4", "linear_split_k_reduce_4"]
        assert plan.workspaces == [((4, 15, 100), dtypes.float32)]
        assert plan.num_inputs == 3 and plan.num_extras == 0
    elif which == "linear_wgmma":
        plan = plan_linear((130, 64), (96, 64), "bfloat16", bias=True, config=WgmmaConfig(64, 128, 3, 1))
        assert plan.out_shape == (130, 96) and len(plan.launches) == 1 and "wgmma" in plan.source
    elif which == "conv_stem":
        plan = plan_conv2d((1, 3, 67, 65), (64, 3, 7, 7), "float16", stride=2, padding=3, bias=True,
                           epilogue=gelu_ep((1, 64, 34, 33)), wgmma=False)  # fmt: skip
        assert [k.func.name.split("_")[1] for k in plan.launches][:2] == ["0", "1"]  # im2col, weight padding
        assert plan.workspaces[0] == ((34 * 33, 152), dtypes.float16)
    elif which == "conv_1x1_direct":
        plan = plan_conv2d((2, 64, 8, 8), (256, 64, 1, 1), "float16", wgmma=False)
        assert len(plan.launches) == 1 and plan.workspaces == [] and plan.aligned_inputs == [1, 0]
    elif which == "conv_nhwc_3x3":  # channels-last: an implicit GEMM, x read through an im2col tensor map
        plan = plan_conv2d((2, 14, 15, 72), (64, 3, 3, 72), "float16", stride=2, padding=(1, 1, 0, 2), bias=True,
                           layout="NHWC", epilogue=gelu_ep((2, 7, 8, 64)))  # fmt: skip
        assert isinstance(plan.config, TmaConfig) and plan.workspaces == [] and len(plan.launches) == 1
        a_map, w_map = plan.tensor_maps
        assert a_map.shape == (2, 14, 15, 72) and a_map.box == (plan.config.block_m, 64)
        # the window of output pixels' filter origins: rows -1, 1, .. 11; columns -1, 1, .. 13
        assert a_map.window == Im2colWindow(lower=(-1, -1), upper=(11 - 13, 13 - 14), strides=(2, 2))
        assert w_map.shape == (1, 64, 648) and w_map.operand == (0, 1)  # the OHWI weight is [O, kh*kw*C] itself
        assert "cp.async.bulk.tensor.4d.shared::cluster.global.im2col" in plan.source
    elif which == "conv_nhwc_3x3_col":  # TESSERA_IMPLICIT_CONV=0: im2col rows of contiguous channels, then the GEMM
        monkeypatch.setenv("TESSERA_IMPLICIT_CONV", "0")
        plan = plan_conv2d((2, 14, 15, 64), (64, 3, 3, 64), "float16", padding=1, bias=True, layout="NHWC",
                           epilogue=gelu_ep((2, 14, 15, 64)))  # fmt: skip
        assert isinstance(plan.config, TmaConfig) and plan.workspaces == [((2 * 14 * 15, 576), dtypes.float16)]
        assert [m.shape for m in plan.tensor_maps] == [(1, 420, 576), (1, 64, 576)]
        assert plan.tensor_maps[1].operand == (0, 1)  # the OHWI weight is [O, kh*kw*C] itself
    elif which == "conv_nhwc_stem":  # 3 channels: dense (tap, channel) columns, K = 147 -> Kp = 152
        plan = plan_conv2d((1, 67, 65, 3), (64, 7, 7, 3), "float16", stride=2, padding=3, bias=True, layout="NHWC")
        assert plan.workspaces == [((34 * 33, 152), dtypes.float16), ((64, 152), dtypes.float16)]
        assert "ts_copy_vector<16>" in plan.source
    elif which == "conv_nhwc_1x1":  # a 1x1 stride-1 NHWC conv reads x itself: no copy
        plan = plan_conv2d((2, 7, 7, 512), (128, 1, 1, 512), "float16", layout="NHWC")
        assert isinstance(plan.config, TmaConfig) and len(plan.launches) == 1 and plan.workspaces == []
    else:
        plan = plan_conv2d((2, 64, 14, 15), (64, 64, 3, 3), "bfloat16", padding=1, wgmma=False)
        assert len(plan.launches) == 2 and plan.workspaces == [((2 * 14 * 15, 576), dtypes.bfloat16)]
    assert plan.build("sm_90a").endswith(".cubin")


@pytest.mark.parametrize("m,n,k,batch", [(1, 4096, 4096, 1), (16, 4096, 4096, 1), (4096, 4096, 4096, 1),
                                         (3136, 64, 576, 1), (49, 512, 4608, 1), (17, 33, 40, 6)])  # fmt: skip
@pytest.mark.parametrize("family", ["mma", "wgmma", "tma"])
def test_heuristic_picks_a_buildable_fitting_config(m, n, k, batch, family):
    dev = PLANNING_DEVICE
    cfg = heuristic_config(m, n, k, batch, family, "nk", dev)
    assert not cfg.problems() and cfg.smem_bytes() <= dev.smem_per_block
    assert cfg.block_m <= max(16 if family == "mma" else 64, 1 << (m - 1).bit_length())
    space = {"mma": lambda: mma_space(m, n, k, batch, dev), "wgmma": lambda: wgmma_space(m, n, k, batch, dev),
             "tma": lambda: schedule_space(m, n, k, batch, "nk", tma=True, dev=dev)}[family]()  # fmt: skip
    assert cfg in space
    best = min(estimate_us(c, m, n, k, batch, dev) for c in space)
    assert estimate_us(cfg, m, n, k, batch, dev) <= best / 0.98 ** 2  # ties go to the larger tile
    if m * n >= 4096 * 4096:
        assert cfg.block_m * cfg.block_n >= 128 * 128 and cfg.split_k == 1
    if m <= 16 and n * k >= 4096 * 4096:
        assert cfg.split_k > 1 or cfg.block_m == 16 or cfg.block_n <= 64  # few row tiles: split K or narrow tiles


def test_split_k_comes_from_one_rule_sized_by_the_device():
    from dataclasses import replace

    from tessera.templates.gemm.space import splits

    assert splits(200, 64, 132) == [1]  # a wave of tiles already: no split-k
    assert splits(32, 64, 132) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert splits(32, 8, 132) == [1, 2, 3, 4]  # each split at least 2 k-tiles deep
    assert splits(32, 64, 16) == [1]  # a small GPU: 32 tiles are two waves
    small = replace(PLANNING_DEVICE, sms=16)
    assert all(c.split_k == 1 for c in schedule_space(2048, 2048, 4096, 1, "nk", tma=True, dev=small))
    assert any(c.split_k > 1 for c in schedule_space(256, 512, 4096, 1, "nk", tma=True, dev=PLANNING_DEVICE))
    little_smem = replace(PLANNING_DEVICE, smem_per_block=100 * 1024)
    assert all(c.smem_bytes() <= 100 * 1024 for c in schedule_space(4096, 4096, 4096, 1, "nk", tma=True, dev=little_smem))


# ---- GPU ----------------------------------------------------------------------------------------------------------------
TOL = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-2}


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def rand(torch, shape, dtype, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64, device="cuda") * scale).to(getattr(torch, dtype))


def check(out, ref, dtype):
    assert tuple(out.shape) == tuple(ref.shape)
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype] * (1 + ref.abs().max().item()), f"max abs error {err}"


def epilogue_for(kind, torch, shape, dtype):
    """(Epilogue, extras at call time, reference fn of the rounded anchor result)."""
    acc = ops.placeholder(shape, dtype, "acc")
    if kind == "none":
        return None, [], lambda y: y
    if kind == "relu":
        return Epilogue(acc, ops.relu(acc), []), [], torch.relu
    if kind == "gelu":
        return Epilogue(acc, ops.gelu(acc), []), [], torch.nn.functional.gelu
    if kind == "residual":
        res = ops.placeholder(shape, dtype, "res")
        rv = rand(torch, shape, dtype)
        return Epilogue(acc, ops.add(acc, res), [res]), [rv], lambda y: y + rv.double()
    if kind == "bias_gelu":
        bias = ops.placeholder(shape[-1:], dtype, "bias")
        bv = rand(torch, shape[-1:], dtype)
        return Epilogue(acc, ops.gelu(ops.add(acc, bias)), [bias]), [bv], lambda y: torch.nn.functional.gelu(y + bv.double())
    if kind == "relu_residual":
        res = ops.placeholder(shape, "float32", "res")
        rv = rand(torch, shape, "float32")
        return Epilogue(acc, ops.relu(ops.add(acc, res)), [res]), [rv], lambda y: torch.relu(y + rv.double())
    assert kind == "cast"
    return Epilogue(acc, ops.cast(ops.mul(acc, 2.0), "float32"), []), [], lambda y: y * 2


def run_anchor(torch, kernel, inputs, extras, ref, dtype):
    out = torch.empty(kernel.out_shape, dtype=getattr(torch, kernel.out_dtype.name), device="cuda")
    kernel(inputs, out, extras)
    torch.cuda.synchronize()
    check(out, ref, dtype if kernel.out_dtype.name != "float32" else "float32")
    return out


MATMUL_CASES = [
    # a shape, b shape, layout, dtype, epilogue
    ((1, 64), (64, 96), "kn", "float16", "relu"),
    ((17, 40), (40, 33), "kn", "float16", "residual"),  # N odd: element-wise loads
    ((130, 72), (256, 72), "nk", "float16", "cast"),
    ((2, 3, 17, 24), (3, 24, 40), "kn", "float16", "bias_gelu"),  # batch dims, broadcast b
    ((4, 33, 20), (4, 20, 18), "kn", "bfloat16", "relu_residual"),  # K = 20
    ((2, 1, 16, 64), (1, 3, 64, 32), "kn", "float16", "none"),  # both broadcast
    ((64,), (2, 64, 24), "kn", "float16", "relu"),  # vector a
    ((3, 5, 64), (64,), "nk", "bfloat16", "none"),  # vector b
    ((2, 130, 64), (2, 48, 64), "nk", "float16", "gelu"),
    ((5, 7, 64), (64, 512), "kn", "float16", "residual"),  # batch folded into M
]


@pytest.mark.cuda
@pytest.mark.parametrize("a_shape,b_shape,layout,dtype,kind", MATMUL_CASES)
def test_matmul_anchor(torch, a_shape, b_shape, layout, dtype, kind):
    k = a_shape[-1]
    a, b = rand(torch, a_shape, dtype, k**-0.5), rand(torch, b_shape, dtype)
    kernel0 = plan_matmul(a_shape, b_shape, dtype, b_layout=layout).load()  # the plain product
    b64 = b.double() if layout == "kn" or len(b_shape) == 1 else b.double().transpose(-1, -2)
    y = torch.matmul(a.double(), b64)
    ep, extras, fn = epilogue_for(kind, torch, tuple(y.shape), dtype)
    kernel = prepare_matmul(a_shape, b_shape, dtype, b_layout=layout, epilogue=ep)
    assert kernel.out_shape == tuple(y.shape)
    run_anchor(torch, kernel0, [a, b], [], y, dtype)
    run_anchor(torch, kernel, [a, b], extras, fn(y.to(getattr(torch, dtype)).double()), dtype)


LINEAR_CASES = [
    ((1, 256), (512, 256), True, "float16", "gelu", None),
    ((2, 17, 96), (130, 96), True, "float16", "relu", None),
    ((130, 100), (33, 100), False, "float16", "cast", None),  # K = 100: element-wise loads
    ((16, 512), (1024, 512), True, "bfloat16", "residual", None),
    ((3, 5, 64), (100, 64), True, "float16", "gelu", GemmConfig(16, 64, 64, 16, 16, 3, 4)),  # split-k
    ((130, 64), (96, 64), True, "bfloat16", "residual", WgmmaConfig(64, 128, 3, 1)),
    ((33, 256), (200, 256), False, "float16", "relu", WgmmaConfig(64, 64, 3, 2)),  # wgmma + split-k
    # the warp-specialised TMA GEMM, epilogue fused into its staged 16-byte stores
    ((2, 17, 96), (136, 96), True, "float16", "residual", TmaConfig(128, 64, 4, 2, epilogue="staged")),
    ((130, 256), (200, 256), True, "bfloat16", "cast", TmaConfig(64, 128, 4, 1, epilogue="staged")),  # f32 out
    ((5, 64), (33, 64), True, "float16", "gelu", TmaConfig(64, 64, 4, 1, epilogue="staged")),  # N odd
    ((33, 512), (100, 512), False, "float16", "relu", TmaConfig(64, 64, 4, 1, split_k=4, epilogue="staged")),
    ((2048, 64), (4096, 64), True, "float16", "relu_residual",
     TmaConfig(128, 128, 4, 2, persistent=True, epilogue="staged")),  # more tiles than SMs
]


@pytest.mark.cuda
@pytest.mark.parametrize("x_shape,w_shape,bias,dtype,kind,config", LINEAR_CASES)
def test_linear_anchor(torch, x_shape, w_shape, bias, dtype, kind, config):
    if isinstance(config, (WgmmaConfig, TmaConfig)) and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs an SM90 GPU")
    x, w = rand(torch, x_shape, dtype, x_shape[-1] ** -0.5), rand(torch, w_shape, dtype)
    b = rand(torch, w_shape[:1], dtype)
    y = x.double() @ w.double().T + (b.double() if bias else 0)
    ep, extras, fn = epilogue_for(kind, torch, tuple(y.shape), dtype)
    plan = plan_linear(x_shape, w_shape, dtype, bias=bias, epilogue=ep, config=config)
    assert plan.config == config or config is None
    kernel = plan.load()
    inputs = [x, w, b] if bias else [x, w]
    run_anchor(torch, kernel, inputs, extras, fn(y.to(getattr(torch, dtype)).double()), dtype)
    x.copy_(rand(torch, x_shape, dtype, x_shape[-1] ** -0.5))  # new data at the same addresses (cached maps)
    y = x.double() @ w.double().T + (b.double() if bias else 0)
    run_anchor(torch, kernel, inputs, extras, fn(y.to(getattr(torch, dtype)).double()), dtype)


CONV_CASES = [
    # x shape, w shape, stride, padding (t, l, b, r), dilation, bias, dtype, epilogue
    ((1, 3, 67, 65), (64, 3, 7, 7), 2, (3, 3, 3, 3), 1, True, "float16", "relu"),  # ResNet stem, odd size
    ((2, 64, 14, 15), (64, 64, 3, 3), 1, (1, 1, 1, 1), 1, True, "float16", "relu_residual"),
    ((2, 64, 8, 8), (256, 64, 1, 1), 1, (0, 0, 0, 0), 1, False, "float16", "residual"),  # 1x1: no copy
    ((1, 512, 7, 7), (128, 512, 1, 1), 1, (0, 0, 0, 0), 1, True, "float16", "relu"),  # 1x1, H*W = 49
    ((2, 256, 14, 14), (512, 256, 1, 1), 2, (0, 0, 0, 0), 1, True, "bfloat16", "none"),  # 1x1 stride 2
    ((1, 32, 17, 17), (48, 32, 3, 3), 2, (1, 1, 1, 1), 1, False, "float16", "cast"),
    ((1, 16, 13, 11), (24, 16, 3, 3), 1, (0, 1, 1, 2), 2, True, "bfloat16", "gelu"),  # dilation, uneven pads
    ((1, 12, 9, 10), (8, 12, 3, 3), 1, (1, 1, 1, 1), 1, True, "float16", "relu"),  # NHWC: dense columns, K 108
    ((2, 1, 11, 9), (8, 1, 3, 3), 2, (1, 1, 1, 1), 1, False, "bfloat16", "none"),  # NHWC: 2-byte copies
    # NHWC implicit GEMM: 72 channels (a k-block bleeds into the next tap), tiles across 3 images
    ((3, 72, 9, 7), (40, 72, 3, 3), 2, (1, 1, 1, 1), 1, True, "bfloat16", "relu_residual"),
    ((1, 8, 5, 1), (16, 8, 3, 3), 1, (1, 1, 1, 1), 1, False, "float16", "none"),  # width 1, 8 channels
    ((4, 128, 6, 5), (136, 128, 3, 3), 1, (1, 1, 1, 1), 1, True, "float16", "relu"),  # 2 blocks per tap
]


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("x_shape,w_shape,stride,pads,dilation,bias,dtype,kind", CONV_CASES)
def test_conv2d_anchor(torch, x_shape, w_shape, stride, pads, dilation, bias, dtype, kind, layout):
    F = torch.nn.functional
    fan_in = w_shape[1] * w_shape[2] * w_shape[3]
    x, w, b = rand(torch, x_shape, dtype), rand(torch, w_shape, dtype, fan_in**-0.5), rand(torch, w_shape[:1], dtype)
    xp = F.pad(x.double(), (pads[1], pads[3], pads[0], pads[2]))
    y = F.conv2d(xp, w.double(), b.double() if bias else None, stride=stride, dilation=dilation)
    if layout == "NHWC":  # the same convolution on channels-last operands (OHWI weight)
        x, w, y = (t.permute(0, 2, 3, 1).contiguous() for t in (x, w, y))
    ep, extras, fn = epilogue_for(kind, torch, tuple(y.shape), dtype)
    kernel = prepare_conv2d(tuple(x.shape), tuple(w.shape), dtype, stride=stride, padding=pads, dilation=dilation,
                            bias=bias, epilogue=ep, layout=layout)  # fmt: skip
    assert kernel.out_shape == tuple(y.shape)
    run_anchor(torch, kernel, [x, w, b] if bias else [x, w], extras, fn(y.to(getattr(torch, dtype)).double()), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("implicit", ["1", "0"])
def test_nhwc_conv_implicit_and_materialised_agree(torch, implicit, monkeypatch):
    """The same NHWC conv as an implicit GEMM and with the col buffer (TESSERA_IMPLICIT_CONV=0),
    called twice with different inputs."""
    monkeypatch.setenv("TESSERA_IMPLICIT_CONV", implicit)
    kernel = prepare_conv2d((2, 11, 13, 64), (72, 3, 3, 64), "float16", stride=(2, 1), padding=1, bias=True,
                            layout="NHWC")  # fmt: skip
    assert (kernel.plan.workspaces == []) == (implicit == "1")
    for _ in range(2):
        x, w, b = rand(torch, (2, 11, 13, 64), "float16"), rand(torch, (72, 3, 3, 64), "float16", 576**-0.5), rand(torch, (72,), "float16")
        y = torch.nn.functional.conv2d(x.permute(0, 3, 1, 2).double(), w.permute(0, 3, 1, 2).double(), b.double(),
                                       stride=(2, 1), padding=1).permute(0, 2, 3, 1)  # fmt: skip
        run_anchor(torch, kernel, [x, w, b], [], y, "float16")


@pytest.mark.cuda
def test_calls_allocate_nothing_and_replay_in_a_cuda_graph(torch):
    kernels = [
        (plan_linear((3, 5, 64), (100, 64), "float16", bias=True, epilogue=gelu_ep((3, 5, 100)),
                     config=GemmConfig(16, 64, 64, 16, 16, 3, 4)).load(), [(3, 5, 64), (100, 64), (100,)]),  # fmt: skip
        (prepare_conv2d((1, 3, 33, 31), (16, 3, 7, 7), "float16", stride=2, padding=3, bias=True),
         [(1, 3, 33, 31), (16, 3, 7, 7), (16,)]),
    ]  # fmt: skip
    for kernel, shapes in kernels:
        inputs = [rand(torch, s, "float16") for s in shapes]
        out = torch.empty(kernel.out_shape, dtype=torch.float16, device="cuda")
        kernel(inputs, out)
        torch.cuda.synchronize()
        expected = out.clone()
        before = torch.cuda.memory_allocated()
        kernel(inputs, out)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            kernel(inputs, out)  # warm-up on the capture stream
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                kernel(inputs, out)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        fresh = [rand(torch, s, "float16") for s in shapes]
        for dst, src in zip(inputs, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        direct = torch.empty_like(out)
        kernel(fresh, direct)
        torch.cuda.synchronize()
        assert torch.equal(out, direct)


@pytest.mark.cuda
def test_call_errors_are_clear(torch):
    kernel = prepare_linear((16, 64), (32, 64), "float16")
    x, w = rand(torch, (16, 64), "float16"), rand(torch, (32, 64), "float16")
    out = torch.empty((16, 32), dtype=torch.float16, device="cuda")
    with pytest.raises(ArgumentError, match="takes 2 inputs"):
        kernel([x], out)
    with pytest.raises(ArgumentError, match="extra tensors"):
        kernel([x, w], out, [x])
    with pytest.raises(ArgumentError, match="16-byte boundary"):
        kernel([torch.empty(16 * 64 + 1, dtype=torch.float16, device="cuda")[1:].view(16, 64), w], out)
    with pytest.raises(ArgumentError):
        kernel([x, w], torch.empty((16, 33), dtype=torch.float16, device="cuda"))
    with pytest.raises(ArgumentError):
        kernel([x.float(), w], out)


@pytest.mark.cuda
def test_tuned_anchor_matches(torch, cache_dir):
    x, w = rand(torch, (16, 64), "float16", 0.125), rand(torch, (64, 64), "float16")
    kernel = prepare_matmul((16, 64), (64, 64), "float16", b_layout="kn", epilogue=gelu_ep((16, 64)), tune=True)
    y = (x.double() @ w.double()).half().double()
    run_anchor(torch, kernel, [x, w], [], torch.nn.functional.gelu(y), "float16")


ATTENTION_CASES = [
    # q shape, k/v heads, k length, v head size, causal, dtype
    ((2, 8, 13, 64), 2, 13, 64, True, "float16"),  # grouped heads, odd length
    ((1, 4, 130, 128), 4, 130, 128, False, "bfloat16"),
    ((1, 2, 17, 64), 1, 40, 32, True, "float16"),  # Sq != Sk: top-left causal alignment, Dv != D
]


@pytest.mark.cuda
@pytest.mark.parametrize("q_shape,hk,sk,dv,causal,dtype", ATTENTION_CASES)
def test_attention_anchor(torch, q_shape, hk, sk, dv, causal, dtype):
    b, h, sq, d = q_shape
    q, k, v = rand(torch, q_shape, dtype), rand(torch, (b, hk, sk, d), dtype), rand(torch, (b, hk, sk, dv), dtype)
    kernel = prepare_attention(q.shape, k.shape, v.shape, dtype, causal=causal)
    rep = h // hk
    k64, v64 = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ k64.transpose(-1, -2) * d**-0.5
    if causal:
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    ref = torch.softmax(s, -1) @ v64
    run_anchor(torch, kernel, [q, k, v], [], ref, dtype)


MASKED_ATTENTION_CASES = [
    # q shape, k/v heads, k length, mask shape, mask dtype, causal, dtype
    ((2, 4, 37, 64), 4, 37, (2, 1, 1, 37), "float16", False, "float16"),  # BERT: additive key-padding mask
    ((2, 4, 37, 64), 2, 37, (2, 1, 37, 37), "bool", True, "float16"),  # GPT-2/Llama: bool mask and causal, GQA
    ((2, 8, 128, 64), 2, 128, (2, 1, 128, 128), "float16", True, "float16"),
    ((1, 8, 128, 64), 2, 128, (1, 1, 128, 128), "float32", True, "float16"),
    ((2, 2, 128, 64), 1, 128, (128, 128), "bool", False, "bfloat16"),
    ((2, 4, 37, 64), 2, 37, (37, 37), "float32", False, "float16"),
    ((2, 4, 128, 64), 4, 128, (2, 1, 1, 128), "bool", False, "bfloat16"),
    ((1, 4, 17, 64), 2, 40, (1, 4, 17, 40), "bool", True, "float16"),  # Sq != Sk, a mask per head
]


def attention_mask(torch, shape, dtype, gen):
    """A random mask that leaves key 0 of every row unmasked (torch and the reference differ on empty rows)."""
    if dtype == "bool":
        m = torch.rand(shape, generator=gen, device="cuda") > 0.3
        m[..., 0] = True
        return m
    t = getattr(torch, dtype)
    m = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64) * 2
    # masked keys: -inf, or the dtype's lowest value as HuggingFace uses
    low = torch.finfo(t).min if dtype == "float16" else float("-inf")
    m = m.masked_fill(torch.rand(shape, generator=gen, device="cuda") < 0.25, low)
    m[..., 0] = 0.5
    return m.to(t)


def sdpa_reference(torch, q, k, v, mask, causal, scale=None):
    """torch's scaled_dot_product_attention in float32, causal folded into the mask (torch takes one or the other)."""
    rep = q.shape[1] // k.shape[1]
    k32, v32 = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    m = mask if mask is None or mask.dtype == torch.bool else mask.float()
    if causal:
        tril = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device="cuda").tril()
        m = tril if m is None else (m & tril if m.dtype == torch.bool else m.masked_fill(~tril, float("-inf")))
    F = torch.nn.functional
    return F.scaled_dot_product_attention(q.float(), k32, v32, attn_mask=m, scale=scale).double()


@pytest.mark.cuda
@pytest.mark.parametrize("q_shape,hk,sk,mask_shape,mask_dtype,causal,dtype", MASKED_ATTENTION_CASES)
def test_masked_attention_anchor(torch, q_shape, hk, sk, mask_shape, mask_dtype, causal, dtype):
    b, h, sq, d = q_shape
    gen = torch.Generator("cuda").manual_seed(sq * 1000 + sk + len(mask_shape))
    q, k, v = rand(torch, q_shape, dtype), rand(torch, (b, hk, sk, d), dtype), rand(torch, (b, hk, sk, d), dtype)
    mask = attention_mask(torch, mask_shape, mask_dtype, gen)
    scale = 0.3 if mask_dtype == "float32" else None
    kernel = prepare_attention(q.shape, k.shape, v.shape, dtype, causal=causal, scale=scale, mask_shape=mask.shape,
                               mask_dtype=mask_dtype)  # fmt: skip
    out = run_anchor(torch, kernel, [q, k, v, mask], [], sdpa_reference(torch, q, k, v, mask, causal, scale), dtype)
    assert torch.isfinite(out).all()
    with pytest.raises(ArgumentError, match="takes 4 inputs"):
        kernel([q, k, v], out)


@pytest.mark.cuda
@pytest.mark.parametrize("mask_dtype", ["bool", "float32"])
def test_attention_fully_masked_rows_match_the_reference(torch, mask_dtype):
    """A row with every key masked is 0/0 in the graph op's reference (NaN); the other rows are unaffected."""
    from tessera.graph.opdefs.linalg import _sdpa_ref

    b, h, hk, sq, sk, d = 2, 4, 2, 37, 37, 64
    gen = torch.Generator("cuda").manual_seed(7)
    q = rand(torch, (b, h, sq, d), "float16")
    k, v = rand(torch, (b, hk, sk, d), "float16"), rand(torch, (b, hk, sk, d), "float16")
    mask = attention_mask(torch, (b, 1, sq, sk), mask_dtype, gen)
    off = False if mask_dtype == "bool" else float("-inf")
    mask[0, :, 5] = off  # query 5 of batch 0 sees no key
    mask[1, :, 3, :4] = off  # query 3 of batch 1: the mask keeps keys > 3 only, causal keys <= 3 only
    kernel = prepare_attention(q.shape, k.shape, v.shape, "float16", causal=True, mask_shape=mask.shape,
                               mask_dtype=mask_dtype)  # fmt: skip
    out = torch.empty(kernel.out_shape, dtype=torch.float16, device="cuda")
    kernel([q, k, v, mask], out)
    torch.cuda.synchronize()
    with np.errstate(invalid="ignore", divide="ignore"):
        (ref,) = _sdpa_ref([t.cpu().numpy() for t in (q, k, v, mask)], {"causal": True, "scale": None})
    ref = torch.from_numpy(ref).cuda().double()
    empty = torch.isnan(ref)
    assert empty[0, :, 5].all() and empty[1, :, 3].all() and not empty[1, :, 2].any()
    assert torch.equal(torch.isnan(out), empty)
    check(torch.where(empty, 0, out.double()), torch.where(empty, 0, ref), "float16")


@pytest.mark.cuda
def test_attention_anchor_runs_the_fused_kernel_on_sm90(torch, caplog):
    """On an SM90 GPU the anchor is the flash kernel (prefill and split-KV decode, repeated calls on
    fresh inputs); a head dim it does not take falls back to the composition, and says why."""
    import logging

    from tessera.templates.attention.plan import FlashAnchorKernel

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernel needs an SM90 GPU")
    for (b, h, sq, d), hk, sk, causal in [((2, 8, 129, 128), 2, 129, True), ((2, 32, 1, 64), 8, 3000, False)]:
        kernel = prepare_attention((b, h, sq, d), (b, hk, sk, d), (b, hk, sk, d), "float16", causal=causal)
        assert isinstance(kernel, FlashAnchorKernel) and kernel.kernels[0].startswith("flash_attention")
        for _ in range(2):
            q, k, v = rand(torch, (b, h, sq, d), "float16"), rand(torch, (b, hk, sk, d), "float16"), rand(torch, (b, hk, sk, d), "float16")
            run_anchor(torch, kernel, [q, k, v], [], sdpa_reference(torch, q, k, v, None, causal), "float16")
    with caplog.at_level(logging.INFO, logger="tessera"):
        kernel = prepare_attention((1, 2, 16, 32), (1, 2, 16, 32), (1, 2, 16, 32), "float16")
    assert not isinstance(kernel, FlashAnchorKernel) and "head dim 32" in caplog.text
