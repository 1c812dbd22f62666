"""LLM decode on a static KV cache: the cache update (`index_copy_` of a graph input) is computed
in the cache's own memory (tessera.graph.compiler.in_place) -- the kernel writes the new rows
alone, the compiled graph returns the input itself and the torch front end copies nothing
back -- and a transformers StaticCache decode step through torch.compile(backend="tessera")
matches eager over several steps with different tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.errors import ArgumentError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph

torch = pytest.importorskip("torch")


# ---- the compiled graph -------------------------------------------------------------------------
def _cache_graph(device: str = "cpu", dtype: str = "float32", other_reader: bool = False):
    """cache [2, 3, 9, 5] updated at `pos` along axis 2 with `new`; attention-like readers of
    the updated cache; optionally a reader of the old cache (which forbids the in-place update)."""
    b = GraphBuilder("kv_update", device=device)
    cache = b.input("cache", [2, 3, 9, 5], dtype)
    pos = b.input("pos", [2], "int64")
    new = b.input("new", [2, 3, 2, 5], dtype)
    updated = b.op("index_copy", cache, pos, new, axis=2)
    read = b.op("reduce_sum", b.op("mul", updated, updated), axes=[2])
    outs = [read, updated]
    if other_reader:
        outs.append(b.op("add", cache, b.constant(np.array(1.0, dtype=dtype))))
    b.output(*outs)
    return b.build()


def _reference(cache, pos, new):
    out = cache.copy()
    out[:, :, pos] = new
    return (out * out).sum(axis=2), out


def _inputs(rng, step):
    pos = rng.choice(9, size=2, replace=False).astype(np.int64)
    if step % 2:
        pos[0] -= 9  # negative positions count from the end, as in torch
    return pos, rng.standard_normal((2, 3, 2, 5)).astype(np.float32)


@pytest.mark.slow
def test_update_is_written_into_the_input_and_returned_as_it():
    rng = np.random.default_rng(0)
    g = _cache_graph()
    compiled = compile_graph(g, "cpu", in_place={1: 0})
    assert compiled.in_place == {1: 0}
    assert "written into their inputs, nothing copied back (1): cache (in place)" in str(compiled.report())
    cache = rng.standard_normal((2, 3, 9, 5)).astype(np.float32)
    expect = cache.copy()
    for step in range(4):  # the first call runs the steps, later ones replay the recorded C calls
        pos, new = _inputs(rng, step)
        want_read, expect = _reference(expect, pos, new)
        read, updated = compiled(cache, pos, new)
        assert np.shares_memory(updated, cache) and updated.ctypes.data == cache.ctypes.data
        np.testing.assert_array_equal(cache, expect)
        np.testing.assert_allclose(read, want_read, rtol=1e-5)


@pytest.mark.slow
def test_in_place_update_has_no_copy_kernel():
    """The functional update copies the cache (an init kernel) before writing the rows; in place,
    the kernel writes the rows alone."""
    functional = compile_graph(_cache_graph(), "cpu").summary()["kernels"]
    in_place = compile_graph(_cache_graph(), "cpu", in_place={1: 0}).summary()["kernels"]
    assert in_place == functional - 1


@pytest.mark.slow
def test_update_of_an_input_read_elsewhere_is_computed_apart():
    rng = np.random.default_rng(1)
    compiled = compile_graph(_cache_graph(other_reader=True), "cpu", in_place={1: 0})
    assert compiled.in_place == {}
    assert not any(op.attrs.get("in_place") for op in compiled.graph.operators if op.kind == "index_copy")
    cache = rng.standard_normal((2, 3, 9, 5)).astype(np.float32)
    before = cache.copy()
    for step in range(2):
        pos, new = _inputs(rng, step)
        read, updated, plus = compiled(cache, pos, new)
        want_read, want = _reference(before, pos, new)
        np.testing.assert_array_equal(cache, before)  # the caller writes the update back, not the graph
        np.testing.assert_array_equal(updated, want)
        np.testing.assert_allclose(plus, before + 1, rtol=1e-6)
        np.testing.assert_allclose(read, want_read, rtol=1e-5)


@pytest.mark.parametrize("pairs", [{5: 0}, {1: 7}, {-1: 0}])
def test_in_place_indices_out_of_range_are_refused(pairs):
    with pytest.raises(ArgumentError, match="in_place"):
        compile_graph(_cache_graph(), "cpu", in_place=pairs)


@pytest.mark.slow
def test_an_update_that_is_no_index_copy_of_the_input_is_not_in_place():
    g = _cache_graph()
    compiled = compile_graph(g, "cpu", in_place={0: 0, 1: 1})  # output 0 is a sum; input 1 is not the cache
    assert compiled.in_place == {}


@pytest.mark.slow
def test_out_of_range_positions_raise():
    from tessera.errors import IndexOutOfRangeError

    compiled = compile_graph(_cache_graph(), "cpu", in_place={1: 0})
    cache = np.zeros((2, 3, 9, 5), np.float32)
    with pytest.raises(IndexOutOfRangeError):
        compiled(cache, np.array([1, 9], np.int64), np.ones((2, 3, 2, 5), np.float32))


# ---- torch.compile on a transformers StaticCache ------------------------------------------------
def _tiny_llama(hidden: int = 64):
    """2 layers, 4 heads over 2 key/value heads (grouped); head dim hidden / 4."""
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096,
                         initializer_range=0.5 if hidden == 64 else 0.05)  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


def _decode(model, cache_len: int, prompt_len: int, steps: int, device: str = "cpu", dtype=torch.float32,
            watch: list | None = None):  # fmt: skip
    """(eager logits, compiled logits, eager cache, compiled cache, the compiled CompiledGraphs,
    key data_ptrs before) over `steps` decode steps, each a new token at the next position.
    `watch[0]` is True during the compiled calls after the first (which compiles)."""
    from transformers import StaticCache

    model = model.to(device=device, dtype=dtype)
    caches = [StaticCache(config=model.config, max_cache_len=cache_len) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 1000, (1, prompt_len), generator=g).to(device)

    def step(ids, pos, cache):
        return model(input_ids=ids, cache_position=pos, past_key_values=cache, use_cache=True).logits

    collect: list = []
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="tessera", options={"collect": collect})
    eager_out, compiled_out = [], []
    with torch.no_grad():
        for c in caches:
            model(input_ids=prompt, cache_position=torch.arange(prompt_len, device=device), past_key_values=c,
                  use_cache=True)  # fmt: skip
        ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in caches[1].layers]
        for s in range(steps):
            ids = torch.randint(0, 1000, (1, 1), generator=g).to(device)
            pos = torch.tensor([prompt_len + s], device=device)
            eager_out.append(step(ids, pos, caches[0]).float())
            if watch is not None:
                watch[0] = s > 0
            compiled_out.append(compiled(ids, pos, caches[1]).float().clone())
            if watch is not None:
                watch[0] = False
    return eager_out, compiled_out, caches[0], caches[1], collect, ptrs


@pytest.mark.slow
def test_static_cache_decode_matches_eager_and_updates_the_cache_in_place(monkeypatch):
    from tessera.frontend.torch import stats

    before = dict(stats)
    copies: list = []
    watch = [False]
    real_copy = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):  # the front end's write-backs go through Tensor.copy_
        if watch[0]:
            copies.append(tuple(self.shape))
        return real_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    eager, ours, cache_e, cache_t, collect, ptrs = _decode(_tiny_llama(), cache_len=16, prompt_len=5, steps=5,
                                                           watch=watch)  # fmt: skip
    monkeypatch.undo()
    for s, (a, b) in enumerate(zip(eager, ours)):
        assert float((a - b).abs().max() / a.abs().max()) < 1e-5, s
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert len({tuple(x.argmax(-1).flatten().tolist()) for x in eager}) > 1  # the steps differ
    for le, lt, (kp, vp) in zip(cache_e.layers, cache_t.layers, ptrs):
        assert lt.keys.data_ptr() == kp and lt.values.data_ptr() == vp
        torch.testing.assert_close(lt.keys, le.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lt.values, le.values, rtol=1e-4, atol=1e-4)
        assert int(lt.cumulative_length) == int(le.cumulative_length) == 10
    assert stats["graphs"] - before["graphs"] == 1 and stats["eager_nodes"] == before["eager_nodes"]
    (graph,) = collect
    (segment,) = graph.steps
    updates = [op for op in segment.graph.operators if op.kind == "index_copy"]
    assert len(updates) == 4 and all(op.attrs["in_place"] for op in updates)  # K and V of 2 layers
    assert len(segment.executor.in_place) == 4
    # the write-backs of the calls after the first: the 2 position counters, no cache (the graph wrote its rows)
    assert copies == [()] * 2 * 4


@pytest.mark.cuda
def test_static_cache_decode_on_the_gpu_keeps_the_cache_in_the_cuda_graph():
    """fp16 on the GPU, head dim 64, a 2048-position cache: the CUDA graph captures the cache
    where it is (no static copy: the arena is smaller than one cache), its replays agree with
    eager step after step, and attention is the flash kernel's split-KV decode variant."""
    from tessera.templates.attention.plan import FlashAnchorKernel

    eager, ours, cache_e, cache_t, collect, ptrs = _decode(_tiny_llama(hidden=256), cache_len=2048, prompt_len=1500,
                                                           steps=6, device="cuda", dtype=torch.float16)  # fmt: skip
    for s, (a, b) in enumerate(zip(eager, ours)):
        assert float((a - b).norm() / a.norm()) < 2e-2, s
    for le, lt, (kp, _) in zip(cache_e.layers, cache_t.layers, ptrs):
        assert lt.keys.data_ptr() == kp
        torch.testing.assert_close(lt.keys, le.keys, rtol=2e-2, atol=2e-2)
    (graph,) = collect
    (segment,) = graph.steps
    executor = segment.executor
    assert len(executor.in_place) == 4 and executor.use_cuda_graph
    assert len(executor.copy_back) == 2  # the layers' position counters (static inputs): inside the CUDA graph
    assert any(p.cuda_graph is not None and p.pinned for p in executor._plans.values())  # replays ran
    one_cache = cache_t.layers[0].keys.numel() * cache_t.layers[0].keys.element_size()
    assert executor.summary()["shared_arena_bytes"] < one_cache
    attention = [r.kernel for s in executor.steps if s.kind == "anchor" for r in s.prepared()
                 if "attention" in s.anchor.kind]  # fmt: skip
    assert attention and all(isinstance(k, FlashAnchorKernel) and k._plan.splits > 1 for k in attention), attention


@pytest.mark.cuda
def test_cuda_graph_of_an_in_place_update_follows_a_moved_input():
    """A call whose in-place input is not where the capture saw it runs without the graph, correctly."""
    rng = np.random.default_rng(2)
    compiled = compile_graph(_cache_graph("cuda"), "cuda", in_place={1: 0})
    caches = [torch.tensor(rng.standard_normal((2, 3, 9, 5)).astype(np.float32), device="cuda") for _ in range(2)]
    expects = [c.cpu().numpy() for c in caches]
    for step in range(6):  # calls 1-2 on cache 0 (eager, capture), then alternate: replays and moved inputs
        k = 0 if step < 3 else step % 2
        pos, new = _inputs(rng, step)
        want_read, expects[k] = _reference(expects[k], pos, new)
        read, updated = compiled(caches[k], torch.tensor(pos, device="cuda"), torch.tensor(new, device="cuda"))
        assert updated.data_ptr() == caches[k].data_ptr()
        np.testing.assert_array_equal(caches[k].cpu().numpy(), expects[k])
        np.testing.assert_allclose(read.cpu().numpy(), want_read, rtol=1e-5)


def _counter_graph(device: str):
    """A cache written at a position counter, which the step advances (transformers' StaticLayer)."""
    b = GraphBuilder("counter", device=device)
    cache = b.input("cache", [1, 2, 6, 3], "float32")
    counter = b.input("counter", [], "int64")
    new = b.input("new", [1, 2, 1, 3], "float32")
    updated = b.op("index_copy", cache, b.op("reshape", counter, shape=[1]), new, axis=2)
    b.output(b.op("reduce_sum", updated, axes=[2]), updated, b.op("add", counter, b.constant(np.int64(1))))
    return b.build()


@pytest.mark.slow
def test_copy_back_is_for_captured_gpu_graphs_only():
    compiled = compile_graph(_counter_graph("cpu"), "cpu", in_place={1: 0, 2: 1}, static_inputs={1})
    assert compiled.in_place == {1: 0} and compiled.copy_back == {}
    cache, counter = np.zeros((1, 2, 6, 3), np.float32), np.array(2, np.int64)
    read, updated, advanced = compiled(cache, counter, np.ones((1, 2, 1, 3), np.float32))
    assert int(advanced) == 3 and int(counter) == 2  # the caller writes the counter back
    assert cache[0, :, 2].sum() == 6 and cache.sum() == 6


@pytest.mark.cuda
def test_static_input_updates_are_copied_back_inside_the_cuda_graph():
    compiled = compile_graph(_counter_graph("cuda"), "cuda", in_place={1: 0, 2: 1}, static_inputs={1})
    assert compiled.in_place == {1: 0} and compiled.copy_back == {2: 1}
    rng = np.random.default_rng(3)
    cache = torch.zeros((1, 2, 6, 3), device="cuda")
    counter = torch.tensor(0, device="cuda")
    expect = np.zeros((1, 2, 6, 3), np.float32)
    for step in range(6):  # eager, capture, then 4 replays
        new = rng.standard_normal((1, 2, 1, 3)).astype(np.float32)
        expect[:, :, step] = new[:, :, 0]
        read, updated, advanced = compiled(cache, counter, torch.tensor(new, device="cuda"))
        assert int(counter) == step + 1 and advanced.data_ptr() == counter.data_ptr()
        assert updated.data_ptr() == cache.data_ptr()
        np.testing.assert_array_equal(cache.cpu().numpy(), expect)
        np.testing.assert_allclose(read.cpu().numpy(), expect.sum(axis=2), rtol=1e-6)
