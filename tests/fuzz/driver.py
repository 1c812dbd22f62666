"""Driving the fuzzer: generating specs with hypothesis, checking batches in forked processes
(a kernel that corrupts memory or hangs takes down its process, not the run), bisecting such
deaths down to one graph, minimizing failures and writing reproducers."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings

from .check import Failure, Result, check_batch, minimize
from .generate import graph_specs
from .spec import GraphSpec, python_source

BATCH_TIMEOUT_S = 600


def generate(n: int, seed_value: int, max_ops: int = 10) -> list[GraphSpec]:
    """n distinct specs from the hypothesis strategy, deterministic for a seed."""
    specs: dict[str, GraphSpec] = {}
    round_ = 0
    while len(specs) < n:

        @seed(seed_value * 1000 + round_)
        # Hypothesis starts every run with its simplest examples: ask for a margin of extra ones.
        @settings(max_examples=100 + (n - len(specs)) * 5 // 4, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(graph_specs(max_ops=max_ops))
        def collect(spec: GraphSpec) -> None:
            if len(specs) < n:
                specs.setdefault(spec.key(), spec)

        collect()
        round_ += 1
    return list(specs.values())


def _child(conn: Any, specs: list[GraphSpec], salt: int) -> None:
    try:
        conn.send(("ok", check_batch(specs, salt)))
    except BaseException:  # noqa: BLE001  (report anything to the parent)
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


# One fork at a time: run_many forks from several threads, and two forks at once break libraries'
# at-fork handlers (filelock's raises "os.fork is unsafe while filelock is changing descriptor
# ownership").
_FORK_LOCK = threading.Lock()


def run_isolated(specs: list[GraphSpec], salt: int = 0, timeout: float = BATCH_TIMEOUT_S) -> Result:
    """check_batch in a forked process; a process that dies (signal, abort, hang) is bisected
    down to the graph that kills it, which is reported as a crash."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, specs, salt))
    with _FORK_LOCK:
        proc.start()
    child.close()
    message = None
    if parent.poll(timeout):
        try:
            message = parent.recv()
        except EOFError:
            message = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if message is not None and message[0] == "ok":
        return message[1]
    if message is not None:
        why = f"the checker raised: {message[1][-2000:]}"
    elif proc.exitcode is not None and proc.exitcode < 0:
        why = f"the process died of {signal.Signals(-proc.exitcode).name}"
    elif proc.exitcode is None or proc.exitcode == -signal.SIGKILL:
        why = f"the process hung for {timeout:.0f} s"
    else:
        why = f"the process exited with {proc.exitcode}"
    if len(specs) == 1:
        return Result(graphs=1, failures=[Failure("crash", specs[0], why)])
    half = len(specs) // 2
    return run_isolated(specs[:half], salt, timeout).merge(run_isolated(specs[half:], salt, timeout))


def run_many(specs: list[GraphSpec], batch: int = 40, jobs: int = 1, salt: int = 0,
             progress: Any = None) -> Result:  # fmt: skip
    """Check specs in packed batches, `jobs` batches at a time."""
    batches = [specs[i: i + batch] for i in range(0, len(specs), batch)]
    total = Result()
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for r in pool.map(lambda b: run_isolated(b, salt), batches):
            total.merge(r)
            if progress is not None:
                progress(total)
    return total


def _fails_isolated(spec: GraphSpec, kind: str, salt: int) -> bool:
    return any(f.kind == kind for f in run_isolated([spec], salt, timeout=120).failures)


def write_reproducers(failures: list[Failure], out: Path, salt: int = 0, do_minimize: bool = True) -> list[Path]:
    """For each failure: <kind>-<key>.json (original and minimized spec, the detail) and
    <kind>-<key>.py (a standalone script of the minimized graph)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for f in failures:
        small = f.spec
        if do_minimize and not f.together_with:
            small = minimize(f.spec, f.kind, salt, checker=lambda s, k: _fails_isolated(s, k, salt))
        stem = out / f"{f.kind}-{f.spec.key()}"
        record = {"kind": f.kind, "detail": f.detail, "spec": json.loads(f.spec.to_json()),
                  "minimized": json.loads(small.to_json()),
                  "together_with": [json.loads(s.to_json()) for s in f.together_with]}  # fmt: skip
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
        stem.with_suffix(".py").write_text(f"# {f.summary()[:2000]}\n" + python_source(small))
        written.append(stem.with_suffix(".py"))
    return written


def report(result: Result, seconds: float) -> str:
    lines = [
        f"graphs: {result.graphs}",
        f"mismatches: {result.count('mismatch')}",
        f"crashes: {result.count('crash')}",
        f"reference errors: {result.count('reference_error')}",
        f"graphs with refused operators (run by their reference): {result.refused_graphs}",
        f"compiles: {result.compiles}, {seconds:.0f} s, {result.graphs / max(seconds, 1e-9):.1f} graphs/s",
    ]
    for reason, n in result.refusals.most_common():
        lines.append(f"  refused {n}x  {reason}")
    for f in result.failures:
        lines.append("  " + f.summary()[:1500])
    return "\n".join(lines)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def now() -> float:
    return time.perf_counter()
