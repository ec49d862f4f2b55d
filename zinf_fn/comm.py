"""Collectives: the only module that imports torch.distributed.

A world of 1 needs no process group: ``LocalComm`` does the same moves as plain copies, so every code
path above this module is the same at any world size.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Work(Protocol):
    def wait(self) -> object: ...


class _Done:
    """A finished collective (what a world of 1 returns)."""

    def wait(self) -> bool:
        return True


class Comm(Protocol):
    rank: int
    world_size: int

    def all_gather_(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Work: ...
    def reduce_scatter_mean_(self, out: torch.Tensor, full: torch.Tensor) -> None: ...
    def all_reduce_sum_(self, x: torch.Tensor) -> None: ...
    def broadcast_(self, x: torch.Tensor, src: int, async_op: bool = False) -> Work: ...
    def all_gather_object(self, obj: object) -> list: ...


class LocalComm:
    """World of one: gather and scatter are copies, reductions are the identity."""

    rank = 0
    world_size = 1

    def all_gather_(self, out, shard, async_op=False):
        out.copy_(shard)
        return _Done()

    def reduce_scatter_mean_(self, out, full):
        out.copy_(full)

    def all_reduce_sum_(self, x):
        pass

    def broadcast_(self, x, src, async_op=False):
        return _Done()

    def all_gather_object(self, obj):
        return [obj]


class DistComm:
    """torch.distributed over the default process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self):
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_gather_(self, out, shard, async_op=False):
        gather = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        work = gather(out, shard, async_op=async_op)
        return work if async_op else _Done()

    def reduce_scatter_mean_(self, out, full):
        scatter = getattr(self._dist, "reduce_scatter_single", None) or self._dist.reduce_scatter_tensor
        if full.device.type == "cpu" and self._dist.get_backend() == "gloo" and not _gloo_has_reduce_scatter():
            full = full.clone()
            self._dist.all_reduce(full)
            start = self.rank * out.numel()
            out.copy_(full[start : start + out.numel()])
        else:
            scatter(out, full)
        out.div_(self.world_size)

    def all_reduce_sum_(self, x):
        self._dist.all_reduce(x)

    def broadcast_(self, x, src, async_op=False):
        work = self._dist.broadcast(x, src, async_op=async_op)
        return work if async_op else _Done()

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out


_GLOO_RS: bool | None = None


def _gloo_has_reduce_scatter() -> bool:
    """gloo gained reduce_scatter_tensor late; probe once instead of trusting the version."""
    global _GLOO_RS
    if _GLOO_RS is None:
        import torch.distributed as dist

        try:
            out = torch.zeros(1)
            dist.reduce_scatter_tensor(out, torch.zeros(dist.get_world_size()))
            _GLOO_RS = True
        except (RuntimeError, NotImplementedError):
            _GLOO_RS = False
    return _GLOO_RS


def current_comm() -> Comm:
    """The comm of the initialised default process group, or a world of one when there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DistComm()
    return LocalComm()
