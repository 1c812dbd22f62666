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
from tessera.graph.passes._match import scalar
from tessera.graph.passes.pattern import Bound, Match, Op, Pattern, Rule, Scalar, any_of, rewrite_with
from tessera.graph.tensor import Tensor


def _exact_up_cast(cast: Operator) -> bool:
    """A cast of a float to a wider float (every value kept)."""
    src, dst = cast.inputs[0].dtype, cast.outputs[0].dtype
    return src.is_float and dst.is_float and src.nbits < dst.nbits and (src.mantissa_bits or 0) < (dst.mantissa_bits or 0)


def _last_axes_kept(mean: Operator) -> bool:
    """A mean over the last k >= 1 axes, with keepdim."""
    rank = mean.inputs[0].ndim
    axes = norm_axes(mean.attrs.get("axes"), rank)
    return bool(mean.attrs.get("keepdim")) and len(axes) > 0 and axes == tuple(range(rank - len(axes), rank))


def _eps(t: Tensor) -> bool:
    v = scalar(t)
    return v is not None and v >= 0


def _norm(xf: Pattern) -> Pattern:
    """y = nx * rsqrt(mean(xf^2) + eps) or nx / sqrt(...), where the builder checks that nx is xf
    or (T5) the x that xf up-casts."""
    ms = Op("reduce_mean", any_of(Op("pow", xf, Scalar(2.0, exact=True)), xf * xf), name="mean", where=_last_axes_kept)
    ms = ms + Bound("eps", where=_eps)
    nx = Bound("nx")
    return any_of((nx * Op("rsqrt", ms)).named("y"), (nx / Op("sqrt", ms)).named("y"))


def _with_tail(y: Pattern) -> Pattern:
    """y, then a weight multiply (its operands of one dtype) and a cast to a float, either, both
    in either order, or neither: the longest first."""
    w = Bound("w")

    def cast(p: Pattern) -> Pattern:
        return Op("cast", p, where=lambda op: op.outputs[0].dtype.is_float)

    def times_w(p: Pattern) -> Pattern:
        return Op("mul", p, w, where=lambda op: op.inputs[0].dtype == op.inputs[1].dtype)

    return any_of(cast(times_w(y)), times_w(cast(y)), times_w(y), cast(y), y)


def _build(m: Match) -> Operator | None:
    xf, nx, y, out, w = m["xf"], m["nx"], m["y"], m.root.outputs[0], m.get("w")
    up = xf.producer
    x = up.inputs[0] if isinstance(up, Operator) and up.kind == "cast" and _exact_up_cast(up) else None
    k = len(norm_axes(m.op("mean").attrs.get("axes"), xf.ndim))
    if not xf.dtype.is_float or nx not in (xf, x) or y.dtype != xf.dtype or tuple(y.shape) != tuple(xf.shape):
        return None
    if w is not None and tuple(w.shape) != tuple(xf.shape[xf.ndim - k :]):
        return None
    src = x if x is not None and x.dtype == out.dtype else xf  # x itself, when the result has its dtype
    if src.dtype != out.dtype or (w is not None and w.dtype != out.dtype):
        return None  # rms_norm keeps its input's dtype: a shorter tail (a root further up) may fit
    attrs = {"num_axes": k, "eps": float(scalar(m["eps"]) or 0.0)}
    return Operator("rms_norm", [src] + ([w] if w is not None else []), [out], attrs, m.op("y").name)


# the up-cast goes with the norm when only the norm reads it; else xf is any tensor (the cast stays)
RULES = (Rule(_with_tail(_norm(Op("cast", Bound(), name="xf", where=_exact_up_cast))), _build),
         Rule(_with_tail(_norm(Bound("xf"))), _build))  # fmt: skip


def fuse_rms_norm(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of RMS norms turned into rms_norm operators."""
    return rewrite_with(graph, RULES)
