"""Helpers of the `serving` suite (bench/serving_suite.py): the model, the workloads, the device's
measured limits, the roofline, the transformers peers and the online (Poisson) client.

Everything here takes token ids (the model has no tokenizer) and times with `time.perf_counter`
after a device synchronize, so a figure covers the whole request path as a user meets it.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import transformers

from tessera.llm import LLM, SamplingParams
from tessera.llm.server.async_engine import AsyncLLMEngine

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=4096,
                rope_theta=500000.0)  # fmt: skip
# Llama-3-8B's shape: the tensor-parallel runs (TP 1, 2, 4).
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192,
                rope_theta=500000.0)  # fmt: skip
# K = 256 and 512 so that the CPU int4 kernels (groups dividing 256) take every linear layer.
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, tie_word_embeddings=True, max_position_embeddings=2048)  # fmt: skip


def build_model_dir(shape: dict[str, Any], dtype: torch.dtype, path: Path, seed: int = 0) -> Path:
    """A random-weight Llama of `shape` saved as a Hugging Face directory (no tokenizer: prompts are ids)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, dtype=str(dtype).removeprefix("torch."))
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def workload(n: int, low: int, high: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's workload: n prompts of random ids; prompt and output lengths uniform in [low, high]."""
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(10, vocab) for _ in range(rnd.randint(low, high))] for _ in range(n)]
    return prompts, [rnd.randint(low, high) for _ in range(n)]


def shared_prefix_workload(groups: int, questions: int, prefix_len: int, question_len: int, out_len: int, vocab: int,
                           seed: int = 0) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """SGLang's generated shared-prefix workload: `groups` system prompts of `prefix_len` random ids,
    each followed by `questions` questions of `question_len` ids; `out_len` output tokens each.  The
    requests come in a shuffled order (groups interleaved), as independent users would send them."""
    rnd = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rnd.randrange(10, vocab) for _ in range(prefix_len)]
        prompts += [system + [rnd.randrange(10, vocab) for _ in range(question_len)] for _ in range(questions)]
    rnd.shuffle(prompts)
    return prompts, [out_len] * len(prompts)


def few_shot_workload(n: int, shots: int, shot_len: int, question_len: int, out_len: int, vocab: int,
                      seed: int = 0) -> tuple[list[list[int]], list[int]]:  # fmt: skip
    """Few-shot evaluation (MMLU-style): one prefix of `shots` examples of `shot_len` ids each, then
    one of n questions of `question_len` ids; `out_len` output tokens (the answer)."""
    rnd = random.Random(seed)
    prefix = [rnd.randrange(10, vocab) for _ in range(shots * shot_len)]
    prompts = [prefix + [rnd.randrange(10, vocab) for _ in range(question_len)] for _ in range(n)]
    return prompts, [out_len] * n


def multi_turn_chats(chats: int, turns: int, first_len: int, user_len: int, vocab: int,
                     seed: int = 0) -> list[list[list[int]]]:  # fmt: skip
    """The user messages of `chats` conversations of `turns` turns: per chat, a first message of
    `first_len` random ids and `turns - 1` follow-ups of `user_len`.  The prompt of turn k is turn
    k - 1's prompt, its answer and message k (`run_multi_turn`)."""
    rnd = random.Random(seed)
    return [[[rnd.randrange(10, vocab) for _ in range(first_len if t == 0 else user_len)] for t in range(turns)]
            for _ in range(chats)]  # fmt: skip


def run_multi_turn(generate: Any, chats: list[list[list[int]]], out_len: int) -> dict[str, Any]:
    """Drive the chats turn by turn: `generate(prompts, out_lens)` returns {"seconds", "outputs"}
    (each prompt's generated ids); every turn appends its answer and the next user message.
    Seconds and tokens are summed over the turns; `outputs` are the final conversations."""
    prompts = [chat[0] for chat in chats]
    seconds, tokens, answers = 0.0, 0, [[] for _ in chats]
    for turn in range(len(chats[0])):
        if turn:
            prompts = [p + a + chat[turn] for p, a, chat in zip(prompts, answers, chats, strict=True)]
        r = generate(prompts, [out_len] * len(prompts))
        answers = r["outputs"]
        seconds += r["seconds"]
        tokens += sum(map(len, answers))
    return {"seconds": seconds, "tokens": tokens, "outputs": [p + a for p, a in zip(prompts, answers, strict=True)]}


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn: Any, device: str, repeats: int = 12) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def host_step_ms(llm: LLM, prompts: list[list[int]], out_lens: list[int], steps: int = 300,
                 warm: int = 50) -> dict[str, float]:  # fmt: skip
    """The engine's own host time per step: the workload's requests (greedy, EOS ignored, as
    LLM.generate adds them) stepped with the model's forward replaced by a stub that returns
    fixed logits, so what is timed is scheduling, packing, building the step's tensors
    (`ModelRunner.run`), sampling, detokenizing and the stop rules.  The decode graphs are off
    for it (their replays are device work).  Median of `steps` steps after `warm`."""
    engine, runner = llm.engine, llm.engine.runner
    rows = 2 * max(len(prompts), 1)  # the runner pads its sampling rows to a power of two at most
    logits = torch.randn(rows, engine.vocab_size, device=llm.device)

    def stub(**inputs: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=logits[: inputs["logits_to_keep"].numel()].unsqueeze(0))

    real, runner.forward = runner.forward, stub
    graphs, runner.decode_graphs = runner.decode_graphs, None
    ids = [f"host-{i}" for i in range(len(prompts))]
    try:
        for request_id, prompt, m in zip(ids, prompts, out_lens, strict=True):
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True),
                               stream=False)  # fmt: skip
        times, running = [], []
        while len(times) < warm + steps and engine.has_unfinished_requests():
            synchronize(llm.device)
            start = time.perf_counter()
            engine.step()
            synchronize(llm.device)
            times.append(time.perf_counter() - start)
            running.append(engine.stats().num_running)
        if len(times) > warm:  # a workload shorter than the warm-up (smoke runs) is timed whole
            times, running = times[warm:], running[warm:]
    finally:
        runner.forward, runner.decode_graphs = real, graphs
        for request_id in ids:
            engine.abort_request(request_id)
    return {"host_ms_per_step": statistics.median(times) * 1e3, "steps": len(times),
            "mean_running": statistics.fmean(running)}  # fmt: skip


def copy_bandwidth(device: str, nbytes: int | None = None) -> float:
    """Bytes read + written per second by one large device copy (median of 10): the bandwidth floor's
    rate.  1 GiB on the GPU (far past L2); 256 MiB on the CPU (past its caches, and not in the peak RSS)."""
    nbytes = nbytes or (1 << 30 if device == "cuda" else 1 << 28)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return nbytes / _median_time(lambda: dst.copy_(src), device)


def gemm_peak(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of a large square torch matmul (cuBLAS on the GPU), median of 10."""
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / _median_time(lambda: a @ b, device)


def model_costs(llm: LLM) -> tuple[int, int, int]:
    """(weight bytes one step reads, KV bytes per cached position, matmul FLOPs per token) of the
    engine's live model: per GPU when tensor-parallel (rank 0's shard, KV heads and FLOPs).  Bytes are those of its unique parameter and buffer storages and of its
    quantized weights' codes, scales and zeros (int4 packs and scales as stored; the tied embedding counted once, as the LM head that reads all of it).
    FLOPs are the linear layers' and the head's; attention's are left out (<= 5% for the 1B shape
    at <= 2k positions), so the bound errs towards fewer seconds."""
    model = llm.engine.runner.model
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for module in model.modules():  # tessera's QuantizedLinear keeps its packed weight as a plain attribute
        for name, value in vars(module).items():
            if not name.startswith("_") and hasattr(value, "codes") and hasattr(value, "scales"):
                for part in (value.codes, value.scales, getattr(value, "zeros", None)):
                    if part is not None:
                        seen[id(part)] = _nbytes(part)
    config = model.config.get_text_config()
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or h // config.num_attention_heads)
    dense = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) + config.vocab_size * h
    runner = llm.engine.runner
    tp = llm.engine.parallel.world_size if llm.engine.parallel is not None else 1
    kv_bytes = layers * 2 * runner.num_kv_heads * runner.head_dim * torch.finfo(runner.dtype).bits // 8
    return sum(seen.values()), kv_bytes, 2 * dense // tp


def _allreduce_rank(rank: int, world_size: int, port: int, nbytes: int, out: Any) -> None:
    """One rank of allreduce_bus_bandwidth: NCCL, one GPU a process."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size)
    x = torch.ones(nbytes // 2, dtype=torch.float16, device="cuda")
    seconds = _median_time(lambda: dist.all_reduce(x), "cuda")
    if rank == 0:
        out.put(2 * (world_size - 1) / world_size * nbytes / seconds)  # nccl-tests' bus bandwidth
    dist.destroy_process_group()


def allreduce_bus_bandwidth(world_size: int, nbytes: int = 1 << 30) -> float:
    """Bus bandwidth (bytes/s) of an fp16 all-reduce of `nbytes` over GPUs 0..world_size-1 through
    torch.distributed and NCCL, as nccl-tests reports it: 2 (n - 1) / n * bytes / time."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world_size, port, nbytes, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=300)
    finally:
        for p in procs:
            p.join(60)


def _nbytes(x: Any) -> int:
    """Bytes of a torch tensor, a numpy array or a tessera PackedTensor (its `nbytes` property)."""
    return x.untyped_storage().nbytes() if isinstance(x, torch.Tensor) else int(x.nbytes)


def roofline_seconds(steps: list[tuple[int, int]], weight_bytes: int, kv_bytes_per_position: int,
                     flops_per_token: int, bandwidth: float, peak: float) -> float:  # fmt: skip
    """The bound of a schedule: the sum over its steps (tokens computed, KV positions read) of
    max((weight + KV bytes read) / copy bandwidth, FLOPs / GEMM peak)."""
    return sum(max((weight_bytes + kv * kv_bytes_per_position) / bandwidth, tokens * flops_per_token / peak)
               for tokens, kv in steps)  # fmt: skip


def hf_generate_batch(model: Any, prompts: list[list[int]], out_lens: list[int]) -> dict[str, Any]:
    """transformers' continuous batching (paged SDPA: `attn_implementation="sdpa"`, which transformers
    5 pages under continuous batching; flash is not switched to).  Requests go through the manager's
    `add_request`, each with its own max_new_tokens and no EOS (eos_token_id=-1), as generate_batch
    would do with one length for all; output tokens are counted from the results (a release without
    eos_token_id there may stop at a random id equal to EOS, ~1 in 128k tokens); the clock starts
    after a warm-up request (CUDA graph capture)."""
    config = transformers.GenerationConfig(max_new_tokens=max(out_lens), do_sample=False, pad_token_id=0)
    # On the GPU transformers sizes its cache from free memory, as tessera does; on the CPU it would
    # take most of the RAM (minutes of allocation), so it gets blocks enough for the whole workload.
    sizes = {} if model.device.type == "cuda" else {
        "num_blocks": sum(-(-(len(p) + m) // 256) for p, m in zip(prompts, out_lens, strict=True)) + 2,
        "max_batch_tokens": 2048}  # fmt: skip
    # Written for transformers 5.25; older 5.x releases (the GPU image had 5.17) lack some of these
    # arguments, so only those the installed one takes are passed.
    takes = inspect.signature(model.continuous_batching_context_manager).parameters
    kwargs: dict[str, Any] = {"generation_config": config, "timeout": 30}
    if hasattr(transformers, "ContinuousBatchingConfig") and "continuous_batching_config" in takes:
        wanted = {"auto_switch_to_flash": False, **sizes}
        known = inspect.signature(transformers.ContinuousBatchingConfig).parameters
        kwargs["continuous_batching_config"] = transformers.ContinuousBatchingConfig(
            **{k: v for k, v in wanted.items() if k in known})
        config.update(**{k: v for k, v in sizes.items() if k not in known})
    else:
        config.update(**sizes)  # where older releases read the cache sizes
    if "workload_hints" in takes:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(max(map(len, prompts)), max(out_lens), len(prompts))
    with torch.no_grad(), model.continuous_batching_context_manager(**kwargs) as manager:
        no_eos = {"eos_token_id": -1} if "eos_token_id" in inspect.signature(manager.add_request).parameters else {}
        _collect(manager, [manager.add_request(prompts[0], max_new_tokens=4, **no_eos)])
        synchronize(model.device)
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=m, **no_eos) for p, m in zip(prompts, out_lens, strict=True)]
        results = _collect(manager, ids)
        synchronize(model.device)
        seconds = time.perf_counter() - start
    outputs = [list(results[i].generated_tokens) for i in ids]
    return {"seconds": seconds, "tokens": sum(map(len, outputs)), "outputs": outputs}


def _collect(manager: Any, ids: list[str | None], timeout_s: float = 1800.0) -> dict[str, Any]:
    """The finished results of `ids`; RuntimeError when a request was dropped, failed or the loop died."""
    if None in ids:
        raise RuntimeError("transformers' continuous batching refused a request")
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            results[result.request_id] = result
        elif result is None and (not manager.is_running() or time.monotonic() > deadline):
            raise RuntimeError(f"continuous batching stopped with {len(ids) - len(results)} requests unfinished")
    return results


def hf_generate(model: Any, prompts: list[list[int]], out_lens: list[int], batch: int) -> dict[str, Any]:
    """transformers' generate, static cache, eager (disable_compile: generate would otherwise
    torch.compile a static-cache forward on its own), over batches of `batch` left-padded prompts in
    workload order.  A batch runs to its longest requested length (min_new_tokens = max_new_tokens,
    so no EOS stops it); only the requested tokens count as output."""
    device = model.device
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, lens = prompts[i : i + batch], out_lens[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(lens),
                             min_new_tokens=max(lens), do_sample=False, cache_implementation="static", pad_token_id=0,
                             disable_compile=True)  # fmt: skip
        assert out.shape[1] - width == max(lens), f"generate made {out.shape[1] - width} tokens, not {max(lens)}"
    synchronize(device)
    return {"seconds": time.perf_counter() - start, "tokens": sum(out_lens)}


def hf_batch1_ms(model: Any, prompt: list[int], new_tokens: int) -> float:
    """Milliseconds per decoded token of transformers' generate (static cache), from the time
    difference of two output lengths, so the prefill cancels out."""
    ids = torch.tensor([prompt], device=model.device)

    def run(n: int) -> float:
        synchronize(model.device)
        start = time.perf_counter()
        model.generate(
            ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
            disable_compile=True,
        )  # eager, or the forward the caller compiled
        synchronize(model.device)
        return time.perf_counter() - start

    run(new_tokens)  # warm up (and compile, for a compiled forward) at both lengths
    run(new_tokens // 4)
    return (run(new_tokens) - run(new_tokens // 4)) / (new_tokens - new_tokens // 4) * 1e3


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 99)) -> dict[str, float]:
    """{"p50": ..., "p99": ...} in milliseconds of values in seconds, linear interpolation as numpy's
    default (what `vllm bench serve` uses); NaN for no values."""
    out = {}
    ordered = sorted(values)
    for q in qs:
        if not ordered:
            out[f"p{q}"] = math.nan
            continue
        pos = (len(ordered) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{q}"] = (ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)) * 1e3
    return out


async def _one_request(engine: AsyncLLMEngine, request_id: str, prompt: list[int], max_tokens: int,
                       delay: float) -> dict[str, Any]:  # fmt: skip
    """Send one request after `delay` s; its TTFT, E2E latency, chunk gaps and output tokens."""
    await asyncio.sleep(delay)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sent = time.perf_counter()
    last, ttft, gaps, tokens = sent, math.nan, [], 0
    async for out in engine.submit(request_id, prompt, params):
        now = time.perf_counter()
        count = len(out.outputs[0].token_ids)
        if count > tokens:  # one chunk: what arrived since the last wake-up, as an SSE chunk would
            if tokens == 0:
                ttft = now - sent
            else:
                gaps.append(now - last)
            last, tokens = now, count
    return {"ttft": ttft, "e2e": last - sent, "itl": gaps, "tokens": tokens}


def online(llm: LLM, prompts: list[list[int]], out_lens: list[int], rate: float, seed: int = 0) -> dict[str, Any]:
    """Poisson arrivals at `rate` requests/s (inf: all at once) through an in-process AsyncLLMEngine,
    reported as `vllm bench serve` does: TTFT and TPOT = (E2E - TTFT) / (output tokens - 1) per
    request, ITL = every gap between consecutive streamed chunks, each at p50 and p99 (ms)."""
    rnd = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += 0.0 if math.isinf(rate) else rnd.expovariate(rate)
    engine = AsyncLLMEngine(llm.engine, max_pending=len(prompts) + 1)

    async def drive() -> list[dict[str, Any]]:
        engine.start()
        await _one_request(engine, "warmup", prompts[0][:16], 4, 0.0)
        start = time.perf_counter()
        done = await asyncio.gather(*(_one_request(engine, f"r{i}", p, m, d)
                                      for i, (p, m, d) in enumerate(zip(prompts, out_lens, delays, strict=True))))  # fmt: skip
        done.append({"duration": time.perf_counter() - start})
        return done

    try:
        results = asyncio.run(drive())
    finally:
        engine.shutdown()
    duration = results.pop()["duration"]
    tokens = sum(r["tokens"] for r in results)
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return {"request_rate": rate, "num_requests": len(results), "duration_s": duration, "output_tokens": tokens,
            "output_tok_s": tokens / duration, "request_throughput": len(results) / duration,
            "ttft_ms": percentiles([r["ttft"] for r in results]), "tpot_ms": percentiles(tpot),
            "itl_ms": percentiles([g for r in results for g in r["itl"]])}  # fmt: skip


def run_workload(spec: dict[str, Any], generate: Any) -> dict[str, Any]:
    """One workload through `generate(prompts, out_lens) -> {"seconds", "tokens", "outputs"}`."""
    if "chats" in spec:
        return run_multi_turn(generate, spec["chats"], spec["out_len"])
    return generate(*spec["load"])


def tokens_asked(spec: dict[str, Any]) -> int:
    if "chats" in spec:
        return len(spec["chats"]) * len(spec["chats"][0]) * spec["out_len"]
    return sum(spec["load"][1])


def warm_slice(spec: dict[str, Any]) -> dict[str, Any]:
    """An eighth of a workload (two turns of multi-turn): the warm-up that builds its shapes' kernels."""
    if "chats" in spec:
        return {**spec, "chats": [c[:2] for c in spec["chats"][: max(2, len(spec["chats"]) // 8)]]}
    prompts, lens = spec["load"]
    k = max(4, len(prompts) // 8)
    return {"load": (prompts[:k], lens[:k])}


def tessera_generate(llm: LLM) -> Any:
    """`generate` for run_workload through tessera's offline API (greedy, EOS ignored)."""

    def generate(prompts: list[list[int]], lens: list[int]) -> dict[str, Any]:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens]
        synchronize(llm.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        synchronize(llm.device)
        outputs = [o.outputs[0].token_ids for o in outs]
        return {"seconds": time.perf_counter() - start, "tokens": sum(map(len, outputs)), "outputs": outputs}

    return generate
