"""Paged attention over a block-paged KV cache, on torch tensors: `write_kv_cache`, `paged_attention`
and `copy_blocks`.

The KV cache of a layer is two tensors [num_blocks, block_size, KVH, D]; a sequence's keys live in
the blocks its row of `block_tables` lists, in order (token p in block block_tables[b, p // bs] at
offset p % bs).  One `paged_attention` call serves a mixed batch: decode sequences (one new token)
and prefill/extend ones (several new tokens against the blocks cached so far, chunked prefill).

Both run tessera's kernels (tessera.templates.paged_attention), built once per (dtype, head dim,
block size, group size, softcap on/off) and cached; every size that changes between steps is a
run-time argument.  CPU tensors run the generated C kernels (float32, float16, bfloat16).  CUDA
tensors run the decode kernel (split over the keys when few tokens would leave SMs idle) on the
tokens of sequences with one new token and, when the batch has more tokens than sequences, the
extend kernel on the others (without reading the lengths on the host: each kernel skips the other's
sequences).  Other devices raise UnsupportedError.  `paged_attention_reference`
is the torch path the kernels replaced (gather the blocks, masked softmax in float32), kept to
compare against.
"""

from __future__ import annotations

import math
from typing import Any

from tessera.errors import ArgumentError, DataTypeError, ShapeError, UnsupportedError
from tessera.ir import dtypes
from tessera.runtime.cuda import multiprocessor_count
from tessera.templates.paged_attention import (
    SERIAL_WORK,
    choose_splits,
    make_paged_attention_cpu,
    make_paged_combine,
    make_paged_decode,
    make_paged_extend,
    make_write_kv_cache_cpu,
    make_write_kv_cache_cuda,
)

_INDEX_DTYPES = ("torch.int32", "torch.int64")
_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")


def _torch() -> Any:
    try:
        import torch  # optional: torch
    except ImportError:  # pragma: no cover
        raise UnsupportedError("paged attention works on torch tensors; install torch") from None
    return torch


def _check_tensor(torch: Any, name: str, t: Any, ndim: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{name} must be a torch tensor {what}, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ShapeError(f"{name} must be {what} ({ndim}-D), got shape {list(t.shape)}")


def _check_index(torch: Any, name: str, t: Any, ndim: int, what: str, device: Any) -> None:
    _check_tensor(torch, name, t, ndim, what)
    if str(t.dtype) not in _INDEX_DTYPES:
        raise DataTypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
    if t.device != device:
        raise ArgumentError(f"{name} is on {t.device}, the cache on {device}: one device")


def _check_cache(torch: Any, key_cache: Any, value_cache: Any) -> None:
    _check_tensor(torch, "key_cache", key_cache, 4, "[num_blocks, block_size, KVH, D]")
    _check_tensor(torch, "value_cache", value_cache, 4, "[num_blocks, block_size, KVH, D]")
    if key_cache.shape != value_cache.shape:
        raise ShapeError(f"key_cache {list(key_cache.shape)} and value_cache {list(value_cache.shape)} differ in shape")
    if key_cache.dtype != value_cache.dtype:
        raise DataTypeError(f"key_cache is {key_cache.dtype}, value_cache {value_cache.dtype}: one dtype")
    if str(key_cache.dtype) not in _DTYPES:
        raise DataTypeError(f"the KV cache must be float32, float16 or bfloat16, got {key_cache.dtype}")
    if key_cache.device != value_cache.device:
        raise ArgumentError(f"key_cache is on {key_cache.device}, value_cache on {value_cache.device}: one device")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ArgumentError("key_cache and value_cache must be contiguous (the blocks are addressed by index)")
    if key_cache.device.type not in ("cpu", "cuda"):
        raise UnsupportedError(f"paged attention runs on CPU and CUDA tensors, not {key_cache.device.type}")


def write_kv_cache(key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any) -> None:
    """Write this step's keys and values into their cache slots, in place.

    key/value: [T, KVH, D]; key_cache/value_cache: [num_blocks, block_size, KVH, D] of key's dtype
    and device; slot_mapping: [T] int32 or int64, slot = block * block_size + offset; a negative
    slot skips that token (padding).  On CPU tensors, slots past the cache raise ArgumentError
    (on CUDA they are not checked: that would synchronise the stream)."""
    torch = _torch()
    _check_cache(torch, key_cache, value_cache)
    num_blocks, block_size, kvh, d = key_cache.shape
    for name, t in (("key", key), ("value", value)):
        _check_tensor(torch, name, t, 3, "[T, KVH, D]")
        if tuple(t.shape[1:]) != (kvh, d):
            raise ShapeError(f"{name} {list(t.shape)} does not match the cache's KVH, D = {kvh}, {d}")
        if t.dtype != key_cache.dtype:
            raise DataTypeError(f"{name} is {t.dtype}, the cache {key_cache.dtype}: one dtype")
        if t.device != key_cache.device:
            raise ArgumentError(f"{name} is on {t.device}, the cache on {key_cache.device}: one device")
    if key.shape[0] != value.shape[0]:
        raise ShapeError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    _check_index(torch, "slot_mapping", slot_mapping, 1, "[T]", key_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ShapeError(f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    slots = num_blocks * block_size
    if not slot_mapping.is_cuda and slot_mapping.numel() and int(slot_mapping.max()) >= slots:
        raise ArgumentError(f"slot_mapping holds slot {int(slot_mapping.max())}; the cache has {slots} slots")
    if key.shape[0] == 0 or slots == 0 or kvh == 0 or d == 0:
        return
    dtype, slot_dtype = dtypes.from_torch(key_cache.dtype), dtypes.from_torch(slot_mapping.dtype)
    if key_cache.is_cuda:
        kernel = make_write_kv_cache_cuda(dtype, d, block_size, slot_dtype)
    else:
        kernel = make_write_kv_cache_cpu(
            dtype, d, block_size, slot_dtype, 2 * key.numel() * key.element_size() > SERIAL_WORK
        )
    kernel(key.contiguous(), value.contiguous(), key_cache, value_cache, slot_mapping.contiguous())


def copy_blocks(key_cache: Any, value_cache: Any, src: Any, dst: Any) -> None:
    """Copy whole blocks of one layer's cache in place: block dst[i] becomes block src[i] (keys and
    values), all sources read before any destination is written.  src/dst: [N] int32 or int64 on the
    cache's device; destinations must be distinct.  The prefix cache's copy on write of a partial
    block; a gather and a scatter of torch's, on any device."""
    torch = _torch()
    _check_cache(torch, key_cache, value_cache)
    _check_index(torch, "src", src, 1, "[N]", key_cache.device)
    _check_index(torch, "dst", dst, 1, "[N]", key_cache.device)
    if src.shape != dst.shape:
        raise ShapeError(f"src has {src.shape[0]} blocks, dst {dst.shape[0]}")
    if not src.is_cuda and src.numel():
        low, high = int(torch.minimum(src.min(), dst.min())), int(torch.maximum(src.max(), dst.max()))
        if low < 0 or high >= key_cache.shape[0]:
            raise ArgumentError(f"block ids must be in [0, {key_cache.shape[0]}), got {low} .. {high}")
    for cache in (key_cache, value_cache):
        cache.index_copy_(0, dst.long(), cache.index_select(0, src.long()))


def _check_attention(torch: Any, query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
                     query_start_loc: Any, scale: float, sliding_window: int, softcap: float, out: Any) -> None:  # fmt: skip
    _check_cache(torch, key_cache, value_cache)
    _check_tensor(torch, "query", query, 3, "[T, H, D]")
    _, _, kvh, d = key_cache.shape
    t, h, dq = query.shape
    if dq != d:
        raise ShapeError(f"query's head dim {dq} differs from the cache's {d}")
    if h == 0 or h % kvh:
        raise ShapeError(f"query has {h} heads, not a positive multiple of the cache's {kvh} KV heads")
    if query.dtype != key_cache.dtype:
        raise DataTypeError(f"query is {query.dtype}, the KV cache {key_cache.dtype}: one dtype")
    if query.device != key_cache.device:
        raise ArgumentError(f"query is on {query.device}, the KV cache on {key_cache.device}: one device")
    device = query.device
    _check_index(torch, "block_tables", block_tables, 2, "[B, max_blocks]", device)
    b = block_tables.shape[0]
    _check_index(torch, "seq_lens", seq_lens, 1, "[B]", device)
    _check_index(torch, "query_start_loc", query_start_loc, 1, "[B + 1]", device)
    if seq_lens.shape[0] != b or query_start_loc.shape[0] != b + 1:
        raise ShapeError(f"block_tables has {b} sequences: seq_lens must be [{b}] and query_start_loc [{b + 1}], "
                         f"got {list(seq_lens.shape)} and {list(query_start_loc.shape)}")  # fmt: skip
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ArgumentError(f"scale must be a finite number, got {scale!r}")
    if not isinstance(sliding_window, int) or sliding_window < 0:
        raise ArgumentError(f"sliding_window must be an int >= 0 (0: none), got {sliding_window!r}")
    if not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
        raise ArgumentError(f"softcap must be a finite number >= 0 (0: none), got {softcap!r}")
    if out is not None:
        if not (isinstance(out, torch.Tensor) and out.shape == query.shape and out.dtype == query.dtype
                and out.device == device and out.is_contiguous()):  # fmt: skip
            raise ArgumentError(
                f"out must be a contiguous {query.dtype} tensor of shape {list(query.shape)} on {device}"
            )
    if not query.is_cuda:
        _check_values(torch, block_tables, seq_lens, query_start_loc, key_cache.shape[0], key_cache.shape[1], t)


def _check_values(torch: Any, block_tables: Any, seq_lens: Any, query_start_loc: Any, num_blocks: int,
                  block_size: int, tokens: int) -> None:  # fmt: skip
    """The index tensors' contents (CPU only: on CUDA reading them would synchronise the stream).
    Whole-tensor checks: the engine calls this once per layer and step; the loop below only
    names the first bad sequence."""
    b, max_blocks = block_tables.shape
    if b == 0:
        return
    first, last = int(query_start_loc[0]), int(query_start_loc[-1])
    if first != 0 or last > tokens:
        raise ArgumentError(f"query_start_loc must start at 0 and end at most at T = {tokens}, got {first} .. {last}")
    new = query_start_loc[1:] - query_start_loc[:-1]
    needed = (seq_lens.long() + block_size - 1) // block_size
    used = torch.arange(max_blocks)[None, :] < needed[:, None]
    ids = block_tables[used]
    bad_ids = ids.numel() > 0 and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks)
    if not (bool((new >= 0).all()) and bool((new <= seq_lens).all()) and int(needed.max()) <= max_blocks) or bad_ids:
        _name_bad_sequence(block_tables, seq_lens.tolist(), query_start_loc.tolist(), num_blocks, block_size)


def _name_bad_sequence(block_tables: Any, lens: list[int], qsl: list[int], num_blocks: int, block_size: int) -> None:
    max_blocks = block_tables.shape[1]
    for i, length in enumerate(lens):
        n = qsl[i + 1] - qsl[i]
        if n < 0:
            raise ArgumentError(f"query_start_loc decreases at sequence {i}: {qsl[i]} > {qsl[i + 1]}")
        if not n <= length <= max_blocks * block_size:
            raise ArgumentError(f"sequence {i}: seq_lens {length} must be at least its {n} new tokens and at most "
                                f"max_blocks * block_size = {max_blocks * block_size}")  # fmt: skip
        used = block_tables[i, : -(-length // block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise ArgumentError(f"sequence {i}: block_tables holds block ids outside 0..{num_blocks - 1}")


def paged_attention(query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
                    query_start_loc: Any, scale: float, sliding_window: int = 0, softcap: float = 0.0,
                    out: Any = None) -> Any:  # fmt: skip
    """Causal attention of packed new tokens against a paged KV cache (decode and prefill/extend).

    query: [T, H, D] (all new tokens of all sequences, packed); H a multiple of KVH (grouped-query:
    head h reads KV head h // (H / KVH)).  key_cache/value_cache: [num_blocks, block_size, KVH, D].
    block_tables: [B, max_blocks] int32 (block ids of each sequence, in order); seq_lens: [B] int32,
    each sequence's context length including this step's new tokens; query_start_loc: [B + 1]
    int32, sequence b's new tokens are query rows [query_start_loc[b], query_start_loc[b + 1]).
    New token j of sequence b sits at position seq_lens[b] - n_b + j and attends cached keys at
    positions <= its own (and > position - sliding_window when sliding_window > 0).  softcap > 0:
    scores = softcap * tanh(scores / softcap) (Gemma 2).  Rows past query_start_loc[B] are left
    untouched in `out` (zero in a new one).  Returns out [T, H, D] in query's dtype; accumulates in
    float32.  On CPU tensors the index tensors' contents are checked too (not on CUDA: that would
    synchronise the stream)."""
    torch = _torch()
    _check_attention(torch, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     sliding_window, softcap, out)  # fmt: skip
    if out is None:
        out = torch.zeros_like(query)
    num_blocks, block_size, kvh, d = key_cache.shape
    if min(query.shape[0], block_tables.shape[0], block_tables.shape[1], num_blocks, d) == 0:
        return out  # no token attends to anything (the runtime takes no empty arrays)
    group = query.shape[1] // kvh
    dtype = dtypes.from_torch(query.dtype)
    cap = float(softcap) > 0
    args = (query.contiguous(), key_cache, value_cache, _int32(torch, block_tables), _int32(torch, seq_lens),
            _int32(torch, query_start_loc))  # fmt: skip
    scalars = (float(scale), int(sliding_window), float(softcap))
    if not query.is_cuda:
        # The keys attended to, summed over the new tokens (an upper bound: windows not counted).
        pairs = int((args[4].long() * (args[5][1:] - args[5][:-1])).sum())
        parallel = pairs * query.shape[1] * d * 2 > SERIAL_WORK
        make_paged_attention_cpu(dtype, d, block_size, group, cap, parallel)(*args, out, *scalars)
        return out
    tokens, batch = query.shape[0], block_tables.shape[0]
    # As many tokens as sequences: a decode step (any other split of the tokens is right too).
    # More: prefill/extend sequences go to the extend kernel, single tokens to the decode kernel.
    mixed = tokens > batch
    if mixed:
        make_paged_extend(dtype, d, block_size, group, cap, True)(*args, out, *scalars)
    splits = choose_splits(min(tokens, batch) * kvh, block_tables.shape[1], multiprocessor_count())
    if splits == 1:
        none = torch.empty(1, dtype=torch.float32, device=query.device)
        make_paged_decode(dtype, d, block_size, group, cap, False, mixed)(*args, out, none, none, *scalars)
        return out
    partial = torch.empty((splits, *query.shape), dtype=torch.float32, device=query.device)
    lse = torch.full((splits, *query.shape[:2]), float("-inf"), dtype=torch.float32, device=query.device)
    make_paged_decode(dtype, d, block_size, group, cap, True, mixed)(*args, out, partial, lse, *scalars)
    make_paged_combine(dtype, d)(partial, lse, args[5], out)
    return out


def _int32(torch: Any, t: Any) -> Any:
    """An index tensor as the kernels take it: contiguous int32 (int64 lengths and ids fit)."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def paged_attention_reference(query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
                              query_start_loc: Any, scale: float, sliding_window: int = 0, softcap: float = 0.0,
                              out: Any = None) -> Any:  # fmt: skip
    """`paged_attention` computed with torch (gather each sequence's blocks, masked softmax in
    float32), on any device; the reference the kernels are compared with.  Reads the lengths on
    the host (a CUDA synchronisation per call)."""
    torch = _torch()
    _check_attention(torch, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     sliding_window, softcap, out)  # fmt: skip
    if out is None:
        out = torch.zeros_like(query)
    _reference(torch, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, float(scale),
               sliding_window, float(softcap), out)  # fmt: skip
    return out


def _reference(torch: Any, query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any,
               query_start_loc: Any, scale: float, window: int, softcap: float, out: Any) -> None:  # fmt: skip
    """The torch path: per sequence, gather its blocks, masked softmax in float32."""
    _, block_size, kvh, d = key_cache.shape
    group = query.shape[1] // kvh
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(block_tables.shape[0]):
        q0, q1, length = qsl[b], qsl[b + 1], lens[b]
        if q1 == q0:
            continue
        ids = block_tables[b, : -(-length // block_size)].long()
        k = key_cache[ids].reshape(-1, kvh, d)[:length].float().repeat_interleave(group, dim=1)
        v = value_cache[ids].reshape(-1, kvh, d)[:length].float().repeat_interleave(group, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("nhd,khd->hnk", q, k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(length - (q1 - q0), length, device=query.device)[:, None]
        keys = torch.arange(length, device=query.device)[None, :]
        visible = keys <= pos
        if window > 0:
            visible &= keys > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q0:q1] = torch.einsum("hnk,khd->nhd", torch.softmax(scores, dim=-1), v).to(out.dtype)
