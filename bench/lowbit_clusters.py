"""Why the register-A kernel's 2-block cluster configs (tessera.kernels.lowbit_gemm_rs_config.CLUSTER_CONFIGS,
X multicast across a pair of blocks) ran 1.7x slower than the same kernel without a cluster
(bench/results/2026-11-28-h200-lowbit-rs-74d247c.jsonl).  Not a second wave: all 66 clusters are
resident; the remote arrivals' cluster-scope release was a MEMBAR.ALL.GPU, and with CTA scope the
cluster configs run level with the plain ones (bench/results/2026-11-28-h200-lowbit-rs-streamk.md).

For each cluster config this prints the driver's cuOccupancyMaxActiveClusters for the kernel as
launched (384 threads, its shared memory), then times, in interleaved rounds after a 1 GB L2
flush (bench/harness.py), the config with its default grid (RegisterAConfig.grid: SMs / 2
clusters), the config with the grid capped at the resident-cluster count, and the same kernel
without a cluster; each checked against float64 first.  M=4096, N=12288, K=4096, group 128.

    python3 bench/lowbit_clusters.py [--types int4,int7]
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
from tessera.kernels.lowbit_gemm import x_tensor_map  # noqa: E402

M0, N0, K0, GROUP = 4096, 12288, 4096, 128


def max_active_clusters(kernel: ts.Kernel, config: rs.RegisterAConfig, bits: int, grid: int) -> int:
    """cuOccupancyMaxActiveClusters for the loaded kernel with the launch's geometry."""
    from tessera.runtime.cuda import _driver, check

    driver = _driver()
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 384, 1, 1
    cfg.sharedMemBytes = config.smem_bytes(bits)
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = config.cluster, 1, 1
    cfg.attrs, cfg.numAttrs = [attr], 1
    return int(check(driver.cuOccupancyMaxActiveClusters(kernel.compile().handle, cfg), "cuOccupancyMaxActiveClusters"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="int4,int7")
    args = ap.parse_args()

    import torch
    from harness import Timer, rel_err

    from tessera.quant.linear import prepare
    from tessera.quant.quantize import quantize_weight
    from tessera.runtime.cuda import multiprocessor_count

    rng = np.random.default_rng(0)
    timer = Timer()
    sms = multiprocessor_count()
    for name in args.types.split(","):
        t = ts.dtype(name)
        bias = t.kind == "uint"
        p = prepare(quantize_weight(rng.normal(size=(N0, K0)) * 0.02, t, GROUP))
        words = p.words_for(FRAGMENT_SPAN)
        w = torch.from_numpy(p.weight.dequantize()).cuda()
        x = torch.randn(M0, K0, dtype=torch.float16, device="cuda")
        y = torch.empty(M0, N0, dtype=torch.float16, device="cuda")
        ref = x[:256].double() @ w.double().T
        calls = {}
        for config in rs_config.CLUSTER_CONFIGS:
            kernel = rs.make_lowbit_gemm_rs(t, GROUP, bias, config)
            tma_a = x_tensor_map(x, y, config.block_t // config.cluster, "low-bit register-A GEMM")
            tma_w = rs.word_map(words, K0, t.nbits)
            grid = config.grid(M0, N0, sms)
            # The first launch raises the kernel's dynamic shared memory limit; before it the
            # driver counts no cluster resident (it did, 2026-11-28).
            whole, partials, flags = config.tiles(M0, N0), torch.empty(1, device="cuda"), torch.empty(1, dtype=torch.uint32, device="cuda")
            functools.partial(kernel, x.view(1, M0, K0), words, p.scales, p.biases, y.view(1, M0, N0),
                              tma_a, tma_w, grid, whole, partials, flags)()  # fmt: skip
            resident = max_active_clusters(kernel, config, t.nbits, grid)
            capped = min(grid, resident * config.cluster)
            print(f"{name} {config}: grid {grid} blocks ({grid // config.cluster} clusters); "
                  f"{resident} clusters resident at most", flush=True)  # fmt: skip
            for label, ctas in ((f"{config} grid {grid}", grid), (f"{config} grid {capped}", capped)):
                launch = functools.partial(kernel, x.view(1, M0, K0), words, p.scales, p.biases, y.view(1, M0, N0),
                                           tma_a, tma_w, ctas, whole, partials, flags)  # fmt: skip
                launch()
                print(f"  {label}: rel_err {rel_err(y[:256], ref):.1e}", flush=True)
                calls[label] = launch
            plain = dataclasses.replace(config, cluster=1)
            calls[str(plain)] = functools.partial(rs.lowbit_gemm_rs, x, words, p.scales, p.biases, y, t, GROUP, bias, plain)
        calls["cublas on the dequantised weights"] = functools.partial(torch.matmul, x, w.half().T)
        for label, us in timer.side_by_side(calls).items():
            print(f"{name} {label:40} {us:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
