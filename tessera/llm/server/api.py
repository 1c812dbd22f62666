"""The OpenAI-compatible FastAPI app: `build_app(engine, served_model_name, api_key=None, max_queue=...)`.

Endpoints: POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with
`"stream": true`), GET /v1/models, /health and /metrics.  Errors use OpenAI's body
{"error": {"message", "type", "param", "code"}}:
- 400: a malformed body or field (FastAPI's 422 is mapped to 400), a parameter out of range, a
  prompt past the context length, an unknown model;
- 401: /v1 without the Bearer token when an API key is set (/health and /metrics stay open);
- 503 with Retry-After: more requests in flight than `max_queue`;
- 500: the engine failed on the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.errors import RequestError, TesseraError
from tessera.llm.server import metrics
from tessera.llm.server.async_engine import AsyncLLMEngine, EngineFailure, ServerOverloaded
from tessera.llm.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, error_body
from tessera.llm.server.serving import Serving, new_request_id

T = TypeVar("T")
log = logging.getLogger("tessera.llm.server")


class UnknownModel(RequestError):
    """The body names a model this server does not serve."""


class Unauthorized(TesseraError):
    """A /v1 request without the API key the server was started with (HTTP 401)."""


def build_app(engine, served_model_name: str | None = None, api_key: str | None = None,
              max_queue: int = 256, max_body_bytes: int = 16 << 20) -> FastAPI:  # fmt: skip
    """The app serving `engine` (an `LLMEngine`, or an `AsyncLLMEngine` already wrapping one).

    served_model_name: the name clients put in "model" (default: the engine's model_name).
    api_key: when set, /v1 answers only requests with `Authorization: Bearer <api_key>`.
    max_queue: requests in flight (queued and running) at most; more get 503 (an
    `AsyncLLMEngine` passed in keeps its own bound).  max_body_bytes: larger request bodies get
    413.  The app starts the engine thread when it starts and stops it when it shuts down.
    """
    async_engine = engine if isinstance(engine, AsyncLLMEngine) else AsyncLLMEngine(engine, max_pending=max_queue)
    llm_engine = async_engine.engine
    name = served_model_name or llm_engine.model_name
    serving = Serving(async_engine, llm_engine.tokenizer, name, llm_engine.max_model_len,
                      getattr(llm_engine, "sampling_defaults", None))  # fmt: skip
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            serving.close()
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="tessera.llm", lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    app.state.engine = async_engine
    app.state.serving = serving

    def authenticate(authorization: str | None = Header(default=None)) -> None:
        if api_key is not None and not hmac.compare_digest((authorization or "").encode(), f"Bearer {api_key}".encode()):
            raise Unauthorized("invalid or missing API key: send the header 'Authorization: Bearer <key>'")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
        return JSONResponse(error_body(str(exc), code="invalid_api_key"), status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})  # fmt: skip

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "the request body"
        message = f"{where}: {first.get('msg', 'malformed request')}"
        return JSONResponse(error_body(message, param=loc[0] if loc else None), status_code=400)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, exc: RequestError) -> JSONResponse:
        code = "model_not_found" if isinstance(exc, UnknownModel) else None
        param = "model" if isinstance(exc, UnknownModel) else None
        return JSONResponse(error_body(str(exc), param=param, code=code), status_code=400)

    @app.exception_handler(ServerOverloaded)
    async def overloaded(request: Request, exc: ServerOverloaded) -> JSONResponse:
        return JSONResponse(error_body(str(exc), type="server_error", code="overloaded"), status_code=503,
                            headers={"Retry-After": str(exc.retry_after_s)})  # fmt: skip

    @app.exception_handler(EngineFailure)
    async def engine_failed(request: Request, exc: EngineFailure) -> JSONResponse:
        return JSONResponse(error_body(str(exc), type="server_error", code=500), status_code=500)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's shape
        log.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error", code=500),
                            status_code=500)  # fmt: skip

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), type="invalid_request_error", code=exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)  # fmt: skip

    def check_model(model: str) -> None:
        if model != name:
            raise UnknownModel(f"the model {model!r} does not exist; this server serves {name!r}")

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(f"the engine is not running: {async_engine.error}", type="server_error"),
                            status_code=503)  # fmt: skip

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(async_engine, name), media_type=metrics.CONTENT_TYPE)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=created, max_model_len=llm_engine.max_model_len)])

    @v1.get("/models/{model:path}")
    async def model(model: str) -> ModelCard:
        check_model(model)
        return ModelCard(id=name, created=created, max_model_len=llm_engine.max_model_len)

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = await serving.completion_prompts(body)
        params = serving.completion_params(body)
        request_id = new_request_id("cmpl")
        streams = serving.submit(request_id, prompts, params, stream=bool(body.stream))
        if body.stream:
            await _accepted(streams)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _event_stream(serving.completion_events(request_id, streams, body.n, include_usage))
        return await _unless_disconnected(request, serving.complete(request_id, streams, body.n))

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        prompt = await serving.chat_prompt(body)
        params = serving.chat_params(body, len(prompt))
        request_id = new_request_id("chatcmpl")
        streams = serving.submit(request_id, [prompt], params, stream=bool(body.stream))
        if body.stream:
            await _accepted(streams)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _event_stream(serving.chat_events(request_id, streams, body.n, include_usage))
        return await _unless_disconnected(request, serving.chat(request_id, streams))

    app.include_router(v1)
    return app


async def _accepted(streams) -> None:
    """Wait until the engine took every request, so a refusal is still an HTTP status, not an event."""
    try:
        for stream in streams:
            await stream.accepted()
    except BaseException:
        for stream in streams:
            stream.abort()
        raise


class _BodyLimit:
    """Refuses request bodies over `limit` bytes, so memory per request stays bounded: 413 when
    Content-Length says so; a chunked body that grows past it fails while being read (400)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            response = JSONResponse(error_body(f"the request body is larger than {self.limit} bytes", code=413),
                                    status_code=413)  # fmt: skip
            return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise RequestError(f"the request body is larger than {self.limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


class _EventStream(StreamingResponse):
    """Server-sent events that stop as soon as the client goes away: the body is sent while
    `receive` is watched for the disconnect (whatever ASGI version the server speaks; starlette
    watches only below 2.4), and the generator is closed however the response ends, so its
    engine requests are aborted at once, not when it is garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        sending = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({sending, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if sending.done() and not isinstance(sending.exception(), OSError):  # OSError: the client left
                sending.result()  # another failure while streaming propagates
        finally:
            for task in (sending, watcher):
                task.cancel()
            await asyncio.gather(sending, watcher, return_exceptions=True)
            await self.body_iterator.aclose()


def _event_stream(events) -> _EventStream:
    return _EventStream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | JSONResponse:
    """Await `work` unless the client disconnects first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()  # its cleanup aborts the engine requests
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return JSONResponse(error_body("client disconnected"), status_code=499)  # for the access log only
