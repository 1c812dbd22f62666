"""The engine loop: requests in, one scheduled step at a time, RequestOutputs out.

`LLMEngine` is synchronous and single-threaded: the caller adds requests, calls `step()` until
`has_unfinished_requests()` is False, and reads each step's outputs (the offline `LLM` and the
server both drive it this way).  A step schedules (scheduler), runs the packed forward
(model_runner), samples (sampler), and applies the stop rules (tokenizer).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from tessera.errors import RequestError
from tessera.llm.block_manager import BlockManager
from tessera.llm.loader import load_model
from tessera.llm.model_runner import ModelRunner
from tessera.llm.outputs import RequestOutput
from tessera.llm.parallel.group import TensorParallelError, TensorParallelGroup
from tessera.llm.prefix_cache import PrefixCache
from tessera.llm.sampler import Sampler
from tessera.llm.sampling_params import SamplingParams
from tessera.llm.scheduler import ScheduledSequence, Scheduler
from tessera.llm.sequence import Request, Sequence
from tessera.llm.tokenizer import IncrementalDetokenizer, append_token

# Tokens one step computes at most when max_num_batched_tokens is not given (longer prompts are
# prefilled in chunks of this many tokens).
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


def _compiles(enforce_eager: bool, compile_model: bool | None) -> bool:
    """Whether the model runs through torch.compile(backend=tessera): only when asked for.

    On the CPU the compiled step measured slower than eager torch (tiny Llama, 32 requests:
    1,650 vs 2,450 tokens/s, after ~10 s of compiling), and the CUDA path is not measured yet."""
    return bool(compile_model) and not enforce_eager


class StepFailure(RuntimeError):
    """A step's forward or sampling raised: its requests (`request_ids`) were aborted, nothing else."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        self.request_ids = request_ids
        super().__init__(f"the step of {len(request_ids)} request(s) failed: {type(cause).__name__}: {cause}")


@dataclass
class EngineStats:
    """A snapshot of the engine's load and counters (the server's /metrics reads it)."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_kv_blocks_used: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    num_requests_finished: int
    prefix_caching: bool = False
    num_kv_blocks_cached: int = 0  # held only by the prefix cache: reusable, evicted when needed
    prefix_cache_query_tokens: int = 0  # prompt tokens of admitted sequences (first admission only)
    prefix_cache_hit_tokens: int = 0  # of those, tokens whose KV came from the prefix cache

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens looked up (0 before any lookup)."""
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0


class LLMEngine:
    """Serves generation requests over a paged KV cache with continuous batching.

    model: a local Hugging Face model directory or a transformers model object (see loader.py).
    max_model_len: the context length (default: the config's max_position_embeddings).
    num_kv_blocks: the KV pool's size in blocks of block_size tokens (default: sized from memory).
    enable_prefix_caching: share cached prompt prefixes between requests (prefix_cache.py).
    The other arguments are LLM's, documented there.  After construction, `enforce_eager` says whether
    the model runs eagerly (True) or compiled by tessera's torch front end.
    """

    def __init__(self, model: str | Path | transformers.PreTrainedModel, *, tokenizer: Any = None,
                 dtype: str | torch.dtype = "auto", quantization: str | None = None,
                 device: str | torch.device | None = None, max_num_seqs: int = 256, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, gpu_memory_utilization: float = 0.9,
                 block_size: int = 16, num_kv_blocks: int | None = None, enforce_eager: bool = False,
                 seed: int = 0, compile_model: bool | None = None, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int = 1) -> None:  # fmt: skip
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        sizes = {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len, "block_size": block_size,
                 "max_num_batched_tokens": max_num_batched_tokens, "num_kv_blocks": num_kv_blocks,
                 "tensor_parallel_size": tensor_parallel_size}  # fmt: skip
        for name, value in sizes.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        # tensor_parallel_size=1: no group and no worker, the single-process path.  Otherwise the
        # group's finalizer stops its workers if anything below raises.
        self.parallel: TensorParallelGroup | None = None
        if tensor_parallel_size > 1:
            self.parallel = TensorParallelGroup(model, tensor_parallel_size, device, dtype, quantization,
                                                _compiles(enforce_eager, compile_model))  # fmt: skip
        shard = self.parallel.shard if self.parallel is not None else None
        loaded = load_model(model, tokenizer, dtype, device, quantization, shard=shard)
        self.tokenizer = loaded.tokenizer
        self.model_name: str = loaded.name
        self.eos_token_ids = loaded.eos_token_ids
        self.sampling_defaults = loaded.sampling_defaults
        config = loaded.model.config.get_text_config()
        limit = getattr(config, "max_position_embeddings", None)
        if max_model_len is not None and limit is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
        self.max_model_len: int = max_model_len or limit or 2048
        batched = max_num_batched_tokens or DEFAULT_BATCHED_TOKENS.get(device.type, 2048)
        runner_args = dict(device=device, block_size=block_size, max_model_len=self.max_model_len,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=batched, num_kv_blocks=num_kv_blocks,
                           gpu_memory_utilization=gpu_memory_utilization,
                           compile_model=_compiles(enforce_eager, compile_model))  # fmt: skip
        if self.parallel is None:
            # Decode steps replay CUDA graphs (not yet across tensor-parallel workers).
            self.runner = ModelRunner(loaded, **runner_args, decode_graphs=device.type == "cuda" and not enforce_eager)
        else:
            self.runner = self.parallel.start_runner(loaded, **runner_args)
        if self.runner.num_kv_blocks * block_size < self.max_model_len:
            raise ValueError(f"the KV cache holds {self.runner.num_kv_blocks} blocks x {block_size} tokens = "
                             f"{self.runner.num_kv_blocks * block_size} tokens, less than one sequence of "
                             f"max_model_len={self.max_model_len}: raise num_kv_blocks or lower max_model_len")  # fmt: skip
        self.enforce_eager = not self.runner.compiled
        self.block_manager = BlockManager(self.runner.num_kv_blocks, block_size)
        self.prefix_cache = PrefixCache(self.block_manager) if enable_prefix_caching else None
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, batched, prefix_cache=self.prefix_cache)
        self.sampler = Sampler(seed, device)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished = 0
        # Per-step (tokens computed, KV positions read) for rooflines (bench/serving_suite.py);
        # None until enable_step_log, so serving pays one `is None` test per step.
        self.step_log: deque[tuple[int, int]] | None = None

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected, or at exit)."""
        if self.parallel is not None:
            self.parallel.close()

    def enable_step_log(self, maxlen: int = 1 << 20) -> deque[tuple[int, int]]:
        """Record every later step as (tokens computed, KV positions read) in a fresh deque of the
        latest `maxlen` steps, and return it.  KV positions read = the sum over the step's sequences
        of their context length after the step (what its attention reads from the cache)."""
        self.step_log = deque(maxlen=maxlen)
        return self.step_log

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, ...)."""
        return SamplingParams(**self.sampling_defaults)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    stream: bool = True) -> None:  # fmt: skip
        """Queue a request; RequestError when it cannot be served as asked (nothing is queued then).

        `stream=False`: `step` returns its output only once it finishes (no per-step copy of its
        tokens, which for long sequences costs more host time than the step's launches)."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._prompt_tokens_of(prompt)
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        request = Request(request_id, text, token_ids, params, next(self._arrivals), stream=stream)
        for index in range(params.n):
            generator = self.sampler.make_generator(params.sample_seed(index))
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            request.seqs.append(Sequence(request, index, generator, detokenizer))
        self.requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
        self._prompt_tokens += len(token_ids)

    def _prompt_tokens_of(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer; this engine has none (pass token ids)")
            if not prompt:
                raise RequestError("the prompt is empty")
            token_ids = list(self.tokenizer(prompt)["input_ids"])
            text: str | None = prompt
        elif isinstance(prompt, SequenceOf) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids, text = list(prompt), None
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise RequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise RequestError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens; the context length is {self.max_model_len}, "
                               "which must hold the prompt and at least one new token")  # fmt: skip
        return text, token_ids

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its blocks at once; no output follows.  Unknown ids: no-op."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; the outputs of requests that produced tokens (a
        request added with stream=False only in the step that finishes it).

        Raises StepFailure when the model or the sampler raised: that step's requests are aborted
        and the engine can go on stepping the others."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.scheduler.has_unfinished():  # cannot happen while the pool holds one max_model_len sequence
                raise RuntimeError(f"no sequence could be scheduled: {self.block_manager.num_free_blocks} of "
                                   f"{self.block_manager.num_blocks} KV blocks free")  # fmt: skip
            return []
        sampling = [entry.seq for entry in scheduled if entry.samples]
        try:  # nothing below changes a sequence until the forward is done
            self.runner.copy_blocks(self.scheduler.take_copies())
            logits = self.runner.execute(scheduled)
        except TensorParallelError:
            raise  # the worker group is gone: no later step can run either
        except Exception as exc:
            raise self._fail_step(scheduled, exc) from exc
        for entry in scheduled:
            seq = entry.seq
            seq.num_computed_tokens += entry.num_tokens
            if entry.num_tokens > 1 or seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.scheduler.cache_prefill(seq)  # prompt (or recomputed) tokens: others may share them
        if self.step_log is not None:
            self.step_log.append((sum(e.num_tokens for e in scheduled),
                                  sum(e.seq.num_computed_tokens for e in scheduled)))  # fmt: skip
        if not sampling:
            return []
        try:
            logits = self._fork_samples(sampling, logits)
            sampled = self.sampler(logits, sampling, self.eos_token_ids)
        except Exception as exc:  # the step's KV is written and cached: only its requests end
            raise self._fail_step(scheduled, exc) from exc
        progressed: dict[str, Request] = {}
        for seq, token_id, logprob in zip(sampling, sampled.token_ids, sampled.logprobs, strict=True):
            if seq.logprobs is not None and logprob is not None:
                seq.logprobs.append(logprob)
            append_token(seq, token_id, self.eos_token_ids, self.max_model_len)
            self._generation_tokens += 1
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            progressed[seq.request.request_id] = seq.request
        outputs = []
        for request in progressed.values():
            if not (request.stream or request.finished):
                continue  # its new tokens and text add up until its one output
            outputs.append(request.output())
            for seq in request.seqs:
                seq.step_token_ids, seq.step_text = [], ""
            if request.finished:
                del self.requests[request.request_id]
                self._finished += 1
        return outputs

    def _fail_step(self, scheduled: list[ScheduledSequence], cause: Exception) -> StepFailure:
        """Abort the requests of a step whose forward or sampling raised; the rest of the queue
        is untouched (the step changed no sequence), so the engine serves on."""
        request_ids = list(dict.fromkeys(entry.seq.request.request_id for entry in scheduled))
        for request_id in request_ids:
            self.abort_request(request_id)
        return StepFailure(request_ids, cause)

    def _fork_samples(self, sampling: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Samples of n > 1 requests whose prompt a sibling computed in this step join `sampling`
        (forked by the scheduler), each with a copy of that sibling's logits row."""
        rows = list(range(len(sampling)))
        for row, seq in enumerate(list(sampling)):
            if seq.params.n > 1 and seq.num_output_tokens == 0:
                for sibling in self.scheduler.fork(seq):
                    sampling.append(sibling)
                    rows.append(row)
        if len(rows) == len(logits):
            return logits
        self.runner.copy_blocks(self.scheduler.take_copies())  # before the parents write those blocks
        return logits[rows]

    def reset_prefix_cache(self) -> int:
        """Evict every cached prefix no running request uses (benchmarks' cold starts); returns
        the blocks freed (0 without a prefix cache)."""
        return self.prefix_cache.reset() if self.prefix_cache is not None else 0

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                           num_kv_blocks=self.block_manager.num_blocks,
                           num_kv_blocks_used=self.block_manager.num_used_blocks,
                           prompt_tokens_total=self._prompt_tokens, generation_tokens_total=self._generation_tokens,
                           num_preemptions=self.scheduler.num_preemptions,
                           num_requests_finished=self._finished, prefix_caching=self.prefix_cache is not None,
                           num_kv_blocks_cached=self.block_manager.num_evictable_blocks,
                           prefix_cache_query_tokens=self.scheduler.prefix_query_tokens,
                           prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens)  # fmt: skip
