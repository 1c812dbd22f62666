"""Register layout of low-bit weights for tensor-core dequantisation (the `dequant` instruction).

One *unit* is what one lane of a warp holds of a 16 x 256 weight tile: 128 values of `bits`
bits in 4 * bits 32-bit words (so `bits` 16-byte loads), ordered as the lane's half2 registers
of sixteen m16n8k16 A fragments (value v is half v % 2 of register v // 2).  Any width is
split into planes of 8, 4, 2 and 1 bits (7 = 4 + 2 + 1, the high code bits in the widest
plane), each packed densely in its own words: in a plane of p bits a word holds 16 / p
registers, register j of the word in bits [j*p, j*p + p) (low half) and [16 + j*p, ...)
(high half).  A register is then rebuilt with one shift and mask per plane and bit group,
OR-ed into the exponent of an fp16 (Marlin's trick, for any width):

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


def planes(bits: int) -> tuple[int, ...]:
    """The plane widths of a `bits`-bit code, widest (highest code bits) first."""
    if not 1 <= bits <= 8:
        raise ValueError(f"low-bit codes are 1 to 8 bits wide, got {bits}")
    return tuple(p for p in (8, 4, 2, 1) if bits & p)


def unit_words(bits: int) -> int:
    return 4 * bits


def plane_layout(bits: int) -> list[tuple[int, int, int]]:
    """(width p, first word, lowest code bit) of each plane."""
    out, word, low = [], 0, bits
    for p in planes(bits):
        low -= p
        out.append((p, word, low))
        word += UNIT_VALUES // 2 // (16 // p)
    return out


def float_shift(t: DataType) -> int:
    """k such that the dequantised half of a small-float code is its value * 2**-k."""
    return 15 - ((1 << (t.exponent_bits - 1)) - 1)


def int_displacement(t: DataType, reg: int) -> int:
    """d such that CUDA places an integer code u at fp16 mantissa bits [d, d + bits) of
    register `reg`, OR-ed into int_magic(d) = 2**(10 - d): the half is then int_magic(d) + u
    exactly.  Single-plane widths (1, 2, 4, 8) keep each field where it lies in its word when it
    fits below bit 10 and otherwise move it with one shift shared by the word's fields, so that d
    depends only on the register's place in the A fragment (reg % 4): every mma step then has
    the same magics (a kernel subtracting them in the tensor core needs one constant fragment).
    1 and 2 bits: d = bits * (reg % 4), shifts by multiples of 4 * bits; 4 bits: the fields at 0
    and 4 stay, those at 8 and 12 move down by 8; 8 bits: d = 0.  Widths of several planes take
    the d per reg % 4 that needs the fewest distinct shifts over the unit (the C lowering of the
    non-raw dequant takes d = 0: the value does not depend on d)."""
    bits = t.nbits
    if t.is_float:
        return 0
    if len(planes(bits)) > 1:
        return _plane_displacements(t)[reg % 4]
    if bits <= 2:
        return bits * (reg % 4)
    pos = (reg % (16 // bits)) * bits
    return pos % 8 if bits == 4 else 0


@functools.cache
def _plane_displacements(t: DataType) -> tuple[int, ...]:
    """d for each of the 4 A-fragment places of a several-plane integer width: the choice that
    leaves the fewest distinct (word, shift) pairs over a unit's 64 registers (one SHF each)."""
    best: tuple[int, tuple[int, ...]] | None = None
    shifted: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for ds in itertools.product(range(11 - t.nbits), repeat=4):
        pairs: set[tuple[int, int]] = set()
        for reg in range(64):
            key = (reg, ds[reg % 4])
            if key not in shifted:
                shifted[key] = [(w, sh) for w, sh, _ in register_terms(t, reg, key[1]) if sh]
            pairs.update(shifted[key])
        if best is None or len(pairs) < best[0]:
            best = (len(pairs), ds)
    assert best is not None
    return best[1]


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
    itself, e.g. with a second mma against those constants (tessera.kernels.lowbit_decode)."""
    return 0.0 if t.is_float else 2.0 ** (10 - int_displacement(t, reg))


def register_terms(t: DataType, reg: int, displacement: int = 0) -> list[tuple[int, int, int]]:
    """(word, left shift (negative: right), mask) terms whose OR (with INT_MAGIC for integers,
    or int_magic(displacement) in both halves) is the half2 bit pattern of register `reg`
    (0..63) of the unit."""
    bits = t.nbits
    terms = []
    for p, first, low in plane_layout(bits):
        per_word = 16 // p
        word, pos = first + reg // per_word, (reg % per_word) * p  # field of code bits [low, low + p)
        groups: dict[int, list[int]] = {}
        for j in range(low, low + p):  # code bit j -> fp16 bit dest(j)
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
    """(word, bit, code bit, width) of each plane's field of lane value `value` (0..127): the
    packer's view of the same layout."""
    reg, half = divmod(value, 2)
    out = []
    for p, first, low in plane_layout(bits):
        per_word = 16 // p
        out.append((first + reg // per_word, 16 * half + (reg % per_word) * p, low, p))
    return out


SPANS = (16, 2)  # the k orders the decode kernel reads (see lane_value_position)
# The k order of mma's own A fragment (span 1): step s is k [16s, 16s + 16) as mma and wgmma
# number it, so a dequantised step is a register-A wgmma's operand against any K-major B tile
# (tessera.kernels.lowbit_gemm_rs); the decode kernel does not read it.
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
