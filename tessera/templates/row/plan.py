"""Row anchors: layer norm, RMS norm and softmax over the last axis on the tuned row kernels
(tessera.templates.row.norm / reduce, with the schedule tessera.templates.row.kinds picks for the
row length), the elementwise tail after them (a cast, a scale, ...) fused into their stores.

The kernel reads x as [R, C] rows: the caller's x [..., C] is remapped in place (no copy), and
the stores into y [R, C] go through the epilogue into the caller's output, which keeps the
kernel's 16-byte vector stores when the rows are 16-byte aligned (C * itemsize % 16 == 0).

Under dynamic shapes (a sequence length or batch that changes per call) a row operator whose
row length C is a number runs generic in its row count (`RowGenericRows`, the template's
`generic`): the kernel reads R only in its grid and bounds, so R stays a free shape symbol,
bound from x (viewed as [R, C]) at call time, and one build serves every length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import prod

from tessera.errors import ArgumentError, UnsupportedError
from tessera.graph.tensor import Tensor
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.templates.epilogue import Epilogue, fuse_epilogue, identity_epilogue
from tessera.templates.gemm.plan import check_epilogue, check_shape
from tessera.templates.kernel import EXTRA, INPUT, LITERAL, OUTPUT, AnchorKernel, AnchorPlan, Launch
from tessera.templates.registry import AnchorSite, Shape, StepKernel, epilogue_inputs, static, symbolic_epilogue
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


class RowGenericRows:
    """One row operator site's kernel for every row count: built on the first call, launched for
    every later shape (the grid follows R; the epilogue keeps the graph's symbolic shapes)."""

    def __init__(self, site: AnchorSite):
        op = site.anchor
        self.site = site
        self.kernel_op, self.num_inputs = ROW_OPS[op.kind]
        self.dtype = op.outputs[0].dtype
        self.c = op.inputs[0].shape[-1]
        self.eps = float(op.attrs.get("eps", 1e-5))
        self._extras = epilogue_inputs(site)
        position = {t: i for i, t in enumerate(site.inputs)}
        self._operands = [position[t] for t in op.inputs]
        self._extra_positions = [position[t] for t in self._extras]
        self._kernel: AnchorKernel | None = None

    @property
    def artifacts(self) -> list[str]:
        """The kernel's cubin once built (what a saved graph ships)."""
        return [str(self._kernel.artifact)] if self._kernel is not None else []

    def bind(self, shapes: Mapping[Tensor, Shape]) -> StepKernel:
        """The step's kernel (the same one at every shape)."""
        if self._kernel is None:
            self._kernel = self.plan().load()
        return StepKernel(self._kernel, self._operands, self._extra_positions)

    def plan(self) -> AnchorPlan:
        """The uncompiled plan with the row count free (inspect `.source`)."""
        c, dt = self.c, self.dtype
        vector = (c * dt.nbytes) % 16 == 0
        f = kernel_for(self.kernel_op, f"torch.{dt.name}", c, vector).ir
        shapes: dict[str, tuple[int | None, ...]] = {"x": (None, c), "y": (None, c)}
        shapes.update({name: (c,) for name in ("w", "b")[: self.num_inputs - 1]})
        f = specialize(f, shapes)
        ep, out_shape = symbolic_epilogue(self.site)
        ep = ep or identity_epilogue(out_shape, dt)
        lead = out_shape[:-1]
        f = fuse_epilogue(f, "y", lambda r, col: (*unravel(r, lead), col), ep, row_major=True)
        f = rename(f, f"{self.kernel_op}_{f.name}_rows")
        slots = [(INPUT, i) for i in range(self.num_inputs)] + [(OUTPUT, 0)]
        slots += [(LITERAL, self.eps)] if self.kernel_op != "softmax" else []  # type: ignore[list-item]
        slots += [(EXTRA, j) for j in range(len(self._extras))]
        plan = AnchorPlan(self.site.anchor.kind, [], (), ep.output.dtype, self.num_inputs, len(self._extras))
        plan.launches.append(Launch(f, slots, generic=True))
        if vector:
            plan.aligned_inputs, plan.aligned_output = list(range(self.num_inputs)), True
        plan.config = f.name
        return plan


def row_generic(site: AnchorSite) -> RowGenericRows | None:
    """The row-generic kernel of a row operator whose row length and parameters are numbers and
    whose rows are symbolic, or None (a static site, or a symbolic row length: per shape)."""
    op = site.anchor
    x = op.inputs[0]
    if static(*site.inputs, *site.outputs) or not isinstance(x.shape[-1], int) or not static(*op.inputs[1:]):
        return None
    return RowGenericRows(site)
