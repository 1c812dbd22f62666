"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a budget of `max_num_batched_tokens` tokens.  Running sequences go first, oldest
first: a decoding one takes 1 token, one still prefilling takes the rest of its prompt or what the
budget leaves (chunked prefill), so prefills and decodes share one forward pass.  Then waiting
sequences are admitted, oldest first, while budget, free blocks and `max_num_seqs` allow.

When a running sequence needs a block and none is free, the latest-arrived running sequence is
preempted by recompute: its blocks are freed, its computed count drops to 0, and it goes back to
the front of the waiting queue with every token it has, so it resumes later where it stopped.

With a prefix cache (prefix_cache.py) admission is cache-aware: among the first `lookahead`
waiting sequences, those with the longest cached prefix go first, except that a sequence waiting
more than `max_wait_steps` steps, or one preempted, goes before all others (in arrival order), so
nothing starves.  An admitted sequence starts at its cached prefix: its full blocks are shared, a
partial last block is copied (`take_copies`), and only the rest counts against the budget.  A
sequence whose uncached prompt a prefilling sequence is computing right now waits for it (the
samples of one request, or requests sharing a prompt, compute it once).  Finished and preempted
sequences leave their computed tokens in the cache.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from tessera.llm.block_manager import BlockManager
from tessera.llm.prefix_cache import PrefixCache
from tessera.llm.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    """A sequence in this step and how many of its uncomputed tokens the step computes;
    `samples`: the step reaches its last token, so a new token is sampled (set when scheduled)."""

    seq: Sequence
    num_tokens: int
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_tokens == len(self.seq.token_ids)


class Scheduler:
    """The waiting and running queues over one block manager (and its prefix cache, if any).

    prefix_cache: share cached prefixes and schedule cache-aware (None: first come, first served).
    max_wait_steps: with a cache, a sequence waiting longer than this many steps goes first.
    lookahead: with a cache, how many waiting sequences (in arrival order) are ranked each step.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_cache: PrefixCache | None = None, max_wait_steps: int = 128, lookahead: int = 128) -> None:  # fmt: skip
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, "
                             f"{max_num_batched_tokens}")  # fmt: skip
        if max_wait_steps < 0 or lookahead < 1:
            raise ValueError(f"max_wait_steps must be >= 0 and lookahead >= 1, got {max_wait_steps}, {lookahead}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.max_wait_steps = max_wait_steps
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.num_preemptions = 0
        self.num_steps = 0
        # Prompt tokens of sequences at their first admission, and how many of them were cached
        # (re-admissions after a preemption are not counted: they would inflate the hit rate).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._copies: list[tuple[int, int]] = []  # (source, destination) blocks to copy before the step

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.waiting_since = self.num_steps
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies the last `schedule` planned (copy-on-write of partial cached blocks),
        which must run before the step's forward; the caller performs them."""
        copies, self._copies = self._copies, []
        return copies

    def schedule(self) -> list[ScheduledSequence]:
        """Pick this step's sequences and allocate the blocks their new tokens need."""
        self.num_steps += 1
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            needed = self.block_manager.blocks_needed(seq, num_tokens)
            while needed and not self.block_manager.can_allocate(needed):
                victim = self.running[-1]  # the latest arrival; never one scheduled already (index >= i)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing after it runs either
            if needed:  # a decoding sequence mostly has its slot already
                self.block_manager.allocate(seq, num_tokens)
            scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens
            i += 1
        # Admitting new work right after a preemption would only preempt again next step.
        if preempted or not self.waiting:
            return scheduled
        if self.prefix_cache is None:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                entry = self._admit(self.waiting[0], budget)
                if entry is None:
                    break
                scheduled.append(entry)
                budget -= entry.num_tokens
            return scheduled
        if budget <= 0 or len(self.running) >= self.max_num_seqs or not self.block_manager.can_allocate(1):
            return scheduled  # no admission possible: skip ranking the queue
        prefilling = [s for s in self.running if s.num_computed_tokens < s.num_prompt_tokens]
        for seq, cached in self._ranked_waiting():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if cached is not None and self._computed_by_another(seq, cached, prefilling):
                continue
            entry = self._admit(seq, budget)
            if entry is None:
                break
            scheduled.append(entry)
            budget -= entry.num_tokens
            if seq.num_computed_tokens < seq.num_prompt_tokens:  # its prompt tokens are cached after the step
                prefilling.append(seq)
        return scheduled

    def _overdue(self, seq: Sequence) -> bool:
        """Preempted sequences, and those past the wait bound, go before cache-aware ranking."""
        return seq.num_cached_tokens is not None or self.num_steps - seq.waiting_since > self.max_wait_steps

    def _ranked_waiting(self) -> list[tuple[Sequence, int | None]]:
        """The first `lookahead` waiting sequences with their cached prefix lengths: overdue ones
        first in arrival order (length None), then the others, longest cached prefix first (ties in
        arrival order)."""
        assert self.prefix_cache is not None
        window = list(itertools.islice(self.waiting, self.lookahead))
        keys = []
        for order, seq in enumerate(window):
            if self._overdue(seq):
                keys.append((0, 0, order))
            else:
                keys.append((1, -self.prefix_cache.match(seq.token_ids, seq.num_tokens - 1).length, order))
        return [(window[order], None if first == 0 else -neg) for first, neg, order in sorted(keys)]

    def _computed_by_another(self, seq: Sequence, cached: int, prefilling: list[Sequence]) -> bool:
        """Whether a sequence in `prefilling` (running, or admitted this step, with prompt tokens
        left) computes the tokens right after `seq`'s `cached` prefix: `seq` then waits, and finds
        them cached once that sequence inserted them."""
        span = self.block_manager.block_size  # the shortest shared span worth waiting a step for
        for other in prefilling:
            if other.request is seq.request:  # a sibling sample: the same prompt, computed once
                return seq.num_prompt_tokens > 1
            end = cached + span
            if end < seq.num_tokens and end <= other.num_prompt_tokens and \
                    other.token_ids[cached:end] == seq.token_ids[cached:end]:  # fmt: skip
                return True
        return False

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSequence | None:
        """Move `seq` from waiting to running with its cached prefix and up to `budget` new tokens,
        or leave it waiting (None) when the blocks are not there."""
        bm, cache = self.block_manager, self.prefix_cache
        cached, node, blocks = 0, None, []
        if cache is not None:  # at least one token is computed, so that the step has logits to sample
            match = cache.match(seq.token_ids, seq.num_tokens - 1, touch=True)
            cached, node, blocks = match.length, match.node, match.blocks
            cache.lock(node)  # pins the matched blocks: the eviction below must not take them
        full = cached // bm.block_size
        num_tokens = min(seq.num_tokens - cached, budget)
        if not bm.can_allocate(bm.blocks_to_hold(cached + num_tokens) - full):
            if cache is None:
                return None
            cache.unlock(node)
            if self.running or not cached:
                return None  # blocks come back as the running sequences finish
            # Nothing runs, so everything cached is evictable: without its match (whose partial
            # block's copy takes one block more) a sequence that fits the pool is admitted.
            cached, node, blocks, full = 0, None, [], 0
            num_tokens = min(seq.num_tokens, budget)
            if not bm.can_allocate(bm.blocks_to_hold(num_tokens)):
                return None
        self.waiting.remove(seq)
        for block in blocks[:full]:
            bm.share(block)
        seq.block_table = list(blocks[:full])
        if cached % bm.block_size:  # copy on write: this sequence writes after the match, in its own block
            copy = bm.allocate_block()
            self._copies.append((blocks[full], copy))  # the source stays pinned by the lock on `node`
            seq.block_table.append(copy)
        seq.num_computed_tokens = cached
        seq.cache_node = node
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = cached
            if seq.index == 0:
                seq.request.num_cached_tokens = cached
            self.prefix_query_tokens += seq.num_prompt_tokens
            self.prefix_hit_tokens += cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        bm.allocate(seq, num_tokens)
        return ScheduledSequence(seq, num_tokens)

    def fork(self, parent: Sequence) -> list[Sequence]:
        """After a step computed `parent`'s whole prompt (with a prefix cache): start its request's
        samples that never ran from it, sharing its full prompt blocks and copying its partial last
        one (`take_copies`, before `parent` writes there again).  They sample from `parent`'s logits
        in this step.  Returns the forked samples, as many as `max_num_seqs` and the blocks allow
        (the others are admitted later, matching the cached prompt)."""
        if self.prefix_cache is None:
            return []
        bm, prompt = self.block_manager, parent.num_prompt_tokens
        full, partial = prompt // bm.block_size, prompt % bm.block_size > 0
        forked = []
        for sibling in parent.request.seqs:
            if (
                sibling is parent
                or sibling.status is not SequenceStatus.WAITING
                or sibling.num_cached_tokens is not None
            ):
                continue
            if len(self.running) >= self.max_num_seqs or not bm.can_allocate(int(partial)):
                break
            self.waiting.remove(sibling)
            for block in parent.block_table[:full]:
                bm.share(block)
            sibling.block_table = parent.block_table[:full]
            if partial:
                copy = bm.allocate_block()
                self._copies.append((parent.block_table[full], copy))
                sibling.block_table.append(copy)
            self.prefix_cache.lock(parent.cache_node)
            sibling.cache_node = parent.cache_node
            sibling.num_computed_tokens = sibling.num_cached_tokens = prompt
            self.prefix_query_tokens += prompt
            self.prefix_hit_tokens += prompt
            sibling.status = SequenceStatus.RUNNING
            self.running.append(sibling)
            forked.append(sibling)
        return forked

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it for recompute ahead of everything waiting (its computed
        tokens stay in the prefix cache, if any, until evicted)."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.waiting_since = self.num_steps
        self.waiting.appendleft(seq)  # victims go latest first, so the queue stays in arrival order
        self.num_preemptions += 1

    def cache_prefill(self, seq: Sequence) -> None:
        """After a step computed prompt tokens of `seq`: cache them, so that others can share them."""
        if self.prefix_cache is not None:
            self.prefix_cache.cache_sequence(seq, done=False)

    def finish(self, seq: Sequence) -> None:
        """`seq` is done: it leaves the running queue and its blocks are freed at once."""
        self.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of whichever queue holds it and free its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if self.prefix_cache is not None and (seq.block_table or seq.cache_node is not None):
            self.prefix_cache.cache_sequence(seq, done=True)
        self.block_manager.free(seq)
