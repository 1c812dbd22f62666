"""Command-line interface.

    tessera examples            build and run the example kernels, checked against numpy
    tessera demo                compile a transformer with torch.compile(backend="tessera") and run it
    tessera run MODEL           compile an ONNX model (or a saved compiled graph) and run it
    tessera bench [--suite S]   run a benchmark suite (bench/run.py of a source checkout)
    tessera cache ACTION        list, size, verify or clear the artifact cache
    tessera serve MODEL_DIR     serve an LLM over an OpenAI-compatible HTTP API (the serve extra)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tessera.cli_cache import add_parser as add_cache_parser
from tessera.cli_cache import run as run_cache
from tessera.errors import TesseraError
from tessera.examples.demo import run_demo
from tessera.examples.run import run_examples
from tessera.run_model import run_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera", description="tessera deep-learning compiler")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("examples", help="build and run the example kernels, checked against numpy")
    ex.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ex.add_argument("--tolerance", type=float, default=1e-4, help="fail if a max relative error exceeds this")
    demo = sub.add_parser("demo", help="compile a GPT-2-style model through torch.compile and compare with torch")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    demo.add_argument("--model", choices=["gpt2", "llama", "resnet18", "bert"], default="gpt2")
    run = sub.add_parser("run", help="compile an ONNX model (or a saved compiled graph) and run it")
    run.add_argument("model", help="path to a .onnx file or a file saved by CompiledGraph.save")
    run.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    run.add_argument("--input", action="append", default=[], help="an input as .npy (repeat, in input order)")
    run.add_argument("--dim", action="append", default=[], help="a symbolic size, name=value (default 1)")
    run.add_argument("--repeat", type=int, default=20, help="timed calls after the warm-up")
    run.add_argument("--int-high", type=int, default=100, help="random integer inputs are drawn from [0, this)")
    run.add_argument("--save", help="also save the compiled graph to this file")
    run.add_argument("--explain", action="store_true",
                     help="print the compile report: kernels and their fused operators, templates and configurations, "
                          "operators left to the reference and why, memory plan, compile time by phase")
    bench = sub.add_parser("bench", help="run a benchmark suite (needs a source checkout with bench/)")
    bench.add_argument("--suite", default="models", help="models, gemm or reduce")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="further arguments for bench/run.py")

    add_cache_parser(sub)
    serve = sub.add_parser("serve", help="serve a Hugging Face model directory over an OpenAI-compatible HTTP API")
    serve.add_argument("model_dir", help="a local Hugging Face model directory (config.json, safetensors, tokenizer)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when there is a GPU")
    serve.add_argument("--dtype", help="weights' and activations' dtype (float16, bfloat16, float32)")
    serve.add_argument("--quantization", help="low-bit weights of a float checkpoint: TYPE[:gN|:channel], e.g. int4 or int3:g64 (a GPTQ/AWQ/compressed-tensors directory needs none)")
    serve.add_argument("--max-model-len", type=int, help="context length (prompt and output tokens)")
    serve.add_argument("--max-num-seqs", type=int, help="sequences batched together at most")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="recompute every prompt in full (no KV reuse between requests; for ablations)")  # fmt: skip
    serve.add_argument(
        "--tensor-parallel-size", type=int, help="shard the model over N GPUs (or CPU processes), one process each"
    )
    serve.add_argument("--max-queue", type=int, default=256, help="requests in flight beyond which new ones get 503")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $TESSERA_API_KEY)")
    serve.add_argument("--served-model-name", help="the name clients pass as model (default: the model's)")
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except TesseraError as exc:
        print(f"tessera {args.command}: {exc}", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "examples":
        results = run_examples(args.device)
        bad = [r["case"] for r in results if not r["max_rel_err"] <= args.tolerance]
        if bad:
            print(f"FAILED: error above {args.tolerance} in {', '.join(bad)}", file=sys.stderr)
            return 1
        print("all examples match numpy")
    elif args.command == "demo":
        return 0 if run_demo(args.model, args.device) else 1
    elif args.command == "run":
        run_model(args.model, args.device, args.input, args.dim, args.repeat, args.int_high, args.save, args.explain)
    elif args.command == "cache":
        return run_cache(args)
    elif args.command == "serve":
        try:
            from tessera.llm.server.main import serve  # optional: fastapi, uvicorn
        except ModuleNotFoundError as exc:
            if exc.name not in ("fastapi", "uvicorn", "starlette", "pydantic"):
                raise
            print(f'tessera serve needs {exc.name}: pip install "tessera[serve]"', file=sys.stderr)
            return 1
        return serve(args)
    elif args.command == "bench":
        script = Path(__file__).resolve().parents[1] / "bench" / "run.py"
        if not script.exists():
            print(f"tessera bench: {script} not found; the benchmarks live in a source checkout (pip install -e .)",
                  file=sys.stderr)  # fmt: skip
            return 1
        return subprocess.call([sys.executable, str(script), "--suite", args.suite, *args.rest], cwd=script.parents[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
