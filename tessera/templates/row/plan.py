"""Row anchors: layer norm, RMS norm and softmax over the last axis on the tuned row kernels
(tessera.templates.row.norm / reduce, with the schedule tessera.templates.row.kinds picks for the
row length), the elementwise tail after them (a cast, a scale, ...) fused into their stores.

The kernel reads x as [R, C] rows: the caller's x [..., C] is remapped in place (no copy), and
the stores into y [R, C] go through the epilogue into the caller's output, which keeps the
kernel's 16-byte vector stores when the rows are 16-byte aligned (C * itemsize % 16 == 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.templates.epilogue import Epilogue, fuse_epilogue, identity_epilogue
from tessera.templates.gemm.plan import check_epilogue, check_shape
from tessera.templates.kernel import EXTRA, INPUT, LITERAL, OUTPUT, AnchorKernel, AnchorPlan, Launch
from tessera.templates.rewrite import remap_operand, rename, specialize, unravel
from tessera.templates.row.kinds import kernel_for

ROW_OPS = {"layer_norm": ("layernorm", 3), "rms_norm": ("rmsnorm", 2), "softmax": ("softmax", 1)}
ROW_DTYPES = (dtypes.float16, dtypes.bfloat16, dtypes.float32)
INT32_ELEMS = 2**31 - 1


def plan_row(op: str, x_shape: Sequence[int], dtype: DataType | str, *, eps: float = 1e-5,
             epilogue: Epilogue | None = None) -> AnchorPlan:  # fmt: skip
    """The plan of a row operator over the last axis of x: "layer_norm" (inputs x, weight, bias),
    "rms_norm" (x, weight) or "softmax" (x); parameters have shape [C]."""
    if op not in ROW_OPS:
        raise UnsupportedError(f"no row kernel for {op!r}; row kernels run {sorted(ROW_OPS)}")
    kernel_op, num_inputs = ROW_OPS[op]
    dt = dtypes.dtype(dtype)
    if dt not in ROW_DTYPES:
        raise UnsupportedError(f"{op}: the row kernels take float16, bfloat16 or float32, not {dt}")
    x_shape = check_shape(x_shape, "x", op)
    if not x_shape:
        raise ArgumentError(f"{op}: x must have at least one axis (the row)")
    lead, c = x_shape[:-1], x_shape[-1]
    rows = prod(lead)
    if rows * c > INT32_ELEMS:
        raise UnsupportedError(f"{op}: {rows} x {c} elements exceed the row kernels' int32 indexing")
    check_epilogue(epilogue, x_shape, op)

    vector = (c * dt.nbytes) % 16 == 0
    f = kernel_for(kernel_op, f"torch.{dt.name}", c, vector).ir
    shapes = {"x": (rows, c), "y": (rows, c)}
    shapes.update({name: (c,) for name in ("w", "b")[: num_inputs - 1]})
    f = specialize(f, shapes)
    index = lambda r, col: (*unravel(r, lead), col)  # noqa: E731
    f = remap_operand(f, "x", x_shape, index)
    ep = epilogue or identity_epilogue(x_shape, dt)
    f = rename(fuse_epilogue(f, "y", index, ep, row_major=True), f"{kernel_op}_{f.name}")
    extras = len(epilogue.extras) if epilogue else 0
    slots = [(INPUT, i) for i in range(num_inputs)] + [(OUTPUT, 0)]
    slots += [(LITERAL, float(eps))] if kernel_op != "softmax" else []  # type: ignore[list-item]
    slots += [(EXTRA, j) for j in range(extras)]
    plan = AnchorPlan(op, [], x_shape, ep.output.dtype, num_inputs, extras)
    # The order of the kernel's parameters: x, (w, b), y, (eps), then the epilogue's extras.
    plan.launches.append(Launch(f, slots))
    if vector:
        plan.aligned_inputs = list(range(num_inputs))
        plan.aligned_output = True
    plan.config = kernel_for(kernel_op, f"torch.{dt.name}", c, vector).ir.name
    return plan


def prepare_row(op: str, x_shape: Sequence[int], dtype: DataType | str, *, eps: float = 1e-5,
                epilogue: Epilogue | None = None) -> AnchorKernel:  # fmt: skip
    """layer norm / RMS norm / softmax over the last axis on the tuned row kernels, epilogue fused.
    Call as ``kernel([x, weight, bias] | [x, weight] | [x], out, extras)`` on CUDA tensors."""
    return plan_row(op, x_shape, dtype, eps=eps, epilogue=epilogue).load()
