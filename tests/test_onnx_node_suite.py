"""ONNX's backend node tests through tessera's CPU path (bench/onnx_node_tests.py).

The CPU tier runs `ci_selection` (a few tests per op family and every 6th test, about 300;
about 100 s in one process on 2 cores with a cold kernel cache), or every test with
`TESSERA_ONNX_NODE_TESTS=all` (about 1400), when the test data is there: `python3
bench/onnx_node_tests.py fetch` puts it in the cache (pip downloads the onnx sdist that ships
it), `$TESSERA_ONNX_NODE_DATA` names another copy; without it these tests skip, saying so.
The report with the pass rate by cause is `python3 bench/onnx_node_tests.py run -j 2`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import onnx_node_tests as suite  # noqa: E402

ROOT = suite.data_dir()
MISSING = suite.missing_data_reason(ROOT)
# One pytest-xdist worker (--dist loadgroup) runs this module: its selection runs once, not per worker.
pytestmark = pytest.mark.xdist_group("onnx-node-suite")


def _selection() -> list[str]:
    listed = dict(suite.list_tests(ROOT))
    counted = [n for n, why in listed.items() if why is None]
    if os.environ.get("TESSERA_ONNX_NODE_TESTS") == "all":
        return counted
    absent = [n for n in suite.CI_SUBSET if n not in listed]
    assert not absent, f"CI_SUBSET names tests the data does not have: {absent}"
    excluded = {n: listed[n] for n in suite.CI_SUBSET if listed[n]}
    assert not excluded, f"CI_SUBSET names excluded tests: {excluded}"
    return suite.ci_selection(counted)


def _run(tmp_path_factory, target: str) -> list[dict]:
    """The selection in worker processes that build into a fresh cache (as every test does)."""
    if MISSING:
        pytest.skip(MISSING)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE_DIR", str(tmp_path_factory.mktemp("tessera-cache")))
        return suite.run_tests(ROOT, _selection(), jobs=2 if target == "cpu" else 1, progress=False, target=target)


@pytest.fixture(scope="module")
def subset_rows(tmp_path_factory):
    return _run(tmp_path_factory, "cpu")


@pytest.mark.slow
def test_onnx_node_tests_pass(subset_rows):
    failed = {r["test"]: f"{r['cause']}: {r.get('detail', '')}" for r in subset_rows
              if r["status"] != "pass" and r["test"] not in suite.KNOWN_FAILURES}  # fmt: skip
    assert not failed, f"{len(failed)} of {len(subset_rows)} ONNX node tests fail: {failed}"


@pytest.mark.slow  # its fixture runs the selection: minutes on 2 cores
def test_onnx_node_tests_leave_nothing_to_numpy(subset_rows):
    """Every operator of the passing tests runs in a compiled kernel: none is left to its numpy
    reference between kernels (a host round trip, and no CUDA-graph capture on the GPU)."""
    in_numpy = {r["test"]: r["reference_ops"] for r in subset_rows if r["status"] == "pass" and r.get("reference_ops")}
    assert not in_numpy, f"operators left to numpy: {in_numpy}"


@pytest.mark.cuda
@pytest.mark.timeout(3600)  # ~300 tests through nvcc one after another
def test_onnx_node_tests_pass_on_the_gpu(tmp_path_factory):
    """The same selection through compile_graph(..., "cuda") (inputs copied to the GPU)."""
    rows = _run(tmp_path_factory, "cuda")
    failed = {r["test"]: f"{r['cause']}: {r.get('detail', '')}" for r in rows
              if r["status"] != "pass" and r["test"] not in suite.KNOWN_FAILURES}  # fmt: skip
    assert not failed, f"{len(failed)} of {len(rows)} ONNX node tests fail on the GPU: {failed}"


def test_missing_data_gives_a_reason_naming_the_fix(tmp_path):
    reason = suite.missing_data_reason(tmp_path / "nowhere")
    assert reason and "onnx_node_tests.py fetch" in reason and "TESSERA_ONNX_NODE_DATA" in reason


def test_comparison_follows_onnx_runner_rules():
    e = np.array([1.0, np.nan, 0.0], np.float32)
    assert suite.compare([e], [e.copy()]) is None
    assert suite.compare([e], [np.array([1.0005, np.nan, 5e-8], np.float32)]) is None  # rtol 1e-3, atol 1e-7
    assert suite.compare([e], [np.array([1.0, np.nan, 1e-6], np.float32)])[0] == "wrong result"
    assert suite.compare([e], [e.astype(np.float64)])[0] == "wrong dtype"
    assert suite.compare([e], [e[:2]])[0] == "wrong shape"
    assert suite.compare([np.array([1, 2])], [np.array([1, 3])])[0] == "wrong result"


def test_exclusions_reach_into_subgraphs():
    from onnx import TensorProto, helper

    inner = helper.make_graph([helper.make_node("SequenceEmpty", [], ["s"])], "b", [],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])])  # fmt: skip
    node = helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=inner)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])  # fmt: skip
    assert suite.exclusion(helper.make_model(g), "test_x") == "sequence/optional values"
    assert suite.exclusion(helper.make_model(g), "test_training_dropout_mask").startswith("training op")
