"""The optimizer pass of a step, as rules: which units it streams and in which order, which lend
their master to the backward fetch, how far it reads ahead, which 16-bit rows stay in memory.

Each is one pure function, the one answer. The per-row ones (``lends_master``, ``keeps_resident``,
``holds_layer``) are asked once, by the layout step, whose answers are each group's read policy
(``zinf_fn.layout.policy.GroupPolicy``: ``lent``, ``resident``, ``held``); the engine's parts
(``ReadAhead``, ``Updater``, the fetcher, the runtime) and the planner's demands read that record.
"""

from __future__ import annotations

from collections.abc import Callable

from ..layout.policy import TILE, GroupPolicy
from ..layout.units import Unit
from ..store import Group, Store

# the largest master row lent whole, in pieces: (depth + 2) such rows are held at once
LEND_PIECES = 4


def fits_whole(shard_numel: int, piece_numel: int) -> bool:
    """Whether a row of ``shard_numel`` elements is small enough to be held whole: at most
    ``LEND_PIECES`` pieces."""
    return shard_numel <= LEND_PIECES * piece_numel


def lends_master(
    store: Store,
    group: Group,
    policy: GroupPolicy,
    unit: Unit,
    depth: int,
    piece_numel: int,
    clipping: bool,
) -> bool:
    """Whether ``unit`` (a row of ``group``, read and written as ``policy`` decides so far)'s update
    lends its master row to its backward fetch: the one rule, whose answer is the policy's ``lent``.

    It does where the one-pass update (no ``clipping``) reads ahead (``depth`` > 0), both the unit's
    16-bit row and its master live on NVMe (``store.placement_of``: the fetch would read the one,
    the update reads the other), and its row is at most ``LEND_PIECES`` pieces (``fits_whole``: it
    is held whole from the fetch to the update). A copy rounded ties away
    (``Config.param_rounding``; always, with a remainder master, whose param row *is* the copy) is
    not a torch cast of the master, so an fp32 master with that copy lends nothing; a remainder
    master lends its param row itself (``RowKinds.lent_kind``). A group never written
    (``policy.written``: frozen) has no master and lends nothing."""
    return (
        not clipping
        and depth > 0
        and (store.row_kinds.remainder or not store.row_kinds.ties_away)
        and policy.written
        and store.placement_of("param", unit) == "nvme"
        and store.placement_of("master", unit) == "nvme"
        and fits_whole(group.part.shard_numel, piece_numel)
    )


def keeps_resident(
    store: Store, group: Group, policy: GroupPolicy, unit: Unit, piece_numel: int
) -> bool:
    """Whether a unit's 16-bit row on NVMe (``store.placement_of``) stays in memory, written through
    (``offload.resident``; a memory tier's rows are in memory anyway): the embedding's and the first
    block's (indices 0 and 1; a unit's or its frozen row, not a tile's), whose reads no compute
    before them could hide, where the row is at most ``LEND_PIECES`` pieces (the bound of a lent
    master), unless the fetcher holds its layer (``holds_layer``: then nothing reads the row after
    the first fetch). The answer is the policy's ``resident``."""
    return (
        unit.index <= 1
        and policy.unit != TILE
        and store.placement_of("param", unit) == "nvme"
        and fits_whole(group.part.shard_numel, piece_numel)
        and not holds_layer(group, policy, unit, piece_numel)
    )


def holds_layer(group: Group, policy: GroupPolicy, unit: Unit, piece_numel: int) -> bool:
    """Whether the fetcher keeps ``unit``'s layer (gathered, in the compute dtype) from its first
    fetch on, so that its later fetches read, gather and cast nothing (``overlap.fetch.Fetcher``): a
    row never written (``policy.written``: frozen, written at init only) of the embedding or the
    first block (a unit's or its frozen row, not a tile's), whose fetches start a step before any
    compute could hide them (and the first block's ends the backward), where the whole layer is at
    most ``LEND_PIECES`` pieces. A row some of whose leaves' codes are lent to the op
    (``lent_leaves``) is held too: its layer's two buffers, the others' decoded values and the
    gathered row the lent leaves view (``overlap.fetch.Kept``). Rank-independent: every rank skips
    the same gathers. The answer is the policy's ``held``."""
    return (
        unit.index <= 1
        and not policy.written
        and policy.unit != TILE
        and fits_whole(group.part.padded_numel, piece_numel)
    )


def pieces_ahead(depth: int, all_lent: bool) -> int:
    """How many pieces a pass reads ahead: ``depth``, or as far as the masters (``depth *
    LEND_PIECES``) where every unit of the pass lends its master."""
    return depth * LEND_PIECES if all_lent else depth


def streamed_units(store: Store, n_layers: int) -> dict[str, list[Unit]]:
    """Per group, the units whose optimizer rows a step streams (on NVMe,
    ``store.placement_of``), of a model of ``n_layers`` layers."""
    return {
        g.name: [
            u
            for u in store.row_units(g, n_layers)
            if store.placement_of("master", u) == "nvme"
        ]
        for g in store.groups.values()
        if store.row_kinds.policy(g.name).written
    }


def pass_order(units_: list[Unit], clipping: bool, streamed: Callable[[Unit], bool]) -> list[Unit]:
    """The units of ``units_`` (scan order) a step's optimizer pass reads, in the order it updates
    them: the one-pass update's in reverse (the gradients' order: ``Updater.begin_step``), the
    clipped second pass's in scan order (``Updater.stream_clipped``); ``streamed(unit)``: its
    optimizer rows are read, not viewed."""
    return [u for u in (units_ if clipping else reversed(units_)) if streamed(u)]
