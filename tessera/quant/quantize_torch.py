"""Round-to-nearest quantisation of a torch weight where it lies (on the GPU for a model there):
`quantize_weight`'s arithmetic step for step in float64 torch ops, so the codes, scales and
zero points are the same bits (tests/test_lowbit_quant.py compares them).  numpy's
`quantize_weight` stays the reference; this is its fast path for integer types -- on one CPU
core numpy takes ~40 s for the 1.1B Llama's linears.

Two steps stay in numpy on purpose: the float64 -> float16 rounding of the scales (torch casts
double to half through float, which can round twice; the [N, G] scales are small) and the dense
bit packing of the codes (`PackedTensor.from_codes`).
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.errors import ArgumentError
from tessera.ir.dtypes import DataType
from tessera.quant import codecs
from tessera.quant.packed import PackedTensor
from tessera.quant.quantize import QuantizedWeight, _int_zero_free, check_arguments, quantize_weight


def _scales16(s: torch.Tensor) -> np.ndarray:
    """float64 scales -> float16 as quantize_weight rounds them (never a needed scale to 0)."""
    s64 = s.cpu().numpy()
    with np.errstate(over="ignore"):  # an overflow is the error below
        s16 = s64.astype(np.float16)
    s16 = np.where((s16 == 0) & (s64 > 0), np.float16(2.0**-24), s16)
    if not np.all(np.isfinite(s16)):
        raise ArgumentError("a group's scale overflows float16 (|w| too large for this type); rescale the weights")
    return s16


def quantize_weight_torch(w: torch.Tensor, dtype: DataType | str, group_size: int | None = 128,
                          zero_point: bool | None = None) -> QuantizedWeight:  # fmt: skip
    """quantize_weight(w, dtype, group_size, zero_point) computed on w's device.  Small-float
    types go to the numpy reference (their encoding searches a table)."""
    t = codecs.weight_type(dtype)
    if t.is_float:
        return quantize_weight(w.detach().float().cpu().numpy(), t, group_size, zero_point)
    n, k, gs, zero_point = check_arguments(tuple(w.shape), t, group_size, zero_point)
    w = w.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()):
        raise ArgumentError("the weights contain inf or NaN; they cannot be quantized")
    g = -(-k // gs)
    pad = w if g * gs == k else torch.cat([w, w[:, -1:].expand(n, g * gs - k)], dim=1)  # edge padding
    groups = pad.reshape(n, g, gs)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)
    qmin, qmax = t.min_value, t.max_value
    if zero_point:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        s = (hi - lo) / (qmax - qmin)
        zeros = torch.clamp(qmin - torch.round(lo / torch.where(s > 0, s, 1.0)), qmin, qmax)
    else:
        z = _int_zero_free(t)
        up, down = qmax - z, z - qmin
        s = torch.maximum(lo.abs(), hi.abs()) / (min(up, down) or max(up, down))
        zeros = torch.full_like(s, float(z))
    s16 = _scales16(s)
    scale = torch.from_numpy(s16.astype(np.float64)).to(w.device)
    x = groups / torch.where(scale > 0, scale, 1.0)[:, :, None]
    q = torch.clamp(torch.round(x) + zeros[:, :, None], qmin, qmax).to(torch.int64)
    codes = (q & ((1 << t.nbits) - 1)).to(torch.uint8).reshape(n, g * gs)[:, :k].cpu().numpy()
    zeros_out = zeros.to(torch.int32).cpu().numpy() if zero_point or t.kind == "uint" else None
    return QuantizedWeight(PackedTensor.from_codes(codes, t), s16, zeros_out, gs)
