"""The graph compiler on the GPU: fp16 models through torch.compile(backend="tessera") with
anchors on the GEMM templates, fused epilogues and CUDA-graph replay, against torch in fp32."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import models as M  # noqa: E402

import tessera.frontend.torch  # noqa: E402,F401  (registers backend="tessera")
from tessera.graph import GraphBuilder  # noqa: E402
from tessera.graph.compiler import compile_graph  # noqa: E402

pytestmark = pytest.mark.cuda


def _rel(out, ref):
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _compare(model, make_inputs, tol=2e-2):
    """Compiled fp16 model vs fp32 torch on two different inputs (the second one replays)."""
    torch.manual_seed(0)
    ref_model = model.eval().float().cuda()
    half = copy.deepcopy(ref_model).half()
    torch._dynamo.reset()
    compiled = torch.compile(half, backend="tessera")
    with torch.no_grad():
        for seed in (1, 2, 3):
            ins = make_inputs(torch.Generator(device="cuda").manual_seed(seed))
            ref = ref_model(*[i.float() if i.is_floating_point() else i for i in ins])
            out = compiled(*[i.half() if i.is_floating_point() else i for i in ins])
            assert out.shape == ref.shape
            assert _rel(out, ref) < tol, (seed, _rel(out, ref))


def test_tiny_gpt_fp16():
    _compare(M.TinyGPT(vocab=509, hidden=96, heads=4, layers=2),
             lambda g: (torch.randint(0, 509, (2, 37), generator=g, device="cuda"),))  # fmt: skip


def test_tiny_llama_fp16():
    _compare(M.TinyLlama(vocab=300, hidden=128, heads=4, kv_heads=2, ffn=344, layers=2),
             lambda g: (torch.randint(0, 300, (1, 45), generator=g, device="cuda"),))  # fmt: skip


def test_resnet18_fp16():
    _compare(M.randomize_batchnorm(M.ResNet18()), lambda g: (torch.randn(2, 3, 37, 33, generator=g, device="cuda"),))


def test_linear_epilogue_is_fused_and_graph_replays():
    rng = np.random.default_rng(0)
    b = GraphBuilder("mlp", device="cuda")
    x = b.input("x", [33, 72], "float16")
    w = b.constant(rng.standard_normal((136, 72)).astype(np.float16) * 0.1)
    bias = b.constant(rng.standard_normal(136).astype(np.float16))
    h = b.op("gelu", b.op("linear", x, w, bias))
    b.output(b.op("add", h, b.op("linear", x, b.constant(rng.standard_normal((136, 72)).astype(np.float16) * 0.1))))
    g = b.build()
    compiled = compile_graph(g, "cuda")
    assert compiled.summary()["fused_ops"] >= 1
    for seed in range(3):
        xv = np.random.default_rng(seed).standard_normal((33, 72)).astype(np.float16)
        expected = g.run(xv)[0].astype(np.float32)
        out = compiled(torch.from_numpy(xv).cuda())[0].float().cpu().numpy()
        assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-2
    assert next(iter(compiled._plans.values())).cuda_graph is not None


def test_rank0_output_of_a_reference_step_on_the_gpu():
    """A host-computed (reference) step writing a rank-0 output into its GPU buffer (det of
    matrices of a symbolic size has no kernel): the copy keeps the shape, on every call."""
    b = GraphBuilder("det", device="cuda")
    x = b.input("x", ["n", "n"], "float32")
    b.output(b.op("det", x))
    compiled = compile_graph(b.build(), "cuda")
    for seed in range(3):
        a = np.random.default_rng(seed).standard_normal((3, 3)).astype(np.float32)
        out = compiled(torch.from_numpy(a).cuda())[0]
        assert out.shape == () and abs(float(out) - np.linalg.det(a.astype(np.float64))) < 1e-4


def test_sdpa_runs_the_flash_kernel():
    """A graph's scaled_dot_product_attention (grouped heads, causal, head dim 64) runs the fused
    flash kernel on an SM90 GPU, against the graph's reference on fresh inputs; and an SDPA
    module through torch.compile matches torch."""
    from tessera.templates.attention.plan import FlashAnchorKernel

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernel needs an SM90 GPU")
    b = GraphBuilder("sdpa", device="cuda")
    q, k, v = b.input("q", [2, 8, 77, 64], "float16"), b.input("k", [2, 2, 77, 64], "float16"), b.input("v", [2, 2, 77, 64], "float16")
    b.output(b.op("scaled_dot_product_attention", q, k, v, causal=True))
    g = b.build()
    compiled = compile_graph(g, "cuda")
    rng = np.random.default_rng(0)
    for _ in range(2):
        ins = [rng.standard_normal(s).astype(np.float16) for s in ((2, 8, 77, 64), (2, 2, 77, 64), (2, 2, 77, 64))]
        expected = g.run(*ins)[0].astype(np.float32)
        out = compiled(*[torch.from_numpy(x).cuda() for x in ins])[0].float().cpu().numpy()
        assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-2
    kernels = [r.kernel for s in compiled.steps if s.kind == "anchor" for r in s.prepared()]
    assert kernels and all(isinstance(kr, FlashAnchorKernel) for kr in kernels)

    class Attn(torch.nn.Module):
        def forward(self, x, y):
            return torch.nn.functional.scaled_dot_product_attention(x, y, y, is_causal=True) * 2

    torch._dynamo.reset()
    fn = torch.compile(Attn(), backend="tessera")
    for seed in range(2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(1, 4, 130, 128, generator=gen, device="cuda").half()
        y = torch.randn(1, 4, 130, 128, generator=gen, device="cuda").half()
        ref = Attn()(x.float(), y.float())
        assert _rel(fn(x, y), ref) < 1e-2


def test_equal_layers_share_loaded_kernels_with_workspaces_of_their_own():
    """Two linear+relu layers of one structure and shape (small M, long K: split-K, whose
    partial sums need a workspace) run one plan's loaded kernels, each step with workspaces of
    its own; a second compile of the graph in the process reuses them; results stay right over
    fresh inputs."""
    rng = np.random.default_rng(4)
    b = GraphBuilder("two_layers", device="cuda")
    outs = []
    for name in ("x1", "x2"):  # two inputs: linears of one input would merge into one (merge_qkv)
        w = b.constant((rng.standard_normal((512, 4096)) * 0.02).astype(np.float16))
        outs.append(b.op("relu", b.op("linear", b.input(name, [3, 4096], "float16"), w)))
    b.output(*outs)
    g = b.build()
    runs = []
    for _ in range(2):  # the second compile: a recompile in the same process
        compiled = compile_graph(g, "cuda")
        for seed in range(3):
            gen = np.random.default_rng(seed)
            xs = [gen.standard_normal((3, 4096)).astype(np.float16) for _ in range(2)]
            for expected, out in zip(g.run(*xs), compiled(*[torch.from_numpy(x).cuda() for x in xs])):
                expected = expected.astype(np.float32)
                assert np.abs(out.float().cpu().numpy() - expected).max() / np.abs(expected).max() < 1e-2, seed
        runs.append([r.kernel for s in compiled.steps if s.kind == "anchor" for r in s.prepared()])
    kernels = [k for run in runs for k in run]
    assert len(kernels) == 4 and all(k.plan is kernels[0].plan for k in kernels)
    loaded = [[fn for fn, _ in k._steps] for k in kernels]
    assert all(all(a is b for a, b in zip(loaded[0], other)) for other in loaded[1:])
    workspaces = [id(w) for k in kernels for w in k.workspaces]
    assert len(workspaces) >= 4 and len(workspaces) == len(set(workspaces))
