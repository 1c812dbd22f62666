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
from tessera.graph.passes.pattern import Bound, Match, Op, Rule, rewrite_with
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


def _swaps_heads(permute: Operator) -> bool:
    return permute.inputs[0].ndim == 4 and list(permute.attrs.get("perm", ())) == _SWAP


def _split(m: Match) -> Operator | None:
    """split_heads for permute(reshape(columns of x, [B, S, H, D]), [0, 2, 1, 3])."""
    piece, heads = m["piece"], m["heads"]
    b, s, h, d = heads.shape
    if piece.ndim != 3 or not (isinstance(h, int) and isinstance(d, int)) or tuple(piece.shape) != (b, s, h * d):
        return None
    cut = piece.producer is not None and piece.producer.kind in ("split", "slice")
    if cut and m.uses.only_user(piece) is not m.op("heads"):
        return None
    found = _column_source(piece)
    if found is None:
        return None
    attrs = {"heads": h, "head_dim": d, "offset": found[1]}
    return Operator("split_heads", [found[0]], [m.root.outputs[0]], attrs, m.root.name)


def _merge(m: Match) -> Operator | None:
    """merge_heads for reshape(permute(y [B, H, S, D], [0, 2, 1, 3]), [B, S, H * D])."""
    y, out = m["y"], m.root.outputs[0]
    b, h, s, d = y.shape
    if tuple(out.shape) != (b, s, h * d):
        return None
    return Operator("merge_heads", [y], [out], {}, m.root.name)


RULES = (Rule(Op("permute", Op("reshape", Bound("piece"), name="heads"), where=_swaps_heads), _split),
         Rule(Op("reshape", Op("permute", Bound("y"), where=_swaps_heads)), _merge))  # fmt: skip


def head_views(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of head splits and merges rewritten."""
    return rewrite_with(graph, RULES)
