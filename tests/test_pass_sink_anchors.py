"""sink_anchors_to_epilogues: a GEMM moves down to its one elementwise consumer when that
consumer reads a later tensor, so the consumer folds into the GEMM's stores; results unchanged."""

from __future__ import annotations

import re

import numpy as np

from tessera.backend.isa import vector_lanes
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.graph.passes import sink_anchors_to_epilogues


def _f32(rng, *shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def _gated_mlp(rng, gate_after_up: bool):
    b = GraphBuilder()
    x = b.input("x", ["n", 16])
    gate = b.op("linear", x, b.constant(_f32(rng, 24, 16)))
    if gate_after_up:  # gate, up, silu, mul: the product's operand comes after the up projection
        up = b.op("linear", x, b.constant(_f32(rng, 24, 16)))
        act = b.op("silu", gate)
    else:
        act = b.op("silu", gate)
        up = b.op("linear", x, b.constant(_f32(rng, 24, 16)))
    b.output(b.op("linear", b.op("mul", act, up), b.constant(_f32(rng, 16, 24))))
    return b.build()


def test_the_up_projection_moves_to_its_product(rng):
    g = _gated_mlp(rng, gate_after_up=True)
    xs = [_f32(rng, n, 16) for n in (3, 1)]
    want = [g.run(x)[0] for x in xs]
    assert sink_anchors_to_epilogues(g) == 1
    kinds = [op.kind for op in g.verify().operators]
    assert kinds == ["linear", "silu", "linear", "mul", "linear"], kinds
    assert sink_anchors_to_epilogues(g) == 0  # idempotent
    compiled = compile_graph(g, "cpu", tune=False)
    for x, ref in zip(xs, want):
        np.testing.assert_allclose(compiled(x)[0], ref, rtol=1e-5, atol=1e-6)
    report = str(compiled.report())
    steps = "in 3 steps (3 anchor)" if vector_lanes() > 1 else "3 kernels"  # the CPU GEMM template, or fused loops
    # the product is the up projection's epilogue (operator names carry a process-wide counter)
    assert steps in report and re.search(r"<- linear \(linear\d+\), mul \(mul\d+\)", report), report


def test_nothing_moves_when_the_operands_are_ready(rng):
    g = _gated_mlp(rng, gate_after_up=False)
    assert sink_anchors_to_epilogues(g) == 0


def test_a_gemm_read_twice_stays(rng):
    b = GraphBuilder()
    x = b.input("x", [2, 8])
    y = b.op("linear", x, b.constant(_f32(rng, 8, 8)))
    z = b.op("relu", x)
    b.output(b.op("add", y, z), y)  # y is also an output: the add is not its only reader
    g = b.build()
    assert sink_anchors_to_epilogues(g) == 0
