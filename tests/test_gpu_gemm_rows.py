"""GPU GEMM anchors generic in their row count (tessera/templates/gemm/generic.py): one build
per schedule serves every batch and length; the grid and A's tensor map follow each call's rows.

The plans are checked here without a GPU (the planning device is an H100); the `cuda` tests
run them against torch in float32 at odd and size-1 row counts."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.errors import ArgumentError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.graph.compiler.partition import partition_for
from tessera.ir import dtypes
from tessera.ir.evaluate import evaluate
from tessera.templates.gemm import GEMM
from tessera.templates.gemm.generic import LADDER, RowGenericGpuGemm, bucket, unsplit
from tessera.templates.gemm.space import estimate_us, heuristic_config
from tessera.templates.gemm.tma import TmaConfig
from tessera.templates.kernel import MapSpec

N, K = 48, 64


def _block(k=K, n=N, matmul=False):
    """x [b, s, K] -> linear + bias (or matmul by a [K, N] input) -> gelu + residual [b, s, N]."""
    g = GraphBuilder("rows", device="cuda")
    x = g.input("x", ["b", "s", k], "float16")
    res = g.input("res", ["b", "s", n], "float16")
    if matmul:
        y = g.op("matmul", x, g.input("w", [k, n], "float16"))
    else:
        y = g.op("linear", x, g.input("w", [n, k], "float16"), g.input("bias", [n], "float16"))
    g.output(g.op("add", g.op("gelu", y), res))
    return g.build()


def _generic(graph) -> RowGenericGpuGemm:
    site = next(g for g in partition_for(graph, "cuda", lambda op: None) if g.kind == "anchor")
    gen = GEMM.generic(site, False)
    assert isinstance(gen, RowGenericGpuGemm)
    return gen


@pytest.mark.parametrize("family", ["tma", "wgmma", "mma"])
def test_each_family_plans_one_kernel_with_the_rows_free(family):
    gen = _generic(_block())
    cfg = heuristic_config(100, N, K, 1, family, "nk")
    plan = gen.plan(cfg)
    (launch,) = plan.launches
    f = launch.func
    assert launch.generic and f.name.endswith("_rows") and "split" not in [p.name for p in f.params]
    m = next(s for s in f.shape_params if s.name == "M")
    assert {s.name for s in f.shape_params} == {"M", "b", "s"}  # the epilogue's [b, s, N] shapes too
    grids = []
    for rows in (1, 100, 5000):
        env = {m: rows, **{s: 1 for s in f.shape_params if s is not m}}
        grids.append([int(evaluate(d, env)) for d in f.launch.grid])
    # The grid follows the rows: more rows, more blocks (a persistent TMA kernel: up to one per SM).
    assert grids[0] != grids[2] and max(grids[0]) <= max(grids[2])
    if family == "tma":
        assert [spec.shape for spec in plan.tensor_maps] == [(1, -1, K), (1, N, K)]
    assert "__global__" in plan.source


def test_a_split_k_schedule_runs_unsplit():
    cfg = TmaConfig(64, 64, 4, consumers=1, split_k=4, persistent=False, split_reduce="cluster")
    assert unsplit(cfg).split_k == 1 and unsplit(cfg).split_reduce == "launch"
    plan = _generic(_block()).plan(unsplit(heuristic_config(16, N, 4096, 1, "mma", "nk")))
    assert len(plan.launches) == 1 and not plan.workspaces


def test_a_free_map_shape_is_filled_from_the_operand():
    spec = MapSpec((0, 0), dtypes.float16, (1, -1, 64), (1, 64, 64))
    x = np.zeros((3, 7, 64), np.float16)
    assert spec.call_shape(x) == (1, 21, 64)
    assert MapSpec((0, 0), dtypes.float16, (1, 5, 64), (1, 64, 64)).call_shape(x) == (1, 5, 64)


def test_static_and_attention_like_sites_are_not_generic():
    g = GraphBuilder("static", device="cuda")
    g.output(g.op("linear", g.input("x", [4, 64], "float16"), g.input("w", [48, 64], "float16")))
    site = next(s for s in partition_for(g.build(), "cuda", lambda op: None) if s.kind == "anchor")
    assert GEMM.generic(site, False) is None
    g = GraphBuilder("scores", device="cuda")
    q, k = g.input("q", ["b", "s", 64], "float16"), g.input("k", ["b", 64, "s"], "float16")
    g.output(g.op("matmul", q, k))
    site = next(s for s in partition_for(g.build(), "cuda", lambda op: None) if s.kind == "anchor")
    assert GEMM.generic(site, False) is None  # both operands symbolic: planned per shape


def test_the_first_call_builds_a_ladder_and_buckets_take_the_best_built():
    gen = _generic(_block(n=768, k=3072))
    schedules = gen.schedules(64)
    assert len(schedules) == len(set(schedules)) >= 2 and all(c.split_k == 1 for c in schedules)
    gen._kernels = dict.fromkeys(schedules)  # built, as far as the choice is concerned
    for m in (17, 40, 300, 5000, 40000):
        best = min(schedules, key=lambda c: estimate_us(c, bucket(m), 768, 3072))
        assert gen.config(m) == best
    assert gen.config(17) != gen.config(40000)  # a few rows and many take different tiles


def test_few_rows_are_planned_per_shape():
    calls = []
    site = next(g for g in partition_for(_block(), "cuda", lambda op: None) if g.kind == "anchor")
    gen = RowGenericGpuGemm(site, False, lambda shapes: calls.append(shapes) or "per-shape")
    x, res = site.anchor.inputs[0], site.inputs[1]
    assert gen.bind({x: (2, 8, K), res: (2, 8, N)}) == "per-shape" and len(calls) == 1 and not gen.kernels


# ---- on the GPU ---------------------------------------------------------------------------------------------------
def _reference(torch, x, w, bias, res, matmul):
    y = x.double() @ w.double() if matmul else x.double() @ w.double().T + bias.double()
    return torch.nn.functional.gelu(y.half().double()) + res.double()


@pytest.mark.cuda
@pytest.mark.parametrize("matmul", [False, True], ids=["linear", "matmul-kn"])
def test_compiled_block_matches_torch_at_every_size_from_one_build(torch, matmul):
    graph = _block(matmul=matmul)
    compiled = compile_graph(graph, "cuda", tune=False)
    sizes = [(2, 5), (1, 1), (3, 7), (1, 8), (4, 33), (1, 300), (3, 7), (2, 1000)]
    for b, s in sizes:
        x = torch.randn(b, s, K, device="cuda", dtype=torch.float16)
        res = torch.randn(b, s, N, device="cuda", dtype=torch.float16)
        w = torch.randn(*((K, N) if matmul else (N, K)), device="cuda", dtype=torch.float16) / 8
        bias = torch.randn(N, device="cuda", dtype=torch.float16)
        args = [x, res, w] if matmul else [x, res, w, bias]
        (got,) = compiled(*args)
        want = _reference(torch, x, w, bias, res, matmul)
        assert got.shape == (b, s, N) and (got.double() - want).abs().max().item() < 3e-2, (b, s)
    step = next(st for st in compiled.steps if st.kind == "anchor")
    generic = [k for shape, k in step.prepared_by_shape() if shape[0][0] * shape[0][1] > 16]
    assert len(step.prepared()) == len(set(sizes)) and all(k.kernel.kernels[0].endswith("_rows") for k in generic)
    assert len({id(k.kernel) for k in generic}) <= len(LADDER) + 1  # of the schedules the first generic call built


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["tma", "wgmma", "mma"])
def test_each_family_runs_odd_row_counts(torch, family):
    gen = _generic(_block())
    step = gen.plan(heuristic_config(300, N, K, 1, family, "nk")).load()
    w = torch.randn(N, K, device="cuda", dtype=torch.float16) / 8
    bias = torch.randn(N, device="cuda", dtype=torch.float16)
    for b, s in [(1, 1), (3, 7), (2, 129), (1, 300), (5, 1)]:
        x = torch.randn(b, s, K, device="cuda", dtype=torch.float16)
        res = torch.randn(b, s, N, device="cuda", dtype=torch.float16)
        out = torch.empty(b, s, N, device="cuda", dtype=torch.float16)
        step([x, w, bias], out, [res])
        want = _reference(torch, x, w, bias, res, False)
        assert (out.double() - want).abs().max().item() < 3e-2, (family, b, s)


@pytest.mark.cuda
def test_torch_compile_dynamic_lengths_launch_kernels_that_exist(torch, monkeypatch):
    import tessera.frontend.torch  # noqa: F401  (registers the backend)
    from tessera.templates import kernel as template_kernel

    builds = []
    build = template_kernel.build_source
    monkeypatch.setattr(template_kernel, "build_source", lambda *a: builds.append(a) or build(*a))
    torch._dynamo.reset()
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64)).cuda().half()
    fast = torch.compile(mlp, backend="tessera", dynamic=True)
    with torch.no_grad():
        for i, s in enumerate((17, 5, 64, 200, 33, 17, 1000)):
            x = torch.randn(3, s, 64, device="cuda", dtype=torch.float16)
            assert (fast(x).double() - mlp(x).double()).abs().max().item() < 3e-2, s
            if i == 1:
                builds.clear()  # the first lengths built the two GEMMs' kernels
    assert builds == []  # new lengths launched kernels that exist: no compiler, no tuner


@pytest.mark.cuda
def test_native_arrays_take_the_flattened_view():
    from tessera.runtime.cuda import DeviceArray

    a = DeviceArray((3, 7, 64), dtypes.float16)
    assert a.reshape((1, -1, 64)).shape == (1, 21, 64) and a.reshape(21, 64).shape == (21, 64)
    with pytest.raises(ArgumentError, match="cannot reshape"):
        a.reshape((5, -1))
