"""Progress bars for the long steps: building a model's kernels, preparing anchors, tuning.

Bars come from tqdm (an optional dependency: without it nothing is shown) and are written to
stderr.  Whether they show, in order of precedence:

1. `progress(False)` / `progress(True)` around the work (the `progress` option of
   `torch.compile(..., backend="tessera", options={...})` and of `compile_graph` sets it);
2. the environment variable TESSERA_PROGRESS (see tessera.settings): `0`/`off` never, `1`/`on`
   always (also when stderr is not a terminal, e.g. into a log);
3. by default: only when stderr is a terminal.

A bar appears only once its step has run for `DELAY_S`, so quick (cached) compiles print
nothing.  This module imports nothing of tessera but its errors and settings, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from typing import Any

from tessera import settings
from tessera.errors import ArgumentError

DELAY_S = 0.5
_SETTING: contextvars.ContextVar[bool | None] = contextvars.ContextVar("tessera_progress", default=None)


def enabled() -> bool:
    """Whether progress bars show here and now (see the module docstring for the rules)."""
    setting = _SETTING.get()
    if setting is not None:
        return setting
    env = settings.progress()
    if env is not None:
        return env
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


@contextlib.contextmanager
def progress(on: bool | None) -> Iterator[None]:
    """Show (True) or hide (False) progress bars inside this context (this thread or task);
    None leaves the decision to TESSERA_PROGRESS and the terminal."""
    if on is not None and not isinstance(on, bool):
        raise ArgumentError(f"progress must be True, False or None, got {on!r}")
    token = _SETTING.set(on if on is not None else _SETTING.get())
    try:
        yield
    finally:
        _SETTING.reset(token)


class _Quiet:
    """What `bar` returns when bars are off: accepts the calls a tqdm bar takes."""

    def __init__(self, iterable: Any = None):
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable if self._iterable is not None else ())

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        return None

    def set_description_str(self, desc: str) -> None:
        return None

    def set_postfix_str(self, text: str) -> None:
        return None

    def close(self) -> None:
        return None


def bar(iterable: Any = None, *, total: int | None = None, desc: str = "", unit: str = "it") -> Any:
    """A tqdm bar on stderr (prefixed "tessera: "), or a quiet stand-in when bars are off or
    tqdm is not installed.  Use it as tqdm: iterate over it, or `update()` and `close()` it."""
    if not enabled():
        return _Quiet(iterable)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Quiet(iterable)
    return tqdm(iterable, total=total, desc=f"tessera: {desc}" if desc else "tessera", unit=unit, delay=DELAY_S,
                leave=False, file=sys.stderr, dynamic_ncols=True)  # fmt: skip
