"""The compile report (`CompiledGraph.report`, `tessera.explain`, `tessera run --explain`) and
the progress bars (TESSERA_PROGRESS, the `progress` option)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import tessera
import tessera.progress as progress
from tessera import settings
from tessera.errors import ArgumentError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _mlp(rng):
    b = GraphBuilder("mlp")
    x = b.input("x", ["batch", 17])
    h = b.op("gelu", b.op("linear", x, b.constant(_f32(rng, 24, 17)), b.constant(_f32(rng, 24))))
    y = b.op("layer_norm", b.op("linear", h, b.constant(_f32(rng, 13, 24))), b.constant(_f32(rng, 13)),
             b.constant(_f32(rng, 13)))  # fmt: skip
    b.output(b.op("softmax", b.op("reshape", y, shape=[-1, 13])))
    return b.build()


def _kernel_names(step):
    """The kernels a compiled graph's step built: a fused group's, or an anchor's (each loaded
    kernel once, however many shapes share it)."""
    if step.kind == "anchor":
        loaded = {id(k.kernel): k.kernel for _, k in step.prepared_by_shape()}
        return [n for k in loaded.values() for n in getattr(k, "kernels", [])]
    return [spec.name for spec in step.compiled.kernels]


def test_report_places_every_operator_and_measures_plan_and_time(rng):
    g = _mlp(rng)
    compiled = compile_graph(g, "cpu")
    before = compiled.report()
    assert "memory plan: none yet" in str(before)
    assert {"optimize", "partition", "lower", "build"} <= set(before.timings)
    xv = _f32(rng, 3, 17)
    np.testing.assert_allclose(compiled(xv)[0], g.run(xv)[0], rtol=1e-4, atol=1e-6)
    report = tessera.explain(compiled)
    text = str(report)
    # Every operator of the optimized graph is in a kernel or named as a view, and every kernel
    # the steps built is listed with its schedule.
    listed = {op for k in report.kernels for op in k.ops} | set(report.views)
    assert listed == {f"{op.kind} ({op.name})" for op in compiled.graph.operators}
    built = [name for s in compiled.steps for name in _kernel_names(s)]
    assert [n for k in report.kernels for n in k.kernels] == built
    # fused steps name their schedule, anchors their template (the linears, generic in the batch)
    assert all("schedule cpu" in k.how or "linear template" in k.how for k in report.kernels)
    plan = next(iter(compiled._plans.values()))
    assert report.plans[0].sizes == {"batch": 3} and report.plans[0].arena_bytes == plan.arena_bytes
    assert "memory plan (batch=3)" in text and {"plan", "anchors"} <= set(report.timings)
    assert f"{len(g.operators)} operators -> {len(built)} kernels" in text
    json.dumps(report.to_dict())  # plain data for tools


def test_report_attributes_inlined_ops_to_their_kernel(rng):
    b = GraphBuilder("softmax_of_scaled")
    x = b.input("x", [5, 7])
    b.output(b.op("softmax", b.op("exp", b.op("mul", x, b.constant(np.float32(0.5))))))
    compiled = compile_graph(b.build(), "cpu")
    (kernel,) = compiled.report().kernels  # mul and exp are inlined into the softmax kernel
    assert [op.split(" ")[0] for op in kernel.ops] == ["mul", "exp", "softmax"]


def test_report_names_reference_ops_and_shared_kernels(rng, monkeypatch, caplog):
    import tessera.graph.lowering as lowering

    original = lowering.lowering_error
    monkeypatch.setattr(lowering, "lowering_error", lambda op: "pretend unsupported" if op.kind == "gelu" else original(op))
    b = GraphBuilder("two_layers")
    h = b.input("x", [4, 9])
    for _ in range(2):  # the same layer twice around an operator left to numpy: one build, two steps
        h = b.op("gelu", b.op("softmax", b.op("mul", h, b.constant(_f32(rng, 9)))))
    b.output(h)
    g = b.build()
    with caplog.at_level(logging.WARNING, logger="tessera"):
        compiled = compile_graph(g, "cpu", optimize=False)
    report = compiled.report()
    assert [(k.step, k.kind) for k in report.kernels] == [(1, "fused"), (2, "reference"), (3, "fused"), (4, "reference")]
    assert report.kernels[2].shared_with == 1 and report.kernels[0].shared_with is None
    assert report.num_kernels == 1
    assert [why for _, why in report.reference] == ["pretend unsupported"] * 2
    assert "left to the numpy reference (2):" in str(report) and "same kernels as step 1" in str(report)
    xv = _f32(rng, 4, 9)
    np.testing.assert_allclose(compiled(xv)[0], g.run(xv)[0], rtol=1e-4, atol=1e-6)


def test_explain_refuses_what_it_cannot_explain():
    with pytest.raises(ArgumentError, match="tessera.explain takes a compiled graph"):
        tessera.explain(object())


def test_onnx_model_report_and_cli_explain(tmp_path, capsys):
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from tessera.cli import main

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Exp", ["r"], ["y"], name="exp")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    compiled = tessera.onnx.compile(str(path), "cpu")
    compiled(np.ones((2, 4), np.float32))
    report = tessera.explain(compiled)
    assert len(report.graphs) == 1 and report.graphs[0].plans[0].sizes == {"batch": 2}
    assert main(["run", str(path), "--device", "cpu", "--dim", "batch=3", "--repeat", "1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "memory plan (batch=3)" in out and "compile time:" in out and "<- relu" in out
    assert main(["run", str(path), "--device", "cpu", "--repeat", "1"]) == 0
    assert "compile time:" not in capsys.readouterr().out


# ---- progress ----------------------------------------------------------------------------------

def _compile_showing(rng, capfd, **kwargs) -> str:
    compile_graph(_mlp(rng), "cpu", **kwargs)
    return capfd.readouterr().err


def test_progress_follows_option_env_and_terminal(rng, monkeypatch, capfd):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(progress, "DELAY_S", 0)  # show at once, however quick the step
    monkeypatch.delenv(settings.PROGRESS.name, raising=False)
    assert "tessera: mlp" not in _compile_showing(rng, capfd)  # stderr is not a terminal under pytest
    assert "tessera: mlp: building" in _compile_showing(rng, capfd, progress=True)
    monkeypatch.setenv(settings.PROGRESS.name, "1")
    assert "tessera: mlp" in _compile_showing(rng, capfd)
    assert "tessera: mlp" not in _compile_showing(rng, capfd, progress=False)  # the option wins
    monkeypatch.setenv(settings.PROGRESS.name, "off")
    assert "tessera: mlp" not in _compile_showing(rng, capfd)
    monkeypatch.setenv(settings.PROGRESS.name, "sometimes")
    with pytest.raises(ArgumentError, match="TESSERA_PROGRESS='sometimes'"):
        compile_graph(_mlp(rng), "cpu")
    with pytest.raises(ArgumentError, match="progress"):
        compile_graph(_mlp(rng), "cpu", progress="yes")


def test_progress_context_nests_and_restores(monkeypatch):
    monkeypatch.delenv(settings.PROGRESS.name, raising=False)
    with progress.progress(True):
        assert progress.enabled()
        with progress.progress(None):  # None keeps the outer setting
            assert progress.enabled()
        with progress.progress(False):
            assert not progress.enabled()
            assert list(progress.bar([1, 2, 3])) == [1, 2, 3]  # the quiet stand-in iterates too
        assert progress.enabled()


def test_tuning_shows_progress(monkeypatch, capfd, cache_dir):
    pytest.importorskip("tqdm")
    from tessera.tune.tuner import tune

    monkeypatch.setattr(progress, "DELAY_S", 0)
    with progress.progress(True):
        record = tune("progress-case", [3, 1, 2], build=lambda c: c, bench=lambda c, built: float(built),
                      check=lambda c, built: None, template="t")  # fmt: skip
    assert record.best == 1 and "tessera: tuning progress-case" in capfd.readouterr().err
    with progress.progress(False):
        tune("progress-case-2", [3, 1], build=lambda c: c, bench=lambda c, b: float(b), check=lambda c, b: None, template="t")
    assert "tuning" not in capfd.readouterr().err


@pytest.mark.cuda
@pytest.mark.parametrize("tune", [False, True])
def test_report_on_the_gpu_names_templates_configs_and_tuning(tune):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    b = GraphBuilder("mlp_fp16", device="cuda")
    x = b.input("x", [33, 72], "float16")
    h = b.op("gelu", b.op("linear", x, b.constant(rng.standard_normal((136, 72)).astype(np.float16) * 0.1),
                          b.constant(rng.standard_normal(136).astype(np.float16))))  # fmt: skip
    b.output(b.op("softmax", h))
    g = b.build()
    compiled = compile_graph(g, "cuda", tune=tune)
    pending = [k for k in compiled.report().kernels if k.kind == "anchor"]
    assert len(pending) == 2 and all("none yet" in k.how for k in pending)  # anchors are prepared per shape at the first call
    xv = rng.standard_normal((33, 72)).astype(np.float16)
    out = compiled(torch.from_numpy(xv).cuda())[0].float().cpu().numpy()
    expected = g.run(xv)[0].astype(np.float32)
    assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-2
    report = compiled.report()
    anchor, row = [k for k in report.kernels if k.kind == "anchor"]  # the linear + gelu GEMM, then the softmax row kernel
    assert row.ops[0].startswith("softmax") and row.how == "softmax template"
    assert anchor.ops == [f"{op.kind} ({op.name})" for op in compiled.steps[0].group.ops]
    assert anchor.ops[0].startswith("linear") and any(op.startswith("gelu") for op in anchor.ops)  # the epilogue
    assert anchor.how == "linear template" and anchor.config and anchor.tuned is tune and anchor.shape.startswith("[33, 72]")
    assert report.cuda_graph and "replayed as a CUDA graph" in str(report)
    assert report.timings["anchors"] > 0
