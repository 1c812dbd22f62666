"""What generation returns: one `RequestOutput` per request, one `CompletionOutput` per sample.

The engine's `step()` returns a `RequestOutput` for every request that made progress in the
step; its completions carry the whole output so far (`token_ids`, `text`) and what this step
added (`new_token_ids`, `new_text`), so the offline API reads the former and streaming the latter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a sample ended, as OpenAI's API spells it: an EOS token or a stop string/token ("stop"),
# max_tokens or the context length ("length"), or the client gave up ("abort").
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class TokenLogprob:
    """The log-probability of one generated token, with the likeliest alternatives at its place."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # alternative token id -> log-probability


@dataclass
class CompletionOutput:
    """One sample of a request.

    index: which of the request's n samples.  token_ids/text: the output so far.
    new_token_ids/new_text: what was added since the previous output (for a streamed request, the
    last step; text is held back while it could still become a stop string, or while it ends
    inside a multi-byte character).
    finish_reason: None while running, else one of FINISH_REASONS; stop_reason: the stop string
    or token id that ended it, if one did.  logprobs: one entry per token when asked for.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt, its samples, and whether all are done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the cache, not computed
