"""tessera.llm's engine end to end on tiny models, checked against transformers' own generate."""

from __future__ import annotations

import asyncio

import pytest
import torch
import transformers
from tiny_llm import FAMILIES, PROMPTS, make_model, make_model_dir, model_dir_maker, train_tokenizer

from tessera.eager.quantize import quantize
from tessera.errors import RequestError
from tessera.llm import LLM, EngineStats, LLMEngine, SamplingParams, StepFailure
from tessera.llm.server.async_engine import AsyncLLMEngine, RequestStream

GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return model_dir_maker(tmp_path_factory)


@pytest.fixture(scope="module")
def llama_dir(model_dirs):
    return model_dirs("llama")


def hf_greedy(model_dir, prompts, max_new_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, alone (EOS included when it ends one)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    if ignore_eos:
        model.generation_config.eos_token_id = None
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt]) if isinstance(prompt, list) else tokenizer(prompt, return_tensors="pt").input_ids
        generated = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=3)
        out.append(generated[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.parametrize("family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_greedy_tokens_equal_transformers_generate(model_dirs, family):
    model_dir = model_dirs(family)
    expected = hf_greedy(model_dir, PROMPTS, GREEDY.max_tokens)
    # 8 tokens a step: the long prompts are prefilled in chunks while the short ones decode.
    llm = LLM(model_dir, device="cpu", max_num_batched_tokens=8, enforce_eager=True)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    tokenizer = llm.get_tokenizer()
    for o, tokens in zip(outputs, expected, strict=True):
        assert o.finished and o.prompt in PROMPTS
        assert o.outputs[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert o.outputs[0].finish_reason == ("stop" if tokens[-1] == 2 else "length")


def test_whole_prompts_in_one_step_and_token_id_prompts(llama_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    llm = LLM(llama_dir, device="cpu", enforce_eager=True)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(llama_dir, prompts, GREEDY.max_tokens)
    assert outputs[0].prompt is None and outputs[0].prompt_token_ids == prompts[0]
    # Long prompts in one step (slots past the runner's vectorised threshold), over blocks of 4.
    long_prompts = [(prompts[1] * 8)[:150], (prompts[3] * 8)[:97]]
    llm = LLM(llama_dir, device="cpu", enforce_eager=True, block_size=4)
    outputs = llm.generate(long_prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(llama_dir, long_prompts, GREEDY.max_tokens)


@pytest.mark.slow
def test_preemption_loses_nothing(llama_dir):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = hf_greedy(llama_dir, PROMPTS, params.max_tokens, ignore_eos=True)
    # 32 blocks of 4 tokens: the four sequences (up to 60 tokens each) cannot all stay resident.
    llm = LLM(llama_dir, device="cpu", block_size=4, num_kv_blocks=32, max_model_len=128,
              max_num_batched_tokens=16, enforce_eager=True)  # fmt: skip
    outputs = llm.generate(PROMPTS, params)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_kv_blocks_used == 0 and stats.num_requests_finished == len(PROMPTS)
    # Seeded sampling too: a preempted sample resumes its draws where it stopped.
    sampled = SamplingParams(max_tokens=40, temperature=0.8, seed=3, n=2, ignore_eos=True)
    roomy = LLM(llama_dir, device="cpu", enforce_eager=True).generate(PROMPTS, sampled)
    before = llm.engine.stats().num_preemptions
    tight = llm.generate(PROMPTS, sampled)
    assert llm.engine.stats().num_preemptions > before
    assert [[c.token_ids for c in o.outputs] for o in tight] == [[c.token_ids for c in o.outputs] for o in roomy]


def test_a_transformers_model_object_and_the_context_length(tmp_path):
    tokenizer = train_tokenizer()
    model = make_model("qwen3", len(tokenizer))
    reference = [t for t in model.generate(torch.tensor([[1, 40, 41, 42]]), do_sample=False, max_new_tokens=6,
                                           eos_token_id=None, pad_token_id=3)[0, 4:].tolist()]  # fmt: skip
    llm = LLM(model, tokenizer=tokenizer, device="cpu", max_model_len=10, block_size=4, enforce_eager=True)
    assert llm.engine.model_name == "Qwen3ForCausalLM" and llm.engine.max_model_len == 10
    out = llm.generate([1, 40, 41, 42], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    # max_tokens past the context: the sample ends with "length" when the context is full
    assert out.outputs[0].token_ids == reference and out.outputs[0].finish_reason == "length"


def test_streaming_adds_up_to_the_offline_output(llama_dir):
    llm = LLM(llama_dir, device="cpu", max_num_batched_tokens=4, enforce_eager=True)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    offline = llm.generate(PROMPTS[1], params)[0].outputs[0]
    steps = list(llm.stream(PROMPTS[1], params))
    assert [s.finished for s in steps] == [False] * (len(steps) - 1) + [True]
    assert sum((s.outputs[0].new_token_ids for s in steps), []) == offline.token_ids
    assert "".join(s.outputs[0].new_text for s in steps) == offline.text == steps[-1].outputs[0].text
    assert len(steps[-1].outputs[0].logprobs) == 12 and all(len(lp.top) == 2 for lp in offline.logprobs)
    # A consumer that stops early (a dropped client) aborts the request: its blocks are free at once.
    stream = llm.stream(PROMPTS[1], params)
    next(stream)
    assert llm.engine.stats().num_kv_blocks_used > 0
    stream.close()
    assert llm.engine.stats().num_kv_blocks_used == 0 and not llm.engine.has_unfinished_requests()


def test_logprobs_equal_the_models_log_softmax(llama_dir):
    llm = LLM(llama_dir, device="cpu", enforce_eager=True)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, logprobs=5))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids])
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    for i, lp in enumerate(out.outputs[0].logprobs):
        row = expected[n - 1 + i]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        assert list(lp.top) == row.topk(5).indices.tolist()


def test_n_seeded_samples_reproduce_in_any_batch(llama_dir):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=3, ignore_eos=True)
    llm = LLM(llama_dir, device="cpu", enforce_eager=True)
    alone = llm.generate(PROMPTS[0], params)[0]
    crowd = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]],
                         [SamplingParams(max_tokens=5, temperature=1.0), params, SamplingParams(max_tokens=9)])[1]  # fmt: skip
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowd.outputs]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # the samples draw differently


def test_stop_strings_end_the_text(llama_dir):
    llm = LLM(llama_dir, device="cpu", enforce_eager=True)
    free = llm.generate(PROMPTS[3], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
    stop = free.text[5:8]
    assert len(stop) == 3 and stop not in free.text[:5]
    cut = llm.generate(PROMPTS[3], SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0].outputs[0]
    assert cut.text == free.text[: free.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)


def test_abort_frees_blocks_and_stats_count(llama_dir):
    engine = LLMEngine(llama_dir, device="cpu", block_size=4, enforce_eager=True)
    engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"a", "b"}
    stats = engine.stats()
    assert isinstance(stats, EngineStats) and stats.num_running == 2 and stats.num_kv_blocks_used > 0
    finished = engine.step()
    assert [o.request_id for o in finished if o.finished] == ["b"]
    engine.abort_request("a")
    engine.abort_request("never-added")
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert stats.generation_tokens_total == 4 and stats.num_requests_finished == 1
    assert stats.prompt_tokens_total == len(engine.tokenizer(PROMPTS[1])["input_ids"]) + len(
        engine.tokenizer(PROMPTS[0])["input_ids"])


def test_unstreamed_requests_output_only_when_finished(llama_dir):
    """stream=False (what LLM.generate asks): no output per step, the same final output."""
    engine = LLMEngine(llama_dir, device="cpu", block_size=4, enforce_eager=True)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("streamed", PROMPTS[0], params)
    engine.add_request("final", PROMPTS[0], params, stream=False)
    seen: dict[str, list] = {"streamed": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["streamed"]) == 3 and [o.finished for o in seen["final"]] == [True]
    last, final = seen["streamed"][-1].outputs[0], seen["final"][0].outputs[0]
    assert final.token_ids == last.token_ids and len(final.token_ids) == 3 and final.text == last.text
    assert final.new_token_ids == final.token_ids  # what it added since its last output: all of it


def test_the_async_engine_streams_per_step_only_when_asked(llama_dir, monkeypatch):
    """What the server does for `stream: true` and `stream: false` requests.  The engine hands a
    streamed request one output per step; outputs the consumer has not taken yet replace each
    other (each is cumulative), so what the consumer sees depends on timing, what is handed not."""
    engine = AsyncLLMEngine(LLM(llama_dir, device="cpu", enforce_eager=True).engine)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    handed: dict[str, int] = {}
    put = RequestStream._put

    def counting_put(self, item):  # noqa: ANN001, ANN202
        handed[self.request_id] = handed.get(self.request_id, 0) + 1
        put(self, item)

    monkeypatch.setattr(RequestStream, "_put", counting_put)

    async def outputs_of(per_step: bool) -> list:
        return [out async for out in engine.submit(f"r-{per_step}", PROMPTS[0], params, stream=per_step)]

    async def drive() -> tuple[list, list]:
        engine.start()
        return await outputs_of(True), await outputs_of(False)

    try:
        streamed, final = asyncio.run(drive())
    finally:
        engine.shutdown()
    assert handed == {"r-True": 3, "r-False": 1} and len(final) == 1 and final[0].finished
    counts = [len(o.outputs[0].token_ids) for o in streamed]
    assert 1 <= len(streamed) <= 3 and counts == sorted(set(counts)) and counts[-1] == 3 and streamed[-1].finished
    assert final[0].outputs[0].token_ids == streamed[-1].outputs[0].token_ids


def test_a_failing_step_aborts_its_requests_and_the_engine_serves_on(llama_dir):
    engine = LLMEngine(llama_dir, device="cpu", max_num_seqs=2, enforce_eager=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(llama_dir, device="cpu", enforce_eager=True).generate(PROMPTS[2:4], params)]
    for i, prompt in enumerate(PROMPTS[:4]):  # at most 2 run at once: "2" and "3" wait
        engine.add_request(str(i), prompt, params)
    execute = engine.runner.execute

    def fail_once(scheduled):
        engine.runner.execute = execute
        raise RuntimeError("injected kernel failure")

    engine.runner.execute = fail_once
    with pytest.raises(StepFailure, match="injected kernel failure") as failure:
        engine.step()
    assert failure.value.request_ids == ["0", "1"]
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 2
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finals[r].outputs[0].token_ids for r in ("2", "3")] == expected
    assert engine.stats().num_kv_blocks_used == 0


def test_bad_requests_raise_request_error(llama_dir):
    engine = LLMEngine(llama_dir, device="cpu", max_model_len=32, enforce_eager=True)
    params = SamplingParams(max_tokens=4)
    with pytest.raises(RequestError, match="prompt has 40 tokens; the context length is 32"):
        engine.add_request("long", [5] * 40, params)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", "", params)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty-ids", [], params)
    with pytest.raises(RequestError, match=r"token ids must be in \[0, 384\), got \[384, -1\]"):
        engine.add_request("ids", [5, 384, -1], params)
    with pytest.raises(RequestError, match="string or a list of token ids"):
        engine.add_request("kind", 3.5, params)
    with pytest.raises(RequestError, match="SamplingParams"):
        engine.add_request("params", "hi", {"max_tokens": 3})
    with pytest.raises(RequestError, match=r"temperature must be in \[0.0, inf\]"):
        SamplingParams(temperature=-1)
    engine.add_request("dup", "hi", params)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", "hi", params)
    assert list(engine.requests) == ["dup"]  # the refused requests left nothing behind


def test_bad_engine_arguments(llama_dir):
    with pytest.raises(ValueError, match="less than one sequence of max_model_len=64"):
        LLMEngine(llama_dir, device="cpu", block_size=4, num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        LLMEngine(llama_dir, device="cpu", max_model_len=4096)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        LLMEngine(llama_dir, device="cpu", block_size=0)
    with pytest.raises(ValueError, match="dtype must be"):
        LLMEngine(llama_dir, device="cpu", dtype="float8")
    with pytest.raises(Exception, match="no config.json"):
        LLMEngine(llama_dir / "missing", device="cpu")


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_attention_equals_transformers(tmp_path, family):
    overrides = {"sliding_window": 6} if family == "mistral" else {"sliding_window": 6, "use_sliding_window": True,
                                                                     "max_window_layers": 0}  # fmt: skip
    model_dir = make_model_dir(tmp_path / family, family, **overrides)
    expected = hf_greedy(model_dir, PROMPTS, 12, ignore_eos=True)
    llm = LLM(model_dir, device="cpu", max_num_batched_tokens=8, block_size=4, enforce_eager=True)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.slow
def test_quantized_weights_equal_transformers_on_the_same_quantized_model(llama_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    quantize(model, weight="int4", skip=("lm_head",), inplace=True)
    expected = []
    for prompt in PROMPTS[:2]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected.append(model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=3)[0, ids.shape[1] :].tolist())
    llm = LLM(llama_dir, device="cpu", quantization="int4", enforce_eager=True)
    outputs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    with pytest.raises(TypeError, match="'int3x' is not a low-bit weight type"):
        LLM(llama_dir, device="cpu", quantization="int3x")


def test_sharded_checkpoints_and_generation_config_defaults(tmp_path, llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                                            do_sample=True, temperature=0.5, top_k=5,
                                                            max_new_tokens=7)  # fmt: skip
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    transformers.AutoTokenizer.from_pretrained(llama_dir).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    llm = LLM(sharded, device="cpu", enforce_eager=True)
    assert llm.engine.model_name == "sharded"
    defaults = llm.engine.default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.5, 5, 7)
    assert len(llm.generate(PROMPTS[0])[0].outputs[0].token_ids) <= 7  # generation_config's max_new_tokens
    greedy = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in greedy] == hf_greedy(llama_dir, PROMPTS, GREEDY.max_tokens)


def test_without_a_tokenizer_prompts_are_token_ids():
    llm = LLM(make_model("llama"), device="cpu", max_model_len=64, enforce_eager=True)
    assert llm.engine.tokenizer is None
    with pytest.raises(RequestError, match="a text prompt needs a tokenizer"):
        llm.generate("Hello", SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        llm.generate([1, 5, 6], SamplingParams(max_tokens=2, stop=["x"]))
    out = llm.generate([[1, 5, 6], [1, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3] and out[0].outputs[0].text == ""
    assert not llm.engine.has_unfinished_requests()  # the refused requests left nothing behind
