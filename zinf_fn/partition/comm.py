"""Collectives: the only module that imports torch.distributed.

A world of 1 needs no process group: ``LocalComm`` does the same moves as plain copies. The code
above this module is not the same at every world size, though: at one rank the fetcher uses a stored
row as the layer and the updater takes the padded gradient as the shard, with no copy, so a world of
one does not run every path of a larger one (the multi-process tests in
``tests/partition/test_distributed.py`` do).

Two paths, two process groups. The prefetcher's fetch thread issues the *fetch path*
(``all_gather_``, ``broadcast_``) in fetch-plan order; the main thread issues the *gradient path*
(``reduce_scatter_mean_``, ``reduce_mean_``, ``all_reduce_sum_``) in scan order. Each thread's order
is the same on every rank, but how the two threads interleave depends on timing and differs between
ranks. Collectives on one process group must be issued in the same order on every rank (otherwise
rank 0's allgather meets rank 1's reduce-scatter: a deadlock or silently wrong data), so
``DistComm`` gives each path its own process group over the same ranks, created once at
construction. At any time only one thread issues collectives on a group (the fetch group is the
fetch thread's during a step; between steps the main thread may use it, e.g. ``zf.gather_params``),
so within a group the order is the plan order.

Every collective is named (``what``: the unit or quantity it moves) and bounded by a timeout: a
dead, stuck or diverged rank turns into a ``CollectiveError`` on the ranks still waiting, naming the
collective, the unit and the rank, instead of a silent hang.
"""

from __future__ import annotations

import datetime
import threading
from collections import Counter
from typing import Protocol

import torch


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a rank died, is stuck, or the ranks diverged."""


class Comm(Protocol):
    """The collectives the engine uses. Methods ending in ``_`` write into their first argument.

    ``what`` names the unit or quantity a collective moves; it appears in errors and in ``calls``,
    a Counter of ``(op, what)`` pairs issued so far (for tests that count collectives per step).
    """

    rank: int
    world_size: int
    calls: Counter

    def all_gather_(self, out: torch.Tensor, shard: torch.Tensor, what: str = "") -> None: ...
    def broadcast_(self, x: torch.Tensor, src: int, what: str = "") -> None: ...
    def reduce_scatter_mean_(
        self, out: torch.Tensor, full: torch.Tensor, what: str = ""
    ) -> None: ...
    def reduce_mean_(self, x: torch.Tensor, dst: int, what: str = "") -> None: ...
    def all_reduce_sum_(self, x: torch.Tensor, what: str = "") -> None: ...
    def all_gather_object(self, obj: object) -> list: ...


class _Counting:
    """``calls``: a thread-safe Counter of (op, what) (the fetch and main threads both count)."""

    def __init__(self):
        self.calls: Counter = Counter()
        self._count_lock = threading.Lock()

    def _count(self, op: str, what: str) -> None:
        with self._count_lock:
            self.calls[(op, what)] += 1


class LocalComm(_Counting):
    """World of one: gather and scatter are copies, reductions are the identity."""

    rank = 0
    world_size = 1

    def all_gather_(self, out, shard, what=""):
        self._count("all_gather", what)
        out.copy_(shard)

    def broadcast_(self, x, src, what=""):
        self._count("broadcast", what)

    def reduce_scatter_mean_(self, out, full, what=""):
        self._count("reduce_scatter_mean", what)
        out.copy_(full)

    def reduce_mean_(self, x, dst, what=""):
        self._count("reduce_mean", what)

    def all_reduce_sum_(self, x, what=""):
        self._count("all_reduce_sum", what)

    def all_gather_object(self, obj):
        return [obj]


class DistComm(_Counting):
    """torch.distributed (gloo on CPU, NCCL on CUDA) over every rank of the default process group.

    ``timeout_s`` bounds every collective: the ranks that wait longer raise ``CollectiveError``.
    Construction is itself collective (it creates the two process groups): every rank must construct
    a DistComm at the same point, which ``zf.init`` guarantees.
    """

    def __init__(self, timeout_s: float):
        super().__init__()
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        ranks = list(range(self.world_size))
        # sync: new_group is collective over the default group; every rank creates both, in this
        # order
        self._fetch_group = dist.new_group(ranks, timeout=self._timeout)
        self._grad_group = dist.new_group(ranks, timeout=self._timeout)
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._scatter = self._pick_reduce_scatter()

    def _pick_reduce_scatter(self):
        """``reduce_scatter_single`` (torch >= 2.13, gloo and NCCL); before it,
        ``reduce_scatter_tensor`` on NCCL and all-reduce + slice on gloo (whose
        reduce_scatter_tensor older releases lacked)."""
        dist = self._dist
        if hasattr(dist, "reduce_scatter_single"):
            return dist.reduce_scatter_single
        if dist.get_backend(self._grad_group) != "gloo":
            return dist.reduce_scatter_tensor
        return self._reduce_scatter_by_all_reduce

    def _reduce_scatter_by_all_reduce(self, out, full, group, async_op):
        total = full.clone()
        self._dist.all_reduce(total, group=group)  # blocking: the slice below needs the sum
        start = self.rank * out.numel()
        out.copy_(total[start : start + out.numel()])
        return None  # already complete: nothing to wait for

    def _run(self, op: str, what: str, launch) -> None:
        """Launch a collective (async) and wait for it at most ``timeout_s``; name it if it
        fails."""
        self._count(op, what)
        try:
            work = launch()
            # sync: the collective is complete
            if work is not None and work.wait(self._timeout) is False:
                raise RuntimeError("wait returned False")
        except RuntimeError as exc:
            raise CollectiveError(
                f"rank {self.rank} of {self.world_size}: {op} of {what or 'an unnamed tensor'} did "
                "not complete "
                f"(timeout {self.timeout_s:g} s, Config.collective_timeout_s): {_first_line(exc)}. "
                "Another rank "
                "died, is stuck, or issued different collectives (do all ranks run the same config "
                "and batches?)"
            ) from exc

    # -- fetch path (fetch thread)
    # ------------------------------------------------------------------
    def all_gather_(self, out, shard, what=""):
        self._run(
            "all_gather",
            what,
            lambda: self._gather(out, shard, group=self._fetch_group, async_op=True),
        )

    def broadcast_(self, x, src, what=""):
        self._run(
            "broadcast",
            what,
            lambda: self._dist.broadcast(x, src, group=self._fetch_group, async_op=True),
        )

    # -- gradient path (main thread)
    # ----------------------------------------------------------------
    def reduce_scatter_mean_(self, out, full, what=""):
        self._run(
            "reduce_scatter_mean",
            what,
            lambda: self._scatter(out, full, group=self._grad_group, async_op=True),
        )
        out.div_(self.world_size)

    def reduce_mean_(self, x, dst, what=""):
        """Sum ``x`` over ranks into rank ``dst`` and divide by the world size there (elsewhere:
        scratch)."""
        self._run(
            "reduce_mean",
            what,
            lambda: self._dist.reduce(x, dst, group=self._grad_group, async_op=True),
        )
        if self.rank == dst:
            x.div_(self.world_size)

    def all_reduce_sum_(self, x, what=""):
        """Sum ``x`` over ranks in place. NCCL reduces only device tensors: a host scalar (the loss,
        the squared grad norm) travels through the current CUDA device and back."""
        on = x
        if x.device.type == "cpu" and self._dist.get_backend(self._grad_group) == "nccl":
            on = x.to(torch.device("cuda", torch.cuda.current_device()))
        self._run(
            "all_reduce_sum",
            what,
            lambda: self._dist.all_reduce(on, group=self._grad_group, async_op=True),
        )
        if on is not x:
            x.copy_(on)  # sync: a device-to-host copy waits for the reduction

    def all_gather_object(self, obj):
        """Every rank's ``obj`` (pickled), in rank order; on the gradient group, so bounded by the
        timeout."""
        out = [None] * self.world_size
        self._count("all_gather_object", "")
        try:
            self._dist.all_gather_object(out, obj, group=self._grad_group)
        except RuntimeError as exc:
            raise CollectiveError(
                f"rank {self.rank} of {self.world_size}: all_gather_object failed: "
                f"{_first_line(exc)}"
            ) from exc
        return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def current_comm(timeout_s: float = 300.0) -> Comm:
    """A comm over the initialised default process group (any size, so an NCCL world of one runs the
    real collectives), or a world of one without collectives when there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return DistComm(timeout_s)
    return LocalComm()
