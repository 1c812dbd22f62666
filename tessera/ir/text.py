"""How IR nodes print: the node modules' `__str__` goes through here to the printer.

`tessera.ir.printer` imports the node modules (expressions, statements, functions), so they
cannot import it; it registers its functions here when it loads instead.  `tessera.ir` imports
the printer, so the functions are in place before any node exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_PRINTERS: dict[str, Callable[[Any], str]] = {}  # "expr", "stmt", "function" -> its printer


def register(kind: str, printer: Callable[[Any], str]) -> None:
    """Print nodes of `kind` ("expr", "stmt" or "function") with `printer`."""
    _PRINTERS[kind] = printer


def to_str(kind: str, node: Any) -> str:
    """`node`'s text, by the printer registered for `kind`."""
    return _PRINTERS[kind](node)
