"""tessera.llm with the model compiled by tessera's torch front end (compile_model=True) on the CPU."""

from __future__ import annotations

import pytest
from test_llm_engine import PROMPTS, hf_greedy
from tiny_llm import make_model_dir

from tessera.llm import LLM, SamplingParams


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_transformers_generate(tmp_path):
    model_dir = make_model_dir(tmp_path / "llama", "llama")
    params = SamplingParams(max_tokens=12, temperature=0)
    llm = LLM(model_dir, device="cpu", compile_model=True, max_num_batched_tokens=8)
    assert not llm.engine.enforce_eager
    # Padded step sizes (powers of two) and symbolic shapes: one graph serves prefill chunks and decodes.
    outputs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, PROMPTS, params.max_tokens)
    assert llm.engine.stats().num_kv_blocks_used == 0


def test_the_model_runs_eagerly_by_default(tmp_path):
    model_dir = make_model_dir(tmp_path / "llama", "llama")
    assert LLM(model_dir, device="cpu").engine.enforce_eager
