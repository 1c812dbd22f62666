"""The `llama-1.1b decode` cases of the models suite (issue 11, item 6): one new token against a
static KV cache, per-token latency of every system, and the HBM floor in the same row.

    python3 bench/models_suite.py --models llama-decode-512,llama-decode-2048     (the GPU run)
    python3 bench/decode_case.py --tiny --device cpu                             (a smoke test)

The step is what `generate` runs per token with `cache_implementation="static"`: the model's
forward with input_ids [1, 1], cache_position [p] and a transformers `StaticCache` of `kv`
positions, which it updates in place (`index_copy_`) before attending over the whole cache.
transformers' StaticLayer writes at its own position counter (`cumulative_length`, one tensor
per layer, advanced by each step) and masks by cache_position; the two are kept equal (`rewind`
sets the counters outside the timed region).  Each system gets its own cache, prefilled by
eager with the same prompt of kv - STEPS tokens.  The timed calls are consecutive steps, each
a new token at the next position, ending at the last one (kv - 1): every step reads the whole
static cache of kv positions, as `generate` does.

Correctness: after timing, each system's cache is prefilled again (eager, the same prompt),
then the system runs STEPS steps at positions kv - STEPS .. kv - 1, each with a different
token, and its logits are compared with eager's on the same steps from the same prefill
(rel_err, max_err, and whether the argmax token agrees).

Floor: the bytes a step must read -- every weight but the embedding table (of which it reads
one row) and the whole static K/V cache -- over the device-to-device copy bandwidth measured
in the same process (`harness.copy_bandwidth_gbs`, bytes read + written per second).

Quantized cases (`weight="int4"`, ...; `quantize_setup`): the same step on a copy of the model
whose decoder-layer linears are `tessera.quantize`d (lm_head, embedding and norms stay fp16).
`tessera` is timed on that model; every peer on the fp16 one, and `tessera:fp16` is tessera on
the fp16 one.  All are checked against fp16 eager on the same tokens, the quantized model on a
cache it prefilled itself (what generating with it would hold), so rel_err and argmax_agree
measure what the low-bit weights change; tessera is also checked against eager on the quantized
model (`vs_quantized_eager`: its own error).  The floor counts the low-bit model's bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

STEPS = 4  # checked decode steps, each a different token at the next position
HOST_CALLS = 16  # steps issued back to back, unsynchronized, for the host time per step


# ---- the model, its cache and the step ---------------------------------------------------------
@dataclass
class DecodeSetup:
    """The model and the decode inputs shared by every system."""

    model: torch.nn.Module
    kv: int  # positions of the static cache; the timed step writes the last one
    prompt: torch.Tensor  # [1, kv - STEPS]: the prefill
    tokens: list[torch.Tensor]  # STEPS inputs [1, 1], one per checked step
    positions: list[torch.Tensor]  # their cache positions [1]: kv - STEPS .. kv - 1

    @property
    def device(self) -> torch.device:
        return self.prompt.device

    def step(self, input_ids: torch.Tensor, cache_position: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step: the logits [1, 1, vocab]; updates `cache` at cache_position."""
        out = self.model(input_ids=input_ids, cache_position=cache_position, past_key_values=cache, use_cache=True)
        return out.logits

    def new_cache(self) -> Any:
        """A fresh StaticCache of `kv` positions, prefilled by eager with the prompt."""
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=self.kv)
        self.prefill(cache)
        return cache

    def prefill(self, cache: Any) -> None:
        """Eager's prefill of the prompt into positions 0 .. kv - STEPS - 1 of `cache`."""
        n = self.prompt.shape[1]
        if cache.layers[0].is_initialized:
            rewind(cache, 0)
        self.model(input_ids=self.prompt, cache_position=torch.arange(n, device=self.device), past_key_values=cache,
                   use_cache=True)  # fmt: skip

    def last(self, cache: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The arguments of a step at the last position, `cache` rewound to it (compile calls)."""
        rewind(cache, self.kv - 1)
        return self.tokens[-1], self.positions[-1], cache

    def timed_steps(self, fn: Callable[..., Any], cache: Any, calls: int) -> Callable[[], Any]:
        """A callable making `calls` consecutive steps through fn that end at position kv - 1,
        each with its own token; `cache` is rewound to the first of them."""
        if calls > self.kv - 1:
            raise ValueError(f"{calls} timed steps need a KV cache of more than {calls} positions, got {self.kv}; "
                             "lower --warmup / --repeats")  # fmt: skip
        g = torch.Generator().manual_seed(7)
        vocab = self.model.config.vocab_size
        args = [(torch.randint(0, vocab, (1, 1), generator=g).to(self.device), torch.tensor([p], device=self.device))
                for p in range(self.kv - calls, self.kv)]  # fmt: skip
        rewind(cache, self.kv - calls)
        queue = iter(args)

        def step() -> Any:
            ids, pos = next(queue)
            return fn(ids, pos, cache)

        return step


def rewind(cache: Any, position: int) -> None:
    """Set every layer's write position (StaticLayer.cumulative_length) to `position`."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(position)


def mixtral(tiny: bool) -> torch.nn.Module:
    """The Mixtral-style model of issue 42 (hidden 2048, 8 experts of 7168 -- Mixtral's 3.5x --,
    top-2, 8 layers, 16 heads of 128 over 4 KV heads), or a tiny one of the same structure."""
    import transformers as tf

    if tiny:
        cfg = tf.MixtralConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=1000,
                               max_position_embeddings=256)  # fmt: skip
    else:
        cfg = tf.MixtralConfig(hidden_size=2048, intermediate_size=7168, num_hidden_layers=8, num_attention_heads=16,
                               num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                               max_position_embeddings=4096)  # fmt: skip
    return tf.MixtralForCausalLM(cfg)


def build_decode(kv: int, device: str, tiny: bool, dtype: torch.dtype = torch.float16, seed: int = 0,
                 family: str = "llama") -> DecodeSetup:  # fmt: skip
    """The 1.1B Llama of bench/PROTOCOL.md (or dynamic_suite's tiny one), or with family "mixtral"
    the Mixtral-style model of `mixtral`; random weights, eval mode."""
    from dynamic_suite import llama

    if kv <= STEPS:
        raise ValueError(f"the KV cache must hold more than {STEPS} positions, got {kv}")
    if family not in ("llama", "mixtral"):
        raise ValueError(f"decode cases are of the llama or mixtral family, not {family!r}")
    torch.manual_seed(seed)
    model = (llama(tiny) if family == "llama" else mixtral(tiny)).eval().to(device=device, dtype=dtype)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, vocab, (1, kv - STEPS), generator=g).to(device)
    tokens = [torch.randint(0, vocab, (1, 1), generator=g).to(device) for _ in range(STEPS)]
    positions = [torch.tensor([kv - STEPS + s], device=device) for s in range(STEPS)]
    return DecodeSetup(model, kv, prompt, tokens, positions)


# Linears left in fp16 by the quantized cases: lm_head, as GPTQ/AWQ checkpoints and llama.cpp's
# mixes keep it (its errors land on the logits unaveraged, and it is 1/8 of the 1.1B model's weights).
QUANT_SKIP = ("lm_head",)


@dataclass(frozen=True)
class WeightSpec:
    """The low-bit weights of a quantized case: a tessera.quant weight type and its group size."""

    weight: str
    group_size: int | None = 128  # None: one scale per output channel

    def __post_init__(self) -> None:
        from tessera.errors import ArgumentError
        from tessera.quant import weight_type

        weight_type(self.weight)  # ArgumentError naming the valid types
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise ArgumentError(f"group_size must be a positive int or None (per channel), got {self.group_size!r}")


def quantize_setup(setup: DecodeSetup, spec: WeightSpec) -> tuple[DecodeSetup, dict[str, Any]]:
    """The decode setup on a quantized copy of setup.model, and what the row records of it.

    Every nn.Linear of the decoder layers (q, k, v, o, gate, up, down projections) becomes a
    tessera QuantizedLinear: round-to-nearest codes of spec.weight with a float16 scale per
    spec.group_size inputs, zero points as tessera.quantize defaults them (uint types only).
    QUANT_SKIP (lm_head) stays fp16; the embedding and the RMS norms are not linears and stay
    fp16 too.  The prompt, tokens and positions are setup's."""
    import dataclasses

    import tessera as ts

    t0 = time.perf_counter()
    model = ts.quantize(setup.model, weight=spec.weight, group_size=spec.group_size, skip=QUANT_SKIP)
    seconds = time.perf_counter() - t0
    layers = [name for name, m in model.named_modules() if hasattr(m, "weight_q")]
    first = next(m for m in model.modules() if hasattr(m, "weight_q")).weight_q
    fields = {"weight": spec.weight, "group_size": spec.group_size, "zero_point": first.zeros is not None,
              "quantized_linears": len(layers), "fp16_linears": list(QUANT_SKIP), "quantize_s": seconds}  # fmt: skip
    return dataclasses.replace(setup, model=model), fields


def quantized_weight_bytes(w: Any) -> int:
    """Bytes a kernel reads of one tessera QuantizedWeight: the densely packed codes, the float16
    scales, and the zero points as the float16 biases the kernels take (tessera.eager.lowbit)."""
    zeros = w.zeros.size * 2 if w.zeros is not None else 0
    return w.codes.nbytes + w.scales.size * 2 + zeros


def inactive_expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of the experts one token does not choose: of each mixture-of-experts layer (an
    experts module with 3-D `gate_up_proj` and `down_proj` over E experts) all but top-k experts'
    weights -- one decode token reads only the weights of the experts its router picks."""
    top_k = getattr(model.config, "num_experts_per_tok", None)
    total = 0
    for m in model.modules():
        gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if top_k and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.ndim == 3:
            experts = gate_up.shape[0]
            nbytes = sum(p.numel() * p.element_size() for p in (gate_up, down))
            total += nbytes * (experts - min(top_k, experts)) // experts
    return total


def bytes_per_token(setup: DecodeSetup, cache: Any) -> dict[str, int]:
    """What one step must read from memory: the weights (of the embedding table one row; of a
    quantized linear its codes, scales and zero points; of a mixture-of-experts layer only the
    top-k experts', `inactive_expert_bytes`) and the whole static K/V cache."""
    model = setup.model
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    weights += embed.shape[1] * embed.element_size()
    weights -= inactive_expert_bytes(model)
    weights += sum(quantized_weight_bytes(m.weight_q) for m in model.modules() if hasattr(m, "weight_q"))
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


# ---- timing (CUDA events on the GPU, the wall clock on the CPU) --------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_call(fn: Callable[..., Any], args: tuple, device: torch.device) -> tuple[Any, float]:
    """fn(*args) and its wall time in seconds, synchronized."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*args)
    _sync(device)
    return out, time.perf_counter() - t0


def host_us(step: Callable[[], Any], device: torch.device, calls: int = HOST_CALLS) -> float:
    """Host time per step (or call) in us: `calls` issued back to back without synchronizing (the
    GPU runs behind).  Close to the timed latency, the system is host-bound; a launch queue
    that fills makes it wait for the GPU, so it never reads much below the GPU time of eager.
    The models suite records it for every model and system too."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    host = (time.perf_counter() - t0) / calls * 1e6
    _sync(device)
    return host


class WallTimer:
    """The CPU stand-in of harness.Timer: median wall time in us of fn(*args)."""

    def __init__(self, repeats: int, warmup: int):
        self.repeats, self.warmup = repeats, warmup

    def __call__(self, fn: Callable[..., Any], *args: Any) -> float:
        import statistics

        for _ in range(self.warmup):
            fn(*args)
        return statistics.median(timed_call(fn, args, torch.device("cpu"))[1] * 1e6 for _ in range(self.repeats))


def graphed_step(setup: DecodeSetup, cache: Any) -> Callable[..., torch.Tensor]:
    """Eager's step captured once in a CUDA graph over `cache` (its tensors stay where they are;
    the token and position are copied into static inputs before each replay)."""
    ids, pos = (x.clone() for x in setup.last(cache)[:2])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture (cuBLAS workspaces, lazy inits)
            setup.step(*setup.last(cache))  # (rewound each time: a step past the cache's end is out of bounds)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = setup.step(ids, pos, cache)

    def replay(input_ids: torch.Tensor, cache_position: torch.Tensor, _cache: Any) -> torch.Tensor:
        if _cache is not cache:
            raise ValueError("the captured step runs on the cache it was captured with")
        ids.copy_(input_ids)
        pos.copy_(cache_position)
        graph.replay()
        return out

    return replay


# ---- one system ---------------------------------------------------------------------------------
def reference_steps(setup: DecodeSetup) -> list[torch.Tensor]:
    """Eager's logits (float32 copies) of the checked steps, on a cache of its own."""
    cache = setup.new_cache()
    return [setup.step(t, p, cache).float().clone() for t, p in zip(setup.tokens, setup.positions)]


def checked_outputs(fn: Callable[..., Any], setup: DecodeSetup, cache: Any) -> list[torch.Tensor]:
    """Prefill `cache` again and run the checked steps through fn: their logits (float32 copies)."""
    setup.prefill(cache)
    # clone: a CUDA-graph output is overwritten by the next call
    return [fn(t, p, cache).detach().float().clone() for t, p in zip(setup.tokens, setup.positions)]


def compare_steps(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> dict[str, Any]:
    """The worst errors of the checked steps' logits against refs, and on how many steps the
    argmax token agrees."""
    from models_suite import output_errors

    worst: dict[str, Any] = {"rel_err": 0.0, "max_err": 0.0, "note": None}
    agree = 0
    for out, ref in zip(outs, refs):
        rel, mx, note = output_errors(out, ref)
        if note:
            worst["note"] = note
        worst["rel_err"] = max(worst["rel_err"], rel if rel is not None else float("nan"))
        worst["max_err"] = max(worst["max_err"], mx if mx is not None else float("nan"))
        agree += int(out.shape == ref.shape and torch.equal(out.argmax(-1), ref.argmax(-1)))
    worst["argmax_agree"] = f"{agree}/{len(refs)}"
    return worst


def measure_decode(system: str, setup: DecodeSetup, refs: list[torch.Tensor], timer: Any, opts: argparse.Namespace,
                   own_refs: list[torch.Tensor] | None = None, ref_name: str = "eager") -> dict[str, Any]:  # fmt: skip
    """One system on a fresh cache: cold and warm compile, per-token latency, errors against
    `refs` (`ref_name`'s logits) over the checked steps.  The keys of models_suite.measure, plus
    `argmax_agree`; with `own_refs` (eager on the same quantized model) also extra
    `vs_quantized_eager`, the errors against those."""
    import models_suite as ms
    from models_report import EAGER, EAGER_GRAPH, TESSERA, TESSERA_SYSTEMS

    device = setup.device

    def body(res: dict[str, Any]) -> None:
        with ms.alarm(opts.system_timeout), ms.fresh_inductor_cache(system):
            torch._dynamo.reset()
            cache = setup.new_cache()
            broken = None
            if system == EAGER:
                fn: Callable[..., Any] = setup.step
            elif system == EAGER_GRAPH:
                fn = graphed_step(setup, cache)
            else:
                if system in TESSERA_SYSTEMS:
                    res["extra"] = {"tessera_backend": ms.ensure_tessera_backend()}
                stats0, breaks0, catcher = ms._tessera_stats(), ms._dynamo_breaks(), ms._Warnings()
                ms.logging.getLogger("tessera").addHandler(catcher)
                try:
                    _, res["compile_s_cold"] = timed_call(torch.compile(setup.step, **ms.compile_kwargs(system)),
                                                          setup.last(cache), device)  # fmt: skip
                finally:
                    ms.logging.getLogger("tessera").removeHandler(catcher)
                res["graph_breaks"] = ms._dynamo_breaks() - breaks0
                if system in TESSERA_SYSTEMS:
                    delta = {k: v - stats0.get(k, 0) for k, v in ms._tessera_stats().items()}
                    res["extra"]["tessera_graph" if system == TESSERA else "tessera_fp16_graph"] = delta
                    broken = ms.graph_break_error(delta.get("graphs"), res["graph_breaks"], delta.get("eager_nodes", 0),
                                                  catcher.messages)  # fmt: skip
                torch._dynamo.reset()
                fn = torch.compile(setup.step, **ms.compile_kwargs(system))
                _, res["compile_s_warm"] = timed_call(fn, setup.last(cache), device)
            _, one = timed_call(fn, setup.last(cache), device)
            if one > opts.max_call_s:
                raise RuntimeError(f"one step takes {one:.2f} s (over --max-call-s {opts.max_call_s}); not timed")
            us = timer(setup.timed_steps(fn, cache, timer.warmup + timer.repeats))
            res["host_us"] = host_us(setup.timed_steps(fn, cache, HOST_CALLS), device)
            outs = checked_outputs(fn, setup, cache)
            checked = compare_steps(outs, refs)
            res["rel_err"], res["max_err"], res["argmax_agree"] = checked["rel_err"], checked["max_err"], checked["argmax_agree"]
            notes = [checked["note"], broken]
            if checked["argmax_agree"] != f"{STEPS}/{STEPS}":
                notes.append(f"argmax token agrees with {ref_name} on {checked['argmax_agree']} steps")
            if own_refs is not None:
                own = compare_steps(outs, own_refs)
                res.setdefault("extra", {})["vs_quantized_eager"] = own
                if own["note"]:
                    notes.append(f"against eager on the quantized model: {own['note']}")
            res["note"] = "; ".join(x for x in notes if x) or None
            if broken:
                res.setdefault("extra", {})["graph_break" if system == TESSERA else "tessera_fp16_graph_break"] = broken
            res["us"] = us

    res = ms.guarded(body)
    torch._dynamo.reset()
    ms.gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ---- the row ------------------------------------------------------------------------------------
def floor_fields(setup: DecodeSetup, copy_gbs: float | None, fp16: DecodeSetup | None = None) -> dict[str, Any]:
    """The row's floor entries: bytes per token, the copy bandwidth and floor_us (None without a
    bandwidth).  A quantized row gives the fp16 setup too: its floor becomes `floor_us_fp16`, the
    one the fp16 systems' % of floor is taken against."""

    def floor(s: DecodeSetup) -> tuple[dict[str, int], float | None]:
        cache = s.new_cache()
        nbytes = bytes_per_token(s, cache)
        del cache
        return nbytes, nbytes["total"] / (copy_gbs * 1e9) * 1e6 if copy_gbs else None

    nbytes, us = floor(setup)
    out = {"kv": setup.kv, "bytes_per_token": nbytes, "copy_gbs": copy_gbs, "floor_us": us, "pct_of_floor": {},
           "argmax_agree": {}, "host_us": {}, "tokens_per_s": {}, "decode_steps_checked": STEPS}  # fmt: skip
    if fp16 is not None:
        out["bytes_per_token_fp16"], out["floor_us_fp16"] = floor(fp16)
    return out


def record_decode(row: dict[str, Any], system: str, res: dict[str, Any]) -> None:
    """models_report.record, plus the system's tokens/s, % of the floor (of the model it ran:
    in a quantized row only tessera runs the low-bit one) and argmax agreement."""
    from models_report import TESSERA, record

    record(row, system, res)
    if res.get("argmax_agree") is not None:
        row["argmax_agree"][system] = res["argmax_agree"]
    if res.get("us"):
        row.setdefault("tokens_per_s", {})[system] = 1e6 / res["us"]
    floor = row.get("floor_us") if system == TESSERA or not row.get("weight") else row.get("floor_us_fp16")
    if res.get("us") and floor:
        row["pct_of_floor"][system] = 100.0 * floor / res["us"]


def measured_copy_gbs(device: str, timer: Any) -> float:
    """Copy bandwidth in this process: 1 GiB on the GPU (harness.copy_bandwidth_gbs), 64 MiB on the CPU."""
    from harness import copy_bandwidth_gbs

    return copy_bandwidth_gbs(timer, 1 << 30 if device == "cuda" else 1 << 26, device=device)


def run_decode(row: dict[str, Any], systems: list[str], kv: int, opts: argparse.Namespace, device: str = "cuda",
               tiny: bool = False, save: Callable[[], None] = lambda: None,
               weights: WeightSpec | None = None, dtype: torch.dtype | None = None,
               family: str = "llama") -> None:  # fmt: skip
    """Fill `row` (models_report.new_row) with every system's decode measurement; `save` after each.
    With `weights`, a quantized case (the module docstring): `tessera` runs the quantized model.
    dtype: the model's (default float16 on the GPU, float32 on the CPU)."""
    from models_report import TESSERA
    from models_suite import record_build_failure

    if weights is not None:  # first: a row whose build fails still says what it was to measure
        row.update(weight=weights.weight, group_size=weights.group_size)
    with torch.no_grad():
        try:
            dtype = dtype or (torch.float16 if device == "cuda" else torch.float32)
            setup = build_decode(kv, device, tiny, dtype=dtype, family=family)
            quant, quant_fields = quantize_setup(setup, weights) if weights is not None else (None, {})
        except Exception as e:  # noqa: BLE001
            record_build_failure(row, systems, e, save)
            return
        row.update(quant_fields)
        if device == "cuda":
            from harness import Timer

            timer: Any = Timer(repeats=opts.repeats, warmup=opts.warmup, flush_l2=False)
        else:
            timer = WallTimer(opts.repeats, opts.warmup)
            row["notes"]["floor"] = ("CPU: copy bandwidth of 64 MiB; a tiny model stays in the caches, so its "
                                     "floor checks the bookkeeping, it bounds nothing")  # fmt: skip
        row.update(floor_fields(quant or setup, measured_copy_gbs(device, timer), setup if quant else None))
        ref_name = "fp16 eager" if quant else "eager"
        row["notes"]["reference"] = (
            f"decode: rel_err / max_err are the worst over the checked steps against {ref_name} in the same dtype, "
            "on the same tokens" + ("; tessera runs the quantized model on a cache it prefilled itself, "
                                    "vs_quantized_eager compares it with eager on that model" if quant else ""))  # fmt: skip
        refs = reference_steps(setup)
        own_refs = reference_steps(quant) if quant else None
        save()
        for s in systems:
            print(f"[decode kv={kv}] {s} ...", flush=True)
            ours = quant is not None and s == TESSERA
            res = measure_decode(s, quant if ours else setup, refs, timer, opts, own_refs if ours else None, ref_name)
            record_decode(row, s, res)
            save()
            print(f"[decode kv={kv}] {s}: {({k: v for k, v in res.items() if k != 'extra'})}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """The decode case on its own, printing its row (a smoke test: --tiny --device cpu)."""
    from models_report import EAGER, TESSERA, TESSERA_FP16, new_row, summarize

    ap = argparse.ArgumentParser(prog="decode_case", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", type=int, default=512)
    ap.add_argument("--tiny", action="store_true", help="dynamic_suite's tiny Llama (float32 on the CPU)")
    ap.add_argument("--family", default="llama", choices=["llama", "mixtral"], help="the model (mixtral: issue 42's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--weight", help="quantize the decoder's linears to this tessera.quant type (int4, int3, ...)")
    ap.add_argument("--group-size", type=int, default=128, help="inputs per scale of --weight (0: per channel)")
    ap.add_argument("--systems", help=f"comma-separated models_report system names (default: {EAGER},{TESSERA}, "
                                      f"and {TESSERA_FP16} with --weight)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--system-timeout", type=float, default=1200.0)
    ap.add_argument("--max-call-s", type=float, default=5.0)
    opts = ap.parse_args(argv)
    weights = None
    if opts.weight:
        from tessera.errors import ArgumentError

        try:
            weights = WeightSpec(opts.weight, opts.group_size or None)
        except ArgumentError as e:
            ap.error(str(e))
    systems = opts.systems or ",".join([EAGER, *([TESSERA_FP16] if weights else []), TESSERA])
    quant = f"w={weights.weight},g={weights.group_size or 'channel'}," if weights else ""
    name = {"llama": "llama-1.1b", "mixtral": "mixtral-2048-8x2-8l"}[opts.family]
    row = new_row(f"model={f'{opts.family}-tiny' if opts.tiny else name},bs=1,decode,kv={opts.kv},{quant}"
                  f"{'fp16' if opts.device == 'cuda' else 'fp32'}")  # fmt: skip
    run_decode(row, [s.strip() for s in systems.split(",") if s.strip()], opts.kv, opts, opts.device, opts.tiny,
               weights=weights, family=opts.family)  # fmt: skip
    print(json.dumps(summarize(row), default=str, indent=1))


if __name__ == "__main__":
    main()
