"""The `dynamic` suite (issue 10, item 8): dynamic shapes and LLM generation, side by side in one process.

    python3 bench/dynamic_suite.py [--part sweep,generate] [--repeats 50] [--out DIR]
    python3 bench/dynamic_suite.py --tiny --device cpu     (a smoke test with tiny configs)

sweep: BERT-base fp16, batch 1, sequence lengths 32, 48, 64, 96, 128, 160, 200, 256, 384, 512
  in that order, under `torch.compile(model, backend="tessera", dynamic=True)` and its peers
  `torch.compile(model, mode="reduce-overhead", dynamic=True)` and torch eager.  Each system compiles once
  (`torch._dynamo.reset()` before its sweep, not before each length: the sweep measures how a
  dynamic-shape compile serves new lengths) and records per length the first-call time (wall
  clock, synchronized: compiling, planning and capturing what the length needs), the steady
  latency (median of --repeats CUDA-event timings after --warmup calls, the same inputs for both
  systems) and the relative error against a float32 eager copy; after the sweep, the extra GPU
  memory it holds (allocated and reserved, against before its first call) and the peak.
generate: the 1.1B Llama of bench/PROTOCOL.md (TinyLlama shape, 22 layers) fp16, prompt 128, 64 new
  tokens, greedy, with `cache_implementation="static"` and with the default (dynamic) cache
  (`--caches`): eager `generate` against `generate` with the
  forward compiled by tessera; tokens/s of a warm call (median of --gen-repeats), the first
  (compiling) call's time, and whether the tokens equal eager's.

Rows go to <out>/<date>-<gpu>-dynamic.jsonl (one per length, one per sweep summary, one for
generate) with a markdown table; `--out` defaults to $OUT, else bench/results.  Set
TESSERA_COMMIT when the checkout has no git history.  On the CPU (--device cpu) timings use
the wall clock and no memory is reported; CPU timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))  # harness

LENGTHS = [32, 48, 64, 96, 128, 160, 200, 256, 384, 512]
TINY_LENGTHS = [5, 8, 13, 21]
TESSERA = "tessera"
PEER = "torch.compile:reduce-overhead"
EAGER = "torch.eager"
MIB = 1 << 20


# ---- models -----------------------------------------------------------------------------------------------------------
def bert(tiny: bool) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                        vocab_size=1000, max_position_embeddings=64) if tiny else tf.BertConfig()  # fmt: skip
    return tf.BertModel(cfg)


def llama(tiny: bool) -> torch.nn.Module:
    import transformers as tf

    if tiny:
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
                             initializer_range=0.5)  # fmt: skip
    else:
        cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                             num_key_value_heads=4)  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


class LastHidden(torch.nn.Module):
    """BERT returning one tensor, so every system computes and is timed on the same thing."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).last_hidden_state


# ---- timing -------------------------------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall(fn: Callable[[], Any], device: str) -> tuple[Any, float]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def steady_us(fn: Callable[[], Any], device: str, repeats: int, warmup: int) -> float:
    """Median time of fn() in us: CUDA events on the GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = [wall(fn, device)[1] * 1e6 for _ in range(repeats)]
        return statistics.median(times)
    sync(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    sync(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def memory(device: str) -> dict[str, int]:
    if device != "cuda":
        return {}
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def ensure_tessera_backend() -> None:
    import tessera.frontend.torch  # noqa: F401  (registers backend="tessera" when not pip-installed)


def tessera_stats() -> dict[str, int]:
    import importlib

    return dict(importlib.import_module("tessera.frontend.torch.backend").stats)


# ---- the length sweep ---------------------------------------------------------------------------------------------------
def sweep(opts: argparse.Namespace) -> list[dict[str, Any]]:
    device, dtype = opts.device, opts.dtype
    lengths = TINY_LENGTHS if opts.tiny else LENGTHS
    torch.manual_seed(0)
    model = LastHidden(bert(opts.tiny)).eval().to(device=device, dtype=dtype)
    vocab = model.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    inputs = {n: torch.randint(0, vocab, (1, n), generator=gen).to(device) for n in lengths}
    with torch.no_grad():
        ref_model = copy.deepcopy(model).float()
        refs = {n: ref_model(inputs[n]).float() for n in lengths}
        del ref_model
    systems: dict[str, dict[str, Any] | None] = {TESSERA: {"backend": "tessera", "dynamic": True},
                                                 PEER: {"mode": "reduce-overhead", "dynamic": True}, EAGER: None}
    results: dict[str, dict[str, Any]] = {}
    for system, kwargs in systems.items():
        if system in opts.skip:
            continue
        res: dict[str, Any] = {"first_call_s": {}, "steady_us": {}, "rel_err": {}, "error": None}
        results[system] = res
        torch._dynamo.reset()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = memory(device)
        stats0 = tessera_stats() if system == TESSERA else {}
        compiled = None
        try:
            compiled = model if kwargs is None else torch.compile(model, **kwargs)
            with torch.no_grad():
                for n in lengths:
                    x = inputs[n]
                    out, res["first_call_s"][n] = wall(lambda: compiled(x), device)  # noqa: B023
                    res["rel_err"][n] = rel_err(out, refs[n])
                    res["steady_us"][n] = steady_us(lambda: compiled(x), device, opts.repeats, opts.warmup)  # noqa: B023
                    print(f"{system} seq={n}: first call {res['first_call_s'][n]:.3f} s, "
                          f"steady {res['steady_us'][n]:.1f} us, rel_err {res['rel_err'][n]:.1e}", flush=True)  # fmt: skip
        except Exception as e:  # noqa: BLE001  (a failing system is recorded, the suite goes on)
            res["error"] = f"{type(e).__name__}: {e}"[:600]
            traceback.print_exc()
        after = memory(device)
        if before:
            res["extra_mem_mib"] = {k: (after[k] - before[k]) / MIB for k in before}
            res["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - before["allocated"]) / MIB
        if system == TESSERA:
            stats = tessera_stats()
            res["tessera_graph"] = {k: stats[k] - stats0.get(k, 0) for k in stats}
        compiled = None  # noqa: F841  (free it before the next system)
        gc.collect()
    rows = []
    tag = "bert-tiny" if opts.tiny else "bert-base"
    for n in lengths:
        rows.append(_row(f"model={tag},bs=1,seq={n},{opts.dtype_name},dynamic", results, n))
    summary = _row(f"model={tag},bs=1,sweep={lengths[0]}..{lengths[-1]},{opts.dtype_name},dynamic", results, None)
    rows.append(summary)
    return rows


def _row(case: str, results: dict[str, dict[str, Any]], n: int | None) -> dict[str, Any]:
    """One JSONL row: tessera's figures, the peer's under peers_*."""

    def pick(system: str, key: str) -> Any:
        res = results.get(system, {})
        v = res.get(key)
        if n is None:
            if key in ("first_call_s", "steady_us"):
                return sum(v.values()) if v else None  # the sweep's total
            if key == "rel_err":
                return max(v.values()) if v else None
            return v
        return v.get(n) if isinstance(v, dict) else None

    row: dict[str, Any] = {"case": case, "tessera_us": pick(TESSERA, "steady_us"),
                           "peers_us": {p: pick(p, "steady_us") for p in results if p != TESSERA},
                           "rel_err": pick(TESSERA, "rel_err"),
                           "peers_rel_err": {p: pick(p, "rel_err") for p in results if p != TESSERA},
                           "first_call_s": pick(TESSERA, "first_call_s"),
                           "peers_first_call_s": {p: pick(p, "first_call_s") for p in results if p != TESSERA}}  # fmt: skip
    mine = row["tessera_us"]
    row["speedup"] = {p: us / mine for p, us in row["peers_us"].items() if us and mine}  # peer time / tessera time
    if n is None:  # the sweep summary: memory, counters, errors
        row["note"] = "tessera_us and peers_us: sums of the steady latencies; first_call_s: sums; rel_err: max"
        row["extra_mem_mib"] = pick(TESSERA, "extra_mem_mib")
        row["peak_extra_mib"] = pick(TESSERA, "peak_extra_mib")
        row["peers_extra_mem_mib"] = {p: results[p].get("extra_mem_mib") for p in results if p != TESSERA}
        row["peers_peak_extra_mib"] = {p: results[p].get("peak_extra_mib") for p in results if p != TESSERA}
        row["tessera_graph"] = pick(TESSERA, "tessera_graph")
        row["errors"] = {s: r["error"] for s, r in results.items() if r.get("error")}
    return row


# ---- generate -------------------------------------------------------------------------------------------------------
def generate(opts: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per KV cache of --caches: transformers' static cache, or its default (dynamic) one,
    whose growing length makes every decode step a new shape."""
    device, dtype = opts.device, opts.dtype
    torch.manual_seed(0)
    model = llama(opts.tiny).eval().to(device=device, dtype=dtype)
    prompt_len, new = (16, 16) if opts.tiny else (128, 64)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(device)
    return [_generate_row(model, prompt, new, cache, opts) for cache in opts.caches]


def _generate_row(model: torch.nn.Module, prompt: torch.Tensor, new: int, cache: str,
                  opts: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    device = opts.device
    kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    row: dict[str, Any] = {"case": f"model={'llama-tiny' if opts.tiny else 'llama-1.1b'},generate,prompt={prompt.shape[1]},"
                                   f"new={new},{cache}-cache,{opts.dtype_name}", "errors": {}}  # fmt: skip
    with torch.no_grad():
        eager_tokens, eager_first = wall(lambda: model.generate(prompt, **kwargs), device)
        eager_s = statistics.median(wall(lambda: model.generate(prompt, **kwargs), device)[1]
                                    for _ in range(opts.gen_repeats))  # fmt: skip
        torch._dynamo.reset()
        stats0 = tessera_stats()
        forward = model.forward
        try:
            model.forward = torch.compile(forward, backend="tessera")
            tokens, first_s = wall(lambda: model.generate(prompt, **kwargs), device)
            tessera_s = statistics.median(wall(lambda: model.generate(prompt, **kwargs), device)[1]
                                          for _ in range(opts.gen_repeats))  # fmt: skip
            row["tokens_equal"] = bool(torch.equal(tokens, eager_tokens))
            row["first_call_s"] = first_s
            row["tessera_tokens_per_s"] = new / tessera_s
            row["tessera_us"] = tessera_s * 1e6
        except Exception as e:  # noqa: BLE001
            row["errors"][TESSERA] = f"{type(e).__name__}: {e}"[:600]
            traceback.print_exc()
        finally:
            model.forward = forward
    stats = tessera_stats()
    row["tessera_graph"] = {k: stats[k] - stats0.get(k, 0) for k in stats}
    row["peers_us"] = {EAGER: eager_s * 1e6}
    row["peers_tokens_per_s"] = {EAGER: new / eager_s}
    row["peers_first_call_s"] = {EAGER: eager_first}
    row["rel_err"] = None  # tokens are compared exactly (tokens_equal)
    if "tessera_tokens_per_s" in row:
        row["speedup_vs_eager"] = row["tessera_tokens_per_s"] / row["peers_tokens_per_s"][EAGER]
    print(json.dumps(row, default=str), flush=True)
    return row


# ---- results --------------------------------------------------------------------------------------------------------
def environment(device: str) -> dict[str, Any]:
    from harness import current_commit

    commit = current_commit()
    import transformers

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__}  # fmt: skip


def _fmt(v: Any, digits: str = ".1f") -> str:
    if isinstance(v, float):
        return format(v, digits)
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x, digits)}" for k, x in v.items())
    return "" if v is None else str(v)


def write(rows: list[dict[str, Any]], out: Path, device: str) -> Path:
    env = environment(device)
    tag = "h200" if "H200" in env["gpu"] else env["gpu"].lower().replace(" ", "-")
    stem = f"{env['date']}-{tag}-dynamic"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps({"suite": "dynamic", **r, **env}, default=str) + "\n")
    lines = [f"# dynamic — {env['gpu']}, {env['date']}, torch {env['torch']}, commit {env['commit'][:12]}", "",
             "| case | tessera us | peer us | speed-up (peer time / tessera time) | tessera first call s | "
             "peer first call s | rel_err | extra memory MiB (tessera; peer) | tokens/s (tessera; eager) | "
             "tokens equal | errors |", "|" + "---|" * 11]  # fmt: skip
    for r in rows:
        tps = r.get("tessera_tokens_per_s")
        lines.append("| " + " | ".join([
            r["case"], _fmt(r.get("tessera_us")), _fmt(r.get("peers_us")), _fmt(r.get("speedup"), ".2f"),
            _fmt(r.get("first_call_s"), ".3g"),
            _fmt(r.get("peers_first_call_s"), ".3g"), _fmt(r.get("rel_err"), ".1e"),
            f"{_fmt(r.get('extra_mem_mib'))}; {_fmt(r.get('peers_extra_mem_mib'))}" if r.get("extra_mem_mib") else "",
            f"{_fmt(tps)}; {_fmt(r.get('peers_tokens_per_s'))}" if tps is not None else "",
            _fmt(r.get("tokens_equal")), _fmt(r.get("errors"))]) + " |")  # fmt: skip
    md = out / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return md


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="dynamic_suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="sweep,generate", help="comma-separated: sweep, generate")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a smoke test, e.g. on the CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default=None, choices=["float16", "float32", "bfloat16"],
                    help="default: float16 on the GPU, float32 on the CPU")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per length (bench/PROTOCOL.md asks >= 50)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls per length after its first call")
    ap.add_argument("--gen-repeats", type=int, default=5, help="timed generate calls per system")
    ap.add_argument("--caches", default="static,dynamic", help="generate's KV caches: static, dynamic (the default cache)")
    ap.add_argument("--skip", default="", help=f"systems to leave out of the sweep: {TESSERA}, {PEER}")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="results folder (default $OUT, else bench/results)")
    opts = ap.parse_args(argv)
    opts.dtype_name = opts.dtype or ("float16" if opts.device == "cuda" else "float32")
    opts.dtype = getattr(torch, opts.dtype_name)
    opts.skip = {s.strip() for s in opts.skip.split(",") if s.strip()}
    opts.caches = [c.strip() for c in opts.caches.split(",") if c.strip()]
    if not opts.caches or set(opts.caches) - {"static", "dynamic"}:
        ap.error(f"--caches takes static and/or dynamic, not {opts.caches}")
    parts = [p.strip() for p in opts.part.split(",") if p.strip()]
    unknown = set(parts) - {"sweep", "generate"}
    if unknown:
        ap.error(f"unknown part(s) {sorted(unknown)}; choose from sweep, generate")
    ensure_tessera_backend()
    rows: list[dict[str, Any]] = []
    if "sweep" in parts:
        rows += sweep(opts)
    if "generate" in parts:
        rows += generate(opts)
    write(rows, Path(opts.out) if opts.out else BENCH / "results", opts.device)


if __name__ == "__main__":
    main()
