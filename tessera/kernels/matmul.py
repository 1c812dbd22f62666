"""`matmul`: the tuned tensor-core GEMM on torch CUDA tensors.

The schedule space is hardware-centric (Hidet): a fixed list of block/warp tiles, k-depths,
pipeline stages and split-k factors that suit an SM90 GPU, pruned only where a shape makes a
candidate pointless (a 256-row tile for M = 16, split-k when there are already several waves
of tiles).  Every surviving candidate is compiled in parallel, timed once on the device, and
the winner is cached per (dtype, layout, shape, GPU) by tessera.tune.
"""

from __future__ import annotations

import functools
from typing import Any

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.kernels.gemm import GemmConfig, make_gemm, make_split_k_reduce
from tessera.kernels.gemm_sm90 import WgmmaConfig, make_gemm_wgmma
from tessera.tune import tune

SMS = 132  # H100/H200; only used to prune split-k and to size waves
# (block_m, block_n, warp_m, warp_n): 4 or 8 warps, warp tiles from 16x32 to 64x64.
TILES = [
    (256, 128, 64, 64), (128, 256, 64, 64), (128, 128, 64, 64), (128, 128, 32, 64), (128, 128, 64, 32),
    (128, 64, 64, 32), (64, 128, 32, 64), (64, 64, 32, 32), (64, 256, 32, 64), (32, 128, 32, 32),
    (32, 256, 32, 64), (16, 128, 16, 32), (16, 256, 16, 64), (16, 64, 16, 16),
]  # fmt: skip
BLOCK_KS = (32, 64)
STAGES = (3, 4, 5)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


WGMMA_TILES = [(128, 256), (128, 128), (64, 256), (64, 128), (128, 64), (64, 64)]


def _splits(tiles: int, k_tiles: int) -> list[int]:
    return [s for s in SPLITS if s == 1 or (tiles * s <= 4 * SMS and k_tiles >= 2 * s and tiles < SMS)]


def schedule_space(m: int, n: int, k: int, batch: int = 1, b_layout: str = "kn", wgmma: bool = False) -> list[Any]:
    """The candidates worth timing for one problem shape.

    With `wgmma` (an SM90 GPU, 16-byte aligned rows and b_layout "nk") the warpgroup GEMM's
    tiles join the mma.sync ones."""
    out: list[Any] = []
    if wgmma and b_layout == "nk":
        for bm, bn in WGMMA_TILES:
            if bm > max(64, 1 << (max(m, 1) - 1).bit_length()):
                continue
            for stages in STAGES:
                for split in _splits(-(-m // bm) * -(-n // bn) * batch, -(-k // 64)):
                    cfg = WgmmaConfig(bm, bn, stages, split)
                    if not cfg.problems():
                        out.append(cfg)
    m_cap = max(16, 1 << (max(m, 1) - 1).bit_length())  # smallest power of two >= m
    for bm, bn, wm, wn in TILES:
        if bm > m_cap:
            continue
        tiles = -(-m // bm) * -(-n // bn) * batch
        for bk in BLOCK_KS:
            k_tiles = -(-k // bk)
            for stages in STAGES:
                for split in _splits(tiles, k_tiles):
                    cfg = GemmConfig(bm, bn, bk, wm, wn, stages, split)
                    if not cfg.problems():
                        out.append(cfg)
    return out


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - the GPU machine has torch
        raise UnsupportedError("tessera.kernels.matmul works on torch CUDA tensors; install torch") from None
    return torch


_TORCH_DTYPES = {"float16": dtypes.float16, "bfloat16": dtypes.bfloat16}


def _check(a: Any, b: Any, b_layout: str) -> tuple[Any, int, int, int, int]:
    torch = _torch()
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise ArgumentError("matmul takes torch tensors")
    if not (a.is_cuda and b.is_cuda) or a.device != b.device:
        raise ArgumentError(f"matmul needs both operands on one CUDA device, got {a.device} and {b.device}")
    name = str(a.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES or a.dtype != b.dtype:
        raise UnsupportedError(f"matmul takes float16 or bfloat16 operands of one dtype, got {a.dtype} and {b.dtype}")
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ArgumentError(f"matmul takes two 2-D or two 3-D (batched) tensors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2:]
    kb, n = b.shape[-2:] if b_layout == "kn" else (b.shape[-1], b.shape[-2])
    if kb != k or (a.dim() == 3 and b.shape[0] != batch):
        raise ArgumentError(f"matmul shapes do not match: A {tuple(a.shape)}, B {tuple(b.shape)} (b_layout={b_layout!r})")
    if min(m, n, k, batch) == 0:
        raise ArgumentError(f"matmul of empty tensors: A {tuple(a.shape)}, B {tuple(b.shape)}")
    return _TORCH_DTYPES[name], batch, m, n, k


def _vector_ok(a: Any, b: Any, n: int, k: int, b_layout: str) -> bool:
    """cp.async moves 16-byte chunks: rows must start 16-byte aligned."""
    row_b = n if b_layout == "kn" else k
    return k % 8 == 0 and row_b % 8 == 0 and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0


@functools.cache
def make_kernel(dtype: Any, cfg: Any, layout: str, vector: bool) -> Any:
    """The compiled-on-demand kernel of one candidate (mma.sync or wgmma)."""
    if isinstance(cfg, WgmmaConfig):
        return make_gemm_wgmma(dtype, cfg, vector)
    return make_gemm(dtype, cfg, layout, vector)


def _run(cfg: Any, dtype: Any, layout: str, vector: bool, a3: Any, b3: Any, c3: Any) -> None:
    torch = _torch()
    kernel = make_kernel(dtype, cfg, layout, vector)
    if cfg.split_k == 1:
        kernel(a3, b3, c3, 1)
        return
    batch, m, n = c3.shape
    work = torch.empty((batch * cfg.split_k, m, n), dtype=torch.float32, device=c3.device)
    kernel(a3, b3, work, cfg.split_k)
    make_split_k_reduce(dtype, cfg.split_k)(work, c3)


_FLUSH: list[Any] = []  # a buffer larger than L2, allocated on first tuning


def _bench(run: Any) -> float:
    """Median of 5 timed runs, each after flushing L2 as the benchmark protocol does."""
    torch = _torch()
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        _FLUSH[0].zero_()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def choose_config(a: Any, b: Any, b_layout: str = "kn") -> Any:
    """The tuned configuration for these operands' shape (tunes on first use, then cached)."""
    dtype, batch, m, n, k = _check(a, b, b_layout)
    return _tuned(a, b, b_layout, dtype, batch, m, n, k, _vector_ok(a, b, n, k, b_layout))


def _tuned(a: Any, b: Any, layout: str, dtype: Any, batch: int, m: int, n: int, k: int, vector: bool) -> Any:
    torch = _torch()
    gpu = torch.cuda.get_device_name(a.device)
    key = f"gemm|{dtype}|{layout}|{'vec' if vector else 'scalar'}|b{batch}|m{m}|n{n}|k{k}|{gpu}"
    a3, b3 = a.reshape(batch, *a.shape[-2:]), b.reshape(batch, *b.shape[-2:])
    c3 = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    wgmma = vector and layout == "nk" and torch.cuda.get_device_capability(a.device) == (9, 0)
    candidates = schedule_space(m, n, k, batch, layout, wgmma)
    record = tune(
        key,
        candidates,
        build=lambda cfg: make_kernel(dtype, cfg, layout, vector).compile(),
        bench=lambda cfg, _: _bench(lambda: _run(cfg, dtype, layout, vector, a3, b3, c3)),
    )
    return record.best


def matmul(a: Any, b: Any, *, b_layout: str = "kn", config: GemmConfig | WgmmaConfig | None = None) -> Any:
    """A @ B on tensor cores for float16/bfloat16 torch CUDA tensors, float32 accumulation.

    `a` is [M, K] or [batch, M, K]; `b` is [K, N] (b_layout="kn") or [N, K] ("nk", as a
    linear layer's weight), with the same batch.  Without `config` the schedule is tuned for
    this shape on first use and cached.  Returns a new tensor of a's dtype.
    """
    if b_layout not in ("kn", "nk"):
        raise ArgumentError(f"b_layout must be 'kn' or 'nk', got {b_layout!r}")
    dtype, batch, m, n, k = _check(a, b, b_layout)
    a, b = a.contiguous(), b.contiguous()
    vector = _vector_ok(a, b, n, k, b_layout)
    cfg = config or _tuned(a, b, b_layout, dtype, batch, m, n, k, vector)
    if isinstance(cfg, WgmmaConfig) and (b_layout != "nk" or not vector):
        raise UnsupportedError(f"{cfg} needs b_layout='nk' and 16-byte aligned rows (K % 8 == 0)")
    torch = _torch()
    c3 = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    _run(cfg, dtype, b_layout, vector, a.reshape(batch, m, k), b.reshape(batch, *b.shape[-2:]), c3)
    return c3 if a.dim() == 3 else c3.reshape(m, n)
