"""fold_repeat_kv: attention reads grouped key/value heads instead of their repetition (HF's
repeat_kv), with the same results."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder
from tessera.graph.passes import eliminate_dead_code, fold_repeat_kv


def _repeat(b, t, batch, hk, rep, s, d):
    e = b.op("expand", b.op("unsqueeze", t, axes=[2]), shape=[batch, hk, rep, s, d])
    return b.op("reshape", e, shape=[batch, hk * rep, s, d])


def _graph(batch, h, hk, s, d, causal=True, keep_k=False):
    rep = h // hk
    b = GraphBuilder()
    q = b.input("q", [batch, h, s, d])
    k, v = (b.op("neg", b.input(n, [batch, hk, s, d])) for n in ("k", "v"))
    kr, vr = _repeat(b, k, batch, hk, rep, s, d), _repeat(b, v, batch, hk, rep, s, d)
    out = b.op("scaled_dot_product_attention", q, kr, vr, causal=causal)
    b.output(out, kr) if keep_k else b.output(out)
    return b.build()


@pytest.mark.parametrize("batch,h,hk,s,d,causal", [(1, 8, 2, 5, 16, True), (2, 4, 1, 1, 8, False), (3, 6, 3, 7, 4, True)])
def test_repeated_heads_are_read_grouped(rng, batch, h, hk, s, d, causal):
    g = _graph(batch, h, hk, s, d, causal)
    calls = [[rng.standard_normal(shape).astype(np.float32) for shape in ((batch, h, s, d), *[(batch, hk, s, d)] * 2)]
             for _ in range(3)]  # fmt: skip
    before = [g.run(*a)[0] for a in calls]
    assert fold_repeat_kv(g) == 2
    eliminate_dead_code(g)
    assert g.verify().summary() == {"neg": 2, "scaled_dot_product_attention": 1}
    attention = next(op for op in g.operators if op.kind == "scaled_dot_product_attention")
    assert attention.inputs[1].shape == (batch, hk, s, d)
    for a, want in zip(calls, before):
        np.testing.assert_allclose(g.run(*a)[0], want, rtol=1e-5, atol=1e-6)


def test_repetitions_that_must_stay():
    assert fold_repeat_kv(_graph(1, 4, 2, 3, 8, keep_k=True)) == 1  # k's repetition is an output too: only v goes
    b = GraphBuilder()  # repeated along another axis: not the grouping attention does
    q = b.input("q", [1, 4, 3, 8])
    k = b.input("k", [1, 2, 3, 8])
    kr, vr = (b.op("reshape", b.op("expand", b.op("unsqueeze", k, axes=[1]), shape=[1, 2, 2, 3, 8]), shape=[1, 4, 3, 8])
              for _ in range(2))  # fmt: skip
    b.output(b.op("scaled_dot_product_attention", q, kr, vr))
    assert fold_repeat_kv(b.build()) == 0
