"""Warp-specialised fp16/bf16 GEMM for SM90: TMA loads, an mbarrier ring, wgmma, written in tessera.

C[b] = A[b] @ B[b] with A [batch, M, K] and B [batch, N, K] ("nk", K-major, a linear layer's
weight) or [batch, K, N] ("kn", torch.matmul's layout, read by wgmma as an MN-major operand
through the descriptor's transpose bit).  Per thread block (one per SM when persistent):

* warpgroup 0 is the producer: one thread walks the block's tiles and issues TMA loads of
  BM x 64 and BN x 64 (or 64 x 64 chunks for "kn") boxes into a `stages`-deep ring, each stage
  guarded by a `full` mbarrier (TMA bytes landed) and an `empty` one (consumers done);
* warpgroups 1..consumers each own BM / consumers rows of the tile and issue m64nBNk16
  wgmmas straight from the swizzled stages, keeping one k-tile of wgmmas in flight
  (`wgmma_wait(1)`) before releasing the stage they no longer read;
* registers move to the consumers with `setmaxnreg` (two consumer warpgroups);
* tiles are visited in groups of 8 tile rows (L2 reuse of B), split-k over the tile index;
* split-k either writes float32 partials for a second kernel to add (split_reduce="launch"),
  or (split_reduce="cluster") makes the split_k blocks of a tile one thread-block cluster
  that adds the partials through distributed shared memory and writes C itself: one launch,
  no workspace, which matters at decode sizes where a launch is a tenth of the time;
* the epilogue (`epilogue=`) stores each element with `C[z, r, c] = value` ("scalar", the
  form epilogue fusion rewrites), packed column pairs ("pair"), or ("staged") has each
  consumer warp park its 16 x BN rows in shared memory and write them back as coalesced
  16-byte row segments: scattered 2-byte stores cost ~12 µs per 128 x 256 tile on the H200,
  the staged form ~1 µs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import tessera as ts
from tessera import f32, u64
from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.ir.mapping import repeat, spatial
from tessera.ir.types import Swizzle
from tessera.target import SM90, Architecture, Target

BLOCK_K = 64  # one 128-byte swizzled row of 16-bit elements
SWIZZLE_128B = Swizzle(3, 3, 3)
GROUP_M = 8  # tile rows visited together (the rasterisation's L2 reuse)
LAYOUTS = ("nk", "kn")
EPILOGUES = ("scalar", "pair", "staged")
SPLIT_REDUCES = ("launch", "cluster")


@dataclass(frozen=True)
class TmaConfig:
    """Block tile, pipeline depth, consumer warpgroups, split-k and epilogue of the TMA GEMM.

    block_m = 64 x consumers x (m64 slabs per consumer, 1 or 2)."""

    block_m: int
    block_n: int
    stages: int
    consumers: int = 2
    split_k: int = 1
    persistent: bool = True
    epilogue: str = "scalar"
    group_m: int = GROUP_M
    split_reduce: str = "launch"

    @property
    def cluster(self) -> bool:
        """Split-k partials added inside the kernel by a cluster of the tile's split_k blocks."""
        return self.split_reduce == "cluster" and self.split_k > 1

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def slabs(self) -> int:
        return self.block_m // (64 * self.consumers)

    def stage_bytes(self) -> int:
        return (self.block_m + self.block_n) * BLOCK_K * 2

    def staging_bytes(self) -> int:
        """Shared memory of the staged epilogue: 16 rows (+ 8 columns of padding) per consumer warp."""
        if self.epilogue != "staged" or self.cluster:
            return 0
        return -(-self.consumers * 4 * 16 * (self.block_n + 8) * 2 // 1024) * 1024

    def smem_bytes(self) -> int:
        # + the two barrier arrays and the stubs of unused buffers, 1 KiB aligned each
        partials = self.block_m * self.block_n * 4 if self.cluster else 1024
        return self.stages * self.stage_bytes() + max(self.staging_bytes(), 1024) + partials + 2048

    def problems(self, target: Target | Architecture = SM90) -> list[str]:
        """Why this configuration cannot be built for `target` (empty when it can)."""
        out = []
        if self.consumers not in (1, 2):
            out.append("consumers must be 1 or 2 warpgroups")
        elif self.block_m % (64 * self.consumers) or self.slabs not in (1, 2):
            out.append(f"block_m must be 64 x consumers x 1 or 2, got {self.block_m}")
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            out.append("block_n must be a multiple of 16 in 16..256 (multiples of 64 for b_layout 'kn')")
        if self.group_m < 1:
            out.append("group_m must be >= 1")
        if self.epilogue not in EPILOGUES:
            out.append(f"epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if self.slabs * self.block_n // 2 > 128:
            out.append("more than 128 accumulator registers per consumer thread")
        if self.stages < 2:
            out.append("a pipeline needs at least 2 stages")
        if self.smem_bytes() > target.smem_per_block:
            out.append(f"{self.smem_bytes()} bytes of shared memory ({target.smem_per_block // 1024} KiB max)")
        if self.split_k < 1:
            out.append("split_k must be >= 1")
        if self.split_reduce not in SPLIT_REDUCES:
            out.append(f"split_reduce must be one of {SPLIT_REDUCES}, got {self.split_reduce!r}")
        elif self.cluster and (self.consumers != 1 or self.persistent or self.split_k > 8):
            out.append("split_reduce='cluster' needs one consumer warpgroup, persistent=False and split_k <= 8")
        return out

    def tiles(self, m: int, n: int, batch: int = 1) -> int:
        """Work items of one launch: output tiles times batch times split-k."""
        return -(-m // self.block_m) * -(-n // self.block_n) * batch * self.split_k

    def grid(self, m: int, n: int, batch: int, sms: int) -> int:
        """Thread blocks to launch on `sms` SMs: one per SM when persistent, else one per work item."""
        tiles = self.tiles(m, n, batch)
        return min(tiles, sms) if self.persistent else tiles

    def __str__(self) -> str:
        flags = ("_p" if self.persistent else "") + {"scalar": "", "pair": "_v", "staged": "_e"}.get(self.epilogue, "?")
        flags += f"_g{self.group_m}" if self.group_m != GROUP_M else ""
        flags += "_cl" if self.split_reduce == "cluster" else ""
        return f"tma_{self.block_m}x{self.block_n}x{BLOCK_K}_s{self.stages}_c{self.consumers}_k{self.split_k}{flags}"


def tensor_map_boxes(config: TmaConfig, b_layout: str) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The TMA boxes of A [batch, M, K] and B ([batch, N, K] or [batch, K, N]) for `config`."""
    a_box = (1, config.block_m, BLOCK_K)
    b_box = (1, BLOCK_K, 64) if b_layout == "kn" else (1, config.block_n, BLOCK_K)
    return a_box, b_box


def c_pairs(n: int) -> ts.TaskMapping:
    """The wgmma m64n{n} accumulator as pairs of neighbouring columns: task j of a thread holds
    registers 2j and 2j + 1 at (row, 2 * column)."""
    return spatial(4, 1) * repeat(1, n // 8) * repeat(2, 1) * spatial(8, 4)


@dataclass(frozen=True)
class ConvWindow:
    """An implicit-GEMM convolution's A operand: the NHWC input read through an im2col tensor map.

    Row m of A is output pixel m = (n, oh, ow) of [N, OH, OW]; column k = (tap, c) with tap =
    (u, v) over the kh x kw filter and c over `channels`.  B is the OHWI weight as
    [O, kh * kw * channels].  The k-loop visits each tap's channels in blocks of BLOCK_K; when
    `channels` is not a multiple of BLOCK_K the last block of a tap reads zeros past the
    image's channels (TMA's fill) against the next tap's weights, so they add nothing."""

    channels: int
    kernel: tuple[int, int]
    out_hw: tuple[int, int]
    stride: tuple[int, int]
    pad: tuple[int, int]  # top, left
    dilation: tuple[int, int]

    def problems(self) -> list[str]:
        out = [] if self.channels % 8 == 0 else [f"channels must be a multiple of 8 (16-byte rows), got {self.channels}"]
        if max((k - 1) * d for k, d in zip(self.kernel, self.dilation)) >= 1 << 15:
            out.append("the filter's extent must fit the 16-bit window offsets")
        return out


@ts.inline
def init_ring(full, empty, tid, stages, full_arrivals, empty_arrivals):
    """Thread 0 initialises the ring's barriers: `full[s]` completes after `full_arrivals`
    arrivals (and the transaction bytes they announce), `empty[s]` after `empty_arrivals`
    (one per consumer warpgroup); then the block meets."""
    if tid == 0:
        for s in range(stages):
            ts.mbarrier_init(full[s], full_arrivals)
            ts.mbarrier_init(empty[s], empty_arrivals)
        ts.fence_mbarrier_init()
    ts.syncthreads()


@ts.inline
def consume_tile(acc, As, Bs, full, empty, stage, phase, last, num_k, row0, lane, slabs, block_n, stages, kn):
    """A consumer warpgroup's k-loop over one output tile: m64n{block_n}k16 wgmmas of its `slabs`
    m64 slabs from each stage once `full` says it landed, one k-tile in flight, the stage
    before released on `empty`; `stage`, `phase` and `last` are the caller's ring position."""
    for sl in ts.unroll(slabs):
        for e in ts.unroll(block_n // 2):
            acc[sl, e] = 0.0
    for kk in range(num_k):
        ts.mbarrier_wait(full[stage], phase)
        ts.wgmma_fence()
        for ks in ts.unroll(BLOCK_K // 16):
            for sl in ts.unroll(slabs):
                if kn:
                    ts.wgmma(acc[sl, 0], As[stage, row0 + sl * 64, ks * 16], Bs[stage, 0, ks * 16, 0], n=block_n,
                             trans_b=True)  # fmt: skip
                else:
                    ts.wgmma(acc[sl, 0], As[stage, row0 + sl * 64, ks * 16], Bs[stage, 0, ks * 16], n=block_n)
        ts.wgmma_commit()
        ts.wgmma_wait(1)  # k-tile kk - 1 is done: release its stage
        if kk > 0 and lane == 0:
            ts.mbarrier_arrive(empty[last])
        last = stage
        stage += 1
        if stage == stages:
            stage = 0
            phase ^= 1
    ts.wgmma_wait(0, acc[0, 0])  # (fenced: the epilogue's reads of acc may not move above the wait)
    if num_k > 0 and lane == 0:
        ts.mbarrier_arrive(empty[last])


@ts.inline
def store_staged_rows(C, Cs, acc, sl, z, m0, n0, row0, lane, wg, M, N, dtype, block_n, pairs):
    """The staged epilogue of slab `sl`: this warp's 16 rows go through shared memory (Cs, one
    [16, block_n + 8] tile per consumer warp), written as column pairs (`pairs`: c_pairs),
    read back as 16-byte row segments (coalesced global stores; epilogue fusion rewrites them)."""
    cw = (wg - 1) * 4 + lane // 32
    pair = ts.register_tensor(dtype, [2])
    ts.syncwarp()  # the previous tile's reads of Cs are done
    for j, (r2, c2) in enumerate(pairs.on(lane)):
        pair[0] = acc[sl, j * 2]
        pair[1] = acc[sl, j * 2 + 1]
        ts.copy_vector(Cs[cw, r2 % 16, c2 * 2], pair[0], 4)
    ts.syncwarp()
    for i in range(lane % 32, 16 * (block_n // 8), 32):
        r3 = i // (block_n // 8)
        c3 = i % (block_n // 8)
        gm = m0 + row0 + sl * 64 + (lane // 32) * 16 + r3
        gn = n0 + c3 * 8
        if gm < M:
            if N % 8 == 0 and gn + 8 <= N:
                ts.copy_vector(C[z, gm, gn], Cs[cw, r3, c3 * 8], 16)
            else:
                for e in ts.unroll(8):
                    if gn + e < N:
                        C[z, gm, gn + e] = Cs[cw, r3, c3 * 8 + e]


def make_gemm_tma(dtype: DataType, config: TmaConfig, b_layout: str = "nk", conv: ConvWindow | None = None) -> ts.Kernel:
    """kernel(A, B, C, tma_a, tma_b, split, ctas): with split == 1, or split-k reduced in a cluster,
    it writes `dtype` results into C [batch, M, N]; otherwise float32 partials into
    C [batch * split, M, N] (see tessera.templates.gemm.mma.make_split_k_reduce).  tma_a / tma_b are
    TensorMaps over A and B with the boxes of `tensor_map_boxes`; ctas is the grid size
    (`config.grid`).  With `conv`, A is an NHWC image and tma_a an im2col map over it
    (`ts.tensor_map_im2col(dtype, block_m, 64)`, the window of `conv`): an implicit-GEMM
    convolution, batch 1, b_layout "nk"."""
    if conv is not None and (conv.problems() or b_layout != "nk"):
        raise UnsupportedError(f"implicit-GEMM convolution {conv}: {'; '.join(conv.problems() or ['needs b_layout nk'])}")
    if config.cluster:  # the cluster shape is compiled in
        return _make(dtype, replace(config, persistent=False), b_layout, True, conv)
    # split_k and persistence are run-time arguments: one kernel serves them all.
    return _make(dtype, replace(config, split_k=1, persistent=False, split_reduce="launch"), b_layout,
                 config.split_k > 1, conv)  # fmt: skip


@functools.cache
def _make(dtype: DataType, config: TmaConfig, b_layout: str, partial: bool, conv: ConvWindow | None = None) -> ts.Kernel:
    if dtype not in (dtypes.float16, dtypes.bfloat16):
        raise UnsupportedError(f"the tensor-core GEMM takes float16 or bfloat16, not {dtype}")
    if b_layout not in LAYOUTS:
        raise UnsupportedError(f"b_layout must be one of {LAYOUTS}, got {b_layout!r}")
    problems = config.problems()
    if b_layout == "kn" and config.block_n % 64:
        problems.append("with b_layout 'kn' block_n must be a multiple of 64 (B is read in 64-column chunks)")
    if problems:
        raise UnsupportedError(f"GEMM config {config}: {'; '.join(problems)}")
    T = dtype
    BM, BN, BK, STAGES = config.block_m, config.block_n, BLOCK_K, config.stages
    CONSUMERS, SLABS = config.consumers, config.slabs
    KN = b_layout == "kn"
    CLUSTER, SPLIT = config.cluster, config.split_k
    if CLUSTER and (config.problems() or SPLIT < 2):
        raise UnsupportedError(f"GEMM config {config}: {'; '.join(config.problems())}")
    OUT = f32 if partial and not CLUSTER else T
    P_SHAPE = [BM, BN] if CLUSTER else [1]  # this block's float32 partial tile (cluster split-k)
    THREADS = 128 * (CONSUMERS + 1)
    # Split-k partials (float32) are written in pairs when a staged epilogue is asked for.
    EPI = "pair" if partial and config.epilogue == "staged" else config.epilogue
    EPI = "scalar" if CLUSTER else EPI  # (the cluster's reduction writes C)
    STAGED = EPI == "staged"
    CST_SHAPE = [CONSUMERS * 4, 16, BN + 8] if STAGED else [1]
    A_BOX, B_BOX = tensor_map_boxes(config, b_layout)
    TA, TB = ts.tensor_map(T, A_BOX), ts.tensor_map(T, B_BOX)
    CONV = conv is not None
    if CONV:
        TA = ts.tensor_map_im2col(T, BM, BK, 4)
        CIN, CB = conv.channels, -(-conv.channels // BK)  # channels, and their blocks per tap
        TAPS, KW = conv.kernel[0] * conv.kernel[1], conv.kernel[1]
        (OH, OW), (SH, SW), (PT, PL), (DH, DW) = conv.out_hw, conv.stride, conv.pad, conv.dilation
        A_SHAPE = ("images", "in_h", "in_w", "in_c")
    else:
        A_SHAPE = ("batch", "M", "K")
    B_SHAPE = ("batch", "K", "N") if KN else ("batch", "N", "K")
    B_TILE = [STAGES, BN // 64, BK, 64] if KN else [STAGES, BN, BK]
    STAGE_BYTES = config.stage_bytes()
    C_FRAG = ts.fragments.wgmma_m64_c(BN)
    C_PAIRS = c_pairs(BN)
    # Two consumer warpgroups need more than the 168 registers a 384-thread block starts with.
    REGS = (40, 232) if CONSUMERS == 2 else (0, 0)
    GROUP = config.group_m
    tile = str(config).rsplit("_k", 1)[0]
    epi = {"scalar": "", "pair": "_v", "staged": "_e"}[EPI]
    name = f"gemm_{T.short}_{b_layout}_{tile}{epi}{f'_g{GROUP}' if GROUP != GROUP_M else ''}"
    name += f"_cluster{SPLIT}" if CLUSTER else "_partial" if partial else ""
    name += "_conv" if CONV else ""

    @ts.kernel(target="cuda", name=name)
    def gemm(A: T[A_SHAPE], B: T[B_SHAPE], C: OUT["zdim", "M", "N"], tma_a: TA, tma_b: TB,
             split: ts.int32, ctas: ts.int32):  # fmt: skip
        ts.attrs.grid = ctas
        ts.attrs.block = 128 * (CONSUMERS + 1)
        ts.attrs.min_blocks = 1
        if CLUSTER:
            ts.attrs.cluster = (SPLIT, 1, 1)
        As = ts.shared_tensor(T, [STAGES, BM, BK], swizzle=SWIZZLE_128B)
        Bs = ts.shared_tensor(T, B_TILE, swizzle=SWIZZLE_128B)
        full = ts.shared_tensor(u64, [STAGES])
        empty = ts.shared_tensor(u64, [STAGES])
        Cs = ts.shared_tensor(T, CST_SHAPE)  # the staged epilogue's rows, per consumer warp
        Ps = ts.shared_tensor(f32, P_SHAPE)
        tid = ts.thread_idx.x
        wg = tid // 128
        init_ring(full, empty, tid, STAGES, 1, CONSUMERS)  # full: the producer's arrive_expect_tx, then the TMA bytes
        tiles_m = ts.ceil_div(M, BM)
        tiles_n = ts.ceil_div(N, BN)
        per_z = tiles_m * tiles_n
        group_tiles = GROUP * tiles_n
        total = per_z * batch * split
        k_tiles = TAPS * CB if CONV else ts.ceil_div(K, BK)
        per_split = ts.ceil_div(k_tiles, split)
        stage = 0
        phase = 0
        if wg == 0:
            if REGS[0]:
                ts.setmaxnreg(REGS[0], False)
            if tid == 0:
                for t in range(ts.block_idx.x, total, ts.grid_dim.x):
                    q = t // split  # the split index varies fastest: a cluster's blocks share a tile
                    bi = q // per_z
                    r = q % per_z
                    first = (r // group_tiles) * GROUP
                    rows = min(tiles_m - first, GROUP)
                    m0 = (first + (r % group_tiles) % rows) * BM
                    n0 = ((r % group_tiles) // rows) * BN
                    kt0 = (t % split) * per_split
                    num_k = max(min(per_split, k_tiles - kt0), 0)
                    for kk in range(num_k):
                        ts.mbarrier_wait(empty[stage], phase ^ 1)
                        ts.mbarrier_arrive_expect_tx(full[stage], STAGE_BYTES)
                        k0 = (kt0 + kk) * BK
                        if CONV:
                            # The tile's first output pixel as the window's input coordinates; the
                            # tap shifts the window, TMA walks it over BM pixels (rows, images).
                            tap = (kt0 + kk) // CB
                            c0 = (kt0 + kk) % CB * BK
                            k0 = tap * CIN + c0
                            ts.tma_load_im2col(As[stage, 0, 0], tma_a, full[stage], m0 // (OH * OW),
                                               m0 % (OH * OW) // OW * SH - PT, m0 % OW * SW - PL, c0, tap // KW * DH,
                                               tap % KW * DW)  # fmt: skip
                        else:
                            ts.tma_load(As[stage, 0, 0], tma_a, full[stage], bi, m0, k0)
                        if KN:
                            for c in range(BN // 64):
                                ts.tma_load(Bs[stage, c, 0, 0], tma_b, full[stage], bi, k0, n0 + c * 64)
                        else:
                            ts.tma_load(Bs[stage, 0, 0], tma_b, full[stage], bi, n0, k0)
                        stage += 1
                        if stage == STAGES:
                            stage = 0
                            phase ^= 1
        else:
            if REGS[1]:
                ts.setmaxnreg(REGS[1], True)
            acc = ts.register_tensor(f32, [SLABS, BN // 2])
            lane = tid % 128
            row0 = (wg - 1) * SLABS * 64
            last = 0
            for t in range(ts.block_idx.x, total, ts.grid_dim.x):
                q = t // split
                z = q // per_z * split + t % split  # the output (or partials) slab
                r = q % per_z
                first = (r // group_tiles) * GROUP
                rows = min(tiles_m - first, GROUP)
                m0 = (first + (r % group_tiles) % rows) * BM
                n0 = ((r % group_tiles) // rows) * BN
                kt0 = (t % split) * per_split
                num_k = max(min(per_split, k_tiles - kt0), 0)
                consume_tile(acc, As, Bs, full, empty, stage, phase, last, num_k, row0, lane, SLABS, BN, STAGES, KN)
                for sl in ts.unroll(SLABS):
                    if CLUSTER:
                        for e, (r2, c2) in enumerate(C_FRAG.on(lane)):
                            Ps[sl * 64 + r2, c2] = acc[sl, e]
                    elif STAGED:
                        store_staged_rows(C, Cs, acc, sl, z, m0, n0, row0, lane, wg, M, N, T, BN, C_PAIRS)
                    elif EPI == "pair":
                        pair2 = ts.register_tensor(OUT, [2])
                        for j, (r2, c2) in enumerate(C_PAIRS.on(lane)):
                            gm = m0 + row0 + sl * 64 + r2
                            gn = n0 + c2 * 2
                            if gm < M:
                                if N % 2 == 0 and gn + 1 < N:
                                    pair2[0] = acc[sl, j * 2]
                                    pair2[1] = acc[sl, j * 2 + 1]
                                    ts.copy_vector(C[z, gm, gn], pair2[0], 2 * OUT.nbytes)
                                else:
                                    if gn < N:
                                        C[z, gm, gn] = acc[sl, j * 2]
                                    if gn + 1 < N:
                                        C[z, gm, gn + 1] = acc[sl, j * 2 + 1]
                    else:
                        for e, (r2, c2) in enumerate(C_FRAG.on(lane)):
                            gm = m0 + row0 + sl * 64 + r2
                            gn = n0 + c2
                            if gm < M and gn < N:
                                C[z, gm, gn] = acc[sl, e]
        if CLUSTER:
            # The cluster's split_k blocks hold the partial tiles of one output tile: block s adds
            # every block's partials for its share of the tile and writes C.
            ts.cluster_sync()
            t2 = ts.block_idx.x
            q2 = t2 // SPLIT
            b2 = q2 // per_z
            r4 = q2 % per_z
            first2 = (r4 // group_tiles) * GROUP
            rows2 = min(tiles_m - first2, GROUP)
            m2 = (first2 + (r4 % group_tiles) % rows2) * BM
            n2 = ((r4 % group_tiles) // rows2) * BN
            part = ts.register_tensor(f32, [4])
            tot = ts.register_tensor(f32, [4])
            for i in range((t2 % SPLIT) * THREADS + tid, BM * BN // 4, THREADS * SPLIT):
                rr = i // (BN // 4)
                cc = i % (BN // 4) * 4
                if m2 + rr < M:
                    for e in ts.unroll(4):
                        tot[e] = 0.0
                    for s2 in ts.unroll(SPLIT):
                        ts.load_cluster(part[0], Ps[rr, cc], s2, 16)
                        for e in ts.unroll(4):
                            tot[e] += part[e]
                    for e in ts.unroll(4):
                        if n2 + cc + e < N:
                            C[b2, m2 + rr, n2 + cc + e] = tot[e]
            ts.cluster_sync()  # no block leaves while the others read its partials

    return gemm
