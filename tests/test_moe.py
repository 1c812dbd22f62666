"""Mixture-of-experts blocks: the fused_moe operator, its CPU kernels and transformers' MoE models
through torch.compile(backend="tessera") as one graph with nothing left to torch."""

from __future__ import annotations

import copy
import zlib

import numpy as np
import pytest

import tessera as ts
from tessera.graph.registry import get_op
from tessera.graph.symbolic import ShapeError
from tessera.templates.moe import moe_cpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tessera.frontend.torch import stats  # noqa: E402
from tessera.frontend.torch.keep_moe import keep_moe_whole  # noqa: E402

# One model shape for the kernel tests, so they share their builds: 8 experts, hidden 64,
# intermediate 48, a shared expert of 40.
E, H, N, S = 8, 64, 48, 40
ROUTINGS = {
    "softmax, normalised": dict(top_k=2, scoring="softmax", normalize=True, scale=1.0, shared_gated=False),
    "softmax + gated shared": dict(top_k=2, scoring="softmax", normalize=False, scale=1.0, shared_gated=True),
    "sigmoid, scaled + shared": dict(top_k=2, scoring="sigmoid", normalize=True, scale=2.5, shared_gated=False),
    "grouped, biased + shared": dict(top_k=2, scoring="sigmoid", normalize=True, scale=2.5, shared_gated=False, groups=4,
                                     topk_group=2, choice_bias=[0.3, -0.2, 0.0, 0.5, -0.4, 0.1, 0.2, -0.1]),
}  # fmt: skip


def _weights(rng: np.random.Generator, attrs: dict, shared: bool) -> list[np.ndarray]:
    w = [rng.standard_normal((E, H)), rng.standard_normal((E, 2 * N, H)) * 0.2, rng.standard_normal((E, H, N)) * 0.2]
    if shared:
        w += [rng.standard_normal((2 * S, H)) * 0.2, rng.standard_normal((H, S)) * 0.2]
        w += [rng.standard_normal((1, H))] if attrs["shared_gated"] else []
    return [a.astype(np.float32) for a in w]


def _reference(x: np.ndarray, weights: list[np.ndarray], attrs: dict) -> np.ndarray:
    return get_op("fused_moe").reference([x.astype(np.float64), *(w.astype(np.float64) for w in weights)], attrs)[0]


def _check(x: np.ndarray, weights: list[np.ndarray], attrs: dict) -> None:
    got, want = moe_cpu(x, weights, attrs), _reference(x, weights, attrs)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 7, (2, 5)])
def test_kernels_match_the_reference(routing, tokens):
    attrs = ROUTINGS[routing]
    rng = np.random.default_rng(zlib.crc32(f"{routing} {tokens}".encode()))  # (str hashes vary per process)
    shape = (*(tokens if isinstance(tokens, tuple) else (tokens,)), H)
    shared = routing != "softmax, normalised"
    _check(rng.standard_normal(shape).astype(np.float32), _weights(rng, attrs, shared), attrs)


def test_many_tokens_run_the_parallel_kernels():
    """39 tokens: several tiles of slots per expert with short last tiles, on OpenMP workers."""
    attrs = ROUTINGS["softmax + gated shared"]
    rng = np.random.default_rng(8)
    _check(rng.standard_normal((3, 13, H)).astype(np.float32), _weights(rng, attrs, True), attrs)


def test_ties_go_to_the_lower_expert():
    """Equal scores (a router with equal rows): the first k experts, as torch.topk and the reference."""
    attrs = ROUTINGS["softmax, normalised"]
    rng = np.random.default_rng(1)
    w = _weights(rng, attrs, False)
    w[0][:] = w[0][0]
    _check(rng.standard_normal((5, H)).astype(np.float32), w, attrs)


def test_one_expert_takes_every_token_and_the_others_none():
    """Expert 3's router row dominates: every token's first choice; experts with no token are skipped."""
    attrs = ROUTINGS["softmax + gated shared"]
    rng = np.random.default_rng(2)
    w = _weights(rng, attrs, True)
    x = np.abs(rng.standard_normal((9, H))).astype(np.float32)
    w[0][3] = 10.0  # positive x: expert 3's logit exceeds the others' by far
    _check(x, w, attrs)
    got = get_op("fused_moe").reference([x, *w], {**attrs, "top_k": 1})[0]
    np.testing.assert_allclose(moe_cpu(x, w, {**attrs, "top_k": 1}), got, rtol=1e-4, atol=1e-5 * np.abs(got).max())


def test_grouped_routing_keeps_to_the_best_groups():
    """DeepSeek-V3's routing: the chosen experts lie in the topk_group groups whose two best
    biased scores sum highest, and the weights are the unbiased scores."""
    from tessera.graph.opdefs.moe import route

    attrs = ROUTINGS["grouped, biased + shared"]
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal((16, H)), _weights(rng, attrs, True)
    idx, weights = route(x, w[0].astype(np.float64), attrs)
    scores = 1.0 / (1.0 + np.exp(-(x @ w[0].T.astype(np.float64))))
    best = (scores + attrs["choice_bias"]).reshape(16, 4, 2).sum(-1)  # groups of 2: their two best are both
    groups = np.argsort(-best, axis=-1, kind="stable")[:, :2]
    assert all(set(idx[t] // 2) <= set(groups[t]) for t in range(16))
    chosen = np.take_along_axis(scores, idx, axis=-1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True) * 2.5)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_the_custom_op_runs_the_same_in_torch(routing):
    """tessera::fused_moe's own body (what runs where tessera does not: the GPU) against the reference."""
    attrs = ROUTINGS[routing]
    rng = np.random.default_rng(7)
    w = _weights(rng, attrs, routing != "softmax, normalised")
    x = rng.standard_normal((2, 5, H)).astype(np.float32)
    t = [torch.from_numpy(a) for a in w]
    shared = [t[3][:S], t[3][S:], t[4]] if len(t) > 3 else [None] * 3
    gate = t[5] if attrs["shared_gated"] else None
    bias = torch.tensor(attrs["choice_bias"]) if attrs.get("choice_bias") else None
    got = torch.ops.tessera.fused_moe(torch.from_numpy(x), *t[:3], *shared, gate, bias, attrs["top_k"],
                                      attrs["scoring"], attrs["normalize"], attrs["scale"], attrs.get("groups", 1),
                                      attrs.get("topk_group", 1))  # fmt: skip
    want = _reference(x, w, attrs)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_bad_operands_raise_clear_errors():
    attrs = ROUTINGS["softmax, normalised"]
    rng = np.random.default_rng(3)
    w = _weights(rng, attrs, False)
    x = ts.graph.Tensor((3, H), "float32", name="x")
    consts = [ts.graph.Tensor.constant(a) for a in w]
    with pytest.raises(ShapeError, match="top_k 9"):
        ts.graph.Operator.create("fused_moe", [x, *consts], {**attrs, "top_k": 9})
    with pytest.raises(ShapeError, match="down is"):
        ts.graph.Operator.create("fused_moe", [x, consts[0], consts[1], consts[1]], attrs)
    with pytest.raises(ShapeError, match="scoring"):
        ts.graph.Operator.create("fused_moe", [x, *consts], {**attrs, "scoring": "relu"})
    with pytest.raises(ShapeError, match="groups"):
        ts.graph.Operator.create("fused_moe", [x, *consts], {**attrs, "groups": 3})
    with pytest.raises(ShapeError, match="choice_bias"):
        ts.graph.Operator.create("fused_moe", [x, *consts], {**attrs, "choice_bias": [0.0] * 3})
    with pytest.raises(ShapeError, match="shared_gate"):
        ts.graph.Operator.create("fused_moe", [x, *consts, *consts[:1]], attrs)


def test_the_template_refuses_other_dtypes():
    from tessera.templates import choose, refusals

    attrs = ROUTINGS["softmax, normalised"]
    w = _weights(np.random.default_rng(4), attrs, False)
    for dt, takes in (("float32", True), ("float64", False)):
        x = ts.graph.Tensor((3, H), dt, name="x")
        op = ts.graph.Operator.create("fused_moe", [x, *(ts.graph.Tensor.constant(a.astype(dt)) for a in w)], attrs)
        assert (choose(op, "cpu") is not None) == takes, refusals(op, "cpu")


# ---- transformers' blocks and models -----------------------------------------------------------
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)


def _config(family: str, layers: int):
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                          num_hidden_layers=layers, **COMMON)  # fmt: skip
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                                           shared_expert_intermediate_size=40, num_experts_per_tok=2,
                                           num_hidden_layers=layers, **COMMON)  # fmt: skip
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8,
                                             num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                                             first_k_dense_replace=0, q_lora_rank=32, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                             num_hidden_layers=layers, **{**COMMON, "num_key_value_heads": 4})  # fmt: skip
    return transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=8, head_dim=16,
                                       num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=layers, **COMMON)  # fmt: skip


MODELS = {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
          "qwen3_moe": transformers.Qwen3MoeForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM}  # fmt: skip


def _model(family: str, layers: int = 2):
    torch.manual_seed(0)
    model = MODELS[family](_config(family, layers)).eval()
    with torch.no_grad():  # routers initialised at zero (Qwen) would tie every score
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's, zero at initialisation
                b.normal_(0.0, 0.1)
    return model


def _block(family: str):
    return _model(family, 1).model.layers[0].mlp


def _error(got, ref) -> float:
    return float((got.double() - ref).abs().max())


def _compiled_matches(model, calls) -> None:
    """Calls the compiled model on fresh inputs; its error against float64 stays at eager's level,
    and every graph is one tessera segment with nothing run in torch or on a numpy reference."""
    reference = copy.deepcopy(model).double()
    for m in reference.modules():  # torch's grouped_mm takes no float64: the reference loops over experts
        if hasattr(m, "config"):
            m.config._experts_implementation_internal = "eager"
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    before = dict(stats)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for args in calls:
            inputs = args(gen)
            got, eager = compiled(inputs), model(inputs)
            ref = reference(inputs.double() if inputs.is_floating_point() else inputs)
            got, eager, ref = (getattr(t, "logits", t) for t in (got, eager, ref))
            scale = float(ref.abs().max())
            assert _error(got, ref) <= 4 * max(_error(eager, ref), 1e-6 * scale), (_error(got, ref), _error(eager, ref))
    assert stats["eager_nodes"] == before["eager_nodes"], "a node ran in torch"
    assert stats["reference_ops"] == before["reference_ops"], "an operator ran on its numpy reference"
    graphs, segments = stats["graphs"] - before["graphs"], stats["segments"] - before["segments"]
    assert graphs >= 1 and segments == graphs, (graphs, segments)
    assert "fused_moe" in str(ts.explain(compiled))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_block_compiles_to_the_fused_operator(family):
    block = _block(family)
    fresh = lambda g: torch.randn(1, 5, 64, generator=g)  # noqa: E731
    _compiled_matches(block, [fresh, fresh])


@pytest.mark.parametrize("family", ["mixtral", *(pytest.param(f, marks=pytest.mark.slow)
                                                for f in ("qwen2_moe", "qwen3_moe", "deepseek_v3"))])  # fmt: skip
def test_keep_moe_replaces_each_block(family):
    model = _model(family, 1)
    found = []

    def backend(gm, example_inputs):
        found.append(keep_moe_whole(gm))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        ids = torch.randint(0, 100, (1, 4))
        out = torch.compile(model, backend=backend)(ids, use_cache=False).logits  # the rewritten graph runs in torch
        torch.testing.assert_close(out, model(ids, use_cache=False).logits, rtol=1e-4, atol=1e-5)
    assert found == [1]


def test_a_router_it_does_not_know_stays_as_traced():
    """A router that adds noise before its top-k is not a fused_moe: the block is left alone."""
    block = _block("mixtral")
    router = block.gate

    class Noisy(type(router)):
        def forward(self, hidden_states):
            logits, weights, experts = super().forward(hidden_states)
            return logits, torch.cos(weights), experts

    router.__class__ = Noisy
    found = []

    def backend(gm, example_inputs):
        found.append(keep_moe_whole(gm))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(block, backend=backend)(torch.randn(1, 3, 64))
    assert found == [0]


def _ids(batch: int, seq: int):
    return lambda g: torch.randint(0, 100, (batch, seq), generator=g)


class _Logits(torch.nn.Module):
    """The causal LM without a cache: its logits (torch.compile of the model itself sees kwargs)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_models_compile_whole_and_match_eager(family):
    calls = [_ids(1, 5), _ids(1, 5), _ids(2, 3), _ids(1, 1), _ids(2, 7)]
    _compiled_matches(_Logits(_model(family)), calls)


@pytest.mark.slow
@pytest.mark.parametrize("compile_model", [False, True])
def test_the_engine_serves_a_mixtral(tmp_path, compile_model):
    """tessera.llm on a tiny Mixtral: greedy tokens equal transformers' generate, eagerly and with
    the forward compiled (its MoE blocks then run as fused_moe)."""
    from test_llm_engine import hf_greedy
    from tiny_llm import PROMPTS, make_model_dir

    from tessera.llm import LLM, SamplingParams

    model_dir = make_model_dir(tmp_path / "mixtral", "mixtral", num_local_experts=4)
    params = SamplingParams(max_tokens=8, temperature=0)
    llm = LLM(model_dir, device="cpu", compile_model=compile_model, max_num_batched_tokens=8)
    outputs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, PROMPTS, params.max_tokens)
