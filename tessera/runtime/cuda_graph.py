"""Streams and CUDA graphs through the driver API, for callers without torch.

`Stream()` is a blocking stream (the legacy default stream waits for it, so host copies made
with cuMemcpyDtoH see its results).  `capture(stream, fn)` records the launches `fn` makes on
`stream` into a graph; `CapturedGraph.replay(stream)` launches them again, as
torch.cuda.CUDAGraph does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tessera.runtime.cuda import use_stream
from tessera.runtime.driver import _driver, check, ensure_current


class Stream:
    """A CUDA stream owned by tessera; `handle` is the CUstream as an int."""

    def __init__(self) -> None:
        ensure_current()
        self._stream = check(_driver().cuStreamCreate(0), "cuStreamCreate")
        self.handle = int(self._stream)

    def synchronize(self) -> None:
        check(_driver().cuStreamSynchronize(self._stream), "cuStreamSynchronize (a kernel may have faulted)")

    def __del__(self) -> None:
        stream = getattr(self, "_stream", None)
        if stream is not None:
            try:
                _driver().cuStreamDestroy(stream)
            except Exception:  # noqa: BLE001  (interpreter shutdown)
                pass


class CapturedGraph:
    """An instantiated CUDA graph: `replay(stream)` runs the captured work again."""

    def __init__(self, graph: Any, executable: Any):
        self._graph, self._executable = graph, executable

    def replay(self, stream: Stream) -> None:
        check(_driver().cuGraphLaunch(self._executable, stream.handle), "cuGraphLaunch")

    def __del__(self) -> None:
        driver = _driver()
        try:
            if getattr(self, "_executable", None) is not None:
                driver.cuGraphExecDestroy(self._executable)
            if getattr(self, "_graph", None) is not None:
                driver.cuGraphDestroy(self._graph)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


def capture(stream: Stream, record: Callable[[], None]) -> CapturedGraph:
    """Capture everything `record()` launches on `stream` (made the current tessera stream)
    into a CUDA graph.  Launches on other streams or synchronous copies inside `record` make
    the capture fail with a DeviceError, rather than be silently left out."""
    driver = _driver()
    ensure_current()
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    check(driver.cuStreamBeginCapture(stream._stream, mode), "cuStreamBeginCapture")
    try:
        with use_stream(stream.handle):
            record()
    except BaseException:
        driver.cuStreamEndCapture(stream._stream)  # leave the stream usable; the error wins
        raise
    graph = check(driver.cuStreamEndCapture(stream._stream), "cuStreamEndCapture (the capture was invalidated)")
    executable = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    return CapturedGraph(graph, executable)
