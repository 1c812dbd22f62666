"""Low-bit weight x fp16 activation GEMM for decode sizes (M <= 16 per tile), written in tessera.

Y[m, n] = sum_k X[m, k] * W[n, k], W given as codes of any low-bit type (tessera.quant) with a
scale per (row, group) and optionally a bias (zero point) per (row, group):
    W[n, k] = (u[n, k] - bias[n, g]) * scale[n, g],   g = k // group_size
(u: the layout's code, offset binary for signed ints; tessera.ir.lowbit).  The weights are laid
out at pack time (tessera.quant.layout) so that each warp streams its 16-row tile with 16-byte
loads, 512 contiguous bytes per warp instruction, and `ts.dequant` turns the words straight
into m16n8k16 A fragments; the activations are the B operand (8 tokens per mma; the k order
is permuted so that each lane's activations are 16-byte loads too).  Blocks of a thread-block
cluster split K and add their partial tiles through distributed shared memory, so one launch
does everything (no workspace, no second kernel).  Tokens beyond 16 take more tiles in grid.y.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

import tessera as ts
from tessera import f16, f32, u32
from tessera.errors import UnsupportedError
from tessera.ir import lowbit
from tessera.ir.dtypes import DataType
from tessera.ir.instructions import DEQUANT_TYPES


@dataclass(frozen=True)
class DecodeConfig:
    """warps per block (each owns a 16-row tile), split (cluster size along K), unroll (units
    whose loads are issued together, register path), m_tiles (8-token mma tiles per launch
    tile: 1 or 2), stages (> 0: the weights stream through a cp.async ring of this many units
    per warp in shared memory instead of registers, scales prefetched with them; `unroll` is
    then unused), span (the weights' k order: 2 applies the scales to each group's fp32 sums
    after the mma, from groups of 32 on, so the dequantisation only rebuilds and subtracts), fold
    (with scales after the mma: the dequantisation only rebuilds the bits, `dequant(raw=True)`,
    and a second mma per step against the constant fragment -(raw_magic + bias) subtracts the
    magic, the signed offset and the zero point in the tensor core; groups under 32 subtract in
    the dequantisation as without fold), min_blocks (> 0: `__launch_bounds__` asks ptxas for
    registers that let this many blocks share an SM, so that the grid runs in one wave)."""

    warps: int = 4
    split: int = 4
    unroll: int = 2
    m_tiles: int = 2
    rows: int = 1  # 16-row tiles per warp (they share the warp's activation registers)
    x_units: int = 0  # > 0: the block's activations (at most this many units) staged in shared memory
    stages: int = 0  # > 0 (2..8): units in flight per warp through a shared-memory ring (cp.async)
    span: int = 16  # the weights' k order (tessera.ir.lowbit.lane_value_position); 2: scales after the mma
    fold: bool = False  # raw dequant, the offsets subtracted by a second mma (needs span 2)
    prefetch: bool = False  # register path: the next batch's loads go out before this batch's math
    min_blocks: int = 0  # > 0: blocks per SM the registers must allow (__launch_bounds__)

    @staticmethod
    def register_path(bits: int, m: int, n: int, k: int, sms: int) -> DecodeConfig:
        """The register path in span 16 for `sms` multiprocessors, from the H200 sweep at
        K=4096, N=12288 (commit 059ebcc): 4 warps; units per batch 8 / bits for 1..3 bits (1
        from 4 bits on at M <= 8, 2 at 4 bits beyond); K split until every SM has several blocks
        (at most 2 ways beyond 8 tokens); 2 row tiles per warp beyond 8 tokens (1 for 1-bit
        weights).  Activations are read from global memory (x_units is not measured yet)."""
        small = m <= 8
        unroll = {1: 8, 2: 4, 3: 2}.get(bits, 1 if small or bits > 4 else 2)
        warps, rows, m_tiles = 4, 1 if small or bits == 1 else 2, 1 if small else 2
        tiles = -(-n // 16)
        blocks = -(-tiles // (warps * rows))
        k_tiles = -(-k // 256)
        split, most = 1, 8 if small else 2
        while split < most and blocks * split < 4 * sms and k_tiles >= 2 * split * unroll:
            split *= 2
        return DecodeConfig(warps, split, unroll, m_tiles, rows)

    @staticmethod
    def default(bits: int, m: int, n: int, k: int, sms: int) -> DecodeConfig:
        """The kernel's choice.  M <= 8: the register path (`register_path`) in span 2, the
        offsets folded into a second mma: the fewest instructions per weight (bench/lowbit_sass.py).  Beyond 8 tokens: the 2-stage weight ring in span 2 (8 stages
        for 1-2 bits), two row tiles per warp where the block's ring stays within 32 KiB, the
        winners of the H200 sweep at dcce684 (bench/results/2026-11-22-h200-lowbit-dev-dcce684.md)."""
        r = DecodeConfig.register_path(bits, m, n, k, sms)
        if m <= 8:
            return dataclasses.replace(r, span=2, fold=True)
        stages = 8 if bits <= 2 else 2
        rows = 2 if bits > 1 and r.warps * stages * 2 * bits * 512 <= 32 * 1024 else 1
        return DecodeConfig(r.warps, r.split, 1, r.m_tiles, rows, 0, stages, 2)

    @staticmethod
    def streaming(bits: int, m: int, n: int, k: int, sms: int, warps: int = 4) -> DecodeConfig:
        """One wave in which every SM streams an equal share with its loads out early (issue
        12; the launch model of tessera/kernels/lowbit_launch.py): the register path in span 2
        with the offsets folded; the block's activations staged in shared memory by cp.async
        while its first weights are in flight, then read 16 bytes per two steps (no L2 round
        trip per unit); K split until the grid holds 16 (M <= 8) or 8 warps per SM and spreads
        evenly (the busiest SM within 10% of the mean); min_blocks = the busiest SM's blocks,
        so that ptxas keeps the registers to hold them all at once; as many units per batch
        as fit half of those registers, a third beyond 8 tokens (one row tile per warp at M <= 8
        or with 8 warps, else 2)."""
        small = m <= 8
        m_tiles, rows = (1 if small else 2), (1 if small or warps >= 8 else 2)
        k_tiles, row_tiles = -(-k // 256), -(-n // 16)
        per_split = -(-row_tiles // (warps * rows)) * -(-m // (8 * m_tiles))
        want = (16 if small else 8) * sms
        split = 1
        while split < min(8, k_tiles) and (per_split * split * warps < want
                                           or per_split * split / sms / -(-per_split * split // sms) < 0.9):  # fmt: skip
            split *= 2
        blocks = per_split * split
        min_blocks = min(-(-blocks // sms), 2048 // (32 * warps))
        units_k = -(-k_tiles // split)
        # weight registers: half the bound at M <= 8, a third with two token tiles (nvcc 13 then spills
        # at most a few words; more unroll spilled ~100 bytes)
        budget = 65536 // (min_blocks * 32 * warps) // (2 if small else 3)
        unroll = 1
        while unroll < min(8, units_k) and 2 * unroll * rows * 4 * bits <= budget:
            unroll *= 2
        return DecodeConfig(warps, split, unroll, m_tiles, rows, units_k, 0, 2, True, False, min_blocks)

    @staticmethod
    def candidates(bits: int, m: int, n: int, k: int, sms: int) -> dict[str, DecodeConfig]:
        """Configs worth timing for one shape (bench/lowbit_dev.py sweeps them), named by
        what differs from the default ("reg", the register path): pN = the cp.async weight
        ring with N stages (8 for 1-2 bits, whose units are small), k2 = span 2 (scales after
        the mma), f = fold (offsets subtracted by a second mma), pf = the register path's next
        batch loaded before this one's math, uN = N units per batch, sN =
        split N, r1 = one row tile per warp, x = activations staged per block; xa = `streaming`
        (one even wave, activations staged while the weights stream), xa8 = that with 8 warps
        per block (M <= 8), xa_nf = without fold, xa_b0 = without min_blocks; reg_b = the default with
        min_blocks for one wave."""
        d = DecodeConfig.default(bits, m, n, k, sms)
        xu = -(-k // 256 // d.split)
        out = {"reg": d, "r16": DecodeConfig.register_path(bits, m, n, k, sms)}  # r16: the span-16 register path
        d = out["r16"]  # the variants below vary the register path's shape
        for span in (16, 2):
            tag = "" if span == 16 else "k2"
            for p in (2, 4, 8) if bits <= 2 else (2, 4):
                out[f"p{p}{tag}"] = DecodeConfig(d.warps, d.split, 1, d.m_tiles, d.rows, 0, p, span)
        split = min(8, 2 * d.split)
        out[f"p4k2_s{split}"] = DecodeConfig(d.warps, split, 1, d.m_tiles, d.rows, 0, 4, 2)
        # the register path in span 2 (scales after the mma), then with the offsets folded into a second mma
        out["k2"] = DecodeConfig(d.warps, d.split, d.unroll, d.m_tiles, d.rows, 0, 0, 2)
        out["k2f"] = DecodeConfig(d.warps, d.split, d.unroll, d.m_tiles, d.rows, 0, 0, 2, True)
        if d.unroll == 1:  # two units' loads in flight per warp (the folded loop is short)
            out["k2f_u2"] = DecodeConfig(d.warps, d.split, 2, d.m_tiles, d.rows, 0, 0, 2, True)
        out["k2f_pf"] = DecodeConfig(d.warps, d.split, max(1, min(d.unroll, 2 // d.m_tiles)), d.m_tiles, d.rows, 0, 0,
                                     2, True, True)  # fmt: skip
        out["p2k2f"] = DecodeConfig(d.warps, d.split, 1, d.m_tiles, d.rows, 0, 2, 2, True)
        if d.rows > 1:  # one row tile per warp: half the ring (and more blocks per SM)
            out["p2k2_r1"] = DecodeConfig(d.warps, d.split, 1, d.m_tiles, 1, 0, 2, 2)
            out["p2k2f_r1"] = DecodeConfig(d.warps, d.split, 1, d.m_tiles, 1, 0, 2, 2, True)
        out["p4k2x"] = DecodeConfig(d.warps, d.split, 1, d.m_tiles, d.rows, xu, 4, 2)
        xa = out["xa"] = DecodeConfig.streaming(bits, m, n, k, sms)
        if m <= 8:  # (beyond 8 tokens its bound of 85 registers spills)
            out["xa8"] = DecodeConfig.streaming(bits, m, n, k, sms, 8)
        out["xa_nf"] = dataclasses.replace(xa, fold=False)
        out["xa_b0"] = dataclasses.replace(xa, min_blocks=0)
        reg = out["reg"]
        blocks = -(-n // (16 * reg.warps * reg.rows)) * reg.split * -(-m // (8 * reg.m_tiles))
        out["reg_b"] = dataclasses.replace(reg, min_blocks=min(-(-blocks // sms), 2048 // (32 * reg.warps)))
        return {name: c for name, c in out.items()
                if (name == "reg" or c != out["reg"]) and not c.problems() and c.smem_bytes(bits) <= 160 * 1024
                and c.min_blocks * (c.smem_bytes(bits) + 1024) <= 228 * 1024}  # fmt: skip

    def problems(self) -> list[str]:
        out = []
        if self.warps not in (1, 2, 4, 8):
            out.append("warps must be 1, 2, 4 or 8")
        if self.split not in (1, 2, 4, 8):
            out.append("split must be 1, 2, 4 or 8 (a portable cluster)")
        if self.unroll not in (1, 2, 4, 8):
            out.append("unroll must be 1, 2, 4 or 8")
        if self.m_tiles not in (1, 2):
            out.append("m_tiles must be 1 or 2")
        if self.rows not in (1, 2, 4):
            out.append("rows must be 1, 2 or 4")
        if self.x_units < 0 or x_smem_bytes(self.x_units, self.m_tiles) > 200 * 1024:
            out.append("x_units must be >= 0 and its shared activations fit 200 KiB")
        if self.stages not in (0, 2, 3, 4, 6, 8):
            out.append("stages must be 0 (register path) or 2, 3, 4, 6, 8")
        if self.span not in lowbit.SPANS:
            out.append(f"span must be one of {lowbit.SPANS}")
        if self.fold and self.span == 16:
            out.append("fold needs span 2 (scales applied after the mma)")
        if not 0 <= self.min_blocks <= 32 or self.min_blocks * 32 * self.warps > 2048:
            out.append("min_blocks must be 0..32 with min_blocks * 32 * warps <= 2048 threads per SM")
        if self.prefetch and (self.stages or self.unroll * self.m_tiles > 2):
            out.append("prefetch is for the register path (stages == 0; the ring prefetches by itself) with "
                       "unroll * m_tiles <= 2 (two sets of registers)")
        return out

    def smem_bytes(self, bits: int) -> int:
        """Shared memory of a block: weight ring, staged activations, split-K partials."""
        ring = self.warps * self.stages * self.rows * bits * 512
        part = 32 * self.warps * self.rows * self.m_tiles * 16 if self.split > 1 else 0
        return ring + (x_smem_bytes(self.x_units, self.m_tiles) if self.x_units else 0) + part

    def __str__(self) -> str:
        return (f"w{self.warps}_s{self.split}_u{self.unroll}_m{self.m_tiles}_r{self.rows}"
                f"{f'_x{self.x_units}' if self.x_units else ''}{f'_p{self.stages}' if self.stages else ''}"
                f"{f'_k{self.span}' if self.span != 16 else ''}{'_f' if self.fold else ''}{'_pf' if self.prefetch else ''}"
                f"{f'_b{self.min_blocks}' if self.min_blocks else ''}")


def x_smem_bytes(x_units: int, m_tiles: int) -> int:
    """Shared memory of the staged activations (see XROW in make_decode)."""
    return 8 * m_tiles * (x_units * 288 + (32 if x_units % 2 == 0 else 0)) * 2


def group_ok(group_size: int) -> bool:
    """Group sizes the kernel takes: a divisor of 64 that is a multiple of 4, or a multiple of 64."""
    return group_size > 0 and ((group_size % 64 == 0) or (64 % group_size == 0 and group_size % 4 == 0))


def scale_slots(span: int, group_size: int) -> tuple[int, int, tuple[int, ...]]:
    """(SPQ, NQ, QK): a unit's steps fall in NQ runs of SPQ steps whose k lie in one group for
    every lane; run q starts at k QK[q] + 4 * span * t of lane t (t = lane % 4)."""
    if span == 16:
        spq = min(16, math.gcd(group_size, 64) // 4)
    else:
        spq = min(16, math.gcd(group_size, 256) // 16) if group_size % 32 == 0 else (2 if group_size in (8, 16) else 1)
    nq = 16 // spq
    return spq, nq, tuple(16 * span * (q * spq // span) + 4 * (q * spq % span) for q in range(nq))


def unit_scales(values: np.ndarray, group_size: int, k_tiles: int) -> np.ndarray:
    """Per-group values [N, G] (scales or biases) in the order the span-2 kernel reads them with
    `unit_scales`: float16 [ceil(N / 16) * k_tiles * 8, 2 * NQ], row (tile * k_tiles + u) * 8 + g,
    column 2q + h the value of row tile * 16 + g + 8h for run q of unit u (the same group for the
    four lanes of g: span 2, groups of 32 and more); rows past N are 0.  One load per unit."""
    if group_size % 32:
        raise UnsupportedError(f"unit scales need span-2 groups of 32 or more, got {group_size}")
    _, nq, qk = scale_slots(2, group_size)
    n, g_count = values.shape
    nt = -(-n // 16)
    grp = np.minimum((np.arange(k_tiles)[:, None] * 256 + np.array(qk)[None, :]) // group_size, g_count - 1)  # [KT, NQ]
    rows = np.arange(nt)[:, None, None] * 16 + np.arange(8)[None, :, None] + 8 * np.arange(2)[None, None, :]  # [NT, 8, 2]
    padded = np.zeros((nt * 16, g_count), np.float16)
    padded[:n] = values
    out = padded[rows[:, None, :, None, :], grp[None, :, None, :, None]]  # [NT, KT, 8, NQ, 2]
    return np.ascontiguousarray(out.reshape(nt * k_tiles * 8, 2 * nq))


@functools.cache
def make_decode(wtype: DataType, group_size: int, has_bias: bool, config: DecodeConfig,
                k_whole: bool = False, unit_scaled: bool = False) -> ts.Kernel:  # fmt: skip
    """kernel(X [M, K] f16, Wq [words] u32, S [N, G] f16, B [N, G] f16, Y [M, N] f16, N, KT).

    KT = padded K / 256 (the packed k tiles); B is read only when `has_bias`.  `k_whole`: the
    caller promises K % 256 == 0, so no activation load needs a bound check (the kernel reads
    past the row otherwise).  `unit_scaled`: S and B come as `unit_scales` lays them out (span 2,
    groups of 32 on), one vector load per unit and row tile."""
    if wtype.name not in DEQUANT_TYPES:
        raise UnsupportedError(f"the low-bit decode kernel takes {', '.join(DEQUANT_TYPES)}, not {wtype}")
    if not group_ok(group_size):
        raise UnsupportedError(f"group size {group_size}: the decode kernel takes multiples of 64 or 4, 8, 16, 32")
    problems = config.problems()
    if config.smem_bytes(wtype.nbits) > 220 * 1024:
        problems.append(f"its shared memory ({config.smem_bytes(wtype.nbits)} bytes for {wtype}) exceeds 220 KiB")
    if problems:
        raise UnsupportedError(f"decode config {config}: {'; '.join(problems)}")
    T, BITS, GS, HAS_BIAS = wtype, wtype.nbits, group_size, has_bias
    WARPS, SPLIT, UNROLL, MT, R = config.warps, config.split, config.unroll, config.m_tiles, config.rows
    XU, P = config.x_units, config.stages
    PF = config.prefetch
    MIN_BLOCKS = config.min_blocks
    SLOTS = P if P else UNROLL * (2 if PF else 1)  # register slots of weights and scales: one per unit in flight
    HALVES = (0, 1) if PF else (0,)  # prefetch: two register sets, loaded and computed in turn
    LOAD_SET = tuple(h * UNROLL if PF else 0 for h in HALVES)
    COMP_SET = tuple((1 - h) * UNROLL if PF else 0 for h in HALVES)
    XPF = PF and XU == 0  # prefetch the activations from global memory with the weights
    # shared activations [8 * MT tokens, XU units x 4 lanes' 64 k + 8 halves of padding each]; the
    # row length keeps a row 64 bytes off the next modulo 128: a warp's 16-byte reads hit no bank twice
    XROW = XU * 288 + (32 if XU % 2 == 0 else 0)
    THREADS = 32 * WARPS
    WORDS = 4 * BITS  # one lane's words of one unit
    SPAN = config.span
    SPQ, NQ, QK = scale_slots(SPAN, GS)  # scale slots: runs of SPQ steps whose k lie in one group for every lane
    AFTER = SPAN != 16 and GS % 32 == 0  # every step's 16 k in one group: scale the fp32 sums
    if unit_scaled and not AFTER:
        raise UnsupportedError(f"unit scales need span 2 and groups of 32 or more (config {config}, group {GS})")
    SC_BYTES = min(16, 4 * NQ)  # unit scales: one row of 2 * NQ halves per unit and row tile, in 16-byte pieces
    SC_Q = SC_BYTES // 4
    SC_COPIES = NQ // SC_Q
    # (a float's zero point would need the raw unit too: floats with zero points subtract in the dequant)
    FOLD = config.fold and AFTER and not (T.is_float and HAS_BIAS)
    # raw halves of the small floats are value * 2**-raw_shift, the scales carry 2**float_shift
    RAW_UNIT = 2.0 ** (lowbit.raw_shift(T) - lowbit.float_shift(T)) if FOLD and T.is_float else 1.0
    # FOLD: register r of step s holds raw_magic + u; the second mma adds -(raw_magic + bias) x
    MAGIC = tuple(lowbit.raw_magic(T, reg) + (0 if HAS_BIAS else lowbit.code_offset(T)) for reg in range(64))
    CORRECT = FOLD and (HAS_BIAS or any(MAGIC))  # floats without zero points need no second mma
    # the correction fragment changes at step s (new magics, or a new group's zero points)
    # one constant fragment for every step (no zero points, the same magics): set once, before the loop
    AC_ONCE = CORRECT and not HAS_BIAS and all(MAGIC[4 * s:4 * s + 4] == MAGIC[:4] for s in range(16))
    REFILL = tuple(not AC_ONCE and (s == 0 or MAGIC[4 * s:4 * s + 4] != MAGIC[4 * s - 4:4 * s]
                                    or (HAS_BIAS and s % SPQ == 0)) for s in range(16))  # fmt: skip

    # k within a unit of step s's value 0 in lane t: 16 SPAN (s // SPAN) + 4 (s % SPAN) + KT_LANE t
    KT_LANE = 4 * SPAN
    UG = 256 // GS if 256 % GS == 0 else 0  # groups per unit: the group index is u * UG + lg[q]
    STEPS, EIGHT, QS = tuple(range(16)), tuple(range(8)), tuple(range(NQ))
    name = (f"lowbit_decode_{T.name}_g{GS}{'_z' if HAS_BIAS else ''}_{config}{'_kw' if k_whole else ''}"
            f"{'_us' if unit_scaled else ''}")

    @ts.kernel(target="cuda", name=name)
    def decode(X: f16["M", "K"], Wq: u32["W"], S: f16["NS", "G"], B: f16["NB", "GB"], Y: f16["M", "N"],
               KT: ts.int32):  # fmt: skip
        ts.attrs.grid = (ts.ceil_div(ts.ceil_div(N, 16), WARPS * R) * SPLIT, ts.ceil_div(M, 8 * MT))
        ts.attrs.block = THREADS
        if MIN_BLOCKS:
            ts.attrs.min_blocks = MIN_BLOCKS
        if SPLIT > 1:
            ts.attrs.cluster = (SPLIT, 1, 1)
        wr = ts.register_tensor(u32, [1 if P else SLOTS, R, WORDS])
        xr = ts.register_tensor(f16, [SLOTS if XPF else 1, MT, 64])
        sc = ts.register_tensor(f16, [SLOTS, R, NQ, 2])
        bz = ts.register_tensor(f16, [SLOTS, R, NQ, 2])
        # one group's unscaled sums (AFTER): even and odd steps, or (CORRECT) the weights' and the corrections' mmas
        accg = ts.register_tensor(f32, [2, R, MT, 4])
        a = ts.register_tensor(f16, [8])
        ac = ts.register_tensor(f16, [R, 8])  # FOLD: the correction fragment -(raw_magic + bias)
        acc = ts.register_tensor(f32, [2, R, MT, 4])  # two sets: even and odd steps' mmas overlap
        tid = ts.thread_idx.x
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        bx = ts.block_idx.x
        rank = bx % SPLIT
        nt0 = ((bx // SPLIT) * WARPS + tid // 32) * R  # this warp's first 16-row tile
        m_base = ts.block_idx.y * (8 * MT)
        per_split = ts.ceil_div(KT, SPLIT)
        u_begin = rank * per_split
        u_end = min(u_begin + per_split, KT)
        xs = ts.shared_tensor(f16, [8 * MT, XROW if XU > 0 else 8])
        lg = ts.register_tensor(ts.int32, [NQ])  # the lane's group of scale slot q within a unit (UG)
        for q in QS:  # compile-time: indexes QK
            lg[q] = (KT_LANE * t + QK[q]) // GS
        for c in ts.unroll(2):
            for r in ts.unroll(R):
                for i in ts.unroll(MT):
                    for e in ts.unroll(4):
                        acc[c, r, i, e] = 0.0
        for c in ts.unroll(2):
            for r in ts.unroll(R):
                for i in ts.unroll(MT):
                    for e in ts.unroll(4):
                        accg[c, r, i, e] = 0.0
        if AC_ONCE:
            for r in ts.unroll(R):
                for e in EIGHT:
                    ac[r, e] = -MAGIC[e // 2]
        n_units = u_end - u_begin
        if XU > 0:  # the activations, in the layout's k order (zero-filled outside M, K)
            for idx in range(tid, 8 * MT * XU * 32, THREADS):
                row = idx // (XU * 32)
                col = idx % (XU * 32)
                m = m_base + row
                k = (u_begin + col // 32) * 256 + (col % 32) * 8
                c16 = col % 32  # the chunk's lane t and 16-byte register j in the layout's k order
                xt = (c16 % (2 * SPAN)) // (SPAN // 2)
                xj = (c16 // (2 * SPAN)) * (SPAN // 2) + c16 % (SPAN // 2)
                dst = (col // 32) * 288 + xt * 72 + xj * 8
                ok = m < M and k < K and col // 32 < n_units
                # asynchronous (zero-filled where not ok): the ring's first group of copies, or the
                # register path's own group, awaited after its first weight loads are out
                ts.copy_async(xs[row, dst], X[ts.select(ok, m, 0), ts.select(ok, k, 0)], 16, ok)
            if P == 0:
                ts.copy_async_commit()
        if P > 0:
            warp = tid // 32
            wsm = ts.shared_tensor(u32, [WARPS, P, R, BITS, 128])  # each lane reads back only its own copies
            # Iteration `it` copies unit it + P - 1 into slot pp and computes unit it (slot (pp + 1) % P);
            # it0 = 1 - P (mod P), so both slots are compile-time and the scales stay in registers.
            for it0 in range(1 - P, n_units, P):
                for pp in ts.unroll(P):
                    it = it0 + pp
                    cs = (pp + 1) % P
                    if it < n_units:
                        if it >= 0:
                            ts.copy_async_wait(P - 2)  # this lane's copies of unit it have landed
                            if XU > 0 and it == 0:
                                ts.syncthreads()  # ... and every thread's activations
                            for r in ts.unroll(R):
                                for j in ts.unroll(BITS):
                                    ts.copy_vector(wr[0, r, 4 * j], wsm[warp, cs, r, j, lane * 4], 16)
                        lu = u_begin + it + P - 1
                        for r in ts.unroll(R):
                            ok = lu < u_end and (nt0 + r) * 16 < N
                            for j in ts.unroll(BITS):
                                src = ((((nt0 + r) * KT + lu) * BITS + j) * 32 + lane) * 4
                                ts.copy_async(wsm[warp, pp, r, j, lane * 4], Wq[ts.select(ok, src, 0)], 16, ok)
                            if unit_scaled:
                                srow = min(((nt0 + r) * KT + min(lu, KT - 1)) * 8 + g, NS - 1)
                                for c in ts.unroll(SC_COPIES):
                                    ts.copy_vector(sc[pp, r, c * SC_Q, 0], S[srow, c * 2 * SC_Q], SC_BYTES)
                                    if HAS_BIAS:
                                        ts.copy_vector(bz[pp, r, c * SC_Q, 0], B[srow, c * 2 * SC_Q], SC_BYTES)
                            else:
                                for q in QS:  # compile-time: indexes QK
                                    grp = min(min(lu, KT - 1) * UG + lg[q], G - 1) if UG else min(
                                        (min(lu, KT - 1) * 256 + KT_LANE * t + QK[q]) // GS, G - 1)
                                    for h in ts.unroll(2):
                                        row = min((nt0 + r) * 16 + g + 8 * h, NS - 1)
                                        sc[pp, r, q, h] = S[row, grp]
                                        if HAS_BIAS:
                                            bz[pp, r, q, h] = B[row, grp]
                        ts.copy_async_commit()
                        if it >= 0:
                            u = u_begin + it
                            for i in ts.unroll(MT):
                                m = m_base + i * 8 + g  # tokens past M read token M - 1: their columns are never stored
                                for j in ts.unroll(8):
                                    if XU > 0:
                                        ts.copy_vector(xr[0, i, j * 8], xs[i * 8 + g, it * 288 + t * 72 + j * 8], 16)
                                    else:
                                        k = u * 256 + KT_LANE * t + 16 * SPAN * (2 * j // SPAN) + 4 * (2 * j % SPAN)
                                        if k_whole:  # every unit is whole: no bound check, no zero fill
                                            ts.copy_vector(xr[0, i, j * 8], X[min(m, M - 1), k], 16)
                                        elif k < K:
                                            ts.copy_vector(xr[0, i, j * 8], X[min(m, M - 1), k], 16)
                                        else:
                                            for e in ts.unroll(8):
                                                xr[0, i, j * 8 + e] = 0.0
                            for s in STEPS:
                                q = s // SPQ
                                for r in ts.unroll(R):
                                    if FOLD:
                                        ts.dequant(a[0], wr[0, r, 0], wtype=T, start=8 * s, count=8, raw=True)
                                    elif AFTER and HAS_BIAS:
                                        ts.dequant(a[0], wr[0, r, 0], bias=bz[cs, r, q, 0], wtype=T, start=8 * s, count=8)
                                    elif AFTER:
                                        ts.dequant(a[0], wr[0, r, 0], wtype=T, start=8 * s, count=8)
                                    elif HAS_BIAS:
                                        ts.dequant(a[0], wr[0, r, 0], sc[cs, r, q, 0], bz[cs, r, q, 0], wtype=T,
                                                   start=8 * s, count=8)
                                    else:
                                        ts.dequant(a[0], wr[0, r, 0], sc[cs, r, q, 0], wtype=T, start=8 * s, count=8)
                                    for i in ts.unroll(MT):
                                        if AFTER:
                                            ts.mma(accg[0 if CORRECT else s % 2, r, i, 0], a[0], xr[0, i, 4 * s])
                                        else:
                                            ts.mma(acc[s % 2, r, i, 0], a[0], xr[0, i, 4 * s])
                                    if CORRECT:
                                        if REFILL[s]:
                                            for e in EIGHT:  # compile-time: indexes MAGIC
                                                if HAS_BIAS:
                                                    ac[r, e] = -(bz[cs, r, q, (e // 2) % 2] + MAGIC[4 * s + e // 2])
                                                else:
                                                    ac[r, e] = -MAGIC[4 * s + e // 2]
                                        for i in ts.unroll(MT):
                                            ts.mma(accg[1, r, i, 0], ac[r, 0], xr[0, i, 4 * s])
                                if AFTER and s % SPQ == SPQ - 1:  # the group's sums, scaled per row
                                    for r in ts.unroll(R):
                                        for i in ts.unroll(MT):
                                            for e in ts.unroll(4):
                                                if RAW_UNIT != 1.0:
                                                    acc[0, r, i, e] += ts.cast(sc[cs, r, q, e // 2], f32) * RAW_UNIT * (
                                                        accg[0, r, i, e] + accg[1, r, i, e])
                                                else:
                                                    acc[0, r, i, e] += ts.cast(sc[cs, r, q, e // 2], f32) * (
                                                        accg[0, r, i, e] + accg[1, r, i, e])
                                                for c in ts.unroll(2):
                                                    accg[c, r, i, e] = 0.0
            ts.copy_async_wait(0)  # the tail's (zero-filling) copies land before the block leaves
        elif XU > 0 or nt0 * 16 < N:  # staged activations: every warp meets the block barrier below
            # batches of UNROLL units: every load of a batch first (weights, scales), then its math;
            # with prefetch the loads of the next batch go out before the math of this one
            # (register sets alternate: the loop starts one batch early and takes two per pass)
            for u00 in range(u_begin - UNROLL if PF else u_begin, u_end, UNROLL * len(HALVES)):
                for hb in HALVES:  # compile-time: the register sets
                    ub = u00 + hb * UNROLL  # the batch computed in this half
                    for uu in ts.unroll(UNROLL):
                        u = ub + (UNROLL if PF else 0) + uu
                        ls = LOAD_SET[hb] + uu
                        if u < u_end:
                            for r in ts.unroll(R):
                                if (nt0 + r) * 16 < N:
                                    for j in ts.unroll(BITS):
                                        ts.copy_vector(wr[ls, r, 4 * j],
                                                       Wq[((((nt0 + r) * KT + u) * BITS + j) * 32 + lane) * 4], 16)
                                if unit_scaled:
                                    srow = min(((nt0 + r) * KT + u) * 8 + g, NS - 1)
                                    for c in ts.unroll(SC_COPIES):
                                        ts.copy_vector(sc[ls, r, c * SC_Q, 0], S[srow, c * 2 * SC_Q], SC_BYTES)
                                        if HAS_BIAS:
                                            ts.copy_vector(bz[ls, r, c * SC_Q, 0], B[srow, c * 2 * SC_Q], SC_BYTES)
                                else:
                                    for q in QS:  # compile-time: indexes QK
                                        grp = min(u * UG + lg[q], G - 1) if UG else min(
                                            (u * 256 + KT_LANE * t + QK[q]) // GS, G - 1)
                                        for h in ts.unroll(2):
                                            row = min((nt0 + r) * 16 + g + 8 * h, NS - 1)
                                            sc[ls, r, q, h] = S[row, grp]
                                            if HAS_BIAS:
                                                bz[ls, r, q, h] = B[row, grp]
                            if XPF:  # this unit's activations, with its weights
                                for i in ts.unroll(MT):
                                    m = m_base + i * 8 + g  # tokens past M read token M - 1: never stored
                                    for j in ts.unroll(8):
                                        k = u * 256 + KT_LANE * t + 16 * SPAN * (2 * j // SPAN) + 4 * (2 * j % SPAN)
                                        if k_whole:
                                            ts.copy_vector(xr[ls, i, j * 8], X[min(m, M - 1), k], 16)
                                        elif k < K:
                                            ts.copy_vector(xr[ls, i, j * 8], X[min(m, M - 1), k], 16)
                                        else:
                                            for e in ts.unroll(8):
                                                xr[ls, i, j * 8 + e] = 0.0
                    if XU > 0:
                        if ub == u_begin:  # the first batch's weights are in flight: now the activations
                            ts.copy_async_wait(0)
                            ts.syncthreads()
                    for uu in ts.unroll(UNROLL):
                        cs = COMP_SET[hb] + uu
                        if ub + uu < u_end and (ub >= u_begin if PF else True):
                            # activations per unit (L1/L2 hits: every warp of the block reads the same ones;
                            # with prefetch from global memory they came with the weights)
                            if XU == 0 and not XPF:
                                for i in ts.unroll(MT):
                                    m = m_base + i * 8 + g  # tokens past M read token M - 1: their columns are never stored
                                    for j in ts.unroll(8):
                                        k = (ub + uu) * 256 + KT_LANE * t + 16 * SPAN * (2 * j // SPAN) + 4 * (2 * j % SPAN)
                                        if k_whole:  # every unit is whole: no bound check, no zero fill
                                            ts.copy_vector(xr[0, i, j * 8], X[min(m, M - 1), k], 16)
                                        elif k < K:
                                            ts.copy_vector(xr[0, i, j * 8], X[min(m, M - 1), k], 16)
                                        else:
                                            for e in ts.unroll(8):
                                                xr[0, i, j * 8 + e] = 0.0
                            for s in STEPS:  # a compile-time list: dequant's start is a constant
                                q = s // SPQ
                                if XU > 0 and s % 2 == 0:  # staged activations: 16 bytes per two steps, as needed
                                    for i in ts.unroll(MT):
                                        ts.copy_vector(xr[0, i, 4 * s], xs[i * 8 + g, (ub + uu - u_begin) * 288 + t * 72 + 4 * s],
                                                       16)  # fmt: skip
                                for r in ts.unroll(R):
                                    if FOLD:
                                        ts.dequant(a[0], wr[cs, r, 0], wtype=T, start=8 * s, count=8, raw=True)
                                    elif AFTER and HAS_BIAS:
                                        ts.dequant(a[0], wr[cs, r, 0], bias=bz[cs, r, q, 0], wtype=T, start=8 * s, count=8)
                                    elif AFTER:
                                        ts.dequant(a[0], wr[cs, r, 0], wtype=T, start=8 * s, count=8)
                                    elif HAS_BIAS:
                                        ts.dequant(a[0], wr[cs, r, 0], sc[cs, r, q, 0], bz[cs, r, q, 0], wtype=T,
                                                   start=8 * s, count=8)
                                    else:
                                        ts.dequant(a[0], wr[cs, r, 0], sc[cs, r, q, 0], wtype=T, start=8 * s, count=8)
                                    for i in ts.unroll(MT):
                                        if AFTER:
                                            ts.mma(accg[0 if CORRECT else s % 2, r, i, 0], a[0], xr[cs if XPF else 0, i, 4 * s])
                                        else:
                                            ts.mma(acc[s % 2, r, i, 0], a[0], xr[cs if XPF else 0, i, 4 * s])
                                    if CORRECT:
                                        if REFILL[s]:
                                            for e in EIGHT:  # compile-time: indexes MAGIC
                                                if HAS_BIAS:
                                                    ac[r, e] = -(bz[cs, r, q, (e // 2) % 2] + MAGIC[4 * s + e // 2])
                                                else:
                                                    ac[r, e] = -MAGIC[4 * s + e // 2]
                                        for i in ts.unroll(MT):
                                            ts.mma(accg[1, r, i, 0], ac[r, 0], xr[cs if XPF else 0, i, 4 * s])
                                if AFTER and s % SPQ == SPQ - 1:  # the group's sums, scaled per row
                                    for r in ts.unroll(R):
                                        for i in ts.unroll(MT):
                                            for e in ts.unroll(4):
                                                if RAW_UNIT != 1.0:
                                                    acc[0, r, i, e] += ts.cast(sc[cs, r, q, e // 2], f32) * RAW_UNIT * (
                                                        accg[0, r, i, e] + accg[1, r, i, e])
                                                else:
                                                    acc[0, r, i, e] += ts.cast(sc[cs, r, q, e // 2], f32) * (
                                                        accg[0, r, i, e] + accg[1, r, i, e])
                                                for c in ts.unroll(2):
                                                    accg[c, r, i, e] = 0.0
            if XU > 0:
                ts.copy_async_wait(0)  # a block without units still staged (zeros): they land before it leaves
        # acc[c, r, i, e]: token m_base + 8i + 2t + e % 2, row (nt0 + r) * 16 + g + 8 (e // 2)
        for r in ts.unroll(R):
            for i in ts.unroll(MT):
                for e in ts.unroll(4):
                    acc[0, r, i, e] += acc[1, r, i, e]
        if SPLIT == 1:
            for r in ts.unroll(R):
                for i in ts.unroll(MT):
                    for e in ts.unroll(4):
                        m = m_base + i * 8 + 2 * t + e % 2
                        n = (nt0 + r) * 16 + g + 8 * (e // 2)
                        if m < M and n < N:
                            Y[m, n] = acc[0, r, i, e]
        else:
            part = ts.shared_tensor(f32, [THREADS, R, MT, 4])
            for r in ts.unroll(R):
                for i in ts.unroll(MT):
                    for e in ts.unroll(4):
                        part[tid, r, i, e] = acc[0, r, i, e]
            ts.cluster_sync()
            if tid % SPLIT == rank:  # each block of the cluster adds and writes 1/SPLIT of the threads' results
                got = ts.register_tensor(f32, [4])
                for r in ts.unroll(R):
                    for i in ts.unroll(MT):
                        for e in ts.unroll(4):
                            acc[0, r, i, e] = 0.0
                        for c in ts.unroll(SPLIT):
                            ts.load_cluster(got[0], part[tid, r, i, 0], c, 16)
                            for e in ts.unroll(4):
                                acc[0, r, i, e] += got[e]
                        for e in ts.unroll(4):
                            m = m_base + i * 8 + 2 * t + e % 2
                            n = (nt0 + r) * 16 + g + 8 * (e // 2)
                            if m < M and n < N:
                                Y[m, n] = acc[0, r, i, e]
            ts.cluster_sync()  # no block leaves while the others read its partials

    return decode
