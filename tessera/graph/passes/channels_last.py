"""Channels-last convolutions: conv2d from NCHW to NHWC, with the layout changes sunk through
elementwise chains so that they cancel between consecutive convolutions.

Why: in NHWC a convolution is one row-major GEMM over all pixels (out[pixel, o] =
col[pixel, :] @ W[o, :], col = x itself for a 1x1 stride-1 conv), which the GPU's TMA GEMM
reads whole, and each im2col row is kh*kw contiguous runs of C channels.  In NCHW the pixel
axis is innermost: the GEMM operands must be gathered.  The compiler runs this pass for the
GPU only (compile_graph with target "cuda"); the x86 convolution reads NCHW.

The rewrite walks the operators in topological order, keeping `nhwc[t]`, a tensor that holds
the NCHW tensor t in NHWC:

* a convertible conv2d (fp16/bf16, groups 1) reads nhwc[x] (a permute of x when there is
  none), its weight permuted to OHWI (at compile time when constant), and writes y';
* an elementwise operator whose 4-D operands all have NHWC forms (other operands: constants,
  permuted here, or rank-0 tensors) runs on those forms, writing out';
* max/average pooling (and adaptive average pooling) of a tensor with an NHWC form pools it
  in NHWC (layout attribute), so a stem -> pool -> conv chain never leaves NHWC.
The original output (y, out) is then produced by permute(y', (0, 3, 1, 2)), so every other
reader still sees NCHW: a reduction reads the permute, which fuses into its kernel as an
index map.  Back-permutes that nobody reads any more are dropped by dead-code
elimination; a chain conv -> bias/activation/residual add -> conv never leaves NHWC.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes.dead_code import eliminate_dead_code
from tessera.graph.tensor import Tensor
from tessera.ir import dtypes

TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
# Elementwise operators whose parameters follow axis 1 (not numpy broadcasting): they stay NCHW.
_CHANNEL_AXIS_OPS = frozenset({"batch_norm"})
# Pooling that runs on NHWC as well (layout attribute): it keeps a chain of convolutions in NHWC.
_POOLS = frozenset({"max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"})


def tensor_core_conv(op: Operator) -> bool:
    """The convolutions the GPU runs as GEMMs on tensor cores: fp16/bf16, groups 1, static channels."""
    if op.kind != "conv2d" or op.attrs.get("layout", "NCHW") != "NCHW" or op.attrs.get("groups", 1) != 1:
        return False
    x, w = op.inputs[0], op.inputs[1]
    return (x.ndim == 4 and w.ndim == 4 and x.dtype in (dtypes.float16, dtypes.bfloat16)
            and all(t.dtype == x.dtype for t in op.inputs) and all(isinstance(d, int) for d in (x.shape[1], *w.shape)))  # fmt: skip


def to_channels_last(graph: FlowGraph, convertible: Callable[[Operator], bool] = tensor_core_conv) -> int:
    """Rewrite in place; returns the number of convolutions moved to NHWC."""
    nhwc: dict[Tensor, Tensor] = {}
    ops: list[Operator] = []
    converted = 0

    def permuted(t: Tensor, perm: list[int]) -> Tensor:
        op = Operator.create("permute", [t], {"perm": perm}, name=f"{t.name or 'x'}_nhwc")
        ops.append(op)
        return op.outputs[0]

    def as_nhwc(t: Tensor) -> Tensor:
        if t not in nhwc:
            nhwc[t] = permuted(t, TO_NHWC)
        return nhwc[t]

    def replace(old: Operator, new: Operator) -> None:
        """new computes old's output in NHWC; old's output becomes the permute back."""
        ops.append(new)
        out = old.outputs[0]
        ops.append(Operator("permute", [new.outputs[0]], [out], {"perm": list(TO_NCHW)}, f"{old.name}_nchw"))
        nhwc[out] = new.outputs[0]

    for op in graph.operators:
        if convertible(op):
            x, w, *bias = op.inputs
            if w.is_constant and w.producer is None:
                w_nhwc = Tensor.constant(np.ascontiguousarray(w.data.transpose(TO_NHWC)), name=f"{w.name or 'w'}_ohwi")
            else:
                w_nhwc = permuted(w, TO_NHWC)
            replace(op, Operator.create("conv2d", [as_nhwc(x), w_nhwc, *bias], {**op.attrs, "layout": "NHWC"},
                                        name=f"{op.name}_nhwc"))  # fmt: skip
            converted += 1
            continue
        if op.kind in _POOLS and op.inputs[0] in nhwc and op.attrs.get("layout", "NCHW") == "NCHW":
            replace(op, Operator.create(op.kind, [nhwc[op.inputs[0]]], {**op.attrs, "layout": "NHWC"},
                                        name=f"{op.name}_nhwc"))  # fmt: skip
            continue
        operands = _elementwise_operands(op, nhwc)
        if operands is not None:
            replace(op, Operator.create(op.kind, operands, dict(op.attrs), name=f"{op.name}_nhwc"))
            continue
        ops.append(op)
    if converted:
        graph.set_operators(ops)
        eliminate_dead_code(graph)
    return converted


def _elementwise_operands(op: Operator, nhwc: dict[Tensor, Tensor]) -> list[Tensor] | None:
    """op's operands in NHWC when op is elementwise over a 4-D output and at least one operand
    already has an NHWC form; None when op must stay as it is."""
    if op.opdef.category != "elementwise" or op.kind in _CHANNEL_AXIS_OPS or len(op.outputs) != 1 or op.outputs[0].ndim != 4:
        return None
    if not any(t in nhwc for t in op.inputs):
        return None
    out: list[Tensor] = []
    for t in op.inputs:
        if t in nhwc:
            out.append(nhwc[t])
        elif t.ndim == 0:
            out.append(t)
        elif t.is_constant and t.producer is None and t.ndim <= 4:
            data = t.data.reshape((1,) * (4 - t.ndim) + tuple(t.data.shape))
            out.append(Tensor.constant(np.ascontiguousarray(data.transpose(TO_NHWC)), name=f"{t.name or 'c'}_nhwc"))
        else:
            return None
    return out
