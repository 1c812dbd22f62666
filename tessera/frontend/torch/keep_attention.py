"""Keep `F.scaled_dot_product_attention` whole through AOTAutograd on the GPU.

`aten.scaled_dot_product_attention` is CompositeImplicit: tracing replaces it with whatever
backend torch's dispatcher picks for the (fake) inputs.  On the GPU it picks the *math*
decomposition for masked attention (BERT's padding mask: two scaled matmuls, `_safe_softmax`'s
where/max chain, a matmul), which loses tessera's flash-attention anchor and leaves the
[heads, len, len] scores in memory.  So before AOTAutograd runs, each SDPA call in dynamo's
graph becomes the custom op `tessera::attention`, which tracing keeps as one node and
`aten_nn` lowers to the `scaled_dot_product_attention` graph operator.  (On the CPU the
decomposition table keeps `_scaled_dot_product_flash_attention_for_cpu` whole instead.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


@torch.library.custom_op("tessera::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:  # fmt: skip
    """Inference attention, as F.scaled_dot_product_attention without dropout (a contiguous result)."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                         enable_gqa=enable_gqa)  # fmt: skip
    return out.contiguous()


@attention.register_fake
def _(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def keep_attention_whole(gm: torch.fx.GraphModule) -> int:
    """Rewrite gm's inference SDPA calls (dropout 0) to `tessera::attention`; the number rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA_TARGETS:
            continue
        given = dict(zip(_SDPA_ARGS, node.args))
        given.update(node.kwargs)
        if set(given) - set(_SDPA_ARGS):
            continue  # a signature this rule does not know: torch decomposes it as before
        args = {**_SDPA_DEFAULTS, **given}
        if not isinstance(args["dropout_p"], (int, float)) or args["dropout_p"] != 0:
            continue  # training-time dropout stays torch's
        if not all(isinstance(args[k], bool) for k in ("is_causal", "enable_gqa")):
            continue
        if not (args["scale"] is None or isinstance(args["scale"], (int, float))):
            continue
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.ops.tessera.attention.default,
                                         (args["query"], args["key"], args["value"], args["attn_mask"],
                                          args["is_causal"], None if args["scale"] is None else float(args["scale"]),
                                          args["enable_gqa"]))  # fmt: skip
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count
