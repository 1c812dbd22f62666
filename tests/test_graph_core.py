"""FlowGraph core: shape inference with symbolic sizes, references against torch, verifier,
printer, executor, memory plan, save/load in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tessera.graph import FlowGraph, GraphBuilder, GraphError, Operator, ShapeError, Sym, Tensor, all_ops, load
from tessera.graph.memory_plan import plan_memory


def test_vocabulary_covers_the_models():
    need = {"conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm", "layer_norm", "rms_norm",
            "matmul", "linear", "scaled_dot_product_attention", "softmax", "log_softmax", "relu", "gelu", "silu",
            "sigmoid", "tanh", "erf", "add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "lt", "where",
            "cast", "take", "gather_elements", "reshape", "flatten", "permute", "slice", "concat", "split", "expand",
            "squeeze", "unsqueeze", "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "cumsum", "full",
            "arange", "neg", "cos", "sin", "rsqrt"}  # fmt: skip
    assert need <= set(all_ops())


def test_symbolic_shapes_propagate():
    b = GraphBuilder()
    x = b.input("x", ["batch", "seq", 12])
    y = b.op("reshape", x, shape=[-1, 12])
    assert y.shape == (Sym.var("batch") * Sym.var("seq"), 12)
    z = b.op("reshape", y, shape=[Sym.var("batch"), -1, 3, 4])
    assert z.shape == (Sym.var("batch"), Sym.var("seq"), 3, 4)
    w = b.op("add", z, b.constant(np.ones((1, 1, 3, 1), np.float32)))
    assert w.shape == z.shape
    r = b.op("reduce_mean", w, axes=[1], keepdim=True)
    assert [str(d) for d in r.shape] == ["batch", "1", "3", "4"]
    with pytest.raises(ShapeError):
        b.op("add", x, b.constant(np.ones(5, np.float32)))


def test_verifier_catches_bad_graphs():
    x = Tensor([2, 3], "float32", name="x")
    op = Operator.create("relu", [x])
    op.outputs[0].shape = (3, 2)  # a pass bug
    with pytest.raises(GraphError, match="inference gives"):
        FlowGraph([x], op.outputs, [op]).verify()
    y = Tensor([2, 3], "float32", name="y")
    with pytest.raises(GraphError, match="before it is defined"):
        FlowGraph([x], [Operator.create("add", [x, y]).outputs[0]]).verify()


def test_printer_lists_ops_and_constants():
    b = GraphBuilder("demo")
    x = b.input("x", ["n", 2])
    b.output(b.op("linear", x, b.constant(np.ones((3, 2), np.float32), "w")))
    text = str(b.build())
    assert "graph demo(%x: f32[n, 2])" in text and "const %w: f32[3, 2]" in text and "linear(%x, %w)" in text


def test_executor_checks_inputs(rng):
    b = GraphBuilder()
    x = b.input("x", ["n", 4])
    y = b.input("y", ["n", 1])
    b.output(b.op("mul", x, y))
    g = b.build()
    out = g.run(x=np.ones((3, 4), np.float32), y=np.full((3, 1), 2, np.float32))[0]
    assert out.shape == (3, 4) and (out == 2).all()
    with pytest.raises(ShapeError, match="size 'n'"):
        g.run(np.ones((3, 4), np.float32), np.ones((2, 1), np.float32))


def test_memory_plan_reuses_buffers():
    b = GraphBuilder()
    x = b.input("x", ["n", 256])
    t = x
    for _ in range(6):
        t = b.op("tanh", t)
    b.output(t)
    plan = plan_memory(b.build(), {"n": 4})
    assert plan.naive_bytes == 6 * 4096
    assert plan.arena_bytes == 2 * 4096 == plan.live_peak_bytes
    # Buffers alive at the same step never overlap.
    for a in plan.offsets:
        for c in plan.offsets:
            if a is not c and not (plan.lifetimes[a][1] < plan.lifetimes[c][0] or plan.lifetimes[c][1] < plan.lifetimes[a][0]):
                assert plan.offsets[a] + plan.sizes[a] <= plan.offsets[c] or plan.offsets[c] + plan.sizes[c] <= plan.offsets[a]


def test_save_load_round_trip_in_fresh_process(tmp_path, rng):
    b = GraphBuilder("saved")
    x = b.input("x", ["batch", 5])
    h = b.op("linear", x, b.constant(rng.standard_normal((7, 5)).astype(np.float32)))
    h = b.op("reshape", b.op("gelu", h, approximate="tanh"), shape=[Sym.var("batch"), 7, 1])
    b.output(b.op("clamp", h, min=float("-inf"), max=0.5))
    g = b.build()
    path = tmp_path / "g.tessera"
    g.save(path)
    xv = rng.standard_normal((3, 5)).astype(np.float32)
    np.save(tmp_path / "x.npy", xv)
    np.save(tmp_path / "ref.npy", g.run(xv)[0])
    script = textwrap.dedent(f"""
        import numpy as np, tessera
        g = tessera.graph.load({str(path)!r})
        out = g.run(np.load({str(tmp_path / 'x.npy')!r}))[0]
        np.testing.assert_array_equal(out, np.load({str(tmp_path / 'ref.npy')!r}))
        print(g.name, len(g.operators))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["saved", "4"]
    assert str(load(path)) == str(g)


def test_bind_shapes_checks_compound_dimensions():
    from tessera.graph.symbolic import as_shape, bind_shapes

    def bind(*items, bindings=None):
        b = dict(bindings or {})
        bind_shapes(b, [(as_shape(s), a, f"input {k}") for k, (s, a) in enumerate(items)])
        return b

    # a compound dimension before the bare one that binds its name
    assert bind((["2*n", 4], (8, 4)), (["n"], (4,))) == {"n": 4}
    with pytest.raises(ShapeError, match=r"input 0: dimension 0 is 2\*n = 8 for these sizes, but the array has 7"):
        bind((["2*n", 4], (7, 4)), (["n"], (4,)))
    with pytest.raises(ShapeError, match="n\\*seq = 12"):
        bind((["n", "seq"], (3, 4)), (["n*seq"], (13,)))
    # one unbound name is solved exactly, or refused
    assert bind((["4*n"], (12,))) == {"n": 3} and bind((["n^2"], (49,))) == {"n": 7}
    assert bind((["n*m"], (12,)), bindings={"m": 4}) == {"m": 4, "n": 3}
    with pytest.raises(ShapeError, match="cannot be 10 for any integer 'n'"):
        bind((["4*n"], (10,)))
    # two unbound names cannot be checked: refused, unless given
    with pytest.raises(ShapeError, match=r"the sizes \['m', 'n'\] are bound by no input's shape"):
        bind((["m*n"], (12,)))
    assert bind((["m*n"], (12,)), bindings={"m": 3, "n": 4}) == {"m": 3, "n": 4}
    with pytest.raises(ShapeError, match="m\\*n = 12"):
        bind((["m*n"], (10,)), bindings={"m": 3, "n": 4})


def test_graph_refuses_an_input_whose_compound_dimension_is_wrong():
    from tessera.graph.compiler import compile_graph

    b = GraphBuilder()
    x = b.input("x", ["n", 4])
    y = b.input("y", ["2*n", 4])
    b.output(b.op("relu", x), b.op("relu", y))
    g = b.build()
    ok = [np.ones((3, 4), np.float32), np.ones((6, 4), np.float32)]
    bad = [np.ones((3, 4), np.float32), np.ones((7, 4), np.float32)]
    for run in (g.run, compile_graph(g, "cpu")):
        assert [o.shape for o in run(*ok)] == [(3, 4), (6, 4)]
        with pytest.raises(ShapeError, match=r"input 'y': dimension 0 is 2\*n = 6"):
            run(*bad)


def test_constant_copies_unless_the_caller_gives_the_array_away():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    kept = Tensor.constant(a)
    given = Tensor.constant(a, copy=False)
    assert not np.shares_memory(kept.data, a) and np.shares_memory(given.data, a)
    a[0, 0] = 99.0  # the caller's later writes reach only the constant it gave away
    assert kept.data[0, 0] == 0.0 and given.data[0, 0] == 99.0
    assert not given.data.flags.writeable and a.flags.writeable  # read-only view; the caller's array untouched
    strided = Tensor.constant(a.T, copy=False)  # not C-contiguous: a contiguous copy all the same
    assert strided.data.flags.c_contiguous and np.array_equal(strided.data, a.T)
    scalar = Tensor.constant(np.float32(2.5), copy=False)  # rank 0 stays rank 0
    assert scalar.shape == () and scalar.data.shape == () and float(scalar.data) == 2.5
    cast = Tensor.constant(np.arange(3), "float16", copy=False)
    assert cast.dtype.name == "float16" and cast.data.dtype == np.float16
