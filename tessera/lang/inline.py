"""`@ts.inline`: a piece of kernel code that kernels call and the parser expands in place.

An inline function is written like a kernel body and called from kernels (or other inline
functions) as a statement.  It is a macro, not a device function: its body is parsed at each
call with its parameters bound to the caller's arguments, so

* compile-time arguments (ints, dtypes, mappings, bools) stay compile-time: `ts.unroll(n)` and
  `if flag:` inside specialise per call;
* a run-time variable passed in is the caller's variable: assigning to the parameter
  (`stage += 1`) assigns it, as the caller's own code would (assigning a parameter that was
  passed a compile-time value is an error: the caller would not see it);
* tensors, shared buffers and registers are passed as they are;
* names the body defines stay its own; it sees its parameters and its own module's Python
  names, never the caller's locals (pass shape symbols such as M explicitly).

It cannot return a value (write results into arguments).  Kernels that share a pipeline stage
or an epilogue call one inline function instead of repeating it (tessera.templates.gemm.tma).
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections import ChainMap
from collections.abc import Callable
from typing import Any

from tessera.errors import KernelSyntaxError
from tessera.lang import pysource


class Inline:
    """A Python function whose body kernels expand where they call it (see the module doc)."""

    def __init__(self, fn: Callable, scope: dict[str, Any]):
        self.fn = fn
        self.name = fn.__name__
        self.signature = inspect.signature(fn)
        try:
            self.source_lines, self.first_line = inspect.getsourcelines(fn)
            self.filename = inspect.getsourcefile(fn) or "<unknown>"
        except (OSError, TypeError) as exc:
            raise KernelSyntaxError(f"cannot read the source of {fn!r}: {exc}", self.name) from None
        fdef = pysource.parse(textwrap.dedent("".join(self.source_lines))).body[0]
        if not isinstance(fdef, ast.FunctionDef):
            raise KernelSyntaxError("an inline function must be a plain `def` function", self.name, self.filename)
        self.body = fdef.body
        self.indent = len(self.source_lines[0]) - len(self.source_lines[0].lstrip())
        # Its defining frame's locals and closure over its module's globals, read live at each
        # expansion (an inline function may call one defined after it).
        local = dict(scope)
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                local[var] = cell.cell_contents
            except ValueError:  # empty cell: defined later in the enclosing function
                pass
        self.env = ChainMap(local, fn.__globals__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"inline function '{self.name}' expands inside kernels; it cannot be called from Python")

    def __repr__(self) -> str:
        return f"<tessera.inline {self.name}>"


def inline(fn: Callable) -> Inline:
    """Mark `fn` as kernel code that kernels expand where they call it (tessera.lang.inline)."""
    return Inline(fn, dict(sys._getframe(1).f_locals))
