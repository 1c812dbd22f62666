"""The tuner checks before it times: a candidate that faults or computes a wrong result is
skipped, never chosen; records are keyed by the template's source, so an edited template is
re-tuned; the GEMM tuner flushes L2 by reading."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest

from tessera.errors import TuningError
from tessera.tune import tuner

# Tuning records live in the artifact cache: each test starts from none.
pytestmark = pytest.mark.usefixtures("cache_dir")

X = np.arange(12, dtype=np.float32)


class Candidate:
    def __init__(self, name: str, fn, us: float):
        self.name, self.fn, self.us = name, fn, us

    def __str__(self) -> str:
        return self.name


def _raises(x):
    raise RuntimeError("illegal instruction (simulated fault)")


def _check(c: Candidate, built) -> str | None:
    out = built(X)
    return None if np.allclose(out, X * 2) else f"max error {np.abs(out - X * 2).max()}"


def _candidates() -> list[Candidate]:
    # The two bad candidates are the fastest: speed alone would choose one of them.
    return [Candidate("faults", _raises, 1.0), Candidate("wrong", lambda x: x * 3, 2.0),
            Candidate("right", lambda x: x * 2, 5.0), Candidate("right_but_slower", lambda x: x + x, 9.0)]  # fmt: skip


def _tune(candidates, template="template v1", timed=None):
    def bench(c, built):
        if timed is not None:
            timed.append(c.name)
        return c.us

    return tuner.tune("fake|shape", candidates, build=lambda c: c.fn, bench=bench, check=_check, template=template)


def test_faulting_and_wrong_candidates_are_skipped_and_logged(caplog):
    timed: list[str] = []
    with caplog.at_level(logging.WARNING, logger="tessera"):
        record = _tune(_candidates(), timed=timed)
    assert record.best.name == "right" and not record.from_cache
    assert timed == ["right", "right_but_slower"]  # the bad ones were never timed
    assert set(record.rejected) == {"faults", "wrong"}
    assert "raised RuntimeError" in record.rejected["faults"] and "wrong result" in record.rejected["wrong"]
    assert "skipping candidate faults" in caplog.text and "skipping candidate wrong" in caplog.text


def test_a_candidate_that_fails_to_build_is_skipped():
    def build(c):
        if c.name == "right":
            raise OSError("nvcc crashed")
        return c.fn

    record = tuner.tune("fake|build", _candidates(), build=build, bench=lambda c, b: c.us, check=_check, template="t")
    assert record.best.name == "right_but_slower" and "failed to build" in record.rejected["right"]


def test_when_every_candidate_fails_the_error_says_why():
    bad = [c for c in _candidates() if c.name in ("faults", "wrong")]
    with pytest.raises(TuningError, match="all 2 candidates failed.*faults: raised RuntimeError.*wrong: wrong result"):
        _tune(bad)


def test_the_record_key_follows_the_template_source(cache_dir):
    first = _tune(_candidates(), template="def template(): return 1")
    assert not first.from_cache
    assert _tune(_candidates(), template="def template(): return 1").from_cache
    timed: list[str] = []
    edited = _tune(_candidates(), template="def template(): return 2", timed=timed)
    assert not edited.from_cache and timed, "an edited template must be re-tuned, not given the stale winner"
    assert tuner.record_key("k", "a") != tuner.record_key("k", "b")
    assert len(list((cache_dir / "tuning").glob("*.json"))) == 2


def test_the_gemm_records_are_keyed_by_the_templates_source():
    from tessera.templates.gemm import config as matmul
    from tessera.templates.gemm import mma as gemm
    from tessera.templates.gemm import tma as gemm_tma
    from tessera.templates.gemm import wgmma as gemm_sm90

    source = matmul.template_source()
    for fn in (gemm.make_gemm, gemm.make_split_k_reduce, gemm_sm90.make_gemm_wgmma, gemm_tma.make_gemm_tma,
               matmul.GemmLaunch):  # fmt: skip
        assert inspect.getsource(fn) in source
    tuned = inspect.getsource(matmul._tuned)
    assert "check=check" in tuned and "template=template_source()" in tuned


def test_a_recorded_winner_that_is_no_longer_a_candidate_is_re_tuned():
    _tune(_candidates())
    remaining = [c for c in _candidates() if c.name != "right"]
    record = _tune(remaining)
    assert not record.from_cache and record.best.name == "right_but_slower"


# ---- on the GPU ------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_gemm_tuner_skips_a_faulting_and_a_wrong_candidate(monkeypatch):
    import torch

    from tessera.eager import matmul as eager
    from tessera.templates.gemm import config as mm

    space = mm.schedule_space(64, 64, 128, 1, "kn", False, False)[:3]
    assert len(space) == 3
    faulting, wrong, good = space
    call = mm.GemmLaunch.__call__

    def patched(self, a, b):
        if self.cfg == faulting:
            raise RuntimeError("simulated fault")
        c = call(self, a, b)
        return c + 1 if self.cfg == wrong else c

    records = []
    tune = mm.tune
    monkeypatch.setattr(mm.GemmLaunch, "__call__", patched)
    monkeypatch.setattr(mm, "schedule_space", lambda *a, **k: list(space))
    monkeypatch.setattr(mm, "tune", lambda *a, **k: records.append(tune(*a, **k)) or records[-1])
    a = torch.randn(64, 128, device="cuda", dtype=torch.float16)
    b = torch.randn(128, 64, device="cuda", dtype=torch.float16)
    assert eager.choose_config(a, b) == good
    assert set(records[0].times_us) == {str(good)} and set(records[0].rejected) == {str(faulting), str(wrong)}


def test_gemm_operand_sets_read_more_than_l2_per_graph():
    """The timed graph's calls rotate through copies of the operands that add up to
    COLD_FACTOR x L2 (capped at one per call), so that each call reads them from HBM."""
    import torch

    from tessera.runtime.cuda import device_properties
    from tessera.tune import timing

    l2 = device_properties().l2_bytes
    for rows in (1, 300, 4096):
        a, b = torch.randn(rows, 512, dtype=torch.float16), torch.randn(512, 1024, dtype=torch.float16)
        sets = timing.operand_sets(a, b)
        per_call = (a.numel() + b.numel()) * 2
        assert sets[0][0] is a and sets[0][1] is b
        assert len(sets) == timing.GRAPH_CALLS or len(sets) * per_call >= timing.COLD_FACTOR * l2
        assert (len(sets) - 1) * per_call < timing.COLD_FACTOR * l2  # no more copies than that needs
        ptrs = {t.data_ptr() for pair in sets for t in pair}
        assert len(ptrs) == 2 * len(sets) and all(torch.equal(x, a) and torch.equal(y, b) for x, y in sets)


@pytest.mark.cuda
def test_gemm_bench_times_the_kernels_not_the_host():
    """Twice the work measures about twice the time, and a launch's host path (tens of µs of
    Python here) does not show: the calls are replayed from a CUDA graph."""
    import time

    import torch

    from tessera.tune.timing import graph_bench

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    once = graph_bench(lambda i: torch.matmul(a, b))
    twice = graph_bench(lambda i: (torch.matmul(a, b), torch.matmul(b, a)))
    assert 1.6 < twice / once < 2.4, (once, twice)
    small = torch.randn(64, 64, device="cuda", dtype=torch.float16)

    def slow_host(i):
        time.sleep(2e-4)  # 200 µs of host time per call, outside the GPU's timeline
        torch.matmul(small, small)

    assert graph_bench(slow_host) < 50.0


def test_close_candidates_are_timed_again_and_the_median_wins(cache_dir):
    """A slower candidate whose first timing was lucky loses once the close ones are re-timed;
    a clearly slower one is not re-timed."""
    samples = {"lucky": iter([4.0, 6.0, 6.2, 5.9, 6.1]), "steady": iter([4.5, 4.6, 4.4, 4.5, 4.6]),
               "slow": iter([9.0])}  # fmt: skip
    timed: list[str] = []

    def bench(c, built):
        timed.append(c.name)
        return next(samples[c.name])

    cands = [Candidate(n, lambda x: x * 2, 0.0) for n in ("lucky", "steady", "slow")]
    record = tuner.tune("fake|noisy", cands, build=lambda c: c.fn, bench=bench, check=_check, template="t")
    assert str(record.best) == "steady"
    assert timed.count("slow") == 1 and timed.count("lucky") == 1 + tuner.CONFIRM_ROUNDS
