"""Paged attention and the KV-cache write on the CPU, written in tessera (generated C, OpenMP).

`make_paged_attention_cpu`: one worker item per (new token, KV head).  The item finds its sequence
from query_start_loc, then walks the cache blocks its token sees (causal, optional sliding
window) with an online softmax per KV block: the block's scores for the G query heads that share
the KV head are computed from one read of each key row, the running maximum and sum are updated
once per block, and each value row is read once for the G heads.  Everything accumulates in
float32.  Only keys a token sees are ever read (loop bounds, never conditions): the cache's other
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


def kernel_name(kind: str, dtype: DataType, head_dim: int, block_size: int, group: int, softcap: bool) -> str:
    return f"{kind}_{dtype.short}_d{head_dim}_bs{block_size}_g{group}{'_cap' if softcap else ''}"


@functools.cache
def make_paged_attention_cpu(dtype: DataType, head_dim: int, block_size: int, group: int, softcap: bool) -> ts.Kernel:
    """kernel(Q, KC, VC, BT, SL, QSL, Out, scale, window, cap).

    Q and Out [T, H, D]; KC and VC [NB, BS, KVH, D] (H = KVH * group); BT [B, MB], SL [B] and
    QSL [B + 1] int32.  window 0: none; with `softcap`, scores are cap * tanh(scores / cap).
    Rows of Out past QSL[B] are not written."""
    T, D, BS, G, CAP = dtype, head_dim, block_size, group, softcap
    # The dot products run in W independent lanes (summed at the end), which gcc vectorises
    # where one running sum would stay scalar (float addition does not reassociate).
    W = 8 if D % 8 == 0 else 1

    @ts.kernel(target="cpu", name=kernel_name("paged_attention", T, D, BS, G, CAP))
    def paged_attention(Q: T["NT", "H", D], KC: T["NB", BS, "KVH", D], VC: T["NB", BS, "KVH", D],
                        BT: i32["B", "MB"], SL: i32["B"], QSL: i32["B1"], Out: T["NT", "H", D],
                        scale: f32, window: i32, cap: f32):  # fmt: skip
        tokens = QSL[B]
        inv_cap = 1.0 / ts.select(CAP, cap, 1.0)
        for item in ts.parallel(tokens * KVH):
            t = item // KVH
            kvh = item % KVH
            # The token's sequence: how many sequences end at or before it (query_start_loc rises).
            b = 0
            for s in range(B):
                b += ts.select(QSL[s + 1] <= t, 1, 0)
            first = QSL[b]
            length = SL[b]
            pos = length - (QSL[b + 1] - first) + (t - first)
            lo = ts.select(window > 0, max(pos - window + 1, 0), 0)
            hi = pos + 1
            qf = ts.register_tensor(f32, [G, D])
            acc = ts.register_tensor(f32, [G, D])
            scores = ts.register_tensor(f32, [G, BS])
            m = ts.register_tensor(f32, [G])
            den = ts.register_tensor(f32, [G])
            row = ts.register_tensor(f32, [D])
            lanes = ts.register_tensor(f32, [W])
            for h in range(G):
                m[h] = NEG_INF
                den[h] = 0.0
                for d in range(D):
                    qf[h, d] = ts.cast(Q[t, kvh * G + h, d], f32) * scale
                    acc[h, d] = 0.0
            for blk in range(lo // BS, ts.ceil_div(hi, BS)):
                block = BT[b, blk]
                k0 = max(lo - blk * BS, 0)
                k1 = min(hi - blk * BS, BS)
                for kk in range(k0, k1):
                    for d in range(D):
                        row[d] = ts.cast(KC[block, kk, kvh, d], f32)
                    for h in range(G):
                        for w in range(W):
                            lanes[w] = 0.0
                        for d0 in range(D // W):
                            for w in range(W):
                                lanes[w] += qf[h, d0 * W + w] * row[d0 * W + w]
                        dot = 0.0
                        for w in range(W):
                            dot += lanes[w]
                        if CAP:
                            dot = cap * ts.tanh(dot * inv_cap)
                        scores[h, kk] = dot
                # Online softmax, once per block: every block holds a key the token sees.
                for h in range(G):
                    top = NEG_INF
                    for kk in range(k0, k1):
                        top = max(top, scores[h, kk])
                    old = m[h]
                    new = max(old, top)
                    alpha = ts.exp(old - new)
                    alpha = ts.select(old == NEG_INF, 0.0, alpha)
                    m[h] = new
                    total = 0.0
                    for kk in range(k0, k1):
                        e = ts.exp(scores[h, kk] - new)
                        scores[h, kk] = e
                        total += e
                    den[h] = den[h] * alpha + total
                    for d in range(D):
                        acc[h, d] = acc[h, d] * alpha
                for kk in range(k0, k1):
                    for d in range(D):
                        row[d] = ts.cast(VC[block, kk, kvh, d], f32)
                    for h in range(G):
                        p = scores[h, kk]
                        for d in range(D):
                            acc[h, d] += p * row[d]
            for h in range(G):
                inv = 1.0 / den[h]
                for d in range(D):
                    Out[t, kvh * G + h, d] = acc[h, d] * inv

    return paged_attention


@functools.cache
def make_write_kv_cache_cpu(dtype: DataType, head_dim: int, block_size: int, slot_dtype: DataType = i64) -> ts.Kernel:
    """kernel(K, V, KC, VC, SLOT): KC[slot // BS, slot % BS] = K[t] (and V) for every t whose
    slot is >= 0; K and V [T, KVH, D], KC and VC [NB, BS, KVH, D], SLOT [T] int32 or int64."""
    T, D, BS, IDX = dtype, head_dim, block_size, slot_dtype

    @ts.kernel(target="cpu", name=f"write_kv_cache_{T.short}_d{D}_bs{BS}_{IDX.short}")
    def write_kv_cache(K: T["NT", "KVH", D], V: T["NT", "KVH", D], KC: T["NB", BS, "KVH", D],
                       VC: T["NB", BS, "KVH", D], SLOT: IDX["NT"]):  # fmt: skip
        for t in ts.parallel(NT):
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
