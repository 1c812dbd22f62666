"""CUDA graphs for decode steps: one graph per bucketed batch size, captured largest first into one pool.

A decode step (every scheduled sequence computes one token and samples) is the same kernels at every
step of a given batch size; only the contents of a few small tensors change.  So each bucket's
forward is captured once into a CUDA graph reading *static* input buffers, and a step writes its
token ids, positions, cache slots, block tables and context lengths into those buffers and replays
the graph of the smallest bucket that holds its batch.  The padding rows of a bucket write no cache
slot (slot -1) and attend one cached key of block 0, so they cost little and change nothing; their
logits are dropped.

All int32 inputs live in one device buffer filled from one pinned host buffer by one copy per step
(no tensor is built per step); the int64 token ids and positions the model takes are converted from
it inside the graph.  All graphs share one memory pool: captured largest first, a smaller batch's
graph reuses the larger one's memory instead of taking its own.

On a CPU model the same buffers and buckets run the forward directly (`capture=False`), which is how
the CPU tier tests everything here except the capture itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tessera.llm.attention import PagedStep

log = logging.getLogger("tessera")

# Buckets up to this batch are powers of two; above it, multiples of it (fewer graphs to capture,
# and a decode step's time grows little with its batch: the weights are read once either way).
POWER_OF_TWO_LIMIT = 64


def batch_buckets(max_batch: int) -> list[int]:
    """The captured batch sizes for up to `max_batch` sequences: 1, 2, 4, .., 64, 128, 192, ...,
    and max_batch itself, ascending."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {1 << i for i in range(POWER_OF_TWO_LIMIT.bit_length()) if 1 << i < max_batch}
    sizes.update(range(2 * POWER_OF_TWO_LIMIT, max_batch, POWER_OF_TWO_LIMIT))
    sizes.add(max_batch)
    return sorted(sizes)


@dataclass
class DecodeGraphStats:
    """What capturing cost: the batch sizes, seconds, and device memory the graphs' pool took."""

    batch_sizes: list[int]
    capture_s: float
    memory_bytes: int


class DecodeGraphs:
    """The decode steps of one model runner, as replays of graphs over static inputs.

    forward: the model's forward (eager or compiled); cache_handle: the runner's KV caches;
    max_blocks_per_seq: the block table width (max_model_len / block_size, rounded up).
    """

    def __init__(self, forward: Callable[..., object], *, device: torch.device, cache_handle: int, max_batch: int,
                 max_blocks_per_seq: int, capture: bool) -> None:  # fmt: skip
        self.forward = forward
        self.device = device
        self.cache_handle = cache_handle
        self.batch_sizes = batch_buckets(max_batch)
        self.max_batch = self.batch_sizes[-1]
        self.width = max_blocks_per_seq
        b, w = self.max_batch, self.width
        # One int32 buffer: ids [b], positions [b], slots [b], seq_lens [b], block tables [b * w].
        self._host = torch.zeros(4 * b + b * w, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._host_np = self._host.numpy()
        self._packed = torch.zeros_like(self._host, device=device)
        self.ids32, self.positions32, self.slots, self.seq_lens = self._packed[: 4 * b].view(4, b)
        self.block_tables = self._packed[4 * b :].view(b, w)
        self.input_ids = torch.zeros(1, b, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, b, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.logits_to_keep = torch.arange(b, dtype=torch.long, device=device)
        self._write_padding(0)
        self._packed.copy_(self._host)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.stats = self._capture() if capture else None

    def _run(self, batch: int) -> torch.Tensor:
        """The forward over the first `batch` rows of the static buffers; logits [batch, vocab]."""
        self.input_ids.copy_(self.ids32.view(1, -1))
        self.position_ids.copy_(self.positions32.view(1, -1))
        step = PagedStep(self.cache_handle, self.slots[:batch], self.block_tables[:batch], self.seq_lens[:batch],
                         self.query_start_loc[: batch + 1])  # fmt: skip
        with torch.inference_mode():
            out = self.forward(input_ids=self.input_ids[:, :batch], position_ids=self.position_ids[:, :batch],
                               use_cache=False, logits_to_keep=self.logits_to_keep[:batch], tessera_step=step)  # fmt: skip
        return out.logits[0]

    def _capture(self) -> DecodeGraphStats:
        """Capture every bucket, largest first, into one pool (each warmed up once outside capture:
        the first call builds kernels and allocates, which a capture must not do)."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.batch_sizes):
            self._run(batch)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._run(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        stats = DecodeGraphStats(self.batch_sizes, time.perf_counter() - start,
                                 torch.cuda.memory_reserved(self.device) - before)  # fmt: skip
        log.info("tessera.llm: captured %d decode graphs (batch %d..%d) in %.1f s, %.1f MiB", len(self.batch_sizes),
                 self.batch_sizes[0], self.max_batch, stats.capture_s, stats.memory_bytes / 2**20)  # fmt: skip
        return stats

    def bucket(self, batch: int) -> int:
        """The smallest captured batch size holding `batch` sequences."""
        for size in self.batch_sizes:
            if size >= batch:
                return size
        raise ValueError(f"a decode batch of {batch} exceeds the largest captured one ({self.max_batch})")

    def run(self, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor:  # fmt: skip
        """One decode step of len(token_ids) sequences (row i: its new token, that token's position
        and cache slot, its block table); the logits [batch, vocab] of their next tokens."""
        n = len(token_ids)
        batch = self.bucket(n)
        b, host = self.max_batch, self._host_np
        host[0:n] = token_ids
        host[b : b + n] = positions
        host[2 * b : 2 * b + n] = slots
        host[3 * b : 3 * b + n] = [p + 1 for p in positions]  # context length: through the new token
        tables = host[4 * b :].reshape(b, self.width)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
            tables[row, len(table) :] = 0
        self._write_padding(n)
        # Only the rows a bucket reads travel (the block tables are the bulk of the buffer).
        length = 4 * b + batch * self.width
        self._packed[:length].copy_(self._host[:length], non_blocking=True)
        if batch in self.graphs:
            self.graphs[batch].replay()
            return self.outputs[batch][:n]
        return self._run(batch)[:n]

    def _write_padding(self, n: int) -> None:
        """Rows n.. of the host buffer: token 0 at position 0, written nowhere, attending one key."""
        b, host = self.max_batch, self._host_np
        host[n:b] = 0
        host[b + n : 2 * b] = 0
        host[2 * b + n : 3 * b] = -1
        host[3 * b + n : 4 * b] = 1
        host[4 * b + n * self.width :] = 0
