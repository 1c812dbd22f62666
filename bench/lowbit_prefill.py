"""The prefill path of low-bit weights on the H200 (issue 12): the dequantiser
(tessera.kernels.lowbit_dequant: the decode kernel's words -> fp16 W), the fused kernel
(tessera.kernels.lowbit_gemm: the dequantisation in the TMA GEMM's mainloop) at each of its
tiles, and `prefill_matmul` as users call it (tuning on: the faster of the two, checked) at
K=4096, N=12288, group 128, M=4096, next to cuBLAS on the same weights in fp16, with the
suite's protocol (bench/harness.py: L2 flushed by a 1 GB read before each repeat, CUDA
events, median of 50).

    python3 bench/lowbit_prefill.py              # GPU: check, time, print; JSONL + table under $OUT if set
    python3 bench/lowbit_prefill.py --dry-run    # no GPU: build the kernels with nvcc, print their registers
    python3 bench/lowbit_prefill.py --types int4 --warps 2,4,8

Per type it prints the dequantiser's time for each block size (`--warps`, warps of one unit
each; prefill_matmul uses make_dequant_units' default), its GB/s (words + scales read, N*K*2
written) against the copy bandwidth measured in the same run, and the floor (those bytes at
copy speed); prefill_matmul as called (W16 allocated per call), the same two steps into a
preallocated W16 (what the allocation costs), the fused kernel per tile, cuBLAS on fp16 W,
and cuBLAS / prefill.
Correctness in the same run: W16 against the QuantizedWeight's dequantisation rounded to fp16
(bit for bit) and the product's relative error against float64 on 256 rows of fresh x.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tessera as ts  # noqa: E402
from tessera.kernels import lowbit_gemm  # noqa: E402
from tessera.kernels.lowbit_dequant import DEFAULT_WARPS, make_dequant_units  # noqa: E402
from tessera.kernels.lowbit_launch import cubin_registers  # noqa: E402
from tessera.quant.linear import PREPARED_SPAN  # noqa: E402

M0, N0, K0, GROUP = 4096, 12288, 4096, 128


def build_all(types: list[str], warps: list[int], workers: int) -> dict:
    """{(type, warps): registers per thread} after building every kernel with nvcc."""
    keys = [(t, w) for t in types for w in warps]
    with ThreadPoolExecutor(workers) as ex:
        regs = list(ex.map(lambda key: cubin_registers(make_dequant_units(ts.dtype(key[0]), GROUP, False, PREPARED_SPAN,
                                                                          key[1]).build()), keys))  # fmt: skip
    return dict(zip(keys, regs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: build the kernels with nvcc only")
    ap.add_argument("--types", default="int4,int3,int8,e4m3", help="weight types timed")
    ap.add_argument("--warps", default="2,4,8", help="dequantiser block sizes timed (warps per block)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 4, help="parallel nvcc builds")
    args = ap.parse_args()
    types, warps = args.types.split(","), sorted({int(w) for w in args.warps.split(",")} | {DEFAULT_WARPS})
    t0 = time.time()
    regs = build_all(types, warps, args.workers)
    print(f"built {len(regs)} kernels in {time.time() - t0:.1f}s (group {GROUP}, span {PREPARED_SPAN}, no zero points)")
    for (t, w), r in regs.items():
        print(f"  {t:5} warps {w}: {r} registers, {w * 8} KiB shared per block")
    if not args.dry_run:
        run(types, warps)


def dequantize(kernel, p, w16) -> None:
    kernel(p.words, p.scales, p.biases, w16)


def prefill_preallocated(kernel, p, x, w16, y) -> None:
    """prefill_matmul's two steps into buffers allocated once (what the per-call workspace costs)."""
    kernel(p.words, p.scales, p.biases, w16)
    torch_matmul(x, w16.T, out=y)


def torch_matmul(*args, **kwargs):
    import torch

    return torch.matmul(*args, **kwargs)


def time_type(name: str, warps: list[int], timer, bw: float, x, w16, y, gen) -> dict:
    """One weight type: check, time and print; returns its result row."""
    import torch
    from harness import rel_err

    from tessera.quant.linear import prefill_matmul, prepare
    from tessera.quant.quantize_torch import quantize_weight_torch

    t = ts.dtype(name)
    t0 = time.time()
    q = quantize_weight_torch(torch.randn(N0, K0, device="cuda", generator=gen) * 0.02, t, GROUP)
    p = prepare(q)
    exact = torch.from_numpy(q.dequantize()).cuda()  # float32: the products are exact there
    setup = time.time() - t0
    kernels = {wp: make_dequant_units(t, p.kernel_group, False, PREPARED_SPAN, wp) for wp in warps}
    deq = {wp: timer(dequantize, kernel, p, w16) for wp, kernel in kernels.items()}
    dequantize(kernels[DEFAULT_WARPS], p, w16)
    same = bool(torch.equal(w16, exact.half()))
    err = rel_err(prefill_matmul(x, p)[:256], x[:256].double() @ exact.double().T)
    pre = timer(prefill_matmul, x, p)
    pre2 = timer(prefill_preallocated, kernels[DEFAULT_WARPS], p, x, w16, y)
    cub = timer(torch.matmul, x, w16.T)  # w16 holds the same weights in fp16
    fused, fused_err = {}, {}
    for c in lowbit_gemm.buildable_configs(t, p.kernel_group, False):
        lowbit_gemm.lowbit_gemm(x, p.words_for(2), p.scales, p.biases, y, t, p.kernel_group, False, c)
        fused_err[str(c)] = rel_err(y[:256], x[:256].double() @ exact.double().T)
        fused[str(c)] = timer(lowbit_gemm.lowbit_gemm, x, p.words_for(2), p.scales, p.biases, y, t, p.kernel_group,
                              False, c)  # fmt: skip
    moved = p.words.numel() * 4 + p.scales.numel() * 2 + N0 * K0 * 2
    d = deq[DEFAULT_WARPS]
    floor = moved / (bw * 1e9) * 1e6
    print(f"{name:5} dequant " + " ".join(f"w{wp} {us:6.1f}" for wp, us in deq.items())
          + f" | {moved / d / 1e3:5.0f} GB/s = {moved / d / 1e3 / bw:4.0%} of copy, floor {floor:5.1f}"
          f" | prefill {pre:6.1f} (preallocated {pre2:6.1f}) cuBLAS fp16 {cub:6.1f} -> {cub / pre:5.3f}x"
          + " | fused " + " ".join(f"{c.removeprefix('tma_')} {us:6.1f} ({fused_err[c]:.0e})" for c, us in fused.items())
          + f" | W16 {'exact' if same else 'DIFFERS'}, rel_err {err:.1e} (setup {setup:.0f}s)", flush=True)  # fmt: skip
    return {"case": f"M={M0},N={N0},K={K0},w={name},g={GROUP},fp16", "tessera_us": pre, "peers_us": {"cublas": cub},
            "rel_err": err, "dequant_us": d, "dequant_us_by_warps": {str(wp): us for wp, us in deq.items()},
            "prefill_prealloc_us": pre2, "dequant_gbs": moved / d / 1e3, "copy_gbs": bw, "floor_us": floor,
            "vs_cublas": cub / pre, "w16_exact": same, "fused_us_by_tile": fused, "fused_rel_err": fused_err}  # fmt: skip


def run(types: list[str], warps: list[int]) -> None:
    import torch
    from harness import Timer, copy_bandwidth_gbs, environment, write_results

    timer = Timer()
    bw = copy_bandwidth_gbs(timer)
    print(f"copy bandwidth {bw:.0f} GB/s; M={M0} N={N0} K={K0} group {GROUP}; us (L2 flushed, median of "
          f"{timer.repeats})", flush=True)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M0, K0, dtype=torch.float16, device="cuda", generator=gen)
    w16 = torch.empty(N0, K0, dtype=torch.float16, device="cuda")
    y = torch.empty(M0, N0, dtype=torch.float16, device="cuda")
    rows = [time_type(name, warps, timer, bw, x, w16, y, gen) for name in types]
    if os.environ.get("OUT"):
        write_results("lowbit-prefill", rows, [Path(os.environ["OUT"])],
                      ["dequant_us", "floor_us", "dequant_gbs", "prefill_prealloc_us", "vs_cublas", "w16_exact"])
    env = environment()
    print(f"({env['gpu']}, torch {env['torch']}, commit {env['commit'][:12]})")


if __name__ == "__main__":
    main()
