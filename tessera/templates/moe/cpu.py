"""The fused_moe kernels on the CPU, written in tessera (generated C, OpenMP).

Four steps, each a kernel, all float32 (tessera.graph.opdefs.moe says what the operator computes):

1. `make_route` — per token: the router's logits, softmax or sigmoid scores, the top k (ties to the
   lower index), normalised and scaled weights, and the shared expert's gate logit.
2. `make_group` — one serial pass that sorts the (token, choice) pairs by expert: OFF [E + 1]
   offsets, ROW (the token of each sorted slot) and POS (each choice's slot), stable in token
   order, so results do not depend on threads.
3. `make_expert_up` / `make_expert_down` — the grouped GEMMs: a worker item is (expert, block of
   output columns) and walks only that expert's slots, so an expert no token chose costs nothing
   and only the chosen experts' weights are read (decode runs at the speed of its active weights).
   The up kernel writes silu(gate) * up per slot; `dense` variants run one expert over every
   token (the shared expert).
4. `make_combine` — per token: its choices' down outputs weighted, plus the (gated) shared expert.

Every token-count size is a run-time size, so a kernel is built once per model shape (experts,
hidden and intermediate sizes, top k and the routing flags), whatever the batch.
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f32, i32

NEG_INF = float("-inf")
COLUMNS = 16  # output columns per worker item of the expert GEMMs: a block of weight rows stays in cache
SLOTS = 4  # slots (rows) of one expert per pass of the expert GEMMs: each weight load serves all of them
# Multiply-adds below which a kernel runs on one thread (waking the OpenMP team costs more).
SERIAL_WORK = 1 << 18


def lanes_for(n: int) -> int:
    """Independent partial sums of a dot product over n values (gcc vectorises them, where one
    running float sum stays scalar)."""
    return 8 if n % 8 == 0 else 1


def _loop(parallel: bool):
    return ts.parallel if parallel else range


@functools.cache
def make_route(experts: int, hidden: int, top_k: int, softmax: bool, normalize: bool, parallel: bool = True,
               groups: int = 1, topk_group: int = 1) -> ts.Kernel:  # fmt: skip
    """kernel(X [T, H], RW [E, H], SG [1, H], CB [E], TI int32 [T, k], TW [T, k], SGV [T], scale):
    experts chosen by score + CB[e], within the `topk_group` best of `groups` groups (by their two
    best choice scores); weights the scores themselves."""
    E, H, K, W, G, GK = experts, hidden, top_k, lanes_for(hidden), groups, topk_group
    per = experts // groups
    items = _loop(parallel)

    @ts.kernel(target="cpu", name=f"moe_route_e{E}_h{H}_k{K}_{'soft' if softmax else 'sig'}"
                                  f"{'_norm' if normalize else ''}{f'_g{G}x{GK}' if G > 1 else ''}"
                                  f"{'' if parallel else '_serial'}")  # fmt: skip
    def moe_route(X: f32["T", H], RW: f32[E, H], SG: f32[1, H], CB: f32[E], TI: i32["T", K], TW: f32["T", K],
                  SGV: f32["T"], scale: f32):  # fmt: skip
        for t in items(T):
            sc = ts.register_tensor(f32, [E])
            choice = ts.register_tensor(f32, [E])
            gsum = ts.register_tensor(f32, [G])
            taken = ts.register_tensor(i32, [E])
            lanes = ts.register_tensor(f32, [W])
            for e in range(E + 1):  # the experts' logits, then the shared gate's (row E: SG)
                for w in range(W):
                    lanes[w] = 0.0
                for h0 in range(H // W):
                    for w in range(W):
                        h = h0 * W + w
                        lanes[w] += X[t, h] * ts.select(e < E, RW[min(e, E - 1), h], SG[0, h])
                dot = 0.0
                for w in range(W):
                    dot += lanes[w]
                if e < E:
                    sc[e] = dot
                else:
                    SGV[t] = dot
            if softmax:
                top = NEG_INF
                for e in range(E):
                    top = max(top, sc[e])
                total = 0.0
                for e in range(E):
                    sc[e] = ts.exp(sc[e] - top)
                    total += sc[e]
                for e in range(E):
                    sc[e] = sc[e] / total
            else:
                for e in range(E):
                    sc[e] = 1.0 / (1.0 + ts.exp(-sc[e]))
            for e in range(E):
                taken[e] = 0
                choice[e] = sc[e] + CB[e]
            if G > 1:  # keep the GK groups whose two best choice scores sum highest
                for g in range(G):
                    m1 = NEG_INF
                    m2 = NEG_INF
                    for e in range(g * per, g * per + per):
                        v = choice[e]
                        m2 = ts.select(v > m1, m1, max(m2, v))
                        m1 = max(m1, v)
                    gsum[g] = m1 + m2
                for _ in range(GK):
                    top = 0.0
                    pick = -1
                    for g in range(G):
                        better = gsum[g] != NEG_INF and (pick < 0 or gsum[g] > top)
                        pick = ts.select(better, g, pick)
                        top = ts.select(better, gsum[g], top)
                    gsum[max(pick, 0)] = NEG_INF  # chosen: marked
                for g in range(G):
                    if gsum[g] != NEG_INF:  # not chosen: its experts are out
                        for e in range(g * per, g * per + per):
                            choice[e] = NEG_INF
            chosen = 0.0
            for j in range(K):
                best = 0.0
                pick = -1
                for e in range(E):  # strictly greater: the lower index wins a tie
                    better = taken[e] == 0 and (pick < 0 or choice[e] > best)
                    pick = ts.select(better, e, pick)
                    best = ts.select(better, choice[e], best)
                taken[pick] = 1
                TI[t, j] = pick
                TW[t, j] = sc[pick]
                chosen += sc[pick]
            for j in range(K):
                if normalize:
                    TW[t, j] = TW[t, j] / chosen * scale
                else:
                    TW[t, j] = TW[t, j] * scale

    return moe_route


@functools.cache
def make_group(experts: int, top_k: int) -> ts.Kernel:
    """kernel(TI int32 [T, k], OFF int32 [E + 1], ROW int32 [T * k], POS int32 [T, k]): one serial pass."""
    E, K = experts, top_k

    @ts.kernel(target="cpu", name=f"moe_group_e{E}_k{K}")
    def moe_group(TI: i32["T", K], OFF: i32[E + 1], ROW: i32["TK"], POS: i32["T", K]):
        fill = ts.register_tensor(i32, [E])
        for e in range(E + 1):
            OFF[e] = 0
        for t in range(T):
            for j in range(K):
                OFF[TI[t, j] + 1] += 1
        for e in range(E):
            OFF[e + 1] += OFF[e]
            fill[e] = OFF[e]
        for t in range(T):
            for j in range(K):
                e = TI[t, j]
                slot = fill[e]
                fill[e] = slot + 1
                ROW[slot] = t
                POS[t, j] = slot

    return moe_group


@functools.cache
def make_expert_up(experts: int, hidden: int, inter: int, dense: bool, parallel: bool = True) -> ts.Kernel:
    """kernel(X [T, H], GU [E, 2I, H], OFF int32 [E + 1], ROW int32 [S], HS [S, I]): for each slot s
    of expert e (OFF[e] <= s < OFF[e + 1], token ROW[s]) HS[s] = silu(gate) * up of that expert.
    `dense`: one expert over every token (slot s is token s; OFF and ROW are not read)."""
    E, H, N, W, C, R = experts, hidden, inter, lanes_for(hidden), COLUMNS, SLOTS
    NB = -(-inter // COLUMNS)
    items = _loop(parallel)

    @ts.kernel(target="cpu", name=f"moe_up_e{E}_h{H}_i{N}{'_dense' if dense else ''}{'' if parallel else '_serial'}")
    def moe_up(X: f32["T", H], GU: f32[E, 2 * N, H], OFF: i32[E + 1], ROW: i32["S"], HS: f32["S", N]):
        for item in items(E * NB):
            e = item // NB
            c0 = item % NB * C
            c1 = min(c0 + C, N)
            gl = ts.register_tensor(f32, [R, W])
            ul = ts.register_tensor(f32, [R, W])
            tok = ts.register_tensor(i32, [R])
            lo = ts.select(dense, 0, OFF[e])
            hi = ts.select(dense, T, OFF[e + 1])
            for b in range(ts.ceil_div(hi - lo, R)):  # R slots at once share each weight load
                s0 = lo + b * R
                rows = min(R, hi - s0)
                for r in range(R):  # a short last tile repeats its last token; only `rows` are stored
                    last = min(s0 + r, hi - 1)
                    tok[r] = ts.select(dense, last, ROW[last])
                for c in range(c0, c1):
                    for r in range(R):
                        for w in range(W):
                            gl[r, w] = 0.0
                            ul[r, w] = 0.0
                    for h0 in range(H // W):
                        for r in range(R):
                            for w in range(W):
                                h = h0 * W + w
                                xv = X[tok[r], h]
                                gl[r, w] += xv * GU[e, c, h]
                                ul[r, w] += xv * GU[e, N + c, h]
                    for r in range(rows):
                        g = 0.0
                        u = 0.0
                        for w in range(W):
                            g += gl[r, w]
                            u += ul[r, w]
                        HS[s0 + r, c] = g / (1.0 + ts.exp(-g)) * u

    return moe_up


@functools.cache
def make_expert_down(experts: int, hidden: int, inter: int, dense: bool, parallel: bool = True) -> ts.Kernel:
    """kernel(HS [S, I], DN [E, H, I], OFF int32 [E + 1], YS [S, H]): YS[s] = DN[e] @ HS[s] for
    each slot s of expert e (`dense`: one expert, every slot)."""
    E, H, N, W, C, R = experts, hidden, inter, lanes_for(inter), COLUMNS, SLOTS
    NB = -(-hidden // COLUMNS)
    items = _loop(parallel)

    @ts.kernel(target="cpu", name=f"moe_down_e{E}_h{H}_i{N}{'_dense' if dense else ''}{'' if parallel else '_serial'}")
    def moe_down(HS: f32["S", N], DN: f32[E, H, N], OFF: i32[E + 1], YS: f32["S", H]):
        for item in items(E * NB):
            e = item // NB
            c0 = item % NB * C
            c1 = min(c0 + C, H)
            lanes = ts.register_tensor(f32, [R, W])
            lo = ts.select(dense, 0, OFF[e])
            hi = ts.select(dense, S, OFF[e + 1])
            for b in range(ts.ceil_div(hi - lo, R)):  # R slots at once share each weight load
                s0 = lo + b * R
                rows = min(R, hi - s0)
                for c in range(c0, c1):
                    for r in range(R):
                        for w in range(W):
                            lanes[r, w] = 0.0
                    for i0 in range(N // W):
                        for r in range(R):  # a short last tile repeats its last slot; only `rows` are stored
                            for w in range(W):
                                i = i0 * W + w
                                lanes[r, w] += HS[min(s0 + r, hi - 1), i] * DN[e, c, i]
                    for r in range(rows):
                        dot = 0.0
                        for w in range(W):
                            dot += lanes[r, w]
                        YS[s0 + r, c] = dot

    return moe_down


@functools.cache
def make_combine(hidden: int, top_k: int, shared: bool, gated: bool, parallel: bool = True) -> ts.Kernel:
    """kernel(YS [T * k, H], TW [T, k], POS int32 [T, k], YSH [TS, H], SGV [T], Y [T, H]):
    Y[t] = sum_j TW[t, j] * YS[POS[t, j]], plus YSH[t] (times sigmoid(SGV[t]) when `gated`)
    with a `shared` expert (else YSH and SGV are not read)."""
    H, K = hidden, top_k
    items = _loop(parallel)

    @ts.kernel(target="cpu", name=f"moe_combine_h{H}_k{K}{'_shared' if shared else ''}{'_gated' if gated else ''}"
                                  f"{'' if parallel else '_serial'}")  # fmt: skip
    def moe_combine(YS: f32["TK", H], TW: f32["T", K], POS: i32["T", K], YSH: f32["TS", H], SGV: f32["T"],
                    Y: f32["T", H]):  # fmt: skip
        for t in items(T):
            gate = 1.0
            if gated:
                gate = 1.0 / (1.0 + ts.exp(-SGV[t]))
            for c in range(H):
                acc = 0.0
                for j in range(K):
                    acc += TW[t, j] * YS[POS[t, j], c]
                if shared:
                    acc += gate * YSH[t, c]
                Y[t, c] = acc

    return moe_combine
