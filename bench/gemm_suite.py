"""The `gemm` suite: tessera's tuned tensor-core GEMM against cuBLAS (torch.matmul) and
torch.compile, on bench/PROTOCOL.md's GEMM workloads; and (`graph_gemm_suite`) the kernels the graph
compiler emits for the suite models' own GEMMs: the anchor with its fused epilogue, prepared as
`compile_graph` prepares it (tuned), against cuBLAS alone, torch eager and torch.compile.

torch.compile peers get `torch._dynamo.reset()` and a fresh compile before every shape: a
compiled function reused across shapes runs dynamic-shape kernels from the second shape on."""

from __future__ import annotations

import math
import time
from functools import partial

import torch
from harness import Timer, rel_err

from tessera.eager.matmul import choose_config, matmul

LLAMA3_8B_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def workloads(quick: bool = False) -> list[tuple[int, int, int]]:
    shapes = [(4096, 4096, 4096), (2048, 14336, 4096), (2048, 4096, 14336), (1, 4096, 4096), (16, 4096, 4096),
              (1, 14336, 4096)]  # fmt: skip
    for m in (1, 16, 128, 2048, 4096):
        shapes += [(m, n, k) for n, k in LLAMA3_8B_NK]
    shapes = list(dict.fromkeys(shapes))
    return shapes[:6] if quick else shapes


def gemm_suite(timer: Timer, quick: bool = False, dtypes: tuple[str, ...] = ("fp16",),
               layouts: tuple[str, ...] = ("nk", "kn")) -> list[dict]:  # fmt: skip
    """B as a linear layer's weight [N, K] ("nk", peer F.linear) and as [K, N] ("kn", peer
    torch.matmul); both peers are cuBLAS."""
    rows = []
    for dname in dtypes:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
        for layout in layouts:
            peer = torch.matmul if layout == "kn" else torch.nn.functional.linear
            for m, n, k in workloads(quick):
                compiled = fresh_compile(peer)
                a = torch.randn(m, k, device="cuda", dtype=dt)
                b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=dt)
                t0 = time.perf_counter()
                cfg = choose_config(a, b, layout)
                tune_s = time.perf_counter() - t0
                out = matmul(a, b, b_layout=layout, config=cfg)
                err = rel_err(out, peer(a.double(), b.double()))
                peers = timer.side_by_side({"cublas": partial(peer, a, b), "torch.compile:default": partial(compiled, a, b),
                                            "tessera": partial(matmul, a, b, b_layout=layout, config=cfg)})  # fmt: skip
                t_us = peers.pop("tessera")
                rows.append(_row(m, n, k, dname, layout, t_us, peers, err, cfg, tune_s))
    return rows


def fresh_compile(fn, **kwargs):  # noqa: ANN001, ANN201
    """torch.compile(fn) after torch._dynamo.reset(): static-shape kernels for the next shape."""
    torch._dynamo.reset()
    return torch.compile(fn, **kwargs)


# The suite models' GEMMs as the graph compiler sees them (fp16, batch 1; bench/PROTOCOL.md's models):
# (model, layer, M, N, K, epilogue).  QKV and gate/up projections are merged by the graph's
# merge_qkv pass; GPT-2's Conv1D weights are transposed once to [N, K].
MODEL_GEMMS = [
    ("bert-base", "qkv", 128, 2304, 768, "bias"), ("bert-base", "attn_out", 128, 768, 768, "bias+residual"),
    ("bert-base", "ffn_up", 128, 3072, 768, "bias+gelu"), ("bert-base", "ffn_down", 128, 768, 3072, "bias+residual"),
    ("gpt2", "lm_head", 128, 50257, 768, "none"),
    ("llama-1.1b", "qkv", 512, 2560, 2048, "none"), ("llama-1.1b", "o_proj", 512, 2048, 2048, "residual"),
    ("llama-1.1b", "gate_up", 512, 11264, 2048, "none"), ("llama-1.1b", "down", 512, 2048, 5632, "residual"),
    ("llama-1.1b", "lm_head", 512, 32000, 2048, "none"),
]  # fmt: skip
# ResNet-50's convolutions as GEMMs (M = N*OH*OW, N = O, K = C*kh*kw): (C, H, O, kernel, stride, padding).
RESNET_CONVS = [(3, 224, 64, 7, 2, 3), (64, 56, 64, 3, 1, 1), (64, 56, 256, 1, 1, 0), (256, 56, 128, 1, 2, 0),
                (128, 28, 128, 3, 1, 1), (256, 14, 256, 3, 1, 1), (1024, 14, 2048, 1, 2, 0), (512, 7, 512, 3, 1, 1),
                (2048, 7, 512, 1, 1, 0)]  # fmt: skip


def _linear_epilogue(kind: str, m: int, n: int):  # noqa: ANN202
    """(tessera Epilogue or None, bias?, needs a residual?, the torch function of (y, residual))."""
    from tessera import ops
    from tessera.templates import Epilogue

    F = torch.nn.functional
    acc = ops.placeholder((m, n), "float16", "acc")
    if kind.endswith("gelu"):
        return Epilogue(acc, ops.gelu(acc), []), kind.startswith("bias"), False, lambda y, r: F.gelu(y)
    if kind.endswith("residual"):
        res = ops.placeholder((m, n), "float16", "res")
        return Epilogue(acc, ops.add(acc, res), [res]), kind.startswith("bias"), True, lambda y, r: y + r
    return None, kind == "bias", False, lambda y, r: y


def graph_gemm_suite(timer: Timer, convs: bool = True, batches: tuple[int, ...] = (1, 16)) -> list[dict]:
    """The anchors the graph compiler emits for the suite models' GEMMs (tuned, as compile_graph
    tunes by default), each with its fused epilogue, against cuBLAS alone (F.linear with its bias
    epilogue), torch eager (the GEMM, then the epilogue) and torch.compile of the same function."""
    from tessera.templates import prepare_conv2d, prepare_linear

    F = torch.nn.functional
    rows = []
    for model, layer, m, n, k, kind in MODEL_GEMMS:
        ep, bias, residual, tail = _linear_epilogue(kind, m, n)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * k**-0.5
        b = torch.randn(n, device="cuda", dtype=torch.float16) if bias else None
        r = torch.randn(m, n, device="cuda", dtype=torch.float16) if residual else None
        t0 = time.perf_counter()
        kern = prepare_linear((m, k), (n, k), "float16", bias=bias, epilogue=ep, tune=True)
        prep_s = time.perf_counter() - t0
        inputs, extras = [x, w] + ([b] if bias else []), [r] if residual else []
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        kern(inputs, out, extras)
        ref = tail(F.linear(x.double(), w.double(), None if b is None else b.double()), None if r is None else r.double())
        eager = lambda x, w, b, r, tail=tail: tail(F.linear(x, w, b), r)  # noqa: E731
        peers = timer.side_by_side({"cublas": partial(F.linear, x, w, b), "torch.eager": partial(eager, x, w, b, r),
                                    "torch.compile:default": partial(fresh_compile(eager), x, w, b, r),
                                    "tessera": partial(kern, inputs, out, extras)})  # fmt: skip
        t_us = peers.pop("tessera")
        rows.append(_graph_row(f"model={model},layer={layer},M={m},N={n},K={k},ep={kind},fp16", t_us, peers,
                               rel_err(out, ref), kern, prep_s))  # fmt: skip
    for bs in batches if convs else ():
        for c, h, o, ks, stride, pad in RESNET_CONVS:
            x = torch.randn(bs, c, h, h, device="cuda", dtype=torch.float16)
            w = torch.randn(o, c, ks, ks, device="cuda", dtype=torch.float16) * (c * ks * ks) ** -0.5
            b = torch.randn(o, device="cuda", dtype=torch.float16)
            ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), stride=stride, padding=pad))
            from tessera import ops
            from tessera.templates import Epilogue

            acc = ops.placeholder(tuple(ref.shape), "float16", "acc")
            t0 = time.perf_counter()
            kern = prepare_conv2d(x.shape, w.shape, "float16", stride=stride, padding=pad, bias=True,
                                  epilogue=Epilogue(acc, ops.relu(acc), []), tune=True)  # fmt: skip
            prep_s = time.perf_counter() - t0
            out = torch.empty(ref.shape, device="cuda", dtype=torch.float16)
            kern([x, w, b], out)
            eager = lambda x, w, b, s=stride, p=pad: F.relu(F.conv2d(x, w, b, stride=s, padding=p))  # noqa: E731
            peers = timer.side_by_side({"torch.eager": partial(eager, x, w, b),
                                        "torch.compile:default": partial(fresh_compile(eager), x, w, b),
                                        "tessera": partial(kern, [x, w, b], out)})  # fmt: skip
            t_us = peers.pop("tessera")
            oh = ref.shape[2]
            case = (f"model=resnet50,bs={bs},conv=C{c}xH{h}xO{o}xk{ks}s{stride},M={bs * oh * oh},N={o},K={c * ks * ks},"
                    "ep=bias+relu,fp16")  # fmt: skip
            rows.append(_graph_row(case, t_us, peers, rel_err(out, ref), kern, prep_s))
    return rows


def _graph_row(case: str, t_us: float, peers: dict, err: float, kern, prep_s: float) -> dict:  # noqa: ANN001
    best = min(v for p, v in peers.items() if p.startswith("torch."))
    row = {"case": case, "tessera_us": t_us, "peers_us": peers, "rel_err": err, "vs_best_torch": best / t_us,
           "vs_cublas": peers["cublas"] / t_us if "cublas" in peers else None, "config": str(kern.config),
           "kernels": len(kern.kernels), "prepare_s": prep_s}  # fmt: skip
    print(f"{case:<78} tessera {t_us:8.1f} us  best torch {best:8.1f}  x{row['vs_best_torch']:.2f}  "
          f"{kern.config}  {len(kern.kernels)} kernel(s)  prepare {prep_s:.1f}s  err {err:.1e}", flush=True)
    return row


def _row(m, n, k, dname, layout, t_us, peers, err, cfg, tune_s) -> dict:  # noqa: ANN001
    tflops = 2 * m * n * k / (t_us * 1e-6) / 1e12
    row = {"case": f"M={m},N={n},K={k},{dname},B={layout}", "tessera_us": t_us, "peers_us": peers, "rel_err": err,
           "vs_cublas": peers["cublas"] / t_us, "tflops": tflops, "config": str(cfg), "tune_s": tune_s}  # fmt: skip
    print(f"{row['case']:<40} tessera {t_us:8.1f} us  cublas {peers['cublas']:8.1f}  "
          f"x{row['vs_cublas']:.2f}  {tflops:6.0f} TF/s  {cfg}  tune {tune_s:.0f}s  err {err:.1e}", flush=True)
    return row


def summary(rows: list[dict]) -> str:
    """Geomean speed vs cuBLAS for M >= 128 and the M = 1 / 16 cases (the issue's targets), per layout."""
    lines = []
    for layout in sorted({r["case"].rsplit("B=", 1)[1] for r in rows}):
        mine = [r for r in rows if r["case"].endswith(f"B={layout}")]
        big = [r["vs_cublas"] for r in mine if int(r["case"].split(",")[0][2:]) >= 128]
        small = [r["vs_cublas"] for r in mine if int(r["case"].split(",")[0][2:]) in (1, 16)]
        lines.append(f"B={layout}: geomean vs cuBLAS: M>=128 {_geo(big):.3f}x ({len(big)} cases), "
                     f"M in (1,16) {_geo(small):.3f}x ({len(small)} cases)")  # fmt: skip
    return "\n".join(lines)


def _geo(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
