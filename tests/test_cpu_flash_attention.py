"""Attention on the CPU generic in batch and lengths (tessera/templates/attention/cpu_flash.py):
one build per site serves every size; masks, causal, grouped heads and odd head sizes against
the operator's numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.backend.isa import vector_lanes
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph

pytestmark = pytest.mark.skipif(vector_lanes() == 1, reason="no AVX2: the CPU templates refuse everything")


def _graph(heads=4, kv_heads=4, d=16, dv=16, causal=False, mask=None, scale=None):
    """sdpa over q [b, H, sq, d], k [b, KVH, sk, d], v [b, KVH, sk, dv]; `mask`: (dtype, dims)."""
    g = GraphBuilder("sdpa")
    q = g.input("q", ["b", heads, "sq", d])
    k = g.input("k", ["b", kv_heads, "sk", d])
    v = g.input("v", ["b", kv_heads, "sk", dv])
    ins = [q, k, v]
    if mask is not None:
        ins.append(g.input("mask", list(mask[1]), mask[0]))
    attrs = {"causal": causal} | ({"scale": scale} if scale is not None else {})
    g.output(g.op("scaled_dot_product_attention", *ins, **attrs))
    return g.build()


def _mask_value(rng, dtype, shape):
    if dtype == "bool":
        return rng.random(shape) < 0.8
    return np.where(rng.random(shape) < 0.2, -np.inf, rng.standard_normal(shape)).astype(np.float32)


def _check(graph, rng, sizes, heads, kv_heads, d, dv, mask_dims=None, mask_dtype=None):
    compiled = compile_graph(graph, "cpu", tune=False)
    step = next(s for s in compiled.steps if s.kind == "anchor")
    for b, sq, sk in sizes:
        env = {"b": b, "sq": sq, "sk": sk}
        args = [rng.standard_normal(shape).astype(np.float32)
                for shape in ((b, heads, sq, d), (b, kv_heads, sk, d), (b, kv_heads, sk, dv))]  # fmt: skip
        if mask_dims is not None:
            args.append(_mask_value(rng, mask_dtype, tuple(env.get(x, x) for x in mask_dims)))
        (got,) = compiled(*args)
        (ref,) = graph.run(*args)
        np.testing.assert_allclose(got, ref, rtol=3e-5, atol=3e-5, equal_nan=True)
    assert all(k.kernel.kernels[0].startswith("flash_attention_cpu") for k in step.prepared())
    return {id(k.kernel) for k in step.prepared()}


SIZES = [(2, 5, 5), (1, 1, 1), (3, 33, 33), (1, 70, 70), (2, 5, 5), (1, 17, 17)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_plain_and_causal_match_the_reference_at_every_size(rng, causal):
    built = _check(_graph(causal=causal), rng, SIZES, 4, 4, 16, 16)
    assert len(built) <= 2  # one thread for small work, the OpenMP team for large: each built once


@pytest.mark.parametrize("mask_dtype", ["bool", "float32"])
@pytest.mark.parametrize("dims", [("b", 1, 1, "sk"), ("b", 1, "sq", "sk"), ("sq", "sk"), (1, 4, 1, "sk")],
                         ids=["padding", "per-query", "2-d", "per-head"])  # fmt: skip
def test_masks_broadcast_and_combine_with_causal(rng, mask_dtype, dims):
    graph = _graph(causal=dims == ("sq", "sk"), mask=(mask_dtype, dims))
    sizes = [(2, 5, 5), (1, 1, 1), (3, 40, 40), (1, 9, 9)] if "sq" in dims else [(2, 3, 7), (1, 1, 1), (2, 40, 9)]
    _check(graph, rng, sizes, 4, 4, 16, 16, dims, mask_dtype)


def test_grouped_heads_odd_head_sizes_and_a_scale(rng):
    """Two query heads per KV head, head sizes that fill no vector (d 20, dv 12), queries and keys of
    different lengths (cross attention), an explicit scale."""
    graph = _graph(heads=6, kv_heads=3, d=20, dv=12, scale=0.3)
    _check(graph, rng, [(2, 3, 7), (1, 1, 50), (2, 41, 2), (1, 1, 1)], 6, 3, 20, 12)


def test_causal_with_more_keys_or_more_queries(rng):
    """Top-left causal alignment (key j <= query i), as the reference: with sq > sk the last
    queries see every key, with sq < sk the later keys are never seen."""
    _check(_graph(causal=True, heads=2, kv_heads=1), rng, [(1, 9, 4), (2, 4, 9), (1, 40, 70)], 2, 1, 16, 16)
    # Three query heads per KV head: tiles of 5 queries, which do not divide the 32-key blocks,
    # so a tile's first rows see none of its last block.
    _check(_graph(causal=True, heads=3, kv_heads=1), rng, [(1, 70, 70), (2, 36, 40)], 3, 1, 16, 16)


def test_fully_masked_rows_give_nan_like_the_reference(rng):
    graph = _graph(mask=("bool", ("b", 1, 1, "sk")))
    compiled = compile_graph(graph, "cpu", tune=False)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 4, 3, 16), (2, 4, 5, 16), (2, 4, 5, 16)))
    mask = np.ones((2, 1, 1, 5), bool)
    mask[1] = False  # the second batch sees no key
    (got,) = compiled(q, k, v, mask)
    (ref,) = graph.run(q, k, v, mask)
    assert np.isnan(got[1]).all() and np.isnan(ref[1]).all()
    np.testing.assert_allclose(got[0], ref[0], rtol=3e-5, atol=3e-5)
