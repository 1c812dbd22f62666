"""The `gemm` suite: tessera's tuned tensor-core GEMM against cuBLAS (torch.matmul) and
torch.compile, on DESIGN.md's GEMM workloads."""

from __future__ import annotations

import math
import time

import torch
from harness import Timer, rel_err

from tessera.kernels.matmul import choose_config, matmul

LLAMA3_8B_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def workloads(quick: bool = False) -> list[tuple[int, int, int]]:
    shapes = [(4096, 4096, 4096), (2048, 14336, 4096), (2048, 4096, 14336), (1, 4096, 4096), (16, 4096, 4096),
              (1, 14336, 4096)]  # fmt: skip
    for m in (1, 16, 128, 2048, 4096):
        shapes += [(m, n, k) for n, k in LLAMA3_8B_NK]
    shapes = list(dict.fromkeys(shapes))
    return shapes[:6] if quick else shapes


def gemm_suite(timer: Timer, quick: bool = False, dtypes: tuple[str, ...] = ("fp16",)) -> list[dict]:
    rows = []
    for dname in dtypes:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
        for m, n, k in workloads(quick):
            a = torch.randn(m, k, device="cuda", dtype=dt)
            b = torch.randn(k, n, device="cuda", dtype=dt)
            t0 = time.perf_counter()
            cfg = choose_config(a, b)
            tune_s = time.perf_counter() - t0
            out = matmul(a, b, config=cfg)
            err = rel_err(out, a.double() @ b.double())
            compiled = torch.compile(torch.matmul)
            peers = {"cublas": timer(torch.matmul, a, b), "torch.compile:default": timer(compiled, a, b)}
            t_us = timer(lambda a, b, cfg: matmul(a, b, config=cfg), a, b, cfg)
            tflops = 2 * m * n * k / (t_us * 1e-6) / 1e12
            row = {"case": f"M={m},N={n},K={k},{dname}", "tessera_us": t_us, "peers_us": peers, "rel_err": err,
                   "vs_cublas": peers["cublas"] / t_us, "tflops": tflops, "config": str(cfg), "tune_s": tune_s}  # fmt: skip
            rows.append(row)
            print(f"{row['case']:<34} tessera {t_us:8.1f} us  cublas {peers['cublas']:8.1f}  "
                  f"x{row['vs_cublas']:.2f}  {tflops:6.0f} TF/s  {cfg}  tune {tune_s:.0f}s  err {err:.1e}", flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    """Geomean speed vs cuBLAS for M >= 128 and the M = 1 / 16 cases (the issue's targets)."""
    big = [r["vs_cublas"] for r in rows if int(r["case"].split(",")[0][2:]) >= 128]
    small = [r["vs_cublas"] for r in rows if int(r["case"].split(",")[0][2:]) in (1, 16)]

    def geo(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")

    return f"geomean vs cuBLAS: M>=128 {geo(big):.3f}x ({len(big)} cases), M in (1,16) {geo(small):.3f}x ({len(small)} cases)"
