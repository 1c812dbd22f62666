"""fuse_attention: written-out attention becomes scaled_dot_product_attention, with the same results."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.graph.passes import eliminate_dead_code, fuse_attention


def _heads(b, t, batch, seq, heads, dim):
    return b.op("permute", b.op("reshape", t, shape=[batch, seq, heads, dim]), perm=[0, 2, 1, 3])


def _attention_graph(batch, seq, heads, dim, *, mask="add", scale="div", dt="float32", kv_seq=None):
    """Eager attention as ONNX exports write it: x [B, S, H*D] -> heads, q @ k^T, scale, mask,
    softmax, @ v, heads back.  `mask`: None, "add" (float [B, 1, 1, Sk]), "add_full" ([B, 1, Sq, Sk]),
    "where" (bool [B, 1, Sq, Sk], keep True), "where_drop" (fill where True)."""
    kv_seq = kv_seq or seq
    b = GraphBuilder()
    xq = b.input("xq", [batch, seq, heads * dim], dt)
    xk = b.input("xk", [batch, kv_seq, heads * dim], dt)
    xv = b.input("xv", [batch, kv_seq, heads * dim], dt)
    q, k, v = _heads(b, xq, batch, seq, heads, dim), _heads(b, xk, batch, kv_seq, heads, dim), _heads(b, xv, batch, kv_seq, heads, dim)
    c = lambda val: b.constant(np.asarray(val, dtype=dt))  # noqa: E731
    if scale == "qk":  # torch's SDPA exported: sqrt(scale) on q and on k^T
        q = b.op("mul", q, c(dim**-0.25))
        kt = b.op("mul", b.op("permute", k, perm=[0, 1, 3, 2]), c(dim**-0.25))
    else:
        kt = b.op("permute", k, perm=[0, 1, 3, 2])
    s = b.op("matmul", q, kt)
    if scale == "div":
        s = b.op("div", s, c(math.sqrt(dim)))
    elif scale == "mul":
        s = b.op("mul", c(0.3), s)
    if mask == "add":
        s = b.op("add", s, b.input("mask", [batch, 1, 1, kv_seq], dt))
    elif mask == "add_full":
        s = b.op("add", b.input("mask", [batch, 1, seq, kv_seq], dt), s)
    elif mask == "where":
        s = b.op("where", b.input("mask", [batch, 1, seq, kv_seq], "bool"), s, c(-np.inf))
    elif mask == "where_drop":
        s = b.op("where", b.input("mask", [batch, 1, seq, kv_seq], "bool"), c(-np.inf), s)
    o = b.op("matmul", b.op("softmax", s, axis=-1), v)
    b.output(b.op("reshape", b.op("permute", o, perm=[0, 2, 1, 3]), shape=[batch, seq, heads * dim]))
    return b.build()


def _inputs(rng, g, fully_masked=True):
    out = []
    for t in g.inputs:
        shape = [int(d) for d in t.shape]
        if t.name != "mask":
            out.append(rng.standard_normal(shape).astype(t.dtype.name))
        elif t.dtype.is_bool:
            m = rng.random(shape) < 0.7
            if fully_masked and shape[-2] > 1:
                m[..., 0, :] = "where_drop" in g.name  # query row 0 sees no key
            out.append(m)
        else:
            lowest = np.finfo(t.dtype.name).min  # transformers' additive mask value
            m = np.where(rng.random(shape) < 0.7, 0.0, lowest).astype(t.dtype.name)
            if fully_masked:
                m[0] = lowest  # every key masked for the first batch: its rows average v, both ways
            out.append(m)
    return out


CASES = [  # (batch, seq, heads, dim, mask, scale)
    (2, 5, 3, 7, "add", "div"),
    (1, 1, 1, 4, "add", "div"),
    (1, 6, 2, 8, "add_full", "mul"),
    (2, 5, 3, 7, "where", "div"),
    (1, 4, 1, 5, "where_drop", "mul"),
    (3, 7, 2, 3, None, None),
    (2, 5, 2, 16, "add", "qk"),
]


@pytest.mark.parametrize("batch,seq,heads,dim,mask,scale", CASES)
def test_attention_chain_becomes_sdpa(rng, batch, seq, heads, dim, mask, scale):
    g = _attention_graph(batch, seq, heads, dim, mask=mask, scale=scale)
    g.name = f"attention_{mask}"
    calls = [_inputs(rng, g) for _ in range(2)]
    before = [g.run(*xs)[0] for xs in calls]
    assert fuse_attention(g) == 1
    eliminate_dead_code(g)
    kinds = g.verify().summary()
    assert kinds.get("scaled_dot_product_attention") == 1 and "softmax" not in kinds and "matmul" not in kinds
    sdpa = next(op for op in g.operators if op.kind == "scaled_dot_product_attention")
    want_scale = {"div": 1 / math.sqrt(dim), "mul": 0.3, "qk": dim**-0.5, None: 1.0}[scale]
    assert sdpa.attrs["scale"] == pytest.approx(want_scale, rel=1e-6) and not sdpa.attrs["causal"]
    assert kinds.get("permute", 0) <= 4  # k's two permutes composed into one (or none)
    for xs, want in zip(calls, before):
        got = g.run(*xs)[0]
        if mask == "where_drop" and seq > 1:
            assert np.isnan(want[:, 0]).all() and np.isnan(got[:, 0]).all()  # a fully masked query row
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("mask", ["add", "where"])
def test_rewritten_attention_compiles_on_the_cpu(rng, mask):
    """The compiled rewritten graph (the attention anchor) against the unrewritten reference,
    fully masked rows included."""
    g = _attention_graph(2, 9, 3, 5, mask=mask, kv_seq=11)
    ref = _attention_graph(2, 9, 3, 5, mask=mask, kv_seq=11)
    compiled = compile_graph(g, "cpu", tune=False)
    assert g.summary().get("scaled_dot_product_attention") == 1
    for _ in range(2):
        xs = _inputs(rng, ref)
        want = ref.run(*xs)[0]
        got = np.asarray(compiled(*xs)[0])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_half_precision_attention_stays_close(rng):
    g = _attention_graph(1, 13, 2, 8, mask="add", dt="float16")
    xs = _inputs(rng, g, fully_masked=False)
    before = g.run(*xs)[0].astype(np.float32)
    assert fuse_attention(g) == 1
    np.testing.assert_allclose(g.run(*xs)[0].astype(np.float32), before, rtol=2e-2, atol=2e-3)


def test_chains_that_are_not_attention_stay(rng):
    # the probabilities are also a graph output (output_attentions=True)
    b = GraphBuilder()
    q, kt, v = b.input("q", [2, 3, 4]), b.input("kt", [2, 4, 5]), b.input("v", [2, 5, 6])
    p = b.op("softmax", b.op("matmul", q, kt), axis=-1)
    b.output(b.op("matmul", p, v), p)
    g = b.build()
    assert fuse_attention(g) == 0
    # batch axes broadcast in the matmuls
    b = GraphBuilder()
    q, kt, v = b.input("q", [2, 3, 4]), b.input("kt", [1, 4, 5]), b.input("v", [2, 5, 6])
    b.output(b.op("matmul", b.op("softmax", b.op("matmul", q, kt), axis=-1), v))
    g = b.build()
    assert fuse_attention(g) == 0
    # softmax over another axis; a mask that widens the scores; a where filling a finite value
    for variant in ("axis", "widen", "finite_fill"):
        b = GraphBuilder()
        q, kt, v = b.input("q", [2, 3, 4]), b.input("kt", [2, 4, 3]), b.input("v", [2, 3, 6])
        s = b.op("matmul", q, kt)
        if variant == "widen":
            s = b.op("add", s, b.input("m", [4, 2, 3, 3]))
        if variant == "finite_fill":
            s = b.op("where", b.input("m", [2, 3, 3], "bool"), s, b.constant(np.float32(-1e4)))
        b.output(b.op("matmul", b.op("softmax", s, axis=1 if variant == "axis" else -1), v))
        g = b.build()
        assert fuse_attention(g) == 0, variant
