"""torch.compile(model, backend="tessera", options={...}) and mode=: validated, applied; and
tessera.explain of a torch.compile'd model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import tessera  # noqa: E402
import tessera.frontend.torch  # noqa: E402,F401  (registers backend="tessera")
from tessera.errors import ArgumentError  # noqa: E402
from tessera.graph.compiler.options import CompileOptions, parse_options  # noqa: E402


class Mlp(torch.nn.Module):
    def __init__(self, split: bool = False):
        super().__init__()
        self.a, self.b, self.split = torch.nn.Linear(11, 19), torch.nn.Linear(19, 5), split

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        if self.split:
            torch._dynamo.graph_break()  # two FX graphs for one compiled module
        return torch.softmax(self.b(h), -1)


def _cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
        if isinstance(exc, ArgumentError):
            break
    return exc


def test_parse_options_validates_names_types_and_modes():
    assert parse_options(None) == CompileOptions()
    assert parse_options({"tune": False, "progress": False}) == CompileOptions(tune=False, progress=False)
    assert parse_options(None, mode="max-autotune").tune and parse_options(None, mode="reduce-overhead").cuda_graph
    assert not parse_options({"tune": False}, mode="reduce-overhead").tune
    assert not parse_options(None, mode="max-autotune-no-cudagraphs").cuda_graph
    with pytest.raises(ArgumentError, match=r"unknown option 'cuda_graphs'.*\n  tune:"):
        parse_options({"cuda_graphs": False})
    with pytest.raises(ArgumentError, match="option 'tune' must be bool, got 'yes'"):
        parse_options({"tune": "yes"})
    with pytest.raises(ArgumentError, match="'executor' must be one of"):
        parse_options({"executor": "fast"})
    with pytest.raises(ArgumentError, match="unknown mode 'turbo'"):
        parse_options(None, mode="turbo")
    with pytest.raises(ArgumentError, match="must be a dict"):
        parse_options(["tune"])


@pytest.mark.slow
def test_torch_compile_options_reach_the_compiler_and_explain_reports_them():
    torch.manual_seed(0)
    model = Mlp().eval()
    x = torch.randn(3, 11)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera", options={"cuda_graph": False, "progress": False})
    assert "no graph compiled yet" in str(tessera.explain(compiled))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    report = tessera.explain(compiled)
    (graph,) = report.graphs
    assert graph.options == {"tune": False, "cuda_graph": False} and graph.num_kernels >= 1  # tune: $TESSERA_TUNE=0
    assert {"gelu", "softmax"} <= {op.split(" ")[0] for k in graph.kernels for op in k.ops}
    assert graph.plans and graph.plans[0].sizes == {}
    # The reference executor: the same answers, no kernels, said so in the report.
    ref = torch.compile(model, backend="tessera", options={"executor": "reference"})
    with torch.no_grad():
        torch.testing.assert_close(ref(x), model(x), rtol=1e-5, atol=1e-6)
    ref_report = tessera.explain(ref)
    assert ref_report.graphs == [] and any("executor='reference'" in n for n in ref_report.notes)
    assert len(tessera.explain(compiled).graphs) == 1  # each compiled model reports its own graphs


def test_unknown_option_is_a_clear_error():
    torch._dynamo.reset()
    compiled = torch.compile(Mlp().eval(), backend="tessera", options={"tunes": True})
    with pytest.raises(Exception) as info, torch.no_grad():
        compiled(torch.randn(2, 11))
    cause = _cause(info.value)
    assert isinstance(cause, ArgumentError) and "unknown option 'tunes'" in str(cause) and "tune:" in str(cause)


@pytest.mark.slow
def test_explain_lists_every_graph_of_a_model_with_graph_breaks():
    torch.manual_seed(1)
    model = Mlp(split=True).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tessera")
    x = torch.randn(4, 11)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    report = tessera.explain(compiled)
    assert len(report.graphs) == 2 and str(report).startswith('torch.compile(backend="tessera") of Mlp: 2 graphs')
    ops = [op.split(" ")[0] for g in report.graphs for k in g.kernels for op in k.ops]
    assert "gelu" in ops and "softmax" in ops
    assert len(tessera.frontend.torch.compiled_graphs()) >= 2


def test_tuning_is_on_by_default_unless_the_environment_says_off(monkeypatch):
    monkeypatch.delenv("TESSERA_TUNE", raising=False)
    assert CompileOptions().tune and parse_options(None).tune
    monkeypatch.setenv("TESSERA_TUNE", "off")
    assert not CompileOptions().tune and parse_options({"tune": True}).tune  # an explicit option wins
    monkeypatch.setenv("TESSERA_TUNE", "sometimes")
    with pytest.raises(ArgumentError, match=r"\$TESSERA_TUNE='sometimes': use 1/on"):
        CompileOptions()
