"""GPU check + timing of the low-bit decode kernel (run on the H200): correctness of every type at
odd sizes and group sizes, then (with --time) a timing table of configs at K=4096, N=12288."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness

import tessera as ts  # noqa: E402
from tessera.kernels.lowbit_decode import DecodeConfig, make_decode  # noqa: E402
from tessera.quant import WEIGHT_TYPES  # noqa: E402
from tessera.quant.layout import padded_shape  # noqa: E402
from tessera.quant.linear import cuda_matmul, prepare  # noqa: E402
from tessera.quant.quantize import quantize_weight  # noqa: E402
from tessera.runtime.cuda import multiprocessor_count  # noqa: E402

CASES = [(16, 256, 1, 128), (40, 520, 3, 32), (100, 1000, 13, None), (48, 776, 9, 8)]
rng = np.random.default_rng(0)


def check(t: Any, n: int, k: int, m: int, gs: int | None, zp: bool | None = None, config: Any = None) -> float:
    """Relative error of the decode GEMM against float64 torch on the dequantized weight."""
    w = rng.normal(size=(n, k)).astype(np.float32) * 0.05
    q = quantize_weight(w, t, gs, zp)
    p = prepare(q)
    x = torch.randn(m, k, dtype=torch.float16, device="cuda")
    y = cuda_matmul(x, p, config).float()
    ref = x.double() @ torch.from_numpy(q.dequantize()).cuda().double().T
    return float((y.double() - ref).norm() / ref.norm())


def plan() -> Iterator[tuple[Any, int, int, int, int | None, bool | None]]:
    for t in WEIGHT_TYPES:
        for i, (n, k, m, gs) in enumerate(CASES):
            for zp in (None, True) if t.is_integer and i % 2 == 0 else (None,):
                yield t, n, k, m, gs, zp


def kernel_of(sms: int, t: Any, n: int, k: int, m: int, gs: int | None, zp: bool | None) -> tuple[Any, ...]:
    kpad = padded_shape(n, k)[1]
    group = kpad if gs is None or gs >= k else gs
    has_bias = (zp is True) or t.kind == "uint"
    return (t, group, has_bias, DecodeConfig.default(t.nbits, m, n, k, sms))


def correctness(sms: int) -> None:
    t0 = time.time()
    todo = {kernel_of(sms, *c) for c in plan()}
    todo |= {(ts.int4, 128, False, DecodeConfig(w, s, u, mt))
             for w, s, u in [(4, 2, 2), (4, 8, 2), (8, 4, 2), (2, 8, 2), (4, 4, 4), (4, 8, 1), (8, 8, 2), (4, 4, 2), (4, 1, 2)]
             for mt in (1, 2)}  # fmt: skip
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda a: make_decode(*a).build(), todo))
    print(f"built {len(todo)} kernels in {time.time() - t0:.1f}s", flush=True)
    bad = 0
    t0 = time.time()
    for t, n, k, m, gs, zp in plan():
        try:
            e = check(t, n, k, m, gs, zp)
        except Exception as exc:  # noqa: BLE001  (a dev script: report every case, go on)
            print("FAIL", t, n, k, m, gs, zp, repr(exc)[:300])
            bad += 1
            continue
        if not e < 2e-3:
            print("BAD", t, n, k, m, gs, zp, e)
            bad += 1
    print(f"correctness: {bad} failures, {time.time() - t0:.1f}s", flush=True)
    for cfg in [DecodeConfig(4, 4, 2, 1), DecodeConfig(4, 1, 2, 1), DecodeConfig(4, 8, 2, 2)]:
        for m in (5, 12):
            print("cfg", cfg, check(ts.int4, 200, 2048, m, 128, None, cfg))


def timing(sms: int) -> None:
    """Default configs against a few variants (read flush, as bench/harness.py)."""
    from harness import Timer, copy_bandwidth_gbs

    timer = Timer()
    bw = copy_bandwidth_gbs(timer) * 1e9
    n, k = 12288, 4096
    wnp = (np.random.default_rng(1).normal(size=(n, k)) * 0.02).astype(np.float32)
    for tname in ["int4", "int1", "int8", "e2m1"]:
        t = ts.dtype(tname)
        q = quantize_weight(wnp, t, 128)
        p = prepare(q)
        floor = (p.words.numel() * 4 + q.scales.size * 2 + k * 2 + n * 2) / bw * 1e6
        for m in (1, 16):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            d = DecodeConfig.default(t.nbits, m, n, k, sms)
            vs = {d, DecodeConfig(d.warps, d.split, d.unroll, d.m_tiles, d.rows, 0)}
            for sp in (2, 4, 8):
                vs.add(DecodeConfig(4, sp, d.unroll, d.m_tiles, d.rows, -(-16 // sp)))
            res = sorted((timer(cuda_matmul, x, p, c), str(c)) for c in vs)
            print(f"{tname} M={m} floor {floor:.1f} default {d}: " + "  ".join(f"{us:.1f} {c}" for us, c in res),
                  flush=True)  # fmt: skip


def main() -> None:
    sms = multiprocessor_count()
    correctness(sms)
    if "--time" in sys.argv:
        timing(sms)


if __name__ == "__main__":
    main()
