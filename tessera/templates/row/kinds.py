"""Row reductions, softmax, LayerNorm and RMSNorm on torch CUDA tensors: pick a kernel and launch it.

Each op works over the last axis of x (any leading shape), allocates its output and chooses:

* the load width: 16-byte vector loads when every row starts 16-byte aligned (x, weight,
  bias and output pointers aligned, C % (16 / itemsize) == 0), else element loads;
* the schedule, from the number of loads per row (`choose_schedule`): short rows share a
  block (up to 32 lanes per row, warp shuffles); longer rows get a block each, sized for about
  `TARGET_LOADS` loads per thread, with the row cached in registers while it fits in
  `MAX_CACHED_ELEMS` elements per thread; longer rows still stream (softmax and the norms
  then read x twice).  Softmax on 16-bit rows caches the row as loaded instead (`RAW_LOADS`
  16-byte loads per thread), which fits rows up to 32768 elements in blocks of C / 64 threads.

Rows are launched in chunks that keep every element index below 2**31 (the kernels index
with int32).
"""

from __future__ import annotations

import functools
from math import prod
from typing import TYPE_CHECKING, Any

import tessera as ts
from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.templates.row.norm import make_layernorm, make_rmsnorm
from tessera.templates.row.reduce import make_row_reduce, make_softmax
from tessera.templates.row.schedule import REDUCTIONS, VECTOR_BYTES, WARP, RowSchedule

if TYPE_CHECKING:
    import torch

# Loads each thread issues per step: enough bytes in flight per SM to cover DRAM latency
# (4 x 16 B vector loads), more for element loads, which move 2 or 4 bytes each.
TARGET_LOADS = {True: 4, False: 8}
# A cached row keeps this many float32 values per thread in registers at most (beyond, the
# register file limits occupancy more than the second read of x costs).
MAX_CACHED_ELEMS = 32
# Softmax caches fewer: its exp and conversions keep the SFU pipe busy, so it needs more warps
# per SM to overlap them with memory (measured on the H200: 4096 x 16384 fp16 caching 32 values
# per thread took 103 us, streaming 78 us; 16384 x 4096, 16 values per thread: 76 us vs 79 us).
SOFTMAX_CACHED_ELEMS = 16
# Softmax on 16-bit rows with 16-byte loads caches the row as loaded (RowSchedule.raw): 8 loads
# (128 bytes) per thread, so blocks stay small (a block of C / 64 threads per row) and many fit
# on an SM.  Measured on the H200 (2026-11-22, L2 flushed by reads), fp16, % of copy bandwidth:
# 8192 x 8192 t128 p8 raw 94.5% (float32 cache t512 p2: 79.9%), 16384 x 4096 t64 p8 raw 95.5%
# (t256 p2: 88.3%), 4096 x 16384 t256 p8 raw 93.9% (streaming t512 p4: 81.9%); larger blocks
# for the same rows lose (t512 p4 raw 90.9%, t1024 p2 raw 64%).
RAW_LOADS = 8
RAW_MIN_THREADS = 64  # a 32-thread block per row would cap an SM at 32 blocks (1024 threads)
# Cached rows use at most 512 threads per block: at 1024, __launch_bounds__ caps a thread at
# 64 registers and the cached LayerNorm spills.
MAX_CACHED_THREADS = 512
SHORT_ROW_THREADS = 128  # block size of the several-rows-per-block schedule
STREAM_THREADS = 512
INT32_LIMIT = 2**31 - 1
_ROW_DTYPES = (dtypes.float16, dtypes.bfloat16, dtypes.float32)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_schedule(C: int, itemsize: int, vector: bool, cached: bool = True,
                    max_cached_elems: int = MAX_CACHED_ELEMS, raw: bool = False) -> RowSchedule:  # fmt: skip
    """The schedule for rows of C elements of `itemsize` bytes.

    `vector`: rows are 16-byte aligned (16-byte loads).  `cached`: the op benefits from
    keeping the row in registers (softmax and the norms); plain reductions pass False.
    `max_cached_elems`: the most values a thread may cache (the block grows to respect it,
    up to MAX_CACHED_THREADS; beyond, the row streams).  `raw` (softmax, with `cached` and
    `vector`): rows longer than the short-row limit are cached as loaded, RAW_LOADS vector
    loads per thread (`max_cached_elems` then does not apply).
    """
    vec = VECTOR_BYTES // itemsize if vector else 1
    loads = -(-C // vec)
    target = TARGET_LOADS[vector]
    if loads <= WARP * target:  # short rows: several rows per block, at most a warp per row
        lanes = min(WARP, _next_pow2(-(-loads // target)))
        return RowSchedule(SHORT_ROW_THREADS, lanes, vec, -(-loads // lanes), cached)
    if cached and raw and vector:
        threads = max(RAW_MIN_THREADS, _next_pow2(-(-loads // RAW_LOADS)))
        if threads <= MAX_CACHED_THREADS:
            return RowSchedule(threads, threads, vec, -(-loads // threads), True, True)
    if cached:
        threads = max(_next_pow2(-(-loads // target)), _next_pow2(-(-loads * vec // max_cached_elems)))
        threads = min(threads, MAX_CACHED_THREADS)
        per_thread = -(-loads // threads)
        if per_thread * vec <= max_cached_elems:
            return RowSchedule(threads, threads, vec, per_thread, True)
    threads = min(STREAM_THREADS, _next_pow2(-(-loads // target)))
    return RowSchedule(threads, threads, vec, min(target, -(-loads // threads)), False)


def _torch() -> Any:
    import torch

    return torch


@functools.cache
def kernel_for(op: str, dtype_name: str, C: int, vector: bool) -> ts.Kernel:
    """The kernel (and schedule) the dispatch functions use; memoised, so a call costs one lookup.

    op: sum, mean, max, min, softmax, layernorm or rmsnorm; dtype_name as in str(torch dtype).
    """
    sdt = dtypes.from_torch(dtype_name)
    if sdt not in _ROW_DTYPES:
        raise UnsupportedError(f"row kernels take float16, bfloat16 or float32 tensors, not {dtype_name}")
    if op in REDUCTIONS:
        return make_row_reduce(op, sdt, choose_schedule(C, sdt.nbytes, vector, cached=False))
    if op == "softmax":
        raw = sdt.nbytes == 2  # float32 rows gain nothing from it (same registers, twice the exps)
        return make_softmax(sdt, choose_schedule(C, sdt.nbytes, vector, True, SOFTMAX_CACHED_ELEMS, raw))
    make = {"layernorm": make_layernorm, "rmsnorm": make_rmsnorm}[op]
    return make(sdt, choose_schedule(C, sdt.nbytes, vector))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous [R, C] tensor (a view when x is contiguous)."""
    if not x.is_cuda:
        raise UnsupportedError("row kernels run on CUDA tensors; move x to the GPU first")
    if x.dim() == 2 and x.is_contiguous():
        return x
    if x.dim() == 0:
        raise ValueError("row kernels reduce over the last axis; x has no axes")
    return x.contiguous().view(prod(x.shape[:-1]), x.shape[-1])


def _param(p: torch.Tensor, x: torch.Tensor, name: str) -> torch.Tensor:
    if p.shape != x.shape[-1:]:
        raise ValueError(f"{name} must have shape ({x.shape[-1]},), got {tuple(p.shape)}")
    if p.dtype == x.dtype and p.device == x.device and p.is_contiguous():
        return p
    return p.to(device=x.device, dtype=x.dtype).contiguous()


def _vector_ok(x2: torch.Tensor, *others: torch.Tensor) -> bool:
    """Every row (and every other operand) starts on a 16-byte boundary."""
    return (x2.shape[1] * x2.element_size()) % VECTOR_BYTES == 0 and all(
        t.data_ptr() % VECTOR_BYTES == 0 for t in (x2, *others)
    )


def _launch(op: str, x2: torch.Tensor, params: tuple, y2: torch.Tensor, scalars: tuple = ()) -> None:
    """kernel(x rows, *params, y rows, *scalars), in row chunks of fewer than 2**31 elements."""
    R, C = x2.shape
    kernel = kernel_for(op, str(x2.dtype), C, _vector_ok(x2, y2, *params))
    if R * C <= INT32_LIMIT:  # the usual case: one launch, no slicing
        kernel(x2, *params, y2, *scalars)
        return
    chunk = max(1, INT32_LIMIT // C)
    for r0 in range(0, R, chunk):
        kernel(x2[r0 : r0 + chunk], *params, y2[r0 : r0 + chunk], *scalars)


def _check_dtype(x: torch.Tensor) -> None:
    if dtypes.from_torch(x.dtype) not in _ROW_DTYPES:
        raise UnsupportedError(f"row kernels take float16, bfloat16 or float32 tensors, not {x.dtype}")


def row_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    """op(x) over the last axis for op in sum, mean, max, min; float32 accumulation, x's dtype out."""
    torch = _torch()
    if op not in REDUCTIONS:
        raise ValueError(f"unknown reduction {op!r}; choose one of {REDUCTIONS}")
    _check_dtype(x)
    x2 = _rows(x)
    R, C = x2.shape
    if R == 0 or C == 0:  # empty rows follow torch (sum 0, mean nan, max/min raise)
        fn = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[op]
        return fn(x, dim=-1)
    y = torch.empty(R, device=x.device, dtype=x.dtype)
    _launch(op, x2, (), y)
    return y if x.dim() == 2 else y.view(x.shape[:-1])


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax(x) over the last axis, computed in float32, x's dtype out."""
    torch = _torch()
    _check_dtype(x)
    x2 = _rows(x)
    y = torch.empty_like(x2)
    if y.numel():
        _launch("softmax", x2, (), y)
    return y if y.shape == x.shape else y.view(x.shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased variance)."""
    torch = _torch()
    _check_dtype(x)
    x2 = _rows(x)
    w, b = _param(weight, x, "weight"), _param(bias, x, "bias")
    y = torch.empty_like(x2)
    if y.numel():
        _launch("layernorm", x2, (w, b), y, (float(eps),))
    return y if y.shape == x.shape else y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    torch = _torch()
    _check_dtype(x)
    x2 = _rows(x)
    w = _param(weight, x, "weight")
    y = torch.empty_like(x2)
    if y.numel():
        _launch("rmsnorm", x2, (w,), y, (float(eps),))
    return y if y.shape == x.shape else y.view(x.shape)
