"""Kernel source is parsed safely from several threads (tessera.lang.pysource)."""

from __future__ import annotations

import ast
import gc
import threading

import pytest

from tessera.lang import pysource

# Big enough that the AST converter runs through thousands of garbage collections.
SOURCE = "\n".join(f"def f{i}(a, b):\n    return [(a + b) * {i} for _ in range(a)]" for i in range(300))


def _parse_with_a_second_parse_inside(at_fraction: float) -> tuple[Exception | None, bool]:
    """Parse SOURCE; at the given fraction of its collections, a garbage-collection callback
    makes another thread parse SOURCE too. That switch is what broke CPython 3.11's shared
    recursion counter (python/cpython#106905)."""
    old = gc.get_threshold()
    gc.set_threshold(1)
    counted = {"n": 0}
    gc.callbacks.append(counter := lambda phase, info: counted.__setitem__("n", counted["n"] + 1))
    try:
        pysource.parse(SOURCE)
    finally:
        gc.callbacks.remove(counter)
    trigger = int(counted["n"] * at_fraction) | 1  # a "start" phase: the calls alternate start, stop
    seen, other = {"n": 0}, {}

    def second() -> None:
        other["tree"] = pysource.parse(SOURCE)

    def callback(phase: str, info: dict) -> None:
        seen["n"] += 1
        if seen["n"] == trigger:
            other["thread"] = threading.Thread(target=second)
            other["thread"].start()
            other["thread"].join(0.3)  # the lock holds it back: go on without it

    gc.callbacks.append(callback)
    error = None
    try:
        tree = pysource.parse(SOURCE)
        assert isinstance(tree, ast.Module) and len(tree.body) == 300
    except SystemError as exc:
        error = exc
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*old)
    other["thread"].join()
    return error, isinstance(other.get("tree"), ast.Module)


@pytest.mark.slow
def test_a_parse_interleaved_with_another_threads_parse_succeeds():
    for fraction in (0.5, 0.75, 0.95):
        error, second_parsed = _parse_with_a_second_parse_inside(fraction)
        assert error is None, f"parse at {fraction}: {error}"
        assert second_parsed


def test_compile_expression_evaluates_a_parsed_expression():
    node = pysource.parse("2 * x + 1", mode="eval").body
    assert eval(pysource.compile_expression(node, "<test>"), {"x": 20}) == 41
