"""keep_attention: F.scaled_dot_product_attention reaches tessera as one operator (the GPU keeps
it whole this way; here the pass runs on the CPU, where the result is the same operator)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from tessera.frontend.torch import backend, stats  # noqa: E402
from tessera.frontend.torch.keep_attention import keep_attention_whole  # noqa: E402


class Attend(torch.nn.Module):
    def __init__(self, mask_kind: str, causal: bool = False, scale: float | None = None, gqa: bool = False,
                 dropout: float = 0.0):  # fmt: skip
        super().__init__()
        self.mask_kind, self.causal, self.scale, self.gqa, self.dropout = mask_kind, causal, scale, gqa, dropout

    def forward(self, q, k, v, lengths):
        mask = None
        if self.mask_kind != "none":  # padding: key j is visible to batch b when j < lengths[b]
            keep = torch.arange(k.shape[-2], device=k.device)[None, None, None, :] < lengths[:, None, None, None]
            mask = keep if self.mask_kind == "bool" else torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, -1e4)
        return F.scaled_dot_product_attention(q * 1.5, k, v, attn_mask=mask, dropout_p=self.dropout,
                                              is_causal=self.causal, scale=self.scale, enable_gqa=self.gqa) + 1  # fmt: skip


def _inputs(g, batch=2, heads=4, kv_heads=4, q_len=7, k_len=9, dim=8):
    q = torch.randn(batch, heads, q_len, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, k_len, dim, generator=g) for _ in range(2))
    lengths = torch.randint(1, k_len + 1, (batch,), generator=g)
    return q, k, v, lengths


CASES = {
    "float mask": (dict(mask_kind="float"), {}),
    "bool mask + scale": (dict(mask_kind="bool", scale=0.3), {}),
    "causal": (dict(mask_kind="none", causal=True), dict(k_len=7)),
    "grouped heads": (dict(mask_kind="bool", gqa=True), dict(kv_heads=2)),
    "size-1 query": (dict(mask_kind="float"), dict(q_len=1, batch=1)),
}


def _compile(model, rewritten, to_tessera):
    def rewrite_then(gm, example_inputs):
        rewritten.append(keep_attention_whole(gm))
        return backend(gm, example_inputs) if to_tessera else gm.forward

    torch._dynamo.reset()
    return torch.compile(model, backend=rewrite_then)


@pytest.mark.parametrize("name", list(CASES))
def test_rewritten_attention_matches_torch_and_compiles_to_one_operator(name):
    kwargs, sizes = CASES[name]
    model = Attend(**kwargs)
    for to_tessera in (False, True):
        rewritten = []
        compiled = _compile(model, rewritten, to_tessera)
        before = dict(stats)
        with torch.no_grad():
            for seed in (1, 2, 3):  # fresh inputs on every call
                args = _inputs(torch.Generator().manual_seed(seed), **sizes)
                torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-5)
        assert rewritten and all(n == 1 for n in rewritten)
        if to_tessera:
            assert stats["eager_nodes"] == before["eager_nodes"], "an op ran in torch"


def test_the_rewrite_leaves_dropout_and_unknown_calls_to_torch():
    rewritten = []
    compiled = _compile(Attend("none", dropout=0.25), rewritten, False)
    compiled.train()
    compiled(*_inputs(torch.Generator().manual_seed(0)))
    assert rewritten == [0]


def test_the_custom_op_refuses_what_torch_refuses():
    q, k, v, _ = _inputs(torch.Generator().manual_seed(0), kv_heads=2)
    with pytest.raises(RuntimeError):
        torch.ops.tessera.attention(q, k, v, None, False, None, False)  # grouped heads without enable_gqa


@pytest.mark.cuda
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_masked_attention_on_the_gpu_runs_on_the_attention_template(mask_kind):
    import tessera

    model = Attend(mask_kind)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    with torch.no_grad():
        for seed in (1, 2, 3):
            q, k, v, lengths = _inputs(torch.Generator().manual_seed(seed), batch=2, heads=12, kv_heads=12, q_len=128,
                                       k_len=128, dim=64)  # fmt: skip
            ref = model(q.double(), k.double(), v.double(), lengths)
            out = compiled(*(t.cuda().half() for t in (q, k, v)), lengths.cuda())
            assert float((out.double().cpu() - ref).abs().max() / ref.abs().max()) < 1e-2
    text = str(tessera.explain(compiled))
    assert "scaled_dot_product_attention template" in text and "softmax" not in text, text
