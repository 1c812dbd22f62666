"""The attention family: scaled dot-product attention, [B, H, S, D] q, k, v and an optional mask.

On SM90 the fused flash kernel (`flash.py`, launched by `launch.py`) runs it, reading q, k, v
through the graph's head-split views and writing through the head merge (`views`); elsewhere,
and on the CPU in float32, it is two GEMMs around a row softmax (`plan.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.backend.isa import vector_lanes
from tessera.errors import UnsupportedError
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor
from tessera.ir import dtypes
from tessera.templates.attention.cpu_flash import GenericCpuAttention
from tessera.templates.attention.plan import flash_unsupported, plan_attention, prepare_attention
from tessera.templates.epilogue import Epilogue
from tessera.templates.registry import AnchorSite, Shape, StepKernel, Template, register, static

MASK_DTYPES = (dtypes.boolean, dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)


def _operand_refusal(op: Operator, qkv_dtypes: tuple[Any, ...], mask_dtypes: tuple[Any, ...]) -> str | None:
    qkv, mask = op.inputs[:3], op.inputs[3:]  # infer checked that the mask broadcasts to [B, H, Sq, Sk]
    if len(op.inputs) not in (3, 4):
        return f"takes q, k, v and an optional mask, not {len(op.inputs)} inputs"
    if not all(t.ndim == 4 and t.dtype == op.outputs[0].dtype and t.dtype in qkv_dtypes for t in qkv):
        return f"takes 4-D q, k, v of the output's dtype, one of {', '.join(d.name for d in qkv_dtypes)}"
    if not all(1 <= t.ndim <= 4 and t.dtype in mask_dtypes for t in mask):
        return f"takes a mask of 1 to 4 dimensions in {', '.join(d.name for d in mask_dtypes)}"
    return None


class GpuAttention(Template):
    name, kinds, target, epilogue = "attention", ("scaled_dot_product_attention",), "cuda", False

    def refuse(self, op: Operator) -> str | None:
        return _operand_refusal(op, (dtypes.float16, dtypes.bfloat16), MASK_DTYPES)

    def views(self, op: Operator, consumers: Mapping[Tensor, list[Operator]],
              outputs: set[Tensor]) -> tuple[list[Operator], list[Operator]]:  # fmt: skip
        """The `split_heads` producing q, k, v (batch 1, static shapes, columns and row width on
        16-byte boundaries; q only without grouped heads: the flash kernel's strided TMA maps)
        and the `merge_heads` after it (its store writes [B, Sq, H * D]), each read by the
        attention alone; only where the fused flash kernel runs (it alone takes them)."""
        if not static(*op.inputs):
            return [], []
        q, k, v = op.inputs[:3]
        if flash_unsupported(q.shape, k.shape, v.shape, op.inputs[3].shape if len(op.inputs) == 4 else None) is not None:
            return [], []
        before = []
        for i, t in enumerate((q, k, v)):
            view = t.producer
            if (view is None or view.kind != "split_heads" or consumers.get(t) != [op] or t in outputs
                    or op.inputs.count(t) != 1 or q.shape[0] != 1 or (i == 0 and q.shape[1] != k.shape[1])):  # fmt: skip
                continue
            width = view.inputs[0].shape[2]
            if isinstance(width, int) and width % 8 == 0 and view.attrs["offset"] % 8 == 0:
                before.append(view)
        users = consumers.get(op.outputs[0], [])
        after = users if len(users) == 1 and users[0].kind == "merge_heads" and op.outputs[0] not in outputs else []
        return before, list(after)

    def prepare(self, site: AnchorSite, shapes: Mapping[Tensor, Shape], tune: bool) -> StepKernel:
        """q, k, v read through the group's `split_heads` views (from the tensor each views), the
        output written through its `merge_heads`."""
        op = site.anchor
        if any(v.kind != "merge_heads" for v in site.epilogue):
            raise UnsupportedError("the attention template takes no epilogue")
        position = {t: i for i, t in enumerate(site.inputs)}
        viewed = {v.outputs[0]: v for v in site.prologue}
        operands, views, qkv_shapes = [], [], []
        for t in op.inputs[:3]:
            view = viewed.get(t)
            if view is None:
                operands.append(position[t])
                views.append(None)
                qkv_shapes.append(shapes[t])
                continue
            x = view.inputs[0]
            b, s, width = shapes[x]
            operands.append(position[x])
            views.append((int(view.attrs["offset"]), width))
            qkv_shapes.append((b, int(view.attrs["heads"]), s, int(view.attrs["head_dim"])))
        masked = len(op.inputs) == 4
        if masked:
            operands.append(position[op.inputs[3]])
        kernel = prepare_attention(*qkv_shapes, op.outputs[0].dtype, causal=bool(op.attrs.get("causal", False)),
                                   scale=op.attrs.get("scale"), mask_shape=shapes[op.inputs[3]] if masked else None,
                                   mask_dtype=op.inputs[3].dtype if masked else None, tune=tune, views=views,
                                   heads_last=bool(site.epilogue))  # fmt: skip
        return StepKernel(kernel, operands, [])


class CpuAttention(Template):
    name, kinds, target, epilogue = "attention", ("scaled_dot_product_attention",), "cpu", False

    def refuse(self, op: Operator) -> str | None:
        if vector_lanes() == 1:
            return "this CPU has no SIMD unit the CPU templates use"
        reason = _operand_refusal(op, (dtypes.float32,), (dtypes.boolean, dtypes.float32))
        if reason is None and not static(*op.inputs):  # generic in the batch and lengths (cpu_flash.py)
            q, k, v = op.inputs[:3]
            if not all(isinstance(d, int) for d in (q.shape[1], q.shape[3], k.shape[1], v.shape[3])):
                return "symbolic heads or head sizes: the CPU attention is generic in the batch and lengths only"
        return reason

    def generic(self, site: AnchorSite, tune: bool) -> GenericCpuAttention | None:
        return None if static(*site.anchor.inputs) else GenericCpuAttention(site)

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        if epilogue is not None:
            raise UnsupportedError("the attention template takes no epilogue")
        masked = len(op.inputs) == 4
        return plan_attention(*shapes[:3], dtypes.float32, causal=bool(op.attrs.get("causal", False)),
                              scale=op.attrs.get("scale"), mask_shape=shapes[3] if masked else None,
                              mask_dtype=op.inputs[3].dtype if masked else None, tune=tune, target="cpu").load()  # fmt: skip


GPU_ATTENTION = register(GpuAttention())
CPU_ATTENTION = register(CpuAttention())
