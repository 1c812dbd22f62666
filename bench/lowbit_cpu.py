"""The CPU low-bit anchor (tessera.quant.anchor_cpu.plan_lowbit_linear_cpu: the row kernel of
tessera/kernels/lowbit_cpu.py) against torch float32 `x @ w.T` with the dequantised weight, at
decode sizes: fastest of --repeats calls each, the two interleaved (a loaded machine slows both).

    python3 bench/lowbit_cpu.py                        # int4 g128, M = 1 and 16, N = K = 1024, 2048, 4096
    python3 bench/lowbit_cpu.py --types int4,int3,int8 --sizes 4096 --threads 1 --out rows.jsonl

At the decode sizes (M <= tessera.quant.anchor_cpu.CPU_DECODE_ROWS) the anchor decodes in registers
(make_linear_decode); the row kernel it replaces there (make_linear_rows) is timed beside it.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np


def _best(fns: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: min(v) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="int4")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--sizes", default="1024,2048,4096", help="N = K values")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--threads", type=int, default=0, help="OpenMP workers for both (0: all the CPUs)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="append one JSON row per case to this file")
    args = ap.parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch

    from tessera.graph.opdefs.lowbit import dequantized_weight
    from tessera.ops.anchors.cpu_gemm import cpu_threads
    from tessera.quant import anchor_cpu as anchor
    from tessera.quant.quantize import quantize_weight
    from tessera.quant.torch_quantize import QuantizedLinear

    def rows_kernel(m: int, attrs: dict, consts: list):  # the row kernel at any M: the decode path switched off
        saved, anchor.CPU_DECODE_ROWS = anchor.CPU_DECODE_ROWS, 0
        try:
            return anchor.plan_lowbit_linear_cpu((m, attrs["k"]), attrs, consts[0], consts[1].shape, consts[2].shape).load()
        finally:
            anchor.CPU_DECODE_ROWS = saved

    torch.set_num_threads(cpu_threads())
    rng = np.random.default_rng(0)
    print(f"threads {cpu_threads()}, group {args.group_size}; fastest of {args.repeats} calls, ms")
    print("| type | N = K | M | tessera low-bit | row kernel | QuantizedLinear eager | torch fp32 | speed-up |\n"
          "|---|---|---|---|---|---|---|---|")  # fmt: skip
    for t in args.types.split(","):
        for size in map(int, args.sizes.split(",")):
            n = k = size
            layer = QuantizedLinear(quantize_weight(rng.standard_normal((n, k)) * 0.02, t, args.group_size))
            consts, attrs = layer.graph_operands()
            w = torch.from_numpy(dequantized_weight(*consts, attrs).astype(np.float32))
            for m in map(int, args.ms.split(",")):
                kernel = anchor.plan_lowbit_linear_cpu((m, k), attrs, consts[0], consts[1].shape, consts[2].shape).load()
                x = rng.standard_normal((m, k)).astype(np.float32)
                xt = torch.from_numpy(x)
                operands = [x, *consts]
                outs = {"tessera": np.empty((m, n), np.float32)}
                fns = {"tessera": functools.partial(kernel, operands, outs["tessera"])}
                if m <= anchor.CPU_DECODE_ROWS:
                    outs["rows"] = np.empty((m, n), np.float32)
                    fns["rows"] = functools.partial(rows_kernel(m, attrs, consts), operands, outs["rows"])
                fns["eager"] = functools.partial(layer, xt)  # the torch module outside torch.compile
                fns["torch"] = functools.partial(torch.matmul, xt, w.T)
                with torch.no_grad():
                    best = _best(fns, args.repeats)
                    outs["eager"] = layer(xt).numpy()
                ref = (xt.double() @ w.T.double()).numpy()
                errs = {name: float(np.abs(y - ref).max() / np.abs(ref).max()) for name, y in outs.items()}
                for name, err in errs.items():
                    assert err < 1e-4, f"{t} {size} M={m} ({name}): relative error {err:.1e}"
                rows = f"{best['rows']:.3f}" if "rows" in best else "-"
                print(f"| {t} | {size} | {m} | {best['tessera']:.3f} | {rows} | {best['eager']:.3f} | "
                      f"{best['torch']:.3f} | {best['torch'] / best['tessera']:.2f}x |")  # fmt: skip
                if args.out:
                    row = {"suite": "lowbit-cpu", "case": f"M={m},N={n},K={k},w={t},g={args.group_size},fp32",
                           "commit": os.environ.get("TESSERA_COMMIT", ""), "tessera_ms": round(best["tessera"], 4),
                           "peers_ms": {"torch_fp32": round(best["torch"], 4),
                                        "quantized_linear_eager": round(best["eager"], 4),
                                        **({"tessera_row_kernel": round(best["rows"], 4)} if "rows" in best else {})},
                           "threads": cpu_threads(), "rel_err": errs["tessera"],
                           "method": f"bench/lowbit_cpu.py, fastest of {args.repeats} calls, peers interleaved"}  # fmt: skip
                    with open(args.out, "a") as fh:
                        fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
