"""Anchor kernels with fused epilogues (tessera.templates) against torch (bench/PROTOCOL.md).

Cases: linear + bias + GELU at LLM projection sizes, and the convolutions of ResNet-50
(BatchNorm folded into a bias) + ReLU.  tessera runs one anchor (GEMM with the epilogue in its
stores, plus im2col for the convolutions that need it); peers are torch eager (cuBLAS/cuDNN
then separate elementwise kernels) and, for linear, cuBLAS's own bias epilogue without the
GELU.  Each is timed as called from Python and as a CUDA-graph replay (what a captured
model runs: no host launch cost).  `--tune` also times the tuned configuration of each case (compiles every candidate).

`--layout NHWC --batch 16` times what the model compiler emits for resnet50 at batch 16 on the
GPU (channels-last convolutions, every distinct conv shape of the network, tuned schedules):
the implicit GEMM (im2col tensor map) against the materialised im2col (TESSERA_IMPLICIT_CONV=0)
and cuDNN on channels-last tensors.

    python3 bench/anchors_suite.py [--tune] [--only SUBSTRINGS] [--repeats 50] [--out DIR]
    python3 bench/anchors_suite.py --layout NHWC --batch 16 --only conv
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
from tessera.templates import Epilogue, prepare_conv2d, prepare_linear  # noqa: E402

F = torch.nn.functional
LINEAR = [(16, 4096, 4096), (128, 4096, 4096), (2048, 4096, 4096), (128, 14336, 4096), (2048, 4096, 14336)]
# ResNet-50 at 224x224, batch 1: (C, H, O, kernel, stride, padding)
CONVS = [(3, 224, 64, 7, 2, 3), (64, 56, 64, 3, 1, 1), (64, 56, 256, 1, 1, 0), (256, 56, 128, 1, 2, 0),
         (128, 28, 128, 3, 1, 1), (256, 14, 256, 3, 1, 1), (1024, 14, 2048, 1, 2, 0), (512, 7, 512, 3, 1, 1),
         (2048, 7, 512, 1, 1, 0)]  # fmt: skip
# Every distinct conv of torchvision's ResNet-50 (v1.5: the stride on the 3x3), for --layout NHWC.
RESNET50_CONVS = [
    (3, 224, 64, 7, 2, 3), (64, 56, 64, 1, 1, 0), (64, 56, 64, 3, 1, 1), (64, 56, 256, 1, 1, 0),
    (256, 56, 64, 1, 1, 0), (256, 56, 128, 1, 1, 0), (128, 56, 128, 3, 2, 1), (128, 28, 512, 1, 1, 0),
    (256, 56, 512, 1, 2, 0), (512, 28, 128, 1, 1, 0), (128, 28, 128, 3, 1, 1), (512, 28, 256, 1, 1, 0),
    (256, 28, 256, 3, 2, 1), (256, 14, 1024, 1, 1, 0), (512, 28, 1024, 1, 2, 0), (1024, 14, 256, 1, 1, 0),
    (256, 14, 256, 3, 1, 1), (1024, 14, 512, 1, 1, 0), (512, 14, 512, 3, 2, 1), (512, 7, 2048, 1, 1, 0),
    (1024, 14, 2048, 1, 2, 0), (2048, 7, 512, 1, 1, 0), (512, 7, 512, 3, 1, 1),
]  # fmt: skip


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


def conv_case_nhwc(timer: Timer, c: int, h: int, o: int, ks: int, stride: int, pad: int, tune: bool, batch: int) -> dict:
    """A channels-last conv as the GPU model compiler plans it (tuned when `tune`), the
    materialised-im2col form beside it, and cuDNN on channels-last tensors."""
    x = torch.randn(batch, h, h, c, device="cuda", dtype=torch.float16)
    w = torch.randn(o, ks, ks, c, device="cuda", dtype=torch.float16) * (c * ks * ks) ** -0.5
    b = torch.randn(o, device="cuda", dtype=torch.float16)
    x_cl, w_cl = x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2)  # NCHW views of channels-last memory
    ref = F.relu(F.conv2d(x_cl.double(), w_cl.double(), b.double(), stride=stride, padding=pad)).permute(0, 2, 3, 1)
    shape = tuple(ref.shape)
    out = torch.empty(shape, device="cuda", dtype=torch.float16)
    row = {"case": f"op=conv2d,C={c},H={h},O={o},k={ks},s={stride},ep=bias+relu,fp16,NHWC,bs={batch}"}
    for label, implicit in (("", "1"), ("col_", "0")):
        os.environ["TESSERA_IMPLICIT_CONV"] = implicit
        try:
            t0 = time.perf_counter()
            kern = prepare_conv2d(x.shape, w.shape, "float16", stride=stride, padding=pad, bias=True,
                                  epilogue=_ep(shape, ops.relu), tune=tune, layout="NHWC")  # fmt: skip
            prep_s = time.perf_counter() - t0
        finally:
            del os.environ["TESSERA_IMPLICIT_CONV"]
        out.fill_(float("nan"))
        kern([x, w, b], out)
        row.update({f"{label}rel_err": rel_err(out, ref), f"{label}config": str(kern.config),
                    f"{label}kernels": len(kern.kernels), f"{label}prepare_s": prep_s,
                    f"tessera_{label}graph_us": timer(graphed(lambda k=kern: k([x, w, b], out)))})  # fmt: skip
    row["tessera_us"] = row["tessera_graph_us"]
    eager = lambda: F.relu(F.conv2d(x_cl, w_cl, b, stride=stride, padding=pad))  # noqa: E731
    row["peers_us"] = {"tessera.im2col": row["tessera_col_graph_us"], "torch.eager:cudagraph": timer(graphed(eager))}
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
    ap.add_argument("--layout", choices=("NCHW", "NHWC"), default="NCHW",
                    help="NHWC: ResNet-50's convolutions as the GPU model compiler runs them (tuned), at --batch")  # fmt: skip
    ap.add_argument("--batch", type=int, default=1, help="images per conv case (--layout NHWC)")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    timer = Timer(repeats=args.repeats)
    only = [s for s in args.only.split(";") if s]
    cases = [("linear", f"op=linear,M={m},N={n},K={k},", (m, n, k)) for m, n, k in LINEAR]
    nhwc = args.layout == "NHWC"
    convs = RESNET50_CONVS if nhwc else CONVS
    cases += [("conv", "op=conv2d,C={},H={},O={},k={},s={},".format(*c[:5]), c) for c in convs]
    rows = []
    for kind, name, params in cases:
        if only and not any(s in name for s in only):
            continue
        if kind == "linear":
            rows.append(linear_case(timer, *params, args.tune))
        elif nhwc:
            rows.append(conv_case_nhwc(timer, *params, args.tune, args.batch))
        else:
            rows.append(conv_case(timer, *params, args.tune))
        print(rows[-1], flush=True)
    for r in rows:
        if "torch.eager" in r["peers_us"]:  # (NHWC rows time CUDA-graph replays only)
            r["vs_torch_eager"] = r["peers_us"]["torch.eager"] / r["tessera_us"]
        r["graph_vs_torch_graph"] = r["peers_us"]["torch.eager:cudagraph"] / r["tessera_graph_us"]
    columns = ["graph_vs_torch_graph", "config", "col_config", "col_rel_err"] if nhwc else [
        "tessera_graph_us", "graph_vs_torch_graph", "vs_torch_eager", "config", "tuned_us", "tuned_config"]  # fmt: skip
    write_results("anchors-nhwc" if nhwc else "anchors", rows, [Path(args.out)], columns)


if __name__ == "__main__":
    main()
