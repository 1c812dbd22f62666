"""Rewrite attention written out as matmul / scale / mask / softmax / matmul into one
`scaled_dot_product_attention` operator.

Eager attention (transformers' "eager" implementation, ONNX exports of any attention) is

    s = q @ kT                   kT = k with its last two axes swapped (usually permutes)
    s = s * c  or  s / c         optional; a scalar on q and/or kT instead counts the same
    s = s + mask                 optional float mask, broadcast to s's shape
      or where(keep, s, -inf)    optional bool mask (or where(drop, -inf, s))
    out = softmax(s, -1) @ v

which is softmax(q k^T * scale + mask) v, the graph op's definition, with scale = c (1/c,
or 1 without a scale: the op's own default 1/sqrt(d) applies only when it is left None).
The operator runs on the attention anchor (the fused flash kernel on an SM90 GPU): the
[.., Sq, Sk] scores never go through memory in half precision, and three kernels become one.
Scores are computed in float32 there, so half-precision results differ from the written-out
chain by its rounding only.  A fully masked row is NaN both ways (a -inf where-mask), or the
same average of v both ways (a finite additive mask such as finfo.min).

Applies when every intermediate has no other use, q, k and v have equal batch axes (no
broadcasting) and one float dtype, and the mask does not widen the scores' shape.  k is
rebuilt from kT by composing the swap into the permute that made kT (often cancelling it).
"""

from __future__ import annotations

import math

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes._match import Uses, other_input, rewrite, scalar, scalar_operand
from tessera.graph.symbolic import ShapeError
from tessera.graph.tensor import Tensor


class _Match:
    def __init__(self) -> None:
        self.ops: list[Operator] = []  # the chain's operators, all removed by the rewrite
        self.new: list[Operator] = []  # operators the rewrite adds besides the attention
        self.scale = 1.0
        self.mask: Tensor | None = None


def _unscaled(t: Tensor, m: _Match, uses: Uses) -> Tensor:
    """t without a single-use scalar multiply or divide in front of it (folded into m.scale)."""
    op = t.producer
    for kind in ("mul", "div"):
        found = scalar_operand(op, kind)
        if found is not None and found[1] != 0 and math.isfinite(found[1]) and uses.only_user(t) is not None:
            m.scale *= found[1] if kind == "mul" else 1.0 / found[1]
            m.ops.append(op)
            return found[0]
    return t


def _scores(t: Tensor, m: _Match, uses: Uses) -> Operator | None:
    """The q @ kT matmul behind t (through an optional scale), or None."""
    base = _unscaled(t, m, uses)
    mm = base.producer
    if mm is None or mm.kind != "matmul" or uses.only_user(base) is None:
        return None
    m.ops.append(mm)
    return mm


def _masked_scores(s: Tensor, m: _Match, uses: Uses) -> Operator | None:
    """Match the optional mask in front of the softmax, then the scores."""
    op = s.producer
    if op is not None and op.kind == "add" and uses.only_user(s) is not None:
        for cand in op.inputs:
            mask = other_input(op, cand)
            trial = _Match()
            trial.ops.append(op)
            if mask is not None and mask.dtype == s.dtype and (mm := _scores(cand, trial, uses)) is not None:
                m.ops += trial.ops
                m.scale, m.mask = trial.scale, mask
                return mm
    if op is not None and op.kind == "where" and uses.only_user(s) is not None and op.inputs[0].dtype.is_bool:
        cond, a, b = op.inputs
        for scores, fill, keep_true in ((a, b, True), (b, a, False)):
            if scalar(fill) == -math.inf and uses.only_user(scores) is op:
                trial = _Match()
                trial.ops.append(op)
                if (mm := _scores(scores, trial, uses)) is not None:
                    m.ops += trial.ops
                    m.scale, m.mask = trial.scale, cond
                    if not keep_true:
                        keep = Operator.create("logical_not", [cond], name=op.name + "_keep")
                        m.new.append(keep)
                        m.mask = keep.outputs[0]
                    return mm
        return None
    return _scores(s, m, uses)


def _untransposed(kt: Tensor, m: _Match, uses: Uses) -> Tensor:
    """k ([.., Sk, D]) from kT ([.., D, Sk]): the swap composed into kT's permute if it has one."""
    n = kt.ndim
    swap = list(range(n - 2)) + [n - 1, n - 2]
    op = kt.producer
    if op is not None and op.kind == "permute" and uses.only_user(kt) is not None:
        perm = [p % n for p in op.attrs["perm"]]
        composed = [perm[i] for i in swap]
        m.ops.append(op)
        if composed == list(range(n)):
            return op.inputs[0]
        new = Operator.create("permute", [op.inputs[0]], {"perm": composed}, name=op.name + "_k")
    else:
        new = Operator.create("permute", [kt], {"perm": swap}, name=f"{kt.name}_k")
    m.new.append(new)
    return new.outputs[0]


def _match(softmax: Operator, uses: Uses) -> tuple[Operator, _Match] | None:
    s = softmax.inputs[0]
    if s.ndim < 2 or softmax.attrs["axis"] % s.ndim != s.ndim - 1 or not s.dtype.is_float:
        return None
    pv = uses.only_user(softmax.outputs[0])
    if pv is None or pv.kind != "matmul" or pv.inputs[0] is not softmax.outputs[0]:
        return None
    m = _Match()
    mm = _masked_scores(s, m, uses)
    if mm is None:
        return None
    m.ops += [softmax, pv]
    q = _unscaled(mm.inputs[0], m, uses)
    kt = _unscaled(mm.inputs[1], m, uses)
    v = pv.inputs[1]
    rank = q.ndim
    if not (rank >= 2 and kt.ndim == rank and v.ndim == rank and mm.outputs[0].ndim == rank):
        return None
    if not (q.shape[:-2] == kt.shape[:-2] == v.shape[:-2]) or not (q.dtype == kt.dtype == v.dtype == s.dtype):
        return None
    if m.mask is not None and (m.mask.ndim > rank or m.mask.ndim == 0):
        return None
    if not math.isfinite(m.scale) or m.scale == 0:
        return None
    k = _untransposed(kt, m, uses)
    inputs = [q, k, v] + ([m.mask] if m.mask is not None else [])
    try:
        probe = Operator.create("scaled_dot_product_attention", inputs, {"causal": False, "scale": m.scale})
    except ShapeError:
        return None
    out = pv.outputs[0]
    if probe.outputs[0].shape != out.shape or probe.outputs[0].dtype != out.dtype:
        return None
    return Operator("scaled_dot_product_attention", inputs, [out], probe.attrs, pv.name), m


def fuse_attention(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of attention chains turned into one operator."""
    uses = Uses(graph)
    drop: list[Operator] = []
    new: list[Operator] = []
    taken: set[Operator] = set()
    for op in list(graph.operators):
        if op.kind != "softmax":
            continue
        found = _match(op, uses)
        if found is None or taken.intersection(found[1].ops):
            continue
        attention, m = found
        taken.update(m.ops)
        drop += m.ops
        new += [*m.new, attention]
    if new:
        rewrite(graph, drop, new)
    return sum(1 for op in new if op.kind == "scaled_dot_product_attention")
