"""Tensor-core GEMM and the instructions under it: nvcc compile checks and IR/front-end rules in
the CPU tier; results against torch on the GPU."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import tessera as ts
from tessera import f16, f32
from tessera.errors import KernelSyntaxError, UnsupportedError
from tessera.ir.fragments import LDMATRIX_X4, LDMATRIX_X4_NK, MMA_M16N8K16_A, MMA_M16N8K16_B, MMA_M16N8K16_C
from tessera.templates.gemm.mma import GemmConfig, make_gemm, make_split_k_reduce
from tessera.templates.gemm.space import schedule_space

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")

CONFIGS = [
    GemmConfig(128, 128, 32, 64, 64, 4),
    GemmConfig(64, 128, 64, 32, 64, 3),
    GemmConfig(16, 64, 64, 16, 16, 4, split_k=3),
    GemmConfig(128, 256, 32, 64, 64, 3),
]


# ---- fragments and swizzles (pure Python) -------------------------------------------------
@pytest.mark.parametrize("lane", range(32))
def test_fragment_mappings_follow_the_ptx_layouts(lane):
    g, t = lane // 4, lane % 4
    assert MMA_M16N8K16_C.on(lane) == [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]
    assert MMA_M16N8K16_A.on(lane) == [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1),
                                       (g, 2 * t + 8), (g, 2 * t + 9), (g + 8, 2 * t + 8), (g + 8, 2 * t + 9)]  # fmt: skip
    assert MMA_M16N8K16_B.on(lane) == [(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]
    assert LDMATRIX_X4.on(lane) == [(lane % 16, lane // 16)]
    assert LDMATRIX_X4_NK.on(lane) == [((lane // 16) * 8 + lane % 8, (lane // 8) % 2)]


@pytest.mark.parametrize("cols", [16, 32, 64, 128, 256])
def test_gemm_swizzles_are_permutations_and_spread_ldmatrix_rows(cols):
    from tessera.templates.gemm.mma import _swizzle_for

    sw = _swizzle_for(cols)
    size = 64 * cols
    assert sorted(sw.apply(i) for i in range(size)) == list(range(size))
    for i in range(0, size, 8):  # 16-byte groups move together
        assert [sw.apply(i + e) for e in range(8)] == [sw.apply(i) + e for e in range(8)]
    for r0 in range(0, 64, 8):  # 8 rows at one column: 8 distinct 16-byte bank groups
        for c in range(0, cols, 8):
            groups = {(sw.apply((r0 + r) * cols + c) * 2 // 16) % 8 for r in range(8)}
            assert len(groups) == 8


def test_swizzle_rejects_overlapping_bit_ranges():
    with pytest.raises(TypeError, match="shift >= bits"):
        ts.Swizzle(3, 3, 2)


# ---- configuration space --------------------------------------------------------------------
def test_config_problems_name_the_reason():
    assert GemmConfig(128, 128, 32, 64, 64, 4).problems() == []
    assert any("multiples of 16" in p for p in GemmConfig(128, 128, 32, 24, 64, 4).problems())
    assert any("shared memory" in p for p in GemmConfig(256, 256, 64, 64, 64, 5).problems())
    with pytest.raises(UnsupportedError, match="GEMM config"):
        make_gemm(f16, GemmConfig(128, 128, 32, 24, 64, 4))
    with pytest.raises(UnsupportedError, match="float16 or bfloat16"):
        make_gemm(f32, CONFIGS[0])


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 14336, 4096), (4096, 4096, 4096), (37, 33, 41)])
def test_schedule_space_is_small_valid_and_fits_the_shape(m, n, k):
    space = schedule_space(m, n, k)
    assert 0 < len(space) <= 400
    assert all(not c.problems() for c in space)
    assert len({str(c) for c in space}) == len(space)
    if m <= 16:
        assert all(c.block_m == 16 for c in space)


# ---- front end rules -------------------------------------------------------------------------
def test_instructions_are_checked_at_the_users_line():
    with pytest.raises(KernelSyntaxError, match="only available in CUDA kernels"):

        @ts.kernel
        def k1(a: f16[64]):
            s = ts.register_tensor(f16, [8])
            ts.copy_async(s[0], a[0], 16, True)

    with pytest.raises(KernelSyntaxError, match="global memory into shared memory"):

        @ts.kernel(target="cuda")
        def k2(a: f16[64]):
            s = ts.register_tensor(f16, [8])
            ts.copy_async(s[0], a[0], 16, True)

    with pytest.raises(KernelSyntaxError, match="accumulates in float32"):

        @ts.kernel(target="cuda")
        def k3(a: f16[64]):
            x = ts.register_tensor(f16, [8])
            c = ts.register_tensor(f16, [4])
            ts.mma(c[0], x[0], x[0])

    with pytest.raises(KernelSyntaxError, match="tensor elements"):

        @ts.kernel(target="cuda")
        def k4(a: f16[64]):
            s = ts.shared_tensor(f16, [64])
            ts.copy_vector(s[0], 3, 16)

    with pytest.raises(KernelSyntaxError, match="swizzle"):

        @ts.kernel(target="cuda")
        def k5(a: f16[64]):
            s = ts.register_tensor(f16, [64], swizzle=ts.Swizzle(3, 3, 3))
            s[0] = a[0]


def test_copy_vector_runs_on_the_cpu(rng):
    @ts.kernel
    def copy_rows(x: f32["R", 8], y: f32["R", 8]):
        for r in ts.parallel(R):
            tmp = ts.register_tensor(f32, [8])
            ts.copy_vector(tmp[0], x[r, 0], 16)
            ts.copy_vector(tmp[4], x[r, 4], 16)
            for j in range(8):
                tmp[j] = tmp[j] * 2.0
            ts.copy_vector(y[r, 0], tmp[0], 16)
            ts.copy_vector(y[r, 4], tmp[4], 16)

    x = rng.standard_normal((5, 8)).astype(np.float32)
    y = np.zeros_like(x)
    copy_rows(x, y)
    np.testing.assert_array_equal(y, 2 * x)


def test_large_shared_tensors_move_to_a_dynamic_pool():
    cfg = GemmConfig(128, 256, 32, 64, 64, 4)  # 96 KiB of shared tiles
    k = make_gemm(f16, cfg)
    assert k.lowered.launch.shared_pool >= cfg.smem_bytes()
    assert "extern __shared__" in k.source
    small = make_gemm(f16, GemmConfig(64, 64, 32, 32, 32, 2))
    assert small.lowered.launch.shared_pool == 0 and "__shared__ __align__(1024) half" in small.source


@needs_nvcc
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", [ts.f16, ts.bf16])
@pytest.mark.slow
def test_gemm_cuda_compiles(layout, dtype):
    for cfg in CONFIGS[:3]:
        make_gemm(dtype, cfg, layout).build()
    make_gemm(dtype, CONFIGS[1], layout, vector=False).build()
    make_split_k_reduce(dtype, 3).build()


# ---- GPU ------------------------------------------------------------------------------------
def _torch():
    return pytest.importorskip("torch")


def _check(out, a, b, layout, dtype_name):
    torch = _torch()
    bb = b if layout == "kn" else b.transpose(-1, -2)
    ref = torch.matmul(a.double(), bb.double())
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < (3e-3 if dtype_name == "float16" else 1.2e-2), err


@pytest.mark.cuda
def test_one_mma_tile_matches_numpy():
    """ldmatrix + mma on one 16x16x16 tile: checks the fragment layouts on hardware."""
    torch = _torch()

    @ts.kernel(target="cuda")
    def tile(A: f16[16, 16], B: f16[16, 8], C: f32[16, 8]):
        ts.attrs.grid = 1
        ts.attrs.block = 32
        lane = ts.thread_idx.x
        As = ts.shared_tensor(f16, [16, 16])
        Bt = ts.shared_tensor(f16, [16, 16])  # B padded to 16 columns for one ldmatrix.x4.trans
        for i in range(lane, 256, 32):
            As[i // 16, i % 16] = A[i // 16, i % 16]
            Bt[i // 16, i % 16] = ts.select(i % 16 < 8, B[i // 16, ts.min_(i % 16, 7)], 0.0)
        ts.syncthreads()
        af = ts.register_tensor(f16, [8])
        bf = ts.register_tensor(f16, [8])
        acc = ts.register_tensor(f32, [4])
        for e in range(4):
            acc[e] = 0.0
        for r, c in ts.fragments.LDMATRIX_X4.on(lane):
            ts.ldmatrix(af[0], As[r, c * 8])
            ts.ldmatrix(bf[0], Bt[r, c * 8], trans=True)
        ts.mma(acc[0], af[0], bf[0])
        for e, (r, c) in enumerate(ts.fragments.MMA_M16N8K16_C.on(lane)):
            C[r, c] = acc[e]

    a = torch.randn(16, 16, device="cuda", dtype=torch.float16)
    b = torch.randn(16, 8, device="cuda", dtype=torch.float16)
    c = torch.full((16, 8), float("nan"), device="cuda")
    tile(a, b, c)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(1, 72, 64), (17, 136, 264), (130, 264, 520), (256, 512, 4104)])
def test_gemm_matches_torch(layout, dtype_name, m, n, k):
    torch = _torch()
    from tessera.eager.matmul import matmul

    dt = getattr(torch, dtype_name)
    a = torch.randn(m, k, device="cuda", dtype=dt)
    b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=dt)
    for cfg in CONFIGS:
        _check(matmul(a, b, b_layout=layout, config=cfg), a, b, layout, dtype_name)


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", [(5, 33, 37), (70, 9, 130), (33, 100, 7)])
def test_gemm_unaligned_shapes_use_the_scalar_path(m, n, k):
    torch = _torch()
    from tessera.eager.matmul import matmul

    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    for layout in ("kn", "nk"):
        b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=torch.float16)
        for cfg in CONFIGS[1:3]:
            _check(matmul(a, b, b_layout=layout, config=cfg), a, b, layout, "float16")


@pytest.mark.cuda
def test_batched_gemm_and_tuned_choice():
    torch = _torch()
    from tessera.eager.matmul import choose_config, matmul

    a = torch.randn(3, 40, 96, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3, 96, 56, device="cuda", dtype=torch.bfloat16)
    _check(matmul(a, b, config=CONFIGS[2]), a, b, "kn", "bfloat16")
    a2 = torch.randn(64, 128, device="cuda", dtype=torch.float16)
    b2 = torch.randn(128, 64, device="cuda", dtype=torch.float16)
    cfg = choose_config(a2, b2)
    # choose_config searches the TMA candidates too (Hopper); the winner is one of them all.
    assert cfg in schedule_space(64, 64, 128, tma=True)
    assert choose_config(a2, b2) == cfg  # cached
    _check(matmul(a2, b2), a2, b2, "kn", "float16")


@pytest.mark.cuda
def test_gemm_rejects_bad_operands():
    torch = _torch()
    from tessera.eager.matmul import matmul
    from tessera.errors import ArgumentError

    a = torch.randn(8, 16, device="cuda", dtype=torch.float16)
    with pytest.raises(ArgumentError, match="do not match"):
        matmul(a, torch.randn(8, 16, device="cuda", dtype=torch.float16))
    with pytest.raises(UnsupportedError, match="float16 or bfloat16"):
        matmul(a.float(), torch.randn(16, 8, device="cuda"))
    with pytest.raises(ArgumentError, match="CUDA device"):
        matmul(a.cpu(), torch.randn(16, 8, dtype=torch.float16))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(1, 72, 64), (130, 264, 520), (256, 512, 4104)])
def test_wgmma_gemm_matches_torch(dtype_name, m, n, k):
    torch = _torch()
    from tessera.eager.matmul import matmul
    from tessera.templates.gemm.wgmma import WgmmaConfig

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs an SM90 GPU")
    dt = getattr(torch, dtype_name)
    a = torch.randn(m, k, device="cuda", dtype=dt)
    b = torch.randn(n, k, device="cuda", dtype=dt)
    for cfg in (WgmmaConfig(128, 256, 4), WgmmaConfig(64, 128, 3, split_k=3), WgmmaConfig(128, 64, 5)):
        _check(matmul(a, b, b_layout="nk", config=cfg), a, b, "nk", dtype_name)


@needs_nvcc
@pytest.mark.slow
def test_wgmma_gemm_cuda_compiles():
    from tessera.templates.gemm.wgmma import WgmmaConfig, make_gemm_wgmma

    k = make_gemm_wgmma(ts.f16, WgmmaConfig(128, 128, 4, split_k=2))
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16" in k.source
    k.build()
    make_gemm_wgmma(ts.bf16, WgmmaConfig(64, 64, 3)).build()


@pytest.mark.cuda
def test_launch_plans_follow_the_arguments():
    """Cached launch plans are keyed by shapes/strides/dtypes: new shapes re-plan, bad ones still fail."""
    torch = _torch()
    from tessera.errors import ArgumentError
    from tessera.templates.gemm.config import make_kernel

    k = make_kernel(ts.f16, CONFIGS[1], "kn", True)
    for m, n in ((20, 64), (70, 136), (20, 64)):
        a = torch.randn(1, m, 64, device="cuda", dtype=torch.float16)
        b = torch.randn(1, 64, n, device="cuda", dtype=torch.float16)
        c = torch.full((1, m, n), float("nan"), device="cuda", dtype=torch.float16)
        k(a, b, c, 1)
        _check(c[0], a[0], b[0], "kn", "float16")
    with pytest.raises(ArgumentError, match="dtype"):
        k(a.float(), b, c, 1)
    with pytest.raises(ArgumentError, match="contiguous"):
        k(a.transpose(1, 2), b, c, 1)


# ---- warp-specialised TMA GEMM ---------------------------------------------------------------
def _tma_configs():
    from tessera.templates.gemm.tma import TmaConfig

    return [
        TmaConfig(128, 256, 3, epilogue="staged"),
        TmaConfig(256, 128, 3),
        TmaConfig(128, 128, 4, split_k=3, epilogue="pair"),
        TmaConfig(64, 128, 6, 1, split_k=2, persistent=False),
        TmaConfig(64, 128, 6, 1, split_k=4, persistent=False, split_reduce="cluster", epilogue="staged"),
        TmaConfig(128, 64, 6, persistent=False, epilogue="staged"),
    ]


def test_tma_config_problems_and_space():
    from tessera.templates.gemm.tma import TmaConfig

    assert all(not c.problems() for c in _tma_configs())
    assert any("shared memory" in p for p in TmaConfig(128, 256, 5).problems())
    assert any("128 accumulator" in p for p in TmaConfig(256, 256, 2).problems())
    assert any("cluster" in p for p in TmaConfig(128, 128, 4, split_k=2, split_reduce="cluster").problems())
    assert any("epilogue" in p for p in TmaConfig(128, 128, 4, epilogue="fast").problems())
    cfg = TmaConfig(128, 256, 3)
    assert cfg.tiles(4096, 4096) == 512 and cfg.grid(4096, 4096, 1, sms=132) == 132 and cfg.grid(4096, 4096, 1, sms=78) == 78
    assert TmaConfig(64, 64, 4, 1, persistent=False).grid(100, 100, 1, 132) == 4
    for m, n, k in ((1, 4096, 4096), (16, 6144, 4096), (128, 28672, 4096), (4096, 4096, 14336), (37, 33, 40)):
        for layout in ("nk", "kn"):
            space = schedule_space(m, n, k, 1, layout, tma=True)
            assert space and all(not c.problems() for c in space)
            assert len({str(c) for c in space}) == len(space)
            if layout == "kn":
                assert all(c.block_n % 64 == 0 for c in space)


def test_tma_gemm_kernels_keep_the_element_store_form():
    """epilogue="scalar" (the default) writes C element by element: the store epilogue fusion rewrites."""
    from tessera.ir.functor import IRVisitor
    from tessera.templates.gemm.tma import TmaConfig, make_gemm_tma

    class Stores(IRVisitor):
        def __init__(self):
            self.names = []

        def visit_Store(self, s):
            self.names.append(s.buffer.name)

    for cfg in (TmaConfig(128, 256, 3), TmaConfig(64, 64, 6, 1, split_k=2, persistent=False, split_reduce="cluster")):
        found = Stores()
        found.visit(make_gemm_tma(f16, cfg, "nk").ir.body)
        assert "C" in found.names
    with pytest.raises(UnsupportedError, match="multiple of 64"):
        make_gemm_tma(f16, TmaConfig(64, 48, 4, 1), "kn")


@needs_nvcc
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.slow
def test_tma_gemm_cuda_compiles(layout):
    from tessera.templates.gemm.tma import make_gemm_tma

    for cfg in _tma_configs()[:5]:
        k = make_gemm_tma(ts.bf16 if cfg.consumers == 1 else f16, cfg, layout)
        assert "cp.async.bulk.tensor.3d" in k.source and "setmaxnreg" in k.source or cfg.consumers == 1
        k.build()


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_tma_gemm_matches_torch(layout, dtype_name):
    """Every configuration kind (tiles, split-k launch/cluster, epilogues) at odd shapes: edge
    tiles, K tails (TMA zero fill), one row, a split whose last part is short."""
    torch = _torch()
    from tessera.eager.matmul import matmul

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA/wgmma need an SM90 GPU")
    dt = getattr(torch, dtype_name)
    for m, n, k in [(1, 72, 64), (17, 136, 264), (130, 264, 520), (256, 512, 4104), (300, 1000, 2000)]:
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=dt)
        for cfg in _tma_configs():
            _check(matmul(a, b, b_layout=layout, config=cfg), a, b, layout, dtype_name)


def test_wave_fitting_tiles_join_the_space_where_they_fill_the_waves():
    from tessera.target import SM90, Target
    from tessera.templates.gemm.space import tma_space, wave_efficiency, wave_fitting_tiles

    h200 = Target.of(SM90, "H200", sms=132, l2_bytes=60 << 20)
    assert wave_efficiency(88, 132) == pytest.approx(88 / 132) and wave_efficiency(133, 132) == pytest.approx(133 / 264)
    # llama's gate/up projection at M=512: 128x256 makes 88 tiles, 128x192 makes 120
    assert (128, 192, 2) in wave_fitting_tiles(512, 5632, 1, "nk", h200)
    assert any(c.block_n == 192 for c in tma_space(512, 5632, 2048, dev=h200))
    assert (64, 160, 1) in wave_fitting_tiles(512, 2560, 1, "nk", h200)  # Q, K, V at once: 128 tiles
    assert all(bn % 64 == 0 for _, bn, _ in wave_fitting_tiles(512, 2560, 1, "kn", h200))
    assert wave_fitting_tiles(4096, 4096, 1, "nk", h200) == []  # 256-wide tiles already fill 4 waves
    assert wave_fitting_tiles(512, 2048, 1, "nk", h200) == []  # 64x128: 128 of 132 SMs


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_tma_gemm_wave_fitting_tiles_match_torch(layout):
    """Tiles of 160, 192 and 224 columns (not powers of two) at odd shapes: edge tiles in N."""
    torch = _torch()
    from tessera.eager.matmul import matmul
    from tessera.templates.gemm.tma import TmaConfig

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA/wgmma need an SM90 GPU")
    configs = [TmaConfig(128, 192, 4, epilogue="staged"), TmaConfig(128, 192, 3, split_k=2)]
    if layout == "nk":
        configs += [TmaConfig(64, 160, 6, 1, epilogue="staged"), TmaConfig(128, 224, 3, persistent=False)]
    for m, n, k in [(1, 200, 64), (130, 584, 520), (512, 5632 // 4, 2048), (300, 1000, 2000)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=torch.float16)
        for cfg in configs:
            assert not cfg.problems(), cfg
            _check(matmul(a, b, b_layout=layout, config=cfg), a, b, layout, "float16")


@pytest.mark.cuda
def test_tma_gemm_batched_repeated_and_tuned():
    """Batched operands; repeated planned calls on fresh data (tensor-map cache); the tuned default."""
    torch = _torch()
    from tessera.eager.matmul import choose_config, matmul
    from tessera.templates.gemm.tma import TmaConfig

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA/wgmma need an SM90 GPU")
    for layout in ("nk", "kn"):
        for cfg in (TmaConfig(128, 128, 4), TmaConfig(64, 64, 6, 1, split_k=2, persistent=False, split_reduce="cluster")):
            for _ in range(3):
                a = torch.randn(3, 40, 96, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(*((3, 96, 72) if layout == "kn" else (3, 72, 96)), device="cuda", dtype=torch.bfloat16)
                _check(matmul(a, b, b_layout=layout, config=cfg), a, b, layout, "bfloat16")
    a = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(256, 128, device="cuda", dtype=torch.float16)
    cfg = choose_config(a, b)
    assert isinstance(cfg, TmaConfig)
    _check(matmul(a, b), a, b, "kn", "float16")
    with pytest.raises(UnsupportedError, match="16-byte aligned"):  # K % 8 != 0: TMA cannot read it
        matmul(a[:, :250], b[:250], config=cfg)
    _check(matmul(a[:, :250], b[:250], config=CONFIGS[1]), a[:, :250], b[:250], "kn", "float16")


def _tile_loops(body):
    """The kernel's top-level scalar declarations and its two `for t in ...` tile loops."""
    from tessera.ir import stmt as S
    from tessera.ir.functor import IRVisitor

    top = [s for s in body.stmts if isinstance(s, S.DeclareVar)]

    class Loops(IRVisitor):
        def __init__(self):
            self.found = []

        def visit_For(self, s):
            if s.var.name == "t":
                self.found.append(s)
            self.visit(s.body)

    loops = Loops()
    loops.visit(body)
    return top, loops.found


@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("m,n,k,batch", [(300, 1000, 2000, 1), (40, 72, 96, 3), (2048, 4096, 4104, 1)])
def test_tma_gemm_producer_and_consumers_walk_the_same_tiles(m, n, k, batch, split):
    """Evaluate the kernel's own tile arithmetic (its IR) for every work item: the producer and
    the consumers agree on the tile, every (batch, tile, split part) is visited once, the K
    ranges of a tile's parts tile K, and the consumers' output slab is batch * split + part."""
    from tessera.ir import stmt as S
    from tessera.ir.evaluate import EvaluationError, evaluate
    from tessera.templates.gemm.tma import TmaConfig, make_gemm_tma

    cfg = TmaConfig(128, 128, 4, split_k=split, group_m=4)
    body = make_gemm_tma(f16, cfg, "nk").ir.body
    top, (producer, consumer) = _tile_loops(body)
    env = {"M": m, "N": n, "K": k, "batch": batch, "split": split}
    for s in top:
        try:
            env[s.var.name] = evaluate(s.init, env)
        except EvaluationError:  # thread indices: not part of the tile arithmetic
            pass
    seen, ranges = set(), {}
    for t in range(env["total"]):
        views = []
        for loop in (producer, consumer):
            local = dict(env, t=t)
            for s in loop.body.stmts:
                if isinstance(s, S.DeclareVar) and s.init is not None:
                    local[s.var.name] = evaluate(s.init, local)
            views.append(local)
        p, c = views
        assert (p["m0"], p["n0"], p["kt0"], p["num_k"]) == (c["m0"], c["n0"], c["kt0"], c["num_k"])
        part = t % split
        assert c["z"] == p["bi"] * split + part
        key = (p["bi"], p["m0"], p["n0"])
        assert (key, part) not in seen
        seen.add((key, part))
        ranges.setdefault(key, []).append((p["kt0"], p["kt0"] + p["num_k"]))
    assert len(ranges) == batch * -(-m // 128) * -(-n // 128)
    for parts in ranges.values():
        covered = sorted(r for r in parts if r[1] > r[0])
        assert covered[0][0] == 0 and covered[-1][1] == -(-k // 64)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
