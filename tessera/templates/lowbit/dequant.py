"""Low-bit weights dequantised to a row-major fp16 matrix on CUDA, read from the words the decode
kernel holds (the prefill path: dequantise once per call, then the tensor-core fp16 GEMM).

The input is the pack-time unit layout (tessera.quant.layout.pack_units: uint32
[N/16][K/256][bits][32 lanes][4 words], k in the order `span`, tessera.ir.lowbit), the same
words `PreparedWeight.words_for(span)` and the graph operator's `words` hold, so no second copy
of the codes lives on the device.  Scales and zero points come as the decode kernel's plain
[N, G] float16 tensors (`PreparedWeight.scales` / `.biases`, the graph's `scales` / `biases`):
W[n, k] = (u - bias[n, g]) * scale[n, g] in the terms of the `dequant` instruction.

Each warp turns one 16 x 256 unit into fp16: `bits` 16-byte loads of its words (512 contiguous
bytes per warp instruction), `ts.dequant` on them (the decode kernel's bit tricks, shared), then
a pass through shared memory, because a lane's 128 values are scattered over two rows
(lowbit.lane_value_position): lane (g, t) owns rows g and g + 8, and per pair of steps 8
consecutive k of each, chunk 8t + j of the row in span 16 (k in [64t, 64t + 64)), chunk 4j + t
in span 2.  The lanes write those 16-byte chunks into the warp's 16 x 256 tile, then each lane
reads back chunk `lane` of a row: every global store instruction writes one whole 512-byte row
segment.  The tile is swizzled at 16-byte granularity (chunk c of row r at c ^ ((c >> 3) & 3)
^ 4 (r & 1), within its 128-byte group) so that neither the writes of either span nor the
row reads meet a bank twice in a quarter warp.

Rounding: the instruction computes fp16(u - bias), then fp16(that * scale) (HSUB2, HMUL2).  For
the integer types with integer biases (what quantisation makes: zero point + offset) the
difference is exact, so each weight is the exact product rounded once: bit-identical to
`tessera.graph.opdefs.lowbit.dequantized_weight` cast to float16.  Small floats without zero
points are exact too (the half holds value * 2**-float_shift exactly, the scale carries the
power).  Two cases round differently, both shared with the decode kernel: a bias that is not an
integer is rounded to one where it is added to the magic 2**(10 - d) (off by at most
half a unit of the code, times the scale); a small float with a zero point subtracts in fp16
first, so the weight is rounded twice (within one fp16 ulp of the exact value).
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f16, u32
from tessera.errors import UnsupportedError
from tessera.ir.dtypes import DataType
from tessera.ir.instructions import DEQUANT_TYPES
from tessera.ir.lowbit import SPANS
from tessera.templates.lowbit.decode import scale_slots
from tessera.templates.lowbit.decode_config import group_ok

DEFAULT_WARPS = 4  # per block, one unit each: 32 KiB of tiles, ~6 blocks per SM (bench/lowbit_prefill.py times others)

# a[i] of a pair of steps (a[0..7] step 2j, a[8..15] step 2j + 1: half i % 2 of register i // 2)
# that go to the chunk of row g + 8h: registers h and h + 2 of each step (rows alternate)
CHUNK_HALVES = tuple(tuple(8 * s + 4 * r + 2 * h + e for s in (0, 1) for r in (0, 1) for e in (0, 1)) for h in (0, 1))


def swizzle(chunk: int, row: int) -> int:
    """Where 16-byte chunk `chunk` (0..31) of tile row `row` lies in the warp's shared tile
    (the kernel computes the same; tests check that it permutes each row and avoids conflicts)."""
    return chunk ^ ((chunk >> 3) & 3) ^ (4 * (row & 1))


def lane_chunk(span: int, lane: int, pair: int) -> int:
    """The 16-byte chunk (k // 8 within the unit) of rows g and g + 8 that lane `lane` holds
    after dequantising steps 2 * pair and 2 * pair + 1 (see lowbit.lane_value_position)."""
    t = lane % 4
    return 8 * t + pair if span == 16 else 4 * pair + t


@functools.cache
def make_dequant_units(wtype: DataType, group_size: int, has_bias: bool, span: int = 16,
                       warps: int = DEFAULT_WARPS) -> ts.Kernel:  # fmt: skip
    """kernel(Wq [words] u32, S [NS, G] f16, B [NB, GB] f16, Out [N, K] f16): Out = the weights.

    `group_size` is the kernel group (the padded K for per-channel scales, as the decode kernel
    takes it: tessera.templates.lowbit.decode_config.group_ok); B is read only when `has_bias`
    (a [1, 1] placeholder otherwise); K % 8 == 0 (16-byte rows; the caller checks).  Only the
    real N x K is written.  One warp per unit, `warps` warps per block, an 8 KiB tile each."""
    if wtype.name not in DEQUANT_TYPES:
        raise UnsupportedError(f"the low-bit dequantiser takes {', '.join(DEQUANT_TYPES)}, not {wtype}")
    if not group_ok(group_size):
        raise UnsupportedError(f"group size {group_size}: the dequantiser takes multiples of 64 or 4, 8, 16, 32")
    if span not in SPANS:
        raise UnsupportedError(f"the words' k order is one of {SPANS}, got span {span}")
    if warps not in (1, 2, 4, 8):
        raise UnsupportedError(f"warps must be 1, 2, 4 or 8, got {warps}")
    T, BITS, GS, HAS_BIAS, SPAN, WARPS = wtype, wtype.nbits, group_size, has_bias, span, warps
    SPQ, _, QK = scale_slots(span, group_size)  # runs of SPQ steps in one group for every lane
    QS = tuple(range(len(QK)))
    KT_LANE = 4 * span  # lane t's k offset within a block of 16 * span k
    PAIRS, ROWS, HALVES, EIGHT = tuple(range(8)), tuple(range(16)), (0, 1), tuple(range(8))
    name = f"lowbit_dequant_{T.name}_g{GS}{'_z' if HAS_BIAS else ''}_k{SPAN}_w{WARPS}"

    @ts.kernel(target="cuda", name=name)
    def dequant(Wq: u32["W"], S: f16["NS", "G"], B: f16["NB", "GB"], Out: f16["N", "K"]):
        ts.attrs.grid = ts.ceil_div(ts.ceil_div(N, 16) * ts.ceil_div(K, 256), WARPS)
        ts.attrs.block = 32 * WARPS
        tile = ts.shared_tensor(f16, [WARPS, 16, 256])
        wr = ts.register_tensor(u32, [4 * BITS])
        sc = ts.register_tensor(f16, [len(QK), 2])
        bz = ts.register_tensor(f16, [len(QK), 2])
        a = ts.register_tensor(f16, [16])
        o = ts.register_tensor(f16, [2, 8])
        tid = ts.thread_idx.x
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        k_tiles = ts.ceil_div(K, 256)
        u = ts.block_idx.x * WARPS + warp  # this warp's unit: (row tile u // k_tiles, k tile u % k_tiles)
        if u < ts.ceil_div(N, 16) * k_tiles:
            nt = u // k_tiles
            kt = u % k_tiles
            for j in ts.unroll(BITS):
                ts.copy_vector(wr[4 * j], Wq[((u * BITS + j) * 32 + lane) * 4], 16)
            for q in QS:  # compile-time: indexes QK
                grp = min((kt * 256 + KT_LANE * t + QK[q]) // GS, G - 1)
                for h in ts.unroll(2):
                    row = min(nt * 16 + g + 8 * h, NS - 1)  # rows past N (the layout's padding): never stored
                    sc[q, h] = S[row, grp]
                    if HAS_BIAS:
                        bz[q, h] = B[row, grp]
            for j in PAIRS:  # compile-time: dequant's start
                for p in HALVES:  # steps 2j and 2j + 1 (inline: a local would be a run-time value)
                    if HAS_BIAS:
                        ts.dequant(a[8 * p], wr[0], sc[(2 * j + p) // SPQ, 0], bz[(2 * j + p) // SPQ, 0], wtype=T,
                                   start=8 * (2 * j + p), count=8)
                    else:
                        ts.dequant(a[8 * p], wr[0], sc[(2 * j + p) // SPQ, 0], wtype=T, start=8 * (2 * j + p), count=8)
                c = 8 * t + j if SPAN == 16 else 4 * j + t
                pc = c ^ ((c >> 3) & 3) ^ (4 * (g & 1))  # swizzle(c, g + 8h): rows g and g + 8 share the parity
                for h in HALVES:  # compile-time: indexes CHUNK_HALVES
                    for e in EIGHT:
                        o[h, e] = a[CHUNK_HALVES[h][e]]
                    ts.copy_vector(tile[warp, g + 8 * h, pc * 8], o[h, 0], 16)
            ts.syncwarp()
            k = kt * 256 + 8 * lane
            rc = lane ^ ((lane >> 3) & 3)
            for r in ROWS:  # compile-time: the row's parity
                n = nt * 16 + r
                if n < N and k < K:
                    ts.copy_vector(Out[n, k], tile[warp, r, (rc ^ (4 * (r & 1))) * 8], 16)

    return dequant


def dequantize_words(words, scales, biases, out, wtype: DataType, group_size: int, has_bias: bool,
                     span: int = 16) -> None:  # fmt: skip
    """Out [N, K] float16 (torch, CUDA) <- the weights in `words` (pack_units, k order `span`)
    with [N, G] float16 scales and biases; `group_size` as make_dequant_units takes it."""
    n, k = out.shape
    if k % 8:
        raise UnsupportedError(f"the low-bit dequantiser needs K % 8 == 0 (16-byte rows), got K = {k}")
    make_dequant_units(wtype, group_size, has_bias, span)(words, scales, biases, out)
