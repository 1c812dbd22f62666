"""Decode steps through static buffers and bucketed batch sizes (tessera.llm.decode_graphs).

CPU tier: the buffers, buckets and padding run uncaptured (capture=False) inside a real engine and
must give the tokens of the ordinary path; a failed capture falls back with a warning.  GPU tier
(-m cuda): captured CUDA graphs give the tokens of the eager engine."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_llm import PROMPTS, make_model_dir

from tessera.llm import LLM, LLMEngine, SamplingParams
from tessera.llm.decode_graphs import DecodeGraphs, batch_buckets

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FIVE_PROMPTS = [*PROMPTS, "Numbers like 12345"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama")


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256]
    assert batch_buckets(200) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 200]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


def generate(engine: LLMEngine, prompts: list[str]) -> list[list[int]]:
    """Greedy tokens of each prompt, prompt i asking for 3 + 2 i of them: the batch shrinks as they end."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[str(i)].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("max_num_seqs", [5, 2])
def test_uncaptured_decode_buffers_give_the_ordinary_tokens(llama_dir, max_num_seqs):
    """Batches of 1..5 sequences padded to buckets 1, 2, 4, 5, block tables growing past a block
    (block_size 4), and prefill steps that take the ordinary path in between."""
    prompts = FIVE_PROMPTS
    expected = generate(LLMEngine(llama_dir, device="cpu", block_size=4, max_num_seqs=max_num_seqs,
                                  enforce_eager=True), prompts)  # fmt: skip
    engine = LLMEngine(llama_dir, device="cpu", block_size=4, max_num_seqs=max_num_seqs, enforce_eager=True)
    runner = engine.runner
    graphs = DecodeGraphs(runner.forward, device=runner.device, cache_handle=runner.cache_handle,
                          max_batch=max_num_seqs, max_blocks_per_seq=-(-engine.max_model_len // 4),
                          capture=False)  # fmt: skip
    batches = []
    run = graphs.run

    def counted(token_ids, *args):
        batches.append(len(token_ids))
        return run(token_ids, *args)

    graphs.run = counted
    runner.decode_graphs = graphs
    assert generate(engine, prompts) == expected
    assert set(batches) == set(range(1, max_num_seqs + 1))  # buckets padded: 3 runs as 4
    assert engine.stats().num_kv_blocks_used == 0


def test_a_failed_capture_falls_back_with_a_warning(llama_dir, caplog):
    engine = LLMEngine(llama_dir, device="cpu", enforce_eager=True)
    with caplog.at_level(logging.WARNING, logger="tessera"):
        assert engine.runner._capture_decode_graphs(4, 8) is None  # no CUDA device to capture on
    assert "without CUDA graphs: capturing failed" in caplog.text


@pytest.mark.cuda
def test_captured_decode_graphs_give_the_eager_tokens(llama_dir):
    prompts = FIVE_PROMPTS
    eager = LLM(llama_dir, device="cuda", dtype=torch.float32, max_num_seqs=4, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, PARAMS)]
    del eager
    llm = LLM(llama_dir, device="cuda", dtype=torch.float32, max_num_seqs=4)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
    assert graphs.stats.capture_s > 0 and graphs.stats.memory_bytes >= 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
