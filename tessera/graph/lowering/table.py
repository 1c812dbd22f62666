"""The lowering table (op kind -> rule), `lowering_error` and `lower_operator`.

Every registered op kind is either in LOWERINGS or in NOT_LOWERED with the reason; the test
suite checks that, so a newly registered kind cannot go missing silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tessera.errors import TesseraError
from tessera.graph.lowering import elementwise as ew
from tessera.graph.lowering import nn, onnx_ops, programs, reduce, shape
from tessera.graph.lowering.core import Ctx, LoweringError
from tessera.graph.operator import Operator
from tessera.ir import expr as E
from tessera.ir.compute import TensorNode
from tessera.ops.common import SUPPORTED


@dataclass(frozen=True)
class Lowering:
    """How one op kind lowers: `rule(ctx)` returns the output nodes; `check(op)` gives the reason
    an operator of that kind cannot be lowered (attributes, dtypes), or None."""

    rule: Callable[[Ctx], list[TensorNode]]
    check: Callable[[Operator], str | None] | None = None


_U = Lowering(ew.unary)
_ARITH, _CMP = Lowering(ew.arith, ew.check_arith), Lowering(ew.compare)
_RED = Lowering(reduce.reduce_axes)
_POOL = Lowering(nn.max_pool2d, nn.check_pool)

LOWERINGS: dict[str, Lowering] = {
    # elementwise: unary math and activations
    "exp": _U, "log": _U, "sqrt": _U, "rsqrt": _U, "sin": _U, "cos": _U, "tan": _U, "tanh": _U,
    "sigmoid": _U, "silu": _U, "erf": _U, "reciprocal": _U, "softplus": _U, "log1p": _U, "expm1": _U,
    "mish": _U, "hardsigmoid": _U, "hardswish": _U, "logical_not": _U, "isnan": _U, "identity": _U,
    "neg": _U, "abs": _U, "relu": _U, "sign": _U, "floor": _U, "ceil": _U, "round": _U,
    "gelu": Lowering(ew.gelu, ew.check_gelu),
    "leaky_relu": Lowering(ew.leaky_relu, ew.check_float_input),
    "elu": Lowering(ew.elu, ew.check_float_input),
    "clamp": Lowering(ew.clamp, ew.check_clamp),
    "cast": Lowering(ew.cast_op),
    # elementwise: binary and ternary
    "add": _ARITH, "sub": _ARITH, "mul": _ARITH, "maximum": _ARITH, "minimum": _ARITH, "pow": _ARITH,
    "remainder": _ARITH, "bitwise_and": _ARITH, "bitwise_or": _ARITH,
    "eq": _CMP, "ne": _CMP, "lt": _CMP, "le": _CMP, "gt": _CMP, "ge": _CMP,
    "logical_and": _CMP, "logical_or": _CMP, "logical_xor": _CMP,
    "div": Lowering(ew.div, ew.check_div),
    "where": Lowering(ew.where),
    # operators of the ONNX front end (onnx_ops.py)
    **dict.fromkeys(onnx_ops.MATH_UNARY, Lowering(onnx_ops.math_unary)),
    "fmod": Lowering(onnx_ops.fmod, onnx_ops.check_fmod),
    "bitwise_xor": Lowering(onnx_ops.bitwise_xor, onnx_ops.check_integer),
    "bitshift": Lowering(onnx_ops.bitshift, onnx_ops.check_unsigned),
    "gather_nd": Lowering(onnx_ops.gather_nd),
    "bitcast": Lowering(onnx_ops.bitcast),
    "cumprod": Lowering(onnx_ops.cumprod, onnx_ops.check_cumprod),
    # written as statements (tessera.ops.programs), and pooling with indices
    "scatter_elements": Lowering(programs.scatter_elements, programs.check_scatter),
    "scatter_nd": Lowering(programs.scatter_nd, programs.check_scatter),
    "index_copy": Lowering(programs.index_copy, programs.check_scatter),
    "topk": Lowering(programs.topk, programs.check_topk),
    "det": Lowering(programs.det, programs.check_det),
    "max_pool_with_indices": Lowering(programs.max_pool_with_indices, programs.check_max_pool_with_indices),
    # reductions and normalizations
    "reduce_sum": _RED, "reduce_mean": _RED, "reduce_max": _RED, "reduce_min": _RED, "reduce_prod": _RED,
    "argmax": Lowering(reduce.arg_reduce), "argmin": Lowering(reduce.arg_reduce),
    "cumsum": Lowering(reduce.cumsum, reduce.check_cumsum),
    "softmax": Lowering(reduce.softmax, reduce.check_float_input),
    "log_softmax": Lowering(reduce.softmax, reduce.check_float_input),
    "layer_norm": Lowering(reduce.layer_norm, reduce.check_float_input),
    "rms_norm": Lowering(reduce.rms_norm, reduce.check_float_input),
    "batch_norm": Lowering(reduce.batch_norm, reduce.check_float_input),
    # anchors and pooling
    "matmul": Lowering(nn.matmul, nn.check_matmul),
    "linear": Lowering(nn.linear, nn.check_matmul),
    "conv2d": Lowering(nn.conv2d, nn.check_conv2d),
    "scaled_dot_product_attention": Lowering(nn.attention, nn.check_attention),
    "max_pool2d": _POOL,
    "avg_pool2d": Lowering(nn.avg_pool2d, nn.check_pool),
    "adaptive_avg_pool2d": Lowering(nn.adaptive_avg_pool2d, nn.check_adaptive),
    # data movement
    "reshape": Lowering(shape.reshape),
    "flatten": Lowering(shape.flatten),
    "permute": Lowering(shape.permute),
    "split_heads": Lowering(shape.split_heads),
    "merge_heads": Lowering(shape.merge_heads),
    "squeeze": Lowering(shape.squeeze),
    "unsqueeze": Lowering(shape.unsqueeze),
    "expand": Lowering(shape.expand),
    "tile": Lowering(shape.tile, shape.check_static_attrs("repeats")),
    "flip": Lowering(shape.flip),
    "tril": Lowering(shape.tri),
    "triu": Lowering(shape.tri),
    "slice": Lowering(shape.slice_op, shape.check_slice),
    "concat": Lowering(shape.concat),
    "split": Lowering(shape.split),
    "pad": Lowering(shape.pad, shape.check_static_attrs("pads", "value")),
    "take": Lowering(shape.take),
    "gather_elements": Lowering(shape.gather_elements),
    # sources
    "full": Lowering(shape.full),
    "arange": Lowering(shape.arange, shape.check_arange),
}  # fmt: skip

# Registered kinds that are deliberately not lowered, with the reason the user sees.
NOT_LOWERED: dict[str, str] = {
    "lowbit_linear": "lowbit_linear runs on its anchors only (the CUDA decode kernel for float16 x, the CPU row "
    "kernels for float32 x); other dtypes, a CPU without AVX2, or on the CPU a group size other than 8 to 256 "
    "dividing 256, a multiple of 256 or per channel, on its reference",
    "fused_moe": "fused_moe runs on its anchor only (tessera.templates.moe: float32 on the CPU); elsewhere on its "
    "reference",
}


def lowering_error(op: Operator) -> str | None:
    """None when `lower_operator` can lower op (its kind, dtypes and attributes), else a short reason."""
    rule = LOWERINGS.get(op.kind)
    if rule is None:
        return NOT_LOWERED.get(op.kind, f"{op.kind} is not lowered yet")
    for t in [*op.inputs, *op.outputs]:
        if t.dtype not in SUPPORTED:
            return f"dtype {t.dtype} ({t.name}) is not supported by tessera.ops"
        if any(isinstance(d, int) and d == 0 for d in t.shape):
            return f"{t.name} is empty (shape {t.type_str()}); tessera.ops has no empty tensors"
    try:
        op.opdef.normalize_attrs(op.attrs)
        return rule.check(op) if rule.check is not None else None
    except (TesseraError, ValueError, TypeError) as exc:
        return f"invalid operator: {exc}"


def lower_operator(op: Operator, inputs: Sequence[TensorNode], symbols: dict[str, E.Expr], *,
                   inline_scalars: bool = False) -> list[TensorNode]:  # fmt: skip
    """Compute definitions of op's outputs (graph shapes and dtypes) from nodes for its inputs.

    `inputs` are placeholders or earlier results, one per graph input, of the same ranks;
    `symbols` maps size names to int32 Vars (shared by every operator of one build; sizes that
    attributes name and no input carries are created there, and the built op must be given
    their values) or to int32 constants when the caller lowers for known sizes.  With `inline_scalars`, rank-0
    constant inputs are folded in as numbers (pow(x, 2) becomes x * x) -- only when the caller
    does not reuse the result for other constant values.  Raises LoweringError (a TesseraError)
    when op cannot be lowered."""
    reason = lowering_error(op)
    if reason is not None:
        raise LoweringError(f"{op.name} ({op.kind}): {reason}")
    try:
        return LOWERINGS[op.kind].rule(Ctx(op, inputs, symbols, inline_scalars))
    except LoweringError:
        raise
    except (TesseraError, E.IRTypeError) as exc:
        raise LoweringError(f"{op.name} ({op.kind}): {exc}") from exc
