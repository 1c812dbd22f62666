"""Paged attention and the KV-cache write on the CPU, written in tessera (generated C, OpenMP).

`make_paged_attention_cpu`: one worker item per (tile of new tokens of one sequence, KV head):
up to `cpu_tile(G)` tokens, whose G query heads each that share the KV head make 16 query rows at
most.  The item finds its tile from query_start_loc, then walks the cache blocks its tokens see
(causal, optional sliding window): each key and value row of a block is converted to float32
once for all the rows, and every row keeps an online softmax updated once per block.  A decode
token is a tile of one token (its G heads).  Everything accumulates in float32.  Only keys a token sees are ever read (loop bounds, never conditions): the cache's other
slots may hold anything, NaN included, and no memory read sits in a conditional arm (issue 36).

Sizes T, B, the number of blocks, max_blocks, KVH and every length are run-time values; a kernel
is specialised to (dtype, head dim, block size, group size, softcap on/off) only.
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f32, i32, i64
from tessera.ir.dtypes import DataType

NEG_INF = float("-inf")
# Multiply-adds (or bytes copied) below which a call runs on one thread: waking the OpenMP team
# and its closing barrier cost more than that much work, and on a loaded machine a descheduled
# worker holds the barrier for a whole time slice (measured: 12 ms for a 256-token write on a
# busy 2-core machine, 0.2 ms on one thread).
SERIAL_WORK = 1 << 20


def kernel_name(kind: str, dtype: DataType, head_dim: int, block_size: int, group: int, softcap: bool) -> str:
    return f"{kind}_{dtype.short}_d{head_dim}_bs{block_size}_g{group}{'_cap' if softcap else ''}"


def cpu_tile(group: int) -> int:
    """New tokens per worker item: up to 16 query rows (tokens x the group's heads) share each
    key and value row converted to float32."""
    return max(1, 16 // group)


@functools.cache
def make_paged_attention_cpu(dtype: DataType, head_dim: int, block_size: int, group: int, softcap: bool,
                             parallel: bool = True) -> ts.Kernel:  # fmt: skip
    """kernel(Q, KC, VC, BT, SL, QSL, Out, scale, window, cap).

    Q and Out [T, H, D]; KC and VC [NB, BS, KVH, D] (H = KVH * group); BT [B, MB], SL [B] and
    QSL [B + 1] int32.  window 0: none; with `softcap`, scores are cap * tanh(scores / cap).
    Rows of Out past QSL[B] are not written.  `parallel`: the items run on OpenMP threads (else
    in one, for calls too small to pay for waking them: `SERIAL_WORK`)."""
    T, D, BS, G, CAP, QT = dtype, head_dim, block_size, group, softcap, cpu_tile(group)
    items = ts.parallel if parallel else range
    R = QT * G  # query rows of an item, token-major
    # The dot products run in W independent lanes (summed at the end), which gcc vectorises
    # where one running sum would stay scalar (float addition does not reassociate).
    W = 8 if D % 8 == 0 else 1

    @ts.kernel(target="cpu", name=kernel_name("paged_attention", T, D, BS, G, CAP) + ("" if parallel else "_serial"))
    def paged_attention(Q: T["NT", "H", D], KC: T["NB", BS, "KVH", D], VC: T["NB", BS, "KVH", D],
                        BT: i32["B", "MB"], SL: i32["B"], QSL: i32["B1"], Out: T["NT", "H", D],
                        scale: f32, window: i32, cap: f32):  # fmt: skip
        inv_cap = 1.0 / ts.select(CAP, cap, 1.0)
        # Items: (tile, KV head); the tiles of every sequence in turn (T // QT + B bounds their
        # number; the items past the last tile have no row).
        for item in items((NT // QT + B) * KVH):
            tile = item // KVH
            kvh = item % KVH
            b = B
            start = 0
            seen = 0
            for s in range(B):
                seq_start = QSL[s]
                n_tiles = ts.ceil_div(QSL[s + 1] - seq_start, QT)
                mine = b == B and tile < seen + n_tiles
                start = ts.select(mine, seq_start + (tile - seen) * QT, start)
                b = ts.select(mine, s, b)
                seen += n_tiles
            live = b < B
            b = min(b, B - 1)
            first = QSL[b]
            last = QSL[b + 1]
            end = ts.select(live, min(start + QT, last), start)  # the tile's tokens: [start, end)
            base = SL[b] - (last - first) - first  # position of token t: base + t
            rows = (end - start) * G
            # The keys some row sees: from the first token's window start to the last token.
            lo = ts.select(window > 0, max(base + start - window + 1, 0), 0)
            hi = ts.select(live, base + end, lo)
            qf = ts.register_tensor(f32, [R, D])
            acc = ts.register_tensor(f32, [R, D])
            m = ts.register_tensor(f32, [R])
            den = ts.register_tensor(f32, [R])
            kf = ts.register_tensor(f32, [BS, D])
            vf = ts.register_tensor(f32, [BS, D])
            scores = ts.register_tensor(f32, [BS])
            lanes = ts.register_tensor(f32, [W])
            for r in range(rows):
                m[r] = NEG_INF
                den[r] = 0.0
                for d in range(D):
                    qf[r, d] = ts.cast(Q[start + r // G, kvh * G + r % G, d], f32) * scale
                    acc[r, d] = 0.0
            for blk in range(lo // BS, ts.ceil_div(hi, BS)):
                block = BT[b, blk]
                # Each key and value row of the block that some row sees, in float32 once.
                for kk in range(max(lo - blk * BS, 0), min(hi - blk * BS, BS)):
                    for d in range(D):
                        kf[kk, d] = ts.cast(KC[block, kk, kvh, d], f32)
                        vf[kk, d] = ts.cast(VC[block, kk, kvh, d], f32)
                for r in range(rows):
                    pos = base + start + r // G
                    k0 = max(ts.select(window > 0, pos - window + 1, 0) - blk * BS, 0)
                    k1 = min(pos + 1 - blk * BS, BS)
                    top = NEG_INF
                    for kk in range(k0, k1):
                        for w in range(W):
                            lanes[w] = 0.0
                        for d0 in range(D // W):
                            for w in range(W):
                                lanes[w] += qf[r, d0 * W + w] * kf[kk, d0 * W + w]
                        dot = 0.0
                        for w in range(W):
                            dot += lanes[w]
                        if CAP:
                            dot = cap * ts.tanh(dot * inv_cap)
                        scores[kk] = dot
                        top = max(top, dot)
                    # Online softmax, once per block (a row that sees no key here keeps its state:
                    # its maximum stays, alpha is 1, or 0 while nothing was seen).
                    old = m[r]
                    new = max(old, top)
                    alpha = ts.select(old == NEG_INF, 0.0, ts.exp(old - new))
                    m[r] = new
                    total = 0.0
                    for kk in range(k0, k1):
                        e = ts.exp(scores[kk] - new)
                        scores[kk] = e
                        total += e
                    den[r] = den[r] * alpha + total
                    for d in range(D):
                        acc[r, d] = acc[r, d] * alpha
                    for kk in range(k0, k1):
                        p = scores[kk]
                        for d in range(D):
                            acc[r, d] += p * vf[kk, d]
            for r in range(rows):
                inv = 1.0 / den[r]
                for d in range(D):
                    Out[start + r // G, kvh * G + r % G, d] = acc[r, d] * inv

    return paged_attention


@functools.cache
def make_write_kv_cache_cpu(dtype: DataType, head_dim: int, block_size: int, slot_dtype: DataType = i64,
                            parallel: bool = True) -> ts.Kernel:  # fmt: skip
    """kernel(K, V, KC, VC, SLOT): KC[slot // BS, slot % BS] = K[t] (and V) for every t whose
    slot is >= 0; K and V [T, KVH, D], KC and VC [NB, BS, KVH, D], SLOT [T] int32 or int64;
    `parallel` as in make_paged_attention_cpu."""
    T, D, BS, IDX = dtype, head_dim, block_size, slot_dtype
    tokens = ts.parallel if parallel else range

    @ts.kernel(target="cpu", name=f"write_kv_cache_{T.short}_d{D}_bs{BS}_{IDX.short}{'' if parallel else '_serial'}")
    def write_kv_cache(K: T["NT", "KVH", D], V: T["NT", "KVH", D], KC: T["NB", BS, "KVH", D],
                       VC: T["NB", BS, "KVH", D], SLOT: IDX["NT"]):  # fmt: skip
        for t in tokens(NT):
            slot = SLOT[t]
            # A negative slot (padding) copies nothing: its loop is empty, no read is conditional.
            rows = ts.select(slot >= 0, KVH, 0)
            safe = max(slot, 0)
            block = safe // BS
            offset = safe % BS
            for g in range(rows):
                for d in range(D):
                    KC[block, offset, g, d] = K[t, g, d]
                    VC[block, offset, g, d] = V[t, g, d]

    return write_kv_cache
