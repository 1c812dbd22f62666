"""The decode kernel's launch model (tessera/templates/lowbit/launch.py) and the `streaming`
configs it motivates: one even wave (min_blocks), activations staged by cp.async while the
first weights stream.  CPU: the model's arithmetic, the cubin register count, nvcc builds;
GPU tier: the streaming configs against the float64 reference at odd sizes."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from lowbit_cases import rotated

import tessera as ts
from tessera.errors import UnsupportedError
from tessera.quant import WEIGHT_TYPES
from tessera.quant.quantize import quantize_weight
from tessera.templates.lowbit.decode import DecodeConfig, make_decode
from tessera.templates.lowbit.launch import cubin_registers, launch_model, resident_blocks

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
N0, K0, SMS = 12288, 4096, 132


def test_resident_blocks_names_the_limit():
    assert resident_blocks(128, 54, 2048) == (9, "registers")  # 56 x 128 = 7168 registers a block
    assert resident_blocks(128, 32, 2048) == (16, "threads")
    assert resident_blocks(128, 40, 60 * 1024) == (3, "shared")
    assert resident_blocks(32, 16, 0) == (32, "blocks")
    assert resident_blocks(128, 255, 0) == (2, "registers")  # 256 x 128 = 32768


def test_launch_model_of_measured_configs():
    """Numbers the H200 sweep at 02c490e can be read against
    (bench/results/2026-11-23-h200-lowbit-dev-02c490e.md)."""
    # int4 M=1 default: 768 blocks of 4 warps, 54 registers: all resident, 4 units per warp one at a time
    c = DecodeConfig.default(4, 1, N0, K0, SMS)
    lm = launch_model(c, 4, 1, N0, K0, SMS, 54)
    assert (lm.blocks, lm.per_sm, lm.limit, lm.waves) == (768, 9, "registers", 1)
    assert abs(lm.fill - 768 / 132 / 6) < 1e-9 and abs(lm.warps_per_sm - 768 * 4 / 132) < 1e-9
    assert (lm.units_per_warp, lm.round_trips, lm.act_trips) == (4, 4, 4)
    assert abs(lm.inflight_kib - 2 * 768 * 4 / 132) < 1e-6  # one 2 KiB unit per warp
    assert lm.launches == 1 and "cluster of 4" in lm.tail
    # the same shape's prefetching candidate at 149 registers: 3 blocks per SM, two waves
    pf = DecodeConfig(4, 4, 1, 1, 1, 0, 0, 2, True, True)
    lm = launch_model(pf, 4, 1, N0, K0, SMS, 149)
    assert (lm.per_sm, lm.waves, lm.act_trips) == (3, 2, 0)
    # M=16 default (two row tiles per warp, split 2): 192 blocks, most SMs hold one, some two
    d16 = DecodeConfig.default(4, 16, N0, K0, SMS)
    lm = launch_model(d16, 4, 16, N0, K0, SMS, 134)
    assert lm.blocks == 192 and abs(lm.fill - 192 / 132 / 2) < 1e-9 and lm.units_per_warp == 16
    assert lm.bound in ("chain", "stream", "mma", "issue") and lm.line().startswith("grid 192")


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("m", [1, 16])
def test_streaming_config_is_one_even_wave(bits, m):
    c = DecodeConfig.streaming(bits, m, N0, K0, SMS)
    assert not c.problems() and c.x_units == -(-16 // c.split) and c.span == 2 and c.fold and c.min_blocks
    blocks = -(-N0 // (16 * c.warps * c.rows)) * c.split
    assert -(-blocks // SMS) <= c.min_blocks and blocks / SMS / -(-blocks // SMS) >= 0.9
    assert c.min_blocks * (c.smem_bytes(bits) + 1024) <= 228 * 1024
    # if ptxas keeps to the bound, the model sees every block resident from the start
    lm = launch_model(c, bits, m, N0, K0, SMS, 65536 // (c.min_blocks * 32 * c.warps) // 8 * 8)
    assert lm.waves == 1 and lm.act_trips == 0
    cands = DecodeConfig.candidates(bits, m, N0, K0, SMS)
    assert cands["xa"] == c and cands["xa_b0"].min_blocks == 0
    # one wave by the register bound: a candidate at M <= 8, the default itself beyond (then no reg_b)
    assert (cands["reg_b"] if m <= 8 else cands["reg"]).min_blocks > 0 and ("reg_b" in cands) == (m <= 8)
    assert ("xa8" in cands) == ("xa_il" in cands) == (m <= 8)
    if m <= 8:
        il = cands["xa_il"]
        assert il.interleave and il.split == c.split // 2 and il.staged_units == il.x_units == 16 // il.split


def test_min_blocks_and_interleave_are_checked():
    with pytest.raises(UnsupportedError, match="min_blocks"):
        make_decode(ts.int4, 128, False, DecodeConfig(8, 1, 1, 1, 1, 0, 0, 16, False, False, 9))
    for bad in (DecodeConfig(4, 2, 2, 1, 1, 0, 0, 2, True, False, 0, True), DecodeConfig(4, 2, 1, 1, 1, 4, 0, 2,
                interleave=True), DecodeConfig(4, 2, 2, 1, 1, 4, 2, 2, interleave=True)):  # fmt: skip
        with pytest.raises(UnsupportedError, match="interleave is for the register path"):
            make_decode(ts.int4, 128, False, bad)
    # interleaved batches stage whole batches of activations (zeros past the block's units)
    assert DecodeConfig(4, 2, 4, 1, 1, 3, 0, 2, interleave=True).staged_units == 4
    assert str(DecodeConfig(4, 4, 2, 1, 1, 4, 0, 2, True, False, 6)) == "w4_s4_u2_m1_r1_x4_k2_f_b6"


@needs_nvcc
@pytest.mark.toolchain
@pytest.mark.parametrize("t, m, name", [("int4", 1, "xa"), ("int2", 16, "xa"), ("e4m3", 1, "xa"), ("int3", 1, "xa_il")])
@pytest.mark.slow
def test_streaming_kernel_builds_within_its_register_bound(t, m, name, tmp_path):
    """The cubin's register count (read from its ELF) is what ptxas reports, and within the
    bound that min_blocks sets; the staged activations are cp.async copies awaited once."""
    t = ts.dtype(t)
    c = DecodeConfig.candidates(t.nbits, m, N0, K0, SMS)[name]
    kernel = make_decode(t, 128, False, c, True, True)
    src = kernel.source_full
    assert f"__launch_bounds__({32 * c.warps}, {c.min_blocks})" in src and "ts_copy_async<16>" in src
    assert src.count("__syncthreads();") == 1
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    from tessera.backend.build import CUDA_FLAGS, arch_flags

    # kernel.build()'s compile (its flags), once, with ptxas's report (-v changes no code)
    out = subprocess.run(["nvcc", "-cubin", *CUDA_FLAGS, *arch_flags(kernel.arch), "-Xptxas=-v", str(cu), "-o",
                          str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True)  # fmt: skip
    regs = cubin_registers(tmp_path / "k.cubin")
    assert 16 <= regs <= 65536 // (c.min_blocks * 32 * c.warps)
    assert int(re.search(r"Used (\d+) registers", out.stderr)[1]) == regs


def test_cubin_registers_refuses_other_files(tmp_path):
    f = tmp_path / "x.cubin"
    f.write_bytes(b"not an elf")
    with pytest.raises(ValueError, match="not a 64-bit ELF"):
        cubin_registers(f)


# streaming configs and their variants at odd sizes: split 4, 2 and 1, staged units 4 (>= a block's
# units at K = 1000 or 520), batches of 1, 2 and 4, one and two token tiles, fold on and off, span 16;
# interleaved batches (the last four), whose units past the block's end run on zero activations
STREAMING = (DecodeConfig(4, 4, 2, 1, 1, 4, 0, 2, True, False, 6), DecodeConfig(4, 4, 1, 2, 2, 4, 0, 2, True, False, 3),
             DecodeConfig(8, 2, 4, 1, 1, 4, 0, 2, True, False, 3), DecodeConfig(4, 4, 2, 2, 2, 4, 0, 2, False, False, 3),
             DecodeConfig(4, 2, 1, 1, 1, 4, 0, 16), DecodeConfig(4, 2, 2, 1, 1, 4, 0, 2, True, False, 3, True),
             DecodeConfig(4, 1, 4, 1, 1, 4, 0, 16, False, False, 0, True),
             DecodeConfig(4, 2, 2, 2, 2, 3, 0, 2, True, False, 0, True),
             DecodeConfig(8, 1, 4, 1, 1, 4, 0, 2, False, False, 0, True))  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=[t.name for t in WEIGHT_TYPES])
def test_cuda_decode_streaming_variants(rng, t):
    """Odd sizes (N % 16, K % 256 != 0), every group size, with and without zero points, M from
    1 past 16 (grid.y), two calls with fresh activations; and the bench's candidates. Each config
    meets two of the (group, zero point) weights, rotated over the types (tests/lowbit_cases.py)."""
    torch = pytest.importorskip("torch")
    from tessera.eager.lowbit import cuda_matmul, prepare

    cands = [c for m in (1, 16) for name, c in DecodeConfig.candidates(t.nbits, m, N0, K0, SMS).items()
             if name.startswith("xa") or name == "reg_b"]  # fmt: skip
    assert any(c.interleave for c in cands)
    weights = []
    for i, group in enumerate((128, 32, 64, None, 8)):
        for zp in ((None, True) if t.is_integer else (None,)):
            n, k = (40, 520) if i % 2 else (100, 1000)
            q = quantize_weight(rng.normal(size=(n, k)) * 0.05, t, group, zp)
            weights.append((group, zp, k, prepare(q), torch.from_numpy(q.dequantize()).cuda().double()))
    for j, config, (group, zp, k, p, w) in rotated(weights, (*STREAMING, *cands), t):
        for m in ((1, 16, 5, 40, 9)[j % 5], 13 if config.m_tiles == 2 else 3):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            ref = x.double() @ w.T
            err = float((cuda_matmul(x, p, config).double() - ref).norm() / ref.norm())
            assert err < 2e-3, (t, group, zp, m, config)


@needs_nvcc
@pytest.mark.parametrize("t, group, bias, config", [
    ("int1", 128, False, STREAMING[0]), *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("uint3", 32, True, STREAMING[1]), ("e2m1", 64, False, STREAMING[2]), ("int4", 128, True, STREAMING[3]),
        ("int8", 8, True, STREAMING[4]), ("int4", 64, True, STREAMING[5]), ("e4m3", 16, False, STREAMING[6]))),
    ("int5", 1024, True, STREAMING[7]), ("e5m2", 128, False, STREAMING[8]),
    pytest.param("uint2", 8, True, STREAMING[5], marks=pytest.mark.slow)])  # fmt: skip  (three in the fast tier)
def test_streaming_variants_build_with_nvcc(t, group, bias, config):
    """Interleaved kernels step the batch's units together: each step's mmas are spelled out
    once per unit and step (a C loop over the units that nvcc unrolls), with no per-unit branch."""
    kernel = make_decode(ts.dtype(t), group, bias, config, False, config.span == 2 and group % 32 == 0)
    src = kernel.source_full
    assert src.count("ts_copy_async_wait<0>();") == 2 and kernel.build()
    if config.interleave:
        assert "u_end_ - 1)" in src and "if ((ub_ + uu" not in src
