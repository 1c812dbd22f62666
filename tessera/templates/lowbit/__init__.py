"""The low-bit family: `lowbit_linear` (x @ W.T with W in any type of 1 to 8 bits, grouped
scales) on the GPU (float16 x) and the CPU (float32 x).

GPU kernels: `decode.py` (M <= DECODE_MAX_M, the weights streamed once), `gemm.py` (prefill:
dequantisation in the TMA GEMM's mainloop), `gemm_rs.py` (prefill with the codes dequantised
into wgmma's A registers; it reads a second copy of the words in fragment order, which the
graph pass `fragment_words.py`, registered here for target "cuda", adds), `dequant.py`;
`tune.py` picks among them per shape; `plan.py` fuses the epilogue and builds.  CPU kernels:
`cpu_kernels.py` over the row layout (tessera.quant.layout), planned by `plan_cpu.py`.
The operator itself (shape rule, numpy reference) is graph vocabulary:
tessera.graph.opdefs.lowbit, so that saved graphs load without any template.
"""

from __future__ import annotations

from typing import Any

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.ir import dtypes
from tessera.templates.epilogue import Epilogue
from tessera.templates.lowbit.decode_config import group_ok
from tessera.templates.lowbit.fragment_words import add_fragment_words
from tessera.templates.lowbit.plan import prepare_lowbit_linear
from tessera.templates.lowbit.plan_cpu import cpu_kernels_take, plan_lowbit_linear_cpu
from tessera.templates.registry import Shape, Template, register, register_pass


def _operand_refusal(op: Operator, dtype: dtypes.DataType) -> str | None:
    """x [..., K] of `dtype` (the kernels read its rows as one [M, K] matrix) and constant weights."""
    x = op.inputs[0]
    if x.ndim < 1 or x.dtype != dtype or op.outputs[0].dtype != dtype:
        return f"takes {dtype.name} activations on this target"
    if not all(t.is_constant for t in op.inputs[1:]):
        return "takes constant weights, scales and biases"
    return None


class GpuLowbit(Template):
    name, kinds, target = "lowbit", ("lowbit_linear",), "cuda"

    def refuse(self, op: Operator) -> str | None:
        k, group = op.attrs["k"], op.attrs["group_size"]
        if k % 8:
            return f"K = {k} is not a multiple of 8"
        if group < k and not group_ok(group):
            return f"groups of {group}: the kernels take divisors of 64 that are multiples of 4, or multiples of 64"
        return _operand_refusal(op, dtypes.float16)

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        return prepare_lowbit_linear(shapes[0], op.attrs, shapes[1][0], shapes[2], shapes[3], epilogue, tune=tune,
                                     fragment=len(op.inputs) == 5)  # fmt: skip


class CpuLowbit(Template):
    name, kinds, target = "lowbit", ("lowbit_linear",), "cpu"

    def refuse(self, op: Operator) -> str | None:
        if not cpu_kernels_take(op.attrs["group_size"], op.attrs["k"]):
            return "groups the row-layout kernels cannot cut, or a CPU without AVX2"
        return _operand_refusal(op, dtypes.float32)

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        return plan_lowbit_linear_cpu(shapes[0], op.attrs, op.inputs[1].data, shapes[2], shapes[3], epilogue,
                                      len(op.inputs)).load()  # fmt: skip


def _fragment_words(graph: FlowGraph, tune: bool) -> None:
    add_fragment_words(graph, tune)


GPU_LOWBIT = register(GpuLowbit())
CPU_LOWBIT = register(CpuLowbit())
register_pass("lowbit_fragment_words", "cuda", _fragment_words)
