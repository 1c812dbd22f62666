"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a budget of `max_num_batched_tokens` tokens.  Running sequences go first, oldest
first: a decoding one takes 1 token, one still prefilling takes the rest of its prompt or what the
budget leaves (chunked prefill), so prefills and decodes share one forward pass.  Then waiting
sequences are admitted, oldest first, while budget, free blocks and `max_num_seqs` allow.

When a running sequence needs a block and none is free, the latest-arrived running sequence is
preempted by recompute: its blocks are freed, its computed count drops to 0, and it goes back to
the front of the waiting queue with every token it has, so it resumes later where it stopped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tessera.llm.block_manager import BlockManager
from tessera.llm.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """A sequence in this step and how many of its uncomputed tokens the step computes."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when the step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    """The waiting and running queues over one block manager."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, "
                             f"{max_num_batched_tokens}")  # fmt: skip
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSequence]:
        """Pick this step's sequences and allocate the blocks their new tokens need."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(self.block_manager.blocks_needed(seq, num_tokens)):
                victim = self.running[-1]  # the latest arrival; never one scheduled already (index >= i)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing after it runs either
            self.block_manager.allocate(seq, num_tokens)
            scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens
            i += 1
        # Admitting new work right after a preemption would only preempt again next step.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(self.block_manager.blocks_needed(seq, num_tokens)):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.block_manager.allocate(seq, num_tokens)
            scheduled.append(ScheduledSequence(seq, num_tokens))
            budget -= num_tokens
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it for recompute ahead of everything waiting."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)  # victims go latest first, so the queue stays in arrival order
        self.num_preemptions += 1

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
        self.block_manager.free(seq)
