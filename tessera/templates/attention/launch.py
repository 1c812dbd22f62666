"""The SM90 flash-attention kernels' launch plans (tessera.eager.attention calls them eagerly).

The launch plan of one signature (shapes, dtype, causal, mask kind, config) is resolved once:
the kernels are compiled and bound, the split-KV workspaces allocated; later calls only
encode the tensor maps of new addresses (cached) and launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir.types import tensor_map
from tessera.runtime.tensor_map import TensorMap
from tessera.templates.attention.flash import (
    LOG2E,
    FlashConfig,
    MaskSpec,
    make_attention_combine,
    make_flash_attention,
    tensor_map_box,
)

MAX_SPLITS = 64


@dataclass(frozen=True)
class AttentionShape:
    """One attention problem: q [b, h, sq, d], k and v [b, hk, sk, d]."""

    b: int
    h: int
    hk: int
    sq: int
    sk: int
    d: int

    @property
    def rows(self) -> int:
        """Packed rows per (batch, kv head): the group's query heads times sq."""
        return self.h // self.hk * self.sq

    @property
    def problems(self) -> int:
        return self.b * self.hk


def choose_config(shape: AttentionShape, sms: int | None = None) -> FlashConfig:
    """Two consumer warpgroups (128 rows) when there are rows for them, else one (64 rows:
    decode); 128-key blocks, two stages (three for head dim 64 and for decode, where loads
    dominate).

    With the SM count given, short sequences (all keys in one block, so there is no next block
    whose loads and matmuls the two warpgroups could overlap) take 64-row tiles too when
    128-row tiles would leave more than half of the SMs idle: twice the thread blocks, each
    half as long (GPT-2 / BERT at 128 tokens: 24 blocks instead of 12)."""
    consumers = 2 if shape.rows > 64 else 1
    if consumers == 2 and sms is not None and shape.sk <= 128 and -(-shape.rows // 128) * shape.problems < sms / 2:
        consumers = 1
    stages = 3 if shape.d <= 64 or consumers == 1 else 2
    cfg = FlashConfig(consumers, 128, stages)
    return cfg if not cfg.problems(shape.d) else FlashConfig(consumers, 128, 2)


def choose_splits(shape: AttentionShape, config: FlashConfig, sms: int, causal: bool = False) -> int:
    """KV splits: the count that minimises waves x key blocks per split (one thread block per
    SM: the kernels use most of its shared memory), the fewest on ties.  Row tiles that fill
    the machine give 1; a decode step over a long cache gives many."""
    tiles = -(-shape.rows // config.block_m) * shape.problems
    blocks = -(-shape.sk // config.block_n)
    if causal:
        blocks = min(blocks, -(-shape.sq // config.block_n))
    if tiles >= 0.8 * sms:
        return 1
    best, best_cost = 1, None
    for splits in range(1, min(blocks, MAX_SPLITS) + 1):
        per = -(-blocks // splits)
        if -(-blocks // per) != splits:  # some split would be empty
            continue
        cost = -(-tiles * splits // sms) * per
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover
        raise UnsupportedError("tessera.templates.attention.launch works on torch CUDA tensors; install torch") from None
    return torch


def mask_spec(mask_shape: tuple[int, ...], mask_dtype: Any, full: tuple[int, int, int, int]) -> MaskSpec:
    """The MaskSpec of a mask of `mask_shape` broadcasting to `full` = (B, H, Sq, Sk)."""
    if not 1 <= len(mask_shape) <= 4:
        raise ArgumentError(f"attention: the mask must have rank 1..4, got shape {list(mask_shape)}")
    tail = full[4 - len(mask_shape):]
    if any(m not in (1, f) for m, f in zip(mask_shape, tail)):
        raise ArgumentError(f"attention: mask shape {list(mask_shape)} does not broadcast to [B, H, Sq, Sk] = {list(full)}")
    return MaskSpec(dtypes.dtype(mask_dtype), tuple(m == f for m, f in zip(mask_shape, tail)))


def kernels_for(shape: AttentionShape, dtype: Any, causal: bool, mask: MaskSpec | None, config: FlashConfig,
                splits: int, scale: float = 1.0, heads_last: bool = False) -> list[Any]:  # fmt: skip
    """The tessera kernels one call runs: the flash kernel, and the combine when split (the one
    that writes O, [B, Sq, H, D] when heads_last).  The scale is folded into the exponent when
    it is positive and no float mask is added."""
    fold = scale > 0 and (mask is None or mask.dtype == dtypes.boolean)
    split = splits > 1
    out = [make_flash_attention(dtype, shape.d, config, causal=causal, mask=mask, partial=split, fold_scale=fold,
                                heads_last=heads_last and not split)]  # fmt: skip
    return out + [make_attention_combine(dtype, shape.d, heads_last)] if split else out


def launch_arguments(shape: AttentionShape, dtype: Any, scale: float, mask: MaskSpec | None, splits: int,
                     device: Any, maps: Sequence[Any], heads_last: bool = False) -> tuple[tuple, tuple | None, dict[str, Any]]:  # fmt: skip
    """Arguments of the flash kernel and of the combine (None unless split) for a signature,
    over placeholder tensors on `device`, and the buffers a plan keeps ("o_part", "lse",
    "dummy"); `maps` are the three tensor maps (q, k, v)."""
    torch = _torch()
    s = shape
    tdt = getattr(torch, dtypes.torch_name(dtype))
    q = torch.empty((s.b, s.h, s.sq, s.d), dtype=tdt, device=device)
    o = torch.empty((s.b, s.sq, s.h, s.d) if heads_last else (s.b, s.h, s.sq, s.d), dtype=tdt, device=device)
    kv = torch.empty((s.b, s.hk, s.sk, s.d), dtype=tdt, device=device)
    keep: dict[str, Any] = {"dummy": torch.zeros(1, dtype=torch.bool, device=device)}
    if mask is not None:
        mshape = tuple(f if full else 1 for f, full in zip((s.b, s.h, s.sq, s.sk)[4 - mask.rank:], mask.full))
        m = torch.empty(mshape, dtype=getattr(torch, dtypes.torch_name(mask.dtype)), device=device)
    else:
        m = keep["dummy"]
    scale_log2 = float(scale) * LOG2E
    if splits == 1:
        keep["lse"] = torch.zeros(1, dtype=torch.float32, device=device)
        return (q, kv, kv, m, o, keep["lse"], *maps, scale_log2, 1), None, keep
    keep["o_part"] = torch.empty((splits * s.problems, s.rows, s.d), dtype=torch.float32, device=device)
    keep["lse"] = torch.empty((splits * s.problems, s.rows), dtype=torch.float32, device=device)
    flash = (q, kv, kv, m, keep["o_part"], keep["lse"], *maps, scale_log2, splits)
    return flash, (keep["o_part"], keep["lse"], o, splits), keep


def operand_layout(shape: AttentionShape, which: int, row_stride: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The view the kernel's TMA map takes of operand `which` (0 q, 1 k, 2 v): dims
    [B * Hk, rows, D] (q's rows pack its group's heads: H / Hk * Sq) and their strides in
    elements, outermost first.  Contiguous [B, H, S, D] operands, or with `row_stride` W a head
    view of a [1, S, W] tensor (heads D apart, rows W apart; FlashPlan checks batch 1 and, for
    q, no grouped heads, so that the packed rows are the sequence)."""
    s = shape
    dims = (s.problems, s.rows, s.d) if which == 0 else (s.problems, s.sk, s.d)
    if row_stride is None:
        return dims, (dims[1] * dims[2], dims[2], 1)
    return dims, (s.d, row_stride, 1)


class FlashPlan:
    """The bound launches of one signature.

    `row_strides` (q, k, v; None: contiguous) reads an operand as a head view of a [1, S, W]
    tensor instead (W its row stride in elements; the call passes the address of the view's
    first element): the TMA maps step D elements from head to head and W from row to row, so
    the heads are read straight out of a fused projection's output.  Batch 1 only, and for q
    only without grouped heads (the problem index must step the heads with one stride, and
    q's packed rows must be its sequence).  `heads_last` writes O as [B, Sq, H, D]."""

    def __init__(self, shape: AttentionShape, dtype: Any, causal: bool, scale: float, mask: MaskSpec | None,
                 config: FlashConfig, splits: int, device: Any, row_strides: Sequence[int | None] = (None,) * 3,
                 heads_last: bool = False):  # fmt: skip
        s = shape
        row_strides = tuple(row_strides)
        if len(row_strides) != 3:
            raise ArgumentError(f"FlashPlan: row_strides takes one entry per q, k, v, got {row_strides}")
        if any(w is not None for w in row_strides) and (s.b != 1 or (row_strides[0] is not None and s.h != s.hk)):
            raise UnsupportedError("flash attention reads head views for batch 1 (and q's only without grouped heads)")
        if any(w is not None and (w < heads * s.d or w % 8) for w, heads in zip(row_strides, (s.h, s.hk, s.hk))):
            raise UnsupportedError(f"flash attention head views need a row stride of at least H * D elements and a "
                                   f"multiple of 8 (16 bytes), got {row_strides}")  # fmt: skip
        self.row_strides = row_strides
        self.heads_last = heads_last
        self.shape, self.dtype, self.config, self.splits = shape, dtype, config, splits
        self.boxes = (tensor_map_box(config, "q"), tensor_map_box(config, "k"))
        self.maps: list[dict[int, bytes]] = [{}, {}, {}]
        self.kernels = kernels = kernels_for(shape, dtype, causal, mask, config, splits, scale, heads_last)
        # Placeholder maps for binding (the kernel checks their type; calls pass their own bytes).
        tmaps = [TensorMap(make_map_type(dtype, self.boxes[min(i, 1)]), bytes(128)) for i in range(3)]
        flash_args, combine_args, keep = launch_arguments(shape, dtype, scale, mask, splits, device, tmaps, heads_last)
        self.dummy, self.lse, self.o_part = keep["dummy"], keep["lse"], keep.get("o_part")
        self.flash = kernels[0].compile().bind(flash_args)
        self.combine = kernels[1].compile().bind(combine_args) if combine_args is not None else None

    def _map(self, which: int, ptr: int) -> bytes:
        """Tensor map bytes of operand `which` (0 q, 1 k, 2 v) at device address `ptr` (cached)."""
        cache = self.maps[which]
        raw = cache.get(ptr)
        if raw is None:
            if len(cache) >= 32:
                cache.pop(next(iter(cache)))
            shape, strides = operand_layout(self.shape, which, self.row_strides[which])
            raw = cache[ptr] = TensorMap.from_pointer(ptr, self.dtype, shape, self.boxes[min(which, 1)], strides=strides).raw
        return raw

    def __call__(self, q: Any, k: Any, v: Any, mask: Any, out: Any, stream: int) -> None:
        mp = mask.data_ptr() if mask is not None else None
        self.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), mp, out.data_ptr(), stream)

    def launch(self, qp: int, kp: int, vp: int, mp: int | None, op: int, stream: int) -> None:
        """Run on device addresses: q, k, v (each operand's first element), the mask (None:
        none), the output."""
        mp = self.dummy.data_ptr() if mp is None else mp
        maps = (self._map(0, qp), self._map(1, kp), self._map(2, vp))
        if self.combine is None:
            self.flash((qp, kp, vp, mp, op, self.lse.data_ptr()), maps, stream)
        else:
            self.flash((qp, kp, vp, mp, self.o_part.data_ptr(), self.lse.data_ptr()), maps, stream)
            self.combine((self.o_part.data_ptr(), self.lse.data_ptr(), op), (), stream)


def make_map_type(dtype: Any, box: tuple[int, ...]) -> Any:
    return tensor_map(dtype, box)
