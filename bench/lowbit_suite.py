"""Suite `lowbit` (issue 12): low-bit weight x fp16 activation GEMM, every weight type, vs cuBLAS
fp16 weights, torch's tinygemm int4 (`_weight_int4pack_mm`, bf16) and Humming (bench/lowbit_peers.py,
where its wheel is installed; at N=12288, K=4096 and every group, not on the Llama-3 shapes: each
new type, group and shape costs it ~16 s of JIT) in the same run.

Rows: case `M=..,N=..,K=..,w=<type>,g=<group|ch>,fp16`, tessera_us, floor_us (bytes the kernel
must move: packed weights + scales (+ zero points) + activations + output, over the copy
bandwidth measured in this run), peers_us, rel_err against float64 on the dequantised weights.
Each case times every system in interleaved rounds (harness.Timer.side_by_side).  Past
DECODE_MAX_M rows, peer `cublas_dequantised` is cuBLAS on the dequantised weights rounded to
fp16: at this power-limited card's compute-bound shapes the clock follows the data the tensor
cores multiply, so it tells the kernel's own efficiency (the same values) apart from the
weights' (issue 12's bar is `cublas`, on the original fp16 weights).
Tilus is not run: its wheel has no quantized matmul (lowbit_peers.py)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from harness import Timer, rel_err
from lowbit_peers import HummingPeer

import tessera as ts
from tessera.quant import WEIGHT_TYPES
from tessera.quant.linear import DECODE_MAX_M, chosen_kernel, cuda_matmul, prepare
from tessera.quant.quantize import quantize_weight

N0, K0 = 12288, 4096
MS = (1, 2, 4, 8, 16, 32, 64, 128, 4096)
LLAMA3 = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def cases(quick: bool) -> list[tuple[int, int, int, str, int | None]]:
    out = []
    ms = (1, 16, 4096) if quick else MS
    for t in WEIGHT_TYPES:
        for m in ms:
            out.append((m, N0, K0, t.name, 128))
    for g in (32, 64, None):
        for m in (1, 16):
            out.append((m, N0, K0, "int4", g))
    for n, k in LLAMA3:
        for m in (1, 16):
            out.append((m, n, k, "int4", 128))
    return out


def _tinygemm(x: torch.Tensor, w: torch.Tensor, group: int):
    """torch's int4 tinygemm on the same weights (bf16 activations, its own RTN), or None."""
    try:
        n, k = w.shape
        wg = w.float().reshape(n, k // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-6)
        zero = lo + scale * 8
        q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        try:  # torch >= 2.5 takes two codes per byte
            packed = torch._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
        except RuntimeError:
            packed = torch._convert_weight_to_int4pack(q, 8)
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        fn = lambda: torch._weight_int4pack_mm(xb, packed, group, sz)  # noqa: E731
        fn()
        return fn
    except Exception as exc:  # noqa: BLE001  (API differences between torch versions)
        print(f"tinygemm unavailable: {type(exc).__name__}: {str(exc)[:120]}")
        return None


def prebuild_prefill(todo: list[tuple[int, int, int, str, int | None]]) -> None:
    """Build every prefill candidate the cases past DECODE_MAX_M will tune, in one parallel pass
    over all of them (tuning builds only one shape's few candidates at a time): minutes of GPU
    time saved on a fresh machine.  A kernel that fails to build is left to the tuner, which
    reports and skips it."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from tessera.quant.layout import padded_shape
    from tessera.quant.linear import PREPARED_SPAN
    from tessera.quant.tune import prefill_candidates, prefill_kernel

    kernels = {}
    for m, n, k, tname, g in todo:
        if m <= DECODE_MAX_M:
            continue
        t, kpad = ts.dtype(tname), padded_shape(n, k)[1]
        group, zeros = kpad if g is None or g >= k else g, t.kind == "uint"  # (quantize_weight's zero points)
        for c in prefill_candidates(t, group, zeros, PREPARED_SPAN, register_a=True):
            kern = prefill_kernel(t, group, zeros, PREPARED_SPAN, c)
            kernels[id(kern)] = kern

    def build(kern) -> None:  # noqa: ANN001
        try:
            kern.build()
        except Exception:  # noqa: BLE001, S110  (the tuner builds it again and reports why)
            pass

    with ThreadPoolExecutor(os.cpu_count() or 4) as ex:
        list(ex.map(build, kernels.values()))


def lowbit_suite(timer: Timer, copy_gbs: float, quick: bool = False, shard: tuple[int, int] = (1, 1),
                 ms: tuple[int, ...] | None = None, types: tuple[str, ...] | None = None) -> list[dict]:  # fmt: skip
    """Rows for every case (with `ms`, those of these M only; with `types`, those of these weight
    types only; with shard (i, n): the i-th of n
    contiguous parts of them, for runs that must fit a time limit); with TESSERA_BENCH_BUDGET_S
    set, the cases started within that many seconds (a partial run says so in its printout)."""
    import os
    import time

    budget = float(os.environ.get("TESSERA_BENCH_BUDGET_S", "inf"))
    start = time.monotonic()
    rows = []
    rng = np.random.default_rng(0)
    weights: dict[tuple[int, int], torch.Tensor] = {}
    prepared: dict[tuple, tuple] = {}
    humming = HummingPeer()
    todo = [c for c in cases(quick) if (ms is None or c[0] in ms) and (types is None or c[3] in types)]
    part, parts = shard
    if not 1 <= part <= parts:
        raise ValueError(f"shard {part}/{parts}: the part must be between 1 and {parts}")
    todo = todo[(part - 1) * len(todo) // parts:part * len(todo) // parts]
    prebuild_prefill(todo)
    for i, (m, n, k, tname, g) in enumerate(todo):
        if time.monotonic() - start > budget:
            print(f"time budget of {budget:.0f} s spent: {len(todo) - i} of {len(todo)} cases not run")
            break
        t = ts.dtype(tname)
        wf = weights.get((n, k))
        if wf is None:
            wf = weights[(n, k)] = torch.from_numpy(rng.normal(size=(n, k)).astype(np.float32) * 0.02).cuda().half()
        key = (tname, g, n, k)
        if key not in prepared:  # one quantisation per weight, shared by the M values
            prepared.clear()
            q = quantize_weight(wf.float().cpu().numpy(), t, g)
            prepared[key] = (q, prepare(q), torch.from_numpy(q.dequantize()).cuda())
        q, p, wdq = prepared[key]
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        y = cuda_matmul(x, p)
        ref = x.double() @ wdq.double().T
        err = rel_err(y, ref)
        calls = {"tessera": functools.partial(cuda_matmul, x, p), "cublas": functools.partial(torch.matmul, x, wf.T)}
        if m > DECODE_MAX_M:
            calls["cublas_dequantised"] = functools.partial(torch.matmul, x, wdq.half().T)
        if tname == "int4" and g in (32, 64, 128, 256):
            tg = _tinygemm(x, wf, g)
            if tg is not None:
                calls["tinygemm"] = tg
        if (n, k) == (N0, K0):
            hm = humming(x, wf, tname, g)
            if hm is not None:
                calls["humming"] = hm
        peers = timer.side_by_side(calls)  # interleaved rounds: clock drift hits every system alike
        us = peers.pop("tessera")
        moved = p.words.numel() * 4 + q.scales.size * 2 + (q.zeros.size * 2 if q.zeros is not None else 0)
        moved += m * k * 2 + m * n * 2
        floor = moved / (copy_gbs * 1e9) * 1e6
        gname = "ch" if g is None else str(g)
        chosen = chosen_kernel(p, m)
        row = {"case": f"M={m},N={n},K={k},w={tname},g={gname},fp16", "tessera_us": us, "floor_us": floor,
               "config": "" if chosen is None else str(chosen),
               "peers_us": peers, "rel_err": err, "vs_floor": us / floor, "vs_cublas": peers["cublas"] / us,
               "target_us": 1.25 * floor + 1.5, "copy_gbs": copy_gbs}  # fmt: skip
        print(f"{row['case']}: {us:.1f} us (floor {floor:.1f}, target {row['target_us']:.1f}), peers "
              f"{ {k2: round(v, 1) for k2, v in peers.items()} }, rel_err {err:.1e}", flush=True)  # fmt: skip
        rows.append(row)
    return rows
