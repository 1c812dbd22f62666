"""Anchor kernels with fused epilogues (tessera.ops.anchors) against torch, DESIGN.md protocol.

Cases: linear + bias + GELU at LLM projection sizes, and the convolutions of ResNet-50
(batch 1, BatchNorm folded into a bias) + ReLU.  tessera runs one anchor (GEMM with the
epilogue in its stores, plus im2col for the convolutions); peers are torch eager (cuBLAS/cuDNN
then separate elementwise kernels) and, for linear, cuBLAS's own bias epilogue without the
GELU.  Each is timed as called from Python and as a CUDA-graph replay (what a captured
model runs: no host launch cost).  `--tune` also times the tuned configuration of each case (compiles every candidate).

    python3 bench/anchors_suite.py [--tune] [--only SUBSTRINGS] [--repeats 50] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Timer, rel_err, write_results  # noqa: E402

from tessera import ops  # noqa: E402
from tessera.ops.anchors import Epilogue, prepare_conv2d, prepare_linear  # noqa: E402

F = torch.nn.functional
LINEAR = [(16, 4096, 4096), (128, 4096, 4096), (2048, 4096, 4096), (128, 14336, 4096), (2048, 4096, 14336)]
# ResNet-50 at 224x224, batch 1: (C, H, O, kernel, stride, padding)
CONVS = [(3, 224, 64, 7, 2, 3), (64, 56, 64, 3, 1, 1), (64, 56, 256, 1, 1, 0), (256, 56, 128, 1, 2, 0),
         (128, 28, 128, 3, 1, 1), (256, 14, 256, 3, 1, 1), (1024, 14, 2048, 1, 2, 0), (512, 7, 512, 3, 1, 1),
         (2048, 7, 512, 1, 1, 0)]  # fmt: skip


def graphed(fn):
    """fn captured in a CUDA graph: the replay times the GPU work without Python's launch cost."""
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    return graph.replay


def _ep(shape: tuple[int, ...], fn) -> Epilogue:
    acc = ops.placeholder(shape, "float16", "acc")
    return Epilogue(acc, fn(acc), [])


def linear_case(timer: Timer, m: int, n: int, k: int, tune: bool) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) * k**-0.5
    b = torch.randn(n, device="cuda", dtype=torch.float16)
    ref = F.gelu(F.linear(x.double(), w.double(), b.double()))
    t0 = time.perf_counter()
    kern = prepare_linear((m, k), (n, k), "float16", bias=True, epilogue=_ep((m, n), ops.gelu))
    prep_s = time.perf_counter() - t0
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    kern([x, w, b], out)
    row = {"case": f"op=linear,M={m},N={n},K={k},ep=bias+gelu,fp16", "tessera_us": timer(kern, [x, w, b], out),
           "rel_err": rel_err(out, ref), "config": str(kern.config), "kernels": len(kern.kernels), "prepare_s": prep_s}  # fmt: skip
    row["tessera_graph_us"] = timer(graphed(lambda: kern([x, w, b], out)))
    eager = lambda: F.gelu(F.linear(x, w, b))  # noqa: E731
    row["peers_us"] = {"torch.eager": timer(eager), "torch.eager:cudagraph": timer(graphed(eager)),
                       "cublas": timer(lambda: F.linear(x, w, b))}  # fmt: skip
    if tune:
        t0 = time.perf_counter()
        tk = prepare_linear((m, k), (n, k), "float16", bias=True, epilogue=_ep((m, n), ops.gelu), tune=True)
        row["tune_s"] = time.perf_counter() - t0
        row["tuned_us"], row["tuned_config"] = timer(tk, [x, w, b], out), str(tk.config)
    return row


def conv_case(timer: Timer, c: int, h: int, o: int, ks: int, stride: int, pad: int, tune: bool) -> dict:
    x = torch.randn(1, c, h, h, device="cuda", dtype=torch.float16)
    w = torch.randn(o, c, ks, ks, device="cuda", dtype=torch.float16) * (c * ks * ks) ** -0.5
    b = torch.randn(o, device="cuda", dtype=torch.float16)
    ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), stride=stride, padding=pad))
    shape = tuple(ref.shape)
    t0 = time.perf_counter()
    kern = prepare_conv2d(x.shape, w.shape, "float16", stride=stride, padding=pad, bias=True, epilogue=_ep(shape, ops.relu))
    prep_s = time.perf_counter() - t0
    out = torch.empty(shape, device="cuda", dtype=torch.float16)
    kern([x, w, b], out)
    row = {"case": f"op=conv2d,C={c},H={h},O={o},k={ks},s={stride},ep=bias+relu,fp16,bs=1",
           "tessera_us": timer(kern, [x, w, b], out), "rel_err": rel_err(out, ref), "config": str(kern.config),
           "kernels": len(kern.kernels), "prepare_s": prep_s}  # fmt: skip
    row["tessera_graph_us"] = timer(graphed(lambda: kern([x, w, b], out)))
    eager = lambda: F.relu(F.conv2d(x, w, b, stride=stride, padding=pad))  # noqa: E731
    row["peers_us"] = {"torch.eager": timer(eager), "torch.eager:cudagraph": timer(graphed(eager))}
    if tune:
        t0 = time.perf_counter()
        tk = prepare_conv2d(x.shape, w.shape, "float16", stride=stride, padding=pad, bias=True,
                            epilogue=_ep(shape, ops.relu), tune=True)  # fmt: skip
        row["tune_s"] = time.perf_counter() - t0
        row["tuned_us"], row["tuned_config"] = timer(tk, [x, w, b], out), str(tk.config)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--only", default="", help="';'-separated substrings: run the cases whose name has one")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    timer = Timer(repeats=args.repeats)
    only = [s for s in args.only.split(";") if s]
    cases = [("linear", f"op=linear,M={m},N={n},K={k},", (m, n, k)) for m, n, k in LINEAR]
    cases += [("conv", "op=conv2d,C={},H={},O={},k={},s={},".format(*c[:5]), c) for c in CONVS]
    rows = []
    for kind, name, params in cases:
        if only and not any(s in name for s in only):
            continue
        rows.append((linear_case if kind == "linear" else conv_case)(timer, *params, args.tune))
        print(rows[-1], flush=True)
    for r in rows:
        r["vs_torch_eager"] = r["peers_us"]["torch.eager"] / r["tessera_us"]
        r["graph_vs_torch_graph"] = r["peers_us"]["torch.eager:cudagraph"] / r["tessera_graph_us"]
    write_results("anchors", rows, [Path(args.out)], ["tessera_graph_us", "graph_vs_torch_graph", "vs_torch_eager",
                                                      "config", "tuned_us", "tuned_config"])  # fmt: skip


if __name__ == "__main__":
    main()
