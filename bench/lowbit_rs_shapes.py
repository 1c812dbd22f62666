"""The register-A low-bit prefill kernel at model shapes and prompt lengths (issue 12): the 1.1B
Llama's projections (DESIGN.md) and Llama-3-8B's, int4 group 128, at M in {128, 512, 2048}
rows, every register-A config (the tuning candidates and the stream-K ones) next to the two
passes (the dequantiser, then cuBLAS) and cuBLAS on the fp16 weights; and what tuning picks
(`tessera.quant.tune.tuned_prefill`).  bench/harness.py: L2 flushed by a 1 GB read, CUDA
events, median of 50, the variants in interleaved rounds.  Every variant is checked against
float64 on the dequantised weights first.

    python3 bench/lowbit_rs_shapes.py            # GPU; JSONL + markdown under $OUT if set
    python3 bench/lowbit_rs_shapes.py --ms 512 --shapes 2048x2048,256x2048
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import tessera as ts  # noqa: E402
from tessera.ir.lowbit import FRAGMENT_SPAN  # noqa: E402
from tessera.kernels import lowbit_gemm_rs  # noqa: E402
from tessera.kernels import lowbit_gemm_rs_config as rs_config  # noqa: E402

GROUP = 128
# N x K: 1.1B Llama q/o, k/v, gate/up, down; Llama-3-8B q/o, k/v, gate/up, down
SHAPES = "2048x2048,256x2048,5632x2048,2048x5632,4096x4096,1024x4096,14336x4096,4096x14336"
# short-prompt candidates under study: deeper rings, four fragment buffers, 64-token tiles
EXPLORE = (rs_config.RegisterAConfig(128, 10, stream_k=True), rs_config.RegisterAConfig(128, 6, in_flight=3, stream_k=True),
           rs_config.RegisterAConfig(64, 12, stream_k=True), rs_config.RegisterAConfig(128, 6, in_flight=3))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="128,512,2048", help="rows (prompt tokens)")
    ap.add_argument("--shapes", default=SHAPES, help="NxK weight shapes")
    ap.add_argument("--type", default="int4")
    ap.add_argument("--no-tune", action="store_true", help="skip what tuning picks")
    ap.add_argument("--explore", action="store_true", help="also configs that are not tuning candidates (EXPLORE)")
    args = ap.parse_args()

    import torch
    from harness import Timer, environment, rel_err

    from tessera.quant import tune
    from tessera.quant.linear import prefill_matmul, prepare
    from tessera.quant.quantize import quantize_weight

    os.environ["TESSERA_LOWBIT_PREFILL"] = "dequant"  # "two passes": prefill_matmul without tuning
    t = ts.dtype(args.type)
    bias = t.kind == "uint"
    configs = [c for c in rs_config.CONFIGS + rs_config.STREAM_K_CONFIGS + (EXPLORE if args.explore else ())
               if not lowbit_gemm_rs.problems(t, GROUP, bias, c)]  # fmt: skip
    rng = np.random.default_rng(0)
    timer, env, rows = Timer(), environment(), []
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        wf = torch.from_numpy(rng.normal(size=(n, k)).astype(np.float32) * 0.02).cuda().half()
        p = prepare(quantize_weight(wf.float().cpu().numpy(), t, GROUP, bias))
        w = torch.from_numpy(p.weight.dequantize()).cuda().double()
        words = p.words_for(FRAGMENT_SPAN)
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            y = torch.empty(m, n, dtype=torch.float16, device="cuda")
            calls, errs = {}, {}
            for config in dict.fromkeys(c.for_output(n) for c in configs):
                call = functools.partial(lowbit_gemm_rs.lowbit_gemm_rs, x, words, p.scales, p.biases, y, t, GROUP, bias,
                                         config)  # fmt: skip
                for _ in range(2):  # fresh activations each call
                    x.copy_(torch.randn_like(x))
                    y.fill_(float("nan"))
                    call()
                    errs[str(config)] = max(errs.get(str(config), 0.0), rel_err(y, x.double() @ w.T))
                calls[str(config)] = call
            calls["two passes"] = functools.partial(prefill_matmul, x, p)
            calls["cublas"] = functools.partial(torch.matmul, x, wf.T)
            times = timer.side_by_side(calls)
            cublas, two = times.pop("cublas"), times["two passes"]
            best = min((v, c) for c, v in times.items() if c.startswith("rs_"))
            picked = None
            if not args.no_tune:
                picked = str(tune.tuned_prefill(t, GROUP, bias, 16, m, n, k, p.words.numel(), tuple(p.scales.shape),
                                                tuple(p.biases.shape), register_a=True))  # fmt: skip
            row = {"suite": "lowbit-rs-shapes", "case": f"M={m},N={n},K={k},w={t.name},g={GROUP},fp16",
                   "tessera_us": best[0], "config": best[1], "peers_us": {"cublas": cublas, "two_passes": two},
                   "variants_us": times, "rel_err": max(errs.values()), "tuned": picked, "vs_cublas": cublas / best[0],
                   **env}  # fmt: skip
            rows.append(row)
            print(f"M={m:5} N={n:5} K={k:5} cuBLAS {cublas:7.1f} two {two:7.1f} | "
                  + " ".join(f"{c.removeprefix('rs_')} {v:.1f}" for c, v in times.items() if c.startswith("rs_"))
                  + f" | best {best[1]} {cublas / best[0]:.2f}x cuBLAS, tuned {picked}, err {row['rel_err']:.1e}",
                  flush=True)  # fmt: skip
            if not row["rel_err"] < 2e-3:
                print(f"FAILED: rel_err {errs}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "lowbit-rs-shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        Path(out, "lowbit-rs-shapes.md").write_text(table(rows))


def table(rows: list[dict]) -> str:
    """Markdown: per case cuBLAS, the two passes, the best register-A config and tuning's pick (us)."""
    head = rows[0] if rows else {}
    out = [f"# lowbit-rs-shapes: {head.get('gpu', '?')}, {head.get('date', '?')}, commit {head.get('commit', '?')[:12]}",
           "", "L2 flushed by a 1 GB read, CUDA events, median of 50, variants in interleaved rounds; us.", "",
           "| case | cuBLAS fp16 | two passes | best register-A | config | vs cuBLAS | tuned |",
           "|---|---:|---:|---:|---|---:|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r['case']} | {r['peers_us']['cublas']:.1f} | {r['peers_us']['two_passes']:.1f} | "
                   f"{r['tessera_us']:.1f} | {r['config']} | {r['vs_cublas']:.2f}x | {r['tuned']} |")  # fmt: skip
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
