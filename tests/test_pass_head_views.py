"""head_views: the head split / merge around attention become split_heads / merge_heads, with
the same results."""

from __future__ import annotations

import numpy as np
import pytest
from graph_form import form

from tessera.graph import GraphBuilder, Sym
from tessera.graph.passes import eliminate_dead_code, head_views


def _heads(b, t, batch, seq, h, d):
    return b.op("permute", b.op("reshape", t, shape=[batch, seq, h, d]), perm=[0, 2, 1, 3])


def _attention_block(batch, seq, h, hk, d, split=True):
    """x [B, S, W] -> q, k, v heads (one split of a fused projection, or three inputs) -> attention ->
    merged heads + x's first columns."""
    b = GraphBuilder()
    if split:
        x = b.input("x", [batch, seq, (h + 2 * hk) * d])
        q, k, v = b.op_multi("split", b.op("add", x, x), axis=-1, sizes=[h * d, hk * d, hk * d])
    else:
        q, k, v = (b.op("neg", b.input(n, [batch, seq, c * d])) for n, c in (("q", h), ("k", hk), ("v", hk)))
    qh, kh, vh = _heads(b, q, batch, seq, h, d), _heads(b, k, batch, seq, hk, d), _heads(b, v, batch, seq, hk, d)
    att = b.op("scaled_dot_product_attention", qh, kh, vh, causal=True)
    merged = b.op("reshape", b.op("permute", att, perm=[0, 2, 1, 3]), shape=[batch, seq, h * d])
    b.output(b.op("exp", merged))
    return b.build()


@pytest.mark.parametrize("batch,seq,h,hk,d", [(1, 5, 4, 4, 8), (2, 1, 6, 2, 4), (3, 7, 2, 1, 16)])
def test_split_and_merge_become_head_views(rng, batch, seq, h, hk, d):
    g = _attention_block(batch, seq, h, hk, d)
    xs = [rng.standard_normal((batch, seq, (h + 2 * hk) * d)).astype(np.float32) for _ in range(3)]
    before = [g.run(x)[0] for x in xs]
    assert head_views(g) == 4
    eliminate_dead_code(g)
    assert g.verify().summary() == {"add": 1, "split_heads": 3, "scaled_dot_product_attention": 1,
                                    "merge_heads": 1, "exp": 1}  # fmt: skip
    offsets = [op.attrs["offset"] for op in g.operators if op.kind == "split_heads"]
    assert sorted(offsets) == [0, h * d, (h + hk) * d]
    for x, want in zip(xs, before):
        np.testing.assert_allclose(g.run(x)[0], want, rtol=1e-5, atol=1e-6)


def test_projections_without_a_split(rng):
    g = _attention_block(2, 3, 2, 2, 4, split=False)
    args = [rng.standard_normal((2, 3, 8)).astype(np.float32) for _ in range(3)]
    before = g.run(*args)[0]
    assert head_views(g) == 4
    assert all(op.attrs["offset"] == 0 for op in g.operators if op.kind == "split_heads")
    np.testing.assert_allclose(g.run(*args)[0], before, rtol=1e-5, atol=1e-6)


def test_symbolic_batch_and_length(rng):
    g = _attention_block(Sym.var("b"), Sym.var("s"), 2, 1, 8)
    assert head_views(g) == 4
    for shape in ((1, 3, 32), (2, 5, 32)):
        x = rng.standard_normal(shape).astype(np.float32)
        want = _attention_block(*shape[:2], 2, 1, 8).run(x)[0]
        np.testing.assert_allclose(g.run(x)[0], want, rtol=1e-5, atol=1e-6)


def test_chains_that_are_not_head_views_stay():
    def build(perm=(0, 2, 1, 3), shared=False):
        b = GraphBuilder()
        x = b.input("x", [2, 3, 8])
        r = b.op("reshape", x, shape=[2, 3, 2, 4])
        y = b.op("permute", r, perm=list(perm))
        b.output(y, r) if shared else b.output(y)
        return b.build()

    assert head_views(build(perm=(0, 1, 3, 2))) == 0  # not the head swap
    assert head_views(build(shared=True)) == 0  # the reshape is read elsewhere too
    b = GraphBuilder()  # a merge whose reshape does not flatten the heads
    y = b.op("permute", b.input("y", [2, 3, 5, 4]), perm=[0, 2, 1, 3])
    b.output(b.op("reshape", y, shape=[2, 15, 4]))
    assert head_views(b.build()) == 0


def test_operators_refuse_bad_attributes():
    from tessera.graph import ShapeError

    b = GraphBuilder()
    x = b.input("x", [2, 3, 8])
    with pytest.raises(ShapeError, match="exceed the width"):
        b.op("split_heads", x, heads=2, head_dim=4, offset=1)
    with pytest.raises(ShapeError, match="positive ints"):
        b.op("split_heads", x, heads=0, head_dim=4)
    with pytest.raises(ShapeError, match="batch, heads, seq"):
        b.op("merge_heads", x)


def test_column_slices_become_head_views(rng):
    # Phi-3 slices its fused projection: q = qkv[..., :H*D], k = qkv[..., H*D:(H+Hk)*D], v = qkv[..., -Hk*D:]
    h, hk, d, s = 4, 2, 8, 5
    b = GraphBuilder()
    x = b.input("x", [1, s, (h + 2 * hk) * d])
    big = 2**62
    q = b.op("slice", x, axes=[-1], starts=[0], ends=[h * d])
    k = b.op("slice", x, axes=[2], starts=[h * d], ends=[(h + hk) * d], steps=[1])
    v = b.op("slice", x, axes=[-1], starts=[-hk * d], ends=[big])
    heads = [_heads(b, t, 1, s, n, d) for t, n in ((q, h), (k, hk), (v, hk))]
    b.output(b.op("scaled_dot_product_attention", *heads, causal=True))
    g = b.build()
    xs = [rng.standard_normal((1, s, (h + 2 * hk) * d)).astype(np.float32) for _ in range(2)]
    before = [g.run(a)[0] for a in xs]
    assert head_views(g) == 3
    eliminate_dead_code(g)
    assert sorted(op.attrs["offset"] for op in g.operators if op.kind == "split_heads") == [0, h * d, (h + hk) * d]
    assert "slice" not in g.summary()
    for a, want in zip(xs, before):
        np.testing.assert_allclose(g.run(a)[0], want, rtol=1e-5, atol=1e-6)


def test_block_before_and_after(rng):
    batch, seq, h, hk, d = 3, 5, 2, 1, 3
    g = _attention_block(batch, seq, h, hk, d)
    xs = [rng.standard_normal((batch, seq, (h + 2 * hk) * d)).astype(np.float32) + 0.1 for _ in range(2)]
    before = [g.run(x)[0] for x in xs]
    assert head_views(g) == 4
    eliminate_dead_code(g)
    b = GraphBuilder()
    x = b.input("x", [batch, seq, (h + 2 * hk) * d])
    qkv = b.op("add", x, x)
    heads = [b.op("split_heads", qkv, heads=n, head_dim=d, offset=o) for n, o in ((h, 0), (hk, h * d), (hk, (h + hk) * d))]
    b.output(b.op("exp", b.op("merge_heads", b.op("scaled_dot_product_attention", *heads, causal=True))))
    assert form(g.verify()) == form(b.build())
    for x, want in zip(xs, before):
        np.testing.assert_allclose(g.run(x)[0], want, rtol=1e-5, atol=1e-6)
