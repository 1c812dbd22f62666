"""The `models` suite: whole fp16 models under torch eager, torch.compile's modes and
`torch.compile(model, backend="tessera")`, side by side in one process per model.

    python3 bench/run.py --suite models [--models gpt2,bert] [--peers all] [--repeats 50] [--out DIR]
    python3 bench/models_suite.py ...            (the same without run.py)

The parent process runs each model in a fresh subprocess (`--child MODEL`): a crash, a hang or
leaked GPU memory stays with that model, every model starts with empty tessera and inductor
caches, and one device call can run a subset. Each finished model's row is appended to
<out>/<date>-h200-models.jsonl and the markdown table is rewritten from the whole file
(bench/models_report.py). A system that fails records `errors[system]` and the suite goes on.

The `llama-decode-*` cases time one decode step (one new token against a static KV cache of 512
or 2048 positions) instead of a forward over a sequence, with the HBM floor in the row
(bench/decode_case.py); `llama-decode-512-int4` / `-int3` do so with the decoder's linears
quantized by `tessera.quantize` (tessera on the low-bit model, the peers and `tessera:fp16` on
the fp16 one).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from decode_case import host_us  # noqa: E402
from models_report import (  # noqa: E402, F401
    EAGER,
    EAGER_GRAPH,
    PEERS,
    TESSERA,
    TESSERA_FP16,
    append_jsonl,
    case_systems,
    clean,
    compile_kwargs,
    cuda_graphed,
    ensure_tessera_backend,
    fresh_inductor_cache,
    new_row,
    read_jsonl,
    record,
    render_markdown,
    stem,
    summarize,
)
from plot import plot_file  # noqa: E402

RESULTS = BENCH / "results"
DEFAULT_PEERS = [EAGER, EAGER_GRAPH, "torch.compile:default", "torch.compile:reduce-overhead"]
SLOW_PEER_REASON = ("not in --peers: it autotunes for minutes per model (238 s for resnet50 on the H200); "
                    "measure it in a call of its own (`--models resnet50,bert --peers torch.compile:max-autotune "
                    "--no-tessera`), which the table merges into the same commit's rows")  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """One case: a model family at a batch size (and sequence length for the transformers)."""

    case: str
    family: str  # resnet50 | bert | gpt2 | llama | mixtral
    batch: int
    seq: int | None = None
    kv: int | None = None  # a decode case: one new token against a static KV cache of kv positions (decode_case.py)
    weight: str | None = None  # a quantized decode case: tessera.quant weight type of the decoder's linears
    group_size: int | None = 128  # its inputs per scale (None: per output channel)

    def systems(self, skipped: dict[str, str]) -> list[str]:
        """The systems this case runs: SYSTEMS, plus tessera:fp16 in a quantized case, less `skipped`."""
        return [s for s in case_systems(bool(self.weight)) if s not in skipped]


MODELS: dict[str, ModelSpec] = {
    "resnet50": ModelSpec("model=resnet50,bs=1,fp16", "resnet50", 1),
    "resnet50-bs16": ModelSpec("model=resnet50,bs=16,fp16", "resnet50", 16),
    "bert": ModelSpec("model=bert-base,bs=1,seq=128,fp16", "bert", 1, 128),
    "gpt2": ModelSpec("model=gpt2,bs=1,seq=128,fp16", "gpt2", 1, 128),
    "llama": ModelSpec("model=llama-1.1b,bs=1,seq=512,fp16", "llama", 1, 512),
    "llama-decode-512": ModelSpec("model=llama-1.1b-decode,bs=1,kv=512,fp16", "llama", 1, kv=512),
    "llama-decode-2048": ModelSpec("model=llama-1.1b-decode,bs=1,kv=2048,fp16", "llama", 1, kv=2048),
    "llama-decode-512-int4": ModelSpec("model=llama-1.1b-decode,bs=1,kv=512,w=int4,g=128,fp16", "llama", 1, kv=512,
                                       weight="int4"),
    "llama-decode-512-int3": ModelSpec("model=llama-1.1b-decode,bs=1,kv=512,w=int3,g=128,fp16", "llama", 1, kv=512,
                                       weight="int3"),
    # issue 42: a Mixtral-style MoE (decode_case.mixtral); the decode floor counts the top-2 experts' bytes only
    "mixtral": ModelSpec("model=mixtral-2048-8x2-8l,bs=1,seq=512,fp16", "mixtral", 1, 512),
    "mixtral-decode-512": ModelSpec("model=mixtral-2048-8x2-8l-decode,bs=1,kv=512,fp16", "mixtral", 1, kv=512),
}  # fmt: skip


# ---- arguments --------------------------------------------------------------------------------
def parse_list(value: str, allowed: list[str], what: str, ap: argparse.ArgumentParser) -> list[str]:
    """A comma-separated selection from `allowed` ("all" for every one), kept in `allowed`'s order."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if names == ["all"]:
        return list(allowed)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        ap.error(f"unknown {what}(s) {', '.join(unknown)}; choose from {', '.join(allowed)} or all")
    return [a for a in allowed if a in names]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="models_suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="all", help=f"comma-separated from {', '.join(MODELS)}, or all")
    ap.add_argument(
        "--peers",
        default=",".join(DEFAULT_PEERS),
        help=f"comma-separated from {', '.join(PEERS)}, or all (default: all but max-autotune)",
    )
    ap.add_argument("--no-tessera", action="store_true", help="time the peers only")
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per system (bench/PROTOCOL.md asks >= 50)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed calls before timing")
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT", ""),
        help="folder for the JSONL and markdown (default $OUT, else bench/results)",
    )
    ap.add_argument(
        "--model-timeout",
        type=float,
        default=3600.0,
        help="seconds before a model's subprocess is killed (the systems it finished are kept)",
    )
    ap.add_argument(
        "--system-timeout",
        type=float,
        default=1200.0,
        help="seconds one system may take (compiles and timing) before it is recorded as an error; 0: no limit",
    )
    ap.add_argument(
        "--max-call-s",
        type=float,
        default=2.0,
        help="a system whose compiled call takes longer is recorded as an error instead of being timed",
    )
    ap.add_argument(
        "--keep-tuning",
        action="store_true",
        help="copy each model's tessera tuning records (winners and candidate times) to OUT/tuning-MODEL.tgz",
    )
    ap.add_argument("--child", choices=list(MODELS), help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    return ap  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; `models` and `peers` become lists of names."""
    ap = build_parser()
    opts = ap.parse_args(argv)
    opts.models = parse_list(opts.models, list(MODELS), "model", ap)
    opts.peers = parse_list(opts.peers, PEERS, "peer", ap)
    if not opts.models:
        ap.error("--models selects no model")
    if opts.repeats < 1 or opts.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if opts.child and not opts.child_out:
        ap.error("--child needs --child-out")
    return opts


def skipped_systems(opts: argparse.Namespace, spec: ModelSpec | None = None) -> dict[str, str]:
    """System -> why it is not run, for every system of `spec` (by default of an fp16 case) the
    selection leaves out."""
    out = {p: SLOW_PEER_REASON if p == "torch.compile:max-autotune" else "not in --peers"
           for p in PEERS if p not in opts.peers}  # fmt: skip
    if opts.no_tessera:
        out[TESSERA] = "--no-tessera"
        if spec is not None and spec.weight:
            out[TESSERA_FP16] = "--no-tessera"
    return out


def child_argv(opts: argparse.Namespace, model: str, out_path: Path) -> list[str]:
    """The command line of the subprocess that measures one model."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", model, "--child-out", str(out_path),
            "--models", model, "--peers", ",".join(opts.peers), "--repeats", str(opts.repeats),
            "--warmup", str(opts.warmup), "--system-timeout", str(opts.system_timeout),
            "--max-call-s", str(opts.max_call_s)]  # fmt: skip
    return argv + (["--no-tessera"] if opts.no_tessera else [])


# ---- failure capture --------------------------------------------------------------------------
class SystemTimeout(Exception):
    """A system ran past --system-timeout."""


def error_text(e: BaseException, limit: int = 600) -> str:
    """One line: the exception's type and message, whitespace collapsed, cut at `limit`."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def record_build_failure(row: dict[str, Any], systems: list[str], e: BaseException, save: Callable[[], None]) -> None:
    """The model could not be built: every system's error says so, and the row is saved."""
    traceback.print_exc()
    for s in systems:
        row["errors"][s] = "model build failed: " + error_text(e)
    save()


def guarded(fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run fn(result); an exception becomes result["error"] and keeps what fn recorded before it."""
    result: dict[str, Any] = {}
    try:
        fn(result)
    except Exception as e:  # noqa: BLE001  (one system's failure must not end the suite)
        traceback.print_exc()
        result["error"] = error_text(e)
    return result


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise SystemTimeout in the main thread after `seconds` (0: never)."""
    if not seconds:
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise SystemTimeout(f"ran past --system-timeout ({seconds:.0f} s)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def graph_break_error(graphs: int | None, dynamo_breaks: int, eager_nodes: int, messages: list[str]) -> str | None:
    """Why tessera did not compile the whole model as one graph, or None when it did.

    `graphs`: FX graphs the backend received (None if unknown); `dynamo_breaks`: dynamo's graph
    breaks; `eager_nodes`: nodes tessera left to torch; `messages`: the "tessera" logger's warnings."""
    parts = []
    if graphs == 0:
        parts.append("the backend received no graph (dynamo ran the model in torch)")
    elif dynamo_breaks or (graphs or 0) > 1:
        parts.append(f"dynamo split the model into {graphs if graphs is not None else '?'} graphs "
                     f"({dynamo_breaks} graph breaks)")  # fmt: skip
    if eager_nodes:
        parts.append(f"{eager_nodes} nodes ran in torch")
    wholly = [m for m in messages if "whole graph in torch" in m]
    if wholly:
        parts.append(f"{len(wholly)} graphs ran wholly in torch")
    if not parts:
        return None
    # Whole-graph fallbacks first: their cause (an exception in tessera) matters most.
    ordered = wholly + [m for m in messages if m not in wholly]
    detail = "; ".join(dict.fromkeys(" ".join(m.split()).removeprefix("tessera: ") for m in ordered))
    return "graph break: " + ", ".join(parts) + (f" — {detail}" if detail else "")


class _Warnings(logging.Handler):
    """Collects the warnings of a logger (tessera reports each graph break there)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, rec: logging.LogRecord) -> None:
        self.messages.append(rec.getMessage())


# ---- models (child side; needs CUDA, torchvision / transformers) ------------------------------
class PlainOutput(torch.nn.Module):
    """A transformers model returning one tensor (logits or last_hidden_state), so every system
    computes and is timed on the same thing."""

    def __init__(self, model: torch.nn.Module, attr: str, **kwargs: Any):
        super().__init__()
        self.model, self.attr, self.kwargs = model, attr, kwargs

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(input_ids=input_ids, **self.kwargs), self.attr)


def build(spec: ModelSpec, seed: int = 0) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The fp16 model in eval mode on the GPU, random weights, and its random inputs (fixed seed)."""
    torch.manual_seed(seed)
    with torch.device("cuda"):
        if spec.family == "resnet50":
            import torchvision

            model: torch.nn.Module = torchvision.models.resnet50(weights=None)
            inputs: tuple[torch.Tensor, ...] = (torch.randn(spec.batch, 3, 224, 224).half(),)
        else:
            import transformers as tf

            if spec.family == "bert":
                inner = tf.BertModel(tf.BertConfig())
                model = PlainOutput(inner, "last_hidden_state")
            elif spec.family == "gpt2":
                inner = tf.GPT2LMHeadModel(tf.GPT2Config())
                model = PlainOutput(inner, "logits", use_cache=False)
            elif spec.family == "mixtral":
                from decode_case import mixtral

                inner = mixtral(tiny=False)
                model = PlainOutput(inner, "logits", use_cache=False)
            else:
                config = tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                        num_attention_heads=32, num_key_value_heads=4)  # fmt: skip
                inner = tf.LlamaForCausalLM(config)
                model = PlainOutput(inner, "logits", use_cache=False)
            inputs = (torch.randint(0, inner.config.vocab_size, (spec.batch, spec.seq or 128)),)
    return model.half().eval(), inputs


def reference(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """float32 eager output of a `model.float()` copy of the same weights, TF32 off."""
    ref_model = copy.deepcopy(model).float()
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        out = ref_model(*[x.float() if x.is_floating_point() else x for x in inputs]).float()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        del ref_model
        torch.cuda.empty_cache()
    return out


def output_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float | None, float | None, str | None]:
    """(‖out − ref‖ / ‖ref‖, max|out − ref| / max|ref|, note) in float64; a non-finite output is a note."""
    if out.shape != ref.shape:
        return None, None, f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(ref).all()):
        return None, None, "non-finite values in the float32 reference"
    if not bool(torch.isfinite(out).all()):
        return None, None, "non-finite values in the output"
    diff = out - ref
    rel = float(diff.norm() / ref.norm().clamp_min(1e-30))
    return rel, float(diff.abs().max() / ref.abs().max().clamp_min(1e-30)), None


def _sync_call(fn: Callable[..., Any], inputs: tuple) -> tuple[Any, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*inputs)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _dynamo_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _tessera_stats() -> dict[str, int]:
    try:
        from tessera.frontend.torch import stats
    except Exception:  # noqa: BLE001
        return {}
    return dict(stats)


def measure(system: str, model: torch.nn.Module, inputs: tuple, ref: torch.Tensor | None, timer: Any,
            opts: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One system: cold and warm compile, steady-state latency, error against `ref`."""

    def body(res: dict[str, Any]) -> None:
        with alarm(opts.system_timeout), fresh_inductor_cache(system):
            broken = None
            torch._dynamo.reset()
            if system == EAGER:
                fn: Callable[..., Any] = model
            elif system == EAGER_GRAPH:
                fn = cuda_graphed(model, inputs)
            else:
                if system == TESSERA:
                    res["extra"] = {"tessera_backend": ensure_tessera_backend()}
                stats0, breaks0, catcher = _tessera_stats(), _dynamo_breaks(), _Warnings()
                logging.getLogger("tessera").addHandler(catcher)
                try:
                    _, res["compile_s_cold"] = _sync_call(torch.compile(model, **compile_kwargs(system)), inputs)
                finally:
                    logging.getLogger("tessera").removeHandler(catcher)
                res["graph_breaks"] = _dynamo_breaks() - breaks0
                if system == TESSERA:
                    delta = {k: v - stats0.get(k, 0) for k, v in _tessera_stats().items()}
                    res["extra"]["tessera_graph"] = delta
                    broken = graph_break_error(delta.get("graphs"), res["graph_breaks"], delta.get("eager_nodes", 0),
                                               catcher.messages)  # fmt: skip
                torch._dynamo.reset()
                fn = torch.compile(model, **compile_kwargs(system))
                _, res["compile_s_warm"] = _sync_call(fn, inputs)
            _, one = _sync_call(fn, inputs)
            if one > opts.max_call_s:
                raise RuntimeError(f"one call takes {one:.2f} s (over --max-call-s {opts.max_call_s}); not timed")
            us = timer(fn, *inputs)
            res["host_us"] = host_us(lambda: fn(*inputs), torch.device("cuda"))  # host-bound when close to us
            out = fn(*inputs).detach().float().clone()  # clone: CUDA-graph outputs are overwritten by the next call
            if ref is not None:
                res["rel_err"], res["max_err"], res["note"] = output_errors(out, ref)
            if broken:  # reported, not hidden: the time includes the nodes torch ran between segments
                res.setdefault("extra", {})["graph_break"] = broken
                res["note"] = "; ".join(x for x in (res.get("note"), broken) if x)
            res["us"] = us

    res = guarded(body)
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torchvision", "transformers", "triton"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def run_child(opts: argparse.Namespace) -> None:
    """Measure one model (opts.child) under every selected system; rewrite opts.child_out after each."""
    from harness import Timer, environment

    spec = MODELS[opts.child]
    row = new_row(spec.case)
    row.update(model=opts.child, batch=spec.batch, seq=spec.seq, repeats=opts.repeats, warmup=opts.warmup,
               l2_flush=False, **environment(), **_versions())  # fmt: skip
    row["skipped"] = skipped_systems(opts, spec)
    systems = spec.systems(row["skipped"])
    out_path = Path(opts.child_out)

    def save() -> None:
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(clean(summarize(row)), allow_nan=False))
        os.replace(tmp, out_path)

    save()
    if spec.kv is not None:
        from decode_case import WeightSpec, run_decode

        row["kv"] = spec.kv
        weights = WeightSpec(spec.weight, spec.group_size) if spec.weight else None
        run_decode(row, systems, spec.kv, opts, save=save, weights=weights, family=spec.family)
        return
    with torch.no_grad():
        try:
            model, inputs = build(spec)
        except Exception as e:  # noqa: BLE001
            record_build_failure(row, systems, e, save)
            return
        ref = None
        try:
            ref = reference(model, inputs)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["notes"]["reference"] = "float32 reference failed: " + error_text(e)
        timer = Timer(repeats=opts.repeats, warmup=opts.warmup, flush_l2=False)
        for s in systems:
            print(f"[{opts.child}] {s} ...", flush=True)
            res = measure(s, model, inputs, ref, timer, opts)
            record(row, s, res)
            save()
            shown = {k: v for k, v in res.items() if k != "extra"}
            print(f"[{opts.child}] {s}: {shown}", flush=True)


# ---- parent side ------------------------------------------------------------------------------
def host_env() -> dict[str, Any]:
    """The run's date, GPU, versions and commit, without touching CUDA (the children do the work)."""
    from harness import current_commit

    commit = current_commit()
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True, timeout=30).stdout.splitlines()[0].strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError):
        gpu = "unknown"
    return {"gpu": gpu, "date": datetime.date.today().isoformat(), "commit": commit, "torch": torch.__version__,
            "cuda": torch.version.cuda}  # fmt: skip


def run_model(opts: argparse.Namespace, model: str,
              command: Callable[[Path], list[str]] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run one model's subprocess with fresh compiler caches; every selected system it did not
    finish is recorded as an error. `command(path)`: the subprocess's command line, given the file
    it writes its row to (child_argv by default)."""
    spec = MODELS[model]
    with tempfile.TemporaryDirectory(prefix=f"tessera-models-{model}-") as tmp:
        out_path = Path(tmp) / "row.json"
        env = dict(os.environ, TESSERA_CACHE_DIR=f"{tmp}/tessera", TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor",
                   TRITON_CACHE_DIR=f"{tmp}/triton")  # fmt: skip
        # A session of its own, so that a timeout ends the child's compiler workers too.
        argv = command(out_path) if command else child_argv(opts, model, out_path)
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=opts.model_timeout)
            why = f"the model's subprocess exited with code {code}" if code else "the model's subprocess ended first"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            why = f"the model's subprocess was killed after --model-timeout {opts.model_timeout:.0f} s"
        row = json.loads(out_path.read_text()) if out_path.exists() else new_row(spec.case)
        tuning = Path(tmp) / "tessera" / "tuning"
        if getattr(opts, "keep_tuning", False) and tuning.is_dir():
            _outdir(opts).mkdir(parents=True, exist_ok=True)
            with tarfile.open(_outdir(opts) / f"tuning-{model}.tgz", "w:gz") as tar:
                tar.add(tuning, arcname="tuning")
    for key, value in host_env().items():
        row.setdefault(key, value)
    row.setdefault("model", model)
    row["skipped"] = row.get("skipped") or skipped_systems(opts, spec)
    for s in spec.systems({}):
        done = s in row["errors"] or s in row["skipped"] or row["peers_us"].get(s) is not None
        if not done and not (s == TESSERA and row.get("tessera_us") is not None):
            row["errors"][s] = f"not measured: {why}"
    return summarize(row)


def _outdir(opts: argparse.Namespace) -> Path:
    return Path(opts.out) if opts.out else RESULTS


def run_suite(opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Every selected model in turn; each row is appended as soon as its model is done."""
    outdir = _outdir(opts)
    if opts.repeats < 50:
        print(f"note: --repeats {opts.repeats} is below bench/PROTOCOL.md's 50", flush=True)
    rows = []
    for model in opts.models:
        row = run_model(opts, model)
        path = outdir / f"{stem(row)}.jsonl"
        append_jsonl(path, [row])
        path.with_suffix(".md").write_text(render_markdown(read_jsonl(path)))
        plot_file(path)  # the PNG next to the table
        rows.append(row)
        print(f"{row['case']}: tessera {row.get('tessera_us')} us, peers {row['peers_us']}, "
              f"errors {sorted(row['errors'])} -> {path}", flush=True)  # fmt: skip
    if rows:
        print(render_markdown(read_jsonl(outdir / f"{stem(rows[-1])}.jsonl")))
    return rows


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    if opts.child:
        run_child(opts)
    else:
        run_suite(opts)


if __name__ == "__main__":
    main()
