"""The graph compiler: partitioning, post-scheduling fusion decisions, the compiled graph
(memory plan, dynamic sizes without recompiling, fallbacks), and save/load in a fresh process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tessera.errors import ArgumentError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph, load_compiled, partition


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _mlp(rng, hidden=24, out=13):
    """x -> linear(+bias) -> gelu -> linear -> add residual-like -> layer_norm -> softmax."""
    b = GraphBuilder("mlp")
    x = b.input("x", ["batch", 17])
    h = b.op("linear", x, b.constant(_f32(rng, hidden, 17)), b.constant(_f32(rng, hidden)))
    h = b.op("gelu", h)
    y = b.op("linear", h, b.constant(_f32(rng, out, hidden) * 0.2))
    y = b.op("add", y, b.op("linear", x, b.constant(_f32(rng, out, 17) * 0.2)))
    y = b.op("layer_norm", y, b.constant(_f32(rng, out)), b.constant(_f32(rng, out)))
    b.output(b.op("softmax", b.op("mul", y, b.constant(np.float32(0.5)))))
    return b.build()


def test_partition_folds_elementwise_tails_into_anchors(rng):
    g = _mlp(rng)
    groups = partition(g, lambda op: None, lambda op: op.kind == "linear")
    anchors = [grp for grp in groups if grp.kind == "anchor"]
    assert [grp.anchor.kind for grp in anchors] == ["linear"] * 3
    assert [op.kind for op in anchors[0].epilogue] == ["gelu"]
    # The add needs the other linear's result, produced after the second anchor: it joins the
    # third anchor's epilogue (operand produced before that anchor) or a fused group, never both.
    placed = [op for grp in groups for op in grp.ops]
    assert sorted(op.name for op in placed) == sorted(op.name for op in g.operators)
    fused = [grp for grp in groups if grp.kind == "fused"]
    assert any("softmax" in [op.kind for op in grp.ops] for grp in fused)
    # Borders: each group's inputs are produced by earlier groups, graph inputs or constants.
    produced = set(g.inputs)
    for grp in groups:
        for t in grp.inputs:
            assert t in produced or t.is_constant
        produced.update(grp.outputs)
    assert set(g.outputs) <= produced


def test_partition_sends_unlowerable_ops_to_reference(rng):
    g = _mlp(rng)
    groups = partition(g, lambda op: "not today" if op.kind == "gelu" else None, lambda op: False)
    ref = [grp for grp in groups if grp.kind == "reference"]
    assert [grp.ops[0].kind for grp in ref] == ["gelu"] and ref[0].reason == "not today"


def test_compiled_mlp_matches_reference_across_batch_sizes(rng, cache_dir, monkeypatch):
    g = _mlp(rng)
    expected = {n: None for n in (1, 5, 33)}
    inputs = {n: _f32(rng, n, 17) for n in expected}
    for n in expected:
        expected[n] = g.run(inputs[n])[0]
    compiled = compile_graph(g, "cpu")
    assert compiled.summary()["reference_ops"] == []
    from tessera.backend import build

    compiled(inputs[5])  # the first call builds (and tunes) the anchors' row-generic kernels
    calls = []
    original = build._run
    monkeypatch.setattr(build, "_run", lambda *a, **k: (calls.append(a), original(*a, **k))[1])
    for n in expected:
        out = compiled(inputs[n])[0]
        assert out.shape == expected[n].shape
        np.testing.assert_allclose(out, expected[n], rtol=1e-4, atol=1e-6)
    assert calls == [], "a new batch size must not recompile"
    # Callers own their results: a second call does not overwrite the first result.
    first = compiled(inputs[5])[0]
    keep = first.copy()
    compiled(inputs[1])
    np.testing.assert_array_equal(first, keep)


def test_memory_plan_reuses_buffers(rng, cache_dir, monkeypatch):
    import tessera.graph.lowering as lowering

    # Host steps between the fused groups keep every intermediate materialised.
    original = lowering.lowering_error
    monkeypatch.setattr(lowering, "lowering_error", lambda op: "host" if op.kind == "mul" else original(op))
    b = GraphBuilder("chain")
    x = b.input("x", [64, 64])
    h = x
    for i in range(6):
        h = b.op("softmax", b.op("mul", h, b.constant(np.float32(1.0 + i))))
        h = b.op("layer_norm", h, b.constant(_f32(rng, 64)), b.constant(_f32(rng, 64)))
    b.output(h)
    g = b.build()
    compiled = compile_graph(g, "cpu")
    xv = _f32(rng, 64, 64)
    np.testing.assert_allclose(compiled(xv)[0], g.run(xv)[0], rtol=1e-4, atol=1e-5)
    plan = next(iter(compiled._plans.values()))
    intermediates = sum(int(np.prod(plan.shapes[t])) * 4 for s in compiled.steps for t in s.outputs if t not in g.outputs)
    assert 0 < plan.arena_bytes < intermediates


def test_fallback_to_reference_is_logged_and_correct(rng, cache_dir, monkeypatch, caplog):
    import tessera.graph.lowering as lowering

    original = lowering.lowering_error
    monkeypatch.setattr(lowering, "lowering_error", lambda op: "pretend unsupported" if op.kind == "gelu" else original(op))
    g = _mlp(rng)
    xv = _f32(rng, 3, 17)
    expected = g.run(xv)[0]
    with caplog.at_level(logging.WARNING, logger="tessera"):
        compiled = compile_graph(g, "cpu")
    assert any("gelu" in r.getMessage() and "pretend unsupported" in r.getMessage() for r in caplog.records)
    assert compiled.summary()["reference_ops"] == ["gelu: pretend unsupported"]
    np.testing.assert_allclose(compiled(xv)[0], expected, rtol=1e-4, atol=1e-6)


def test_reference_step_of_an_op_reading_one_tensor_twice(rng, cache_dir, monkeypatch):
    """concat(x, y, x) run by its reference gets x twice (the step's inputs are distinct tensors)."""
    import tessera.graph.lowering as lowering

    original = lowering.lowering_error
    monkeypatch.setattr(lowering, "lowering_error", lambda op: "pretend unsupported" if op.kind == "concat" else original(op))
    b = GraphBuilder("twice")
    x, y = b.input("x", [3, 2], "float32"), b.input("y", [3, 5], "float32")
    b.output(b.op("concat", x, y, x, axis=1))
    g = b.build()
    xv, yv = _f32(rng, 3, 2), _f32(rng, 3, 5)
    compiled = compile_graph(g, "cpu")
    assert compiled.summary()["reference_ops"] == ["concat: pretend unsupported"]
    np.testing.assert_array_equal(compiled(xv, yv)[0], np.concatenate([xv, yv, xv], axis=1))


def test_bad_inputs_are_reported(rng, cache_dir):
    compiled = compile_graph(_mlp(rng), "cpu")
    with pytest.raises(ArgumentError, match="takes 1 inputs"):
        compiled()
    with pytest.raises(ArgumentError, match="must be float32"):
        compiled(np.ones((2, 17), np.float64))
    with pytest.raises(Exception, match="17"):
        compiled(np.ones((2, 16), np.float32))
    with pytest.raises(ArgumentError, match="target"):
        compile_graph(_mlp(rng), "tpu")


def test_save_and_load_in_a_fresh_process(rng, cache_dir, tmp_path):
    g = _mlp(rng)
    xv = _f32(rng, 4, 17)
    compiled = compile_graph(g, "cpu")
    expected = compiled(xv)[0]
    path = tmp_path / "mlp.tsr"
    compiled.save(path)
    np.save(tmp_path / "x.npy", xv)
    np.save(tmp_path / "expected.npy", expected)
    script = textwrap.dedent(f"""
        import numpy as np
        from tessera.graph.compiler import load_compiled
        from tessera.backend import build
        calls = []
        original = build._run
        build._run = lambda *a, **k: (calls.append(a), original(*a, **k))[1]
        compiled = load_compiled({str(path)!r})
        out = compiled(np.load({str(tmp_path / 'x.npy')!r}))[0]
        np.testing.assert_allclose(out, np.load({str(tmp_path / 'expected.npy')!r}), rtol=1e-6)
        assert calls == [], "loading must not recompile"
        print("ok")
    """)
    # A fresh process with an EMPTY cache: the artifacts travel inside the file.
    env = {**__import__("os").environ, "TESSERA_CACHE_DIR": str(tmp_path / "fresh-cache")}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
    assert load_compiled(path)(xv)[0].shape == expected.shape


def test_corrupt_saved_file_gives_clear_error(tmp_path):
    path = tmp_path / "bad.tsr"
    path.write_bytes(b"not a zip at all")
    with pytest.raises(Exception, match="not a readable compiled-graph file"):
        load_compiled(path)


def test_cli_run_on_a_saved_graph(rng, cache_dir, tmp_path, capsys):
    from tessera.cli import main

    path = tmp_path / "mlp.tsr"
    compile_graph(_mlp(rng), "cpu").save(path)
    assert main(["run", str(path), "--device", "cpu", "--dim", "batch=3", "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    assert "shape (3, 13)" in out and "latency" in out
    assert main(["run", str(tmp_path / "missing.onnx")]) == 1


def test_cuda_anchor_templates_are_kept_by_structure_and_shape(monkeypatch):
    """The process-wide table of CUDA anchor kernels (build._SHARED_ANCHORS): a template is a
    sibling without workspaces; a hit hands out a new sibling with the template's artifacts and
    tuning records; the least recently used templates go first; kernels that cannot be shared
    (no `sibling`) are not kept."""
    from collections import OrderedDict

    from tessera.graph.compiler import build

    class Fake:
        def __init__(self, workspaces: bool = True):
            self.workspaces = workspaces
            self.artifacts, self.tuning = ["k.cubin"], ["record"]

        def sibling(self, *, workspaces: bool = True) -> Fake:
            return Fake(workspaces)

    monkeypatch.setattr(build, "_SHARED_ANCHORS", OrderedDict())
    monkeypatch.setattr(build, "SHARED_ANCHORS_KEPT", 2)
    assert build._shared_anchor(("a",)) is None and build._shared_anchor(None) is None
    first = Fake()
    build._keep_anchor(("a",), first)
    assert build._SHARED_ANCHORS[("a",)].workspaces is False  # the template holds no device memory
    hit = build._shared_anchor(("a",))
    assert hit is not first and hit.workspaces and hit.artifacts == ["k.cubin"] and hit.tuning == ["record"]
    build._keep_anchor(("b",), Fake())
    build._shared_anchor(("a",))  # "a" is now the most recent
    build._keep_anchor(("c",), Fake())
    assert list(build._SHARED_ANCHORS) == [("a",), ("c",)]
    build._keep_anchor(("d",), lambda arrays, outputs: None)  # a generic anchor: nothing to share
    build._keep_anchor(None, Fake())  # a CPU anchor (no key): its kernel packs the weights
    assert list(build._SHARED_ANCHORS) == [("a",), ("c",)]


def test_cuda_anchor_templates_are_planned_anew_under_other_planning_settings(monkeypatch):
    """The settings the planners read are part of the shared anchors' key: after a recompile
    with $TESSERA_LOWBIT_PREFILL changed, the anchor is planned under the new setting, not
    reused from the old one's (register-A plans were timed as 'auto' ones so); the same
    setting again reuses it."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from tessera.graph.compiler import build

    class Fake:
        kernel = SimpleNamespace(artifact="k.cubin")

        def __init__(self, mode: str | None = None, workspaces: bool = True):
            self.mode, self.workspaces = mode, workspaces

        def sibling(self, *, workspaces: bool = True) -> Fake:
            return Fake(self.mode, workspaces)

    monkeypatch.setattr(build, "_SHARED_ANCHORS", OrderedDict())
    monkeypatch.setattr(build, "group_signature", lambda group: "lowbit_linear")
    template = SimpleNamespace(prepare=lambda group, shapes, tune: Fake(os.environ.get("TESSERA_LOWBIT_PREFILL")),
                               generic=lambda group, tune: None)  # fmt: skip
    monkeypatch.setattr(build, "chosen", lambda op, target: template)
    prepare = build._anchor_preparer("cuda", "sm_90", True, {})
    group = SimpleNamespace(inputs=[], anchor=None)
    for mode in ("register", "auto", "register"):
        monkeypatch.setenv("TESSERA_LOWBIT_PREFILL", mode)
        assert prepare(group, {}).mode == mode
    assert len(build._SHARED_ANCHORS) == 2
    monkeypatch.setenv("TESSERA_IMPLICIT_CONV", "0")
    assert build.planning_settings() == ("register", False)


def test_cpu_anchors_are_not_shared_between_equal_layers():
    """CPU templates pack their constant weights into the kernel: two linears of the same
    shape and structure get kernels of their own, and the process-wide table stays empty of them."""
    from tessera.graph.compiler import build

    rng = np.random.default_rng(3)
    b = GraphBuilder("two_layers")
    x = b.input("x", [5, 48], "float32")
    h = b.op("relu", b.op("linear", x, b.constant(rng.standard_normal((48, 48)).astype(np.float32))))
    b.output(b.op("relu", b.op("linear", h, b.constant(rng.standard_normal((48, 48)).astype(np.float32)))))
    g = b.build()
    before = dict(build._SHARED_ANCHORS)
    compiled = compile_graph(g, "cpu")
    for seed in range(2):
        xv = np.random.default_rng(seed).standard_normal((5, 48)).astype(np.float32)
        np.testing.assert_allclose(compiled(xv)[0], g.run(xv)[0], rtol=1e-4, atol=1e-4)
    kernels = [r.kernel for s in compiled.steps if s.kind == "anchor" for r in s.prepared()]
    assert len(kernels) == 2 and kernels[0] is not kernels[1]
    assert dict(build._SHARED_ANCHORS) == before
