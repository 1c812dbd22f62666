"""Paged attention (tessera.eager.paged_attention, the kernels of tessera.templates.paged_attention)
against dense float64 attention computed from the unpaged keys and values: decode, extend and
mixed batches, GQA, block sizes, sliding window, softcap, padding rows; write_kv_cache; bad inputs
raise clearly.  CPU tier: the generated C kernels, their reads (issue 36), narrower ISAs, nvcc
builds of the CUDA kernels.  GPU tier (-m cuda): the CUDA kernels against the same reference."""

from __future__ import annotations

import math
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tessera import bf16, f16, f32, i32, i64
from tessera.eager.paged_attention import paged_attention, paged_attention_reference, write_kv_cache
from tessera.errors import ArgumentError, DataTypeError, ShapeError, UnsupportedError
from tessera.templates.paged_attention import (
    MAX_SPLITS,
    choose_splits,
    extend_tile,
    make_paged_attention_cpu,
    make_paged_combine,
    make_paged_decode,
    make_paged_extend,
    make_write_kv_cache_cpu,
    make_write_kv_cache_cuda,
)
from tessera.transforms.unconditional_loads import unconditional_loads

torch = pytest.importorskip("torch")
NVCC = shutil.which("nvcc")


@dataclass
class Batch:
    """A paged batch and the dense keys and values it was made from."""

    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [L, KVH, D], float64
    values: list[torch.Tensor]


def make_batch(new_tokens: list[int], lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
               dtype=torch.float32, seed: int = 0, pad_rows: int = 0, spare_blocks: int = 3) -> Batch:  # fmt: skip
    """Sequences with `new_tokens[b]` new tokens and context `lens[b]`, blocks placed at random
    (shuffled ids, spare blocks of garbage between them); `pad_rows` extra query rows at the end."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare_blocks
    ids = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(need, default=0) + 1
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)  # garbage everywhere
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    keys, values = [], []
    for b, length in enumerate(lens):
        k = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
        mine = [ids.pop() for _ in range(need[b])]
        tables[b, : need[b]] = torch.tensor(mine, dtype=torch.int32)
        for p in range(length):
            key_cache[mine[p // block_size], p % block_size] = k[p]
            value_cache[mine[p // block_size], p % block_size] = v[p]
        keys.append(k.double())
        values.append(v.double())
    total = sum(new_tokens)
    query = torch.randn(total + pad_rows, heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32), qsl, keys, values)


def reference(batch: Batch, scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Dense causal attention per sequence in float64, from the unpaged K/V; padding rows 0."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    heads = batch.query.shape[1]
    qsl = batch.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.query[qsl[b] : qsl[b + 1]].double()
        n, length, group = q.shape[0], k.shape[0], heads // k.shape[1]
        for j in range(n):
            pos = length - n + j
            lo = max(0, pos - sliding_window + 1) if sliding_window > 0 else 0
            for h in range(heads):
                s = k[lo : pos + 1, h // group] @ q[j, h] * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                out[qsl[b] + j, h] = torch.softmax(s, 0) @ v[lo : pos + 1, h // group]
    return out


def run(batch: Batch, scale: float, **kw) -> torch.Tensor:
    return paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
                           batch.query_start_loc, scale, **kw)  # fmt: skip


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check(batch: Batch, scale: float | None = None, **kw) -> None:
    scale = batch.query.shape[2] ** -0.5 if scale is None else scale
    got = run(batch, scale, **kw)
    assert got.dtype == batch.query.dtype and got.shape == batch.query.shape
    want = reference(batch, scale, kw.get("sliding_window", 0), kw.get("softcap", 0.0))
    tol = TOL[batch.query.dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


# ---- shapes -----------------------------------------------------------------------------------

CASES = [  # (new tokens, context lengths, H, KVH, D, block size)
    ([1], [1], 1, 1, 16, 16),  # the smallest: one token, no cache
    ([1, 1, 1], [5, 17, 33], 4, 4, 32, 16),  # decode
    ([1, 1], [40, 7], 8, 2, 64, 8),  # decode, GQA 4
    ([7], [7], 4, 2, 32, 16),  # prefill, no cache
    ([5, 3], [21, 3], 6, 3, 16, 32),  # extend against cached blocks
    ([1, 6, 1, 9], [30, 6, 1, 50], 8, 4, 80, 16),  # mixed decode + extend, GQA 2, head dim 80
    ([2, 1], [19, 64], 4, 1, 96, 1),  # block size 1, MQA
    ([3, 1], [3, 17], 2, 2, 128, 8),
    ([1, 2], [9, 33], 4, 2, 256, 16),
    ([40, 1, 19], [45, 20, 19], 2, 2, 32, 16),  # several tiles of tokens per sequence
]


@pytest.mark.parametrize("new_tokens,lens,heads,kv_heads,head_dim,block_size", CASES)
def test_matches_dense_attention(new_tokens, lens, heads, kv_heads, head_dim, block_size):
    check(make_batch(new_tokens, lens, heads, kv_heads, head_dim, block_size, seed=len(lens) * head_dim))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    check(make_batch([1, 4, 1], [33, 20, 2], 8, 2, 64, 16, dtype=dtype, seed=3))


@pytest.mark.parametrize("window", [1, 4, 16, 100])
def test_sliding_window(window):
    check(make_batch([1, 5, 1, 12], [40, 9, 3, 30], 4, 2, 32, 8, seed=window), sliding_window=window)
    check(make_batch([33, 1], [50, 9], 2, 2, 16, 8, seed=window), sliding_window=window)  # windows across tiles


@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_softcap(softcap):
    check(make_batch([1, 3], [25, 11], 4, 4, 64, 16, seed=7), scale=0.4, softcap=softcap)


def test_softcap_with_window_and_odd_scale():
    check(make_batch([2, 1, 7], [18, 45, 7], 6, 2, 16, 8, seed=11), scale=1.7, softcap=5.0, sliding_window=6)


def test_padding_rows_zero_or_untouched():
    batch = make_batch([1, 4], [10, 4], 4, 2, 32, 16, seed=5, pad_rows=3)
    got = run(batch, 0.2)
    assert torch.equal(got[5:], torch.zeros_like(got[5:]))
    out = torch.full_like(batch.query, 7.0)
    assert run(batch, 0.2, out=out) is out
    assert torch.equal(out[5:], torch.full_like(out[5:], 7.0))
    torch.testing.assert_close(out[:5], got[:5], rtol=0, atol=0)


def test_empty_sequences_and_batch():
    batch = make_batch([0, 2, 0], [6, 9, 4], 2, 1, 16, 8, seed=2)  # sequences with no new token this step
    check(batch)
    empty = make_batch([], [], 2, 1, 16, 8)
    assert run(empty, 0.5).shape == (0, 2, 16)


def test_many_sequences_random_blocks():
    g = torch.Generator().manual_seed(9)
    lens = torch.randint(1, 70, (13,), generator=g).tolist()
    new = [1 if i % 3 else min(n, int(torch.randint(1, 9, (1,), generator=g))) for i, n in enumerate(lens)]
    check(make_batch(new, lens, 8, 2, 32, 8, seed=9, spare_blocks=10))


# ---- write_kv_cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_cache_scatters_and_skips_negative_slots(dtype, slot_dtype):
    g = torch.Generator().manual_seed(1)
    cache_k = torch.randn(5, 4, 2, 16, generator=g).to(dtype)
    cache_v = torch.randn(5, 4, 2, 16, generator=g).to(dtype)
    want_k, want_v = cache_k.clone(), cache_v.clone()
    key = torch.randn(6, 2, 16, generator=g).to(dtype)
    value = torch.randn(6, 2, 16, generator=g).to(dtype)
    slots = torch.tensor([17, 3, -1, 0, 19, -1], dtype=slot_dtype)
    write_kv_cache(key, value, cache_k, cache_v, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // 4, s % 4] = key[t]
            want_v[s // 4, s % 4] = value[t]
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)


def test_written_cache_feeds_attention():
    """The engine's step: write the new tokens' K/V, then attend."""
    batch = make_batch([3, 1], [8, 12], 4, 2, 32, 4, seed=4)
    g = torch.Generator().manual_seed(4)
    new_k = torch.randn(4, 2, 32, generator=g)
    new_v = torch.randn(4, 2, 32, generator=g)
    slots = []
    for b, (n, length) in enumerate(((3, 8), (1, 12))):
        for p in range(length - n, length):
            slots.append(int(batch.block_tables[b, p // 4]) * 4 + p % 4)
        first = sum((3, 1)[:b])
        batch.keys[b][length - n :] = new_k[first : first + n].double()
        batch.values[b][length - n :] = new_v[first : first + n].double()
    write_kv_cache(new_k, new_v, batch.key_cache, batch.value_cache, torch.tensor(slots, dtype=torch.int32))
    check(batch)


# ---- bad inputs -------------------------------------------------------------------------------


def _args(batch: Batch) -> dict:
    return dict(query=batch.query, key_cache=batch.key_cache, value_cache=batch.value_cache,
                block_tables=batch.block_tables, seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc,
                scale=0.125)  # fmt: skip


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(query=a["query"][0]), ShapeError, "query must be"),
    (lambda a: a.update(key_cache=a["key_cache"][0]), ShapeError, "key_cache must be"),
    (lambda a: a.update(query=a["query"][:, :3]), ShapeError, "multiple of"),
    (lambda a: a.update(query=a["query"][..., :8]), ShapeError, "head dim"),
    (lambda a: a.update(value_cache=a["value_cache"][:2]), ShapeError, "differ in shape"),
    (lambda a: a.update(query=a["query"].half()), DataTypeError, "one dtype"),
    (lambda a: a.update(value_cache=a["value_cache"].half()), DataTypeError, "one dtype"),
    (lambda a: a.update(key_cache=a["key_cache"].double(), value_cache=a["value_cache"].double(),
                        query=a["query"].double()), DataTypeError, "float32, float16 or bfloat16"),  # fmt: skip
    (lambda a: a.update(block_tables=a["block_tables"].float()), DataTypeError, "block_tables must be an int32"),
    (lambda a: a.update(seq_lens=a["seq_lens"].float()), DataTypeError, "seq_lens must be an int32"),
    (lambda a: a.update(query_start_loc=a["query_start_loc"][:-1]), ShapeError, "query_start_loc \\[3\\]"),
    (lambda a: a.update(seq_lens=a["seq_lens"][None]), ShapeError, "seq_lens must be"),
    (lambda a: a.update(block_tables=a["block_tables"].numpy()), ArgumentError, "torch tensor"),
    (lambda a: a.update(scale=math.nan), ArgumentError, "scale"),
    (lambda a: a.update(sliding_window=-1), ArgumentError, "sliding_window"),
    (lambda a: a.update(softcap=-1.0), ArgumentError, "softcap"),
    (lambda a: a.update(out=torch.empty(3)), ArgumentError, "out must be"),
    (lambda a: a.update(key_cache=a["key_cache"].transpose(1, 2), value_cache=a["value_cache"].transpose(1, 2)),
     ArgumentError, "contiguous"),  # fmt: skip
    (lambda a: a.update(query=a["query"].to("meta")), ArgumentError, "device"),
    (lambda a: a.update(seq_lens=a["seq_lens"] + 100), ArgumentError, "seq_lens"),
    (lambda a: a.update(seq_lens=torch.zeros_like(a["seq_lens"])), ArgumentError, "new tokens"),
    (lambda a: a.update(query_start_loc=a["query_start_loc"].flip(0)), ArgumentError, "query_start_loc"),
    (lambda a: a.update(block_tables=a["block_tables"] + 1000), ArgumentError, "block ids"),
])  # fmt: skip
def test_bad_attention_inputs_raise(change, error, match):
    args = _args(make_batch([1, 3], [9, 5], 4, 2, 16, 4, seed=1))
    change(args)
    with pytest.raises(error, match=match):
        paged_attention(**args)


def test_bad_cache_writes_raise():
    cache_k = torch.randn(3, 4, 2, 16)
    cache_v = torch.randn(3, 4, 2, 16)
    key = torch.randn(2, 2, 16)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ShapeError, match="KVH, D"):
        write_kv_cache(key[:, :1], key[:, :1], cache_k, cache_v, slots)
    with pytest.raises(DataTypeError, match="one dtype"):
        write_kv_cache(key.half(), key.half(), cache_k, cache_v, slots)
    with pytest.raises(DataTypeError, match="int32 or int64"):
        write_kv_cache(key, key, cache_k, cache_v, slots.float())
    with pytest.raises(ShapeError, match="slots for"):
        write_kv_cache(key, key, cache_k, cache_v, slots[:1])
    with pytest.raises(ArgumentError, match="the cache has 12 slots"):
        write_kv_cache(key, key, cache_k, cache_v, torch.tensor([0, 12]))
    with pytest.raises(ShapeError, match="differ in shape"):
        write_kv_cache(key, key, cache_k, cache_v[:1], slots)


# ---- kernels: generated code, other paths ----------------------------------------------------


def test_reference_path_matches_dense_attention():
    batch = make_batch([1, 6, 1], [30, 6, 13], 8, 4, 32, 8, seed=21)
    got = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                    batch.seq_lens, batch.query_start_loc, 0.3, sliding_window=5, softcap=2.0)  # fmt: skip
    torch.testing.assert_close(got.double(), reference(batch, 0.3, 5, 2.0), rtol=2e-5, atol=2e-5)


def test_cache_garbage_outside_the_context_is_never_read():
    """Slots past a sequence's length and blocks it does not own may hold NaN (torch.empty)."""
    batch = make_batch([1, 3], [13, 7], 4, 2, 32, 8, seed=8)
    for b, length in enumerate(batch.seq_lens.tolist()):
        last = int(batch.block_tables[b, (length - 1) // 8])
        batch.key_cache[last, length % 8 or 8 :] = math.nan
        batch.value_cache[last, length % 8 or 8 :] = math.nan
    used = set(batch.block_tables[batch.block_tables >= 0].tolist())
    for i in set(range(batch.key_cache.shape[0])) - used:
        batch.key_cache[i] = math.nan
        batch.value_cache[i] = math.nan
    check(batch, sliding_window=3)
    check(batch)


def test_index_tensors_may_be_int64_and_non_contiguous():
    batch = make_batch([2, 1], [9, 20], 4, 2, 16, 4, seed=6)
    want = run(batch, 0.25)
    wide = torch.zeros(batch.block_tables.shape[0], 2 * batch.block_tables.shape[1], dtype=torch.int64)
    wide[:, ::2] = batch.block_tables
    batch.block_tables = wide[:, ::2]
    batch.seq_lens, batch.query_start_loc = batch.seq_lens.long(), batch.query_start_loc.long()
    query = batch.query
    batch.query = torch.cat([query, query], dim=2)[..., :16]  # a strided view
    torch.testing.assert_close(run(batch, 0.25), want, rtol=0, atol=0)


def test_cpu_kernels_read_memory_unconditionally():
    """No memory read of the generated C sits in a conditional arm (issue 36): the
    unconditional_loads pass finds nothing to move in the kernels as written."""
    kernels = [make_paged_attention_cpu(dt, 64, 16, 4, cap) for dt in (f32, bf16) for cap in (False, True)]
    kernels += [make_write_kv_cache_cpu(f16, 32, 8, i32), make_write_kv_cache_cpu(f32, 32, 8, i64)]
    for k in kernels:
        assert str(unconditional_loads(k.ir)) == str(k.ir), k.ir.name


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_cpu_kernel_under_narrower_isas(isa, monkeypatch):
    """The same C built for AVX2 and for no vector unit gives the same answers."""
    monkeypatch.setenv("TESSERA_CPU_ISA", isa)
    batch = make_batch([1, 5, 2], [21, 5, 40], 6, 2, 32, 8, seed=13)
    want = run(batch, 0.2, sliding_window=9)
    fresh = make_paged_attention_cpu.__wrapped__(f32, 32, 8, 3, False)
    out = torch.zeros_like(batch.query)
    fresh(batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
          out, 0.2, 9, 0.0)  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_parallel_and_serial_kernels_agree():
    """Small calls run on one thread (SERIAL_WORK), larger ones on the OpenMP team: same answers."""
    batch = make_batch([1, 1, 30, 1], [2000, 700, 60, 1500], 8, 2, 64, 16, seed=17)
    check(batch)  # large enough for the parallel kernel
    outs = []
    for parallel in (True, False):
        out = torch.zeros_like(batch.query)
        make_paged_attention_cpu(f32, 64, 16, 4, False, parallel)(
            batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, out, 0.125, 0, 0.0)  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    cache = [torch.zeros(40, 16, 8, 64) for _ in range(4)]
    key = torch.randn(600, 8, 64)
    slots = torch.randperm(640)[:600]
    for parallel, (kc, vc) in ((True, cache[:2]), (False, cache[2:])):
        make_write_kv_cache_cpu(f32, 64, 16, i64, parallel)(key, key, kc, vc, slots)
    assert torch.equal(cache[0], cache[2]) and torch.equal(cache[0].view(-1, 8, 64)[slots], key)


def test_other_devices_are_unsupported():
    batch = make_batch([1], [3], 2, 1, 16, 4)
    args = _args(batch)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(UnsupportedError, match="CPU and CUDA"):
        paged_attention(**meta)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.slow
def test_cuda_kernels_compile():
    """nvcc -arch=sm_90a builds every CUDA kernel family (GQA, odd head dims, softcap, splits)."""
    kernels = [make_paged_decode(f16, 128, 16, 4, False, False), make_paged_decode(bf16, 80, 16, 1, True, True),
               make_paged_decode(f16, 256, 32, 8, False, True), make_paged_combine(bf16, 80),
               make_paged_extend(f16, 128, 16, 4, False), make_paged_extend(bf16, 96, 1, 2, True),
               make_paged_extend(f16, 256, 32, 8, False), make_paged_extend(f16, 16, 8, 1, False, True),
               make_paged_decode(bf16, 64, 8, 2, False, True, True),
               make_write_kv_cache_cuda(bf16, 64, 16, i64), make_write_kv_cache_cuda(f16, 80, 16, i32)]  # fmt: skip
    with ThreadPoolExecutor(2) as ex:
        paths = list(ex.map(lambda k: k.build(), kernels))
    assert all(p.endswith(".cubin") for p in paths)
    assert all(k.arch == "sm_90a" for k in kernels)  # no GPU here: the default target


def test_splits_and_tiles():
    assert choose_splits(8 * 8, 512, 132) == 5  # batch 8 decode, 8 KV heads: ~2 waves
    assert choose_splits(2, 512, 132) == MAX_SPLITS
    assert choose_splits(2, 3, 132) == 3  # never more splits than blocks
    assert choose_splits(256 * 8, 512, 132) == 1
    assert choose_splits(1, 1, 132) == 1
    assert extend_tile(64, 1) == 16 and extend_tile(128, 4) == 8 and extend_tile(256, 8) == 2 and extend_tile(512, 16) == 1


# ---- GPU tier ---------------------------------------------------------------------------------

GPU_CASES = [  # (new tokens, context lengths, H, KVH, D, block size): decode, split decode, extend, mixed
    ([1] * 6, [5, 17, 33, 1, 300, 64], 8, 2, 64, 16),
    ([1, 1], [2000, 700], 32, 8, 128, 16),  # few long contexts: the split decode kernel
    ([1], [4097], 16, 2, 80, 32),
    ([1, 1, 1], [40, 7, 129], 8, 8, 256, 16),
    ([37, 5], [37, 90], 16, 4, 128, 16),  # prefill and extend
    ([1, 6, 1, 9, 40], [30, 6, 1, 50, 300], 8, 4, 96, 8),  # mixed
    ([3, 1], [19, 64], 4, 1, 16, 1),  # block size 1, MQA, a tiny head
    ([20, 1], [25, 33], 4, 2, 32, 32),
    ([0, 2, 1], [9, 40, 17], 8, 2, 64, 16),  # as many tokens as sequences, not all decodes: the decode kernel
    ([1, 5], [3000, 40], 16, 4, 128, 16),  # mixed, the decode share split over the keys
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("new_tokens,lens,heads,kv_heads,head_dim,block_size", GPU_CASES)
def test_gpu_matches_dense_attention(dtype, new_tokens, lens, heads, kv_heads, head_dim, block_size):
    batch = make_batch(new_tokens, lens, heads, kv_heads, head_dim, block_size, dtype=dtype, seed=head_dim, pad_rows=2)
    _check_on_gpu(batch)
    _check_on_gpu(batch, sliding_window=7, softcap=3.0, scale=0.3)


def _check_on_gpu(batch: Batch, scale: float | None = None, **kw) -> None:
    scale = batch.query.shape[2] ** -0.5 if scale is None else scale
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in _args(batch).items()}
    cuda["scale"] = scale
    got = paged_attention(**cuda, **kw)
    want = reference(batch, scale, kw.get("sliding_window", 0), kw.get("softcap", 0.0))
    tol = TOL[batch.query.dtype]
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_gpu_write_kv_cache(slot_dtype):
    g = torch.Generator().manual_seed(2)
    cache_k = torch.randn(7, 16, 2, 80, generator=g).half()
    cache_v = torch.randn(7, 16, 2, 80, generator=g).half()
    key = torch.randn(9, 2, 80, generator=g).half()
    value = torch.randn(9, 2, 80, generator=g).half()
    slots = torch.tensor([100, -1, 3, 4, 5, 111, -1, 0, 16], dtype=slot_dtype)
    gk, gv = cache_k.cuda(), cache_v.cuda()
    write_kv_cache(key.cuda(), value.cuda(), gk, gv, slots.cuda())
    write_kv_cache(key, value, cache_k, cache_v, slots)
    assert torch.equal(gk.cpu(), cache_k) and torch.equal(gv.cpu(), cache_v)
