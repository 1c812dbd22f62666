"""`tessera serve MODEL_DIR`: load the model, build the app, run uvicorn until interrupted."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from tessera import settings
from tessera.errors import ArgumentError, TesseraError
from tessera.llm.llm import LLM
from tessera.llm.server.api import build_app


def serve(args: argparse.Namespace) -> int:
    """Serve `args.model_dir` as the `tessera serve` arguments say (tessera/cli.py declares them)."""
    try:
        api_key = args.api_key or settings.api_key()
    except ArgumentError as exc:
        print(f"tessera serve: {exc}", file=sys.stderr)
        return 1
    options = {"device": args.device, "dtype": args.dtype, "quantization": args.quantization,
               "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
               "enable_prefix_caching": not getattr(args, "no_prefix_cache", False),
               "tensor_parallel_size": getattr(args, "tensor_parallel_size", None)}  # fmt: skip
    try:
        llm = LLM(args.model_dir, **{k: v for k, v in options.items() if v is not None})
    except (TesseraError, ValueError, OSError) as exc:  # a wrong path or option: a message, not a traceback
        print(f"tessera serve: cannot serve {args.model_dir}: {exc}", file=sys.stderr)
        return 1
    app = build_app(llm.engine, args.served_model_name, api_key=api_key, max_queue=args.max_queue)
    name = args.served_model_name or llm.engine.model_name
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"tessera serve: listening on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)  # fmt: skip
    print(f"tessera serve: {name!r} on http://{args.host}:{args.port}/v1 "
          f"(context {llm.engine.max_model_len} tokens, at most {args.max_queue} requests in flight)", file=sys.stderr)  # fmt: skip
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        llm.close()  # tensor-parallel workers stop with the server
    return 0
