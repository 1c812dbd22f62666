"""Flash attention (tessera.templates.attention.flash): configuration rules, launch arguments and grids,
the register-sourced wgmma, and nvcc compile checks of every variant family in the CPU tier;
results against a float32 torch reference on the GPU."""

from __future__ import annotations

import shutil

import pytest

from tessera.errors import ArgumentError, KernelSyntaxError, UnsupportedError
from tessera.ir import dtypes
from tessera.templates.attention.flash import (
    FlashConfig,
    MaskSpec,
    make_attention_combine,
    make_flash_attention,
    tensor_map_box,
)
from tessera.templates.attention.launch import (
    AttentionShape,
    choose_config,
    choose_splits,
    kernels_for,
    launch_arguments,
    make_map_type,
    mask_spec,
)

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
f16, bf16 = dtypes.float16, dtypes.bfloat16


def test_config_problems_name_the_reason():
    assert not FlashConfig().problems(128)
    assert "consumers" in FlashConfig(3).problems()[0]
    assert "block_n" in FlashConfig(2, 96).problems()[0]
    assert "shared memory" in " ".join(FlashConfig(2, 128, 4).problems(128))
    with pytest.raises(UnsupportedError, match="head dims"):
        make_flash_attention(f16, 48)
    with pytest.raises(UnsupportedError, match="float16 or bfloat16"):
        make_flash_attention(dtypes.float32, 64)


def test_choose_config_and_splits():
    decode = AttentionShape(1, 32, 8, 1, 8192, 128)
    cfg = choose_config(decode)
    assert cfg.consumers == 1 and not cfg.problems(128)
    assert choose_splits(decode, cfg, 132) == 16  # 8 problems x 16 splits fill one wave
    prefill = AttentionShape(4, 32, 32, 2048, 2048, 128)
    assert choose_config(prefill).consumers == 2
    assert choose_splits(prefill, choose_config(prefill), 132) == 1
    short = AttentionShape(1, 12, 12, 128, 128, 64)  # GPT-2 at 128 tokens: 12 tiles of 128 rows on 132 SMs
    assert choose_config(short).consumers == 2 and choose_config(short, 132).consumers == 1
    assert choose_config(AttentionShape(16, 12, 12, 128, 128, 64), 132).consumers == 2  # 192 tiles fill the GPU
    assert choose_config(AttentionShape(1, 32, 4, 512, 512, 64), 132).consumers == 2  # 4 key blocks to pipeline
    tiny = AttentionShape(1, 2, 2, 1, 1, 64)
    assert choose_splits(tiny, choose_config(tiny), 132) == 1
    for sk in (129, 1000, 4097):  # no split is ever empty
        shape = AttentionShape(2, 8, 2, 1, sk, 64)
        splits = choose_splits(shape, choose_config(shape), 132)
        blocks = -(-sk // 128)
        per = -(-blocks // splits)
        assert (splits - 1) * per < blocks


def test_mask_spec_checks_broadcasting():
    full = (2, 4, 7, 9)
    assert mask_spec((2, 1, 7, 9), "bool", full).full == (True, False, True, True)
    assert mask_spec((7, 9), "float32", full) == MaskSpec(dtypes.float32, (True, True))
    with pytest.raises(ArgumentError, match="does not broadcast"):
        mask_spec((3, 9), "bool", full)
    with pytest.raises(ArgumentError, match="rank 1..4"):
        mask_spec((1, 2, 4, 7, 9), "bool", full)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mask", [None, MaskSpec(dtypes.boolean, (True, False, True, True)), MaskSpec(dtypes.float16, (True,))])
def test_launch_arguments_bind_and_grids(splits, mask):
    """The arguments a plan binds fit the kernels' signatures, and the grids cover the row
    tiles x (batch, kv head) x splits (checked on the CPU with the runtime's own binder)."""
    torch = pytest.importorskip("torch")
    del torch
    from tessera.runtime.args import bind, eval_launch_dims, scalar_env
    from tessera.runtime.tensor_map import TensorMap

    shape = AttentionShape(2, 8, 2, 33, 300, 80)
    cfg = choose_config(shape)
    kernels = kernels_for(shape, f16, True, mask, cfg, splits)
    maps = [TensorMap(make_map_type(f16, tensor_map_box(cfg, "q" if i == 0 else "k")), bytes(128)) for i in range(3)]
    flash_args, combine_args, _ = launch_arguments(shape, f16, 0.125, mask, splits, "cpu", maps)
    grids = []
    for kernel, args in zip(kernels, (flash_args, combine_args)):
        values, _, _ = bind(kernel.ir, args, "cpu")
        grids.append(eval_launch_dims(kernel.ir, scalar_env(kernel.ir, values), kernel.lowered.launch.grid))
    assert grids[0] == (-(-shape.rows // cfg.block_m), 4, splits)
    if splits > 1:
        assert grids[1] == (-(-4 * shape.rows * 80 // 128), 1, 1)
    else:
        assert combine_args is None and len(kernels) == 1


def test_register_sourced_wgmma_is_checked():
    """wgmma takes A from registers (the RS form flash attention feeds P through); B must still
    be in shared memory."""
    import tessera as ts
    from tessera import f32

    with pytest.raises(KernelSyntaxError, match="B from shared memory"):

        @ts.kernel(target="cuda")
        def bad(x: f16["n"]):
            ts.attrs.grid = 1
            ts.attrs.block = 128
            acc = ts.register_tensor(f32, [32])
            a = ts.register_tensor(f16, [8])
            b = ts.register_tensor(f16, [64])
            ts.wgmma(acc[0], a[0], b[0], n=64)


def test_fmax_and_fast_exp2_intrinsics(rng):
    """fmax ignores a NaN operand (C's fmax) on the CPU too; fast_exp2 is a CUDA-only intrinsic."""
    import numpy as np

    import tessera as ts

    @ts.kernel
    def k(x: ts.f32["n"], y: ts.f32["n"], z: ts.f32["n"]):
        for i in ts.grid(n):
            z[i] = ts.fmax(x[i], y[i])

    x = rng.standard_normal(9).astype(np.float32)
    y = rng.standard_normal(9).astype(np.float32)
    y[2] = np.nan
    z = np.zeros(9, np.float32)
    k(x, y, z)
    assert np.array_equal(z, np.fmax(x, y))
    with pytest.raises(KernelSyntaxError, match="fast_exp2"):

        @ts.kernel
        def bad(x: ts.f32["n"]):
            for i in ts.grid(n):
                x[i] = ts.fast_exp2(x[i])


def test_fold_scale_refuses_a_float_mask():
    with pytest.raises(UnsupportedError, match="float mask"):
        make_flash_attention(f16, 64, mask=MaskSpec(dtypes.float32, (True,)), fold_scale=True)
    names = [k.ir.name for k in kernels_for(AttentionShape(1, 2, 2, 9, 9, 64), f16, False, None, FlashConfig(), 1, 0.1)]
    assert names[0].endswith("_fs")
    names = [k.ir.name for k in kernels_for(AttentionShape(1, 2, 2, 9, 9, 64), f16, False, None, FlashConfig(), 1, -0.1)]
    assert not names[0].endswith("_fs")  # a negative scale reverses the order of the scores


@needs_nvcc
@pytest.mark.slow
def test_flash_attention_variants_compile():
    """One kernel of each family builds with nvcc: both dtypes, head dims 64/80/96/128, causal,
    bool and float masks of several ranks, split-KV (decode) and the combine."""
    variants = [
        make_flash_attention(f16, 128, fold_scale=True),
        make_flash_attention(f16, 128, FlashConfig(2, 128, 2, overlap=False, pingpong=False)),
        make_flash_attention(bf16, 80, causal=True),
        make_flash_attention(f16, 96, FlashConfig(1, 128, 3), partial=True),
        make_flash_attention(bf16, 64, FlashConfig(2, 64, 4), causal=True, mask=MaskSpec(dtypes.float32, (True, True))),
        make_flash_attention(f16, 128, mask=MaskSpec(dtypes.boolean, (True, False, True, True))),
        make_attention_combine(bf16, 96),
        make_flash_attention(f16, 64, FlashConfig(1, 128, 3), causal=True, heads_last=True),  # [B, Sq, H, D] output
        make_attention_combine(f16, 80, heads_last=True),
    ]
    for k in variants:
        src = k.source
        if k.ir.name.startswith("flash_attention_combine"):
            assert "exp2f" in src
        else:
            assert "cp.async.bulk.tensor.3d" in src and "setmaxnreg" in src or "_64x" in k.ir.name
            assert "_rs(" in src  # P V reads P from registers
            assert "ex2.approx.ftz.f32" in src
            assert ("bar.sync" in src) == ("_pp" in k.ir.name)
        k.build()


# ---- GPU ------------------------------------------------------------------------------------------
def _reference(q, k, v, causal=False, mask=None):
    q, k, v = q.float(), k.float(), v.float()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        import torch

        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype.is_floating_point is False else s + mask.float()
    return s.softmax(-1) @ v


def _check(out, ref, dtype_name):
    import torch

    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan), "NaN rows (fully masked) differ from the reference"
    o, r = out.float()[~nan], ref[~nan]
    err = float((o - r).norm() / r.norm())
    assert err < (1e-2 if dtype_name == "float16" else 2e-2), err


CASES = [  # b, h, hk, sq, sk, d, causal, splits
    (2, 4, 4, 129, 129, 64, False, None), (1, 8, 2, 1000, 1000, 80, True, None), (1, 4, 1, 7, 300, 96, False, None),
    (2, 8, 2, 1, 4097, 128, False, None), (1, 2, 2, 1, 1, 128, False, None), (3, 6, 3, 129, 77, 128, True, None),
    (3, 6, 3, 77, 129, 64, True, None), (1, 2, 2, 64, 1000, 128, False, 5), (2, 4, 4, 300, 700, 80, True, 3),
    (1, 32, 8, 1, 8192, 128, False, None), (4, 32, 4, 1, 512, 96, False, None),
    # one key block and few 128-row tiles: 64-row tiles (GPT-2 / BERT at 128 tokens; packed heads across tiles)
    (1, 12, 12, 128, 128, 64, True, None), (1, 12, 12, 128, 128, 64, False, None), (2, 6, 2, 100, 77, 80, True, None),
]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_flash_attention_matches_torch(dtype_name):
    """Odd lengths (1, 7, 77, 129, 1000, 4097), Sk != Sq, causal, GQA/MQA, forced and chosen
    KV splits, every head dim; outputs poisoned with NaN first; two calls on fresh inputs."""
    import torch

    from tessera.eager.attention import flash_attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA/wgmma need an SM90 GPU")
    dt = getattr(torch, dtype_name)
    for b, h, hk, sq, sk, d, causal, splits in CASES:
        for _ in range(2):
            q = torch.randn(b, h, sq, d, device="cuda", dtype=dt)
            k, v = (torch.randn(b, hk, sk, d, device="cuda", dtype=dt) for _ in range(2))
            out = torch.full_like(q, float("nan"))
            flash_attention(q, k, v, causal=causal, splits=splits, out=out)
            _check(out, _reference(q, k, v, causal), dtype_name)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_flash_attention_masks(dtype_name):
    """Bool masks (with a fully masked row: NaN, like the reference) and float masks (with -inf
    entries), broadcast from [B, 1, Sq, Sk], [Sq, Sk], [B, H, 1, Sk] and [B, 1, 1, Sk], alone
    and with causal; a decode step with a padding mask over a split cache."""
    import torch

    from tessera.eager.attention import flash_attention

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA/wgmma need an SM90 GPU")
    dt = getattr(torch, dtype_name)
    for b, h, hk, sq, sk, d, causal, kind in [
        (2, 4, 2, 129, 200, 128, False, "bool_b1qk"), (2, 4, 2, 129, 200, 64, False, "float_qk"),
        (2, 4, 4, 33, 150, 96, True, "bool_b1qk"), (2, 4, 4, 50, 1000, 80, False, "half_bh1k"),
        (1, 4, 4, 1, 2048, 128, False, "bool_b11k"),
    ]:  # fmt: skip
        q = torch.randn(b, h, sq, d, device="cuda", dtype=dt)
        k, v = (torch.randn(b, hk, sk, d, device="cuda", dtype=dt) for _ in range(2))
        if kind.startswith("bool"):
            mask = torch.rand((b, 1, sq, sk) if kind == "bool_b1qk" else (b, 1, 1, sk), device="cuda") > 0.3
            if kind == "bool_b1qk":
                mask[..., 3, :] = False
        elif kind == "float_qk":
            mask = torch.randn(sq, sk, device="cuda") * 2
        else:
            mask = torch.randn(b, h, 1, sk, device="cuda").half()
            mask[..., ::7] = float("-inf")
        out = torch.full_like(q, float("nan"))
        flash_attention(q, k, v, causal=causal, mask=mask, out=out)
        _check(out, _reference(q, k, v, causal, mask), dtype_name)


@pytest.mark.cuda
def test_flash_attention_rejects_bad_operands():
    import torch

    from tessera.eager.attention import flash_attention

    q = torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 3, 8, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ArgumentError, match="multiple"):
        flash_attention(q, k, k)
    with pytest.raises(UnsupportedError, match="head dims"):
        x = torch.randn(1, 2, 8, 40, device="cuda", dtype=torch.float16)
        flash_attention(x, x, x)
    with pytest.raises(UnsupportedError, match="float16 or bfloat16"):
        x = torch.randn(1, 2, 8, 64, device="cuda")
        flash_attention(x, x, x)
    with pytest.raises(ArgumentError, match="broadcast"):
        flash_attention(q, q, q, mask=torch.ones(3, 8, dtype=torch.bool, device="cuda"))


def test_anchor_says_why_the_fused_kernel_does_not_apply(monkeypatch):
    """The attention anchor's fallback reasons (checked as if on an SM90 GPU)."""
    from tessera.templates.attention import plan as attention

    monkeypatch.setattr(attention, "_sm90", lambda: True)
    assert attention.flash_unsupported((2, 8, 9, 128), (2, 2, 9, 128), (2, 2, 9, 128)) is None
    assert "head dim 32" in attention.flash_unsupported((2, 8, 9, 32), (2, 2, 9, 32), (2, 2, 9, 32))
    assert "differs" in attention.flash_unsupported((2, 8, 9, 64), (2, 2, 9, 64), (2, 2, 9, 32))
    assert "2**31" in attention.flash_unsupported((1, 8, 9, 64), (1, 8, 9, 64), (1, 8, 9, 64), (64, 64, 1 << 20, 9))
    assert "65535" in attention.flash_unsupported((70000, 1, 9, 64), (70000, 1, 9, 64), (70000, 1, 9, 64))
    monkeypatch.setattr(attention, "_sm90", lambda: False)
    assert "SM90" in attention.flash_unsupported((2, 8, 9, 128), (2, 2, 9, 128), (2, 2, 9, 128))
