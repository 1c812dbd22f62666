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


def gemm_suite(timer: Timer, quick: bool = False, dtypes: tuple[str, ...] = ("fp16",),
               layouts: tuple[str, ...] = ("nk", "kn")) -> list[dict]:  # fmt: skip
    """B as a linear layer's weight [N, K] ("nk", peer F.linear) and as [K, N] ("kn", peer
    torch.matmul); both peers are cuBLAS."""
    rows = []
    for dname in dtypes:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
        for layout in layouts:
            peer = torch.matmul if layout == "kn" else torch.nn.functional.linear
            compiled = torch.compile(peer)
            for m, n, k in workloads(quick):
                a = torch.randn(m, k, device="cuda", dtype=dt)
                b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=dt)
                t0 = time.perf_counter()
                cfg = choose_config(a, b, layout)
                tune_s = time.perf_counter() - t0
                out = matmul(a, b, b_layout=layout, config=cfg)
                err = rel_err(out, peer(a.double(), b.double()))
                peers = {"cublas": timer(peer, a, b), "torch.compile:default": timer(compiled, a, b)}
                t_us = timer(lambda a, b, cfg, layout: matmul(a, b, b_layout=layout, config=cfg), a, b, cfg, layout)
                rows.append(_row(m, n, k, dname, layout, t_us, peers, err, cfg, tune_s))
    return rows


def _row(m, n, k, dname, layout, t_us, peers, err, cfg, tune_s) -> dict:  # noqa: ANN001
    tflops = 2 * m * n * k / (t_us * 1e-6) / 1e12
    row = {"case": f"M={m},N={n},K={k},{dname},B={layout}", "tessera_us": t_us, "peers_us": peers, "rel_err": err,
           "vs_cublas": peers["cublas"] / t_us, "tflops": tflops, "config": str(cfg), "tune_s": tune_s}  # fmt: skip
    print(f"{row['case']:<40} tessera {t_us:8.1f} us  cublas {peers['cublas']:8.1f}  "
          f"x{row['vs_cublas']:.2f}  {tflops:6.0f} TF/s  {cfg}  tune {tune_s:.0f}s  err {err:.1e}", flush=True)
    return row


def summary(rows: list[dict]) -> str:
    """Geomean speed vs cuBLAS for M >= 128 and the M = 1 / 16 cases (the issue's targets), per layout."""
    lines = []
    for layout in sorted({r["case"].rsplit("B=", 1)[1] for r in rows}):
        mine = [r for r in rows if r["case"].endswith(f"B={layout}")]
        big = [r["vs_cublas"] for r in mine if int(r["case"].split(",")[0][2:]) >= 128]
        small = [r["vs_cublas"] for r in mine if int(r["case"].split(",")[0][2:]) in (1, 16)]
        lines.append(f"B={layout}: geomean vs cuBLAS: M>=128 {_geo(big):.3f}x ({len(big)} cases), "
                     f"M in (1,16) {_geo(small):.3f}x ({len(small)} cases)")  # fmt: skip
    return "\n".join(lines)


def _geo(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
