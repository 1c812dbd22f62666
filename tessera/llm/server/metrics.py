"""`/metrics`: the server's and the engine's counters in Prometheus' text format (version 0.0.4).

Every series carries the served model's name as a label, as vLLM's do; names start `tessera_`.
"""

from __future__ import annotations

from tessera.llm.server.async_engine import AsyncLLMEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render(engine: AsyncLLMEngine, model_name: str) -> str:
    """The exposition text: one HELP, TYPE and sample line per metric."""
    stats = engine.stats
    label = '{model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"') + '"}'

    def stat(name: str) -> float:
        return getattr(stats, name, 0) if stats is not None else 0

    blocks_total = stat("num_kv_blocks")
    rows = [
        ("requests_total", "counter", "requests admitted", engine.requests_total),
        ("requests_rejected_total", "counter", "requests refused because the server was full (HTTP 503)",
         engine.requests_rejected),
        ("requests_failed_total", "counter", "requests ended by an engine error (HTTP 500)", engine.requests_failed),
        ("requests_finished_total", "counter", "requests the engine finished", stat("num_requests_finished")),
        ("requests_running", "gauge", "requests the engine is generating for", stat("num_running")),
        ("requests_waiting", "gauge", "requests waiting in the engine's scheduler", stat("num_waiting")),
        ("queue_length", "gauge", "requests in flight in the server: queued or running", engine.num_pending),
        ("queue_limit", "gauge", "requests in flight beyond which new ones get HTTP 503", engine.max_pending),
        ("prompt_tokens_total", "counter", "prompt tokens processed", stat("prompt_tokens_total")),
        ("generation_tokens_total", "counter", "tokens generated", stat("generation_tokens_total")),
        ("generation_tokens_per_second", "gauge", "tokens generated per second over the last 10 s",
         engine.generation_tokens_per_s()),
        ("kv_blocks_used", "gauge", "KV-cache blocks in use", stat("num_kv_blocks_used")),
        ("kv_blocks_total", "gauge", "KV-cache blocks in the pool", blocks_total),
        ("kv_cache_usage_ratio", "gauge", "fraction of the KV-cache blocks in use",
         stat("num_kv_blocks_used") / blocks_total if blocks_total else 0.0),
        ("kv_blocks_cached", "gauge", "KV-cache blocks held only by the prefix cache (reused or evicted as needed)",
         stat("num_kv_blocks_cached")),
        ("prefix_cache_queries_total", "counter", "prompt tokens looked up in the prefix cache",
         stat("prefix_cache_query_tokens")),
        ("prefix_cache_hits_total", "counter", "prompt tokens found in the prefix cache (not computed)",
         stat("prefix_cache_hit_tokens")),
        ("prefix_cache_hit_rate", "gauge", "prefix cache hits / queries since the start",
         stat("prefix_cache_hit_tokens") / stat("prefix_cache_query_tokens") if stat("prefix_cache_query_tokens") else 0.0),
        ("preemptions_total", "counter", "requests preempted (their KV recomputed later)", stat("num_preemptions")),
        ("engine_up", "gauge", "1 while the engine thread runs", int(engine.is_running)),
    ]  # fmt: skip
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP tessera_{name} {help_text}", f"# TYPE tessera_{name} {kind}",
                  f"tessera_{name}{label} {_number(value)}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
