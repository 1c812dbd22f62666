"""The paged-attention family: attention of packed new tokens against a block-paged KV cache.

The cache of a layer is key_cache and value_cache [num_blocks, block_size, KVH, D]; sequence b's
token p lives in block block_tables[b, p // block_size] at offset p % block_size.  A call serves a
mixed batch (decode sequences with one new token, prefill/extend ones with several), causal,
grouped-query, with an optional sliding window and softcap.  tessera.eager.paged_attention is the
torch-facing entry point; it checks the arguments and picks these kernels:

* CPU (`cpu.py`, generated C): `make_paged_attention_cpu`, `make_write_kv_cache_cpu`;
* CUDA (`cuda.py`): `make_paged_decode` (split over the keys with `make_paged_combine` when few
  tokens would leave SMs idle: `choose_splits`), `make_paged_extend`, `make_write_kv_cache_cuda`.

Every kernel takes the token count, the batch size, the number of blocks, the block table's
width and the context lengths at run time: the engine calls them with new sizes every step, and
a kernel is built once per (dtype, head dim, block size, group size, softcap on/off).

No `Template` is registered: the registry maps graph operators to kernels, and there is no
paged-attention graph operator.  Its operands are the engine's state (the cache, block tables
and lengths change every step, outside any traced graph), so the engine's model runner calls
the eager entry point directly.  A graph operator (an opdef taking the cache and the index
tensors) can later wrap these kernels in a Template, should the compiled model take the call.
"""

from __future__ import annotations

from tessera.templates.paged_attention.cpu import SERIAL_WORK, make_paged_attention_cpu, make_write_kv_cache_cpu
from tessera.templates.paged_attention.cuda import (
    MAX_SPLITS,
    extend_tile,
    make_paged_combine,
    make_paged_decode,
    make_paged_extend,
    make_write_kv_cache_cuda,
)

__all__ = [
    "MAX_SPLITS",
    "SERIAL_WORK",
    "choose_splits",
    "extend_tile",
    "make_paged_attention_cpu",
    "make_paged_combine",
    "make_paged_decode",
    "make_paged_extend",
    "make_write_kv_cache_cpu",
    "make_write_kv_cache_cuda",
]


def choose_splits(items: int, max_blocks: int, sms: int) -> int:
    """KV splits of the decode kernel for `items` (token, KV head) pairs whose contexts span at
    most `max_blocks` cache blocks: enough blocks for about two waves of `sms` SMs, never more
    splits than blocks (each split gets at least one block of the longest context).  Only sizes
    the host knows go in, so the choice needs no read of the lengths (and CUDA graphs replay it)."""
    if items >= sms or max_blocks <= 1:
        return 1
    return max(1, min(MAX_SPLITS, max_blocks, -(-2 * sms // items)))
