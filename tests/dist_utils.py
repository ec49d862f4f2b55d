"""Run a function in a gloo world of N processes on 127.0.0.1, propagating exceptions with their
rank.

    results = run_world(2, fn, *args)   # fn(rank, world_size, *args) runs in each process; returns
    its results

Each process gets its own free port-backed process group; torch's intra-op threads are set to 1 so N
processes share the 2 cores fairly. The processes fork from a forkserver that has imported torch and
the project once (``forkserver``): a rank starts in milliseconds, not with an interpreter's start
and torch's import (seconds each, on a loaded machine many); it runs in the parent's environment.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_module
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_part(batch: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s equal part of the global ``batch`` (every leaf split along its leading
    dimension)."""
    n = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def assert_like_world_of_one(one: dict, ranks: list[dict]) -> None:
    """Each rank's ``{partition: (losses, final weights by key path)}`` against a world of one's
    (``one``): losses and LoRA weights to another summation order over ranks (the tolerances of
    tests/partition/test_distributed.py), every other (frozen) weight bitwise."""
    import pytest

    for rank_result in ranks:
        for partition, (losses, final) in rank_result.items():
            ref_losses, ref_final = one[partition]
            assert losses == pytest.approx(ref_losses, rel=1e-6)
            assert max((final[p] - ref_final[p]).abs().max().item() for p in ref_final) < 1e-4
            assert all(torch.equal(final[p], ref_final[p]) for p in ref_final if "lora" not in p)


@contextlib.contextmanager
def one_thread():
    """Torch's intra-op threads set to 1 for the ``with`` block, as in run_world's processes and a
    child run with OMP_NUM_THREADS=1: the CPU kernels sum in another order with another thread
    count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


TESTS = os.path.dirname(os.path.abspath(__file__))
# Imported once by the forkserver, so each forked process starts warm (torch.func and dynamo import
# slowly; tests/checkpoints/test_checkpoints_crash.py's trials need them; transformers and peft:
# the worlds of the HF, PEFT and fine-tuning tests)
PRELOAD = [
    "torch",
    "torch.distributed",
    "zinf_fn",
    "layers",
    "checkpoints",
    "ckpt_workers",
    "torch._dynamo",
    "torch._functorch.eager_transforms",
    "torch.func",
    "transformers",
    "peft",
    "hf_workers",
    "zinf_cli.finetune",
]


def forkserver():
    """The forkserver context, its server running with ``PRELOAD`` imported from this checkout and
    tests/ (the forkserver ignores our sys.path, CPython 3.11: it inherits the environment, so
    ``PYTHONPATH`` names them while it starts)."""
    from multiprocessing import forkserver as server

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    paths = [os.path.dirname(TESTS), TESTS, *([before] if before else [])]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    try:
        server.ensure_running()  # a no-op where it runs already
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    pass


def _entry(rank, world_size, port, fn, args, queue, timeout_s, environ):
    os.environ.clear()  # the parent's environment of now, not the forkserver's of its start
    os.environ.update(
        environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    import datetime

    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        # plain pickle copies tensors by value; the queue's own pickler would share their storage
        # through files that vanish when this process exits before the parent has read them
        # (FileNotFoundError)
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as exc:  # reported to the parent with the rank that raised
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world_size: int, fn, *args, timeout_s: float = 120.0, allow_errors: bool = False):
    """Results of ``fn(rank, world_size, *args)`` in rank order; raises RankFailed naming the rank
    that failed.

    With ``allow_errors`` the per-rank outcome ``("ok", value)`` or ``("error", text)`` is returned
    instead.
    """
    ctx = forkserver()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, timeout_s, environ))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes = {}
    deadline = time.monotonic() + timeout_s + 60
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.5)
                outcomes[rank] = (status, pickle.loads(value) if status == "ok" else value)
            except queue_module.Empty:
                # a rank that died without reporting (os._exit, a crash) never will: stop waiting
                # for it once every process has ended and the queue is drained
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if allow_errors:
        return [
            outcomes.get(r, ("error", "no result: the process ended without reporting"))
            for r in range(world_size)
        ]
    for rank in range(world_size):
        status, value = outcomes.get(
            rank, ("error", "no result: the process ended without reporting")
        )
        if status != "ok":
            raise RankFailed(f"rank {rank} of {world_size} raised {value}")
    return [outcomes[r][1] for r in range(world_size)]
