"""The template registry: which template takes an operator on a target, why others refuse,
the families' spaces and passes, and what `explain` prints for a refused operator."""

import numpy as np
import pytest

import tessera
from tessera.backend.isa import vector_lanes
from tessera.errors import ArgumentError, UnsupportedError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.templates import choose, chosen, passes, refusals, register, templates
from tessera.templates.registry import Template


def _op(kind, *shapes, dtype="float16", **attrs):
    b = GraphBuilder("g")
    ins = [b.input(f"x{i}", s, dtype) for i, s in enumerate(shapes)]
    out = b.op(kind, *ins, **attrs)
    b.output(out)
    return out.producer


def test_every_family_is_registered_once_per_target():
    names = {(t.name, t.target) for t in templates()}
    assert len(names) == len(templates())
    assert {"gemm", "conv2d-gemm", "row", "attention", "lowbit"} <= {t.name for t in templates("cuda")}
    assert {"cpu-gemm", "cpu-conv2d", "cpu-max-pool2d", "attention", "lowbit"} <= {t.name for t in templates("cpu")}


def test_the_gpu_gemm_takes_half_precision_linears_and_says_why_not_float32():
    assert choose(_op("linear", (5, 24), (40, 24)), "cuda").name == "gemm"
    op = _op("linear", (5, 24), (40, 24), dtype="float32")
    assert choose(op, "cuda") is None
    [(name, why)] = refusals(op, "cuda")
    assert name == "gemm" and "float32" in why
    with pytest.raises(UnsupportedError, match="no kernel template for linear on cuda .*float32"):
        chosen(op, "cuda")


def test_row_and_attention_refusals_name_the_reason():
    assert choose(_op("softmax", (3, 7), axis=-1), "cuda").name == "row"
    assert "last" in refusals(_op("softmax", (3, 7), axis=0), "cuda")[0][1]
    sdpa = _op("scaled_dot_product_attention", (1, 2, 5, 64), (1, 2, 5, 64), (1, 2, 5, 64))
    assert choose(sdpa, "cuda").name == "attention" and not choose(sdpa, "cuda").takes_epilogue(sdpa)
    assert choose(_op("relu", (3,)), "cuda") is None and refusals(_op("relu", (3,)), "cuda") == []


@pytest.mark.skipif(vector_lanes() == 1, reason="no AVX2: the CPU templates refuse everything")
def test_cpu_templates_take_float32_static_or_symbolic_in_the_rows_only():
    assert choose(_op("linear", (5, 24), (40, 24), dtype="float32"), "cpu").name == "cpu-gemm"
    rows = _op("linear", ("b", "n", 24), (40, 24), dtype="float32")
    assert choose(rows, "cpu").name == "cpu-gemm"  # generic in its row count (templates/cpu/gemm_rows.py)
    depth = _op("matmul", (3, "n"), ("n", 8), dtype="float32")
    assert choose(depth, "cpu") is None and "beyond the rows" in refusals(depth, "cpu")[0][1]
    scores = _op("matmul", (2, "n", 8), (2, 8, "n"), dtype="float32")  # q @ k^T of a dynamic length
    assert choose(scores, "cpu") is None and "beyond the rows" in refusals(scores, "cpu")[0][1]
    conv = _op("conv2d", (1, 3, 9, 9), (4, 3, 3, 3), dtype="float32", stride=1, padding=1, dilation=1)
    assert choose(conv, "cpu").name == "cpu-conv2d"


def test_spaces_are_candidate_schedules_for_the_shapes():
    op = _op("linear", (5, 24), (40, 24))
    space = choose(op, "cuda").space(op, [(5, 24), (40, 24)])
    assert space and all(hasattr(c, "split_k") for c in space)
    if vector_lanes() > 1:
        cpu_op = _op("linear", (5, 24), (40, 24), dtype="float32")
        cpu_space = choose(cpu_op, "cpu").space(cpu_op, [(5, 24), (40, 24)])
        assert cpu_space and all(c.lanes == vector_lanes() for c in cpu_space)


def test_families_register_their_graph_passes_per_target():
    assert {p.name for p in passes("cuda")} == {"channels_last", "lowbit_fragment_words"}
    assert passes("cpu") == []


def test_register_refuses_a_duplicate_or_an_incomplete_template():
    class Gemm(Template):
        name, kinds, target = "gemm", ("linear",), "cuda"

    with pytest.raises(ArgumentError, match="twice"):
        register(Gemm())
    with pytest.raises(ArgumentError, match="target"):
        register(type("Bad", (Template,), {"name": "x", "kinds": ("relu",), "target": "tpu"})())


def test_explain_says_why_no_template_took_an_operator():
    b = GraphBuilder("g")
    x = b.input("x", [3, "k"], "float32")
    w = b.input("w", ["k", 4], "float32")
    b.output(b.op("relu", b.op("matmul", x, w)))
    compiled = compile_graph(b.build(), "cpu")
    text = str(tessera.explain(compiled))
    if vector_lanes() > 1:
        assert "no template took them (1)" in text and "symbolic sizes beyond the rows" in text
    for depth in (1, 3, 7):
        rng = np.random.default_rng(depth)
        xv, wv = rng.standard_normal((3, depth)).astype(np.float32), rng.standard_normal((depth, 4)).astype(np.float32)
        (y,) = compiled(xv, wv)
        np.testing.assert_allclose(y, np.maximum(xv @ wv, 0), rtol=1e-5, atol=1e-5)
