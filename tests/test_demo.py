"""The README's main job on the CPU: `python3 -m tessera demo` compiles the tiny GPT-2, checks
it against torch and prints both latencies from interleaved calls."""

from __future__ import annotations

import re

import pytest


@pytest.mark.slow
def test_demo_on_the_cpu_checks_and_times_honestly(capsys):
    pytest.importorskip("torch")
    from tessera.examples.demo import REPEAT, run_demo

    assert run_demo("gpt2", "cpu")
    out = capsys.readouterr().out
    assert "(ok tolerance" in out and f"medians of {REPEAT} interleaved calls" in out
    tessera_ms, eager_ms = (float(v) for v in re.search(r"tessera ([\d.]+) ms, torch eager ([\d.]+) ms", out).groups())
    speedup = float(re.search(r"speed-up: ([\d.]+)x", out).group(1))
    assert speedup == pytest.approx(eager_ms / tessera_ms, rel=0.02)
    assert ("faster than" in out) == (speedup >= 1.0)
