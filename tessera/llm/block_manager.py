"""The paged KV cache's bookkeeping: fixed-size blocks, a free list and reference counts.

The cache itself (tensors per layer) belongs to the model runner; this class only decides which
block numbers a sequence owns.  A sequence's `block_table[i]` holds its tokens
`i * block_size ... (i + 1) * block_size - 1`.  Reference counts let several sequences share a
block (prefix sharing builds on them): a block returns to the free list when its count drops to 0.
"""

from __future__ import annotations

from collections import deque

from tessera.llm.sequence import Sequence


class BlockManager:
    """Hands out the `num_blocks` blocks of `block_size` tokens each of the paged KV cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_to_hold(self, num_tokens: int) -> int:
        """How many blocks `num_tokens` tokens fill."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks `seq` needs so that its next `num_new_tokens` tokens have slots."""
        return max(0, self.blocks_to_hold(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend `seq`'s block table to hold its next `num_new_tokens` tokens."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self.free_blocks):
            raise RuntimeError(f"{needed} blocks asked for, {len(self.free_blocks)} free (check can_allocate first)")
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def share(self, block: int) -> None:
        """One more holder of a block already in use (prefix sharing)."""
        if self.ref_counts[block] < 1:
            raise RuntimeError(f"block {block} is free; only used blocks can be shared")
        self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; blocks nobody holds go back to the free list."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
