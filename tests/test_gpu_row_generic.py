"""Row anchors generic in their row count (tessera/templates/row/plan.py: RowGenericRows): one
build of a layer norm / RMS norm / softmax serves every batch and length under dynamic shapes."""

from __future__ import annotations

import pytest

from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.graph.compiler.partition import partition_for
from tessera.ir.evaluate import evaluate
from tessera.templates.row import ROW
from tessera.templates.row.plan import RowGenericRows

C = 96


def _norm_block(kind="layer_norm", c=C):
    """x [b, s, C] -> norm -> * 2 + residual [b, s, C] (the residual add folds into the store)."""
    g = GraphBuilder("rows", device="cuda")
    x = g.input("x", ["b", "s", c], "float16")
    res = g.input("res", ["b", "s", c], "float16")
    params = [g.input("w", [c], "float16"), g.input("bias", [c], "float16")][: 2 if kind == "layer_norm" else 1]
    y = g.op(kind, x, *params, eps=1e-5) if kind != "softmax" else g.op("softmax", x, axis=-1)
    g.output(g.op("add", g.op("mul", y, g.constant(2.0, dtype="float16")), res))
    return g.build()


def _site(graph):
    return next(g for g in partition_for(graph, "cuda", lambda op: None) if g.kind == "anchor")


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "softmax"])
def test_plan_leaves_the_rows_free(kind):
    gen = ROW.generic(_site(_norm_block(kind)), False)
    assert isinstance(gen, RowGenericRows)
    plan = gen.plan()
    (launch,) = plan.launches
    f = launch.func
    assert launch.generic and f.name.endswith("_rows") and {s.name for s in f.shape_params} == {"R", "b", "s"}
    r = next(s for s in f.shape_params if s.name == "R")
    grid = [int(evaluate(f.launch.grid[0], {r: rows})) for rows in (1, 37, 4096)]
    assert grid[0] <= grid[1] < grid[2]  # the grid follows the rows
    assert "__global__" in plan.source


def test_static_sites_and_symbolic_row_lengths_are_planned_per_shape():
    g = GraphBuilder("static", device="cuda")
    g.output(g.op("softmax", g.input("x", [4, 64], "float16"), axis=-1))
    assert ROW.generic(_site(g.build()), False) is None
    g = GraphBuilder("scores", device="cuda")
    g.output(g.op("softmax", g.input("x", ["b", "s", "s"], "float16"), axis=-1))
    assert ROW.generic(_site(g.build()), False) is None  # the row length itself changes


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "softmax"])
def test_compiled_norm_matches_torch_at_every_size_from_one_build(torch, kind):
    graph = _norm_block(kind)
    compiled = compile_graph(graph, "cuda", tune=False)
    F = torch.nn.functional
    sizes = [(2, 5), (1, 1), (3, 7), (4, 33), (1, 300), (3, 7)]
    for b, s in sizes:
        x = torch.randn(b, s, C, device="cuda", dtype=torch.float16)
        res = torch.randn(b, s, C, device="cuda", dtype=torch.float16)
        w, bias = torch.randn(C, device="cuda", dtype=torch.float16), torch.randn(C, device="cuda", dtype=torch.float16)
        args = [x, res, w, bias] if kind == "layer_norm" else [x, res, w] if kind == "rms_norm" else [x, res]
        (got,) = compiled(*args)
        xd = x.double()
        if kind == "layer_norm":
            y = F.layer_norm(xd, (C,), w.double(), bias.double(), 1e-5)
        elif kind == "rms_norm":
            y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
        else:
            y = torch.softmax(xd, -1)
        want = y.half().double() * 2 + res.double()
        assert got.shape == (b, s, C) and (got.double() - want).abs().max().item() < 3e-2, (kind, b, s)
    step = next(st for st in compiled.steps if st.kind == "anchor")
    assert len(step.prepared()) == len(set(sizes)) and len({id(k.kernel) for k in step.prepared()}) == 1
