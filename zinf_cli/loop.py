"""The training loop the subcommands share: ranks, per-step records, progress, evaluation, stopping.

A run stops early, cleanly, on SIGINT or SIGTERM: the step in flight finishes, the caller saves a
checkpoint (when saving is on) and the process exits 0; ``--resume`` continues from it bitwise.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from tqdm import tqdm

import zinf_fn as zf
from layers import lora
from zinf_data import IGNORE
from zinf_fn.state import view


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: the process group's (``torchrun_world`` or a test
    made it), or (0, 1)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


@contextlib.contextmanager
def torchrun_world():
    """Join torchrun's process group for the body (launched by torchrun and no group made yet), and
    leave it after a body that returned: every rank waits for the others, then the process groups
    (the engine's too) are destroyed.

    Why: a gloo group left to the interpreter's exit keeps its C++ worker threads alive while Python
    is torn down, and a rank then dies with ``terminate called without an active exception``
    (SIGABRT) now and then. After a body that raised, the group is left as it is: another rank may
    be inside a collective, and destroying it there would hang (torchtitan's rule too).
    """
    made = not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if made:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    yield rank_and_world()
    if made:
        dist.barrier()  # sync: every rank is past its last collective
        dist.destroy_process_group()


def rows_of(batch: dict) -> dict:
    """This rank's rows of a global batch (every rank builds the same one)."""
    rank, world = rank_and_world()
    n = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def evaluate(state, batches) -> dict:
    """Held-out loss over ``batches`` (global batches), weighted by their target tokens, and its
    perplexity."""
    total, count = 0.0, 0
    for batch in batches:
        # the global batch's targets: eval_step's mean is over every rank's
        n = int((batch["targets"] != IGNORE).sum())
        if n:
            total += float(zf.eval_step(state, rows_of(batch))) * n
            count += n
    loss = total / max(count, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


class StopSignal:
    """SIGINT / SIGTERM set a flag instead of raising: the loop asks ``requested()`` after each step
    (every rank agrees: the flag is reduced over the process group) and stops there."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.flag = False
        self.previous = {}

    def __enter__(self) -> StopSignal:
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.flag = True

    def requested(self) -> bool:
        if not dist.is_initialized():
            return self.flag
        flag = torch.tensor([float(self.flag)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # sync: every rank stops after the same step
        return bool(flag.item())


def peak_rss_gib() -> float:
    """This process's peak resident memory (``ru_maxrss``, KiB on Linux) in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


class TokenFlops(NamedTuple):
    """The model FLOPs of one trained token in a row of ``length`` positions: ``weights +
    attention * length`` (``at``), PaLM's count (its appendix B)."""

    weights: float  # the matmuls': 2 per weight in forward, 2 for the input's gradient, 2 trained
    attention: float  # per position the token attends over: 12 * layers * query width

    def at(self, length: int) -> float:
        """The FLOPs of one token in a batch of rows ``length`` long (its scores and values span the
        row it is in, whatever the model's ``seq_len``)."""
        return self.weights + self.attention * length


def flops_per_token(state) -> TokenFlops:
    """The model FLOPs of one trained token, PaLM's count (its appendix B): per weight of a matmul 2
    in forward, 2 in backward for the input's gradient and 2 for the weight's own where it trains (a
    frozen base has none), plus ``12 * layers * n_heads * head_dim`` (the query width: ``d_model``
    but where a family sets head_dim apart, as Gemma 3 and Qwen3 do) per position of the row for
    attention's scores and values. The embedding is a lookup (none); norms and biases are left
    out."""
    store = view(state)
    total = 0
    for name, group in store.groups.items():
        if name.split(":")[0].split("--")[0] == "embed":
            continue
        matmul = sum(leaf.numel for leaf in group.spec.leaves if len(leaf.shape) >= 2) * group.rows
        total += matmul * (4 if store.is_frozen(name) else 6)
    cfg = lora.base_config(state.model.config)
    width = cfg.n_heads * getattr(cfg, "head_dim", cfg.d_model // cfg.n_heads)
    return TokenFlops(float(total), float(12 * state.model.n_layers * width))


def step_record(step: int, metrics: dict, tokens: int, seconds: float, flops: float) -> dict:
    """The per-step record: loss, lr, grad norm, tokens/s, model FLOP/s (``flops`` per token), the
    time compute waited on I/O, disk read and write GB/s (the nvme tier), peak RSS."""
    read, written = metrics.get("bytes_read.nvme", 0), metrics.get("bytes_written.nvme", 0)
    return {
        "step": step,
        "loss": metrics["loss"],
        "lr": metrics["lr"],
        "grad_norm": metrics["grad_norm"],
        "tokens_per_s": tokens / seconds,
        "model_flops_per_s": flops * tokens / seconds,
        "io_wait_s": metrics.get("io_wait_s", 0.0),
        "disk_read_gb_s": read / seconds / 1e9,
        "disk_write_gb_s": written / seconds / 1e9,
        "peak_rss_gib": peak_rss_gib(),
    }


class Progress:
    """A progress bar on a terminal; elsewhere (a log file) one line every ``every`` steps."""

    def __init__(self, first: int, end: int, every: int, show: bool):
        self.end, self.every, self.show = end, max(1, every), show
        on_terminal = show and sys.stderr.isatty()
        self.bar = None
        if on_terminal:
            self.bar = tqdm(total=end, initial=first, unit="step", dynamic_ncols=True)

    def step(self, record: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}"
            )
        elif self.show and (record["step"] % self.every == 0 or record["step"] == self.end):
            print(
                f"step {record['step']}/{self.end}: loss {record['loss']:.4f}, "
                f"lr {record['lr']:.2e}, grad norm {record['grad_norm']:.3f}, "
                f"{record['tokens_per_s']:,.0f} tokens/s, "
                f"peak RSS {record['peak_rss_gib']:.2f} GiB",
                flush=True,
            )

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.show:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def timed_step(state, batch: dict, step: int, flops: TokenFlops):
    """(state, the step's record): ``zf.train_step`` on this rank's rows of ``batch`` (a global
    batch: tokens/s and FLOP/s are the world's), ``flops`` per token (``flops_per_token``) at the
    batch's own row length (a bucketed batch is shorter than ``seq_len``)."""
    tokens = int(batch["targets"].numel())
    per_token = flops.at(batch["targets"].shape[1])
    t0 = time.perf_counter()
    state, metrics = zf.train_step(state, rows_of(batch))
    return state, step_record(step + 1, metrics, tokens, time.perf_counter() - t0, per_token)
