"""tessera.llm's prefix cache: the radix tree on its own, the scheduler over it, and the engine with
the cache on against the cache off (greedy tokens equal, eviction under pressure, n > 1 forks)."""

from __future__ import annotations

import argparse
import itertools

import pytest
import torch
from tiny_llm import make_model

from tessera.eager.paged_attention import copy_blocks
from tessera.errors import ArgumentError
from tessera.llm import LLM, SamplingParams
from tessera.llm.block_manager import BlockManager
from tessera.llm.prefix_cache import PrefixCache
from tessera.llm.sampling_params import SamplingParams as Params
from tessera.llm.scheduler import Scheduler
from tessera.llm.sequence import Request, Sequence

_ARRIVALS = itertools.count()


def make_seq(tokens: list[int], n: int = 1) -> Sequence:
    request = Request(f"r{next(_ARRIVALS)}", None, list(tokens), Params(n=n), arrival=next(_ARRIVALS))
    request.seqs = [Sequence(request, i, None, None) for i in range(n)]
    return request.seqs[0]


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence whose tokens all have (pretend) KV in freshly allocated blocks."""
    seq = make_seq(tokens)
    bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    return seq


def finish(cache: PrefixCache, seq: Sequence) -> None:
    cache.cache_sequence(seq, done=True)
    cache.block_manager.free(seq)


# -- the tree -------------------------------------------------------------------------------------
def test_insert_match_and_split_at_token_granularity():
    bm = BlockManager(16, 4)
    cache = PrefixCache(bm)
    a = computed(bm, list(range(1, 11)))  # 10 tokens: blocks of 4, 4, 2
    blocks_a = list(a.block_table)
    finish(cache, a)
    assert bm.num_used_blocks == 0 and bm.num_evictable_blocks == 3 and bm.ref_counts[blocks_a[0]] == 1
    m = cache.match(list(range(1, 11)) + [99])
    assert (m.length, m.blocks) == (10, blocks_a)
    m = cache.match([1, 2, 3, 4, 5, 6, 50, 51])  # parts inside the second block
    assert (m.length, m.blocks) == (6, blocks_a[:2])
    assert cache.match([7, 1]).length == 0 and cache.match([1, 2, 3], limit=2).length == 2
    # b shares the first 6 tokens: the edge splits at 6, inside block 1, which both halves then hold.
    b = computed(bm, [1, 2, 3, 4, 5, 6, 50, 51, 52])
    finish(cache, b)
    assert cache.num_nodes == 3 and cache.num_tokens == 13 and bm.ref_counts[blocks_a[1]] == 2
    m = cache.match([1, 2, 3, 4, 5, 6, 50, 51, 52, 0])
    assert m.length == 9 and m.blocks[0] == blocks_a[0] and m.blocks[1] not in blocks_a
    assert cache.match(list(range(1, 11))).blocks == blocks_a  # the first branch is intact
    assert bm.num_used_blocks == 0 and bm.num_evictable_blocks == 3 + 2


def test_locks_pin_blocks_and_eviction_is_lru():
    bm = BlockManager(12, 4)
    cache = PrefixCache(bm)
    for first in (10, 20, 30):  # three unrelated prompts of two blocks each, inserted in this order
        finish(cache, computed(bm, [first + i for i in range(8)]))
    assert bm.num_free_blocks == 6 and bm.num_evictable_blocks == 6
    cache.match([10, 11, 12], touch=True)  # the oldest becomes the most recently used
    node = cache.match([30, 31]).node
    cache.lock(node)  # in use: not evictable
    assert bm.num_evictable_blocks == 4 and bm.num_used_blocks == 2
    # The least recently used unlocked leaf (20...) loses blocks from its end, then goes.
    assert cache.evict(1) == 1 and cache.match(list(range(20, 28))).length == 4 and cache.num_tokens == 20
    assert cache.evict(1) == 1 and cache.match([20, 21]).length == 0 and cache.match([10, 11]).length == 2
    assert cache.evict(100) == 2 and cache.match([10]).length == 0  # then 10...; 30... is locked
    assert cache.match([30, 31, 32]).length == 3 and bm.num_free_blocks == 10
    cache.unlock(node)
    assert bm.num_evictable_blocks == 2 and cache.reset() == 2 and bm.num_free_blocks == 12
    assert cache.num_nodes == 0 and cache.num_tokens == 0
    with pytest.raises(RuntimeError, match="unlocked more often"):
        cache.unlock(node)


def test_allocation_evicts_when_the_free_list_runs_short():
    bm = BlockManager(4, 4)
    cache = PrefixCache(bm)
    finish(cache, computed(bm, list(range(1, 17))))  # the whole pool is cached
    assert bm.num_free_blocks == 0 and bm.can_allocate(4)
    seq = make_seq([99] * 8)
    bm.allocate(seq, 8)  # takes 2 blocks: the cached prefix keeps its first 8 tokens
    assert len(seq.block_table) == 2 and cache.match(list(range(1, 17))).length == 8 and bm.num_free_blocks == 0
    assert not bm.can_allocate(3)
    with pytest.raises(RuntimeError, match="check can_allocate"):
        bm.allocate(make_seq([5] * 12), 12)


def test_admission_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(16, 4)
    cache = PrefixCache(bm)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, prefix_cache=cache)
    a = computed(bm, list(range(1, 11)))
    blocks_a = list(a.block_table)
    finish(cache, a)
    b = make_seq(list(range(1, 7)) + [70, 71, 72])  # 6 cached tokens: block 0 shared, block 1 copied
    sched.add(b)
    (entry,) = sched.schedule()
    assert entry.num_tokens == 3 and b.num_computed_tokens == 6 and b.num_cached_tokens == 6
    assert b.block_table[0] == blocks_a[0] and b.block_table[1] not in blocks_a
    assert sched.take_copies() == [(blocks_a[1], b.block_table[1])] and sched.take_copies() == []
    assert bm.ref_counts[blocks_a[0]] == 2 and bm.pins[blocks_a[1]] == 1  # copy source pinned by the lock
    assert (sched.prefix_query_tokens, sched.prefix_hit_tokens) == (9, 6)
    # A whole prompt in the cache: its last token is still computed, so that there are logits.
    c = make_seq(list(range(1, 9)))
    sched.add(c)
    (entry_b, entry_c) = sched.schedule()
    assert entry_c.seq is c and entry_c.num_tokens == 1 and c.num_computed_tokens == 7
    sched.finish(b)
    sched.finish(c)
    assert bm.num_used_blocks == 0 and sum(bm.pins) == 0


def test_a_match_that_cannot_fit_is_dropped_when_nothing_runs():
    bm = BlockManager(4, 4)
    cache = PrefixCache(bm)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, prefix_cache=cache)
    finish(cache, computed(bm, list(range(1, 11))))  # 3 blocks cached, 1 free
    seq = make_seq(list(range(1, 7)) + [50] * 10)  # 16 tokens: the whole pool
    sched.add(seq)
    # With its 6-token match it would need 3 new blocks (the copy of the partial one among them)
    # while the matched leaf stays pinned; nothing runs, so it is admitted without the match.
    (entry,) = sched.schedule()
    assert entry.num_tokens == 16 and seq.num_computed_tokens == 0 and len(seq.block_table) == 4
    assert cache.num_nodes == 0 and sched.take_copies() == [] and seq.num_cached_tokens == 0


def test_cache_aware_order_with_a_wait_bound():
    bm = BlockManager(64, 4)
    cache = PrefixCache(bm)
    finish(cache, computed(bm, [5] * 12))
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64, prefix_cache=cache, max_wait_steps=2)
    cold, warm1, warm2 = make_seq([9] * 6), make_seq([5] * 12 + [1]), make_seq([5] * 12 + [2])
    for s in (cold, warm1, warm2):
        sched.add(s)
    assert [e.seq for e in sched.schedule()] == [warm1]  # longest cached prefix first, not arrival
    sched.finish(warm1)
    sched.num_steps += 5  # cold has now waited past the bound: it goes first
    assert [e.seq for e in sched.schedule()] == [cold]
    with pytest.raises(ValueError, match="max_wait_steps"):
        Scheduler(bm, 1, 8, prefix_cache=cache, max_wait_steps=-1)


def test_a_prompt_being_computed_is_waited_for_not_computed_twice():
    bm = BlockManager(64, 4)
    cache = PrefixCache(bm)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, prefix_cache=cache)
    shared = list(range(1, 14))
    a, b, c = make_seq(shared + [40]), make_seq(shared + [50]), make_seq([7] * 9)
    for s in (a, b, c):
        sched.add(s)
    step = sched.schedule()
    assert [e.seq for e in step] == [a, c]  # b waits: a computes its first 13 tokens in this step
    for e in step:  # the step ran: computed tokens go into the cache, as the engine does
        e.seq.num_computed_tokens += e.num_tokens
        sched.cache_prefill(e.seq)
        e.seq.token_ids.append(3)
    step = sched.schedule()
    assert {e.seq: e.num_tokens for e in step} == {a: 1, c: 1, b: 1} and b.num_cached_tokens == 13
    assert sched.take_copies() == [(a.block_table[3], b.block_table[3])]  # 13 = 3 blocks + 1 token


def test_copy_blocks_copies_keys_and_values():
    k = torch.arange(4 * 2 * 1 * 3, dtype=torch.float32).view(4, 2, 1, 3)
    v = -k.clone()
    k0, v0 = k.clone(), v.clone()
    copy_blocks(k, v, torch.tensor([1, 3], dtype=torch.int32), torch.tensor([3, 0], dtype=torch.int32))
    assert torch.equal(k[3], k0[1]) and torch.equal(k[0], k0[3]) and torch.equal(v[3], v0[1])  # reads first
    assert torch.equal(k[1], k0[1]) and torch.equal(k[2], k0[2])
    with pytest.raises(ArgumentError, match=r"block ids must be in \[0, 4\)"):
        copy_blocks(k, v, torch.tensor([4]), torch.tensor([0]))


# -- the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """One artifact cache for the module (conftest's is per test): the kernels are built once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CACHE_DIR", str(tmp_path_factory.mktemp("tessera-cache")))
        yield


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


def tokens_of(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


SYSTEM = [1] + [10 + (7 * i) % 300 for i in range(37)]  # 38 tokens: not a multiple of the block size
SHARED = [SYSTEM + [40 + i, 41 + 2 * i, 42 + 3 * i] + [100 + i] * (i % 3) for i in range(6)]


@pytest.mark.slow
def test_greedy_outputs_equal_with_the_cache_on_and_off(model):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", max_model_len=160, block_size=4, max_num_batched_tokens=32, enforce_eager=True)
    off = LLM(model, enable_prefix_caching=False, **kw)
    on = LLM(model, **kw)
    first = on.generate(SHARED, params)
    assert tokens_of(first) == tokens_of(off.generate(SHARED, params))
    assert first[0].num_cached_tokens == 0 and all(o.num_cached_tokens >= len(SYSTEM) - 3 for o in first[1:])
    # Multi-turn: each turn's prompt is the previous prompt, its answer and new user tokens.
    chats_on, chats_off = [SHARED[0][:20], SHARED[3][:25]], [SHARED[0][:20], SHARED[3][:25]]
    for turn in range(3):
        outs_on, outs_off = on.generate(chats_on, params), off.generate(chats_off, params)
        assert tokens_of(outs_on) == tokens_of(outs_off)
        if turn:  # the previous turn's prompt and all of its answer but the last token (not computed)
            assert [o.num_cached_tokens for o in outs_on] == [len(p) - 4 - 1 for p in chats_on]
        chats_on = [p + o.outputs[0].token_ids + [200 + turn] * 4 for p, o in zip(chats_on, outs_on, strict=True)]
        chats_off = [p + o.outputs[0].token_ids + [200 + turn] * 4 for p, o in zip(chats_off, outs_off, strict=True)]
    stats, cold = on.engine.stats(), off.engine.stats()
    assert stats.prefix_caching and not cold.prefix_caching and cold.prefix_cache_hit_tokens == 0
    assert 0.5 < stats.prefix_cache_hit_rate < 1 and stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_cached > 0
    assert on.reset_prefix_cache() == stats.num_kv_blocks_cached and on.engine.stats().num_kv_blocks_cached == 0


@pytest.mark.slow
def test_eviction_under_pressure_loses_nothing(model):
    prompts = [SHARED[i % 6][: 30 + 3 * i] + [250 + i] for i in range(10)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", max_model_len=80, block_size=1, max_num_batched_tokens=48, enforce_eager=True)
    expected = tokens_of(LLM(model, enable_prefix_caching=False, **kw).generate(prompts, params))
    # 80 blocks of 1 token = one sequence of max_model_len: once the pool is full, every step's new
    # tokens take blocks from cached prefixes (evicted), and sequences are preempted too.
    llm = LLM(model, num_kv_blocks=80, **kw)
    cache = llm.engine.prefix_cache
    ids = [f"p{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        llm.engine.add_request(request_id, prompt, params)
    finals, evicted = {}, []
    while llm.engine.has_unfinished_requests():
        before = cache.num_evicted_blocks
        for out in llm.engine.step():
            if out.finished:
                finals[out.request_id] = out
        evicted.append(cache.num_evicted_blocks > before)
    assert tokens_of([finals[i] for i in ids]) == expected
    first = evicted.index(True)
    assert first <= 5 and evicted[first:].count(False) <= 2 and llm.engine.stats().num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and sum(bm.pins) == 0
    assert bm.num_free_blocks + bm.num_evictable_blocks == bm.num_blocks


def test_n_samples_fork_from_one_computed_prompt(model):
    prompt = SHARED[2]
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=11, n=4, ignore_eos=True)
    kw = dict(device="cpu", max_model_len=96, block_size=4, enforce_eager=True)
    off = LLM(model, enable_prefix_caching=False, **kw).generate(prompt, params)
    llm = LLM(model, **kw)
    log = llm.engine.enable_step_log()
    (out,) = llm.generate(prompt, params)
    assert tokens_of([out]) == tokens_of(off) and len({tuple(c.token_ids) for c in out.outputs}) > 1
    # The prompt is computed once: the other samples fork from it and draw from the same logits.
    assert sum(t for t, _ in log) == len(prompt) + 4 * (params.max_tokens - 1)
    assert log[0] == (len(prompt), len(prompt)) and log[1] == (4, 4 * (len(prompt) + 1))
    stats = llm.engine.stats()
    assert stats.prefix_cache_hit_tokens == 3 * len(prompt) and out.num_cached_tokens == 0
    # Only one sequence slot: the samples cannot fork, they run one after another on the cached prompt.
    solo = LLM(model, max_num_seqs=1, **kw)
    (one,) = solo.generate(prompt, params)
    assert tokens_of([one]) == tokens_of(off) and solo.engine.stats().prefix_cache_hit_tokens == 3 * (len(prompt) - 1)


def test_metrics_usage_and_the_no_prefix_cache_flag(model, monkeypatch):
    pytest.importorskip("fastapi")
    from tessera.cli import main
    from tessera.llm.server import main as server_main
    from tessera.llm.server import metrics, serving
    from tessera.llm.server.async_engine import AsyncLLMEngine

    llm = LLM(model, device="cpu", max_model_len=96, block_size=4, enforce_eager=True)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    outs = llm.generate([SHARED[0], SHARED[1]], params)
    engine = AsyncLLMEngine(llm.engine)
    engine.stats = llm.engine.stats()
    text = metrics.render(engine, "m")
    hits = outs[1].num_cached_tokens
    assert hits > 0 and f'tessera_prefix_cache_hits_total{{model_name="m"}} {hits}' in text
    assert "# TYPE tessera_prefix_cache_hit_rate gauge" in text and "tessera_kv_blocks_cached" in text
    assert serving.usage(outs).prompt_tokens_details.cached_tokens == hits
    assert llm.reset_prefix_cache() == engine.stats.num_kv_blocks_cached > 0
    assert llm.engine.stats().num_kv_blocks_cached == 0 and llm.engine.prefix_cache.num_nodes == 0
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        LLM(model, device="cpu", enable_prefix_caching="no")
    seen: dict[str, object] = {}

    def fake_serve(args: argparse.Namespace) -> int:
        seen["flag"] = args.no_prefix_cache
        return 0

    real_serve = server_main.serve
    monkeypatch.setattr(server_main, "serve", fake_serve)
    assert main(["serve", "dir", "--no-prefix-cache"]) == 0 and seen["flag"] is True
    assert main(["serve", "dir"]) == 0 and seen["flag"] is False

    def fake_llm(model_dir, **options):
        seen["options"] = options
        raise ValueError("not loading in this test")

    monkeypatch.setattr(server_main, "LLM", fake_llm)
    args = argparse.Namespace(model_dir="dir", device="cpu", dtype=None, quantization=None, max_model_len=None,
                              max_num_seqs=None, no_prefix_cache=True, api_key=None)  # fmt: skip
    assert real_serve(args) == 1 and seen["options"]["enable_prefix_caching"] is False
