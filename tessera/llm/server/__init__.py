"""tessera.llm's OpenAI-compatible HTTP server (`tessera serve MODEL_DIR`).

- `async_engine.py`: `AsyncLLMEngine`, one thread that owns the synchronous `LLMEngine` and
  streams each request's outputs to asyncio; the bound on requests in flight (503 beyond it).
- `protocol.py`: the request and response bodies of the OpenAI API (pydantic), and its error shape.
- `serving.py`: requests to `SamplingParams` and engine outputs to responses and SSE chunks.
- `metrics.py`: the Prometheus text of `/metrics`.
- `api.py`: `build_app(engine, served_model_name, api_key=None, max_queue=...)`, the FastAPI app.
- `main.py`: `serve(args)`, what `tessera serve` runs (loads the model, starts uvicorn).

The modules other than this one import fastapi/uvicorn/pydantic at module level: the `serve`
extra (`pip install "tessera[serve]"`).
"""
