"""Prefix sharing: a radix tree from token prefixes to the paged KV cache's blocks (SGLang's RadixAttention).

Each node holds an edge of tokens, positions [start, end) of every sequence that passes through
it, and the blocks of block indices start // block_size .. ceil(end / block_size) - 1.  The
invariant: a node's block of index b holds valid keys and values for the path's positions from
b * block_size up to min((b + 1) * block_size, end).  Two nodes hold the same block where an edge
was split inside it (the block serves both halves); two branches that part inside a block hold a
block each (each branch's tokens differ after the parting).

Matching is token-granular: a request reuses every full block of its longest cached prefix by
reference, and when the match ends inside a block, that block is copied into a fresh one (copy on
write: the request writes its own tokens after the match) — the scheduler plans the copy and the
model runner performs it before the step's forward.

Blocks are held through the block manager's reference counts.  A sequence using a path *locks* its
last node (and so its ancestors); a locked node's blocks are pinned.  Unlocked leaves are evicted
least recently used first, block by block from their ends, when the free list runs short: the
block manager calls `evict`.  A
sequence that finishes or is preempted inserts its computed tokens instead of dropping them, and a
prefilling one inserts each chunk, so that requests arriving meanwhile share its prompt.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tessera.llm.block_manager import BlockManager
from tessera.llm.sequence import Sequence


class _Node:
    """An edge of the tree: tokens key at positions [start, start + len(key)), and their blocks."""

    __slots__ = ("parent", "children", "key", "start", "blocks", "lock_ref", "last_access")

    def __init__(self, parent: _Node | None, key: list[int], start: int, blocks: list[int]) -> None:
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.key = key
        self.start = start
        self.blocks = blocks
        self.lock_ref = 0  # sequences whose locked path runs through this node
        self.last_access = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)


@dataclass
class PrefixMatch:
    """A cached prefix: `length` tokens ending in `node` (None: nothing matched), and the block ids
    of block indices 0 .. ceil(length / block_size) - 1, the last one partial when length isn't a
    multiple of the block size."""

    length: int
    node: _Node | None
    blocks: list[int] = field(default_factory=list)


def _common(key: list[int], tokens: list[int], pos: int, limit: int) -> int:
    """How many of key's tokens equal tokens[pos:limit], from the start."""
    n = min(len(key), limit - pos)
    if (key if n == len(key) else key[:n]) == tokens[pos : pos + n]:  # the usual case, compared in C
        return n
    i = 0
    while key[i] == tokens[pos + i]:
        i += 1
    return i


class PrefixCache:
    """The radix tree over one block manager's blocks; it becomes that manager's evictor."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.root = _Node(None, [], 0, [])
        self._clock = itertools.count(1)  # LRU time: a counter, so that eviction order is reproducible
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, tie, leaf); stale entries skipped
        self._tie = itertools.count()
        self.num_nodes = 0
        self.num_tokens = 0  # tokens held by the tree's edges
        self.num_evicted_blocks = 0
        block_manager.evictor = self.evict

    # -- lookups ------------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int | None = None, touch: bool = False) -> PrefixMatch:
        """The longest cached prefix of tokens[:limit].  touch: mark its nodes as just used (LRU)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node, pos, last = self.root, 0, None
        blocks: list[int] = []
        now = next(self._clock) if touch else 0
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            c = _common(child.key, tokens, pos, limit)
            del blocks[child.start // self.block_size :]  # a block shared with the parent: the child's copy
            blocks.extend(child.blocks)
            pos += c
            last = child
            if touch:
                child.last_access = now
            if c < len(child.key):
                break
            node = child
        if last is None:
            return PrefixMatch(0, None)
        if touch:
            self._push_if_evictable(last)
        return PrefixMatch(pos, last, blocks[: -(-pos // self.block_size)])

    # -- updates ------------------------------------------------------------------------------
    def insert(self, tokens: list[int], length: int, blocks: list[int]) -> PrefixMatch:
        """Cache tokens[:length], whose keys and values are in `blocks` (block indices 0 ..
        ceil(length / block_size) - 1).  The tree takes a reference to the blocks of the part it did
        not hold yet; returns the whole prefix's match (a node ending exactly at `length`, and the
        tree's blocks, which for the part cached before are not `blocks`' own)."""
        if length <= 0:
            return PrefixMatch(0, None)
        bs = self.block_size
        if len(blocks) < -(-length // bs):
            raise ValueError(f"{length} tokens need {-(-length // bs)} blocks, got {len(blocks)}")
        now = next(self._clock)
        node, pos = self.root, 0
        path: list[int] = []
        while pos < length:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            c = _common(child.key, tokens, pos, length)
            if c < len(child.key):
                child = self._split(child, c)
            child.last_access = now
            del path[child.start // bs :]
            path.extend(child.blocks)
            pos += c
            node = child
        if pos < length:
            first = pos // bs
            leaf = _Node(node, tokens[pos:length], pos, list(blocks[first : -(-length // bs)]))
            for block in leaf.blocks:
                self.block_manager.hold(block, pinned=False)
            leaf.last_access = now
            node.children[tokens[pos]] = leaf
            self.num_nodes += 1
            self.num_tokens += length - pos
            del path[first:]
            path.extend(leaf.blocks)
            node = leaf
        self._push_if_evictable(node)
        return PrefixMatch(length, node, path)

    def _split(self, node: _Node, c: int) -> _Node:
        """Cut node's edge after c tokens; returns the new upper half (node keeps the lower one, so
        references to it, such as a sequence's locked node, still name the end of its path)."""
        bs, parent = self.block_size, node.parent
        assert parent is not None and 0 < c < len(node.key)
        p, first = node.start + c, node.start // bs
        upper = _Node(parent, node.key[:c], node.start, node.blocks[: -(-p // bs) - first])
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        parent.children[upper.key[0]] = upper
        node.blocks = node.blocks[p // bs - first :]
        node.key, node.start, node.parent = node.key[c:], p, upper
        upper.children[node.key[0]] = node
        if p % bs:  # the block holding position p serves both halves: one more holder
            self.block_manager.hold(upper.blocks[-1], pinned=upper.lock_ref > 0)
        self.num_nodes += 1
        return upper

    def lock(self, node: _Node | None) -> None:
        """A sequence uses the path to `node`: pin its blocks and keep it from eviction."""
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                for block in node.blocks:
                    self.block_manager.pin(block)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node | None) -> None:
        """The inverse of `lock`."""
        while node is not None and node is not self.root:
            if node.lock_ref < 1:
                raise RuntimeError("prefix cache: a node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                for block in node.blocks:
                    self.block_manager.unpin(block)
                self._push_if_evictable(node)
            node = node.parent

    def cache_sequence(self, seq: Sequence, done: bool) -> None:
        """Insert `seq`'s computed tokens.  done (finished, preempted, aborted): drop its lock; its
        blocks are freed next by the caller and live on in the tree.  Otherwise `seq` keeps running:
        it locks the path just inserted, and its full blocks that the tree held already are swapped
        for the tree's (the duplicates go back to the free list)."""
        n = seq.num_computed_tokens
        match = self.insert(seq.token_ids, n, seq.block_table)
        old, seq.cache_node = seq.cache_node, None
        if not done:
            self.lock(match.node)
            seq.cache_node = match.node
            table = seq.block_table
            for i in range(n // self.block_size):  # full blocks: the partial last one is written on
                if table[i] != match.blocks[i]:
                    self.block_manager.share(match.blocks[i])
                    self.block_manager.release(table[i])
                    table[i] = match.blocks[i]
        self.unlock(old)

    # -- eviction -----------------------------------------------------------------------------
    def _push_if_evictable(self, node: _Node) -> None:
        if node is not self.root and not node.children and node.lock_ref == 0:
            heapq.heappush(self._heap, (node.last_access, next(self._tie), node))
            if len(self._heap) > 4 * self.num_nodes + 64:  # drop stale entries now and then
                self._heap = [e for e in self._heap if self._valid(e)]
                heapq.heapify(self._heap)

    @staticmethod
    def _valid(entry: tuple[int, int, _Node]) -> bool:
        access, _, node = entry
        return node.parent is not None and not node.children and node.lock_ref == 0 and node.last_access == access

    def evict(self, num_blocks: int) -> int:
        """Evict from unlocked leaves, least recently used first, until `num_blocks` blocks went back
        to the free list or nothing is left to evict; returns the blocks freed.  A leaf longer than
        what is needed loses only its last blocks (the head of a prefix is the likelier to be shared)."""
        free, bs = self.block_manager.free_blocks, self.block_size
        start = len(free)
        while len(free) - start < num_blocks and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._valid(entry):
                continue
            node = entry[2]
            keep = len(node.blocks) - (num_blocks - (len(free) - start))
            end = (node.start // bs + keep) * bs
            if keep > 0 and end > node.start:  # cut the edge back to a block boundary
                for block in node.blocks[keep:]:
                    self.block_manager.unhold(block, pinned=False)
                del node.blocks[keep:]
                self.num_tokens -= node.end - end
                node.key = node.key[: end - node.start]
                heapq.heappush(self._heap, entry)  # still the least recently used leaf
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            for block in node.blocks:
                self.block_manager.unhold(block, pinned=False)
            node.parent = None
            self.num_nodes -= 1
            self.num_tokens -= len(node.key)
            self._push_if_evictable(parent)
        freed = len(free) - start
        self.num_evicted_blocks += freed
        return freed

    def reset(self) -> int:
        """Evict every unlocked node (a cold cache for benchmarks); returns the blocks freed."""
        return self.evict(self.block_manager.num_blocks)
