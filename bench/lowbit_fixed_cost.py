"""Where the register-A kernel's time goes beyond its k loop (tessera.kernels.lowbit_gemm_rs,
issue 12), on the H200: at M=4096 and N=12672 (12 full rounds of tiles, no last-round effect),
K = 1024 .. 4096 for the kernel and cuBLAS on the fp16 weights side by side; a line through
each gives its fixed cost (prologue, pipeline fill, epilogue: per round, divide by 12) and its
cost per 1024 k.  A measurement-only variant with the epilogue's stores removed (the module's
source with the epilogue's condition made false at run time: its results are wrong, it is only
timed) says how much of the fixed cost the epilogue is, and the same config with the other
epilogue (TMA or stmatrix) what the TMA epilogue saves.  Last, each kernel back to back for 3 s
while nvidia-smi samples the SM clock and power.

Found at 6f464d5 (bench/results/2026-11-28-h200-lowbit-tma-epilogue.md), with the stmatrix
epilogue: per 1024 k the kernel was as fast as cuBLAS or faster (int4 125.9 us against 132.8),
but its fixed cost was 57.7 us against 24.2 (int7 68.2 / 31.8, int8 58.6 / 26.5), and removing
the epilogue's stores saved 29-38 us: the synchronous stores, all blocks writing their tiles at
once, were the whole gap.  The TMA epilogue (RegisterAConfig(epilogue="tma")) came of it.

    python3 bench/lowbit_fixed_cost.py [--types int4,int7,int8] [--config 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import tessera as ts  # noqa: E402
from tessera.ir.lowbit import FRAGMENT_SPAN  # noqa: E402
from tessera.kernels import lowbit_gemm_rs as rs  # noqa: E402

M, N, KS = 4096, 12672, (1024, 2048, 3072, 4096)
EPILOGUES = ("                if u0 == 0 and TMA_OUT:", "                elif u0 == 0:")


def without_epilogue():
    """A copy of tessera.kernels.lowbit_gemm_rs whose epilogues never run (M < 0 is false at run
    time, so ptxas keeps the k loop) and whose kernels have names of their own."""
    src = Path(rs.__file__).read_text()
    for line in EPILOGUES:
        assert line in src, f"the kernel's epilogue changed: {line.strip()!r} not found"
        src = src.replace(line, line[:-1] + " and M < 0:")
    src = src.replace('name = f"lowbit_gemm_rs_', 'name = f"no_epilogue_')
    path = Path(tempfile.mkdtemp()) / "rs_no_epilogue.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("rs_no_epilogue", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["rs_no_epilogue"] = module  # (the kernel decorator finds its module's globals there)
    spec.loader.exec_module(module)
    return module


def sustained(label: str, fn, seconds: float = 3.0) -> str:
    """fn back to back for `seconds` while nvidia-smi samples every 50 ms: median SM clock and power."""
    import torch

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    start, calls = time.time(), 0
    while time.time() - start < seconds:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        calls += 20
    smi.terminate()
    rows = [[float(v) for v in line.split(",")] for line in smi.communicate()[0].strip().splitlines()[5:] if line.count(",") == 1]
    return (f"sustained {label:14}: {calls} calls, SM clock median {statistics.median(r[0] for r in rows):.0f} MHz, "
            f"power {statistics.median(r[1] for r in rows):.0f} W")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="int4,int7,int8")
    ap.add_argument("--config", type=int, default=3, help="index into tessera.kernels.lowbit_gemm_rs.CONFIGS")
    args = ap.parse_args()

    import torch
    from harness import Timer, rel_err

    from tessera.quant.linear import prepare
    from tessera.quant.quantize import quantize_weight

    timer, rng, config = Timer(), np.random.default_rng(0), rs.CONFIGS[args.config]
    bare = without_epilogue()
    lines = []
    for name in args.types.split(","):
        t = ts.dtype(name)
        calls = {}
        for k in KS:
            p = prepare(quantize_weight(rng.normal(size=(N, k)) * 0.02, t, 128))
            bias = p.weight.zeros is not None
            w = torch.from_numpy(p.weight.dequantize()).cuda().half()
            x = torch.randn(M, k, dtype=torch.float16, device="cuda")
            y = torch.empty(M, N, dtype=torch.float16, device="cuda")
            run = functools.partial(rs.lowbit_gemm_rs, x, p.words_for(FRAGMENT_SPAN), p.scales, p.biases, y, t, 128, bias, config)
            run()
            print(f"{name} K={k} {config}: rel_err {rel_err(y[:128].double(), x[:128].double() @ w.double().T):.1e}", flush=True)
            calls[f"tessera K={k}"] = run
            calls[f"cublas K={k}"] = functools.partial(torch.matmul, x, w.T)
            if k == KS[-1]:
                other = dataclasses.replace(config, epilogue="stmatrix" if config.epilogue == "tma" else "tma")
                if not rs.problems(t, 128, bias, other):
                    calls[f"{other}"] = functools.partial(rs.lowbit_gemm_rs, x, p.words_for(FRAGMENT_SPAN), p.scales,
                                                          p.biases, torch.empty_like(y), t, 128, bias, other)  # fmt: skip
                calls["no epilogue"] = functools.partial(bare.lowbit_gemm_rs, x, p.words_for(FRAGMENT_SPAN), p.scales, p.biases,
                                                         torch.empty_like(y), t, 128, bias, config)  # fmt: skip
        times = timer.side_by_side(calls)
        for label, us in times.items():
            lines.append(f"{name} {label:16} {us:7.1f} us")
        for peer in ("tessera", "cublas"):
            slope, fixed = np.polyfit(KS, [times[f"{peer} K={k}"] for k in KS], 1)
            lines.append(f"{name} {peer:8}: fixed {fixed:6.1f} us ({fixed / 12:5.2f} a round), {slope * 1024:6.1f} us per 1024 k")
        lines.append(f"{name} without the epilogue's stores: {times['no epilogue']:.1f} us against {times[f'tessera K={KS[-1]}']:.1f}")
        lines.append(sustained(f"{name} tessera", calls[f"tessera K={KS[-1]}"]))
        lines.append(sustained(f"{name} cublas", calls[f"cublas K={KS[-1]}"]))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
