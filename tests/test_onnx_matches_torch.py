"""ONNX exports of transformers models optimise to the same graph as the torch front end's.

The graph passes (fuse_attention, fuse_gelu, fold_linear_bias, drop_reshapes) turn what the
exporters write out (attention as matmul / scale / mask / softmax / matmul, GELU as erf or
tanh chains, MatMul + Add, flatten pairs around GEMMs) into the operators the torch path
gets, so both compile to the same kernels (bench/onnx_gpu.py checks it at real sizes on the
GPU).  CPU tier: tiny BERT and GPT-2 with transformers' eager attention; the GPU partition
is computed without a GPU (partition + is_anchor(op, "cuda")).  GPU tier: the same models in
float16, compiled both ways, with equal kernel lists and results.
"""

from __future__ import annotations

import collections
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402

import tessera  # noqa: E402
from tessera.graph.compiler.partition import partition_for  # noqa: E402
from tessera.graph.lowering import lowering_error  # noqa: E402
from tessera.graph.passes import optimize  # noqa: E402


class _Eager(torch.nn.Module):
    """The model on transformers' eager attention, called with (input_ids, attention_mask)."""

    def __init__(self, name: str):
        super().__init__()
        torch.manual_seed(0)
        self.model, _ = zoo.hf_model(name)
        self.model.config._attn_implementation = "eager"
        self.model.eval()

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _export(model, inputs) -> bytes:
    f = io.BytesIO()
    torch.onnx.export(model, inputs, f, input_names=["ids", "mask"], output_names=["out"], opset_version=17,
                      dynamo=False)  # fmt: skip
    return f.getvalue()


def _torch_graphs(model, inputs):
    from tessera.frontend.torch.backend import backend

    collected = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, ex: backend(gm, ex, collect=collected,
                                                                   options={"executor": "reference"}))  # fmt: skip
    compiled(*inputs)
    torch._dynamo.reset()
    return [s.graph for cg in collected for s in cg.steps if getattr(s, "graph", None) is not None]


def _gpu_steps(graphs):
    """(steps by kind, anchors by operator kind) of the graphs partitioned for the GPU."""
    steps, anchors = collections.Counter(), collections.Counter()
    for g in graphs:
        for group in partition_for(g, "cuda", lowering_error):
            steps[group.kind] += 1
            if group.kind == "anchor":
                anchors[" ".join(op.kind for op in group.ops)] += 1
    return steps, anchors


def _inputs(model, batch, seq, seed, padded):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.model.config.vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        mask[0, -3:] = 0
    return ids, mask


@pytest.mark.parametrize("name", ["bert", "gpt2"])
@pytest.mark.slow
def test_onnx_graph_partitions_like_the_torch_graph(name):
    model = _Eager(name).half()
    inputs = _inputs(model, 1, 13, 0, padded=False)
    with torch.no_grad():
        torch_steps = _gpu_steps(_torch_graphs(model, inputs))
        graph = optimize(tessera.onnx.load(_export(model, inputs)))
    onnx_steps = _gpu_steps([graph])
    kinds = graph.summary()
    layers = model.model.config.num_hidden_layers
    assert kinds.get("scaled_dot_product_attention") == layers and kinds.get("gelu") == layers
    assert "softmax" not in kinds and "matmul" not in kinds and "erf" not in kinds and "tanh" not in kinds
    assert onnx_steps == torch_steps, f"ONNX {onnx_steps} != torch {torch_steps}"


class _FixedMask(torch.nn.Module):
    """The eager model with a fixed padding mask (the first sequence's last 3 tokens hidden):
    the export folds the mask into a constant additive mask."""

    def __init__(self, name: str, batch: int, seq: int):
        super().__init__()
        self.inner = _Eager(name)
        self.register_buffer("mask", _inputs(self.inner, batch, seq, 0, padded=True)[1])

    def forward(self, input_ids):
        return self.inner(input_ids, self.mask)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
@pytest.mark.slow
def test_onnx_with_a_padding_mask_matches_eager(name):
    """Through the rewritten attention (scale and padding mask) the compiled ONNX model gives
    eager's results.  (The mask is fixed: with the mask as a graph input, the TorchScript
    exporter's graph of transformers' mask code gives wrong results before any pass runs.)"""
    model = _FixedMask(name, 2, 7).eval()
    with torch.no_grad():
        f = io.BytesIO()
        ids = _inputs(model.inner, 2, 7, 0, padded=True)[0]
        torch.onnx.export(model, (ids,), f, input_names=["ids"], output_names=["out"], opset_version=17, dynamo=False)
        compiled = tessera.onnx.compile(f.getvalue(), "cpu", tune=False)
        for seed in (1, 2):
            ids = _inputs(model.inner, 2, 7, seed, padded=True)[0]
            want = model(ids).numpy()
            got = np.asarray(compiled(ids.numpy())[0])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        graph = compiled.latest.graph
    assert graph.summary().get("scaled_dot_product_attention") == model.inner.model.config.num_hidden_layers


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_onnx_native_and_torch_paths_run_the_same_kernels_cuda(name):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from onnx_gpu import kernel_counts

    import tessera.frontend.torch  # noqa: F401

    model = _Eager(name).half().cuda()
    ids, mask = (t.cuda() for t in _inputs(model, 1, 64, 0, padded=False))
    with torch.no_grad():
        want = model.float()(ids, mask)
        model.half()
        torch._dynamo.reset()
        via_torch = torch.compile(model, backend="tessera")
        out_torch = via_torch(ids, mask)
        torch_counts = kernel_counts(tessera.explain(via_torch))
        torch._dynamo.reset()
        via_onnx = tessera.onnx.compile(_export(model.cpu(), (ids.cpu(), mask.cpu())), "cuda", arrays="native")
        outs = [torch.from_dlpack(via_onnx(ids, mask)[0]) for _ in range(3)]  # the third call replays
    scale = want.abs().max().item()
    for out in (out_torch, *outs):
        assert (out.float() - want).abs().max().item() <= 2e-2 * scale
    counts = kernel_counts(tessera.explain(via_onnx))
    assert counts["anchors"].get("scaled_dot_product_attention") == model.model.config.num_hidden_layers
    assert counts == torch_counts
