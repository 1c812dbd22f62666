"""Rank 0's side of tensor parallelism: the worker processes, the process group, lockstep steps.

`TensorParallelGroup` starts world_size - 1 workers (`python -m tessera.llm.parallel.worker`,
one per device: cuda:i+rank, or the CPU), rendezvouses them with rank 0 (this process) in a
torch.distributed process group over a TCPStore on a free localhost port (NCCL on CUDA, gloo on
the CPU), and keeps one authenticated control connection per worker.  Every rank loads the model
and keeps its shard (layers.py); rank 0 schedules, sends each step's packed batch down the
control connections, runs its own shard of the forward in lockstep with the workers (the
all-reduces meet inside the model), and alone samples.

Steps travel over the control connections rather than a collective so that idle workers wait
without a collective's timeout, and a dead parent is an EOF.  Subprocesses rather than
multiprocessing's spawn, so that the user's __main__ module is not imported again in workers.

Failures: a worker that raises sends its traceback and exits, which breaks the collective rank 0
waits in (gloo: the peer's connection closes; NCCL: the group's timeout); rank 0 then raises
`TensorParallelError` with the worker's message, stops the other workers, and refuses later
steps.  Workers exit when rank 0 closes the group, is collected, or dies.
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

from tessera.errors import TesseraError
from tessera.llm.loader import LoadedModel
from tessera.llm.model_runner import ModelRunner
from tessera.llm.parallel.layers import Communicator, ShardPlan, plan_shards, shard_model
from tessera.llm.scheduler import ScheduledSequence

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
# How long a collective, the rendezvous, or a worker's start (loading included) may take.
TIMEOUT_S = 600.0
# How long rank 0 waits for a failed worker's message before reporting without it.
FAILURE_GRACE_S = 5.0


class TensorParallelError(TesseraError, RuntimeError):
    """A tensor-parallel worker failed (its message included), or the group failed earlier."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to join the group and load its shard (sent over the control connection)."""

    rank: int
    world_size: int
    store_port: int
    backend: str
    device: str
    timeout_s: float
    model: str
    dtype: str | torch.dtype
    quantization: str | None


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: cuda:(index + rank) on CUDA, the CPU otherwise."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def make_process_group(store: dist.Store, rank: int, world_size: int, backend: str,
                       timeout_s: float) -> dist.ProcessGroup:  # fmt: skip
    """A process group of its own (not the default one, so several engines and a user's own
    torch.distributed setup coexist in one process)."""
    store = dist.PrefixStore("tessera_tp", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


class _Workers:
    """The worker processes and their connections (no reference to the group: its finalizer owns this)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.conns: dict[int, Connection] = {}
        self.closed = False

    def watch(self, group: dist.ProcessGroup) -> None:
        """Abort `group` when a worker dies unannounced: a collective rank 0 waits in then fails at
        once (gloo notices a closed peer by itself; NCCL would wait for its timeout)."""
        while not self.closed:
            if any(proc.poll() is not None for proc in self.procs):
                if not self.closed:
                    try:
                        group.abort()
                    except Exception:  # noqa: BLE001  (a backend without abort: its timeout still ends the wait)
                        pass
                return
            time.sleep(0.5)

    def stop(self, wait_s: float = 10.0) -> None:
        """Tell the workers to stop; kill those still running after `wait_s` (0: blocked ones, after a failure)."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns.values():
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns.values():
            conn.close()


class TensorParallelGroup:
    """Rank 0 of `world_size` processes serving one model (see the module docstring).

    model: a local Hugging Face directory (each rank loads its own shard from it).  Raises
    ValueError when the model's heads, KV heads or MLP do not divide over world_size, or there are
    fewer GPUs than ranks."""

    def __init__(self, model: str | Path | transformers.PreTrainedModel, world_size: int, device: torch.device,
                 dtype: str | torch.dtype, quantization: str | None, compile_model: bool = False,
                 timeout_s: float = TIMEOUT_S) -> None:  # fmt: skip
        if not isinstance(model, str | Path):
            raise ValueError("tensor_parallel_size > 1 needs a model directory: every rank loads its own shard of it")
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
        plan_shards(transformers.AutoConfig.from_pretrained(path, local_files_only=True), world_size)
        if compile_model:
            raise ValueError("compile_model is not supported with tensor_parallel_size > 1 yet (run eagerly)")
        if device.type == "cuda" and (device.index or 0) + world_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={world_size} from {device} needs GPUs up to "
                             f"cuda:{(device.index or 0) + world_size - 1}; there are {torch.cuda.device_count()}")  # fmt: skip
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"tensor parallelism runs on cuda or cpu, not {device.type}")
        self.world_size, self.device, self.timeout_s = world_size, device, timeout_s
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.plan: ShardPlan | None = None
        self.error: TensorParallelError | None = None
        self._workers = _Workers()
        self._finalizer = weakref.finalize(self, self._workers.stop)
        try:
            self._start(path, dtype, quantization)
        except BaseException:
            self.close()
            raise

    def _start(self, path: Path, dtype: str | torch.dtype, quantization: str | None) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, timeout=timeout,
                                    wait_for_workers=False)  # fmt: skip
        key = secrets.token_bytes(32)
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(0.2)
        # The workers import this tessera, wherever it was found (an uninstalled checkout included).
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
        try:
            for rank in range(1, self.world_size):
                cmd = [sys.executable, "-m", "tessera.llm.parallel.worker", str(server.getsockname()[1]), str(rank)]
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
                self._workers.procs.append(proc)
                proc.stdin.write(key.hex().encode() + b"\n")
                proc.stdin.close()
            self._accept(server, key)
        finally:
            server.close()
        for rank, conn in self._workers.conns.items():
            conn.send(WorkerSpec(rank, self.world_size, self._store.port, self.backend,
                                 str(rank_device(self.device, rank)), self.timeout_s, str(path.resolve()), dtype,
                                 quantization))  # fmt: skip
        self.comm = Communicator(make_process_group(self._store, 0, self.world_size, self.backend, self.timeout_s),
                                 0, self.world_size)  # fmt: skip
        if self.backend == "nccl":
            threading.Thread(target=self._workers.watch, args=(self.comm.group,), daemon=True,
                             name="tessera-tp-watch").start()  # fmt: skip

    def _accept(self, server: socket.socket, key: bytes) -> None:
        deadline = time.monotonic() + self.timeout_s
        while len(self._workers.conns) < self.world_size - 1:
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not connect within {self.timeout_s:.0f} s")
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            sock.setblocking(True)
            conn = Connection(sock.detach())
            try:
                deliver_challenge(conn, key)
                answer_challenge(conn, key)
                rank = conn.recv()
            except (OSError, EOFError, AuthenticationError):  # not one of ours (or gone): wait for the others
                conn.close()
                continue
            if not isinstance(rank, int) or not 0 < rank < self.world_size or rank in self._workers.conns:
                conn.close()
                raise TensorParallelError(f"a tensor-parallel worker announced itself as rank {rank!r}")
            self._workers.conns[rank] = conn

    def _check_alive(self, doing: str) -> None:
        for rank, proc in enumerate(self._workers.procs, start=1):
            if proc.poll() is not None:
                message = self._worker_message(rank, 0.0)
                raise TensorParallelError(f"tensor-parallel worker {rank} exited with code {proc.returncode} "
                                          f"while {doing}" + (f":\n{message}" if message else ""))  # fmt: skip

    def _worker_message(self, rank: int, wait_s: float) -> str | None:
        """The traceback worker `rank` sent, waiting up to `wait_s` while it still runs."""
        conn = self._workers.conns.get(rank)
        proc = self._workers.procs[rank - 1]
        deadline = time.monotonic() + wait_s
        try:
            while conn is not None:
                if conn.poll(min(0.1, wait_s)):
                    message = conn.recv()
                    if message[0] == "error":
                        return message[1]
                elif proc.poll() is not None or time.monotonic() >= deadline:
                    return None
        except (OSError, EOFError):
            pass
        return None

    def shard(self, model: transformers.PreTrainedModel) -> None:
        """Keep rank 0's shard of `model` (load_model's shard hook)."""
        self.plan = shard_model(model, self.comm)

    def start_runner(self, loaded: LoadedModel, **runner_kwargs: Any) -> TensorParallelRunner:
        """Rank 0's runner, once every worker has built its own with the same arguments."""
        if self.plan is None:
            raise RuntimeError("start_runner before the model was loaded with shard=group.shard")
        self.broadcast(("runner", runner_kwargs))
        try:
            runner = TensorParallelRunner(self, loaded, comm=self.comm, num_kv_heads=self.plan.local_kv_heads,
                                          **runner_kwargs)  # fmt: skip
            for rank, conn in self._workers.conns.items():
                deadline = time.monotonic() + self.timeout_s
                while not conn.poll(0.2):
                    self._check_alive("loading the model")
                    if time.monotonic() > deadline:
                        raise TensorParallelError(
                            f"tensor-parallel worker {rank} was not ready in {self.timeout_s:.0f} s"
                        )
                message = conn.recv()
                if message[0] != "ready":
                    raise TensorParallelError(f"tensor-parallel worker {rank} failed while loading:\n{message[1]}")
        except TensorParallelError:
            raise
        except Exception as exc:
            raise self.fail(exc) from exc
        return runner

    def broadcast(self, message: tuple) -> None:
        """Send `message` to every worker (pickled once)."""
        if self.error is not None:
            raise self.error
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._workers.conns.values():
                conn.send_bytes(data)
        except OSError as exc:
            raise self.fail(exc) from exc

    def fail(self, exc: BaseException) -> TensorParallelError:
        """Stop the group after `exc` in a step; the error to raise (with the workers' messages)."""
        if self.error is not None:
            return self.error
        # An interrupt of rank 0 leaves the workers blocked: nothing to wait for.
        grace = FAILURE_GRACE_S if isinstance(exc, Exception) else 0.0
        deadline = time.monotonic() + grace
        messages = []
        for rank in self._workers.conns:
            message = self._worker_message(rank, max(0.0, deadline - time.monotonic()))
            if message is not None:
                messages.append(f"tensor-parallel worker {rank} failed:\n{message}")
        self._finalizer.detach()
        self._workers.stop(wait_s=0.0)  # the others are blocked in a collective that cannot finish
        detail = "\n".join(messages) or f"rank 0: {type(exc).__name__}: {exc}"
        self.error = TensorParallelError(f"the tensor-parallel group stopped; create a new engine. {detail}")
        return self.error

    def close(self) -> None:
        """Stop the workers (they finish their step first, or are killed after 10 s)."""
        self._finalizer()


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: sends each packed step to the workers, then runs its own shard."""

    def __init__(self, group: TensorParallelGroup, loaded: LoadedModel, **kwargs: Any) -> None:
        self.group = group
        super().__init__(loaded, **kwargs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """The prefix cache's block copies, on every rank's share of the KV cache."""
        if pairs:
            self.group.broadcast(("copy", pairs))
        super().copy_blocks(pairs)

    def execute(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        batch = self.pack(scheduled)
        self.group.broadcast(("step", batch))
        try:
            return self.run(batch)
        except BaseException as exc:  # an interrupt too: the workers are out of step from here on
            error = self.group.fail(exc)
            if isinstance(exc, Exception):
                raise error from exc
            raise
