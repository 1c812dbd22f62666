"""lowbit_linear in the graph passes: drop_reshapes removes the flatten / unflatten pair that
tessera.quantize's layers put around it (x [..., K] goes straight in, the epilogue sees the
[..., N] result), and merge_parallel_projections merges projections of one input (Q, K, V;
the gated gate/up pair too) into one wider lowbit_linear and a split.  Each rewrite is checked
against the unrewritten graph on the numpy reference, then compiled (CPU row kernel; the GPU
decode kernel in the `cuda` test) over fresh inputs."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.backend.isa import vector_lanes
from tessera.eager.quantize import QuantizedLinear
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.graph.passes import drop_reshapes, merge_parallel_projections
from tessera.quant.quantize import quantize_weight

needs_simd = pytest.mark.skipif(vector_lanes() == 1, reason="the CPU low-bit kernel needs AVX2 or AVX-512")


def _layer(rng, n, k, weight="int4", group=32, zp=False):
    consts, attrs = QuantizedLinear(quantize_weight(rng.standard_normal((n, k)) * 0.1, weight, group, zp)).graph_operands()
    return consts, attrs


def _lowbit(b, x, layer):
    """tessera.quantize's layer as the front end records it: flatten, lowbit_linear, unflatten."""
    consts, attrs = layer
    lead = list(x.shape[:-1])
    flat = b.op("reshape", x, shape=[-1, attrs["k"]])
    y = b.op("lowbit_linear", flat, *(b.constant(c) for c in consts), **attrs)
    return b.op("reshape", y, shape=[*lead, attrs["n"]])


def _block(rng, lead, k=64, dtype="float32", zp=False):
    """Q, K, V of one input, and a SwiGLU MLP with a residual: a decoder layer's projections."""
    wt = "uint4" if zp else "int4"
    layers = {name: _layer(rng, n, kk, wt, 32, zp) for name, n, kk in
              (("q", 64, k), ("k", 32, k), ("v", 32, k), ("gate", 96, k), ("up", 96, k), ("down", k, 96))}  # fmt: skip
    b = GraphBuilder("block")
    x = b.input("x", [*lead, k], dtype)
    q, kk, v = (_lowbit(b, x, layers[n]) for n in ("q", "k", "v"))
    n2 = b.op("tanh", x)  # (the MLP reads another input than the attention: its own norm)
    h = b.op("mul", b.op("silu", _lowbit(b, n2, layers["gate"])), _lowbit(b, n2, layers["up"]))
    b.output(b.op("add", _lowbit(b, h, layers["down"]), x), q, kk, v)
    return b.build()


def _kinds(graph) -> list[str]:
    return [op.kind for op in graph.operators]


@pytest.mark.parametrize("lead", [(1, 1), (2, 3), (5,)])
def test_rewrites_keep_the_results(rng, lead):
    g = _block(rng, lead)
    x = rng.standard_normal((*lead, 64)).astype(np.float32)
    before = g.run(x)
    assert drop_reshapes(g) >= 6  # every flatten / unflatten pair (identities with one leading axis)
    lowbits = [op for op in g.operators if op.kind == "lowbit_linear"]
    assert all(op.inputs[0].shape == (*lead, op.attrs["k"]) for op in lowbits)
    assert all(op.inputs[0].producer is None or op.inputs[0].producer.kind != "reshape" for op in lowbits)
    assert merge_parallel_projections(g) == 2  # Q, K, V and gate, up
    assert _kinds(g).count("lowbit_linear") == 3 and _kinds(g).count("split") == 2
    merged = [op for op in g.operators if op.kind == "lowbit_linear" and op.name.startswith("merged_")]
    assert sorted(op.attrs["n"] for op in merged) == [128, 192]
    g.verify()
    for got, ref in zip(g.run(x), before):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_zero_points_merge_with_their_biases(rng):
    g = _block(rng, (3,), zp=True)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    before = g.run(x)
    drop_reshapes(g)
    assert merge_parallel_projections(g) == 2
    for got, ref in zip(g.run(x), before):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_projections_that_cannot_share_a_kernel_stay_apart(rng):
    """Widths off whole 16-row tiles (the words would not concatenate), another group size or
    type: no merge."""
    b = GraphBuilder("apart")
    x = b.input("x", [2, 64])
    b.output(*(b.op("lowbit_linear", x, *(b.constant(c) for c in consts), **attrs) for consts, attrs in
               (_layer(rng, 40, 64), _layer(rng, 24, 64), _layer(rng, 32, 64, group=64), _layer(rng, 32, 64, "int3"))))  # fmt: skip
    g = b.build()
    assert merge_parallel_projections(g) == 0
    assert _kinds(g) == ["lowbit_linear"] * 4


@needs_simd
@pytest.mark.slow
def test_cpu_compiles_the_rewritten_block_into_fewer_kernels(rng):
    """The whole pipeline on the CPU: the residual add folds into down's stores, silu * up into one
    kernel after the merged gate/up, no reshape kernel, no numpy reference; fresh inputs per call."""
    lead = (1, 1)
    reference = _block(np.random.default_rng(7), lead)  # the same weights, never rewritten
    compiled = compile_graph(_block(np.random.default_rng(7), lead), "cpu")
    summary = compiled.summary()
    assert not summary["reference_ops"], summary
    assert summary["steps"]["anchor"] == 3, summary  # merged QKV, merged gate/up, down (+ residual)
    names = [name for step in compiled.report().kernels for name in step.kernels]
    assert not any("reshape" in name for name in names), names
    for _ in range(3):
        x = rng.standard_normal((*lead, 64)).astype(np.float32)
        for got, ref in zip(compiled(x), reference.run(x)):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_prefill_rows_plan_a_dequantised_temporary_and_the_fp16_gemm():
    """Beyond DECODE_MAX_M rows the GPU anchor dequantises into a per-call temporary [N, K] (the
    graph's arena, not a workspace the kernel keeps) and runs the GEMM template on it, the
    epilogue in the GEMM's stores; nvcc builds it."""
    from tessera.eager.lowbit import DECODE_MAX_M
    from tessera.ir import dtypes
    from tessera.templates.epilogue import identity_epilogue
    from tessera.templates.kernel import TEMPORARY
    from tessera.templates.lowbit.plan import plan_lowbit_linear

    consts, attrs = _layer(np.random.default_rng(1), 96, 520, "uint3", 8, True)
    for lead in ((2, 70), (DECODE_MAX_M + 1,)):
        plan = plan_lowbit_linear((*lead, 520), attrs, consts[0].size, consts[1].shape, consts[2].shape,
                                  identity_epilogue((*lead, 96), dtypes.float32, dtypes.float16))  # fmt: skip
        assert plan.out_shape == (*lead, 96) and plan.temporaries == [((96, 520), dtypes.float16)]
        assert not plan.workspaces and len(plan.launches) == 2
        assert plan.launches[0].func.name.startswith("lowbit_dequant") and (TEMPORARY, 0) in plan.launches[0].slots
    plan.build()
    decode = plan_lowbit_linear((DECODE_MAX_M, 520), attrs, consts[0].size, consts[1].shape, consts[2].shape)
    assert not decode.temporaries and len(decode.launches) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("prefill", ["dequant", "fused", "register"])
def test_cuda_compiles_the_rewritten_block_on_the_decode_kernel(rng, monkeypatch, prefill):
    """The same block in float16 on the GPU: three decode-kernel launches (beyond DECODE_MAX_M
    rows: dequantise into the arena, then the fp16 GEMM, or the fused prefill kernel, or the
    register-A kernel on the words the lowbit_fragment_words pass added), the epilogue fused,
    checked over fresh inputs (the replayed CUDA graph included) against the float32 reference."""
    monkeypatch.setenv("TESSERA_LOWBIT_PREFILL", prefill)
    for lead in ((1, 1), (3, 5), (2, 70)) if prefill == "dequant" else ((2, 70), (1, 300)):
        ref_graph = _block(np.random.default_rng(3), lead)
        compiled = compile_graph(_block(np.random.default_rng(3), lead, dtype="float16"), "cuda")
        summary = compiled.summary()
        assert not summary["reference_ops"] and summary["steps"]["anchor"] == 3, summary
        for _ in range(3):
            x = rng.standard_normal((*lead, 64)).astype(np.float32)
            outs = compiled(x.astype(np.float16))
            for got, ref in zip(outs, ref_graph.run(x)):
                got = np.asarray(got.cpu() if hasattr(got, "cpu") else got, np.float32)
                np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
        if prefill == "register":  # (not a silent fall back to the two passes)
            names = [name for step in compiled.report().kernels for name in step.kernels]
            assert sum("_rs_" in name for name in names) == 3, names


def test_small_float_weights_with_zero_points_are_refused(rng):
    """The kernels and the reference disagree on what a small float's zero point would mean, and
    quantisation never makes one: the operator refuses it with a clear error."""
    from tessera.graph.symbolic import ShapeError

    consts, attrs = _layer(rng, 32, 256, "e2m1", 32, None)
    b = GraphBuilder("float_zp")
    x = b.input("x", [2, 256])
    with pytest.raises(ShapeError, match="take no zero points"):
        b.op("lowbit_linear", x, *(b.constant(c) for c in consts), **{**attrs, "has_bias": True})
