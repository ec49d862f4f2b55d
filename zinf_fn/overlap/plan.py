"""The fetch plan of a step, as data: which unit is fetched for which phase, in what order.

The plan of a training step is known before the step starts, because the fetch order *is* the scan
order: embed, blocks 0..L-1, head, then blocks L-1..0 and embed again for the backward pass. It is a
value that can be printed (``format_plan``) and unit-tested before anything moves. So are the step's
events (``step_plan``): an entry names what starts once it is in hand (the optimizer's reads, the
next step's early reads), and the runtime's step driver runs them. A plan that the pass's own ops
revise as they run (the tile plan, as routing comes in) is a ``PassPlan``: its revisions are
values, appended in order to a queue. Beside it, the rules of when a stored row is itself the layer
(``row_is_layer``, ``staged_is_layer``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..layout.units import BLOCKS, EMBED, HEAD, Unit, reused

# The in-step events a plan entry may name (``FetchOp.events``), run once the entry is in hand.
BEGIN_UPDATES = "the optimizer's reads begin"  # Updater.begin_step: read ahead in gradient order
READ_EARLY = "the next step's early reads"  # Fetcher.read_early: rows never written after init


class FetchOp(NamedTuple):
    """One fetch of a step: ``unit`` for ``phase``; ``events``: what starts once it is in hand."""

    unit: Unit
    phase: str  # "forward" | "backward"
    events: tuple[str, ...] = ()  # BEGIN_UPDATES, READ_EARLY

    def __str__(self) -> str:
        return f"{self.phase:8s} {self.unit.name}"


def step_plan(
    all_units: list[Unit], embed_trains: bool, reuse: int, depth: int, clipping: bool
) -> list[FetchOp]:
    """A training step's plan (``train_plan``) with its events on the entries that start them.

    The optimizer's rows are read ahead from ``depth`` units before the head on (``BEGIN_UPDATES``),
    not at the step's start, where they would queue in front of the first layers' parameter reads.
    Without clipping, the backward's last unit starts the next step's first reads of the rows never
    written (``READ_EARLY``); with clipping the updates run after the backward and would wait behind
    them.
    """
    plan = train_plan(all_units, embed_trains, reuse)
    begin_at = max(0, all_units[-1].index - depth)  # the head's entry, less depth
    marks = {begin_at: [BEGIN_UPDATES]}
    if not clipping:
        marks.setdefault(len(plan) - 1, []).append(READ_EARLY)
    return [op._replace(events=tuple(marks.get(i, ()))) for i, op in enumerate(plan)]


def train_plan(all_units: list[Unit], embed_trains: bool = True, reuse: int = 0) -> list[FetchOp]:
    """Forward over every unit, then backward over the units ``refetched`` in reverse: the blocks,
    and the embedding unless nothing of it trains (``embed_trains`` False:
    ``zinf_fn.formats.frozen``), less the forward's last ``reuse`` blocks (``reused``: kept fetched
    from their forward into their backward)."""
    *body, head = all_units
    forward = [FetchOp(u, "forward") for u in all_units]
    backward = [
        FetchOp(u, "backward")
        for u in reversed(body)
        if refetched(u.group, embed_trains) and not reused(u, len(body) - 1, reuse)
    ]
    assert head.group == HEAD
    return forward + backward


def reuse_blocks(config_reuse: int, n_layers: int, tiled: bool) -> int:
    """How many of the forward's last blocks stay fetched into the backward
    (``Config.reuse_blocks``, at most every block); none for a model with tiled leaves (their tiles
    are fetched and released per pass)."""
    return 0 if tiled else min(config_reuse, n_layers)


def refetched(stage: str, embed_trains: bool) -> bool:
    """Whether the backward fetches the units of ``stage`` again (with their tiles and frozen rows):
    the blocks always; the embedding where something of it trains (else nothing needs its backward);
    never the head, whose backward runs right after its forward, while it is materialised."""
    return stage == BLOCKS or (stage == EMBED and embed_trains)


def eval_plan(all_units: list[Unit]) -> list[FetchOp]:
    return [FetchOp(u, "forward") for u in all_units]


def format_plan(plan: list[FetchOp], depth: int) -> str:
    """One line per fetch: when it is issued (which compute it overlaps), what it brings, and the
    events that start once it is in hand."""
    lines = []
    for i, op in enumerate(plan):
        issued = (
            "on demand"
            if depth == 0 or i == 0
            else f"during {str(plan[max(0, i - depth)]).strip()}"
        )
        then = "".join(f"; then {event}" for event in op.events)
        lines.append(f"{i:3d}  fetch {str(op):24s} issued {issued}{then}")
    return "\n".join(lines)


# Why a pass's plan was revised (``Revision.cause``).
PLANNED = "planned before the pass"
ROUTED = "an op told its routing"  # tiling.routed.Routes.tell
KEPT = "a block kept its activations"  # tiling.routed.Routes.keep: no recompute in backward
LEARNT = "a unit's order of use was learnt"  # tiling.layout.TileLayout.observe_use / _recompute


class Revision(NamedTuple):
    """One version of a pass's plan: ``items`` (what the prefetcher fetches, by position) from now
    on; ``moved``: how many positions before the prefetcher's cursor left the plan (the cursor's
    position is that many fewer); ``cause``: why (``PLANNED``, ``ROUTED``, ``KEPT``, ``LEARNT``)."""

    items: Sequence
    moved: int
    cause: str


# revisions a ``PassPlan`` keeps whole: the newest and the one it replaced (each is the whole plan,
# and a long routed pass makes hundreds)
RECENT = 2


class PassPlan:
    """The items of one pass's plan as they come to be: the plan built before the pass
    (``planned``), then each revision its events make (a routing told, activations kept, an order
    of use learnt), appended in order to a queue whose newest is the plan from then on (``now``;
    ``len`` and ``[j]`` read it). A revision is a value, never changed.

    The layers' plan of a step is never revised; the tile plan (``tiling.step_tiles.StepTiles``) is,
    once per routing, kept tape or learnt order its ops tell, each revision the whole plan (its
    unchanged sections shared with the one before: ``tiling.runs.Runs.replaced``). The queue keeps
    the ``RECENT`` newest revisions whole and counts every one by cause (``causes``). The
    prefetcher that runs the plan appends a revision and follows it in one call
    (``Prefetcher.revise``).

        the plain loop a pass equals:   for j in range(len(plan)): fetch(plan.now[j])
    """

    def __init__(self, items: Sequence):
        self.planned = items
        self.recent: deque[Revision] = deque([Revision(items, 0, PLANNED)], maxlen=RECENT)
        self.causes: Counter[str] = Counter()

    @property
    def now(self) -> Sequence:
        """The plan's items as its newest revision has them."""
        return self.recent[-1].items

    def revise(self, items: Sequence, moved: int, cause: str) -> None:
        """Append the revision ``Revision(items, moved, cause)``: the plan from now on."""
        self.recent.append(Revision(items, moved, cause))
        self.causes[cause] += 1

    def __len__(self) -> int:
        return len(self.recent[-1].items)

    def __getitem__(self, j: int):
        return self.recent[-1].items[j]

    def __str__(self) -> str:
        """The items planned, the revisions by cause, the items now."""
        revised = "".join(f"; {n} x {cause}" for cause, n in self.causes.items())
        return f"planned {len(self.planned)} items{revised}; now {len(self.now)} items"


def row_is_layer(
    world_size: int,
    row_device: torch.device,
    row_dtype: torch.dtype,
    device: torch.device,
    compute_dtype: torch.dtype,
) -> bool:
    """Whether a stored row in memory *is* the layer (``Fetcher``: no pool buffer, no copy): one
    rank, the row on the compute device, in the compute dtype."""
    return world_size == 1 and row_device == device and row_dtype == compute_dtype


def staged_is_layer(world_size: int, param_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether a row staged on the compute device (read from NVMe, or copied to the GPU) becomes the
    layer buffer itself (``Fetcher._whole_unit``): one rank, nothing to cast."""
    return world_size == 1 and param_dtype == compute_dtype
