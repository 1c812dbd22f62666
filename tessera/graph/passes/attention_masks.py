"""Replace constant attention masks by what they say: none at all, or `causal=True`.

Exports of models called with a fixed attention mask (all ones, a causal LM) carry the
additive mask transformers builds as a constant: zeros where a key is kept and finfo.min
where it is not.  An all-zero (or all-True) mask is no mask; a mask that keeps exactly the
lower triangle (key j <= query i, the op's top-left aligned `causal`) in every broadcast
batch is `causal=True`, which the attention kernels apply without reading a mask and, on the
GPU, by skipping the blocks above the diagonal.

Exact: a masked entry is -inf, False, or at most half of its dtype's lowest value, so that
score + mask rounds to a value whose exponential (after subtracting the row maximum) is 0,
as -inf's is; every causal row keeps key 0, so no row becomes fully masked.
"""

from __future__ import annotations

import numpy as np

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes._match import rewrite


def _kept(mask: np.ndarray) -> np.ndarray | None:
    """A bool array of the kept entries, or None if some entry is neither kept nor surely masked."""
    if mask.dtype == np.bool_:
        return mask
    if mask.dtype not in (np.float16, np.float32, np.float64):
        return None
    kept = mask == 0
    return kept if np.all(kept | (mask <= float(np.finfo(mask.dtype).min) / 2)) else None


def simplify_attention_masks(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of attention masks removed."""
    drop: list[Operator] = []
    new: list[Operator] = []
    for op in graph.operators:
        if op.kind != "scaled_dot_product_attention" or len(op.inputs) != 4:
            continue
        mask = op.inputs[3]
        if not (mask.is_constant and mask.producer is None):
            continue
        kept = _kept(mask.data)
        if kept is None:
            continue
        sq, sk = op.inputs[0].shape[-2], op.inputs[1].shape[-2]
        if kept.all():
            causal = bool(op.attrs["causal"])
        elif isinstance(sq, int) and isinstance(sk, int) and not op.attrs["causal"]:
            full = np.broadcast_to(kept, (*kept.shape[:-2], sq, sk)) if kept.ndim >= 2 else None
            if full is None or not np.array_equal(full, np.broadcast_to(np.tri(sq, sk, dtype=bool), full.shape)):
                continue
            causal = True
        else:
            continue
        attrs = {**op.attrs, "causal": causal}
        drop.append(op)
        new.append(Operator(op.kind, op.inputs[:3], list(op.outputs), attrs, op.name))
    if new:
        rewrite(graph, drop, new)
    return len(new)
