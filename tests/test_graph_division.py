"""Integer division by zero has one meaning on the host: the numpy references (reference executor,
interim executor) raise DivisionByZeroError as the compiled CPU kernels and torch on the CPU do;
constant folding leaves such an operator for the device to decide at run time."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.errors import DivisionByZeroError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.graph.passes import optimize


def _graph(kind, **attrs):
    b = GraphBuilder(f"int_{kind}")
    x, y = b.input("x", [5], "int32"), b.input("y", [5], "int32")
    b.output(b.op(kind, x, y, **attrs))
    return b.build()


@pytest.mark.parametrize("kind,attrs", [("div", {"rounding": "floor"}), ("div", {"rounding": "trunc"}), ("remainder", {}),
                                        ("fmod", {})])
def test_reference_and_compiled_cpu_raise_on_zero_divisor(kind, attrs):
    g = _graph(kind, **attrs)
    x = np.array([7, -7, 3, 0, 9], np.int32)
    good, bad = np.array([2, 3, -2, 5, 4], np.int32), np.array([2, 3, 0, 5, 4], np.int32)
    compiled = compile_graph(_graph(kind, **attrs), "cpu")
    np.testing.assert_array_equal(compiled(x, good)[0], g.run(x, good)[0])
    with pytest.raises(DivisionByZeroError):
        g.run(x, bad)
    with pytest.raises(DivisionByZeroError):
        compiled(x, bad)
    np.testing.assert_array_equal(compiled(x, good)[0], g.run(x, good)[0])  # usable afterwards


def test_constant_folding_leaves_a_zero_divisor_to_run_time():
    b = GraphBuilder("fold")
    x = b.input("x", [3], "int32")
    q = b.op("remainder", b.constant(np.array([4, 5, 6], np.int32)), b.constant(np.array([1, 0, 2], np.int32)))
    b.output(b.op("add", x, q))
    g = b.build()
    optimize(g)
    assert [op.kind for op in g.operators] == ["remainder", "add"]
    with pytest.raises(DivisionByZeroError):
        compile_graph(g, "cpu")(np.ones(3, np.int32))
