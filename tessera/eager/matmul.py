"""`matmul`: the tuned tensor-core GEMM on torch CUDA tensors, called eagerly.

The schedule space is hardware-centric (Hidet): a fixed list of block/warp tiles, k-depths,
pipeline stages and split-k factors that suit an SM90 GPU (tessera.templates.gemm.space).
Every candidate is compiled in parallel, checked once against torch.matmul, timed on the
device, and the winner cached per (dtype, layout, shape, GPU, template source) by tessera.tune.
"""

from __future__ import annotations

from typing import Any

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.templates.gemm.config import GemmLaunch, config_for_shape
from tessera.templates.gemm.mma import GemmConfig
from tessera.templates.gemm.tma import TmaConfig
from tessera.templates.gemm.wgmma import WgmmaConfig


def _torch() -> Any:
    try:
        import torch  # optional: torch
    except ImportError:  # pragma: no cover - the GPU machine has torch
        raise UnsupportedError("tessera.eager.matmul works on torch CUDA tensors; install torch") from None
    return torch


_MATMUL_DTYPES = (dtypes.float16, dtypes.bfloat16)


def _check(a: Any, b: Any, b_layout: str) -> tuple[Any, int, int, int, int]:
    torch = _torch()
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise ArgumentError("matmul takes torch tensors")
    if not (a.is_cuda and b.is_cuda) or a.device != b.device:
        raise ArgumentError(f"matmul needs both operands on one CUDA device, got {a.device} and {b.device}")
    dtype = dtypes.from_torch(a.dtype)
    if dtype not in _MATMUL_DTYPES or a.dtype != b.dtype:
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
    return dtype, batch, m, n, k


def _vector_ok(a: Any, b: Any, n: int, k: int, b_layout: str) -> bool:
    """cp.async moves 16-byte chunks: rows must start 16-byte aligned."""
    row_b = n if b_layout == "kn" else k
    return k % 8 == 0 and row_b % 8 == 0 and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0


def choose_config(a: Any, b: Any, b_layout: str = "kn") -> Any:
    """The tuned configuration for these operands' shape (tunes on first use, then cached):
    `config_for_shape` on the operands' shape, dtype and alignment."""
    dtype, batch, m, n, k = _check(a, b, b_layout)
    return config_for_shape(dtype, b_layout, batch, m, n, k, _vector_ok(a, b, n, k, b_layout), tune=True)


_PLANS: dict[tuple, GemmLaunch] = {}


def matmul(a: Any, b: Any, *, b_layout: str = "kn", config: GemmConfig | WgmmaConfig | TmaConfig | None = None) -> Any:
    """A @ B on tensor cores for float16/bfloat16 torch CUDA tensors, float32 accumulation.

    `a` is [M, K] or [batch, M, K]; `b` is [K, N] (b_layout="kn") or [N, K] ("nk", as a
    linear layer's weight), with the same batch.  Without `config` the schedule is tuned for
    this shape on first use and cached.  Returns a new tensor of a's dtype.

    The first call with a signature (shapes, dtypes, devices, layout, config) checks the
    operands and resolves the kernel; later calls with contiguous, 16-byte aligned operands of
    that signature go straight to the launches (a few µs of host time).
    """
    torch = _torch()
    key = None
    if type(a) is torch.Tensor and type(b) is torch.Tensor:
        key = (b_layout, config, a.dtype, b.dtype, a.get_device(), b.get_device(), a.shape, b.shape)
        plan = _PLANS.get(key)
        if plan is not None and a.is_contiguous() and b.is_contiguous():
            if not plan.vector or not (a.data_ptr() | b.data_ptr()) & 15:
                return plan(a, b)
    if b_layout not in ("kn", "nk"):
        raise ArgumentError(f"b_layout must be 'kn' or 'nk', got {b_layout!r}")
    dtype, batch, m, n, k = _check(a, b, b_layout)
    a, b = a.contiguous(), b.contiguous()
    vector = _vector_ok(a, b, n, k, b_layout)
    cfg = config or choose_config(a, b, b_layout)
    if isinstance(cfg, WgmmaConfig) and (b_layout != "nk" or not vector):
        raise UnsupportedError(f"{cfg} needs b_layout='nk' and 16-byte aligned rows (K % 8 == 0)")
    if isinstance(cfg, TmaConfig) and not vector:
        raise UnsupportedError(f"{cfg} needs 16-byte aligned rows and operands (K and, for 'kn', N multiples of 8)")
    c3 = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    a3, b3 = a.reshape(batch, m, k), b.reshape(batch, *b.shape[-2:])
    plan = GemmLaunch(cfg, dtype, b_layout, vector, a3, b3, c3, a.dim() == 3)
    if key is not None:
        if len(_PLANS) >= 1024:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan(a, b)
