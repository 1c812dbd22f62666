"""The `serving` suite: tessera.llm against transformers' own generation paths, in one run.

    python3 bench/run.py --suite serving [--parts startup,offline,online,batch1,prefix] [--weights fp16,int4]
                         [--peers hf-generate-batch,hf-generate,hf-generate:tessera] [--n 256]
                         [--rates 2,8,32] [--online-n 64] [--out DIR]
    python3 bench/serving_suite.py --tiny --device cpu      (a CPU smoke run of the same code, ~1 min)

Tensor parallelism (issue 43): `--shape llama-3-8b --tensor-parallel-size N` runs the engine over
GPUs 0..N-1, eagerly; the rows carry `tensor_parallel_size` and, for N > 1, `allreduce_bus_gbs` (an
fp16 all-reduce of 1 GiB through NCCL, nccl-tests' bus bandwidth); the roofline is per GPU (rank
0's shard); `startup` stays TP 1.

A whole default run may outlast one 10-minute device command; split it by parts (rows append):
`--parts offline,batch1` (the peers run here), then `--parts online,startup --peers ""`, then
`--parts prefix --weights fp16 --prefix-workloads shared-prefix` (and each other workload).

Model: the Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads over 8 KV heads, intermediate 8192,
vocab 128256, tied embeddings) with random weights, saved to a temporary directory so that startup
is timed from disk.  Weights fp16 and int4 (`LLM(..., quantization="int4")`, the LM head stays
fp16); the peers run fp16 (`peers_weights`).  On the CPU the model is float32 (rows say "fp32").
The engine is compiled by tessera on CUDA and eager on the CPU (`--compile`, the engine's advice).
Rows, appended to `<out>/<date>-<gpu>-serving.jsonl` (a GPU run may be split over several commands
by `--parts`), with a markdown table per part and a plot (bench/plot.py: peer or floor time per
output token over tessera's) rebuilt from the whole file:

- `offline`: the nano-vllm workload, `workload=random-100-1024,n=256` (prompt and output lengths
  uniform in 100-1024, random ids, EOS ignored, greedy).  `tessera_tok_s` = output tokens/s of
  `LLM.generate`, the second of two runs of the workload (`first_run_tok_s`: the first, which builds
  the kernels of every new shape); `peers_tok_s`: `hf-generate-batch` (transformers' continuous
  batching, paged SDPA, per-request lengths) and `hf-generate` (static cache, eager, batches of
  `--hf-batch` left-padded prompts: a batch runs to its longest request, only requested tokens
  count).  `hf-generate:tessera` is batch-1 only: offline, every batch's new prompt width would
  recompile its forward.  `roofline_tok_s` = output tokens / the bound of tessera's own schedule:
  over the engine's logged steps (tokens computed, KV positions read), the sum of max((weight + KV
  bytes) / copy bandwidth, matmul FLOPs / GEMM peak), both measured in this run (`copy_gbs`,
  `gemm_tflops`).  `tokens` / `tokens_asked` check that every requested token was made.
- `online`: Poisson arrivals at each of `--rates` requests/s (`inf`: all at once) of `--online-n`
  requests of the same random workload, through `AsyncLLMEngine` in-process: the engine's own
  latency, without HTTP and SSE framing (`vllm bench serve` goes through HTTP; our server's
  framing is a per-chunk JSON dump, small beside a step).  TTFT, TPOT = (E2E - TTFT) / (output
  tokens - 1) per request, ITL = every gap between streamed chunks; p50 and p99 in ms.
- `batch1`: one request (128-token prompt, 256 new tokens, greedy): ms per output token after the
  first (`tessera_ms_per_token`), its HBM floor (`floor_ms`: weight + KV bytes of each decode step
  over copy bandwidth), `frac_floor` = floor / measured, and `peers_ms_per_token` of `hf-generate`
  (static cache, eager) and `hf-generate:tessera` (the same with `model.forward` compiled by
  `torch.compile(backend="tessera")`), from two output lengths' time difference.
- `prefix`: prefix sharing (the radix-tree KV cache) on four workloads, greedy, EOS ignored:
  `shared-prefix` (64 groups x 16 questions, shuffled: a 1024-token system prompt per group,
  128-token questions, 256 output tokens), `few-shot` (512 requests: one 2,000-token 5-shot prefix
  plus a 64-token question, 16 output tokens), `multi-turn` (64 chats of 4 turns: a 256-token first
  message, 64-token follow-ups, 128-token answers; turn k's prompt is turn k - 1's prompt, its
  answer and the new message) and `random-<low>-<high>` (the offline workload: no sharing).
  `tessera_tok_s` with the cache on; `peers_tok_s`: `tessera:no-prefix-cache` (the same engine
  built with `enable_prefix_caching=False`, in this run) and `hf-generate-batch`.  Each engine runs
  a slice of each workload first (kernels of its shapes), then empties its cache, then the timed
  run.  `hit_rate` = cached / looked-up prompt tokens; `greedy_equal`: the cache on and off made
  the same tokens.
- `host` (not in the default parts): the engine's host time per step on the offline workload,
  with the model's forward replaced by a stub returning fixed logits (scheduling, packing, the
  step's tensors, sampling, detokenizing, stop rules; decode graphs off); median ms of 300
  steps after 50.
- `startup`: a fresh process importing tessera, building `LLM(model_dir)` and returning its first
  token: `cold_s` with an empty tessera artifact cache, `warm_s` with the cache it left
  (the weights are in the OS page cache both times).

Every tessera row carries `peak_memory_gib` (torch's peak allocation on CUDA, with the KV pool
sized by `--gpu-memory-utilization`; the process's peak RSS on the CPU) and `kv_cache_gib`; a
peer that fails leaves `errors[peer]` and the suite goes on; a weight type whose engine fails
leaves an `error` row and the other's rows.  `--tiny`: 8 offline requests of 8-24 tokens, 6
online ones at rates 50 and inf, batch-1 8 + 16 tokens, startup and prefix (workloads scaled down
to 16 requests or 4 chats of tens of tokens) of the first weight type only.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import transformers

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import serving_workloads as sw  # noqa: E402
from harness import current_commit  # noqa: E402

import tessera  # noqa: E402, F401  (registers torch.compile's "tessera" backend)
from tessera.llm import LLM, SamplingParams  # noqa: E402

PEERS = ("hf-generate-batch", "hf-generate", "hf-generate:tessera")
PREFIX_WORKLOADS = "shared-prefix,few-shot,multi-turn,random"


def peak_memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def reset_peak(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def try_peer(errors: dict[str, str], name: str, fn: Any) -> Any:
    """fn(), or None with errors[name] set: a failing peer is recorded and the suite goes on."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        errors[name] = f"{type(exc).__name__}: {exc}"[:400]
        print(f"peer {name} failed: {errors[name]}", file=sys.stderr, flush=True)
        return None


def run_peers(args: argparse.Namespace, model_dir: Path, dtype: torch.dtype, offline_load: tuple[list, list] | None,
              batch1_load: tuple[list[int], int] | None, prefix_specs: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The fp16 peers, once for every weight type: offline tok/s, batch-1 ms/token and the prefix
    workloads' tok/s, before the engine takes its share of device memory."""
    peers, errors = set(args.peers.split(",")) - {""}, {}
    res: dict[str, Any] = {"offline": {}, "offline_tokens": {}, "batch1": {}, "errors": errors, "peak": {},
                           "prefix": {}}  # fmt: skip
    if not peers:
        return res
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    ref = ref.to(args.device).eval()
    jobs = []
    if offline_load is not None:
        prompts, lens = offline_load
        jobs += [("offline", "hf-generate-batch", lambda: sw.hf_generate_batch(ref, prompts, lens)),
                 ("offline", "hf-generate", lambda: sw.hf_generate(ref, prompts, lens, args.hf_batch))]  # fmt: skip
    if batch1_load is not None:
        jobs.append(("batch1", "hf-generate", lambda: sw.hf_batch1_ms(ref, *batch1_load)))
    for part, name, fn in jobs:
        if name in peers:
            reset_peak(args.device)
            r = try_peer(errors, name if part == "offline" else f"{name} (batch1)", fn)
            if r is not None and part == "offline":
                res["offline"][name], res["offline_tokens"][name] = r["tokens"] / r["seconds"], r["tokens"]
            elif r is not None:
                res["batch1"][name] = r
            res["peak"][f"{part}:{name}"] = peak_memory_gib(args.device)
    if "hf-generate-batch" in peers:
        for name, spec in prefix_specs.items():
            reset_peak(args.device)
            r = try_peer(errors, f"hf-generate-batch (prefix {name})",
                         lambda spec=spec: sw.run_workload(spec, lambda p, m: sw.hf_generate_batch(ref, p, m)))  # fmt: skip
            if r is not None:
                res["prefix"][name] = {"hf-generate-batch": r["tokens"] / r["seconds"]}
    if batch1_load is not None and "hf-generate:tessera" in peers:
        ref.forward = torch.compile(ref.forward, backend="tessera", dynamic=False)
        r = try_peer(errors, "hf-generate:tessera (batch1)", lambda: sw.hf_batch1_ms(ref, *batch1_load))
        if r is not None:
            res["batch1"]["hf-generate:tessera"] = r
    return res  # the reference model goes with this frame; the caller's reset_peak frees its memory


def startup(model_dir: Path, args: argparse.Namespace, quantization: str | None, cache: Path) -> dict[str, float]:
    """A fresh process's seconds to import, to build the LLM, and to its first token, with cache as
    the tessera artifact cache."""
    child = (f"import time; t0 = time.perf_counter()\nimport json, torch\nfrom tessera.llm import LLM, SamplingParams\n"
             f"t1 = time.perf_counter()\nllm = LLM({str(model_dir)!r}, device={args.device!r}, dtype={args.dtype!r}, "
             f"quantization={quantization!r}, compile_model={args.compile_model})\nt2 = time.perf_counter()\n"
             f"llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))\n"
             f"torch.cuda.synchronize() if {args.device!r} == 'cuda' else None\nt3 = time.perf_counter()\n"
             f"print(json.dumps({{'import_s': t1 - t0, 'build_s': t2 - t1, 'total_s': t3 - t0}}))\n")  # fmt: skip
    env = {**os.environ, "TESSERA_CACHE_DIR": str(cache), "PYTHONPATH": str(BENCH.parent)}
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"startup child failed: {proc.stderr[-600:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def offline(llm: LLM, prompts: list[list[int]], lens: list[int], costs: tuple[int, int, int],
            limits: tuple[float, float]) -> dict[str, Any]:  # fmt: skip
    """tessera's offline tok/s and the roofline of the steps it ran.  The workload runs twice: the
    first run builds the kernels and graphs of every new shape (on the CPU it ran 25x slower than
    the second), so it is the warm-up, reported as `first_run_tok_s`; the second is timed."""
    greedy = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens]
    start = time.perf_counter()
    llm.generate(prompts, greedy)
    sw.synchronize(llm.device)
    first = sum(lens) / (time.perf_counter() - start)
    preempted = llm.engine.scheduler.num_preemptions
    llm.engine.reset_prefix_cache()  # the timed run computes every prompt, as the first did
    log = llm.engine.enable_step_log()
    sw.synchronize(llm.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy)
    sw.synchronize(llm.device)
    seconds = time.perf_counter() - start
    llm.engine.step_log = None
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    bound = sw.roofline_seconds(list(log), *costs, *limits)
    return {"tessera_tok_s": tokens / seconds, "first_run_tok_s": first, "roofline_tok_s": tokens / bound,
            "frac_roofline": bound / seconds, "seconds": seconds, "tokens": tokens, "tokens_asked": sum(lens),
            "steps": len(log), "preemptions": llm.engine.scheduler.num_preemptions - preempted}  # fmt: skip


def batch1(
    llm: LLM, prompt: list[int], new_tokens: int, costs: tuple[int, int, int], bandwidth: float
) -> dict[str, Any]:
    """ms per output token after the first, streamed alone, and the HBM floor of those decode steps."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)  # warm up
    llm.engine.reset_prefix_cache()
    log = llm.engine.enable_step_log()
    stamps = []
    for _ in llm.stream(prompt, params):
        sw.synchronize(llm.device)  # the token is on the host already; this only makes the clock honest
        stamps.append(time.perf_counter())
    llm.engine.step_log = None
    decode = list(log)[1:]  # the first step is the prefill
    floor_s = sum((costs[0] + kv * costs[1]) / bandwidth for _, kv in decode) / len(decode)
    ms = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3
    return {"tessera_ms_per_token": ms, "floor_ms": floor_s * 1e3, "frac_floor": floor_s * 1e3 / ms,
            "tokens": len(stamps), "tokens_asked": new_tokens}  # fmt: skip


def engine_rows(args: argparse.Namespace, model_dir: Path, quant: str | None, label: dict[str, Any],
                loads: dict[str, Any], peers: dict[str, Any],
                limits: tuple[float, float]) -> list[dict[str, Any]]:  # fmt: skip
    """The offline, online and batch-1 rows of one weight type, through one LLM."""
    parts, rows = set(args.parts.split(",")), []
    dtype = getattr(torch, args.dtype)
    llm = LLM(str(model_dir), device=args.device, dtype=dtype, quantization=quant, compile_model=args.compile_model,
              gpu_memory_utilization=args.gpu_memory_utilization,
              tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
    runner = llm.engine.runner
    costs = sw.model_costs(llm)
    label = {**label, "weight_gib": costs[0] / 2**30}
    mem = {"kv_cache_gib": runner.num_kv_blocks * runner.block_bytes / 2**30}
    if "offline" in parts:
        r, pt = offline(llm, *loads["offline"], costs, limits), peers["offline"]
        rows.append({"case": f"offline workload=random-{args.low}-{args.high},n={args.n} {label['weights']}",
                     "part": "offline", **label, **r, "peers_tok_s": dict(pt),
                     "peers_tokens": dict(peers["offline_tokens"]), "errors": dict(peers["errors"]),
                     "peers_peak_memory_gib": {k[8:]: v for k, v in peers["peak"].items() if k.startswith("offline:")},
                     "vs_hf_generate_batch": r["tessera_tok_s"] / pt.get("hf-generate-batch", math.nan),
                     "tessera_us": 1e6 / r["tessera_tok_s"], "floor_us": 1e6 / r["roofline_tok_s"],
                     "peers_us": {p: 1e6 / v for p, v in pt.items()},
                     "peak_memory_gib": peak_memory_gib(args.device), **mem})  # fmt: skip
    if "online" in parts:
        prompts, lens = loads["online"]
        llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in lens])  # warm every shape first
        for rate in (float(x) for x in args.rates.split(",")):
            llm.engine.reset_prefix_cache()  # every rate serves the same prompts: none cached beforehand
            r = sw.online(llm, prompts, lens, rate)
            rows.append({"case": f"online rate={rate:g},n={args.online_n} {label['weights']}", "part": "online",
                         **label, **r, "tessera_tok_s": r["output_tok_s"], "tokens_asked": sum(lens),
                         "peak_memory_gib": peak_memory_gib(args.device), **mem})  # fmt: skip
    if "host" in parts:
        r = sw.host_step_ms(llm, *loads["offline"])
        rows.append({"case": f"host workload=random-{args.low}-{args.high},n={args.n} {label['weights']}",
                     "part": "host", **label, **r})  # fmt: skip
    if "batch1" in parts:
        (prompt, new), pb = loads["batch1"], peers["batch1"]
        r = batch1(llm, prompt, new, costs, limits[0])
        rows.append({"case": f"batch1 decode prompt={len(prompt)},new={new} {label['weights']}", "part": "batch1",
                     **label, **r, "peers_ms_per_token": dict(pb),
                     "errors": {k: v for k, v in peers["errors"].items() if "batch1" in k},
                     "tessera_us": r["tessera_ms_per_token"] * 1e3, "floor_us": r["floor_ms"] * 1e3,
                     "peers_us": {p: v * 1e3 for p, v in pb.items()},
                     "peak_memory_gib": peak_memory_gib(args.device), **mem})  # fmt: skip
    return rows


def prefix_specs(args: argparse.Namespace, vocab: int, random_load: tuple[list, list]) -> dict[str, Any]:
    """The prefix part's workloads by name: {"load": (prompts, out_lens)} or, for multi-turn,
    {"chats": user messages, "out_len": answer length}; full size, or scaled down with --tiny."""
    tiny, specs = args.tiny, {}
    for name in args.prefix_workloads.split(","):
        if name == "shared-prefix":
            specs[name] = {"load": sw.shared_prefix_workload(*((4, 4, 32, 8, 8) if tiny else (64, 16, 1024, 128, 256)),
                                                             vocab, seed=3)}  # fmt: skip
        elif name == "few-shot":
            specs[name] = {"load": sw.few_shot_workload(*((16, 5, 12, 8, 4) if tiny else (512, 5, 400, 64, 16)),
                                                        vocab, seed=4)}  # fmt: skip
        elif name == "multi-turn":
            specs[name] = {"chats": sw.multi_turn_chats(*((4, 3, 24, 8) if tiny else (64, 4, 256, 64)), vocab, seed=5),
                           "out_len": 8 if tiny else 128}  # fmt: skip
        elif name == "random":
            specs[f"random-{args.low}-{args.high}"] = {"load": random_load}
        elif name:
            raise SystemExit(f"unknown prefix workload {name!r}: choose from {PREFIX_WORKLOADS}")
    return specs


def prefix_engine(args: argparse.Namespace, model_dir: Path, quant: str | None, specs: dict[str, Any],
                  enable: bool) -> tuple[dict[str, Any], float]:  # fmt: skip
    """Every prefix workload through one engine with the prefix cache on or off (warm-up slice,
    cache emptied, timed run); the results by workload and the KV pool's GiB."""
    llm = LLM(str(model_dir), device=args.device, dtype=getattr(torch, args.dtype), quantization=quant,
              compile_model=args.compile_model, gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=enable)  # fmt: skip
    generate, results = sw.tessera_generate(llm), {}
    for name, spec in specs.items():
        sw.run_workload(sw.warm_slice(spec), generate)
        llm.engine.reset_prefix_cache()
        before = llm.engine.stats()
        r = sw.run_workload(spec, generate)
        after = llm.engine.stats()
        queried = after.prefix_cache_query_tokens - before.prefix_cache_query_tokens
        r["cached_tokens"] = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        r["hit_rate"] = r["cached_tokens"] / queried if queried else 0.0
        r["preemptions"] = after.num_preemptions - before.num_preemptions
        r["peak_memory_gib"] = peak_memory_gib(args.device)
        results[name] = r
    runner = llm.engine.runner
    return results, runner.num_kv_blocks * runner.block_bytes / 2**30


def prefix_rows(args: argparse.Namespace, model_dir: Path, quant: str | None, label: dict[str, Any],
                specs: dict[str, Any], peers: dict[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """One row per prefix workload: the cache on, against the same engine with it off and the peers."""
    off, _ = prefix_engine(args, model_dir, quant, specs, enable=False)
    reset_peak(args.device)  # the first engine is gone: its KV pool goes back before the second's
    on, kv_gib = prefix_engine(args, model_dir, quant, specs, enable=True)
    rows = []
    for name, spec in specs.items():
        a, b = on[name], off[name]
        tok_s = a["tokens"] / a["seconds"]
        pt = {"tessera:no-prefix-cache": b["tokens"] / b["seconds"], **peers["prefix"].get(name, {})}
        count = len(spec["chats"]) if "chats" in spec else len(spec["load"][0])
        rows.append({"case": f"prefix workload={name},n={count} {label['weights']}", "part": "prefix",
                     "workload": name, **label, "tessera_tok_s": tok_s, "peers_tok_s": pt,
                     "vs_no_prefix_cache": tok_s / pt["tessera:no-prefix-cache"],
                     "vs_hf_generate_batch": tok_s / pt.get("hf-generate-batch", math.nan),
                     "hit_rate": a["hit_rate"], "cached_tokens": a["cached_tokens"],
                     "greedy_equal": a["outputs"] == b["outputs"], "seconds": a["seconds"], "tokens": a["tokens"],
                     "tokens_asked": sw.tokens_asked(spec), "preemptions": a["preemptions"],
                     "errors": {k: v for k, v in peers["errors"].items() if f"prefix {name}" in k},
                     "tessera_us": 1e6 / tok_s, "peers_us": {p: 1e6 / v for p, v in pt.items()},
                     "peak_memory_gib": max(a["peak_memory_gib"], b["peak_memory_gib"]), "kv_cache_gib": kv_gib})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--parts", default="startup,offline,online,batch1,prefix")
    ap.add_argument("--prefix-workloads", default=PREFIX_WORKLOADS, help="the prefix part's workloads")
    ap.add_argument("--weights", default="fp16,int4", help="fp16 (float32 on the CPU) and/or int4")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--n", type=int, help="requests of the offline workload (256; --tiny: 8)")
    ap.add_argument("--low", type=int, help="shortest prompt and output (100; --tiny: 8)")
    ap.add_argument("--high", type=int, help="longest prompt and output (1024; --tiny: 24)")
    ap.add_argument("--rates", default="2,8,32", help="online request rates per second (inf: all at once)")
    ap.add_argument("--online-n", type=int, default=64, help="requests per online rate")
    ap.add_argument("--hf-batch", type=int, default=64, help="hf-generate's batch size (offline)")
    ap.add_argument("--batch1", default="128,256", help="batch-1 prompt length and new tokens")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument(
        "--compile", choices=["auto", "on", "off"], default="auto", help="auto: on for CUDA, off on the CPU"
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama and small workloads (smoke runs)")
    ap.add_argument("--shape", choices=["llama-3.2-1b", "llama-3-8b"], default="llama-3.2-1b", help="the model's shape")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="shard the engine over N GPUs (eager)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(BENCH / "results"))
    args = ap.parse_args(argv)
    # --tiny: small enough for ~1 min on 2 CPU cores, every code path still taken; sizes given
    # explicitly stay (the `host` part on the tiny model takes the full workload).
    for name, full, tiny in (("n", 256, 8), ("low", 100, 8), ("high", 1024, 24)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.tiny:
        args.online_n = min(args.online_n, 6)
        args.rates, args.batch1 = ("50,inf" if args.rates == "2,8,32" else args.rates), "8,16"
    tp = args.tensor_parallel_size
    # The tensor-parallel engine runs eagerly (compile_model is refused with it).
    args.compile_model = tp == 1 and (args.compile == "on" or (args.compile == "auto" and args.device == "cuda"))
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    args.dtype = str(dtype).removeprefix("torch.")
    parts, b1_prompt_len, b1_new = set(args.parts.split(",")), *map(int, args.batch1.split(","))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    env = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "commit": current_commit(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "transformers": transformers.__version__, "compiled": args.compile_model,
           "model": "tiny-llama" if args.tiny else f"{args.shape}-shape", "tensor_parallel_size": tp}  # fmt: skip
    if tp > 1 and args.device == "cuda":  # beside the engine's figures: what its all-reduces can move
        env["allreduce_bus_gbs"] = sw.allreduce_bus_bandwidth(tp) / 1e9
    every: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        shape = sw.TINY if args.tiny else {"llama-3.2-1b": sw.LLAMA_1B, "llama-3-8b": sw.LLAMA_8B}[args.shape]
        model_dir = sw.build_model_dir(shape, dtype, Path(tmp) / "model")
        vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        env["copy_gbs"] = (bandwidth := sw.copy_bandwidth(args.device)) / 1e9
        env["gemm_tflops"] = (peak := sw.gemm_peak(args.device, dtype)) / 1e12
        load = sw.workload(args.n, args.low, args.high, vocab)
        online_load = sw.workload(args.online_n, args.low, args.high, vocab, seed=1)
        b1_prompt = sw.workload(1, b1_prompt_len, b1_prompt_len, vocab, seed=2)[0][0]
        loads = {"offline": load, "online": online_load, "batch1": (b1_prompt, b1_new)}
        specs = prefix_specs(args, vocab, load) if "prefix" in parts else {}
        peers = run_peers(args, model_dir, dtype, load if "offline" in parts else None,
                          (b1_prompt, b1_new) if "batch1" in parts else None, specs)  # fmt: skip
        reset_peak(args.device)
        for weights in args.weights.split(","):
            quant = None if weights == "fp16" else weights
            label = {"weights": weights if quant else ("fp16" if dtype == torch.float16 else "fp32"),
                     "peers_weights": "fp16" if dtype == torch.float16 else "fp32"}  # fmt: skip
            rows: list[dict[str, Any]] = []
            try:
                # tiny: one weight type's startup (each is ~20 s of imports on 2 cores)
                if "startup" in parts and not (args.tiny and any(r["part"] == "startup" for r in every)):
                    cold, warm = (startup(model_dir, args, quant, Path(tmp) / f"cache-{weights}") for _ in range(2))
                    rows.append({"case": f"startup {label['weights']}", "part": "startup", **label,
                                 "cold_s": cold["total_s"], "warm_s": warm["total_s"],
                                 "cold": cold, "warm": warm})  # fmt: skip
                if parts & {"offline", "online", "batch1", "host"}:
                    rows += engine_rows(args, model_dir, quant, label, loads, peers, (bandwidth, peak))
                    reset_peak(args.device)
                # tiny: the first weight type's prefix rows only (two engines, four workloads each)
                if specs and not (args.tiny and weights != args.weights.split(",")[0]):
                    rows += prefix_rows(args, model_dir, quant, label, specs, peers)
            except Exception as exc:  # noqa: BLE001  (one weight type failing leaves the others' rows)
                traceback.print_exc()
                rows.append({"case": f"error {label['weights']}", "part": "error", **label,
                             "error": f"{type(exc).__name__}: {exc}"[:600]})  # fmt: skip
            reset_peak(args.device)
            rows = [{"suite": "serving", **r, **env} for r in rows]
            write(rows, Path(args.out), env)  # after every weight type, so a later crash loses nothing
            every += rows
    return every


COLUMNS = {
    "offline": ["tessera_tok_s", "peers_tok_s", "roofline_tok_s", "frac_roofline", "vs_hf_generate_batch",
                "first_run_tok_s", "steps", "preemptions", "peak_memory_gib", "errors"],
    "online": ["request_rate", "tessera_tok_s", "ttft_ms", "tpot_ms", "itl_ms", "duration_s"],
    "batch1": ["tessera_ms_per_token", "floor_ms", "frac_floor", "peers_ms_per_token", "peak_memory_gib", "errors"],
    "prefix": ["tessera_tok_s", "peers_tok_s", "vs_no_prefix_cache", "vs_hf_generate_batch", "hit_rate",
               "greedy_equal", "preemptions", "peak_memory_gib", "errors"],
    "startup": ["cold_s", "warm_s"],
    "host": ["host_ms_per_step", "mean_running", "steps"],
    "error": ["error"],
}  # fmt: skip


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_cell(x)}" for k, x in v.items()) or "-"
    return " ".join(str(v).split()).replace("|", "/")  # one table cell: no newlines, no column breaks


def write(rows: list[dict[str, Any]], out: Path, env: dict[str, Any]) -> Path:
    """Append rows to <date>-<gpu>-serving.jsonl, rebuild its markdown (a table per part) and plot."""
    out.mkdir(parents=True, exist_ok=True)
    tag = "h200" if "H200" in env["gpu"] else env["gpu"].lower().replace(" ", "-")
    jsonl = out / f"{env['date']}-{tag}-serving.jsonl"
    with jsonl.open("a") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
    every = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    lines = [f"# serving — {env['gpu']}, {env['date']}, torch {env['torch']}, transformers {env['transformers']}\n"]
    for part, cols in COLUMNS.items():
        mine = [r for r in every if r.get("part") == part]
        if mine:
            lines += [f"\n## {part}\n", "| case | " + " | ".join(cols) + " | commit |", "|---" * (len(cols) + 2) + "|"]
            lines += ["| " + " | ".join([r["case"], *(_cell(r.get(c, "")) for c in cols), r["commit"][:10]]) + " |"
                      for r in mine]  # fmt: skip
    jsonl.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        from plot import plot_file

        with tempfile.TemporaryDirectory() as tmp:  # only the rows with times (offline, batch1) are plotted
            timed = Path(tmp) / jsonl.name
            timed.write_text("".join(json.dumps(r) + "\n" for r in every if "tessera_us" in r))
            plot_file(timed, jsonl.with_suffix(".png"))
    except Exception as exc:  # noqa: BLE001  (a plot is a convenience; the table is the result)
        print(f"no plot: {exc}", file=sys.stderr)
    return jsonl


if __name__ == "__main__":
    main()
