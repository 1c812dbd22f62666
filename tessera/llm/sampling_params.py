"""How one request samples: `SamplingParams`, checked when it is made.

The fields follow vLLM's and OpenAI's names, so the server maps a request body onto them one to
one.  A value out of range raises `RequestError` (a ValueError) naming the field and its range;
the server answers it with HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.errors import RequestError

# The most alternatives `logprobs` may ask for per token (OpenAI's completions API allows 5,
# its chat API 20; vLLM's default cap is 20).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the continuation of one prompt.

    max_tokens: new tokens at most (the prompt and these must fit `max_model_len`).
    temperature: 0 is greedy; otherwise logits are divided by it before sampling.
    top_p: nucleus sampling, keep the smallest set of tokens whose probability reaches top_p (1 = off).
    top_k: keep the k likeliest tokens (-1 or 0 = off).
    min_p: drop tokens whose probability is below min_p times the likeliest's (0 = off).
    seed: makes this request's samples reproducible, whatever else runs in the batch.
    stop: strings that end the output (not included in it); stop_token_ids: token ids that do (included).
    ignore_eos: keep going past the end-of-sequence token (benchmarks use it).
    min_tokens: EOS and stop token ids are not sampled before this many new tokens.
    n: samples per prompt.
    logprobs: None for none; k >= 0 returns the chosen token's log-probability and the k likeliest alternatives'.
    presence_penalty, frequency_penalty: OpenAI's penalties on tokens already generated (0 = off).
    repetition_penalty: divides positive logits (multiplies negative ones) of tokens in the prompt or output (1 = off).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Accept a single string or any iterable for stop / stop_token_ids, store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, open_low=True)
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2**63), high=2**64 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop must hold non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        _check_int("n", self.n, low=1, high=128)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, open_low=True, high=10.0)

    @property
    def greedy(self) -> bool:
        """True when the likeliest token is always taken (temperature 0)."""
        return self.temperature == 0.0

    def sample_seed(self, index: int) -> int | None:
        """The seed of the `index`-th of `n` samples (None when the request has no seed)."""
        return None if self.seed is None else (self.seed + index) % 2**64


def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(f"{name} must be in [{_bound(low)}, {_bound(high)}], got {value}")


def _check_number(name: str, value: object, low: float | None = None, high: float | None = None,
                  open_low: bool = False) -> None:  # fmt: skip
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise RequestError(f"{name} must be a number, got {value!r}")
    too_low = low is not None and (value <= low if open_low else value < low)
    if too_low or (high is not None and value > high):
        left = "(" if open_low else "["
        raise RequestError(f"{name} must be in {left}{_bound(low)}, {_bound(high)}], got {value}")


def _bound(b: float | None) -> str:
    return "inf" if b is None else str(b)
