"""Tensor parallelism in tessera.llm on the CPU: two gloo ranks against one process.

The layer test spawns two ranks that shard tiny decoders of every family (and single layers)
and compare with the unsharded model; the engine tests run `LLM(..., tensor_parallel_size=2)`
(rank 0 here, one worker process) against `LLM(...)` on the same directory.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from tiny_llm import FAMILIES, PROMPTS, make_model, model_dir_maker

from tessera.cli import main
from tessera.llm import LLM, SamplingParams
from tessera.llm.parallel.group import TensorParallelError, make_process_group
from tessera.llm.parallel.layers import (
    Communicator,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    plan_shards,
    shard_model,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
ENGINE = dict(device="cpu", num_kv_blocks=64, max_model_len=256, max_num_seqs=8)

# (family, config overrides): every family; KV heads replicated (1 KV head over 2 ranks); tied
# embeddings with a vocabulary that does not divide by 2 (padded).
SHARD_CASES = [(f, {}) for f in FAMILIES] + [
    ("llama", {"num_key_value_heads": 1}),
    ("qwen2", {"tie_word_embeddings": True, "vocab_size": 383}),
]


def _rank_check_layers(rank: int, port: int, results: multiprocessing.Queue) -> None:
    """One rank of the layer test: every case's max |sharded - unsharded| logit, and single layers'."""
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
        comm = Communicator(make_process_group(store, rank, 2, "gloo", 60.0), rank, 2)
        errors = {}
        torch.manual_seed(0)
        x = torch.randn(3, 5, 32)
        full = torch.nn.Linear(32, 16)
        # Row-parallel: each rank takes its half of the inputs; the bias is added once.
        full_row = torch.nn.Linear(32, 16)
        row = RowParallelLinear(torch.nn.Linear(16, 16, bias=False), full_row.bias.detach().clone(), comm)
        with torch.no_grad():
            row.linear.weight.copy_(full_row.weight[:, rank * 16 : (rank + 1) * 16])
            errors["row_parallel"] = (row(x[..., rank * 16 : (rank + 1) * 16]) - full_row(x)).abs().max().item()
            # Column-parallel: the rank's output rows, no communication.
            col = torch.nn.functional.linear(
                x, full.weight[rank * 8 : (rank + 1) * 8], full.bias[rank * 8 : (rank + 1) * 8]
            )
            errors["column_parallel"] = (col - full(x)[..., rank * 8 : (rank + 1) * 8]).abs().max().item()
            table = torch.nn.Embedding(11, 32)  # 11 rows: 6 per rank, the last one padding
            shard = torch.cat([table.weight, torch.zeros(1, 32)])[rank * 6 : (rank + 1) * 6]
            ids = torch.tensor([[0, 5, 6, 10, 3]])
            embedding = VocabParallelEmbedding(shard.clone(), rank * 6, 11, comm)
            errors["vocab_embedding"] = (embedding(ids) - table(ids)).abs().max().item()
            head = ParallelLMHead(torch.nn.Parameter(shard.clone()), None, 11, comm)
            errors["lm_head"] = (head(x) - x @ table.weight.T).abs().max().item()
        for family, overrides in SHARD_CASES:
            model = make_model(family, **overrides)
            model.set_attn_implementation("sdpa")
            ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                expected = model(ids).logits
                shard_model(model, comm)
                got = model(ids).logits
            errors[f"{family}{overrides}"] = (got - expected).abs().max().item()
        results.put((rank, errors))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tensor_parallel_layers_match_unsharded():
    """Two spawned gloo ranks: row/column-parallel linears, the vocabulary-parallel embedding and
    LM head, and whole sharded decoders of every family equal the unsharded ones."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_check_layers, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, errors in got.items():
        assert isinstance(errors, dict), f"rank {rank} failed:\n{errors}"
        bad = {case: err for case, err in errors.items() if not err < 1e-4}
        assert not bad, f"rank {rank}: sharded differs from unsharded: {bad}"
        assert len(errors) == 4 + len(SHARD_CASES)


def test_tensor_parallel_plan_checks_sizes():
    config = transformers.LlamaConfig(num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                                      intermediate_size=96)  # fmt: skip
    assert plan_shards(config, 2).local_kv_heads == 1
    replicated = plan_shards(config, 4)  # 2 KV heads over 4 ranks: each on 2 ranks
    assert (replicated.local_heads, replicated.local_kv_heads) == (2, 1)
    assert [replicated.kv_head_start(r) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible"):
        plan_shards(config, 3)
    with pytest.raises(ValueError, match="intermediate_size=96 is not divisible"):
        plan_shards(config, 64)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads=2"):
        plan_shards(transformers.LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48), 3)
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="positive integer"):
            plan_shards(config, bad)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return model_dir_maker(tmp_path_factory)


def test_tensor_parallel_bad_sizes_are_clear_errors(model_dirs):
    model_dir = model_dirs("llama")  # 4 heads over 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not fit this model: num_attention_heads=4"):
        LLM(model_dir, tensor_parallel_size=3, **ENGINE)
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
            LLM(model_dir, tensor_parallel_size=bad, **ENGINE)
    with pytest.raises(ValueError, match="needs a model directory"):
        LLM(make_model("llama"), tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match="compile_model is not supported"):
        LLM(model_dir, tensor_parallel_size=2, compile_model=True, **ENGINE)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="needs GPUs up to cuda:1"):
            LLM(model_dir, tensor_parallel_size=2, **{**ENGINE, "device": "cuda"})


def _generate(llm: LLM, prompts) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, GREEDY)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def _check_equal(model_dir) -> None:
    prompts = PROMPTS + [[5, 17, 200, 31] * 10]  # a longer prompt too: prefilled with the others
    # Then prompts the prefix cache has seen: whole ones, and one ending inside a cached block
    # (its partial block is copied on every rank).
    again = [*prompts, [5, 17, 200, 31] * 10 + [7, 8]]
    one = LLM(model_dir, **ENGINE)
    expected = _generate(one, prompts) + _generate(one, again)
    two = LLM(model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        assert two.engine.runner.num_kv_heads == one.engine.runner.num_kv_heads // 2
        got = _generate(two, prompts) + _generate(two, again)
        assert two.engine.stats().prefix_cache_hit_tokens > 0
    finally:
        two.close()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.slow
def test_tensor_parallel_llama_equals_one_process(model_dirs):
    """Greedy tokens identical, log-probabilities close at fp32: Llama over 2 gloo ranks."""
    _check_equal(model_dirs("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "phi3", "gemma"])
def test_tensor_parallel_family_equals_one_process(model_dirs, family):
    _check_equal(model_dirs(family))


@pytest.mark.slow
def test_tensor_parallel_worker_failure_surfaces(model_dirs):
    """An exception in a worker reaches rank 0 as TensorParallelError with the worker's traceback,
    without hanging; the LLM refuses later steps; the worker process is gone."""
    llm = LLM(model_dirs("llama"), tensor_parallel_size=2, **ENGINE)
    group = llm.engine.parallel
    group.broadcast(("step", "not a batch"))  # the worker's run() raises AttributeError on it
    with pytest.raises(TensorParallelError, match=r"(?s)worker 1 failed.*AttributeError"):
        llm.generate(PROMPTS[:1], GREEDY)
    with pytest.raises(TensorParallelError, match="stopped"):
        llm.generate(PROMPTS[:1], GREEDY)
    assert all(p.poll() is not None for p in group._workers.procs)


@pytest.mark.slow
def test_tensor_parallel_killed_worker_and_close(model_dirs):
    """A worker killed mid-service fails the next step clearly; close() and garbage collection stop workers."""
    llm = LLM(model_dirs("llama"), tensor_parallel_size=2, **ENGINE)
    procs = llm.engine.parallel._workers.procs
    assert len(_generate(llm, PROMPTS[:2])) == 2
    procs[0].kill()
    procs[0].wait()
    with pytest.raises(TensorParallelError, match="tensor-parallel group stopped"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm = LLM(model_dirs("llama"), tensor_parallel_size=2, **ENGINE)
    procs = llm.engine.parallel._workers.procs
    del llm
    gc.collect()
    assert all(p.wait(15) == 0 for p in procs)


def test_serve_tensor_parallel_size_reaches_the_engine(model_dirs, capsys):
    """`tessera serve --tensor-parallel-size N` passes N to the engine: a size the model cannot take is refused."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    assert main(["serve", str(model_dirs("llama")), "--device", "cpu", "--tensor-parallel-size", "3"]) == 1
    assert "tensor_parallel_size=3 does not fit this model" in capsys.readouterr().err


def _exited(pid: int) -> bool:
    """Whether process `pid` is gone (or a zombie no one has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_tensor_parallel_workers_exit_with_a_killed_parent(model_dirs):
    """Rank 0 killed (SIGKILL, no cleanup at all): its worker notices and exits by itself."""
    script = (
        "import os, signal, sys\n"
        "from tessera.llm import LLM\n"
        f"llm = LLM({str(model_dirs('llama'))!r}, tensor_parallel_size=2, **{ENGINE!r})\n"
        "print(llm.engine.parallel._workers.procs[0].pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while not _exited(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _exited(pid), f"worker {pid} outlived its parent"
