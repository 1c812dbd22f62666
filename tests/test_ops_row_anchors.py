"""Row anchors (tessera.templates.row.plan): layer norm, RMS norm and softmax on the tuned row kernels
with an elementwise tail fused into their stores, and the graph compiler running them.

CPU tier: plans compile with nvcc (vector and element schedules), bad inputs are refused clearly.
GPU tier: against float64 torch on odd shapes, size-1 rows, several calls with fresh inputs; a
compiled graph with residual add + layer norm + cast runs its norm on a row kernel.
"""

from __future__ import annotations

import shutil

import pytest

from tessera import ops
from tessera.errors import ArgumentError, UnsupportedError
from tessera.templates import Epilogue, EpilogueError
from tessera.templates.row import ROW
from tessera.templates.row.plan import plan_row, prepare_row

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def cast_ep(shape, dtype, out="float32", scale=None):
    acc = ops.placeholder(shape, dtype, "acc")
    value = ops.mul(acc, scale) if scale is not None else acc
    return Epilogue(acc, ops.cast(value, out), [])


@needs_nvcc
@pytest.mark.parametrize("op,shape,dtype", [("layer_norm", (2, 64, 768), "float16"), ("rms_norm", (512, 2048), "bfloat16"),
                                            ("softmax", (12, 128, 128), "float16"), ("softmax", (3, 50257), "float32"),
                                            ("layer_norm", (5, 33), "float16")])  # fmt: skip
def test_row_plans_compile_with_the_epilogue_in_their_stores(op, shape, dtype):
    plan = plan_row(op, shape, dtype, eps=1e-6, epilogue=cast_ep(shape, dtype))
    assert plan.out_shape == shape and plan.out_dtype.name == "float32" and len(plan.launches) == 1
    vector = shape[-1] * (4 if dtype == "float32" else 2) % 16 == 0
    assert plan.aligned_output == vector
    assert ("ts_copy_vector<16>((&y_[" in plan.source) == vector  # 8 float32 results: two 16-byte stores
    assert plan.build("sm_90a").endswith(".cubin")


def test_row_plans_refuse_what_they_cannot_run():
    with pytest.raises(UnsupportedError, match="float16, bfloat16 or float32"):
        plan_row("softmax", (4, 8), "int32")
    with pytest.raises(UnsupportedError, match="no row kernel"):
        plan_row("log_softmax", (4, 8), "float16")
    with pytest.raises(ArgumentError, match="positive sizes"):
        plan_row("softmax", (4, 0), "float16")
    with pytest.raises(EpilogueError, match="acc has shape"):
        plan_row("softmax", (4, 8), "float16", epilogue=cast_ep((4, 9), "float16"))


def test_which_graph_norms_are_row_anchors():
    from tessera.graph.builder import GraphBuilder

    b = GraphBuilder()
    x = b.input("x", (4, 8), "float16")
    w, bias = b.input("w", (8,), "float16"), b.input("b", (8,), "float16")
    w32 = b.input("w32", (8,), "float32")
    cases = {
        "ln": (b.op("layer_norm", x, w, bias, eps=1e-5), True),
        "ln_no_affine": (b.op("layer_norm", x), False),  # the kernel takes a weight and a bias
        "rms": (b.op("rms_norm", x, w), True),
        "rms_mixed": (b.op("rms_norm", x, w32), False),  # parameters of another dtype
        "softmax_last": (b.op("softmax", x, axis=-1), True),
        "softmax_first": (b.op("softmax", x, axis=0), False),
    }
    for name, (t, expected) in cases.items():
        reason = ROW.refuse(t.producer)
        assert (reason is None) == expected, (name, reason)


# ---- GPU ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _ref(torch, op, x, params, eps):
    F = torch.nn.functional
    xd = x.double()
    if op == "layer_norm":
        return F.layer_norm(xd, xd.shape[-1:], params[0].double(), params[1].double(), eps)
    if op == "rms_norm":
        return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * params[0].double()
    return torch.softmax(xd, -1)


@pytest.mark.cuda
@pytest.mark.parametrize("op,shape,dtype", [("layer_norm", (2, 63, 768), "float16"), ("rms_norm", (3, 2048), "bfloat16"),
                                            ("softmax", (12, 1, 129), "float16"), ("softmax", (7, 4096), "float32"),
                                            ("layer_norm", (1, 33), "float32"), ("rms_norm", (5, 1), "float16")])  # fmt: skip
def test_row_anchor_matches_torch(torch, op, shape, dtype):
    tdt = getattr(torch, dtype)
    eps = 1e-5
    kernel = prepare_row(op, shape, dtype, eps=eps, epilogue=cast_ep(shape, dtype, "float32", 2.0))
    n_params = {"layer_norm": 2, "rms_norm": 1, "softmax": 0}[op]
    for _ in range(2):  # fresh inputs each call
        x = (torch.randn(shape, dtype=torch.float64, device="cuda") * 3 + 1).to(tdt)
        params = [torch.randn(shape[-1:], dtype=torch.float64, device="cuda").to(tdt) for _ in range(n_params)]
        out = torch.full(shape, float("nan"), dtype=torch.float32, device="cuda")
        kernel([x, *params], out)
        torch.cuda.synchronize()
        ref = _ref(torch, op, x, params, eps).to(tdt).double() * 2  # rounded to dtype, then the epilogue
        tol = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}[dtype]
        err = (out.double() - ref).abs().max().item()
        assert err <= tol * (1 + ref.abs().max().item()), f"max error {err}"


@pytest.mark.cuda
def test_compiled_graph_runs_norms_on_row_kernels(torch):
    from tessera.graph.builder import GraphBuilder
    from tessera.graph.compiler import compile_graph

    b = GraphBuilder("norms", device="cuda")
    x, r = b.input("x", (2, 37, 768), "float16"), b.input("r", (2, 37, 768), "float16")
    w, bias = b.input("w", (768,), "float16"), b.input("b", (768,), "float16")
    h = b.op("add", x, r)
    y = b.op("cast", b.op("layer_norm", h, w, bias, eps=1e-5), dtype="float32")
    s = b.op("softmax", b.op("mul", y, b.constant(0.5, dtype="float32")), axis=-1)
    b.output(y)
    b.output(s)
    compiled = compile_graph(b.build(), "cuda", tune=False)
    kinds = [getattr(step, "group", None) for step in compiled.steps]
    anchors = [g.anchor.kind for g in kinds if g is not None and g.kind == "anchor"]
    assert anchors == ["layer_norm", "softmax"], anchors  # the cast is the norm's epilogue
    F = torch.nn.functional
    for _ in range(2):
        args = [torch.randn(2, 37, 768, device="cuda", dtype=torch.float16) for _ in range(2)]
        args += [torch.randn(768, device="cuda", dtype=torch.float16) for _ in range(2)]
        outs = compiled(*args)
        ref = F.layer_norm((args[0] + args[1]).double(), (768,), args[2].double(), args[3].double(), 1e-5)
        assert (outs[0].double() - ref).abs().max().item() < 2e-2
        assert (outs[1].double() - torch.softmax(outs[0].double() * 0.5, -1)).abs().max().item() < 1e-4
