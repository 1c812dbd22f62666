"""tessera.llm's sampler on hand-made logits: support of each filter, seeds, penalties, logprobs."""

from __future__ import annotations

import itertools

import torch

from tessera.llm.sampler import Sampler, filtered_probs
from tessera.llm.sampling_params import SamplingParams
from tessera.llm.sequence import Request, Sequence

_IDS = itertools.count()
VOCAB = 10


def make_seq(sampler: Sampler, prompt=(1, 2), output=(), **params) -> Sequence:
    params = SamplingParams(**params)
    request = Request(f"r{next(_IDS)}", None, list(prompt), params, arrival=next(_IDS))
    seq = Sequence(request, 0, sampler.make_generator(params.sample_seed(0)), None)
    seq.token_ids += list(output)
    return seq


def logits_row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs[0] > 0).flatten().tolist())


def test_greedy_takes_the_argmax():
    sampler = Sampler()
    logits = torch.randn(3, VOCAB)
    seqs = [make_seq(sampler, temperature=0) for _ in range(3)]
    assert sampler(logits, seqs, eos_token_ids={0}).token_ids == logits.argmax(-1).tolist()


def test_filters_keep_the_right_support():
    sampler = Sampler()
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]]))
    assert support(filtered_probs(logits, [make_seq(sampler, top_k=2)])) == {0, 1}
    # top_p: the smallest set reaching p (0.4 + 0.25 = 0.65 >= 0.6; 0.65 < 0.7 needs a third)
    assert support(filtered_probs(logits, [make_seq(sampler, top_p=0.6)])) == {0, 1}
    assert support(filtered_probs(logits, [make_seq(sampler, top_p=0.7)])) == {0, 1, 2}
    # min_p: probability >= min_p * 0.4
    assert support(filtered_probs(logits, [make_seq(sampler, min_p=0.3)])) == {0, 1, 2}
    combined = filtered_probs(logits, [make_seq(sampler, top_k=3, top_p=0.99, min_p=0.5)])
    assert support(combined) == {0, 1}
    assert torch.allclose(combined.sum(), torch.tensor(1.0))
    # rows with different parameters side by side
    rows = filtered_probs(logits.repeat(2, 1), [make_seq(sampler, top_k=1), make_seq(sampler)])
    assert support(rows[:1]) == {0} and support(rows[1:]) == set(range(6))


def test_temperature_sharpens_the_distribution():
    sampler = Sampler()
    logits = logits_row(2.0, 1.0, 0.0)
    hot = filtered_probs(logits, [make_seq(sampler, temperature=2.0)])
    cold = filtered_probs(logits, [make_seq(sampler, temperature=0.5)])
    assert torch.allclose(hot, torch.softmax(logits / 2.0, -1)) and cold[0, 0] > hot[0, 0]


def test_a_seeded_request_reproduces_whatever_the_batch():
    logits = torch.randn(8, 50)

    def draw(batch_rows: list[int], seeds: list[int | None], steps: int = 5) -> list[list[int]]:
        sampler = Sampler(seed=123)
        seqs = [make_seq(sampler, seed=s) for s in seeds]
        tokens = [[] for _ in seqs]
        for _ in range(steps):
            for i, t in enumerate(sampler(logits[batch_rows], seqs, eos_token_ids=()).token_ids):
                tokens[i].append(t)
        return tokens

    alone = draw([3], [42])[0]
    in_batch = draw([0, 3, 5], [None, 42, 7])[1]
    other_position = draw([5, 1, 3, 3], [None, 9, None, 42])[3]
    assert alone == in_batch == other_position
    assert draw([3], [43])[0] != alone  # another seed, other tokens (with 50 tokens over 5 draws)


def test_logprobs_are_the_models_log_softmax_with_top_alternatives():
    sampler = Sampler()
    logits = torch.randn(2, VOCAB)
    seqs = [make_seq(sampler, temperature=0, logprobs=3), make_seq(sampler, temperature=0.7, logprobs=0)]
    out = sampler(logits, seqs, eos_token_ids=())
    expected = torch.log_softmax(logits, -1)
    first, second = out.logprobs
    assert abs(first.logprob - float(expected[0, first.token_id])) < 1e-6
    top = expected[0].topk(3)
    assert list(first.top) == top.indices.tolist()
    assert all(abs(first.top[i] - float(expected[0, i])) < 1e-6 for i in first.top)
    assert second.top == {} and abs(second.logprob - float(expected[1, second.token_id])) < 1e-6
    assert sampler(logits, [make_seq(sampler)], ()).logprobs == [None]


def test_penalties():
    sampler = Sampler()
    logits = logits_row(1.0, 2.0, -1.0, 1.5)
    # repetition: prompt token 1 and output token 2 are penalised (positive divided, negative multiplied)
    seq = make_seq(sampler, prompt=[1], output=[2], temperature=0, repetition_penalty=2.0)
    sampler(logits, [seq], ())  # applies to a copy: logits stay as they are
    assert logits.tolist() == [[1.0, 2.0, -1.0, 1.5]]
    assert sampler(logits, [seq], ()).token_ids == [3]  # 2.0 / 2 = 1.0 < 1.5
    # frequency and presence count output tokens only: token 1 twice, in the output
    seq = make_seq(sampler, prompt=[3], output=[1, 1], temperature=0, frequency_penalty=0.3, presence_penalty=0.2)
    # token 1: 2.0 - 2 * 0.3 - 0.2 = 1.2 < 1.5 (token 3 is in the prompt only: not penalised)
    assert sampler(logits, [seq], ()).token_ids == [3]


def test_min_tokens_masks_eos_and_stop_token_ids():
    sampler = Sampler()
    logits = logits_row(5.0, 4.0, 3.0, 0.0)
    early = make_seq(sampler, temperature=0, min_tokens=2, max_tokens=4, stop_token_ids=[1])
    assert sampler(logits, [early], eos_token_ids={0}).token_ids == [2]
    late = make_seq(sampler, output=[3, 3], temperature=0, min_tokens=2, max_tokens=4)
    assert sampler(logits, [late], eos_token_ids={0}).token_ids == [0]


def test_draws_follow_the_distribution_on_shared_and_own_generators():
    """Frequencies over many draws match the filtered probabilities, for rows on the shared
    generator (drawn together) and for seeded rows (each from its own generator)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0, 0, 0, 0, 0])
    logits = probs.clamp_min(1e-30).log().expand(8, VOCAB).contiguous()
    sampler = Sampler(seed=7)
    seqs = [make_seq(sampler, temperature=1.0, seed=s) for s in (None, None, None, 5, None, 9, None, 11)]
    counts = torch.zeros(len(seqs), VOCAB)
    draws = 600
    for _ in range(draws):
        tokens = sampler(logits, seqs, eos_token_ids=set()).token_ids
        counts[torch.arange(len(seqs)), torch.tensor(tokens)] += 1
    assert counts[:, 5:].sum() == 0  # never a token of probability 0
    # Each row's frequencies within 5 standard deviations of a binomial count.
    bound = 5 * (draws * probs * (1 - probs)).sqrt() + 1
    assert bool(((counts - draws * probs).abs() <= bound).all()), counts
