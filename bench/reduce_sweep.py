"""Time many row-kernel schedules side by side on the GPU (a tuning aid, not a suite):

    python bench/reduce_sweep.py [--out DIR] [--peers]

For each benchmark shape and op, every schedule in SWEEP is built (in parallel, through the
artifact cache), checked against float64 torch and timed with the harness Timer (L2 flushed).
Prints the achieved fraction of the copy bandwidth per schedule, best first, and writes
sweep.json under --out.  `--peers` also times torch eager and torch.compile (slow: compiles).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Timer, copy_bandwidth_gbs, rel_err  # noqa: E402

import tessera as ts  # noqa: E402
from tessera.kernels import make_row_reduce, make_softmax, reduce_ops  # noqa: E402
from tessera.kernels.reduce_schedule import RowSchedule as S  # noqa: E402

# (R, C, dtype) -> op -> schedules.  The dispatcher's current choice is added to each list.
R_ = dict(cached=True, raw=True)  # softmax: the row cached as loaded
SWEEP: dict[tuple[int, int, str], dict[str, list[S]]] = {
    (8192, 8192, "float16"): {
        "sum": [S(256, 256, 8, 4), S(512, 512, 8, 2), S(128, 128, 8, 8), S(256, 32, 8, 8), S(1024, 32, 8, 4)],
        "softmax": [
            S(256, 256, 8, 4),
            S(256, 256, 8, 4, **R_),
            S(128, 128, 8, 8, **R_),
            S(512, 512, 8, 2, **R_),
            S(128, 128, 8, 8),
            S(1024, 1024, 8, 1, **R_),
            S(128, 128, 8, 4),
            S(64, 64, 8, 16, **R_),
        ],
    },
    (16384, 4096, "float16"): {
        "sum": [S(128, 128, 8, 4), S(256, 256, 8, 2), S(128, 32, 8, 4), S(128, 16, 8, 8)],
        "softmax": [
            S(256, 256, 8, 2, True),
            S(128, 128, 8, 4),
            S(128, 128, 8, 4, **R_),
            S(256, 256, 8, 2, **R_),
            S(64, 64, 8, 8, **R_),
            S(512, 512, 8, 1, **R_),
        ],
    },
    (4096, 16384, "float16"): {
        "sum": [S(512, 512, 8, 4), S(256, 256, 8, 8), S(256, 256, 8, 4), S(512, 32, 8, 8)],
        "softmax": [
            S(256, 256, 8, 8),
            S(256, 256, 8, 8, **R_),
            S(512, 512, 8, 4, **R_),
            S(128, 128, 8, 16, **R_),
            S(1024, 1024, 8, 2, **R_),
            S(128, 128, 8, 8),
            S(128, 128, 8, 16),
        ],
    },
    (4096, 16384, "bfloat16"): {
        "sum": [S(512, 512, 8, 4), S(256, 256, 8, 8)],
        "softmax": [S(256, 256, 8, 8), S(256, 256, 8, 8, **R_), S(512, 512, 8, 4, **R_)],
    },
    (8192, 8192, "float32"): {
        "sum": [S(512, 512, 4, 4), S(256, 256, 4, 8)],
        "softmax": [S(512, 512, 4, 4, True), S(512, 512, 4, 4, **R_), S(256, 256, 4, 8, **R_), S(256, 256, 4, 8)],
    },
}


def _kernel(op: str, dtype, s: S) -> ts.Kernel:
    return make_softmax(dtype, s) if op == "softmax" else make_row_reduce(op, dtype, s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--ops", default="sum,max,mean,softmax")
    args = ap.parse_args()
    ops = args.ops.split(",")
    torch.manual_seed(0)
    timer = Timer()
    zero_timer = Timer()
    zero_timer.flush = lambda: zero_timer.scratch.zero_()  # the old write flush, for comparison
    copy_read, copy_zero = copy_bandwidth_gbs(timer), copy_bandwidth_gbs(zero_timer)
    print(f"copy bandwidth: read-flush {copy_read:.0f} GB/s, zero-flush {copy_zero:.0f} GB/s", flush=True)

    jobs = []
    for (R, C, dn), table in SWEEP.items():
        dt = ts.dtype(dn)
        for op in ops:
            scheds = table["sum" if op in ("max", "mean") else op]
            default = reduce_ops.kernel_for(op, f"torch.{dn}", C, True)
            jobs.append(((R, C, dn), op, default, True))
            jobs += [((R, C, dn), op, _kernel(op, dt, s), False) for s in scheds]
    kernels = list({id(k): k for _, _, k, _ in jobs}.values())
    t0 = time.time()
    with ThreadPoolExecutor(os.cpu_count() or 4) as ex:
        list(ex.map(lambda k: k.build(), kernels))
    for k in kernels:
        k.compile()
    print(f"built/loaded {len(kernels)} kernels in {time.time() - t0:.1f}s", flush=True)

    rows = []
    data = {}
    for (R, C, dn), op, k, is_default in jobs:
        if (R, C, dn) not in data:
            data[(R, C, dn)] = torch.randn(R, C, device="cuda", dtype=getattr(torch, dn))
        x = data[(R, C, dn)]
        ref = torch.softmax(x.double(), -1) if op == "softmax" else {"sum": torch.sum, "max": torch.amax,
                                                                     "mean": torch.mean}[op](x.double(), -1)  # fmt: skip
        y = torch.empty(ref.shape, device="cuda", dtype=x.dtype)
        k(x, y)
        err = rel_err(y, ref)
        us = timer(k, x, y)
        nbytes = x.numel() * x.element_size() + y.numel() * y.element_size()
        frac = nbytes / (us * 1e-6) / 1e9 / copy_read
        row = {"shape": f"{R}x{C}", "dtype": dn, "op": op, "kernel": k.ir.name, "default": is_default, "us": us,
               "frac_copy": frac, "err": err}  # fmt: skip
        if is_default:
            row["us_zero_flush"] = zero_timer(k, x, y)
            fn = (lambda t: reduce_ops.softmax(t)) if op == "softmax" else (lambda t, o=op: reduce_ops.row_reduce(t, o))
            row["us_dispatch"] = timer(fn, x)
        rows.append(row)
        extra = f" zero-flush {row['us_zero_flush']:.1f} dispatch {row['us_dispatch']:.1f}" if is_default else ""
        print(f"{R}x{C} {dn:<8} {op:<8} {k.ir.name:<34} {us:7.1f} us {frac:6.1%} err {err:.1e}{extra}", flush=True)

    # Host cost of one dispatch call (small shape, no sync inside the loop).
    xs = torch.randn(64, 1024, device="cuda", dtype=torch.float16)
    for name, fn in [("row_reduce", lambda: reduce_ops.row_reduce(xs, "sum")), ("softmax", lambda: reduce_ops.softmax(xs)),
                     ("torch.sum", lambda: torch.sum(xs, -1))]:  # fmt: skip
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(1000):
            fn()
        torch.cuda.synchronize()
        print(f"host cost per call {name}: {(time.perf_counter() - t0) * 1e3:.1f} us", flush=True)

    peers = []
    if args.peers:
        for (R, C, dn), x in data.items():
            for op in [o for o in ops if o in ("sum", "softmax")]:
                eager = (lambda t: torch.softmax(t, -1)) if op == "softmax" else (
                    lambda t, o=op: {"sum": torch.sum, "max": torch.amax, "mean": torch.mean}[o](t, dim=-1))  # fmt: skip
                t0 = time.time()
                comp = torch.compile(eager)
                comp(x)
                cs = time.time() - t0
                pe, pc = timer(eager, x), timer(comp, x)
                peers.append(
                    {"shape": f"{R}x{C}", "dtype": dn, "op": op, "eager_us": pe, "compile_us": pc, "compile_s": cs}
                )
                print(f"peers {R}x{C} {dn} {op}: eager {pe:.1f} us, torch.compile {pc:.1f} us (compile {cs:.1f}s)",
                      flush=True)  # fmt: skip

    print("\nbest per case:")
    for key in dict.fromkeys((r["shape"], r["dtype"], r["op"]) for r in rows):
        rs = sorted((r for r in rows if (r["shape"], r["dtype"], r["op"]) == key), key=lambda r: r["us"])
        d = next(r for r in rs if r["default"])
        print(f"{' '.join(key):<28} best {rs[0]['kernel']:<34} {rs[0]['us']:7.1f} us {rs[0]['frac_copy']:6.1%}"
              f"   default {d['us']:7.1f} us {d['frac_copy']:6.1%}")  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = {"copy_read_gbs": copy_read, "copy_zero_gbs": copy_zero, "rows": rows, "peers": peers}
        (Path(args.out) / "sweep.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
