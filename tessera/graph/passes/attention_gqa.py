"""Drop the key/value head repetition before attention: the operator takes grouped heads.

Models with grouped-query attention (Llama, Mistral, Qwen) repeat each key/value head for its
query heads before attention when they cannot pass `enable_gqa` (HF's `repeat_kv`, whenever a
mask is passed):
    k_rep = reshape(expand(unsqueeze(k, 2), [B, Hk, rep, S, D]), [B, Hk * rep, S, D])
`scaled_dot_product_attention` reads key/value head h // (H / Hk) for query head h by itself,
which is exactly what k_rep holds, so the attention reads k instead.  The repetition is a
copy of rep times the keys and values (8x for TinyLlama) that no kernel needs.  Every
intermediate must have no other use.
"""

from __future__ import annotations

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes._match import Uses, rewrite
from tessera.graph.tensor import Tensor


def _repeated(t: Tensor, uses: Uses) -> tuple[Tensor, list[Operator]] | None:
    """(kv, the ops) when t = reshape(expand(unsqueeze(kv, 2)), [B, Hk * rep, S, D])."""
    reshape = t.producer
    if reshape is None or reshape.kind != "reshape" or t.ndim != 4:
        return None
    expand = reshape.inputs[0].producer
    if expand is None or expand.kind != "expand" or uses.only_user(reshape.inputs[0]) is not reshape:
        return None
    unsqueeze = expand.inputs[0].producer
    if unsqueeze is None or unsqueeze.kind != "unsqueeze" or uses.only_user(expand.inputs[0]) is not expand:
        return None
    if list(unsqueeze.attrs.get("axes", ())) not in ([2], [-3]):
        return None
    kv = unsqueeze.inputs[0]
    if kv.ndim != 4:
        return None
    b, hk, s, d = kv.shape
    rep = expand.outputs[0].shape[2]
    if tuple(expand.outputs[0].shape) != (b, hk, rep, s, d) or not isinstance(rep, int) or not isinstance(hk, int):
        return None
    if tuple(t.shape) != (b, hk * rep, s, d):
        return None
    return kv, [unsqueeze, expand, reshape]


def fold_repeat_kv(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of key/value repetitions dropped."""
    uses = Uses(graph)
    drop: list[Operator] = []
    count = 0
    for op in graph.operators:
        if op.kind != "scaled_dot_product_attention":
            continue
        for i in (1, 2):
            t = op.inputs[i]
            found = _repeated(t, uses) if uses.only_user(t) is op else None
            if found is None:
                continue
            op.inputs[i] = found[0]
            drop += found[1]
            count += 1
    if drop:
        rewrite(graph, drop, [])
    return count
