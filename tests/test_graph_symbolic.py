"""Graph shape inference over general symbolic sizes (tessera.ir.symbolic): sums, floor
divisions and min/max stay evaluable, so a KV-cache attention with `past + seq` keys compiles
once and runs for every (past, seq); bind_shapes solves compound input dims."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder, ShapeError, Sym
from tessera.graph.compiler import compile_graph
from tessera.graph.symbolic import bind_shapes
from tessera.ir.symbolic import parse_dim

past, seq = Sym.var("past"), Sym.var("seq")


def _kv_attention_graph():
    """One decoder attention step: append the new keys/values to the cache, attend, and return the
    grown cache too (its size `past + seq` leaves the graph)."""
    b = GraphBuilder("kv")
    q = b.input("q", [1, 2, "seq", 8])
    k_cache, v_cache = b.input("k_cache", [1, 2, "past", 8]), b.input("v_cache", [1, 2, "past", 8])
    k_new, v_new = b.input("k_new", [1, 2, "seq", 8]), b.input("v_new", [1, 2, "seq", 8])
    k = b.op("concat", k_cache, k_new, axis=2)
    v = b.op("concat", v_cache, v_new, axis=2)
    scores = b.op("matmul", q, b.op("permute", k, perm=[0, 1, 3, 2]))
    probs = b.op("softmax", b.op("mul", scores, b.constant(np.float32(8 ** -0.5))), axis=-1)
    out = b.op("matmul", probs, v)
    # the last position's keys, by a slice whose bounds are symbolic sums
    last = b.op("slice", k, axes=[2], starts=[past + seq - 1], ends=[past + seq])
    b.output(out, k, last)
    return b.build()


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_kv_cache_concat_has_sum_sizes_and_runs_for_every_length(rng):
    g = _kv_attention_graph()
    out, k, last = g.outputs
    assert k.shape == (1, 2, past + seq, 8) and out.shape == (1, 2, seq, 8)
    assert last.shape == (1, 2, 1, 8)
    assert str(k.shape[2]) == "past + seq" and not any(n.startswith("_") for n in g.symbols())
    compiled = compile_graph(g, "cpu")
    for p, s in ((5, 1), (6, 1), (1, 7), (11, 3)):
        arrays = [rng.standard_normal(shape).astype(np.float32) for shape in
                  [(1, 2, s, 8), (1, 2, p, 8), (1, 2, p, 8), (1, 2, s, 8), (1, 2, s, 8)]]  # fmt: skip
        q, kc, vc, kn, vn = (a.astype(np.float64) for a in arrays)
        kk, vv = np.concatenate([kc, kn], 2), np.concatenate([vc, vn], 2)
        want = _softmax(q @ kk.transpose(0, 1, 3, 2) * 8 ** -0.5) @ vv
        for got in (compiled(*arrays), g.run(*arrays)):
            assert got[1].shape == (1, 2, p + s, 8)
            np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=2e-6)
            np.testing.assert_array_equal(got[1], kk.astype(np.float32))
            np.testing.assert_array_equal(got[2], kk[:, :, -1:].astype(np.float32))


def test_symbolic_sizes_survive_save_and_load(tmp_path):
    from tessera.graph import load

    g = _kv_attention_graph()
    path = tmp_path / "kv.tsg"
    g.save(path)
    again = load(path)
    assert [t.shape for t in again.outputs] == [t.shape for t in g.outputs]


def test_reshape_flatten_and_pooling_sizes_are_expressions():
    b = GraphBuilder("sizes")
    x = b.input("x", ["n", 3, "h", "w"])
    pooled = b.op("max_pool2d", x, kernel=[3, 3], stride=[2, 2], padding=[1, 1, 1, 1], ceil_mode=True)
    flat = b.op("reshape", pooled, shape=[-1, 3])
    b.output(pooled, flat)
    g = b.build()
    assert pooled.shape[2] == Sym.var("h") // 2 + 1  # torch's ceil-mode rule, simplified
    assert str(flat.shape[0]) == str(pooled.shape[0] * pooled.shape[2] * pooled.shape[3])
    compiled = compile_graph(g, "cpu")
    import torch

    for shape in ((1, 3, 7, 9), (2, 3, 8, 5), (1, 3, 1, 2)):
        xv = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        want = torch.nn.functional.max_pool2d(torch.from_numpy(xv), 3, 2, 1, ceil_mode=True).numpy()
        got = compiled(xv)
        np.testing.assert_array_equal(got[0], want)
        assert got[1].shape == (want.size // 3, 3)


def test_bind_shapes_solves_sums():
    items = [((1, 2, parse_dim("past + seq"), 8), (1, 2, 9, 8), "k"), ((seq,), (2,), "ids")]
    bindings: dict[str, int] = {}
    bind_shapes(bindings, items)
    assert bindings == {"seq": 2, "past": 7}
    with pytest.raises(ShapeError, match="cannot be 1 for any integer 'past'"):
        bind_shapes({}, [((parse_dim("past + seq"),), (1,), "k"), ((seq,), (2,), "ids")])
    with pytest.raises(ShapeError, match=r"sizes \['past', 'seq'\] are bound by no input's shape"):
        bind_shapes({}, [((parse_dim("past + seq"),), (4,), "k")])


def _mlp_graph():
    b = GraphBuilder("mlp")
    x = b.input("x", ["n", 16])
    w = b.constant(np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32))
    h = b.op("relu", b.op("matmul", x, w))
    b.output(b.op("reduce_sum", b.op("exp", b.op("mul", h, b.constant(np.float32(0.1)))), axes=[1]))
    return b.build(), w


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_plans_share_one_arena_sized_by_the_largest(rng, target):
    """Plans per length share one arena: memory follows the largest shape seen, not the sum;
    a length seen before the arena grew is planned again and still right."""
    g, w = _mlp_graph()
    compiled = compile_graph(g, target)
    wv = w.data.astype(np.float64)
    sizes = []
    for n in (3, 5, 9, 17, 5, 3, 33, 9):
        xv = rng.standard_normal((n, 16)).astype(np.float32)
        for _ in range(3):  # on the GPU: eager, capture, replay
            got = compiled(xv)[0]
            got = got.cpu().numpy() if hasattr(got, "cpu") else got
            want = np.exp(np.maximum(xv.astype(np.float64) @ wv, 0) * 0.1).sum(1)
            np.testing.assert_allclose(got, want, rtol=1e-5)
        sizes.append(compiled.summary()["shared_arena_bytes"])
    largest = max(p.arena_bytes for p in compiled._plans.values())
    assert sizes == sorted(sizes) and sizes[-1] >= largest
    assert all(p.arena is compiled._arena for p in compiled._plans.values())
    assert sizes[-1] <= 1.5 * largest + 4096
