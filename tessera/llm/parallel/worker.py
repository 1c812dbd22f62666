"""A tensor-parallel worker: `python -m tessera.llm.parallel.worker PORT RANK` (started by group.py).

It reads the group's key from stdin, connects to rank 0's control port, joins the process group,
loads its shard of the model, builds its model runner with rank 0's arguments, and then runs each
step rank 0 sends, in lockstep, until told to stop.  Any exception goes back to rank 0 as a
traceback before the worker exits; a dead rank 0 (EOF, or a new parent process id) ends it too.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import torch
import torch.distributed as dist

from tessera.llm.loader import load_model
from tessera.llm.model_runner import ModelRunner
from tessera.llm.parallel.group import WorkerSpec, make_process_group
from tessera.llm.parallel.layers import Communicator, shard_model


def _exit_with_parent(parent: int) -> None:
    """End this process once its parent is gone (a collective may be blocked with no peer left)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def serve(conn: Connection) -> None:
    """Join the group as the spec says, then run rank 0's steps until it says stop."""
    spec: WorkerSpec = conn.recv()
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the CPU: a worker's intra-op threads get its share of the cores, not all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False)
    comm = Communicator(make_process_group(store, spec.rank, spec.world_size, spec.backend, spec.timeout_s),
                        spec.rank, spec.world_size)  # fmt: skip
    plans = []
    loaded = load_model(spec.model, None, spec.dtype, device, spec.quantization,
                        shard=lambda model: plans.append(shard_model(model, comm)))  # fmt: skip
    message = conn.recv()
    if message[0] != "runner":
        return
    runner = ModelRunner(loaded, comm=comm, num_kv_heads=plans[0].local_kv_heads, **message[1])
    conn.send(("ready",))
    while True:
        message = pickle.loads(conn.recv_bytes())
        if message[0] == "step":
            runner.run(message[1])
        elif message[0] == "copy":
            runner.copy_blocks(message[1])
        elif message[0] == "stop":
            return


def main(argv: list[str]) -> int:
    port, rank = int(argv[0]), int(argv[1])
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    key = bytes.fromhex(sys.stdin.readline().strip())
    conn = Connection(socket.create_connection(("127.0.0.1", port)).detach())
    answer_challenge(conn, key)
    deliver_challenge(conn, key)
    conn.send(rank)
    try:
        serve(conn)
    except EOFError:  # rank 0 closed the connection: nothing to report to
        return 1
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    # os._exit: skip interpreter teardown, where a process group's threads may still be blocked.
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
