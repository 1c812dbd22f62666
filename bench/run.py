"""Run a benchmark suite on the GPU: `python bench/run.py --suite reduce [--out DIR]`.

Suites: attention (bench/attention_suite.py: flash attention vs torch SDPA's flash and cuDNN
backends, prefill and decode), gemm (bench/gemm_suite.py: tuned tensor-core GEMM vs cuBLAS and torch.compile), gemm-graph
(the same file: the anchors the graph compiler emits for the suite models' GEMMs, fused epilogues
included, vs cuBLAS, torch eager and torch.compile; --quick skips ResNet-50's convolutions), models
(bench/models_suite.py: whole models under torch.compile(backend="tessera") vs eager and
torch.compile's modes; its own options follow, see `python3 bench/models_suite.py --help`) and
reduce (row sum/max/mean, softmax, layernorm, rmsnorm over the last axis, through the dispatch
functions of tessera.templates.row.kinds, output allocation included) against
torch eager and torch.compile (default mode), with the achieved bandwidth and its fraction
of the device copy bandwidth measured in the same run.  serving (bench/serving_suite.py: tessera.llm
offline, online, batch-1 decode and startup vs transformers' generate_batch and generate; its
own options follow, see `python3 bench/serving_suite.py --help`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Timer, copy_bandwidth_gbs, rel_err, write_results  # noqa: E402

import tessera as ts  # noqa: E402
from tessera.templates.row import kinds as reduce_ops  # noqa: E402

_DT = {"fp16": (torch.float16, ts.f16), "bf16": (torch.bfloat16, ts.bf16), "fp32": (torch.float32, ts.f32)}
EPS = 1e-5


def _torch_op(op: str):
    if op in ("sum", "mean"):
        return lambda x: getattr(torch, op)(x, dim=-1)
    if op in ("max", "min"):
        return lambda x: getattr(torch, op == "max" and "amax" or "amin")(x, dim=-1)
    if op == "softmax":
        return lambda x: torch.softmax(x, dim=-1)
    if op == "layernorm":
        return lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, EPS)
    return lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS)


def _tessera_op(op: str):
    """The dispatch function (tessera.templates.row.kinds): output allocation and kernel choice included."""
    if op in ("sum", "max", "mean", "min"):
        return lambda x: reduce_ops.row_reduce(x, op)
    if op == "softmax":
        return reduce_ops.softmax
    if op == "layernorm":
        return lambda x, w, b: reduce_ops.layer_norm(x, w, b, EPS)
    return lambda x, w: reduce_ops.rms_norm(x, w, EPS)


def _schedule(op: str, x: torch.Tensor) -> str:
    """The kernel the dispatcher launches for x (its name spells the schedule)."""
    C = x.shape[-1]
    vector = (C * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
    return reduce_ops.kernel_for(op, str(x.dtype), C, vector).ir.name


def reduce_suite(timer: Timer, copy_gbs: float) -> list[dict]:
    rows = []
    # >= 64 MB cases for the bandwidth target, plus L2-sized ones (flushed between repeats).
    cases = [((8192, 8192), "fp16"), ((16384, 4096), "fp16"), ((4096, 16384), "fp16"), ((8192, 8192), "fp32"),
             ((4096, 4096), "fp16"), ((2048, 768), "fp16")]  # fmt: skip
    ops = ["sum", "max", "mean", "softmax", "layernorm", "rmsnorm"]
    for (R, C), dname in cases:
        tdt, _ = _DT[dname]
        x = torch.randn(R, C, device="cuda", dtype=tdt)
        w = torch.randn(C, device="cuda", dtype=tdt)
        b = torch.randn(C, device="cuda", dtype=tdt)
        for op in ops:
            args = {"layernorm": (x, w, b), "rmsnorm": (x, w)}.get(op, (x,))
            out_bytes = (R if op in ("sum", "max", "mean") else x.numel()) * x.element_size()
            ours, eager = _tessera_op(op), _torch_op(op)
            compiled = torch.compile(eager)
            err = rel_err(ours(*args), eager(*[a.double() for a in args]))
            peers = {"torch.eager": timer(eager, *args), "torch.compile:default": timer(compiled, *args)}
            t_us = timer(ours, *args)
            nbytes = x.numel() * x.element_size() + out_bytes
            gbs = nbytes / (t_us * 1e-6) / 1e9
            row = {"case": f"op={op},R={R},C={C},{dname}", "tessera_us": t_us, "peers_us": peers, "rel_err": err,
                   "mbytes": nbytes / 1e6, "gbs": gbs, "frac_copy_bw": gbs / copy_gbs,
                   "vs_eager": peers["torch.eager"] / t_us, "schedule": _schedule(op, x),
                   "l2": "flushed by a 1 GB read before each repeat"}  # fmt: skip
            rows.append(row)
            print(f"{row['case']:<36} tessera {t_us:8.1f} us  eager {peers['torch.eager']:8.1f}  "
                  f"compile {peers['torch.compile:default']:8.1f}  {gbs:7.0f} GB/s ({gbs / copy_gbs:.0%})  "
                  f"err {err:.1e}  {row['schedule']}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=["reduce", "gemm", "gemm-graph", "models", "cpu", "lowbit", "attention",
                                        "serving"], required=True)  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="gemm: the first six shapes only; lowbit: fewer M; attention: a few shapes")
    ap.add_argument("--shard", default="1/1", help="lowbit: run the I-th of N contiguous parts of the cases (I/N)")
    ap.add_argument("--ms", default="", help="lowbit: only the cases of these M (comma-separated), e.g. 4096")
    ap.add_argument("--types", default="", help="lowbit: only the cases of these weight types (comma-separated), e.g. int5,int7")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--repeats", type=int, default=50)
    args, rest = ap.parse_known_args()  # the models and cpu suites have options of their own
    if args.suite == "cpu":  # no GPU needed: bench/cpu_suite.py times on the CPU
        from cpu_suite import main as cpu_main

        cpu_main([*(["--out", args.out] if args.out else []), *rest])
        return
    if args.suite == "serving":  # tessera.llm vs transformers' generation; its own options follow
        from serving_suite import main as serving_main

        serving_main([*(["--out", args.out] if args.out else []), *rest])
        return
    if args.suite == "models":
        from models_suite import main as models_main

        models_main(["--repeats", str(args.repeats), *(["--out", args.out] if args.out else []), *rest])
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    torch.manual_seed(0)
    timer = Timer(repeats=args.repeats)
    copy_gbs = copy_bandwidth_gbs(timer)
    print(f"device copy bandwidth this run: {copy_gbs:.0f} GB/s")
    outdirs = [Path(__file__).resolve().parent / "results"] + ([Path(args.out)] if args.out else [])
    if args.suite == "gemm-graph":  # the kernels the graph compiler emits for the suite models' GEMMs
        from gemm_suite import graph_gemm_suite

        rows = graph_gemm_suite(timer, convs=not args.quick)
        write_results("gemm-graph", rows, outdirs, ["vs_best_torch", "vs_cublas", "config", "kernels", "prepare_s"])
        return
    if args.suite == "gemm":
        from gemm_suite import gemm_suite, summary

        rows = gemm_suite(timer, quick=args.quick)
        write_results(args.suite, rows, outdirs, ["vs_cublas", "tflops", "config"])
        print(summary(rows))
        return
    if args.suite == "lowbit":
        from lowbit_suite import lowbit_suite

        try:
            part, parts = (int(v) for v in args.shard.split("/"))
        except ValueError:
            ap.error(f"--shard takes I/N (the I-th of N parts), got {args.shard!r}")
        try:
            ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else None
        except ValueError:
            ap.error(f"--ms takes comma-separated row counts, got {args.ms!r}")
        from tessera.quant import WEIGHT_TYPES

        types = tuple(args.types.split(",")) if args.types else None
        unknown = sorted(set(types or ()) - {t.name for t in WEIGHT_TYPES})
        if unknown:
            ap.error(f"--types: unknown weight types {unknown}; known: {', '.join(t.name for t in WEIGHT_TYPES)}")
        rows = lowbit_suite(timer, copy_gbs, quick=args.quick, shard=(part, parts), ms=ms, types=types)
        name = args.suite + (f"-m{'-'.join(map(str, ms))}" if ms else "") + (f"-{'-'.join(types)}" if types else "")
        name += "" if parts == 1 else f"-part{part}of{parts}"
        write_results(name, rows, outdirs, ["floor_us", "target_us", "vs_floor", "vs_cublas", "config"])
        return
    if args.suite == "attention":
        from attention_suite import attention_suite
        from attention_suite import summary as attention_summary

        rows = attention_suite(timer, quick=args.quick)
        write_results(args.suite, rows, outdirs, ["tflops", "gbs", "vs_flash", "vs_cudnn", "config"])
        print(attention_summary(rows))
        return
    rows = reduce_suite(timer, copy_gbs)
    for r in rows:
        r["copy_gbs"] = copy_gbs
    write_results(args.suite, rows, outdirs, ["gbs", "frac_copy_bw", "vs_eager", "schedule"])


if __name__ == "__main__":
    main()
