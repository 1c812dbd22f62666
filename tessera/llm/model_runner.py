"""Runs one scheduled step through the model over the paged KV cache.

All scheduled tokens of all sequences are packed into one row: input_ids [1, T] and position_ids
[1, T], with each token's cache slot (slot_mapping), each sequence's block table, context length
(seq_lens) and first row (query_start_loc) passed to the attention layers as a `PagedStep`.  The
LM head runs only on the rows whose next token is sampled (`logits_to_keep` with their indices).

The KV cache is one (key, value) pair per layer, each [num_blocks, block_size, KVH, D].  On the
CPU the pool has `num_kv_blocks` blocks, or as many as a memory budget holds; on CUDA, as many as
fit in `gpu_memory_utilization` of the GPU's memory after a profiling forward of the largest step.
With `decode_graphs`, steps that only decode replay CUDA graphs over static inputs (decode_graphs.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tessera.eager.paged_attention import copy_blocks
from tessera.frontend.torch import backend as tessera_backend
from tessera.llm.attention import PagedStep, register_kv_caches, release_kv_caches
from tessera.llm.decode_graphs import DecodeGraphs
from tessera.llm.loader import LoadedModel
from tessera.llm.parallel.layers import Communicator
from tessera.llm.scheduler import ScheduledSequence

log = logging.getLogger("tessera")

# The CPU pool's size when num_kv_blocks is not given: enough for max_num_seqs sequences of
# max_model_len tokens, but no more than this.
CPU_KV_CACHE_BYTES = 4 << 30


@dataclass
class StepBatch:
    """One step packed into plain lists (what tensor-parallel rank 0 sends its workers)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]
    seq_lens: list[int]
    query_start_loc: list[int]
    logits_rows: list[int]
    num_rows: int


class ModelRunner:
    """The model, its paged KV cache, and the packing of a step into one forward call.

    comm, num_kv_heads: for a tensor-parallel rank, its group and the KV heads it keeps (the pool's
    size is then the smallest over the ranks)."""

    def __init__(self, loaded: LoadedModel, *, device: torch.device, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, compile_model: bool = False,
                 comm: Communicator | None = None, num_kv_heads: int | None = None,
                 decode_graphs: bool = False) -> None:  # fmt: skip
        self.model = loaded.model
        self.device = device
        self.block_size = block_size
        config = self.model.config.get_text_config()
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = num_kv_heads or getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size = config.vocab_size
        self.dtype = self.model.dtype
        self.forward = self.model.forward
        self.compiled = compile_model
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if num_kv_blocks is None:
            num_kv_blocks = self._blocks_that_fit(max_model_len, max_num_seqs, max_num_batched_tokens,
                                                  gpu_memory_utilization)  # fmt: skip
        if comm is not None:  # every rank's pool must hold the blocks rank 0 hands out
            fewest = torch.tensor([num_kv_blocks], dtype=torch.int64, device=device)
            num_kv_blocks = int(comm.all_reduce(fewest, dist.ReduceOp.MIN).item())
        self.num_kv_blocks = num_kv_blocks
        self.kv_caches = self._allocate_cache(num_kv_blocks)
        self.cache_handle = register_kv_caches(self, self.kv_caches)
        if compile_model:
            # Symbolic sizes, and sizes padded to powers of two (see execute) so that steps reuse
            # the compiled graph and its plans; the paged ops stay torch custom ops between segments.
            self.forward = torch.compile(self.model.forward, backend=tessera_backend, dynamic=True)
        self.decode_graphs: DecodeGraphs | None = None
        if decode_graphs:
            self.decode_graphs = self._capture_decode_graphs(min(max_num_seqs, max_num_batched_tokens),
                                                             -(-max_model_len // block_size))  # fmt: skip

    def _capture_decode_graphs(self, max_batch: int, max_blocks_per_seq: int) -> DecodeGraphs | None:
        """CUDA graphs for decode steps; None, with a warning, when capturing fails (steps then run
        the forward directly: same results, more launch overhead)."""
        try:
            return DecodeGraphs(self.forward, device=self.device, cache_handle=self.cache_handle, max_batch=max_batch,
                                max_blocks_per_seq=max_blocks_per_seq, capture=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001  (any capture failure leaves the uncaptured path working)
            log.warning("tessera.llm: decode steps run without CUDA graphs: capturing failed (%s: %s)",
                        type(exc).__name__, exc)  # fmt: skip
            return None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, keys and values."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def _allocate_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(self.num_layers)]  # fmt: skip

    def _blocks_that_fit(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                         gpu_memory_utilization: float) -> int:  # fmt: skip
        wanted = max_num_seqs * -(-max_model_len // self.block_size)
        if self.device.type != "cuda":
            return max(1, min(wanted, CPU_KV_CACHE_BYTES // self.block_bytes))
        # Profile the largest step with a cache just big enough for it, then size the pool from
        # what is left under the utilisation cap.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = max_num_batched_tokens
        self.kv_caches = self._allocate_cache(-(-tokens // self.block_size))
        self.cache_handle = register_kv_caches(self, self.kv_caches)
        self.execute_dummy(tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        release_kv_caches(self.cache_handle)
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use_elsewhere = total - free - torch.cuda.memory_allocated(self.device)
        available = int(total * gpu_memory_utilization) - peak - in_use_elsewhere
        blocks = available // self.block_bytes
        if blocks < 1:
            raise MemoryError(f"no GPU memory left for the KV cache: the model's step peaks at {peak / 2**30:.2f} GiB "
                              f"of {total / 2**30:.2f} GiB x gpu_memory_utilization={gpu_memory_utilization}")  # fmt: skip
        log.info("tessera.llm: KV cache of %d blocks (%.2f GiB)", blocks, blocks * self.block_bytes / 2**30)
        return int(min(blocks, wanted))

    def execute_dummy(self, num_tokens: int) -> None:
        """One forward of `num_tokens` tokens as a single prefill over blocks 0.. (profiling)."""
        num_blocks = -(-num_tokens // self.block_size)
        step = PagedStep(self.cache_handle, self._int_tensor(range(num_tokens)),
                         self._int_tensor(range(num_blocks)).view(1, -1),
                         self._int_tensor([num_tokens]), self._int_tensor([0, num_tokens]))  # fmt: skip
        ids = torch.zeros(1, num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device).view(1, -1)
        with torch.inference_mode():
            self.forward(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1, tessera_step=step)

    def _int_tensor(self, values: object, dtype: type[np.integer] = np.int32) -> torch.Tensor:
        """A device tensor of Python ints (through numpy: torch.tensor on a list of 8k ints costs
        ~1 ms of host time, numpy a fifth of it); the tensor's dtype is the numpy one's."""
        array = np.asarray(values if isinstance(values, list) else list(values), dtype=dtype)
        return torch.from_numpy(array).to(self.device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block src to block dst in every layer's keys and values, for each (src, dst) pair
        (the prefix cache's copy on write of a partial block; before the step that writes dst)."""
        if not pairs:
            return
        src = self._int_tensor(s for s, _ in pairs)
        dst = self._int_tensor(d for _, d in pairs)
        for key_cache, value_cache in self.kv_caches:
            copy_blocks(key_cache, value_cache, src, dst)

    def execute(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Run the step; the logits [num_sampling, vocab] of the sequences that sample, in order."""
        graphs = self.decode_graphs
        if graphs is not None and len(scheduled) <= graphs.max_batch and all(e.num_tokens == 1 and e.samples
                                                                            for e in scheduled):  # fmt: skip
            return self._execute_decode(graphs, scheduled)
        return self.run(self.pack(scheduled))

    def pack(self, scheduled: list[ScheduledSequence]) -> StepBatch:
        """The step's tokens, positions, cache slots and metadata, padded when compiled."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        logits_rows: list[int] = []
        bs = self.block_size
        for entry in scheduled:
            seq = entry.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + entry.num_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            if end - start > _VECTOR_SLOTS:  # a prefill chunk: its slots in numpy
                p = np.arange(start, end)
                slots += (np.asarray(table)[p // bs] * bs + p % bs).tolist()
            else:
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + entry.num_tokens)
            if entry.samples:
                logits_rows.append(query_start_loc[-1] - 1)
        num_tokens, num_rows = len(input_ids), len(logits_rows)
        max_blocks = max(len(e.seq.block_table) for e in scheduled)
        tables = [e.seq.block_table + [0] * (max_blocks - len(e.seq.block_table)) for e in scheduled]
        if self.compiled:  # padding: tokens that write nowhere, empty sequences, repeated rows
            # At least 2 everywhere: dynamo specialises sizes 0 and 1, which would cost a recompile each
            # (sizes that happen to be equal when it compiles cost one more: dynamo's duck sizing).
            padded = _bucket(num_tokens, 8)
            input_ids += [0] * (padded - num_tokens)
            positions += [0] * (padded - num_tokens)
            slots += [-1] * (padded - num_tokens)
            max_blocks = _bucket(max_blocks, 2)
            tables = [t + [0] * (max_blocks - len(t)) for t in tables]
            tables += [[0] * max_blocks] * (_bucket(len(tables), 2) - len(tables))
            seq_lens += [0] * (len(tables) - len(seq_lens))
            query_start_loc += [query_start_loc[-1]] * (len(tables) + 1 - len(query_start_loc))
            logits_rows += [0] * (len(tables) - num_rows)  # as many as sequences: one size fewer to vary
        return StepBatch(input_ids, positions, slots, tables, seq_lens, query_start_loc, logits_rows, num_rows)

    def run(self, b: StepBatch) -> torch.Tensor:
        """The forward of a packed step; the logits of its sampling rows."""
        step = PagedStep(self.cache_handle, self._int_tensor(b.slots), self._int_tensor(b.tables),
                         self._int_tensor(b.seq_lens), self._int_tensor(b.query_start_loc))  # fmt: skip
        ids = self._int_tensor(b.input_ids, np.int64).view(1, -1)
        position_ids = self._int_tensor(b.positions, np.int64).view(1, -1)
        keep = self._int_tensor(b.logits_rows or [0], np.int64)
        with torch.inference_mode():
            out = self.forward(input_ids=ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep,
                               tessera_step=step)  # fmt: skip
        return out.logits[0, : b.num_rows]

    def _execute_decode(self, graphs: DecodeGraphs, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """A step where every sequence computes its one newest token, through the decode graphs."""
        bs = self.block_size
        positions = [e.seq.num_computed_tokens for e in scheduled]
        tables = [e.seq.block_table for e in scheduled]
        slots = [table[p // bs] * bs + p % bs for table, p in zip(tables, positions, strict=True)]
        token_ids = [e.seq.token_ids[p] for e, p in zip(scheduled, positions, strict=True)]
        return graphs.run(token_ids, positions, slots, tables)


_VECTOR_SLOTS = 64  # tokens of one sequence in a step above which its slots are computed in numpy


def _bucket(n: int, smallest: int = 1) -> int:
    """The power of two at or above n (at least `smallest`)."""
    return max(smallest, 1 << max(n - 1, 0).bit_length())
