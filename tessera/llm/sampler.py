"""The next token of every sequence that reached its last token this step.

Order of operations per row: penalties (repetition over prompt and output, presence and frequency
over the output), min_tokens (EOS and stop token ids masked), then greedy argmax, or temperature,
top-k, top-p, min-p and one draw from the row's own `torch.Generator` (or the shared one).  A seeded request owns its
generator and draws exactly one sample per token, so its tokens do not depend on what else runs in
the batch.  Log-probabilities are those of the model's distribution (log_softmax of the raw
logits, before penalties and temperature), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from tessera.llm.outputs import TokenLogprob
from tessera.llm.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for sequences that did not ask for logprobs


class Sampler:
    """Samples one token per logits row; unseeded requests share one generator seeded once."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int | None) -> torch.Generator | None:
        """A request's own generator when it has a seed, else None (the shared one)."""
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int]) -> SamplerOutput:
        """logits [len(seqs), vocab]: the next-token logits of each sequence, in order."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        adjusted = [(row, seq) for row, seq in enumerate(seqs) if _penalised(seq) or _stops_banned(seq)]
        if adjusted:  # rows are touched one by one only where a penalty or min_tokens applies
            logits = logits.clone()
            for row, seq in adjusted:
                _apply_penalties(logits[row], seq)
                _mask_early_stops(logits[row], seq, eos_token_ids)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if len(greedy) == len(seqs):  # the common batch: one argmax, no row gathers
            tokens = logits.argmax(dim=-1)
        elif not greedy:
            tokens = self._draw(filtered_probs(logits, seqs), [s.generator for s in seqs])
        else:
            sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
            tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
            tokens[greedy] = logits[greedy].argmax(dim=-1)
            probs = filtered_probs(logits[sampled], [seqs[i] for i in sampled])
            tokens[sampled] = self._draw(probs, [seqs[i].generator for i in sampled])
        token_ids = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                if seq.params.logprobs is not None:
                    logprobs[i] = _token_logprob(raw_logprobs[i], token_ids[i], seq.params.logprobs)
        return SamplerOutput(token_ids, logprobs)

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of `probs`, drawn as argmax(probs / E) with E ~ Exp(1) (the exponential
        race, exact for categorical sampling): rows on the shared generator take their noise in one
        call, and a seeded row draws from its own generator, so its tokens ignore the rest of the batch."""
        noise = torch.empty_like(probs)
        shared = [row for row, g in enumerate(generators) if g is None]
        if shared:
            draws = torch.empty(len(shared), probs.shape[-1], device=probs.device)
            noise[shared] = draws.exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        # A zero draw would make 0 / 0 = NaN, which argmax takes for the largest value.
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, one row per sequence."""
    device = logits.device
    temperature = torch.tensor([s.params.temperature for s in seqs], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
    if any(k < vocab for k in top_k):
        kth = logits.topk(max(top_k), dim=-1).values.gather(1, torch.tensor(top_k, device=device)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = torch.tensor([s.params.top_p for s in seqs], device=device, dtype=logits.dtype)
    if bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the likelier ones alone already reach top_p (the first always stays).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([s.params.min_p for s in seqs], device=device, dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _penalised(seq: Sequence) -> bool:
    params = seq.params
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)


def _stops_banned(seq: Sequence) -> bool:
    return seq.num_output_tokens < seq.params.min_tokens


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    """OpenAI's presence/frequency penalties (output tokens) and the repetition penalty (all)."""
    params = seq.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        output = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(output, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def _mask_early_stops(logits: torch.Tensor, seq: Sequence, eos_token_ids: Collection[int]) -> None:
    """Before min_tokens new tokens, neither EOS nor a stop token id may be drawn."""
    if not _stops_banned(seq):
        return
    banned = [t for t in (*eos_token_ids, *seq.params.stop_token_ids) if t < logits.shape[-1]]
    if banned:
        logits[banned] = float("-inf")


def _token_logprob(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    top = logprobs.topk(num_top) if num_top else None
    alternatives = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else {}
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id]), top=alternatives)
