"""torch.compile(backend="tessera") on models that update tensors in place: functionalization
turns the updates into functional ops, and the compiled graph writes the new values of its
inputs (a KV cache, a module buffer) back into those tensors itself.  Every case checks the
outputs and the updated tensors against eager, over several calls with fresh inputs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tessera.frontend.torch import stats  # noqa: E402


def _rel(out, ref):
    return float((out.float() - ref.float()).abs().max() / max(ref.float().abs().max(), 1e-30))


class StaticKVCache(torch.nn.Module):
    """A static KV cache (transformers' StaticCache): `index_copy_` at the current positions,
    then attention over the whole cache."""

    def __init__(self, heads=3, length=11, dim=5):
        super().__init__()
        self.register_buffer("k", torch.zeros(2, heads, length, dim))
        self.register_buffer("v", torch.zeros(2, heads, length, dim))

    def forward(self, q, k, v, pos):
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)
        return torch.nn.functional.scaled_dot_product_attention(q, self.k, self.v)


class SliceUpdates(torch.nn.Module):
    def forward(self, cache, x, i: int):
        cache[:, 1:4] = x[:, :3] * 2  # slice_scatter
        cache[:, 5] += x[:, 4]  # select_scatter of an update
        cache[0, 2:7:2] = -1.0  # strided slice of a row
        return cache.sum(dim=1)


class CopyInto(torch.nn.Module):
    def forward(self, out, x):
        out.copy_(torch.tanh(x))  # broadcast from [n] into [m, n]
        return x + 1


class RunningMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(7))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        self.count += 1
        y = x - self.mean
        y.add_(1.0)  # an intermediate updated in place and read afterwards
        return y * y


def _run(model_eager, model_compiled, make_inputs, calls=3, tol=1e-5, dynamic=None):
    torch._dynamo.reset()
    compiled = torch.compile(model_compiled, backend="tessera", dynamic=dynamic)
    before = dict(stats)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(calls):
            ins = make_inputs(g)
            ins_c = [t.clone() if isinstance(t, torch.Tensor) else t for t in ins]
            ref = model_eager(*ins)
            out = compiled(*ins_c)
            assert _rel(out, ref) < tol
            for a, b in zip(ins, ins_c):  # the inputs updated in place, like eager
                if isinstance(a, torch.Tensor):
                    assert _rel(b, a) < tol
            for (name, a), (_, b) in zip(model_eager.named_buffers(), model_compiled.named_buffers()):
                assert _rel(b, a) < tol, name
    if not dynamic:  # dynamic: sizes such as s0 - 3 are beyond tessera's monomial sizes; those ops run in torch
        assert stats["eager_nodes"] == before["eager_nodes"]
    assert stats["whole_graph_fallbacks"] == before["whole_graph_fallbacks"]
    assert stats["reference_ops"] == before["reference_ops"]
    if dynamic is None:
        assert stats["graphs"] - before["graphs"] == 1
    return before


def test_static_kv_cache_index_copy():
    def inputs(g):
        pos = torch.randperm(11, generator=g)[:4]
        return (torch.randn(2, 3, 4, 5, generator=g), torch.randn(2, 3, 4, 5, generator=g),
                torch.randn(2, 3, 4, 5, generator=g), pos)  # fmt: skip

    _run(StaticKVCache(), StaticKVCache(), inputs)


def test_slice_and_select_updates_of_an_input():
    _run(SliceUpdates(), SliceUpdates(), lambda g: (torch.randn(3, 9, generator=g), torch.randn(3, 6, generator=g), 0))


def test_copy_into_an_input():
    _run(CopyInto(), CopyInto(), lambda g: (torch.randn(4, 6, generator=g), torch.randn(6, generator=g)))


def test_buffer_updates_and_in_place_intermediates():
    _run(RunningMean(), RunningMean(), lambda g: (torch.randn(5, 7, generator=g),), calls=4)


class NegativeBounds(torch.nn.Module):
    def forward(self, grid, x):
        grid[:, -3:-1] = x[:, :2]  # bounds counted from the end of a (symbolic) size
        grid[:, -1] = 0.5
        grid[-1] *= 2
        return grid.cumsum(1)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.slow
def test_updates_with_negative_bounds(dynamic):
    sizes = iter([(4, 9), (3, 7), (5, 11), (2, 6)])

    def inputs(g):
        r, c = next(sizes)
        return torch.randn(r, c, generator=g), torch.randn(r, 5, generator=g)

    _run(NegativeBounds(), NegativeBounds(), inputs, calls=4, dynamic=dynamic)
