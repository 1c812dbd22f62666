"""tessera.llm's block manager and scheduler, on sequences without a model."""

from __future__ import annotations

import itertools

import pytest

from tessera.llm.block_manager import BlockManager
from tessera.llm.sampling_params import SamplingParams
from tessera.llm.scheduler import Scheduler
from tessera.llm.sequence import Request, Sequence, SequenceStatus

_ARRIVALS = itertools.count()


def make_seq(num_prompt_tokens: int, **params) -> Sequence:
    request = Request(f"r{next(_ARRIVALS)}", None, list(range(1, num_prompt_tokens + 1)), SamplingParams(**params),
                      arrival=next(_ARRIVALS))  # fmt: skip
    seq = Sequence(request, 0, None, None)
    request.seqs.append(seq)
    return seq


def run_step(scheduler: Scheduler) -> dict[int, int]:
    """Schedule one step and pretend it ran: computed counts advance, samplers append a token."""
    scheduled = scheduler.schedule()
    for entry in scheduled:
        samples = entry.samples
        entry.seq.num_computed_tokens += entry.num_tokens
        if samples:
            entry.seq.token_ids.append(7)
    return {e.seq.seq_id: e.num_tokens for e in scheduled}


def test_block_manager_allocates_frees_and_counts_references():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq(5), make_seq(3)
    assert bm.blocks_needed(a, 5) == 2 and bm.can_allocate(2)
    bm.allocate(a, 5)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 2
    a.num_computed_tokens = 5
    assert bm.blocks_needed(a, 3) == 0  # tokens 5..7 still fit the second block
    assert bm.blocks_needed(a, 4) == 1
    bm.allocate(b, 3)
    bm.share(a.block_table[0])  # a second holder: the block outlives a
    shared = a.block_table[0]
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 2 and bm.ref_counts[shared] == 1
    assert not bm.can_allocate(3)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(make_seq(12), 12)


def test_admission_respects_token_budget_and_chunks_prefill():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b, c = make_seq(6), make_seq(7), make_seq(3)
    for s in (a, b, c):
        sched.add(s)
    step = run_step(sched)
    assert step == {a.seq_id: 6, b.seq_id: 4}  # b's prompt is chunked; c waits for budget
    assert [s.seq_id for s in sched.running] == [a.seq_id, b.seq_id] and list(sched.waiting) == [c]
    step = run_step(sched)  # a decodes (1), b finishes its prefill (3), c is admitted whole (3)
    assert step == {a.seq_id: 1, b.seq_id: 3, c.seq_id: 3}
    assert b.num_tokens == 8 and b.num_computed_tokens == 7


def test_max_num_seqs_bounds_running():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(2) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    assert set(run_step(sched)) == {seqs[0].seq_id, seqs[1].seq_id}
    sched.finish(seqs[0])
    assert set(run_step(sched)) == {seqs[1].seq_id, seqs[2].seq_id}


def test_admission_waits_for_free_blocks():
    sched = Scheduler(BlockManager(3, 4), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(8), make_seq(8)
    sched.add(a)
    sched.add(b)
    assert set(run_step(sched)) == {a.seq_id}  # b needs 2 blocks, 1 is free
    assert b.status is SequenceStatus.WAITING and b.block_table == []


def test_preemption_takes_the_latest_and_loses_nothing():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(8), make_seq(7)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a: 2 blocks for 8 tokens, b: 2 blocks for 7; both sample
    assert bm.num_free_blocks == 0
    # a's next token (position 8) needs a third block: b, the latest, is preempted.
    step = run_step(sched)
    assert step == {a.seq_id: 1}
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b]
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.num_tokens == 8  # its sampled token stays
    sched.finish(a)
    assert bm.num_free_blocks == 4
    assert run_step(sched) == {b.seq_id: 8}  # recomputed: prompt and generated token


def test_a_sequence_preempts_itself_when_it_is_the_latest():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(8), make_seq(8)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.preempt(a)  # b is now the only runner, with all blocks but a's two
    sched.waiting.remove(a)
    bm.allocate(make_seq(8), 8)  # another holder takes a's blocks
    step = run_step(sched)  # b needs a block for position 8, none is free, b itself is the latest
    assert step == {} and list(sched.waiting) == [b] and sched.running == []


def test_abort_frees_blocks_at_once():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(9), make_seq(3)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert bm.num_used_blocks == 4
    sched.remove(a)
    assert bm.num_used_blocks == 1 and a not in sched.running
    sched.remove(b)
    assert bm.num_used_blocks == 0 and not sched.has_unfinished()
