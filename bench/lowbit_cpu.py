"""The CPU low-bit anchor (tessera.quant.anchor.plan_lowbit_linear_cpu: the row kernel of
tessera/kernels/lowbit_cpu.py) against torch float32 `x @ w.T` with the dequantised weight, at
decode sizes: fastest of --repeats calls each, the two interleaved (a loaded machine slows both).

    python3 bench/lowbit_cpu.py                        # int4 g128, M = 1 and 16, N = K = 1024, 2048, 4096
    python3 bench/lowbit_cpu.py --types int4,int3,int8 --sizes 4096 --threads 1
"""

from __future__ import annotations

import argparse
import functools
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
    args = ap.parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch

    from tessera.graph.opdefs.lowbit import dequantized_weight
    from tessera.ops.anchors.cpu_gemm import cpu_threads
    from tessera.quant.anchor import plan_lowbit_linear_cpu
    from tessera.quant.quantize import quantize_weight
    from tessera.quant.torch_quantize import QuantizedLinear

    torch.set_num_threads(cpu_threads())
    rng = np.random.default_rng(0)
    print(f"threads {cpu_threads()}, group {args.group_size}; fastest of {args.repeats} calls, ms")
    print("| type | N = K | M | tessera low-bit | torch fp32 | speed-up |\n|---|---|---|---|---|---|")
    for t in args.types.split(","):
        for size in map(int, args.sizes.split(",")):
            n = k = size
            consts, attrs = QuantizedLinear(quantize_weight(rng.standard_normal((n, k)) * 0.02, t, args.group_size)
                                            ).graph_operands()  # fmt: skip
            w = torch.from_numpy(dequantized_weight(*consts, attrs).astype(np.float32))
            for m in map(int, args.ms.split(",")):
                kernel = plan_lowbit_linear_cpu((m, k), attrs, consts[0], consts[1].shape, consts[2].shape).load()
                x = rng.standard_normal((m, k)).astype(np.float32)
                y = np.empty((m, n), np.float32)
                xt = torch.from_numpy(x)
                operands = [x, *consts]
                best = _best({"tessera": functools.partial(kernel, operands, y),
                              "torch": functools.partial(torch.matmul, xt, w.T)}, args.repeats)  # fmt: skip
                err = float(np.abs(y - (xt @ w.T).numpy()).max() / np.abs(y).max())
                assert err < 1e-4, f"{t} {size} M={m}: relative error {err:.1e}"
                print(f"| {t} | {size} | {m} | {best['tessera']:.3f} | {best['torch']:.3f} | "
                      f"{best['torch'] / best['tessera']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
