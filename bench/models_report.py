"""The `models` suite's systems and results: how each system it times is built (the
torch.compile arguments of a system name, the tessera backend made resolvable, a fresh inductor
cache per torch.compile mode, eager torch captured in a CUDA graph for the `torch.eager+cudagraph`
peer), the per-case summary, the JSONL file and its markdown table.

Kept free of transformers and torchvision, and CUDA is touched only when a system is built, so
that the CPU test tier can check it on synthetic rows (tests/test_bench_models.py).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

SUITE = "models"
EAGER = "torch.eager"
EAGER_GRAPH = "torch.eager+cudagraph"  # eager captured once in a CUDA graph and replayed
COMPILE_PEERS = ["torch.compile:default", "torch.compile:reduce-overhead", "torch.compile:max-autotune"]
PEERS = [EAGER, EAGER_GRAPH, *COMPILE_PEERS]  # bench/PROTOCOL.md's peer names, in table order
TESSERA = "tessera"
SYSTEMS = [*PEERS, TESSERA]
# Quantized decode cases (decode_case.py): `tessera` runs the low-bit model, every peer the fp16
# model, and this peer is tessera on the fp16 model (what the low-bit weights gain).
TESSERA_FP16 = "tessera:fp16"
TESSERA_SYSTEMS = (TESSERA, TESSERA_FP16)  # compiled with backend="tessera"


def case_systems(quantized: bool) -> list[str]:
    """The systems of a case, in table order: SYSTEMS, and tessera:fp16 in a quantized one."""
    return [*PEERS, TESSERA_FP16, TESSERA] if quantized else list(SYSTEMS)


def row_systems(row: dict[str, Any]) -> list[str]:
    """The systems a row can hold (a quantized row has `weight`)."""
    return case_systems(bool(row.get("weight")))


def new_row(case: str) -> dict[str, Any]:
    """An empty result row: every system fills its own entries (or `errors[system]`)."""
    return {"suite": SUITE, "case": case, "tessera_us": None, "peers_us": {}, "rel_err": None,
            "compile_s_cold": None, "compile_s_warm": None, "peers_rel_err": {}, "peers_compile_s_cold": {},
            "peers_compile_s_warm": {}, "max_err": {}, "graph_breaks": {}, "errors": {}, "skipped": {},
            "notes": {}, "host_us": {}}  # fmt: skip


def record(row: dict[str, Any], system: str, result: dict[str, Any]) -> None:
    """Store one system's measurement (`us`, `compile_s_cold`, `compile_s_warm`, `rel_err`,
    `max_err`, `graph_breaks`, `host_us`, `note`, `error`, and `extra`: keys copied into the row as
    they are) under the row's keys for that system."""
    ours = system == TESSERA
    if result.get("us") is not None:
        if ours:
            row["tessera_us"] = result["us"]
        else:
            row["peers_us"][system] = result["us"]
    for key in ("compile_s_cold", "compile_s_warm", "rel_err"):
        if result.get(key) is not None:
            if ours:
                row[key] = result[key]
            else:
                row[f"peers_{key}"][system] = result[key]
    for key in ("max_err", "graph_breaks", "host_us"):
        if result.get(key) is not None:
            row.setdefault(key, {})[system] = result[key]
    if result.get("note"):
        row["notes"][system] = result["note"]
    if result.get("error"):
        row["errors"][system] = result["error"]
    row.update(result.get("extra", {}))


def summarize(row: dict[str, Any]) -> dict[str, Any]:
    """Add the fastest torch.compile mode and tessera's speed-up over it (> 1: tessera faster)."""
    compiled = {p: t for p, t in row.get("peers_us", {}).items() if p in COMPILE_PEERS and t}
    row["best_compile_peer"] = min(compiled, key=compiled.get) if compiled else None
    best = compiled.get(row["best_compile_peer"]) if compiled else None
    t = row.get("tessera_us")
    row["vs_best_compile"] = best / t if best and t else None
    eager = row.get("peers_us", {}).get(EAGER)
    row["vs_eager"] = eager / t if eager and t else None
    return row


def stem(env: dict[str, Any]) -> str:
    """`<date>-<gpu>-models`, the gpu tagged as bench/harness.py does (`h200`)."""
    gpu = str(env.get("gpu", "unknown"))
    tag = "h200" if "H200" in gpu else gpu.lower().replace(" ", "-")
    return f"{env['date']}-{tag}-{SUITE}"


def clean(value: Any) -> Any:
    """`value` with NaN and infinities replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def append_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append rows (one JSON object per line); several runs of model subsets share one file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(clean(r), allow_nan=False) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_PER_SYSTEM = ("peers_rel_err", "peers_compile_s_cold", "peers_compile_s_warm", "max_err", "graph_breaks", "errors",
               "notes", "pct_of_floor", "argmax_agree", "host_us", "tokens_per_s")  # fmt: skip


def merge_rows(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` with the systems that `new` skipped and `old` measured (or failed) taken from `old`:
    runs of the same case at the same commit that each measured some systems (max-autotune in a
    call of its own, say) make one row."""
    out = json.loads(json.dumps(new))
    for system in [s for s in new.get("skipped", {}) if s not in old.get("skipped", {})]:
        del out["skipped"][system]
        if system == TESSERA:
            for key in ("tessera_us", "compile_s_cold", "compile_s_warm", "rel_err"):
                out[key] = old.get(key)
        elif system in old.get("peers_us", {}):
            out["peers_us"][system] = old["peers_us"][system]
        for key in _PER_SYSTEM:
            if system in old.get(key, {}):
                out.setdefault(key, {})[system] = old[key][system]
    return summarize(out)


def latest_per_case(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case, in the order cases first appear: a later run at another commit supersedes;
    runs at the same commit are merged system by system (merge_rows; the later one wins where both
    measured a system)."""
    last: dict[str, dict[str, Any]] = {}
    for r in rows:
        prev = last.pop(r["case"], None)
        same = prev is not None and prev.get("commit") == r.get("commit")
        last[r["case"]] = merge_rows(prev, r) if same else r
    order = list(dict.fromkeys(r["case"] for r in rows))
    return [last[c] for c in order]


def _ms(us: Any) -> str:
    return f"{us / 1e3:.3f}" if isinstance(us, (int, float)) else "–"


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "–"


def _cell(text: str, limit: int = 90) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _short(system: str) -> str:
    return system.replace("torch.compile:", "")


def render_markdown(rows: list[dict[str, Any]]) -> str:
    """Latency table (ms, ratios vs the best torch.compile mode), compile times and errors, notes."""
    rows = latest_per_case(rows)
    if not rows:
        return f"# {SUITE}: no results\n"
    env = rows[-1]
    commits = sorted({str(r.get("commit", "unknown"))[:12] for r in rows})
    repeats = sorted({r.get("repeats") for r in rows if r.get("repeats")})
    out = [f"# {SUITE} — {env.get('gpu')}, {env.get('date')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
           f"commit {', '.join(commits)}", ""]  # fmt: skip
    out += [f"Median of {', '.join(map(str, repeats)) or '?'} repeats (CUDA events, after warm-up), fp16, "
            "same inputs for every system, no L2 flush (see notes). Speed-up = best torch.compile mode / tessera "
            "(> 1: tessera faster).", ""]  # fmt: skip
    cols = ["case", "tessera (ms)", *[f"{_short(p)} (ms)" for p in PEERS], "best torch.compile",
            "speed-up vs best", "speed-up vs eager", "tessera rel_err"]  # fmt: skip
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        peers = r.get("peers_us", {})
        cells = [r["case"], _ms(r.get("tessera_us")), *[_peer_cell(r, p, _ms(peers.get(p))) for p in PEERS],
                 _short(r.get("best_compile_peer") or "–"), _num(r.get("vs_best_compile"), ".2f"),
                 _num(r.get("vs_eager"), ".2f"), _num(r.get("rel_err"), ".1e")]  # fmt: skip
        if r.get("tessera_us") is None:
            cells[1] = (
                "error" if TESSERA in r.get("errors", {}) else "skipped" if TESSERA in r.get("skipped", {}) else "–"
            )
        out.append("| " + " | ".join(cells) + " |")
    out += _decode_table(rows)
    out += _quantized_table(rows)
    out += ["", "## Compile time (s; cold: empty caches, warm: after `torch._dynamo.reset()`), host time per call "
            "(µs, calls issued without synchronizing) and error vs fp32", ""]  # fmt: skip
    cols = ["case", "system", "compile cold", "compile warm", "host µs / call", "rel_err", "max_err", "graph breaks",
            "error / note"]  # fmt: skip
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        for s in row_systems(r):
            if s in r.get("skipped", {}):
                continue
            ours = s == TESSERA
            cold = r.get("compile_s_cold") if ours else r.get("peers_compile_s_cold", {}).get(s)
            warm = r.get("compile_s_warm") if ours else r.get("peers_compile_s_warm", {}).get(s)
            err = r.get("rel_err") if ours else r.get("peers_rel_err", {}).get(s)
            text = r.get("errors", {}).get(s) or r.get("notes", {}).get(s) or ""
            host = (r.get("host_us") or {}).get(s)
            out.append("| " + " | ".join([r["case"], s, _num(cold, ".1f"), _num(warm, ".1f"), _num(host, ".0f"),
                                           _num(err, ".1e"),
                                           _num(r.get("max_err", {}).get(s), ".1e"),
                                           _num(r.get("graph_breaks", {}).get(s), "d"), _cell(text, 200)]) + " |")  # fmt: skip
    skipped = {(s, why) for r in rows for s, why in r.get("skipped", {}).items()}
    out += ["", "## Notes", ""]
    out += [f"- Skipped: `{s}` — {why}" for s, why in sorted(skipped)]
    out += NOTES
    return "\n".join(out) + "\n"


def _decode_table(rows: list[dict[str, Any]]) -> list[str]:
    """The decode cases against their HBM floor (bench/decode_case.py): % of floor per system
    (floor_us / us: 100 is the floor) and on how many checked steps the argmax token agrees."""
    decode = [r for r in rows if r.get("kv") is not None and not r.get("weight")]
    if not decode:
        return []
    out = ["", "## Decode: per-token latency against the HBM floor (floor = bytes read per token / copy bandwidth "
           "measured in the same run; % of floor = floor / latency)", ""]  # fmt: skip
    cols = ["case", "floor (ms)", "MB read / token", "copy GB/s",
            *[f"{_short(s)} % of floor" for s in SYSTEMS], "tessera host µs / step", "argmax agrees with eager"]  # fmt: skip
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in decode:
        nbytes = (r.get("bytes_per_token") or {}).get("total")
        pct = r.get("pct_of_floor") or {}
        agree = ", ".join(f"{_short(s)} {a}" for s, a in (r.get("argmax_agree") or {}).items())
        out.append("| " + " | ".join([r["case"], _ms(r.get("floor_us")), _num(nbytes / 1e6 if nbytes else None, ".1f"),
                                       _num(r.get("copy_gbs"), ".0f"), *[_num(pct.get(s), ".0f") for s in SYSTEMS],
                                       _num((r.get("host_us") or {}).get(TESSERA), ".0f"), agree or "–"]) + " |")  # fmt: skip
    return out


def _quantized_table(rows: list[dict[str, Any]]) -> list[str]:
    """The quantized decode cases: tessera on the low-bit model against tessera and eager on the
    fp16 one, per-token latency, tokens/s, the low-bit model's floor, and agreement with fp16 eager."""
    quant = [r for r in rows if r.get("kv") is not None and r.get("weight")]
    if not quant:
        return []
    out = ["", "## Quantized decode: low-bit weights (tessera.quantize) against fp16 (per-token latency; floor = "
           "bytes of the low-bit model read per token / copy bandwidth; agreement with fp16 eager on the same "
           "tokens, each model on a cache it prefilled itself)", ""]  # fmt: skip
    cols = ["case", "weights", "tessera (ms)", "tokens/s", "tessera fp16 (ms)", "eager fp16 (ms)",
            "speed-up vs tessera fp16", "floor (ms)", "% of floor", "argmax agrees with fp16 eager",
            "rel_err vs fp16 eager", "rel_err vs low-bit eager"]  # fmt: skip
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in quant:
        peers, t = r.get("peers_us", {}), r.get("tessera_us")
        fp16 = peers.get(TESSERA_FP16)
        group = r.get("group_size")
        weights = f"{r['weight']}, {'per channel' if group is None else f'g{group}'}"
        own = r.get("vs_quantized_eager") or {}
        out.append("| " + " | ".join([
            r["case"], weights, _ms(t) if t else _peer_cell(r, TESSERA, "–"),
            _num((r.get("tokens_per_s") or {}).get(TESSERA), ".0f"), _peer_cell(r, TESSERA_FP16, _ms(fp16)),
            _peer_cell(r, EAGER, _ms(peers.get(EAGER))), _num(fp16 / t if fp16 and t else None, ".2f"),
            _ms(r.get("floor_us")), _num((r.get("pct_of_floor") or {}).get(TESSERA), ".0f"),
            str((r.get("argmax_agree") or {}).get(TESSERA, "–")), _num(r.get("rel_err"), ".1e"),
            _num(own.get("rel_err"), ".1e")]) + " |")  # fmt: skip
    return out


def _peer_cell(row: dict[str, Any], peer: str, text: str) -> str:
    if peer in row.get("errors", {}):
        return "error"
    if peer in row.get("skipped", {}):
        return "skipped"
    return text


NOTES = [
    "- No L2 flush: a whole model streams its weights and activations (tens to hundreds of MB) through the "
    "60 MB L2 within one forward, and models run back to back in serving; every system is timed the same way, "
    "on the same inputs.",
    "- rel_err = ‖out − ref‖ / ‖ref‖ and max_err = max|out − ref| / max|ref|, against a float32 eager copy "
    "(`model.float()`) of the same fp16 weights on the same inputs (TF32 off). torch.eager's own fp16 error is the "
    "bar for the others.",
    "- compile cold: the first call, compilation included, with an empty tessera cache (TESSERA_CACHE_DIR) and an "
    "empty inductor cache (TORCHINDUCTOR_CACHE_DIR), both fresh temporary folders per model, after "
    "`torch._dynamo.reset()`. compile warm: `torch._dynamo.reset()`, a new `torch.compile` and its first call in "
    "the same process, so on-disk caches (tessera's artifacts; inductor's FX-graph, Triton and autotuning caches) "
    "and in-process memoisation are warm. reduce-overhead records its CUDA graph on later calls (inside the "
    "warm-up), not in the first call.",
    "- A tessera graph break (dynamo splitting the model into several graphs, or tessera running nodes in torch) "
    "is not hidden: tessera_us is the time with the breaks (the unsupported nodes run in torch between compiled "
    "segments), the break is named in the note column and in `extra.graph_break`.",
    "- Each model runs in its own subprocess; a system that fails records `errors[system]` and the suite goes on.",
]

def compile_kwargs(system: str) -> dict[str, Any]:
    if system in TESSERA_SYSTEMS:
        return {"backend": "tessera"}
    mode = system.split(":", 1)[1]
    return {} if mode == "default" else {"mode": mode}


def ensure_tessera_backend() -> str:
    """Make `backend="tessera"` resolvable; says whether the entry point or the import provided it."""
    from torch._dynamo.backends.registry import lookup_backend

    try:
        lookup_backend("tessera")
        return "entry point"
    except Exception:  # noqa: BLE001  (not pip-installed: importing the front end registers the name)
        import tessera.frontend.torch  # noqa: F401

        lookup_backend("tessera")
        return "registered on import of tessera.frontend.torch (no entry point: tessera is not pip-installed)"


def fresh_inductor_cache(system: str) -> contextlib.AbstractContextManager:
    """An empty inductor/Triton cache for each torch.compile mode, so that its cold compile is
    not served by the previous mode's FX-graph cache; warm then means warm in this folder."""
    if system not in COMPILE_PEERS:
        return contextlib.nullcontext()
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or getattr(utils, "fresh_inductor_cache", None)
    return fresh() if fresh else contextlib.nullcontext()


def cuda_graphed(model: torch.nn.Module, inputs: tuple) -> Callable[..., Any]:
    """Eager `model` captured once in a CUDA graph: each call copies its inputs into the static
    ones and replays (what tessera's compiled graphs do too), returning the static output."""
    static = [x.clone() for x in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture (cuBLAS workspaces, lazy inits)
            model(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(*static)

    def replay(*args: torch.Tensor) -> torch.Tensor:
        for dst, src in zip(static, args):
            dst.copy_(src)
        graph.replay()
        return out

    return replay
