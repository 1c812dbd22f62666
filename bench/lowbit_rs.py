"""The register-A low-bit prefill kernel (tessera.kernels.lowbit_gemm_rs) on the H200, next to
the shared-memory fused kernel (tessera.kernels.lowbit_gemm), the two passes users get today
(`prefill_matmul`: dequantise, then the fp16 GEMM) and cuBLAS on the fp16 weights, at K=4096,
N=12288, group 128, M=4096 (bench/harness.py: L2 flushed by a 1 GB read, CUDA events, median
of 50, the variants in interleaved rounds), every config.  Correctness first, in the same
run: odd shapes (zero points, groups of 32, per channel, M and N past a tile) and every timed
case against float64 on the dequantised weights, two calls with fresh activations each.

    python3 bench/lowbit_rs.py                   # GPU: check, time, print; JSONL + table under $OUT if set
    python3 bench/lowbit_rs.py --dry-run         # no GPU: build every kernel with nvcc only
    python3 bench/lowbit_rs.py --types int4,int1
    python3 bench/lowbit_rs.py --table results.jsonl   # no GPU: the markdown table of an earlier run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import tessera as ts  # noqa: E402
from tessera.ir.lowbit import FRAGMENT_SPAN  # noqa: E402
from tessera.kernels import lowbit_gemm, lowbit_gemm_rs  # noqa: E402
from tessera.kernels import lowbit_gemm_rs_config as rs_config  # noqa: E402
from tessera.quant.layout import padded_shape  # noqa: E402

M0, N0, K0, GROUP = 4096, 12288, 4096, 128
# every config (the scalar-store epilogue lost to stmatrix by 0.3-1.3% at 38590c8: not timed)
TIMED = rs_config.CONFIGS + rs_config.CLUSTER_CONFIGS
ODD = (("uint4", 32, True, 300, 520, 1000), ("int2", None, False, 65, 136, 264), ("e2m1", 64, False, 200, 200, 512),
       ("int8", 128, False, 1, 24, 256))  # fmt: skip


def configs(name: str, group: int, bias: bool) -> list:
    """The configs the kernel builds for these weights (the word ring's take more shared memory as the bits grow)."""
    return [c for c in TIMED if not lowbit_gemm_rs.problems(ts.dtype(name), group, bias, c)]


def zero_points(name: str) -> bool:
    """Whether the timed weights have zero points: quantize_weight's default (the unsigned types)."""
    return ts.dtype(name).kind == "uint"


def build(types: list[str], workers: int) -> None:
    kernels = [lowbit_gemm_rs.make_lowbit_gemm_rs(ts.dtype(t), GROUP, zero_points(t), c) for t in types
               for c in configs(t, GROUP, zero_points(t))]  # fmt: skip
    kernels += [lowbit_gemm.make_lowbit_gemm(ts.dtype(t), GROUP, zero_points(t), lowbit_gemm.prefill_config()) for t in types]
    for name, group, bias, _, _, k in ODD:
        kgroup = group or padded_shape(1, k)[1]  # (per channel: the padded K, as prepare gives it)
        kernels += [lowbit_gemm_rs.make_lowbit_gemm_rs(ts.dtype(name), kgroup, bias, c) for c in configs(name, kgroup, bias)]
    t0 = time.time()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda kern: kern.build(), kernels))
    print(f"built {len(kernels)} kernels in {time.time() - t0:.1f}s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: build the kernels with nvcc only")
    ap.add_argument("--types", default="int4,int3,int8,e4m3", help="weight types timed at M=4096")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 4, help="parallel nvcc builds")
    ap.add_argument("--table", metavar="JSONL", help="print the markdown table of an earlier run's rows and stop")
    args = ap.parse_args()
    if args.table:
        print(variants_table([json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]))
        return
    types = args.types.split(",")
    build(types, args.workers)
    if not args.dry_run:
        run(types)


def run(types: list[str]) -> None:
    import torch
    from harness import Timer, copy_bandwidth_gbs, environment, rel_err

    from tessera.quant.linear import prefill_matmul, prepare
    from tessera.quant.quantize import quantize_weight

    os.environ["TESSERA_LOWBIT_PREFILL"] = "dequant"  # "two passes" below: prefill_matmul as it was before tuning
    rng = np.random.default_rng(0)
    timer = Timer()
    print(f"copy bandwidth {copy_bandwidth_gbs(timer):.0f} GB/s", flush=True)
    bad = []
    for name, group, bias, m, n, k in ODD:  # correctness at odd shapes, every config
        t = ts.dtype(name)
        p = prepare(quantize_weight(rng.normal(size=(n, k)) * 0.05, t, group, bias))
        w = torch.from_numpy(p.weight.dequantize()).cuda().double()
        words = p.words_for(FRAGMENT_SPAN)
        for config in configs(name, p.kernel_group, bias):
            for _ in range(2):
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
                lowbit_gemm_rs.lowbit_gemm_rs(x, words, p.scales, p.biases, y, t, p.kernel_group, bias, config)
                err = rel_err(y, x.double() @ w.T)
                if not err < 2e-3:
                    bad.append((name, group, bias, m, n, k, str(config), err))
    print("odd shapes:", "all within 2e-3" if not bad else f"FAILED {bad}", flush=True)
    rows = []
    env = environment()
    for name in types:
        t = ts.dtype(name)
        wf = torch.from_numpy(rng.normal(size=(N0, K0)).astype(np.float32) * 0.02).cuda().half()
        p = prepare(quantize_weight(wf.float().cpu().numpy(), t, GROUP))
        assert (p.weight.zeros is not None) == zero_points(name)
        w = torch.from_numpy(p.weight.dequantize()).cuda()
        words1 = p.words_for(FRAGMENT_SPAN)
        x = torch.randn(M0, K0, dtype=torch.float16, device="cuda")
        y = torch.empty(M0, N0, dtype=torch.float16, device="cuda")
        ref = x[:256].double() @ w.double().T
        errs, calls = {}, {}
        for config in configs(name, GROUP, zero_points(name)):
            args = (x, words1, p.scales, p.biases, y, t, GROUP, zero_points(name), config)
            lowbit_gemm_rs.lowbit_gemm_rs(*args)
            errs[str(config)] = rel_err(y[:256], ref)
            calls[str(config)] = functools.partial(lowbit_gemm_rs.lowbit_gemm_rs, *args)
        ss = lowbit_gemm.prefill_config()
        args = (x, p.words, p.scales, p.biases, y, t, GROUP, zero_points(name), ss)
        lowbit_gemm.lowbit_gemm(*args)
        errs["fused"] = rel_err(y[:256], ref)
        calls["fused " + str(ss)] = functools.partial(lowbit_gemm.lowbit_gemm, *args)
        calls["two passes"] = functools.partial(prefill_matmul, x, p)
        calls["cublas"] = functools.partial(torch.matmul, x, wf.T)
        times = timer.side_by_side(calls)  # interleaved rounds: the card's clock drift hits every variant alike
        cublas = times.pop("cublas")
        best = min((v, c) for c, v in times.items() if c.startswith("rs_"))
        row = {"suite": "lowbit-rs", "case": f"M={M0},N={N0},K={K0},w={name},g={GROUP},fp16", "tessera_us": best[0],
               "config": best[1], "peers_us": {"cublas": cublas}, "variants_us": times, "rel_err": max(errs.values()),
               "rel_errs": errs, "vs_cublas": cublas / best[0], **env}  # fmt: skip
        rows.append(row)
        print(f"{name:5} cuBLAS {cublas:6.1f} | " + " | ".join(f"{c} {v:6.1f}" for c, v in times.items())
              + f" | best rs {cublas / best[0]:.3f}x cuBLAS, rel_err {row['rel_err']:.1e}", flush=True)  # fmt: skip
    out = os.environ.get("OUT")
    if out:
        Path(out, "lowbit-rs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        Path(out, "lowbit-rs.md").write_text(variants_table(rows))
    if bad:
        sys.exit(1)


def variants_table(rows: list[dict]) -> str:
    """Markdown: every variant's time (us) per weight type, cuBLAS first, then the best register-A
    config against cuBLAS (ratio > 1: tessera faster)."""
    types = [r["case"].split("w=")[1].split(",")[0] for r in rows]
    variants = list(dict.fromkeys(v for r in rows for v in r["variants_us"]))
    head = rows[0] if rows else {}
    out = [f"# lowbit-rs: {head.get('gpu', '?')}, {head.get('date', '?')}, commit {head.get('commit', '?')[:12]}", "",
           f"M={M0}, N={N0}, K={K0}, group {GROUP}, fp16 activations (zero points for the unsigned types); L2 flushed "
           "by a 1 GB read before each call, CUDA events, median of 50, variants in interleaved rounds; us.", "",
           "| variant | " + " | ".join(types) + " |", "|---|" + "---:|" * len(types),
           "| cuBLAS fp16 | " + " | ".join(f"{r['peers_us']['cublas']:.1f}" for r in rows) + " |"]  # fmt: skip
    for v in variants:
        out.append(f"| {v} | " + " | ".join(f"{r['variants_us'].get(v, float('nan')):.1f}" for r in rows) + " |")
    best = [f"**{r['vs_cublas']:.3f}x** {r['config']}" for r in rows]
    out.append("| **best register-A vs cuBLAS** | " + " | ".join(best) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
