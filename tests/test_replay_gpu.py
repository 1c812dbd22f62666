"""Every call of a compiled model is checked, on the GPU, where plans replay CUDA graphs: each
test model through both front ends (torch.compile and ONNX) is called 5 times with fresh random
inputs, in float16 and bfloat16, under no_grad and inference_mode; outputs that pass an input
through (Identity, eval dropout, clone) must follow every call, not the captured one."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

import models as M  # noqa: E402

import tessera  # noqa: E402
import tessera.frontend.torch  # noqa: E402,F401  (registers backend="tessera")
from tessera.graph.compiler import compile_graph  # noqa: E402

pytestmark = pytest.mark.cuda

CALLS = 5


def _rel(out, ref):
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


# name -> (model factory, inputs(generator) on cuda in fp32/int64, ONNX dynamic axes or None)
MODELS = {
    "cnn": (lambda: M.randomize_batchnorm(M.SmallCNN()), lambda g: (torch.randn(2, 3, 17, 19, generator=g, device="cuda"),),
            {"x": {0: "batch"}}),
    "resnet18": (lambda: M.randomize_batchnorm(M.ResNet18()),
                 lambda g: (torch.randn(2, 3, 37, 33, generator=g, device="cuda"),), {"x": {0: "batch"}}),
    "bert": (M.BertLayer, lambda g: (torch.randint(0, 50, (2, 11), generator=g, device="cuda"),
                                     (torch.rand(2, 11, generator=g, device="cuda") > 0.2).long()),
             {"ids": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}),
    "gpt2": (M.GPT2Block, lambda g: (torch.randn(2, 13, 40, generator=g, device="cuda"),), {"x": {0: "batch", 1: "seq"}}),
    "llama": (M.LlamaBlock, lambda g: (torch.randn(1, 13, 48, generator=g, device="cuda"),), {"x": {0: "batch", 1: "seq"}}),
    "llama_gqa": (M.LlamaGQABlock, lambda g: (torch.randn(2, 9, 48, generator=g, device="cuda"),), None),
    "tiny_gpt": (lambda: M.TinyGPT(vocab=509, hidden=96, heads=4, layers=2),
                 lambda g: (torch.randint(0, 509, (2, 37), generator=g, device="cuda"),), None),
    "tiny_llama": (lambda: M.TinyLlama(vocab=300, hidden=128, heads=4, kv_heads=2, ffn=344, layers=2),
                   lambda g: (torch.randint(0, 300, (1, 45), generator=g, device="cuda"),), None),
}  # fmt: skip

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {"fp16": 2e-2, "bf16": 6e-2}


def _cast(ins, dtype):
    return [i.to(dtype) if i.is_floating_point() else i for i in ins]


def _export(model, ins, dynamic_axes) -> bytes:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(ins), f, dynamo=False, input_names=list(dynamic_axes),
                          dynamic_axes=dynamic_axes, opset_version=17)  # fmt: skip
    return f.getvalue()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(MODELS))
def test_torch_compile_every_call_fresh_inputs(name, dtype, mode):
    make, inputs, _ = MODELS[name]
    torch.manual_seed(0)
    ref_model = make().eval().cuda()
    model = copy.deepcopy(ref_model).to(DTYPES[dtype])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        for seed in range(CALLS):
            ins = inputs(torch.Generator(device="cuda").manual_seed(seed))
            ref = ref_model(*ins)
            out = compiled(*_cast(ins, DTYPES[dtype]))
            assert out.dtype == DTYPES[dtype] and out.shape == ref.shape
            assert _rel(out, ref) < TOL[dtype], (seed, _rel(out, ref))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", [n for n, m in MODELS.items() if m[2] is not None])
def test_onnx_every_call_fresh_inputs(name, dtype):
    make, inputs, dynamic_axes = MODELS[name]
    torch.manual_seed(0)
    ref_model = make().eval().cuda()
    model = copy.deepcopy(ref_model).to(DTYPES[dtype])
    example = _cast(inputs(torch.Generator(device="cuda").manual_seed(100)), DTYPES[dtype])
    graph = tessera.onnx.load(_export(model, example, dynamic_axes))
    declared = getattr(torch, graph.outputs[0].dtype.name)  # the exporter may declare float32 here
    compiled = compile_graph(graph, "cuda")
    with torch.no_grad():
        for seed in range(CALLS):
            ins = inputs(torch.Generator(device="cuda").manual_seed(seed))
            ref = ref_model(*ins)
            out = compiled(*_cast(ins, DTYPES[dtype]))[0]
            assert out.dtype == declared and out.shape == ref.shape
            assert _rel(out, ref) < TOL[dtype], (seed, _rel(out, ref))
    assert any(p.cuda_graph is not None for p in compiled._plans.values())


def _identity_and_square_onnx(dtype: int) -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", dtype, [4, 64])
    nodes = [helper.make_node("Identity", ["x"], ["same"]), helper.make_node("Mul", ["x", "x"], ["square"])]
    outs = [helper.make_tensor_value_info(n, dtype, [4, 64]) for n in ("same", "square")]
    model = helper.make_model(helper.make_graph(nodes, "passthrough", [x], outs),
                              opset_imports=[helper.make_opsetid("", 17)])  # fmt: skip
    del TensorProto
    return model.SerializeToString()


def test_onnx_identity_output_follows_each_replay():
    """The issue's reproduction: Identity(x) and Mul(x, x), 4 calls with fresh inputs."""
    compiled = compile_graph(tessera.onnx.load(_identity_and_square_onnx(onnx.TensorProto.FLOAT16)), "cuda")
    for seed in range(4):
        x = torch.randn(4, 64, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").half()
        same, square = compiled(x)
        assert torch.equal(same, x)
        assert same.data_ptr() != x.data_ptr()  # callers own what they get
        torch.testing.assert_close(square, x * x)
    assert next(iter(compiled._plans.values())).cuda_graph is not None


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_torch_pass_through_outputs_follow_each_replay(mode):
    torch.manual_seed(0)
    model = M.PassThrough().eval().half().cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        for seed in range(5):
            x = torch.randn(4, 64, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").half()
            dropped, lin, cloned = compiled(x)
            assert torch.equal(dropped, x) and torch.equal(cloned, x)
            assert _rel(lin, model.linear(x).relu()) < 1e-2


def test_inference_mode_then_no_grad_on_the_gpu():
    """Plans made under inference_mode keep working outside it (static buffers are normal tensors)."""
    torch.manual_seed(0)
    model = M.GPT2Block().eval().half().cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    g = torch.Generator(device="cuda").manual_seed(0)
    for context in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with context():
            for _ in range(2):
                x = torch.randn(2, 13, 40, generator=g, device="cuda").half()
                assert _rel(compiled(x), model(x)) < 2e-2


def test_bf16_graph_builder_on_the_gpu():
    """bf16 constants and inputs through the graph compiler directly (anchors on bf16)."""
    from tessera.graph import GraphBuilder

    rng = np.random.default_rng(0)
    b = GraphBuilder("mlp_bf16", device="cuda")
    x = b.input("x", [33, 72], "bfloat16")
    w = rng.standard_normal((136, 72)).astype(np.float32) * 0.1
    b.output(b.op("gelu", b.op("linear", x, b.constant(w, dtype="bfloat16"))))
    compiled = compile_graph(b.build(), "cuda")
    wt = torch.from_numpy(w).cuda()
    for seed in range(CALLS):
        xv = torch.randn(33, 72, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
        out = compiled(xv.bfloat16())[0]
        ref = torch.nn.functional.gelu(xv.bfloat16().float() @ wt.bfloat16().float().T)
        assert out.dtype == torch.bfloat16 and _rel(out, ref) < 2e-2
