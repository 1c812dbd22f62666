"""Predication of data-dependent branches (tessera/frontend/torch/predication.py): a pure branch
on a tensor's value becomes a select, dynamo traces one graph, and results stay the same."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from tessera.frontend.torch.predication import predicate, select  # noqa: E402


def _graphs(module, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(module)(*args).graph_count


class Clamped(torch.nn.Module):
    """The fp16 overflow guard of BART-style layers, inside a loop and beside a branch on Python values."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, steps: int = 2):
        h = self.lin(x)
        for _ in range(steps):
            h = h * 2
            if h.dtype == torch.float16 and not torch.isfinite(h).all():
                limit = torch.finfo(h.dtype).max - 1000
                h = torch.clamp(h, min=-limit, max=limit)
        if steps > 1:  # a branch on Python values stays as it is
            h = h + 1
        return h


def _inputs(dtype, overflow):
    x = torch.randn(3, 5, 8, dtype=dtype)
    if overflow:
        x[1, 2] = 6e4  # fp16 overflows to inf after the doubling
    return x


@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflowing"])
def test_a_pure_guard_is_predicated_with_the_same_results_and_one_graph(overflow):
    torch.manual_seed(0)
    model = Clamped().half()
    x = _inputs(torch.float16, overflow)
    with torch.no_grad():
        want = model(x)
        # dynamo breaks at the branch (inside a loop it may give up on the whole forward: no graph)
        assert _graphs(model, x) != 1
        report = predicate(model)
        assert [r[2] for r in report.rewritten] == ["predicated (h selected)"] and report.modules == 1
        for _ in range(2):
            got = model(x)
            assert torch.equal(got, want)  # bitwise: the select keeps every element as the branch had it
        assert _graphs(model, x) == 1
    # the guard clamped exactly when something overflowed (to finfo.max - 1000, plus the 1 after the loop)
    assert bool(torch.isfinite(want).all()) and bool(want.abs().max() > 6e4) == overflow


def test_the_select_on_host_values_keeps_the_branch_semantics():
    assert select(True, 1.0, 2.0) == 1.0 and select(torch.tensor(False), 1.0, 2.0) == 2.0
    a, b = torch.ones(3), torch.zeros(3)
    assert torch.equal(select(torch.tensor(True), a, b), a) and torch.equal(select(torch.tensor(False), a, b), b)


class Unsafe(torch.nn.Module):
    """Branches that must stay branches, each for its own reason."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        if x.isnan().any():
            self.calls = self.calls + 1  # an attribute store: a side effect
        if x.isinf().any():
            y = x * 0  # read after the branch but unbound before it
        else:
            y = x
        if (x > 100).any():
            x = x + torch.randn_like(x)  # not a known pure call (it draws random numbers)
        if x.isinf().any() and x.dtype == torch.float32:
            x = x.clamp(-1, 1)  # the Python condition would run whatever the tensor one says
        if (x < -100).any():
            z = x + 1  # read after the branch, never bound before it
        return x + y + (z if (x < -100).any() else 0)


def test_unsafe_branches_are_declined_with_reasons():
    model = Unsafe()
    report = predicate(model)
    reasons = " | ".join(r[2] for r in report.declined)
    assert report.rewritten == [] and report.modules == 0 and "forward" not in vars(model)
    assert "more than assign names" in reasons and "else branch" in reasons and "not known to be pure" in reasons
    assert "Python condition follows" in reasons and "['z'] is read after it" in reasons
    lines = open(__file__).read().splitlines()
    assert "self.calls = self.calls + 1" in lines[int(reasons.split("(line ")[1].split(")")[0]) - 1]
    assert "predication: 0 branch(es) rewritten" in str(report)


def _decorated(forward):
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs) * 1.0

    return wrapper


class Base(torch.nn.Module):
    def forward(self, x):
        return x + 1


class Decorated(Base):
    """A decorated forward (as transformers wraps its layers' forwards) that calls super()."""

    @_decorated
    def forward(self, x):
        x = super().forward(x)
        if torch.isinf(x).any():
            x = torch.nan_to_num(x, posinf=7.0)
        return x


def test_a_decorated_forward_is_rebuilt_around_the_rewritten_function_for_this_model_only():
    model, other = Decorated(), Decorated()
    x = torch.tensor([1.0, float("inf"), -2.0])
    want = model(x)
    report = predicate(model)
    assert len(report.rewritten) == 1 and report.rewritten[0][0] == "Decorated.forward"
    assert torch.equal(model(x), want) and torch.equal(model(x[:1]), other(x[:1]))
    assert _graphs(model, x) == 1 and _graphs(other, x) != 1  # the class itself is untouched
    line = report.rewritten[0][1]
    assert "torch.isinf(x).any()" in open(__file__).read().splitlines()[line - 1]  # the source line is reported


def test_predicate_takes_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        predicate(lambda x: x)  # type: ignore[arg-type]


def _bart(layers=2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BartConfig(vocab_size=100, d_model=32, encoder_layers=layers, decoder_layers=1, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    return transformers.BartModel(cfg).eval().half().get_encoder()


@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflowing"])
def test_bart_encoder_gains_a_whole_graph(overflow):
    encoder = _bart()
    if overflow:  # the last layer norm scaled past fp16's range: the guard clamps the output
        with torch.no_grad():
            encoder.layers[-1].final_layer_norm.weight.mul_(1e5)
    ids = torch.randint(0, 100, (2, 11))
    with torch.no_grad():
        want = encoder(input_ids=ids).last_hidden_state
        before = _graphs(encoder, ids)
        report = predicate(encoder)
        assert [r[0] for r in report.rewritten] == ["BartEncoderLayer.forward"] and report.modules == 2
        assert torch.equal(encoder(input_ids=ids).last_hidden_state, want)
        assert before > 1 and _graphs(encoder, ids) == 1
    assert bool(torch.isfinite(want).all()) and bool((want.abs() == 64504).any()) == overflow


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bart_encoder_compiles_whole_through_tessera(device):
    import tessera.frontend.torch  # noqa: F401  (registers the backend)

    encoder = _bart(layers=2).to(device)
    predicate(encoder)
    torch._dynamo.reset()
    fast = torch.compile(encoder, backend="tessera")
    with torch.no_grad():
        for s in (11, 23):
            ids = torch.randint(0, 100, (2, s), device=device)
            got = fast(input_ids=ids).last_hidden_state
            want = encoder(input_ids=ids).last_hidden_state
            assert (got.float() - want.float()).abs().max().item() < 3e-2, s
        assert _graphs(encoder, ids) == 1
