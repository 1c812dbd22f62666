"""Rewrite RMS norm written out as elementwise ops and a mean into one `rms_norm` operator.

Front ends that trace a model's own code (the torch front end on ATen: `_fused_rms_norm` has
no fake kernel, so HF Llama/Mistral/Qwen/T5 norms arrive decomposed; ONNX exports) write
    xf = cast(x, float32)                      (optional: the up-cast of a float16/bf16 x)
    y  = xf * rsqrt(mean(xf^2, last axes, keepdim) + eps)    or  xf / sqrt(...)   (T5: x * ..., promoted)
    y  = w * cast(y, x.dtype)                  (optional, in either order: weight, down-cast)
as six to nine ops.  The generic scheduler runs them as one reduction kernel; `rms_norm`
(weight of x's dtype, last axis) runs on the GPU's tuned row kernel instead, and the up-cast
stays out of the graph.  x^2 may be pow(xf, 2) or xf * xf; every intermediate must have no
other use.

Semantics: `rms_norm` computes in float32 and rounds once; the written-out float16 form rounds
the normalised value to float16 before the weight multiplies it.  The results differ by at
most about one unit in the last place of the output dtype (as fuse_gelu's do).
"""

from __future__ import annotations

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.opdefs._common import norm_axes
from tessera.graph.operator import Operator
from tessera.graph.passes._match import Uses, other_input, rewrite, scalar, scalar_operand
from tessera.graph.tensor import Tensor


def _square_of(t: Tensor) -> Tensor | None:
    """x for t = pow(x, 2) or t = x * x, else None."""
    p = t.producer
    if p is None:
        return None
    if p.kind == "pow" and len(p.inputs) == 2 and scalar(p.inputs[1]) == 2.0:
        return p.inputs[0]
    if p.kind == "mul" and len(p.inputs) == 2 and p.inputs[0] is p.inputs[1]:
        return p.inputs[0]
    return None


def _exact_up_cast(cast: Operator) -> bool:
    """A cast of a float to a wider float (every value kept)."""
    src, dst = cast.inputs[0].dtype, cast.outputs[0].dtype
    return src.is_float and dst.is_float and src.nbits < dst.nbits and (src.mantissa_bits or 0) < (dst.mantissa_bits or 0)


def _core(mean: Operator, uses: Uses) -> tuple[Tensor, Tensor, int, float, list[Operator]] | None:
    """For mean = reduce_mean(xf^2) over the last k axes, followed by + eps, rsqrt and * xf (or
    sqrt and xf / ...): (xf, the normalised tensor, k, eps, the ops from the square on)."""
    sq = mean.inputs[0]
    xf = _square_of(sq)
    if xf is None or not xf.dtype.is_float or uses.only_user(sq) is not mean or not mean.attrs.get("keepdim"):
        return None
    axes = norm_axes(mean.attrs.get("axes"), xf.ndim)
    k = len(axes)
    if k == 0 or axes != tuple(range(xf.ndim - k, xf.ndim)):
        return None
    plus = uses.only_user(mean.outputs[0])
    found = scalar_operand(plus, "add")
    if found is None or found[0] is not mean.outputs[0] or found[1] < 0:
        return None
    inv = uses.only_user(plus.outputs[0])
    if inv is None or inv.kind not in ("rsqrt", "sqrt"):
        return None
    norm = uses.only_user(inv.outputs[0])
    if norm is None or len(norm.inputs) != 2:
        return None
    # the normalised tensor: xf, or (T5) the x that xf up-casts exactly, promoted by the op itself
    up = xf.producer
    same = {xf} | ({up.inputs[0]} if up is not None and up.kind == "cast" and _exact_up_cast(up) else set())
    if inv.kind == "rsqrt" and not (norm.kind == "mul" and other_input(norm, inv.outputs[0]) in same):
        return None
    if inv.kind == "sqrt" and not (norm.kind == "div" and norm.inputs[0] in same):
        return None
    y = norm.outputs[0]
    if y.dtype != xf.dtype or tuple(y.shape) != tuple(xf.shape):
        return None
    return xf, y, k, found[1], [sq.producer, mean, plus, inv, norm]


def _tail(y: Tensor, xf: Tensor, k: int, uses: Uses) -> list[tuple[Operator, Tensor | None]]:
    """Up to one weight multiply and one cast after y, in order: [(op, weight or None)]."""
    steps: list[tuple[Operator, Tensor | None]] = []
    current = y
    while len(steps) < 2:
        nxt = uses.only_user(current)
        if nxt is None or tuple(nxt.outputs[0].shape) != tuple(current.shape):
            break
        if nxt.kind == "cast" and nxt.outputs[0].dtype.is_float and not any(w is None for _, w in steps):
            steps.append((nxt, None))
        elif nxt.kind == "mul" and not any(w is not None for _, w in steps):
            w = other_input(nxt, current)
            if w is None or tuple(w.shape) != tuple(xf.shape[xf.ndim - k :]) or w.dtype != current.dtype:
                break
            steps.append((nxt, w))
        else:
            break
        current = nxt.outputs[0]
    return steps


def _source(xf: Tensor, out_dtype, uses: Uses, core: list[Operator]) -> tuple[Tensor, list[Operator]]:
    """What rms_norm reads: x when xf is an exact up-cast of x and the result is x's dtype (the
    cast goes too when nothing else reads it), else xf itself."""
    up = xf.producer
    if up is not None and up.kind == "cast" and up.inputs[0].dtype == out_dtype and _exact_up_cast(up):
        readers = uses.users.get(xf, [])
        drop = [up] if xf not in uses.outputs and all(r in core for r in readers) else []
        return up.inputs[0], drop
    return xf, []


def fuse_rms_norm(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of RMS norms turned into rms_norm operators."""
    uses = Uses(graph)
    drop: list[Operator] = []
    new: list[Operator] = []
    taken: set[Operator] = set()
    for op in graph.operators:
        if op.kind != "reduce_mean":
            continue
        found = _core(op, uses)
        if found is None:
            continue
        xf, y, k, eps, core = found
        tail = _tail(y, xf, k, uses)
        for n in range(len(tail), -1, -1):  # the longest tail whose dtypes rms_norm can keep
            out = tail[n - 1][0].outputs[0] if n else y
            weights = [w for _, w in tail[:n] if w is not None]
            x, up = _source(xf, out.dtype, uses, core)
            if x.dtype == out.dtype and all(w.dtype == out.dtype for w in weights):
                break
        chain = core + [t for t, _ in tail[:n]] + up
        if taken.intersection(chain):
            continue
        taken.update(chain)
        drop += chain
        attrs = {"num_axes": k, "eps": float(eps)}
        new.append(Operator("rms_norm", [x, *weights], [out], attrs, core[-1].name))
    if new:
        rewrite(graph, drop, new)
    return len(new)
