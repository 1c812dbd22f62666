"""simplify_attention_masks: constant all-kept masks go, causal masks become causal=True; results stay."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.graph.passes import simplify_attention_masks


def _graph(mask: np.ndarray, sq: int, sk: int, heads: int = 2, dim: int = 5, causal: bool = False):
    b = GraphBuilder()
    q = b.input("q", [2, heads, sq, dim])
    k, v = b.input("k", [2, heads, sk, dim]), b.input("v", [2, heads, sk, dim])
    b.output(b.op("scaled_dot_product_attention", q, k, v, b.constant(mask), causal=causal, scale=0.4))
    return b.build()


def _run_both(rng, g, before_graph, compiled=None):
    for _ in range(2):
        xs = [rng.standard_normal([int(d) for d in t.shape]).astype(np.float32) * 2 for t in g.inputs]
        want = before_graph.run(*xs)[0]
        np.testing.assert_allclose(g.run(*xs)[0], want, rtol=1e-5, atol=1e-6)
        if compiled is not None:
            np.testing.assert_allclose(np.asarray(compiled(*xs)[0]), want, rtol=1e-4, atol=1e-5)


def _causal(sq, sk, masked, dtype=np.float32, shape=(1, 1)):
    keep = np.tri(sq, sk, dtype=bool)
    m = keep if masked is None else np.where(keep, 0, masked).astype(dtype)
    return np.broadcast_to(m, (*shape, sq, sk)).copy()


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 4), (1, 6)])
@pytest.mark.parametrize("masked", [np.finfo(np.float32).min, -np.inf, None])
def test_causal_masks_become_causal(rng, sq, sk, masked):
    mask = _causal(sq, sk, masked)
    g, before = _graph(mask, sq, sk), _graph(mask, sq, sk)
    assert simplify_attention_masks(g) == 1
    (op,) = g.verify().operators
    assert len(op.inputs) == 3 and op.attrs["causal"] and op.attrs["scale"] == 0.4
    _run_both(rng, g, before)


def test_all_kept_masks_go_and_the_cpu_kernel_agrees(rng):
    for mask in (np.zeros((1, 1, 1, 6), np.float32), np.ones((2, 1, 5, 6), bool)):
        g, before = _graph(mask, 5, 6), _graph(mask, 5, 6)
        assert simplify_attention_masks(g) == 1
        (op,) = g.operators
        assert len(op.inputs) == 3 and not op.attrs["causal"]
        _run_both(rng, g, before)
    g = _graph(_causal(6, 6, np.finfo(np.float32).min, shape=(2, 2)), 6, 6)
    compiled = compile_graph(g, "cpu", tune=False)  # the pipeline runs the pass
    assert g.operators[0].attrs["causal"] and len(g.operators[0].inputs) == 3
    _run_both(rng, g, _graph(_causal(6, 6, np.finfo(np.float32).min, shape=(2, 2)), 6, 6), compiled)


def test_masks_that_say_more_stay():
    lowest = np.finfo(np.float32).min
    padding = np.zeros((2, 1, 1, 6), np.float32)
    padding[0, ..., -2:] = lowest
    per_batch = _causal(6, 6, lowest, shape=(2, 1))
    per_batch[1, 0, 3, 0] = lowest  # one batch's mask is not causal
    alibi = np.where(np.tri(6, 6, dtype=bool), -0.5, lowest).astype(np.float32)[None, None]  # kept entries biased
    soft = _causal(6, 6, -100.0)  # -100 does not surely vanish
    for mask in (padding, per_batch, alibi, soft):
        g = _graph(mask, 6, 6)
        assert simplify_attention_masks(g) == 0
    assert simplify_attention_masks(_graph(_causal(6, 6, lowest), 6, 6, causal=True)) == 0  # causal twice: kept as is
