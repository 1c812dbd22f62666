"""Paged attention and the KV-cache write on NVIDIA GPUs, written in tessera.

Two attention kernels, both over the same paged cache and run-time sizes (tokens, sequences,
blocks and lengths are never compiled in; a kernel is specialised to dtype, head dim, block
size, group size and softcap on/off):

* `make_paged_decode`: a thread block per (new token, KV head, KV split).  It finds the token's
  sequence from query_start_loc, and its 4 warps take the keys the token sees in turn: a lane
  holds ceil(D / 32) columns of each key and value row (coalesced across the warp), the G query
  heads that share the KV head reuse each row, and a warp keeps an online softmax per head.
  The warps merge through shared memory.  With `partial`, a split writes its float32 output and
  log-sum-exp per head and `make_paged_combine` merges the splits (flash-decoding: a few
  sequences with long contexts fill the GPU only when their keys are split).  It serves any
  token; with `single` only those of sequences with one new token.
* `make_paged_extend`: a thread block per (tile of QT (`extend_tile`) new tokens of one sequence, KV head).
  It stages each cache block's keys and values in shared memory once for the tile's QT * G
  query rows, a warp per row at a time with the same lane layout.  The tiles of all sequences
  are numbered in order; a block finds its own by walking query_start_loc, and the blocks past
  the last tile (the grid is sized from T / QT + B, an upper bound) return.  With `multi` it
  leaves sequences with one new token out: a mixed batch runs both kernels, each on its rows.

Every thread accumulates in float32; the scores use the natural exp.
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f32, i32
from tessera.ir.dtypes import DataType
from tessera.templates.paged_attention.cpu import kernel_name

NEG_INF = float("-inf")
WARPS = 4  # warps per block of both kernels
MAX_EXTEND_TILE = 16  # new tokens per block of the extend kernel, at most
MAX_SPLITS = 32


def lane_columns(head_dim: int) -> int:
    """Columns of a row each lane holds: d = lane + 32 * e for e below this."""
    return -(-head_dim // 32)


def extend_tile(head_dim: int, group: int) -> int:
    """New tokens per block of the extend kernel: a lane keeps at most 32 floats of query and as
    many of output (rows per warp x lane columns), so the tile shrinks for big heads and groups."""
    return max(1, min(MAX_EXTEND_TILE, 32 * WARPS // (group * lane_columns(head_dim))))


@functools.cache
def make_paged_decode(dtype: DataType, head_dim: int, block_size: int, group: int, softcap: bool, partial: bool,
                      single: bool = False) -> ts.Kernel:  # fmt: skip
    """kernel(Q, KC, VC, BT, SL, QSL, Out, OP, LSE, scale, window, cap).

    Q and Out [T, H, D]; KC and VC [NB, BS, KVH, D]; BT [B, MB], SL [B], QSL [B + 1] int32.
    Not partial: writes Out (OP and LSE are [1] placeholders), grid (T, KVH, 1).  Partial: writes
    OP float32 [S, T, H, D] and LSE float32 [S, T, H] of S splits (Out is not written), grid
    (T, KVH, S).  Rows past QSL[B] are not written; with `single`, neither are the rows of
    sequences with several new tokens (the extend kernel's share of a mixed batch)."""
    T, D, BS, G, CAP, PARTIAL, E = dtype, head_dim, block_size, group, softcap, partial, lane_columns(head_dim)
    SINGLE = single
    OP_SHAPE = ("S", "NT", "H", D) if partial else (1,)
    LSE_SHAPE = ("S", "NT", "H") if partial else (1,)

    @ts.kernel(target="cuda", name=kernel_name("paged_decode", T, D, BS, G, CAP) + ("_split" if PARTIAL else "") + ("_single" if SINGLE else ""))
    def decode(Q: T["NT", "H", D], KC: T["NB", BS, "KVH", D], VC: T["NB", BS, "KVH", D], BT: i32["B", "MB"],
               SL: i32["B"], QSL: i32["B1"], Out: T["NT", "H", D], OP: f32[OP_SHAPE], LSE: f32[LSE_SHAPE],
               scale: f32, window: i32, cap: f32):  # fmt: skip
        ts.attrs.grid = (NT, KVH, S if PARTIAL else 1)
        ts.attrs.block = 32 * WARPS
        splits = S if PARTIAL else 1
        sm_m = ts.shared_tensor(f32, [WARPS, G])
        sm_l = ts.shared_tensor(f32, [WARPS, G])
        sm_o = ts.shared_tensor(f32, [WARPS, G, D])
        t = ts.block_idx.x
        kvh = ts.block_idx.y
        split = ts.block_idx.z
        tid = ts.thread_idx.x
        warp = tid // 32
        lane = tid % 32
        tokens = QSL[B]
        b = 0
        for s in range(B):
            b += ts.select(QSL[s + 1] <= t, 1, 0)
        b = min(b, B - 1)
        first = QSL[b]
        n_new = QSL[b + 1] - first
        live = t < tokens and (n_new == 1 or not SINGLE)
        pos = SL[b] - n_new + (t - first)
        lo = ts.select(window > 0, max(pos - window + 1, 0), 0)
        hi = ts.select(live, pos + 1, lo)  # padding rows see no key
        # This split's share of the cache blocks the token sees.
        blk0 = lo // BS
        per = ts.ceil_div(ts.ceil_div(hi, BS) - blk0, splits)
        key_lo = max(lo, (blk0 + split * per) * BS)
        key_hi = min(hi, (blk0 + split * per + per) * BS)
        inv_cap = 1.0 / ts.select(CAP, cap, 1.0)
        q = ts.register_tensor(f32, [G, E])
        acc = ts.register_tensor(f32, [G, E])
        m = ts.register_tensor(f32, [G])
        den = ts.register_tensor(f32, [G])
        kv = ts.register_tensor(f32, [E])
        sc = ts.register_tensor(f32, [G])
        for h in ts.unroll(G):
            m[h] = NEG_INF
            den[h] = 0.0
            for e in ts.unroll(E):
                acc[h, e] = 0.0
                q[h, e] = 0.0
                if live and lane + 32 * e < D:
                    q[h, e] = ts.cast(Q[t, kvh * G + h, lane + 32 * e], f32) * scale
        for p in range(key_lo + warp, key_hi, WARPS):
            block = BT[b, p // BS]
            off = p % BS
            for e in ts.unroll(E):
                kv[e] = 0.0
                if lane + 32 * e < D:
                    kv[e] = ts.cast(KC[block, off, kvh, lane + 32 * e], f32)
            for h in ts.unroll(G):
                part = 0.0
                for e in ts.unroll(E):
                    part += q[h, e] * kv[e]
                for o in (16, 8, 4, 2, 1):
                    part += ts.shfl_xor(part, ts.cast(o, i32))
                if CAP:
                    part = cap * ts.tanh(part * inv_cap)
                sc[h] = part
            for e in ts.unroll(E):
                kv[e] = 0.0
                if lane + 32 * e < D:
                    kv[e] = ts.cast(VC[block, off, kvh, lane + 32 * e], f32)
            for h in ts.unroll(G):
                new = ts.fmax(m[h], sc[h])
                alpha = ts.exp(m[h] - new)  # exp(-inf) = 0 before the first key
                pe = ts.exp(sc[h] - new)
                den[h] = den[h] * alpha + pe
                m[h] = new
                for e in ts.unroll(E):
                    acc[h, e] = acc[h, e] * alpha + pe * kv[e]
        for h in ts.unroll(G):
            if lane == 0:
                sm_m[warp, h] = m[h]
                sm_l[warp, h] = den[h]
            for e in ts.unroll(E):
                if lane + 32 * e < D:
                    sm_o[warp, h, lane + 32 * e] = acc[h, e]
        ts.syncthreads()
        for i in range(tid, G * D, 32 * WARPS):
            h = i // D
            d = i % D
            mx = NEG_INF
            for w in ts.unroll(WARPS):
                mx = ts.fmax(mx, sm_m[w, h])
            sh = ts.select(mx == NEG_INF, 0.0, mx)
            num = 0.0
            tot = 0.0
            for w in ts.unroll(WARPS):
                wt = ts.exp(sm_m[w, h] - sh)
                num += wt * sm_o[w, h, d]
                tot += wt * sm_l[w, h]
            if live:
                if PARTIAL:
                    OP[split, t, kvh * G + h, d] = ts.select(tot > 0.0, num / ts.select(tot > 0.0, tot, 1.0), 0.0)
                    if d == 0:
                        LSE[split, t, kvh * G + h] = ts.select(tot > 0.0, sh + ts.log(ts.select(tot > 0.0, tot, 1.0)), NEG_INF)
                else:
                    Out[t, kvh * G + h, d] = num / tot

    return decode


@functools.cache
def make_paged_combine(dtype: DataType, head_dim: int) -> ts.Kernel:
    """kernel(OP, LSE, QSL, Out): Out[t, h] = sum_s exp(lse_s - max) OP[s, t, h] / sum_s exp(lse_s - max)
    for the rows t < QSL[B] the decode kernel wrote: LSE starts at -inf, and a row it computed has
    keys in some split (a finite maximum, a positive sum)."""
    T, D = dtype, head_dim

    @ts.kernel(target="cuda", name=f"paged_combine_{T.short}_d{D}")
    def combine(OP: f32["S", "NT", "H", D], LSE: f32["S", "NT", "H"], QSL: i32["B1"], Out: T["NT", "H", D]):
        ts.attrs.grid = ts.ceil_div(NT * H * D, 128)
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        tokens = QSL[B1 - 1]
        if i < tokens * H * D:
            d = i % D
            h = (i // D) % H
            t = i // (D * H)
            mx = NEG_INF
            for s in range(S):
                mx = ts.fmax(mx, LSE[s, t, h])
            if mx > NEG_INF:
                num = 0.0
                tot = 0.0
                for s in range(S):
                    wt = ts.exp(LSE[s, t, h] - mx)
                    num += wt * OP[s, t, h, d]
                    tot += wt
                Out[t, h, d] = num / tot

    return combine


@functools.cache
def make_paged_extend(dtype: DataType, head_dim: int, block_size: int, group: int, softcap: bool,
                      multi: bool = False) -> ts.Kernel:  # fmt: skip
    """kernel(Q, KC, VC, BT, SL, QSL, Out, scale, window, cap), grid (T // QT + B, KVH): the tiles
    of QT = extend_tile(head_dim, group) new tokens of each sequence in turn, for one KV head per
    block.  With `multi`, sequences with a single new token have no tile (the decode kernel's)."""
    T, D, BS, G, CAP, E, MULTI = dtype, head_dim, block_size, group, softcap, lane_columns(head_dim), multi
    QT = extend_tile(head_dim, group)
    ROWS = QT * G  # query rows of a tile: token-major, the G heads of a token together
    RPW = ROWS // WARPS if ROWS % WARPS == 0 else ROWS // WARPS + 1  # rows per warp

    @ts.kernel(target="cuda", name=kernel_name("paged_extend", T, D, BS, G, CAP) + ("_multi" if MULTI else ""))
    def extend(Q: T["NT", "H", D], KC: T["NB", BS, "KVH", D], VC: T["NB", BS, "KVH", D], BT: i32["B", "MB"],
               SL: i32["B"], QSL: i32["B1"], Out: T["NT", "H", D], scale: f32, window: i32, cap: f32):  # fmt: skip
        ts.attrs.grid = (NT // QT + B, KVH)
        ts.attrs.block = 32 * WARPS
        ks = ts.shared_tensor(T, [BS, D])  # 16-bit rows: 32 KiB for 32 keys of 256 columns
        vs = ts.shared_tensor(T, [BS, D])
        tid = ts.thread_idx.x
        warp = tid // 32
        lane = tid % 32
        kvh = ts.block_idx.y
        # This block's tile: the sequence b whose tiles cover index block_idx.x, and its first token.
        tile = ts.block_idx.x
        b = B
        start = 0
        seen = 0
        for s in range(B):
            n_tiles = ts.ceil_div(QSL[s + 1] - QSL[s], QT)
            if MULTI:
                n_tiles = ts.select(QSL[s + 1] - QSL[s] == 1, 0, n_tiles)
            mine = b == B and tile < seen + n_tiles
            start = ts.select(mine, QSL[s] + (tile - seen) * QT, start)
            b = ts.select(mine, s, b)
            seen += n_tiles
        live = b < B
        b = min(b, B - 1)
        end = ts.select(live, min(start + QT, QSL[b + 1]), start)  # the tile's tokens: [start, end)
        n_new = QSL[b + 1] - QSL[b]
        base = SL[b] - n_new - QSL[b]  # position of token t: base + t
        inv_cap = 1.0 / ts.select(CAP, cap, 1.0)
        # The keys some token of the tile sees: from the first token's window start to the last token.
        lo = ts.select(window > 0, max(base + start - window + 1, 0), 0)
        hi = ts.select(live, base + end, lo)  # a block past the last tile reads no key
        q = ts.register_tensor(f32, [RPW, E])
        acc = ts.register_tensor(f32, [RPW, E])
        m = ts.register_tensor(f32, [RPW])
        den = ts.register_tensor(f32, [RPW])
        for r in ts.unroll(RPW):
            m[r] = NEG_INF
            den[r] = 0.0
            row = warp * RPW + r
            t = start + row // G
            for e in ts.unroll(E):
                acc[r, e] = 0.0
                q[r, e] = 0.0
                if row < ROWS and t < end and lane + 32 * e < D:
                    q[r, e] = ts.cast(Q[t, kvh * G + row % G, lane + 32 * e], f32) * scale
        for blk in range(lo // BS, ts.ceil_div(hi, BS)):
            block = BT[b, blk]
            ts.syncthreads()  # the previous block's rows are no longer read
            for i in range(tid, BS * D, 32 * WARPS):
                kk = i // D
                d = i % D
                ks[kk, d] = KC[block, kk, kvh, d]
                vs[kk, d] = VC[block, kk, kvh, d]
            ts.syncthreads()
            for r in ts.unroll(RPW):
                row = warp * RPW + r
                t = start + row // G
                pos = base + t
                k_lo = ts.select(window > 0, max(pos - window + 1, 0), 0)
                # The row's keys in this block; none for rows past the tile.
                k0 = max(k_lo - blk * BS, 0)
                k1 = ts.select(row < ROWS and t < end, min(pos + 1 - blk * BS, BS), 0)
                for kk in range(k0, k1):
                    part = 0.0
                    for e in ts.unroll(E):
                        if lane + 32 * e < D:
                            part += q[r, e] * ts.cast(ks[kk, lane + 32 * e], f32)
                    for o in (16, 8, 4, 2, 1):
                        part += ts.shfl_xor(part, ts.cast(o, i32))
                    if CAP:
                        part = cap * ts.tanh(part * inv_cap)
                    new = ts.fmax(m[r], part)
                    alpha = ts.exp(m[r] - new)
                    pe = ts.exp(part - new)
                    den[r] = den[r] * alpha + pe
                    m[r] = new
                    for e in ts.unroll(E):
                        if lane + 32 * e < D:
                            acc[r, e] = acc[r, e] * alpha + pe * ts.cast(vs[kk, lane + 32 * e], f32)
        for r in ts.unroll(RPW):
            row = warp * RPW + r
            t = start + row // G
            if row < ROWS and t < end:
                inv = 1.0 / den[r]
                for e in ts.unroll(E):
                    if lane + 32 * e < D:
                        Out[t, kvh * G + row % G, lane + 32 * e] = acc[r, e] * inv

    return extend


@functools.cache
def make_write_kv_cache_cuda(dtype: DataType, head_dim: int, block_size: int, slot_dtype: DataType) -> ts.Kernel:
    """kernel(K, V, KC, VC, SLOT): the scatter of cpu.make_write_kv_cache_cpu, a thread per element."""
    T, D, BS, IDX = dtype, head_dim, block_size, slot_dtype

    @ts.kernel(target="cuda", name=f"write_kv_cache_{T.short}_d{D}_bs{BS}_{IDX.short}")
    def write_kv_cache(K: T["NT", "KVH", D], V: T["NT", "KVH", D], KC: T["NB", BS, "KVH", D],
                       VC: T["NB", BS, "KVH", D], SLOT: IDX["NT"]):  # fmt: skip
        ts.attrs.grid = ts.ceil_div(NT * KVH * D, 128)
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < NT * KVH * D:
            d = i % D
            g = (i // D) % KVH
            t = i // (D * KVH)
            slot = SLOT[t]
            if slot >= 0:
                KC[slot // BS, slot % BS, g, d] = K[t, g, d]
                VC[slot // BS, slot % BS, g, d] = V[t, g, d]

    return write_kv_cache
