"""Dev tool: time decode-kernel configs (and run a few under ncu with --ncu) at K=4096, N=12288."""
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, "bench")
from harness import Timer, copy_bandwidth_gbs  # noqa: E402

import tessera as ts  # noqa: E402
from tessera.kernels.lowbit_decode import DecodeConfig, make_decode  # noqa: E402
from tessera.quant.linear import cuda_matmul, prepare  # noqa: E402
from tessera.quant.quantize import quantize_weight  # noqa: E402

N, K = 12288, 4096
rng = np.random.default_rng(0)
wnp = rng.normal(size=(N, K)).astype(np.float32) * 0.02
TYPES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["int4", "int1", "int8", "e2m1", "uint3"]


def variants(bits, m):
    mt = 1 if m <= 8 else 2
    u0 = {1: 8, 2: 4, 3: 2, 4: 2}.get(bits, 1)
    out = []
    for pipe in (True, False):
        for w, s, u, r in [(4, 4, u0, 1), (4, 2, u0, 1), (4, 8, u0, 1), (8, 4, u0, 1), (2, 8, u0, 1), (4, 4, max(1, u0 // 2), 1),
                           (4, 4, u0, 2), (4, 2, u0, 2), (4, 8, max(1, u0 // 2), 1), (8, 8, max(1, u0 // 2), 1)]:
            out.append(DecodeConfig(w, s, u, mt, r, pipe))
    return out


if sys.argv[1] == "ncu":
    for tname in TYPES[:2]:
        t = ts.dtype(tname)
        p = prepare(quantize_weight(wnp, t, 128))
        x = torch.randn(1, K, dtype=torch.float16, device="cuda")
        for pipe in (False, True):
            cfg = DecodeConfig(4, 4, {1: 8, 4: 2}.get(t.nbits, 1), 1, 1, pipe)
            for _ in range(2):
                cuda_matmul(x, p, cfg)
        torch.cuda.synchronize()
    sys.exit()

timer = Timer()
bw = copy_bandwidth_gbs(timer) * 1e9
print(f"copy {bw / 1e9:.0f} GB/s")
todo = {(ts.dtype(tn), 128, ts.dtype(tn).kind == "uint", c) for tn in TYPES for m in (1, 16) for c in variants(ts.dtype(tn).nbits, m)}
with ThreadPoolExecutor(16) as ex:
    list(ex.map(lambda a: make_decode(*a).build(), todo))
for tname in TYPES:
    t = ts.dtype(tname)
    q = quantize_weight(wnp, t, 128)
    p = prepare(q)
    floor = (p.words.numel() * 4 + q.scales.size * 2 + K * 2 + N * 2) / bw * 1e6
    for m in (1, 16):
        x = torch.randn(m, K, dtype=torch.float16, device="cuda")
        res = sorted((timer(cuda_matmul, x, p, c), str(c)) for c in variants(t.nbits, m))
        print(f"{tname} M={m} floor {floor:.1f}: " + "  ".join(f"{us:.1f} {c}" for us, c in res), flush=True)
