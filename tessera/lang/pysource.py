"""Python's own parser and compiler, serialised across threads.

CPython 3.11 and 3.12 keep the AST converter's recursion depth in one per-interpreter counter.
A thread switch inside `ast.parse` (a garbage-collection callback is enough) lets a second
thread's parse move that counter, and the first one fails with "SystemError: AST constructor
recursion depth mismatch" (python/cpython#106905). Kernels are parsed from threads (the tuner
builds its candidates in a pool), so every parse and compile of kernel source goes through one
lock here.
"""

from __future__ import annotations

import ast
import threading
from typing import Any

_LOCK = threading.RLock()


def parse(source: str, mode: str = "exec") -> ast.Module | ast.Expression:
    """`ast.parse(source, mode=mode)`, one thread at a time."""
    with _LOCK:
        return ast.parse(source, mode=mode)


def compile_expression(node: ast.expr, filename: str) -> Any:
    """Compile one expression node to a code object for `eval`, one thread at a time."""
    with _LOCK:
        return compile(ast.Expression(node), filename, "eval")
