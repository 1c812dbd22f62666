"""Is the M=4096 low-bit prefill power-bound?  Each variant (cuBLAS on the fp16 weights, the two
passes, the register-A kernel) runs back to back for a few seconds while `nvidia-smi` samples
the SM clock, board power and throttle reasons every 50 ms; the table gives us per call, the
mean clock and power, and the cycles per call (us x MHz) that compare work without the
clock's drift.  K=4096, N=12288, group 128, M=4096, no L2 flush (the loop's steady state).
Kernels launch as tessera launches them ($TESSERA_PDL: programmatic dependent launch, on by
default); run it with TESSERA_PDL=0 too to see what back-to-back launches cost without it.

    python3 bench/lowbit_power.py --types int1,int4,int7,e4m3
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import tessera as ts  # noqa: E402
from tessera.ir.lowbit import FRAGMENT_SPAN  # noqa: E402
from tessera.kernels import lowbit_gemm_rs  # noqa: E402

M0, N0, K0, GROUP = 4096, 12288, 4096, 128


@functools.cache
def query() -> str:
    """The fields to sample; the throttle reasons' name changed between driver versions."""
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        fields = f"clocks.sm,power.draw,{reasons}"
        if subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True).returncode == 0:
            return fields
    return "clocks.sm,power.draw,pstate"


def sampled(fn, seconds: float) -> tuple[float, float, float, str]:
    """(us per call, mean SM MHz, mean W, throttle reasons seen) of fn looped for `seconds`."""
    import torch

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query()}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    calls = 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    rows = rows[len(rows) // 4:]  # the ramp's samples out
    mhz = float(np.mean([float(r[0]) for r in rows])) if rows else float("nan")
    watts = float(np.mean([float(r[1]) for r in rows])) if rows else float("nan")
    reasons = ",".join(sorted({r[2].strip() for r in rows}))
    return start.elapsed_time(end) * 1e3 / calls, mhz, watts, reasons


def main() -> None:
    import torch

    from tessera.quant.linear import prefill_matmul, prepare
    from tessera.quant.quantize import quantize_weight

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="int1,int4,int7,e4m3")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    os.environ["TESSERA_LOWBIT_PREFILL"] = "dequant"  # prefill_matmul: the two passes
    rng = np.random.default_rng(0)
    wf = torch.from_numpy(rng.normal(size=(N0, K0)).astype(np.float32) * 0.02).cuda().half()
    x = torch.randn(M0, K0, dtype=torch.float16, device="cuda")
    y = torch.empty(M0, N0, dtype=torch.float16, device="cuda")
    from tessera.kernels.matmul import matmul

    rows = [("cuBLAS fp16", *sampled(functools.partial(torch.matmul, x, wf.T), args.seconds)),
            ("tessera fp16 GEMM", *sampled(functools.partial(matmul, x, wf, b_layout="nk"), args.seconds))]  # fmt: skip
    for name in args.types.split(","):
        t = ts.dtype(name)
        p = prepare(quantize_weight(wf.float().cpu().numpy(), t, GROUP))
        config = lowbit_gemm_rs.CONFIGS[0]
        rs = functools.partial(lowbit_gemm_rs.lowbit_gemm_rs, x, p.words_for(FRAGMENT_SPAN), p.scales, p.biases, y, t,
                               GROUP, p.weight.zeros is not None, config)  # fmt: skip
        w16 = prefill_matmul(torch.eye(K0, dtype=torch.float16, device="cuda"), p).T.contiguous()  # the fp16 weights
        rows.append((f"{name} register-A", *sampled(rs, args.seconds)))
        rows.append((f"{name} two passes", *sampled(functools.partial(prefill_matmul, x, p), args.seconds)))
        rows.append((f"{name} cuBLAS on its fp16", *sampled(functools.partial(torch.matmul, x, w16.T), args.seconds)))
    rows.append(("cuBLAS fp16 (again)", *sampled(functools.partial(torch.matmul, x, wf.T), args.seconds)))
    print(f"{'variant':28} {'us':>7} {'MHz':>6} {'W':>6} {'Mcycles':>8}  reasons")
    for name, us, mhz, watts, reasons in rows:
        print(f"{name:28} {us:7.1f} {mhz:6.0f} {watts:6.0f} {us * mhz / 1e6:8.3f}  {reasons}")


if __name__ == "__main__":
    main()
