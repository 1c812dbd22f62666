"""Low-bit prefill GEMM for SM90: the weights dequantised inside the TMA GEMM's mainloop.

Y[m, n] = sum_k X[m, k] W[n, k] with X [1, M, K] float16 read by TMA and W given as the words of
the decode kernel (tessera.quant.layout.pack_units, k order span 2) with [N, G] float16 scales
and optional zero points, as tessera.templates.lowbit.dequant takes them.  One thread block per SM
walks the output tiles (tessera.templates.gemm.tma's persistent schedule and rasterisation):

* warpgroup 0 dequantises: each warp owns block_n / 64 units of 16 weight rows; per 256 k of
  the tile it loads those units' words and scales into registers (`bits` 16-byte loads per lane
  and unit), then for each of the four 64-k stages it waits for the stage to be free, has thread
  0 issue the TMA load of X's tile, turns its rows' 64 k into fp16 with `ts.dequant` (the decode
  kernel's bit tricks) and stores them as 16-byte chunks into the stage's 128-byte-swizzled B
  tile, the layout wgmma reads; a proxy fence, then one arrival per warp on the stage's `full`
  barrier (with the TMA's transaction bytes);
* warpgroups 1 and 2 consume as the fp16 GEMM does: m64nBNk16 wgmmas from the stage, one k-tile
  in flight, then the staged epilogue (16-byte row segments; tessera.templates.epilogue
  fuses the caller's epilogue there).

So no fp16 copy of the weights exists anywhere, and the tensor cores never wait on a separate
dequantisation pass.  The words' span-2 order is what makes a 64-k stage cheap: lane t of a
unit holds k [32j + 8t, 32j + 8t + 8) after steps 2j and 2j + 1, so the four stages of 256 k
are the steps 4b..4b + 3 of every lane (tessera.ir.lowbit.lane_value_position).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import tessera as ts
from tessera import f16, f32, u32, u64
from tessera.errors import UnsupportedError
from tessera.ir import lowbit
from tessera.ir.dtypes import DataType
from tessera.ir.instructions import DEQUANT_TYPES
from tessera.runtime.cuda import multiprocessor_count
from tessera.runtime.lru import LRUCache
from tessera.runtime.tensor_map import TensorMap
from tessera.templates.gemm import tma as gemm_tma
from tessera.templates.gemm.tma import BLOCK_K, GROUP_M, SWIZZLE_128B, TmaConfig, c_pairs
from tessera.templates.lowbit.decode import scale_slots
from tessera.templates.lowbit.decode_config import group_ok
from tessera.templates.lowbit.dequant import CHUNK_HALVES

SPAN = 2  # the words' k order this kernel reads (tessera.ir.lowbit.SPANS)
DEQUANT_WARPS = 4
# The block's registers: what it is launched with (ptxas gives a setmaxnreg kernel the 168 per
# thread its launch bounds, 384 threads x 1 block, allow); setmaxnreg only moves them between
# warpgroups (an increase waits, forever, for registers the others never released).
REGISTERS = 168 * 384
# (block_m, block_n, stages) the prefill kernel is built with; the first is the default.
TILES = ((256, 128, 3), (128, 256, 3), (128, 128, 4))


@dataclass(frozen=True)
class PrefillConfig(TmaConfig):
    """The GEMM's tile and pipeline (two consumer warpgroups, the staged epilogue), and whether
    the dequantising warps `spread` their stores: a quarter warp (lanes of rows 2q and 2q + 1)
    writes its two rows' 16-byte chunks t of a stage's k in one store and chunks 4 + t in the
    next, so both land in the same half of the 128-byte swizzle and meet in each bank twice;
    spread, the odd rows store the other pair of steps first (32 selects per unit and stage)
    and no bank is met twice (tests/test_lowbit_gemm.py counts them).  Which is faster is the
    tuner's to measure (more instructions against fewer shared-memory wavefronts)."""

    spread: bool = False

    def __str__(self) -> str:
        return super().__str__() + ("_sp" if self.spread else "")


def stores_spread(config: TmaConfig) -> bool:
    """Whether `config` asks for the spread store order (a plain TmaConfig does not)."""
    return bool(getattr(config, "spread", False))


def prefill_config(block_m: int = 256, block_n: int = 128, stages: int = 3, spread: bool = False) -> PrefillConfig:
    """The kernel's config: tile, stages and the dequantisers' store order (PrefillConfig)."""
    return PrefillConfig(block_m, block_n, stages, 2, epilogue="staged", spread=spread)


def producer_registers(bits: int, block_n: int, group_size: int, has_bias: bool, spread: bool = False) -> int:
    """Registers per thread the dequantising warpgroup needs (ptxas spills below it, measured
    with -Xptxas -v at groups 32/128/per channel, with and without zero points): its units'
    words, their scales (and zero points), one register per half, plus ~68 for addresses (the
    next 256 k's loads among them) and the values of a stage, ~12 more per unit for the spread
    stores' selects."""
    units = block_n // (16 * DEQUANT_WARPS)
    scales = units * len(scale_slots(SPAN, group_size)[2]) * 2 * (2 if has_bias else 1)
    return -(-(units * 4 * bits + scales + 68 + (12 * units if spread else 0)) // 8) * 8


def register_split(bits: int, block_n: int, group_size: int, has_bias: bool, spread: bool = False) -> tuple[int, int]:
    """(dequantising, consuming) warpgroups' registers per thread (setmaxnreg, multiples of 8,
    128 * first + 256 * second <= REGISTERS): the dequantisers what they need (at least 112), the
    consumers (block_n / 2 float32 accumulators per m64 slab) the rest, up to 232."""
    producer = min(168, max(112, producer_registers(bits, block_n, group_size, has_bias, spread)))
    return producer, min(232, (REGISTERS - 128 * producer) // 256 // 8 * 8)


def problems(wtype: DataType, group_size: int, has_bias: bool, config: TmaConfig) -> list[str]:
    """Why the kernel cannot be built for these arguments (empty when it can)."""
    out = list(config.problems())
    if wtype.name not in DEQUANT_TYPES:
        out.append(f"the low-bit prefill kernel takes {', '.join(DEQUANT_TYPES)}, not {wtype}")
    if not group_ok(group_size):
        out.append(f"group size {group_size}: the kernel takes multiples of 64 or 4, 8, 16, 32")
    if config.consumers != 2 or config.epilogue != "staged" or config.split_k != 1:
        out.append("the prefill kernel has two consumer warpgroups, the staged epilogue and no split-k")
    if config.block_n % 64:
        out.append(f"block_n must be a multiple of 64 (16 rows per dequantising warp), got {config.block_n}")
    # (the estimate is conservative by up to 8: int8 with groups of 32 and zero points needs 168)
    if not out and producer_registers(wtype.nbits, config.block_n, group_size, has_bias, stores_spread(config)) > 176:
        out.append(f"the {wtype} words and scales of {config.block_n} weight rows need more than the 168 registers "
                   "a dequantising thread can have; use a smaller block_n")  # fmt: skip
    return out


def buildable_configs(wtype: DataType, group_size: int, has_bias: bool) -> list[TmaConfig]:
    """The configs of TILES (both store orders) the kernel builds with for these weights (a
    tuner's candidates)."""
    configs = (prefill_config(*tile, spread=order) for tile in TILES for order in (False, True))
    return [c for c in configs if not problems(wtype, group_size, has_bias, c)]


def word_loads(bits: int) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[tuple[int, int], ...], ...]]:
    """(all, per_stage) loads of a lane's unit words, (first word, bytes) each: `all` the
    `bits` 16-byte chunks of 256 k; per_stage[b] the words 64-k stage b (steps 4b..4b + 3)
    reads (tessera.ir.lowbit.stage_words) as aligned 16-, 8- or 4-byte loads.  After stage b
    they are dead: the kernels reload them for the next 256 k there, so the loads' latency hides
    behind the later stages."""
    return tuple((4 * j, 16) for j in range(bits)), tuple(_vectors(lowbit.stage_words(bits, b)) for b in range(4))


def _vectors(words: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Ascending word indices as loads no wider than their alignment (16-byte chunks of 4 words)."""
    out, i = [], 0
    while i < len(words):
        w = words[i]
        n = next(n for n in (4, 2, 1) if w % n == 0 and words[i : i + n] == tuple(range(w, w + n)))
        out.append((w, 4 * n))
        i += n
    return tuple(out)


def slots_after(steps_per_slot: int, slots: int) -> tuple[tuple[int, ...], ...]:
    """Per 64-k stage b, the scale runs (of `steps_per_slot` steps each) whose last step is in
    it: reloaded for the next 256 k after it, as the words are (word_loads)."""
    return tuple(tuple(q for q in range(slots) if ((q + 1) * steps_per_slot - 1) // 4 == b) for b in range(4))


@ts.inline
def load_unit(wr, sc, bz, Wq, S, Z, uu, unit, ku, k_units, n_units, lane, t4, g, G, NS, words, slots, bits, kt_lane, qk,
              group_size, has_bias):  # fmt: skip
    """Unit `uu`'s `words` ((first word, bytes) loads) and scale runs `slots` of 256-k block `ku`
    into registers: run q's group is that of k ku * 256 + kt_lane * t4 + qk[q] (units past N,
    the tile's padding rows, read the last one: their columns are never stored).  A lane's
    16-byte chunk j of a unit lies at ((unit * k_units + ku) * bits + j) * 32 + lane."""
    nt = min(unit, n_units - 1)
    for w, nbytes in words:
        ts.copy_vector(wr[uu, w], Wq[(((nt * k_units + ku) * bits + w // 4) * 32 + lane) * 4 + w % 4], nbytes)
    for q in slots:
        grp = min((ku * 256 + kt_lane * t4 + qk[q]) // group_size, G - 1)
        for h in ts.unroll(2):
            row = min(nt * 16 + g + 8 * h, NS - 1)
            sc[uu, q, h] = S[row, grp]
            if has_bias:
                bz[uu, q, h] = Z[row, grp]


@ts.inline
def tile_origins(t, stride, tiles_m, per_z, group_tiles, group, block_m, block_n, m0, n0, next_n0):
    """Tile t's origin (m0, n0) in the persistent schedule's rasterisation (gemm_tma's: groups of
    `group` m tiles), and next_n0, that of the block's next tile t + stride (the last tile's own
    when there is none): the weights the kernels prefetch are the next tile's.  (The assignments
    are the caller's variables, as ts.inline binds them.)"""
    first = (t // group_tiles) * group
    rows = min(tiles_m - first, group)
    m0 = (first + (t % group_tiles) % rows) * block_m  # noqa: F841
    n0 = ((t % group_tiles) // rows) * block_n  # noqa: F841
    tn = min(t + stride, per_z - 1)
    first_n = (tn // group_tiles) * group
    next_n0 = ((tn % group_tiles) // min(tiles_m - first_n, group)) * block_n  # noqa: F841


@functools.cache
def make_lowbit_gemm(wtype: DataType, group_size: int, has_bias: bool, config: PrefillConfig) -> ts.Kernel:
    """kernel(A [1, M, K] f16, Wq u32, S [NS, G] f16, Z [NB, GB] f16, C [1, M, N] f16, tma_a, ctas).

    `group_size` is the kernel group (the padded K for per-channel scales, as
    lowbit_dequant.make_dequant_units takes it); Z is read only when `has_bias`.  tma_a maps A
    with box (1, block_m, 64) (zero fill past M and K); ctas = config.grid(M, N, 1, SMs).  K % 8 == 0."""
    bad = problems(wtype, group_size, has_bias, config)
    if bad:
        raise UnsupportedError(f"low-bit prefill GEMM {wtype} g{group_size} {config}: {'; '.join(bad)}")
    T, BITS, GS, HAS_BIAS = wtype, wtype.nbits, group_size, has_bias
    BM, BN, BK, STAGES, SLABS = config.block_m, config.block_n, BLOCK_K, config.stages, config.slabs
    UPW = BN // (16 * DEQUANT_WARPS)  # units (16 weight rows) per dequantising warp
    SPQ, _, QK = scale_slots(SPAN, group_size)
    QS, UNITS, BLOCKS, PAIRS, HALVES, EIGHT = (tuple(range(n)) for n in (len(QK), UPW, 4, 2, 2, 8))
    KT_LANE = 4 * SPAN  # lane t's k offset within each 32 k of a unit
    A_BYTES = BM * BK * 2
    TA = ts.tensor_map(f16, (1, BM, BK))
    C_FRAG_PAIRS = c_pairs(BN)
    SPREAD = stores_spread(config)
    REGS = register_split(BITS, BN, GS, HAS_BIAS, SPREAD)
    GROUP = GROUP_M
    ALL_WORDS, STAGE_WORDS = word_loads(BITS)
    SLOTS_AFTER = slots_after(SPQ, len(QK))

    name = f"lowbit_gemm_{T.name}_g{GS}{'_z' if HAS_BIAS else ''}_{BM}x{BN}_s{STAGES}{'_sp' if SPREAD else ''}"

    @ts.kernel(target="cuda", name=name)
    def gemm(A: f16["batch", "M", "K"], Wq: u32["W"], S: f16["NS", "G"], Z: f16["NB", "GB"], C: f16["zdim", "M", "N"],
             tma_a: TA, ctas: ts.int32):  # fmt: skip
        ts.attrs.grid = ctas
        ts.attrs.block = 384
        ts.attrs.min_blocks = 1
        As = ts.shared_tensor(f16, [STAGES, BM, BK], swizzle=SWIZZLE_128B)
        Bs = ts.shared_tensor(f16, [STAGES, BN, BK], swizzle=SWIZZLE_128B)
        full = ts.shared_tensor(u64, [STAGES])
        empty = ts.shared_tensor(u64, [STAGES])
        Cs = ts.shared_tensor(f16, [8, 16, BN + 8])  # the staged epilogue's rows, per consumer warp
        tid = ts.thread_idx.x
        wg = tid // 128
        # full: the TMA's expect_tx, then each dequantising warp's rows; empty: each consumer warpgroup
        gemm_tma.init_ring(full, empty, tid, STAGES, 1 + DEQUANT_WARPS, 2)
        tiles_m = ts.ceil_div(M, BM)
        tiles_n = ts.ceil_div(N, BN)
        per_z = tiles_m * tiles_n
        group_tiles = GROUP * tiles_n
        k_units = ts.ceil_div(K, 256)
        n_units = ts.ceil_div(N, 16)
        stage = 0
        phase = 0
        if wg == 0:
            ts.setmaxnreg(REGS[0], False)
            lane = tid % 32
            warp = tid // 32
            g = lane // 4
            t4 = lane % 4
            wr = ts.register_tensor(u32, [UPW, 4 * BITS])
            sc = ts.register_tensor(f16, [UPW, len(QK), 2])
            bz = ts.register_tensor(f16, [UPW, len(QK), 2])
            a = ts.register_tensor(f16, [2, 16])  # both pairs of steps of a stage
            o = ts.register_tensor(f16, [2, 8])
            m0 = 0
            n0 = 0
            next_n0 = 0  # the next 256 k's words and scales: this tile's, or the next tile's first
            for t in range(ts.block_idx.x, per_z, ts.grid_dim.x):
                tile_origins(t, ts.grid_dim.x, tiles_m, per_z, group_tiles, GROUP, BM, BN, m0, n0, next_n0)
                if t == ts.block_idx.x:  # the block's first tile: nothing was prefetched
                    for uu in UNITS:
                        load_unit(wr, sc, bz, Wq, S, Z, uu, n0 // 16 + warp * UPW + uu, 0, k_units, n_units, lane, t4,
                                  g, G, NS, ALL_WORDS, QS, BITS, KT_LANE, QK, GS, HAS_BIAS)  # fmt: skip
                for ku in range(k_units):
                    nku = ku + 1
                    nn0 = n0
                    if nku == k_units:
                        nku = 0
                        nn0 = next_n0
                    for b in BLOCKS:  # compile-time: the dequant's steps 4b..4b + 3
                        ts.mbarrier_wait(empty[stage], phase ^ 1)
                        if tid == 0:
                            ts.mbarrier_arrive_expect_tx(full[stage], A_BYTES)
                            ts.tma_load(As[stage, 0, 0], tma_a, full[stage], 0, m0, ku * 256 + b * BK)
                        for uu in UNITS:
                            for jj in PAIRS:  # steps 4b + 2jj and 4b + 2jj + 1: k chunk 4jj + t4 of the stage
                                for p in HALVES:
                                    if HAS_BIAS:
                                        ts.dequant(a[jj, 8 * p], wr[uu, 0], sc[uu, (4 * b + 2 * jj + p) // SPQ, 0],
                                                   bz[uu, (4 * b + 2 * jj + p) // SPQ, 0], wtype=T,
                                                   start=8 * (4 * b + 2 * jj + p), count=8)  # fmt: skip
                                    else:
                                        ts.dequant(a[jj, 8 * p], wr[uu, 0], sc[uu, (4 * b + 2 * jj + p) // SPQ, 0],
                                                   wtype=T, start=8 * (4 * b + 2 * jj + p), count=8)  # fmt: skip
                            # this stage's words and scale runs are dead: load the next 256 k's in their place
                            load_unit(wr, sc, bz, Wq, S, Z, uu, nn0 // 16 + warp * UPW + uu, nku, k_units, n_units, lane,
                                      t4, g, G, NS, STAGE_WORDS[b], SLOTS_AFTER[b], BITS, KT_LANE, QK, GS,
                                      HAS_BIAS)  # fmt: skip
                            for s in PAIRS:  # store slot s: pair s, or with SPREAD pair s ^ (g % 2)
                                for h in HALVES:
                                    for e in EIGHT:
                                        if SPREAD:  # (odd rows: the other pair)
                                            o[h, e] = a[1 - s, CHUNK_HALVES[h][e]] if g % 2 else a[s, CHUNK_HALVES[h][e]]
                                        else:
                                            o[h, e] = a[s, CHUNK_HALVES[h][e]]
                                    ts.copy_vector(Bs[stage, (warp * UPW + uu) * 16 + g + 8 * h,
                                                      (4 * (s ^ (g % 2) if SPREAD else s) + t4) * 8], o[h, 0], 16)  # fmt: skip
                        ts.fence_proxy_async()  # the generic-proxy stores, before wgmma reads them
                        ts.syncwarp()
                        if lane == 0:
                            ts.mbarrier_arrive(full[stage])
                        stage += 1
                        if stage == STAGES:
                            stage = 0
                            phase ^= 1
        else:
            ts.setmaxnreg(REGS[1], True)
            acc = ts.register_tensor(f32, [SLABS, BN // 2])
            lane = tid % 128
            row0 = (wg - 1) * SLABS * 64
            last = 0
            m0 = 0
            n0 = 0
            next_n0 = 0
            for t in range(ts.block_idx.x, per_z, ts.grid_dim.x):
                tile_origins(t, ts.grid_dim.x, tiles_m, per_z, group_tiles, GROUP, BM, BN, m0, n0, next_n0)
                gemm_tma.consume_tile(acc, As, Bs, full, empty, stage, phase, last, k_units * 4, row0, lane, SLABS,
                                      BN, STAGES, False)  # fmt: skip
                for sl in ts.unroll(SLABS):
                    gemm_tma.store_staged_rows(C, Cs, acc, sl, 0, m0, n0, row0, lane, wg, M, N, f16, BN, C_FRAG_PAIRS)

    return gemm


_MAPS: LRUCache[object] = LRUCache(64)  # x's tensor maps by (address, M, K, rows)


def x_tensor_map(x, out, rows: int, kernel: str) -> object:
    """The TMA map of x [M, K] in boxes of `rows` x 64 (cached by address and shape: a map only
    encodes those and the box), after checking x and out [M, N] as the prefill kernels take them."""
    import torch

    m, k = x.shape
    n = out.shape[1]
    if x.dtype != torch.float16 or out.dtype != torch.float16 or tuple(out.shape) != (m, n) or not out.is_contiguous():
        raise UnsupportedError(f"the {kernel} takes float16 x [M, K] and a contiguous float16 out [M, N], got "
                               f"{x.dtype} {list(x.shape)} and {out.dtype} {list(out.shape)}")  # fmt: skip
    if k % 8 or not x.is_contiguous() or x.data_ptr() % 16:
        raise UnsupportedError(f"the {kernel} reads x by TMA: contiguous, 16-byte aligned rows (K % 8 == 0), "
                               f"got K = {k}")  # fmt: skip
    key = (x.data_ptr(), m, k, rows)
    tma = _MAPS.get(key)
    if tma is None:
        tma = TensorMap.from_pointer(x.data_ptr(), f16, (1, m, k), (1, rows, BLOCK_K))
        _MAPS.put(key, tma)
    return tma


def lowbit_gemm(x, words, scales, biases, out, wtype: DataType, group_size: int, has_bias: bool,
                config: TmaConfig | None = None) -> None:  # fmt: skip
    """out [M, N] float16 <- x [M, K] float16 @ W^T on torch CUDA tensors, W the weights in
    `words` (pack_units in span 2) with [N, G] float16 scales and biases; `group_size` as
    make_lowbit_gemm takes it; `config` one of `buildable_configs` (prefill_config() by default)."""

    m, k = x.shape
    n = out.shape[1]
    config = config or prefill_config()
    tma_a = x_tensor_map(x, out, config.block_m, "low-bit prefill GEMM")
    kernel = make_lowbit_gemm(wtype, group_size, has_bias, config)
    ctas = config.grid(m, n, 1, multiprocessor_count())  # (persistent: one block per SM, at most one per tile)
    kernel(x.view(1, m, k), words, scales, biases, out.view(1, m, n), tma_a, ctas)
