"""The paged KV cache's bookkeeping: fixed-size blocks, a free list and reference counts.

The cache itself (tensors per layer) belongs to the model runner; this class only decides which
block numbers a sequence owns.  A sequence's `block_table[i]` holds its tokens
`i * block_size ... (i + 1) * block_size - 1`.  Reference counts let several holders share a
block: sequences, and the prefix cache's tree (prefix_cache.py).  A block returns to the free
list when its count drops to 0.

Each block also counts its *pins*: the holders that keep it from eviction (sequences, and tree
nodes that a sequence has locked).  A held block without pins is held by unlocked tree nodes only,
so the prefix cache can evict it; `allocate` asks the cache (`evictor`) to evict such blocks when
the free list runs short, and `can_allocate` counts them as available.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tessera.llm.sequence import Sequence


class BlockManager:
    """Hands out the `num_blocks` blocks of `block_size` tokens each of the paged KV cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.pins = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.num_evictable_blocks = 0  # held, unpinned: only unlocked prefix-tree nodes hold them
        # evictor(n): free at least n evictable blocks (the prefix cache sets it; None: no cache).
        self.evictor: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks in use by sequences (and locked tree nodes); evictable cached blocks are not counted."""
        return self.num_blocks - len(self.free_blocks) - self.num_evictable_blocks

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can get: free ones and evictable cached ones."""
        return len(self.free_blocks) + self.num_evictable_blocks

    def blocks_to_hold(self, num_tokens: int) -> int:
        """How many blocks `num_tokens` tokens fill."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks `seq` needs so that its next `num_new_tokens` tokens have slots."""
        return max(0, self.blocks_to_hold(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_available_blocks

    def _make_room(self, num_blocks: int) -> None:
        if num_blocks > self.num_available_blocks:
            raise RuntimeError(f"{num_blocks} blocks asked for, {len(self.free_blocks)} free and "
                               f"{self.num_evictable_blocks} evictable (check can_allocate first)")  # fmt: skip
        if num_blocks > len(self.free_blocks) and self.evictor is not None:
            self.evictor(num_blocks - len(self.free_blocks))
        if num_blocks > len(self.free_blocks):  # the evictor broke its promise: a bookkeeping bug
            raise RuntimeError(f"eviction left {len(self.free_blocks)} free blocks, {num_blocks} needed")

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend `seq`'s block table to hold its next `num_new_tokens` tokens (evicting if needed)."""
        needed = self.blocks_needed(seq, num_new_tokens)
        self._make_room(needed)
        for _ in range(needed):
            seq.block_table.append(self._take())

    def allocate_block(self) -> int:
        """One fresh block held (and pinned) by the caller, evicting if needed; `release` returns it."""
        self._make_room(1)
        return self._take()

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        self.pins[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more pinned holder (a sequence) of a block already in use."""
        if self.ref_counts[block] < 1:
            raise RuntimeError(f"block {block} is free; only used blocks can be shared")
        self.hold(block, pinned=True)

    def release(self, block: int) -> None:
        """Drop one pinned holder's reference (the inverse of `share` or `allocate_block`)."""
        self.unhold(block, pinned=True)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; blocks nobody holds go back to the free list."""
        for block in reversed(seq.block_table):
            self.unhold(block, pinned=True)
        seq.block_table = []

    # -- the prefix cache's side: holds by tree nodes, pinned while the node is locked -------------
    def _evictable(self, block: int) -> bool:
        return self.ref_counts[block] > 0 and self.pins[block] == 0

    def hold(self, block: int, pinned: bool) -> None:
        """One more holder of `block` (in use already), pinned or not."""
        before = self._evictable(block)
        self.ref_counts[block] += 1
        self.pins[block] += pinned
        self.num_evictable_blocks += self._evictable(block) - before

    def unhold(self, block: int, pinned: bool) -> None:
        """One holder fewer; the block is free when none is left."""
        if self.ref_counts[block] < 1 or (pinned and self.pins[block] < 1):
            raise RuntimeError(f"block {block} released more often than held")
        before = self._evictable(block)
        self.ref_counts[block] -= 1
        self.pins[block] -= pinned
        self.num_evictable_blocks += self._evictable(block) - before
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    def pin(self, block: int) -> None:
        """An existing holder now keeps `block` from eviction (its tree node was locked)."""
        before = self._evictable(block)
        self.pins[block] += 1
        self.num_evictable_blocks += self._evictable(block) - before

    def unpin(self, block: int) -> None:
        before = self._evictable(block)
        self.pins[block] -= 1
        self.num_evictable_blocks += self._evictable(block) - before
