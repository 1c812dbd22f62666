"""The state of a request while the engine serves it: one `Request`, one `Sequence` per sample.

A sequence is the unit the scheduler and the block manager see.  Its `token_ids` hold the prompt
and every token generated so far; `num_computed_tokens` says how many of them have their keys and
values in the paged cache.  After a preemption by recompute that count drops to 0 while the tokens
stay, so the sequence resumes exactly where it was, prompt and generated tokens alike.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.llm.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tessera.llm.sampling_params import SamplingParams

_SEQ_IDS = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds blocks; prefilling in chunks or decoding
    FINISHED = "finished"


class Sequence:
    """One sample of a request: its tokens, its blocks, and what its output looks like so far."""

    def __init__(self, request: Request, index: int, generator: torch.Generator | None, detokenizer: Any) -> None:
        self.seq_id = next(_SEQ_IDS)
        self.request = request
        self.index = index
        self.params: SamplingParams = request.params
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.cache_node: Any = None  # the prefix-cache node this sequence locks (prefix_cache.py), or None
        self.num_cached_tokens: int | None = None  # prompt tokens the cache held at first admission
        self.waiting_since = 0  # the scheduler step it (re)entered the waiting queue
        self.status = SequenceStatus.WAITING
        self.generator = generator  # None: the engine's shared generator (unseeded request)
        self.detokenizer = detokenizer  # tokenizer.IncrementalDetokenizer, or None without a tokenizer
        self.decoded = ""  # all text decoded so far, held-back text included
        self.text = ""  # the text released so far: a prefix of `decoded`
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs is not None else None
        self.step_token_ids: list[int] = []  # what the current step added
        self.step_text = ""

    @property
    def arrival(self) -> tuple[int, int]:
        """The order the scheduler keeps: earlier requests first, samples of one request in order."""
        return (self.request.arrival, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose keys and values are not in the cache yet (1 while decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def completion(self) -> CompletionOutput:
        """This sample as the API returns it, with what the last step added."""
        return CompletionOutput(index=self.index, token_ids=self.output_token_ids, text=self.text,
                                new_token_ids=list(self.step_token_ids), new_text=self.step_text,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                logprobs=list(self.logprobs) if self.logprobs is not None else None)  # fmt: skip


@dataclass
class Request:
    """A prompt with its sampling parameters and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens of its first sample that came from the prefix cache
    stream: bool = True  # an output after every step that adds to it; False: only the final one

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=list(self.prompt_token_ids),
                             outputs=[s.completion() for s in self.seqs], finished=self.finished,
                             num_cached_tokens=self.num_cached_tokens)  # fmt: skip
