"""Flash-attention development run on the GPU: every variant checked against a float32 torch
reference on fresh random inputs (outputs poisoned with NaN first), then a few shapes timed
against torch SDPA's flash and cuDNN backends.  Prints a short table.

    PYTHONPATH=$PWD python3 bench/attention_dev.py [--check-only] [--time-only]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from tessera.kernels.attention import FlashConfig
from tessera.kernels.attention_call import flash_attention


def reference(q, k, v, causal=False, scale=None, mask=None):
    """float32 math: repeat kv heads, scale, causal (top-left), mask, softmax, @ v."""
    q, k, v = q.float(), k.float(), v.float()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    return torch.softmax(s, -1) @ v


def compare(out, ref):
    """(relative error over rows that are not fully masked, NaN pattern equal)."""
    nan_ref = torch.isnan(ref)
    same = bool(torch.equal(torch.isnan(out), nan_ref))
    o, r = out.float()[~nan_ref], ref[~nan_ref]
    err = float((o - r).norm() / r.norm().clamp_min(1e-30)) if r.numel() else 0.0
    return err, same


def check_cases():
    cases = []  # (b, h, hk, sq, sk, d, causal, mask kind, splits, config)
    for d in (64, 80, 96, 128):
        cases += [(2, 4, 4, 129, 129, d, False, None, None, None), (1, 8, 2, 1000, 1000, d, True, None, None, None),
                  (1, 4, 1, 7, 300, d, False, None, None, None), (2, 8, 2, 1, 4097, d, False, None, None, None)]
    cases += [
        (1, 2, 2, 1, 1, 128, False, None, None, None), (1, 2, 2, 1, 1, 64, True, None, None, None),
        (3, 6, 3, 129, 77, 128, True, None, None, None), (3, 6, 3, 77, 129, 64, True, None, None, None),
        (1, 2, 2, 64, 1000, 128, False, None, 5, None), (2, 4, 4, 300, 700, 128, True, None, 3, None),
        (2, 4, 2, 129, 200, 128, False, "bool_b1qk", None, None), (2, 4, 2, 129, 200, 64, False, "float_qk", None, None),
        (2, 4, 4, 33, 150, 96, True, "bool_b1qk", None, None), (2, 4, 4, 50, 1000, 80, False, "float16_bh1k", None, None),
        (1, 4, 4, 1, 2048, 128, False, "bool_b11k", None, None), (1, 32, 8, 1, 8192, 128, False, None, None, None),
        (4, 32, 4, 1, 512, 128, False, None, None, None), (1, 12, 12, 257, 257, 64, False, None, None, FlashConfig(1, 128, 2)),
        (1, 12, 12, 1024, 1024, 64, True, None, None, FlashConfig(2, 64, 4)), (2, 4, 4, 200, 200, 64, False, None, None, FlashConfig(2, 128, 4)),
        (2, 8, 2, 300, 700, 128, True, None, None, FlashConfig(2, 128, 2, False, False)),
        (2, 8, 2, 1, 3000, 96, False, "bool_b11k", None, FlashConfig(1, 128, 3, False, False)),
        (2, 8, 8, 300, 700, 80, False, "float_qk", None, FlashConfig(2, 128, 2, True, False)),
    ]  # fmt: skip
    return cases


def make_mask(kind, b, h, sq, sk, device):
    if kind is None:
        return None
    if kind.startswith("bool"):
        shape = {"bool_b1qk": (b, 1, sq, sk), "bool_b11k": (b, 1, 1, sk)}[kind]
        m = torch.rand(shape, device=device) > 0.3
        if kind == "bool_b1qk":
            m[..., 3, :] = False  # a fully masked row: NaN, like the reference
        return m
    if kind == "float_qk":
        return torch.randn(sq, sk, device=device) * 2
    if kind == "float16_bh1k":
        m = torch.randn(b, h, 1, sk, device=device).half()
        m[..., ::7] = float("-inf")
        return m
    raise ValueError(kind)


def run_checks() -> bool:
    ok_all = True
    print(f"{'case':58s} {'rel_err':>9s} {'nan_ok':>6s} {'again':>9s}")
    for dt in (torch.float16, torch.bfloat16):
        for b, h, hk, sq, sk, d, causal, mk, splits, cfg in check_cases():
            name = f"{str(dt)[6:]} b{b} h{h}/{hk} sq{sq} sk{sk} d{d}{' causal' if causal else ''}{' ' + mk if mk else ''}"
            name += f" s{splits}" if splits else ""
            name += f" {cfg}" if cfg else ""
            try:
                errs = []
                for _ in range(2):  # repeated calls on fresh inputs
                    q = torch.randn(b, h, sq, d, device="cuda", dtype=dt)
                    k = torch.randn(b, hk, sk, d, device="cuda", dtype=dt)
                    v = torch.randn(b, hk, sk, d, device="cuda", dtype=dt)
                    mask = make_mask(mk, b, h, sq, sk, "cuda")
                    out = torch.full_like(q, float("nan"))
                    flash_attention(q, k, v, causal=causal, mask=mask, splits=splits, config=cfg, out=out)
                    torch.cuda.synchronize()
                    errs.append(compare(out, reference(q, k, v, causal, None, mask)))
                tol = 1e-2 if dt == torch.float16 else 2e-2
                ok = all(e < tol and same for e, same in errs)
                ok_all &= ok
                print(f"{name:58s} {errs[0][0]:9.2e} {str(errs[0][1] and errs[1][1]):>6s} {errs[1][0]:9.2e} {'' if ok else 'FAIL'}")
            except Exception as exc:  # noqa: BLE001
                ok_all = False
                print(f"{name:58s} ERROR {type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc(limit=2)
    return ok_all


def bench(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def run_timing() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    shapes = [(4, 32, 32, 2048, 2048, 128, False), (4, 32, 32, 2048, 2048, 128, True), (8, 16, 16, 1024, 1024, 64, False),
              (16, 12, 12, 512, 512, 64, True), (1, 32, 32, 4096, 4096, 128, True), (2, 32, 8, 2048, 2048, 128, True),
              (8, 32, 8, 1, 8192, 128, False), (1, 32, 8, 1, 2048, 128, False), (16, 32, 32, 1, 4096, 128, False)]  # fmt: skip
    variants = {  # name: config for prefill (2 consumers) / decode (1 consumer)
        "serial": (FlashConfig(2, 128, 2, False, False), FlashConfig(1, 128, 3, False, False)),
        "overlap": (FlashConfig(2, 128, 2, True, False), FlashConfig(1, 128, 3, True, False)),
        "o+pp": (FlashConfig(2, 128, 2, True, True), FlashConfig(1, 128, 4, True, False)),
        "o+pp/s3bn64": (FlashConfig(2, 64, 3, True, True), FlashConfig(1, 64, 6, True, False)),
    }
    print(f"\n{'shape':40s} " + " ".join(f"{v:>11s}" for v in variants) + f" {'flash':>8s} {'cudnn':>8s}  best TF/s  flash/best")
    for b, h, hk, sq, sk, d, causal in shapes:
        q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.float16)
        k = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.float16)
        v = torch.randn(b, hk, sk, d, device="cuda", dtype=torch.float16)
        flops = 4 * b * h * sq * sk * d * (0.5 if causal and sq == sk else 1)
        times = {}
        ref = reference(q, k, v, causal)
        for name, (pre, dec) in variants.items():
            cfg = dec if sq == 1 else pre
            if cfg.problems(d):
                times[name] = float("nan")
                continue
            try:
                err, _ = compare(flash_attention(q, k, v, causal=causal, config=cfg), ref)
                t = bench(lambda q=q, k=k, v=v, c=causal, cfg=cfg: flash_attention(q, k, v, causal=c, config=cfg))
                times[name] = t if err < 1e-2 else float("inf")
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: {type(exc).__name__}: {str(exc)[:200]}")
                times[name] = float("nan")
        peers = {}
        for nm, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    peers[nm] = bench(lambda q=q, k=k, v=v, c=causal, g=h != hk: sdpa(q, k, v, is_causal=c, enable_gqa=g))
            except Exception:  # noqa: BLE001
                peers[nm] = float("nan")
        best = min((t for t in times.values() if t == t), default=float("nan"))
        name = f"b{b} h{h}/{hk} sq{sq} sk{sk} d{d}{' c' if causal else ''}"
        print(f"{name:40s} " + " ".join(f"{t:11.1f}" for t in times.values())
              + f" {peers['flash']:8.1f} {peers['cudnn']:8.1f}  {flops / best / 1e6:9.1f}  {peers['flash'] / best:6.2f}x")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--time-only", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    ok = True
    if not args.time_only:
        ok = run_checks()
        print(f"checks {'PASSED' if ok else 'FAILED'} in {time.time() - t0:.0f} s")
    if not args.check_only:
        run_timing()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
