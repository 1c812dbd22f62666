"""Low-bit prefill GEMM for SM90 with the dequantised weights as wgmma's register A operand.

Y[m, n] = sum_k X[m, k] W[n, k] computed as Y^T = W X^T: the weights are wgmma's A (64 rows a
warpgroup), X is its B, a K-major [tokens, 64] tile that TMA writes into a ring of shared
stages as it does for tessera.templates.gemm.tma.  The words are packed in mma's own k order
(tessera.ir.lowbit.FRAGMENT_SPAN), so `ts.dequant` of step s is, register for register, the
m64k16 A fragment of k [16s, 16s + 16): no weight tile is ever written to shared memory.

* warpgroup 0, thread 0: the TMA loads of X's stages (1 producer thread, its registers given up)
  and, with `words="tma"`, of the tile's weight words a 256-k block at a time into a two-slot
  ring (the block after the one X is at: the consumers read it while they work through this one);
  with `cluster=2`, the two blocks of a cluster take adjacent weight tiles of the same tokens and
  each loads half of every X stage for both (TMA multicast), so X crosses L2 once per pair; each
  block's consumers release a stage in both blocks (remote mbarrier arrivals);
* warpgroups 1 and 2: 64 weight rows each, one 16-row unit per warp.  Per 64-k stage, four
  steps: dequantise the step's fragment into one of in_flight + 1 register buffers (the others
  are read by the wgmmas in flight), fence, `wgmma m64n{block_t}k16` with A from registers,
  commit, then wait until in_flight groups are in flight, which frees the next step's buffer
  and, at the stage's step in_flight - 1, the stage before (the item's last wgmmas are waited
  for after its k loop).  A unit's words and scales for the next 256 k are reloaded
  stage by stage as they die (tessera.templates.lowbit.gemm.word_loads): from global memory, or
  the words from the shared ring (`words="tma"`; each warp releases a slot after its last read);
* epilogue: each warp's [16 rows, block_t tokens] accumulator goes through shared memory in
  64-token chunks (stmatrix .trans: four 8 x 8 blocks an instruction; `epilogue="scalar"`
  stores element by element) and out as 16-byte segments of Y's rows.

Why: the fused kernel of tessera.templates.lowbit.gemm writes each dequantised fp16 B tile into
shared memory for wgmma to read back; measured on the H200 (bench/results/...-7331bfc.md) its
shared-memory pipe ran at 85% and it reached 0.73-0.78x cuBLAS.  Here shared memory carries
only X, and the dequantisation overlaps the tensor cores inside the consumers themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import tessera as ts
from tessera import f16, f32, u32, u64
from tessera.errors import UnsupportedError
from tessera.ir.dtypes import DataType
from tessera.runtime.cuda import multiprocessor_count, torch_stream
from tessera.runtime.lru import LRUCache
from tessera.runtime.tensor_map import TensorMap
from tessera.templates.gemm import tma as gemm_tma
from tessera.templates.gemm.tma import BLOCK_K, SWIZZLE_128B
from tessera.templates.lowbit.gemm import load_unit, slots_after, tile_origins, word_loads, x_tensor_map
from tessera.templates.lowbit.gemm_rs_config import (
    CHUNK,
    CONFIGS,
    ROWS,
    STAGING,
    WORD_SLOTS,
    RegisterAConfig,
    problems,
    scale_runs,
)

_log = logging.getLogger("tessera")
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232  # setmaxnreg: 128 x 40 + 256 x 232 = 168 x 384


@ts.inline
def release_stage(empty, stage, cluster):
    """A consumer warpgroup is done with X's `stage`: one arrival on its barrier in every block of
    the cluster (each block's producer writes its share of the stage into all of them)."""
    if cluster > 1:
        for r in range(cluster):
            ts.mbarrier_arrive_cluster(empty[stage], r)
    else:
        ts.mbarrier_arrive(empty[stage])


@ts.inline
def stage_tokens(Cs, h, acc, warp, lane, first, tokens):
    """A consumer warp's accumulators acc[first ..] for `tokens` tokens into its rows of Cs
    [warp, token, row] by stmatrix .trans: register 4i + e is token 8i + 2 t4 + e % 2, row g + 8
    (e // 2), so per token block and row half an 8 x 8 [rows, tokens] matrix in mma's fragment
    layout, written as [tokens, rows]."""
    for p in ts.unroll(tokens // 16):  # token blocks 2p, 2p + 1 x row halves: 4 matrices
        for q in ts.unroll(4):
            h[q, 0] = acc[first + 4 * (2 * p + q // 2) + 2 * (q % 2)]
            h[q, 1] = acc[first + 4 * (2 * p + q // 2) + 2 * (q % 2) + 1]
        # lane 8q + r: row r (token) of matrix q
        ts.stmatrix(Cs[warp, 16 * p + 8 * (lane // 16) + lane % 8, 8 * ((lane // 8) % 2)], h[0, 0], num=4, trans=True)


@ts.inline
def work_item(i, block, blocks, n_whole, whole, first, end, k_units, t, u0, u1):
    """The block's item i of the persistent schedule: 256-k blocks [u0, u1) of tile t.  Items
    below n_whole are whole tiles (block, block + blocks, ...); the others cut the block's share
    [first, end) of the stream-K units (k_units a tile, tiles from `whole` on) at tile ends."""
    j = i - n_whole
    start = ts.select(j == 0, first, (first // k_units + j) * k_units)
    t = ts.select(j < 0, block + i * blocks, whole + start // k_units)  # noqa: F841
    u0 = ts.select(j < 0, 0, start % k_units)  # noqa: F841
    u1 = ts.select(j < 0, k_units, min(k_units, end - (start - start % k_units)))  # noqa: F841


@ts.inline
def load_words(Ws, wfull, wempty, tma_w, wslot, wphase, unit, ku, nbytes):
    """Producer: 256-k block `ku` of the tile's units from `unit` on into the word ring's next slot."""
    ts.mbarrier_wait(wempty[wslot], wphase ^ 1)
    ts.mbarrier_arrive_expect_tx(wfull[wslot], nbytes)
    ts.tma_load(Ws[wslot, 0, 0, 0], tma_w, wfull[wslot], unit, ku, 0, 0)
    wslot += 1
    if wslot == WORD_SLOTS:
        wslot = 0
        wphase ^= 1


@ts.inline
def read_words(wr, Ws, wfull, wempty, wslot, wphase, warp, lane, words, first, last):
    """Consumer warp: `words` ((first word, bytes) loads, as load_unit takes them) of its unit from
    the word ring's current slot, waiting for it at the block's `first` read and releasing it
    (then moving to the next slot) after its `last`."""
    if first:
        ts.mbarrier_wait(wfull[wslot], wphase)
    for w, nbytes in words:
        ts.copy_vector(wr[0, w], Ws[wslot, warp, w // 4, lane * 4 + w % 4], nbytes)
    if last:
        ts.syncwarp()  # the warp's reads of the slot are done
        if lane == 0:
            ts.mbarrier_arrive(wempty[wslot])
        wslot += 1
        if wslot == WORD_SLOTS:
            wslot = 0
            wphase ^= 1


@functools.cache
def make_lowbit_gemm_rs(wtype: DataType, group_size: int, has_bias: bool, config: RegisterAConfig) -> ts.Kernel:
    """kernel(A [1, M, K] f16, Wq u32, S [NS, G] f16, Z [NB, GB] f16, C [1, M, N] f16, tma_a, tma_w,
    ctas), the arguments of tessera.templates.lowbit.gemm.make_lowbit_gemm with the words packed in
    span FRAGMENT_SPAN; tma_a maps A with box (1, block_t / cluster, 64), tma_w the words
    (word_map; read only when config.words == "tma"); ctas = config.grid(M, N, SMs)."""
    bad = problems(wtype, group_size, has_bias, config)
    if bad:
        raise UnsupportedError(f"low-bit register-A GEMM {wtype} g{group_size} {config}: {'; '.join(bad)}")
    T, BITS, GS, HAS_BIAS = wtype, wtype.nbits, group_size, has_bias
    BT, BK, STAGES, GROUP = config.block_t, BLOCK_K, config.stages, config.group_m
    FLIGHT, BUFFERS = config.in_flight, config.in_flight + 1
    STMATRIX = config.epilogue == "stmatrix"
    TMA_OUT = config.epilogue == "tma"
    WTMA = config.words == "tma"
    SKC = config.stream_k
    UNITS = ROWS // 16
    W_SHAPE = [WORD_SLOTS, UNITS, BITS, 128] if WTMA else [1, 1, 1, 4]  # (a placeholder when unused)
    W_BYTES = UNITS * BITS * 512  # a 256-k block of the tile's words
    SPQ, NQ = scale_runs(GS)
    QK = tuple(16 * SPQ * q for q in range(NQ))  # run q's first k within the 256
    QS = tuple(range(NQ))
    ALL_WORDS, STAGE_WORDS = word_loads(BITS)
    SLOTS_AFTER = slots_after(SPQ, NQ)
    BLOCKS, STEPS = tuple(range(4)), tuple(range(4))
    X_BYTES = BT * BK * 2
    CL = config.cluster
    HALF, MASK = BT // CL, (1 << CL) - 1  # tokens of an X stage each block of the cluster loads, for all of them
    TA = ts.tensor_map(f16, (1, HALF, BK))
    TW = ts.tensor_map(u32, (UNITS, 1, BITS, 128), swizzle=0)
    TC = ts.tensor_map(f16, (1, BT, 16), swizzle=0)  # a warp's slab of the tile: [tokens, its 16 rows]
    name = f"lowbit_gemm_rs_{T.name}_g{GS}{'_z' if HAS_BIAS else ''}_{str(config).removeprefix('rs_')}"

    @ts.kernel(target="cuda", name=name)
    def gemm(A: f16["batch", "M", "K"], Wq: u32["W"], S: f16["NS", "G"], Z: f16["NB", "GB"], C: f16["zdim", "M", "N"],
             tma_a: TA, tma_w: TW, tma_c: TC, ctas: ts.int32, whole: ts.int32, P: f32["PW"], F: u32["FW"]):  # fmt: skip
        ts.attrs.grid = ctas
        ts.attrs.block = 384
        ts.attrs.min_blocks = 1
        if CL > 1:
            ts.attrs.cluster = (CL, 1, 1)
        Xs = ts.shared_tensor(f16, [STAGES, BT, BK], swizzle=SWIZZLE_128B)
        full = ts.shared_tensor(u64, [STAGES])
        empty = ts.shared_tensor(u64, [STAGES])
        Cs = ts.shared_tensor(f16, [8, BT, 16] if TMA_OUT else list(STAGING))
        Ws = ts.shared_tensor(u32, W_SHAPE)
        wfull = ts.shared_tensor(u64, [WORD_SLOTS])
        wempty = ts.shared_tensor(u64, [WORD_SLOTS])
        Tk = ts.shared_tensor(u32, [8 if SKC else 1])  # stream_k: each consumer warp's ticket, for its lanes
        tid = ts.thread_idx.x
        wg = tid // 128
        # full: the producer's expect_tx; empty: each consumer warpgroup once its wgmmas read the stage
        # (with a cluster, every block's consumers release each block's stage: its producers write them all)
        gemm_tma.init_ring(full, empty, tid, STAGES, 1, 2 * CL)
        if WTMA:  # the word ring: wempty once each of the 8 consumer warps read its unit's words
            gemm_tma.init_ring(wfull, wempty, tid, WORD_SLOTS, 1, 8)
        rank = ts.block_idx.x % CL
        cluster = ts.block_idx.x // CL
        clusters = ts.grid_dim.x // CL
        if CL > 1:
            ts.cluster_sync()  # the other blocks' barriers exist before anything lands there
        tiles_m = ts.ceil_div(M, BT)
        tiles_n = ts.ceil_div(ts.ceil_div(N, ROWS), CL)  # (a cluster's CL adjacent weight tiles count as one)
        per_z = tiles_m * tiles_n
        group_tiles = GROUP * tiles_n
        k_units = ts.ceil_div(K, 256)
        n_units = ts.ceil_div(N, 16)
        # the schedule: whole tiles `cluster`, + clusters, ... below `whole`; then (stream_k) the
        # block's share [first, end) of the other tiles' 256-k blocks (work_item)
        n_whole = ts.ceil_div(whole - cluster, clusters)
        sk_units = (per_z - whole) * k_units
        first = cluster * sk_units // clusters
        end = (cluster + 1) * sk_units // clusters
        n_items = n_whole
        if end > first:
            n_items += (end - 1) // k_units - first // k_units + 1
        # the current work item (tile t, 256-k blocks [u0, u1)) and the next one's (tile tn from nu0)
        t = 0
        u0 = 0
        u1 = 0
        tn = 0
        nu0 = 0
        nu1 = 0
        nm0 = 0
        after_n0 = 0
        stage = 0
        phase = 0
        wslot = 0  # the word ring: the next block's slot and phase (producer: to fill; consumers: to read)
        wphase = 0
        if wg == 0:
            ts.setmaxnreg(PRODUCER_REGISTERS, False)
            if tid == 0:
                m0 = 0
                n0 = 0
                next_n0 = 0
                if WTMA:  # the first item's first 256 k: the consumers' prologue reads it
                    work_item(0, cluster, clusters, n_whole, whole, first, end, k_units, t, u0, u1)
                    tile_origins(t, clusters, tiles_m, per_z, group_tiles, GROUP, BT, ROWS * CL, m0, n0, next_n0)
                    n0 += rank * ROWS
                    load_words(Ws, wfull, wempty, tma_w, wslot, wphase, n0 // 16, u0, W_BYTES)
                for i in range(n_items):
                    work_item(i, cluster, clusters, n_whole, whole, first, end, k_units, t, u0, u1)
                    tile_origins(t, clusters, tiles_m, per_z, group_tiles, GROUP, BT, ROWS * CL, m0, n0, next_n0)
                    # the next item's first 256 k (the last item's own: loaded, never used)
                    work_item(min(i + 1, n_items - 1), cluster, clusters, n_whole, whole, first, end, k_units, tn, nu0, nu1)
                    tile_origins(tn, clusters, tiles_m, per_z, group_tiles, GROUP, BT, ROWS * CL, nm0, next_n0, after_n0)
                    n0 += rank * ROWS
                    next_n0 += rank * ROWS
                    for kk in range(u0 * 4, u1 * 4):
                        if WTMA and kk % 4 == 0:  # the consumers read the next 256 k's words during this one's
                            nku = kk // 4 + 1
                            nn0 = n0
                            if nku == u1:
                                nku = nu0
                                nn0 = next_n0
                            load_words(Ws, wfull, wempty, tma_w, wslot, wphase, nn0 // 16, nku, W_BYTES)
                        ts.mbarrier_wait(empty[stage], phase ^ 1)
                        ts.mbarrier_arrive_expect_tx(full[stage], X_BYTES)
                        if CL > 1:  # this block's share of the stage, written into every block of the cluster
                            ts.tma_load_multicast(Xs[stage, rank * HALF, 0], tma_a, full[stage], MASK, 0, m0 + rank * HALF,
                                                  kk * BK)  # fmt: skip
                        else:
                            ts.tma_load(Xs[stage, 0, 0], tma_a, full[stage], 0, m0, kk * BK)
                        stage += 1
                        if stage == STAGES:
                            stage = 0
                            phase ^= 1
        else:
            ts.setmaxnreg(CONSUMER_REGISTERS, True)
            acc = ts.register_tensor(f32, [BT // 2])
            a = ts.register_tensor(f16, [BUFFERS, 8])  # A fragments: the FLIGHT wgmmas in flight read the others
            wr = ts.register_tensor(u32, [1, 4 * BITS])
            sc = ts.register_tensor(f16, [1, NQ, 2])
            bz = ts.register_tensor(f16, [1, NQ, 2])
            h = ts.register_tensor(f16, [4, 2])  # one stmatrix.x4: a register of each of 4 matrices
            lane = tid % 32
            warp = tid // 32 - 4  # consumer warp 0..7: weight rows 16 warp.. of the tile
            g = lane // 4
            t4 = lane % 4
            last = 0
            m0 = 0
            n0 = 0
            next_n0 = 0  # the next 256 k's words and scales: this tile's, or the next tile's first
            seen = ts.register_tensor(u32, [1])  # stream_k: a ticket's count before this share's
            zero = ts.register_tensor(f32, [4])
            for e in ts.unroll(4):
                zero[e] = 0.0
            for i in range(n_items):
                work_item(i, cluster, clusters, n_whole, whole, first, end, k_units, t, u0, u1)
                tile_origins(t, clusters, tiles_m, per_z, group_tiles, GROUP, BT, ROWS * CL, m0, n0, next_n0)
                work_item(min(i + 1, n_items - 1), cluster, clusters, n_whole, whole, first, end, k_units, tn, nu0, nu1)
                tile_origins(tn, clusters, tiles_m, per_z, group_tiles, GROUP, BT, ROWS * CL, nm0, next_n0, after_n0)
                n0 += rank * ROWS
                next_n0 += rank * ROWS
                if i == 0:  # the block's first item: nothing was prefetched
                    if WTMA:
                        load_unit(wr, sc, bz, Wq, S, Z, 0, n0 // 16 + warp, u0, k_units, n_units, lane, t4, g, G, NS,
                                  (), QS, BITS, 0, QK, GS, HAS_BIAS)  # fmt: skip
                        read_words(wr, Ws, wfull, wempty, wslot, wphase, warp, lane, ALL_WORDS, True, True)
                    else:
                        load_unit(wr, sc, bz, Wq, S, Z, 0, n0 // 16 + warp, u0, k_units, n_units, lane, t4, g, G, NS,
                                  ALL_WORDS, QS, BITS, 0, QK, GS, HAS_BIAS)  # fmt: skip
                for e in ts.unroll(BT // 2):
                    acc[e] = 0.0
                for ku in range(u0, u1):
                    nku = ku + 1
                    nn0 = n0
                    if nku == u1:
                        nku = nu0
                        nn0 = next_n0
                    for b in BLOCKS:  # compile-time: steps 4b..4b + 3 of the unit
                        ts.mbarrier_wait(full[stage], phase)
                        for j in STEPS:
                            if HAS_BIAS:
                                ts.dequant(a[j % BUFFERS, 0], wr[0, 0], sc[0, (4 * b + j) // SPQ, 0],
                                           bz[0, (4 * b + j) // SPQ, 0], wtype=T, start=8 * (4 * b + j), count=8)  # fmt: skip
                            else:
                                ts.dequant(a[j % BUFFERS, 0], wr[0, 0], sc[0, (4 * b + j) // SPQ, 0], wtype=T,
                                           start=8 * (4 * b + j), count=8)  # fmt: skip
                            if j == 3:  # this stage's words and scale runs are dead: the next 256 k's in their place
                                if WTMA:
                                    load_unit(wr, sc, bz, Wq, S, Z, 0, nn0 // 16 + warp, nku, k_units, n_units, lane, t4,
                                              g, G, NS, (), SLOTS_AFTER[b], BITS, 0, QK, GS, HAS_BIAS)  # fmt: skip
                                    read_words(wr, Ws, wfull, wempty, wslot, wphase, warp, lane, STAGE_WORDS[b], b == 0,
                                               b == 3)  # fmt: skip
                                else:
                                    load_unit(wr, sc, bz, Wq, S, Z, 0, nn0 // 16 + warp, nku, k_units, n_units, lane, t4,
                                              g, G, NS, STAGE_WORDS[b], SLOTS_AFTER[b], BITS, 0, QK, GS, HAS_BIAS)  # fmt: skip
                            ts.wgmma_fence()  # the fragment's registers were just written
                            ts.wgmma(acc[0], a[j % BUFFERS, 0], Xs[stage, 0, j * 16], n=BT)
                            ts.wgmma_commit()
                            ts.wgmma_wait(FLIGHT)  # step j - FLIGHT is done: its buffer, the next step's, is free
                            if j == FLIGHT - 1 and tid % 128 == 0:  # ... and with it the stage before this one
                                if b > 0:
                                    release_stage(empty, last, CL)
                                elif ku > u0:  # (the item's first stage: the last one before it was released at its end)
                                    release_stage(empty, last, CL)
                        last = stage
                        stage += 1
                        if stage == STAGES:
                            stage = 0
                            phase ^= 1
                # The item's last wgmmas, waited for once after the loop, the accumulators fenced so that
                # no read of them moves above the wait (ptxas (CUDA 13.0) hoisted the epilogue's F2FP
                # conversions above an unfenced one: the H200 lost part of the last step, rel_err ~2e-2;
                # tests/test_wgmma_hazards.py scans the SASS for it).  The earlier form, a fenced wait(0)
                # at the last step inside the loop, made ptxas drain the wgmmas at every 256-k back edge
                # (C7517): 0.5-1.7% slower at M=4096 with in_flight 1 (bench/results/...-wait-after-loop.md).
                ts.wgmma_wait(0, acc[0])
                if tid % 128 == 0:
                    release_stage(empty, last, CL)
                whole_sum = 1  # this warp holds its slab's whole sum: it writes C
                if SKC:
                    if u1 - u0 < k_units:  # a share of a cut tile: added into the tile's sums at the L2 at once
                        # (no share waits for another); the share whose ticket completes the tile's k_units
                        # reads the whole sum back, leaves the sums and the ticket at zero and writes C
                        cut = (t - whole) * 8 + warp
                        for e in ts.unroll(BT // 8):
                            ts.reduce_add(P[(cut * (BT // 8) + e) * 128 + lane * 4], acc[4 * e], bytes=16)
                        ts.syncwarp()  # (the lanes' adds are ordered before lane 0's release)
                        if lane == 0:
                            ts.ticket(F[cut], u1 - u0, seen[0])
                            Tk[warp] = seen[0]
                        ts.syncwarp()  # (and lane 0's acquire before the lanes' reads)
                        whole_sum = ts.select(ts.cast(Tk[warp], ts.int32) + (u1 - u0) == k_units, 1, 0)
                        if whole_sum == 1:
                            for e in ts.unroll(BT // 8):
                                ts.copy_vector(acc[4 * e], P[(cut * (BT // 8) + e) * 128 + lane * 4], 16)
                                ts.copy_vector(P[(cut * (BT // 8) + e) * 128 + lane * 4], zero[0], 16)
                            if lane == 0:  # at rest for the next launch
                                F[cut] = 0
                if whole_sum == 1 and TMA_OUT:  # the tile's whole sum is here: the warp's slab by TMA
                    if lane == 0:  # the previous tile's store has read the slab
                        ts.tma_store_wait(0)
                    ts.syncwarp()
                    stage_tokens(Cs, h, acc, warp, lane, 0, BT)
                    ts.fence_proxy_async()  # the slab's writes, visible to the TMA unit
                    ts.syncwarp()
                    if lane == 0:
                        ts.tma_store(tma_c, Cs[warp, 0, 0], 0, m0, n0 + 16 * warp)
                elif whole_sum == 1:  # the tile's whole sum is here: through Cs a chunk of tokens at a time
                    for c0 in ts.unroll(BT // CHUNK):
                        ts.syncwarp()  # the previous chunk's reads of Cs are done
                        if STMATRIX:
                            stage_tokens(Cs, h, acc, warp, lane, c0 * (CHUNK // 2), CHUNK)
                        else:
                            for r in ts.unroll(CHUNK // 2):
                                Cs[warp, 8 * (r // 4) + 2 * t4 + r % 2, g + 8 * ((r // 2) % 2)] = acc[c0 * (CHUNK // 2) + r]
                        ts.syncwarp()
                        for i in range(lane, 2 * CHUNK, 32):  # a token's 16 rows: two 16-byte segments
                            gm = m0 + c0 * CHUNK + i // 2
                            gn = n0 + 16 * warp + 8 * (i % 2)
                            if gm < M:
                                if N % 8 == 0 and gn + 8 <= N:
                                    ts.copy_vector(C[0, gm, gn], Cs[warp, i // 2, 8 * (i % 2)], 16)
                                else:
                                    for e in ts.unroll(8):
                                        if gn + e < N:
                                            C[0, gm, gn + e] = Cs[warp, i // 2, 8 * (i % 2) + e]
            if TMA_OUT and lane == 0:  # the block's shared memory is its last store's source until read
                ts.tma_store_wait(0)
        if CL > 1:  # no block leaves while another may still write its stages or arrive on its barriers
            ts.cluster_sync()

    return gemm


def lowbit_gemm_rs(x, words, scales, biases, out, wtype: DataType, group_size: int, has_bias: bool,
                   config: RegisterAConfig | None = None) -> None:  # fmt: skip
    """out [M, N] float16 <- x [M, K] float16 @ W^T on torch CUDA tensors, W the weights in
    `words` (pack_units in span FRAGMENT_SPAN) with [N, G] float16 scales and biases;
    `group_size` the kernel group (padded K for per-channel scales); `config` one of CONFIGS."""

    m, k = x.shape
    n = out.shape[1]
    config = config or CONFIGS[0]
    tma_a = x_tensor_map(x, out, config.block_t // config.cluster, "low-bit register-A GEMM")
    tma_w = word_map(words, k, wtype.nbits)
    tma_c = output_map(out, config.block_t) if config.epilogue == "tma" else None
    if config.epilogue == "tma" and tma_c is None:
        _log.info("register-A GEMM: TMA cannot write out [%d, %d] (rows not 16-byte aligned: N %% 8 or the base); "
                  "the stmatrix epilogue instead", m, n)  # fmt: skip
        config = dataclasses.replace(config, epilogue="stmatrix")  # (config.for_output(n) where N is the cause)
    if tma_c is None:
        tma_c = _placeholder_slab_map(x.device, config.block_t)  # (the kernel never writes through it)
    sms = multiprocessor_count()
    grid, whole = config.grid(m, n, sms, k), config.whole_tiles(m, n, k, sms)
    cut = config.tiles(m, n) - whole  # (config.cut_tiles, whole_tiles computed once on this per-call path)
    partials, tickets = stream_k_workspace(x, config, cut) if cut else (None, None)
    if partials is None:  # nothing shared: the kernel without stream-K's schedule and sums
        if config.stream_k:  # (replace builds a config a call, ~5 us of host time: only where it changes one)
            config = dataclasses.replace(config, stream_k=False)
            grid, whole = config.grid(m, n, sms), config.tiles(m, n)
        partials, tickets = _placeholders(x.device)
    kernel = make_lowbit_gemm_rs(wtype, group_size, has_bias, config)
    kernel(x.view(1, m, k), words, scales, biases, out.view(1, m, n), tma_a, tma_w, tma_c, grid, whole, partials, tickets)


# stream_k's sums and tickets, per device and stream (two grids adding into one tile at once
# would mix their sums); zero at rest: each launch leaves them as it found them.
_WORKSPACES: dict = {}


def stream_k_workspace(x, config: RegisterAConfig, cut_tiles: int):
    """(sums float32, tickets uint32), zeroed, for a stream_k launch that cuts `cut_tiles` tiles,
    on x's device and the current stream; or (None, None) while that stream captures a CUDA graph
    and has none large enough yet (zeroing new memory is not a captured operation's to do): the
    launch then gives out whole tiles only, the same result a little slower (logged)."""
    import torch

    key = (x.device.index, torch_stream(x))
    floats, words = config.workspace(cut_tiles)
    have = _WORKSPACES.get(key)
    if have is None or have[0].numel() < floats or have[1].numel() < words:
        if torch.cuda.is_current_stream_capturing():
            _log.info("register-A GEMM: no stream-K workspace for a stream that captures a CUDA graph; whole tiles only")
            return None, None
        if have is not None:  # the larger one replaces it (a size a shape needs once is likely needed again)
            floats, words = max(floats, have[0].numel()), max(words, have[1].numel())
        have = _WORKSPACES[key] = (torch.zeros(floats, dtype=torch.float32, device=x.device),
                                   torch.zeros(words, dtype=torch.int32, device=x.device).view(torch.uint32))  # fmt: skip
    return have


_PLACEHOLDERS: dict = {}


def _placeholders(device):
    """One-element tensors for the workspace arguments of a launch without stream-K (one pair a
    device, made once: not an allocation and a fill kernel every call)."""
    import torch

    have = _PLACEHOLDERS.get(device.index)
    if have is None:
        have = _PLACEHOLDERS[device.index] = (torch.empty(1, dtype=torch.float32, device=device),
                                              torch.empty(1, dtype=torch.uint32, device=device))  # fmt: skip
    return have


def word_shape(words: int, k: int, bits: int) -> tuple[int, int, int, int]:
    """The words (`words` uint32 in span FRAGMENT_SPAN for K = k) as the 4-d tensor word_map
    reads: [units of 16 rows, 256-k blocks, bits, 128 words] (a lane's 16-byte chunk j of a unit
    and block at [.., .., j, 4 lane])."""
    k_units = -(-k // 256)
    per_unit = k_units * bits * 128
    if words % per_unit:
        raise UnsupportedError(f"{words} words are not whole 16-row units of K = {k} at {bits} bits "
                               f"({per_unit} words a unit): pack them with pack_units")  # fmt: skip
    return words // per_unit, k_units, bits, 128


_OUT_MAPS: LRUCache[object] = LRUCache(64)


def output_map(out, block_t: int) -> object | None:
    """The TMA map of out [M, N] float16 in consumer-warp slabs of block_t tokens x 16 rows
    (cached by address and shape, as x_tensor_map's), or None where TMA cannot write it: its
    rows must start 16-byte aligned (N % 8 == 0 and an aligned base)."""

    m, n = out.shape
    if n % 8 or out.data_ptr() % 16:
        return None
    key = (out.data_ptr(), m, n, block_t)
    tma = _OUT_MAPS.get(key)
    if tma is None:
        tma = TensorMap.from_pointer(out.data_ptr(), f16, (1, m, n), (1, block_t, 16), swizzle=0)
        _OUT_MAPS.put(key, tma)
    return tma


_SLAB_MAPS: dict = {}


def _placeholder_slab_map(device, block_t: int) -> object:
    """A map of the output slab's box over a scratch tensor, for launches whose epilogue does not
    use TMA (the kernel takes the parameter either way); one a device and block_t."""
    import torch

    key = (device.index, block_t)
    have = _SLAB_MAPS.get(key)
    if have is None:
        slab = torch.empty(block_t * 16, dtype=torch.float16, device=device)
        have = _SLAB_MAPS[key] = (slab, TensorMap.from_pointer(slab.data_ptr(), f16, (1, block_t, 16), (1, block_t, 16),
                                                                   swizzle=0))  # fmt: skip
    return have[1]


# One map per weight's words (a model's linears: Llama's 1.1B has 154); a map encodes only the
# address and shape, so an address reused by another weight of that shape finds a valid map.
WORD_MAP_CACHE = 1024
_WORD_MAPS: LRUCache[object] = LRUCache(WORD_MAP_CACHE)


def word_map(words, k: int, bits: int) -> object:
    """The TMA map of the words in boxes of a tile's units x one 256-k block (cached by address
    and shape, as x_tensor_map's)."""

    shape = word_shape(words.numel(), k, bits)
    key = (words.data_ptr(), shape)
    tma = _WORD_MAPS.get(key)
    if tma is None:
        tma = TensorMap.from_pointer(words.data_ptr(), u32, shape, (ROWS // 16, 1, bits, 128), swizzle=0)
        _WORD_MAPS.put(key, tma)
    return tma
