"""The optimizer pass of a step, as rules: which units it streams and in which order, which lend their master
to the backward fetch, how far it reads ahead, which 16-bit rows stay in memory.

Each is one pure function, the one answer the engine's parts (``ReadAhead``, ``Updater``, the runtime) and
the planner's demands (``optim.readahead.demand``, ``planner.memory``) ask alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..frozen import is_frozen_group
from ..store import Store
from ..units import STAGES, Unit

if TYPE_CHECKING:   # type names only: the layout step sits above the optimizer
    from ..layout import Layout

LEND_PIECES = 4   # the largest master row lent whole, in pieces: (depth + 2) such rows are held at once


def fits_whole(shard_numel: int, piece_numel: int) -> bool:
    """Whether a row of ``shard_numel`` elements is small enough to be held whole: at most ``LEND_PIECES`` pieces."""
    return shard_numel <= LEND_PIECES * piece_numel


def lends_master(store: Store, unit: Unit, depth: int, piece_numel: int, clipping: bool) -> bool:
    """Whether ``unit``'s update lends its master row to its backward fetch: the one rule, asked by the
    updater (``begin_step``), the read-ahead and the planner's memory model alike.

    It does where the one-pass update (no ``clipping``) reads ahead (``depth`` > 0), both the unit's 16-bit row
    and its master live on NVMe (``store.placement_of``: the fetch would read the one, the update reads the
    other), and its row is at most ``LEND_PIECES`` pieces (``fits_whole``: it is held whole from the fetch
    to the update). A copy rounded ties away (``Config.param_rounding``; always, with a remainder master,
    whose param row *is* the copy) is not a torch cast of the master, so an fp32 master with that copy lends
    nothing; a remainder master lends its param row itself (``Store.lent_kind``). A frozen group
    (``Store.frozen``) has no master and lends nothing."""
    return (not clipping and depth > 0 and (store.remainder or not store.ties_away)
            and unit.group not in store.frozen
            and store.placement_of("param", unit) == "nvme" and store.placement_of("master", unit) == "nvme"
            and fits_whole(store.group_of(unit).part.shard_numel, piece_numel))


def keeps_resident(store: Store, unit: Unit, piece_numel: int) -> bool:
    """Whether a unit's 16-bit row on NVMe stays in memory, written through (``offload.resident``): the
    embedding's and the first block's (indices 0 and 1), whose reads no compute before them could hide, where
    the row is at most ``LEND_PIECES`` pieces (the bound of a lent master), unless the fetcher holds its layer
    (``holds_layer``: then nothing reads the row after the first fetch)."""
    return (unit.index <= 1 and fits_whole(store.group_of(unit).part.shard_numel, piece_numel)
            and not holds_layer(store, unit, piece_numel))


def holds_layer(store: Store, unit: Unit, piece_numel: int) -> bool:
    """Whether the fetcher keeps ``unit``'s layer (gathered, in the compute dtype) from its first fetch on, so
    that its later fetches read, gather and cast nothing (``overlap.fetch.Fetcher``): a frozen row
    (``Store.frozen``: written at init, never after) of the embedding or the first block, whose fetches start a
    step before any compute could hide them (and the first block's ends the backward), where the whole layer is
    at most ``LEND_PIECES`` pieces. Rank-independent: every rank skips the same gathers."""
    return (unit.index <= 1 and unit.group in store.frozen and (unit.group in STAGES or is_frozen_group(unit.group))
            and fits_whole(store.group_of(unit).part.padded_numel, piece_numel))


def pieces_ahead(depth: int, all_lent: bool) -> int:
    """How many pieces a pass reads ahead: ``depth``, or as far as the masters (``depth * LEND_PIECES``)
    where every unit of the pass lends its master."""
    return depth * LEND_PIECES if all_lent else depth


def streamed_units(layout: Layout) -> dict[str, list[Unit]]:
    """Per group, the units whose optimizer rows a step streams (on NVMe, ``store.placement_of``)."""
    store = layout.store
    return {g.name: [u for u in store.row_units(g, layout.n_layers) if store.placement_of("master", u) == "nvme"]
            for g in store.groups.values() if g.name not in store.frozen}


def pass_order(units_: list[Unit], clipping: bool, streamed: Callable[[Unit], bool]) -> list[Unit]:
    """The units of ``units_`` (scan order) a step's optimizer pass reads, in the order it updates them: the
    one-pass update's in reverse (the gradients' order: ``Updater.begin_step``), the clipped second pass's in
    scan order (``Updater.stream_clipped``); ``streamed(unit)``: its optimizer rows are read, not viewed."""
    return [u for u in (units_ if clipping else reversed(units_)) if streamed(u)]
