"""The register-A kernel's last round and stream-K (tessera.kernels.lowbit_gemm_rs, issue 12) on
the H200.  At M=4096 the persistent grid gives each SM whole 256 x 128 tiles; at N=12288 the
twelfth round is 84 tiles for 132 SMs, and the kernel took as long for 1456 tiles as for 1584
(bench/results/2026-11-28-h200-lowbit-rs-streamk.md).  `RegisterAConfig.stream_k` cuts that round
into 256-k shares over all blocks.

Correctness first: the stream-K configs at odd shapes whose last round is shared (two calls with
fresh activations each, against float64 on the dequantised weights; the tickets and sums back
at zero after each).  Then, in interleaved rounds (bench/harness.py: L2 flushed by a 1 GB read, median
of 50), each timed config with and without stream-K next to cuBLAS on the fp16 weights, at
N=12288; `--rounds` adds N=11520 / 11648 / 12672 (11, 12 nearly empty, 12 full rounds).

    python3 bench/lowbit_tail.py [--types int4,int7] [--rounds]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import tessera as ts  # noqa: E402
from tessera.ir.lowbit import FRAGMENT_SPAN  # noqa: E402
from tessera.kernels import lowbit_gemm_rs as rs  # noqa: E402
from tessera.kernels import lowbit_gemm_rs_config as rs_config  # noqa: E402

M0, K0, GROUP = 4096, 4096, 128
TIMED = (rs.CONFIGS[0], rs.CONFIGS[3], rs.CONFIGS[4])  # the default and the word-ring configs (the tuner's usual picks)
ODD = (("uint3", 1000, 5000, 1096), ("e4m3", 700, 12283, 4096), ("int7", 4096, 12288, 4096))


def weights(rng: np.random.Generator, name: str, n: int, k: int):
    from tessera.quant.linear import prepare
    from tessera.quant.quantize import quantize_weight

    return prepare(quantize_weight(rng.normal(size=(n, k)) * 0.05, ts.dtype(name), GROUP))


def check(rng: np.random.Generator, sms: int) -> list:
    """Every stream-K config at the odd shapes: (case, error) for each that fails."""
    import torch

    bad = []
    for name, m, n, k in ODD:
        p = weights(rng, name, n, k)
        t, bias = p.weight.dtype, p.weight.zeros is not None
        w = torch.from_numpy(p.weight.dequantize()).cuda().double()
        for c in rs_config.STREAM_K_CONFIGS:
            if rs.problems(t, p.kernel_group, bias, c):
                continue
            assert c.cut_tiles(m, n, k, sms), (name, m, n, k, str(c))
            for _ in range(2):
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
                rs.lowbit_gemm_rs(x, p.words_for(FRAGMENT_SPAN), p.scales, p.biases, y, t, p.kernel_group, bias, c)
                ref = x.double() @ w.T
                err = float((y.double() - ref).norm() / ref.norm())
                sums, tickets = rs.stream_k_workspace(x, c, c.cut_tiles(m, n, k, sms))
                set_flags = int(tickets.view(torch.int32).ne(0).sum()) + int(sums.ne(0).sum())
                print(f"check {name} {m}x{n}x{k} {c}: rel_err {err:.1e}, tickets and sums left set {set_flags}", flush=True)
                if not (err < 2e-3 and set_flags == 0):
                    bad.append((name, m, n, k, str(c), err, set_flags))
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="int4,int7")
    ap.add_argument("--rounds", action="store_true", help="also N = 11520, 11648, 12672")
    args = ap.parse_args()

    import torch
    from harness import Timer

    from tessera.runtime.cuda import multiprocessor_count

    rng = np.random.default_rng(0)
    sms = multiprocessor_count()
    bad = check(rng, sms)
    timer = Timer()
    for name in args.types.split(","):
        calls = {}
        for n in (11520, 11648, 12288, 12672) if args.rounds else (12288,):
            p = weights(rng, name, n, K0)
            t, bias = p.weight.dtype, p.weight.zeros is not None
            x = torch.randn(M0, K0, dtype=torch.float16, device="cuda")
            y = torch.empty(M0, n, dtype=torch.float16, device="cuda")
            for c in (c for plain in TIMED for c in (plain, dataclasses.replace(plain, stream_k=True))):
                if not rs.problems(t, p.kernel_group, bias, c):
                    label = f"N={n} {c} ({c.whole_tiles(M0, n, K0, sms)} of {c.tiles(M0, n)} tiles whole)"
                    calls[label] = functools.partial(rs.lowbit_gemm_rs, x, p.words_for(FRAGMENT_SPAN), p.scales, p.biases,
                                                     y, t, p.kernel_group, bias, c)  # fmt: skip
            w16 = torch.from_numpy(p.weight.dequantize()).cuda().half()
            calls[f"N={n} cuBLAS fp16"] = functools.partial(torch.matmul, x, w16.T)
        times = timer.side_by_side(calls)
        for label, us in times.items():
            blas = times[f"{label.split()[0]} cuBLAS fp16"]
            print(f"{name} {label:62} {us:7.1f} us  {blas / us:.3f}x cuBLAS", flush=True)
    print("stream-K checks failed:" if bad else "stream-K checks: all passed", bad or "", flush=True)


if __name__ == "__main__":
    main()
