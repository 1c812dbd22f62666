"""CPU GEMM anchors generic in their row count (tessera/templates/cpu/gemm_rows.py): one build
serves every batch and length, with the epilogue's symbolic shapes bound at call time."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.backend.isa import vector_lanes
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.func import Function
from tessera.ir.types import TensorType
from tessera.templates.cpu.gemm_kernel import CpuGemmConfig, make_gemm
from tessera.templates.gemm.generic import bucket
from tessera.templates.rewrite import specialize

pytestmark = pytest.mark.skipif(vector_lanes() == 1, reason="no AVX2: the CPU templates refuse everything")


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _anchor_kernels(compiled):
    """The distinct loaded kernels behind each anchor step's prepared shapes."""
    return [{id(k.kernel) for k in step.prepared()} for step in compiled.steps if step.kind == "anchor"]


def _block(rng, n=40, k=24, weight_input=False):
    """x [b, s, K] -> linear (+bias) -> gelu * scale[N] + residual[b, s, N] + table[s, N]: an
    epilogue reading a full-size tensor, one broadcast over the rows and one over the batch."""
    g = GraphBuilder("rows")
    x = g.input("x", ["b", "s", k])
    res = g.input("res", ["b", "s", n])
    table = g.input("table", ["s", n])
    w = g.input("w", [n, k]) if weight_input else g.constant(_f32(rng, n, k))
    y = g.op("linear", x, w, g.constant(_f32(rng, n)))
    y = g.op("mul", g.op("gelu", y), g.constant(_f32(rng, n)))
    g.output(g.op("add", g.op("add", y, res), table))
    return g.build()


@pytest.mark.parametrize("weight_input", [False, True], ids=["packed-weight", "weight-input"])
def test_linear_with_epilogue_matches_numpy_at_every_size_from_one_build(rng, weight_input):
    graph = _block(rng, weight_input=weight_input)
    compiled = compile_graph(graph, "cpu", tune=False)
    sizes = [(2, 5), (1, 1), (3, 7), (1, 8), (2, 3), (1, 13), (3, 7)]
    for b, s in sizes:  # 10, 1, 21, 8, 6, 13, 21 rows: buckets 16, 1, 32, 8, 8, 16, 32
        args = [_f32(rng, b, s, 24), _f32(rng, b, s, 40), _f32(rng, s, 40)]
        if weight_input:
            args.append(_f32(rng, 40, 24))
        (got,) = compiled(*args)
        (ref,) = graph.run(*args)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    (kernels,) = _anchor_kernels(compiled)
    # Every row count ran on the template (no step fell back to per-shape kernels), and they all
    # shared the single-thread kernel(s) the cost model picked: at most one per thread count.
    step = next(s for s in compiled.steps if s.kind == "anchor")
    assert all(k.kernel.kernels[0].endswith("_rows") for k in step.prepared())
    assert len(step.prepared()) == len(set(sizes)) and len(kernels) <= 2


def test_matmul_with_a_constant_or_input_right_operand(rng):
    g = GraphBuilder("mm")
    x = g.input("x", ["m", 17])
    c = g.constant(_f32(rng, 17, 9))
    v = g.input("v", [17, 9])
    g.output(g.op("relu", g.op("matmul", x, c)), g.op("matmul", x, v))
    graph = g.build()
    compiled = compile_graph(graph, "cpu", tune=False)
    assert len([s for s in compiled.steps if s.kind == "anchor"]) == 2
    for m in (1, 2, 9, 33, 9):
        args = [_f32(rng, m, 17), _f32(rng, 17, 9)]
        for got, ref in zip(compiled(*args), graph.run(*args)):
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_many_rows_split_over_the_workers(rng):
    """Row counts large enough for a team of workers: the row chunks come from the run-time count."""
    g = GraphBuilder("big")
    x = g.input("x", ["m", 64])
    g.output(g.op("linear", x, g.constant(_f32(rng, 48, 64))))
    graph = g.build()
    compiled = compile_graph(graph, "cpu", tune=False)
    for m in (1500, 1, 1100, 2049):
        (got,) = compiled(xv := _f32(rng, m, 64))
        np.testing.assert_allclose(got, graph.run(xv)[0], rtol=2e-5, atol=2e-5)


def test_buckets_are_powers_of_two():
    assert [bucket(m) for m in (1, 2, 3, 5, 8, 9, 1000)] == [1, 2, 4, 8, 8, 16, 1024]


def test_specialize_leaves_a_free_size_and_takes_a_scalar_expression():
    f = make_gemm(CpuGemmConfig(2, 1, vector_lanes(), 1), "kn").ir
    m = next(s for s in f.shape_params if s.name == "M")
    chunks = (m + 1) // 2
    out = specialize(f, {"A": (1, None, 6), "B": (1, 6, 8), "C": (1, None, 8), "W": (1, 6 * vector_lanes())},
                     {"RC": chunks})  # fmt: skip
    assert isinstance(out, Function) and out.shape_params == [m]
    assert [p.name for p in out.params] == ["A", "B", "C", "W"]  # RC became the expression
    a = out.params[0].type
    assert isinstance(a, TensorType) and a.shape[0].value == 1 and a.shape[1] is m and a.shape[2].value == 6
    assert m.type == dtypes.int32 and isinstance(chunks, E.Expr)
