# ruff: noqa: F821, B023  (kernel shape symbols; lambdas are called inside their loop iteration)
"""Device checks and timings for the GEMM work, in one call: `python3 bench/gemm_dev.py [sections]`.

Sections (default: all): prims (TMA + mbarrier copy, setmaxnreg), profile (host cost vs kernel
time of matmul() at small M), check (TMA GEMM against torch: layouts, dtypes, odd shapes,
batch, split-k), time (TMA GEMM candidates against cuBLAS).  Prints a short table per
section; full rows go to $OUT/gemm_dev.jsonl when OUT is set.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tessera as ts  # noqa: E402
from tessera import f16, u64  # noqa: E402
from tessera.kernels.gemm import GemmConfig, make_split_k_reduce  # noqa: E402
from tessera.kernels.gemm_sm90 import WgmmaConfig  # noqa: E402
from tessera.kernels.gemm_tma import TmaConfig, tensor_map_boxes  # noqa: E402
from tessera.kernels.matmul import SMS, make_kernel, matmul  # noqa: E402
from tessera.runtime.tensor_map import TensorMap  # noqa: E402

ROWS: list[dict] = []
FLUSH: list[torch.Tensor] = []  # a buffer larger than L2, allocated on first use


def log(section: str, **row) -> None:
    ROWS.append({"section": section, **row})
    print(f"[{section}] " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def timed(fn, reps: int = 30, flush: bool = True) -> float:
    """Median µs of fn() between CUDA events, L2 flushed before each repeat."""
    if not FLUSH:
        FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if flush:
            FLUSH[0].zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def host_us(fn, n: int = 200) -> float:
    """Host time per call (no synchronisation inside the loop)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


# ---- primitives --------------------------------------------------------------------------
SW = ts.Swizzle(3, 3, 3)


@ts.kernel(target="cuda")
def tma_copy(X: f16["R", "C"], Y: f16["R", "C"], tx: ts.tensor_map(f16, (64, 64)), rounds: ts.int32):
    """Each block loads its 64x64 box `rounds` times through one mbarrier (parity flips)."""
    ts.attrs.grid = (ts.ceil_div(C, 64), ts.ceil_div(R, 64))
    ts.attrs.block = 128
    tile = ts.shared_tensor(f16, [64, 64], swizzle=SW)
    bar = ts.shared_tensor(u64, [1])
    tid = ts.thread_idx.x
    if tid == 0:
        ts.mbarrier_init(bar[0], 1)
        ts.fence_mbarrier_init()
    ts.syncthreads()
    for k in range(rounds):
        if tid == 0:
            ts.mbarrier_arrive_expect_tx(bar[0], 64 * 64 * 2)
            ts.tma_load(tile[0, 0], tx, bar[0], ts.block_idx.y * 64, ts.block_idx.x * 64)
        ts.mbarrier_wait(bar[0], k % 2)
        ts.syncthreads()  # everyone has seen this round before the next overwrites the tile
    for i in range(tid, 64 * 64, 128):
        r = ts.block_idx.y * 64 + i // 64
        c = ts.block_idx.x * 64 + i % 64
        if r < R and c < C:
            Y[r, c] = tile[i // 64, i % 64]


def prims() -> None:
    for r, c in ((200, 136), (64, 64), (1, 520)):
        x = torch.randn(r, c, device="cuda", dtype=torch.float16)
        y = torch.full_like(x, float("nan"))
        tma_copy(x, y, TensorMap.tiled(x, (64, 64)), 3)
        torch.cuda.synchronize()
        log("prims", test=f"tma_copy {r}x{c}", ok=bool(torch.equal(x, y)))


# ---- step 1: where the time goes at small M -----------------------------------------------
OLD = [GemmConfig(16, 64, 64, 16, 16, 3, 8), GemmConfig(16, 64, 64, 16, 16, 4, 4), WgmmaConfig(64, 64, 3, 6)]


def profile() -> None:
    for m, n, k in ((1, 4096, 4096), (16, 4096, 4096), (16, 6144, 4096)):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(n, k, device="cuda", dtype=torch.float16)
        cub = timed(lambda: torch.nn.functional.linear(a, b))
        cub_host = host_us(lambda: torch.nn.functional.linear(a, b))
        for cfg in OLD + [TmaConfig(64, 128, 8, 1, 4), TmaConfig(64, 64, 8, 1, 4), TmaConfig(64, 128, 8, 1, 1)]:
            kern = make_kernel(ts.f16, cfg, "nk", True)
            a3, b3 = a.view(1, m, k), b.view(1, n, k)
            c3 = torch.empty(1, m, n, device="cuda", dtype=torch.float16)
            work = torch.empty(cfg.split_k, m, n, device="cuda", dtype=torch.float32)
            red = make_split_k_reduce(ts.f16, cfg.split_k)
            if isinstance(cfg, TmaConfig):
                ab, bb = tensor_map_boxes(cfg, "nk")
                ta, tb = TensorMap.tiled(a3, ab), TensorMap.tiled(b3, bb)
                grid = cfg.grid(m, n, 1, SMS)

                def gemm_only(kern=kern, ta=ta, tb=tb, cfg=cfg, grid=grid, work=work, c3=c3):
                    kern(a3, b3, work if cfg.split_k > 1 else c3, ta, tb, cfg.split_k, grid)
            else:

                def gemm_only(kern=kern, cfg=cfg, work=work, c3=c3):
                    kern(a3, b3, work if cfg.split_k > 1 else c3, cfg.split_k)

            def both(gemm_only=gemm_only, cfg=cfg, red=red, work=work, c3=c3):
                gemm_only()
                if cfg.split_k > 1:
                    red(work, c3)

            def call(cfg=cfg):
                return matmul(a, b, b_layout="nk", config=cfg)

            err = rel(call(), a.double() @ b.double().T)
            log("profile", case=f"M={m},N={n},K={k}", cfg=str(cfg), gemm_kernel_us=timed(gemm_only),
                kernels_us=timed(both), matmul_us=timed(call), matmul_host_us=host_us(call),
                launch_host_us=host_us(gemm_only), cublas_us=cub, cublas_host_us=cub_host, err=err)  # fmt: skip


# ---- TMA GEMM correctness -------------------------------------------------------------------
CHECK_CFGS = [TmaConfig(128, 256, 4), TmaConfig(256, 128, 3), TmaConfig(128, 128, 5, split_k=3),
              TmaConfig(64, 128, 6, 1, split_k=2), TmaConfig(128, 64, 6, epilogue="pair"), TmaConfig(128, 256, 3, epilogue="staged"), TmaConfig(64, 48, 8, 1, epilogue="staged"),
              TmaConfig(128, 128, 4, persistent=False),
              TmaConfig(64, 128, 6, 1, split_k=4, persistent=False, split_reduce="cluster", epilogue="staged"),
              TmaConfig(64, 64, 8, 1, split_k=3, persistent=False, split_reduce="cluster")]  # fmt: skip
CHECK_SHAPES = [(1, 72, 64), (17, 136, 264), (130, 264, 520), (256, 512, 4104), (300, 1000, 2000)]


def check() -> None:
    for layout in ("nk", "kn"):
        for dname in ("float16", "bfloat16"):
            dt = getattr(torch, dname)
            for m, n, k in CHECK_SHAPES:
                batch = 1
                a = torch.randn(m, k, device="cuda", dtype=dt)
                b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=dt)
                ref = a.double() @ (b.double() if layout == "kn" else b.double().T)
                for cfg in CHECK_CFGS:
                    if layout == "kn" and cfg.block_n % 64:
                        continue
                    try:
                        e = rel(matmul(a, b, b_layout=layout, config=cfg), ref)
                        ok = e < (3e-3 if dname == "float16" else 1.2e-2)
                    except Exception as exc:  # noqa: BLE001
                        e, ok = float("nan"), f"{type(exc).__name__}: {str(exc)[:200]}"
                    if ok is not True or cfg is CHECK_CFGS[0]:
                        log("check", layout=layout, dtype=dname, shape=f"{batch}x{m}x{n}x{k}", cfg=str(cfg), err=e, ok=ok)
            # batched
            a = torch.randn(3, 40, 96, device="cuda", dtype=dt)
            b = torch.randn(*((3, 96, 72) if layout == "kn" else (3, 72, 96)), device="cuda", dtype=dt)
            ref = a.double() @ (b.double() if layout == "kn" else b.double().transpose(1, 2))
            for cfg in (TmaConfig(128, 128, 4), TmaConfig(64, 64, 6, 1, split_k=2),
                        TmaConfig(64, 64, 6, 1, split_k=2, persistent=False, split_reduce="cluster")):  # fmt: skip
                try:
                    e = rel(matmul(a, b, b_layout=layout, config=cfg), ref)
                    ok = e < 1.2e-2
                except Exception as exc:  # noqa: BLE001
                    e, ok = float("nan"), f"{type(exc).__name__}: {str(exc)[:200]}"
                log("check", layout=layout, dtype=dname, shape="3x40x72x96", cfg=str(cfg), err=e, ok=ok)


# ---- timing -------------------------------------------------------------------------------
TIME_SHAPES = [(m, n, k) for m in (128, 2048, 4096) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))]
TIME_SHAPES += [(4096, 4096, 4096), (2048, 14336, 4096), (2048, 4096, 14336)]


def time_section() -> None:
    from tessera.kernels.matmul import tma_space

    for m, n, k in TIME_SHAPES:
        for layout in ("nk", "kn"):
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=torch.float16)
            peer = torch.matmul if layout == "kn" else torch.nn.functional.linear
            cub = timed(lambda: peer(a, b))
            best = (float("inf"), None)
            for cfg in tma_space(m, n, k, 1, layout):
                try:
                    t = timed(lambda cfg=cfg: matmul(a, b, b_layout=layout, config=cfg), reps=10)
                except Exception as exc:  # noqa: BLE001
                    log("time", case=f"{m}x{n}x{k}", layout=layout, cfg=str(cfg), error=str(exc)[:200])
                    continue
                best = min(best, (t, cfg), key=lambda x: x[0])
            t, cfg = best
            if cfg is None:
                continue
            t = timed(lambda: matmul(a, b, b_layout=layout, config=cfg))
            err = rel(matmul(a, b, b_layout=layout, config=cfg), a.double() @ (b.double() if layout == "kn" else b.double().T))
            log("time", case=f"{m}x{n}x{k}", layout=layout, best=str(cfg), tessera_us=t, cublas_us=cub,
                vs_cublas=cub / t, tflops=2 * m * n * k / t / 1e6, err=err)  # fmt: skip


def sass() -> None:
    """Instruction counts in the SASS of two TMA kernels (cuobjdump must be on PATH)."""
    import subprocess

    for cfg, layout in ((TmaConfig(128, 256, 4), "nk"), (TmaConfig(128, 256, 4), "kn")):
        path = make_kernel(ts.f16, cfg, layout, True).build()
        text = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True).stdout
        counts = {op: text.count(op) for op in ("HGMMA", "UTMALDG", "SYNCS", "LDL", "STL", "USETMAXREG", "STG.E.U16", "WARPSYNC")}
        log("sass", cfg=str(cfg), layout=layout, **counts)


SMALL_SHAPES = [(m, n, k) for m in (1, 16) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))]
HOST_CFGS = [TmaConfig(64, 32, 16, 1), TmaConfig(64, 128, 8, 1, 4), GemmConfig(16, 64, 64, 16, 16, 4, 4)]


def host() -> None:
    """Host cost of one matmul() call (signature plan, bound launches) against cuBLAS's."""
    for m, n, k in ((1, 4096, 4096), (16, 6144, 4096)):
        for layout in ("nk", "kn"):
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=torch.float16)
            peer = torch.matmul if layout == "kn" else torch.nn.functional.linear
            log("host", case=f"{m}x{n}x{k}", layout=layout, cfg="cublas", host_us=host_us(lambda: peer(a, b)),
                us=timed(lambda: peer(a, b)))  # fmt: skip
            for cfg in HOST_CFGS:
                if layout == "kn" and isinstance(cfg, TmaConfig) and cfg.block_n % 64:
                    continue
                log("host", case=f"{m}x{n}x{k}", layout=layout, cfg=str(cfg),
                    host_us=host_us(lambda cfg=cfg: matmul(a, b, b_layout=layout, config=cfg)),
                    us=timed(lambda cfg=cfg: matmul(a, b, b_layout=layout, config=cfg)))  # fmt: skip


def repeat_check() -> None:
    """Planned calls on fresh data, alternating buffers (tensor-map cache), both layouts."""
    for layout in ("nk", "kn"):
        for cfg in (TmaConfig(128, 128, 4, split_k=2), TmaConfig(64, 64, 8, 1), TmaConfig(128, 256, 4)):
            bad = 0
            for _ in range(6):
                m, n, k = 130, 264, 520
                a = torch.randn(m, k, device="cuda", dtype=torch.float16)
                b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=torch.float16)
                ref = a.double() @ (b.double() if layout == "kn" else b.double().T)
                bad += rel(matmul(a, b, b_layout=layout, config=cfg), ref) > 3e-3
            log("repeat", layout=layout, cfg=str(cfg), bad=bad)


KSWEEP = [TmaConfig(128, 256, 3, epilogue="staged"), TmaConfig(256, 128, 3, epilogue="staged"),
          TmaConfig(128, 128, 5, epilogue="staged"), TmaConfig(128, 256, 3, epilogue="staged", group_m=16),
          TmaConfig(128, 256, 4, epilogue="pair")]  # fmt: skip


def ksweep() -> None:
    """M = N = 4096 over K: the slope is the main loop, the intercept the per-tile fixed cost."""
    for cfg in KSWEEP:
        times = {}
        for k in (1024, 2048, 4096, 8192):
            a = torch.randn(4096, k, device="cuda", dtype=torch.float16)
            b = torch.randn(4096, k, device="cuda", dtype=torch.float16)
            times[k] = timed(lambda: matmul(a, b, b_layout="nk", config=cfg), reps=15)
            if cfg is KSWEEP[0]:
                times[f"cublas{k}"] = timed(lambda: torch.nn.functional.linear(a, b), reps=15)
        slope = (times[8192] - times[1024]) / 7168
        log("ksweep", cfg=str(cfg), **{str(k): v for k, v in times.items()}, us_per_k=slope,
            intercept_us=times[1024] - slope * 1024, mainloop_tflops=2 * 4096 * 4096 / slope / 1e6)  # fmt: skip


def small() -> None:
    from tessera.kernels.matmul import tma_space

    for m, n, k in SMALL_SHAPES:
        for layout in ("nk", "kn"):
            a = torch.randn(m, k, device="cuda", dtype=torch.float16)
            b = torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda", dtype=torch.float16)
            peer = torch.matmul if layout == "kn" else torch.nn.functional.linear
            cub = timed(lambda: peer(a, b))
            res = sorted((timed(lambda cfg=cfg: matmul(a, b, b_layout=layout, config=cfg), reps=10), str(cfg), cfg)
                         for cfg in tma_space(m, n, k, 1, layout, cluster=True))  # fmt: skip
            best = res[0][2]
            t = timed(lambda: matmul(a, b, b_layout=layout, config=best))
            cl = [x for x in res if x[2].cluster][:1] or [(float("nan"), "-", None)]
            la = [x for x in res if not x[2].cluster][:1]
            log("small", case=f"{m}x{n}x{k}", layout=layout, best=str(best), tessera_us=t, cublas_us=cub,
                vs_cublas=cub / t, best_cluster=f"{cl[0][1]}:{cl[0][0]:.1f}", best_other=f"{la[0][1]}:{la[0][0]:.1f}")  # fmt: skip


def one() -> None:
    """One TMA GEMM launch and one cuBLAS launch at 4096^3 (for ncu)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    matmul(a, b, b_layout="nk", config=TmaConfig(128, 256, 4))
    torch.nn.functional.linear(a, b)
    torch.cuda.synchronize()


def prebuild(sections: list[str]) -> None:
    """Compile the kernels the sections use, in parallel (nvcc is a subprocess); "suite" builds
    those of the gemm benchmark suite and bench/sanitize.py (run with TESSERA_PREBUILD_ONLY=1)."""
    from tessera.kernels.matmul import tma_space

    cfgs = set()
    if "check" in sections:
        for layout in ("nk", "kn"):
            for dt in (ts.f16, ts.bf16):
                for cfg in CHECK_CFGS + [TmaConfig(128, 128, 4), TmaConfig(64, 64, 6, 1, split_k=2),
                                         TmaConfig(64, 64, 6, 1, split_k=2, persistent=False, split_reduce="cluster")]:
                    if not (layout == "kn" and cfg.block_n % 64):
                        cfgs.add((dt, cfg, layout))
    if "time" in sections:
        for m, n, k in TIME_SHAPES:
            for layout in ("nk", "kn"):
                cfgs.update((ts.f16, c, layout) for c in tma_space(m, n, k, 1, layout))
    if "host" in sections:
        cfgs.update((ts.f16, c, lay) for c in HOST_CFGS for lay in ("nk", "kn") if not (lay == "kn" and isinstance(c, TmaConfig) and c.block_n % 64))
    if "repeat" in sections:
        cfgs.update((ts.f16, c, lay) for c in (TmaConfig(128, 128, 4, split_k=2), TmaConfig(64, 64, 8, 1), TmaConfig(128, 256, 4)) for lay in ("nk", "kn"))
    if "ksweep" in sections or "one" in sections:
        cfgs.update((ts.f16, c, "nk") for c in KSWEEP)
    if "small" in sections:
        for m, n, k in SMALL_SHAPES:
            for layout in ("nk", "kn"):
                cfgs.update((ts.f16, c, layout) for c in tma_space(m, n, k, 1, layout, cluster=True))
    if "profile" in sections:
        cfgs.update((ts.f16, c, "nk") for c in OLD + [TmaConfig(64, 128, 8, 1, 4), TmaConfig(64, 64, 8, 1, 4),
                                                       TmaConfig(64, 128, 8, 1, 1)])  # fmt: skip
    if "suite" in sections:  # bench/run.py --suite gemm and bench/sanitize.py
        from gemm_suite import workloads

        for m, n, k in workloads():
            for layout in ("nk", "kn"):
                cfgs.update((ts.f16, c, layout) for c in tma_space(m, n, k, 1, layout))
        for c in (TmaConfig(128, 256, 3), TmaConfig(128, 64, 4, epilogue="staged"),
                  TmaConfig(64, 64, 4, 1, split_k=2, persistent=False),
                  TmaConfig(64, 64, 4, 1, split_k=2, persistent=False, split_reduce="cluster")):  # fmt: skip
            cfgs.update((ts.f16, c, layout) for layout in ("nk", "kn"))
    kernels = {make_kernel(dt, c, lay, True) for dt, c, lay in cfgs}
    kernels |= {make_split_k_reduce(ts.f16, s) for s in (2, 3, 4, 6, 8, 12, 16)}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        list(pool.map(lambda k: k.build(), kernels))
    print(f"built {len(kernels)} kernels in {time.perf_counter() - t0:.1f}s", flush=True)


def main() -> None:
    sections = sys.argv[1:] or ["prims", "check", "repeat", "host", "small", "ksweep"]
    torch.manual_seed(0)
    prebuild(sections)
    if os.environ.get("TESSERA_PREBUILD_ONLY"):
        return
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for name in sections:
        fn = {"prims": prims, "profile": profile, "check": check, "time": time_section, "sass": sass, "host": host,
              "repeat": repeat_check, "ksweep": ksweep, "small": small, "one": one}[name]  # fmt: skip
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            log(name, error="section failed (traceback above)")
        print(f"-- {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"gemm_dev_{'_'.join(sections)}.jsonl").write_text("\n".join(json.dumps(r, default=str) for r in ROWS) + "\n")


if __name__ == "__main__":
    main()
