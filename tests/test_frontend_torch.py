"""torch.compile(backend="tessera"): the test models match torch, dynamic batch needs no
rebuild, an ATen op without a lowering runs in torch inside the compiled graph with a logged
reason."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

import models as M  # noqa: E402

from tessera.frontend.torch import stats  # noqa: E402

CASES = {
    "cnn": (lambda: M.randomize_batchnorm(M.SmallCNN()), lambda b, g: (torch.randn(b, 3, 17, 19, generator=g),)),
    "resnet18": (lambda: M.randomize_batchnorm(M.ResNet18()), lambda b, g: (torch.randn(b, 3, 37, 33, generator=g),)),
    "bert": (M.BertLayer, lambda b, g: (torch.randint(0, 50, (b, 11), generator=g),
                                        (torch.rand(b, 11, generator=g) > 0.2).long())),
    "gpt2": (M.GPT2Block, lambda b, g: (torch.randn(b, 13, 40, generator=g),)),
    "llama": (M.LlamaBlock, lambda b, g: (torch.randn(b, 13, 48, generator=g),)),
    "llama_gqa": (M.LlamaGQABlock, lambda b, g: (torch.randn(b, 9, 48, generator=g),)),
}  # fmt: skip


def _check(out, ref, rtol=1e-5):
    # (a ReLU output can be all zeros for some random inputs: then 0 / 0 without the floor)
    err = float((out - ref).abs().max() / max(float(ref.abs().max()), 1e-3))
    assert err < rtol, err


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_model_matches_torch_with_dynamic_batch(name):
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    g = torch.Generator().manual_seed(1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera", dynamic=True)
    before = dict(stats)
    with torch.no_grad():
        for b in (2, 3, 5):
            ins = inputs(b, g)
            _check(compiled(*ins), model(*ins))
    # One FX graph, built once, fully translated: new batch sizes reuse it.
    assert stats["graphs"] - before["graphs"] == 1
    assert stats["builds"] - before["builds"] == 1
    assert stats["eager_nodes"] == before["eager_nodes"]
    assert stats["whole_graph_fallbacks"] == before["whole_graph_fallbacks"]
    # Compiled to generated kernels: nothing left to the numpy references.
    assert stats["kernels"] > before["kernels"]
    assert stats["reference_ops"] == before["reference_ops"]


class WithSort(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.a(x))
        y = torch.sort(y, dim=-1).values  # aten.sort has no tessera lowering
        return torch.tanh(self.b(y * 2.0))


@pytest.mark.slow
def test_op_without_lowering_runs_in_torch_with_logged_reason(caplog):
    torch.manual_seed(0)
    model = WithSort().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    before = dict(stats)
    x = torch.randn(4, 6)
    with caplog.at_level(logging.WARNING, logger="tessera"), torch.no_grad():
        out = compiled(x)
        _check(out, model(x))
    assert [r.getMessage() for r in caplog.records if "runs in torch" in r.getMessage()] == [
        "tessera: aten.sort.default runs in torch: aten.sort.default has no tessera lowering"]
    assert stats["graphs"] - before["graphs"] == 1  # no graph break: one dynamo graph
    assert stats["eager_nodes"] - before["eager_nodes"] >= 1
    assert stats["segments"] - before["segments"] == 2  # the linear layers before and after


@pytest.mark.parametrize("bias", [True, False])  # two folded tensors, and one
@pytest.mark.slow
def test_changed_weights_are_not_ignored(bias):
    model = torch.nn.Sequential(torch.nn.Linear(5, 3, bias=bias), torch.nn.ReLU()).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(2, 5)
            _check(compiled(x), model(x))
            if step == 1:
                model[0].weight.mul_(-2.0)  # in place: same tensor, new version
            _check(compiled(x), model(x))


def test_autograd_runs_in_torch():
    model = torch.nn.Linear(4, 3)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    x = torch.randn(2, 4)
    out = compiled(x)
    out.sum().backward()
    assert model.weight.grad is not None


class DataDependent(torch.nn.Module):
    def forward(self, x):
        y = torch.tanh(x) * 2
        idx = torch.nonzero(y > 0)  # output shape from the data
        z = y[y > 0.5]  # boolean-mask indexing
        flag = (y.sum() > 0).item()  # a Python value steering control flow
        return (idx.float().sum() + z.sum() + (1.0 if flag else -1.0)) * y.mean()


@pytest.mark.slow
def test_graph_breaks_only_for_data_dependent_shapes_logged_once(caplog):
    from torch._dynamo.utils import counters

    from tessera.frontend.torch.backend import _logged

    counters["graph_break"].clear(), _logged.clear()  # "once" is per process: forget earlier tests' breaks
    torch._dynamo.reset()
    compiled = torch.compile(DataDependent(), backend="tessera")
    g = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="tessera"), torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 7, generator=g)
            _check(compiled(x), DataDependent()(x))
    breaks = [r.getMessage() for r in caplog.records if "graph break" in r.getMessage()]
    assert len(breaks) == len(set(breaks)) >= 2  # each reason once, however many calls and recompiles
    assert any("nonzero" in b for b in breaks) and any("item()" in b for b in breaks)
    assert not [r for r in caplog.records if "runs in torch" in r.getMessage()]


def _graphs(model, *inputs):
    from tessera.frontend.torch import backend

    collected = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, ex: backend(gm, ex, collect=collected))
    with torch.no_grad():
        _check(compiled(*inputs), model(*inputs))
    return [g for cg in collected for g in cg.graphs]


@pytest.mark.slow
def test_graph_passes_apply_to_the_aten_graph():
    """The ATen graph keeps the operators the passes and anchors expect: batch norm folds into the
    convolution, the q/k/v projections (permute + mm in ATen) merge into one wide linear, and the
    attention stays one operator."""
    torch.manual_seed(0)
    (cnn,) = _graphs(M.randomize_batchnorm(M.SmallCNN()).eval(), torch.randn(2, 3, 17, 19))
    kinds = [op.kind for op in cnn.operators]
    assert "conv2d" in kinds and "batch_norm" not in kinds, kinds
    (llama,) = _graphs(M.LlamaBlock().eval(), torch.randn(2, 13, 48))
    kinds = [op.kind for op in llama.operators]
    linears = [op for op in llama.operators if op.kind == "linear"]
    assert kinds.count("scaled_dot_product_attention") == 1 and "matmul" not in kinds, kinds
    assert any(op.outputs[0].shape[-1] == 48 + 2 * 16 for op in linears), [op.outputs[0].shape for op in linears]
    assert all(op.inputs[0].ndim == 3 for op in linears)  # on the [batch, seq, hidden] input, not a 2-D view


@pytest.mark.slow
def test_options_reach_the_backend_and_outputs_are_fresh():
    """torch.compile(..., options={...}) arrives nested under "options"; every call returns new tensors."""
    collected = []
    model = M.GPT2Block().eval()
    torch._dynamo.reset()
    reference = torch.compile(model, backend="tessera", options={"executor": "reference", "collect": collected})
    x = torch.randn(2, 13, 40)
    with torch.no_grad():
        _check(reference(x), model(x))
    assert len(collected) == 1 and type(collected[0].steps[0].executor).__name__ == "Executor"
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    with torch.no_grad():
        first = compiled(x)
        kept = first.clone()
        second = compiled(torch.randn(2, 13, 40))
    assert torch.equal(first, kept) and first.data_ptr() != second.data_ptr()


def test_python_scalars_become_constants_of_their_own_kind():
    """A bool, int or float reaching the converter without a dtype keeps its kind (bool was an
    AttributeError: the dtype's name was wrong)."""
    import numpy as np

    from tessera.frontend.torch.convert import Converter
    from tessera.ir import dtypes

    cv = Converter()
    for value, dtype in ((True, dtypes.boolean), (3, dtypes.int64), (2.5, dtypes.float32)):
        t = cv.tensor(value)
        assert t.dtype == dtype and t.is_constant and np.asarray(t.data).item() == value
