"""CPU plans replayed from their recorded C calls (tessera/graph/compiler/cpu_replay.py): the
same results as running the steps, call after call on fresh inputs, with fresh outputs, per
plan of a dynamic graph, with errors raised from replayed kernels, and no replay where the
arrays' addresses cannot be told apart or a step computes in Python."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest

from tessera.backend.isa import vector_lanes
from tessera.errors import DivisionByZeroError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _block(rng, batch="batch"):
    """Two inputs: linear + gelu-tanh (a GEMM template with its epilogue, generic in the rows when
    the batch is symbolic), layer norm, a residual, softmax, a scalar power (folded
    into the code) and a second output passed through a reshape."""
    b = GraphBuilder("block")
    x = b.input("x", [batch, 19])
    r = b.input("r", [batch, 23])
    h = b.op("gelu", b.op("linear", x, b.constant(_f32(rng, 23, 19)), b.constant(_f32(rng, 23))), approximate="tanh")
    h = b.op("add", h, b.op("pow", r, b.constant(np.float32(3.0))))
    y = b.op("layer_norm", h, b.constant(_f32(rng, 23)), b.constant(_f32(rng, 23)))
    b.output(b.op("softmax", y), b.op("reshape", b.op("exp", x), shape=[-1]))
    return b.build()


def _plans(compiled):
    return list(compiled._plans.values())


NATIVE = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")  # where cpu_runner's trampoline runs


@pytest.fixture(params=["native", "ctypes"])
def replay_kind(request, monkeypatch):
    """Every replay test twice: through the native trampoline and through one ctypes call per kernel."""
    if request.param == "ctypes":
        from tessera.graph.compiler import cpu_runner

        monkeypatch.setattr(cpu_runner, "_trampoline", lambda: None)
    elif not NATIVE:
        pytest.skip("the native trampoline runs on x86-64 Linux")
    return request.param


@pytest.mark.parametrize("batch", [5, "batch"])
@pytest.mark.slow
def test_replay_matches_the_steps_call_after_call(rng, batch, replay_kind):
    graph = _block(rng, batch)
    compiled = compile_graph(graph, "cpu")
    assert any(s.kind == "anchor" for s in compiled.steps) == (vector_lanes() > 1)
    previous = None
    for _ in range(4):
        x, r = _f32(rng, 5, 19), _f32(rng, 5, 23)
        got = compiled(x, r)
        for out, ref in zip(got, graph.run(x, r)):
            np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
        if previous is not None:  # each call returns new arrays, not the last call's
            assert not np.shares_memory(got[0], previous[0])
            assert not np.array_equal(got[0], previous[0])
        previous = got
        (plan,) = _plans(compiled)
        assert plan.replayable and (plan.replay is not None) and len(plan.replay) >= 3
        assert plan.replay.native == (replay_kind == "native")


@pytest.mark.slow
def test_replay_per_plan_of_a_dynamic_graph(rng, replay_kind):
    graph = _block(rng)
    compiled = compile_graph(graph, "cpu")
    for batch in (3, 1, 7, 3, 1, 7):
        x, r = _f32(rng, batch, 19), _f32(rng, batch, 23)
        for out, ref in zip(compiled(x, r), graph.run(x, r)):
            np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    assert len(_plans(compiled)) == 3 and all(p.replay is not None for p in _plans(compiled))


@pytest.mark.slow
def test_profiling_runs_the_steps_and_agrees(rng):
    graph = _block(rng)
    compiled = compile_graph(graph, "cpu")
    x, r = _f32(rng, 4, 19), _f32(rng, 4, 23)
    replayed = compiled(x, r) and compiled(x, r)
    compiled.profile_steps()
    profiled = compiled(x, r)
    assert len(compiled.step_times) == len(compiled.steps) and all(t > 0 for t in compiled.step_times)
    for a, b in zip(replayed, profiled):
        np.testing.assert_array_equal(a, b)
    compiled.profile_steps(False)
    assert compiled.step_times is None


@pytest.mark.slow
def test_overlapping_inputs_are_not_recorded_until_they_are_apart(rng, replay_kind):
    """One array passed as both inputs: an address inside it could belong to either, so that call
    runs the steps and records nothing; a later call with separate arrays records."""
    b = GraphBuilder("pair")
    x, y = b.input("x", [6, 9]), b.input("y", [6, 9])
    b.output(b.op("add", b.op("mul", x, b.constant(np.float32(2.0))), b.op("tanh", y)))
    graph = b.build()
    compiled = compile_graph(graph, "cpu")
    a = _f32(rng, 6, 9)
    np.testing.assert_allclose(compiled(a, a)[0], graph.run(a, a)[0], rtol=2e-6, atol=1e-6)
    (plan,) = _plans(compiled)
    assert plan.replay is None
    for _ in range(3):
        x, y = _f32(rng, 6, 9), _f32(rng, 6, 9)
        np.testing.assert_allclose(compiled(x, y)[0], graph.run(x, y)[0], rtol=2e-6, atol=1e-6)
    assert plan.replay is not None
    np.testing.assert_allclose(compiled(a, a)[0], graph.run(a, a)[0], rtol=2e-6, atol=1e-6)  # the replay, aliased


@pytest.mark.slow
def test_replayed_kernel_raises_its_error(rng, replay_kind):
    b = GraphBuilder("div")
    x, y = b.input("x", [3, 5], "int32"), b.input("y", [3, 5], "int32")
    b.output(b.op("div", x, y, rounding="floor"))
    compiled = compile_graph(b.build(), "cpu")
    x = rng.integers(-50, 50, (3, 5)).astype(np.int32)
    y = rng.integers(1, 9, (3, 5)).astype(np.int32)
    np.testing.assert_array_equal(compiled(x, y)[0], np.floor_divide(x, y))
    assert _plans(compiled)[0].replay is not None
    assert _plans(compiled)[0].replay.native == (replay_kind == "native")
    y[1, 2] = 0
    with pytest.raises(DivisionByZeroError, match="div"):
        compiled(x, y)
    y[1, 2] = 4
    np.testing.assert_array_equal(compiled(x, y)[0], np.floor_divide(x, y))


@pytest.mark.slow
def test_a_python_step_keeps_the_plan_on_the_steps(rng, monkeypatch):
    """A numpy-reference step is no C call: a plan with one is never replayed (it would be skipped)."""
    from tessera.graph import lowering

    real = lowering.lowering_error
    monkeypatch.setattr(lowering, "lowering_error", lambda op: "test: in numpy" if op.kind == "tanh" else real(op))
    b = GraphBuilder("mixed")
    x = b.input("x", [4, 7])
    b.output(b.op("mul", b.op("tanh", b.op("add", x, x)), b.constant(np.float32(3.0))))
    graph = b.build()
    compiled = compile_graph(graph, "cpu")
    assert [s.kind for s in compiled.steps].count("reference") == 1
    for _ in range(3):
        xv = _f32(rng, 4, 7)
        np.testing.assert_allclose(compiled(xv)[0], graph.run(xv)[0], rtol=2e-6, atol=1e-6)
    (plan,) = _plans(compiled)
    assert not plan.replayable and plan.replay is None


def test_trampoline_takes_only_integer_class_parameters():
    import ctypes

    from tessera.graph.compiler.cpu_runner import MAX_ARGS, runnable

    assert runnable([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_bool])
    assert not runnable([ctypes.c_void_p, ctypes.c_float])  # floats travel in vector registers
    assert not runnable([ctypes.c_double])
    assert not runnable([ctypes.c_void_p] * (MAX_ARGS + 1))
