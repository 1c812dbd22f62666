"""Rewrite the head split and merge around attention into `split_heads` / `merge_heads`.

Every transformer writes, around its attention,
    q = permute(reshape(split(qkv)[i], [B, S, H, D]), [0, 2, 1, 3])     -> split_heads(qkv, offset=...)
    y = reshape(permute(attn, [0, 2, 1, 3]), [B, S, H * D])             -> merge_heads(attn)
(the split is absent when q has a projection of its own, or a slice of the columns).  As reshapes and permutes these are
copies: kernels of their own before and after attention.  As one operator each, the GPU
attention anchor takes them into its own loads and stores (`templates/attention`: its TMA
maps read the heads straight from the projection's output through strides, and it writes its
output in [B, S, H * D] order), so the copies vanish; elsewhere they lower to the same
injective computations as before.  Every intermediate must have no other use.
"""

from __future__ import annotations

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.opdefs.shape import slice_window
from tessera.graph.operator import Operator
from tessera.graph.passes._match import Uses, rewrite
from tessera.graph.tensor import Tensor

_SWAP = [0, 2, 1, 3]


def _last_axis(op: Operator) -> bool:
    return op.attrs.get("axis") in (-1, op.inputs[0].ndim - 1)


def _column_source(t: Tensor) -> tuple[Tensor, int] | None:
    """(x, first column) when t is x itself or a piece of a split of x along its last axis, or
    a unit-step slice of x's columns (Phi-3's fused projection)."""
    p = t.producer
    if p is not None and p.kind == "split" and _last_axis(p):
        sizes = [t2.shape[-1] for t2 in p.outputs]
        k = p.outputs.index(t)
        return (p.inputs[0], sum(sizes[:k])) if all(isinstance(s, int) for s in sizes[:k]) else None
    if p is not None and p.kind == "slice" and _column_slice(p):
        first, _ = slice_window(p.inputs[0].shape[-1], p.attrs["starts"][0], p.attrs["ends"][0], 1)
        return (p.inputs[0], first) if isinstance(first, int) else None
    return t, 0


def _column_slice(op: Operator) -> bool:
    """A slice of the last axis alone, with step 1."""
    x = op.inputs[0]
    axes, steps = list(op.attrs["axes"]), op.attrs.get("steps") or [1]
    return len(axes) == 1 and axes[0] in (-1, x.ndim - 1) and list(steps) == [1]


def _split_chain(permute: Operator, uses: Uses) -> tuple[Operator, list[Operator]] | None:
    """split_heads for permute(reshape(columns of x, [B, S, H, D]), [0, 2, 1, 3])."""
    if list(permute.attrs.get("perm", ())) != _SWAP or permute.inputs[0].producer is None:
        return None
    reshape = permute.inputs[0].producer
    if reshape.kind != "reshape" or uses.only_user(reshape.outputs[0]) is not permute:
        return None
    piece = reshape.inputs[0]
    b, s, h, d = reshape.outputs[0].shape
    if piece.ndim != 3 or not (isinstance(h, int) and isinstance(d, int)) or tuple(piece.shape) != (b, s, h * d):
        return None
    if piece.producer is not None and piece.producer.kind in ("split", "slice") and uses.only_user(piece) is not reshape:
        return None
    found = _column_source(piece)
    if found is None:
        return None
    x, offset = found
    attrs = {"heads": h, "head_dim": d, "offset": offset}
    return Operator("split_heads", [x], [permute.outputs[0]], attrs, permute.name), [reshape, permute]


def _merge_chain(permute: Operator, uses: Uses) -> tuple[Operator, list[Operator]] | None:
    """merge_heads for reshape(permute(y [B, H, S, D], [0, 2, 1, 3]), [B, S, H * D])."""
    if list(permute.attrs.get("perm", ())) != _SWAP:
        return None
    reshape = uses.only_user(permute.outputs[0])
    if reshape is None or reshape.kind != "reshape":
        return None
    b, h, s, d = permute.inputs[0].shape
    if tuple(reshape.outputs[0].shape) != (b, s, h * d):
        return None
    return Operator("merge_heads", [permute.inputs[0]], [reshape.outputs[0]], {}, reshape.name), [permute, reshape]


def head_views(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of head splits and merges rewritten."""
    uses = Uses(graph)
    drop: list[Operator] = []
    new: list[Operator] = []
    taken: set[Operator] = set()
    for op in graph.operators:
        if op.kind != "permute" or op.inputs[0].ndim != 4:
            continue
        found = _split_chain(op, uses) or _merge_chain(op, uses)
        if found is None or taken.intersection(found[1]):
            continue
        taken.update(found[1])
        drop += found[1]
        new.append(found[0])
    if new:
        rewrite(graph, drop, new)
    return len(new)
