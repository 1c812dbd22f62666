"""docs/aten_ops.md is the generated coverage table of the core ATen op set, and is up to date;
every core op has a status with a reason, and every op kept whole has a lowering."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tessera.frontend.torch import coverage  # noqa: E402
from tessera.frontend.torch.convert import rule_for  # noqa: E402
from tessera.frontend.torch.decompositions import kept_ops  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "aten_ops.md"


def test_table_is_up_to_date():
    assert DOC.read_text() == coverage.table(), "regenerate it: python -m tessera.frontend.torch.coverage"


def test_every_core_op_has_a_status_and_reason():
    ops = coverage.core_ops()
    assert len(ops) > 150  # the core op set (about 190 overloads)
    statuses = {str(op): coverage.status(op) for op in ops}
    unexplained = [name for name, (_, why) in statuses.items() if why == "no lowering yet"]
    assert not unexplained, unexplained
    assert {s for s, _ in statuses.values()} <= {"lowered", "decomposed", "metadata", "falls back", "breaks",
                                                 "functionalized"}  # fmt: skip
    assert statuses["aten.nonzero.default"][0] == "breaks"


def test_ops_kept_whole_have_lowerings():
    for op in kept_ops():
        assert rule_for(op) is not None, op
