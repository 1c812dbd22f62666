"""Suite `lowbit` (issue 12): low-bit weight x fp16 activation GEMM, every weight type, vs cuBLAS
fp16 weights, torch's tinygemm int4 (`_weight_int4pack_mm`, bf16) and Humming (`HummingPeer` below,
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
Peers that travel as wheels (bench/PROTOCOL.md; carried in `.whl`, see the device README):
Humming (`humming-kernels` 0.1.19, the any-width weight-only kernels vLLM ships).  Its adapter
quantises the same fp16 weights with Humming's own round-to-nearest and returns a zero-argument
callable that runs its GEMM on x, or None with the reason printed once (a peer that is not
installed or refuses a type is reported, never silently dropped).  Tilus 0.2.0's wheel ships the
language, not a quantized matmul (that lives in its repository's examples), so it is not run;
bench/PROTOCOL.md gives its published number."""

from __future__ import annotations

import functools

import numpy as np
import torch
from harness import Timer, rel_err

import tessera as ts
from tessera.eager.lowbit import DECODE_MAX_M, chosen_kernel, cuda_matmul, prepare
from tessera.quant import WEIGHT_TYPES
from tessera.quant.quantize import quantize_weight

N0, K0 = 12288, 4096
MS = (1, 2, 4, 8, 16, 32, 64, 128, 4096)
LLAMA3 = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))

# tessera weight type -> Humming's name (Humming stores signed integers as unsigned codes)
_HUMMING_TYPES = {"e2m1": "float4e2m1", "e2m3": "float6e2m3", "e3m2": "float6e3m2", "e4m3": "float8e4m3",
                  "e5m2": "float8e5m2"}  # fmt: skip
_REPORTED: set[str] = set()


def _report(key: str, message: str) -> None:
    if key not in _REPORTED:
        _REPORTED.add(key)
        print(message, flush=True)


def humming_type(tname: str) -> str:
    """Humming's dtype string for a tessera weight type name (int4 -> uint4, e4m3 -> float8e4m3)."""
    if tname in _HUMMING_TYPES:
        return _HUMMING_TYPES[tname]
    return "uint" + tname.removeprefix("u").removeprefix("int")


class HummingPeer:
    """One quantised Humming layer per (Humming type, group, N, K), reused across M and by the
    signed and unsigned tessera types of one width (Humming stores both as unsigned codes)."""

    def __init__(self) -> None:
        self.layers: dict[tuple, object] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, tname: str, group: int | None):
        try:
            from humming.layer import HummingLayer
        except Exception as exc:  # noqa: BLE001  (not installed, or its import fails)
            _report("import", f"humming unavailable: {type(exc).__name__}: {str(exc)[:160]}")
            return None
        n, k = w.shape
        key = (humming_type(tname), group, n, k)
        try:
            layer = self.layers.get(key)
            if layer is None:
                layer = HummingLayer(shape_n=n, shape_k=k, torch_dtype=torch.float16,
                                     weight_config={"dtype": humming_type(tname), "group_size": group or 0}).cuda()  # fmt: skip
                layer.load_from_unquantized(w.to(torch.float16))
                layer.transform()
                self.layers[key] = layer
            fn = lambda: layer(x)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            return fn
        except Exception as exc:  # noqa: BLE001  (a type or shape the peer refuses)
            _report(f"{tname},{group}", f"humming refused w={tname} g={group}: {type(exc).__name__}: {str(exc)[:200]}")
            return None


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

    from tessera.eager.lowbit import PREPARED_SPAN
    from tessera.quant.layout import padded_shape
    from tessera.templates.lowbit.tune import prefill_candidates, prefill_kernel

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
