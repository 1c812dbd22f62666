"""Timing harnesses the tuners share: candidates replayed from a CUDA graph on operands that
come from HBM, and the check of a candidate's output against a float32 reference.

Both work on torch CUDA tensors (the tuners make their operands with torch)."""

from __future__ import annotations

import statistics
from typing import Any

from tessera.errors import UnsupportedError
from tessera.runtime.cuda import device_properties


def _torch() -> Any:
    try:
        import torch  # optional: torch
    except ImportError:  # pragma: no cover - the GPU machine has torch
        raise UnsupportedError("timing candidates on the GPU needs torch; install torch") from None
    return torch


GRAPH_CALLS = 20  # launches per captured graph: a candidate's time is a replay's / GRAPH_CALLS
GRAPH_REPLAYS = 7  # timed replays; the median is taken
COLD_FACTOR = 2  # rotated operand sets read this many times L2 per replay (operands come from HBM)


def operand_sets(a: Any, b: Any) -> list[tuple[Any, Any]]:
    """(a, b) and enough copies that GRAPH_CALLS calls taking them in turn read COLD_FACTOR
    times L2: each call then reads its operands from HBM, as a model's weights are read,
    without an L2 flush inside the timed region."""
    per_call = a.numel() * a.element_size() + b.numel() * b.element_size()
    count = min(GRAPH_CALLS, max(1, -(-COLD_FACTOR * device_properties().l2_bytes // max(per_call, 1))))
    return [(a, b)] + [(a.clone(), b.clone()) for _ in range(count - 1)]


def graph_bench(run: Any, calls: int = GRAPH_CALLS) -> float:
    """A candidate's time (µs): `calls` calls `run(i)` (i = 0, 1, ...: the operand set to use)
    captured in one CUDA graph, the median of GRAPH_REPLAYS replays divided by the calls.

    Launched one by one from Python and timed with an event pair each, a GEMM of a few µs
    measured its host's launch path more than itself (H200: event times of 10-60 µs for a
    5 µs kernel, run to run; tuned picks were chance, and resnet50 bs16 ran 0.84-1.09 ms with
    different picks).  Replayed from a graph, the calls run back to back, with programmatic
    launch where tessera uses it, as they do inside a compiled model's graph."""
    torch = _torch()
    stream = _capture_stream(torch)
    stream.wait_stream(torch.cuda.current_stream())  # (the operands were made there)
    with torch.cuda.stream(stream):  # (on the capture stream: what a kernel keeps per stream is made now)
        run(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            run(i)
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(GRAPH_REPLAYS)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3 / calls


_CAPTURE_STREAMS: dict = {}


def _capture_stream(torch: Any) -> Any:
    """One stream per device for graph_bench's captures: a warm-up call on it first makes what a
    kernel keeps per stream (the register-A GEMM's stream-K sums), which a capture cannot."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def check_result(out: Any, ref: Any) -> str | None:
    """None when `out` matches the float32 reference `ref` elementwise (within fp16/bf16
    rounding and float32 accumulation-order error), else what is wrong."""
    torch = _torch()
    out, ref = out.float(), ref.float()
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = (out - ref).abs()
    bad = ~(err <= 1e-2 * ref.abs() + 1e-3 * scale)  # NaN counts as bad
    if bool(bad.any()):
        worst = float(torch.nan_to_num(err, nan=float("inf")).max())
        return f"{int(bad.sum())} of {out.numel()} elements differ from the float32 reference (max error {worst:.3g})"
    return None
