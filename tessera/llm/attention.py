"""Attention of transformers' decoders routed to tessera's paged-attention op.

Importing this module registers `ATTN_IMPLEMENTATION` ("tessera_paged") with transformers'
`AttentionInterface`.  A model loaded or set with that implementation calls
`paged_attention_forward` in every attention layer instead of its own kernel; transformers builds
no mask for a name its mask interface does not know, which is right: the paged op is causal per
sequence from the step's metadata.  The model runner passes that metadata (`PagedStep`) through
the model forward's keyword arguments as `tessera_step`; each layer picks its cache by
`module.layer_idx`, writes this step's keys and values into it, and attends over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from tessera.eager.paged_attention import paged_attention, write_kv_cache
from tessera.errors import UnsupportedError

ATTN_IMPLEMENTATION = "tessera_paged"


@dataclass
class PagedStep:
    """What every attention layer needs to know about one packed step.

    kv_caches[layer] = (key_cache, value_cache), each [num_blocks, block_size, KVH, D].
    slot_mapping [T]: the cache slot of each new token.  block_tables [B, max_blocks] int32,
    seq_lens [B] int32 (context length including this step's tokens), query_start_loc [B + 1] int32.
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None,
                            tessera_step: PagedStep | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention signature: query [1, H, T, D], key/value [1, KVH, T, D] -> ([1, T, H, D], None)."""
    if tessera_step is None:
        raise UnsupportedError(f"attention '{ATTN_IMPLEMENTATION}' runs only inside tessera.llm's engine "
                               "(the forward call must pass tessera_step=PagedStep(...))")  # fmt: skip
    key_cache, value_cache = tessera_step.kv_caches[module.layer_idx]
    # [1, heads, T, D] -> [T, heads, D]: tokens of all sequences packed along one axis.
    write_kv_cache(key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache, tessera_step.slot_mapping)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(query[0].transpose(0, 1).contiguous(), key_cache, value_cache, tessera_step.block_tables,
                          tessera_step.seq_lens, tessera_step.query_start_loc, float(scale),
                          sliding_window=int(sliding_window or 0), softcap=float(softcap or 0.0))  # fmt: skip
    return out.unsqueeze(0), None


transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
