"""Give `lowbit_linear` operators their codes in mma's own k order, for the register-A prefill kernel.

The decode kernels read a graph's words in span 2 or 16 (tessera.ir.lowbit.lane_value_position).
The register-A prefill kernel (tessera.templates.lowbit.gemm_rs) dequantises straight into
wgmma's A registers and needs the codes in FRAGMENT_SPAN. Its B operand (the activations) comes
by TMA in plain k order, so no index map at run time can undo the other orders' permutation.
This pass re-lays each operator's constant words once, at compile time, into a fifth constant
input of as many words (the opdef's optional input). The prefill plan reads those, the decode
plans read the words (tessera.templates.lowbit.plan).

It runs for CUDA targets (tessera.graph.compiler.build), and only where that kernel can be
chosen:
- a Hopper GPU (SM90, the kernel's only target);
- float16 activations;
- rows that may exceed DECODE_MAX_M (a static M at or below it only decodes);
- $TESSERA_LOWBIT_PREFILL 'register', or 'auto' (the default) with tuning on, so that tuning
  may choose the kernel per shape (`AUTO_TUNES_IT`).  Measured on the H200 before it was set:
  the 1.1B Llama's 512-token prefill ran 3.527 ms with 'auto' against 3.717 with 'dequant' (the
  two passes), at the same compile time (29.8 against 29.5 s) and error
  (bench/results/2026-11-28-h200-lowbit-model-prefill-auto.md).

The price is a second copy of the low-bit words on the GPU: bits/16 of the fp16 weights' memory,
as the eager layer keeps it (tessera.eager.lowbit.PreparedWeight.words_for).
"""

from __future__ import annotations

import math

from tessera import settings
from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor
from tessera.ir import dtypes, lowbit
from tessera.quant.layout import repack_units
from tessera.runtime import cuda
from tessera.target import SM90
from tessera.templates.lowbit.decode_config import DECODE_MAX_M


def may_prefill(op: Operator) -> bool:
    """Whether a lowbit_linear may run more than DECODE_MAX_M rows (symbolic leading sizes may)."""
    lead = op.inputs[0].shape[:-1]
    return not all(isinstance(d, int) for d in lead) or math.prod(lead) > DECODE_MAX_M


def _wanted(op: Operator) -> bool:
    return (op.kind == "lowbit_linear" and len(op.inputs) == 4 and op.inputs[0].dtype == dtypes.float16
            and all(t.is_constant and t.producer is None for t in op.inputs[1:]) and may_prefill(op))  # fmt: skip


def fragment_words_of(op: Operator) -> Tensor:
    """The operator's codes packed in FRAGMENT_SPAN: a constant of as many uint32 words."""
    a, words = op.attrs, op.inputs[1]
    packed = repack_units(words.data, dtypes.dtype(a["wtype"]), a["n"], a["k"], a.get("span", 16), lowbit.FRAGMENT_SPAN)
    return Tensor.constant(packed.reshape(words.data.shape), name=f"{words.name}_fragment", copy=False)


AUTO_TUNES_IT = True  # whether 'auto' with tuning adds the words (see the module docstring)


def add_fragment_words(graph: FlowGraph, tune: bool) -> int:
    """Append the fragment-order words to every lowbit_linear the register-A kernel may run
    (see the module docstring), when the current GPU is an SM90 one; returns how many."""
    mode = settings.lowbit_prefill()
    if mode != "register" and not (mode == "auto" and tune and AUTO_TUNES_IT):
        return 0
    if cuda.device_properties().capability != SM90.capability:
        return 0
    done = 0
    for op in graph.operators:
        if _wanted(op):
            op.inputs.append(fragment_words_of(op))
            done += 1
    return done
