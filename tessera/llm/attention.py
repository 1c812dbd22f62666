"""Attention of transformers' decoders routed to tessera's paged-attention op.

Importing this module registers `ATTN_IMPLEMENTATION` ("tessera_paged") with transformers'
`AttentionInterface`.  A model loaded or set with that implementation calls
`paged_attention_forward` in every attention layer instead of its own kernel; transformers builds
no mask for a name its mask interface does not know, which is right: the paged op is causal per
sequence from the step's metadata.  The model runner passes that metadata (`PagedStep`) through
the model forward's keyword arguments as `tessera_step`; each layer picks its cache by
`module.layer_idx`, writes this step's keys and values into it, and attends over it.

Both steps are one torch custom op (`tessera_llm::paged_attention`), so that torch.compile keeps
it as one node of the graph; it reaches the caches by handle, so they are not graph inputs.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
import transformers

from tessera.eager.paged_attention import paged_attention, write_kv_cache
from tessera.errors import UnsupportedError

ATTN_IMPLEMENTATION = "tessera_paged"

# The KV caches of live model runners by handle: the op reaches its layer's cache through an int,
# so the caches are never graph inputs (functionalising a mutated input would copy the whole
# cache every step).  tessera.eager.quantize keeps its weights out of graphs the same way.
_KV_CACHES: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
_HANDLES = itertools.count(1)


def register_kv_caches(owner: object, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """A handle for `kv_caches[layer] = (key_cache, value_cache)`, released when `owner` is collected."""
    handle = next(_HANDLES)
    _KV_CACHES[handle] = kv_caches
    weakref.finalize(owner, _KV_CACHES.pop, handle, None)
    return handle


def release_kv_caches(handle: int) -> None:
    """Forget the caches of `handle` (their memory goes once nothing else holds them)."""
    _KV_CACHES.pop(handle, None)


@dataclass
class PagedStep:
    """What every attention layer needs to know about one packed step.

    cache_handle: register_kv_caches' handle of the caches, each [num_blocks, block_size, KVH, D].
    slot_mapping [T]: the cache slot of each new token (negative: padding, written nowhere).
    block_tables [B, max_blocks] int32, seq_lens [B] int32 (context length including this step's
    tokens), query_start_loc [B + 1] int32.
    """

    cache_handle: int
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


@torch.library.custom_op("tessera_llm::paged_attention", mutates_args=())
def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                       cache_handle: int, layer: int, scale: float, sliding_window: int,
                       softcap: float) -> torch.Tensor:  # fmt: skip
    """Write this step's key/value [T, KVH, D] into the layer's cache, then attend: query [T, H, D] -> [T, H, D].

    The cache is state outside the graph (reached by handle), so the op declares no mutation."""
    key_cache, value_cache = _KV_CACHES[cache_handle][layer]
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                           sliding_window=sliding_window, softcap=softcap)  # fmt: skip


@paged_attention_op.register_fake
def _(query, key, value, slot_mapping, block_tables, seq_lens, query_start_loc, cache_handle, layer, scale,
      sliding_window, softcap):  # fmt: skip
    return torch.empty_like(query)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None,
                            tessera_step: PagedStep | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention signature: query [1, H, T, D], key/value [1, KVH, T, D] -> ([1, T, H, D], None)."""
    if tessera_step is None:
        raise UnsupportedError(f"attention '{ATTN_IMPLEMENTATION}' runs only inside tessera.llm's engine "
                               "(the forward call must pass tessera_step=PagedStep(...))")  # fmt: skip
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # [1, heads, T, D] -> [T, heads, D]: tokens of all sequences packed along one axis.
    out = paged_attention_op(query[0].transpose(0, 1).contiguous(), key[0].transpose(0, 1), value[0].transpose(0, 1),
                             tessera_step.slot_mapping, tessera_step.block_tables, tessera_step.seq_lens,
                             tessera_step.query_start_loc, tessera_step.cache_handle, module.layer_idx, float(scale),
                             int(sliding_window or 0), float(softcap or 0.0))  # fmt: skip
    return out.unsqueeze(0), None


transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
