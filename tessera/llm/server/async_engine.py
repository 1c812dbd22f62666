"""`AsyncLLMEngine`: the synchronous `LLMEngine` behind an asyncio server.

The engine is not thread-safe, so one background thread owns it: it takes commands (add, abort,
stop) from a thread-safe queue, steps while there is work and waits on the queue otherwise.  Each
request's outputs reach the event loop through `loop.call_soon_threadsafe` into its
`RequestStream`, which keeps only the latest output: every output carries the whole output so
far, so a slow client costs one output's memory, not one per step.

Requests in flight (queued in the server or the engine, or running) are bounded by `max_pending`;
beyond it `submit` raises `ServerOverloaded` (HTTP 503 with Retry-After).  An exception from the
engine fails the requests it concerns with `EngineFailure` (HTTP 500): a failed step, the requests
of that step, and the others are served on; if the engine cannot be
brought back to an empty state the thread stops, records why (`error`), and every later request
fails at once instead of waiting on a dead thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from tessera.errors import RequestError, TesseraError
from tessera.llm.engine import StepFailure
from tessera.llm.outputs import RequestOutput
from tessera.llm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tessera.llm.engine import EngineStats, LLMEngine

log = logging.getLogger("tessera.llm.server")

# The window over which /metrics reports generation tokens per second.
RATE_WINDOW_S = 10.0


class ServerOverloaded(TesseraError):
    """More requests are in flight than the server holds; the client should retry later (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineFailure(TesseraError):
    """The engine raised while serving the request, or its thread has stopped (HTTP 500)."""


class RequestStream:
    """One request's outputs on the event loop: `async for output in stream` yields the latest
    cumulative `RequestOutput` each time the engine made progress, the last one finished.

    Outputs that arrive while the consumer is busy replace each other; nothing is lost because
    each carries the whole output so far.  An error ends the iteration by being raised.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner: AsyncLLMEngine):
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._owner = owner
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._accepted = asyncio.Event()

    async def accepted(self) -> None:
        """Wait until the engine took the request; raises what `add_request` raised if it did not."""
        await self._accepted.wait()
        if isinstance(self._latest, BaseException):
            self.finished = True
            raise self._latest

    def abort(self) -> None:
        """Give up on the request: the engine drops it and frees its KV blocks (idempotent)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert item is not None
        self.finished = item.finished
        return item

    # Called on the event loop's thread (through call_soon_threadsafe) by the engine thread.
    def _put(self, item: RequestOutput | BaseException) -> None:
        self._latest = item
        self._accepted.set()
        self._ready.set()

    def _accept(self) -> None:
        self._accepted.set()


class AsyncLLMEngine:
    """Runs an `LLMEngine` on a background thread for asyncio callers.

    max_pending: requests in flight at most (queued and running); more get `ServerOverloaded`.
    retry_after_s: what the 503's Retry-After header says.
    """

    def __init__(self, engine: LLMEngine, max_pending: int = 256, retry_after_s: int = 1):
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self.error: BaseException | None = None  # why the engine thread stopped, if it did
        self.requests_total = 0  # admitted
        self.requests_rejected = 0  # refused for overload (503)
        self.requests_failed = 0  # ended by an engine error (500)
        self.stats: EngineStats | None = None  # the engine's stats after its latest step or command
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams and the counters
        self._thread: threading.Thread | None = None
        self._rate_samples: deque[tuple[float, int]] = deque()  # (time, generation tokens so far)
        self._rate_snapshot: tuple[tuple[float, int], ...] = ()

    # -- the event loop's side --------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is None:
            self.stats = self.engine.stats()
            self._thread = threading.Thread(target=self._run, name="tessera-llm-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; requests still in flight fail."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)
        self._fail_all(EngineFailure("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and taking requests."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_pending(self) -> int:
        """Requests in flight: submitted and neither finished, failed nor aborted."""
        return len(self._streams)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
               stream: bool = True) -> RequestStream:  # fmt: skip
        """Queue a request for the engine; call from the event loop.  `stream=False`: the stream
        gets only the final output.  Raises `ServerOverloaded` past `max_pending`, `EngineFailure`
        when the engine thread has stopped."""
        if not self.is_running:
            raise EngineFailure(f"the engine is not running{f': {self.error}' if self.error else ''}")
        with self._lock:
            if len(self._streams) >= self.max_pending:
                self.requests_rejected += 1
                raise ServerOverloaded(f"the server is at its limit of {self.max_pending} requests in flight; "
                                       f"retry after {self.retry_after_s} s", self.retry_after_s)  # fmt: skip
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in flight")
            outputs = RequestStream(request_id, asyncio.get_running_loop(), self)
            self._streams[request_id] = outputs
            self.requests_total += 1
        self._commands.put(("add", request_id, prompt, params, stream))
        return outputs

    def abort(self, request_id: str) -> None:
        """Drop a request (its stream gets nothing more); the engine frees its blocks."""
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            self._commands.put(("abort", request_id))

    def generation_tokens_per_s(self, now: float | None = None) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S seconds."""
        now = time.monotonic() if now is None else now
        samples = [s for s in self._rate_snapshot if s[0] >= now - RATE_WINDOW_S]
        if len(samples) < 2:
            return 0.0
        (t0, n0), (_, n1) = samples[0], samples[-1]
        return (n1 - n0) / max(now - t0, 1e-6)

    # -- the engine thread's side -----------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self._take_commands(block=not self.engine.has_unfinished_requests()):
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
        except BaseException as exc:  # the thread must not die silently: record, log, fail everyone
            self.error = exc
            log.exception("the engine thread stopped")
            self._fail_all(EngineFailure(f"the engine stopped: {type(exc).__name__}: {exc}"))

    def _take_commands(self, block: bool) -> bool:
        """Carry out the queued commands (waiting for one if `block`); False on stop."""
        try:
            command = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, *rest = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*rest)
            elif kind == "abort":
                self._abort_in_engine(rest[0])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams, per_step: bool) -> None:
        stream = self._streams.get(request_id)
        if stream is None:  # aborted before the engine saw it
            return
        try:
            self.engine.add_request(request_id, prompt, params, stream=per_step)
        except RequestError as exc:
            self._finish(request_id, exc)
        except Exception as exc:
            log.exception("add_request failed for %s", request_id)
            self._finish(request_id, EngineFailure(f"the engine failed to add the request: {exc}"), failed=True)
        else:
            self._deliver(stream, None)

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # finished meanwhile, or never added: nothing to free
            log.debug("abort of %s: not in the engine", request_id, exc_info=True)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailure as exc:  # the engine aborted that step's requests and serves on
            log.exception("engine step failed")
            for request_id in exc.request_ids:
                self._finish(request_id, EngineFailure(f"the engine failed: {exc.__cause__!r}"), failed=True)
            return
        except Exception as exc:
            log.exception("engine step failed")
            with self._lock:
                ids = list(self._streams)
            for request_id in ids:
                self._abort_in_engine(request_id)
                self._finish(request_id, EngineFailure(f"the engine failed: {type(exc).__name__}: {exc}"), failed=True)
            if self.engine.has_unfinished_requests():
                raise EngineFailure("the engine holds requests it cannot step or abort") from exc
            return
        for out in outputs:
            with self._lock:
                stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                self._deliver(stream, out)  # the engine built it fresh this step and keeps no reference

    def _finish(self, request_id: str, error: BaseException, failed: bool = False) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if failed and stream is not None:
                self.requests_failed += 1
        if stream is not None:
            self._deliver(stream, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self._deliver(stream, error)

    def _deliver(self, stream: RequestStream, item: RequestOutput | BaseException | None) -> None:
        callback = stream._accept if item is None else lambda: stream._put(item)
        try:
            stream._loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        self.stats = stats
        now = time.monotonic()
        samples = self._rate_samples
        if not samples or samples[-1][1] != stats.generation_tokens_total:
            samples.append((now, stats.generation_tokens_total))
        while len(samples) > 2 and samples[1][0] < now - RATE_WINDOW_S:
            samples.popleft()
        self._rate_snapshot = tuple(samples)  # what other threads read

