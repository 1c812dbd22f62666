"""GPU check + timing of the low-bit decode kernel (run on the H200): correctness of every type at
odd sizes and group sizes, then a timing table of configs at K=4096, N=12288."""
import sys
import time

import numpy as np
import torch

import tessera as ts
from tessera.kernels.lowbit_decode import DecodeConfig
from tessera.quant import WEIGHT_TYPES
from tessera.quant.linear import cuda_matmul, prepare
from tessera.quant.quantize import quantize_weight

rng = np.random.default_rng(0)
def check(t, n, k, m, gs, zp=None, config=None):
    w = rng.normal(size=(n, k)).astype(np.float32) * 0.05
    q = quantize_weight(w, t, gs, zp)
    p = prepare(q)
    x = torch.randn(m, k, dtype=torch.float16, device="cuda")
    y = cuda_matmul(x, p, config).float()
    ref = x.double() @ torch.from_numpy(q.dequantize()).cuda().double().T
    err = float((y.double() - ref).norm() / ref.norm())
    return err
from concurrent.futures import ThreadPoolExecutor

from tessera.kernels.lowbit_decode import make_decode
from tessera.quant.layout import padded_shape
from tessera.runtime.cuda import multiprocessor_count

SMS = multiprocessor_count()
CASES = [(16, 256, 1, 128), (40, 520, 3, 32), (100, 1000, 13, None), (48, 776, 9, 8)]
def plan():
    for t in WEIGHT_TYPES:
        for i, (n, k, m, gs) in enumerate(CASES):
            for zp in ((None, True) if t.is_integer and i % 2 == 0 else (None,)):
                yield t, n, k, m, gs, zp
def kernel_of(t, n, k, m, gs, zp):
    kpad = padded_shape(n, k)[1]
    group = kpad if gs is None or gs >= k else gs
    has_bias = (zp is True) or t.kind == "uint"
    return (t, group, has_bias, DecodeConfig.default(t.nbits, m, n, k, SMS))
t0 = time.time()
todo = {kernel_of(*c) for c in plan()}
todo |= {(ts.int4, 128, False, DecodeConfig(w, s, u, mt)) for w, s, u in [(4, 2, 2), (4, 8, 2), (8, 4, 2), (2, 8, 2), (4, 4, 4), (4, 8, 1), (8, 8, 2), (4, 4, 2), (4, 1, 2)] for mt in (1, 2)}
with ThreadPoolExecutor(16) as ex:
    list(ex.map(lambda a: make_decode(*a).build(), todo))
print(f"built {len(todo)} kernels in {time.time()-t0:.1f}s", flush=True)
bad = 0
t0 = time.time()
for t, n, k, m, gs, zp in plan():
        if True:
            try:
                e = check(t, n, k, m, gs, zp)
            except Exception as exc:
                print("FAIL", t, n, k, m, gs, zp, repr(exc)[:300]); bad += 1; continue
            if not e < 2e-3:
                print("BAD", t, n, k, m, gs, zp, e); bad += 1
print(f"correctness: {bad} failures, {time.time()-t0:.1f}s", flush=True)
for cfg in [DecodeConfig(4, 4, 2, 1), DecodeConfig(4, 1, 2, 1), DecodeConfig(4, 8, 2, 2)]:
    e = check(ts.int4, 200, 2048, 5, 128, None, cfg); print("cfg", cfg, e)
    e = check(ts.int4, 200, 2048, 12, 128, None, cfg); print("cfg", cfg, e)

# timing (read flush, as bench/harness.py): default configs against a few variants
if "--time" not in sys.argv:
    sys.exit(0)
sys.path.insert(0, "bench")
from harness import Timer, copy_bandwidth_gbs

timer = Timer()
bw = copy_bandwidth_gbs(timer) * 1e9
N, K = 12288, 4096
wnp = (np.random.default_rng(1).normal(size=(N, K)) * 0.02).astype(np.float32)
for tname in ["int4", "int1", "int8", "e2m1"]:
    t = ts.dtype(tname)
    q = quantize_weight(wnp, t, 128)
    p = prepare(q)
    floor = (p.words.numel() * 4 + q.scales.size * 2 + K * 2 + N * 2) / bw * 1e6
    for m in (1, 16):
        x = torch.randn(m, K, dtype=torch.float16, device="cuda")
        d = DecodeConfig.default(t.nbits, m, N, K, SMS)
        vs = {d, DecodeConfig(d.warps, d.split, d.unroll, d.m_tiles, d.rows, 0)}
        for sp in (2, 4, 8):
            xu = -(-16 // sp)
            vs.add(DecodeConfig(4, sp, d.unroll, d.m_tiles, d.rows, xu))
        res = sorted((timer(cuda_matmul, x, p, c), str(c)) for c in vs)
        print(f"{tname} M={m} floor {floor:.1f} default {d}: " + "  ".join(f"{us:.1f} {c}" for us, c in res), flush=True)
