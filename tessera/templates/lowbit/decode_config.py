"""The decode kernel's configurations (tessera/templates/lowbit/decode.py): what a launch varies,
the default choice per shape, the candidates bench/lowbit_dev.py sweeps, and their checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.ir import lowbit
from tessera.target import SM90

DECODE_MAX_M = 64  # larger M: dequantise to fp16, then the tensor-core GEMM (prefill)


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
    registers that let this many blocks share an SM, so that the grid runs in one wave),
    interleave (register path with staged activations: the batch's units advance step by step
    together, each into its own accumulators, so their mma chains overlap; units past the
    block's end are computed on zero activations instead of branched around)."""

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
    interleave: bool = False  # the batch's units step together, one accumulator set each (needs x_units)

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
        winners of the H200 sweep at dcce684 (bench/results/2026-11-22-h200-lowbit-dev-dcce684.md),
        with min_blocks so that the grid runs in one wave (the sweep at 62bc338: M=16 int4 30.9 ->
        20.9 us, every type 18-22 us where it took 26-37)."""
        r = DecodeConfig.register_path(bits, m, n, k, sms)
        if m <= 8:
            return dataclasses.replace(r, span=2, fold=True)
        stages = 8 if bits <= 2 else 2
        rows = 2 if bits > 1 and r.warps * stages * 2 * bits * 512 <= 32 * 1024 else 1
        per_sm = -(-(-(-n // (16 * r.warps * rows)) * r.split * -(-m // (8 * r.m_tiles))) // sms)
        # (beyond 4 blocks per SM the bound would squeeze the registers into spills: several waves then)
        return DecodeConfig(r.warps, r.split, 1, r.m_tiles, rows, 0, stages, 2, min_blocks=per_sm if per_sm <= 4 else 0)

    @staticmethod
    def streaming(bits: int, m: int, n: int, k: int, sms: int, warps: int = 4) -> DecodeConfig:
        """One wave in which every SM streams an equal share with its loads out early (issue
        12; the launch model of tessera/templates/lowbit/launch.py): the register path in span 2
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
        min_blocks = min(-(-blocks // sms), SM90.threads_per_sm // (32 * warps))
        units_k = -(-k_tiles // split)
        # weight registers: half the bound at M <= 8, a third with two token tiles (nvcc 13 then spills
        # at most a few words; more unroll spilled ~100 bytes)
        budget = SM90.registers_per_sm // (min_blocks * 32 * warps) // (2 if small else 3)
        unroll = 1
        while unroll < min(8, units_k) and 2 * unroll * rows * 4 * bits <= budget:
            unroll *= 2
        return DecodeConfig(warps, split, unroll, m_tiles, rows, units_k, 0, 2, True, False, min_blocks)

    @staticmethod
    def candidates(bits: int, m: int, n: int, k: int, sms: int) -> dict[str, DecodeConfig]:
        """Configs worth timing for one shape (bench/lowbit_dev.py sweeps them), named by
        what differs from the default ("reg", the register path): pN = the cp.async weight
        ring with N stages (4 and 8 only for 1-2 bits, whose units are small), k2 = span 2
        (scales after the mma), f = fold (offsets subtracted by a second mma), pf = the register
        path's next batch loaded before this one's math, uN = N units per batch, r1 = one row
        tile per warp, x = activations staged per block; xa = `streaming` (one even wave,
        activations staged while the weights stream), xa8 = that with 8 warps per block
        (M <= 8), xa_nf = without fold, xa_b0 = without min_blocks, xa_pf = prefetching
        (up to 4 bits at M <= 8, 2 beyond), xa_il = interleaved (M <= 8,
        half the split); reg_b = the default with min_blocks for one wave.  The span-16 rings,
        the 4-stage ring from 3 bits on and the doubled split were dropped after two H200 sweeps
        (dcce684, 02c490e) where they never won and ran 2-20 us behind."""
        d = DecodeConfig.default(bits, m, n, k, sms)
        xu = -(-k // 256 // d.split)
        out = {"reg": d, "r16": DecodeConfig.register_path(bits, m, n, k, sms)}  # r16: the span-16 register path
        d = out["r16"]  # the variants below vary the register path's shape
        for p in (2, 4, 8) if bits <= 2 else (2,):
            out[f"p{p}k2"] = DecodeConfig(d.warps, d.split, 1, d.m_tiles, d.rows, 0, p, 2)
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
        if bits <= (4 if m <= 8 else 2):  # prefetching: the next batch's weights load during this one's math
            # (wider weights, or two token tiles from 3 bits on, spill ~100 bytes under the bound with nvcc 13)
            out["xa_pf"] = dataclasses.replace(xa, prefetch=True, unroll=max(1, xa.unroll // 2 // xa.m_tiles))
        if m <= 8 and xa.split > 1:  # interleaved: ~100-150 registers (ptxas, no spills), so half the split
            split = xa.split // 2
            blocks = -(-n // (16 * xa.warps)) * split
            out["xa_il"] = dataclasses.replace(xa, split=split, unroll=4 if bits <= 2 else 2, x_units=-(-k // 256 // split),
                                               min_blocks=-(-blocks // sms), interleave=True)  # fmt: skip
        reg = out["reg"]
        blocks = -(-n // (16 * reg.warps * reg.rows)) * reg.split * -(-m // (8 * reg.m_tiles))
        out["reg_b"] = dataclasses.replace(reg, min_blocks=min(-(-blocks // sms), SM90.threads_per_sm // (32 * reg.warps)))
        return {name: c for name, c in out.items()
                if (name == "reg" or c != out["reg"]) and not c.problems() and c.smem_bytes(bits) <= 160 * 1024
                and c.min_blocks * (c.smem_bytes(bits) + SM90.smem_reserved_per_block) <= SM90.smem_per_sm}  # fmt: skip

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
        if self.interleave and (self.stages or self.prefetch or not self.x_units or self.unroll == 1):
            out.append("interleave is for the register path with staged activations (stages 0, x_units > 0, "
                       "no prefetch) and several units per batch (unroll > 1)")
        if self.prefetch and (self.stages or self.unroll * self.m_tiles > 2):
            out.append("prefetch is for the register path (stages == 0; the ring prefetches by itself) with "
                       "unroll * m_tiles <= 2 (two sets of registers)")
        return out

    def smem_bytes(self, bits: int) -> int:
        """Shared memory of a block: weight ring, staged activations, split-K partials."""
        ring = self.warps * self.stages * self.rows * bits * 512
        part = 32 * self.warps * self.rows * self.m_tiles * 16 if self.split > 1 else 0
        return ring + (x_smem_bytes(self.staged_units, self.m_tiles) if self.x_units else 0) + part

    @property
    def staged_units(self) -> int:
        """Units of activations staged in shared memory: x_units, rounded up to whole batches
        when interleaved (a batch past the block's end reads zeros there)."""
        return -(-self.x_units // self.unroll) * self.unroll if self.interleave else self.x_units

    def __str__(self) -> str:
        return (f"w{self.warps}_s{self.split}_u{self.unroll}_m{self.m_tiles}_r{self.rows}"
                f"{f'_x{self.x_units}' if self.x_units else ''}{f'_p{self.stages}' if self.stages else ''}"
                f"{f'_k{self.span}' if self.span != 16 else ''}{'_f' if self.fold else ''}{'_pf' if self.prefetch else ''}"
                f"{f'_b{self.min_blocks}' if self.min_blocks else ''}{'_il' if self.interleave else ''}")


def x_smem_bytes(x_units: int, m_tiles: int) -> int:
    """Shared memory of the staged activations (see XROW in make_decode)."""
    return 8 * m_tiles * (x_units * 288 + (32 if x_units % 2 == 0 else 0)) * 2


def group_ok(group_size: int) -> bool:
    """Group sizes the kernel takes: a divisor of 64 that is a multiple of 4, or a multiple of 64."""
    return group_size > 0 and ((group_size % 64 == 0) or (64 % group_size == 0 and group_size % 4 == 0))
