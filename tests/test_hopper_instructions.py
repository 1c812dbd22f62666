"""Hopper instructions: mbarriers, TMA tensor maps and loads, setmaxnreg, syncwarp, thread-block
clusters (cluster_sync, load_cluster) and wgmma with an MN-major B.  Front-end rules and
generated CUDA in the CPU tier (nvcc builds where nvcc is installed); results on the GPU."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

import tessera as ts
from tessera import f16, f32, u32, u64
from tessera.errors import ArgumentError, KernelSyntaxError
from tessera.ir.types import TensorMapType, tensor_map
from tessera.runtime.tensor_map import MAP_BYTES, TensorMap, TensorMapSlot, check_tensor_map

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
SW = ts.Swizzle(3, 3, 3)


def make_tma_copy():
    """Each block loads its 64 x 64 box `rounds` times through one mbarrier, then copies it out."""

    @ts.kernel(target="cuda")
    def tma_copy(X: f16["R", "C"], Y: f16["R", "C"], tx: ts.tensor_map(f16, (64, 64)), rounds: ts.int32):
        ts.attrs.grid = (ts.ceil_div(C, 64), ts.ceil_div(R, 64))
        ts.attrs.block = 128
        tile = ts.shared_tensor(f16, [64, 64], swizzle=SW)
        bar = ts.shared_tensor(u64, [1])
        tid = ts.thread_idx.x
        if tid == 0:
            ts.mbarrier_init(bar[0], 1)
            ts.fence_mbarrier_init()
        ts.syncthreads()
        for k in range(rounds):
            if tid == 0:
                ts.mbarrier_arrive_expect_tx(bar[0], 64 * 64 * 2)
                ts.tma_load(tile[0, 0], tx, bar[0], ts.block_idx.y * 64, ts.block_idx.x * 64)
            ts.mbarrier_wait(bar[0], k % 2)
            ts.syncthreads()
        for i in range(tid, 64 * 64, 128):
            r = ts.block_idx.y * 64 + i // 64
            c = ts.block_idx.x * 64 + i % 64
            if r < R and c < C:
                Y[r, c] = tile[i // 64, i % 64]

    return tma_copy


def make_tma_store_rows():
    """Each block writes 2 X into its 64 x 64 box of Y in two 32-row halves, both through one
    swizzled shared tile: the second half waits for the first store to have read it."""

    @ts.kernel(target="cuda")
    def tma_store_rows(X: f16["R", "C"], Y: f16["R", "C"], ty: ts.tensor_map(f16, (32, 64))):
        ts.attrs.grid = (ts.ceil_div(C, 64), ts.ceil_div(R, 64))
        ts.attrs.block = 128
        tile = ts.shared_tensor(f16, [32, 64], swizzle=SW)
        tid = ts.thread_idx.x
        for half in range(2):
            if tid == 0:
                ts.tma_store_wait(0)  # the previous half's store has read the tile
            ts.syncthreads()
            for i in range(tid, 32 * 64, 128):
                r = ts.block_idx.y * 64 + 32 * half + i // 64
                c = ts.block_idx.x * 64 + i % 64
                if r < R and c < C:
                    tile[i // 64, i % 64] = X[r, c] * 2.0
            ts.fence_proxy_async()
            ts.syncthreads()
            if tid == 0:
                ts.tma_store(ty, tile[0, 0], ts.block_idx.y * 64 + 32 * half, ts.block_idx.x * 64)
        if tid == 0:
            ts.tma_store_wait(0)  # the shared tile outlives the store's read of it

    return tma_store_rows


def make_cluster_exchange():
    """Blocks of a 4-block cluster publish their index in shared memory; each reads its
    neighbour's through distributed shared memory."""

    @ts.kernel(target="cuda")
    def exchange(Y: f32["G", 4]):
        ts.attrs.grid = G
        ts.attrs.block = 32
        ts.attrs.cluster = (4, 1, 1)
        mine = ts.shared_tensor(f32, [4])
        got = ts.register_tensor(f32, [4])
        b = ts.block_idx.x
        if ts.thread_idx.x < 4:
            mine[ts.thread_idx.x] = ts.cast(b * 10 + ts.thread_idx.x, f32)
        ts.cluster_sync()
        if ts.thread_idx.x == 0:
            ts.load_cluster(got[0], mine[0], (b + 1) % 4, 16)
            for e in range(4):
                Y[b, e] = got[e]
        ts.cluster_sync()

    return exchange


def make_multicast_rows():
    """Clusters of 2 blocks share a 16 x 64 tile of X: block r loads rows [8r, 8r + 8) once and
    multicasts them into both blocks' shared memory (each barrier expects the whole tile); then
    each block tells its peer through a remote mbarrier arrival that it is done reading, waits for
    the peer's, and writes what it holds to Y[block]."""

    @ts.kernel(target="cuda")
    def multicast_rows(X: f16["R", 64], Y: f16["B", 16, 64], tx: ts.tensor_map(f16, (8, 64), swizzle=0)):
        ts.attrs.grid = B
        ts.attrs.block = 64
        ts.attrs.cluster = (2, 1, 1)
        tile = ts.shared_tensor(f16, [16, 64])
        bars = ts.shared_tensor(u64, [2])  # 0: the tile landed; 1: the peer is done with its tile
        tid = ts.thread_idx.x
        b = ts.block_idx.x
        rank = b % 2
        if tid == 0:
            ts.mbarrier_init(bars[0], 1)
            ts.mbarrier_init(bars[1], 1)
            ts.fence_mbarrier_init()
        ts.cluster_sync()  # the peer's barriers exist before anything lands there
        if tid == 0:
            ts.mbarrier_arrive_expect_tx(bars[0], 16 * 64 * 2)
            ts.tma_load_multicast(tile[8 * rank, 0], tx, bars[0], 3, (b // 2) * 16 + 8 * rank, 0)
        ts.mbarrier_wait(bars[0], 0)
        for i in range(tid, 16 * 64, 64):
            Y[b, i // 64, i % 64] = tile[i // 64, i % 64]
        ts.syncthreads()
        if tid == 0:
            ts.mbarrier_arrive_cluster(bars[1], 1 - rank)
        ts.mbarrier_wait(bars[1], 0)
        ts.cluster_sync()

    return multicast_rows


def multicast_reference(x: np.ndarray, blocks: int) -> np.ndarray:
    return np.stack([x[(b // 2) * 16 : (b // 2) * 16 + 16] for b in range(blocks)])


# ---- front end -------------------------------------------------------------------------------
def test_tensor_map_annotations_are_validated():
    t = tensor_map(f16, (1, 128, 64))
    assert isinstance(t, TensorMapType) and t.rank == 3 and t.box_bytes == 128 * 64 * 2
    with pytest.raises(TypeError, match="swizzle span"):
        tensor_map(f16, (128, 128))  # 256 bytes per row > 128-byte swizzle
    with pytest.raises(TypeError, match="1 to 5 dimensions"):
        tensor_map(f16, (1, 512, 64))
    with pytest.raises(TypeError, match="multiple of 16 bytes"):
        tensor_map(f16, (64, 4), swizzle=0)
    with pytest.raises(KernelSyntaxError, match="CUDA kernels"):

        @ts.kernel
        def on_cpu(x: f16[8], tx: ts.tensor_map(f16, (64, 64))):
            x[0] = x[1]


def test_hopper_instructions_are_checked_at_the_users_line():
    with pytest.raises(KernelSyntaxError, match="mbarriers are uint64"):

        @ts.kernel(target="cuda")
        def k1(a: f16[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            bars = ts.shared_tensor(f32, [2])
            ts.mbarrier_init(bars[0], 1)

    with pytest.raises(KernelSyntaxError, match="takes 2 coordinates"):

        @ts.kernel(target="cuda")
        def k2(a: f16[64], tx: ts.tensor_map(f16, (64, 64))):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            s = ts.shared_tensor(f16, [64, 64])
            bar = ts.shared_tensor(u64, [1])
            ts.tma_load(s[0, 0], tx, bar[0], 0, 0, 0)

    with pytest.raises(KernelSyntaxError, match="describes float16"):

        @ts.kernel(target="cuda")
        def k3(a: f16[64], tx: ts.tensor_map(f16, (64, 64))):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            s = ts.shared_tensor(f32, [64, 64])
            bar = ts.shared_tensor(u64, [1])
            ts.tma_load(s[0, 0], tx, bar[0], 0, 0)

    with pytest.raises(KernelSyntaxError, match="register count"):

        @ts.kernel(target="cuda")
        def k4(a: f16[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 128
            ts.setmaxnreg(100, True)

    with pytest.raises(KernelSyntaxError, match="tensor-map parameter"):

        @ts.kernel(target="cuda")
        def k5(a: f16[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            s = ts.shared_tensor(f16, [64, 64])
            bar = ts.shared_tensor(u64, [1])
            ts.tma_load(s[0, 0], a, bar[0], 0, 0)

    with pytest.raises(KernelSyntaxError, match="another block's shared memory"):

        @ts.kernel(target="cuda")
        def k6(a: f32[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            r = ts.register_tensor(f32, [4])
            ts.load_cluster(r[0], a[0], 0, 16)

    with pytest.raises(KernelSyntaxError, match="attrs.cluster"):

        @ts.kernel(target="cuda")
        def k7(a: f32[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            ts.attrs.cluster = (0, 1)

    with pytest.raises(KernelSyntaxError, match="trans_b=True reads B"):

        @ts.kernel(target="cuda")
        def k8(a: f16[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 128
            As = ts.shared_tensor(f16, [64, 64], swizzle=SW)
            Bs = ts.shared_tensor(f16, [64, 64], swizzle=SW)
            acc = ts.register_tensor(f32, [32])
            ts.wgmma(acc[0], As[0, 0], Bs[0, 0], n=64, trans_b=True)


def test_generated_cuda_for_the_async_pipeline():
    src = make_tma_copy().source
    assert "const __grid_constant__ CUtensorMap tx_" in src
    # coordinates go innermost first: (column, row)
    assert "ts_tma_load_2d((&tile_[0]), &tx_, (&bar_[0]), ((int32_t)blockIdx.x) * 64, ((int32_t)blockIdx.y) * 64);" in src
    assert "mbarrier.try_wait.parity.shared::cta.b64" in src and "ts_mbarrier_arrive_expect_tx((&bar_[0]), 8192);" in src
    ex = make_cluster_exchange().source
    assert "__cluster_dims__(4, 1, 1)" in ex and "barrier.cluster.arrive.release" in ex and "mapa.shared::cluster" in ex


def test_wgmma_with_an_mn_major_b_sets_the_transpose_bit():
    @ts.kernel(target="cuda")
    def mn(a: f32[64]):
        ts.attrs.grid = 1
        ts.attrs.block = 128
        As = ts.shared_tensor(f16, [64, 64], swizzle=SW)
        Bs = ts.shared_tensor(f16, [2, 64, 64], swizzle=SW)  # B [k = 64, n = 128] as two 64-column chunks
        acc = ts.register_tensor(f32, [64])
        ts.wgmma(acc[0], As[0, 0], Bs[0, 16, 0], n=128, trans_b=True)

    src = mn.source
    assert "ts_wgmma_desc_mn(b, 8192u)" in src and "p, 1, 1, 0, 1;" in src


def test_wgmma_wait_fences_the_register_tensors_named_after_it():
    """wgmma_wait(0, acc[0]) waits, then fences acc whole (no read of it may move above the
    wait); only float32 / 32-bit integer register tensors can be fenced."""

    @ts.kernel(target="cuda")
    def fenced(a: f32[64]):
        ts.attrs.grid = 1
        ts.attrs.block = 128
        As = ts.shared_tensor(f16, [64, 64], swizzle=SW)
        acc = ts.register_tensor(f32, [2, 32])
        ts.wgmma(acc[0, 0], As[0, 0], As[0, 0], n=64)
        ts.wgmma_commit()
        ts.wgmma_wait(0, acc[1, 3])
        a[0] = acc[0, 0]

    src = fenced.source
    assert re.search(r"ts_wgmma_wait<0>\(\);\s*ts_fence_registers<64>\(acc_\);", src)
    with pytest.raises(KernelSyntaxError, match="wgmma_wait fences float32"):

        @ts.kernel(target="cuda")
        def shared(a: f32[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 128
            Cs = ts.shared_tensor(f32, [64])
            ts.wgmma_wait(0, Cs[0])


def test_tensor_map_arguments_are_checked():
    t = tensor_map(f16, (64, 64))
    raw = bytes(range(MAP_BYTES))
    tm = TensorMap(t, raw)
    assert check_tensor_map("k", "tx", t, tm) is tm
    with pytest.raises(ArgumentError, match="expects tensor_map"):
        check_tensor_map("k", "tx", tensor_map(f16, (32, 64)), tm)
    with pytest.raises(ArgumentError, match="must be a TensorMap"):
        check_tensor_map("k", "tx", t, raw)
    with pytest.raises(ArgumentError, match="128 bytes"):
        TensorMap(t, b"\0" * 64)
    slot = TensorMapSlot(raw)
    assert bytes(slot) == raw
    with pytest.raises(ArgumentError):
        TensorMap.from_pointer(0x1008, f16, (64, 64), (64, 64))  # not 16-byte aligned


@needs_nvcc
@pytest.mark.slow
def test_hopper_kernels_build_with_nvcc():
    make_tma_copy().build()
    make_cluster_exchange().build()
    make_tma_store_rows().build()  # ptxas takes the bulk store, its commit and its wait


def make_stmatrix(num: int, trans: bool):
    """One warp: lane l's register q holds the values 8l + 2q, 8l + 2q + 1; stmatrix.x{num}
    writes them into S [32, 8] (lane l addresses row l), which is copied out."""

    @ts.kernel(target="cuda", name=f"stmatrix_x{num}{'_t' if trans else ''}")
    def store(out: f16[32, 8]):
        ts.attrs.grid = 1
        ts.attrs.block = 32
        S = ts.shared_tensor(f16, [32, 8])
        r = ts.register_tensor(f16, [8])
        lane = ts.thread_idx.x
        for i in range(8):
            S[lane, i] = 0.0
            r[i] = ts.cast(8 * lane + i, f16)
        ts.syncwarp()
        ts.stmatrix(S[lane, 0], r[0], num=num, trans=trans)
        ts.syncwarp()
        for i in range(8):
            out[lane, i] = S[lane, i]

    return store


def stmatrix_reference(num: int, trans: bool) -> np.ndarray:
    """Matrix q's fragment (PTX ISA, mma m8n8 / ldmatrix): row g, columns 2t, 2t + 1 in lane
    4g + t's register q; stored row r of matrix q is its row r, or with .trans its column r."""
    out = np.zeros((32, 8), np.float16)
    for q in range(num):
        m = np.zeros((8, 8))
        for g in range(8):
            for c in range(8):
                m[g, c] = 8 * (4 * g + c // 2) + 2 * q + c % 2
        out[8 * q : 8 * q + 8] = m.T if trans else m
    return out


@needs_nvcc
@pytest.mark.slow
def test_stmatrix_stores_mma_fragments_as_rows_on_the_host(tmp_path):
    """Every count and both orientations against the fragment layout, on the host model (the
    register-A low-bit GEMM's epilogue uses x4 .trans); rows past num matrices stay zero."""
    from cuda_on_host import run_on_host

    shapes = [(num, trans) for num in (1, 2, 4) for trans in (False, True)]
    cases = [(make_stmatrix(num, trans), {"out": np.full((32, 8), np.nan, np.float16)}, "out", 1, 32)
             for num, trans in shapes]  # fmt: skip
    for (num, trans), got in zip(shapes, run_on_host(tmp_path, cases)):
        np.testing.assert_array_equal(got, stmatrix_reference(num, trans), err_msg=f"x{num} trans={trans}")


def test_stmatrix_and_ldmatrix_are_checked():
    with pytest.raises(KernelSyntaxError, match="ldmatrix loads shared memory into a register tensor"):

        @ts.kernel(target="cuda")
        def k0(a: f16[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            s = ts.shared_tensor(f16, [32, 8])
            r = ts.register_tensor(f16, [8])
            ts.ldmatrix(s[0, 0], r[0])

    with pytest.raises(KernelSyntaxError, match="stmatrix stores a register tensor into shared memory"):

        @ts.kernel(target="cuda")
        def k(a: f16[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            s = ts.shared_tensor(f16, [32, 8])
            ts.stmatrix(a[0], s[0, 0])

    with pytest.raises(KernelSyntaxError, match="1, 2 or 4 matrices"):

        @ts.kernel(target="cuda")
        def k2(a: f16[64]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            s = ts.shared_tensor(f16, [32, 8])
            r = ts.register_tensor(f16, [8])
            ts.stmatrix(s[0, 0], r[0], num=3)


# ---- GPU ---------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("r,c", [(200, 136), (64, 64), (1, 520), (129, 8)])
def test_tma_load_and_mbarrier_phases(r, c):
    torch = pytest.importorskip("torch")
    x = torch.randn(r, c, device="cuda", dtype=torch.float16)
    y = torch.full_like(x, float("nan"))
    make_tma_copy()(x, y, TensorMap.tiled(x, (64, 64)), 3)
    torch.cuda.synchronize()
    assert torch.equal(x, y)
    # A transposed view is refused: as non-contiguous, or (1-row x, whose transpose torch
    # calls contiguous) for its 2-byte rows.
    with pytest.raises(ArgumentError, match="contiguous|multiple of 16 bytes"):
        TensorMap.tiled(x.t(), (64, 64))


@needs_nvcc
@pytest.mark.slow
def test_tma_store_writes_the_box_inside_the_tensor_on_the_host(rng, tmp_path):
    from cuda_on_host import HostTensorMap, run_on_host

    x = rng.standard_normal((70, 136)).astype(np.float16)
    values = {"X": x, "Y": np.full((70, 136), np.nan, np.float16), "ty": HostTensorMap("Y", (70, 136), (32, 64)),
              "R": 70, "C": 136}  # fmt: skip
    (got,) = run_on_host(tmp_path, [(make_tma_store_rows(), values, "Y", (3, 2, 1), 128)])
    np.testing.assert_array_equal(got, x * np.float16(2))


def test_tma_store_is_checked_and_lowered():
    src = make_tma_store_rows().source
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in src and "cp.async.bulk.commit_group" in src
    assert "cp.async.bulk.wait_group.read %0" in src and "ts_tma_store_wait<0>()" in src
    with pytest.raises(KernelSyntaxError, match="tensor-map parameter"):

        @ts.kernel(target="cuda")
        def k0(X: f16["R", 64]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            tile = ts.shared_tensor(f16, [8, 64])
            ts.tma_store(X[0, 0], tile[0, 0], 0, 0)

    with pytest.raises(KernelSyntaxError, match="reads shared memory"):

        @ts.kernel(target="cuda")
        def k1(X: f16["R", 64], tx: ts.tensor_map(f16, (8, 64))):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            ts.tma_store(tx, X[0, 0], 0, 0)

    with pytest.raises(KernelSyntaxError, match="2 coordinates"):

        @ts.kernel(target="cuda")
        def k2(X: f16["R", 64], tx: ts.tensor_map(f16, (8, 64))):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            tile = ts.shared_tensor(f16, [8, 64])
            ts.tma_store(tx, tile[0, 0], 0)

    with pytest.raises(KernelSyntaxError, match="holds float32 but the tensor map describes float16"):

        @ts.kernel(target="cuda")
        def k3(X: f16["R", 64], tx: ts.tensor_map(f16, (8, 64))):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            tile = ts.shared_tensor(f32, [8, 64])
            ts.tma_store(tx, tile[0, 0], 0, 0)

    with pytest.raises(KernelSyntaxError, match="0..7"):

        @ts.kernel(target="cuda")
        def k4(X: f16["R", 64]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            ts.tma_store_wait(9)


@pytest.mark.cuda
@pytest.mark.parametrize("r,c", [(200, 136), (64, 64), (1, 520), (129, 8)])
def test_tma_store_on_the_gpu(r, c):
    """Boxes past both edges write only inside the tensor; two launches with fresh inputs."""
    torch = pytest.importorskip("torch")
    for _ in range(2):
        x = torch.randn(r, c, dtype=torch.float16, device="cuda")
        y = torch.full_like(x, float("nan"))
        make_tma_store_rows()(x, y, TensorMap.tiled(y, (32, 64)))
        torch.cuda.synchronize()
        assert torch.equal(y, x * 2)


@pytest.mark.cuda
def test_cluster_blocks_read_each_others_shared_memory():
    torch = pytest.importorskip("torch")
    y = torch.full((8, 4), float("nan"), device="cuda")
    make_cluster_exchange()(y)
    b = torch.arange(8, device="cuda")
    ref = ((b // 4) * 4 + (b + 1) % 4)[:, None] * 10.0 + torch.arange(4, device="cuda")[None, :]
    torch.testing.assert_close(y, ref.float())


@needs_nvcc
@pytest.mark.slow
def test_multicast_tma_fills_both_blocks_of_a_cluster_on_the_host(rng, tmp_path):
    """Rows past the tensor (the last cluster's second half) arrive as zeros in both blocks."""
    from cuda_on_host import HostTensorMap, run_on_host

    x = rng.standard_normal((40, 64)).astype(np.float16)
    values = {"X": x, "Y": np.full((6, 16, 64), np.nan, np.float16), "tx": HostTensorMap("X", (40, 64), (8, 64), swizzle=0),
              "R": 40, "B": 6}  # fmt: skip
    make_multicast_rows().build()  # ptxas takes the multicast and the remote arrival
    (got,) = run_on_host(tmp_path, [(make_multicast_rows(), values, "Y", 6, 64)])
    ref = multicast_reference(np.concatenate([x, np.zeros((8, 64), np.float16)]), 6)
    np.testing.assert_array_equal(got, ref)


def test_multicast_and_remote_arrive_are_checked_and_lowered():
    src = make_multicast_rows().source
    assert ".multicast::cluster" in src and "ts_tma_load_multicast_2d(" in src
    assert "mapa.shared::cluster" in src and "ts_mbarrier_arrive_cluster(" in src
    with pytest.raises(KernelSyntaxError, match="block mask and 2 coordinates"):

        @ts.kernel(target="cuda")
        def k0(X: f16["R", 64], tx: ts.tensor_map(f16, (8, 64), swizzle=0)):
            ts.attrs.grid = 2
            ts.attrs.block = 32
            ts.attrs.cluster = (2, 1, 1)
            tile = ts.shared_tensor(f16, [8, 64])
            bar = ts.shared_tensor(u64, [1])
            ts.tma_load_multicast(tile[0, 0], tx, bar[0], 3, 0)

    with pytest.raises(KernelSyntaxError, match="mbarrier"):

        @ts.kernel(target="cuda")
        def k1(X: f16["R", 64]):
            ts.attrs.grid = 2
            ts.attrs.block = 32
            ts.attrs.cluster = (2, 1, 1)
            tile = ts.shared_tensor(f16, [8, 64])
            ts.mbarrier_arrive_cluster(tile[0, 0], 1)


def make_suffix_sums():
    """Block b waits for block b + 1's flag, adds its X to the sum that block published, publishes
    its own and puts b + 1's flag back to rest: V = suffix sums of X, through flags only."""

    @ts.kernel(target="cuda")
    def suffix_sums(X: f32["B"], V: f32["B"], F: u32["B"]):
        ts.attrs.grid = B
        ts.attrs.block = 32
        b = ts.block_idx.x
        lane = ts.thread_idx.x
        if b + 1 < B:
            if lane == 0:
                ts.wait_flag(F[b + 1], 1)
            ts.syncwarp()
        if lane == 0:
            total = X[b]
            if b + 1 < B:
                total += V[b + 1]
                ts.signal_flag(F[b + 1], 0)
            V[b] = total
        ts.syncwarp()
        if lane == 0 and b > 0:
            ts.signal_flag(F[b], 1)

    return suffix_sums


@needs_nvcc
@pytest.mark.slow
def test_flags_pass_sums_between_blocks_on_the_host(rng, tmp_path):
    from cuda_on_host import run_on_host

    x = rng.standard_normal(7).astype(np.float32)
    cases = [(make_suffix_sums(), {"X": x, "V": np.full(7, np.nan, np.float32), "F": np.zeros(7, np.uint32), "B": 7}, out, 7, 32)
             for out in ("V", "F")]  # fmt: skip
    got, flags = run_on_host(tmp_path, cases)
    np.testing.assert_allclose(got, np.cumsum(x[::-1])[::-1], rtol=1e-6)
    assert not flags.any()  # every flag consumed


def test_flags_are_checked_and_lowered():
    src = make_suffix_sums().source
    assert "st.release.gpu.global.u32" in src and "ld.acquire.gpu.global.u32" in src
    with pytest.raises(KernelSyntaxError, match="global uint32 or int32"):

        @ts.kernel(target="cuda")
        def k0(X: f32["B"]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            flags = ts.shared_tensor(u32, [4])
            ts.signal_flag(flags[0], 1)

    with pytest.raises(KernelSyntaxError, match="global uint32 or int32"):

        @ts.kernel(target="cuda")
        def k1(X: f32["B"]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            ts.wait_flag(X[0], 1)


def test_reduce_add_and_ticket_are_checked_and_lowered():
    """ts.reduce_add lowers to red.global.add.v4/v2/f32 and ts.ticket to atom.add.acq_rel.gpu;
    misuse is refused at the kernel's line with what to write instead."""

    @ts.kernel(target="cuda")
    def k(P: f32["N"], F: u32["B"]):
        ts.attrs.grid = 1
        ts.attrs.block = 32
        acc = ts.register_tensor(f32, [4])
        seen = ts.register_tensor(u32, [1])
        for e in ts.unroll(4):
            acc[e] = 1.0
        ts.reduce_add(P[ts.thread_idx.x * 4], acc[0], bytes=16)
        ts.reduce_add(P[ts.thread_idx.x * 4], acc[0], bytes=8)
        ts.reduce_add(P[ts.thread_idx.x * 4], acc[0], bytes=4)
        ts.ticket(F[0], 1, seen[0])

    src = k.source
    assert "red.global.add.v4.f32" in src and "red.global.add.v2.f32" in src and "atom.add.acq_rel.gpu" in src
    with pytest.raises(KernelSyntaxError, match="adds registers into global memory"):

        @ts.kernel(target="cuda")
        def k1(P: f32["N"]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            Ps = ts.shared_tensor(f32, [128])
            acc = ts.register_tensor(f32, [4])
            ts.reduce_add(Ps[0], acc[0], bytes=16)

    with pytest.raises(KernelSyntaxError, match="4, 8 or 16 bytes"):

        @ts.kernel(target="cuda")
        def k2(P: f32["N"]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            acc = ts.register_tensor(f32, [4])
            ts.reduce_add(P[0], acc[0], bytes=12)

    with pytest.raises(KernelSyntaxError, match="old value into a uint32 register"):

        @ts.kernel(target="cuda")
        def k3(F: u32["B"]):
            ts.attrs.grid = 1
            ts.attrs.block = 32
            seen = ts.register_tensor(f32, [1])
            ts.ticket(F[0], 1, seen[0])


@pytest.mark.cuda
def test_flags_pass_sums_between_blocks_on_the_gpu():
    torch = pytest.importorskip("torch")

    for blocks in (1, 5, 64):  # (all resident at once: a block waits on the next)
        x = torch.randn(blocks, device="cuda")
        v = torch.full((blocks,), float("nan"), device="cuda")
        f = torch.zeros(blocks, dtype=torch.int32, device="cuda").view(torch.uint32)
        make_suffix_sums()(x, v, f)
        torch.cuda.synchronize()
        ref = torch.flip(torch.cumsum(torch.flip(x.double(), [0]), 0), [0])
        torch.testing.assert_close(v.double(), ref, rtol=1e-5, atol=1e-5)
        assert int(f.view(torch.int32).abs().sum()) == 0


@pytest.mark.cuda
def test_multicast_tma_and_remote_arrive_on_the_gpu():
    torch = pytest.importorskip("torch")
    from tessera.runtime.tensor_map import TensorMap

    x = torch.randn(40, 64, device="cuda", dtype=torch.float16)
    y = torch.full((6, 16, 64), float("nan"), device="cuda", dtype=torch.float16)
    make_multicast_rows()(x, y, TensorMap.tiled(x, (8, 64), swizzle=0))
    torch.cuda.synchronize()
    ref = multicast_reference(np.concatenate([x.cpu().numpy(), np.zeros((8, 64), np.float16)]), 6)
    np.testing.assert_array_equal(y.cpu().numpy(), ref)


@pytest.mark.cuda
@pytest.mark.parametrize("num,trans", [(1, False), (2, True), (4, False), (4, True)])
def test_stmatrix_on_the_gpu_matches_the_fragment_layout(num, trans):
    """The hardware against the layout the host model (and the register-A GEMM's epilogue)
    assumes."""
    torch = pytest.importorskip("torch")
    out = torch.full((32, 8), float("nan"), device="cuda", dtype=torch.float16)
    make_stmatrix(num, trans)(out)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), stmatrix_reference(num, trans))
