"""The GPU convolution family: fp16/bf16 group-1 `conv2d` as one GEMM on the GEMM family's
templates (`plan.py`): a 1x1 conv reads x itself, NHWC convs are implicit GEMMs through TMA's
im2col mode, the rest materialise col (`im2col.py`).  On the GPU every such conv is moved to
NHWC first (the graph pass `channels_last`, registered here for target "cuda")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes.channels_last import to_channels_last
from tessera.templates.conv.plan import conv_geometry, prepare_conv2d
from tessera.templates.epilogue import Epilogue
from tessera.templates.gemm import gpu_dtype_refusal
from tessera.templates.gemm.config import families
from tessera.templates.gemm.space import schedule_space
from tessera.templates.registry import Shape, Template, register, register_pass


class ConvTemplate(Template):
    name, kinds, target = "conv2d-gemm", ("conv2d",), "cuda"

    def refuse(self, op: Operator) -> str | None:
        if op.attrs.get("groups", 1) != 1:
            return f"groups={op.attrs['groups']}: the GEMM form takes group-1 convolutions"
        return gpu_dtype_refusal(op)

    def space(self, op: Operator, shapes: Sequence[Shape]) -> list[Any]:
        x, w = shapes[0], shapes[1]
        nhwc = op.attrs.get("layout", "NCHW") == "NHWC"
        x_hw, k_hw = (x[1:3], w[1:3]) if nhwc else (x[2:4], w[2:4])
        geo = conv_geometry(x_hw, k_hw, op.attrs["stride"], op.attrs["padding"], op.attrs["dilation"])
        m, n, k = x[0] * geo["oh"] * geo["ow"], w[0], (x[3] if nhwc else x[1]) * k_hw[0] * k_hw[1]
        fams = families("nk", k % 8 == 0, tma=nhwc)
        return schedule_space(m, n, k, 1, "nk", wgmma="wgmma" in fams, tma="tma" in fams)

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        a = op.attrs
        return prepare_conv2d(shapes[0], shapes[1], op.outputs[0].dtype, stride=a["stride"], padding=a["padding"],
                              dilation=a["dilation"], groups=a.get("groups", 1), bias=len(op.inputs) == 3,
                              epilogue=epilogue, tune=tune, layout=a.get("layout", "NCHW"))  # fmt: skip


def _channels_last(graph: FlowGraph, tune: bool) -> None:
    to_channels_last(graph)


CONV = register(ConvTemplate())
register_pass("channels_last", "cuda", _channels_last)
