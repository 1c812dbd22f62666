"""tessera.onnx: models exported by torch import as FlowGraphs that match torch, with
symbolic batch/sequence sizes; unsupported ops raise a clear error."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

import models as M  # noqa: E402

import tessera  # noqa: E402
from tessera.errors import UnsupportedError  # noqa: E402
from tessera.graph.passes import optimize  # noqa: E402

CASES = {
    "cnn": (lambda: M.randomize_batchnorm(M.SmallCNN()), lambda b, s, g: (torch.randn(b, 3, 17, 19, generator=g),),
            {"x": {0: "batch"}}),
    "resnet18": (lambda: M.randomize_batchnorm(M.ResNet18()),
                 lambda b, s, g: (torch.randn(b, 3, 37, 33, generator=g),), {"x": {0: "batch"}}),
    "bert": (M.BertLayer, lambda b, s, g: (torch.randint(0, 50, (b, s), generator=g),
                                           (torch.rand(b, s, generator=g) > 0.2).long()),
             {"ids": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}),
    "gpt2": (M.GPT2Block, lambda b, s, g: (torch.randn(b, s, 40, generator=g),), {"x": {0: "batch", 1: "seq"}}),
    "llama": (M.LlamaBlock, lambda b, s, g: (torch.randn(b, s, 48, generator=g),), {"x": {0: "batch", 1: "seq"}}),
}  # fmt: skip


def export(model, inputs, dynamic_axes) -> bytes:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, f, dynamo=False, input_names=list(dynamic_axes), dynamic_axes=dynamic_axes,
                          opset_version=17)  # fmt: skip
    return f.getvalue()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_exported_model_matches_torch(name):
    make, inputs, dyn = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    g = torch.Generator().manual_seed(2)
    graph = tessera.onnx.load(export(model, inputs(2, 11, g), dyn))
    assert "batch" in graph.symbols()
    optimize(graph)
    with torch.no_grad():
        for b, s in ((2, 11), (3, 7), (1, 13)):
            ins = inputs(b, s, g)
            ref = model(*ins).numpy()
            out = graph.run(*[i.numpy() for i in ins])[0]
            assert out.shape == ref.shape
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_exported_model_compiles_and_matches_torch(name, cache_dir):
    """The same models through the graph compiler (generated C): every operator compiled,
    three batch/sequence sizes from one build."""
    from tessera.graph.compiler import compile_graph

    make, inputs, dyn = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    g = torch.Generator().manual_seed(3)
    compiled = compile_graph(tessera.onnx.load(export(model, inputs(2, 11, g), dyn)), "cpu")
    assert compiled.summary()["reference_ops"] == []
    with torch.no_grad():
        for b, s in ((2, 11), (3, 7), (1, 13)):
            ins = inputs(b, s, g)
            ref = model(*ins).numpy()
            out = compiled(*[i.numpy() for i in ins])[0]
            assert out.shape == ref.shape
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_unsupported_op_names_op_node_and_opset():
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.UINT8, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, ["h", "w", 3])
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu0"),
             helper.make_node("ImageDecoder", ["r"], ["y"], name="my_decoder")]  # fmt: skip
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 20)])
    with pytest.raises(UnsupportedError, match=r"ImageDecoder \(node 'my_decoder', opset 20\) is not supported"):
        tessera.onnx.load(model)


def test_initializers_are_constants_and_dim_params_symbolic(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(approximate="tanh")).eval()
    path = tmp_path / "m.onnx"
    path.write_bytes(export(model, (torch.randn(3, 4),), {"x": {0: "rows"}}))
    graph = tessera.onnx.load(path)
    assert [str(d) for d in graph.inputs[0].shape] == ["rows", "4"]
    assert {c.shape for c in graph.constants} >= {(6, 4), (6,)}
    x = np.random.default_rng(0).standard_normal((5, 4), dtype=np.float32)
    np.testing.assert_allclose(graph.run(x)[0], model(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)
