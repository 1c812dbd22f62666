"""Tokens to text, one at a time, and the rules that end a sample.

`IncrementalDetokenizer` decodes a window of recent tokens and releases only the text a new token
added, holding it back while it ends inside a multi-byte character (the tokenizer decodes a lone
byte of one as U+FFFD).  A few prompt tokens seed the window, so the first output token decodes in
context (a leading space stays a space).

`append_token` adds a sampled token to a sequence and applies the stop rules: EOS (unless
ignore_eos), stop_token_ids (the token is kept, stop_reason is its id), stop strings (the text is
cut before the string, stop_reason is the string; text that could still become one is held back),
max_tokens and the context length (finish_reason "length").
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tessera.llm.sequence import Sequence

# Prompt tokens decoded ahead of the output so that its first token decodes in context.
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a sequence's output token by token (`add`), then what is left (`flush`)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # transformers' decode of a fast tokenizer is the Rust decode plus, when
        # clean_up_tokenization_spaces is set, a clean-up; without one, call the Rust side directly
        # (5x less host time per token, which a large batch pays every step).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already released
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The text `token_id` completes ('' while it ends inside a character)."""
        self.ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Whatever is still held back, incomplete characters decoded as U+FFFD."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""
        new_text = full[len(prefix) :]
        # The window restarts at the tokens just released; earlier ones are no longer needed.
        self.ids = self.ids[self.read_offset :]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        return new_text


def append_token(seq: Sequence, token_id: int, eos_token_ids: Collection[int], max_model_len: int) -> None:
    """Add a sampled token to `seq`, decode it, and finish `seq` if a stop rule says so.

    Sets seq.finish_reason / stop_reason, and seq.step_token_ids / step_text to what this
    token released; the caller frees a finished sequence's blocks."""
    params = seq.params
    seq.token_ids.append(token_id)
    seq.step_token_ids.append(token_id)
    if seq.detokenizer is not None:
        seq.decoded += seq.detokenizer.add(token_id)
    past_min_tokens = seq.num_output_tokens >= params.min_tokens
    stop_at = _find_stop_string(seq.decoded, len(seq.text), params.stop) if past_min_tokens else None
    if stop_at is not None:
        index, stop = stop_at
        seq.decoded = seq.decoded[:index]
        _finish(seq, "stop", stop)
    elif token_id in params.stop_token_ids and past_min_tokens:
        _finish(seq, "stop", token_id)
    elif token_id in eos_token_ids and not params.ignore_eos and past_min_tokens:
        _finish(seq, "stop", None)
    elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        _finish(seq, "length", None)
    if seq.finish_reason is not None:
        if seq.detokenizer is not None and not isinstance(seq.stop_reason, str):  # a stop string cut it
            seq.decoded += seq.detokenizer.flush()
        released = seq.decoded
    else:
        released = seq.decoded[: len(seq.decoded) - _held_back(seq.decoded, params.stop)]
    if len(released) > len(seq.text):
        seq.step_text += released[len(seq.text) :]
        seq.text = released


def _finish(seq: Sequence, reason: str, stop_reason: str | int | None) -> None:
    seq.finish_reason, seq.stop_reason = reason, stop_reason


def _find_stop_string(text: str, start: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in text[start:] (one may begin only in unreleased text)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest suffix of `text` that could still grow into a stop string."""
    held = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:length]):
                held = length
                break
    return held
