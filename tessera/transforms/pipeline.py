"""The lowering pipeline: the passes, in order, that take a parsed kernel to codegen form."""

from __future__ import annotations

from collections.abc import Callable

from tessera.ir.func import Function
from tessera.transforms.flatten_buffers import flatten_buffers
from tessera.transforms.lower_task_mapping import lower_task_mapping
from tessera.transforms.plan_shared_memory import plan_shared_memory
from tessera.transforms.simplify import simplify
from tessera.transforms.unconditional_loads import unconditional_loads
from tessera.transforms.verify import verify

Pass = Callable[[Function], Function]

PIPELINE: list[tuple[str, Pass]] = [
    ("verify", verify),
    ("lower_task_mapping", lower_task_mapping),
    ("simplify", simplify),
    ("unconditional_loads", unconditional_loads),
    ("flatten_buffers", flatten_buffers),
    ("simplify", simplify),
    ("plan_shared_memory", plan_shared_memory),
    ("verify", verify),
]


def lower(func: Function, trace: list[tuple[str, Function]] | None = None) -> Function:
    """Run every pass; with `trace`, record the function after each one (for debugging)."""
    for name, pass_ in PIPELINE:
        func = pass_(func)
        if trace is not None:
            trace.append((name, func))
    return func
