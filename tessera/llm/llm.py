"""`LLM`: offline batch generation and a streaming iterator over one `LLMEngine`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from tessera.errors import RequestError
from tessera.llm.engine import LLMEngine
from tessera.llm.outputs import RequestOutput
from tessera.llm.sampling_params import SamplingParams
from tessera.progress import bar, progress

Prompt = str | list[int]


class LLM:
    """Generate text with a transformers decoder served by tessera's engine.

    model: a local Hugging Face directory (config.json, safetensors, tokenizer files,
    generation_config.json) or a transformers model object; nothing is downloaded.
    tokenizer: a tokenizer object or directory (default: the model directory's).
    dtype: "auto" (float32 on the CPU; the checkpoint's half type or bfloat16 on CUDA), a name or a torch.dtype.
    quantization: None, or a tessera.quantize weight type to round a float checkpoint's linears to at
    load time (lm_head stays float): "int4", "uint4", "int8", "e2m1", ... (tessera.quant.WEIGHT_TYPES),
    with scales per 128 inputs, or "int4:g64" per 64, or "int4:channel" per output channel.  A
    directory quantized with GPTQ, AWQ or compressed-tensors (config.json's quantization_config)
    loads its low-bit weights as stored; quantization must then be None or that method's name
    ("gptq", "awq", "compressed-tensors").  A conflict or a method tessera cannot load raises a
    ValueError (tessera.llm.checkpoint's error types).
    device: "cpu" or "cuda" (default: cuda when available).
    max_num_seqs: sequences running at once; max_num_batched_tokens: tokens one step computes at most.
    max_model_len: the context length (default: the model's); a longer prompt is refused.
    gpu_memory_utilization: the share of GPU memory the model and KV cache may take.
    block_size, num_kv_blocks: the paged KV cache's block size in tokens and size in blocks.
    enforce_eager: run the model eagerly: no compilation and, on CUDA, no CUDA graphs of decode steps
    (see tessera.llm.decode_graphs).  seed: the seed of unseeded requests' sampling.
    compile_model: compile the model with torch.compile(backend=tessera), unless enforce_eager (default
    off: on the CPU eager torch is faster for now, and the CUDA path is not measured yet).
    enable_prefix_caching: keep finished requests' KV in a radix tree and reuse the longest cached
    prefix of every new prompt (RequestOutput.num_cached_tokens says how much); False: recompute all.
    tensor_parallel_size: shard the model Megatron-style over this many processes, one per GPU
    (cuda:0..N-1 from `device`'s index; NCCL) or on the CPU (gloo); this process is rank 0 and
    schedules.  It needs a model directory whose heads and MLP divide by N (KV heads are replicated
    when there are fewer than N); `close()` stops the workers (so do garbage collection and exit).
    A worker's failure raises `TensorParallelError` here, and the LLM cannot be used after it.
    """

    def __init__(self, model: str | Path | transformers.PreTrainedModel, *, tokenizer: Any = None,
                 dtype: str | torch.dtype = "auto", quantization: str | None = None,
                 device: str | torch.device | None = None, max_num_seqs: int = 256, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, gpu_memory_utilization: float = 0.9,
                 block_size: int = 16, num_kv_blocks: int | None = None, enforce_eager: bool = False,
                 seed: int = 0, compile_model: bool | None = None, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int = 1) -> None:  # fmt: skip
        self.engine = LLMEngine(model, tokenizer=tokenizer, dtype=dtype, quantization=quantization, device=device,
                                max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                max_num_batched_tokens=max_num_batched_tokens,
                                gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
                                num_kv_blocks=num_kv_blocks, enforce_eager=enforce_eager, seed=seed,
                                compile_model=compile_model, enable_prefix_caching=enable_prefix_caching,
                                tensor_parallel_size=tensor_parallel_size)  # fmt: skip
        self._ids = itertools.count()

    @property
    def device(self) -> torch.device:
        """The device the model and its KV cache live on."""
        return self.engine.runner.device

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix that no running request uses; returns the KV blocks freed."""
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any; the LLM cannot generate afterwards then."""
        self.engine.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:  # fmt: skip
        """Generate for every prompt (a string, token ids, or a list of either); outputs in prompt order.

        sampling_params: one for all prompts, one per prompt, or None for the model's defaults.
        use_tqdm: show a progress bar of finished requests on stderr (when tqdm is installed)."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.engine.default_sampling_params()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(f"generate-{next(self._ids)}")
                self.engine.add_request(ids[-1], prompt, p, stream=False)
            finals: dict[str, RequestOutput] = {}
            with progress(use_tqdm):
                finished_bar = bar(total=len(ids), desc="generate", unit="req")
            while len(finals) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        finished_bar.update()
            finished_bar.close()
        finally:  # a bad prompt or an interrupt leaves nothing behind in the engine
            for request_id in ids:
                self.engine.abort_request(request_id)
        return [finals[i] for i in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that adds to it, the last one finished.

        Closing the iterator early aborts the request and frees its blocks."""
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, sampling_params or self.engine.default_sampling_params())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise RequestError(f"prompts must be a string, token ids or a list of them, got {type(prompts).__name__}")
