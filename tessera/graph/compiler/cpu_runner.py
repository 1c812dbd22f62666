"""One native call for a whole recorded CPU plan: a small C trampoline that calls the plan's
kernels through their function pointers (cpu_replay.Replay uses it where it can).

A ctypes call costs microseconds (argument conversion, the GIL dance), so a small model's
replay spent more time in 30 ctypes calls than in its kernels.  The trampoline takes the
kernels' addresses and their argument words in flat arrays, writes this call's input and
output addresses into the recorded slots, and calls each kernel in order, stopping at the
first one that sets its status word.

It calls every kernel through a pointer to a function of N 64-bit integer parameters plus
the status pointer.  That is what the x86-64 (System V) calling convention does for the
kernels' actual parameters when they are all pointers and integers: each goes in the next
integer register or 8-byte stack slot, and a 32-bit parameter reads the low half of its
word.  So `runnable` admits only such kernels (no float or double parameters), on x86-64
Linux, with at most MAX_ARGS parameters; anything else replays through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import sys
from pathlib import Path
from typing import Any

from tessera.backend.build import build_c
from tessera.errors import TesseraError

log = logging.getLogger("tessera")

MAX_ARGS = 40
_INTEGER_CLASS = (ctypes.c_void_p, ctypes.c_bool, ctypes.c_int8, ctypes.c_int16, ctypes.c_int32, ctypes.c_int64,
                  ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64)  # fmt: skip


def _source() -> str:
    cases = []
    for n in range(MAX_ARGS + 1):
        params = ", ".join(["int64_t"] * n + ["int32_t*"])
        args = ", ".join([f"a[{j}]" for j in range(n)] + ["status"])
        cases.append(f"      case {n}: ((void (*)({params}))fns[i])({args}); break;")
    return "\n".join([
        "#include <stdint.h>",
        "/* Run n recorded kernel calls: fns[i] with the nargs[i] words args[first[i]..]; first write",
        "   bases[region[p]] + offset[p] into args[slot[p]] (this call's input and output addresses).",
        "   Returns the index of the first call that sets *status, or -1. */",
        "int64_t ts_replay(int64_t n, void* const* fns, const int32_t* nargs, const int64_t* first, int64_t* args,",
        "                  int64_t npatch, const int64_t* slot, const int64_t* region, const int64_t* offset,",
        "                  const int64_t* bases, int32_t* status) {",
        "  for (int64_t p = 0; p < npatch; ++p) args[slot[p]] = bases[region[p]] + offset[p];",
        "  for (int64_t i = 0; i < n; ++i) {",
        "    const int64_t* a = args + first[i];",
        "    switch (nargs[i]) {",
        *cases,
        "      default: return i;",
        "    }",
        "    if (*status) return i;",
        "  }",
        "  return -1;",
        "}",
    ]) + "\n"  # fmt: skip


def artifact() -> Path | None:
    """The built trampoline library (in the artifact cache, like any kernel; a saved compiled
    graph ships it), or None where it cannot be built or used.  Not memoised: the cache
    directory may change (TESSERA_CACHE_DIR), and a lookup of a built one is cheap."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        return Path(build_c(_source()))
    except TesseraError as exc:  # no compiler, and no prebuilt artifact: ctypes replays instead
        log.info("tessera: the native CPU replay is not available (%s); replaying through ctypes", exc)
        return None


@functools.cache
def _trampoline() -> Any:
    """The loaded trampoline, or None (see `artifact`)."""
    path = artifact()
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(str(path)).ts_replay
    except OSError as exc:
        log.info("tessera: the native CPU replay is not available (%s); replaying through ctypes", exc)
        return None
    p64 = ctypes.POINTER(ctypes.c_int64)
    fn.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int32), p64, p64,
                   ctypes.c_int64, p64, p64, p64, p64, ctypes.POINTER(ctypes.c_int32)]  # fmt: skip
    fn.restype = ctypes.c_int64
    return fn


def runnable(argtypes: list[Any]) -> bool:
    """Whether a kernel with these ctypes argument types (status pointer excluded) can be called
    by the trampoline: integer-class parameters only, at most MAX_ARGS of them."""
    return len(argtypes) <= MAX_ARGS and all(t in _INTEGER_CLASS for t in argtypes)


class NativeRun:
    """The recorded calls of one plan as the trampoline's arrays."""

    def __init__(self, calls: list[tuple[Any, list[Any], list[tuple[int, int, int]], str]], regions: int):
        self._fn = _trampoline()
        if self._fn is None:
            raise RuntimeError("the native replay trampoline is not available")
        words: list[int] = []
        first, nargs, slots, where, offsets = [], [], [], [], []
        for _fn, values, patches, _ in calls:
            first.append(len(words))
            nargs.append(len(values))
            for pos, r, off in patches:
                slots.append(len(words) + pos)
                where.append(r)
                offsets.append(off)
            words += [int(v) & 0xFFFFFFFFFFFFFFFF for v in values]  # bools and negative ints as 64-bit words
        self.names = [name for *_, name in calls]
        n = len(calls)
        self._n, self._npatch, self._regions = n, len(slots), regions
        self._fns = (ctypes.c_void_p * max(n, 1))(*[ctypes.cast(fn, ctypes.c_void_p).value for fn, *_ in calls])
        self._nargs = (ctypes.c_int32 * max(n, 1))(*nargs)
        self._first = (ctypes.c_int64 * max(n, 1))(*first)
        self._args = (ctypes.c_uint64 * max(len(words), 1))(*words)
        self._slots = (ctypes.c_int64 * max(len(slots), 1))(*slots)
        self._where = (ctypes.c_int64 * max(len(where), 1))(*where)
        self._offsets = (ctypes.c_int64 * max(len(offsets), 1))(*offsets)
        p64 = ctypes.POINTER(ctypes.c_int64)
        self._call_args = (n, self._fns, self._nargs, self._first, ctypes.cast(self._args, p64), len(slots),
                           self._slots, self._where, self._offsets)  # fmt: skip

    def __call__(self, bases: list[int], status: ctypes.c_int32) -> int:
        """Run every call with this call's region addresses; the index of the call that set
        `status`, or -1."""
        return self._fn(*self._call_args, (ctypes.c_int64 * self._regions)(*bases), ctypes.byref(status))
