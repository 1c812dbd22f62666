"""tessera.llm's incremental detokenizer and stop rules, fed one token at a time."""

from __future__ import annotations

import itertools

import pytest
from tiny_llm import train_tokenizer

from tessera.llm.sampling_params import SamplingParams
from tessera.llm.sequence import Request, Sequence
from tessera.llm.tokenizer import IncrementalDetokenizer, append_token

EOS = 2
_IDS = itertools.count()


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def make_seq(tokenizer, prompt: str = "Hello", **params) -> Sequence:
    params = SamplingParams(**params)
    ids = tokenizer(prompt)["input_ids"]
    request = Request(f"r{next(_IDS)}", prompt, ids, params, arrival=next(_IDS))
    seq = Sequence(request, 0, None, IncrementalDetokenizer(tokenizer, ids, params.skip_special_tokens))
    request.seqs.append(seq)
    return seq


def feed(seq: Sequence, token_ids: list[int], max_model_len: int = 1000) -> list[str]:
    """append_token for each id until the sequence finishes; the text each token released."""
    steps = []
    for t in token_ids:
        seq.step_text = ""
        append_token(seq, t, {EOS}, max_model_len)
        steps.append(seq.step_text)
        if seq.finish_reason is not None:
            break
    return steps


def test_incremental_text_equals_the_full_decode_and_never_splits_a_character(tokenizer):
    text = " Café, naïve, über and 東京 are words; 12345 and 3.14159!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)  # some token ends inside a character: the case under test
    seq = make_seq(tokenizer, max_tokens=len(ids))
    steps = feed(seq, ids)
    assert "".join(steps) == seq.text == tokenizer.decode(ids)
    assert not any("\ufffd" in s for s in steps)
    assert seq.finish_reason == "length"


@pytest.mark.parametrize("clean_up", [False, True])
def test_the_rust_decode_equals_transformers_decode(tokenizer, clean_up):
    """The detokenizer calls the fast tokenizer's Rust decode directly unless transformers would
    clean the text up after it; either way its text is transformers' decode of the same ids."""
    tokenizer.clean_up_tokenization_spaces = clean_up
    try:
        text = "Hello , how are you ? Café 東京 <|user|> 12345 !"
        ids = tokenizer(text)["input_ids"]
        for skip in (True, False):
            detokenizer = IncrementalDetokenizer(tokenizer, [], skip)
            assert (detokenizer.backend is not None) == (not clean_up)
            released = "".join(detokenizer.add(t) for t in ids) + detokenizer.flush()
            assert released == tokenizer.decode(ids, skip_special_tokens=skip)
    finally:
        tokenizer.clean_up_tokenization_spaces = False


def test_first_token_decodes_in_the_prompts_context(tokenizer):
    ids = tokenizer(" fox jumps", add_special_tokens=False)["input_ids"]
    seq = make_seq(tokenizer, prompt="The quick brown", max_tokens=10)
    feed(seq, ids)
    assert seq.text == " fox jumps"


def test_a_stop_string_spanning_tokens_cuts_the_text_and_is_held_back_until_decided(tokenizer):
    ids = tokenizer(" I am fine, thank you very much!", add_special_tokens=False)["input_ids"]
    seq = make_seq(tokenizer, stop=["thank you"], max_tokens=50)
    steps = feed(seq, ids)
    assert seq.text == " I am fine, " and "".join(steps) == seq.text
    assert seq.finish_reason == "stop" and seq.stop_reason == "thank you"
    assert seq.output_token_ids == ids[: len(steps)]  # tokens are kept up to the one that completed the string
    # " th" might begin "thank you": it is held back, and released once it cannot
    ids = tokenizer(" I think so", add_special_tokens=False)["input_ids"]
    seq = make_seq(tokenizer, stop=["thank you"], max_tokens=len(ids))
    steps = feed(seq, ids)
    assert "".join(steps) == " I think so" and seq.finish_reason == "length"
    assert steps[ids.index(tokenizer(" th", add_special_tokens=False)["input_ids"][0])] == " "  # "th" held
    partial = make_seq(tokenizer, stop=["thinking"], max_tokens=50)
    feed(partial, tokenizer(" I am th", add_special_tokens=False)["input_ids"])
    assert partial.text == " I am " and partial.decoded == " I am th"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer(" ok ok ok", add_special_tokens=False)["input_ids"]
    first = len(tokenizer(" ok", add_special_tokens=False)["input_ids"])
    seq = make_seq(tokenizer, stop=["ok"], min_tokens=first + 1, max_tokens=10)
    feed(seq, ids)  # the first "ok" comes before min_tokens: it does not stop the sample
    assert (seq.finish_reason, seq.text) == ("stop", " ok ")


def test_eos_stop_token_ids_max_tokens_and_context_length(tokenizer):
    word = tokenizer(" fox", add_special_tokens=False)["input_ids"][0]
    seq = make_seq(tokenizer, max_tokens=10)
    feed(seq, [word, EOS, word])
    assert (seq.finish_reason, seq.stop_reason, seq.output_token_ids) == ("stop", None, [word, EOS])
    assert seq.text == tokenizer.decode([word])  # EOS is a special token: no text
    seq = make_seq(tokenizer, max_tokens=3, ignore_eos=True)
    feed(seq, [EOS, word, EOS, word])
    assert seq.finish_reason == "length" and seq.num_output_tokens == 3
    seq = make_seq(tokenizer, max_tokens=10, stop_token_ids=[word])
    feed(seq, [5, word, 5])
    assert (seq.finish_reason, seq.stop_reason, seq.output_token_ids) == ("stop", word, [5, word])
    seq = make_seq(tokenizer, max_tokens=100)
    feed(seq, [word] * 10, max_model_len=seq.num_prompt_tokens + 4)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 4
