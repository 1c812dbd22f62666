"""`flash_attention`: the SM90 flash-attention kernels on torch CUDA tensors, called eagerly.

The launch plan of one signature (shapes, dtype, causal, mask kind, config) is resolved once
(tessera.templates.attention.launch.FlashPlan): the kernels are compiled and bound, the split-KV
workspaces allocated; later calls only encode the tensor maps of new addresses (cached) and launch.
"""

from __future__ import annotations

import math
from typing import Any

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.runtime.cuda import ensure_current, multiprocessor_count, torch_stream
from tessera.templates.attention.flash import FlashConfig, check_problem
from tessera.templates.attention.launch import (
    MAX_SPLITS,
    AttentionShape,
    FlashPlan,
    choose_config,
    choose_splits,
    mask_spec,
)


def _torch() -> Any:
    try:
        import torch  # optional: torch
    except ImportError:  # pragma: no cover
        raise UnsupportedError("flash_attention works on torch CUDA tensors; install torch") from None
    return torch


_PLANS: dict[tuple, FlashPlan] = {}
_ATTENTION_DTYPES = (dtypes.float16, dtypes.bfloat16)


def flash_attention(q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None, mask: Any = None,
                    config: FlashConfig | None = None, splits: int | None = None, out: Any = None) -> Any:  # fmt: skip
    """softmax(q @ k^T * scale [causal] [+ mask]) @ v on SM90 tensor cores, for torch CUDA tensors.

    q [B, H, Sq, D], k and v [B, Hk, Sk, D] (H a multiple of Hk: grouped / multi-query heads),
    float16 or bfloat16, D in 64, 80, 96, 128.  `causal` is top-left aligned (torch's
    is_causal); `mask` is a bool (keep True) or float (added) tensor broadcasting to
    [B, H, Sq, Sk], combinable with causal; `scale` defaults to D ** -0.5.  `splits` forces the
    number of KV splits (default: chosen from the SM count).  Returns `out` (a contiguous
    [B, H, Sq, D] tensor of q's dtype) or a new tensor.  Non-contiguous operands are copied."""
    torch = _torch()
    fast = _FAST.get(_fast_key(torch, q, k, v, causal, scale, mask, config, splits)) if out is None else None
    if fast is not None:  # a signature seen before with contiguous operands: straight to the launch
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        fast(q, k, v, mask, out, torch_stream(q))
        return out
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise ArgumentError(f"flash_attention: {name} must be a torch CUDA tensor")
        if t.ndim != 4:
            raise ArgumentError(f"flash_attention: {name} must be [B, heads, S, D], got shape {list(t.shape)}")
    dtype = dtypes.from_torch(q.dtype)
    if not (q.dtype == k.dtype == v.dtype) or dtype not in _ATTENTION_DTYPES:
        raise UnsupportedError(f"flash_attention takes float16 or bfloat16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, h, sq, d = q.shape
    bk, hk, sk, dk = k.shape
    if bk != b or dk != d or tuple(v.shape) != (b, hk, sk, d):
        raise ArgumentError(f"flash_attention: shapes do not match: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                            "(k and v [B, Hk, Sk, D] with q's B and D)")  # fmt: skip
    if h % hk:
        raise ArgumentError(f"flash_attention: {h} query heads are not a multiple of {hk} key/value heads")
    if min(b, h, sq, sk) == 0:
        raise ArgumentError("flash_attention: empty operands")
    shape = AttentionShape(b, h, hk, sq, sk, d)
    spec = None
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.device != q.device:
            raise ArgumentError("flash_attention: mask must be a torch tensor on q's device")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise ArgumentError(f"flash_attention: the mask must be bool (keep True) or floating point (added), not {mask.dtype}")
        spec = mask_spec(tuple(mask.shape), str(mask.dtype).removeprefix("torch."), (b, h, sq, sk))
        mask = mask.contiguous()
    scale_arg, splits_arg = scale, splits
    if config is None or splits is None:
        sms = multiprocessor_count()
    cfg = config or choose_config(shape, sms)
    check_problem(dtype, d, cfg, spec)
    if splits is None:
        splits = choose_splits(shape, cfg, sms, causal)
    if not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
        raise ArgumentError(f"flash_attention: splits must be an int in 1..{MAX_SPLITS}, got {splits!r}")
    scale = d**-0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ArgumentError(f"flash_attention: scale must be finite, got {scale}")
    key = (shape, dtype, bool(causal), scale, spec, cfg, splits, q.device)
    plan = _PLANS.get(key)
    if plan is None:
        ensure_current()
        plan = _PLANS[key] = FlashPlan(shape, dtype, bool(causal), scale, spec, cfg, splits, q.device)
    fkey = _fast_key(torch, q, k, v, causal, scale_arg, mask, config, splits_arg)
    if fkey is not None and len(_FAST) < 256:
        _FAST[fkey] = plan
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if out is None:
        out = torch.empty((b, h, sq, d), dtype=q.dtype, device=q.device)
    elif not (isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
              and out.device == q.device and out.is_contiguous()):  # fmt: skip
        raise ArgumentError(f"flash_attention: out must be a contiguous {q.dtype} tensor of shape {list(q.shape)} on q's device")
    plan(q, k, v, mask, out, torch_stream(q))
    return out


def _fast_key(torch: Any, q: Any, k: Any, v: Any, causal: Any, scale: Any, mask: Any, config: Any, splits: Any) -> Any:
    """The key of a call whose operands need no checking beyond their signature (plain
    contiguous CUDA tensors), or None."""
    ts = (q, k, v) if mask is None else (q, k, v, mask)
    if not all(type(t) is torch.Tensor and t.is_contiguous() for t in ts) or not q.is_cuda:
        return None
    sig = tuple((t.shape, t.dtype, t.device) for t in ts)
    return (sig, causal, scale, config, splits)


_FAST: dict[Any, FlashPlan] = {}
