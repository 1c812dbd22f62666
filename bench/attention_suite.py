"""The `attention` suite: tessera's flash attention (tessera.eager.attention.flash_attention,
host dispatch included) against torch SDPA's flash and cuDNN backends on bench/PROTOCOL.md's attention
workloads: prefill (batch 1-16, heads 12-32, grouped heads, seq 128-4096, head dims 64 and 128,
causal and not) and decode (one query token against a KV cache of 512-8192).

flash-attn is timed when it can be imported (its PyPI release is a source distribution whose
build compiles CUDA for hours; no wheel exists for the GPU machine's torch 2.11 / CUDA 13, so it
is normally absent and the rows say so).
"""

from __future__ import annotations

import math

import torch
from harness import Timer, rel_err

from tessera.eager.attention import flash_attention
from tessera.templates.attention.launch import AttentionShape, choose_config, choose_splits

PREFILL = [  # b, h, hk, s, d
    (16, 12, 12, 128, 64), (8, 12, 12, 512, 64), (4, 16, 16, 1024, 64), (16, 32, 32, 512, 128),
    (2, 32, 32, 2048, 128), (1, 32, 32, 4096, 128), (4, 32, 8, 2048, 128),
    (1, 12, 12, 128, 64), (1, 32, 4, 512, 64),  # the models suite's GPT-2 / BERT and TinyLlama attention
]  # fmt: skip
DECODE = [  # b, h, hk, kv, d
    (1, 32, 8, 512, 128), (1, 32, 8, 2048, 128), (1, 32, 8, 8192, 128), (8, 32, 8, 2048, 128),
    (8, 32, 8, 8192, 128), (16, 32, 32, 4096, 128), (4, 32, 32, 8192, 128), (1, 12, 12, 1024, 64),
]  # fmt: skip


def _flash_attn() -> object | None:
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]

        return flash_attn_func
    except Exception:  # noqa: BLE001  (not installed, or built for another torch)
        return None


def _reference(q, k, v, causal):  # noqa: ANN001
    """float32 SDPA (math backend) with the kv heads repeated."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1), is_causal=causal)


def _case(timer: Timer, b, h, hk, sq, sk, d, causal, dt, dname, fa) -> dict:  # noqa: ANN001
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from tessera.runtime.cuda import multiprocessor_count

    q = torch.randn(b, h, sq, d, device="cuda", dtype=dt)
    k = torch.randn(b, hk, sk, d, device="cuda", dtype=dt)
    v = torch.randn(b, hk, sk, d, device="cuda", dtype=dt)
    err = rel_err(flash_attention(q, k, v, causal=causal), _reference(q, k, v, causal))
    gqa = h != hk
    calls, skipped = {}, {}

    def with_backend(backend):  # noqa: ANN001, ANN202  (sdpa pinned to one backend for each call)
        def call():  # noqa: ANN202
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)

        return call

    for name, backend in (("sdpa:flash", SDPBackend.FLASH_ATTENTION), ("sdpa:cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with_backend(backend)()
            calls[name] = with_backend(backend)
        except Exception as exc:  # noqa: BLE001  (a backend that does not take the shape)
            skipped[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    if fa is not None:
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # flash-attn takes [B, S, H, D]
        calls["flash-attn"] = lambda: fa(qt, kt, vt, causal=causal)
    else:
        skipped["flash-attn"] = "not installed (no wheel for this torch/CUDA; PyPI has a source distribution only)"
    calls["tessera"] = lambda: flash_attention(q, k, v, causal=causal)
    peers = timer.side_by_side(calls)  # interleaved rounds: the card's clock drift hits every system alike
    t_us = peers.pop("tessera")
    visible = sq * sk if not causal else sum(min(i + 1, sk) for i in range(sq))  # top-left causal
    flops = 4 * b * h * visible * d
    nbytes = (2 * b * hk * sk * d + 2 * b * h * sq * d) * q.element_size()
    shape = AttentionShape(b, h, hk, sq, sk, d)
    cfg = choose_config(shape, multiprocessor_count())  # what flash_attention chose
    splits = choose_splits(shape, cfg, multiprocessor_count(), causal)
    kind = "decode" if sq == 1 else "prefill"
    row = {"case": f"{kind},B={b},H={h},Hk={hk},Sq={sq},Sk={sk},D={d},{'causal,' if causal else ''}{dname}",
           "tessera_us": t_us, "peers_us": peers, "rel_err": err, "tflops": flops / (t_us * 1e-6) / 1e12,
           "gbs": nbytes / (t_us * 1e-6) / 1e9, "config": f"{cfg}_k{splits}", "skipped": skipped,
           "l2": "flushed by a 1 GB read before each repeat"}  # fmt: skip
    for name in ("sdpa:flash", "sdpa:cudnn", "flash-attn"):
        if name in peers:
            row[f"vs_{name.split(':')[-1]}"] = peers[name] / t_us
    line = f"{row['case']:<62} tessera {t_us:8.1f} us {row['tflops']:6.0f} TF/s {row['gbs']:6.0f} GB/s"
    line += "".join(f"  {n} {p:8.1f} (x{p / t_us:.2f})" for n, p in peers.items())
    print(line + f"  err {err:.1e}  {row['config']}", flush=True)
    return row


def attention_suite(timer: Timer, quick: bool = False, dtypes: tuple[str, ...] = ("fp16", "bf16")) -> list[dict]:
    fa = _flash_attn()
    rows = []
    for dname in dtypes:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
        prefill = PREFILL[:3] if quick else PREFILL
        decode = DECODE[:3] if quick else DECODE
        if dname != dtypes[0]:  # the second dtype: a subset
            prefill, decode = prefill[-2:], decode[2:4]
        for b, h, hk, s, d in prefill:
            for causal in (False, True):
                rows.append(_case(timer, b, h, hk, s, s, d, causal, dt, dname, fa))
        for b, h, hk, kv, d in decode:
            rows.append(_case(timer, b, h, hk, 1, kv, d, False, dt, dname, fa))
        torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> str:
    """Geomean speed against each SDPA backend, prefill and decode apart."""
    lines = []
    for kind in ("prefill", "decode"):
        mine = [r for r in rows if r["case"].startswith(kind)]
        for peer in ("flash", "cudnn"):
            xs = [r[f"vs_{peer}"] for r in mine if f"vs_{peer}" in r]
            geo = math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
            lines.append(f"{kind}: geomean vs sdpa:{peer} {geo:.3f}x ({len(xs)} cases)")
    return "\n".join(lines)
