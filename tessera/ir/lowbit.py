"""Register layout of low-bit weights for tensor-core dequantisation (the `dequant` instruction).

One *unit* is what one lane of a warp holds of a 16 x 256 weight tile: 128 values of `bits`
bits in 4 * bits 32-bit words (so `bits` 16-byte loads), ordered as the lane's half2 registers
of sixteen m16n8k16 A fragments (value v is half v % 2 of register v // 2).  Each 64-k stage
(four steps, 16 registers) reads its own `bits` words (stage_words), which die with it.  A word's
two 16-bit halves hold the two values of a register at the same places: f = 16 // bits whole
fields at bits 0, bits, 2 bits, ... and, for the widths that do not divide 16 (3, 5, 6, 7), 16 %
bits leftover top bits; the leftover bits of a stage's words, in order, hold its last
16 - f * bits registers (stage_plan).  A register is then rebuilt with one shift and mask per
field piece, OR-ed into the exponent of an fp16 (Marlin's trick, for any width):

* integers: the code u (offset binary for the signed types: q + 2**(bits-1)) lands in the low
  mantissa bits of 1024.0, so the half is 1024 + u exactly;
* small floats: magnitude bits go to fp16 bit 10 - mantissa_bits up, the sign to bit 15, which
  gives value * 2**-FLOAT_SHIFT[type] exactly (subnormals included): the scale absorbs the power.

The packer (tessera.quant.layout), the C lowering and the CUDA lowering all read this module.
"""

from __future__ import annotations

import functools
import itertools

from tessera.ir.dtypes import DataType

UNIT_VALUES = 128  # values per lane per unit (16 mma steps x 8 values)
UNIT_ROWS, UNIT_K = 16, 256  # the warp's weight tile of one unit
INT_MAGIC = 0x64006400  # two fp16 1024.0


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"low-bit codes are 1 to 8 bits wide, got {bits}")


def unit_words(bits: int) -> int:
    return 4 * bits


def stage_words(bits: int, stage: int) -> tuple[int, ...]:
    """The `bits` unit words 64-k stage `stage` (registers 16 stage .. 16 stage + 15) reads: its
    q = bits // 4 16-byte chunks [4q stage, 4q stage + 4q) and its r = bits % 4 words of the tail
    [16q + r stage, ...), so that a stage loads whole vectors and its words die with it."""
    _check_bits(bits)
    q, r = divmod(bits, 4)
    return (*range(4 * q * stage, 4 * q * (stage + 1)), *range(16 * q + r * stage, 16 * q + r * (stage + 1)))


Piece = tuple[int, int, int, int]  # (word, bit in the 16-bit half, lowest code bit, width)


def register_pieces(bits: int, reg: int) -> tuple[Piece, ...]:
    """The pieces of register `reg` (0..63) of a unit: both halves (values 2 reg, 2 reg + 1)
    at the same bits of the low and high half of each word."""
    stage, local = divmod(reg, 16)
    words = stage_words(bits, stage)
    return tuple((words[w], pos, low, width) for w, pos, low, width in stage_plan(bits)[0][local])


@functools.cache
def stage_plan(bits: int) -> tuple[tuple[tuple[Piece, ...], ...], tuple[int, ...]]:
    """(pieces of each of a stage's 16 registers, in the stage's own word numbering; the integer
    displacement d of each A-fragment place reg % 4).  Widths that divide 16 put register r in
    field r % f of word r // f.  The others give whole fields to the first f * bits registers and
    build the last ones from the words' leftover top bits, and choose the fields and the d's
    together: fewest LOP3 (one per piece) plus SHF (one per distinct word and shift)."""
    _check_bits(bits)
    fields = 16 // bits
    if fields * bits == 16:
        return tuple(((r // fields, (r % fields) * bits, 0, bits),) for r in range(16)), _dividing_displacements(bits)
    best: tuple[int, tuple[tuple[Piece, ...], ...], tuple[int, ...]] | None = None
    for ds in itertools.product(range(11 - bits), repeat=4):
        plan = _assign_fields(bits, ds)
        cost = _instructions(plan, ds)
        if best is None or cost < best[0]:
            best = (cost, plan, ds)
    assert best is not None
    return best[1], best[2]


def _dividing_displacements(bits: int) -> tuple[int, ...]:
    """d per reg % 4 for widths dividing 16 (see int_displacement)."""
    if bits <= 2:
        return tuple(bits * c for c in range(4))
    return tuple((c * bits) % 8 if bits == 4 else 0 for c in range(4))


def _assign_fields(bits: int, ds: tuple[int, ...]) -> tuple[tuple[Piece, ...], ...]:
    """A stage's pieces under displacements `ds`: registers class by class (reg % 4) take the free
    whole field that costs the fewest new instructions; the leftover top bits of the words, in
    order, make the last registers."""
    fields, top = divmod(16, bits)
    n_whole = fields * bits
    free = [(w, i * bits) for w in range(bits) for i in range(fields)]
    shifts: set[tuple[int, int]] = set()
    plan: dict[int, tuple[Piece, ...]] = {}
    for r in sorted(range(n_whole), key=lambda r: (r % 4, r)):
        d = ds[r % 4]
        w, pos = min(free, key=lambda f, d=d: (f[1] != d and (f[0], d - f[1]) not in shifts, abs(d - f[1]), f))
        free.remove((w, pos))
        if pos != d:
            shifts.add((w, d - pos))
        plan[r] = ((w, pos, 0, bits),)
    leftover = [(w, 16 - top, top) for w in range(bits)]  # (word, first bit, bits left)
    for r in range(n_whole, 16):
        pieces, low = [], 0
        while low < bits:
            w, pos, left = leftover[0]
            width = min(left, bits - low)
            pieces.append((w, pos, low, width))
            low += width
            leftover[0] = (w, pos + width, left - width)
            if left == width:
                leftover.pop(0)
        plan[r] = tuple(pieces)
    assert not free and not leftover
    return tuple(plan[r] for r in range(16))


def _instructions(plan: tuple[tuple[Piece, ...], ...], ds: tuple[int, ...]) -> int:
    """LOP3 (one a piece) + SHF (one a distinct (word, shift)) to build a stage's integer registers."""
    shifts = {(w, low + ds[r % 4] - pos) for r, pieces in enumerate(plan) for w, pos, low, _ in pieces}
    return sum(len(p) for p in plan) + sum(1 for _, shift in shifts if shift)


def float_shift(t: DataType) -> int:
    """k such that the dequantised half of a small-float code is its value * 2**-k."""
    return 15 - ((1 << (t.exponent_bits - 1)) - 1)


def int_displacement(t: DataType, reg: int) -> int:
    """d such that CUDA places an integer code u at fp16 mantissa bits [d, d + bits) of
    register `reg`, OR-ed into int_magic(d) = 2**(10 - d): the half is then int_magic(d) + u
    exactly.  d depends only on the register's place in the A fragment (reg % 4), so every mma
    step has the same magics (a kernel subtracting them in the tensor core needs one constant
    fragment).  Widths dividing 16 keep each field where it lies in its word when it fits below
    bit 10 and otherwise move it with one shift shared by the word's fields: 1 and 2 bits: d =
    bits * (reg % 4), shifts by multiples of 4 * bits; 4 bits: the fields at 0 and 4 stay, those
    at 8 and 12 move down by 8; 8 bits: d = 0.  The other widths take stage_plan's d (the C
    lowering of the non-raw dequant takes d = 0: the value does not depend on d)."""
    return 0 if t.is_float else stage_plan(t.nbits)[1][reg % 4]


def int_magic(d: int) -> int:
    """The fp16 bits of 2**(10 - d): its mantissa bit d weighs 1."""
    return (25 - d) << 10


HARDWARE_FLOATS = ("e4m3",)  # raw dequant converts these with cvt.rn.f16x2.<type>x2 (sm_89+)


def raw_shift(t: DataType) -> int:
    """k such that a raw dequant's half of a small float is its value * 2**-k: float_shift, but
    0 for the HARDWARE_FLOATS (the conversion gives the value itself)."""
    return 0 if t.name in HARDWARE_FLOATS else float_shift(t)


def code_offset(t: DataType) -> int:
    """What a dequantisation without bias subtracts from the layout code: the offset of the
    signed types' offset-binary codes (0 for the unsigned and float types)."""
    return 1 << (t.nbits - 1) if t.kind == "int" else 0


def raw_magic(t: DataType, reg: int) -> float:
    """What a *raw* dequant (no subtraction, no scale) leaves on top of the code in register
    `reg`: the half is raw_magic + u for the integers (2**(10 - d), d = int_displacement: the
    magic of the CUDA lowering, which both targets then share), and the value * 2**-raw_shift
    for the small floats (raw_magic 0).  A kernel subtracts raw_magic + bias (or code_offset)
    itself, e.g. with a second mma against those constants (tessera.templates.lowbit.decode)."""
    return 0.0 if t.is_float else 2.0 ** (10 - int_displacement(t, reg))


def register_terms(t: DataType, reg: int, displacement: int = 0) -> list[tuple[int, int, int]]:
    """(word, left shift (negative: right), mask) terms whose OR (with INT_MAGIC for integers,
    or int_magic(displacement) in both halves) is the half2 bit pattern of register `reg`
    (0..63) of the unit."""
    bits = t.nbits
    terms = []
    for word, pos, low, width in register_pieces(bits, reg):  # code bits [low, low + width) at bit pos
        groups: dict[int, list[int]] = {}
        for j in range(low, low + width):  # code bit j -> fp16 bit dest(j)
            if t.is_float:
                dest = 15 if j == bits - 1 else 10 - t.mantissa_bits + j
            else:
                dest = j + displacement
            groups.setdefault(dest - (pos + j - low), []).append(dest)
        for shift, dests in groups.items():
            mask = 0
            for d in dests:
                mask |= (1 << d) | (1 << (16 + d))
            terms.append((word, shift, mask))
    return terms


def value_bit_locations(bits: int, value: int) -> list[tuple[int, int, int, int]]:
    """(word, bit, code bit, width) of each piece of lane value `value` (0..127): the packer's
    view of the same layout."""
    reg, half = divmod(value, 2)
    return [(word, 16 * half + pos, low, width) for word, pos, low, width in register_pieces(bits, reg)]


SPANS = (16, 2)  # the k orders the decode kernel reads (see lane_value_position)
# The k order of mma's own A fragment (span 1): step s is k [16s, 16s + 16) as mma and wgmma
# number it, so a dequantised step is a register-A wgmma's operand against any K-major B tile
# (tessera.templates.lowbit.gemm_rs); the decode kernel does not read it.
FRAGMENT_SPAN = 1
ORDERS = (*SPANS, FRAGMENT_SPAN)  # every k order a unit may be packed in


def lane_value_position(lane: int, value: int, span: int = 16) -> tuple[int, int]:
    """(row, k) in the unit's 16 x 256 tile of lane `lane`'s value `value`.

    Register r of step s is A-fragment register r of mma step s (rows g and g + 8 alternate,
    g = lane // 4); the mma's k index is permuted so that, within each block of `span` steps
    (16 * span k), lane t = lane % 4 owns 4 * span consecutive k: step s, registers 0-1 take
    k = 16 span (s // span) + 4 span t + 4 (s % span) + {0, 1}, registers 2-3 the next two.
    The B fragment (activations, token g) of step s is then four consecutive halves and
    16-byte loads cover two steps.  span 16: lane t owns k in [64t, 64t + 64) of the unit;
    span 2: the 16 k of every step lie in 32 consecutive k (one scale group from 32 on).
    span 1 (FRAGMENT_SPAN): no permutation, mma's own order: registers 0-1 take k = 16s + 2t +
    {0, 1}, registers 2-3 k = 16s + 2t + 8 + {0, 1}."""
    if span not in ORDERS:
        raise ValueError(f"a unit's span is one of {ORDERS}, got {span}")
    g, t = divmod(lane, 4)
    reg, half = divmod(value, 2)
    s, r = divmod(reg, 4)
    if span == FRAGMENT_SPAN:
        return g + 8 * (r % 2), 16 * s + 2 * t + 8 * (r // 2) + half
    return g + 8 * (r % 2), 16 * span * (s // span) + 4 * span * t + 4 * (s % span) + 2 * (r // 2) + half
