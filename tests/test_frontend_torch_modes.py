"""torch.compile(backend="tessera") under the contexts and dtypes users run: torch.inference_mode()
(static and dynamic shapes, models built inside it), bfloat16 modules compiled to kernels (not
left to torch), and pass-through outputs; every call gets fresh inputs and is checked."""

from __future__ import annotations

import copy
import logging

import pytest

torch = pytest.importorskip("torch")

import models as M  # noqa: E402

from tessera.frontend.torch import stats  # noqa: E402

CASES = {
    "cnn": (lambda: M.randomize_batchnorm(M.SmallCNN()), lambda b, g: (torch.randn(b, 3, 17, 19, generator=g),)),
    "bert": (M.BertLayer, lambda b, g: (torch.randint(0, 50, (b, 11), generator=g),
                                        (torch.rand(b, 11, generator=g) > 0.2).long())),
    "gpt2": (M.GPT2Block, lambda b, g: (torch.randn(b, 13, 40, generator=g),)),
}  # fmt: skip


def _rel(out, ref):
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_inference_mode(name, dynamic):
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera", dynamic=dynamic)
    g = torch.Generator().manual_seed(1)
    before = dict(stats)
    with torch.inference_mode():
        for b in (2, 3, 2, 1):
            ins = inputs(b, g)
            assert _rel(compiled(*ins), model(*ins)) < 1e-5
    with torch.no_grad():  # the same compiled model outside inference mode afterwards
        ins = inputs(2, g)
        assert _rel(compiled(*ins), model(*ins)) < 1e-5
    assert stats["kernels"] > before["kernels"]
    assert stats["eager_nodes"] == before["eager_nodes"]
    assert stats["whole_graph_fallbacks"] == before["whole_graph_fallbacks"]


@pytest.mark.slow
def test_model_built_in_inference_mode_sees_in_place_updates(caplog):
    """Parameters made under inference_mode have no version counter: they must still never be
    stale (they are read as graph inputs, which is logged)."""
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode(), caplog.at_level(logging.INFO, logger="tessera"):
        torch.manual_seed(0)
        model = M.GPT2Block().eval()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="tessera")
        for _ in range(3):
            x = torch.randn(2, 13, 40, generator=g)
            assert _rel(compiled(x), model(x)) < 1e-5
            for p in model.parameters():
                p.mul_(1.1)
    assert any("inference tensors" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_bfloat16_module_compiles_to_kernels(name):
    """A bf16 module compiles (constants in bf16, kernels generated) and matches torch's bf16
    result to bf16 precision; the fp32 model is the reference."""
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(bf16, backend="tessera")
    before = dict(stats)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for b in (2, 3, 1):
            ins = inputs(b, g)
            out = compiled(*[i.bfloat16() if i.is_floating_point() else i for i in ins])
            assert out.dtype == torch.bfloat16
            ref = model(*ins)
            eager = bf16(*[i.bfloat16() if i.is_floating_point() else i for i in ins])
            # tessera's error against fp32 is of the order of torch's own bf16 error.
            assert _rel(out, ref) < max(3 * _rel(eager, ref), 2e-2)
    # Compiled, not handed back to torch: segments built into kernels, nothing left to references.
    assert stats["segments"] > before["segments"] and stats["kernels"] > before["kernels"]
    assert stats["eager_nodes"] == before["eager_nodes"]
    assert stats["whole_graph_fallbacks"] == before["whole_graph_fallbacks"]
    assert stats["reference_ops"] == before["reference_ops"]


def test_pass_through_outputs_follow_each_call():
    torch.manual_seed(0)
    model = M.PassThrough().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    with torch.no_grad():
        for seed in range(5):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed))
            for out, ref in zip(compiled(x), model(x)):
                assert torch.equal(out, ref) or _rel(out, ref) < 1e-5
