"""CPU plans replayed as a list of prepared C calls: the CPU's counterpart of a CUDA graph.

A plan's steps check their arguments, bind shape symbols and evaluate scalar arguments on
every call, in Python, per kernel: for a small model that host work costs more than the
kernels.  But within one plan every shape, every intermediate's address (the plan's arena),
constant and workspace is fixed; only the graph's inputs and outputs move from call to call.
So the plan's first call runs the steps as usual while `runtime.cpu.recording` notes each C
call with its checked argument values; `Replay` keeps that list, and later calls only
substitute the addresses of this call's inputs and outputs (at their recorded offsets) and
call the C functions in order -- in one native call through `cpu_runner`'s trampoline where
every kernel's parameters allow it, else one ctypes call each.

Only steps that do nothing but launch CPU kernels may be replayed (`replayable`): a step that
computes in Python (a numpy reference) would be skipped by the replay.  The recorded argument
views keep alive every array the recorded pointers point into.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tessera.errors import raise_for_status
from tessera.graph.compiler.cpu_runner import NativeRun, runnable
from tessera.runtime.cpu import RecordedCall, recording


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class Replay:
    """The C calls of one plan, with the argument slots that take this call's input and output
    addresses."""

    def __init__(self, launches: Sequence[RecordedCall], regions: Sequence[np.ndarray]):
        spans = [(_address(a), a.nbytes) for a in regions]
        self._keep = [launch.views for launch in launches]  # what the fixed addresses point into
        self._calls: list[tuple[Any, list[Any], list[tuple[int, int, int]], str]] = []
        for launch in launches:
            kernel = launch.kernel
            patches = []
            for pos, (value, is_pointer) in enumerate(zip(launch.values, kernel.pointer_args)):
                if not is_pointer:
                    continue
                for r, (base, size) in enumerate(spans):
                    if base <= value < base + size:
                        patches.append((pos, r, value - base))
                        break
            self._calls.append((kernel.fn, list(launch.values), patches, kernel.func.name))
        self._regions = len(spans)
        self._native: NativeRun | None = None
        if all(runnable(launch.kernel.fn.argtypes[:-1]) for launch in launches):
            try:
                self._native = NativeRun(self._calls, self._regions)
            except RuntimeError:
                self._native = None
        self._lock = threading.Lock()  # the native run patches its argument words in place

    @classmethod
    def record(cls, run: Callable[[], None], inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> Replay | None:
        """Run `run()` (the plan's steps on `inputs`, writing `outputs`) and return its replay,
        or None when the arrays overlap (an address could not be told apart: record on a
        later call)."""
        with recording() as launches:
            run()
        regions = [*inputs, *outputs]
        spans = sorted((_address(a), _address(a) + a.nbytes) for a in regions)
        if any(prev[1] > nxt[0] for prev, nxt in zip(spans, spans[1:])):
            return None
        return cls(launches, regions)

    def __call__(self, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> None:
        """Run the recorded calls on this call's arrays (of the recorded shapes and dtypes,
        C-contiguous: the plan's shape check and input conversion guarantee it)."""
        bases = [_address(a) for a in inputs] + [_address(a) for a in outputs]
        status = ctypes.c_int32(0)
        if self._native is not None:
            with self._lock:
                failed = self._native(bases, status)
            if failed >= 0:
                raise_for_status(status.value, self._calls[failed][3])
            return
        ref = ctypes.byref(status)
        for fn, values, patches, name in self._calls:
            if patches:
                values = values.copy()  # the recorded list stays as it was (calls from several threads)
                for pos, r, offset in patches:
                    values[pos] = bases[r] + offset
            fn(*values, ref)
            if status.value:
                raise_for_status(status.value, name)

    def __len__(self) -> int:
        return len(self._calls)

    @property
    def native(self) -> bool:
        """Whether the calls run in one native call (cpu_runner) rather than one ctypes call each."""
        return self._native is not None
