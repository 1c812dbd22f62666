"""The `serving` bench suite (bench/serving_suite.py): the engine's step log it builds its roofline
on, its percentile and roofline arithmetic, and (slow) the whole `--tiny --device cpu` smoke run,
its rows' fields and that every row made exactly the tokens it asked for."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import serving_workloads as sw  # noqa: E402

from tessera.llm import LLM, SamplingParams  # noqa: E402


def test_step_log_counts_tokens_and_kv_positions(tmp_path: Path) -> None:
    model_dir = sw.build_model_dir(sw.TINY, torch.float32, tmp_path / "model")
    llm = LLM(str(model_dir), device="cpu", enforce_eager=True, num_kv_blocks=64, max_model_len=256)
    assert llm.device == torch.device("cpu") and llm.engine.step_log is None
    log = llm.engine.enable_step_log(maxlen=1000)
    prompts, new = [[5] * 7, [6] * 12], 5
    llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    steps = list(log)
    # Every prompt token and every output token but the last is computed once.
    assert sum(t for t, _ in steps) == sum(len(p) + new - 1 for p in prompts)
    # One step prefills both prompts (7 + 12 positions), then each decode step reads both contexts.
    assert steps[0] == (19, 19)
    assert steps[1:] == [(2, 19 + 2 * k) for k in range(1, new)]
    assert len(llm.engine.enable_step_log(maxlen=2)) == 0


def test_percentiles_and_roofline() -> None:
    assert sw.percentiles([0.001, 0.002, 0.003]) == pytest.approx({"p50": 2.0, "p99": 2.98})
    assert all(math.isnan(v) for v in sw.percentiles([]).values())
    # One bandwidth-bound step (100 + 10 * 2 bytes at 10 B/s) and one compute-bound (4 * 50 FLOPs at 20/s).
    assert sw.roofline_seconds([(1, 10), (4, 0)], 100, 2, 50, 10.0, 20.0) == pytest.approx(12.0 + 10.0)


def test_prefix_workloads_share_what_they_say() -> None:
    prompts, lens = sw.shared_prefix_workload(3, 4, 10, 5, 7, vocab=100)
    assert len(prompts) == 12 and lens == [7] * 12 and all(len(p) == 15 for p in prompts)
    assert len({tuple(p[:10]) for p in prompts}) == 3 and len({tuple(p) for p in prompts}) == 12
    prompts, lens = sw.few_shot_workload(6, 5, 4, 3, 2, vocab=100)
    assert len({tuple(p[:20]) for p in prompts}) == 1 and all(len(p) == 23 for p in prompts) and lens == [2] * 6
    chats = sw.multi_turn_chats(2, 3, 6, 2, vocab=100)
    seen = []

    def generate(prompts, out_lens):  # answers the prompt's length, out_len times
        seen.append([len(p) for p in prompts])
        return {"seconds": 1.0, "outputs": [[len(p)] * m for p, m in zip(prompts, out_lens, strict=True)]}

    r = sw.run_multi_turn(generate, chats, out_len=3)
    assert seen == [[6, 6], [11, 11], [16, 16]]  # each turn: the last prompt + its 3-token answer + 2 new
    assert r["seconds"] == 3.0 and r["tokens"] == 18 and r["outputs"][0][-3:] == [16] * 3
    assert r["outputs"][0][:6] == chats[0][0] and r["outputs"][0][9:11] == chats[0][1]
    assert sw.tokens_asked({"chats": chats, "out_len": 3}) == 18


def _tiny_run(tmp_path: Path, *args: str) -> dict[str, list[dict]]:
    """A --tiny CPU run of the suite; its rows by part, checked against the JSONL it wrote."""
    import serving_suite as ss

    rows = ss.main(["--tiny", "--device", "cpu", "--out", str(tmp_path), *args])
    (jsonl,) = tmp_path.glob("*-cpu-serving.jsonl")
    assert [json.loads(line) for line in jsonl.read_text().splitlines()] == json.loads(json.dumps(rows, default=str))
    assert jsonl.with_suffix(".md").exists()
    for r in rows:
        assert r["suite"] == "serving" and r["gpu"] == "cpu" and r["commit"] and r["model"] == "tiny-llama"
    return {p: [r for r in rows if r["part"] == p] for p in ("offline", "online", "batch1", "startup", "prefix", "host")}


@pytest.mark.slow
def test_tiny_cpu_smoke_run(tmp_path: Path) -> None:
    """Offline, batch-1 and startup, fp32 and int4 weights."""
    parts = _tiny_run(tmp_path, "--parts", "offline,batch1,startup")
    assert [len(parts[p]) for p in parts] == [2, 0, 2, 1, 0, 0]  # fp32 and int4; startup once
    for r in parts["offline"]:
        assert r["tokens"] == r["tokens_asked"] and r["steps"] > 0 and r["errors"] == {}
        assert set(r["peers_tok_s"]) == {"hf-generate-batch", "hf-generate"}
        assert all(v == r["tokens_asked"] for v in r["peers_tokens"].values())
        assert 0 < r["tessera_tok_s"] < r["roofline_tok_s"] and r["peak_memory_gib"] > 0
    fp32, int4 = (r["weight_gib"] for r in parts["offline"])
    # int4 codes + fp16 scales of the linear layers, the fp32 embedding (tied head) kept: ~0.22 of fp32.
    assert 0.15 < int4 / fp32 < 0.3
    for r in parts["batch1"]:
        assert r["tokens"] == r["tokens_asked"] == 16
        assert 0 < r["floor_ms"] < r["tessera_ms_per_token"]
        assert set(r["peers_ms_per_token"]) == {"hf-generate", "hf-generate:tessera"}
    assert parts["startup"][0]["cold_s"] > 0 and parts["startup"][0]["warm_s"] > 0


@pytest.mark.slow
def test_tiny_cpu_smoke_run_online_and_prefix(tmp_path: Path) -> None:
    """Online arrivals, the prefix-sharing workloads and the host time per step, fp32 weights."""
    parts = _tiny_run(tmp_path, "--parts", "online,prefix,host", "--weights", "fp16")
    assert [len(parts[p]) for p in parts] == [0, 2, 0, 0, 4, 1]  # two rates; four workloads
    (host,) = parts["host"]
    assert host["host_ms_per_step"] > 0 and host["steps"] > 0 and 0 < host["mean_running"] <= 8
    for r in parts["online"]:
        assert r["output_tokens"] == r["tokens_asked"] and r["num_requests"] == 6
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert 0 < r[key]["p50"] <= r[key]["p99"]
    assert [r["workload"] for r in parts["prefix"]] == ["shared-prefix", "few-shot", "multi-turn", "random-8-24"]
    for r in parts["prefix"]:
        assert r["tokens"] == r["tokens_asked"] and r["greedy_equal"] and r["errors"] == {}
        assert set(r["peers_tok_s"]) == {"tessera:no-prefix-cache", "hf-generate-batch"}
        assert (r["hit_rate"] > 0.3) == (r["workload"] != "random-8-24")
