"""GPU check + timing of the low-bit decode kernel (run on the H200): correctness of every type at
odd sizes and group sizes, then a timing table of configs at K=4096, N=12288."""
import sys, time, itertools
import numpy as np, torch
import tessera as ts
from tessera.quant import WEIGHT_TYPES
from tessera.quant.quantize import quantize_weight
from tessera.quant.linear import prepare, cuda_matmul
from tessera.kernels.lowbit_decode import DecodeConfig

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
from tessera.quant.linear import multiprocessor_count
from tessera.quant.layout import padded_shape
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

# timing (read flush, as bench/harness.py)
sys.path.insert(0, "bench")
from harness import Timer, copy_bandwidth_gbs
timer = Timer()
bw = copy_bandwidth_gbs(timer) * 1e9
print(f"copy bandwidth {bw/1e9:.0f} GB/s")
N, K = 12288, 4096
wf = torch.randn(N, K, dtype=torch.float16, device="cuda") * 0.05
for m in (1, 16):
    xm = torch.randn(m, K, dtype=torch.float16, device="cuda")
    print(f"cublas fp16 M={m}: {timer(torch.matmul, xm, wf.T):.1f} us")
wnp = wf.float().cpu().numpy()
V = [(4, 1, 2, 1, 1), (4, 2, 2, 1, 1), (4, 4, 2, 1, 1), (4, 8, 2, 1, 1), (8, 4, 2, 1, 1), (4, 4, 4, 1, 1), (4, 2, 2, 1, 2), (4, 4, 2, 1, 2), (8, 2, 2, 1, 2), (4, 2, 4, 1, 2)]
todo = set()
for tname in ["int4", "int1", "int2", "int3", "int5", "int8", "e2m1", "e4m3", "uint4"]:
    for v in V:
        for mt in (1, 2):
            c = DecodeConfig(v[0], v[1], v[2] if tname != "int1" else 8, mt, v[4])
            todo.add((ts.dtype(tname), 128, ts.dtype(tname).kind == "uint", c))
with ThreadPoolExecutor(16) as ex:
    list(ex.map(lambda a: make_decode(*a).build(), todo))
for tname in ["int4", "int1", "int2", "int3", "int5", "int8", "e2m1", "e4m3", "uint4"]:
    t = ts.dtype(tname)
    q = quantize_weight(wnp, t, 128)
    p = prepare(q)
    floor = (p.words.numel() * 4 + p.scales.numel() * 2 + (p.biases.numel() * 2 if q.zeros is not None else 0) + K * 2 + N * 2) / bw * 1e6
    row = [f"{tname:6s} floor {floor:5.1f}"]
    for m in (1, 16):
        x = torch.randn(m, K, dtype=torch.float16, device="cuda")
        best = (1e9, None)
        for v in [None] + V:
            cfg = None if v is None else DecodeConfig(v[0], v[1], v[2] if tname != "int1" else 8, 1 if m <= 8 else 2, v[4])
            us = timer(cuda_matmul, x, p, cfg)
            if v is None:
                row.append(f"M={m} default {us:.1f}")
            best = min(best, (us, str(cfg)))
        row.append(f"best {best[0]:.1f} {best[1]}")
    print(" | ".join(row), flush=True)
