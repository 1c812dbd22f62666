"""Decode-kernel variants on the H200 (issue 12): correctness of every candidate config against
the reference at odd sizes, then a timing table of candidates x weight types at K=4096,
N=12288, group 128, M = 1 and 16, with the suite's protocol (bench/harness.py: L2 flushed by a
1 GB read, CUDA events, median of 50).

    python3 bench/lowbit_dev.py                 # check + time (GPU), JSONL under $OUT if set
    python3 bench/lowbit_dev.py --dry-run       # no GPU: quantise, pack and nvcc-build every kernel
    python3 bench/lowbit_dev.py --types int4,int1 --ms 1

A "!" after a time marks a candidate whose result or checks were wrong (never "best").

Candidates come from `DecodeConfig.candidates` (the register path, the cp.async weight ring
with 2..4 stages, activations staged in shared memory or not, other splits, `streaming`: one
even wave with the activations staged while the weights stream).  Before the timings (and in a
dry run) each candidate's launch model is printed (tessera/kernels/lowbit_launch.py: the grid
against the SMs, resident blocks from the cubin's registers, waves, weight bytes in flight per
SM, each warp's serial chain, the reduction tail, the bound it predicts); the JSONL rows carry
its numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tessera as ts  # noqa: E402
from tessera.kernels.lowbit_decode import DecodeConfig, make_decode  # noqa: E402
from tessera.kernels.lowbit_launch import LaunchModel, cubin_registers, launch_model  # noqa: E402
from tessera.quant import WEIGHT_TYPES  # noqa: E402
from tessera.quant.linear import prepare  # noqa: E402
from tessera.quant.quantize import quantize_weight  # noqa: E402
from tessera.runtime.cuda import device_properties  # noqa: E402

N0, K0 = 12288, 4096
# odd sizes of the checks: (n, k, m, group, zero points)
CHECKS = [(100, 1000, None, 128, None), (40, 520, None, 32, True), (72, 776, None, None, None)]


def kernel_key(p, config: DecodeConfig) -> tuple:
    """The make_decode arguments cuda_matmul uses for prepared weight `p` under `config`."""
    return (p.weight.dtype, p.kernel_group, p.weight.zeros is not None, config, p.weight.shape[1] % 256 == 0,
            config.span == 2 and p.kernel_group % 32 == 0)  # fmt: skip


def plan(types: list[str], ms: list[int], sms: int, device: str) -> tuple[list, list]:
    """(checks, timings): checks are (label, prepared weight, m, config); timings (type, m,
    prepared weight, quantized weight, {name: config})."""
    rng = np.random.default_rng(0)
    checks, timings = [], []
    wbig = (rng.normal(size=(N0, K0)) * 0.02).astype(np.float32)
    for name in types:
        t = ts.dtype(name)
        q = quantize_weight(wbig, t, 128)
        p = prepare(q, device)
        cands = {m: DecodeConfig.candidates(t.nbits, m, N0, K0, sms) for m in ms}
        for m in ms:
            timings.append((name, m, p, q, cands[m]))
        configs = {c for cs in cands.values() for c in cs.values()}
        for i, (n, k, _, gs, zp) in enumerate(CHECKS):
            if zp and not t.is_integer:
                continue
            qs = quantize_weight(rng.normal(size=(n, k)) * 0.05, t, gs, zp)
            ps = prepare(qs, device)
            for c in sorted(configs, key=str):
                m = 13 if c.m_tiles == 2 else (1, 3, 7)[i]
                checks.append((f"{name} n={n} k={k} m={m} g={gs} zp={bool(zp)} {c}", ps, m, c))
    # every other type once, on one pipelined candidate per M (the family the timings do not cover)
    for t in WEIGHT_TYPES:
        if t.name in types:
            continue
        for m in ms:
            c = next(c for c in DecodeConfig.candidates(t.nbits, m, N0, K0, sms).values() if c.stages)
            for n, k, _, gs, zp in CHECKS[:2]:
                if zp and not t.is_integer:
                    continue
                ps = prepare(quantize_weight(rng.normal(size=(n, k)) * 0.05, t, gs, zp), device)
                checks.append((f"{t.name} n={n} k={k} m={13 if m > 8 else 1} g={gs} zp={bool(zp)} {c}", ps,
                               13 if m > 8 else 1, c))  # fmt: skip
    return checks, timings


def build_all(keys: set, workers: int) -> tuple[float, dict]:
    """(seconds, {kernel key: registers per thread}) after building every kernel."""
    t0 = time.time()
    keys = sorted(keys, key=str)
    with ThreadPoolExecutor(workers) as ex:
        regs = list(ex.map(lambda key: cubin_registers(make_decode(*key).build()), keys))
    return time.time() - t0, dict(zip(keys, regs))


def models(timings: list, regs: dict, sms: int) -> dict:
    """{(type, m, candidate name): LaunchModel} of every timed candidate, printed."""
    out = {}
    print("launch model (tessera/kernels/lowbit_launch.py; est = rough latency terms, us):")
    for name, m, p, _, cands in timings:
        bits = p.weight.dtype.nbits
        for cname, c in cands.items():
            r = regs[kernel_key(p, c)]
            lm = out[name, m, cname] = launch_model(c, bits, m, N0, K0, sms, r)
            print(f"  {name:5} M={m:<3} {cname:7} {str(c):28} {r:3} regs | {lm.line()}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: build every kernel with nvcc, print the plan")
    ap.add_argument("--types", default="int1,int2,int4,int8,e4m3,e2m1,uint3", help="weight types timed")
    ap.add_argument("--ms", default="1,16", help="token counts timed")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 4, help="parallel nvcc builds")
    args = ap.parse_args()
    types, ms = args.types.split(","), [int(m) for m in args.ms.split(",")]
    sms = device_properties().sms
    device = "cpu" if args.dry_run else "cuda"
    t0 = time.time()
    checks, timings = plan(types, ms, sms, device)
    keys = {kernel_key(p, c) for _, p, _, c in checks} | {kernel_key(p, c) for _, _, p, _, cs in timings
                                                           for c in cs.values()}  # fmt: skip
    print(f"{sms} SMs; planned in {time.time() - t0:.1f}s: {len(checks)} checks, "
          f"{sum(len(cs) for *_, cs in timings)} timings, {len(keys)} kernels", flush=True)
    seconds, regs = build_all(keys, args.workers)
    print(f"built {len(keys)} kernels in {seconds:.1f}s", flush=True)
    lms = models(timings, regs, sms)
    if args.dry_run:
        return
    run(checks, timings, lms)


def run(checks: list, timings: list, lms: dict[tuple, LaunchModel]) -> None:
    import torch
    from harness import Timer, copy_bandwidth_gbs, environment, rel_err

    from tessera.quant.linear import cuda_matmul

    bad, failed = 0, set()
    t0 = time.time()
    for label, p, m, c in checks:
        w = torch.from_numpy(p.weight.dequantize()).cuda().double()
        errs = []
        for _ in range(2):  # two calls, fresh activations
            x = torch.randn(m, w.shape[1], dtype=torch.float16, device="cuda")
            try:
                errs.append(rel_err(cuda_matmul(x, p, c), x.double() @ w.T))
            except Exception as exc:  # noqa: BLE001  (reported, the run goes on)
                errs.append(float("inf"))
                print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:300]}")
        if not max(errs) < 2e-3:
            bad += 1
            failed.add(str(c))
            print(f"BAD {label}: rel_err {max(errs):.2e}")
    print(f"checks: {bad} of {len(checks)} failed ({time.time() - t0:.1f}s)", flush=True)

    timer = Timer()
    bw = copy_bandwidth_gbs(timer)
    env = environment()
    out_dir = os.environ.get("OUT")
    rows = []
    w16 = torch.randn(N0, K0, dtype=torch.float16, device="cuda")
    # fixed costs under the same protocol: one tiny torch kernel (launch + events), and each
    # int4 candidate on a tiny weight (launch, cluster, prologue and split-K epilogue)
    one = torch.ones(1, device="cuda")
    print(f"a 1-element torch add: {timer(torch.add, one, one):.1f} us")
    tiny = prepare(quantize_weight(np.random.default_rng(1).normal(size=(128, 256)) * 0.05, "int4", 128))
    xt = torch.randn(1, 256, dtype=torch.float16, device="cuda")
    for name, m, _, _, cands in timings:
        if name == "int4" and m == 1:
            print("int4 N=128 K=256 M=1: " + " ".join(f"{k} {timer(cuda_matmul, xt, tiny, c):.1f}"
                                                       for k, c in cands.items()), flush=True)  # fmt: skip
            # the same kernels without a cluster (split 1): what the cluster launch and its reduction cost
            solo = {k: dataclasses.replace(cands[k], split=1, min_blocks=0) for k in ("reg", "p2k2", "xa") if k in cands}
            print("  split 1 (no cluster): " + " ".join(f"{k} {timer(cuda_matmul, xt, tiny, c):.1f}"
                                                        for k, c in solo.items()), flush=True)  # fmt: skip
    print(f"copy bandwidth {bw:.0f} GB/s; times in us (L2 flushed, median of {timer.repeats})")
    dequantized: dict[str, torch.Tensor] = {}
    for name, m, p, q, cands in timings:
        x = torch.randn(m, K0, dtype=torch.float16, device="cuda")
        if name not in dequantized:
            dequantized.clear()
            dequantized[name] = torch.from_numpy(q.dequantize()).cuda().double()
        ref = x.double() @ dequantized[name].T
        moved = p.words.numel() * 4 + q.scales.size * 2 + (q.zeros.size * 2 if q.zeros is not None else 0)
        floor = (moved + m * K0 * 2 + m * N0 * 2) / (bw * 1e9) * 1e6
        res = {}
        for cname, c in cands.items():
            try:
                err = rel_err(cuda_matmul(x, p, c), ref)
                us = timer(cuda_matmul, x, p, c)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name} M={m} {cname} {c}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            res[cname] = (us, err, c)
            rows.append({"suite": "lowbit-dev", "case": f"M={m},N={N0},K={K0},w={name},g=128,fp16", "variant": cname,
                         "config": str(c), "tessera_us": us, "floor_us": floor, "target_us": 1.25 * floor + 1.5,
                         "rel_err": err, "copy_gbs": bw, **model_fields(lms[name, m, cname]), **env})  # fmt: skip
        cub = timer(torch.matmul, x, w16.T) if name == "int4" else None
        good = {k: v for k, v in res.items() if v[1] < 2e-3 and str(v[2]) not in failed}
        best = min(good.items(), key=lambda kv: kv[1][0]) if good else None
        line = f"{name:5} M={m:<3} floor {floor:5.1f} target {1.25 * floor + 1.5:5.1f} |"
        line += " ".join(f" {k} {v[0]:5.1f}{'' if k in good else '!'}" for k, v in res.items())
        if best:
            line += f" | best {best[0]} {best[1][0]:.1f} ({best[1][2]})"
        if cub is not None:
            line += f" | cuBLAS fp16 {cub:.1f}"
        print(line, flush=True)
    if failed:
        print("configs with failed checks:", sorted(failed))
    if out_dir:
        path = Path(out_dir) / f"{env['date']}-lowbit-dev.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        print(f"wrote {path}")


def model_fields(lm: LaunchModel) -> dict:
    """The launch model's numbers for a JSONL row (prefixed model_)."""
    keys = ("blocks", "per_sm", "limit", "waves", "fill", "warps_per_sm", "units_per_warp", "round_trips", "act_trips",
            "inflight_kib", "chain_us", "stream_us", "mma_us", "issue_us", "bound")  # fmt: skip
    return {f"model_{k}": getattr(lm, k) for k in keys}


if __name__ == "__main__":
    main()
