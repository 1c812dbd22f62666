"""The graph fuzzer in CI (issue 9, item 14): a few hundred random graphs from a fixed seed,
packed into a few compiled graphs, each called three times on fresh inputs and checked against
its reference (tests/fuzz explains the generator, the tolerances and the packing; run
`python3 tests/fuzz/run.py` for the 10,000-graph run)."""

from __future__ import annotations

import re

import pytest
from fuzz.driver import generate, now, report, run_many
from fuzz.spec import python_source

# Operators the compiler may decline: they run in their numpy reference (logged with the
# reason, results checked like any other); anything else that falls back is a failure.
LEGITIMATE_REFUSALS = [re.compile(p) for p in (
    r"^conv2d: conv2d of integer tensors",  # no integer GEMM path (torch has none on the CPU either)
    r"^(max|avg)_pool2d: .* with asymmetric padding",  # ONNX-only; the pooling kernels pad symmetrically
    r"^clamp: clamp of a bool tensor",  # torch refuses it
    r"^(elu|leaky_relu): \w+ of int",  # torch refuses it; the reference truncates to the integer dtype
    r"^slice: slice with a negative step over a symbolic size",  # reversing a dynamic axis
)]  # fmt: skip


@pytest.mark.slow
def test_fuzzed_graphs_match_the_reference(cache_dir):
    start = now()
    specs = generate(600, seed_value=2024)
    assert len(specs) == 600
    result = run_many(specs, batch=50, jobs=2)
    text = report(result, now() - start)
    assert result.graphs == len(specs), text
    if result.failures:  # the first failing graph as a standalone script, to start from
        text += "\n\n" + python_source(result.failures[0].spec)
    assert not result.failures, text
    unexpected = [r for r in result.refusals if not any(p.search(r) for p in LEGITIMATE_REFUSALS)]
    assert not unexpected, text
