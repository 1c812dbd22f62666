"""`torch.compile(..., backend="tessera", dynamic=True)`: models over several sequence lengths
and batch sizes, each call checked against eager on fresh inputs, with no graph break and no
recompile per size (dynamo's guards decide recompiles; sizes are tessera size expressions).
And a KV-cache attention whose cache grows by `past + seq` each call."""

from __future__ import annotations

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
tb = importlib.import_module("tessera.frontend.torch.backend")

SIZES = [(1, 7), (2, 13), (3, 21), (2, 5)]  # (batch, sequence); size 1 is specialised by dynamo


def _tiny(name: str) -> torch.nn.Module:
    if name == "bert":
        cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=37, vocab_size=100, max_position_embeddings=64)  # fmt: skip
        return transformers.BertModel(cfg)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100,
                                                                    n_positions=64))  # fmt: skip
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _output(model_name: str, out) -> torch.Tensor:
    return out.last_hidden_state if model_name == "bert" else out.logits


def _count_breaks_and_graphs():
    return tb.stats["eager_nodes"], tb.stats["graphs"]


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
@pytest.mark.slow
def test_transformers_dynamic_shapes_match_eager(name):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _tiny(name).eval()
    compiled = torch.compile(model, backend="tessera", dynamic=True)
    breaks0, graphs0 = _count_breaks_and_graphs()
    fallbacks0, builds0 = tb.stats.get("whole_graph_fallbacks", 0), tb.stats["builds"]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch, seq in SIZES:
            ids = torch.randint(0, 100, (batch, seq), generator=gen)
            mask = torch.ones(batch, seq, dtype=torch.long)
            if batch > 1:  # padding in the first row (at the end: no query of a causal LM sees no key)
                mask[0, seq - seq // 3:] = 0
            kwargs = {"input_ids": ids, "attention_mask": mask}
            if name != "bert":
                kwargs["use_cache"] = False
            got, want = _output(name, compiled(**kwargs)), _output(name, model(**kwargs))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    breaks, graphs = _count_breaks_and_graphs()
    assert breaks == breaks0, "graph breaks under dynamic=True"
    assert tb.stats.get("whole_graph_fallbacks", 0) == fallbacks0
    assert graphs - graphs0 <= 2, "a graph per size: the sizes did not stay symbolic"  # batch 1, then dynamic
    assert tb.stats["builds"] - builds0 <= 2, "tessera rebuilt a graph for a new size"


class KVAttention(torch.nn.Module):
    """One attention layer with an explicit cache: the new keys/values are appended."""

    def __init__(self, dim: int = 24, heads: int = 3):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x, k_cache, v_cache):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
        past = k_cache.shape[2]
        # causal over the whole cache: query i sees keys up to past + i
        mask = torch.ones(s, past + s, dtype=torch.bool).tril(diagonal=past)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, d)), k, v


@pytest.mark.slow
def test_kv_cache_model_with_dynamic_past_and_sequence():
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = KVAttention().eval()
    compiled = torch.compile(model, backend="tessera", dynamic=True)
    breaks0, graphs0 = _count_breaks_and_graphs()
    gen = torch.Generator().manual_seed(2)
    k = v = torch.randn(2, 3, 4, 8, generator=gen)
    with torch.no_grad():
        for seq in (5, 1, 1, 3, 1):  # a prefill, decode steps, a chunk
            x = torch.randn(2, seq, 24, generator=gen)
            got, want = compiled(x, k, v), model(x, k, v)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
            k, v = want[1], want[2]
    assert _count_breaks_and_graphs()[0] == breaks0
    assert _count_breaks_and_graphs()[1] - graphs0 <= 3


def _tiny_lm(kind: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny causal LM with weights large enough that greedy decoding does not repeat one token."""
    common = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, max_position_embeddings=128, initializer_range=0.5)  # fmt: skip
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=16, **common))
    return model.eval().to(device=device, dtype=dtype)


def _check_generate(kind: str, cache: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _tiny_lm(kind, device, dtype)
    prompt = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(3)).to(device)
    kwargs = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    before = dict(tb.stats)
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        model.forward = torch.compile(model.forward, backend="tessera", dynamic=True if cache == "dynamic" else None)
        got = model.generate(prompt, **kwargs)
    assert len(set(want[0, 9:].tolist())) > 4, "a degenerate reference (one repeated token) tests little"
    assert torch.equal(got, want), (got[0, 9:].tolist(), want[0, 9:].tolist())
    assert tb.stats["kernels"] > before["kernels"], "tessera compiled nothing"
    assert tb.stats["eager_nodes"] == before["eager_nodes"], "an op ran in torch"
    assert tb.stats.get("whole_graph_fallbacks", 0) == before.get("whole_graph_fallbacks", 0)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.slow
def test_generate_greedy_matches_eager_tokens(kind, cache):
    """model.generate(max_new_tokens=32, greedy) with the forward compiled by tessera: the default
    dynamic cache (growing `past + 1` sizes) and the static cache (index_copy_ into fixed buffers)."""
    _check_generate(kind, cache)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_generate_greedy_matches_eager_tokens_cuda(kind, cache, dtype):
    _check_generate(kind, cache, "cuda", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_transformers_dynamic_shapes_match_eager_cuda(name):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _tiny(name).eval().cuda()
    compiled = torch.compile(model, backend="tessera", dynamic=True)
    breaks0 = tb.stats["eager_nodes"]
    with torch.no_grad():
        for batch, seq in SIZES + SIZES + SIZES:  # per shape: eager, capture, replay
            ids = torch.randint(0, 100, (batch, seq), device="cuda")
            kwargs = {"input_ids": ids} if name == "bert" else {"input_ids": ids, "use_cache": False}
            torch.testing.assert_close(_output(name, compiled(**kwargs)), _output(name, model(**kwargs)),
                                       rtol=1e-4, atol=1e-4)  # fmt: skip
    assert tb.stats["eager_nodes"] == breaks0


@pytest.mark.slow
def test_automatic_dynamic_shapes_recompile_once():
    """Without dynamic=True dynamo compiles the first size statically, then marks the changed sizes
    dynamic (automatic dynamic shapes): one more graph serves every later size."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _tiny("bert").eval()
    compiled = torch.compile(model, backend="tessera")
    breaks0, graphs0 = _count_breaks_and_graphs()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for seq in (6, 11, 17, 9):
            ids = torch.randint(0, 100, (2, seq), generator=gen)
            torch.testing.assert_close(compiled(input_ids=ids).last_hidden_state,
                                       model(input_ids=ids).last_hidden_state, rtol=1e-4, atol=1e-5)  # fmt: skip
    breaks, graphs = _count_breaks_and_graphs()
    assert breaks == breaks0 and graphs - graphs0 == 2


# ---- the model zoo of the front end's tests, under dynamic=True ------------------------------------------------------
# Blocks over batch sizes and the other transformers over lengths: tests/test_frontend_torch_models.py; here
# ViT over batch sizes (BERT, GPT-2 and Llama: test_transformers_dynamic_shapes_match_eager above).


def _main_tensor(value):
    """A model output's main tensor (transformers' last_hidden_state or logits, else the first)."""
    if isinstance(value, torch.Tensor):
        return value
    for key in ("last_hidden_state", "logits"):
        if getattr(value, key, None) is not None:
            return getattr(value, key)
    return value[0]


def _compare_dynamic(model, make_inputs, sizes) -> None:
    """model under dynamic=True against eager on fresh inputs for each size: at most one graph per
    two sizes (the sizes stay symbolic), nothing in torch or in numpy references."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera", dynamic=True)
    before = dict(tb.stats)
    with torch.no_grad():
        for k, size in enumerate(sizes):
            args, kwargs = make_inputs(size, torch.Generator().manual_seed(10 + k))
            out, ref = compiled(*args, **kwargs), model(*args, **kwargs)
            out, ref = _main_tensor(out), _main_tensor(ref)
            assert out.shape == ref.shape, (size, out.shape, ref.shape)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert tb.stats["eager_nodes"] == before["eager_nodes"], "an op ran in torch"
    assert tb.stats["reference_ops"] == before["reference_ops"], "an op ran in its numpy reference"
    assert tb.stats.get("whole_graph_fallbacks", 0) == before.get("whole_graph_fallbacks", 0)
    assert tb.stats["graphs"] - before["graphs"] < len(sizes), "a graph per size: the sizes did not stay symbolic"


@pytest.mark.slow
def test_vit_dynamic_batch():
    import zoo

    torch.manual_seed(0)
    model, kind = zoo.hf_model("vit")
    model.eval()
    _compare_dynamic(model, lambda b, g: ((), zoo.hf_inputs(model, kind, b, 0, g)), [2, 3, 5])
