"""Pack-time layout of low-bit weights for the tensor-core kernels (tessera.ir.lowbit).

`pack_units(codes, dtype)` turns a [N, K] matrix of codes into uint32 words ordered
[N / 16][K / 256][bits][32 lanes][4 words]: a warp reads unit (n-tile, k-tile) with `bits`
16-byte loads, load j of lane l at word ((tile * bits + j) * 32 + l) * 4, each one 512
contiguous bytes across the warp.  N is padded to a multiple of 16 and K of 256 with code 0
(value 0 for the floats; any finite value is fine, the kernels read zero activations there),
so for such shapes the words hold exactly N * K * bits / 8 bytes.
"""

from __future__ import annotations

import functools

import numpy as np

from tessera.ir import lowbit
from tessera.ir.dtypes import DataType

ROW_BLOCK = 256  # k per block of the row layout (the tensor-core layout's padded K is a multiple of it)
Piece = tuple[int, int, int, int]  # (first word in the block, shift in the word, width, lowest code bit)


@functools.cache
def row_segments(bits: int) -> tuple[tuple[int, int, tuple[Piece, ...]], ...]:
    """The CPU row layout, the one source of truth of its packer and its kernel: a block of 256
    codes is 8 * bits uint32 words, and each (k0, length, pieces) segment says that code k0 + j
    (j < length) is the OR over its pieces (word, shift, width, low) of ((W[word + j] >> shift) &
    (2**width - 1)) << low.  Runs of consecutive k read runs of consecutive words at one shift,
    which the kernel decodes with vector loads, shifts and masks.

    Each word holds f = 32 // bits whole fields: field i of word j is code k = i * 8 bits + j.
    For 3, 5, 6 and 7 bits the r = 32 - f * bits bits left at the top of every word hold the
    last 8r codes, split into pieces of powers of two no wider than r (7 bits: 4 + 2 + 1 in
    slots of 4; 5: 2 + 2 + 1, 6: 2 + 2 + 2, 3: 2 + 1 in slots of 2), the widest the highest
    bits; a piece of width q takes 8q words, each slot r // q pieces, piece i of word j being
    leftover code i * 8q + j.  So 15/16 of a block's codes (7 bits: 7/8) are one field each,
    where the plane split (7 = 4 + 2 + 1 everywhere) joined three."""
    f, rest = 32 // bits, 32 % bits
    segments = [(i * 8 * bits, 8 * bits, ((0, i * bits, bits, 0),)) for i in range(f)]
    if rest:
        widths, left = [], bits
        while left:
            widths.append(1 << (min(rest, left).bit_length() - 1))
            left -= widths[-1]
        run = 8 * min(widths)  # leftover codes per segment: one field of one run of words in every piece
        for c0 in range(0, 8 * rest, run):
            pieces, word, low = [], 0, bits
            for q in widths:
                low -= q
                pieces.append((word + c0 % (8 * q), f * bits + c0 // (8 * q) * q, q, low))
                word += 8 * q
            segments.append((8 * bits * f + c0, run, tuple(pieces)))
    return tuple(segments)


def layout_codes(codes: np.ndarray, t: DataType) -> np.ndarray:
    """The codes the layout stores: offset binary (q + 2**(bits-1)) for the signed integers."""
    codes = np.asarray(codes, dtype=np.uint32)
    return codes ^ (1 << (t.nbits - 1)) if t.kind == "int" else codes


@functools.cache
def _lane_positions(span: int) -> np.ndarray:
    """[128 * 32]: row * 256 + k in the unit's 16 x 256 tile of lane value (value, lane)
    (lowbit.lane_value_position), in the row order of `_unit_values`."""
    out = np.empty((lowbit.UNIT_VALUES, 32), np.int64)
    for lane in range(32):
        for v in range(lowbit.UNIT_VALUES):
            row, k = lowbit.lane_value_position(lane, v, span)
            out[v, lane] = row * lowbit.UNIT_K + k
    return out.reshape(-1)


def _value_pieces(bits: int) -> np.ndarray:
    """[pieces, 4, 128]: per piece index j, each lane value's (word, bit, code bit, width) from
    tessera.ir.lowbit.value_bit_locations (width 0 where a value has fewer pieces)."""
    places = [lowbit.value_bit_locations(bits, v) for v in range(lowbit.UNIT_VALUES)]
    out = np.zeros((max(map(len, places)), 4, lowbit.UNIT_VALUES), np.int64)
    for v, pieces in enumerate(places):
        for j, piece in enumerate(pieces):
            out[j, :, v] = piece
    return out


@functools.cache
def _word_pieces(bits: int) -> np.ndarray:
    """[slots, 4, 4 bits words]: per slot index i, each word's (value, bit, code bit, width): the
    same pieces grouped by word (width 0 where a word has fewer)."""
    by_word: list[list[tuple[int, int, int, int]]] = [[] for _ in range(lowbit.unit_words(bits))]
    for v in range(lowbit.UNIT_VALUES):
        for word, bit, low, width in lowbit.value_bit_locations(bits, v):
            by_word[word].append((v, bit, low, width))
    out = np.zeros((max(map(len, by_word)), 4, len(by_word)), np.int64)
    for w, pieces in enumerate(by_word):
        for i, piece in enumerate(pieces):
            out[i, :, w] = piece
    return out


def padded_shape(n: int, k: int) -> tuple[int, int]:
    return -(-n // lowbit.UNIT_ROWS) * lowbit.UNIT_ROWS, -(-k // lowbit.UNIT_K) * lowbit.UNIT_K


def pack_units(codes: np.ndarray, t: DataType, span: int = 16) -> np.ndarray:
    """uint32 words of the [N, K] codes (unsigned, as tessera.quant.codecs.encode gives them),
    each unit's k in the order of `span` (tessera.ir.lowbit.lane_value_position)."""
    codes = np.asarray(codes)
    n, k = codes.shape
    npad, kpad = padded_shape(n, k)
    u = np.zeros((npad, kpad), np.uint32)
    u[:n, :k] = layout_codes(codes, t)
    nt, kt = npad // 16, kpad // 256
    by_position = u.reshape(nt, 16, kt, 256).transpose(1, 3, 0, 2).reshape(16 * 256, nt * kt)  # [row * 256 + k, unit]
    return _unit_words(by_position[_lane_positions(span)], t, nt, kt)


def lane_unit(words: np.ndarray, t: DataType, n_tile: int, k_tile: int, k_tiles: int, lane: int) -> np.ndarray:
    """The 4 * bits words lane `lane` holds of unit (n_tile, k_tile): what the kernels load."""
    b = t.nbits
    w = np.asarray(words).reshape(-1, k_tiles, b, 32, 4)
    return w[n_tile, k_tile, :, lane, :].reshape(-1)


def _unit_values(words: np.ndarray, t: DataType, units: int) -> np.ndarray:
    """[128 values * 32 lanes, units] the layout codes each lane holds of each unit (units last:
    every piece of the layout then moves whole rows)."""
    w = np.asarray(words, np.uint32).reshape(units, t.nbits, 32, 4).transpose(1, 3, 2, 0).reshape(-1, 32, units)
    values = np.zeros((lowbit.UNIT_VALUES, 32, units), np.uint32)
    for word, bit, low, width in _value_pieces(t.nbits).astype(np.uint32)[..., None, None]:
        values |= ((w[word[:, 0, 0]] >> bit) & ((np.uint32(1) << width) - np.uint32(1))) << low
    return values.reshape(-1, units)


def _unit_words(values: np.ndarray, t: DataType, nt: int, kt: int) -> np.ndarray:
    """The words (flat, [nt][kt][bits][32 lanes][4]) of the lane values [128 * 32, nt * kt]
    (`_unit_values`' inverse)."""
    v = values.reshape(lowbit.UNIT_VALUES, 32, nt * kt)
    words = np.zeros((lowbit.unit_words(t.nbits), 32, nt * kt), np.uint32)
    for value, bit, low, width in _word_pieces(t.nbits).astype(np.uint32)[..., None, None]:
        words |= ((v[value[:, 0, 0]] >> low) & ((np.uint32(1) << width) - np.uint32(1))) << bit
    # [bits, 4, 32, units] -> [units, bits, 32, 4]: load j of a warp is 512 contiguous bytes.
    return np.ascontiguousarray(words.reshape(t.nbits, 4, 32, nt * kt).transpose(3, 0, 2, 1)).reshape(-1)


def unpack_units(words: np.ndarray, t: DataType, n: int, k: int, span: int = 16) -> np.ndarray:
    """The [n, k] layout codes (`layout_codes`) that `pack_units(..., span)` stored in `words`."""
    npad, kpad = padded_shape(n, k)
    nt, kt = npad // 16, kpad // 256
    u = np.empty((16 * 256, nt * kt), np.uint32)
    u[_lane_positions(span)] = _unit_values(words, t, nt * kt)  # (every position of the unit exactly once)
    return u.reshape(16, 256, nt, kt).transpose(2, 0, 3, 1).reshape(npad, kpad)[:n, :k]


@functools.cache
def _reorder(span: int, new_span: int) -> np.ndarray:
    """[128 * 32] for each lane value (value, lane) of the order `new_span`, the row of the
    order `span` at the same (row, k)."""
    at = np.empty(16 * 256, np.int64)
    at[_lane_positions(span)] = np.arange(32 * lowbit.UNIT_VALUES)
    return at[_lane_positions(new_span)]


def repack_units(words: np.ndarray, t: DataType, n: int, k: int, span: int, new_span: int) -> np.ndarray:
    """The words of `pack_units(..., span)` holding the same codes in the k order `new_span`
    (as many words: a unit's size does not depend on its order).  Each unit's values move
    between lanes in place, without the [N, K] matrix between (a graph compile re-lays every
    low-bit weight: tessera.templates.lowbit.fragment_words)."""
    npad, kpad = padded_shape(n, k)
    nt, kt = npad // 16, kpad // 256
    return _unit_words(_unit_values(words, t, nt * kt)[_reorder(span, new_span)], t, nt, kt)


def pack_rows(u: np.ndarray, t: DataType) -> np.ndarray:
    """uint32 words [N, ceil(K / 256) * 8 * bits] of the [N, K] layout codes `u` in the CPU row
    layout (tessera.templates.lowbit.cpu_kernels.row_segments): per row, blocks of 256 k, whole fields of
    runs of k in runs of words, the codes left over in the words' top bits; K is padded with
    code 0."""

    u = np.asarray(u, np.uint32)
    n, k = u.shape
    kb = -(-k // lowbit.UNIT_K)
    padded = np.zeros((n, kb, lowbit.UNIT_K), np.uint32)
    padded.reshape(n, -1)[:, :k] = u
    out = np.zeros((n, kb, 8 * t.nbits), np.uint32)
    for k0, length, pieces in row_segments(t.nbits):
        for word, shift, width, low in pieces:
            field = (padded[:, :, k0 : k0 + length] >> np.uint32(low)) & np.uint32((1 << width) - 1)
            out[:, :, word : word + length] |= field << np.uint32(shift)
    return out.reshape(n, -1)
