"""What bounds one launch of the low-bit decode kernel (issue 12): a model, no GPU needed.

For a `DecodeConfig` at one shape it computes the grid against the SMs (resident blocks per
SM from threads, registers and shared memory; waves; how evenly the blocks spread), the
weight bytes each SM has in flight, the length of each warp's serial chain (units streamed
one after another, DRAM round trips, activation round trips, dependent mmas) and the launch's
fixed parts (launches per call, the split-K reduction tail).  `bench/lowbit_dev.py` prints it
next to the timings; the register count comes from the built cubin (`cubin_registers`).

The latency constants are rough Hopper figures (loaded HBM latency, L2 hit, mma.sync chain);
the estimate ranks configs and names the bound, it does not predict microseconds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from tessera.target import SM90
from tessera.templates.lowbit.decode_config import DecodeConfig

# sm_90 per-SM limits (tessera.target's table)
SM_REGISTERS = SM90.registers_per_sm
SM_THREADS = SM90.threads_per_sm
SM_BLOCKS = SM90.blocks_per_sm
SM_SHARED = SM90.smem_per_sm
BLOCK_RESERVED_SHARED = SM90.smem_reserved_per_block  # the driver's per-block reservation
REGISTER_GRANULE = SM90.register_granule  # registers are allocated per warp in these
# rough latencies in cycles at ~1.9 GHz (an estimate's terms, not measurements)
DRAM_CYCLES = 1600  # HBM under a full-chip stream (~0.8 us)
L2_CYCLES = 500  # an L2 hit under load
MMA_CYCLES = 33  # mma.sync m16n8k16 f32, dependent issue to issue
MMA_ISSUE = 6  # cycles of one SM sub-partition's tensor pipe per mma.sync m16n8k16
CLOCK_GHZ = 1.9
# what a warp's pass over one unit costs in issue besides its mmas (bench/lowbit_sass.py: ~140-400)
UNIT_INSTRUCTIONS = 170


@dataclass(frozen=True)
class LaunchModel:
    """One launch of the decode kernel, as `launch_model` sees it."""

    registers: int  # per thread, from the cubin
    blocks: int  # grid size (x * y)
    per_sm: int  # blocks one SM holds at once
    limit: str  # what caps per_sm: threads, registers, shared, blocks
    waves: int  # rounds the busiest SM runs (1: every block resident from the start)
    fill: float  # mean blocks per SM over the busiest SM's (1.0: even spread)
    warps_per_sm: float  # resident warps per SM, mean over the chip in the first round
    units_per_warp: int  # 16 x 256 weight tiles one warp streams
    round_trips: int  # dependent DRAM round trips in one warp's chain (weights; activations staged synchronously)
    act_trips: int  # dependent activation loads (L1/L2) in one warp's chain
    mma_chain: int  # dependent mmas in one warp's chain
    inflight_kib: float  # weight bytes in flight per SM, KiB (resident warps x bytes issued before first use)
    launches: int  # kernel launches per call
    tail: str  # the split-K reduction: none, or through the cluster's shared memory
    chain_us: float  # one warp's serial chain, times the waves
    stream_us: float  # the weights at the measured copy bandwidth given in_flight (Little's law)
    mma_us: float  # the busiest sub-partition's tensor pipe
    issue_us: float  # the busiest sub-partition's instruction issue

    @property
    def bound(self) -> str:
        terms = {"chain": self.chain_us, "stream": self.stream_us, "mma": self.mma_us, "issue": self.issue_us}
        return max(terms, key=terms.get)

    def line(self) -> str:
        return (f"grid {self.blocks} ({self.per_sm}/SM by {self.limit}, {self.waves} wave{'s' * (self.waves > 1)}, "
                f"fill {self.fill:.2f}) {self.warps_per_sm:.0f} warps/SM {self.inflight_kib:.0f} KiB in flight/SM | "
                f"warp: {self.units_per_warp} units, {self.round_trips} DRAM + {self.act_trips} act trips, "
                f"{self.mma_chain} dep. mmas | {self.launches} launch, tail {self.tail} | est chain "
                f"{self.chain_us:.1f} stream {self.stream_us:.1f} mma {self.mma_us:.1f} issue {self.issue_us:.1f} us: "
                f"{self.bound}")  # fmt: skip


def resident_blocks(threads: int, registers: int, shared: int) -> tuple[int, str]:
    """(blocks an SM holds at once, the limit that decides it) for sm_90."""
    per_warp = -(-registers * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    warps = -(-threads // 32)
    limits = {
        "threads": SM_THREADS // threads,
        "registers": SM_REGISTERS // (per_warp * warps),
        "shared": SM_SHARED // (shared + BLOCK_RESERVED_SHARED),
        "blocks": SM_BLOCKS,
    }
    limit = min(limits, key=limits.get)
    return limits[limit], limit


def launch_model(config: DecodeConfig, bits: int, m: int, n: int, k: int, sms: int, registers: int,
                 bandwidth_gbs: float = 4200.0) -> LaunchModel:  # fmt: skip
    """The launch of `config` for weights of `bits` at M x N x K on `sms` SMs, its kernel
    using `registers` per thread (cubin_registers)."""
    c = config
    k_tiles = -(-k // 256)
    row_tiles = -(-n // 16)
    blocks_x = -(-row_tiles // (c.warps * c.rows)) * c.split
    blocks = blocks_x * -(-m // (8 * c.m_tiles))
    per_sm, limit = resident_blocks(32 * c.warps, registers, c.smem_bytes(bits) + 16 * c.m_tiles * 8)
    per_sm = max(per_sm, 1)  # (0: the launch fails; the model still says one)
    busiest = -(-blocks // sms)  # blocks of the busiest SM over the whole launch
    waves = -(-busiest // per_sm)
    first = min(blocks, per_sm * sms)  # blocks resident in the first round
    warps_per_sm = first * c.warps / sms
    fill = blocks / sms / busiest
    units_k = -(-k_tiles // c.split)  # k units of one warp, in order
    units = units_k * c.rows
    unit_bytes = bits * 512
    if c.stages:
        ahead = (c.stages - 1) * c.rows
        round_trips = -(-units_k // max(c.stages - 1, 1))
    else:
        ahead = c.unroll * c.rows * (2 if c.prefetch else 1)
        round_trips = -(-units_k // c.unroll)
    ahead = min(ahead, units)
    # the register path reads each unit's activations before its math (an L2 round trip), unless they
    # come with the weights (prefetch) or were staged in shared memory (cp.async, beside the first weights)
    act_trips = 0 if (c.x_units or c.prefetch) else units_k
    # dependent mmas: each of a unit's 16 steps adds into the same accumulator pair (two chains);
    # interleaved, the batch's units run their chains side by side
    mma_chain = units_k * 8 // (c.unroll if c.interleave else 1)
    inflight = ahead * unit_bytes * min(warps_per_sm, busiest * c.warps)
    chain_cycles = round_trips * DRAM_CYCLES + act_trips * L2_CYCLES + mma_chain * MMA_CYCLES
    chain_us = waves * chain_cycles / (CLOCK_GHZ * 1e3)
    sm_bytes = busiest * c.warps * units * unit_bytes  # the busiest SM's weights
    # Little's law: an SM streams at most in_flight / latency, and the chip at most the copy bandwidth
    latency_us = DRAM_CYCLES / (CLOCK_GHZ * 1e3)
    sm_rate = min(inflight / latency_us, bandwidth_gbs * 1e3 / sms) if inflight else 1e-9  # bytes per us
    stream_us = sm_bytes / sm_rate
    mmas_per_step = c.m_tiles * c.rows * (2 if c.fold else 1)  # (fold: the integers' second mma)
    warp_units = busiest * c.warps * units_k  # the busiest SM's warp passes over a unit
    mma_us = warp_units * 16 * mmas_per_step * MMA_ISSUE / 4 / (CLOCK_GHZ * 1e3)
    issue_us = warp_units * c.rows * (UNIT_INSTRUCTIONS + 16 * mmas_per_step) / 4 / (CLOCK_GHZ * 1e3)
    tail = f"cluster of {c.split} (DSMEM, 2 cluster syncs)" if c.split > 1 else "none"
    return LaunchModel(registers, blocks, per_sm, limit, waves, fill, warps_per_sm, units, round_trips, act_trips, mma_chain,
                       inflight / 1024, 1, tail, chain_us, stream_us, mma_us, issue_us)  # fmt: skip


EIATTR_REGCOUNT = 0x2F


def cubin_registers(path: str | Path) -> int:
    """Registers per thread of the (single) kernel in a cubin: the EIATTR_REGCOUNT record of
    its .nv.info section (what `ptxas -v` prints), read from the ELF without CUDA tools."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path} is not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    entsize, count, names = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * entsize) for i in range(count)]
    base = sections[names][4]

    def name(off: int) -> bytes:
        return data[base + off:data.index(b"\0", base + off)]

    found = []
    for sec in sections:
        if name(sec[0]) != b".nv.info":
            continue
        pos, end = sec[4], sec[4] + sec[5]
        while pos + 4 <= end:
            fmt, attr = data[pos], data[pos + 1]
            if fmt == 4:  # EIFMT_SVAL: a 16-bit length, then the value
                size = struct.unpack_from("<H", data, pos + 2)[0]
                if attr == EIATTR_REGCOUNT:
                    found.append(struct.unpack_from("<I", data, pos + 8)[0])
                pos += 4 + size
            else:
                pos += 4
    if len(found) != 1:
        raise ValueError(f"{path}: expected one kernel's register count, found {len(found)}")
    return found[0]
