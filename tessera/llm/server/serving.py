"""From OpenAI requests to engine requests, and from engine outputs to OpenAI responses.

`Serving` handles one endpoint call: it turns the body into prompts and one `SamplingParams`,
submits one engine request per prompt (n samples each), then either collects the final outputs
into one response or yields server-sent events, one chunk per engine output, each carrying what
the client has not seen yet (the text, tokens and log-probabilities past what it sent).  However
the call ends (done, an error, the client gone) the engine requests still running are aborted.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from tessera.errors import RequestError
from tessera.llm.outputs import CompletionOutput, RequestOutput
from tessera.llm.sampling_params import SamplingParams
from tessera.llm.server.async_engine import AsyncLLMEngine, EngineFailure, RequestStream
from tessera.llm.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    error_body,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Sampling fields a request may leave out, with OpenAI's (or vLLM's) defaults; the model's
# generation_config.json overrides these, as vLLM's server does.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


class Serving:
    """What the endpoints share: the engine, tokenizers of the server's own, the model's name.

    Tokenizers are not thread-safe, so the server holds two copies of the engine's, one per
    thread: prompts are tokenized on a worker thread (neither the event loop nor the engine's
    steps wait for a long prompt; the engine gets token ids), and the event loop decodes single
    tokens for log-probabilities.
    """

    def __init__(self, engine: AsyncLLMEngine, tokenizer, model_name: str, max_model_len: int,
                 model_defaults: dict | None = None):  # fmt: skip
        self.engine = engine
        self.defaults = {k: (model_defaults or {}).get(k, v) for k, v in SAMPLING_DEFAULTS.items()}
        self.tokenizer = copy.deepcopy(tokenizer)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._encoder = copy.deepcopy(tokenizer)
        self._encoding = ThreadPoolExecutor(1, thread_name_prefix="tessera-tokenize")
        self._token_text: dict[int, str] = {}

    def close(self) -> None:
        """Stop the tokenizing thread."""
        self._encoding.shutdown(wait=False, cancel_futures=True)

    async def _on_encoder(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._encoding, fn, *args)

    # -- requests ----------------------------------------------------------------------------
    async def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """The token ids of each prompt of a completions body (strings are tokenized as the
        engine would, special tokens such as BOS included)."""
        if req.echo:
            raise RequestError("echo is not supported")
        if req.suffix:
            raise RequestError("suffix is not supported")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError("best_of other than n is not supported")
        prompt = req.prompt
        prompts: list = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise RequestError("the prompt is empty")
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            if self._encoder is None:
                raise RequestError("the model has no tokenizer: send the prompt as token ids")
            encoded = iter(await self._on_encoder(lambda: self._encoder(texts)["input_ids"]))
            prompts = [list(next(encoded)) if isinstance(p, str) else p for p in prompts]
        return [list(p) for p in prompts]

    async def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The chat template applied to the messages, as token ids."""
        if req.tools:
            raise RequestError("tools are not supported")
        if req.response_format is not None and req.response_format.type != "text":
            raise RequestError(f"response_format {req.response_format.type!r} is not supported")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                if any(part.type != "text" for part in content):
                    raise RequestError("only text content parts are supported")
                content = "".join(part.text or "" for part in content)
            messages.append({"role": m.role, "content": content or ""})
        if getattr(self._encoder, "chat_template", None) is None:
            raise RequestError("the model's tokenizer has no chat template; use /v1/completions")
        return await self._on_encoder(self._render_chat, messages, req.add_generation_prompt)

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        try:
            text = self._encoder.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # the template's own checks (roles must alternate, ...) raise
            raise RequestError(f"the chat template refused the messages: {exc}") from exc
        # The template writes the special tokens it wants (BOS included), so add none.
        return list(self._encoder(text, add_special_tokens=False)["input_ids"])

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                        logprobs: int | None) -> SamplingParams:  # fmt: skip
        """The body's sampling fields, range-checked by SamplingParams (RequestError: HTTP 400)."""
        if req.logit_bias:
            raise RequestError("logit_bias is not supported")
        if max_tokens is None:
            raise RequestError("max_tokens is required")
        given = {k: getattr(req, k) for k in SAMPLING_DEFAULTS if getattr(req, k) is not None}
        return SamplingParams(
            max_tokens=max_tokens,
            **{**self.defaults, **given},
            seed=req.seed,
            stop=req.stop or (),
            stop_token_ids=req.stop_token_ids or (),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            n=req.n,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            skip_special_tokens=req.skip_special_tokens,
        )

    def completion_params(self, req: CompletionRequest) -> SamplingParams:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        return self.sampling_params(req, max_tokens, req.logprobs)

    def chat_params(self, req: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # OpenAI's default: as much as the context holds
            max_tokens = self.max_model_len - prompt_len
            if max_tokens < 1:
                raise RequestError(f"the prompt has {prompt_len} tokens, the model's context length is "
                                   f"{self.max_model_len}")  # fmt: skip
        return self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)

    def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams, *,
               stream: bool = True) -> list[RequestStream]:  # fmt: skip
        """One engine request per prompt (with outputs per step when `stream`, else only the final
        one); on an error the ones already submitted are aborted."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(
                    self.engine.submit(request_id if len(prompts) == 1 else f"{request_id}-{i}", prompt, params,
                                       stream=stream)
                )
        except BaseException:
            abort_all(streams)
            raise
        return streams

    # -- whole responses ---------------------------------------------------------------------
    async def complete(self, request_id: str, streams: list[RequestStream], n: int) -> CompletionResponse:
        finals = await collect(streams)
        choices = [CompletionChoice(index=i * n + c.index, text=c.text, finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason, logprobs=self.completion_logprobs(c, 0, 0))
                   for i, out in enumerate(finals) for c in out.outputs]  # fmt: skip
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, created=int(time.time()), model=self.model_name,
                                  choices=choices, usage=usage(finals))  # fmt: skip

    async def chat(self, request_id: str, streams: list[RequestStream]) -> ChatCompletionResponse:
        (final,) = await collect(streams)
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason, logprobs=self.chat_logprobs(c, 0))
                   for c in sorted(final.outputs, key=lambda c: c.index)]  # fmt: skip
        return ChatCompletionResponse(id=request_id, created=int(time.time()), model=self.model_name,
                                      choices=choices, usage=usage([final]))  # fmt: skip

    # -- streams -----------------------------------------------------------------------------
    async def completion_events(self, request_id: str, streams: list[RequestStream], n: int,
                                include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
        """The SSE events of a streamed completion, `data: [DONE]` last."""
        sent: dict[int, tuple[int, int, bool]] = {}  # choice index -> (characters, tokens, the end) sent
        created = int(time.time())
        latest: list[RequestOutput | None] = [None] * len(streams)
        extra = {"usage": None} if include_usage else {}
        try:
            async for i, out in merge(streams):
                latest[i] = out
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    chars, tokens, ended = sent.get(index, (0, 0, False))
                    if not _news(c, chars, tokens, ended):
                        continue
                    sent[index] = (len(c.text), len(c.token_ids), c.finished)
                    choices.append(CompletionChoice(index=index, text=c.text[chars:], finish_reason=c.finish_reason,
                                                    logprobs=self.completion_logprobs(c, tokens, chars)))  # fmt: skip
                if choices:
                    chunk = CompletionResponse(id=request_id, object="text_completion", created=created,
                                               model=self.model_name, choices=choices, **extra)  # fmt: skip
                    yield sse(chunk.model_dump_json(exclude_unset=True))
            if include_usage:
                chunk = CompletionResponse(id=request_id, object="text_completion", created=created,
                                           model=self.model_name, choices=[],
                                           usage=usage([x for x in latest if x is not None]))  # fmt: skip
                yield sse(chunk.model_dump_json(exclude_unset=True))
        except (RequestError, EngineFailure) as exc:  # the status line has gone: report it in the stream
            yield sse(json.dumps(error_event(exc)))
        finally:
            abort_all(streams)
        yield sse("[DONE]")

    async def chat_events(self, request_id: str, streams: list[RequestStream], n: int,
                          include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
        """The SSE events of a streamed chat completion: the assistant's role first, then content."""
        created = int(time.time())
        extra = {"usage": None} if include_usage else {}

        def chunk(choices: list[ChatChunkChoice], **fields) -> str:
            body = ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created,
                                       model=self.model_name, choices=choices, **fields)  # fmt: skip
            return sse(body.model_dump_json(exclude_unset=True))

        sent: dict[int, tuple[int, int, bool]] = {}
        final: RequestOutput | None = None
        try:
            yield chunk([ChatChunkChoice(index=k, delta=Delta(role="assistant", content=""), logprobs=None,
                                         finish_reason=None) for k in range(n)], **extra)  # fmt: skip
            async for _, out in merge(streams):
                final = out
                choices = []
                for c in out.outputs:
                    chars, tokens, ended = sent.get(c.index, (0, 0, False))
                    if not _news(c, chars, tokens, ended):
                        continue
                    sent[c.index] = (len(c.text), len(c.token_ids), c.finished)
                    delta = Delta(content=c.text[chars:]) if len(c.text) > chars else Delta()
                    choices.append(ChatChunkChoice(index=c.index, delta=delta, finish_reason=c.finish_reason,
                                                   logprobs=self.chat_logprobs(c, tokens)))  # fmt: skip
                if choices:
                    yield chunk(choices, **extra)
            if include_usage and final is not None:
                yield chunk([], usage=usage([final]))
        except (RequestError, EngineFailure) as exc:
            yield sse(json.dumps(error_event(exc)))
        finally:
            abort_all(streams)
        yield sse("[DONE]")

    # -- log-probabilities -------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """A token's text on its own (partial UTF-8 shows as U+FFFD), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            decoded = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"<{token_id}>"
            text = self._token_text[token_id] = decoded
        return text

    def completion_logprobs(self, c: CompletionOutput, start: int, offset: int) -> CompletionLogprobs | None:
        """The legacy shape for tokens [start:] of `c`; text offsets count from `offset`."""
        if c.logprobs is None:
            return None
        # Fields set explicitly: streamed chunks are dumped with exclude_unset.
        result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in c.logprobs[start:]:
            text = self.token_text(lp.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(lp.logprob)
            top: dict[str, float] = {}
            for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1]):
                top.setdefault(self.token_text(t), v)  # tokens whose texts collide (U+FFFD) keep the likeliest
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def chat_logprobs(self, c: CompletionOutput, start: int) -> ChatLogprobs | None:
        """The chat shape (token, logprob, UTF-8 bytes, alternatives) for tokens [start:] of `c`."""
        if c.logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [ChatTokenLogprob(**entry(lp.token_id, lp.logprob),
                                    top_logprobs=[TopLogprob(**entry(t, v)) for t, v in
                                                  sorted(lp.top.items(), key=lambda kv: -kv[1])])
                   for lp in c.logprobs[start:]]  # fmt: skip
        return ChatLogprobs(content=content)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(finals: list[RequestOutput]) -> Usage:
    prompt = sum(len(out.prompt_token_ids) for out in finals)
    completion = sum(len(c.token_ids) for out in finals for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in finals)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))  # fmt: skip


def _news(c: CompletionOutput, chars_sent: int, tokens_sent: int, end_sent: bool) -> bool:
    """Whether a sample has something to tell the client: text, log-probabilities or its end
    (a request's outputs carry its finished samples too, until the last one ends)."""
    if end_sent:
        return False
    return c.finished or len(c.text) > chars_sent or (c.logprobs is not None and len(c.token_ids) > tokens_sent)


def sse(data: str) -> str:
    return f"data: {data}\n\n"


def error_event(exc: Exception) -> dict:
    if isinstance(exc, RequestError):
        return error_body(str(exc))
    return error_body(str(exc), type="server_error", code=500)


def abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream; whatever ends the wait, the unfinished ones are aborted."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        if final is None:
            raise EngineFailure("the request ended without output")
        return final

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # one failed, or the caller was cancelled: the others must not wait on forever
        for task in tasks:
            task.cancel()
        abort_all(streams)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all the streams, in the order the outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    out = future.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for future in pending:
            future.cancel()
