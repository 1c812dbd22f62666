"""tessera.templates.lowbit.tune: the decode kernel's configs tuned per shape for the lowbit_linear anchor —
candidates that read the graph's k order, random weights with finite codes only, and (GPU) a
tuned graph that computes the same as the default one over fresh inputs, its winner recorded."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.eager.quantize import QuantizedLinear
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.ir import dtypes
from tessera.quant import codecs
from tessera.quant.layout import pack_units, unpack_units
from tessera.quant.quantize import quantize_weight
from tessera.templates.lowbit.tune import decode_candidates, finite_words, template_source

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("m,n,k", [(1, 2048, 2048), (1, 11264, 2048), (16, 2048, 5632), (5, 72, 264)])
@pytest.mark.parametrize("span", [2, 16])
def test_candidates_read_the_graphs_k_order_and_start_with_the_default(m, n, k, span):
    cands = decode_candidates(4, m, n, k, 132, span)
    assert cands[0].span == span and len(cands) == len(set(cands)) >= 2
    assert all(c.span == span and not c.problems() for c in cands)
    assert all(c.x_units == 0 or c.x_units >= -(-k // 256 // c.split) for c in cands)  # each block's staged units
    assert "lowbit_decode" in template_source()


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1", "int3", "uint8"])
def test_random_tuning_words_hold_finite_codes_only(rng, name):
    t = dtypes.dtype(name)
    n, k = 32, 512
    words = pack_units(np.zeros((n, k), np.uint32), t, 2).size
    mask = finite_words(t, 2, words).numpy().view(np.uint32)
    raw = rng.integers(0, 2**32, words, dtype=np.uint64).astype(np.uint32)
    codes = unpack_units(raw & mask, t, n, k, 2).astype(np.int64)
    if t.is_float:
        assert np.isfinite(codecs.decode(codes, t)).all()
    else:  # integers: every code is a value, none is masked away
        assert (mask == np.uint32(0xFFFFFFFF)).all()
    assert len(np.unique(codes)) > (1 << t.nbits) // 4  # still random codes


def _graph(consts, attrs, lead, dtype="float16"):
    b = GraphBuilder("tuned")
    x = b.input("x", [*lead, attrs["k"]], dtype)
    y = b.op("lowbit_linear", x, *(b.constant(c) for c in consts), **attrs)
    b.output(b.op("relu", y))
    return b.build()


@pytest.mark.cuda
@pytest.mark.parametrize("weight,zp", [("int4", False), ("uint3", True), ("e4m3", None)])
def test_cuda_tuned_anchor_matches_the_default_and_records_its_winner(rng, tmp_path, monkeypatch, weight, zp):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))  # a fresh tuning record
    consts, attrs = QuantizedLinear(quantize_weight(rng.standard_normal((96, 520)) * 0.1, weight, 8 if zp else 32,
                                                    zp)).graph_operands()  # fmt: skip
    for lead in ((1,), (1, 1), (3, 5)):
        plain = compile_graph(_graph(consts, attrs, lead), "cuda", tune=False)
        tuned = compile_graph(_graph(consts, attrs, lead), "cuda", tune=True)
        assert not tuned.summary()["reference_ops"]
        for _ in range(2):
            x = rng.standard_normal((*lead, 520)).astype(np.float16)
            a, b = (np.asarray(r[0].cpu() if hasattr(r[0], "cpu") else r[0], np.float32) for r in (plain(x), tuned(x)))
            np.testing.assert_allclose(b, a, rtol=1e-2, atol=1e-2 * np.abs(a).max())
    records = list((tmp_path / "tuning").glob("*.json"))
    assert records, "no tuning record written"


@pytest.mark.cuda
def test_cuda_eager_layer_tunes_once_per_token_bucket(rng, tmp_path, monkeypatch):
    """tessera.eager.lowbit.cuda_matmul with tuning on: a tuned config per bucket (<= 8 tokens,
    beyond), right over fresh inputs, and the second bucket's calls reuse their config."""
    from tessera.eager.lowbit import cuda_matmul, prepare

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TESSERA_TUNE", "1")
    q = quantize_weight(rng.standard_normal((200, 776)) * 0.1, "int3", 8, True)
    p = prepare(q)
    w = torch.from_numpy(q.dequantize()).cuda().double()
    for m in (1, 5, 13, 40):
        for _ in range(2):
            x = torch.randn(m, 776, dtype=torch.float16, device="cuda")
            ref = x.double() @ w.T
            assert float((cuda_matmul(x, p).double() - ref).norm() / ref.norm()) < 2e-3
    assert {key for key in p.cache if key[0] == "config"} == {("config", True), ("config", False)}
    assert list((tmp_path / "tuning").glob("*.json"))
