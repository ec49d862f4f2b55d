"""What a streaming part costs: the buffers it holds at its peak and the bytes it moves per step.

Each streaming part of the engine (the fetcher, the gradient backlog, the optimizer read-ahead, the
write-behind, the kept rows, activation offload) declares its cost in a pure ``demand(store, sizing,
...)`` beside its class, as a ``Demand``: over the store's groups, sized by the few numbers of the
config and the layout it reads (``Sizing``). The planner's memory model
(``zinf_fn.planner.memory``) and the runtime's buffer pool limit are sums of these, never a second
count. This module imports nothing of the engine: every part builds on it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The phases of a step, as its buffers come and go: the forward scan; the turn, from the optimizer's
# first reads (``prefetch_depth`` units before the head) to its first update or stash, while the
# previous step's last writes are still in flight; the backward scan with the one-pass updates; the
# clipped second pass of updates.
PHASES = ("forward", "turn", "backward", "update")
# the phases a scan runs in: what fetches and activations span
SCANS = ("forward", "turn", "backward")


class Buffers(NamedTuple):
    """``count`` pool buffers of ``numel`` x ``dtype`` a part holds at once at its peak, in host
    memory ("host") or on the compute device ("device"; the host itself on CPU compute), in the
    ``phases`` of a step where it holds them."""

    numel: int
    dtype: torch.dtype
    count: int
    where: str = "host"
    phases: tuple[str, ...] = PHASES

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize * self.count


class Demand(NamedTuple):
    """One part's cost: its pool buffers, the bytes it holds outside the pool (``held``, host
    memory) and the NVMe bytes it moves per step (this rank; read in forward, read in backward,
    written)."""

    part: str
    buffers: tuple[Buffers, ...] = ()
    held: int = 0
    read_forward: int = 0
    read_backward: int = 0
    written: int = 0


class Sizing(NamedTuple):
    """What the streaming parts' demands read of a step besides the store: the numbers of the config
    and the layout that size their buffers, built from both by the planner's memory model
    (``zinf_fn.planner.memory.sizing``), so no part below the layout step reads a ``Config`` or a
    ``Layout``."""

    n_layers: int  # the model's layers (``Layout.n_layers``)
    world_size: int  # the ranks the rows are sharded over (``Layout.sharding``)
    device: torch.device  # the compute device (``Config.resolved_device``)
    compute: torch.dtype  # the compute dtype (``Config.resolved_compute_dtype``)
    depth: int  # units fetched and pieces read ahead (``Config.prefetch_depth``)
    workers: int  # the update's background workers (``Config.update_workers``; 0: inline)
    piece_numel: int  # elements of an optimizer piece (``optim.pieces.piece_numel``)
    clipping: bool  # global-norm clipping: the two-pass update (``Config.clip_grad_norm``)
    grad_accum: int  # micro-batches per step (``Config.grad_accum``)
    reuse: int  # blocks kept fetched from forward to backward (``overlap.plan.reuse_blocks``)
    embed_trains: bool  # whether the embedding trains (``FrozenLeaves.embed_trains``)
    keep_tiles: int  # bytes of frozen tiles kept into the backward (``Config.keep_tiles``)


Key = tuple[int, torch.dtype, str]  # a pool buffer's (numel, dtype, where)


def pool_counts(demands: list[Demand], cpu_compute: bool) -> dict[Key, int]:
    """The pool buffers of each (numel, dtype, where) the parts hold together at its peak: the most,
    over a step's phases, of what the parts hold in that phase (the pool makes a size's buffers once
    and reuses them from phase to phase). On CPU compute the device is the host: "device" buffers
    count as "host" ones (the pool keys them alike)."""
    return {k: peak for k, (peak, _) in _peaks(demands, cpu_compute).items()}


def pool_bytes_by_part(demands: list[Demand], cpu_compute: bool) -> dict[str, dict[str, int]]:
    """where -> part -> bytes of the pool at its peak (``pool_counts``), each size's buffers counted
    to the parts that hold them in the phase of its peak: a part's share of the pool, summing to
    it."""
    out: dict[str, dict[str, int]] = {}
    for (numel, dtype, where), (_, parts) in _peaks(demands, cpu_compute).items():
        for part, count in parts.items():
            by_part = out.setdefault(where, {})
            by_part[part] = by_part.get(part, 0) + numel * dtype.itemsize * count
    return out


def _peaks(demands: list[Demand], cpu_compute: bool) -> dict[Key, tuple[int, dict[str, int]]]:
    """Per (numel, dtype, where): the most buffers the parts hold together in one phase, and each
    part's."""
    per_phase: dict[Key, dict[str, dict[str, int]]] = {}
    for demand in demands:
        for b in demand.buffers:
            key = (b.numel, b.dtype, "host" if cpu_compute else b.where)
            for phase in b.phases:
                parts = per_phase.setdefault(key, {}).setdefault(phase, {})
                parts[demand.part] = parts.get(demand.part, 0) + b.count
    return {
        key: max(((sum(p.values()), p) for p in phases.values()), key=lambda t: t[0])
        for key, phases in per_phase.items()
    }


def shared(buffers: list[Buffers], cap: int) -> list[Buffers]:
    """Buffers of several groups that one window serves (the tiles' prefetcher, the tiles' update
    backlog): of each (numel, dtype, where, phases), their counts summed, at most ``cap`` (a
    window's, one buffer an item)."""
    out: dict[tuple, int] = {}
    for b in buffers:
        out[(b.numel, b.dtype, b.where, b.phases)] = (
            out.get((b.numel, b.dtype, b.where, b.phases), 0) + b.count
        )
    return [
        Buffers(n, dtype, min(count, cap), where, phases)
        for (n, dtype, where, phases), count in out.items()
    ]


def pieces_held(shard: int, piece: int, rows: int, window: int) -> list[tuple[int, int]]:
    """``(numel, count)`` of the pieces a window of ``window`` consecutive pieces holds at most,
    over ``rows`` rows of ``shard`` elements cut in pieces of ``piece`` (``optim.pieces``): full
    pieces, and the shorter last piece of each row where ``piece`` does not divide ``shard`` (a pool
    key of its own). Of ``k`` pieces a row, ``window`` consecutive ones hold at most ``ceil(window /
    k)`` last pieces and ``window - window // k`` full ones (each count at its own most: a key's
    peak)."""
    per_row = -(-shard // piece)
    if not rows or not window:
        return []
    if shard <= piece or shard % piece == 0:
        return [(min(shard, piece), min(rows * per_row, window))]
    fulls, tails = (
        min(rows * (per_row - 1), window - window // per_row),
        min(rows, -(-window // per_row)),
    )
    return [(piece, fulls), (shard % piece, tails)]
