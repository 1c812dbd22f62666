"""Merge projections that read the same input into one wider matmul followed by a split.

Attention computes Q, K and V as three linear layers of the same activation; one GEMM with
the weights concatenated reads the activation once and fills the GPU better.  Applies to
groups of `linear` ops with constant weights (and all or none with constant biases) and to
groups of `matmul(x, W)` with constant 2-D W, when they share the input x -- or reshapes of
one x to one shape (the ATen graph flattens x once per projection: `view(x, [B*S, K])`).

A gated pair — act(x @ Wg) * (x @ Wu), the SwiGLU/GeGLU of Llama-style MLPs — stays two
projections: then the activation folds into the first GEMM's stores and the product into the
second's (reading the first's output as an epilogue operand), where one merged GEMM would
write both halves for a separate kernel to multiply (H200, llama-1.1B seq 512: that product
kernel was 7% of the forward).

`lowbit_linear` projections (tessera.quantize's layers) merge too, gated pairs included: their
kernel streams the weights with a fixed cost per launch that the product kernel does not
outweigh (H200, 1.1B Llama decode, int4: gate and up 6.7 us each, merged 8.8 us, a product
kernel ~1.5 us).  Members need whole 16-row tiles (N % 16 == 0) and equal types, groups and
zero-point layout; their words concatenate because the layout is tile-major in N.
"""

from __future__ import annotations

import numpy as np

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes._match import Uses, other_input
from tessera.graph.tensor import Tensor
from tessera.ir import lowbit

GATE_ACTIVATIONS = frozenset({"silu", "gelu", "relu", "sigmoid", "tanh"})


def _const(t: Tensor) -> bool:
    return t.is_constant and t.producer is None


def _source(x: Tensor) -> object:
    """What a projection reads: x, or for a reshape, (its input, the shape): equal reshapes of
    one tensor are one value."""
    op = x.producer
    if op is not None and op.kind == "reshape":
        return (op.inputs[0], tuple(x.shape))
    return x


def _key(op: Operator):
    """Ops with equal keys can merge; None if op is not a mergeable projection."""
    if op.kind == "lowbit_linear" and all(_const(t) for t in op.inputs[1:]) and op.attrs["n"] % lowbit.UNIT_ROWS == 0:
        a = op.attrs  # whole 16-row tiles: the members' words, tile-major in N, concatenate
        return ("lowbit_linear", _source(op.inputs[0]), a["k"], a["wtype"], a["group_size"], bool(a["has_bias"]),
                a.get("span", 16))  # fmt: skip
    if op.kind == "linear" and _const(op.inputs[1]) and all(_const(t) for t in op.inputs[2:]):
        w = op.inputs[1]
        return ("linear", _source(op.inputs[0]), w.shape[1], w.dtype, len(op.inputs))
    if op.kind == "matmul" and _const(op.inputs[1]) and op.inputs[1].ndim == 2 and op.inputs[0].ndim >= 2:
        w = op.inputs[1]
        return ("matmul", _source(op.inputs[0]), w.shape[0], w.dtype)
    return None


def _gated(gate: Operator, up: Operator, uses: Uses) -> bool:
    """gate's output feeds only act(.), whose output feeds only a product with up's output (its only use)."""
    act = uses.only_user(gate.outputs[0])
    if act is None or act.kind not in GATE_ACTIVATIONS or len(act.inputs) != 1:
        return False
    prod = uses.only_user(act.outputs[0])
    return (prod is not None and prod.kind == "mul" and other_input(prod, act.outputs[0]) is up.outputs[0]
            and uses.only_user(up.outputs[0]) is prod)  # fmt: skip


def _without_gated_pairs(members: list[Operator], uses: Uses) -> list[Operator]:
    paired = {op for a in members for b in members if a is not b and _gated(a, b, uses) for op in (a, b)}
    return [m for m in members if m not in paired]


def _merged_lowbit(x: Tensor, members: list[Operator]) -> tuple[list[Tensor], list[int], dict]:
    """The wide lowbit_linear's inputs, the members' widths and its attributes: words (tile-major
    in N), scales and zero-point biases [N, G] stacked in the members' order."""
    words, scales, biases = ([m.inputs[i] for m in members] for i in (1, 2, 3))
    name = "_".join(w.name for w in words)
    sizes = [m.attrs["n"] for m in members]
    inputs = [x, Tensor.constant(np.concatenate([w.data for w in words]), name=name),
              Tensor.constant(np.concatenate([s.data for s in scales]), name=name + "_s"),
              Tensor.constant(np.concatenate([b.data for b in biases]), name=name + "_z") if members[0].attrs["has_bias"]
              else biases[0]]  # fmt: skip
    return inputs, sizes, {**members[0].attrs, "n": sum(sizes)}


def merge_parallel_projections(graph: FlowGraph, min_group: int = 2) -> int:
    """Rewrite in place; returns the number of groups merged."""
    groups: dict[tuple, list[Operator]] = {}
    for op in graph.operators:
        key = _key(op)
        if key is not None:
            groups.setdefault(key, []).append(op)
    merged = 0
    ops = list(graph.operators)
    uses = Uses(graph)
    for key, members in groups.items():
        if key[0] != "lowbit_linear":
            members = _without_gated_pairs(members, uses)
        if len(members) < min_group:
            continue
        x = members[0].inputs[0]  # key[1] may have been rewired by an earlier merge
        if key[0] == "lowbit_linear":
            inputs, sizes, attrs = _merged_lowbit(x, members)
        elif key[0] == "linear":
            weight = np.concatenate([m.inputs[1].data for m in members], axis=0)
            sizes = [m.inputs[1].shape[0] for m in members]
        else:
            weight = np.concatenate([m.inputs[1].data for m in members], axis=1)
            sizes = [m.inputs[1].shape[1] for m in members]
        if key[0] != "lowbit_linear":
            inputs, attrs = [x, Tensor.constant(weight, name="_".join(m.inputs[1].name for m in members))], {}
        if key[0] == "linear" and key[4] == 3:
            inputs.append(Tensor.constant(np.concatenate([m.inputs[2].data for m in members]), name=inputs[1].name + "_b"))
        wide = Operator.create(key[0], inputs, attrs, name="merged_" + members[0].name)
        split = Operator.create("split", wide.outputs, {"axis": -1, "sizes": sizes}, name="split_" + members[0].name)
        for m, out in zip(members, split.outputs):
            graph.replace_uses(m.outputs[0], out)
            out.name = m.outputs[0].name
        # The wide op sits where the first member was; the graph is re-sorted below anyway.
        first = ops.index(members[0])
        ops[first:first] = [wide, split]
        ops = [op for op in ops if op not in members]
        graph.operators = ops
        merged += 1
    graph.set_operators(ops)
    return merged
